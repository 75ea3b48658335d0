"""Loaders for the six math test sets, mapped to `Problem` records.

Each benchmark is one published ``test.jsonl`` (see
``shared/data/benchmarks/SOURCES.md``) whose fields differ; `BENCHMARKS` says,
per benchmark, which field holds the question and how the gold final answer
is read. Paths are always arguments; nothing is downloaded.

    problems, skipped = load_benchmark("math500", "/path/to/benchmarks")

GSM8K can also be read from a TFDS-prepared copy (array_record files, no
TensorFlow needed) with `load_gsm8k_tfds`.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, NamedTuple

from erpo_jax.data.problem import Problem
# The balanced-brace scan is shared with the reward's extractor so that a gold
# and a response are read by the same rule.
from erpo_jax.rewards.extract import last_boxed

BENCHMARKS_DIR_ENV = "ERPO_BENCHMARKS_DIR"


class BadRowError(ValueError):
    """A row lacks a field or its gold answer cannot be read."""


class LoadResult(NamedTuple):
    problems: list[Problem]
    skipped: int  # rows dropped under skip_bad_rows=True


# ----------------------------------------------------------------------------
# Gold answer readers: field value -> gold string. Raise ValueError on failure.


def gsm8k_gold(answer: Any) -> str:
    """GSM8K: the text after the last ``#### `` with thousands commas removed."""
    if not isinstance(answer, str) or "####" not in answer:
        raise ValueError("no '#### ' marker in the answer")
    gold = answer.rsplit("####", 1)[1].strip().replace(",", "")
    if not gold:
        raise ValueError("nothing after '####'")
    return gold


def boxed_gold(text: Any) -> str:
    """The last ``\\boxed{...}`` of a worked solution."""
    if not isinstance(text, str):
        raise ValueError(f"expected a string, got {type(text).__name__}")
    gold = last_boxed(text)
    if not gold:
        raise ValueError("no \\boxed{...} with balanced braces")
    return gold


def math500_gold(answer: Any) -> str:
    """MATH-500 (BiRM copy): the last ``\\boxed{}``, else after ``The answer is: ``."""
    if isinstance(answer, str):
        gold = last_boxed(answer)
        if gold:
            return gold
        if "The answer is: " in answer:
            gold = answer.rsplit("The answer is: ", 1)[1].strip()
            if gold:
                return gold
    raise ValueError("no \\boxed{...} and no 'The answer is: ' in the answer")


def number_gold(answer: Any) -> str:
    """A JSON number (AMC23 stores 27.0): ``'27'`` when integral, else ``repr``."""
    if isinstance(answer, bool) or not isinstance(answer, int | float | str):
        raise ValueError(f"expected a number, got {answer!r}")
    if isinstance(answer, str):
        answer = answer.strip()
        if not answer:
            raise ValueError("empty answer")
        try:
            value = float(answer)
        except ValueError:
            return answer  # already a string answer, keep it as published
    else:
        value = float(answer)
    if value != value or value in (float("inf"), float("-inf")):
        raise ValueError(f"answer {answer!r} is not finite")
    return str(int(value)) if value.is_integer() else repr(value)


def text_gold(answer: Any) -> str:
    """An answer stored as text (AIME24: ``'025'``), kept as published."""
    if isinstance(answer, int | float) and not isinstance(answer, bool):
        return number_gold(answer)
    if not isinstance(answer, str) or not answer.strip():
        raise ValueError(f"expected a non-empty string, got {answer!r}")
    return answer.strip()


def _strip_dollars(s: str) -> str:
    # Items are like "$2^{1009}$", but some hold several math spans
    # ("$69$,$84$"): every unescaped `$` is a delimiter, never content.
    return re.sub(r"(?<!\\)\$", "", s).strip()


def olympiad_gold(final_answer: Any) -> str:
    """OlympiadBench: the `final_answer` list joined by ``", "``, each item
    with its ``$`` math delimiters removed (``"$69$,$84$"`` -> ``"69,84"``)."""
    if isinstance(final_answer, str):
        final_answer = [final_answer]
    if not isinstance(final_answer, list) or not final_answer:
        raise ValueError(f"expected a non-empty list of strings, got {final_answer!r}")
    parts = [_strip_dollars(str(x)) for x in final_answer]
    if not all(parts):
        raise ValueError(f"empty item in {final_answer!r}")
    return ", ".join(parts)


# ----------------------------------------------------------------------------
# The six benchmarks.


@dataclasses.dataclass(frozen=True)
class BenchmarkSpec:
    """How one benchmark's rows map to `Problem`.

    path: file relative to the benchmarks root.
    question_field / answer_field: the row keys holding question and gold.
    gold: reads the gold final answer from the answer field's value.
    id_field: row key used for `Problem.id`; None means the 0-based row number.
    rows: the published number of rows (checked by tests, not by loaders).
    """

    path: str
    question_field: str
    answer_field: str
    gold: Callable[[Any], str]
    id_field: str | None
    rows: int


