"""The slip testbed's long horizon: the three methods for FACTOR x the main budget (issue 19).

    erpo sweep experiments/slip_horizon.py --cpu --seeds 0,1,2,3,4 --jobs 2

slip_testbed.py's main comparison (lr 3e-4, rollout temperature 1, tuned
coefficients) run FACTOR times as many steps, evaluated greedily and with 8
samples on the test families every 50 steps as there; claim 3 is whether any
method collapses (the report's definition: an evaluation COLLAPSE_DROP below
the run's best so far) when training goes on after accuracy has risen, and
claim 2 how far each drifts. Runs go to runs/slip_horizon/<method>/seed<k>.
"""

from __future__ import annotations

from pathlib import Path

from erpo_jax.tools.presets import METHODS
from erpo_jax.tools.sweep import load_experiment
from erpo_jax.train.config import RunConfig

testbed = load_experiment(Path(__file__).with_name("slip_testbed.py"))

EXPERIMENT = "slip_horizon"
FACTOR = 2
COMPARISONS = testbed.COMPARISONS[:3]
COLLAPSE_DROP = 0.15
ENTROPY_FLOOR = testbed.ENTROPY_FLOOR
sft_config = testbed.sft_config


def variant(method: str) -> RunConfig:
    return testbed.method_config(method, steps=FACTOR * testbed.STEPS, experiment=EXPERIMENT)


get_config, get_cpu_config, sweep = testbed.cpu_experiment(
    EXPERIMENT, lambda: {m: variant(m) for m in METHODS}, "erpo")
