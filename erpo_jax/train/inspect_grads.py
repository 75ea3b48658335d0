"""`erpo inspect-grads`: where each term of a run's loss sends its gradient, on a real batch.

    erpo inspect-grads --config experiments/main_comparison.py --cpu \
        --checkpoint runs/sft-arith/model [--reference DIR] [--queries 2] [--step 0] \
        [--unit] [--json report.json] [section.field=value ...]

With `--config` the loss is exactly that run's: its method resolved
(`train/methods.py`), coefficients, estimators, clamp, aggregation and
per-query weights. With `--checkpoint` (an HF-format policy directory) the
batch is real, built the way the trainer builds its step-`--step` batch:

- prompts: the first `--queries` prompts of the run's batch at that step
  (its data iterator and seed), from the config's task;
- responses: a group of `rollout.group_size` sampled by the checkpoint with
  the run's sampling settings and rollout key; rewards from the task's reward;
- old log-probs: the sampler's, as in a rollout;
- reference query log-probs: the run's cached reference pass (the same cache
  file and key the run uses; computed and stored if absent), and the
  dataset-static weights from it; reference response log-probs (Policy-KL)
  from a forward of the reference over the sampled responses;
- advantages: the run's estimator (GAE with a fresh critic, whose values are 0).

The reference is the config's `model.path` when it holds a model, else the
checkpoint itself (then the policy equals the reference: every KL is at its
floor), or `--reference DIR`. Nothing is synthetic. Without `--config` and
`--checkpoint` the inspector runs on a random model and a synthetic batch
(`erpo_jax.rl.grad_flow`), and says so.

The logits are materialised ([N, T-1, V] float32 for every term): keep
`--queries` small for large vocabularies.
"""

from __future__ import annotations

import argparse
import dataclasses
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from erpo_jax.rl import grad_flow


def add_parser(subparsers) -> argparse.ArgumentParser:
    """Register `inspect-grads` (the real-batch path and the synthetic one)."""
    p = subparsers.add_parser("inspect-grads", help="per-term gradient flow of the RL loss",
                              description=__doc__.split("\n\n")[0],
                              epilog="Without --config/--checkpoint: " +
                              grad_flow.__doc__.split("\n\n")[0],
                              formatter_class=argparse.RawDescriptionHelpFormatter)
    grad_flow._add_arguments(p)
    p.add_argument("--config", default=None,
                   help="experiment file (.py with get_config) or a run's config.json: inspect "
                        "exactly that run's loss, task and reference")
    p.add_argument("--cpu", action="store_true", help="use the file's get_cpu_config()")
    p.add_argument("--reference", default=None,
                   help="the reference model directory (default: the config's model.path if "
                        "it holds a model, else the checkpoint)")
    p.add_argument("--step", type=int, default=0, help="whose batch: the run's step (default 0)")
    p.add_argument("overrides", nargs="*", help="section.field=value overrides of --config")
    p.set_defaults(func=run)
    return p


def run(args: argparse.Namespace) -> dict:
    """The command: real batch with --config/--checkpoint, else the synthetic inspector."""
    if args.json:   # before the work, which a bad output path would otherwise lose
        from erpo_jax.runtime.rundir import check_output_file
        check_output_file(args.json, "--json")
    if args.config is None and args.checkpoint is None:
        if args.overrides:
            raise SystemExit("inspect-grads: section.field=value overrides need --config.")
        return grad_flow.run(args)
    if args.config is None or args.checkpoint is None:
        raise SystemExit("inspect-grads: a real batch needs both --config (the run: its task, "
                         "loss and reference) and --checkpoint (the policy to inspect).")
    flags = {f: getattr(args, f) for f in grad_flow.LOSS_FLAGS if getattr(args, f) is not None}
    if flags:
        names = ", ".join("--" + f.replace("_", "-") for f in flags)
        raise SystemExit(f"inspect-grads: {names} set the synthetic batch's loss; with --config "
                         "the run's loss is used (override it with loss.<field>=value).")
    from erpo_jax.train.config import ConfigError, load_config
    from erpo_jax.train.policy import check_model_dir
    cfg = load_config(args.config, args.overrides, cpu=args.cpu)   # a bad field: rc 2
    for flag in ("checkpoint", "reference"):
        if getattr(args, flag):
            check_model_dir(getattr(args, flag), "--" + flag)
    try:
        report = inspect_run(cfg, args.checkpoint, reference=args.reference,
                             queries=args.queries, step=args.step, unit=args.unit,
                             config_name=args.config + (" (get_cpu_config)" if args.cpu else ""))
    except ConfigError:
        raise
    except (OSError, ValueError) as e:
        raise SystemExit(f"inspect-grads: {e}") from None
    if args.json:   # written first: nothing after the computation can lose it
        grad_flow.write_json(report, args.json)
    print(grad_flow.format_table(report))
    return report


