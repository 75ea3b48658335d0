"""The `erpo` command line: one entry point, one subcommand per job.

    erpo sft    --config experiments/sft_arith.py [section.field=value ...]
    erpo train  --config experiments/main_comparison.py loss.beta_query=0.1
    erpo eval   --config FILE [--checkpoint DIR]
    erpo inspect-grads --config FILE --checkpoint DIR [--json OUT] [--unit] ...
    erpo sweep  experiments/main_comparison.py --seeds 0,1,2 --cpu
    erpo report runs/main_comparison/*/seed* --out runs/main_comparison/report
    erpo bench  [--quick]
    erpo plan   --config FILE --topology v4-8 [--json out.json] [--suggest]
    erpo demo   (the embedded CPU demo: SFT, then RL three ways, then a summary)

Every config field can be overridden with `section.field=value`; invalid
values fail before anything compiles, with a sentence naming the field.

Exit codes: 0 done; 1 the run failed (one sentence on stderr; set
ERPO_JAX_TRACEBACK=1 for the traceback); 2 a bad config field; 75 `erpo train`
was stopped by SIGTERM (preemption) after saving a checkpoint: rerun the same
command to resume.
"""

from __future__ import annotations

import argparse
import json
import sys


def _load(args):
    from erpo_jax.train.config import load_config
    return load_config(args.config, args.overrides, cpu=args.cpu)


def _sft(args) -> int:
    from erpo_jax.train.sft import run_sft
    out = run_sft(_load(args))
    print(json.dumps({"model_dir": out["model_dir"], "eval": out["eval"]["average"]}, indent=2))
    return 0


def _train(args) -> int:
    from erpo_jax.train.loop import train
    out = train(_load(args))
    summary = {"status": out["status"], "step": out["step"],
               "ref_forward_calls": out["ref_forward_calls"]}
    if out.get("model_dir"):
        summary["model_dir"] = out["model_dir"]
    if out.get("eval"):
        summary["eval"] = out["eval"]["average"]
    print(json.dumps(summary, indent=2))
    if out["status"] == "preempted":
        from erpo_jax.train.loop import PREEMPTED_EXIT_CODE
        return PREEMPTED_EXIT_CODE
    return 0


def _eval(args) -> int:
    import dataclasses

    import jax

    from erpo_jax.runtime import compile_cache
    from erpo_jax.train.evaluate import Evaluator, write_eval
    from erpo_jax.train.policy import build_sharding, load_policy
    from erpo_jax.train.tasks import load_task
    from erpo_jax.runtime import rundir
    from erpo_jax.train.config import validate
    cfg = _load(args)
    if args.checkpoint:
        cfg = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, init="hf",
                                                                 path=args.checkpoint))
    validate(cfg)
    compile_cache.configure(cfg.train.compile_cache)
    sharding = build_sharding(cfg)
    model_cfg, params, tok = load_policy(cfg, sharding)
    task = load_task(cfg, tok)
    try:
        res = Evaluator(model_cfg, task, cfg, sharding).evaluate(
            params, jax.random.key(cfg.train.seed), 0)
    finally:
        task.close()
    out = rundir.path(args.out or cfg.train.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    write_eval(out, res)
    print(json.dumps({"sets": res["sets"], "average": res["average"]}, indent=2))
    return 0


def _demo(args) -> int:
    from erpo_jax.tools.demo import run_demo
    return run_demo(args)


def _config_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", default=None, help="experiment file (.py with get_config) or .json")
    p.add_argument("--cpu", action="store_true", help="use the file's get_cpu_config()")
    p.add_argument("overrides", nargs="*", help="section.field=value overrides")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="erpo", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("sft", help="supervised fine-tuning (the warm start / reference model)")
    _config_args(p)
    p.set_defaults(func=_sft)
    p = sub.add_parser("train", help="RL training (GRPO / PPO / REINFORCE, with ERPO)")
    _config_args(p)
    p.set_defaults(func=_train)
    p = sub.add_parser("eval", help="greedy pass@1 and sampled pass@k on the evaluation sets")
    _config_args(p)
    p.add_argument("--checkpoint", default=None, help="an HF-format model directory to evaluate")
    p.add_argument("--out", default=None, help="where to write the results")
    p.set_defaults(func=_eval)
    from erpo_jax.tools import bench, plan, report, sweep
    from erpo_jax.train.inspect_grads import add_parser as add_inspect
    add_inspect(sub)
    report.add_parser(sub)
    sweep.add_parser(sub)
    bench.add_parser(sub)
    plan.add_parser(sub)
    p = sub.add_parser("demo", help="the embedded CPU demo (no download)")
    p.add_argument("--out", default="runs/demo", help="output directory")
    p.add_argument("--quick", action="store_true", help="a minimal run for smoke tests")
    p.set_defaults(func=_demo)
    return parser


def _user_errors() -> tuple:
    """What a bad input, bad data or a failing disk raises: reported in one sentence."""
    from erpo_jax.train.checkpoint import SaveFailed
    return ValueError, FloatingPointError, OSError, SaveFailed


def main(argv: list[str] | None = None) -> int:
    import os
    args = build_parser().parse_args(argv)
    # Exceptions nobody can raise (orbax's abandoned coroutines after a failed
    # save or restore) are held back: replayed if the command ends otherwise,
    # dropped after a user error, whose one sentence says what happened.
    held, hook = [], sys.unraisablehook
    sys.unraisablehook = held.append
    try:
        result = args.func(args)
        return result if isinstance(result, int) else 0
    except _user_errors() as e:
        if os.environ.get("ERPO_JAX_TRACEBACK"):
            raise
        import gc
        gc.collect()
        held.clear()
        sys.unraisablehook = lambda unraisable: None   # and at exit, for the same failure
        hook = sys.unraisablehook
        config = isinstance(e, ValueError) and str(e).startswith("config field")
        text = " ".join(str(e).split()) or type(e).__name__
        if isinstance(e, OSError) and not config and "rerun" not in text:
            text += ("; files in the run directory are intact up to the last checkpoint: fix "
                     "the cause and rerun the same command to resume")
        print(f"erpo {args.command}: {text}", file=sys.stderr, flush=True)
        return 2 if config else 1
    finally:
        sys.unraisablehook = hook
        for u in held:
            hook(u)


if __name__ == "__main__":
    sys.exit(main())