BENCHMARKS: dict[str, BenchmarkSpec] = {
    "gsm8k": BenchmarkSpec("gsm8k/test.jsonl", "question", "answer", gsm8k_gold, "idx", 1319),
    "math500": BenchmarkSpec("math500/test.jsonl", "question", "answer", math500_gold, None, 500),
    "aime24": BenchmarkSpec("aime24/test.jsonl", "problem", "answer", text_gold, "id", 30),
    "amc23": BenchmarkSpec("amc23/test.jsonl", "question", "answer", number_gold, "id", 40),
    "minerva_math": BenchmarkSpec(
        "minerva_math/test.jsonl", "problem", "solution", boxed_gold, "idx", 272
    ),
    "olympiadbench": BenchmarkSpec(
        "olympiadbench/test.jsonl", "question", "final_answer", olympiad_gold, "id", 675
    ),
}


def load_jsonl(
    path: str | os.PathLike,
    question_field: str,
    answer_field: str,
    gold: Callable[[Any], str] | None = None,
    *,
    source: str | None = None,
    id_field: str | None = None,
    skip_bad_rows: bool = False,
    solution: Callable[[dict], str | None] | None = None,
    lines: list[int] | None = None,
) -> LoadResult:
    """Load any JSONL file of problems.

    Args:
      path: the .jsonl file, one JSON object per line (blank lines ignored).
      question_field, answer_field: keys of the question and gold answer.
      gold: maps the answer field's value to the gold string (default:
        `text_gold`, the value as text).
      source: `Problem.source` and id prefix (default: the parent folder name).
      id_field: key for the id (default: 0-based row number).
      skip_bad_rows: False raises `BadRowError` naming file and line on the
        first bad row (bad JSON, a missing field, an unreadable gold, bytes
        that are not UTF-8); True skips bad rows and counts them.
      solution: maps a row to `Problem.solution` (a worked solution to
        train on), or None for no solution; may raise ValueError (a bad row).
      lines: a list the 1-based line of each loaded problem is appended to.
    Returns:
      LoadResult(problems, skipped).
    """
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(
            f"benchmark file {path} does not exist; pass the folder that holds the "
            f"benchmark folders (or set {BENCHMARKS_DIR_ENV})"
        )
    gold = gold or text_gold
    source = source or path.parent.name
    problems: list[Problem] = []
    skipped = 0
    row_number = 0
    with path.open("rb") as f:
        for line_no, raw in enumerate(f, start=1):
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as e:
                if skip_bad_rows:
                    skipped += 1
                    continue
                raise BadRowError(
                    f"{path}:{line_no}: byte {e.start} is not UTF-8 ({e.reason}); re-encode "
                    "the file as UTF-8, or skip bad rows (data.skip_bad_rows=true; "
                    "skip_bad_rows=True in Python)"
                ) from None
            if not line.strip():
                continue
            try:
                row = json.loads(line)
                if not isinstance(row, dict):
                    raise ValueError(f"expected a JSON object, got {type(row).__name__}")
                for field in (question_field, answer_field) + ((id_field,) if id_field else ()):
                    if field not in row or row[field] is None:
                        raise ValueError(f"missing field {field!r} (row has {sorted(row)})")
                question = row[question_field]
                if not isinstance(question, str) or not question.strip():
                    raise ValueError(f"field {question_field!r} is not a non-empty string")
                answer = gold(row[answer_field])
                worked = solution(row) if solution is not None else None
            except ValueError as e:  # json.JSONDecodeError is a ValueError too
                if skip_bad_rows:
                    skipped += 1
                    continue
                raise BadRowError(
                    f"{path}:{line_no}: {e}; fix the row, or skip bad rows "
                    "(data.skip_bad_rows=true; skip_bad_rows=True in Python)"
                ) from e
            row_id = row[id_field] if id_field else row_number
            problems.append(Problem(f"{source}/{row_id}", question, answer, source, worked))
            if lines is not None:
                lines.append(line_no)
            row_number += 1
    return LoadResult(problems, skipped)


def resolve_benchmarks_dir(root: str | os.PathLike | None = None) -> Path:
    """`root` if given, else ``$ERPO_BENCHMARKS_DIR``; raises if neither is set."""
    if root is None:
        root = os.environ.get(BENCHMARKS_DIR_ENV)
        if not root:
            raise ValueError(
                f"no benchmarks folder given: pass root=... or set {BENCHMARKS_DIR_ENV}"
            )
    return Path(root)


def load_benchmark(
    name: str, root: str | os.PathLike | None = None, *, skip_bad_rows: bool = False
) -> LoadResult:
    """Load one of `BENCHMARKS` from ``root/<name>/test.jsonl``."""
    if name not in BENCHMARKS:
        raise KeyError(f"unknown benchmark {name!r}; choose from {sorted(BENCHMARKS)}")
    spec = BENCHMARKS[name]
    return load_jsonl(
        resolve_benchmarks_dir(root) / spec.path,
        spec.question_field,
        spec.answer_field,
        spec.gold,
        source=name,
        id_field=spec.id_field,
        skip_bad_rows=skip_bad_rows,
    )


