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
    # Bad arguments: one sentence each, rc 2, before anything loads.
    if args.step < 0:
        raise ConfigError(f"inspect-grads: --step is {args.step}; give an RL step of the run "
                          "(>= 0).")
    if not 1 <= args.queries <= cfg.train.batch_size:
        raise ConfigError(f"inspect-grads: --queries is {args.queries}; give 1 to "
                          f"train.batch_size={cfg.train.batch_size} (groups of the step's batch).")
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


def run_position(cfg, step: int) -> tuple[int, float | None, str]:
    """(iterator position of step `step`'s first prompts, the adaptive
    Policy-KL coefficient in force at its start (None: not adaptive), where
    they were read). Without dynamic sampling the position is the step; with
    it, and for the adaptive coefficient, both come from the run's per-step
    metrics (<train.out_dir>/metrics.jsonl: `filter/batches` drawn and
    `kl_coef_next` of each step before it)."""
    import json
    from erpo_jax.runtime import rundir
    lc, a = cfg.loss, cfg.algo
    position = step
    coef = lc.beta_policy if lc.adaptive_kl else None
    if step == 0 or not (a.filter_groups or lc.adaptive_kl):
        return position, coef, "the run's config"
    path = rundir.path(cfg.train.out_dir) / "metrics.jsonl"
    what = " and ".join(x for x, on in (("the batches dynamic sampling drew", a.filter_groups),
                                        ("the adaptive KL coefficient", lc.adaptive_kl)) if on)
    try:
        rows = {r["step"]: r for r in map(json.loads, path.read_text().splitlines()) if r}
    except (OSError, ValueError) as e:
        raise ValueError(f"--step {step} of this run needs {what} at each step before it, from "
                         f"the run's {path} (train.out_dir), which cannot be read ({e}); point "
                         "train.out_dir at the run, or inspect --step 0.") from None
    missing = [s for s in range(1, step + 1) if s not in rows]
    if missing:
        raise ValueError(f"--step {step} of this run needs {what} at steps 1-{step}, but "
                         f"{path} has no row for step {missing[0]}; inspect a step the run "
                         "has reached.")
    if a.filter_groups:
        position = int(sum(rows[s].get("filter/batches", 1) for s in range(1, step + 1)))
    if lc.adaptive_kl:
        coef = float(rows[step]["kl_coef_next"])
    return position, coef, str(path)


def inspect_run(cfg, checkpoint: str, *, reference: str | None = None, queries: int = 2,
                step: int = 0, unit: bool = False, config_name: str = "") -> dict:
    """The gradient report of run `cfg`'s loss for the policy at `checkpoint`,
    on the real batch described in the module docstring; report['source']
    says what it ran on."""
    if not 1 <= queries <= cfg.train.batch_size:   # before the step's rollout
        raise ValueError(f"--queries must be in [1, train.batch_size={cfg.train.batch_size}] "
                         f"(groups of the step's batch), got {queries}.")
    batch, info = run_batch(cfg, checkpoint, reference=reference, step=step, unit=unit)
    return _report(info["cfg"], batch, info, queries=queries, step=step, unit=unit,
                   checkpoint=checkpoint, config_name=config_name)


