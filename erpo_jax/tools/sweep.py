"""`erpo sweep`: run an experiment file's variants x seeds, then report.

    erpo sweep experiments/main_comparison.py --cpu --seeds 0,1,2 [--only erpo,no_kl]
        [--jobs N] [--dry-run] [--runs-root runs] [--restart-stale] [--set section.field=value ...]

An experiment file (see `experiments/README.md`) defines `get_config()`,
`get_cpu_config()` and `sweep(cpu: bool) -> {variant name: RunConfig}` (or a
`VARIANTS` dict). Each variant's `name` is the method label the report groups
by. Run `k` of variant `v` of experiment `E` (the file's stem) lives in
`<runs-root>/E/v/seed<k>`, with `train.seed = k`; all runs of an experiment
share one reference-pass cache, `<runs-root>/E/.refcache`.

Per run, in order:
- done (the last metrics row is at `train.steps` and, if evaluation is on,
  evals.jsonl has the final step): skipped;
- stale (its saved config.json differs from the config it would run now, e.g.
  after the base config was retuned): not run, and named with the first
  differing field; `--restart-stale` deletes such a run directory and runs it
  again from scratch;
- otherwise run (a run directory with a checkpoint resumes from it: the
  trainer does that by itself).

Each run is a fresh `python -m erpo_jax.cli train --config <json>` process
(its output goes to `<run dir>/train.log`), so one crash does not end the
sweep and memory does not pile up over many runs. SIGTERM to the sweep is
passed on to the running trainers (they checkpoint and stop) and no further
run starts; the same command later resumes them. Jobs share a persistent XLA
compilation cache (`<runs-root>/.xla-cache`): runs of the same shapes compile
once. One line per run, with its wall time, is appended to
`<runs-root>/E/sweep.log`. At the end, every finished run under
`<runs-root>/E/` goes into `report.write_report` (`<runs-root>/E/report/`).

Runs that start from `model.init='sft'` at their SFT reference model get it
trained first if it is absent: the experiment file's `sft_config()` if it has
one, else the shared CPU reference (`runs/sft-arith/model`,
`presets.arith_sft_config()`). Where the package ships that config's export
(`erpo_jax/assets/slip_reference/`, the slip testbed's), it is installed
instead: training is bit-identical only on one CPU type, and a reference
retrained on another machine would start the runs of one comparison from
different weights (`--train-reference` trains it all the same).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from types import ModuleType
from typing import Iterable

from erpo_jax.runtime import rundir
from erpo_jax.tools.report import WALL_LOG, report_options
from erpo_jax.train.config import (ConfigError, RunConfig, apply_overrides, config_dict,
                                   from_dict, load_experiment, save_config, validate)
from erpo_jax.train.methods import resolve_method

# Fields that do not change what a run computes; a difference there is not stale.
# Configs are compared after `resolve_method`, so algo.method is only a label
# there (its coefficients and weight scheme are compared field by field).
_COSMETIC = {("train", "progress"), ("algo", "method")}


def variants(mod: ModuleType, cpu: bool) -> dict[str, RunConfig]:
    """{variant name: base RunConfig} of an experiment module."""
    if hasattr(mod, "sweep"):
        out = mod.sweep(cpu=cpu)
    elif hasattr(mod, "VARIANTS"):
        out = dict(mod.VARIANTS)
    else:
        name = "get_cpu_config" if cpu else "get_config"
        getter = getattr(mod, name, None)
        if getter is None:
            raise ValueError(f"experiment {mod.__file__} defines no {name}()"
                             + ("; drop --cpu to run its get_config()" if cpu else "") + ".")
        cfg = getter()
        out = {cfg.name: cfg}
    for name, cfg in out.items():
        if cfg.name != name:
            raise ValueError(f"variant {name!r} has config name {cfg.name!r}; they must match "
                             "(the report groups runs by name).")
        if "/" in name or name.startswith("."):
            raise ValueError(f"variant name {name!r} must be usable as a directory name.")
    return out


@dataclasses.dataclass(frozen=True)
class Run:
    experiment: str
    variant: str
    seed: int
    cfg: RunConfig

    @property
    def dir(self):
        return rundir.path(self.cfg.train.out_dir)

    @property
    def label(self) -> str:
        return f"{self.experiment}/{self.variant}/seed{self.seed}"


def plan(path: str | Path, seeds: Iterable[int], cpu: bool = False,
         only: Iterable[str] | None = None, runs_root: str | Path = "runs",
         overrides: Iterable[str] = ()) -> list[Run]:
    """The runs of an experiment file: variants (filtered by `only`) x seeds, each
    with the dotted `overrides` applied (before the sweep places it)."""
    exp = Path(path).stem
    table = variants(load_experiment(path), cpu)
    if only is not None:
        only = list(only)
        if not only:   # an empty list would select every variant
            raise ConfigError(f"--only names no variant; give comma-separated variant names of "
                              f"{exp} ({', '.join(table)}), or drop --only to run every "
                              "variant.")
        unknown = [n for n in only if n not in table]
        if unknown:
            raise ConfigError(f"--only {','.join(unknown)}: not a variant of {exp}; its "
                              f"variants are {', '.join(table)}.")
        table = {n: table[n] for n in only}
    root = Path(runs_root) / exp
    runs = []
    for name, base in table.items():
        base = apply_overrides(base, list(overrides))
        for seed in seeds:
            train = dataclasses.replace(base.train, seed=int(seed),
                                        out_dir=str(root / name / f"seed{seed}"),
                                        ref_cache_dir=str(root / ".refcache"))
            runs.append(Run(exp, name, int(seed), dataclasses.replace(base, train=train)))
    return runs


def _jsonable(cfg: RunConfig) -> dict:
    """The config as config.json holds it: method resolved (what the trainer saves)."""
    try:
        cfg = resolve_method(cfg)
    except ValueError:
        pass   # validate() reports it with the field's name
    return config_dict(cfg)


def _saved(path) -> dict:
    """A saved config.json with fields added since it was written at their defaults,
    so a newer erpo-jax does not call every older run stale."""
    data = rundir.read_json(path)
    try:
        return _jsonable(from_dict(RunConfig, data))
    except (TypeError, ValueError):
        return data


def _first_difference(a, b, path=()) -> tuple[str, ...] | None:
    if isinstance(a, dict) and isinstance(b, dict):
        for k in sorted(set(a) | set(b)):
            if path + (k,) in _COSMETIC:
                continue
            d = _first_difference(a.get(k), b.get(k), path + (k,))
            if d is not None:
                return d
        return None
    return None if a == b else path


def _rows(path) -> list[dict]:
    return rundir.read_jsonl(path)


def is_finished(run_dir) -> bool:
    """Final step reached (per its config.json) and, if evaluation is on, its final eval
    written (local or gs://)."""
    run_dir = rundir.path(run_dir)
    if not (run_dir / "config.json").exists():
        return False
    cfg = rundir.read_json(run_dir / "config.json")
    steps = cfg["train"]["steps"]
    metrics = _rows(run_dir / "metrics.jsonl")
    if steps > 0 and (not metrics or metrics[-1]["step"] < steps):
        return False
    if cfg["train"]["eval_every"] > 0:
        return any(e.get("step") == steps for e in _rows(run_dir / "evals.jsonl"))
    return True


def status(run: Run) -> tuple[str, str]:
    """('new' | 'partial' | 'done' | 'stale', detail)."""
    saved = run.dir / "config.json"
    if not saved.exists():
        return "new", ""
    diff = _first_difference(_saved(saved), _jsonable(run.cfg))
    if diff is not None:
        old = rundir.read_json(saved)
        new = _jsonable(run.cfg)
        for k in diff:
            old, new = (old or {}).get(k), (new or {}).get(k)
        return "stale", f"{'.'.join(diff)}: {old!r} in the run dir, {new!r} now"
    if is_finished(run.dir):
        return "done", ""
    return "partial", f"last step {(_rows(run.dir / 'metrics.jsonl') or [{'step': 0}])[-1]['step']}"


# ----------------------------------------------------------------------------- running


def _env(runs_root: Path) -> dict:
    env = dict(os.environ)
    env.setdefault("JAX_COMPILATION_CACHE_DIR", str((runs_root / ".xla-cache").resolve()))
    env.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "1")
    return env


