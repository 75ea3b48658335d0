"""From task rewards to the advantages of one rollout: Policy-KL reward shaping,
then the advantage estimator.

With `loss.policy_kl_mode='reward'` the Policy-KL penalty beta_policy * k(d[t])
(d = logp_ref - logp_old on the response tokens) is taken out of the reward
instead of being a loss term. Its form follows the estimator's unit:

- outcome estimators (grpo, dr_grpo, rloo, reinforce, and reinforce_pp with
  `algo.reinforce_pp_whiten='response'`) see one number per response:
  r - beta * sum_t k(d[t]);
- token-level returns (gae, and reinforce_pp with the default
  `reinforce_pp_whiten='token'`) see a reward per token: -beta * k(d[t]) on
  every response token plus r on the last one, so the return from token t
  only carries the penalties of tokens t and later.

Pure and jittable with the configs static; the trainer jits it once per run.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from erpo_jax.rl import advantages as adv_lib
from erpo_jax.rl import estimators
from erpo_jax.rl.kl import kl_penalized_rewards

WHITEN_MODES = ("token", "response")


def is_token_level(algo) -> bool:
    """Whether the estimator of `algo` (an AlgoSection) works on per-token
    rewards and returns per-token advantages float32[N, T-1] (else one
    advantage per response); its registered `level` says."""
    return estimators.get(algo.advantage).token_level(algo)


def shaped_advantages(rewards: jax.Array, response_mask: jax.Array, old_logp=None, ref_logp=None,
                      *, loss_cfg, algo, group_size: int, beta=None):
    """(shaped, advantages) of one rollout.

    rewards: float32[R] task rewards (R = B * G, query-major);
    response_mask: bool[R, T-1]; old_logp, ref_logp: float32[R, T-1] sampling and
      reference log-probs of the response tokens, or None when the Policy-KL
      penalty is not in the reward.
    loss_cfg: LossConfig; algo: the run's AlgoSection (advantage, adv_eps,
      gamma, reinforce_pp_whiten).
    beta: the penalty's coefficient when it is not loss_cfg.beta_policy (the
      adaptive controller's current value, a float32[]).
    shaped: float32[R] (outcome estimators) or float32[R, T-1] (token level),
      the rewards the estimator saw. advantages: float32[R] or float32[R, T-1];
      None for an estimator with a critic (gae), whose advantages need the
      critic's values (`advantages.gae` on `shaped`).
    """
    est = estimators.get(algo.advantage)
    token = est.token_level(algo)
    m = response_mask.astype(bool)
    r = jnp.asarray(rewards, jnp.float32)
    if old_logp is not None:
        shaped = kl_penalized_rewards(r, old_logp, ref_logp, m,
                                      loss_cfg.beta_policy if beta is None else beta,
                                      loss_cfg.policy_kl_estimator, loss_cfg.kl_clamp,
                                      token_level=token)
    else:
        shaped = adv_lib.outcome_to_token_rewards(r, m) if token else r
    if est.needs_critic:
        return shaped, None
    return shaped, est.advantages(shaped, m, algo, group_size)


def per_response(shaped: jax.Array) -> jax.Array:
    """float32[R]: each response's total shaped reward (a token-level array summed)."""
    return shaped if shaped.ndim == 1 else jnp.sum(shaped, axis=-1)
