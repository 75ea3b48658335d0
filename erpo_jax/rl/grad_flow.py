"""Gradient-flow inspector: where each loss term's gradient goes.

For a batch and a LossConfig it reports, for every registered term
(`erpo_jax/rl/terms/`: pg, policy_kl, query_kl, entropy, and any added
since) and their sum (total):
  - the norm of the term's gradient with respect to the logits, split into
    query positions, response positions and the rest (padding);
  - the norm of the term's gradient with respect to the parameters;
  - the cosine between every pair of terms' parameter gradients.

The method requires QKL's response-position gradient and the PG and
Policy-KL query-position gradients to be exactly 0; this makes it visible on
any model and batch. The logits are materialised in full ([N, T-1, V]
float32), so use it on small batches.

`add_parser(subparsers)` + `run(args)` are the `erpo inspect-grads` command;
`main(argv)` runs it standalone. Without a checkpoint it builds a tiny random
model and a synthetic batch. Its lists come from the registries: a flag per
registered term's coefficient, `--pg-loss` choices from the policy losses,
and `--unit` sets every term's coefficient, so a new term or policy loss is
in all of them without an edit here.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import itertools
import json
import math
import textwrap

import jax
import jax.numpy as jnp

from erpo_jax.model import lora
from erpo_jax.model import model as model_lib
from erpo_jax.model.config import PRESETS, ModelConfig
from erpo_jax.rl.batch import RLBatch
from erpo_jax.rl.kl import ESTIMATORS as KL_ESTIMATORS
from erpo_jax.rl.loss import LossConfig, loss_terms, stats_from_logits
from erpo_jax.rl.policy_losses import POLICY_LOSSES
from erpo_jax.rl.query_kl import LOSS_ESTIMATORS as QUERY_KL_ESTIMATORS
from erpo_jax.rl.terms import AGG_MODES, TERMS


def rows() -> tuple[str, ...]:
    """The report's rows: every registered term, in registry order, then 'total'."""
    return tuple(TERMS) + ("total",)


def coefficient_fields() -> tuple[str, ...]:
    """The LossConfig fields of the registered terms' coefficients, in registry
    order, each once (the PG term, always on, has none)."""
    return tuple(dict.fromkeys(t.coef for t in TERMS.values() if t.coef is not None))


def unit_coefficients(cfg: LossConfig, has_ref_logp: bool) -> LossConfig:
    """The config with every registered term's coefficient set to 1, to compare
    raw gradient directions: a term that reads the reference response log-probs
    (Policy-KL) only if they exist (else 0), Policy-KL in the loss and at a
    fixed coefficient. ValueError if a term that gets 1 is still off (its
    `active` reads more than its coefficient: say here what turns it on)."""
    unit = {t.coef: 0.0 if "ref_logp" in t.needs and not has_ref_logp else 1.0
            for t in TERMS.values() if t.coef is not None}
    out = dataclasses.replace(cfg, **unit, policy_kl_mode="loss", kl_target=0.0)
    off = [t.name for t in TERMS.values()
           if t.coef is not None and unit[t.coef] > 0 and not t.is_on(out)]
    if off:
        raise ValueError(f"unit coefficients leave the terms {off} off: their coefficient "
                         "alone does not turn them on (set what does in "
                         "grad_flow.unit_coefficients).")
    return out


