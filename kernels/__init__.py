"""Sequence-mixing ops, each with a token-loop reference beside its fast implementations."""
