"""The train state, the optimizer, and the one pure jitted update.

`update(state, batch, extras) -> (state, metrics)` takes one mini-batch of
whole groups, splits it into micro-batches, accumulates their gradients with
`lax.scan`, clips, and applies AdamW, all inside one jitted function with the
state donated. Accumulation is exact: each micro-batch's terms are weighted by
its share of each term's normaliser (response tokens for token-mean, sequences
for sequence means, queries for Query-KL), so the accumulated gradient equals
the gradient of the full mini-batch loss.

A non-finite loss or gradient skips the update (parameters and optimizer
state untouched) and increments `state.nonfinite`; the host loop aborts after
K in a row.
"""

from __future__ import annotations

import functools
from typing import Any

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np
import optax

from erpo_jax.runtime import xla_options
from erpo_jax.model import lora
from erpo_jax.model import model as model_lib
from erpo_jax.model.config import ModelConfig
from erpo_jax.model.logprobs import token_logprobs
from erpo_jax.model.sharding import Sharding
from erpo_jax.rl import critic as critic_lib
from erpo_jax.rl import kl_control
from erpo_jax.rl.batch import RLBatch
from erpo_jax.rl.loss import LossConfig, loss_selection, loss_terms
from erpo_jax.rl.policy_losses import get_policy_loss
from erpo_jax.rl.terms import TERMS
from erpo_jax.rl.terms import pg as pg_term
from erpo_jax.train.config import AlgoSection, OptimSection


def trainable(params, model_cfg: ModelConfig):
    """What the update trains of the policy's parameters: all of them, or with
    LoRA (`model_cfg.lora_rank`) the adapters alone (model/lora.py)."""
    return lora.adapters(params) if model_cfg.lora_rank else params


def with_trainable(params, new, model_cfg: ModelConfig):
    """The policy's parameters with their trainable part replaced by `new`."""
    return lora.attach(lora.base(params), new) if model_cfg.lora_rank else new


@flax.struct.dataclass
class TrainState:
    """Everything an update changes. critic / critic_opt are None unless PPO;
    kl_coef is None unless the Policy-KL coefficient is adaptive
    (`loss.kl_target`, rl/kl_control.py). params: the whole policy, base
    included under LoRA; opt_state: of its `trainable` part only."""

    step: jax.Array  # int32[] optimizer updates applied so far
    params: Any
    opt_state: Any
    critic: Any = None
    critic_opt: Any = None
    nonfinite: jax.Array = None  # int32[] consecutive skipped updates
    skipped: jax.Array = None  # int32[] skipped updates in total
    kl_coef: jax.Array = None  # float32[] the adaptive Policy-KL coefficient


def make_optimizer(o: OptimSection, total_updates: int, lr: float | None = None):
    """optax AdamW with warmup and a constant or cosine schedule, after global-norm clipping."""
    peak = o.lr if lr is None else lr
    warm = max(int(o.warmup_steps), 0)
    if o.schedule == "cosine":
        sched = optax.warmup_cosine_decay_schedule(0.0, peak, max(warm, 1) if warm else 1,
                                                   max(total_updates, warm + 1), 0.0)
    elif warm:
        sched = optax.join_schedules([optax.linear_schedule(0.0, peak, warm),
                                      optax.constant_schedule(peak)], [warm])
    else:
        sched = optax.constant_schedule(peak)
    tx = optax.chain(optax.clip_by_global_norm(o.max_grad_norm) if o.max_grad_norm > 0
                     else optax.identity(),
                     optax.adamw(sched, b1=o.b1, b2=o.b2, weight_decay=o.weight_decay))
    return tx, sched


