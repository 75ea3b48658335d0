"""One jittable loss for every variant (GRPO + Policy-KL, no KL, ERPO, PPO, REINFORCE...).

    L = agg(w[query] * pg[t])                     PG surrogate (loss.pg_loss), per-query weight
      + beta_policy  * agg(k(logp_ref - logp))    Policy-KL, response positions
      + beta_query   * QKL                        Query-KL, query positions, temperature 1
      - entropy_coef * agg(entropy[t])

Each line is a registered term (`erpo_jax/rl/terms/`, one module each) and
the PG surrogate a registered policy loss (`erpo_jax/rl/policy_losses/`:
ppo_clip, clip_cov, kl_cov): `loss_terms` calls every registered term and
the loss is their sum, so a new term is one module plus its coefficient's
field here.

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

import contextlib
import contextvars
import dataclasses

import jax
import jax.numpy as jnp

from erpo_jax.model.logprobs import TokenLogprobs, logprobs_from_logits, token_logprobs
from erpo_jax.rl.batch import RLBatch  # noqa: F401  (re-exported: the loss's input)
from erpo_jax.rl.kl import ESTIMATORS as KL_ESTIMATORS
from erpo_jax.rl.policy_losses import POLICY_LOSSES, get_policy_loss
from erpo_jax.rl.query_kl import check_loss_estimator
# TERMS: the registered terms, name -> Term, in their order (the loss's dict,
# the update's shares, the inspector's rows); re-exported here.
from erpo_jax.rl.terms import AGG_MODES, TERMS, LossInputs, aggregate  # noqa: F401
from erpo_jax.rl.rollout_correction import ROLLOUT_CORRECTIONS

POLICY_KL_MODES = ("loss", "reward")

# While set, LossConfig does not check itself when built: a config that is
# assembled field by field (command-line overrides in any order, a JSON file,
# the method's resolution) is checked once, whole (`train.config.validate`).
_DEFERRED = contextvars.ContextVar("erpo_loss_config_deferred", default=False)


@contextlib.contextmanager
def deferred_validation():
    """Build LossConfigs without their checks inside; the caller checks the result."""
    token = _DEFERRED.set(True)
    try:
        yield
    finally:
        _DEFERRED.reset(token)


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
    pg_loss: the PG term's per-token surrogate, a registered policy loss:
      'ppo_clip' (default), 'clip_cov' or 'kl_cov' (rl/policy_losses/).
    clip_cov_ratio, clip_cov_lb, clip_cov_ub: Clip-Cov's fraction of tokens
      detached and the covariance band they are drawn from (the paper's
      2e-4, 1, 5).
    kl_cov_ratio, kl_cov_coef: KL-Cov's fraction of tokens penalised and the
      coefficient of |log r| on them (the paper's 2e-3, 1).
    kl_cov_tol: KL-Cov's penalty is 0, with no gradient, where |log r| is at
      most this: log r against the sampler's log-probs is rounding on the
      first pass (rl/policy_losses/kl_cov.py).
    kl_target: > 0 makes beta_policy adaptive (rl/kl_control.py): its initial
      value is beta_policy, and after each update it moves toward this
      Policy-KL; 0 = a fixed beta_policy.
    kl_horizon: the adaptive controller's horizon in samples: one update on
      n samples changes the coefficient by at most 20% * min(n / kl_horizon, 1)
      (rl/kl_control.py; the cap keeps it positive).
    rollout_correction: 'none' (default), 'token_mask' or 'sequence_mask':
      masked importance sampling against the sampler (as verl's and TRL's).
      The ratio is the current policy's against the sampler's log-probs
      (batch.old_logp; on the update's first pass exactly the sampler/trainer
      mismatch). 'token_mask' removes from the PG term the response tokens
      whose ratio is outside [rollout_correction_low, rollout_correction_high];
      'sequence_mask' removes every token of the sequences whose
      geometric-mean ratio exp(mean_t log r) (over their response tokens) is
      outside it. Masked tokens add 0 to the PG term and stay in its
      denominator (counted as 0, verl's convention); the other terms are
      untouched (rl/terms/pg.py).
    rollout_correction_low, rollout_correction_high: the band of kept ratios,
      bounds included; 0 < low < 1 < high (defaults 0.5 and 2.0).
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
    pg_loss: str = "ppo_clip"
    clip_cov_ratio: float = 2e-4
    clip_cov_lb: float = 1.0
    clip_cov_ub: float = 5.0
    kl_cov_ratio: float = 2e-3
    kl_cov_coef: float = 1.0
    kl_cov_tol: float = 1e-4
    kl_target: float = 0.0
    kl_horizon: float = 10000.0
    rollout_correction: str = "none"
    rollout_correction_low: float = 0.5
    rollout_correction_high: float = 2.0

    def __post_init__(self):
        if not _DEFERRED.get():
            self.validate()

    def validate(self) -> None:
        """Raise ValueError with a sentence naming the field when inconsistent."""
        if not 0.0 <= self.eps_low < 1.0:
            raise ValueError(f"LossConfig.eps_low must be in [0, 1), got {self.eps_low}.")
        if not self.eps_high >= 0.0:
            raise ValueError(f"LossConfig.eps_high must be >= 0, got {self.eps_high}.")
        if self.dual_clip is not None and not self.dual_clip > 1.0:
            raise ValueError(f"LossConfig.dual_clip must be None or > 1, got {self.dual_clip}.")
        coefs = dict.fromkeys(t.coef for t in TERMS.values() if t.coef is not None)
        for name in coefs:   # every registered term's coefficient
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
        if self.pg_loss not in POLICY_LOSSES:
            raise ValueError(f"LossConfig.pg_loss is {self.pg_loss!r}; choose one of "
                             f"{sorted(POLICY_LOSSES)}.")
        if self.kl_target < 0:
            raise ValueError(f"LossConfig.kl_target must be >= 0 (0 = a fixed beta_policy), got "
                             f"{self.kl_target}.")
        if not self.kl_horizon > 0:
            raise ValueError(f"LossConfig.kl_horizon must be > 0 (samples), got "
                             f"{self.kl_horizon}.")
        if self.kl_target > 0:
            if not self.beta_policy > 0:
                raise ValueError(f"LossConfig.kl_target={self.kl_target} adapts beta_policy, "
                                 "which is 0 (Policy-KL off); set beta_policy to the initial "
                                 "coefficient.")
        if self.rollout_correction not in ROLLOUT_CORRECTIONS:
            raise ValueError(f"LossConfig.rollout_correction is {self.rollout_correction!r}; "
                             f"choose one of {sorted(ROLLOUT_CORRECTIONS)}.")
        lo, hi = self.rollout_correction_low, self.rollout_correction_high
        if not lo < hi:
            raise ValueError(f"LossConfig.rollout_correction_low is {lo}, not below "
                             f"LossConfig.rollout_correction_high ({hi}): the band of kept "
                             "ratios is empty or inverted; set e.g. 0.5 and 2.0.")
        if not 0.0 < lo < 1.0:
            raise ValueError(f"LossConfig.rollout_correction_low must be in (0, 1), below the "
                             f"ratio 1 of a sampler that matches the trainer, got {lo}.")
        if not hi > 1.0:
            raise ValueError(f"LossConfig.rollout_correction_high must be > 1, above the ratio "
                             f"1 of a sampler that matches the trainer, got {hi}.")
        for term in TERMS.values():
            if term.check is not None:
                term.check(self)

    @property
    def policy_kl_in_loss(self) -> bool:
        return self.beta_policy > 0 and self.policy_kl_mode == "loss"

    @property
    def needs_ref_logp(self) -> bool:
        """Whether the trainer must run the reference over the responses."""
        return self.beta_policy > 0

    @property
    def adaptive_kl(self) -> bool:
        """Whether beta_policy is the adaptive controller's (kl_target > 0)."""
        return self.kl_target > 0

    @property
    def needs_key(self) -> bool:
        """Whether the loss draws (its policy loss needs a PRNG key)."""
        return get_policy_loss(self.pg_loss).needs_key


