"""Response token ids -> strings for the reward, cut at the first EOS.

The cut is found for all rows at once (argmax over a boolean mask); the only
Python loop is over rows, handing each truncated row to the tokenizer's
batch_decode or to a join over a per-token string table.
"""

from __future__ import annotations

from typing import Any, Sequence

import numpy as np


def response_lengths(ids: np.ndarray, eos_ids: Sequence[int], mask: np.ndarray | None = None,
                     *, include_eos: bool = False) -> np.ndarray:
    """int64[R]: tokens to keep per row of ids int[R, N].

    A row is cut before its first EOS id (after it if include_eos); rows with
    no EOS keep everything, or only their mask's True prefix when `mask`
    bool[R, N] (e.g. Rollout.response_mask) is given.
    """
    ids = np.asarray(ids)
    if ids.ndim != 2:
        raise ValueError(f"response ids must be int[R, N], got shape {ids.shape}.")
    R, N = ids.shape
    limit = np.full(R, N) if mask is None else np.asarray(mask, bool).sum(axis=-1)
    if len(eos_ids) == 0:
        return limit
    is_eos = np.isin(ids, np.asarray(eos_ids))
    if mask is not None:
        is_eos &= np.asarray(mask, bool)
    first = np.where(is_eos.any(axis=-1), is_eos.argmax(axis=-1) + int(include_eos), N)
    return np.minimum(first, limit)


def truncate_responses(ids: np.ndarray, eos_ids: Sequence[int], mask: np.ndarray | None = None,
                       *, include_eos: bool = False) -> list[np.ndarray]:
    """Each row of ids int[R, N] cut at its first EOS (see `response_lengths`)."""
    ids = np.asarray(ids)
    n = response_lengths(ids, eos_ids, mask, include_eos=include_eos)
    return [row[:k] for row, k in zip(ids, n)]


def decode_responses(ids: np.ndarray, eos_ids: Sequence[int], *, tokenizer: Any = None,
                     token_strings: Sequence[str] | np.ndarray | None = None,
                     mask: np.ndarray | None = None, include_eos: bool = False,
                     **decode_kwargs) -> list[str]:
    """R strings from response ids int[R, N], each stopped at its first EOS.

    Give exactly one of `tokenizer` (anything with `batch_decode(list of id
    lists, **decode_kwargs)`, e.g. a transformers tokenizer) or
    `token_strings` (the string of every token id, indexed by id: a
    char-level lookup table).
    """
    if (tokenizer is None) == (token_strings is None):
        raise ValueError("decode_responses: pass exactly one of tokenizer= or token_strings=.")
    ids = np.asarray(ids)
    n = response_lengths(ids, eos_ids, mask, include_eos=include_eos)
    if tokenizer is not None:
        return list(tokenizer.batch_decode([row[:k].tolist() for row, k in zip(ids, n)],
                                           **decode_kwargs))
    table = np.asarray(token_strings, dtype=object)
    if ids.size and (ids.min() < 0 or ids.max() >= len(table)):
        raise ValueError(f"decode_responses: token id outside the {len(table)}-entry "
                         "token_strings table.")
    pieces = table[ids]                                        # object[R, N]
    pieces[np.arange(ids.shape[1])[None, :] >= n[:, None]] = ""
    return ["".join(row) for row in pieces.tolist()]
