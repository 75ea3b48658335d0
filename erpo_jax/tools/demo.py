"""The embedded CPU demo: what `erpo demo` (the README's first command) runs.

It runs on the slip testbed (experiments/SLIP_TESTBED.md): a reference model
whose worked solutions drop a carry or a borrow, so it often knows the right
answer without committing to it (sampled pass@8 well above greedy pass@1) and
RL has something to fix.

1. The reference: the `arith-medium` model SFT'd for 900 steps on slipped
   demonstrations (`presets.slip_sft_config`). Its export ships with the
   package (`erpo_jax/assets/slip_reference/`, 6 MB), so the demo starts at RL;
   `--rebuild-reference` trains it again (about 9 minutes on 2 cores), bit for
   bit the same weights on the same CPU type and JAX version
   (tests/test_demo.py).
2. RL from it three ways with the same budget (50 steps, 16 prompts x 8
   samples, the testbed's tuned coefficients): GRPO + Policy-KL, no KL, ERPO.
3. Evaluation before and after on the six held-out families (100 problems
   each): greedy pass@1, pass@1 and pass@8 from 8 samples at temperature 1;
   query drift; a markdown summary with the table and PNG plots.
"""

from __future__ import annotations

import dataclasses
import json
import math
import time
from pathlib import Path

from erpo_jax.tools.presets import BETA_POLICY, BETA_QUERY, METHODS, SLIP_ENTROPY_FLOOR, \
    slip_method_config, slip_sft_config
from erpo_jax.train.config import RunConfig

# The committed export of slip_sft_config() (README of that folder: how it was made).
REFERENCE = Path(__file__).resolve().parents[1] / "assets" / "slip_reference"
STEPS = 50
LABELS = {"grpo+policy_kl": f"GRPO + Policy-KL (beta {BETA_POLICY})", "no_kl": "no KL",
          "erpo": f"ERPO (beta_query {BETA_QUERY}, likelihood weights)"}
ONE_SEED = ("One seed: it shows the size of RL's lift and of ERPO's lead at this budget, "
            "not their spread; experiments/RESULTS.md has them over 5 seeds with 95% CIs.")


def _pct(x: float | None) -> str:
    return "-" if x is None or not math.isfinite(x) else f"{100 * x:.1f}%"


def _last_drift(run: dict) -> float | None:
    vals = [m["drift/qkl_k3"] for m in run["metrics"] if "drift/qkl_k3" in m]
    return vals[-1] if vals else None


def accuracy_table(runs: list[dict]) -> str:
    """Markdown: the reference (every run's step-0 evaluation) and each method
    after RL, with its change in greedy pass@1, and its last query drift."""
    keys = (("greedy_acc", "greedy pass@1"), ("pass@1", "sampled pass@1"),
            ("pass@8", "sampled pass@8"))
    first = runs[0]["evals"][0]["average"]
    c = runs[0]["config"]
    rows = [f"| method ({c['train']['steps']} RL steps, {c['train']['batch_size']} prompts x "
            f"{c['rollout']['group_size']} samples) | "
            + " | ".join(label for _, label in keys) + " | query drift (QKL k3, held-out) |",
            "|---|" + "---|" * (len(keys) + 1),
            "| reference (the SFT model, step 0) | "
            + " | ".join(_pct(first.get(k)) for k, _ in keys) + " | 0 |"]
    for r in runs:
        last = r["evals"][-1]["average"]
        cells = [_pct(last.get(k)) for k, _ in keys]
        cells[0] += f" ({100 * (last['greedy_acc'] - first['greedy_acc']):+.1f})"
        drift = _last_drift(r)
        rows.append(f"| {LABELS.get(r['name'], r['name'])} | " + " | ".join(cells)
                    + f" | {'-' if drift is None else f'{drift:.3f}'} |")
    return "\n".join(rows)


def _sft_done(cfg: RunConfig) -> bool:
    """An SFT run with the same config already exported its model."""
    from erpo_jax.train.config import from_dict
    out = Path(cfg.train.out_dir)
    saved = out / "config.json"
    if not (out / "model" / "config.json").is_file() or not saved.is_file():
        return False
    try:  # fields added since the run was saved take their defaults
        return from_dict(RunConfig, json.loads(saved.read_text())) == cfg
    except (TypeError, ValueError):
        return False


def _shipped(rebuild: bool) -> bool:
    """Whether the demo starts from the reference the package ships."""
    return not rebuild and (REFERENCE / "model.safetensors").is_file()


def reference_dir(out: Path, rebuild: bool) -> Path:
    """Where `reference_model` puts (or finds) the reference, before it runs."""
    from erpo_jax.train.sft import MODEL_SUBDIR
    return REFERENCE if _shipped(rebuild) else out / "sft" / MODEL_SUBDIR


def reference_model(out: Path, rebuild: bool) -> Path:
    """The reference model directory: the committed one, or (rebuild, or the
    package was installed without it) slip_sft_config() trained into out/sft."""
    if _shipped(rebuild):
        print(f"[demo] 1/3 the slip testbed's reference model, shipped in {REFERENCE} "
              "(erpo demo --rebuild-reference trains it again)")
        return REFERENCE
    from erpo_jax.train.sft import MODEL_SUBDIR, run_sft
    cfg = slip_sft_config(str(out / "sft"))
    if _sft_done(cfg):
        print(f"[demo] 1/3 reusing the reference model in {out / 'sft' / MODEL_SUBDIR}")
    else:
        print("[demo] 1/3 SFT of the slip testbed's reference model (900 steps)")
        run_sft(cfg)
    return out / "sft" / MODEL_SUBDIR


