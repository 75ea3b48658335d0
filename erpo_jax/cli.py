"""The `erpo` command line: one entry point, one subcommand per job.

    erpo sft    --config experiments/sft_arith.py [section.field=value ...]
    erpo train  --config experiments/main_comparison.py loss.beta_query=0.1
    erpo eval   --config FILE [--checkpoint DIR] [--out DIR | --into-run]
    erpo inspect-grads --config FILE --checkpoint DIR [--json OUT] [--unit] ...
    erpo sweep  experiments/main_comparison.py --seeds 0,1,2 --cpu
    erpo report runs/main_comparison/*/seed* --out runs/main_comparison/report
    erpo bench  [--quick]
    erpo plan   --config FILE --topology v4-8 [--json out.json] [--suggest]
    erpo demo   (the embedded CPU demo: the slip testbed's reference, RL three ways, a summary)
    erpo config --show [--config FILE] [section.field=value ...]

Every config field can be overridden with `section.field=value`, anywhere on
the line; invalid values fail before anything compiles, with a sentence naming
the field. `erpo config --show [--config FILE] [overrides]` lists every field
with the value it resolves to and its doc (the sections are defined in
erpo_jax/train/config.py). `erpo eval` writes its results beside the model it evaluates
(`<model>-eval-...`, or `--out DIR`), never into a training run's directory
unless `--into-run` says so (then as an eval of the run, not a training step).
`erpo eval`, `erpo report` and `erpo demo` refuse an `--out` that is a file, a
training run's directory, or holds another kind of output or the same kind made
with other settings (an eval of another model or settings, a --quick demo for a
full one); `--force` writes over another output (never over a training run).

Exit codes: 0 done; 1 the run failed (one sentence on stderr; set
ERPO_JAX_TRACEBACK=1 for the traceback); 2 a bad config field, config file,
override or output path, or a run directory another run holds; 75 `erpo train`
was stopped by SIGTERM (preemption) after saving a checkpoint: rerun the same
command to resume.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys


def _load(args):
    from erpo_jax.train.config import load_config
    cfg = load_config(args.config, args.overrides, cpu=args.cpu)
    args.run_dir = cfg.train.out_dir   # where a failure may have left a resumable run
    return cfg


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


def _eval_settings(cfg) -> dict:
    """What an evaluation's numbers depend on besides the model."""
    t = cfg.train
    return {"data": dataclasses.asdict(cfg.data), "seed": t.seed, "eval_split": t.eval_split,
            "eval_n": t.eval_n, "eval_k": list(t.eval_k), "eval_temperature": t.eval_temperature,
            "eval_max_problems": t.eval_max_problems,
            "max_new_tokens": cfg.rollout.max_new_tokens,
            "dtypes": [cfg.model.param_dtype, cfg.model.compute_dtype]}


def _eval_dir(cfg, settings: dict) -> str:
    """The default directory of `erpo eval`'s results: beside the model it
    evaluates, named for it and the settings (never a training run's directory)."""
    import hashlib
    digest = hashlib.sha256(json.dumps(settings, sort_keys=True).encode()).hexdigest()[:8]
    tag = f"eval-{cfg.train.eval_split}-n{cfg.train.eval_n}-{digest}"
    m = cfg.model
    base = m.path if m.init in ("sft", "hf") else f"{cfg.train.out_dir}-random-{m.preset}"
    return f"{base.rstrip('/')}-{tag}"


def _model_name(cfg) -> str:
    """The model `erpo eval` evaluates, as its eval_config.json records it."""
    return cfg.model.path if cfg.model.init in ("sft", "hf") else f"random {cfg.model.preset}"


