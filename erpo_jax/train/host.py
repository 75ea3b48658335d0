"""Sampling onto every host's numpy, single- or multi-host."""

from __future__ import annotations

from typing import Any, Sequence

import jax
import numpy as np

from erpo_jax.distributed import to_host


def sample(sampler, params, prompts: Sequence[Sequence[int]], key: jax.Array):
    """A Rollout of numpy arrays over exactly len(prompts) * G rows (any number of hosts)."""
    out, n = sampler.run(params, prompts, key)
    out = to_host(out)
    return type(out)(*(a[:n] if np.ndim(a) else a for a in out))
