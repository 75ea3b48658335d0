"""Pre-processing of answer strings before math-verify sees them.

math-verify decides equivalence; this file only covers the few spellings where
it (v0.9) disagrees with a human grader, found by the cases in
`tests/test_rewards.py`. Each rule is narrow, applied to gold and prediction
alike, and never turns a wrong answer into a right one by itself:

1. Thin/negative spaces used as thousands separators: ``1\\,000`` and
   ``1\\!000`` are 1000 (math-verify reads ``1\\,000`` as ``1*0``).
2. ``\\!`` (negative thin space) is typography: removed everywhere.
3. A bare number followed only by plain words is that number:
   ``18 dollars`` -> ``18`` (math-verify parses the words as a product of
   variables; it already handles ``5 cm`` and ``5\\text{ cm}``).
"""

from __future__ import annotations

import re

_THOUSANDS_THIN_SPACE_RE = re.compile(r"(?<=\d)\\[,!;: ]\s*(?=\d{3}(?!\d))")
_NEG_THIN_SPACE_RE = re.compile(r"\\!")
_NUMBER_THEN_WORDS_RE = re.compile(
    r"^\s*(-?(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?)\s+[A-Za-z]+(?:[\s.]+[A-Za-z]+)*\.?\s*$"
)


def normalize_answer(answer: str) -> str:
    """Apply the rules above to one answer string; returns the new string."""
    prev = None
    while prev != answer:  # `1\,000\,000` needs one pass per separator.
        prev = answer
        answer = _THOUSANDS_THIN_SPACE_RE.sub("", answer)
    answer = _NEG_THIN_SPACE_RE.sub("", answer)
    m = _NUMBER_THEN_WORDS_RE.match(answer)
    if m:
        answer = m.group(1)
    return answer.strip()
