"""Where a run's numbers go: metrics.jsonl, TensorBoard events, a tqdm bar.

Only process 0 writes (`primary=True`); every other process gets a writer
that does nothing, so multi-host runs produce one set of files. The file
goes through `rundir` (local or gs://; torn last lines skipped, rewrites atomic).
"""

from __future__ import annotations

import math
from typing import Any, Mapping

import numpy as np

from erpo_jax.runtime import rundir


def to_python(metrics: Mapping[str, Any]) -> dict[str, float]:
    """Scalars as plain floats (NaN/inf kept as strings JSON can hold)."""
    out = {}
    for k, v in metrics.items():
        v = float(np.asarray(v))
        out[k] = v if math.isfinite(v) else str(v)
    return out


class MetricsWriter:
    def __init__(self, run_dir, primary: bool = True, tensorboard: bool = True):
        self.primary = primary
        self.path = rundir.path(run_dir) / "metrics.jsonl"
        self._tb = None
        # The TensorBoard writer is made at the first write: importing
        # tensorboardX imports torch when it is installed (~1 s), which
        # would otherwise delay the first step.
        self._tb_dir = self.path.parent / "tb" if primary and tensorboard else None
        if primary:
            self.path.parent.mkdir(parents=True, exist_ok=True)

    def _tensorboard(self):
        if self._tb is None and self._tb_dir is not None:
            from tensorboardX import SummaryWriter
            self._tb = SummaryWriter(str(self._tb_dir))
        return self._tb

    def write(self, step: int, metrics: Mapping[str, Any]) -> dict:
        row = {"step": int(step), **to_python(metrics)}
        if not self.primary:
            return row
        rundir.append_line(self.path, row)
        tb = self._tensorboard()
        if tb is not None:
            for k, v in row.items():
                if k != "step" and isinstance(v, float):
                    tb.add_scalar(k, v, step)
        return row

    def truncate_after(self, step: int) -> None:
        """Drop rows after `step` (a resumed run rewrites what it redoes)."""
        if self.primary:
            rundir.keep_steps(self.path, lambda s: s <= step)

    def close(self) -> None:
        if self._tb is not None:
            self._tb.close()


def read_metrics(run_dir) -> list[dict]:
    return rundir.read_jsonl(rundir.path(run_dir) / "metrics.jsonl")
