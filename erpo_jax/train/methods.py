"""The named methods of the method page, resolved into loss coefficients and weights.

`algo.method` says what a run is; `resolve_method` turns it into the
coefficients and the weight scheme the loss and the weights read, and refuses
a config whose explicit settings contradict its name:

| method          | beta_policy        | beta_query        | weight scheme |
|-----------------|--------------------|-------------------|---------------|
| erpo            | 0                  | > 0 (default 0.1) | likelihood    |
| grpo_policy_kl  | > 0 (default 0.04) | 0                 | uniform       |
| no_kl           | 0                  | 0                 | uniform       |
| custom          | as given           | as given          | as given (default uniform) |

A coefficient the method needs that is left at 0 gets the method's default;
`algo.weight_scheme=''` (the default) means the method's scheme. Estimators
(k2/k3), the KL mode, the advantage estimator and tau/bounds stay free under
every name: the method is which terms are on and which weights scale the PG
loss. Ablations that change one of those (e.g. Query-KL with uniform weights)
are `custom`, so nothing that is not ERPO is called ERPO. The resolved config
(method included) is what a run prints in its header and writes to config.json.
"""

from __future__ import annotations

import dataclasses

from erpo_jax.rl.terms import TERMS

METHODS = ("erpo", "grpo_policy_kl", "no_kl", "custom")
ERPO_BETA_QUERY = 0.1      # the demo's and experiments' value
POLICY_KL_BETA = 0.04      # DeepSeekMath's GRPO value
_SCHEME = {"erpo": "likelihood", "grpo_policy_kl": "uniform", "no_kl": "uniform",
           "custom": "uniform"}


def _fail(field: str, msg: str):
    raise ValueError(f"config field {field}: {msg}")


def resolve_method(cfg):
    """cfg (a RunConfig) with its loss coefficients and weight scheme set by
    `algo.method`; ValueError naming the field when they contradict it.
    Idempotent: a resolved config resolves to itself."""
    a, lc = cfg.algo, cfg.loss
    method = a.method
    if method not in METHODS:
        _fail("algo.method", f"is {method!r}; choose one of {METHODS} (custom: set "
              "loss.beta_policy, loss.beta_query and algo.weight_scheme yourself).")
    scheme = a.weight_scheme or _SCHEME[method]
    bp, bq = lc.beta_policy, lc.beta_query
    hint = "; use algo.method=custom for an ablation."
    if method == "erpo":
        if bp > 0:
            _fail("loss.beta_policy", f"is {bp}, but algo.method='erpo' has no Policy-KL" + hint)
        bq = bq if bq > 0 else ERPO_BETA_QUERY
    elif method == "grpo_policy_kl":
        if bq > 0:
            _fail("loss.beta_query", f"is {bq}, but algo.method='grpo_policy_kl' has no "
                  "Query-KL" + hint)
        bp = bp if bp > 0 else POLICY_KL_BETA
    elif method == "no_kl":
        for name, value in (("loss.beta_policy", bp), ("loss.beta_query", bq)):
            if value > 0:
                _fail(name, f"is {value}, but algo.method='no_kl' has no KL term" + hint)
    if method != "custom" and scheme != _SCHEME[method]:
        _fail("algo.weight_scheme", f"is {scheme!r}, but algo.method={method!r} uses "
              f"{_SCHEME[method]!r} weights" + hint)
    return dataclasses.replace(
        cfg, algo=dataclasses.replace(a, weight_scheme=scheme),
        loss=dataclasses.replace(lc, beta_policy=bp, beta_query=bq))


# The terms algo.method switches (resolve_method): the header always names
# them, 'off' when off. Every other registered term is named when it is on.
METHOD_TERMS = ("policy_kl", "query_kl")


def _policy_kl(lc) -> str:
    if not lc.beta_policy > 0:
        return "policy_kl=off"
    adaptive = (f", adaptive to target {lc.kl_target} over {lc.kl_horizon:g} samples"
                if lc.kl_target > 0 else "")
    return (f"policy_kl={lc.beta_policy} {lc.policy_kl_estimator} "
            f"(in the {lc.policy_kl_mode}{adaptive})")


