"""DAPO's dynamic sampling (`algo.filter_groups`): train only on groups whose
rewards vary.

A group whose G responses all got the same task reward has advantages that
are exactly 0 under every group-baselined estimator: it adds no PG gradient
but would dilute the token mean. With filtering on, a step samples its B
prompts, drops the groups with zero reward variance, and samples further
batches of B prompts from the data stream (the next positions of the
iterator, so no prompt is skipped or repeated out of order) until B groups
with varying rewards are in hand, as DAPO (Yu et al., 2025) and verl's recipe
do. Draw d of a step samples iterator position first + d with the key
fold_in(step key, d) (draw 0 keeps the step key, what a run without
filtering samples).

The bound. `algo.filter_max_batches` (default 10, verl's recipe) caps the
draws of one step; 0 means no cap, but never more than one pass over the
training set in a step. Reaching the bound short of B varied groups follows
`algo.filter_on_short`:
- 'error' (the default, as DAPO): the run stops with a sentence naming the
  step, the varied groups found and the fields to change; the Trainer saves
  the last finished step first, so nothing is lost.
- 'pad': the batch is filled with the first flat groups (draw order). A
  filler group carries no signal: the assembly (rl/assemble.py) gives its
  rows advantage exactly 0 and takes them out of every mask, so they enter
  no term and no denominator, whatever shaping is on (the overlong penalty
  varies inside a flat group; DAPO never trains on one). `filter/short`
  counts them.

Filtering reads the task reward (DAPO's accuracy metric), before the
overlong shaping. The iterator position after a step is saved in its
checkpoint, so a resumed run draws the same prompts.
"""

from __future__ import annotations

import dataclasses
from typing import Callable, Sequence

import jax
import numpy as np

from erpo_jax.rollout.types import Rollout

ON_SHORT = ("error", "pad")


@dataclasses.dataclass
class Draw:
    """One batch of prompts, sampled and scored.

    rollout: its Rollout (B * G rows); idx: int[B] the prompts' indices in the
    training set; rewards: float32[B * G] task rewards; reasons: each
    response's reward reason; stats: the engine's `last_stats` for it.
    """

    rollout: Rollout
    idx: np.ndarray
    rewards: np.ndarray
    reasons: list
    stats: dict


class ShortBatch(ValueError):
    """Dynamic sampling reached its bound short of train.batch_size varied
    groups, with algo.filter_on_short='error'."""


def varied_groups(rewards, group_size: int) -> np.ndarray:
    """bool[B]: groups (of `group_size` consecutive rewards) whose rewards differ."""
    r = np.asarray(rewards).reshape(-1, group_size)
    return r.max(axis=1) != r.min(axis=1)


def max_draws(algo, batches_per_epoch: int) -> int:
    """The most batches one step draws: algo.filter_max_batches, or with 0
    (no cap) one pass over the training set."""
    return algo.filter_max_batches or max(batches_per_epoch, 1)


def draw_step(sample_and_score: Callable[[np.ndarray, jax.Array], Draw],
              batch_at: Callable[[int], np.ndarray], first: int, key: jax.Array, *,
              filter_groups: bool, batch_size: int, group_size: int, limit: int,
              first_idx=None) -> list[Draw]:
    """The draws of one RL step: one, or with `filter_groups` as many as it
    takes to hold `batch_size` varied groups, at most `limit`.

    sample_and_score(idx, key) -> Draw samples and scores prompts `idx`;
    batch_at(position) gives the prompts at an iterator position; first: the
    step's first position; key: the step's rollout key. first_idx: the first
    draw's prompts when the caller already has them (batch_at(first))."""
    draws: list[Draw] = []
    while True:
        d = len(draws)
        idx = first_idx if d == 0 and first_idx is not None else batch_at(first + d)
        draws.append(sample_and_score(np.asarray(idx), key if d == 0
                                      else jax.random.fold_in(key, d)))
        if not filter_groups:
            return draws
        n_varied = sum(int(varied_groups(x.rewards, group_size).sum()) for x in draws)
        if n_varied >= batch_size or len(draws) >= limit:
            return draws


def choose_groups(varied: Sequence[np.ndarray], batch_size: int) -> tuple[list, int]:
    """([(draw, group)] of the `batch_size` groups to train on, how many of
    them are filler (zero reward variance)): varied groups in draw order,
    then, when there are too few, the first non-varied ones in draw order."""
    kept = [(d, g) for d, v in enumerate(varied) for g in np.flatnonzero(v)]
    if len(kept) >= batch_size:
        return kept[:batch_size], 0
    fill = [(d, g) for d, v in enumerate(varied) for g in np.flatnonzero(~v)]
    short = batch_size - len(kept)
    chosen = sorted(kept + fill[:short])   # draw order: draw, then group
    return chosen, short


