"""Hugging Face checkpoints in and out: config, safetensors weights, tokenizer.

One regex table maps every HF tensor name to a leaf of our parameter pytree
and back. Loading checks every shape, and fails with the tensor's name on any
unmapped, missing or duplicate key. With a mesh, each parameter is built with
`jax.make_array_from_callback`, which reads only the slice each device owns
from the memory-mapped files: the model never exists whole on one device.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
from pathlib import Path
from typing import Any, Callable

import jax
import numpy as np

from erpo_jax.model import model as model_lib
from erpo_jax.model.config import ModelConfig, from_hf_config
from erpo_jax.model.safetensors_io import SafetensorsFile, save_file
from erpo_jax.model.sharding import Sharding


class CheckpointError(ValueError):
    pass


@dataclasses.dataclass(frozen=True)
class Rule:
    """HF name pattern -> our leaf path, with the layout change both ways.

    to_ours(hf_tensor, cfg) -> our layer slice; to_hf(our_slice, cfg) -> HF tensor.
    """

    pattern: str
    path: tuple[str, ...]
    to_ours: Callable[[np.ndarray, ModelConfig], np.ndarray]
    to_hf: Callable[[np.ndarray, ModelConfig], np.ndarray]
    per_layer: bool = True


def _same(x, cfg):
    return x


def _linear(out_heads: str | None):
    """HF Linear weight [out, in] <-> our kernel [in, (heads, head_dim) | out]."""

    def heads(cfg):
        return {"q": cfg.num_heads, "kv": cfg.num_kv_heads}[out_heads]

    def to_ours(w, cfg):
        w = w.T
        return w.reshape(w.shape[0], heads(cfg), cfg.head_dim) if out_heads else w

    def to_hf(k, cfg):
        return k.reshape(k.shape[0], -1).T if out_heads else k.T

    return to_ours, to_hf


def _bias(kind: str):
    def to_ours(b, cfg):
        return b.reshape({"q": cfg.num_heads, "kv": cfg.num_kv_heads}[kind], cfg.head_dim)

    return to_ours, lambda b, cfg: b.reshape(-1)


def _o_proj_to_ours(w, cfg):  # [D, H*K] -> [H, K, D]
    return w.T.reshape(cfg.num_heads, cfg.head_dim, w.shape[0])


def _o_proj_to_hf(k, cfg):  # [H, K, D] -> [D, H*K]
    return k.reshape(-1, k.shape[-1]).T


_L = r"model\.layers\.(\d+)\."
RULES: tuple[Rule, ...] = (
    Rule(r"model\.embed_tokens\.weight", ("embed",), _same, _same, per_layer=False),
    Rule(r"model\.norm\.weight", ("final_norm", "scale"), _same, _same, per_layer=False),
    Rule(r"lm_head\.weight", ("lm_head",), lambda w, c: w.T, lambda k, c: k.T, per_layer=False),
    Rule(_L + r"self_attn\.q_proj\.weight", ("layers", "attn", "q_proj"), *_linear("q")),
    Rule(_L + r"self_attn\.k_proj\.weight", ("layers", "attn", "k_proj"), *_linear("kv")),
    Rule(_L + r"self_attn\.v_proj\.weight", ("layers", "attn", "v_proj"), *_linear("kv")),
    Rule(_L + r"self_attn\.o_proj\.weight", ("layers", "attn", "o_proj"), _o_proj_to_ours,
         _o_proj_to_hf),
    Rule(_L + r"self_attn\.q_proj\.bias", ("layers", "attn", "q_bias"), *_bias("q")),
    Rule(_L + r"self_attn\.k_proj\.bias", ("layers", "attn", "k_bias"), *_bias("kv")),
    Rule(_L + r"self_attn\.v_proj\.bias", ("layers", "attn", "v_bias"), *_bias("kv")),
    Rule(_L + r"self_attn\.q_norm\.weight", ("layers", "attn", "q_norm", "scale"), _same, _same),
    Rule(_L + r"self_attn\.k_norm\.weight", ("layers", "attn", "k_norm", "scale"), _same, _same),
    Rule(_L + r"mlp\.gate_proj\.weight", ("layers", "mlp", "gate_proj"), *_linear(None)),
    Rule(_L + r"mlp\.up_proj\.weight", ("layers", "mlp", "up_proj"), *_linear(None)),
    Rule(_L + r"mlp\.down_proj\.weight", ("layers", "mlp", "down_proj"), *_linear(None)),
    Rule(_L + r"input_layernorm\.weight", ("layers", "input_norm", "scale"), _same, _same),
    Rule(_L + r"post_attention_layernorm\.weight", ("layers", "post_attn_norm", "scale"),
         _same, _same),
)
# Buffers some checkpoints carry that are recomputed, not loaded.
IGNORED = (re.compile(_L + r"self_attn\.rotary_emb\.inv_freq"),)
_COMPILED = [(re.compile(r.pattern + r"$"), r) for r in RULES]


def _hf_name(rule: Rule, layer: int | None) -> str:
    name = rule.pattern.replace(r"\.", ".")
    return name.replace(r"(\d+)", str(layer)) if rule.per_layer else name


def _leaf_paths(tree) -> dict[tuple[str, ...], Any]:
    flat = jax.tree_util.tree_flatten_with_path(tree)[0]
    return {tuple(k.key for k in path): leaf for path, leaf in flat}


def _set_path(tree: dict, path: tuple[str, ...], value) -> None:
    for k in path[:-1]:
        tree = tree.setdefault(k, {})
    tree[path[-1]] = value


# ----------------------------------------------------------------------------- reading


def read_config(path: str | os.PathLike) -> dict:
    path = Path(path)
    f = path / "config.json"
    if not f.is_file():
        raise CheckpointError(f"{path}: no config.json; expected a Hugging Face checkpoint "
                              "directory (config.json + *.safetensors).")
    try:
        return json.loads(f.read_text())
    except json.JSONDecodeError as e:
        raise CheckpointError(f"{f}: not valid JSON ({e}).") from None


def open_safetensors(path: str | os.PathLike) -> dict[str, SafetensorsFile]:
    """Map every tensor name to the (memory-mapped) file that holds it."""
    path = Path(path)
    index = path / "model.safetensors.index.json"
    if index.is_file():
        weight_map = json.loads(index.read_text()).get("weight_map")
        if not isinstance(weight_map, dict):
            raise CheckpointError(f"{index}: has no 'weight_map' object.")
        files = {fn: None for fn in weight_map.values()}
    else:
        files = {p.name: None for p in sorted(path.glob("*.safetensors"))}
        weight_map = None
    if not files:
        bins = sorted(p.name for p in path.glob("*.bin")) + sorted(p.name for p in path.glob("*.pt"))
        hint = (f" It has {bins}: pickle checkpoints are never loaded; convert them with "
                "transformers' save_pretrained(safe_serialization=True).") if bins else ""
        raise CheckpointError(f"{path}: no *.safetensors files.{hint}")
    for fn in files:
        if not (path / fn).is_file():
            raise CheckpointError(f"{path}: the index names {fn}, which does not exist.")
        files[fn] = SafetensorsFile(path / fn)
    where: dict[str, SafetensorsFile] = {}
    for fn, f in files.items():
        for name in f.keys():
            if name in where:
                raise CheckpointError(f"{path}: tensor {name!r} appears in both "
                                      f"{where[name].path.name} and {fn} (duplicate key).")
            if weight_map is not None and weight_map.get(name) != fn:
                raise CheckpointError(f"{path}: tensor {name!r} is in {fn} but the index says "
                                      f"{weight_map.get(name)!r}.")
            where[name] = f
    if weight_map is not None:
        missing = sorted(set(weight_map) - set(where))
        if missing:
            raise CheckpointError(f"{path}: the index lists {missing[:5]} but no file holds them.")
    return where


def _plan(names, cfg: ModelConfig, abstract) -> dict[tuple[str, ...], list[str | None]]:
    """Our leaf path -> HF names (one per layer for stacked leaves); validates keys."""
    ours = _leaf_paths(abstract)
    plan: dict[tuple[str, ...], list] = {}
    for name in names:
        if any(p.match(name) for p in IGNORED):
            continue
        for pat, rule in _COMPILED:
            m = pat.match(name)
            if m:
                break
        else:
            raise CheckpointError(f"HF tensor {name!r} matches no mapping rule; this checkpoint "
                                  "has a layer erpo-jax does not implement.")
        if rule.path == ("lm_head",) and cfg.tie_word_embeddings:
            continue  # tied: the head is the embedding (some exports save both)
        if rule.path not in ours:
            raise CheckpointError(f"HF tensor {name!r} maps to {'/'.join(rule.path)}, which this "
                                  f"config ({cfg.family}, qkv_bias={cfg.qkv_bias}, "
                                  f"qk_norm={cfg.qk_norm}) does not have.")
        slots = plan.setdefault(rule.path, [None] * (cfg.num_layers if rule.per_layer else 1))
        i = int(m.group(1)) if rule.per_layer else 0
        if i >= len(slots):
            raise CheckpointError(f"HF tensor {name!r}: layer {i} >= num_hidden_layers "
                                  f"{cfg.num_layers}.")
        if slots[i] is not None:
            raise CheckpointError(f"HF tensor {name!r} duplicates {slots[i]!r}.")
        slots[i] = name
    for path in ours:
        slots = plan.get(path)
        if slots is None or None in slots:
            rule = next(r for r in RULES if r.path == path)
            i = 0 if slots is None else slots.index(None)
            raise CheckpointError(f"checkpoint is missing tensor {_hf_name(rule, i)!r}.")
    return plan


def load_hf(path: str | os.PathLike, sharding: Sharding | None = None,
            **config_overrides) -> tuple[ModelConfig, Any]:
    """Load a local HF checkpoint directory: (ModelConfig, params).

    config_overrides: ModelConfig fields, e.g. param_dtype='float32', remat=True.
    With `sharding`, parameters are created directly in their NamedSharding.
    """
    cfg = from_hf_config(read_config(path), **config_overrides)
    tensors = open_safetensors(path)
    abstract = model_lib.abstract_params(cfg)
    plan = _plan(tensors.keys(), cfg, abstract)
    rules = {r.path: r for r in RULES}
    shardings = _leaf_paths(model_lib.param_shardings(cfg, sharding)) if sharding else {}
    params: dict = {}
    for path, leaf in _leaf_paths(abstract).items():
        rule, names = rules[path], plan[path]
        want = leaf.shape[1:] if rule.per_layer else leaf.shape

        def convert(name, rule=rule, want=want):
            src = tensors[name][name]
            out = rule.to_ours(src, cfg) if src.ndim else src
            if tuple(out.shape) != tuple(want):
                raise CheckpointError(f"HF tensor {name!r} has shape {list(src.shape)}, which does "
                                      f"not fit {'/'.join(rule.path)} {list(want)} of this config.")
            return out

        for name in names:  # check every shape before any device memory is used
            convert(name)

        def read(index, names=names, convert=convert, per_layer=rule.per_layer, dtype=leaf.dtype):
            if per_layer:
                layers = range(len(names))[index[0]]
                return np.stack([np.asarray(convert(names[i])[index[1:]]) for i in layers]
                                ).astype(dtype)
            return np.asarray(convert(names[0])[index]).astype(dtype)

        if sharding is None:
            value = jax.device_put(read(tuple(slice(None) for _ in leaf.shape)))
        else:
            value = jax.make_array_from_callback(leaf.shape, shardings[path], read)
        _set_path(params, path, value)
    return cfg, params


# A directory holds a tokenizer if it has one of these vocabularies (plus,
# usually, tokenizer_config.json).
TOKENIZER_FILES = ("tokenizer.json", "vocab.json", "tokenizer.model")
_EXPECTED = ("tokenizer.json (or vocab.json + merges.txt, or tokenizer.model) with "
             "tokenizer_config.json")


def load_tokenizer(path: str | os.PathLike):
    """transformers.AutoTokenizer from a local directory (no hub access).

    Raises CheckpointError naming the directory and the files expected when
    it holds no tokenizer, an empty one, or one transformers cannot read.
    """
    from transformers import AutoTokenizer
    path = Path(path)
    if not path.is_dir():
        raise CheckpointError(f"tokenizer directory {path} does not exist.")
    fix = ("save the model's tokenizer there with tokenizer.save_pretrained(dir) or copy its "
           "tokenizer files from the original checkpoint")
    present = [f for f in TOKENIZER_FILES if (path / f).is_file()]
    if not present:
        raise CheckpointError(f"{path}: no tokenizer files; expected {_EXPECTED}. {fix}.")
    empty = [f for f in present if (path / f).stat().st_size == 0]
    if empty:
        raise CheckpointError(f"{path}: tokenizer file {empty[0]} is empty; expected "
                              f"{_EXPECTED}. {fix}.")
    try:
        tok = AutoTokenizer.from_pretrained(str(path), local_files_only=True)
    except Exception as e:  # noqa: BLE001 - any failure is an unreadable tokenizer
        raise CheckpointError(f"{path}: transformers cannot load the tokenizer "
                              f"({type(e).__name__}: {str(e)[:200]}); expected {_EXPECTED}. "
                              f"{fix}.") from e
    if len(tok) == 0:
        raise CheckpointError(f"{path}: the tokenizer has an empty vocabulary; expected "
                              f"{_EXPECTED}. {fix}.")
    return tok


def generation_eos_ids(path: str | os.PathLike) -> tuple[tuple[int, ...], int | None]:
    """(eos ids, pad id) of a checkpoint's generation_config.json (empty, None
    when it has none): the ids transformers' `generate` stops at."""
    f = Path(path) / "generation_config.json"
    if not f.is_file():
        return (), None
    try:
        gen = json.loads(f.read_text())
    except json.JSONDecodeError as e:
        raise CheckpointError(f"{f}: not valid JSON ({e}).") from None
    eos = gen.get("eos_token_id")
    eos = [] if eos is None else eos if isinstance(eos, list) else [eos]
    pad = gen.get("pad_token_id")
    return tuple(int(e) for e in eos), None if pad is None else int(pad)


