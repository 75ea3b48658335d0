"""DAPO's overlong reward shaping (Yu et al., 2025, "DAPO: An Open-Source LLM
Reinforcement Learning System at Scale", section 3.4): a soft length penalty
over the last L tokens before the length limit.

With L_max = rollout.max_new_tokens, L = algo.overlong_buffer and a
penalty factor f (algo.overlong_penalty, DAPO's 1.0), a response of |y|
tokens gets

    0                                   |y| <= L_max - L
    f * ((L_max - L) - |y|) / L         L_max - L < |y| <= L_max

added to its task reward: 0 at the buffer's start, -f at the limit. A
response cut at the limit (no EOS) gets the full -f. The trainer's
`accuracy` is measured on the task reward, before the penalty.
"""

from __future__ import annotations

import numpy as np


def overlong_penalty(lengths, max_new_tokens: int, buffer: int, factor: float = 1.0):
    """float32[R]: the (<= 0) penalty of responses of `lengths` tokens."""
    if not 0 < buffer <= max_new_tokens:
        raise ValueError(f"algo.overlong_buffer must be in [1, rollout.max_new_tokens="
                         f"{max_new_tokens}], got {buffer}.")
    lengths = np.asarray(lengths, np.float64)
    exceed = lengths - (max_new_tokens - buffer)
    return np.minimum(-exceed / buffer * factor, 0.0).astype(np.float32)
