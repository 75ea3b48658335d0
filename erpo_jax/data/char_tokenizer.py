"""A fixed-alphabet character tokenizer for the embedded arithmetic task.

Ids: PAD=0, BOS=1, EOS=2, then one id per character of `ALPHABET`
(digits, operators, parentheses, punctuation, space, newline, ``Q``, ``A``
and lowercase letters): vocab_size 55. Unknown characters raise.

It offers the small part of a HF tokenizer's surface the rest of erpo_jax
uses: `encode`, `decode`, `batch_decode`, `vocab_size` and the
`pad_token_id` / `bos_token_id` / `eos_token_id` aliases.
"""

from __future__ import annotations

import string
from collections.abc import Iterable, Sequence

import numpy as np

PAD_ID, BOS_ID, EOS_ID = 0, 1, 2
NUM_SPECIAL = 3
ALPHABET = string.digits + "+-*/()=?;:,. \n" + "QA" + string.ascii_lowercase


class CharTokenizer:
    """Character <-> id map over `alphabet` (no duplicates, no NUL)."""

    def __init__(self, alphabet: str = ALPHABET):
        if len(set(alphabet)) != len(alphabet):
            raise ValueError(f"alphabet has repeated characters: {alphabet!r}")
        if "\x00" in alphabet:
            raise ValueError("alphabet may not contain NUL (used internally for special ids)")
        self.alphabet = alphabet
        self._char_to_id = {c: i + NUM_SPECIAL for i, c in enumerate(alphabet)}
        # id -> code point; specials map to 0 (NUL) and are removed when decoding.
        self._codepoints = np.zeros(self.vocab_size, np.uint32)
        self._codepoints[NUM_SPECIAL:] = [ord(c) for c in alphabet]

    @property
    def vocab_size(self) -> int:
        return NUM_SPECIAL + len(self.alphabet)

    pad_id = pad_token_id = PAD_ID
    bos_id = bos_token_id = BOS_ID
    eos_id = eos_token_id = EOS_ID

    def encode(self, text: str, *, add_bos: bool = False, add_eos: bool = False) -> list[int]:
        """Ids of `text`'s characters, optionally framed by BOS / EOS."""
        ids = [BOS_ID] if add_bos else []
        table = self._char_to_id
        try:
            ids.extend(table[c] for c in text)
        except KeyError:
            pos = next(i for i, c in enumerate(text) if c not in table)
            raise ValueError(
                f"character {text[pos]!r} at position {pos} of {text[:40]!r} is not in the "
                f"tokenizer's alphabet {self.alphabet!r}; remove it or extend the alphabet"
            ) from None
        if add_eos:
            ids.append(EOS_ID)
        return ids

    def encode_batch(
        self,
        texts: Sequence[str],
        length: int | None = None,
        *,
        add_bos: bool = True,
        add_eos: bool = False,
        pad_left: bool = False,
    ) -> np.ndarray:
        """int32[B, length] of encoded `texts`, PAD-filled (right, or left for
        prompts that generation continues). Raises if a text does not fit."""
        rows = [self.encode(t, add_bos=add_bos, add_eos=add_eos) for t in texts]
        width = max((len(r) for r in rows), default=0) if length is None else length
        out = np.full((len(rows), width), PAD_ID, np.int32)
        for b, r in enumerate(rows):
            if len(r) > width:
                raise ValueError(f"text {b} needs {len(r)} tokens but length is {width}")
            if pad_left:
                out[b, width - len(r) :] = r
            else:
                out[b, : len(r)] = r
        return out

    def _check_ids(self, ids: np.ndarray) -> None:
        if ids.size and (ids.min() < 0 or ids.max() >= self.vocab_size):
            bad = ids[(ids < 0) | (ids >= self.vocab_size)].flat[0]
            raise ValueError(f"token id {int(bad)} is outside [0, {self.vocab_size})")

    def decode(self, ids: Iterable[int], *, stop_at_eos: bool = True) -> str:
        """Text of `ids`; PAD and BOS are dropped, decoding stops at the first EOS."""
        arr = np.asarray(list(ids) if not isinstance(ids, np.ndarray) else ids, np.int64)
        return self.batch_decode(arr.reshape(1, -1), stop_at_eos=stop_at_eos)[0]

    def batch_decode(self, ids: np.ndarray, *, stop_at_eos: bool = True) -> list[str]:
        """Decode int[B, T] to B strings without a per-token Python loop.

        Each id becomes a code point through a lookup table (specials and
        everything after a row's first EOS become NUL), each row's code points
        are viewed as one fixed-width numpy string, and NULs are removed.
        """
        ids = np.asarray(ids)
        if ids.ndim != 2:
            raise ValueError(f"batch_decode expects int[B, T], got shape {ids.shape}")
        self._check_ids(ids)
        b, t = ids.shape
        if t == 0:
            return [""] * b
        codes = self._codepoints[ids]
        if stop_at_eos:
            codes[np.cumsum(ids == EOS_ID, axis=1) > 0] = 0
        rows = np.ascontiguousarray(codes).view(f"<U{t}").reshape(b)
        return [str(s).replace("\x00", "") for s in rows]
