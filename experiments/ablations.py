"""Ablations of ERPO: beta_query, weight scheme x Query-KL on/off, k2 vs k3, the estimator.

CPU:

    erpo sweep experiments/ablations.py --cpu --seeds 0,1,2

Real scale (Qwen2.5-Math-1.5B on a TPU v4-8):

    erpo sweep experiments/ablations.py --seeds 0,1,2

Every variant is the main comparison's 'erpo' (GRPO advantages, Query-KL k3
at the demo's beta_query, likelihood weights) with one thing changed, at the
main budget:

| variant | change |
|---|---|
| erpo | none (the reference point of every comparison) |
| beta_q<b> | loss.beta_query = b for b in BETA_QUERY (the reference value is `erpo`) |
| qkl+uniform, qkl+typicality | weight scheme, Query-KL on (qkl+likelihood is `erpo`); method custom |
| noqkl+<scheme> | weight scheme, Query-KL off (noqkl+uniform is method no_kl, the others custom) |
| qkl_k2 | Query-KL estimator k2 instead of k3 |
| ppo+erpo, ppo+no_kl | algo.advantage = gae (learned critic) as method erpo and no_kl |
| reinforce_pp+erpo, reinforce_pp+no_kl | algo.advantage = reinforce_pp, with and without |

(GRPO with and without ERPO are `erpo` and `noqkl+uniform`.) Runs go to
runs/ablations/<variant>/seed<k>.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

from erpo_jax.tools.sweep import load_experiment
from erpo_jax.train.config import RunConfig, apply_overrides

main = load_experiment(Path(__file__).with_name("main_comparison.py"))

BETA_QUERY = (0.02, 0.5)
SCHEMES = ("uniform", "likelihood", "typicality")
ESTIMATORS = {"ppo": "gae", "reinforce_pp": "reinforce_pp"}
COMPARISONS = ([(f"beta_q{b}", "erpo") for b in BETA_QUERY]
               + [("qkl+uniform", "noqkl+uniform"), ("qkl+typicality", "noqkl+typicality"),
                  ("erpo", "noqkl+likelihood"), ("qkl+uniform", "erpo"),
                  ("qkl+typicality", "erpo"), ("qkl_k2", "erpo"), ("erpo", "noqkl+uniform")]
               + [(f"{e}+erpo", f"{e}+no_kl") for e in ESTIMATORS])


def _variants(cpu: bool) -> dict[str, list[str]]:
    """variant name -> overrides of the 'erpo' config."""
    out = {"erpo": []}
    out.update({f"beta_q{b}": [f"loss.beta_query={b}"] for b in BETA_QUERY})
    # Query-KL without likelihood weights, or weights without Query-KL, is not
    # ERPO: those variants are algo.method=custom (no Query-KL, uniform: no_kl).
    for s in SCHEMES:
        if s != "likelihood":
            out[f"qkl+{s}"] = ["algo.method=custom", f"algo.weight_scheme={s}"]
        off = "no_kl" if s == "uniform" else "custom"
        out[f"noqkl+{s}"] = [f"algo.method={off}", f"algo.weight_scheme={s}", "loss.beta_query=0"]
    out["qkl_k2"] = ["loss.query_kl_estimator=k2"]
    for e, adv in ESTIMATORS.items():
        out[f"{e}+erpo"] = [f"algo.advantage={adv}"]
        out[f"{e}+no_kl"] = [f"algo.advantage={adv}", "algo.method=no_kl", "loss.beta_query=0",
                             "algo.weight_scheme=uniform"]
    return out


def variant(name: str, cpu: bool) -> RunConfig:
    cfg = apply_overrides(main.method_config("erpo", cpu), _variants(cpu)[name])
    return main.placed(dataclasses.replace(cfg, name=name), "ablations")


def get_config() -> RunConfig:
    return variant("erpo", cpu=False)


def get_cpu_config() -> RunConfig:
    return variant("erpo", cpu=True)


def sweep(cpu: bool = False) -> dict[str, RunConfig]:
    return {name: variant(name, cpu) for name in _variants(cpu)}
