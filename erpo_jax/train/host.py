"""Moving results from the mesh to every host's numpy, single- or multi-host."""

from __future__ import annotations

from typing import Any, Sequence

import jax
import numpy as np


def to_host(tree: Any) -> Any:
    """numpy copies of every array leaf; arrays spread over several processes
    are gathered (each process gets the whole global value)."""
    def one(x):
        if isinstance(x, jax.Array) and not x.is_fully_addressable:
            from jax.experimental import multihost_utils
            return np.asarray(multihost_utils.process_allgather(x, tiled=True))
        return np.asarray(x) if isinstance(x, (jax.Array, np.ndarray)) else x
    return jax.tree_util.tree_map(one, tree)


def sample(sampler, params, prompts: Sequence[Sequence[int]], key: jax.Array):
    """A Rollout of numpy arrays over exactly len(prompts) * G rows (any number of hosts)."""
    out, n = sampler.run(params, prompts, key)
    out = to_host(out)
    return type(out)(*(a[:n] if np.ndim(a) else a for a in out))
