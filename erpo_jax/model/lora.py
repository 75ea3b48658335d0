"""Low-rank adapters (LoRA) on a frozen base.

A targeted projection W [*in, *out] gains two float32 parameters beside it in
the same module, A [*in, r] (`<name>_lora_a`) and B [r, *out] (`<name>_lora_b`),
and computes

    y = x . W + (x . A) . (s B),   s = lora_alpha / lora_rank

(`ModelConfig.lora_rank` > 0 turns it on, `lora_targets` names the
projections). B starts at zero, so the adapted model is the base bit for bit
until the first update. The adapters live in the same parameter pytree as the
base (the layer scan stacks them on [L] and the sharding rules place them as
their base layer: A takes W's input axes, B its output axes, the rank axis is
never split), so every path of the model (the layer scan, the cached decode,
the paged decode, the grouped query pass) applies them with no second code
path. What is trained is `adapters(params)`; what the reference runs is
`base(params)` under `base_config(cfg)`: the same buffers with the adapters
left out, never a copy.

Why not qwix (what google-tunix uses): it intercepts flax modules' matmuls,
but this model applies its weights through `dense` (a custom gradient on the
CPU), einsums on head-major layouts and per-layer `Block.apply` calls on
unstacked trees in the decode loops; an interception layer would have to
follow all of them, and the adapters would not be plain leaves of the one
parameter pytree that the optimizer, the checkpoint, the sharding rules and
the export read.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from erpo_jax.model.config import LORA_TARGETS, ModelConfig

A_SUFFIX, B_SUFFIX = "_lora_a", "_lora_b"


def is_adapter(name: str) -> bool:
    return name.endswith(A_SUFFIX) or name.endswith(B_SUFFIX)


def _filter(tree, keep) -> Any:
    """The nested dict with the leaves whose key `keep` accepts (empty dicts dropped)."""
    if not isinstance(tree, dict):
        return tree
    out = {}
    for k, v in tree.items():
        if isinstance(v, dict):
            sub = _filter(v, keep)
            if sub:
                out[k] = sub
        elif isinstance(v, tuple):   # unstack_layers' per-layer trees
            out[k] = tuple(_filter(x, keep) for x in v)
        elif keep(k):
            out[k] = v
    return out


def adapters(params) -> dict:
    """The adapter leaves of a parameter tree, in its nesting (empty without LoRA)."""
    return _filter(params, is_adapter)


def base(params) -> dict:
    """The parameter tree without its adapters: the base model's (the same arrays)."""
    return _filter(params, lambda k: not is_adapter(k))


def attach(base_params, adapter_params) -> dict:
    """The base tree with the adapter leaves put back in their modules."""
    if not adapter_params:
        return base_params
    out = dict(base_params)
    for k, v in adapter_params.items():
        out[k] = attach(out[k], v) if isinstance(v, dict) else v
    return out


def base_config(cfg: ModelConfig) -> ModelConfig:
    """The model config of the base alone (the reference, the export)."""
    if not cfg.lora_rank:
        return cfg
    return dataclasses.replace(cfg, lora_rank=0, lora_targets=())


def scale(cfg: ModelConfig) -> float:
    return cfg.lora_alpha / cfg.lora_rank


def n_in(name: str) -> int:
    """How many leading axes of projection `name`'s kernel are its inputs."""
    return 2 if name == "o_proj" else 1


def a_init(key, shape, dtype=jnp.float32):
    """A's initialiser: U(-1/sqrt(fan_in), 1/sqrt(fan_in)) over its input
    axes (what PyTorch's default Linear init gives, and PEFT uses for A)."""
    fan_in = math.prod(shape[:-1])
    bound = 1.0 / math.sqrt(fan_in)
    return jax.random.uniform(key, shape, dtype, -bound, bound)


def _delta(a, b, name: str, s: float):
    """s * A . B as a kernel shaped like the base's [*in, *out], float32."""
    k = n_in(name)
    return s * jnp.tensordot(a.astype(jnp.float32), b.astype(jnp.float32), ((k,), (0,)))


