"""Math answer verification with math-verify, in a pool of worker processes.

Why processes: math-verify's own time limits use `signal.alarm`, which only
works on a process's main thread, and some sympy work (``9^{9^{9^9}}``) is a
single C call that no signal interrupts. So each comparison runs in a worker
process; the parent enforces a wall-time limit per call and SIGKILLs and
replaces a worker that overruns or dies. The response then scores 0 with
reason ``timeout`` or ``error``; the batch carries on.

Workers start with 'forkserver' (default, modules preloaded once so a
replacement starts in milliseconds) or 'spawn'; never 'fork', because the
parent runs JAX's threads. As with any non-fork start method, a script that
creates a pool must guard its entry point with ``if __name__ == "__main__":``.

Safety: model output is only ever parsed as LaTeX (latex2sympy's ANTLR
grammar). math-verify's plain-expression extractor (`ExprExtractionConfig`)
calls sympy's `parse_expr`, which evaluates Python, so it is never enabled.

Flow per response (parent): decode bytes -> keep the last `max_chars`
characters -> `extract_answer` (None: ``no_answer``, no worker needed) ->
`normalize_answer` -> worker: parse gold and prediction as LaTeX, `verify`.
Identical (answer, gold) pairs in a batch are verified once.
"""

from __future__ import annotations

import collections
import dataclasses
import logging
import multiprocessing as mp
import os
import time
import traceback
import weakref
from collections.abc import Sequence
from multiprocessing.connection import wait

import numpy as np

from erpo_jax.rewards.extract import ExtractConfig, extract_answer
from erpo_jax.rewards.normalize import normalize_answer
from erpo_jax.rewards.outcome import CORRECT, ERROR, NO_ANSWER, OVER_BUDGET, TIMEOUT, WRONG

log = logging.getLogger(__name__)

# Fraction of the parent's hard limit after which a worker gives up by itself
# (SIGALRM between Python bytecodes): it then answers `timeout` and survives,
# so only C-level hangs cost a process restart.
_SOFT_FRACTION = 0.8


# ----------------------------------------------------------------------------
# Worker side.


class _SoftTimeout(BaseException):
    """Raised by SIGALRM in a worker. A BaseException, so math-verify's
    `except Exception` handlers cannot swallow it."""


def _is_math(parsed: list, numeric: bool = False) -> bool:
    """Whether math-verify's parse of a gold holds a math object (not only the
    string it falls back to: '???'), and with `numeric` one free of symbols
    ('seven' parses to a product of five symbols)."""
    objects = [x for x in parsed if not isinstance(x, str)]
    if not numeric:
        return bool(objects)
    return any(not getattr(x, "free_symbols", {None}) for x in objects)


def _worker_main(conn, soft_timeout_s: float, float_rounding: int, numeric_precision: int):
    """Worker process loop: recv (key, answer, gold); send (key, reason, detail).

    soft_timeout_s <= 0 disables the worker's own alarm (the parent's hard
    limit still applies).
    """
    import functools
    import signal

    try:
        from math_verify import LatexExtractionConfig, parse, verify

        logging.getLogger("math_verify").setLevel(logging.ERROR)
        latex_only = [LatexExtractionConfig(boxed_match_priority=0)]
    except BaseException:  # noqa: BLE001 - report any import failure to the parent
        conn.send(("failed", traceback.format_exc()))
        return

    def _parse(text: str):
        # Timeouts are ours (below), not math-verify's, so they can be told
        # apart from "wrong".
        return parse("\\boxed{" + text + "}", latex_only, parsing_timeout=None)

    parse_gold = functools.lru_cache(maxsize=1024)(_parse)

    def on_alarm(signum, frame):
        raise _SoftTimeout()

    signal.signal(signal.SIGALRM, on_alarm)
    conn.send(("ready", os.getpid()))
    while True:
        try:
            msg = conn.recv()
        except (EOFError, OSError):
            return
        if msg is None:
            return
        key, answer, gold = msg
        if soft_timeout_s > 0:
            signal.setitimer(signal.ITIMER_REAL, soft_timeout_s)
        try:
            gold_parsed = parse_gold(gold)
            if not gold_parsed:
                result = (ERROR, f"gold answer {gold[:200]!r} could not be parsed")
            elif isinstance(answer, tuple):  # a check of the gold alone (`gold_reasons`)
                ok = _is_math(gold_parsed, numeric=answer[1] == "numeric")
                result = (CORRECT, "") if ok else (ERROR, f"gold answer {gold[:200]!r} parses "
                                                          "to no math object")
            else:
                pred_parsed = _parse(answer)
                ok = bool(pred_parsed) and verify(
                    gold_parsed,
                    pred_parsed,
                    float_rounding=float_rounding,
                    numeric_precision=numeric_precision,
                    timeout_seconds=None,
                )
                result = (CORRECT if ok else WRONG, "")
        except _SoftTimeout:
            result = (TIMEOUT, "soft time limit in worker")
        except Exception as e:  # noqa: BLE001 - any failure is this response's error
            result = (ERROR, f"{type(e).__name__}: {str(e)[:200]}")
        finally:
            signal.setitimer(signal.ITIMER_REAL, 0)
        try:
            conn.send((key, *result))
        except _SoftTimeout:  # alarm raced with the reset above
            conn.send((key, *result))


