"""What the rollout-engine tests share: two rollouts hold the same samples;
the sizes of a compiled program's collectives."""

from __future__ import annotations

import numpy as np

from erpo_jax.rollout.types import Rollout


def assert_same_samples(a: Rollout, b: Rollout, what: str = "") -> None:
    """b holds a's samples: every field equal, log-probs to float rounding."""
    for f in Rollout._fields:
        x, y = np.asarray(getattr(a, f)), np.asarray(getattr(b, f))
        if f == "logp":
            np.testing.assert_allclose(x, y, atol=2e-5, rtol=0, err_msg=f"{what} {f}")
        else:
            np.testing.assert_array_equal(x, y, err_msg=f"{what} {f}")


def all_gather_sizes(hlo: str) -> list[int]:
    """Element counts of the outputs of every all-gather in optimized HLO text."""
    return collective_sizes(hlo, "all-gather")


def collective_sizes(hlo: str, op: str) -> list[int]:
    """Element counts of the outputs (a tuple's first) of every `op`
    ('all-gather', 'all-reduce') in optimized HLO text."""
    import re
    sizes = []
    for line in hlo.splitlines():
        m = re.search(r"= \(?\w+\[([\d,]*)\][^=]*? " + op + r"(?:-start)?\(", line)
        if m:
            sizes.append(int(np.prod([int(d) for d in m.group(1).split(",") if d])))
    return sizes
