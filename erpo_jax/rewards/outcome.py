"""Why a response got its reward: the reason vocabulary and a metrics counter."""

from __future__ import annotations

from collections.abc import Iterable

CORRECT = "correct"
WRONG = "wrong"
NO_ANSWER = "no_answer"
TIMEOUT = "timeout"
ERROR = "error"
# Not verified: the batch's time budget ran out first (scored as a timeout, 0).
OVER_BUDGET = "over_budget"

# Every verifier returns one of these per response.
REASONS: tuple[str, ...] = (CORRECT, WRONG, NO_ANSWER, TIMEOUT, ERROR, OVER_BUDGET)


def count_reasons(reasons: Iterable[str], prefix: str = "reward/") -> dict[str, float]:
    """Counts and fractions of each reason, as flat metrics.

    Returns ``{prefix+reason: count, prefix+reason+"_frac": fraction}`` for every
    reason in `REASONS` (zeros included, so metric keys are stable), plus
    ``prefix+"n"``. Raises ValueError on a reason outside `REASONS`.
    """
    counts = dict.fromkeys(REASONS, 0)
    n = 0
    for r in reasons:
        if r not in counts:
            raise ValueError(f"unknown reward reason {r!r}; expected one of {REASONS}")
        counts[r] += 1
        n += 1
    out: dict[str, float] = {f"{prefix}n": float(n)}
    for r, c in counts.items():
        out[f"{prefix}{r}"] = float(c)
        out[f"{prefix}{r}_frac"] = c / n if n else 0.0
    return out