@dataclasses.dataclass
class Selected:
    """The B groups a step trains on.

    rollout: their Rollout (B * G rows, query-major); idx: int[B] prompt
    indices; rewards: float32[B * G] task rewards; reasons; filler: bool[B],
    groups kept only to fill the batch (no signal); info: the step's sampling
    metrics (prompts sampled, accuracy over every draw, the engine's
    statistics summed over the draws, and the filter's counts).
    """

    rollout: Rollout
    idx: np.ndarray
    rewards: np.ndarray
    reasons: list
    filler: np.ndarray
    info: dict


def select(draws: Sequence[Draw], algo, *, batch_size: int, group_size: int, pad_id: int,
           step: int) -> Selected:
    """The batch of a step's draws (one draw without filtering: all of it).

    With algo.filter_groups: the varied groups in draw order, and when the
    draws hold fewer than `batch_size`, per algo.filter_on_short: ShortBatch
    ('error', a sentence naming the step, the groups found and the fields),
    or filler groups ('pad')."""
    G, B = group_size, batch_size
    info = {"rollout/prompts_sampled": float(len(draws) * B),   # every process's
            "accuracy": float(np.mean(np.concatenate([d.rewards for d in draws]) == 1.0)),
            **{f"rollout/{k}": v for k, v in engine_stats(draws).items()}}
    if not algo.filter_groups:
        (d,) = draws
        return Selected(d.rollout, np.asarray(d.idx), np.asarray(d.rewards, np.float32),
                        list(d.reasons), np.zeros(len(d.idx), bool), info)
    varied = [varied_groups(d.rewards, G) for d in draws]
    n_varied = sum(int(v.sum()) for v in varied)
    chosen, short = choose_groups(varied, B)
    if short and algo.filter_on_short == "error":
        bound = (f"algo.filter_max_batches={algo.filter_max_batches}" if algo.filter_max_batches
                 else "one pass over the training set (algo.filter_max_batches=0)")
        raise ShortBatch(
            f"dynamic sampling found {n_varied} groups with varying rewards of the "
            f"train.batch_size={B} step {step + 1} needs, in {len(draws)} batches of prompts "
            f"({bound}); raise algo.filter_max_batches (0: no cap), or set "
            "algo.filter_on_short=pad to fill the batch with flat groups that carry no signal.")
    rows = lambda g: slice(g * G, (g + 1) * G)
    ro = concat_chosen([d.rollout for d in draws], chosen, G, pad_id)
    filler_set = set()
    if short:
        filler_set = {dg for dg in chosen if not varied[dg[0]][dg[1]]}
    info.update({"filter/batches": float(len(draws)), "filter/varied_groups": float(n_varied),
                 "filter/short": float(short)})
    return Selected(
        ro, np.asarray([draws[d].idx[g] for d, g in chosen]),
        np.concatenate([np.asarray(draws[d].rewards, np.float32)[rows(g)] for d, g in chosen]),
        [x for d, g in chosen for x in draws[d].reasons[rows(g)]],
        np.asarray([(d, g) in filler_set for d, g in chosen], bool), info)


def engine_stats(draws: Sequence[Draw]) -> dict:
    """The engine's statistics over every draw of a step: decode steps
    summed, slot utilisation as the useful tokens of all draws over all
    their slot steps (what one rollout's numbers mean, for the whole step)."""
    stats = [d.stats for d in draws if d.stats]
    if not stats:
        return {}
    if len(stats) == 1:
        return dict(stats[0])
    out = {}
    if all("decode_steps" in s for s in stats):
        out["decode_steps"] = int(sum(s["decode_steps"] for s in stats))
    if all("slot_steps" in s and "useful_tokens" in s for s in stats):
        slot = sum(s["slot_steps"] for s in stats)
        useful = sum(s["useful_tokens"] for s in stats)
        out.update(slot_steps=int(slot), useful_tokens=int(useful),
                   slot_utilization=useful / slot if slot else 1.0)
    return out


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


def concat_chosen(rollouts: Sequence[Rollout], chosen, group_size: int, pad_id: int) -> Rollout:
    """The Rollout of the `chosen` [(draw, group)] groups, in that order."""
    ro = concat_rollouts(rollouts, pad_id)
    B = len(np.asarray(rollouts[0].lengths)) // group_size
    rows = np.concatenate([np.arange(group_size) + (d * B + g) * group_size for d, g in chosen])
    return ro._replace(**{f: np.asarray(getattr(ro, f))[rows] for f in Rollout._fields
                          if f != "num_steps"})
