"""The LM head as a decode step uses it: one copy per call, placed so that no
step gathers it (`decode_head`), and the logits of each row's last hidden
state on the chips of its row (`head_logits`). The product itself is the
model's (`model.lm_logits`), as in the training forward and `logprobs`.

On a mesh the head copy is split on the vocabulary over every chip (when the
mesh's size divides V), so each chip multiplies its slice of the vocabulary
for every row; the logits then go back to their rows' chips for sampling.
"""

from __future__ import annotations

import jax

from erpo_jax.model import model as model_lib
from erpo_jax.model.config import ModelConfig
from erpo_jax.model.sharding import Sharding


def decode_head(params, cfg: ModelConfig, sharding: Sharding | None = None) -> jax.Array:
    """The LM head weight [D, V] as the engines use it (made once per call):
    on a mesh whose size divides V, split on V over every chip, so no decode
    step gathers the [D, V] weight."""
    w = model_lib.head_weight(params, cfg).astype(cfg.jnp_compute_dtype)
    axes = decode_head_axes(cfg, sharding)
    return w if axes is None else sharding.constrain(w, axes)


def decode_head_axes(cfg: ModelConfig, sharding: Sharding | None):
    """The logical axes of `decode_head`'s [D, V] weight (None: as it is)."""
    if sharding is None or sharding.mesh.size == 1:
        return None
    if cfg.vocab_size % sharding.mesh.size:
        return ("embed", "vocab")
    return (None, "head_vocab")


def head_logits(h: jax.Array, head: jax.Array, cfg: ModelConfig,
                sharding: Sharding | None = None) -> jax.Array:
    """float32 logits [R, V] of final hidden states h [R, D] (head: from
    `decode_head`), on the chips of their rows. With a vocabulary-split head
    every chip computes its slice of the vocabulary for every row, then each
    row's logits go to its chip (an all-to-all of R x V / chips floats)."""
    axes = decode_head_axes(cfg, sharding)
    split = axes is not None and axes[1] == "head_vocab"
    if split:
        h = sharding.constrain(h, (None, None))
    logits = model_lib.lm_logits(h, head, sharding)
    if axes is None:
        return logits
    if split:
        logits = sharding.constrain(logits, (None, "head_vocab"))
    return sharding.constrain(logits, ("rows", None))
