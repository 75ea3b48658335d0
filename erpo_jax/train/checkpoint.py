"""Orbax checkpoints of a run: train state plus a small JSON of host-side position.

Each checkpoint holds the full `TrainState` (parameters, optimizer state,
critic if any, counters) and a JSON item with the RL step, the data
iterator's state and the raw sampling seed key, so a restarted command
continues exactly where the interrupted one stopped. The state is restored
into the shardings of a freshly built state (so a resumed run is laid out
like a new one, across any number of hosts).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import jax
import numpy as np
import orbax.checkpoint as ocp


class Checkpointer:
    def __init__(self, directory: str | Path, keep: int = 2, every: int = 1):
        self.directory = Path(directory).absolute()
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
        out = self.manager.restore(step, args=ocp.args.Composite(
            state=ocp.args.StandardRestore(abstract), meta=ocp.args.JsonRestore()))
        return out["state"], dict(out["meta"])

    def close(self) -> None:
        self.manager.close()


def key_to_list(key: jax.Array) -> list[int]:
    return np.asarray(jax.random.key_data(key)).astype(np.uint32).tolist()


def key_from_list(data: list[int]) -> jax.Array:
    return jax.random.wrap_key_data(np.asarray(data, np.uint32))
