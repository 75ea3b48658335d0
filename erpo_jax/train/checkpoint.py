"""Orbax checkpoints of a run: train state plus a small JSON of host-side position.

Each checkpoint holds the full `TrainState` (parameters, optimizer state,
critic if any, counters) and a JSON item with the RL step, the data
iterator's state and the raw sampling seed key, so a restarted command
continues exactly where the interrupted one stopped. The state is restored
into the shardings of a freshly built state (so a resumed run is laid out
like a new one, across any number of hosts).
"""

from __future__ import annotations

import contextlib
import logging
import re
import warnings
from typing import Any

import jax
import numpy as np
import orbax.checkpoint as ocp
from etils import epath

# A save or restore that fails part-way (a full disk, a checkpoint of another
# shape) leaves some of orbax's per-array coroutines unawaited. Which ones depends
# on where the failure met its gather, and they are collected when Python gets to
# them: in orbax's thread, while the error unwinds, or at exit. Python then prints
# a warning and a tracemalloc hint after the one-sentence error, burying it. This
# package has no coroutines of its own, so every such warning is a library's
# leftover: all are ignored, not one name (a save once left another one).
warnings.filterwarnings("ignore", message=r"coroutine '.*' was never awaited",
                        category=RuntimeWarning)


class SaveFailed(RuntimeError):
    """A checkpoint could not be written (a full disk, a lost bucket): one sentence
    saying what failed, what is intact and how to resume."""

    def __init__(self, directory, step: int, latest: int | None, error: BaseException):
        cause = root_cause(error)
        text = " ".join(str(cause).split())
        os_error = re.search(r"[^:\"]*: [^:\"]*\[os_error_code='\d+'\]", text)  # tensorstore's
        reason = os_error.group(0).strip() if os_error else f"{type(cause).__name__}: {text}"[:300]
        intact = (f"the checkpoint of step {latest} is intact, and so are the metrics up to it; "
                  f"rerunning the same command resumes from step {latest}" if latest is not None
                  else "no earlier checkpoint exists; rerunning the same command starts at step 0")
        super().__init__(f"saving the checkpoint of step {step} to {directory} failed ({reason}); "
                         f"{intact} once the cause (e.g. a full disk) is fixed.")


def root_cause(e: BaseException) -> BaseException:
    """The innermost exception of a chain (orbax wraps the OSError several times)."""
    seen = {id(e)}
    while True:
        nxt = e.__cause__ or e.__context__
        if nxt is None or id(nxt) in seen:
            return e
        seen.add(id(nxt))
        e = nxt


class _Held(logging.Filter):
    """Keeps error records instead of letting them through."""

    def __init__(self):
        super().__init__()
        self.records = []

    def filter(self, record):
        if record.levelno >= logging.ERROR:
            self.records.append(record)
            return False
        return True


class _DropTaskErrors(logging.Filter):
    """Drops asyncio's "Task exception was never retrieved" and "Future
    exception was never retrieved" records (orbax's thread-pool reads are
    futures as well as tasks)."""

    def filter(self, record):
        first = str(record.msg).split("\n", 1)[0]
        return not (record.levelno >= logging.ERROR
                    and first.endswith("exception was never retrieved"))


_DROP_TASK_ERRORS = _DropTaskErrors()


@contextlib.contextmanager
def _orbax_errors_held():
    """orbax logs a failing read or write from each of its threads, with
    tracebacks, and its abandoned tasks report their exception through
    asyncio's logger ("Task/Future exception was never retrieved") during the call or
    when they are collected later. The caller's exception says it in one
    sentence, so on failure those records are dropped (the asyncio ones for
    good: they arrive at garbage collection); on success whatever was logged is
    passed on as it was."""
    held = _Held()
    loggers = [logging.getLogger("absl"), logging.getLogger("asyncio")]
    for logger in loggers:
        logger.addFilter(held)
    try:
        yield
    except BaseException:
        logging.getLogger("asyncio").addFilter(_DROP_TASK_ERRORS)   # idempotent
        raise
    finally:
        for logger in loggers:
            logger.removeFilter(held)
    for record in held.records:
        logging.getLogger(record.name).handle(record)