class _Children:
    """Running run processes; SIGTERM to the sweep is passed on to them (each trainer
    then checkpoints and exits) and no further run starts."""

    def __init__(self):
        self.procs: set[subprocess.Popen] = set()
        self.stopping = threading.Event()
        self.lock = threading.Lock()

    def on_sigterm(self, signum, frame):
        self.stopping.set()
        with self.lock:
            for p in self.procs:
                p.send_signal(signal.SIGTERM)


_CHILDREN = _Children()


def _subprocess(kind: str, cfg: RunConfig, log: Path, runs_root: Path) -> int:
    """`erpo <kind> --config <cfg as json>` in a fresh process, output to `log`."""
    if _CHILDREN.stopping.is_set():
        return -signal.SIGTERM
    log.parent.mkdir(parents=True, exist_ok=True)
    cfg_file = log.parent / f".{kind}-config.json"
    save_config(cfg, cfg_file)
    with open(log, "a") as f:
        f.write(f"\n=== {time.strftime('%Y-%m-%d %H:%M:%S')} erpo {kind} {cfg_file}\n")
        f.flush()
        with _CHILDREN.lock:
            proc = subprocess.Popen([sys.executable, "-m", "erpo_jax.cli", kind, "--config",
                                     str(cfg_file)], stdout=f, stderr=subprocess.STDOUT,
                                    env=_env(runs_root))
            _CHILDREN.procs.add(proc)
        try:
            return proc.wait()
        finally:
            with _CHILDREN.lock:
                _CHILDREN.procs.discard(proc)


