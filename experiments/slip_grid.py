"""The slip testbed's pre-declared stability grid (issue 35, item 4).

    erpo sweep experiments/slip_grid.py --cpu --seeds 0,1,2 --jobs 2

Learning rate {3e-4, 5e-4, 7e-4, 1e-3} x rollout temperature {1.0, 1.5} at
100 steps, the three methods of the main comparison at their tuned
coefficients (ERPO, GRPO + Policy-KL, no KL), 3 seeds. Declared before any of
its runs, with the verdict rule of experiments/RESULTS.md ("The verdict rule"):
claim 3's verdict comes from the collapse counts over the whole grid.

Three cells exist as committed runs and are reused, not rerun:
- lr 3e-4, T 1.0: slip_testbed.py's main runs;
- lr 3e-4, T 1.5: slip_temperature.py;
- lr 1e-3, T 1.5: slip_stress.py.
This file runs the other five cells (45 runs), with slip_stress.py's
evaluation protocol: greedy on the test families every 20 steps, which the
collapse test reads. Runs go to runs/slip_grid/<method>-lr<lr>-T<t>/seed<k>.
"""

from __future__ import annotations

from pathlib import Path

from erpo_jax.tools.presets import METHODS
from erpo_jax.tools.sweep import load_experiment
from erpo_jax.train.config import RunConfig

testbed = load_experiment(Path(__file__).with_name("slip_testbed.py"))

EXPERIMENT = "slip_grid"
LRS = (3e-4, 5e-4, 7e-4, 1e-3)
TEMPERATURES = (1.0, 1.5)
STEPS = 100
# (lr, T) -> the experiment whose committed runs are that cell.
REUSED = {(3e-4, 1.0): "slip_testbed", (3e-4, 1.5): "slip_temperature",
          (1e-3, 1.5): "slip_stress"}
COMPARISONS = testbed.COMPARISONS[:3]
COLLAPSE_DROP = 0.15
ENTROPY_FLOOR = testbed.ENTROPY_FLOOR
sft_config = testbed.sft_config


def cell_name(method: str, lr: float, temperature: float) -> str:
    return f"{method}-lr{lr:g}-T{temperature:g}"


def variant(method: str, lr: float, temperature: float) -> RunConfig:
    return testbed.method_config(method, lr=lr, temperature=temperature, steps=STEPS,
                                 eval_every=20, sampled_eval=False,
                                 name=cell_name(method, lr, temperature), experiment=EXPERIMENT)


def _variants() -> dict[str, RunConfig]:
    # The hot column first: it is where collapses are expected.
    return {cell_name(m, lr, t): variant(m, lr, t)
            for t in sorted(TEMPERATURES, reverse=True) for lr in LRS for m in METHODS
            if (lr, t) not in REUSED}


get_config, get_cpu_config, sweep = testbed.cpu_experiment(
    EXPERIMENT, _variants, cell_name("erpo", 5e-4, 1.5))