def run_batch(cfg, checkpoint: str, *, reference: str | None = None, step: int = 0,
              unit: bool = False):
    """(RLBatch, info) of run `cfg`'s step `step` for the policy at
    `checkpoint`: the whole step's batch, drawn and assembled as the Trainer
    does (`rl.assemble`), from the run's programs. With `unit` the
    reference's response log-probs are in it even when the run has no
    Policy-KL (the inspector's --unit puts the term on)."""
    from erpo_jax.data.iterator import QueryBatchIterator
    from erpo_jax.rl import assemble, dynamic_sampling as ds
    from erpo_jax.rollout.types import rollout_key
    from erpo_jax.runtime.distributed import to_host
    from erpo_jax.train.config import validate
    from erpo_jax.train.host import sample
    from erpo_jax.train.loop import _put
    from erpo_jax.train.policy import load_policy
    from erpo_jax.train.programs import Programs
    from erpo_jax.train.startup import reference_cache_dir, reference_pass, start

    cfg = validate(cfg)   # method resolved: the coefficients and scheme the run uses
    if step < 0:
        raise ValueError(f"--step must be >= 0 (an RL step of the run), got {step}.")
    m = cfg.model
    # LoRA: --checkpoint may be a run's PEFT adapter directory (<out_dir>/adapter);
    # the policy is then the reference (the base) with those adapters.
    adapter_dir = None
    if m.lora_rank and (Path(checkpoint) / "adapter_config.json").is_file():
        adapter_dir = checkpoint
        if reference is None and not (m.init in ("sft", "hf") and _has_model(m.path)):
            raise ValueError(f"--checkpoint {checkpoint} holds LoRA adapters; their base model "
                             "is the config's model.path, which holds no model: give it, or "
                             "--reference DIR.")
    if reference is None:
        reference = m.path if m.init in ("sft", "hf") and _has_model(m.path) else checkpoint
    if adapter_dir is not None:
        checkpoint = reference
    for name, path in (("--checkpoint", checkpoint), ("--reference", reference)):
        if not _has_model(path):
            raise ValueError(f"{name} {path} is not a model directory (no config.json).")
    position, kl_coef, read_from = run_position(cfg, step)
    at = lambda path: dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, init="hf",
                                                                         path=str(path)))
    # The run's start-up; the task's rows are the run's (they depend on data.* alone).
    started = start(at(checkpoint), policy=f"the checkpoint {checkpoint}")
    sharding, task = started.sharding, started.task
    model_cfg, params, tok = started.model_cfg, started.params, started.tokenizer
    if adapter_dir is not None:
        from erpo_jax.model import lora
        params = lora.attach(lora.base(params), lora.load_peft(adapter_dir, model_cfg, sharding))
    same = Path(reference).resolve() == Path(checkpoint).resolve()
    t, r, a = cfg.train, cfg.rollout, cfg.algo
    G, B = r.group_size, t.batch_size
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
        progs = Programs(cfg, model_cfg, sharding, tok.eos_ids, tok.pad_id)
        rec = progs.recipe
        # The run's reference pass: the Trainer's cache directory (local or gs://) and key.
        # The reference is the base under LoRA (`Programs.reference_params`).
        ref_params = progs.reference_params(ref_params)
        ref_cache, computed = reference_pass(cfg, ref_params, progs.ref_cfg, tok, task, sharding,
                                             task.train_prompts)
        weights = ref_cache.weights(a.weight_scheme, a.weight_tau, a.weight_min, a.weight_max)
        iterator = QueryBatchIterator(len(task.train), B, t.seed)

        def sample_and_score(idx, key):
            ro = sample(progs.sampler, params, [task.train_prompts[i] for i in idx], key,
                        r.max_prompts_per_call)
            stats = dict(progs.sampler.last_stats)
            texts = tok.decode_responses(ro.response_tokens, ro.response_mask)
            rewards, reasons = task.reward_fn(texts, [task.train[i].answer for i in idx
                                                      for _ in range(G)])
            return ds.Draw(ro, np.asarray(idx), np.asarray(rewards, np.float32),
                           list(reasons), stats)

        key = rollout_key(jax.random.fold_in(jax.random.key(t.seed), 1), step)
        draws = ds.draw_step(sample_and_score, iterator.batch_at, position, key,
                             filter_groups=rec.filter_groups, batch_size=B, group_size=G,
                             limit=ds.max_draws(a, iterator.batches_per_epoch))
    finally:
        task.close()
    sel = ds.select(draws, a, batch_size=B, group_size=G, pad_id=tok.pad_id, step=step)
    base = assemble.layout(sel, ref_cache, weights, G)
    ref_logp = None
    if rec.needs_ref_logp or unit:
        ref_logp = to_host(progs.ref_logp_fn(ref_params, *_put((base.tokens, base.attn_mask),
                                                              sharding),
                                             last=sel.rollout.response_tokens.shape[1]))
    values_fn = None
    if rec.needs_critic:   # the Trainer's step-0 critic: a zero value head
        values_fn = lambda tok_, m: np.zeros((tok_.shape[0], tok_.shape[1] - 1), np.float32)
    out = assemble.build_batch(
        sel, cfg, rec, ref_cache=ref_cache, weights=weights,
        advantages_fn=progs.advantages_fn, ref_logp=ref_logp,
        kl_coef=None if kl_coef is None else np.float32(kl_coef), values_fn=values_fn,
        query_group=progs.query_group, base=base)
    if adapter_dir is not None:
        checkpoint = adapter_dir
    info = {"cfg": cfg, "params": params, "model_cfg": model_cfg, "recipe": rec, "task": task.name,
            "same": same, "reference": reference, "ref_cache": ref_cache,
            "computed": computed, "cache_dir": reference_cache_dir(cfg), "rewards": out.rewards,
            "task_rewards": sel.rewards, "metrics": out.info, "position": position,
            "draws": len(draws), "kl_coef": kl_coef, "read_from": read_from,
            "filler": int(sel.filler.sum())}
    return out.batch, info


