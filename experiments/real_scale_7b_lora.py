"""Qwen2.5-7B with ERPO and LoRA on the slices researchers are given: a v4-8
(4 chips x 32 GiB) and a v5litepod-8 (8 chips x 16 GiB).

`experiments/real_scale.py`'s recipe with the base frozen in bfloat16 and
rank-32 adapters on every attention and MLP projection (float32, their
AdamW state float32). Full fine-tuning of 7B needs about 16 bytes a
parameter before activations (float32 weights, gradients and two moments:
about 120 GB), more than either slice holds; here the trained state is the
adapters' (about 81M parameters) and the base is 15 GB of bfloat16 weights
split over the chips.

    erpo plan --config experiments/real_scale_7b_lora.py --topology v4-8
    erpo plan --config experiments/real_scale_7b_lora.py --topology v5e-8 mesh.shape=[1,8,1]
    erpo train --config experiments/real_scale_7b_lora.py train.out_dir=gs://BUCKET/runs/7b-lora/seed0

Full fine-tuning of the same run, planned beside it (it does not fit):

    erpo plan --config experiments/real_scale_7b_lora.py --topology v4-8 --only update \
        model.lora_rank=0 model.param_dtype=float32 optim.lr=1e-6

Choices (ours, where the sources leave them):
- rank 32, alpha 32 (scale 1), every linear layer: "LoRA Without Regret"
  (Thinking Machines, 2025) reports RL with LoRA matching full fine-tuning
  down to rank 1, with all layers adapted; 32 leaves room for the longer
  horizon of a 7B run at little memory.
- learning rate 1e-5: ten times the full fine-tuning rate of real_scale.py
  (1e-6), the published rule of thumb for LoRA's optimal rate.
- 64 micro-batches (16 rows each): a 7B layer's remat activations for 4096
  tokens fit a 16 GiB v5e chip at 2 rows per chip.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

from erpo_jax.tools.sweep import load_experiment
from erpo_jax.train.config import MeshSection

real_scale = load_experiment(Path(__file__).with_name("real_scale.py"))

LORA_RANK, LORA_ALPHA, LORA_LR = 32, 32.0, 1e-5


def lora_config(method: str = "erpo", chips: int = 4):
    """The 7B run of `method` with LoRA, laid out for `chips` chips (FSDP)."""
    cfg = real_scale.method_config(method, "7b")
    return dataclasses.replace(
        cfg, name=f"7b-lora-{method}",
        model=dataclasses.replace(cfg.model, param_dtype="bfloat16", lora_rank=LORA_RANK,
                                  lora_alpha=LORA_ALPHA),
        optim=dataclasses.replace(cfg.optim, lr=LORA_LR, micro_batches=64),
        train=dataclasses.replace(cfg.train, out_dir=f"runs/real_scale/7b-lora-{method}/seed0"),
        mesh=MeshSection(shape=(1, chips, 1)))


def get_config():
    return lora_config("erpo", 4)
