"""Loading the starting policy (which is also the reference) and its tokenizer."""

from __future__ import annotations

import dataclasses
import json
import tempfile
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from erpo_jax.model import lora
from erpo_jax.model import model as model_lib
from erpo_jax.model.config import PRESETS
from erpo_jax.model.hf import export_hf, load_hf
from erpo_jax.model.sharding import Sharding
from erpo_jax.train.config import RunConfig
from erpo_jax.runtime import rundir
from erpo_jax.train.tasks import Tokenizer, load_tokenizer

MODEL_SUBDIR = "model"   # <out_dir>/model: the exported policy of `erpo sft` and `erpo train`
ADAPTER_SUBDIR = "adapter"   # <out_dir>/adapter: a LoRA run's adapters, in PEFT's format


def build_sharding(cfg: RunConfig) -> Sharding:
    """Join the multi-host run if the environment says so, then build the mesh
    of `cfg.mesh.shape` with each host owning a contiguous block of the batch."""
    from erpo_jax.runtime import distributed
    distributed.maybe_initialize()
    data, fsdp, tensor = cfg.mesh.shape
    try:
        return Sharding(distributed.mesh_for(data=data, fsdp=fsdp, tensor=tensor))
    except ValueError as e:   # the shape does not fit the devices: the field's fault
        from erpo_jax.train.config import ConfigError
        raise ConfigError(f"config field mesh.shape: {str(e).rstrip('.')}; give the axes sizes "
                          "whose product is the device count, or -1 for the data axis to take "
                          "the rest.") from None


def check_model_dir(path, what: str = "model.path") -> None:
    """Refuse, naming `what`, a run directory given where its exported model
    directory (`<dir>/model`) is meant; other problems are the loader's."""
    p = rundir.path(path)
    if rundir.is_remote(p) or (p / "config.json").is_file():
        return
    if (p / MODEL_SUBDIR / "config.json").is_file():
        field = "config field model.path: " if what == "model.path" else ""
        from erpo_jax.train.config import ConfigError
        raise ConfigError(f"{field}{what} {path} is a run directory, not a model directory; its "
                          f"exported model is {p / MODEL_SUBDIR}: pass that.")


def require_model_dir(path, what: str = "model.path") -> None:
    """Refuse, naming `what` (a ConfigError, rc 2), a local model directory with
    no config.json: before a mesh is built or anything is loaded. A relative
    path is read from the current directory, which the sentence names (an
    experiment file's `runs/...` paths are relative to where it is run)."""
    import os
    check_model_dir(path, what)
    p = rundir.path(path)
    if rundir.is_remote(p) or (p / "config.json").is_file():
        return
    from erpo_jax.train.config import ConfigError
    named = "config field model.path:" if what == "model.path" else what
    where = "" if os.path.isabs(str(path)) else f", read from the current directory {os.getcwd()}"
    state = "has no config.json" if p.is_dir() else "does not exist"
    raise ConfigError(f"{named} {path} {state}{where}: it is not a model directory "
                      "(config.json + *.safetensors, e.g. an `erpo sft` run's <out_dir>/model); "
                      f"give {what} a model directory.")


def load_policy(cfg: RunConfig, sharding: Sharding | None):
    """(ModelConfig, params, Tokenizer) for `cfg.model`, parameters in their sharding."""
    m = cfg.model
    numerics = dict(param_dtype=m.param_dtype, compute_dtype=m.compute_dtype, remat=m.remat,
                    scan_layers=m.scan_layers)
    if m.init in ("sft", "hf"):
        check_model_dir(m.path)
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
    if m.lora_rank:
        # The base as loaded (the same weights full fine-tuning starts from),
        # with fresh adapters beside it: B = 0, so the policy is the base.
        from erpo_jax.train.config import check_lora
        check_lora(cfg, model_cfg)
        model_cfg = dataclasses.replace(model_cfg, lora_rank=m.lora_rank,
                                        lora_alpha=float(m.lora_alpha),
                                        lora_targets=tuple(m.lora_targets))
        adapters = lora.init_adapters(model_cfg, jax.random.fold_in(
            jax.random.key(cfg.train.seed), LORA_STREAM), sharding)
        params = lora.attach(params, adapters)
    return model_cfg, params, tokenizer


LORA_STREAM = 0x10A   # the adapters' initialisation draws fold_in(key(train.seed), this)


def check_vocab(model_cfg, tokenizer: Tokenizer) -> None:
    if tokenizer.vocab_size > model_cfg.vocab_size:
        raise ValueError(f"the tokenizer has {tokenizer.vocab_size} ids but the model's vocabulary "
                         f"has only {model_cfg.vocab_size}; use a matching checkpoint.")


def check_finite(params, what: str) -> None:
    """Raise ValueError naming the first parameter tensor of `what` that holds
    NaN or inf (corrupt bytes load fine and only fail steps later)."""
    leaves = [(jax.tree_util.keystr(k), x) for k, x in
              jax.tree_util.tree_leaves_with_path(params)
              if jnp.issubdtype(x.dtype, jnp.floating)]
    if not leaves:
        return
    bad = jax.jit(lambda xs: jnp.stack([jnp.sum(~jnp.isfinite(x)) for x in xs]))(
        [x for _, x in leaves])
    bad = np.asarray(jax.device_get(bad))
    if bad.any():
        i = int(np.flatnonzero(bad)[0])
        name, x = leaves[i]
        raise ValueError(f"{what}: parameter {name} (shape {tuple(x.shape)}) holds {int(bad[i])} "
                         f"non-finite values ({int((bad > 0).sum())} of {len(leaves)} tensors "
                         "do); the weights are corrupt: restore or re-export them.")


def export_adapter(params, model_cfg, cfg: RunConfig, out_dir):
    """A LoRA policy's adapters in PEFT's format (`lora.export_peft`), for the
    base at model.path; a remote `out_dir` is written locally, then copied."""
    import os
    m = cfg.model
    base = os.path.abspath(m.path) if m.init in ("sft", "hf") else ""
    out = rundir.path(out_dir)
    if not rundir.is_remote(out):
        lora.export_peft(params, model_cfg, out, base)
        return out
    with tempfile.TemporaryDirectory() as tmp:
        lora.export_peft(params, model_cfg, tmp, base)
        out.mkdir(parents=True, exist_ok=True)
        for f in Path(tmp).iterdir():
            rundir.write_atomic(out / f.name, f.read_bytes())
    return out


def export_policy(params, model_cfg, tokenizer: Tokenizer, cfg: RunConfig, out_dir):
    """Write the policy as a Hugging Face directory plus its tokenizer (what
    `model.init='sft'`/'hf' loads); an HF starting model keeps its own config.json.
    A LoRA policy is written merged (W + s A B, `lora.merge`), as its base's
    architecture. A remote `out_dir` is written locally first, then copied."""
    if model_cfg.lora_rank:
        params, model_cfg = lora.merge(params, model_cfg), lora.base_config(model_cfg)
    hf_config = None
    if cfg.model.init == "hf":
        hf_config = json.loads(rundir.path(cfg.model.path, ).joinpath("config.json").read_text())
    out = rundir.path(out_dir)
    if not rundir.is_remote(out):
        export_hf(params, model_cfg, out, hf_config=hf_config)
        tokenizer.save(out)
        return out
    with tempfile.TemporaryDirectory() as tmp:
        local = export_hf(params, model_cfg, tmp, hf_config=hf_config)
        tokenizer.save(local)
        out.mkdir(parents=True, exist_ok=True)
        for f in local.iterdir():
            rundir.write_atomic(out / f.name, f.read_bytes())
    return out
