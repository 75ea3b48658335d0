"""One jittable loss for every variant (GRPO + Policy-KL, no KL, ERPO, PPO, REINFORCE...).

    L = agg(w[query] * pg[t])                     clipped PG surrogate, per-query weight
      + beta_policy  * agg(k(logp_ref - logp))    Policy-KL, response positions
      + beta_query   * QKL                        Query-KL, query positions, temperature 1
      - entropy_coef * agg(entropy[t])

`agg` runs over response positions only, in one of three modes:
  token_mean            sum over all response tokens / their count
  seq_mean_token_mean   mean over rows (with >= 1 response token) of each row's token mean
  seq_sum_norm          sum over all response tokens / (N * seq_sum_norm_const)  (Dr. GRPO)

The core `loss_from_stats` works on per-token statistics (TokenLogprobs), so
the gradient with respect to the logits can be taken by building the
statistics from logits (`stats_from_logits`); `loss_fn` makes the one policy
forward pass with `token_logprobs` and calls it. Every term reads the policy
statistics through `where(mask, ...)`, so each term's gradient is exactly 0.0
at the positions it does not own (PG, Policy-KL and entropy: query and
padding positions; Query-KL: response and padding positions).

Denominators are guarded, so the jitted path stays finite on a batch without
response tokens; `batch.validate_batch` rejects such a batch on the host.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from erpo_jax.model.logprobs import TokenLogprobs, logprobs_from_logits, token_logprobs
from erpo_jax.rl.batch import RLBatch  # noqa: F401  (re-exported: the loss's input)
from erpo_jax.rl.kl import ESTIMATORS as KL_ESTIMATORS
from erpo_jax.rl.kl import LOG_RATIO_LIMIT, kl_estimate
from erpo_jax.rl.query_kl import check_loss_estimator, query_kl

AGG_MODES = ("token_mean", "seq_mean_token_mean", "seq_sum_norm")
POLICY_KL_MODES = ("loss", "reward")
TERMS = ("pg", "policy_kl", "query_kl", "entropy")


@dataclasses.dataclass(frozen=True)
class LossConfig:
    """Coefficients and switches of the loss (hashable: a static jit argument).

    eps_low, eps_high: the ratio is clipped to [1 - eps_low, 1 + eps_high].
    dual_clip: None, or c > 1: for negative advantages the per-token loss is
      capped at c * |A| (dual-clip PPO).
    beta_policy: Policy-KL coefficient; 0 means reference response log-probs
      are neither needed nor read.
    policy_kl_estimator: 'k1', 'k2' or 'k3' on response positions.
    policy_kl_mode: 'loss' (the term above) or 'reward' (the trainer subtracts
      beta_policy * k from the rewards with `kl.kl_penalized_rewards`; the
      loss then has no Policy-KL term).
    beta_query: Query-KL coefficient (ERPO: > 0).
    query_kl_estimator: 'k3' (default) or 'k2'; k1 is monitoring only.
    kl_clamp: optional clamp of per-token KL values (both KL terms).
    entropy_coef: coefficient of the entropy bonus.
    agg_mode: one of AGG_MODES; seq_sum_norm_const is the constant of
      'seq_sum_norm' (e.g. the maximum response length).
    """

    eps_low: float = 0.2
    eps_high: float = 0.2
    dual_clip: float | None = None
    beta_policy: float = 0.0
    policy_kl_estimator: str = "k3"
    policy_kl_mode: str = "loss"
    beta_query: float = 0.0
    query_kl_estimator: str = "k3"
    kl_clamp: float | None = None
    entropy_coef: float = 0.0
    agg_mode: str = "token_mean"
    seq_sum_norm_const: float | None = None

    def __post_init__(self):
        self.validate()

    def validate(self) -> None:
        """Raise ValueError with a sentence naming the field when inconsistent."""
        if not 0.0 <= self.eps_low < 1.0:
            raise ValueError(f"LossConfig.eps_low must be in [0, 1), got {self.eps_low}.")
        if not self.eps_high >= 0.0:
            raise ValueError(f"LossConfig.eps_high must be >= 0, got {self.eps_high}.")
        if self.dual_clip is not None and not self.dual_clip > 1.0:
            raise ValueError(f"LossConfig.dual_clip must be None or > 1, got {self.dual_clip}.")
        for name in ("beta_policy", "beta_query", "entropy_coef"):
            if getattr(self, name) < 0:
                raise ValueError(f"LossConfig.{name} must be >= 0, got {getattr(self, name)}.")
        if self.policy_kl_estimator not in KL_ESTIMATORS:
            raise ValueError(f"LossConfig.policy_kl_estimator is {self.policy_kl_estimator!r}; "
                             f"choose one of {sorted(KL_ESTIMATORS)}.")
        if self.policy_kl_mode not in POLICY_KL_MODES:
            raise ValueError(f"LossConfig.policy_kl_mode is {self.policy_kl_mode!r}; choose one "
                             f"of {POLICY_KL_MODES}.")
        try:
            check_loss_estimator(self.query_kl_estimator)
        except ValueError as e:
            raise ValueError(f"LossConfig.{e}") from None
        if self.kl_clamp is not None and not self.kl_clamp > 0:
            raise ValueError(f"LossConfig.kl_clamp must be None or > 0, got {self.kl_clamp}.")
        if self.agg_mode not in AGG_MODES:
            raise ValueError(
                f"LossConfig.agg_mode is {self.agg_mode!r}; choose one of {AGG_MODES}.")
        if self.agg_mode == "seq_sum_norm":
            if self.seq_sum_norm_const is None or not self.seq_sum_norm_const > 0:
                raise ValueError("LossConfig.seq_sum_norm_const must be a positive constant (e.g. "
                                 "the maximum response length) when agg_mode='seq_sum_norm', "
                                 f"got {self.seq_sum_norm_const}.")

    @property
    def policy_kl_in_loss(self) -> bool:
        return self.beta_policy > 0 and self.policy_kl_mode == "loss"

    @property
    def needs_ref_logp(self) -> bool:
        """Whether the trainer must run the reference over the responses."""
        return self.beta_policy > 0


def stats_from_logits(logits: jax.Array, targets: jax.Array, temperature=1.0) -> TokenLogprobs:
    """TokenLogprobs float32[N, T-1] from logits [N, T-1, V] and targets int[N, T-1].

    The same statistics `token_logprobs` returns, but as a function of an
    explicit logits tensor, for gradients with respect to the logits.
    """
    logp, ent = logprobs_from_logits(logits, targets, temperature)
    logp_t1 = logprobs_from_logits(logits, targets, 1.0)[0]
    return TokenLogprobs(logp, ent, logp_t1)


def aggregate(x: jax.Array, mask: jax.Array, mode: str, norm_const: float | None = None):
    """float32[] aggregate of per-token x float32[N, T-1] over mask bool[N, T-1]."""
    m = mask.astype(bool)
    x = jnp.where(m, x, 0.0)
    if mode == "token_mean":
        return jnp.sum(x) / jnp.maximum(jnp.sum(m), 1).astype(jnp.float32)
    if mode == "seq_mean_token_mean":
        lens = jnp.sum(m, axis=-1)
        row = jnp.sum(x, axis=-1) / jnp.maximum(lens, 1).astype(jnp.float32)
        return jnp.sum(row) / jnp.maximum(jnp.sum(lens > 0), 1).astype(jnp.float32)
    if mode == "seq_sum_norm":
        return jnp.sum(x) / (x.shape[0] * norm_const)
    raise ValueError(f"Unknown aggregation mode {mode!r}; choose one of {AGG_MODES}.")


def _check_shapes(stats: TokenLogprobs, batch: RLBatch, cfg: LossConfig) -> None:
    """Trace-time checks: shapes are static, so mismatches fail here, not as NaNs."""
    N, T1 = batch.response_mask.shape
    want = {"stats.logp": stats.logp, "stats.entropy": stats.entropy,
            "stats.logp_t1": stats.logp_t1, "batch.query_mask": batch.query_mask,
            "batch.old_logp": batch.old_logp, "batch.ref_query_logp": batch.ref_query_logp}
    if batch.tokens is not None:
        if tuple(batch.tokens.shape) != (N, T1 + 1):
            raise ValueError(f"batch.tokens has shape {tuple(batch.tokens.shape)} but "
                             f"batch.response_mask has {(N, T1)}; per-token fields must have "
                             "one column fewer than tokens.")
    if cfg.policy_kl_in_loss:
        if batch.ref_logp is None:
            raise ValueError(f"beta_policy={cfg.beta_policy} puts Policy-KL in the loss, which "
                             "needs batch.ref_logp (reference log-probs of the response tokens), "
                             "but it is None.")
        want["batch.ref_logp"] = batch.ref_logp
    for name, a in want.items():
        if tuple(a.shape) != (N, T1):
            raise ValueError(f"{name} has shape {tuple(a.shape)}, expected {(N, T1)} like "
                             "batch.response_mask.")
    if tuple(batch.advantages.shape) not in ((N,), (N, T1)):
        raise ValueError(f"batch.advantages has shape {tuple(batch.advantages.shape)}; expected "
                         f"{(N,)} or {(N, T1)}.")
    for name in ("query_weight", "group_id"):
        if tuple(getattr(batch, name).shape) != (N,):
            raise ValueError(f"batch.{name} has shape {tuple(getattr(batch, name).shape)}, "
                             f"expected {(N,)}.")


def loss_terms(stats: TokenLogprobs, batch: RLBatch, cfg: LossConfig):
    """(terms, metrics): each term as it enters the loss (coefficient and sign included).

    terms: dict over TERMS of float32[]; the loss is exactly their sum. A term
    whose coefficient is 0 is a constant 0.0 (nothing is computed for it and,
    for Policy-KL, batch.ref_logp is not read).
    """
    _check_shapes(stats, batch, cfg)
    rm = batch.response_mask.astype(bool)
    qm = batch.query_mask.astype(bool)
    agg = lambda x: aggregate(x, rm, cfg.agg_mode, cfg.seq_sum_norm_const)
    f32 = lambda x: x.astype(jnp.float32)
    logp, ent = f32(stats.logp), f32(stats.entropy)
    zero = jnp.zeros((), jnp.float32)

    # --- PG surrogate (response positions).
    adv = f32(batch.advantages)
    adv = adv[:, None] if adv.ndim == 1 else adv
    adv = jnp.where(rm, adv, 0.0)
    log_ratio = jnp.where(rm, logp - f32(batch.old_logp), 0.0)
    ratio = jnp.exp(jnp.clip(log_ratio, -LOG_RATIO_LIMIT, LOG_RATIO_LIMIT))  # cannot overflow
    pg_unclipped = -adv * ratio
    pg_clipped = -adv * jnp.clip(ratio, 1.0 - cfg.eps_low, 1.0 + cfg.eps_high)
    pg = jnp.maximum(pg_unclipped, pg_clipped)
    clipped = rm & (pg_clipped > pg_unclipped)
    if cfg.dual_clip is not None:
        cap = -adv * cfg.dual_clip  # = c * |A| for A < 0
        dual = rm & (adv < 0) & (pg > cap)
        pg = jnp.where(adv < 0, jnp.minimum(pg, cap), pg)
    pg = pg * f32(batch.query_weight)[:, None]
    terms = {"pg": agg(pg)}

    # --- Policy-KL (response positions, sampling temperature).
    if cfg.policy_kl_in_loss:
        pkl = agg(kl_estimate(logp, batch.ref_logp, cfg.policy_kl_estimator, rm, cfg.kl_clamp))
        terms["policy_kl"] = cfg.beta_policy * pkl
    else:
        pkl = None
        terms["policy_kl"] = zero

    # --- Query-KL (query positions, temperature 1, once per query).
    qkl_args = (f32(stats.logp_t1), f32(batch.ref_query_logp), qm, batch.group_id)
    sg = jax.lax.stop_gradient
    mon_args = (sg(qkl_args[0]),) + qkl_args[1:]
    if cfg.beta_query > 0:
        qkl = query_kl(*qkl_args, cfg.query_kl_estimator, cfg.kl_clamp)
        terms["query_kl"] = cfg.beta_query * qkl
    else:
        qkl = query_kl(*mon_args, cfg.query_kl_estimator, cfg.kl_clamp)
        terms["query_kl"] = zero

    # --- Entropy bonus (response positions).
    mean_ent = agg(ent)
    terms["entropy"] = -cfg.entropy_coef * mean_ent if cfg.entropy_coef > 0 else zero

    # --- Monitoring (no gradient).
    n_tok = jnp.maximum(jnp.sum(rm), 1).astype(jnp.float32)
    tok_mean = lambda x: jnp.sum(jnp.where(rm, x, 0.0)) / n_tok
    any_tok = jnp.any(rm)
    metrics = {
        "pg_loss": sg(terms["pg"]),
        "policy_kl": sg(pkl) if pkl is not None else zero,
        "query_kl": sg(qkl),
        "query_kl_k1": query_kl(*mon_args, "k1"),
        "query_kl_k3": query_kl(*mon_args, "k3"),
        "entropy": sg(tok_mean(ent)),
        "clip_frac": tok_mean(clipped.astype(jnp.float32)),
        "ratio_mean": sg(tok_mean(ratio)),
        "ratio_min": sg(jnp.where(any_tok, jnp.min(jnp.where(rm, ratio, jnp.inf)), 1.0)),
        "ratio_max": sg(jnp.where(any_tok, jnp.max(jnp.where(rm, ratio, -jnp.inf)), 1.0)),
        "approx_kl_old": sg(tok_mean(kl_estimate(logp, batch.old_logp, "k3", rm))),
        "response_tokens": jnp.sum(rm).astype(jnp.float32),
    }
    if cfg.dual_clip is not None:
        metrics["dual_clip_frac"] = tok_mean(dual.astype(jnp.float32))
    return terms, metrics


def loss_from_stats(stats: TokenLogprobs, batch: RLBatch, cfg: LossConfig):
    """(loss float32[], metrics dict of float32[]) from per-token policy statistics.

    stats.logp / stats.entropy are at the sampling temperature (PG ratio,
    Policy-KL, entropy); stats.logp_t1 is at temperature 1 (Query-KL).

    metrics (all without gradient): loss; pg_loss (the weighted PG term);
    policy_kl and query_kl (each term before its coefficient; policy_kl is 0
    when Policy-KL is not in the loss; query_kl uses the loss estimator even
    when beta_query is 0); query_kl_k1, query_kl_k3 (drift monitors);
    entropy (token mean over response tokens); clip_frac (response tokens
    where the ratio clip is active); ratio_mean/min/max over response tokens;
    approx_kl_old (k3 between the sampling and current policy); response_tokens;
    dual_clip_frac when dual_clip is set.
    """
    terms, metrics = loss_terms(stats, batch, cfg)
    loss = terms["pg"] + terms["policy_kl"] + terms["query_kl"] + terms["entropy"]
    metrics = {"loss": jax.lax.stop_gradient(loss), **metrics}
    return loss, metrics


def loss_fn(params, cfg_model, batch: RLBatch, loss_cfg: LossConfig, temperature=1.0,
            chunk_size: int | None = 512):
    """(loss, metrics) of the policy `params` on `batch`: one forward pass, then the core.

    cfg_model: ModelConfig; temperature: the sampling temperature of the
    responses (PG and Policy-KL use it; Query-KL always uses temperature 1).
    Jit with cfg_model and loss_cfg static (both are frozen dataclasses).
    """
    stats = token_logprobs(params, cfg_model, batch.tokens, batch.attn_mask,
                           temperature=temperature, chunk_size=chunk_size)
    return loss_from_stats(stats, batch, loss_cfg)
