"""Command-line overrides of the tiny trainer runs the tests make, and the
briefly SFT'd model they start from (built once per session in conftest.py).

The SFT model has memorised most of the worked solutions of the 64 training
problems the RL runs use, so with `ANSWERING` rollouts (long enough for a
whole solution, 4 samples per prompt) the sampled rewards vary within groups
from the first step: the policy-gradient path has a signal to follow.
"""

from __future__ import annotations

from pathlib import Path

TINY = ["model.init=random", "model.preset=tiny", "data.n_train=64", "data.n_test=4",
        "rollout.group_size=2", "rollout.max_new_tokens=8", "train.batch_size=8",
        "train.eval_every=0", "train.drift_every=0", "train.progress=false",
        "train.eval_max_problems=4", "train.drift_queries=4", "optim.lr=1e-3"]

# Rollouts that can reach the answer (solutions are at most 40 characters).
ANSWERING = ["rollout.group_size=4", "rollout.max_new_tokens=40"]

SFT_STEPS = 200


def sft_args(out: Path) -> list[str]:
    return ["sft", *TINY, "train.batch_size=32", f"train.steps={SFT_STEPS}", "optim.lr=3e-3",
            f"train.out_dir={out}"]


def rl_args(sft_model: Path, out: Path, *extra: str) -> list[str]:
    """Overrides of an RL run from the SFT model into `out` (sibling runs share a reference cache)."""
    return [*TINY, "model.init=sft", f"model.path={sft_model}", f"train.out_dir={out}",
            f"train.ref_cache_dir={out.parent / 'refcache'}", *extra]
