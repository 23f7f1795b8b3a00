"""Using a trained model: loading a checkpoint or an export, KV/state caches, batched generation with
a loop budget per row, adaptive exit, self-speculative decoding, chat, evaluation and the lm-eval
adapter, and the inference memory estimate.

It imports the models, the checkpoint and export readers, config and text; never training
(elr.train), which sits beside it. The scripts and the transformers classes import it.
"""
