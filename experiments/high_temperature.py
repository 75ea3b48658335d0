"""High-temperature decoding: rollout temperature 1.0, 1.2 and 1.5 for each method (claim 3).

CPU:

    erpo sweep experiments/high_temperature.py --cpu --seeds 0,1,2

Real scale (Qwen2.5-Math-1.5B on a TPU v4-8):

    erpo sweep experiments/high_temperature.py --seeds 0,1,2

Variants '<method>-T<temperature>' for the three methods of the main
comparison at its budget; only `rollout.temperature` changes (the PG ratio and
Policy-KL use the sampling temperature; Query-KL and the weights stay at
temperature 1; evaluation stays greedy). Runs go to
runs/high_temperature/<variant>/seed<k>.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

from erpo_jax.tools.presets import METHODS
from erpo_jax.tools.sweep import load_experiment
from erpo_jax.train.config import RunConfig

main = load_experiment(Path(__file__).with_name("main_comparison.py"))

TEMPERATURES = (1.0, 1.2, 1.5)
COMPARISONS = [(f"erpo-T{t}", f"{b}-T{t}") for t in TEMPERATURES
               for b in ("grpo+policy_kl", "no_kl")]


def variant(method: str, temperature: float, cpu: bool) -> RunConfig:
    base = main.method_config(method, cpu)
    cfg = dataclasses.replace(base, name=f"{method}-T{temperature}",
                              rollout=dataclasses.replace(base.rollout, temperature=temperature))
    return main.placed(cfg, "high_temperature")


def get_config() -> RunConfig:
    return variant("erpo", TEMPERATURES[-1], cpu=False)


def get_cpu_config() -> RunConfig:
    return variant("erpo", TEMPERATURES[-1], cpu=True)


def sweep(cpu: bool = False) -> dict[str, RunConfig]:
    out = {}
    for t in TEMPERATURES:
        for m in METHODS:
            cfg = variant(m, t, cpu)
            out[cfg.name] = cfg
    return out
