"""Deterministic, resumable, epoch-aware batches of query indices.

The order comes from grain: ``MapDataset.range(n).shuffle(seed).repeat()``
is a random-access stream in which element ``e*n + i`` is the i-th element of
epoch e's permutation, and every epoch is shuffled with its own seed (grain
folds the epoch into the seed). Random access is what makes resuming exact:
the iterator's whole position is one step counter, and batch `step` is
computed from it, never from history.

Batching is per epoch: each epoch yields ``n // global_batch_size`` full
batches and drops its remainder, so batches never straddle epochs. Each of
`process_count` processes gets the contiguous slice ``[p*B/P, (p+1)*B/P)`` of
every global batch, so the processes together see exactly the global batch.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import numpy as np

try:  # grain >= 0.2.? exposes the dataset API at the top level
    import grain

    MapDataset = grain.MapDataset
except AttributeError:  # older grain
    import grain.python as grain

    MapDataset = grain.MapDataset


class QueryBatchIterator(Iterator[np.ndarray]):
    """Yields this process's share of each global batch of dataset indices.

    Args:
      num_examples: dataset size n (indices are in [0, n)).
      global_batch_size: B, queries per step over all processes.
      seed: any non-negative int; the shuffle seed is derived from it, so
        nearby seeds give unrelated orders.
      process_index, process_count: this process's place in a multi-host run
        (`jax.process_index()`, `jax.process_count()`).
      step: position to start from (0 for a fresh run).
    Each `next()` returns int64[B // process_count].
    """

    def __init__(
        self,
        num_examples: int,
        global_batch_size: int,
        seed: int,
        *,
        process_index: int = 0,
        process_count: int = 1,
        step: int = 0,
    ):
        if global_batch_size < 1 or num_examples < global_batch_size:
            raise ValueError(
                f"global batch {global_batch_size} needs a dataset of at least that many "
                f"examples, got {num_examples}"
            )
        if process_count < 1 or not 0 <= process_index < process_count:
            raise ValueError(f"process_index {process_index} is not in [0, {process_count})")
        if global_batch_size % process_count:
            raise ValueError(
                f"global batch {global_batch_size} is not divisible by process_count {process_count}"
            )
        if seed < 0:
            raise ValueError(f"seed must be non-negative, got {seed}")
        self.num_examples = int(num_examples)
        self.global_batch_size = int(global_batch_size)
        self.seed = int(seed)
        self.process_index = int(process_index)
        self.process_count = int(process_count)
        self.local_batch_size = global_batch_size // process_count
        self.batches_per_epoch = num_examples // global_batch_size
        self.step = int(step)
        # grain seeds epoch e with (seed + e): hash the user's seed first so
        # that seed s+1 does not replay seed s's epochs shifted by one.
        shuffle_seed = int(np.random.SeedSequence(self.seed).generate_state(1, np.uint32)[0])
        self._order = MapDataset.range(num_examples).shuffle(seed=shuffle_seed).repeat()

    @property
    def epoch(self) -> int:
        """The epoch the next batch comes from."""
        return self.step // self.batches_per_epoch

    def batch_at(self, step: int) -> np.ndarray:
        """int64[B_local]: this process's indices for batch `step` (pure)."""
        epoch, j = divmod(step, self.batches_per_epoch)
        start = epoch * self.num_examples + j * self.global_batch_size
        start += self.process_index * self.local_batch_size
        return np.fromiter(
            (self._order[k] for k in range(start, start + self.local_batch_size)),
            dtype=np.int64,
            count=self.local_batch_size,
        )

    def __iter__(self) -> QueryBatchIterator:
        return self

    def __next__(self) -> np.ndarray:
        batch = self.batch_at(self.step)
        self.step += 1
        return batch

    # -- checkpointing ---------------------------------------------------------

    def get_state(self) -> dict[str, Any]:
        """JSON-able position (plus what it is only valid for)."""
        return {
            "step": self.step,
            "seed": self.seed,
            "num_examples": self.num_examples,
            "global_batch_size": self.global_batch_size,
        }

    def set_state(self, state: dict[str, Any]) -> None:
        """Resume at `state["step"]`. Raises ValueError if the state was saved
        for another dataset size, batch size or seed (the order would differ)."""
        for key in ("seed", "num_examples", "global_batch_size"):
            if key in state and int(state[key]) != getattr(self, key):
                raise ValueError(
                    f"iterator state has {key}={state[key]} but this iterator has "
                    f"{key}={getattr(self, key)}; resume with the run's original data config"
                )
        step = int(state["step"])
        if step < 0:
            raise ValueError(f"iterator state step must be >= 0, got {step}")
        self.step = step
