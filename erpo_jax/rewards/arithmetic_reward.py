"""Exact, in-process reward for the embedded arithmetic task (integer answers).

The answer is the text after the last ``A:`` up to the end of the text or of
its line, which must be an optionally signed integer (surrounding spaces
allowed). It is compared to the gold as a canonical digit string, so there is
no eval and no int() conversion limit: a 10^5-digit answer is just compared.
"""

from __future__ import annotations

import re
from collections.abc import Sequence

import numpy as np

from erpo_jax.rewards.extract import to_text
from erpo_jax.rewards.outcome import CORRECT, NO_ANSWER, WRONG

ANSWER_MARKER = "A:"
_INT_RE = re.compile(r"\s*([+-]?)(\d+)\s*")


def _canonical(sign: str, digits: str) -> str:
    digits = digits.lstrip("0") or "0"
    return digits if sign != "-" or digits == "0" else "-" + digits


def parse_int_answer(text: str | bytes) -> str | None:
    """Canonical integer string after the last ``A:`` (e.g. ``"-12"``), or None."""
    text = to_text(text)
    pos = text.rfind(ANSWER_MARKER)
    if pos < 0:
        return None
    tail = text[pos + len(ANSWER_MARKER) :]
    end = tail.find("\n")
    if end >= 0:
        tail = tail[:end]
    m = _INT_RE.fullmatch(tail)
    return None if m is None else _canonical(m.group(1), m.group(2))


def _canonical_gold(gold: str | int, i: int) -> str:
    m = _INT_RE.fullmatch(str(gold))
    if m is None:
        raise ValueError(f"gold answer of pair {i} is {gold!r}, not an integer")
    return _canonical(m.group(1), m.group(2))


def arithmetic_rewards(
    pairs: Sequence[tuple[str | bytes, str | int]],
) -> tuple[np.ndarray, list[str]]:
    """Score (response, gold_integer) pairs exactly.

    Returns rewards: float32[N] (1.0 iff the parsed answer equals the gold)
    and reasons: N strings in {correct, wrong, no_answer}.
    Raises ValueError when a gold answer is not an integer.
    """
    rewards = np.zeros(len(pairs), np.float32)
    reasons = []
    for i, (response, gold) in enumerate(pairs):
        want = _canonical_gold(gold, i)
        got = parse_int_answer(response)
        if got is None:
            reasons.append(NO_ANSWER)
        elif got == want:
            rewards[i] = 1.0
            reasons.append(CORRECT)
        else:
            reasons.append(WRONG)
    return rewards, reasons
