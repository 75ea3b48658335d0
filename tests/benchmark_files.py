"""Where the tests find the six benchmark files, and what a test that needs
them does when they are missing.

They are read from $ERPO_BENCHMARKS_DIR, else from ../shared/data/benchmarks
beside the repository (what `.ci/run` passes). When CI is set or
ERPO_BENCHMARKS_DIR is given, a missing file fails the test with a sentence
saying where it was expected; otherwise the test skips, naming the missing path.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from erpo_jax.data.benchmarks import BENCHMARKS_DIR_ENV

DEFAULT = Path(__file__).resolve().parents[2] / "shared" / "data" / "benchmarks"


def benchmarks_dir() -> Path:
    env = os.environ.get(BENCHMARKS_DIR_ENV)
    return Path(env) if env else DEFAULT


def require(path: Path) -> Path:
    """`path` if it exists; else fail (in CI, or with ERPO_BENCHMARKS_DIR set) or skip."""
    if path.exists():
        return path
    where = (f"${BENCHMARKS_DIR_ENV}={os.environ[BENCHMARKS_DIR_ENV]}"
             if os.environ.get(BENCHMARKS_DIR_ENV) else f"the default {DEFAULT}")
    msg = (f"benchmark file {path} not found: the six benchmark files are expected in "
           f"{where} (set {BENCHMARKS_DIR_ENV} to the directory that holds them)")
    if os.environ.get("CI") or os.environ.get(BENCHMARKS_DIR_ENV):
        pytest.fail(msg + ".", pytrace=False)
    pytest.skip(msg + "; outside CI this test is skipped.")
