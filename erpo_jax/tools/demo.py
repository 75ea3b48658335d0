"""The embedded CPU demo: what `erpo demo` (the README's first command) runs.

1. SFT of a small character-level model on the arithmetic task (cached: a
   second demo reuses it). This is the reference model.
2. RL from it three ways with the same budget: GRPO + Policy-KL, no KL, ERPO.
3. Evaluation on the six held-out families, a markdown summary with a table
   and PNG plots (reward, accuracy, query drift, entropy vs step).

The configs here are also the base of the CPU experiments in `experiments/`.
"""

from __future__ import annotations

import dataclasses
import json
import time
from pathlib import Path

from erpo_jax.tools.presets import METHODS, arith_rl_config, arith_sft_config
from erpo_jax.train.config import RunConfig

def accuracy_table(runs) -> str:
    """Markdown: each method's accuracies at its first (the SFT model) and last evaluation."""
    rows = ["| method | metric | SFT model (step 0) | after RL | change |", "|---|---|---|---|---|"]
    for r in runs:
        first, last = r["evals"][0]["average"], r["evals"][-1]["average"]
        for key, label in (("greedy_acc", "greedy pass@1"), ("pass@1", "sampled pass@1"),
                           ("pass@4", "sampled pass@4")):
            if key in first and key in last:
                rows.append(f"| {r['name']} | {label} | {100 * first[key]:.1f}% | "
                            f"{100 * last[key]:.1f}% | {100 * (last[key] - first[key]):+.1f} |")
    return "\n".join(rows)


def _sft_done(cfg: RunConfig) -> bool:
    """An SFT run with the same config already exported its model."""
    out = Path(cfg.train.out_dir)
    saved = out / "config.json"
    if not (out / "model" / "config.json").is_file() or not saved.is_file():
        return False
    from erpo_jax.train.config import from_dict
    try:  # fields added since the run was saved take their defaults
        return from_dict(RunConfig, json.loads(saved.read_text())) == cfg
    except (TypeError, ValueError):
        return False


def run_demo(args) -> int:
    from erpo_jax.tools.report import load_run, markdown, plot
    from erpo_jax.train.loop import train
    from erpo_jax.train.sft import run_sft

    out = Path(args.out)
    quick = getattr(args, "quick", False)
    t0 = time.perf_counter()
    sft_cfg = arith_sft_config(str(out / "sft"), steps=4 if quick else 300)
    if quick:
        sft_cfg = dataclasses.replace(sft_cfg, data=dataclasses.replace(
            sft_cfg.data, n_train=512, n_test=8))
    if _sft_done(sft_cfg):
        print(f"[demo] reusing the SFT model in {out / 'sft' / 'model'}")
    else:
        print("[demo] 1/3 SFT of the reference model on the arithmetic task")
        run_sft(sft_cfg)
    sft_model = str(out / "sft" / "model")
    run_dirs = []
    for i, method in enumerate(METHODS):
        print(f"[demo] 2/3 RL {i + 1}/{len(METHODS)}: {method}")
        cfg = arith_rl_config(method, sft_model, str(out / method), steps=2 if quick else 60)
        if quick:
            cfg = dataclasses.replace(
                cfg, data=sft_cfg.data,
                rollout=dataclasses.replace(cfg.rollout, group_size=2, max_new_tokens=8),
                train=dataclasses.replace(cfg.train, batch_size=4, eval_max_problems=4,
                                          drift_queries=8, progress=False))
        train(cfg)
        run_dirs.append(out / method)
    print("[demo] 3/3 summary")
    runs = [load_run(d) for d in run_dirs]
    pngs = plot(runs, out)
    lines = ["# erpo-jax CPU demo", "",
             "SFT reference model, then RL from it three ways with the same budget. Accuracy "
             "on the six held-out arithmetic families (100 problems each), averaged: greedy "
             "pass@1, and pass@1 / pass@4 from 4 samples at temperature 1 (what RL optimises).",
             "", accuracy_table(runs), "", "Per family and over steps (greedy pass@1):", "",
             markdown(runs), ""]
    lines += [f"![{p.stem}]({p.name})" for p in pngs]
    lines += ["", f"Total wall time {time.perf_counter() - t0:.0f} s."]
    (out / "SUMMARY.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines[:7]))
    print(f"[demo] wrote {out / 'SUMMARY.md'} in {time.perf_counter() - t0:.0f} s")
    return 0