@functools.partial(jax.jit, static_argnames=("cfg_model", "loss_cfg", "temperature"))
def _inspect(params, batch: RLBatch, cfg_model: ModelConfig, loss_cfg: LossConfig,
             temperature: float):
    # With LoRA the parameters are the adapters, what the update trains: the
    # frozen base enters as a constant.
    lora_on = bool(cfg_model.lora_rank)
    frozen = lora.base(params) if lora_on else None

    def logits_fn(p):
        full = lora.attach(frozen, p) if lora_on else p
        logits, _ = model_lib.forward(full, cfg_model, batch.tokens, attn_mask=batch.attn_mask)
        return logits[:, :-1]

    logits, vjp = jax.vjp(logits_fn, lora.adapters(params) if lora_on else params)
    targets = batch.tokens[:, 1:]

    names = rows()

    def all_terms(lg):
        terms, _ = loss_terms(stats_from_logits(lg, targets, temperature), batch, loss_cfg)
        values = [terms[name] for name in names[:-1]]
        return jnp.stack(values + [sum(values)])

    # The terms' logit gradients [rows, N, T-1, V], then one model backward
    # per term, stacked. (Not jax.vmap(vjp): batching the attention's custom
    # backward over the cotangents mixed them, so a term with a zero logit
    # gradient got a non-zero parameter gradient.)
    values = all_terms(logits)
    g_logits = jax.jacrev(all_terms)(logits)
    per_term = [vjp(g_logits[i])[0] for i in range(len(names))]
    g_params = jax.tree.map(lambda *xs: jnp.stack(xs), *per_term)
    qm = batch.query_mask.astype(bool)
    rm = batch.response_mask.astype(bool)
    other = ~(qm | rm)
    g2 = jnp.sum(jnp.square(g_logits), axis=-1)  # [rows, N, T-1]
    part = lambda m: jnp.sqrt(jnp.sum(jnp.where(m, g2, 0.0), axis=(1, 2)))
    flat = jnp.concatenate([x.reshape(len(names), -1).astype(jnp.float32)
                            for x in jax.tree.leaves(g_params)], axis=1)
    gram = flat @ flat.T
    stats = {"value": values, "logit_grad_query": part(qm), "logit_grad_response": part(rm),
             "logit_grad_other": part(other), "param_grad_norm": jnp.sqrt(jnp.diagonal(gram))}
    out = {name: {k: v[i] for k, v in stats.items()} for i, name in enumerate(names)}
    dots = {f"{names[i]}|{names[j]}": gram[i, j]
            for i, j in itertools.combinations(range(len(names)), 2)}
    return out, dots, _by_layer(g_params)


def _by_layer(g_params) -> dict:
    """{group: float32[rows]} squared-norm sums per parameter group: each
    top-level entry ('embed', 'final_norm', 'lm_head', ...) on its own and the
    stacked `layers` subtree split along its leading [L] axis ('layer_<i>')."""
    sq = {}
    for path, g in jax.tree_util.tree_flatten_with_path(g_params)[0]:
        top = str(getattr(path[0], "key", path[0]))
        g = jnp.square(g.astype(jnp.float32))
        if top == "layers":
            per = jnp.sum(g.reshape(g.shape[0], g.shape[1], -1), axis=-1)   # [rows, L]
            for i in range(g.shape[1]):
                sq[f"layer_{i}"] = sq.get(f"layer_{i}", 0.0) + per[:, i]
        else:
            sq[top] = sq.get(top, 0.0) + jnp.sum(g.reshape(g.shape[0], -1), axis=-1)
    return sq


def inspect_gradients(params, cfg_model: ModelConfig, batch: RLBatch, loss_cfg: LossConfig,
                      temperature: float = 1.0, unit: bool = False) -> dict:
    """Gradient-flow report as plain Python floats.

    Returns {"terms": {term: {value, logit_grad_query, logit_grad_response,
    logit_grad_other, param_grad_norm}}, "cosine": {"a|b": cos or nan when a
    gradient is 0}, "param_grad_by_layer": {term: {group: norm}} (groups:
    'embed', 'layer_0'.., 'final_norm', 'lm_head'), "loss_config": {...}} for
    terms in `rows()`. unit=True first replaces the coefficients by 1
    (`unit_coefficients`).
    """
    if unit:
        loss_cfg = unit_coefficients(loss_cfg, batch.ref_logp is not None)
    out, dots, layer_sq = _inspect(params, batch, cfg_model, loss_cfg, float(temperature))
    names = rows()
    terms = {k: {m: float(v) for m, v in out[k].items()} for k in names}
    cosine = {}
    for key, dot in dots.items():
        a, b = key.split("|")
        na, nb = terms[a]["param_grad_norm"], terms[b]["param_grad_norm"]
        cosine[key] = float(dot) / (na * nb) if na > 0 and nb > 0 else math.nan
    layers = {name: {g: math.sqrt(float(v[i])) for g, v in layer_sq.items()}
              for i, name in enumerate(names)}
    trained = (f"the LoRA adapters (rank {cfg_model.lora_rank}, {lora.count(cfg_model)} "
               "parameters; the base is frozen)" if cfg_model.lora_rank else "all parameters")
    return {"terms": terms, "cosine": cosine, "param_grad_by_layer": layers,
            "loss_config": dataclasses.asdict(loss_cfg), "temperature": float(temperature),
            "parameters": trained}