def demo_config(method: str, reference: Path, out: Path, quick: bool = False) -> RunConfig:
    """One demo run: the slip testbed's `method` at STEPS steps, evaluated at
    the start and the end; quick: 2 steps on 4 prompts, 4 problems per family."""
    cfg = slip_method_config(method, steps=2 if quick else STEPS, eval_every=2 if quick else STEPS,
                             sft_model=str(reference))
    train = dataclasses.replace(cfg.train, out_dir=str(out / method),
                                ref_cache_dir=str(out / ".refcache"))
    if quick:
        train = dataclasses.replace(train, batch_size=4, eval_max_problems=4, drift_every=2,
                                    drift_queries=8)
        cfg = dataclasses.replace(cfg, rollout=dataclasses.replace(cfg.rollout, group_size=2),
                                  data=dataclasses.replace(cfg.data, n_train=512))
    return dataclasses.replace(cfg, train=train)


# What `erpo demo` takes: the way out its refusals name.
FLAGS = "erpo demo takes --out DIR, --quick, --rebuild-reference and --force"


def _kind(quick: bool) -> str:
    return "a --quick demo" if quick else "a full demo"


def _held_settings(out: Path) -> dict | None:
    """The settings of the demo `out` holds ({'quick', 'reference'}), read from
    its marker, else from its runs' config.json (a demo written before the
    marker), else None."""
    from erpo_jax.runtime import rundir
    rec = rundir.output_record(out)
    if rec is not None and rec["kind"] == "demo" and isinstance(rec["settings"], dict):
        return rec["settings"]
    for method in METHODS:
        saved = out / method / "config.json"
        if saved.is_file():
            try:
                c = json.loads(saved.read_text())
                return {"quick": c["train"]["steps"] != STEPS, "reference": c["model"]["path"]}
            except (OSError, ValueError, KeyError, TypeError):
                return None
    return None


def claim_out(out: Path, quick: bool, rebuild: bool, force: bool) -> dict:
    """Before the work: refuse an --out that is a file, a training run, another
    kind of output, or a demo with other settings (a --quick one for a full
    one, another reference), in one sentence naming what `erpo demo` takes
    (a ConfigError, rc 2); with `force`, the old demo's runs are deleted so
    the new one starts over. Returns the settings, recorded in its marker."""
    import shutil

    from erpo_jax.runtime import rundir
    from erpo_jax.runtime.errors import ConfigError
    reference = reference_dir(out, rebuild)
    settings = {"quick": bool(quick), "reference": str(reference)}
    old = _held_settings(out) if out.is_dir() else None
    if old is not None and old != settings and not force:
        if old.get("quick") != settings["quick"]:
            what = f"{_kind(old.get('quick'))}, and this is {_kind(quick)}"
        else:
            what = (f"a demo from the reference model {old.get('reference')}, and this one "
                    f"starts from {reference}" + (" (--rebuild-reference)" if rebuild else ""))
        raise ConfigError(f"--out {out} holds {what}; give another --out, or pass --force to "
                          f"replace it ({FLAGS}).")
    rundir.claim_output_dir(out, "--out", "demo", force=force)
    if force and old is not None and old != settings:
        for method in METHODS:   # the old demo's runs: the new one starts them over
            if rundir.is_run_dir(out / method):
                shutil.rmtree(out / method)
    rundir.write_output_marker(out, "demo", settings)
    return settings


def run_demo(args) -> int:
    from erpo_jax.tools.report import load_run, markdown, plot
    from erpo_jax.train.loop import train

    out = Path(args.out)
    quick = getattr(args, "quick", False)
    claim_out(out, quick, getattr(args, "rebuild_reference", False),
              getattr(args, "force", False))
    t0 = time.perf_counter()
    print("[demo] the slip testbed: a reference whose worked solutions drop carries, "
          "then RL from it three ways (experiments/SLIP_TESTBED.md)")
    reference = reference_model(out, getattr(args, "rebuild_reference", False))
    run_dirs = []
    for i, method in enumerate(METHODS):
        print(f"[demo] 2/3 RL {i + 1}/{len(METHODS)}: {LABELS[method]}")
        train(demo_config(method, reference, out, quick))
        run_dirs.append(out / method)
    print("[demo] 3/3 summary")
    runs = [load_run(d) for d in run_dirs]
    pngs = plot(runs, out)
    lines = ["# erpo-jax CPU demo: the slip testbed", "",
             "The reference model (SFT on worked solutions that drop carries and borrows), "
             f"then {runs[0]['config']['train']['steps']} RL steps from it three ways with the "
             "same budget. Accuracy on the six held-out arithmetic families "
             f"({runs[0]['config']['train']['eval_max_problems']} problems each), averaged: "
             "greedy pass@1, "
             "and pass@1 / pass@8 from 8 samples at temperature 1 (what RL optimises).", "",
             accuracy_table(runs), "", ONE_SEED, "",
             "Per family and over steps (greedy pass@1):", "",
             markdown(runs, entropy_floor=SLIP_ENTROPY_FLOOR), ""]
    lines += [f"![{p.stem}]({p.name})" for p in pngs]
    lines += ["", f"Total wall time {time.perf_counter() - t0:.0f} s."]
    (out / "SUMMARY.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines[:9]))
    print(f"[demo] wrote {out / 'SUMMARY.md'} in {time.perf_counter() - t0:.0f} s")
    return 0
