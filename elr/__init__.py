"""Elastic Latent Recurrence: a compact trainer for looped language models."""