LEGEND = (
    "columns: value = the term as it enters the loss (coefficient and sign included); "
    "|dL/dz| query / response / other = L2 norm of the term's gradient with respect to "
    "the logits z at query target positions (x2..xm) / response positions (y1..yn) / "
    "padding; |dL/dtheta| = L2 norm of its gradient with respect to all parameters; "
    "total = the sum of the terms (the loss). An exact 0 means the term does not reach "
    "those positions (QKL: response 0; PG, Policy-KL, entropy: query 0).")


def format_table(report: dict) -> str:
    """The report as fixed-width tables: what it ran on (if `report['source']`),
    per-term norms with a legend, per-layer parameter-gradient norms, and
    pairwise cosines."""
    lines = []
    for key, text in report.get("source", {}).items():
        lines.append(f"{key + ':':<11}{text}")
    if lines:
        lines.append("")
    cols = ("value", "logit_grad_query", "logit_grad_response", "logit_grad_other",
            "param_grad_norm")
    heads = ("value", "|dL/dz| query", "|dL/dz| response", "|dL/dz| other", "|dL/dtheta|")
    lines.append(f"{'term':<10}" + "".join(f"{h:>18}" for h in heads))
    for name, row in report["terms"].items():
        lines.append(f"{name:<10}" + "".join(f"{row[c]:>18.6g}" for c in cols))
    lines += textwrap.wrap(LEGEND, 100)
    if report.get("parameters", "all parameters") != "all parameters":
        lines.append(f"theta here: {report['parameters']}.")
    names = list(report["terms"])
    layers = report.get("param_grad_by_layer")
    if layers:
        groups = list(next(iter(layers.values())))
        lines += ["", "parameter-gradient norm per layer (|dL/dtheta| of each group)",
                  f"{'group':<12}" + "".join(f"{n:>12}" for n in names)]
        for g in groups:
            lines.append(f"{g:<12}" + "".join(f"{layers[n][g]:>12.4g}" for n in names))
    lines += ["", "cosine between parameter gradients ('-' where a gradient is zero)",
              f"{'':<10}" + "".join(f"{n:>11}" for n in names)]
    for a in names:
        cells = []
        for b in names:
            c = 1.0 if a == b else report["cosine"].get(f"{a}|{b}",
                                                        report["cosine"].get(f"{b}|{a}"))
            zero = report["terms"][a]["param_grad_norm"] == 0
            cells.append("-" if zero or c is None or math.isnan(c) else f"{c:.4f}")
        lines.append(f"{a:<10}" + "".join(f"{x:>11}" for x in cells))
    return "\n".join(lines)


def write_json(report: dict, path) -> None:
    """The report as JSON (NaN cosines as null)."""
    clean = {**report, "cosine": {k: None if math.isnan(v) else v
                                  for k, v in report["cosine"].items()}}
    with open(path, "w") as f:
        json.dump(clean, f, indent=2)


# ----------------------------------------------------------------------------- CLI


def add_parser(subparsers) -> argparse.ArgumentParser:
    """Register the `inspect-grads` subcommand on an argparse subparsers object."""
    p = subparsers.add_parser("inspect-grads", help="per-term gradient flow of the RL loss",
                              description=__doc__.split("\n\n")[0])
    _add_arguments(p)
    p.set_defaults(func=run)
    return p


def _add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--checkpoint", default=None,
                   help="an HF-format policy directory (e.g. an SFT run's model/); "
                        "default: a random model of --preset")
    p.add_argument("--preset", default="tiny", choices=sorted(PRESETS),
                   help="model shape for the random model")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--queries", type=int, default=2, help="queries in the batch")
    p.add_argument("--group-size", type=int, default=4, help="synthetic batch: responses per query")
    p.add_argument("--query-width", type=int, default=8, help="synthetic batch")
    p.add_argument("--response-width", type=int, default=8, help="synthetic batch")
    p.add_argument("--temperature", type=float, default=1.0, help="synthetic batch")
    # The synthetic batch's loss (None: the default in synthetic_loss()); a run's
    # loss comes from its config instead. One flag per registered term's
    # coefficient, in registry order.
    defaults = synthetic_loss()
    for field in coefficient_fields():
        names = " and ".join(t.name for t in TERMS.values() if t.coef == field)
        p.add_argument("--" + field.replace("_", "-"), type=float, default=None,
                       help=f"the {names} term's coefficient (synthetic batch default "
                            f"{defaults[field]:g})")
    p.add_argument("--policy-kl-estimator", default=None, choices=tuple(KL_ESTIMATORS))
    p.add_argument("--query-kl-estimator", default=None, choices=tuple(QUERY_KL_ESTIMATORS))
    p.add_argument("--agg-mode", default=None, choices=AGG_MODES)
    p.add_argument("--seq-sum-norm-const", type=float, default=None)
    p.add_argument("--pg-loss", default=None, choices=tuple(POLICY_LOSSES),
                   help="the PG term's surrogate (rl/policy_losses/)")
    p.add_argument("--unit", action="store_true",
                   help="set every registered term's coefficient to 1 (compare directions)")
    p.add_argument("--json", default=None, help="also write the report to this JSON file")