def init_state(params, tx, critic_params=None, critic_tx=None,
               sharding: Sharding | None = None, shardings=None,
               kl_coef: float | None = None, model_cfg: ModelConfig | None = None
               ) -> TrainState:
    """A fresh state; optimizer moments are created by a jitted init, so they
    inherit the parameters' shardings (nothing is built unsharded). Counters
    are replicated over the mesh of `sharding`. shardings: the TrainState's
    shardings to commit to (`Programs.state_shardings`, what the update's
    program was built for); default: where the leaves were made. kl_coef:
    the adaptive Policy-KL coefficient's initial value (None: not adaptive).
    model_cfg: with LoRA, the optimizer's state is of the adapters only."""
    where = sharding.replicated() if sharding is not None else None
    # Distinct buffers (the state is donated), placed with the parameters.
    zero = lambda: jax.device_put(np.zeros((), np.int32), where)
    def on_mesh(tree):  # constants (Adam's step count, a fresh head) sit on one device
        if where is None:
            return tree
        return jax.tree_util.tree_map(
            lambda x: x if isinstance(x.sharding, jax.sharding.NamedSharding)
            else jax.device_put(np.asarray(x), where), tree)

    critic_params = on_mesh(critic_params)
    once = xla_options.for_once()
    init_opt = lambda tx, p: on_mesh(jax.jit(tx.init, compiler_options=once)(p))
    state = TrainState(
        step=zero(), params=params,
        opt_state=init_opt(tx, params if model_cfg is None else trainable(params, model_cfg)),
        critic=critic_params,
        critic_opt=None if critic_params is None else init_opt(critic_tx, critic_params),
        nonfinite=zero(), skipped=zero(),
        kl_coef=None if kl_coef is None else jax.device_put(np.float32(kl_coef), where))
    # Commit every leaf to its sharding now, so the first update compiles once
    # (its outputs carry these shardings; uncommitted inputs would retrace).
    return jax.device_put(state, shardings_of(state) if shardings is None else shardings)


@flax.struct.dataclass
class CriticBatch:
    """PPO critic targets, float32[N, T-1]: values at rollout time and GAE returns."""

    old_values: jax.Array
    returns: jax.Array


def _normaliser_counts(batch: RLBatch, loss_cfg: LossConfig):
    """{normaliser: float32[]} for this (micro-)batch: 'response', what the
    aggregation mode divides by; 'query', the distinct queries."""
    rm = batch.response_mask.astype(bool)
    if loss_cfg.agg_mode == "token_mean":
        resp = jnp.sum(rm)
    elif loss_cfg.agg_mode == "seq_mean_token_mean":
        resp = jnp.sum(jnp.any(rm, axis=-1))
    else:  # seq_sum_norm divides by the number of rows
        resp = jnp.asarray(rm.shape[0])
    has_q = jnp.any(batch.query_mask, axis=-1).astype(jnp.float32)
    queries = jax.ops.segment_max(has_q, batch.group_id, num_segments=rm.shape[0])
    queries = jnp.sum(jnp.maximum(queries, 0.0))
    return {"response": resp.astype(jnp.float32), "query": queries}


def _term_counts(batch: RLBatch, loss_cfg: LossConfig):
    """The normaliser of each registered loss term for this (micro-)batch, float32[]."""
    counts = _normaliser_counts(batch, loss_cfg)
    return {name: counts[term.normaliser] for name, term in TERMS.items()}


def _finite(tree) -> jax.Array:
    leaves = jax.tree_util.tree_leaves(tree)
    return jnp.all(jnp.stack([jnp.all(jnp.isfinite(x)) for x in leaves]))


def _select(pred, a, b):
    return jax.tree_util.tree_map(lambda x, y: jnp.where(pred, x, y), a, b)


