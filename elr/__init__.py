"""Elastic Latent Recurrence: a compact trainer for looped language models."""

from elr.console import quiet_logs

quiet_logs.install()  # before anything imports torchao (elr/console/quiet_logs.py)
