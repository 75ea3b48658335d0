"""The arithmetic task's run presets: the SFT of a reference model and RL from
it by each method, on the first testbed (`arith_*`) and on the slip testbed
(`slip_*`, issue 19; experiments/SLIP_TESTBED.md).

`erpo demo` and the CPU experiments in `experiments/` build on these, and
nothing in `erpo_jax.tools` is imported here: the demo, the sweep and the
report import this module, never each other's presets.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

from erpo_jax.rl.loss import LossConfig
from erpo_jax.train.config import (AlgoSection, DataSection, ModelSection, OptimSection,
                                   RolloutSection, RunConfig, TrainSection)
from erpo_jax.train.sft import MODEL_SUBDIR

METHODS = ("grpo+policy_kl", "no_kl", "erpo")
# Each demo run's `algo.method` (train/methods.py), which the run header and
# config.json name; the run names above are the report's labels.
ALGO_METHOD = {"grpo+policy_kl": "grpo_policy_kl", "no_kl": "no_kl", "erpo": "erpo"}


def arith_sft_config(out_dir: str = "runs/sft-arith", steps: int = 300) -> RunConfig:
    """SFT of the `arith-small` model on 20k arithmetic problems."""
    return RunConfig(
        name="sft-arith",
        model=ModelSection(init="random", preset="arith-small"),
        data=DataSection(task="arithmetic", n_train=20000, n_test=100, max_prompt_len=24),
        rollout=RolloutSection(max_new_tokens=44),
        optim=OptimSection(lr=3e-3, warmup_steps=20, schedule="cosine", weight_decay=0.01),
        train=TrainSection(steps=steps, batch_size=64, out_dir=out_dir, ckpt_every=100,
                           eval_max_problems=100),
    )


def arith_rl_config(method: str, sft_model: str, out_dir: str, steps: int = 60,
                    seed: int = 0) -> RunConfig:
    """RL on the arithmetic task from the SFT model; `method` picks the regulariser."""
    if method == "grpo+policy_kl":
        loss, scheme = LossConfig(beta_policy=0.04, policy_kl_estimator="k3"), "uniform"
    elif method == "no_kl":
        loss, scheme = LossConfig(), "uniform"
    elif method == "erpo":
        loss, scheme = LossConfig(beta_query=0.1, query_kl_estimator="k3"), "likelihood"
    else:
        raise ValueError(f"unknown demo method {method!r}; choose one of {METHODS}.")
    return RunConfig(
        name=method,
        model=ModelSection(init="sft", path=sft_model),
        data=DataSection(task="arithmetic", n_train=20000, n_test=100, max_prompt_len=24),
        rollout=RolloutSection(group_size=8, temperature=1.0, max_new_tokens=44),
        algo=AlgoSection(method=ALGO_METHOD[method], advantage="grpo", weight_scheme=scheme),
        loss=loss,
        optim=OptimSection(lr=5e-5, max_grad_norm=1.0),
        train=TrainSection(steps=steps, batch_size=16, seed=seed, out_dir=out_dir,
                           eval_every=max(steps // 2, 1), eval_max_problems=100,
                           eval_n=4, eval_k=(1, 4), eval_temperature=1.0,
                           drift_every=2, drift_queries=64, ckpt_every=steps),
    )


# ----------------------------------------------------------------------------- stabilizers

# Clip-higher: DAPO's asymmetric clip (eps_low stays at 0.2).
CLIP_HIGHER = ("loss.eps_high=0.28",)
# DAPO's overlong buffer as a share of the response budget (its 4096 of 20480 tokens).
DAPO_OVERLONG_SHARE = 0.2


def dapo_overrides(max_new_tokens: int) -> tuple[str, ...]:
    """DAPO: clip-higher, dynamic sampling and overlong shaping over the last
    DAPO_OVERLONG_SHARE of `max_new_tokens` (token-mean is the default aggregation)."""
    buffer = max(int(DAPO_OVERLONG_SHARE * max_new_tokens), 1)
    return CLIP_HIGHER + ("algo.filter_groups=true", f"algo.overlong_buffer={buffer}")


# The stability techniques ERPO is compared with (issue 35): technique ->
# (the method it modifies, its fixed overrides, the field its tuning varies,
# that field's default). `dapo` needs the run's max_new_tokens
# (`stabilizer_overrides`).
STABILIZERS = {
    "adaptive_kl": ("grpo+policy_kl", (), "loss.kl_target", 0.01),
    "clip_higher": ("no_kl", (), "loss.eps_high", 0.28),
    "entropy_bonus": ("no_kl", (), "loss.entropy_coef", 1e-3),
    "clip_cov": ("no_kl", ("loss.pg_loss=clip_cov",), "loss.clip_cov_ratio", 2e-4),
    "kl_cov": ("no_kl", ("loss.pg_loss=kl_cov",), "loss.kl_cov_ratio", 2e-3),
    "dapo": ("no_kl", ("dapo",), None, None),
    "erpo+dapo": ("erpo", ("dapo",), None, None),
}


def stabilizer_overrides(name: str, max_new_tokens: int, value=None) -> tuple[str, tuple]:
    """(base method, overrides) of technique `name`, its tuned field at `value`
    (default the technique's default)."""
    base, fixed, field, default = STABILIZERS[name]
    out = []
    for o in fixed:
        out += dapo_overrides(max_new_tokens) if o == "dapo" else [o]
    if field is not None:
        out.append(f"{field}={default if value is None else value}")
    return base, tuple(out)


# ----------------------------------------------------------------------------- the slip testbed

SFT_SLIP = 0.6       # the reference's demonstrations drop each carry or borrow this often
N_VAL = 100          # validation problems per training family
LR, STEPS = 3e-4, 100
# Chosen on the validation split by experiments/slip_tuning.py (its REPORT.md and
# tests/test_results_tables.py, which checks these against its committed summaries).
BETA_POLICY = 0.04   # GRPO + Policy-KL
BETA_QUERY = 1.0     # ERPO
SLIP_EXPERIMENT = "slip_testbed"
# Response entropy sits at 0.005-0.06 here (a confident model uncertain only at
# carries), so the entropy floor is off; a collapse is the accuracy drop.
SLIP_ENTROPY_FLOOR = 0.0


def slip_sft_config(out_dir: str = "runs/sft-arith-slip") -> RunConfig:
    """The slip testbed's reference: arith-medium SFT'd for 900 steps on
    demonstrations that slip (data.sft_slip), validation rows held out."""
    base = arith_sft_config(out_dir, steps=900)
    return dataclasses.replace(
        base, name="sft-arith-slip",
        model=dataclasses.replace(base.model, preset="arith-medium"),
        data=dataclasses.replace(base.data, sft_slip=SFT_SLIP, n_val=N_VAL),
        train=dataclasses.replace(base.train, eval_n=8, eval_k=(1, 8), eval_temperature=1.0))


def slip_method_config(method: str, *, beta: float | None = None, lr: float = LR,
                       temperature: float = 1.0, steps: int = STEPS, eval_split: str = "test",
                       eval_every: int = 50, sampled_eval: bool = True, name: str | None = None,
                       experiment: str = SLIP_EXPERIMENT,
                       sft_model: str | None = None) -> RunConfig:
    """`method` from the slipped reference. `beta`: its coefficient (β_policy for
    GRPO + Policy-KL, β_q for ERPO; default the tuned one); eval_split 'validation'
    evaluates on the validation problems (coefficient and regime searches);
    sampled_eval: pass@1 and pass@8 from 8 samples besides greedy; sft_model:
    the reference's directory (default slip_sft_config()'s export)."""
    sft_model = sft_model or str(Path(slip_sft_config().train.out_dir) / MODEL_SUBDIR)
    cfg = arith_rl_config(method, sft_model, out_dir="", steps=steps)
    loss = cfg.loss
    if method == "grpo+policy_kl":
        loss = dataclasses.replace(loss, beta_policy=BETA_POLICY if beta is None else beta)
    elif method == "erpo":
        loss = dataclasses.replace(loss, beta_query=BETA_QUERY if beta is None else beta)
    elif beta is not None:
        raise ValueError(f"{method} has no coefficient to set (beta={beta}).")
    name = name or method
    return dataclasses.replace(
        cfg, name=name, loss=loss,
        data=dataclasses.replace(cfg.data, n_val=N_VAL),
        optim=dataclasses.replace(cfg.optim, lr=lr),
        rollout=dataclasses.replace(cfg.rollout, temperature=temperature),
        train=dataclasses.replace(cfg.train, eval_n=8 if sampled_eval else 1,
                                  eval_k=(1, 8) if sampled_eval else (1,), drift_every=10,
                                  eval_every=eval_every, eval_split=eval_split,
                                  ckpt_every=min(steps, 100),
                                  out_dir=f"runs/{experiment}/{name}/seed{cfg.train.seed}"))