def _has_model(path: str) -> bool:
    return bool(path) and (Path(path) / "config.json").is_file()


def inspect_run(cfg, checkpoint: str, *, reference: str | None = None, queries: int = 2,
                step: int = 0, unit: bool = False, config_name: str = "") -> dict:
    """The gradient report of run `cfg`'s loss for the policy at `checkpoint`,
    on the real batch described in the module docstring; report['source']
    says what it ran on."""
    from erpo_jax.data.iterator import QueryBatchIterator
    from erpo_jax.rl.advantages import gae
    from erpo_jax.rl.batch import as_jax, validate_batch
    from erpo_jax.rl.shaping import per_response, shaped_advantages
    from erpo_jax.rollout.sampler import rollout_key
    from erpo_jax.train.config import validate
    from erpo_jax.train.host import sample
    from erpo_jax.train.loop import rollout_to_batch
    from erpo_jax.train.methods import describe
    from erpo_jax.train.policy import load_policy
    from erpo_jax.train.startup import reference_cache_dir, reference_pass, start
    from erpo_jax.train.programs import rollout_engine, rollout_sampling
    from erpo_jax.train.train_step import make_logprob_fn

    cfg = validate(cfg)   # method resolved: the coefficients and scheme the run uses
    if queries < 1 or step < 0:
        raise ValueError(f"--queries must be >= 1 and --step >= 0, got {queries} and {step}.")
    if reference is None:
        m = cfg.model
        reference = m.path if m.init in ("sft", "hf") and _has_model(m.path) else checkpoint
    for name, path in (("--checkpoint", checkpoint), ("--reference", reference)):
        if not _has_model(path):
            raise ValueError(f"{name} {path} is not a model directory (no config.json).")
    at = lambda path: dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, init="hf",
                                                                         path=str(path)))
    # The run's start-up; the task's rows are the run's (they depend on data.* alone).
    started = start(at(checkpoint), policy=f"the checkpoint {checkpoint}")
    sharding, task = started.sharding, started.task
    model_cfg, params, tok = started.model_cfg, started.params, started.tokenizer
    same = Path(reference).resolve() == Path(checkpoint).resolve()
    t, r, a, lc = cfg.train, cfg.rollout, cfg.algo, cfg.loss
    G = r.group_size
    try:
        if same:
            ref_params, ref_tok = params, tok
        else:
            ref_cfg, ref_params, ref_tok = load_policy(at(reference), sharding)
            if ref_tok.identity != tok.identity:
                raise ValueError(f"the checkpoint's tokenizer differs from the reference's "
                                 f"({reference}); inspect a policy trained from that reference.")
            if dataclasses.replace(ref_cfg, remat=model_cfg.remat) != model_cfg:
                raise ValueError(f"the checkpoint's model config differs from the reference's "
                                 f"({reference}).")
        # The run's reference pass: the Trainer's cache directory (local or gs://) and key.
        ref_cache, computed = reference_pass(cfg, ref_params, model_cfg, tok, task, sharding,
                                             task.train_prompts)
        weights = ref_cache.weights(a.weight_scheme, a.weight_tau, a.weight_min, a.weight_max)
        idx = QueryBatchIterator(len(task.train), t.batch_size, t.seed).batch_at(step)[:queries]
        prompts = [task.train_prompts[i] for i in idx]
        sampler = rollout_engine(cfg, model_cfg, rollout_sampling(cfg, tok.eos_ids, tok.pad_id),
                                 sharding)
        key = rollout_key(jax.random.fold_in(jax.random.key(t.seed), 1), step)
        ro = sample(sampler, params, prompts, key, r.max_prompts_per_call)
        texts = tok.decode_responses(ro.response_tokens, ro.response_mask)
        rewards, _ = task.reward_fn(texts, [task.train[i].answer for i in idx for _ in range(G)])
    finally:
        task.close()
    rewards = np.asarray(rewards, np.float32)
    batch = rollout_to_batch(ro, np.zeros(len(rewards), np.float32), idx, ref_cache, weights, G)
    need_ref = lc.needs_ref_logp or unit
    ref_logp = None
    if need_ref:
        ref_fn = make_logprob_fn(model_cfg, r.temperature, cfg.model.logprob_chunk, sharding)
        ref_logp = np.asarray(jax.device_get(ref_fn(
            ref_params, jnp.asarray(batch.tokens), jnp.asarray(batch.attn_mask),
            last=ro.response_tokens.shape[1])), np.float32)
    from erpo_jax.rl.recipe import recipe
    rec = recipe(cfg)
    shaping = rec.shapes_rewards
    shaped, adv = shaped_advantages(
        jnp.asarray(rewards), jnp.asarray(batch.response_mask),
        jnp.asarray(batch.old_logp) if shaping else None,
        jnp.asarray(ref_logp) if shaping else None, loss_cfg=lc, algo=a, group_size=G)
    if adv is None:   # a critic estimator (GAE) with the trainer's step-0 critic: a zero value head
        zeros = jnp.zeros(batch.response_mask.shape, jnp.float32)
        adv, _ = gae(shaped, zeros, jnp.asarray(batch.response_mask), gamma=a.gamma, lam=a.lam,
                     whiten=True)
    batch = batch._replace(advantages=np.asarray(adv, np.float32), ref_logp=ref_logp)
    validate_batch(batch, needs_ref_logp=lc.policy_kl_in_loss)
    report = grad_flow.inspect_gradients(params, model_cfg, as_jax(batch), lc, r.temperature,
                                         unit)
    n_tok = int(np.sum(batch.response_mask))
    w = batch.query_weight[::G]
    report["source"] = {
        "config": f"{config_name or cfg.name}: {describe(cfg)[len('[erpo] '):]}"
                  + (" (--unit: every coefficient set to 1)" if unit else ""),
        "model": f"{checkpoint} ({model_cfg.num_layers} layers, hidden {model_cfg.hidden_size}, "
                 f"vocab {model_cfg.vocab_size}, params {model_cfg.param_dtype}, compute "
                 f"{model_cfg.compute_dtype})",
        "reference": ("the checkpoint itself (policy = reference)" if same else str(reference))
                     + f"; query log-probs of {ref_cache.num_queries} training queries "
                     + ("computed now and cached" if computed else "read from the run's cache")
                     + f" in {reference_cache_dir(cfg)}",
        "batch": f"{len(idx)} prompts of the {task.name} training set (the first of the run's "
                 f"step-{step} batch, seed {t.seed}), {G} responses each sampled by the "
                 f"checkpoint at temperature {r.temperature} (max {r.max_new_tokens} tokens); "
                 f"{n_tok} response tokens, {int(np.sum(batch.query_mask))} query targets",
        "rewards": f"task reward mean {float(rewards.mean()):.4g}"
                   + (f", KL-shaped mean {float(np.mean(per_response(shaped))):.4g}"
                      if shaping else "")
                   + f"; advantages {a.advantage}" + (" (critic values 0, as at step 0)"
                                                      if rec.needs_critic else ""),
        "old logp": "from the sampler (no synthetic noise)",
        "weights": f"{a.weight_scheme}, this batch's queries: "
                   + ", ".join(f"{x:.3f}" for x in w),
        "loss": f"terms on: {', '.join(rec.terms)}; pg_loss {lc.pg_loss}, "
                f"agg {lc.agg_mode}, clip [{1 - lc.eps_low:g}, {1 + lc.eps_high:g}], "
                f"kl_clamp {lc.kl_clamp}, "
                + (f"Policy-KL {lc.policy_kl_estimator} in the {lc.policy_kl_mode}, "
                   if lc.beta_policy > 0 or unit else "Policy-KL off, ")
                + f"Query-KL {lc.query_kl_estimator}, temperature "
                f"{r.temperature} (Query-KL at 1)",
    }
    return report
