"""Sampling onto every host's numpy, single- or multi-host, in bounded chunks."""

from __future__ import annotations

from typing import Sequence

import jax


def sample(engine, params, prompts: Sequence[Sequence[int]], key: jax.Array,
           max_prompts: int = 0):
    """A Rollout of numpy arrays over exactly len(prompts) * G rows (any
    number of hosts), from a rollout engine (`rollout.engine`: the
    `StaticEngine` or the `ContinuousEngine`). max_prompts > 0: chunk c of that
    many prompts uses the key fold_in(key, c), whichever engine runs it, so
    both engines draw the same samples, to float rounding: a draw can flip
    where rounding moves it across a token boundary."""
    return engine.sample(params, prompts, key, max_prompts)
