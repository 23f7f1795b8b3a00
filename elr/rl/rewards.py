"""Verifiable rewards: (prompt, completion, answer) -> a number.

Built in, `exact`: the completion's answer (its last number, its last \\boxed{...}, or all of it) against
the reference after the same normalisation (case, surrounding space and punctuation, thousands
separators; two numbers compare by value, so "12.0" is "12"). A user's own reward is a function named in
the job config (`rl.reward = "module:function"`): the config names it, so the config runs it, as a
training script would; nothing read from data or checkpoints is ever imported or run.
"""

from __future__ import annotations

import importlib
import math
import numbers
import re
from collections.abc import Callable

from elr.errors import ConfigError, DataError

Reward = Callable[[str, str, str], float]

NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?|-?\.\d+")


class RewardError(DataError):
    """A reward function failed or returned something that is not a finite number, on a named prompt."""


def last_number(text: str) -> str | None:
    found = NUMBER.findall(text)
    return found[-1] if found else None


def last_boxed(text: str) -> str | None:
    """The content of the last \\boxed{...}, braces inside it balanced."""
    start = text.rfind("\\boxed{")
    if start == -1:
        return None
    depth, i = 1, start + len("\\boxed{")
    for j in range(i, len(text)):
        depth += {"{": 1, "}": -1}.get(text[j], 0)
        if depth == 0:
            return text[i:j]
    return None


EXTRACT = {"last_number": last_number, "boxed": last_boxed, "text": lambda text: text}


def normalise(text: str) -> str:
    """Lower case, inner space collapsed, surrounding space and end punctuation dropped; a number in its
    plain form (no thousands separators, no trailing zeros)."""
    text = " ".join(text.strip().lower().split()).strip(" .,;:!?\"'")
    plain = text.replace(",", "")
    try:
        value = float(plain)
    except ValueError:
        return text
    if not math.isfinite(value):
        return text
    return str(int(value)) if value == int(value) else repr(value)


def exact_match(answer_format: str) -> Reward:
    """1.0 when the completion's extracted answer equals the reference, both normalised; else 0.0."""
    extract = EXTRACT[answer_format]

    def reward(prompt: str, completion: str, answer: str) -> float:
        found = extract(completion)
        return float(found is not None and normalise(found) == normalise(answer))

    return reward


def load_reward(spec: str, answer_format: str) -> Reward:
    """`exact`, or the function `module:function` (imported here: the job config asked for it)."""
    if spec == "exact":
        return exact_match(answer_format)
    module_name, _, function_name = spec.partition(":")
    try:
        module = importlib.import_module(module_name)
    except ImportError as e:
        raise ConfigError(f"rl.reward: cannot import {module_name!r} ({e})") from None
    except (Exception, SystemExit) as e:  # the user's module failed as it ran (1/0, a syntax error, sys.exit)
        raise ConfigError(f"rl.reward: importing {module_name!r} {_failure(e)}") from None
    function = getattr(module, function_name, None)
    if not callable(function):
        raise ConfigError(f"rl.reward: {module_name} has no function {function_name!r}")
    return function


def score(reward: Reward, prompt: str, completion: str, answer: str) -> float:
    """The reward as a float, or one RewardError naming the prompt it failed on."""
    try:
        value = reward(prompt, completion, answer)
    except (Exception, SystemExit) as e:  # a user's function: any failure is reported with the prompt
        raise RewardError(f"rl.reward {_failure(e)} on prompt {prompt[:200]!r}") from None
    if not isinstance(value, numbers.Real) or not math.isfinite(value):
        raise RewardError(f"rl.reward returned {value!r}, not a finite number, on prompt {prompt[:200]!r}")
    return float(value)


def _failure(e: BaseException) -> str:
    """What a user's reward code did, in a few words: "called sys.exit(0)", "raised ZeroDivisionError: ..."."""
    if isinstance(e, SystemExit):  # caught: exit code 0 would end the run as if it had finished
        return f"called sys.exit({e.code!r})"
    return f"raised {type(e).__name__}: {e}"