def merge(params, cfg: ModelConfig) -> dict:
    """The base tree with each targeted kernel replaced by W + s A B (in W's
    dtype): the adapted model as plain weights, for `base_config(cfg)`.
    Stacked [L, ...] layers are merged layer by layer (a vmap)."""
    if not cfg.lora_rank:
        return params
    s = scale(cfg)
    out = base(params)
    layers = dict(out["layers"])
    for module, names in (("attn", ("q_proj", "k_proj", "v_proj", "o_proj")),
                          ("mlp", ("gate_proj", "up_proj", "down_proj"))):
        mod = dict(layers[module])
        src = params["layers"][module]
        for name in names:
            if name + A_SUFFIX not in src:
                continue
            w = mod[name]
            d = jax.vmap(lambda a, b, name=name: _delta(a, b, name, s))(
                src[name + A_SUFFIX], src[name + B_SUFFIX])
            mod[name] = (w.astype(jnp.float32) + d).astype(w.dtype)
        layers[module] = mod
    out["layers"] = layers
    return out


def init_adapters(cfg: ModelConfig, rng, sharding=None) -> dict:
    """Fresh adapters for `cfg` (A drawn, B zero), in their shardings; the base
    is not built."""
    from erpo_jax.model import model as model_lib
    from erpo_jax.runtime import xla_options
    if not cfg.lora_rank:
        return {}
    shapes = adapters(model_lib.abstract_params(cfg))
    leaves, treedef = jax.tree_util.tree_flatten_with_path(shapes)

    def init(rng):
        keys = jax.random.split(rng, len(leaves))
        out = []
        for k, (path, sd) in zip(keys, leaves):
            name = path[-1].key
            out.append(a_init(k, sd.shape) if name.endswith(A_SUFFIX)
                       else jnp.zeros(sd.shape, jnp.float32))
        return jax.tree_util.tree_unflatten(treedef, out)

    shardings = None
    if sharding is not None:
        shardings = adapters(model_lib.param_shardings(cfg, sharding))
    return jax.jit(init, out_shardings=shardings, compiler_options=xla_options.for_once())(rng)


def count(cfg: ModelConfig) -> int:
    """Adapter parameters of `cfg` (0 without LoRA)."""
    if not cfg.lora_rank:
        return 0
    D, F, r = cfg.hidden_size, cfg.intermediate_size, cfg.lora_rank
    q, kv = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    dims = {"q_proj": (D, q), "k_proj": (D, kv), "v_proj": (D, kv), "o_proj": (q, D),
            "gate_proj": (D, F), "up_proj": (D, F), "down_proj": (F, D)}
    return cfg.num_layers * sum(r * sum(dims[t]) for t in cfg.lora_target_names)


# ----------------------------------------------------------------------------- PEFT

_PEFT_MODULE = {"q_proj": "self_attn", "k_proj": "self_attn", "v_proj": "self_attn",
                "o_proj": "self_attn", "gate_proj": "mlp", "up_proj": "mlp",
                "down_proj": "mlp"}


def peft_tensors(params, cfg: ModelConfig) -> dict[str, np.ndarray]:
    """The adapters as PEFT names them: lora_A [r, in] and lora_B [out, r]
    (Linear layouts) of `base_model.model.model.layers.<i>.<module>.<name>`.
    PEFT applies lora_alpha / r itself, so B is written unscaled."""
    layers = jax.device_get(adapters(params))["layers"]
    out = {}
    for module, names in (("attn", ("q_proj", "k_proj", "v_proj", "o_proj")),
                          ("mlp", ("gate_proj", "up_proj", "down_proj"))):
        for name in names:
            if name + A_SUFFIX not in layers.get(module, {}):
                continue
            a = np.asarray(layers[module][name + A_SUFFIX], np.float32)   # [L, *in, r]
            b = np.asarray(layers[module][name + B_SUFFIX], np.float32)   # [L, r, *out]
            for i in range(a.shape[0]):
                prefix = f"base_model.model.model.layers.{i}.{_PEFT_MODULE[name]}.{name}"
                ai = a[i].reshape(-1, a.shape[-1]).T
                bi = b[i].reshape(b.shape[1], -1).T
                out[f"{prefix}.lora_A.weight"] = np.ascontiguousarray(ai)
                out[f"{prefix}.lora_B.weight"] = np.ascontiguousarray(bi)
    return out


