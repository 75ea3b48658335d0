"""The RL batch of one step, built in one place from its sampled groups.

`build_batch` takes the groups a step trains on (`dynamic_sampling.select`:
one draw, or dynamic sampling's choice among several) and returns the
RLBatch the update reads, its critic targets and its metrics:

1. the [query | response] layout, the cached reference query log-probs and
   the dataset-static per-query weights (`rollout_to_batch`);
2. the rewards: task reward plus DAPO's overlong penalty (rl/overlong.py);
3. filler groups (dynamic sampling's 'pad'): out of every mask, so they
   enter no term and no denominator;
4. the advantages: Policy-KL reward shaping (policy_kl_mode 'reward') with
   the coefficient in force (the adaptive controller's), the estimator, and
   GAE on the critic's values; filler rows get exactly 0;
5. validation (`batch.validate_batch`) and the step's batch metrics.

The Trainer (train/loop.py) and `erpo inspect-grads` both call it, so the
inspector's batch is the run's batch; the Trainer only schedules around it
(the reference forward overlapping the scoring, the draws, the timing).
Every device program it runs comes from the run's `Programs` (advantages,
critic values), passed in, so both callers run the same programs.
"""

from __future__ import annotations

import dataclasses
from typing import Callable

import jax.numpy as jnp
import numpy as np

from erpo_jax.rl import advantages as adv_lib
from erpo_jax.rl.batch import RLBatch, group_ids, masks_from_layout, validate_batch
from erpo_jax.rl.dynamic_sampling import Selected
from erpo_jax.rl.overlong import overlong_penalty
from erpo_jax.rl.shaping import per_response


def rollout_to_batch(ro, advantages, query_index, ref_cache, weights, group_size,
                     ref_logp=None) -> RLBatch:
    """The RLBatch (numpy) of one rollout: [query | response] rows, T = P + N."""
    P = ro.prompt_tokens.shape[1]
    tokens = np.concatenate([ro.prompt_tokens, ro.response_tokens], axis=1).astype(np.int32)
    attn = np.concatenate([ro.prompt_mask, ro.response_mask], axis=1).astype(bool)
    qmask, rmask = masks_from_layout(attn, P)
    old_logp = np.zeros(qmask.shape, np.float32)
    old_logp[:, P - 1:] = np.where(ro.response_mask, ro.logp, 0.0)
    rows_query = np.repeat(np.asarray(query_index), group_size)
    return RLBatch(
        tokens=tokens, attn_mask=attn, query_mask=qmask, response_mask=rmask,
        old_logp=old_logp, advantages=np.asarray(advantages, np.float32),
        ref_query_logp=ref_cache.batch_layout(rows_query, P, tokens.shape[1]),
        query_weight=np.asarray(weights, np.float32)[rows_query],
        group_id=group_ids(len(query_index), group_size), ref_logp=ref_logp)


def layout(sel: Selected, ref_cache, weights, group_size: int) -> RLBatch:
    """The selected groups' batch before advantages (what the reference
    forward reads: tokens and attention mask)."""
    return rollout_to_batch(sel.rollout, np.zeros(len(sel.rewards), np.float32), sel.idx,
                            ref_cache, weights, group_size)


@dataclasses.dataclass
class StepBatch:
    """batch: the RLBatch (numpy); critic_batch: CriticBatch or None;
    info: the step's batch metrics; rewards: float32[R] the rewards the
    advantages were computed on (task reward + overlong penalty)."""

    batch: RLBatch
    critic_batch: object
    info: dict
    rewards: np.ndarray


def build_batch(sel: Selected, cfg, recipe, *, ref_cache, weights, advantages_fn,
                ref_logp=None, kl_coef=None, values_fn: Callable | None = None,
                query_group: int = 1, base: RLBatch | None = None) -> StepBatch:
    """The step's batch of the groups `sel` (see the module docstring).

    cfg: the RunConfig; recipe: its Recipe; ref_cache / weights: the reference
    pass and the per-query weights; advantages_fn: `Programs.advantages_fn`;
    ref_logp: float32[R, T-1] host reference log-probs of the responses
    (needed when Policy-KL is on); kl_coef: the adaptive coefficient in force
    (float32[]; None: loss.beta_policy); values_fn: (tokens, attn) -> host
    float32[R, T-1] critic values (GAE); query_group: the update's query
    sharing (validation checks the rows repeat their query); base: the
    layout already made for the reference forward (`layout(sel, ...)`)."""
    from erpo_jax.train.train_step import CriticBatch
    G, a, lc = cfg.rollout.group_size, cfg.algo, cfg.loss
    ro = sel.rollout
    batch = base if base is not None else layout(sel, ref_cache, weights, G)
    task_rewards = np.asarray(sel.rewards, np.float32)
    rewards = task_rewards
    info = dict(sel.info)
    if recipe.overlong_buffer:
        penalty = overlong_penalty(ro.lengths, cfg.rollout.max_new_tokens, a.overlong_buffer,
                                   a.overlong_penalty)
        rewards = task_rewards + penalty
        info["reward/overlong_penalty_mean"] = float(np.mean(penalty))
    filler = np.repeat(np.asarray(sel.filler, bool), G)   # per row
    if filler.any():   # no term reads a filler row, no denominator counts it
        keep = ~filler[:, None]
        batch = batch._replace(query_mask=batch.query_mask & keep,
                               response_mask=batch.response_mask & keep)
    shaping = recipe.shapes_rewards
    token = (batch.old_logp, ref_logp) if shaping else (None, None)
    beta = kl_coef if recipe.adaptive_kl and shaping else None
    shaped, adv = advantages_fn(rewards.astype(np.float32), batch.response_mask, *token, beta)
    critic_batch = None
    if recipe.needs_critic:
        vals = np.asarray(values_fn(batch.tokens, batch.attn_mask), np.float32)
        adv, returns = adv_lib.gae(shaped, jnp.asarray(vals), jnp.asarray(batch.response_mask),
                                   gamma=a.gamma, lam=a.lam, whiten=True)
        critic_batch = CriticBatch(vals, np.asarray(returns, np.float32))
    adv = np.asarray(adv, np.float32)
    if filler.any():
        adv = np.where(filler if adv.ndim == 1 else filler[:, None], 0.0, adv).astype(np.float32)
    batch = batch._replace(advantages=adv, ref_logp=ref_logp)
    validate_batch(batch, needs_ref_logp=lc.policy_kl_in_loss,
                   response_width=cfg.rollout.max_new_tokens, group_size=query_group,
                   allow_empty=bool(filler.all()))
    r = task_rewards.reshape(-1, G)
    trained = batch.response_mask
    a_abs = np.abs(adv)[~filler] if adv.ndim == 1 else np.abs(adv)[trained]
    info.update({
        "advantage_abs_mean": float(a_abs.mean()) if a_abs.size else 0.0,
        "reward_mean": float(np.mean(rewards)),
        "response_len_mean": float(np.mean(ro.lengths)),
        "response_len_max": float(np.max(ro.lengths)),
        "truncated_frac": float(np.mean(ro.truncated)),
        "zero_var_group_frac": float(np.mean(r.max(axis=1) == r.min(axis=1))),
        **{f"reward/{k}": float(np.mean([x == k for x in sel.reasons]))
           for k in sorted(set(sel.reasons))},
    })
    if shaping:   # the task reward minus the Policy-KL penalty, per response
        info["reward_shaped_mean"] = float(np.mean(np.asarray(per_response(shaped))))
    return StepBatch(batch, critic_batch, info, rewards)