class Checkpointer:
    def __init__(self, directory, keep: int = 2, every: int = 1):
        directory = epath.Path(directory)
        self.directory = directory if "://" in str(directory) else directory.absolute()
        self.every = max(int(every), 1)
        options = ocp.CheckpointManagerOptions(max_to_keep=keep, create=True,
                                               enable_async_checkpointing=False)
        self.manager = ocp.CheckpointManager(self.directory, options=options,
                                             item_names=("state", "meta"))

    def latest_step(self) -> int | None:
        return self.manager.latest_step()

    def save(self, step: int, state: Any, meta: dict, force: bool = False) -> bool:
        """Save at RL step `step` (every `every` steps, or now with force)."""
        if not force and step % self.every:
            return False
        if self.manager.latest_step() == step:
            return False
        with _orbax_errors_held():   # a failed save: SaveFailed says it, once
            saved = self.manager.save(step, args=ocp.args.Composite(
                state=ocp.args.StandardSave(state), meta=ocp.args.JsonSave(meta)), force=True)
            self.manager.wait_until_finished()
        return saved

    def restore(self, state_like: Any, step: int | None = None) -> tuple[Any, dict]:
        """(state, meta) from `step` (default latest), laid out like `state_like`."""
        step = self.manager.latest_step() if step is None else step
        if step is None:
            raise FileNotFoundError(f"no checkpoint in {self.directory}")
        abstract = jax.tree_util.tree_map(
            lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding)
            if isinstance(x, jax.Array) else x, state_like)
        with _orbax_errors_held():   # e.g. a checkpoint of other shapes: the caller says it
            out = self.manager.restore(step, args=ocp.args.Composite(
                state=ocp.args.StandardRestore(abstract), meta=ocp.args.JsonRestore()))
        return out["state"], dict(out["meta"])

    def meta(self, step: int) -> dict:
        """The JSON meta of checkpoint `step` alone (no arrays are read)."""
        with _orbax_errors_held():
            out = self.manager.restore(step, args=ocp.args.Composite(
                meta=ocp.args.JsonRestore()))
        return dict(out["meta"])

    def restore_newest_intact(self, state_like: Any) -> tuple[Any, dict, list]:
        """(state, meta, broken) from the newest checkpoint that restores, where
        broken lists (step, exception) of the newer ones that did not (a
        truncated or corrupt file). When none restores, the latest's exception
        is raised: then no checkpoint fits this config, nothing is corrupt."""
        broken = []
        for step in sorted(self.manager.all_steps(), reverse=True):
            try:
                state, meta = self.restore(state_like, step)
            except Exception as e:  # noqa: BLE001 - told apart below: corrupt or misfit
                broken.append((step, e))
                continue
            return state, meta, broken
        if not broken:
            raise FileNotFoundError(f"no checkpoint in {self.directory}")
        raise broken[0][1]

    def set_aside(self, step: int) -> epath.Path:
        """Move checkpoint `step` out of the manager's directory (to
        `<run>/broken_checkpoints/<step>`, kept for a look, never deleted)."""
        dest = self.directory.parent / "broken_checkpoints" / str(step)
        dest.parent.mkdir(parents=True, exist_ok=True)
        if dest.exists():
            dest = dest.parent / f"{step}-{len(list(dest.parent.iterdir()))}"
        (self.directory / str(step)).rename(dest)
        self.manager.reload()
        return dest

    def close(self) -> None:
        self.manager.close()


def key_to_list(key: jax.Array) -> list[int]:
    return np.asarray(jax.random.key_data(key)).astype(np.uint32).tolist()


def key_from_list(data: list[int]) -> jax.Array:
    return jax.random.wrap_key_data(np.asarray(data, np.uint32))
