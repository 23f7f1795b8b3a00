"""Using a trained ELR model: checkpoint loading, KV caches, generation, memory accounting, evaluation."""
