"""SFT of the arithmetic task's model: the warm start and reference of every CPU experiment.

    erpo sft --config experiments/sft_arith.py [train.steps=120 ...]

Writes runs/sft-arith/model (an HF-format directory with the char tokenizer),
the `model.path` the CPU variants of main_comparison, ablations,
high_temperature and long_horizon start from (`erpo sweep` trains it first if
it is absent). The same config as the demo's SFT stage
(`erpo_jax.tools.presets.arith_sft_config`).
"""

from __future__ import annotations

from erpo_jax.tools.presets import arith_sft_config
from erpo_jax.train.config import RunConfig


def get_config() -> RunConfig:
    return arith_sft_config()
