"""The search for a stress regime on the slip testbed (issue 19, item 3).

    erpo sweep experiments/slip_search.py --cpu --seeds 0,1 --jobs 2

GRPO without KL, the baseline most free to run away, from the slipped
reference at learning rates 3e-4 (the main comparison's) and 1e-3, rollout
temperatures 1.0, 1.5 and 2.0, and, at the main learning rate and temperature,
twice the horizon (200 steps). Evaluated greedily on the validation split
every 20 steps (the collapse test needs the evaluations in between), never on
the test families. A run collapses, by the report's definition, at an
evaluation more than 15 points below its best so far (COLLAPSE_DROP; the
entropy floor is off on this testbed). `chosen_regime` picks slip_stress.py's
REGIME: the grid point where the most seeds collapsed; among ties, the one
whose first evaluation after step 0 is the highest on average (the mildest
collapse, where a regulariser has the most room to matter).
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import numpy as np

from erpo_jax.tools import report
from erpo_jax.tools.sweep import load_experiment
from erpo_jax.train.config import RunConfig

testbed = load_experiment(Path(__file__).with_name("slip_testbed.py"))

EXPERIMENT = "slip_search"
# (learning rate, rollout temperature, steps)
GRID = [(lr, t, testbed.STEPS) for lr in (3e-4, 1e-3) for t in (1.0, 1.5, 2.0)
        if (lr, t) != (3e-4, 1.0)] + [(3e-4, 1.0, 2 * testbed.STEPS)]
COMPARISONS: list = []
COLLAPSE_DROP = 0.15
ENTROPY_FLOOR = testbed.ENTROPY_FLOOR
sft_config = testbed.sft_config


def name(method: str, lr: float, temperature: float, steps: int) -> str:
    return f"{method}-lr{lr:g}-T{temperature:g}-s{steps}"


def variant(method: str, lr: float, temperature: float, steps: int) -> RunConfig:
    return testbed.method_config(method, lr=lr, temperature=temperature, steps=steps,
                                 eval_split="validation", eval_every=20, sampled_eval=False,
                                 name=name(method, lr, temperature, steps),
                                 experiment=EXPERIMENT)


def chosen_regime(runs: Sequence[dict]) -> tuple[float, float, int]:
    """(lr, temperature, steps) by the module docstring's rule; `runs` as
    `erpo_jax.tools.report.load_run` gives them."""
    by = report.group(runs)
    scores = {}
    for g in GRID:
        rs = by.get(name("no_kl", *g), [])
        if rs:
            collapses = sum(report.collapsed(r, COLLAPSE_DROP, ENTROPY_FLOOR) for r in rs)
            first = np.mean([r["evals"][1]["average"]["greedy_acc"] for r in rs])
            scores[g] = (collapses, first)
    return max(scores, key=scores.get)


def get_config() -> RunConfig:
    return get_cpu_config()


def get_cpu_config() -> RunConfig:
    return variant("no_kl", *GRID[0])


def sweep(cpu: bool = False) -> dict[str, RunConfig]:
    if not cpu:
        raise ValueError("slip_search.py searches the CPU testbed; run it with --cpu.")
    return {name("no_kl", *g): variant("no_kl", *g) for g in GRID}