def sft_prerequisite(runs: list[Run], sft: RunConfig | None = None) -> RunConfig | None:
    """The SFT config if some run needs its model and it is absent; raises if a run
    needs an SFT model that is absent and that this runner does not know. `sft`:
    the experiment file's `sft_config()`, else the shared `presets.arith_sft_config()`."""
    from erpo_jax.tools.presets import arith_sft_config
    from erpo_jax.train.sft import MODEL_SUBDIR
    sft = sft or arith_sft_config()
    known = Path(sft.train.out_dir) / MODEL_SUBDIR
    for r in runs:
        m = r.cfg.model
        if m.init != "sft" or (Path(m.path) / "config.json").is_file():
            continue
        if Path(m.path).resolve() != known.resolve():
            raise ValueError(f"{r.label} starts from the SFT model {m.path}, which does not exist "
                             f"and is not the shared one ({known}); train it first.")
        return sft
    saved = Path(sft.train.out_dir) / "config.json"
    if any(r.cfg.model.init == "sft" and Path(r.cfg.model.path).resolve() == known.resolve()
           for r in runs) and saved.is_file():
        diff = _first_difference(_saved(saved), _jsonable(sft))
        if diff is not None:
            raise ValueError(f"{sft.train.out_dir} was trained with a different config "
                             f"({'.'.join(diff)} differs from the experiment's SFT config); "
                             "delete it, and the RL runs started from it, to retrain.")
    return None


# Committed exports of SFT reference configs: the folder holds the run's
# config.json as `sft_config.json` next to the exported model's files.
SHIPPED_REFERENCES = (Path(__file__).resolve().parents[1] / "assets" / "slip_reference",)
_NOT_MODEL = ("sft_config.json", "sft_eval.json", "README.md")


def _placed(data: dict, out_dir: str) -> dict:
    return {**data, "train": {**data.get("train", {}), "out_dir": out_dir}}


def shipped_reference(sft: RunConfig) -> Path | None:
    """The shipped export of the SFT config `sft` (wherever it is to go), or None."""
    want = _placed(_jsonable(sft), "")
    for d in SHIPPED_REFERENCES:
        saved = d / "sft_config.json"
        if saved.is_file() and _first_difference(_placed(_saved(saved), ""), want) is None:
            return d
    return None


def install_reference(sft: RunConfig, src: Path) -> Path:
    """Copy the shipped export `src` to `<sft out_dir>/model`, with its config.json
    in the out_dir as training it there would have written; the model folder
    appears whole or not at all. Returns the model folder."""
    from erpo_jax.train.sft import MODEL_SUBDIR
    out = Path(sft.train.out_dir)
    model, part = out / MODEL_SUBDIR, out / (MODEL_SUBDIR + ".partial")
    if part.exists():
        shutil.rmtree(part)
    part.mkdir(parents=True)
    for f in sorted(src.iterdir()):
        if f.is_file() and f.name not in _NOT_MODEL:
            shutil.copy2(f, part / f.name)
    rundir.write_json(out / "config.json",
                      _placed(rundir.read_json(src / "sft_config.json"), sft.train.out_dir))
    if model.exists():   # an export cut off before its config.json (what marks it whole)
        shutil.rmtree(model)
    part.rename(model)
    return model