def _query_kl(lc) -> str:
    return (f"query_kl={lc.beta_query} {lc.query_kl_estimator}" if lc.beta_query > 0
            else "query_kl=off")


# The header's words for a term, where they are more than '<name>=<coefficient>'.
_TERM_TEXT = {"policy_kl": _policy_kl, "query_kl": _query_kl}


def _term_text(term, lc) -> str | None:
    """A registered term's part of the header; None for a term that is off
    (and for the PG term, which `pg_loss` describes)."""
    if term.name in _TERM_TEXT:
        return _TERM_TEXT[term.name](lc)
    if term.name == "pg" or not term.is_on(lc):
        return None
    return term.name if term.coef is None else f"{term.name}={getattr(lc, term.coef)}"


# The header's detail of a policy loss (`loss.pg_loss`), where it has settings
# of its own; any other registered one is named alone.
_PG_LOSS_DETAIL = {
    "clip_cov": lambda lc: (f"ratio {lc.clip_cov_ratio:g}, "
                            f"band ({lc.clip_cov_lb:g}, {lc.clip_cov_ub:g})"),
    "kl_cov": lambda lc: f"ratio {lc.kl_cov_ratio:g}, coef {lc.kl_cov_coef:g}",
}
DEFAULT_PG_LOSS = "ppo_clip"


def describe(cfg) -> str:
    """One line for the run header: the resolved method and what it switched on.
    Its terms come from the registry (`rl/terms/`): the method's KL terms
    always, then the weights, then every other registered term that is on,
    the policy loss (`rl/policy_losses/`) unless it is the default, and the
    rollout correction (`loss.rollout_correction`) unless it is 'none'."""
    a, lc = cfg.algo, cfg.loss
    parts = [f"method={a.method}", f"advantage={a.advantage}"]
    texts = {name: _term_text(term, lc) for name, term in TERMS.items()}
    parts += [texts[name] for name in TERMS if name in METHOD_TERMS]
    w = f"weights={a.weight_scheme}"
    if a.weight_scheme != "uniform":
        w += f" (tau {a.weight_tau}, bounds [{a.weight_min}, {a.weight_max}])"
    parts.append(w)
    parts += [t for name, t in texts.items() if name not in METHOD_TERMS and t is not None]
    if lc.pg_loss != DEFAULT_PG_LOSS:
        detail = _PG_LOSS_DETAIL[lc.pg_loss](lc) if lc.pg_loss in _PG_LOSS_DETAIL else ""
        parts.append(f"pg_loss={lc.pg_loss}" + (f" ({detail})" if detail else ""))
    if lc.rollout_correction != "none":
        parts.append(f"rollout_correction={lc.rollout_correction} "
                     f"[{lc.rollout_correction_low:g}, {lc.rollout_correction_high:g}]")
    if lc.eps_high != lc.eps_low:
        parts.append(f"clip=[{1 - lc.eps_low:g}, {1 + lc.eps_high:g}]")
    if a.filter_groups:
        cap = (f"<= {a.filter_max_batches} batches/step" if a.filter_max_batches
               else "no cap but one pass over the data/step")
        short = ("a short step stops the run" if a.filter_on_short == "error"
                 else "a short step is padded with flat groups, counted in filter/short")
        parts.append(f"dynamic sampling ({cap}; {short})")
    if a.overlong_buffer:
        parts.append(f"overlong shaping (last {a.overlong_buffer} tokens, "
                     f"penalty {a.overlong_penalty:g})")
    m = cfg.model
    if m.lora_rank:
        targets = ",".join(m.lora_targets) if m.lora_targets else "all linear"
        parts.append(f"LoRA (rank {m.lora_rank}, alpha {m.lora_alpha:g}, {targets}; base "
                     "frozen, reference = base)")
    return "[erpo] " + ", ".join(parts)