# ----------------------------------------------------------------------------- writing


def to_hf_tensors(params, cfg: ModelConfig, dtype=None) -> dict[str, np.ndarray]:
    """Our parameters as a dict of HF-named numpy arrays."""
    out = {}
    rules = {r.path: r for r in RULES}
    for path, leaf in _leaf_paths(params).items():
        rule = rules[path]
        arr = np.asarray(jax.device_get(leaf))
        if dtype is not None:
            arr = arr.astype(dtype)
        if rule.per_layer:
            for i in range(arr.shape[0]):
                out[_hf_name(rule, i)] = np.ascontiguousarray(rule.to_hf(arr[i], cfg))
        else:
            out[_hf_name(rule, 0)] = np.ascontiguousarray(rule.to_hf(arr, cfg))
    return out


def hf_config_dict(cfg: ModelConfig) -> dict:
    """A config.json for transformers from our ModelConfig."""
    arch = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM",
            "qwen3": "Qwen3ForCausalLM"}[cfg.family]
    rope: dict[str, Any] = {"rope_type": cfg.rope_scaling.kind, "rope_theta": cfg.rope_theta}
    if cfg.rope_scaling.kind != "default":
        sc = cfg.rope_scaling
        rope.update(factor=sc.factor, low_freq_factor=sc.low_freq_factor,
                    high_freq_factor=sc.high_freq_factor,
                    original_max_position_embeddings=sc.original_max_position_embeddings)
    d = {
        "architectures": [arch], "model_type": cfg.family, "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.hidden_size, "intermediate_size": cfg.intermediate_size,
        "num_hidden_layers": cfg.num_layers, "num_attention_heads": cfg.num_heads,
        "num_key_value_heads": cfg.num_kv_heads, "head_dim": cfg.head_dim,
        "rms_norm_eps": cfg.rms_norm_eps, "max_position_embeddings": cfg.max_position_embeddings,
        "tie_word_embeddings": cfg.tie_word_embeddings, "hidden_act": "silu",
        "rope_parameters": rope, "dtype": cfg.param_dtype,
    }
    if cfg.family in ("llama", "qwen3"):
        d["attention_bias"] = cfg.qkv_bias
    if cfg.family == "llama":
        d["mlp_bias"] = False
    if cfg.family == "qwen2":
        d["use_sliding_window"] = False
    return d


