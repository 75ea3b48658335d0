"""`erpo report`: tables and plots from run directories.

A run directory holds config.json, metrics.jsonl and evals.jsonl. Runs are
grouped into methods by their config `name` (seeds of one method share it);
each table cell is the mean over seeds with a 95% confidence interval
(Student t), and each plot has one line per method with a band over seeds.

Collapse. A run collapses when, after its best held-out accuracy, the
accuracy falls by more than `collapse_drop` (absolute) from that best, or
when the response entropy falls below `entropy_floor`. Both thresholds are
printed with the table.
"""

from __future__ import annotations

import argparse
import json
import math
from collections import defaultdict
from pathlib import Path
from typing import Any, Sequence

import numpy as np

PLOT_KEYS = (("accuracy", "train accuracy"), ("reward_mean", "reward"),
             ("drift/qkl_k3", "query drift (QKL k3, held-out)"), ("entropy", "response entropy"),
             ("response_len_mean", "response length"))


def load_run(run_dir: str | Path) -> dict[str, Any]:
    run_dir = Path(run_dir)
    cfg_path = run_dir / "config.json"
    if not cfg_path.is_file():
        raise ValueError(f"{run_dir} is not a run directory (no config.json).")
    cfg = json.loads(cfg_path.read_text())
    read = lambda f: [json.loads(x) for x in (run_dir / f).read_text().splitlines() if x.strip()] \
        if (run_dir / f).is_file() else []
    return {"dir": str(run_dir), "name": cfg.get("name", run_dir.name), "config": cfg,
            "metrics": read("metrics.jsonl"), "evals": read("evals.jsonl")}


def mean_ci(values: Sequence[float]) -> tuple[float, float]:
    """(mean, half-width of the 95% confidence interval); 0 width for one value."""
    v = np.asarray([x for x in values if x is not None and np.isfinite(x)], np.float64)
    if v.size == 0:
        return float("nan"), float("nan")
    if v.size == 1:
        return float(v[0]), 0.0
    from scipy import stats
    half = stats.t.ppf(0.975, v.size - 1) * v.std(ddof=1) / math.sqrt(v.size)
    return float(v.mean()), float(half)


def series(run: dict, key: str) -> tuple[np.ndarray, np.ndarray]:
    rows = [(m["step"], m[key]) for m in run["metrics"]
            if isinstance(m.get(key), (int, float))]
    if not rows:
        return np.zeros(0), np.zeros(0)
    s, v = zip(*rows)
    return np.asarray(s), np.asarray(v, np.float64)


def eval_table(run: dict) -> dict[str, dict[str, float]]:
    """{'final': {set: acc, 'average': acc}, 'best': {...}, 'initial': {...}} (greedy pass@1)."""
    evals = run["evals"]
    if not evals:
        return {}
    acc = lambda e: {**{k: v["greedy_acc"] for k, v in e["sets"].items()},
                     "average": e["average"].get("greedy_acc", float("nan"))}
    per = [acc(e) for e in evals]
    best = {k: max(p[k] for p in per) for k in per[-1]}
    return {"initial": per[0], "final": per[-1], "best": best}


def collapsed(run: dict, collapse_drop: float, entropy_floor: float) -> bool:
    per = [e["average"].get("greedy_acc") for e in run["evals"]]
    per = [p for p in per if p is not None]
    if per:
        best_i = int(np.argmax(per))
        if any(per[best_i] - p > collapse_drop for p in per[best_i:]):
            return True
    _, ent = series(run, "entropy")
    return bool(ent.size and np.nanmin(ent) < entropy_floor)


def group(runs: Sequence[dict]) -> dict[str, list[dict]]:
    out = defaultdict(list)
    for r in runs:
        out[r["name"]].append(r)
    return dict(out)


def fmt(mean: float, half: float, pct: bool = True) -> str:
    if not np.isfinite(mean):
        return "n/a"
    scale = 100.0 if pct else 1.0
    return f"{mean * scale:.1f} ± {half * scale:.1f}" if half else f"{mean * scale:.1f}"