# The synthetic batch's coefficients of the terms registered when it was
# written; a term registered since gets SYNTHETIC_COEF, so it is on there too.
_SYNTHETIC_COEFS = dict(beta_policy=0.05, beta_query=0.1, entropy_coef=0.01)
SYNTHETIC_COEF = 0.1
_SYNTHETIC_REST = dict(policy_kl_estimator="k3", query_kl_estimator="k3", agg_mode="token_mean",
                       seq_sum_norm_const=None, pg_loss="ppo_clip")


def synthetic_loss() -> dict:
    """The synthetic batch's LossConfig fields: every registered term's
    coefficient (registry order), then the estimators, aggregation and PG loss."""
    coefs = {f: _SYNTHETIC_COEFS.get(f, SYNTHETIC_COEF) for f in coefficient_fields()}
    return {**coefs, **_SYNTHETIC_REST}


def loss_flags() -> tuple[str, ...]:
    """The synthetic batch's loss flags (argparse dests), one per synthetic_loss() field."""
    return tuple(synthetic_loss())


def __getattr__(name: str):
    # SYNTHETIC_LOSS and LOSS_FLAGS are read from the registry when asked for,
    # so a term registered after this module's import is in them.
    if name == "SYNTHETIC_LOSS":
        return synthetic_loss()
    if name == "LOSS_FLAGS":
        return loss_flags()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def run(args: argparse.Namespace) -> dict:
    """Random or given model, synthetic batch, loss from the flags; print the table;
    return the report. (A run's real batch: `erpo_jax.train.inspect_grads`.)"""
    from erpo_jax.rl.synthetic import random_params, synthetic_batch

    if args.checkpoint is not None:
        from erpo_jax.model.hf import load_hf
        try:
            cfg_model, params = load_hf(args.checkpoint, param_dtype="float32")
        except (OSError, ValueError) as e:
            raise SystemExit(f"inspect-grads: cannot load --checkpoint: {e}") from None
    else:
        cfg_model = PRESETS[args.preset]
        params = random_params(cfg_model, args.seed)
    kw = {f: default if getattr(args, f, None) is None else getattr(args, f)
          for f, default in synthetic_loss().items()}
    if kw["agg_mode"] == "seq_sum_norm" and kw["seq_sum_norm_const"] is None:
        kw["seq_sum_norm_const"] = float(args.response_width)
    try:
        loss_cfg = LossConfig(**kw)
    except ValueError as e:
        raise SystemExit(f"inspect-grads: {e}") from None
    batch = synthetic_batch(params, cfg_model, args.seed, num_queries=args.queries,
                            group_size=args.group_size, query_width=args.query_width,
                            response_width=args.response_width, temperature=args.temperature,
                            with_ref_logp=loss_cfg.needs_ref_logp or args.unit)
    report = inspect_gradients(params, cfg_model, batch, loss_cfg, args.temperature, args.unit)
    report["source"] = {
        "model": args.checkpoint or f"a random '{args.preset}' model (seed {args.seed})",
        "batch": f"SYNTHETIC: {args.queries} random queries x {args.group_size} random "
                 "responses; old log-probs = policy + N(0, 0.3) noise; reference = the "
                 "parameters plus noise (for a run's real batch: --config and --checkpoint)",
        "loss": ", ".join(f"{k} {v}" for k, v in kw.items()),
    }
    print(format_table(report))
    if args.json:
        write_json(report, args.json)
    return report


def main(argv=None) -> dict:
    """Standalone entry point: `python -m erpo_jax.rl.grad_flow [options]`."""
    p = argparse.ArgumentParser(prog="inspect-grads", description=__doc__.split("\n\n")[0])
    _add_arguments(p)
    return run(p.parse_args(argv))


if __name__ == "__main__":
    main()
