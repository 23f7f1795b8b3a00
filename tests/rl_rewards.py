"""Reward functions the RLVR tests name in their configs (`rl.reward = "rl_rewards:..."`)."""

import sys


def digits(prompt: str, completion: str, answer: str) -> float:
    """A graded reward: the share of digits in the completion."""
    return sum(ch.isdigit() for ch in completion) / (len(completion) + 1)


def length(prompt: str, completion: str, answer: str) -> float:
    """A reward that differs between any model's completions, an untrained one's too: their length in
    characters, modulo 7."""
    return (len(completion) % 7) / 6


def raises(prompt: str, completion: str, answer: str) -> float:
    raise KeyError("no such thing")


def not_a_number(prompt: str, completion: str, answer: str):
    return "high"


def exits(prompt: str, completion: str, answer: str) -> float:
    sys.exit(0)
