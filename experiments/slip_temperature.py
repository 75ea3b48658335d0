"""The slip testbed's temperature comparison: the three methods with hot rollouts (issue 19).

    erpo sweep experiments/slip_temperature.py --cpu --seeds 0,1,2,3,4 --jobs 2

The main comparison (slip_testbed.py) at rollout temperature TEMPERATURE
instead of 1: same reference, learning rate, horizon, tuned coefficients and
evaluation (greedy and 8 samples at temperature 1, every 50 steps, on the test
families). Only `rollout.temperature` changes: the PG ratio and Policy-KL use
the sampling temperature, Query-KL and the weights stay at temperature 1. The
T = 1 point is slip_testbed.py's main runs (same seeds). Runs go to
runs/slip_temperature/<method>-T<t>/seed<k>.
"""

from __future__ import annotations

from pathlib import Path

from erpo_jax.tools.presets import METHODS
from erpo_jax.tools.sweep import load_experiment
from erpo_jax.train.config import RunConfig

testbed = load_experiment(Path(__file__).with_name("slip_testbed.py"))

EXPERIMENT = "slip_temperature"
TEMPERATURE = 1.5
COMPARISONS = [(f"{a}-T{TEMPERATURE}", f"{b}-T{TEMPERATURE}") for a, b in testbed.COMPARISONS[:3]]
COLLAPSE_DROP = 0.15
ENTROPY_FLOOR = testbed.ENTROPY_FLOOR
sft_config = testbed.sft_config


def variant(method: str) -> RunConfig:
    return testbed.method_config(method, temperature=TEMPERATURE,
                                 name=f"{method}-T{TEMPERATURE}", experiment=EXPERIMENT)


get_config, get_cpu_config, sweep = testbed.cpu_experiment(
    EXPERIMENT, lambda: {f"{m}-T{TEMPERATURE}": variant(m) for m in METHODS}, f"erpo-T{TEMPERATURE}")
