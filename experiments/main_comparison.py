"""Main comparison: ERPO vs GRPO + Policy-KL vs no KL, same budget (claims 1, 2 and 4).

CPU (the embedded arithmetic task, from the shared SFT model runs/sft-arith,
which the sweep trains first if it is absent):

    erpo sweep experiments/main_comparison.py --cpu --seeds 0,1,2

Real scale (Qwen2.5-Math-1.5B on a TPU v4-8, see experiments/real_scale.py):

    erpo sweep experiments/main_comparison.py --seeds 0,1,2

Variants: 'grpo+policy_kl', 'no_kl', 'erpo' (their regularisers are
`erpo_jax.tools.presets.arith_rl_config`'s; the CPU budget is its default step count).
Runs go to runs/main_comparison/<variant>/seed<k>, the report to
runs/main_comparison/report/.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

from erpo_jax.tools.presets import METHODS, arith_rl_config, arith_sft_config
from erpo_jax.tools.sweep import load_experiment
from erpo_jax.train.config import RunConfig
from erpo_jax.train.sft import MODEL_SUBDIR

real_scale = load_experiment(Path(__file__).with_name("real_scale.py"))

EXPERIMENT = "main_comparison"
SFT_MODEL = str(Path(arith_sft_config().train.out_dir) / MODEL_SUBDIR)
COMPARISONS = [("erpo", "grpo+policy_kl"), ("erpo", "no_kl"), ("grpo+policy_kl", "no_kl")]


def placed(cfg: RunConfig, experiment: str) -> RunConfig:
    """cfg with out_dir runs/<experiment>/<name>/seed<seed> (what the sweep also uses)."""
    return dataclasses.replace(cfg, train=dataclasses.replace(
        cfg.train, out_dir=f"runs/{experiment}/{cfg.name}/seed{cfg.train.seed}"))


def method_config(method: str, cpu: bool, steps_factor: int = 1) -> RunConfig:
    """`method` at the main budget times `steps_factor`; evaluation every third of
    the main budget whatever the factor, so longer runs are evaluated as often."""
    if cpu:
        base = arith_rl_config(method, SFT_MODEL, out_dir="")
    else:
        base = real_scale.method_config(method, "1.5b")
        base = dataclasses.replace(base, name=method)
    if steps_factor != 1:
        t = base.train
        base = dataclasses.replace(base, train=dataclasses.replace(
            t, steps=t.steps * steps_factor, ckpt_every=min(t.ckpt_every, t.steps)))
    return placed(base, EXPERIMENT)


def get_config() -> RunConfig:
    return method_config("erpo", cpu=False)


def get_cpu_config() -> RunConfig:
    return method_config("erpo", cpu=True)


def sweep(cpu: bool = False) -> dict[str, RunConfig]:
    return {m: method_config(m, cpu) for m in METHODS}
