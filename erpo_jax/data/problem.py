"""The one record every dataset in erpo_jax maps its rows to."""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class Problem:
    """One evaluation or training problem.

    id: unique within its dataset, e.g. ``"gsm8k/17"`` or ``"add/test/000003"``.
    question: the problem text (for the arithmetic task: the full prompt text).
    answer: the gold final answer as a string (LaTeX allowed), compared by a
      verifier; never a worked solution.
    source: the dataset or task family it came from, e.g. ``"math500"``.
    solution: a worked solution when the dataset has one we train on (the
      arithmetic task's step-by-step text); None otherwise.
    """

    id: str
    question: str
    answer: str
    source: str
    solution: str | None = None
