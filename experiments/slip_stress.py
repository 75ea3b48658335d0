"""The slip testbed's stress regime: the three methods where a baseline collapses (issue 19).

    erpo sweep experiments/slip_stress.py --cpu --seeds 0,1,2,3,4 --jobs 2

REGIME is what experiments/slip_search.py found on the validation split (its
REPORT.md): the learning rate, rollout temperature and horizon at which GRPO
without KL collapsed, by the report's definition, in the most seeds. Here the
three methods of the main comparison run in it, at their tuned coefficients,
evaluated greedily on the test families every 20 steps (the collapse test
reads the evaluations); claim 3 is the collapse count of each.
"""

from __future__ import annotations

from pathlib import Path

from erpo_jax.tools.presets import METHODS
from erpo_jax.tools.sweep import load_experiment
from erpo_jax.train.config import RunConfig

testbed = load_experiment(Path(__file__).with_name("slip_testbed.py"))

EXPERIMENT = "slip_stress"
REGIME = (1e-3, 1.5, 100)   # (learning rate, rollout temperature, steps), from slip_search.py
COMPARISONS = testbed.COMPARISONS[:3]
COLLAPSE_DROP = 0.15
ENTROPY_FLOOR = testbed.ENTROPY_FLOOR
sft_config = testbed.sft_config


def variant(method: str) -> RunConfig:
    lr, temperature, steps = REGIME
    return testbed.method_config(method, lr=lr, temperature=temperature, steps=steps,
                                 eval_every=20, sampled_eval=False, experiment=EXPERIMENT)


get_config, get_cpu_config, sweep = testbed.cpu_experiment(
    EXPERIMENT, lambda: {m: variant(m) for m in METHODS}, "erpo")
