"""The slipped-demonstration testbed (issue 19, in progress; see SLIP_TESTBED.md).

    erpo sweep experiments/slip_testbed.py --cpu --seeds 0,1,2 --jobs 2

The reference: arith-medium SFT'd for 900 steps on demonstrations that drop
each carry or borrow with probability 0.6 (`data.sft_slip`), which the sweep
trains first into runs/sft-arith-slip (about 5.5 minutes on 2 cores). From
it, the three methods of the main comparison at lr 3e-4 for 100 steps, with
greedy and 8-sample evaluation every 50 steps. The coefficients are still the
main comparison's (β = 0.04, β_q = 0.1): not yet chosen on a validation split,
as issue 19 requires before its verdicts. CPU only: the real-scale runs are
main_comparison.py's.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

from erpo_jax.tools.demo import METHODS, arith_rl_config, arith_sft_config
from erpo_jax.train.config import RunConfig
from erpo_jax.train.sft import MODEL_SUBDIR

EXPERIMENT = "slip_testbed"
SFT_SLIP = 0.6
COMPARISONS = [("erpo", "grpo+policy_kl"), ("erpo", "no_kl"), ("grpo+policy_kl", "no_kl")]
# Response entropy sits at 0.005-0.06 here (a confident model uncertain only at
# carries), so the entropy floor is off; a collapse is the accuracy drop.
ENTROPY_FLOOR = 0.0


def sft_config() -> RunConfig:
    base = arith_sft_config("runs/sft-arith-slip", steps=900)
    return dataclasses.replace(
        base, name="sft-arith-slip",
        model=dataclasses.replace(base.model, preset="arith-medium"),
        data=dataclasses.replace(base.data, sft_slip=SFT_SLIP),
        train=dataclasses.replace(base.train, eval_n=8, eval_k=(1, 8), eval_temperature=1.0))


def method_config(method: str) -> RunConfig:
    cfg = arith_rl_config(method, str(Path(sft_config().train.out_dir) / MODEL_SUBDIR),
                          out_dir="", steps=100)
    return dataclasses.replace(
        cfg, optim=dataclasses.replace(cfg.optim, lr=3e-4),
        train=dataclasses.replace(cfg.train, eval_n=8, eval_k=(1, 8), drift_every=10,
                                  out_dir=f"runs/{EXPERIMENT}/{method}/seed{cfg.train.seed}"))


def get_config() -> RunConfig:
    return get_cpu_config()


def get_cpu_config() -> RunConfig:
    return method_config("erpo")


def sweep(cpu: bool = False) -> dict[str, RunConfig]:
    if not cpu:
        raise ValueError("slip_testbed.py is a CPU testbed (the embedded arithmetic task); "
                         "run it with --cpu.")
    return {m: method_config(m) for m in METHODS}