def _log(path: Path, line: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a") as f:
        f.write(line + "\n")
    print(line, flush=True)


def run_sweep(runs: list[Run], jobs: int = 1, runs_root: str | Path = "runs",
              dry_run: bool = False, restart_stale: bool = False,
              sft: RunConfig | None = None,
              train_reference: bool = False) -> dict[str, list[Run]]:
    """Run what is not done, the SFT model they start from first (`sft`: see
    `sft_prerequisite`; installed from the package where it ships that model,
    unless `train_reference`); returns {'done', 'ran', 'failed', 'stale': [Run]}."""
    for r in runs:
        validate(r.cfg)
    if not dry_run and rundir.is_remote(runs_root):
        raise ValueError(f"--runs-root {runs_root}: the sweep starts its runs as local processes "
                         "that log into their run directories, so it runs on a local disk only "
                         "(--dry-run can check a remote one); on a TPU slice, run `erpo train "
                         "train.out_dir=gs://...` per run instead.")
    runs_root = rundir.path(runs_root)
    out = {"done": [], "ran": [], "failed": [], "stale": []}
    todo = []
    exps = sorted({r.experiment for r in runs})
    logs = {e: runs_root / e / "sweep.log" for e in exps}
    for r in runs:
        st, detail = status(r)
        if st == "stale" and restart_stale and not dry_run:
            r.dir.rmtree()
            st = "new"
        if st == "done":
            out["done"].append(r)
        elif st == "stale":
            out["stale"].append(r)
            print(f"[sweep] STALE {r.label}: {detail}; --restart-stale deletes and reruns it",
                  flush=True)
        else:
            todo.append(r)
        if dry_run:
            print(f"[sweep] {st:7s} {r.label} {detail}".rstrip(), flush=True)
    if dry_run:
        return out
    sft = sft_prerequisite(todo, sft)
    shipped = None if sft is None or train_reference else shipped_reference(sft)
    if shipped is not None:
        model = install_reference(sft, shipped)
        for e in exps:
            _log(logs[e], f"{time.strftime('%Y-%m-%d %H:%M:%S')} {sft.name}: installed the "
                          f"shipped export {shipped} as {model} (--train-reference trains it)")
    elif sft is not None:
        t0 = time.perf_counter()
        rc = _subprocess("sft", sft, Path(sft.train.out_dir) / "sft.log", runs_root)
        for e in exps:
            _log(logs[e], f"{time.strftime('%Y-%m-%d %H:%M:%S')} {sft.name} rc={rc} "
                          f"wall={time.perf_counter() - t0:.0f}s")
        if rc != 0:
            raise RuntimeError(f"the SFT reference run failed (rc={rc}); see "
                               f"{sft.train.out_dir}/sft.log")

    def one(r: Run) -> tuple[Run, int]:
        t0 = time.perf_counter()
        st, detail = status(r)
        if _CHILDREN.stopping.is_set():
            return r, 1
        rc = _subprocess("train", r.cfg, r.dir / "train.log", runs_root)
        ok = rc == 0 and is_finished(r.dir)
        state = "ok" if ok else "interrupted" if _CHILDREN.stopping.is_set() else "FAILED"
        wall = round(time.perf_counter() - t0, 1)   # one value for the log and the record
        _log(logs[r.experiment], f"{time.strftime('%Y-%m-%d %H:%M:%S')} {r.label} "
                                 f"{state} rc={rc} steps={r.cfg.train.steps} "
                                 f"from={st}{' (' + detail + ')' if detail else ''} "
                                 f"wall={wall:.0f}s")
        if (r.dir / "config.json").exists():   # the run's own record, which summaries keep
            with open(r.dir / WALL_LOG, "a") as f:
                f.write(json.dumps({"time": time.strftime("%Y-%m-%d %H:%M:%S"), "state": state,
                                    "from": st, "wall_s": wall}) + "\n")
        return r, 0 if ok else (rc or 1)

    main = threading.current_thread() is threading.main_thread()
    old = signal.signal(signal.SIGTERM, _CHILDREN.on_sigterm) if main else None
    try:
        with ThreadPoolExecutor(max_workers=max(1, jobs)) as pool:
            for r, rc in pool.map(one, todo):
                out["ran" if rc == 0 else "failed"].append(r)
    finally:
        if old is not None:
            signal.signal(signal.SIGTERM, old)
    return out


def finished_run_dirs(exp_dir: str | Path) -> list[Path]:
    """Finished run directories `<exp_dir>/<variant>/seed<k>`, sorted."""
    return sorted(p.parent for p in Path(exp_dir).glob("*/seed*/config.json")
                  if is_finished(p.parent))


def report(exp_dir: str | Path, mod: ModuleType | None = None) -> Path | None:
    """REPORT.md and PNGs of every finished run of an experiment, in `<exp_dir>/report`."""
    from erpo_jax.tools.report import load_run, report_runs
    from erpo_jax.tools.run_summary import write_summaries
    exp_dir = Path(exp_dir)
    dirs = finished_run_dirs(exp_dir)
    if not dirs:
        return None
    title, kw = report_options(mod, exp_dir.name)
    runs = [load_run(d) for d in dirs]
    path = report_runs(runs, exp_dir / "report", title=title, **kw)
    # The committable record: report/ with runs/<variant>/seed<k>.json can be copied to
    # experiments/results/<experiment>/, and `erpo report --experiment` remakes it.
    write_summaries(runs, exp_dir / "report" / "runs")
    return path


# ----------------------------------------------------------------------------- CLI


def add_parser(subparsers) -> None:
    p = subparsers.add_parser("sweep", help="run an experiment's variants x seeds, then report")
    _arguments(p)
    p.set_defaults(func=_run)


def _arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("experiment", help="experiment file, e.g. experiments/main_comparison.py")
    p.add_argument("--seeds", default="0", help="comma-separated seeds (default 0)")
    p.add_argument("--cpu", action="store_true", help="the CPU variant of every config")
    p.add_argument("--only", default=None, help="comma-separated variant names (default: "
                   "every variant)")
    p.add_argument("--jobs", type=int, default=1, help="runs in parallel (default 1)")
    p.add_argument("--dry-run", action="store_true", help="list the runs and their state only")
    p.add_argument("--runs-root", default="runs", help="where run directories go")
    p.add_argument("--restart-stale", action="store_true",
                   help="delete and rerun runs whose saved config differs from the current one")
    p.add_argument("--no-report", action="store_true", help="skip the report at the end")
    p.add_argument("--train-reference", action="store_true",
                   help="train the SFT reference where the package ships its export "
                        "(the shipped one is installed by default: the same weights on "
                        "every machine)")
    p.add_argument("--set", dest="overrides", nargs="+", action="extend", default=[],
                   metavar="SECTION.FIELD=VALUE", help="overrides for every run (e.g. "
                   "train.steps=4 for a smoke sweep, with another --runs-root)")


def _run(args: argparse.Namespace) -> int:
    try:
        seeds = [int(s) for s in args.seeds.split(",") if s.strip()]
    except ValueError:
        raise ConfigError(f"--seeds {args.seeds!r}: give comma-separated non-negative integers, "
                          "e.g. --seeds 0,1,2.") from None
    if not seeds or min(seeds) < 0:
        raise ConfigError(f"--seeds {args.seeds!r}: give comma-separated non-negative integers, "
                          "e.g. --seeds 0,1,2.")
    only = None if args.only is None else [s.strip() for s in args.only.split(",") if s.strip()]
    mod = load_experiment(args.experiment)
    runs = plan(args.experiment, seeds, args.cpu, only, args.runs_root, args.overrides)
    print(f"[sweep] {len(runs)} runs of {Path(args.experiment).stem} "
          f"({'CPU' if args.cpu else 'full'} configs, seeds {seeds}, jobs {args.jobs})",
          flush=True)
    t0 = time.perf_counter()
    sft = mod.sft_config() if hasattr(mod, "sft_config") else None
    out = run_sweep(runs, args.jobs, args.runs_root, args.dry_run, args.restart_stale, sft,
                    args.train_reference)
    if args.dry_run:
        return 0
    print(f"[sweep] {len(out['ran'])} ran, {len(out['done'])} already done, "
          f"{len(out['failed'])} failed, {len(out['stale'])} stale, "
          f"{time.perf_counter() - t0:.0f} s", flush=True)
    if not args.no_report:
        path = report(Path(args.runs_root) / Path(args.experiment).stem, mod)
        print(f"[sweep] report: {path}" if path else "[sweep] no finished runs to report")
    return 1 if out["failed"] or out["stale"] else 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m erpo_jax.tools.sweep", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    _arguments(p)
    return _run(p.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