def _split_micro(tree, n: int):
    return jax.tree_util.tree_map(
        lambda x: None if x is None else x.reshape((n, x.shape[0] // n) + x.shape[1:]), tree)


def build_update(model_cfg: ModelConfig, loss_cfg: LossConfig, algo: AlgoSection, tx,
                 critic_tx=None, *, micro_batches: int = 1, group_size: int = 1,
                 temperature: float = 1.0, chunk_size: int | None = 512,
                 sharding: Sharding | None = None, state_shardings=None,
                 nan_injector=None, schedule=None, response_width: int | None = None,
                 share_query: bool = False, seed: int = 0):
    """The jitted `update(state, batch, critic_batch) -> (state, metrics)`.

    batch: RLBatch of N rows (whole groups of `group_size`, query-major);
    critic_batch: CriticBatch or None (PPO only). The state is donated.
    nan_injector: test hook, a function grads -> grads applied before the check.
    schedule: the optimizer's learning-rate schedule; with it the metrics
    carry `lr`, the rate this update applied (so the host reads every number
    of a step in one transfer). The metrics also carry the state's skip
    counters after the update: `skipped_total`, `nonfinite_in_a_row`.
    response_width: N, when every batch has the rollout layout with N response
      slots (`validate_batch(..., response_width=N)` checks it): the log-prob
      pass then scores query columns at temperature 1 and response columns at
      the sampling temperature only (`token_logprobs(response_columns=N)`).
    share_query: with `response_width`, run each group's query through the
      model once per micro-batch instead of once per row
      (`token_logprobs(group_size=group_size)`): every batch's groups must
      repeat their query (`validate_batch(..., group_size=G)` checks it).
    seed: the run's seed, for a loss that draws (loss.pg_loss='clip_cov'):
      the update at optimizer step s draws over its whole mini-batch with
      fold_in(key(seed), s), so a resumed run draws the same, and so does a
      run with other micro_batches.
    A policy loss with a token selection (clip_cov, kl_cov) selects over the
    whole mini-batch: with micro_batches > 1 the update first runs a
    gradient-free forward over every micro-batch for it (one more forward
    per update; none with one micro-batch).
    With `loss.kl_target` the state's kl_coef is the Policy-KL coefficient
    and is adapted after the update (rl/kl_control.py); metrics `kl_coef`
    (the value this update used) and `kl_coef_next`.
    Metrics are the micro-batches' means, except the sampler/trainer
    mismatch's (`mismatch/*`, rl/terms/pg.py) and
    `rollout_correction_masked_frac`: token means over the whole mini-batch's
    response tokens, and its largest per-sequence |sum log r|.
    """
    if share_query and response_width is None:
        raise ValueError("build_update: share_query needs response_width (the query is the "
                         "columns before the response).")
    query_group = group_size if share_query else 1
    n_micro = micro_batches
    # Gradients (and their accumulator) sharded as the parameters, not left to
    # the partitioner, which may replicate them (a full float32 copy per chip).
    param_sh = (None if state_shardings is None
                else trainable(state_shardings.params, model_cfg))
    like_params = ((lambda g: g) if param_sh is None
                   else (lambda g: jax.lax.with_sharding_constraint(g, param_sh)))
    # With LoRA the gradient is taken of the adapters alone: the base enters
    # the loss as a constant (no gradient, accumulator or optimizer state).
    part = lambda p: trainable(p, model_cfg)
    whole = lambda frozen, t: lora.attach(frozen, t) if model_cfg.lora_rank else t

    adaptive, draws = loss_cfg.adaptive_kl, loss_cfg.needs_key
    # A policy loss that selects tokens by a statistic of the batch selects
    # over the whole mini-batch (policy_losses.base): with several
    # micro-batches, from a gradient-free forward of all of them first.
    selects = get_policy_loss(loss_cfg.pg_loss).select is not None and n_micro > 1

    def stats_of(params, mb: RLBatch):
        return token_logprobs(params, model_cfg, mb.tokens, mb.attn_mask,
                              temperature=temperature, chunk_size=chunk_size,
                              sharding=sharding, response_columns=response_width,
                              group_size=query_group)

    def micro_loss(params, frozen, mb: RLBatch, shares, coef, key, selected):
        terms, metrics = loss_terms(stats_of(whole(frozen, params), mb), mb, loss_cfg,
                                    coef=coef, key=key, selected=selected)
        loss = sum(shares[k] * terms[k] for k in terms)
        return loss, (terms, metrics)

    def mini_batch_selection(params, batch: RLBatch, micro: RLBatch, coef, key):
        """bool[n_micro, m, T-1]: the policy loss's selection over the whole mini-batch."""
        stats = jax.lax.map(lambda mb: stats_of(jax.lax.stop_gradient(params), mb), micro)
        whole = jax.tree_util.tree_map(lambda x: x.reshape((-1,) + x.shape[2:]), stats)
        sel = loss_selection(whole, batch, loss_cfg, coef=coef, key=key)
        return sel.reshape(micro.response_mask.shape)

    def update(state: TrainState, batch: RLBatch, critic_batch):
        # Each micro-batch differentiates the compute-dtype copy of the
        # parameters its forward reads anyway (every weight is cast before
        # use; XLA hoists those casts out of the loop), so its gradient is
        # held in that dtype (for bfloat16, half the float32 bytes) and only
        # the accumulator is float32. The numbers are the same: the gradient
        # of a cast weight is a compute-dtype array. The embedding table keeps
        # its dtype: its gradient is a scatter-add over tokens, which a
        # bfloat16 accumulation would round.
        compute_params = {**model_lib.in_compute_dtype(state.params, model_cfg),
                          "embed": state.params["embed"]}
        # LoRA: the frozen base (compute dtype) and the float32 adapters apart.
        frozen = lora.base(compute_params) if model_cfg.lora_rank else None
        train_params = part(state.params) if model_cfg.lora_rank else compute_params
        N = batch.tokens.shape[0]
        m = N // n_micro
        gid = (jnp.arange(m, dtype=jnp.int32) // group_size)
        micro = _split_micro(batch._replace(group_id=jnp.zeros((N,), jnp.int32)), n_micro)
        micro = micro._replace(group_id=jnp.broadcast_to(gid, (n_micro, m)))
        counts = jax.vmap(lambda b: _term_counts(b, loss_cfg))(micro)
        totals = {k: jnp.maximum(jnp.sum(v), 1.0) for k, v in counts.items()}
        cb = _split_micro(critic_batch, n_micro) if critic_batch is not None else None
        coef = {"beta_policy": state.kl_coef} if adaptive else None
        # One key per mini-batch: the selection is the whole mini-batch's.
        step_key = (jax.random.fold_in(jax.random.key(seed), state.step) if draws else None)
        selected = (mini_batch_selection(compute_params, batch, micro, coef, step_key)
                    if selects else None)

        def body(acc, xs):
            mb, cnt, cmb, sel = xs
            shares = {k: cnt[k] / totals[k] for k in cnt}
            (loss, (terms, metrics)), g = jax.value_and_grad(micro_loss, has_aux=True)(
                train_params, frozen, mb, shares, coef, step_key, sel)
            g = like_params(g)
            grads = jax.tree_util.tree_map(jnp.add, acc["grads"], g)
            out = {"grads": grads, "loss": acc["loss"] + loss}
            if cmb is not None:
                (vl, vmet), cg = jax.value_and_grad(critic_lib.critic_loss_fn, has_aux=True)(
                    state.critic, model_cfg, mb.tokens, mb.attn_mask, mb.response_mask,
                    cmb.old_values, cmb.returns, algo.value_clip)
                out["critic_grads"] = jax.tree_util.tree_map(jnp.add, acc["critic_grads"],
                                                             jax.tree_util.tree_map(
                                                                 lambda x: x / n_micro, cg))
                metrics = {**metrics, **vmet}
            return out, (metrics, terms)

        acc0 = {"grads": like_params(jax.tree_util.tree_map(jnp.zeros_like,
                                                            part(state.params))),
                "loss": jnp.zeros((), jnp.float32)}
        if critic_batch is not None:
            acc0["critic_grads"] = jax.tree_util.tree_map(jnp.zeros_like, state.critic)
        acc, (metrics, terms) = jax.lax.scan(body, acc0, (micro, counts, cb, selected))
        grads = acc["grads"]
        if nan_injector is not None:
            grads = nan_injector(grads)
        grad_norm = optax.tree.norm(grads)
        ok = jnp.isfinite(acc["loss"]) & jnp.isfinite(grad_norm)
        trained = part(state.params)
        updates, new_opt = tx.update(grads, state.opt_state, trained)
        params = with_trainable(state.params, _select(ok, optax.apply_updates(trained, updates),
                                                      trained), model_cfg)
        opt_state = _select(ok, new_opt, state.opt_state)
        critic, critic_opt = state.critic, state.critic_opt
        out_metrics = {k: jnp.mean(v) for k, v in metrics.items()}
        # Over the whole mini-batch: token means weighted by each micro-batch's
        # response tokens, maxima as maxima (the sampler/trainer mismatch, pg.py).
        toks = metrics["response_tokens"]
        out_metrics.update({k: jnp.sum(metrics[k] * toks) / jnp.maximum(jnp.sum(toks), 1.0)
                            for k in pg_term.TOKEN_MEAN_METRICS if k in metrics})
        out_metrics.update({k: jnp.max(metrics[k]) for k in pg_term.MAX_METRICS if k in metrics})
        # A per-micro-batch value over the whole mini-batch: each micro-batch
        # weighted by its share of term k's normaliser.
        by_share = lambda v, k: jnp.sum(v * counts[k] / totals[k])
        out_metrics.update({f"term_{k}": by_share(v, k) for k, v in terms.items()})
        if critic_batch is not None:
            cgrads = acc["critic_grads"]
            c_ok = _finite(cgrads)
            cu, new_copt = critic_tx.update(cgrads, state.critic_opt, state.critic)
            critic = _select(ok & c_ok, optax.apply_updates(state.critic, cu), state.critic)
            critic_opt = _select(ok & c_ok, new_copt, state.critic_opt)
            out_metrics["critic_grad_norm"] = optax.tree.norm(cgrads)
        out_metrics.update(loss=acc["loss"], grad_norm=grad_norm,
                           update_skipped=(~ok).astype(jnp.float32))
        kl_coef = state.kl_coef
        if adaptive:   # the update's Policy-KL, each micro-batch by its share of the tokens
            kl = by_share(metrics["policy_kl"], "policy_kl")
            nxt = kl_control.adapt(state.kl_coef, kl, N, loss_cfg.kl_target, loss_cfg.kl_horizon)
            kl_coef = jnp.where(ok, nxt, state.kl_coef)
            out_metrics.update(kl_coef=state.kl_coef, kl_coef_next=kl_coef)
        if schedule is not None:   # optax counts applied updates as state.step does
            out_metrics["lr"] = jnp.asarray(schedule(state.step), jnp.float32)
        new_state = TrainState(
            step=state.step + ok.astype(jnp.int32), params=params, opt_state=opt_state,
            critic=critic, critic_opt=critic_opt,
            nonfinite=jnp.where(ok, 0, state.nonfinite + 1),
            skipped=state.skipped + (~ok).astype(jnp.int32), kl_coef=kl_coef)
        out_metrics.update(skipped_total=new_state.skipped, nonfinite_in_a_row=new_state.nonfinite)
        if state_shardings is not None:
            new_state = jax.lax.with_sharding_constraint(new_state, state_shardings)
        return new_state, out_metrics

    return jax.jit(update, donate_argnums=(0,), compiler_options=xla_options.for_steps())


def shardings_of(tree):
    """The shardings of a pytree of arrays (None leaves stay None)."""
    return jax.tree_util.tree_map(lambda x: x.sharding, tree)


@functools.lru_cache(maxsize=None)
def make_logprob_fn(model_cfg: ModelConfig, temperature: float, chunk_size: int | None,
                    sharding: Sharding | None = None, row_chunks: int = 1,
                    group_size: int = 1):
    """Jitted (params, tokens, mask, last=None) -> logp float32[N, T-1] at
    `temperature` (the reference's response log-probs for Policy-KL).
    last (static): score only the last `last` predictions, a rollout's
    response columns; the others are 0 (see `token_logprobs`).
    row_chunks: run the rows in this many equal chunks, one after another
    (as the update runs its micro-batches), when it divides N; the numbers
    are the same, the program's temporary memory is about 1/row_chunks.
    group_size: G > 1 when the rows are a rollout's groups of G responses
      to one query (query-major): with `last`, each group's query runs
      through the model once (`token_logprobs(group_size=G)`), and row
      chunks hold whole groups."""
    def rows(params, tokens, mask, last, G):
        return token_logprobs(params, model_cfg, tokens, mask, temperature=temperature,
                              chunk_size=chunk_size, sharding=sharding, last=last,
                              group_size=G).logp

    def logprob_fn(params, tokens, mask, last=None):
        N = tokens.shape[0]
        G = group_size if last is not None else 1
        if N % G:
            raise ValueError(f"logprob_fn: {N} rows are not whole groups of group_size={G}.")
        n = row_chunks if row_chunks > 1 and (N // G) % row_chunks == 0 else 1
        if n == 1:
            return rows(params, tokens, mask, last, G)
        # Chunk j holds groups j, j + n, j + 2n, ... (a group is one row when
        # G is 1): with the rows sharded in blocks over a mesh, every device
        # keeps its share of every chunk.
        split = lambda x: x.reshape((N // (n * G), n, G) + x.shape[1:]).swapaxes(0, 1).reshape(
            (n, N // n) + x.shape[1:])
        out = jax.lax.map(lambda tm: rows(params, tm[0], tm[1], last, G),
                          (split(tokens), split(mask)))
        out = out.reshape((n, N // (n * G), G) + out.shape[2:]).swapaxes(0, 1)
        return out.reshape((N,) + out.shape[3:])

    return jax.jit(logprob_fn, static_argnames="last", compiler_options=xla_options.for_steps())
