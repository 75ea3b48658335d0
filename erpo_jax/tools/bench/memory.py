"""`erpo bench` section memory: the hand formula of per-device bytes for the
real-scale configs (a cross-check of `erpo plan`, which has the compiler's)."""

from __future__ import annotations

import dataclasses

import jax
import numpy as np

from erpo_jax.model.config import PRESETS, ModelConfig

# ----------------------------------------------------------------------------- memory

# Real-scale settings: (preset, hardware, devices, HBM GiB/device, mesh (data, fsdp,
# tensor), rollout rows, prompt + new tokens, rows per device per micro-batch).
REAL_SCALE = [
    ("qwen2.5-math-1.5b", "TPU v4-8", 4, 32.0, (1, 4, 1), 512, (512, 1024), 4),
    ("qwen2.5-7b", "TPU v5e-16", 16, 16.0, (1, 16, 1), 512, (512, 1024), 1),
]
_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}


def _per_device_param_bytes(cfg: ModelConfig, mesh: dict, dtype_bytes: int) -> float:
    from erpo_jax.model import model as model_lib
    from erpo_jax.model.sharding import RULES, axis_size, logical_to_spec
    logical = model_lib.param_logical_axes(cfg)
    shapes = model_lib.abstract_params(cfg)
    total = 0.0
    is_leaf = lambda x: isinstance(x, tuple) and all(isinstance(a, (str, type(None))) for a in x)
    for ax, leaf in zip(jax.tree_util.tree_leaves(logical, is_leaf=is_leaf),
                        jax.tree_util.tree_leaves(shapes)):
        split = 1
        for m in logical_to_spec(ax, RULES):
            split *= axis_size(_FakeMesh(mesh), m)
        total += np.prod(leaf.shape) * dtype_bytes / split
    return total


class _FakeMesh:
    """Just the `.shape` mapping that sharding.axis_size reads (no devices needed)."""

    def __init__(self, shape: dict):
        self.shape = shape


def memory_estimate(preset: str, hardware: str, devices: int, hbm_gib: float, mesh_shape,
                    rollout_rows: int, lengths, micro_rows: int, param_dtype="float32",
                    compute_dtype="bfloat16", chunk: int = 512) -> dict:
    """Per-device GiB of each state, from shapes (see BENCHMARKS.md for the formulas)."""
    cfg = dataclasses.replace(PRESETS[preset], param_dtype=param_dtype,
                              compute_dtype=compute_dtype)
    mesh = dict(zip(("data", "fsdp", "tensor"), mesh_shape))
    dp, tp = mesh["data"] * mesh["fsdp"], mesh["tensor"]
    pb, cb = _BYTES[param_dtype], _BYTES[compute_dtype]
    G = 2 ** 30
    params = _per_device_param_bytes(cfg, mesh, pb)
    opt = 2 * _per_device_param_bytes(cfg, mesh, 4)
    P, Nn = lengths
    T = P + Nn
    L, D, F, H, N, K, V = (cfg.num_layers, cfg.hidden_size, cfg.intermediate_size,
                           cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.vocab_size)
    kv = 2 * L * (rollout_rows / dp) * (T - 1) * (N / min(tp, N)) * K * cb
    m = micro_rows
    per_layer = (m * T * cb * (4 * D + (3 * H * K + 3 * N * K) / tp + 4 * F / tp)
                 + m * (H / tp) * T * T * (4 + cb))
    head = 3 * m * min(chunk, T) * (V / tp) * 4
    act_remat = L * m * T * D * cb + per_layer + head
    act_full = L * per_layer + head
    train_remat = params + params + opt + act_remat   # params + grads + moments + activations
    train_full = params + params + opt + act_full
    rollout = params + kv
    row = {"preset": preset, "hardware": hardware, "devices": devices, "hbm_gib": hbm_gib,
           "mesh": mesh, "param_dtype": param_dtype, "compute_dtype": compute_dtype,
           "params_b": cfg.num_params() / 1e9, "rollout_rows": rollout_rows,
           "prompt_plus_new": list(lengths), "micro_rows_per_device": m,
           "gib": {"params": params / G, "grads": params / G, "adam_moments": opt / G,
                   "kv_cache": kv / G, "activations_remat": act_remat / G,
                   "activations_no_remat": act_full / G, "train_peak_remat": train_remat / G,
                   "train_peak_no_remat": train_full / G, "rollout_peak": rollout / G,
                   "reference_params_if_policy_kl": params / G}}
    row["fits_remat"] = bool(max(train_remat, rollout) / G <= hbm_gib)
    row["fits_no_remat"] = bool(max(train_full, rollout) / G <= hbm_gib)
    return row