def _report(cfg, batch, info, *, queries: int, step: int, unit: bool, checkpoint: str,
            config_name: str) -> dict:
    """The gradient report on the first `queries` groups of the step's batch
    (`cfg`: the method-resolved config `run_batch` ran)."""
    from erpo_jax.rl.batch import RLBatch, as_jax
    from erpo_jax.train.methods import describe
    t, r, a, lc = cfg.train, cfg.rollout, cfg.algo, cfg.loss
    G, B = r.group_size, t.batch_size
    rows = queries * G
    part = RLBatch(*[None if x is None else np.asarray(x)[:rows] for x in batch])
    if not np.asarray(part.response_mask).any():
        raise ValueError(f"the first {queries} groups of step {step}'s batch are dynamic "
                         "sampling's filler (no signal); raise --queries.")
    rec, model_cfg, params = info["recipe"], info["model_cfg"], info["params"]
    report = grad_flow.inspect_gradients(params, model_cfg, as_jax(part), lc, r.temperature,
                                         unit)
    rewards, shaped_mean = info["rewards"][:rows], info["metrics"].get("reward_shaped_mean")
    shaping = rec.shapes_rewards
    same, reference, ref_cache = info["same"], info["reference"], info["ref_cache"]
    computed = info["computed"]
    n_tok = int(np.sum(part.response_mask))
    drawn = (f", drawn from iterator position {info['position']} in {info['draws']} "
             f"batch(es) of dynamic sampling" if rec.filter_groups else "")
    if info["filler"]:
        drawn += f" ({info['filler']} filler groups in the step)"
    w = part.query_weight[::G]
    coef = ""
    if info["kl_coef"] is not None:
        coef = f"; adaptive Policy-KL coefficient {info['kl_coef']:.4g} (from {info['read_from']})"
    report["source"] = {
        "config": f"{config_name or cfg.name}: {describe(cfg)[len('[erpo] '):]}"
                  + (" (--unit: every coefficient set to 1)" if unit else ""),
        "model": f"{checkpoint} ({model_cfg.num_layers} layers, hidden {model_cfg.hidden_size}, "
                 f"vocab {model_cfg.vocab_size}, params {model_cfg.param_dtype}, compute "
                 f"{model_cfg.compute_dtype})",
        "reference": ("the checkpoint itself (policy = reference)" if same else str(reference))
                     + f"; query log-probs of {ref_cache.num_queries} training queries "
                     + ("computed now and cached" if computed else "read from the run's cache")
                     + f" in {info['cache_dir']}",
        "batch": f"{queries} prompts of the {info['task']} training set (the first {queries} "
                 f"of the {B} groups of the run's step-{step} batch, seed {t.seed}{drawn}), "
                 f"{G} responses each sampled by the checkpoint at temperature "
                 f"{r.temperature} (max {r.max_new_tokens} tokens); "
                 f"{n_tok} response tokens, {int(np.sum(part.query_mask))} query targets",
        "rewards": f"task reward mean {float(info['task_rewards'][:rows].mean()):.4g}"
                   + (f", with overlong shaping {float(rewards.mean()):.4g}"
                      if rec.overlong_buffer else "")
                   + (f", the step's KL-shaped mean {shaped_mean:.4g}"
                      if shaping and shaped_mean is not None else "")
                   + f"; advantages {a.advantage} over the step's whole batch"
                   + (" (critic values 0, as at step 0)" if rec.needs_critic else "") + coef,
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
