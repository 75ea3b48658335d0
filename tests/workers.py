"""Waiting on the worker processes of the multi-process tests."""

from __future__ import annotations

import subprocess
import time
from pathlib import Path

import pytest


def wait_for_workers(procs: list[subprocess.Popen], logs: list[Path], timeout_s: float) -> None:
    """Wait up to timeout_s in all; fail the test with each worker's log tail
    unless every worker exited 0. Workers still running are left to the caller's
    `finally` (kill_workers)."""
    deadline = time.monotonic() + timeout_s
    for p in procs:
        try:
            p.wait(timeout=max(1.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            pass
    status = [p.poll() for p in procs]
    if any(s != 0 for s in status):
        pytest.fail(f"worker exit codes {status} (None: still running after {timeout_s:.0f} s)\n"
                    + "\n".join(f"--- worker {i} ---\n{_tail(log)}" for i, log in enumerate(logs)))


def kill_workers(procs: list[subprocess.Popen]) -> None:
    for p in procs:
        if p.poll() is None:
            p.kill()
            p.wait()


def _tail(path: Path, n: int = 3000) -> str:
    return path.read_text(errors="replace")[-n:] if path.exists() else "(no output)"
