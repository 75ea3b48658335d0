"""Progress of a loop, for a person: a tqdm bar on a terminal, plain lines
elsewhere.

Redirected to a file or a pipe (a sweep's run logs, `erpo demo > log`, a TPU
VM's nohup), a tqdm bar writes a carriage-return update per refresh, about a
thousand in a short run's log. There `progress_bar` gives a `LineProgress`
instead: one line every `every_n` steps (a tenth of the loop by default) or
`every_s` seconds, whichever comes first, and one at the end, each with what
the caller shows (`set_postfix`).
"""

from __future__ import annotations

import math
import sys
import time
from typing import Any, TextIO


def _is_terminal(stream: Any) -> bool:
    try:
        return bool(stream.isatty())
    except (AttributeError, ValueError):   # no isatty, or a closed stream
        return False


class LineProgress:
    """tqdm's update / set_postfix / close, as lines:
    `<desc>: 12/60 steps (20%), 1.23 s/step, reward=0.512, acc=0.500`."""

    def __init__(self, total: int, initial: int = 0, desc: str = "", unit: str = "step",
                 stream: TextIO | None = None, every_n: int | None = None,
                 every_s: float = 60.0, leave: bool = True):
        self.total, self.n, self.desc, self.unit = total, initial, desc, unit
        self.stream = stream if stream is not None else sys.stderr
        self.every_n = every_n or max(1, math.ceil((total - initial) / 10))
        self.every_s = every_s   # leave: tqdm's; a line stays whatever it is
        self._start_n, self._t0 = initial, time.perf_counter()
        self._last_t, self._last_n = self._t0, initial
        self._postfix: dict[str, Any] = {}

    def set_postfix(self, **shown: Any) -> None:
        self._postfix = shown

    def update(self, n: int = 1) -> None:
        self.n += n
        now = time.perf_counter()
        if (self.n - self._start_n) % self.every_n == 0 or now - self._last_t >= self.every_s \
                or self.n == self.total:
            self._emit(now)

    def _emit(self, now: float) -> None:
        done = self.n - self._start_n
        rate = (now - self._t0) / done if done else float("nan")
        pct = f" ({100 * self.n / self.total:.0f}%)" if self.total else ""
        units = self.unit + ("es" if self.unit.endswith(("s", "sh", "ch", "x")) else "s")
        parts = [f"{self.desc}: {self.n}/{self.total} {units}{pct}",
                 f"{rate:.2f} s/{self.unit}"]
        parts += [f"{k}={v}" for k, v in self._postfix.items()]
        print(", ".join(parts), file=self.stream, flush=True)
        self._last_t, self._last_n = now, self.n

    def close(self) -> None:
        if self.n != self._last_n:
            self._emit(time.perf_counter())


def progress_bar(total: int, initial: int = 0, desc: str = "", unit: str = "step",
                 stream: TextIO | None = None, leave: bool = True, **line_kw: Any):
    """A tqdm bar when `stream` (default stderr) is a terminal, else a
    `LineProgress` (line_kw: every_n, every_s)."""
    stream = stream if stream is not None else sys.stderr
    if _is_terminal(stream):
        from tqdm import tqdm
        return tqdm(total=total, initial=initial, desc=desc, unit=unit, file=stream, leave=leave)
    return LineProgress(total, initial, desc, unit, stream, leave=leave, **line_kw)