def _eval(args) -> int:
    import time

    import jax

    from erpo_jax.runtime import rundir
    from erpo_jax.train.config import ConfigError, validate
    from erpo_jax.train.evaluate import Evaluator, keep_evals, write_eval
    from erpo_jax.train.policy import require_model_dir
    from erpo_jax.train.startup import start
    cfg = _load(args)
    args.run_dir = None   # eval leaves no run to resume
    if args.checkpoint:
        require_model_dir(args.checkpoint, "--checkpoint")
        cfg = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, init="hf",
                                                                 path=args.checkpoint))
    validate(cfg)
    if cfg.data.task == "jsonl" and not cfg.data.eval_benchmarks and \
            cfg.train.eval_split == "test":
        raise ConfigError("config field data.eval_benchmarks: is empty, so this JSONL task has "
                          "no evaluation set for erpo eval to run; name benchmarks (e.g. "
                          "data.eval_benchmarks=gsm8k) or evaluate on held-out training rows "
                          "(data.n_val=100 train.eval_split=validation).")
    settings = _eval_settings(cfg)
    # Where the results go, checked before the work.
    if args.into_run:
        out = args.out or cfg.train.out_dir
        if not rundir.is_run_dir(out):
            raise ConfigError(f"--into-run: {out} holds no training run (no metrics.jsonl or "
                              "checkpoints/); drop --into-run to write an eval directory.")
        rundir.check_output_dir(out, "--out")
    else:
        out = args.out or _eval_dir(cfg, settings)
        # The default directory is named for the model and the settings; an
        # --out holding an evaluation of another model or with other settings
        # (or another kind of output) is refused unless --force.
        rundir.claim_output_dir(out, "--out", "eval", json.loads(json.dumps(
                                    {"model": _model_name(cfg), "settings": settings})),
                                force=args.force,
                                run_hint=", or pass --into-run to record the evaluation there "
                                "as an eval of the run (external_evals.jsonl), never as a "
                                "training step")
    s = start(cfg, policy="the model evaluated")
    try:
        res = Evaluator(s.model_cfg, s.task, s.cfg, s.sharding).evaluate(
            s.params, jax.random.key(cfg.train.seed), 0)
    finally:
        s.task.close()
    if not res["sets"]:   # the task loaded no evaluation set (checked above for the known cases)
        raise ConfigError("the task loaded no evaluation set to run; name benchmarks in "
                          "data.eval_benchmarks, or set data.n_val with "
                          "train.eval_split=validation.")
    out = rundir.path(out)
    model = _model_name(cfg)
    if args.into_run:   # recorded as an eval of the run, never as one of its training steps
        stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime())
        row = {"time": stamp, "model": model, "settings": settings,
               "sets": res["sets"], "average": res["average"]}
        rundir.write_json(out / f"external_eval_{stamp}.json", {**row, "samples": res["samples"]},
                          indent=2)
        rundir.append_line(out / "external_evals.jsonl", row)
    else:
        keep_evals(out, lambda s: False)   # this directory holds the latest evaluation
        write_eval(out, res)
        rundir.write_json(out / "eval_config.json", {"model": model, "settings": settings},
                          indent=2, sort_keys=True)
    print(json.dumps({"sets": res["sets"], "average": res["average"], "out": str(out)}, indent=2))
    return 0


def _config(args) -> int:
    from erpo_jax.train.config import validate
    from erpo_jax.train.config_doc import show_lines
    # Checked as `erpo train` checks it (a config it would refuse is refused here,
    # rc 2), method resolved: the coefficients as the run saves them.
    cfg = validate(_load(args))
    args.run_dir = None
    print("\n".join(show_lines(cfg, docs=not args.no_docs)))
    return 0


def _demo(args) -> int:
    from erpo_jax.tools.demo import run_demo
    return run_demo(args)


def _config_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", default=None, help="experiment file (.py with get_config) or .json")
    p.add_argument("--cpu", action="store_true", help="use the file's get_cpu_config()")
    p.add_argument("overrides", nargs="*", help="section.field=value overrides, anywhere on "
                   "the line; every field, its value and its doc: erpo config --show "
                   "[--config FILE] [overrides]")


