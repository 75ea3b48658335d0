"""Coefficients for the slip testbed, chosen on its validation split (issue 19, item 4).

    erpo sweep experiments/slip_tuning.py --cpu --seeds 0,1 --jobs 2

Each regularised method at four coefficients a factor of about 3-4 apart
around the old testbed's (β_policy 0.01 / 0.04 / 0.16 / 0.5 for GRPO +
Policy-KL, β_q 0.03 / 0.1 / 0.3 / 1 for ERPO; the fourth values were added
when the first three put ERPO's best at the edge), at the main comparison's budget (lr 3e-4,
100 steps), evaluated only on the 100 held-out validation problems of each
training family (`train.eval_split=validation`), never on the test families.
`chosen` picks each method's coefficient with the highest final validation
greedy pass@1, averaged over seeds; slip_testbed.py's BETA_POLICY and
BETA_QUERY are those (a test checks them against the committed summaries).
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import numpy as np

from erpo_jax.tools.sweep import load_experiment
from erpo_jax.train.config import RunConfig

testbed = load_experiment(Path(__file__).with_name("slip_testbed.py"))

EXPERIMENT = "slip_tuning"
GRID = {"grpo+policy_kl": (0.01, 0.04, 0.16, 0.5), "erpo": (0.03, 0.1, 0.3, 1.0)}
COMPARISONS = [("erpo-b0.3", f"erpo-b{b}") for b in (0.03, 0.1, 1.0)] + [
    ("grpo+policy_kl-b0.04", f"grpo+policy_kl-b{b}") for b in (0.01, 0.16, 0.5)]
ENTROPY_FLOOR = testbed.ENTROPY_FLOOR
sft_config = testbed.sft_config


def variant(method: str, beta: float) -> RunConfig:
    return testbed.method_config(method, beta=beta, eval_split="validation",
                                 eval_every=testbed.STEPS, name=f"{method}-b{beta}",
                                 experiment=EXPERIMENT)


def chosen(runs: Sequence[dict], sep: str = "-b") -> dict[str, float]:
    """{method: coefficient} with the best mean final validation greedy pass@1 over
    seeds; `runs` as `erpo_jax.tools.report.load_run` gives them, each named
    '<method><sep><coefficient>'."""
    by: dict[tuple[str, float], list[float]] = {}
    for r in runs:
        method, beta = r["name"].rsplit(sep, 1)
        by.setdefault((method, float(beta)), []).append(r["evals"][-1]["average"]["greedy_acc"])
    best: dict[str, tuple[float, float]] = {}
    for (method, beta), accs in sorted(by.items()):
        score = float(np.mean(accs))
        if method not in best or score > best[method][1]:
            best[method] = (beta, score)
    return {m: b for m, (b, _) in best.items()}


def get_config() -> RunConfig:
    return get_cpu_config()


def get_cpu_config() -> RunConfig:
    return variant("erpo", testbed.BETA_QUERY)


def sweep(cpu: bool = False) -> dict[str, RunConfig]:
    if not cpu:
        raise ValueError("slip_tuning.py tunes the CPU testbed; run it with --cpu.")
    return {f"{m}-b{b}": variant(m, b) for m, betas in GRID.items() for b in betas}
