"""Sampling onto every host's numpy, single- or multi-host, in bounded chunks."""

from __future__ import annotations

from typing import Sequence

import jax
import numpy as np

from erpo_jax.runtime.distributed import to_host


def sample(sampler, params, prompts: Sequence[Sequence[int]], key: jax.Array,
           max_prompts: int = 0):
    """A Rollout of numpy arrays over exactly len(prompts) * G rows (any number of hosts).

    max_prompts > 0 samples at most that many prompts per call (chunk c uses
    the key fold_in(key, c)), bounding the KV cache to max_prompts * G rows;
    chunks are joined with their prompts left-padded to one width.
    """
    if max_prompts <= 0 or len(prompts) <= max_prompts:
        return _one(sampler, params, prompts, key)
    parts = [_one(sampler, params, prompts[i:i + max_prompts],
                  jax.random.fold_in(key, c))
             for c, i in enumerate(range(0, len(prompts), max_prompts))]
    width = max(p.prompt_tokens.shape[1] for p in parts)
    pad_id = sampler.sampling.pad_id

    def left_pad(a, fill):
        return np.pad(a, ((0, 0), (width - a.shape[1], 0)), constant_values=fill)

    parts = [p._replace(prompt_tokens=left_pad(p.prompt_tokens, pad_id),
                        prompt_mask=left_pad(p.prompt_mask, False)) for p in parts]
    joined = {f: np.concatenate([getattr(p, f) for p in parts])
              for f in parts[0]._fields if f != "num_steps"}
    return type(parts[0])(**joined, num_steps=max(int(p.num_steps) for p in parts))


def _one(sampler, params, prompts, key):
    out, n = sampler.run(params, prompts, key)
    out = to_host(out)
    return type(out)(*(a[:n] if np.ndim(a) else a for a in out))