def load_all_benchmarks(
    root: str | os.PathLike | None = None, *, skip_bad_rows: bool = False
) -> dict[str, LoadResult]:
    """Every benchmark in `BENCHMARKS`, by name."""
    return {name: load_benchmark(name, root, skip_bad_rows=skip_bad_rows) for name in BENCHMARKS}


# ----------------------------------------------------------------------------
# GSM8K from a TFDS-prepared copy.


def _as_text(v: Any) -> str:
    return v.decode("utf-8") if isinstance(v, bytes) else str(v)


# TFDS writes a split's records in the order of md5(split name + key) of the
# keys its builder yielded (unless the dataset disables shuffling); that order
# is part of a TFDS dataset version (see tensorflow_datasets/core/hashing.py).
# The gsm8k builder keys each example by its 0-based line in the published
# JSONL, so the line of record j is the j-th key in hash order. Versions listed
# here are known to key by line number.
_GSM8K_TFDS_LINE_KEYED_VERSIONS = frozenset({"1.0.0"})


def _tfds_record_lines(n: int, split: str, disable_shuffling: bool) -> list[int]:
    """Line number (the builder's key) of each of a split's ``n`` records."""
    if disable_shuffling:
        return list(range(n))
    from tensorflow_datasets.core import hashing

    hasher = hashing.Hasher(split)
    return sorted(range(n), key=hasher.hash_key)


def load_gsm8k_tfds(
    data_dir: str | os.PathLike, split: str = "test", *, skip_bad_rows: bool = False
) -> LoadResult:
    """GSM8K from ``data_dir/gsm8k/<version>/`` prepared by TFDS as array_record.

    Reads with `tfds.data_source` (random access, no TensorFlow). Never
    downloads: raises FileNotFoundError saying where it looked and how to
    prepare the data when it is absent.

    Problems come back in the published line order with ids ``gsm8k/<line>``,
    the same as `load_benchmark('gsm8k', ...)` gives for the same file: TFDS
    stores records shuffled by a hash of each example's key (its line), and
    this undoes that shuffle. `split` is a plain split name ("test",
    "train"); slice the returned list instead of passing "test[:10]".
    """
    if not split or any(c in split for c in "[]+%"):
        raise ValueError(
            f"split must be a plain split name such as 'test', got {split!r}; "
            "slice the returned problems instead"
        )
    data_dir = Path(data_dir)
    found = sorted((data_dir / "gsm8k").glob("*/dataset_info.json"))
    if not found:
        raise FileNotFoundError(
            f"no TFDS-prepared GSM8K under {data_dir / 'gsm8k'} (looked for "
            f"{data_dir / 'gsm8k' / '<version>' / 'dataset_info.json'}). Prepare it on a "
            "machine with internet: `tfds build gsm8k --data_dir "
            f"{data_dir} --file_format array_record`, then copy the folder here; "
            "or load the JSONL copy with load_benchmark('gsm8k', root)."
        )
    import tensorflow_datasets as tfds
    import tensorflow_datasets.text  # noqa: F401  (registers the gsm8k builder)

    version = str(tfds.builder_cls("gsm8k").VERSION)
    info_path = data_dir / "gsm8k" / version / "dataset_info.json"
    if not info_path.is_file():
        raise FileNotFoundError(
            f"TFDS here reads GSM8K version {version}, but {data_dir / 'gsm8k'} holds "
            f"only {[p.parent.name for p in found]}; prepare version {version} with "
            f"`tfds build gsm8k --data_dir {data_dir} --file_format array_record`"
        )
    file_format = json.loads(info_path.read_text(encoding="utf-8")).get("fileFormat", "tfrecord")
    if file_format != "array_record":
        raise ValueError(
            f"{info_path.parent} was prepared as {file_format!r}, which needs TensorFlow to "
            "read; rebuild it with `tfds build gsm8k --data_dir DIR --file_format "
            "array_record` (TFDS's default is tfrecord)"
        )
    if version not in _GSM8K_TFDS_LINE_KEYED_VERSIONS:
        raise ValueError(
            f"GSM8K TFDS version {version} is not known to key examples by line number, "
            "so its record order cannot be mapped back to the published lines"
        )

    source = tfds.data_source("gsm8k", split=split, data_dir=os.fspath(data_dir), download=False)
    lines = _tfds_record_lines(len(source), split, bool(source.dataset_info.disable_shuffling))
    record_of_line = sorted(range(len(lines)), key=lines.__getitem__)
    problems: list[Problem] = []
    skipped = 0
    for line in range(len(record_of_line)):
        i = record_of_line[line]
        row: Mapping[str, Any] = source[i]
        try:
            question = _as_text(row["question"])
            if not question.strip():
                raise ValueError("empty question")
            answer = gsm8k_gold(_as_text(row["answer"]))
        except (KeyError, ValueError) as e:
            if skip_bad_rows:
                skipped += 1
                continue
            raise BadRowError(
                f"gsm8k {split} (TFDS, {data_dir}) record {i} (line {line}): {e!r}; "
                "skip bad rows with data.skip_bad_rows=true (skip_bad_rows=True in Python)"
            ) from e
        problems.append(Problem(f"gsm8k/{line}", question, answer, "gsm8k"))
    return LoadResult(problems, skipped)
