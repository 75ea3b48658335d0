"""Qwen2.5-7B with ERPO on a v5p-8: `experiments/real_scale.py`'s recipe, one config.

    erpo plan --config experiments/real_scale_7b_v5p.py --topology v5p-8
    erpo train --config experiments/real_scale_7b_v5p.py train.out_dir=gs://BUCKET/runs/real_scale_7b_v5p/seed0
"""

from __future__ import annotations

from pathlib import Path

from erpo_jax.tools.sweep import load_experiment

real_scale = load_experiment(Path(__file__).with_name("real_scale.py"))


def get_config():
    return real_scale.get_config_7b_v5p()
