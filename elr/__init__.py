"""Elastic Latent Recurrence: a compact trainer for looped language models."""

from elr import quiet_logs

quiet_logs.install()  # before anything imports torchao (elr/quiet_logs.py)
