"""Parallelism applied to a built model: the device mesh (parallel_dims), one parallelize() that
applies TP, CP, EP, activation checkpointing, compile, float8 and FSDP2 in that order, each from its
own module, plus the gradient anchor that lets data-parallel ranks run different loop counts.

The models below never communicate; this package is where collectives enter. It imports the models,
the config and elr.errors; training imports it; inference and the checkpoint format do not.
"""