def export_hf(params, cfg: ModelConfig, out_dir: str | os.PathLike, *,
              hf_config: dict | None = None, tokenizer=None, dtype=None,
              max_shard_bytes: int = 5 * 2**30) -> Path:
    """Write an HF checkpoint directory that transformers can load.

    hf_config: the original config.json dict to keep (default: generated).
    tokenizer: a transformers tokenizer saved beside the weights.
    Files larger than max_shard_bytes are split with a safetensors index.
    """
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tensors = to_hf_tensors(params, cfg, dtype)
    config = dict(hf_config) if hf_config else hf_config_dict(cfg)
    (out / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True))
    shards, cur, size = [], {}, 0
    for name in sorted(tensors):
        if cur and size + tensors[name].nbytes > max_shard_bytes:
            shards.append(cur)
            cur, size = {}, 0
        cur[name] = tensors[name]
        size += tensors[name].nbytes
    shards.append(cur)
    if len(shards) == 1:
        save_file(shards[0], out / "model.safetensors")
    else:
        weight_map = {}
        for i, shard in enumerate(shards):
            fn = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
            save_file(shard, out / fn)
            weight_map.update({n: fn for n in shard})
        total = sum(t.nbytes for t in tensors.values())
        (out / "model.safetensors.index.json").write_text(json.dumps(
            {"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2))
    if tokenizer is not None:
        tokenizer.save_pretrained(str(out))
    return out
