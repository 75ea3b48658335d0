"""A math training file (JSONL) read under a declared answer format.

`data.answer_format` says what the answer field holds:

- ``plain`` (default): the gold final answer itself (``"18"``, ``"\\frac{1}{2}"``);
- ``gsm8k``: a worked solution ending in ``#### 18`` (GSM8K's ``answer``
  field); the gold is the text after the last ``####``, thousands separators
  removed;
- ``boxed``: a worked solution whose last ``\\boxed{...}`` is the gold
  (MATH's ``solution`` field).

A file whose answers look like another format fails before anything loads,
with a sentence naming `data.answer_format` and the value to use: a sample
of rows is checked (``####`` under ``plain``; no ``\\boxed{}`` under
``boxed``; no ``####`` under ``gsm8k``), because a wrong format otherwise
scores every correct response 0 and the run still reports success.

Worked solutions (for `erpo sft`): ``gsm8k`` rows train on the solution with
its calculator annotations (``<<48/2=24>>``) removed and the ``#### 18`` line
replaced by ``\\boxed{18}`` (the instruction asks for a box); ``boxed`` rows
train on the solution as it is; ``plain`` rows train on `solution_field`
when one is given.

    result = load_training_file("train.jsonl", "question", "answer", "gsm8k")
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from erpo_jax.data.benchmarks import LoadResult, boxed_gold, gsm8k_gold, load_jsonl, text_gold
from erpo_jax.data.problem import Problem

ANSWER_FORMATS = ("plain", "gsm8k", "boxed")
_GOLD = {"plain": text_gold, "gsm8k": gsm8k_gold, "boxed": boxed_gold}
_CALCULATOR = re.compile(r"<<[^<>]*>>")
# Rows read by the up-front format check.
FORMAT_SAMPLE = 64


def _looks_like(value: str) -> str:
    """The answer format a field value looks like."""
    if "####" in value:
        return "gsm8k"
    if "\\boxed" in value or "\\fbox" in value:
        return "boxed"
    return "plain"


def check_answer_format(path: str | Path, answer_field: str, answer_format: str,
                        sample: int = FORMAT_SAMPLE) -> None:
    """Raise ValueError naming `data.answer_format` and the value to use when
    the first `sample` readable answers of `path` look like another format.

    Under ``plain`` one answer holding ``####`` is enough (no final answer
    contains it); under ``gsm8k`` / ``boxed``, a majority of answers without
    the marker is (a few bad rows are the loader's business).
    """
    if answer_format not in ANSWER_FORMATS:
        raise ValueError(f"config field data.answer_format: is {answer_format!r}; use one of "
                         f"{ANSWER_FORMATS}.")
    seen: list[tuple[int, str]] = []
    with Path(path).open("rb") as f:
        for line_no, raw in enumerate(f, start=1):
            try:
                row = json.loads(raw.decode("utf-8"))
            except ValueError:  # bad bytes / JSON: the loader reports those with file:line
                continue
            if isinstance(row, dict) and isinstance(row.get(answer_field), str):
                seen.append((line_no, row[answer_field]))
            if len(seen) >= sample:
                break
    if not seen:
        return
    kinds = [(line_no, _looks_like(v), v) for line_no, v in seen]
    if answer_format == "plain":
        wrong = [k for k in kinds if k[1] == "gsm8k"]
        if wrong:
            line_no, _, v = wrong[0]
            raise ValueError(
                f"config field data.answer_format: is 'plain', but {len(wrong)} of the first "
                f"{len(seen)} answers in {path} hold '####' (line {line_no}: "
                f"{_clip(v)!r}), GSM8K's worked-solution format; set data.answer_format=gsm8k.")
        return
    marker = {"gsm8k": "'####'", "boxed": "\\boxed{}"}[answer_format]
    wrong = [k for k in kinds if k[1] != answer_format]
    if 2 * len(wrong) > len(seen):
        counts = {f: sum(k[1] == f for k in wrong) for f in ANSWER_FORMATS}
        use = max(counts, key=counts.get)
        line_no, _, v = wrong[0]
        raise ValueError(
            f"config field data.answer_format: is {answer_format!r}, but {len(wrong)} of the "
            f"first {len(seen)} answers in {path} have no {marker} (line {line_no}: "
            f"{_clip(v)!r}); set data.answer_format={use}.")


def _clip(text: str, n: int = 60) -> str:
    return text if len(text) <= n else text[:n] + "..."


def gsm8k_solution(answer: str) -> str:
    """A GSM8K worked solution as an SFT target: calculator annotations
    removed, the final ``#### x`` replaced by ``\\boxed{x}``."""
    gold = gsm8k_gold(answer)
    steps = _CALCULATOR.sub("", answer.rsplit("####", 1)[0]).strip()
    return (steps + "\n" if steps else "") + f"The answer is \\boxed{{{gold}}}."


def solution_reader(answer_format: str, answer_field: str,
                    solution_field: str = "") -> Callable[[dict], str | None]:
    """row -> the worked solution SFT trains on (None when the file has none)."""
    if solution_field:
        def read(row: dict) -> str | None:
            value = row.get(solution_field)
            if not isinstance(value, str) or not value.strip():
                raise ValueError(f"field {solution_field!r} (data.solution_field) is not a "
                                 "non-empty string")
            return value.strip()
        return read
    if answer_format == "gsm8k":
        return lambda row: gsm8k_solution(row[answer_field])
    if answer_format == "boxed":
        return lambda row: str(row[answer_field]).strip()
    return lambda row: None


def load_training_file(path: str | Path, question_field: str, answer_field: str,
                       answer_format: str = "plain", *, solution_field: str = "",
                       skip_bad_rows: bool = False, source: str | None = None,
                       lines: list[int] | None = None) -> LoadResult:
    """Problems of a math JSONL training file, golds read by `answer_format`
    (`lines`: a list the 1-based line of each problem is appended to).

    Raises ValueError naming `data.train_file` when the file is missing,
    ValueError naming `data.answer_format` when the answers look like another
    format, and `BadRowError` (file:line) on a bad row unless `skip_bad_rows`.
    """
    path = Path(path)
    if not path.is_file():
        raise ValueError(f"config field data.train_file: {path} does not exist (or is not a "
                         "file); point it at a JSONL training file.")
    check_answer_format(path, answer_field, answer_format)
    return load_jsonl(path, question_field, answer_field, _GOLD[answer_format],
                      source=source or path.stem, skip_bad_rows=skip_bad_rows,
                      solution=solution_reader(answer_format, answer_field, solution_field),
                      lines=lines)


def drop_unparseable(problems: Sequence[Problem], parsed: Sequence[bool | str], where: str,
                     skip_bad_rows: bool, lines: Sequence[int] | None = None,
                     path: str | Path | None = None,
                     numeric: bool = False) -> tuple[list[Problem], dict[str, Any]]:
    """Keep the problems whose gold math-verify parsed to a math object; refuse
    or drop the rest.

    parsed: per problem, True/False or the verifier's reason (`CORRECT` is
    parsed, `TIMEOUT` ran out of time, anything else did not parse). Timeouts
    are the verifier's problem, not the data's: when every check timed out, or
    any did and `skip_bad_rows` is False, a ValueError names
    `reward.timeout_s`. `lines` and `path` name each bad row as file:line.
    Returns (kept problems, report {'unparseable': n, 'first_ids': [...]},
    plus 'timed_out': n when any timed out); raises ValueError naming
    `data.skip_bad_rows` when any gold is unparseable and `skip_bad_rows` is
    False.
    """
    from erpo_jax.rewards.outcome import CORRECT, TIMEOUT
    reason = [(CORRECT if ok else "unparsed") if isinstance(ok, bool) else ok for ok in parsed]
    timed_out = sum(r == TIMEOUT for r in reason)
    if timed_out and (timed_out == len(reason) or not skip_bad_rows):
        raise ValueError(
            f"config field reward.timeout_s: math-verify ran out of time on {timed_out} of "
            f"{len(reason)} gold answers of {where} while checking they parse; that is the "
            "verifier's time limit, not the data: raise reward.timeout_s (or, if only a few "
            "rows are that slow, set data.skip_bad_rows=true to drop them).")

    def name(i: int) -> str:
        p = problems[i]
        at = f"{path}:{lines[i]}" if lines is not None and path is not None else p.id
        return f"{at} ({_clip(p.answer, 30)!r})"

    bad = [i for i, r in enumerate(reason) if r != CORRECT]
    report = {"unparseable": len(bad) - timed_out,
              "first_ids": [problems[i].id for i in bad[:5]]}
    if timed_out:
        report["timed_out"] = timed_out
    if bad and not skip_bad_rows:
        kind = "a number" if numeric else "a number or expression"
        raise ValueError(
            f"{where}: math-verify cannot parse {len(bad)} of {len(problems)} gold answers "
            f"(first: {', '.join(name(i) for i in bad[:3])}) to {kind}; every response to them "
            "would score 0. Fix those rows or set data.skip_bad_rows=true to drop them.")
    return [p for p, r in zip(problems, reason) if r == CORRECT], report