# ----------------------------------------------------------------------------
# Parent side.


@dataclasses.dataclass
class _Worker:
    proc: mp.process.BaseProcess
    conn: object
    state: str  # "starting" | "idle" | "busy"
    deadline: float
    task: int | None = None


def _shutdown_workers(workers: list[_Worker]) -> None:
    for w in workers:
        try:
            w.conn.send(None)
        except (OSError, ValueError):
            pass
    for w in workers:
        w.proc.join(timeout=1.0)
        if w.proc.is_alive():
            w.proc.kill()
            w.proc.join(timeout=1.0)
        try:
            w.conn.close()
        except OSError:
            pass
    workers.clear()


class MathVerifyPool:
    """A pool of math-verify worker processes with a per-call time limit.

    Use as a context manager (or call `close()`):

        with MathVerifyPool(num_workers=2, timeout_s=5.0) as pool:
            rewards, reasons = pool.verify_batch([(response, gold), ...])

    Args:
      num_workers: worker processes (each uses one core while verifying).
      timeout_s: wall-time limit per (answer, gold) comparison, enforced by
        the parent: an overrunning worker is killed and replaced.
      extract: how final answers are found in responses (`ExtractConfig`;
        its `max_chars` caps how much of each response is looked at).
      start_method: "forkserver" (default) or "spawn". "fork" is refused.
      startup_timeout_s: how long a new worker may take to import math-verify.
      float_rounding, numeric_precision: passed to `math_verify.verify`.
      worker_soft_timeout: let workers stop themselves (SIGALRM) at 80% of
        `timeout_s`, which saves a restart for hangs in Python code. False
        leaves only the parent's kill (tests use it to exercise that path).
    """

    def __init__(
        self,
        num_workers: int = 2,
        timeout_s: float = 5.0,
        extract: ExtractConfig = ExtractConfig(),
        start_method: str = "forkserver",
        startup_timeout_s: float = 60.0,
        float_rounding: int = 6,
        numeric_precision: int = 15,
        worker_soft_timeout: bool = True,
    ):
        if num_workers < 1:
            raise ValueError(f"num_workers must be >= 1, got {num_workers}")
        if timeout_s <= 0:
            raise ValueError(f"timeout_s must be > 0, got {timeout_s}")
        if start_method not in ("forkserver", "spawn"):
            raise ValueError(
                f"start_method {start_method!r} is not allowed: use 'forkserver' or 'spawn' "
                "('fork' copies JAX's threads into the child and can deadlock)"
            )
        self.num_workers = num_workers
        self.timeout_s = float(timeout_s)
        self.extract = extract
        self.startup_timeout_s = float(startup_timeout_s)
        soft = self.timeout_s * _SOFT_FRACTION if worker_soft_timeout else 0.0
        self._args = (soft, float_rounding, numeric_precision)
        self._ctx = mp.get_context(start_method)
        if start_method == "forkserver":
            # Only takes effect if this process's fork server is not running yet.
            self._ctx.set_forkserver_preload(["math_verify", __name__])
        self._workers: list[_Worker] = []
        self._closed = False
        self.restarts = 0  # workers killed or replaced after dying; for metrics
        self._startup_deaths = 0
        self._finalizer = weakref.finalize(self, _shutdown_workers, self._workers)
        for _ in range(num_workers):
            self._workers.append(self._start_worker())

    # -- lifecycle -------------------------------------------------------------

    def _start_worker(self) -> _Worker:
        parent_conn, child_conn = self._ctx.Pipe(duplex=True)
        proc = self._ctx.Process(
            target=_worker_main, args=(child_conn, *self._args), daemon=True,
            name="math-verify-worker",
        )
        proc.start()
        child_conn.close()
        return _Worker(proc, parent_conn, "starting", time.monotonic() + self.startup_timeout_s)

    def _replace(self, i: int) -> None:
        w = self._workers[i]
        if w.proc.is_alive():
            w.proc.kill()
        w.proc.join(timeout=5.0)
        try:
            w.conn.close()
        except OSError:
            pass
        self.restarts += 1
        self._workers[i] = self._start_worker()

    def close(self) -> None:
        """Stop all workers. Idempotent."""
        self._closed = True
        self._finalizer()

    def __enter__(self) -> MathVerifyPool:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # -- verification ----------------------------------------------------------

    def verify_batch(
        self, pairs: Sequence[tuple[str | bytes, str]], budget_s: float | None = None
    ) -> tuple[np.ndarray, list[str]]:
        """Score responses against gold answers.

        Args:
          pairs: N pairs (response, gold_answer). `response` is the model's
            text (str, or bytes decoded as UTF-8 with errors='replace');
            `gold_answer` is the gold final answer (e.g. `Problem.answer`),
            not a worked solution.
          budget_s: wall-time budget for the whole batch (None or <= 0: no
            budget). Once spent, the comparisons still running are killed and
            every one not finished scores 0 with reason ``over_budget``.
        Returns:
          rewards: float32[N], 1.0 for `correct` and 0.0 otherwise.
          reasons: N strings from `outcome.REASONS`.
        """
        if self._closed:
            raise RuntimeError(
                "MathVerifyPool is closed; create a new pool (or use it inside its `with` block)"
            )
        n = len(pairs)
        reasons: list[str] = [NO_ANSWER] * n
        jobs: dict[tuple[str, str], list[int]] = {}
        for i, pair in enumerate(pairs):
            response, gold = pair
            if not isinstance(gold, str):
                raise TypeError(
                    f"gold answer of pair {i} must be str, got {type(gold).__name__}"
                )
            answer = extract_answer(response, self.extract)
            if answer is None:
                continue
            key = (normalize_answer(answer), normalize_answer(gold))
            jobs.setdefault(key, []).append(i)
        keys = list(jobs)
        for key, reason in zip(keys, self._run(keys, budget_s)):
            for i in jobs[key]:
                reasons[i] = reason
        rewards = np.asarray([r == CORRECT for r in reasons], dtype=np.float32).reshape(n)
        return rewards, reasons

    def verify(self, response: str | bytes, gold: str) -> tuple[float, str]:
        """One pair; see `verify_batch`."""
        rewards, reasons = self.verify_batch([(response, gold)])
        return float(rewards[0]), reasons[0]

    def check_golds(self, golds: Sequence[str], numeric: bool = False) -> list[bool]:
        """Whether math-verify parses each gold answer to a math object (see
        `gold_reasons`; a timeout counts as no)."""
        return [r == CORRECT for r in self.gold_reasons(golds, numeric)]

    def gold_reasons(self, golds: Sequence[str], numeric: bool = False) -> list[str]:
        """Per gold answer: CORRECT when math-verify parses it (as LaTeX, in the
        workers, under the per-call time limit) to a math object (`numeric`:
        one without free symbols, a GSM8K answer), ERROR when it does not,
        TIMEOUT when the verifier ran out of time on it."""
        unique = list(dict.fromkeys(normalize_answer(g) for g in golds))
        kind = ("gold", "numeric" if numeric else "any")
        out = dict(zip(unique, self._run([(kind, g) for g in unique])))
        return [out[normalize_answer(g)] for g in golds]

    def _run(self, keys: list[tuple[str | None, str]], budget_s: float | None = None
             ) -> list[str]:
        """Verify every (answer, gold) in `keys` on the workers; one reason each.

        Past `budget_s` seconds the busy workers are replaced and everything
        unfinished is `OVER_BUDGET`."""
        out: list[str | None] = [None] * len(keys)
        pending = collections.deque(range(len(keys)))
        remaining = len(keys)
        end = time.monotonic() + budget_s if budget_s and budget_s > 0 else None
        while remaining:
            if end is not None and time.monotonic() >= end:
                for i, w in enumerate(self._workers):
                    if w.state == "busy":
                        self._replace(i)
                for t in range(len(keys)):
                    if out[t] is None:
                        out[t] = OVER_BUDGET
                break
            # Hand work to idle workers.
            for i, w in enumerate(self._workers):
                if w.state != "idle" or not pending:
                    continue
                t = pending.popleft()
                try:
                    w.conn.send((t, *keys[t]))
                except (OSError, ValueError):  # died while idle: not this task's fault
                    pending.appendleft(t)
                    self._replace(i)
                    continue
                w.state, w.task = "busy", t
                w.deadline = time.monotonic() + self.timeout_s
            waiting = [w for w in self._workers if w.state in ("busy", "starting")]
            next_deadline = min([w.deadline for w in waiting] + ([end] if end else []))
            ready = wait([w.conn for w in waiting], timeout=max(0.0, next_deadline - time.monotonic()))
            for conn in ready:
                i = next(k for k, w in enumerate(self._workers) if w.conn is conn)
                w = self._workers[i]
                try:
                    msg = conn.recv()
                except (EOFError, OSError):
                    if w.state == "starting":
                        self._startup_deaths += 1
                        if self._startup_deaths > 3 * self.num_workers:
                            raise RuntimeError(
                                "math-verify workers keep dying while starting; check that "
                                "`python -c 'import math_verify'` works in this environment"
                            ) from None
                    if w.state == "busy":
                        log.warning("math-verify worker died while verifying %r", keys[w.task])
                        out[w.task] = ERROR
                        remaining -= 1
                    self._replace(i)
                    continue
                if w.state == "starting":
                    if msg[0] != "ready":
                        raise RuntimeError(f"math-verify worker failed to start:\n{msg[1]}")
                    w.state = "idle"
                    self._startup_deaths = 0
                    continue
                t, reason, detail = msg
                if reason == ERROR and not isinstance(keys[t][0], tuple):   # not gold checks
                    log.warning("verification error for %r: %s", keys[t], detail)
                out[t] = reason
                remaining -= 1
                w.state, w.task = "idle", None
            now = time.monotonic()
            for i, w in enumerate(self._workers):
                if w.state == "busy" and w.deadline <= now:
                    out[w.task] = TIMEOUT
                    remaining -= 1
                    self._replace(i)
                elif w.state == "starting" and w.deadline <= now:
                    raise RuntimeError(
                        f"math-verify worker did not start within {self.startup_timeout_s} s; "
                        "raise startup_timeout_s or check that math-verify imports in a fresh process"
                    )
        return out  # type: ignore[return-value]


def verify_batch(
    pairs: Sequence[tuple[str | bytes, str]], **pool_kwargs
) -> tuple[np.ndarray, list[str]]:
    """One-off `MathVerifyPool(**pool_kwargs).verify_batch(pairs)`; prefer a
    long-lived pool in training loops (worker start-up costs ~1 s)."""
    with MathVerifyPool(**pool_kwargs) as pool:
        return pool.verify_batch(pairs)
