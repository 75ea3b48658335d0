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


def describe(cfg) -> str:
    """One line for the run header: the resolved method and what it switched on."""
    a, lc = cfg.algo, cfg.loss
    parts = [f"method={a.method}", f"advantage={a.advantage}"]
    if lc.beta_policy > 0:
        adaptive = (f", adaptive to target {lc.kl_target} over {lc.kl_horizon:g} samples"
                    if lc.kl_target > 0 else "")
        parts.append(f"policy_kl={lc.beta_policy} {lc.policy_kl_estimator} "
                     f"(in the {lc.policy_kl_mode}{adaptive})")
    else:
        parts.append("policy_kl=off")
    parts.append(f"query_kl={lc.beta_query} {lc.query_kl_estimator}" if lc.beta_query > 0
                 else "query_kl=off")
    w = f"weights={a.weight_scheme}"
    if a.weight_scheme != "uniform":
        w += f" (tau {a.weight_tau}, bounds [{a.weight_min}, {a.weight_max}])"
    parts.append(w)
    if lc.entropy_coef > 0:
        parts.append(f"entropy={lc.entropy_coef}")
    if lc.pg_loss != "ppo_clip":
        detail = (f"ratio {lc.clip_cov_ratio:g}, band ({lc.clip_cov_lb:g}, {lc.clip_cov_ub:g})"
                  if lc.pg_loss == "clip_cov" else
                  f"ratio {lc.kl_cov_ratio:g}, coef {lc.kl_cov_coef:g}"
                  if lc.pg_loss == "kl_cov" else "")
        parts.append(f"pg_loss={lc.pg_loss}" + (f" ({detail})" if detail else ""))
    if lc.eps_high != lc.eps_low:
        parts.append(f"clip=[{1 - lc.eps_low:g}, {1 + lc.eps_high:g}]")
    if a.filter_groups:
        parts.append(f"dynamic sampling (<= {a.filter_max_batches} batches/step)")
    if a.overlong_buffer:
        parts.append(f"overlong shaping (last {a.overlong_buffer} tokens, "
                     f"penalty {a.overlong_penalty:g})")
    return "[erpo] " + ", ".join(parts)
