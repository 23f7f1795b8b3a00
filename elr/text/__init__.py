"""Text and data below the model: the tokenizer, the chat template and the conversation formats it
reads, JSON read from a user's file as text (json_text.py), prepared chat data on disk, and the synthetic
depth tasks (answers known by construction).

Plain data, no torch.distributed and no model code: the config, training, inference, the export and
the scripts all import it; it imports only elr.errors.
"""