def peft_config(cfg: ModelConfig, base_model: str = "") -> dict:
    """adapter_config.json for PEFT's LoraConfig."""
    return {
        "peft_type": "LORA", "task_type": "CAUSAL_LM", "base_model_name_or_path": base_model,
        "r": cfg.lora_rank, "lora_alpha": cfg.lora_alpha, "lora_dropout": 0.0,
        "target_modules": sorted(cfg.lora_target_names), "bias": "none",
        "fan_in_fan_out": False, "use_rslora": False, "init_lora_weights": True,
        "inference_mode": True, "modules_to_save": None,
    }


def export_peft(params, cfg: ModelConfig, out_dir, base_model: str = "") -> None:
    """Write `adapter_config.json` and `adapter_model.safetensors` to out_dir."""
    import json
    from pathlib import Path
    from erpo_jax.model.safetensors_io import save_file
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    save_file(peft_tensors(params, cfg), out / "adapter_model.safetensors")
    (out / "adapter_config.json").write_text(
        json.dumps(peft_config(cfg, base_model), indent=2, sort_keys=True))


def load_peft(path, cfg: ModelConfig, sharding=None) -> dict:
    """Adapters from a PEFT directory (`export_peft`'s, or PEFT's own for
    this architecture) as the adapter tree of `cfg`, in their shardings.
    ValueError naming the file when its rank, alpha or targets are not
    cfg's, or a tensor is missing or of another shape."""
    import json
    from pathlib import Path
    from erpo_jax.model import model as model_lib
    from erpo_jax.model.safetensors_io import SafetensorsFile
    path = Path(path)
    conf = json.loads((path / "adapter_config.json").read_text())
    theirs = (int(conf.get("r", 0)), float(conf.get("lora_alpha", 0)),
              sorted(conf.get("target_modules") or []))
    ours = (cfg.lora_rank, float(cfg.lora_alpha), sorted(cfg.lora_target_names))
    if theirs != ours or conf.get("use_rslora"):
        raise ValueError(
            f"{path / 'adapter_config.json'}: r={theirs[0]}, lora_alpha={theirs[1]:g}, "
            f"target_modules={theirs[2]}{', use_rslora' if conf.get('use_rslora') else ''}; "
            f"the config asks for model.lora_rank={ours[0]}, lora_alpha={ours[1]:g}, "
            f"lora_targets={ours[2]}: set those to the adapter's.")
    f = SafetensorsFile(path / "adapter_model.safetensors")
    shapes = adapters(model_lib.abstract_params(cfg))
    names = set(f.keys())
    out: dict = {}
    for module, sub in shapes["layers"].items():
        for leaf, sd in sub.items():
            name, kind = leaf.rsplit("_lora_", 1)
            per = []
            for i in range(cfg.num_layers):
                key = (f"base_model.model.model.layers.{i}.{_PEFT_MODULE[name]}.{name}."
                       f"lora_{kind.upper()}.weight")
                if key not in names:
                    raise ValueError(f"{path / 'adapter_model.safetensors'} has no tensor "
                                     f"{key}; it is not an adapter of this model.")
                t = np.asarray(f[key], np.float32)
                want = sd.shape[1:]
                # lora_A [r, in] -> [*in, r]; lora_B [out, r] -> [r, *out].
                t = t.T.reshape(want) if t.ndim == 2 and t.size == math.prod(want) else None
                if t is None:
                    raise ValueError(f"{path / 'adapter_model.safetensors'}: {key} has the "
                                     f"wrong size for this model's {name} (want {want}).")
                per.append(t)
            out.setdefault(module, {})[leaf] = np.stack(per)
    tree = {"layers": out}
    if sharding is None:
        return jax.tree_util.tree_map(jnp.asarray, tree)
    sh = adapters(model_lib.param_shardings(cfg, sharding))
    return jax.tree_util.tree_map(lambda x, s: jax.device_put(x, s), tree, sh)


__all__ = ["LORA_TARGETS", "adapters", "attach", "base", "base_config", "merge",
           "init_adapters", "count", "export_peft", "load_peft", "peft_tensors", "scale"]