def stats_from_logits(logits: jax.Array, targets: jax.Array, temperature=1.0) -> TokenLogprobs:
    """TokenLogprobs float32[N, T-1] from logits [N, T-1, V] and targets int[N, T-1].

    The same statistics `token_logprobs` returns, but as a function of an
    explicit logits tensor, for gradients with respect to the logits.
    """
    logp, ent = logprobs_from_logits(logits, targets, temperature)
    logp_t1 = logprobs_from_logits(logits, targets, 1.0)[0]
    return TokenLogprobs(logp, ent, logp_t1)


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
    for term in TERMS.values():
        if not term.is_on(cfg):
            continue
        for field in term.needs:
            if getattr(batch, field) is None:
                what = (f"beta_policy={cfg.beta_policy} puts Policy-KL in the loss, which"
                        if term.name == "policy_kl" else f"the loss term {term.name!r}")
                raise ValueError(f"{what} needs batch.{field}, but it is None.")
            want[f"batch.{field}"] = getattr(batch, field)
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


def _inputs(stats: TokenLogprobs, batch: RLBatch, cfg: LossConfig, coef, key,
            selected) -> LossInputs:
    """The LossInputs every term reads (float32 statistics, bool masks)."""
    rm = batch.response_mask.astype(bool)
    coef = dict(coef or {})
    if key is None and cfg.needs_key:
        key = jax.random.key(0)
    return LossInputs(
        logp=stats.logp.astype(jnp.float32), entropy=stats.entropy.astype(jnp.float32),
        logp_t1=stats.logp_t1.astype(jnp.float32), batch=batch, cfg=cfg, rm=rm,
        qm=batch.query_mask.astype(bool),
        agg=lambda x: aggregate(x, rm, cfg.agg_mode, cfg.seq_sum_norm_const),
        coef=lambda name: coef[name] if name in coef else getattr(cfg, name), key=key,
        selected=selected)


