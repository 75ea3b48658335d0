"""DAPO's dynamic sampling (`algo.filter_groups`): train only on groups whose
rewards vary.

A group whose G responses all got the same reward has advantages that are
exactly 0 under every group-baselined estimator: it adds no PG gradient but
still dilutes the token mean. With filtering on, the trainer samples the
step's B prompts, drops the groups with zero reward variance, and samples
further batches of B prompts from the data stream (the next positions of the
iterator, so no prompt is skipped or repeated out of order) until B groups
with varying rewards are in hand or `algo.filter_max_batches` batches were
drawn. The kept groups are taken in the order they were drawn; when the
limit leaves fewer than B, the rest of the batch is filled with the first
dropped groups (their PG term is 0; the metric `filter/short` counts them),
so a hard stretch of the data slows learning instead of stopping the run.

Filtering reads the task reward (DAPO's accuracy metric), before the
overlong shaping. The iterator position after a step is saved in its
checkpoint, so a resumed run draws the same prompts.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np

from erpo_jax.rollout.sampler import Rollout


def varied_groups(rewards, group_size: int) -> np.ndarray:
    """bool[B]: groups (of `group_size` consecutive rewards) whose rewards differ."""
    r = np.asarray(rewards).reshape(-1, group_size)
    return r.max(axis=1) != r.min(axis=1)


def concat_rollouts(rollouts: Sequence[Rollout], pad_id: int) -> Rollout:
    """One Rollout of the rows of several, prompts left-padded to the widest."""
    P = max(ro.prompt_tokens.shape[1] for ro in rollouts)

    def left_pad(x, fill):
        x = np.asarray(x)
        return np.pad(x, ((0, 0), (P - x.shape[1], 0)), constant_values=fill)

    cat = lambda xs: np.concatenate([np.asarray(x) for x in xs], axis=0)
    return Rollout(
        prompt_tokens=cat([left_pad(ro.prompt_tokens, pad_id) for ro in rollouts]),
        prompt_mask=cat([left_pad(ro.prompt_mask, False) for ro in rollouts]),
        response_tokens=cat([ro.response_tokens for ro in rollouts]),
        response_mask=cat([ro.response_mask for ro in rollouts]),
        logp=cat([ro.logp for ro in rollouts]),
        lengths=cat([ro.lengths for ro in rollouts]),
        truncated=cat([ro.truncated for ro in rollouts]),
        num_steps=max(int(np.asarray(ro.num_steps)) for ro in rollouts))


def choose_groups(varied: Sequence[np.ndarray], batch_size: int) -> tuple[list, int]:
    """([(draw, group)] of the `batch_size` groups to train on, how many of
    them have zero reward variance): varied groups in draw order, then the
    first non-varied ones when there are too few."""
    kept = [(d, g) for d, v in enumerate(varied) for g in np.flatnonzero(v)]
    if len(kept) >= batch_size:
        return kept[:batch_size], 0
    fill = [(d, g) for d, v in enumerate(varied) for g in np.flatnonzero(~v)]
    short = batch_size - len(kept)
    chosen = sorted(kept + fill[:short])   # draw order: draw, then group
    return chosen, short


def select(rollouts: Sequence[Rollout], chosen, group_size: int, pad_id: int) -> Rollout:
    """The Rollout of the `chosen` [(draw, group)] groups, in that order."""
    ro = concat_rollouts(rollouts, pad_id)
    B = len(np.asarray(rollouts[0].lengths)) // group_size
    rows = np.concatenate([np.arange(group_size) + (d * B + g) * group_size for d, g in chosen])
    return ro._replace(**{f: np.asarray(getattr(ro, f))[rows] for f in Rollout._fields
                          if f != "num_steps"})