# Where every field is listed, in the help of each command that takes a config.
FIELDS_EPILOG = ("Every field (section.field), the value it resolves to for a --config and "
                 "overrides, and its doc: `erpo config --show [--config FILE] [--cpu] "
                 "[section.field=value ...]`; the sections are defined in "
                 "erpo_jax/train/config.py.")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="erpo", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("sft", help="supervised fine-tuning (the warm start / reference model)",
                       epilog=FIELDS_EPILOG)
    _config_args(p)
    p.set_defaults(func=_sft)
    p = sub.add_parser("train", help="RL training (GRPO / PPO / REINFORCE, with ERPO)",
                       epilog=FIELDS_EPILOG)
    _config_args(p)
    p.set_defaults(func=_train)
    p = sub.add_parser("eval", help="greedy pass@1 and sampled pass@k on the evaluation sets",
                       epilog=FIELDS_EPILOG)
    _config_args(p)
    p.add_argument("--checkpoint", default=None, help="an HF-format model directory to evaluate "
                   "(a run's is <out_dir>/model)")
    p.add_argument("--out", default=None, help="the directory to write the results in (default: "
                   "beside the model, <model>-eval-<split>-n<eval_n>-<settings hash>); never a "
                   "training run's directory unless --into-run")
    p.add_argument("--into-run", action="store_true", help="record the results in a training "
                   "run's directory (--out, default train.out_dir) as an eval of it, in "
                   "external_evals.jsonl: never as a training step")
    p.add_argument("--force", action="store_true", help="write into an --out that holds "
                   "another evaluation (of another model or with other settings), a report or "
                   "a demo, replacing the evaluation there (never a training run's directory)")
    p.set_defaults(func=_eval)
    from erpo_jax.tools import bench, plan, report, sweep
    from erpo_jax.train.inspect_grads import add_parser as add_inspect
    add_inspect(sub)
    report.add_parser(sub)
    sweep.add_parser(sub)
    bench.add_parser(sub)
    plan.add_parser(sub)
    p = sub.add_parser("config", help="every config field with its resolved value and doc",
                       epilog=FIELDS_EPILOG)
    _config_args(p)
    p.add_argument("--show", action="store_true", help="print the resolved config, one "
                   "section.field = value line per field with its doc (the default action)")
    p.add_argument("--no-docs", action="store_true", help="values only")
    p.set_defaults(func=_config)
    p = sub.add_parser("demo", help="the embedded CPU demo (no download)")
    p.add_argument("--out", default="runs/demo", help="output directory")
    p.add_argument("--quick", action="store_true", help="a minimal run for smoke tests")
    p.add_argument("--rebuild-reference", action="store_true",
                   help="train the slip testbed's reference model (900 SFT steps, about 9 "
                        "minutes on 2 cores) instead of using the one the package ships")
    p.add_argument("--force", action="store_true",
                   help="replace what --out holds: a demo made with other settings (its runs "
                        "start over), a report or an evaluation (never a training run)")
    p.set_defaults(func=_demo)
    return parser


def _user_errors() -> tuple:
    """What a bad input, bad data or a failing disk raises: reported in one sentence."""
    from erpo_jax.train.checkpoint import SaveFailed
    return ValueError, FloatingPointError, OSError, SaveFailed


def _parse(argv: list[str] | None) -> argparse.Namespace:
    """The command line, with `section.field=value` overrides accepted anywhere
    on it (argparse alone takes them only in one run of positionals)."""
    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    if extra and hasattr(args, "overrides") and args.command not in ("sweep",):
        stray = [a for a in extra if a.startswith("-") or "=" not in a]
        if not stray:
            args.overrides = [*(args.overrides or []), *extra]
            extra = []
    if extra:
        parser.error(f"unrecognized arguments: {' '.join(extra)}")
    return args


def _resumable(run_dir) -> bool:
    """Whether `run_dir` holds a checkpoint a rerun resumes from."""
    if not run_dir:
        return False
    from erpo_jax.runtime import rundir
    try:
        ckpts = rundir.path(run_dir) / "checkpoints"
        return ckpts.is_dir() and any(p.name.isdigit() for p in ckpts.iterdir())
    except OSError:
        return False


def main(argv: list[str] | None = None) -> int:
    import os
    args = _parse(argv)
    args.run_dir = None
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
        from erpo_jax.train.config import ConfigError
        config = isinstance(e, ConfigError) or (isinstance(e, ValueError)
                                                and str(e).startswith("config field"))
        text = " ".join(str(e).split()) or type(e).__name__
        if (isinstance(e, OSError) and not config and "rerun" not in text
                and args.command in ("train", "sft") and _resumable(args.run_dir)):
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