def markdown(runs: Sequence[dict], collapse_drop: float = 0.15,
             entropy_floor: float = 0.05) -> str:
    methods = group(runs)
    sets = sorted({k for r in runs for k in eval_table(r).get("final", {}) if k != "average"})
    lines = ["| method | seeds | initial avg | final avg | best avg | "
             + " | ".join(f"final {s}" for s in sets) + " | final drift (QKL k3) | collapses |",
             "|" + "---|" * (6 + len(sets) + 1)]
    for name, rs in methods.items():
        tabs = [eval_table(r) for r in rs]
        tabs = [t for t in tabs if t]
        cell = lambda part, key: fmt(*mean_ci([t[part].get(key, np.nan) for t in tabs]))
        drift = [series(r, "drift/qkl_k3")[1][-1] for r in rs if series(r, "drift/qkl_k3")[1].size]
        n_col = sum(collapsed(r, collapse_drop, entropy_floor) for r in rs)
        lines.append(f"| {name} | {len(rs)} | {cell('initial', 'average')} | "
                     f"{cell('final', 'average')} | {cell('best', 'average')} | "
                     + " | ".join(cell("final", s) for s in sets)
                     + f" | {fmt(*mean_ci(drift), pct=False) if drift else 'n/a'} | "
                     f"{n_col}/{len(rs)} |")
    lines.append("")
    lines.append(f"Accuracies are greedy pass@1 in percent, mean ± 95% CI over seeds. A collapse "
                 f"is an accuracy drop of more than {collapse_drop * 100:.0f} points below the "
                 f"run's best, or response entropy below {entropy_floor}.")
    return "\n".join(lines)


def plot(runs: Sequence[dict], out_dir: str | Path, keys=PLOT_KEYS) -> list[Path]:
    """One PNG per key: a line per method (mean over seeds) with a min-max band."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = []
    for key, title in keys:
        fig, ax = plt.subplots(figsize=(6, 3.6))
        drawn = False
        for name, rs in group(runs).items():
            curves = [series(r, key) for r in rs]
            curves = [c for c in curves if c[0].size]
            if not curves:
                continue
            n = min(len(c[0]) for c in curves)
            steps = curves[0][0][:n]
            vals = np.stack([c[1][:n] for c in curves])
            ax.plot(steps, vals.mean(0), label=name)
            if len(curves) > 1:
                ax.fill_between(steps, vals.min(0), vals.max(0), alpha=0.2)
            drawn = True
        if drawn:
            ax.set_xlabel("RL step")
            ax.set_title(title)
            ax.legend(fontsize=8)
            fig.tight_layout()
            path = out_dir / f"{key.replace('/', '_')}.png"
            fig.savefig(path, dpi=100)
            paths.append(path)
        plt.close(fig)
    return paths


def write_report(run_dirs: Sequence[str | Path], out_dir: str | Path, title: str = "Report",
                 **kw) -> Path:
    runs = [load_run(d) for d in run_dirs]
    out_dir = Path(out_dir)
    pngs = plot(runs, out_dir)
    text = [f"# {title}", "", markdown(runs, **kw), ""]
    text += [f"![{p.stem}]({p.name})" for p in pngs]
    path = out_dir / "REPORT.md"
    path.write_text("\n".join(text) + "\n")
    return path


def add_parser(subparsers) -> None:
    p = subparsers.add_parser("report", help="markdown tables and PNG plots from run directories")
    p.add_argument("runs", nargs="+", help="run directories")
    p.add_argument("--out", required=True, help="output directory for REPORT.md and PNGs")
    p.add_argument("--title", default="erpo-jax report")
    p.add_argument("--collapse-drop", type=float, default=0.15)
    p.add_argument("--entropy-floor", type=float, default=0.05)
    p.set_defaults(func=_run)


def _run(args: argparse.Namespace) -> int:
    path = write_report(args.runs, args.out, args.title, collapse_drop=args.collapse_drop,
                        entropy_floor=args.entropy_floor)
    print(path)
    return 0
