"""Tiny random transformers models for parity tests (built here, never downloaded)."""

from __future__ import annotations

from pathlib import Path

KINDS = ("qwen2", "llama", "qwen3")


def tiny_hf_config(kind: str):
    import transformers as tf
    common = dict(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                  rms_norm_eps=1e-6)
    if kind == "qwen2":  # bias on q/k/v, tied embeddings
        return tf.Qwen2Config(**common, tie_word_embeddings=True, use_sliding_window=False,
                              rope_theta=10000.0)
    if kind == "llama":  # untied head, llama3 rope scaling
        return tf.LlamaConfig(**common, tie_word_embeddings=False, rope_theta=500000.0,
                              rope_scaling={"rope_type": "llama3", "factor": 8.0,
                                            "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                            "original_max_position_embeddings": 64})
    if kind == "qwen3":  # per-head q/k RMSNorm, explicit head_dim
        return tf.Qwen3Config(**common, head_dim=16, tie_word_embeddings=False,
                              rope_theta=1000000.0)
    raise ValueError(kind)


def build_tiny_hf(kind: str, out_dir: str | Path, seed: int = 0):
    """Random float32 transformers model of `kind`, saved with save_pretrained."""
    import torch
    import transformers as tf
    torch.manual_seed(seed)
    cfg = tiny_hf_config(kind)
    cls = {"qwen2": tf.Qwen2ForCausalLM, "llama": tf.LlamaForCausalLM,
           "qwen3": tf.Qwen3ForCausalLM}[kind]
    model = cls(cfg).float().eval()
    with torch.no_grad():  # norms start at 1; perturb them so their mapping is tested
        for name, p in model.named_parameters():
            if "norm" in name or name.endswith("bias"):
                p.add_(0.1 * torch.randn_like(p))
    model.save_pretrained(str(out_dir), safe_serialization=True)
    return model
