"""The slipped-demonstration testbed (issue 19; see SLIP_TESTBED.md): main comparison and ablations.

    erpo sweep experiments/slip_testbed.py --cpu --seeds 0,1,2,3,4 --jobs 2 --only erpo,grpo+policy_kl,no_kl
    erpo sweep experiments/slip_testbed.py --cpu --seeds 0,1,2 --jobs 2

The reference: arith-medium SFT'd for 900 steps on demonstrations that drop
each carry or borrow with probability 0.6 (`data.sft_slip`). The sweep
installs its shipped export (erpo_jax/assets/slip_reference, the same weights
on every machine) into runs/sft-arith-slip; `erpo sweep --train-reference`
trains it there instead (about 6 minutes on 2 cores). It often
can produce the right answer but not reliably (sampled pass@8 far above
pass@1), the setting where RL lifts pass@1 a lot. From it, the three methods
of the main comparison at lr 3e-4 for 100 steps, with greedy and 8-sample
evaluation every 50 steps.

Validation: 100 problems of each training family (`data.n_val`) are held out
of the SFT and RL training sets and apart from the test sets. The
coefficients below were chosen on them by experiments/slip_tuning.py (each
method's best of four at this budget, never looking at the test families).
The other slip_* experiments build on `method_config`. CPU only: the
real-scale runs are main_comparison.py's.

The main comparison runs 5 seeds; the ablations (ABLATIONS, each the 'erpo'
run with one thing changed, as in ablations.py, and the β_q sweep over
slip_tuning.py's other values, here on the test families) 3, sharing the main
runs of seeds 0-2 as their reference points ('erpo'; 'no_kl' is GRPO without
ERPO). slip_temperature.py and slip_horizon.py run the main comparison hot and
long.
"""

from __future__ import annotations

from pathlib import Path
from typing import Callable

from erpo_jax.tools.presets import (BETA_POLICY, BETA_QUERY, LR, METHODS, N_VAL,  # noqa: F401
                                    SFT_SLIP, SLIP_ENTROPY_FLOOR, SLIP_EXPERIMENT, STEPS,
                                    slip_method_config,
                                    slip_sft_config)
from erpo_jax.train.config import RunConfig, apply_overrides, load_experiment

ablations = load_experiment(Path(__file__).with_name("ablations.py"))

EXPERIMENT = SLIP_EXPERIMENT
# The testbed's constants (SFT_SLIP, N_VAL, LR, STEPS and the coefficients chosen on
# the validation split, BETA_POLICY and BETA_QUERY) live with its presets, which
# `erpo demo` runs too.
# The β_q sweep on the test families: slip_tuning.py's other values (which chose
# BETA_QUERY on the validation split), to show how much the choice matters.
BETA_Q_SWEEP = (0.03, 0.1, 0.3)
# Ablation variant -> overrides of the 'erpo' config (ablations.py's, those issue 19 asks for).
ABLATIONS = {k: v for k, v in ablations._variants(True).items() if k in (
    "qkl+uniform", "noqkl+likelihood", "qkl_k2", "ppo+erpo", "ppo+no_kl",
    "reinforce_pp+erpo", "reinforce_pp+no_kl")}
ABLATIONS.update({f"beta_q{b}": [f"loss.beta_query={b}"] for b in BETA_Q_SWEEP})
COMPARISONS = ([("erpo", "grpo+policy_kl"), ("erpo", "no_kl"), ("grpo+policy_kl", "no_kl")]
               + [("qkl+uniform", "no_kl"), ("noqkl+likelihood", "no_kl"),
                  ("qkl+uniform", "noqkl+likelihood"), ("qkl_k2", "erpo")]
               + [(f"{e}+erpo", f"{e}+no_kl") for e in ablations.ESTIMATORS]
               + [(f"beta_q{b}", "erpo") for b in BETA_Q_SWEEP])
ENTROPY_FLOOR = SLIP_ENTROPY_FLOOR   # (presets: the testbed's entropy is low by nature)


sft_config = slip_sft_config
method_config = slip_method_config   # experiment= names the runs' directory


def cpu_experiment(experiment: str, variants: Callable[[], dict[str, RunConfig]], base: str):
    """(get_config, get_cpu_config, sweep) of a slip experiment file: both getters
    give variant `base`; sweep(cpu) gives every variant and refuses the full-scale
    path (the slip experiments are the embedded arithmetic task's)."""
    def get_cpu_config() -> RunConfig:
        return variants()[base]

    def sweep(cpu: bool = False) -> dict[str, RunConfig]:
        if not cpu:
            raise ValueError(f"{experiment}.py is a CPU testbed (the embedded arithmetic task); "
                             "run it with --cpu.")
        return variants()

    return get_cpu_config, get_cpu_config, sweep


def _variants() -> dict[str, RunConfig]:
    out = {m: method_config(m) for m in METHODS}
    for name, overrides in ABLATIONS.items():
        out[name] = apply_overrides(method_config("erpo", name=name), overrides)
    return out


get_config, get_cpu_config, sweep = cpu_experiment(EXPERIMENT, _variants, "erpo")
