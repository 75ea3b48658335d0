"""Prompt preparation, on the host: token-id prompts validated and
left-padded to a length bucket (a power of two), the batch padded to a
multiple of the data-parallel size, so an RL run compiles a handful of
shapes. Every engine's call starts here."""

from __future__ import annotations

from typing import Sequence

import numpy as np

from erpo_jax.model.sharding import Sharding
from erpo_jax.rollout.types import SamplingConfig


def bucket_length(n: int, min_bucket: int, max_len: int) -> int:
    """The padded prompt length for a longest prompt of n tokens: the next power
    of two, at least min_bucket, at most max_len."""
    b = max(min_bucket, 1 << max(0, int(n) - 1).bit_length())
    return min(b, max_len)


def batch_shape(sc: SamplingConfig, sharding: Sharding | None, num_prompts: int,
                longest_prompt: int) -> tuple[int, int]:
    """(B', P) of a padded prompt batch: B' = num_prompts rounded up to the
    data-parallel size, P = the length bucket of the longest prompt."""
    dp = sharding.data_size if sharding is not None else 1
    return (-(-num_prompts // dp) * dp,
            bucket_length(longest_prompt, sc.min_bucket, sc.max_prompt_len))


def prepare_prompts(prompts: Sequence[Sequence[int]], sc: SamplingConfig, vocab_size: int,
                    sharding: Sharding | None = None) -> tuple[np.ndarray, np.ndarray, int]:
    """Validate and left-pad: (tokens int32[B', P], mask bool[B', P], B).

    B' >= B is B rounded up to the data-parallel size (extra rows repeat the
    last prompt and are dropped from the result). Raises ValueError naming
    the offending prompt's index.
    """
    V = vocab_size
    if isinstance(prompts, np.ndarray) and prompts.ndim == 2:
        prompts = list(prompts)
    if prompts is None or len(prompts) == 0:
        raise ValueError("Sampler: the prompt list is empty; pass at least one prompt.")
    arrays = []
    for i, p in enumerate(prompts):
        a = np.asarray(p)
        if a.ndim != 1:
            raise ValueError(f"Sampler: prompt {i} must be a flat list of token ids, "
                             f"got shape {a.shape}.")
        if a.size == 0:
            raise ValueError(f"Sampler: prompt {i} is empty; every prompt needs at least "
                             "one token.")
        if not np.issubdtype(a.dtype, np.integer):
            raise ValueError(f"Sampler: prompt {i} has dtype {a.dtype}; token ids must be "
                             "integers.")
        if a.size > sc.max_prompt_len:
            raise ValueError(f"Sampler: prompt {i} has {a.size} tokens, more than "
                             f"max_prompt_len={sc.max_prompt_len}.")
        bad = a[(a < 0) | (a >= V)]
        if bad.size:
            raise ValueError(f"Sampler: prompt {i} holds token id {int(bad[0])} outside the "
                             f"vocabulary [0, {V}).")
        arrays.append(a.astype(np.int32))
    B = len(arrays)
    Bp, P = batch_shape(sc, sharding, B, max(a.size for a in arrays))
    tokens = np.full((Bp, P), sc.pad_id, np.int32)
    mask = np.zeros((Bp, P), bool)
    for i in range(Bp):
        a = arrays[min(i, B - 1)]
        tokens[i, P - a.size:] = a
        mask[i, P - a.size:] = True
    return tokens, mask, B

