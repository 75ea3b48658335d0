"""Long horizon: each method for 4x the main comparison's budget, watching for collapse (claim 3).

CPU:

    erpo sweep experiments/long_horizon.py --cpu --seeds 0,1,2

Real scale (Qwen2.5-Math-1.5B on a TPU v4-8):

    erpo sweep experiments/long_horizon.py --seeds 0,1,2

Variants: the main comparison's three methods with `train.steps` times 4,
evaluated at the main comparison's interval (so 4x as many evaluations) and
checkpointed at least every main budget. A collapse is counted by the report
(see erpo_jax/tools/report.py): an evaluation more than COLLAPSE_DROP below the
run's best so far, or response entropy below ENTROPY_FLOOR. Runs go to
runs/long_horizon/<variant>/seed<k>.
"""

from __future__ import annotations

from pathlib import Path

from erpo_jax.tools.presets import METHODS
from erpo_jax.tools.sweep import load_experiment
from erpo_jax.train.config import RunConfig

main = load_experiment(Path(__file__).with_name("main_comparison.py"))

FACTOR = 4
COLLAPSE_DROP = 0.15
ENTROPY_FLOOR = 0.05
COMPARISONS = main.COMPARISONS


def variant(method: str, cpu: bool) -> RunConfig:
    return main.placed(main.method_config(method, cpu, steps_factor=FACTOR), "long_horizon")


def get_config() -> RunConfig:
    return variant("erpo", cpu=False)


def get_cpu_config() -> RunConfig:
    return variant("erpo", cpu=True)


def sweep(cpu: bool = False) -> dict[str, RunConfig]:
    return {m: variant(m, cpu) for m in METHODS}