def loss_terms(stats: TokenLogprobs, batch: RLBatch, cfg: LossConfig, *, coef=None, key=None,
               selected=None):
    """(terms, metrics): each term as it enters the loss (coefficient and sign included).

    terms: dict over TERMS (the registered terms, `erpo_jax/rl/terms/`) of
    float32[]; the loss is exactly their sum. A term that is off is a
    constant 0.0 (nothing is computed for it and none of its batch fields,
    e.g. Policy-KL's batch.ref_logp, is read).
    coef: {LossConfig field: value} overriding coefficients (the update passes
      the adaptive Policy-KL coefficient, a traced float32[]).
    key: PRNG key for a policy loss that draws (clip_cov); default key(0).
    selected: bool[N, T-1], the policy loss's token selection made over a
      larger batch (the update's mini-batch); None: made on this batch.
    """
    _check_shapes(stats, batch, cfg)
    inputs = _inputs(stats, batch, cfg, coef, key, selected)
    rm = inputs.rm
    zero = jnp.zeros((), jnp.float32)
    terms, metrics = {}, {}
    for name, term in TERMS.items():
        if term.is_on(cfg):
            value, m = term.fn(inputs)
            c = 1.0 if term.coef is None else inputs.coef(term.coef)
            terms[name] = term.sign * c * value
        else:
            terms[name] = zero
            m = term.monitor(inputs) if term.monitor is not None else {}
        metrics.update(m)
    metrics = {"pg_loss": jax.lax.stop_gradient(terms["pg"]), **metrics,
               "response_tokens": jnp.sum(rm).astype(jnp.float32)}
    return terms, metrics


def loss_selection(stats: TokenLogprobs, batch: RLBatch, cfg: LossConfig, *, coef=None,
                   key=None):
    """bool[N, T-1] or None: the tokens the policy loss (loss.pg_loss) singles
    out on this whole batch, what `loss_terms(..., selected=)` takes for its
    parts (None when the policy loss selects nothing)."""
    from erpo_jax.rl.terms.pg import selection
    if get_policy_loss(cfg.pg_loss).select is None:
        return None
    return selection(_inputs(stats, batch, cfg, coef, key, None))


def loss_from_stats(stats: TokenLogprobs, batch: RLBatch, cfg: LossConfig, *, coef=None,
                    key=None):
    """(loss float32[], metrics dict of float32[]) from per-token policy statistics.

    stats.logp / stats.entropy are at the sampling temperature (PG ratio,
    Policy-KL, entropy); stats.logp_t1 is at temperature 1 (Query-KL).

    metrics (all without gradient): loss; pg_loss (the weighted PG term);
    policy_kl and query_kl (each term before its coefficient; policy_kl is
    measured in 'reward' mode too, and 0 when beta_policy is 0; query_kl uses
    the loss estimator even when beta_query is 0); query_kl_k1, query_kl_k3 (drift monitors);
    entropy (token mean over response tokens); clip_frac (response tokens
    where the ratio clip is active); ratio_mean/min/max over response tokens;
    approx_kl_old (k3 between the sampling and current policy); response_tokens;
    dual_clip_frac when dual_clip is set; cov_selected_frac under
    clip_cov / kl_cov; whatever else a registered term reports.
    coef, key: as `loss_terms`.
    """
    terms, metrics = loss_terms(stats, batch, cfg, coef=coef, key=key)
    loss = sum(terms.values())
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
