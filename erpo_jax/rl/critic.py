"""PPO's critic: a value head on its own copy of the model trunk.

Only the `gae` advantage estimator needs it (its registry entry says
`needs_critic`, `rl/estimators.py`); GRPO, RLOO and the REINFORCE variants
never create one. The critic is the
same model function as the policy with a separate parameter pytree (and so
its own optimizer state in the trainer):

    critic_params = {"trunk": <model params>, "value_head": {"kernel": f32[D], "bias": f32[]}}

The trunk's LM-head weights are carried along unused (the model module
declares them), and receive zero gradient.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from erpo_jax.model import model as model_lib
from erpo_jax.model.config import ModelConfig


def init_critic(cfg: ModelConfig, rng, trunk_params=None):
    """Critic parameters: a copy of `trunk_params` (e.g. the initial policy) or a fresh
    random trunk, and a zero value head (every value starts at 0)."""
    if trunk_params is None:
        trunk = model_lib.init_params(cfg, rng)
    else:
        trunk = jax.tree.map(jnp.copy, trunk_params)
    head = {"kernel": jnp.zeros((cfg.hidden_size,), jnp.float32),
            "bias": jnp.zeros((), jnp.float32)}
    return {"trunk": trunk, "value_head": head}


def values(critic_params, cfg: ModelConfig, tokens: jax.Array, attn_mask: jax.Array | None = None
           ) -> jax.Array:
    """float32[B, T-1] state values aligned with `token_logprobs`.

    values[:, t] is V(tokens[:, :t+1]), the value of the state in which
    tokens[:, t+1] is generated. tokens: int32[B, T]; attn_mask: [B, T].
    """
    h, _ = model_lib.hidden_states(critic_params["trunk"], cfg, tokens, None, attn_mask)
    head = critic_params["value_head"]
    return h[:, :-1].astype(jnp.float32) @ head["kernel"] + head["bias"]


def value_loss(new_values: jax.Array, old_values: jax.Array, returns: jax.Array,
               mask: jax.Array, clip_eps: float | None = 0.2):
    """(loss float32[], metrics): PPO's clipped value loss, token mean over mask.

    loss_t = 0.5 * max((v - R)^2, (v_old + clip(v - v_old, -eps, eps) - R)^2);
    clip_eps=None gives the plain squared error. All inputs float32[N, T-1].
    """
    m = mask.astype(bool)
    v, v_old, R = (x.astype(jnp.float32) for x in (new_values, old_values, returns))
    err = jnp.square(v - R)
    if clip_eps is not None:
        v_clip = v_old + jnp.clip(v - v_old, -clip_eps, clip_eps)
        err_clip = jnp.square(v_clip - R)
        clipped = m & (err_clip > err)
        err = jnp.maximum(err, err_clip)
    else:
        clipped = jnp.zeros_like(m)
    n = jnp.maximum(jnp.sum(m), 1).astype(jnp.float32)
    loss = 0.5 * jnp.sum(jnp.where(m, err, 0.0)) / n
    metrics = {"value_loss": jax.lax.stop_gradient(loss),
               "value_clip_frac": jnp.sum(clipped) / n,
               "value_mean": jax.lax.stop_gradient(jnp.sum(jnp.where(m, v, 0.0)) / n)}
    return loss, metrics


def critic_loss_fn(critic_params, cfg: ModelConfig, tokens: jax.Array, attn_mask: jax.Array,
                   response_mask: jax.Array, old_values: jax.Array, returns: jax.Array,
                   clip_eps: float | None = 0.2):
    """(loss, metrics) of the critic on a batch: one trunk forward, then `value_loss`
    over the response positions. old_values, returns: float32[N, T-1] (from `gae`)."""
    v = values(critic_params, cfg, tokens, attn_mask)
    return value_loss(v, old_values, returns, response_mask, clip_eps)
