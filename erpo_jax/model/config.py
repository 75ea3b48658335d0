"""Model configuration: one dataclass for the Llama 3 / Qwen2 / Qwen2.5 / Qwen3 family.

The three families differ only in a few switches (q/k/v bias, per-head q/k
RMSNorm, tied embeddings, RoPE scaling), so one decoder covers them all.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax.numpy as jnp

ARCHITECTURES = {
    "LlamaForCausalLM": "llama",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
}

# The projections low-rank adapters can target (model/lora.py).
LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")

_DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16, "float16": jnp.float16}


@dataclasses.dataclass(frozen=True)
class RopeScaling:
    """RoPE frequency scaling. `kind` is 'default', 'linear' or 'llama3'."""

    kind: str = "default"
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """Shape and numerics of one decoder-only transformer.

    Attributes:
      family: 'llama', 'qwen2' or 'qwen3' (used for HF export only).
      qkv_bias: bias on the q, k and v projections (Qwen2/2.5).
      qk_norm: RMSNorm over head_dim on q and k, per head (Qwen3).
      param_dtype: dtype parameters are stored in ('float32' or 'bfloat16').
      compute_dtype: dtype of matmuls and activations; logits, log-softmax and
        attention softmax are always float32.
      remat: rematerialise each layer in the backward pass.
      scan_layers: run the cacheless pass (training, scoring) as one scan over
        the layers (compile time independent of depth) or unrolled (faster for
        shallow models: no stacked activation buffers); None = scan above
        4 layers. Parameters are stacked on a leading [L] axis either way.
        Unrolled 6-layer medium-25m scored 256 x 384 tokens 17% slower, with
        1.8x the peak memory, than scanned.
      lora_rank: rank of the low-rank adapters on `lora_targets` (0 = none;
        model/lora.py); lora_alpha: their scale is lora_alpha / lora_rank;
        lora_targets: projection names (LORA_TARGETS), empty = all of them.
    """

    vocab_size: int = 256
    hidden_size: int = 64
    intermediate_size: int = 128
    num_layers: int = 2
    num_heads: int = 4
    num_kv_heads: int = 2
    head_dim: int = 16
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: RopeScaling = RopeScaling()
    max_position_embeddings: int = 4096
    tie_word_embeddings: bool = False
    qkv_bias: bool = False
    qk_norm: bool = True
    family: str = "qwen3"
    param_dtype: str = "float32"
    compute_dtype: str = "float32"
    remat: bool = False
    scan_layers: bool | None = None
    lora_rank: int = 0
    lora_alpha: float = 32.0
    lora_targets: tuple[str, ...] = ()

    def __post_init__(self):
        self.validate()

    def validate(self) -> None:
        """Raise ValueError with a sentence naming the field when inconsistent."""
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_layers",
                     "num_heads", "num_kv_heads", "head_dim"):
            if getattr(self, name) <= 0:
                raise ValueError(f"ModelConfig.{name} must be positive, got {getattr(self, name)}.")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"ModelConfig.num_heads ({self.num_heads}) must be a multiple of "
                f"num_kv_heads ({self.num_kv_heads}) for grouped-query attention.")
        for name in ("param_dtype", "compute_dtype"):
            if getattr(self, name) not in _DTYPES:
                raise ValueError(
                    f"ModelConfig.{name} is {getattr(self, name)!r}; use one of {sorted(_DTYPES)}.")
        if self.family not in ("llama", "qwen2", "qwen3"):
            raise ValueError(f"ModelConfig.family is {self.family!r}; use 'llama', 'qwen2' or 'qwen3'.")
        if self.family == "qwen3" and not self.qk_norm:
            raise ValueError("ModelConfig.qk_norm must be True for family 'qwen3' (Qwen3 "
                             "normalises q and k per head); use family 'llama' without it.")
        if self.family == "qwen2" and not self.qkv_bias:
            raise ValueError("ModelConfig.qkv_bias must be True for family 'qwen2'.")
        if self.family in ("llama", "qwen2") and self.qk_norm:
            raise ValueError(f"ModelConfig.qk_norm is only for family 'qwen3', not "
                             f"{self.family!r}.")
        self._validate_lora()
        if self.rope_scaling.kind not in ("default", "linear", "llama3"):
            raise ValueError(
                f"RoPE scaling {self.rope_scaling.kind!r} is not supported; "
                "supported: 'default', 'linear', 'llama3'.")

    def _validate_lora(self) -> None:
        if self.lora_rank < 0 or (self.lora_rank == 0 and self.lora_targets):
            raise ValueError(
                f"ModelConfig.lora_rank is {self.lora_rank} with lora_targets "
                f"{list(self.lora_targets)}; give a positive rank for adapters, or rank 0 "
                "and no targets for none.")
        bad = [t for t in self.lora_targets if t not in LORA_TARGETS]
        if bad:
            raise ValueError(f"ModelConfig.lora_targets names {bad}, not projections; the "
                             f"valid ones are {list(LORA_TARGETS)}.")
        if not self.lora_rank:
            return
        if not self.lora_alpha > 0:
            raise ValueError(f"ModelConfig.lora_alpha must be positive, got {self.lora_alpha}.")
        q, kv = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        D, F = self.hidden_size, self.intermediate_size
        dims = {"q_proj": (D, q), "k_proj": (D, kv), "v_proj": (D, kv), "o_proj": (q, D),
                "gate_proj": (D, F), "up_proj": (D, F), "down_proj": (F, D)}
        for t in self.lora_target_names:
            if self.lora_rank > min(dims[t]):
                raise ValueError(
                    f"ModelConfig.lora_rank {self.lora_rank} is above {t}'s smaller dimension "
                    f"{min(dims[t])} (it is {dims[t][0]} x {dims[t][1]}); give a rank of at "
                    f"most {min(dims[t])}, or leave {t} out of lora_targets.")

    @property
    def lora_target_names(self) -> tuple[str, ...]:
        """The projections that carry adapters (none without LoRA)."""
        if not self.lora_rank:
            return ()
        return tuple(self.lora_targets) or LORA_TARGETS

    @property
    def scans_layers(self) -> bool:
        """Whether the cacheless pass scans the layers (see `scan_layers`)."""
        return self.num_layers > 4 if self.scan_layers is None else bool(self.scan_layers)

    @property
    def jnp_param_dtype(self):
        return _DTYPES[self.param_dtype]

    @property
    def jnp_compute_dtype(self):
        return _DTYPES[self.compute_dtype]

    def num_params(self) -> int:
        """Parameter count (embeddings included, head counted once if tied)."""
        d, f, v = self.hidden_size, self.intermediate_size, self.vocab_size
        q = self.num_heads * self.head_dim
        kv = self.num_kv_heads * self.head_dim
        attn = d * q + 2 * d * kv + q * d + (q + 2 * kv if self.qkv_bias else 0)
        attn += 2 * self.head_dim if self.qk_norm else 0
        layer = attn + 3 * d * f + 2 * d
        head = 0 if self.tie_word_embeddings else d * v
        return v * d + self.num_layers * layer + d + head


def _get(cfg: dict, *keys, default=None):
    for k in keys:
        if k in cfg and cfg[k] is not None:
            return cfg[k]
    return default


def rope_from_hf(hf: dict[str, Any]) -> tuple[float, RopeScaling]:
    """Read RoPE theta and scaling from a transformers 5 (`rope_parameters`) or
    older (`rope_theta` / `rope_scaling`) config dict."""
    params = hf.get("rope_parameters") or {}
    legacy = hf.get("rope_scaling") or {}
    theta = _get(params, "rope_theta", default=None) or _get(hf, "rope_theta", default=10000.0)
    src = params if params.get("rope_type") or params.get("type") else legacy
    kind = _get(src, "rope_type", "type", default="default")
    if kind == "default":
        return float(theta), RopeScaling()
    if kind not in ("linear", "llama3"):
        raise ValueError(
            f"config.json asks for RoPE scaling {kind!r}, which erpo-jax does not implement; "
            "supported: default, linear, llama3.")
    return float(theta), RopeScaling(
        kind=kind,
        factor=float(_get(src, "factor", default=1.0)),
        low_freq_factor=float(_get(src, "low_freq_factor", default=1.0)),
        high_freq_factor=float(_get(src, "high_freq_factor", default=4.0)),
        original_max_position_embeddings=int(
            _get(src, "original_max_position_embeddings", default=8192)),
    )


def from_hf_config(hf: dict[str, Any], **overrides) -> ModelConfig:
    """Build a ModelConfig from a parsed HF `config.json`.

    Raises ValueError naming the architecture when it is not one we implement.
    """
    archs = hf.get("architectures") or []
    family = None
    for a in archs:
        family = ARCHITECTURES.get(a, family)
    if family is None:
        family = {"llama": "llama", "qwen2": "qwen2", "qwen3": "qwen3"}.get(hf.get("model_type"))
    if family is None:
        raise ValueError(
            f"Unknown architecture {archs or hf.get('model_type')!r} in config.json; "
            f"erpo-jax supports {sorted(ARCHITECTURES)}.")
    if hf.get("use_sliding_window"):
        raise ValueError("config.json sets use_sliding_window=true; sliding-window attention "
                         "is not implemented. Set it to false (Qwen2.5 checkpoints ship false).")
    theta, scaling = rope_from_hf(hf)
    heads = int(hf["num_attention_heads"])
    hidden = int(hf["hidden_size"])
    dtype = _get(hf, "dtype", "torch_dtype", default="float32")
    kwargs = dict(
        vocab_size=int(hf["vocab_size"]),
        hidden_size=hidden,
        intermediate_size=int(hf["intermediate_size"]),
        num_layers=int(hf["num_hidden_layers"]),
        num_heads=heads,
        num_kv_heads=int(_get(hf, "num_key_value_heads", default=heads)),
        head_dim=int(_get(hf, "head_dim", default=hidden // heads)),
        rms_norm_eps=float(_get(hf, "rms_norm_eps", default=1e-6)),
        rope_theta=theta,
        rope_scaling=scaling,
        max_position_embeddings=int(_get(hf, "max_position_embeddings", default=4096)),
        tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
        qkv_bias=family == "qwen2" or bool(hf.get("attention_bias", False)),
        qk_norm=family == "qwen3",
        family=family,
        param_dtype=dtype if dtype in _DTYPES else "float32",
    )
    kwargs.update(overrides)
    return ModelConfig(**kwargs)


PRESETS = {
    # Tiny shapes for tests and the embedded CPU task.
    "tiny": ModelConfig(),
    # The embedded arithmetic task's model (character vocabulary padded to 64).
    "arith-small": ModelConfig(vocab_size=64, hidden_size=96, intermediate_size=256,
                               num_layers=3, num_heads=4, num_kv_heads=2, head_dim=24,
                               max_position_embeddings=128),
    # A larger model for the same task (about 4x the parameters): multiplications,
    # arith-small's weak family, need the capacity.
    "arith-medium": ModelConfig(vocab_size=64, hidden_size=192, intermediate_size=512,
                                num_layers=4, num_heads=6, num_kv_heads=2, head_dim=32,
                                max_position_embeddings=128),
    # The shapes of google-tunix's GRPO timing script (../shared/peers/tunix_grpo.py),
    # for `erpo bench --peer tunix`: Qwen3-style with tied embeddings.
    "peer-tiny": ModelConfig(tie_word_embeddings=True),
    "peer-small": ModelConfig(vocab_size=8192, hidden_size=256, intermediate_size=1024,
                              num_layers=4, num_heads=8, num_kv_heads=4, head_dim=32,
                              tie_word_embeddings=True),
    # About 25M parameters: the medium benchmark model.
    "medium-25m": ModelConfig(vocab_size=8192, hidden_size=512, intermediate_size=1536,
                              num_layers=6, num_heads=8, num_kv_heads=4, head_dim=64),
    # Shapes of real checkpoints (weights come from a local HF directory).
    "qwen2.5-0.5b": ModelConfig(vocab_size=151936, hidden_size=896, intermediate_size=4864,
                                num_layers=24, num_heads=14, num_kv_heads=2, head_dim=64,
                                rope_theta=1000000.0, tie_word_embeddings=True, qkv_bias=True,
                                family="qwen2", qk_norm=False, max_position_embeddings=32768),
    "qwen2.5-math-1.5b": ModelConfig(vocab_size=151936, hidden_size=1536, intermediate_size=8960,
                                     num_layers=28, num_heads=12, num_kv_heads=2, head_dim=128,
                                     rope_theta=10000.0, tie_word_embeddings=True, qkv_bias=True,
                                     family="qwen2", qk_norm=False, max_position_embeddings=4096),
    "qwen2.5-7b": ModelConfig(vocab_size=152064, hidden_size=3584, intermediate_size=18944,
                              num_layers=28, num_heads=28, num_kv_heads=4, head_dim=128,
                              rope_theta=1000000.0, qkv_bias=True, family="qwen2", qk_norm=False,
                              max_position_embeddings=32768),
}
