"""Loading the starting policy (which is also the reference) and its tokenizer."""

from __future__ import annotations

import dataclasses

import jax

from erpo_jax.model import model as model_lib
from erpo_jax.model.config import PRESETS
from erpo_jax.model.hf import load_hf
from erpo_jax.model.sharding import Sharding
from erpo_jax.train.config import RunConfig
from erpo_jax.train.tasks import Tokenizer, load_tokenizer


def build_sharding(cfg: RunConfig) -> Sharding:
    """Join the multi-host run if the environment says so, then build the mesh
    of `cfg.mesh.shape` with each host owning a contiguous block of the batch."""
    from erpo_jax import distributed
    distributed.maybe_initialize()
    data, fsdp, tensor = cfg.mesh.shape
    return Sharding(distributed.mesh_for(data=data, fsdp=fsdp, tensor=tensor))


def load_policy(cfg: RunConfig, sharding: Sharding | None):
    """(ModelConfig, params, Tokenizer) for `cfg.model`, parameters in their sharding."""
    m = cfg.model
    numerics = dict(param_dtype=m.param_dtype, compute_dtype=m.compute_dtype, remat=m.remat,
                    scan_layers=m.scan_layers)
    if m.init in ("sft", "hf"):
        model_cfg, params = load_hf(m.path, sharding=sharding, **numerics)
        tokenizer = load_tokenizer(m.path)
    else:
        if m.preset not in PRESETS:
            raise ValueError(f"config field model.preset: {m.preset!r} is not one of "
                             f"{sorted(PRESETS)}.")
        model_cfg = dataclasses.replace(PRESETS[m.preset], **numerics)
        params = model_lib.init_params(model_cfg, jax.random.key(cfg.train.seed), sharding)
        tokenizer = load_tokenizer(None)
    check_vocab(model_cfg, tokenizer)
    return model_cfg, params, tokenizer


def check_vocab(model_cfg, tokenizer: Tokenizer) -> None:
    if tokenizer.vocab_size > model_cfg.vocab_size:
        raise ValueError(f"the tokenizer has {tokenizer.vocab_size} ids but the model's vocabulary "
                         f"has only {model_cfg.vocab_size}; use a matching checkpoint.")
