"""`erpo report`: tables and plots from run directories.

A run directory holds config.json, metrics.jsonl and evals.jsonl. Runs are
seeds of one method when they share their config `name` and their configs
differ in the seed alone (and where they wrote: SEED_FIELDS); runs of one name
whose configs differ otherwise are reported as different methods, each named
by the fields that differ, with a note saying so, and two runs of one method
with the same seed are refused (`methods`). Each table cell is the mean over
seeds with a 95% confidence interval (Student t), and each plot has one line
per method (the mean over seeds) with a band from the lowest to the highest
seed.

Collapse. A run collapses at the first evaluation whose held-out accuracy
(greedy pass@1, average over the evaluation sets) is more than
`collapse_drop` (absolute) below the best accuracy the run had reached so
far, or at the first step whose response entropy is below `entropy_floor`.
Both thresholds are printed with the table.

Effect sizes. For a pair (method A, baseline B): the difference of the seed
means of a quantity, mean(A) - mean(B), with a 95% Welch confidence interval,
next to the seed noise: the pooled standard deviation over seeds of the two
methods and the difference in units of it (Cohen's d). A difference whose
interval contains 0 is not resolved by these seeds.
"""

from __future__ import annotations

import argparse
import functools
import io
import math
from collections import defaultdict
from pathlib import Path
from types import ModuleType
from typing import Any, Sequence

from erpo_jax.runtime import rundir

import numpy as np

WALL_LOG = "sweep_wall.jsonl"  # in a run directory: `erpo sweep`'s wall time per segment of it
EVAL_KEY = "eval/average"  # held-out greedy pass@1, averaged over the evaluation sets
PLOT_KEYS = ((EVAL_KEY, "held-out accuracy (greedy pass@1, mean of sets)"),
             ("accuracy", "train accuracy (sampled)"), ("reward_mean", "reward"),
             ("drift/qkl_k3", "query drift (QKL k3, held-out queries)"),
             ("entropy", "response entropy"), ("response_len_mean", "response length"))


def load_run(run_dir) -> dict[str, Any]:
    """A run directory (local or gs://) as {'dir', 'name', 'config', 'metrics', 'evals'},
    or a run summary file (`run_summary.py`); a torn last line (an interrupted
    write) is skipped with a warning."""
    if str(run_dir).endswith(".json") and rundir.path(run_dir).is_file():
        from erpo_jax.tools.run_summary import load_summary
        return load_summary(run_dir)
    run_dir = rundir.path(run_dir)
    cfg_path = run_dir / "config.json"
    if not cfg_path.exists():
        raise ValueError(f"{run_dir} is not a run directory (no config.json).")
    cfg = rundir.read_json(cfg_path)
    walls = rundir.read_jsonl(run_dir / WALL_LOG)
    return {"dir": str(run_dir), "name": cfg.get("name", run_dir.name), "config": cfg,
            "metrics": rundir.read_jsonl(run_dir / "metrics.jsonl"),
            "evals": rundir.read_jsonl(run_dir / "evals.jsonl"),
            "wall_s": round(sum(w["wall_s"] for w in walls), 1) if walls else None}


def expand_run_dirs(paths: Sequence) -> list:
    """Run directories; a directory without config.json stands for its `*/seed*` runs."""
    out = []
    for p in map(rundir.path, paths):
        if (p / "config.json").exists():
            out.append(p)
        else:
            found = (sorted(q.parent for q in p.glob("*/seed*/config.json"))
                     or sorted(p.glob("*/seed*.json")))   # run summaries
            if not found:
                raise ValueError(f"{p} is neither a run directory nor holds <variant>/seed<k> "
                                 "run directories or <variant>/seed<k>.json run summaries.")
            out += found
    return out


def _finite(values: Sequence[float | None]) -> np.ndarray:
    return np.asarray([x for x in values if isinstance(x, (int, float)) and np.isfinite(x)],
                      np.float64)


def _t975(df: float) -> float:
    from scipy import stats
    return float(stats.t.ppf(0.975, df))


def mean_ci(values: Sequence[float]) -> tuple[float, float]:
    """(mean, half-width of the 95% confidence interval); NaN width for one value."""
    v = _finite(values)
    if v.size == 0:
        return float("nan"), float("nan")
    if v.size == 1:
        return float(v[0]), float("nan")
    half = _t975(v.size - 1) * v.std(ddof=1) / math.sqrt(v.size)
    return float(v.mean()), float(half)


def effect(a: Sequence[float], b: Sequence[float]) -> dict[str, float]:
    """mean(a) - mean(b), its 95% Welch CI half-width, pooled seed SD and Cohen's d.

    NaN where the seeds do not allow it (fewer than 2 per side for the CI).
    """
    a, b = _finite(a), _finite(b)
    nan = float("nan")
    if a.size == 0 or b.size == 0:
        return {"diff": nan, "half": nan, "sd": nan, "d": nan, "n": (a.size, b.size)}
    diff = float(a.mean() - b.mean())
    half = sd = d = nan
    if a.size > 1 and b.size > 1:
        va, vb = a.var(ddof=1) / a.size, b.var(ddof=1) / b.size
        se = math.sqrt(va + vb)
        if se > 0:
            df = (va + vb) ** 2 / (va ** 2 / (a.size - 1) + vb ** 2 / (b.size - 1))
            half = _t975(df) * se
        else:
            half = 0.0
        sd = math.sqrt(((a.size - 1) * a.var(ddof=1) + (b.size - 1) * b.var(ddof=1))
                       / (a.size + b.size - 2))
        d = diff / sd if sd > 0 else (0.0 if diff == 0 else math.copysign(math.inf, diff))
    return {"diff": diff, "half": half, "sd": sd, "d": d, "n": (a.size, b.size)}


def rank_test(a: Sequence[float], b: Sequence[float]) -> dict[str, float]:
    """Exact two-sided Mann-Whitney test of a against b: U (pairs with a above b,
    ties counted half) and p, the share of the C(n+m, n) splits of the pooled
    values into groups of n and m whose |U - nm/2| is at least the observed one
    (ties kept as they are, so no normal approximation and no tie correction).
    A rank test reads drift and log-drift alike and no heavy tail moves it;
    at 5 vs 5 its smallest p is 2/252 = 0.0079, at 3 vs 3 it is 0.1.
    p is NaN where a side has no finite value."""
    import itertools
    a, b = _finite(a), _finite(b)
    if a.size == 0 or b.size == 0:
        return {"u": float("nan"), "p": float("nan"), "n": (a.size, b.size)}
    pooled = np.concatenate([a, b])
    # wins[i, j]: 1 if value i is above value j, 0.5 if equal
    wins = (pooled[:, None] > pooled[None, :]) + 0.5 * (pooled[:, None] == pooled[None, :])

    def u_of(idx) -> float:
        rest = np.setdiff1d(np.arange(pooled.size), idx)
        return float(wins[np.ix_(idx, rest)].sum())

    u = u_of(np.arange(a.size))
    centre = a.size * b.size / 2
    far = abs(u - centre) - 1e-9
    splits = [abs(u_of(np.array(c)) - centre) >= far
              for c in itertools.combinations(range(pooled.size), a.size)]
    return {"u": u, "p": float(np.mean(splits)), "n": (a.size, b.size)}


def series(run: dict, key: str) -> tuple[np.ndarray, np.ndarray]:
    """(steps, values) of a metrics key, or of EVAL_KEY from evals.jsonl."""
    if key == EVAL_KEY:
        rows = [(e["step"], e["average"].get("greedy_acc")) for e in run["evals"]]
    else:
        rows = [(m["step"], m.get(key)) for m in run["metrics"]]
    rows = [(s, v) for s, v in rows if isinstance(v, (int, float))]
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


def collapse_step(run: dict, collapse_drop: float, entropy_floor: float) -> int | None:
    """The first step at which the run collapsed (module docstring), or None."""
    steps = []
    best = -math.inf
    for s, acc in zip(*series(run, EVAL_KEY)):
        best = max(best, acc)
        if best - acc > collapse_drop:
            steps.append(int(s))
            break
    s, ent = series(run, "entropy")
    low = np.flatnonzero(ent < entropy_floor)
    if low.size:
        steps.append(int(s[low[0]]))
    return min(steps) if steps else None


def collapsed(run: dict, collapse_drop: float, entropy_floor: float) -> bool:
    return collapse_step(run, collapse_drop, entropy_floor) is not None


# Config fields the seeds of one method may differ in: the seed, and those
# that do not touch a run's numbers (rundir.FREE_ON_RESUME: where it wrote,
# its caches, its progress bar). Any other field makes another method.
SEED_FIELDS = ("train.seed", *rundir.FREE_ON_RESUME)


def _flat(d: dict, prefix: str = "") -> dict[str, Any]:
    out = {}
    for k, v in d.items():
        if isinstance(v, dict):
            out.update(_flat(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out


def _method_fields(run: dict) -> dict[str, Any]:
    """The run's config as {dotted field: value}, without its name and the
    SEED_FIELDS: what the seeds of one method share. Fields added since the
    run was written take their defaults (train.config.normalized)."""
    import json
    cfg = run["config"] if isinstance(run["config"], dict) else {}
    return dict(_method_items(json.dumps(cfg, sort_keys=True, default=str)))


@functools.lru_cache(maxsize=4096)
def _method_items(config_json: str) -> tuple:
    """`_method_fields` of a config given as JSON (cached: every table groups the runs)."""
    import json
    from erpo_jax.train.config import normalized
    flat = _flat(normalized(json.loads(config_json)))
    return tuple((k, v) for k, v in flat.items() if k != "name" and k not in SEED_FIELDS)


def _seed(run: dict) -> Any:
    return (run["config"].get("train") or {}).get("seed", 0)


def _value(v: Any) -> str:
    import json
    return v if isinstance(v, str) else json.dumps(v)


def methods(runs: Sequence[dict]) -> tuple[dict[str, list[dict]], list[str]]:
    """({method label: its runs}, notes). Runs are seeds of one method when they
    share a name and their configs differ in SEED_FIELDS alone. Runs sharing a
    name whose configs differ otherwise are different methods, each labelled by
    the name and the fields that differ, and a note says so. Two runs of one
    method with the same seed cannot both be seeds of it: a ConfigError names
    them."""
    import json
    from erpo_jax.runtime.errors import ConfigError
    by_name: dict[str, list[dict]] = defaultdict(list)
    for r in runs:
        by_name[r["name"]].append(r)
    out: dict[str, list[dict]] = {}
    notes = []
    for name, rs in by_name.items():
        fields = [_method_fields(r) for r in rs]
        keys = [json.dumps(f, sort_keys=True, default=str) for f in fields]
        if len(set(keys)) == 1:
            labels = [name] * len(rs)
        else:
            varying = sorted({k for f in fields for k in f
                              if len({_value(g.get(k)) for g in fields}) > 1})
            labels = [f"{name} ({', '.join(f'{k}={_value(f.get(k))}' for k in varying)})"
                      for f in fields]
            notes.append(f"The runs named {name!r} differ in more than the seed "
                         f"({', '.join(varying)}): they are reported as "
                         f"{len(set(keys))} methods, each named by those fields.")
        for label, r in zip(labels, rs):
            out.setdefault(label, []).append(r)
    for label, rs in out.items():
        seen: dict[Any, dict] = {}
        for r in rs:
            s = _seed(r)
            if s in seen:
                raise ConfigError(f"{seen[s]['dir']} and {r['dir']} are both seed {s} of the "
                                  f"same method ({label}), so they cannot be two of its seeds "
                                  "(one run given twice, or a copy); report one of them.")
            seen[s] = r
    return out, notes


def group(runs: Sequence[dict]) -> dict[str, list[dict]]:
    """{method label: its runs} (`methods`)."""
    return methods(runs)[0]


def fmt(mean: float, half: float, pct: bool = True, digits: int = 1) -> str:
    if not np.isfinite(mean):
        return "n/a"
    scale = 100.0 if pct else 1.0
    m = f"{mean * scale:.{digits}f}"
    return f"{m} ± {half * scale:.{digits}f}" if np.isfinite(half) else m


def _last(run: dict, key: str) -> float | None:
    v = series(run, key)[1]
    return float(v[-1]) if v.size else None


def _max(run: dict, key: str) -> float | None:
    v = series(run, key)[1]
    return float(v.max()) if v.size else None


def _min(run: dict, key: str) -> float | None:
    v = series(run, key)[1]
    return float(v.min()) if v.size else None


# Quantities an effect can be computed on: label -> (per-run value, in percent?).
QUANTITIES = {
    "final avg acc": (lambda r: eval_table(r).get("final", {}).get("average"), True),
    "best avg acc": (lambda r: eval_table(r).get("best", {}).get("average"), True),
    "final drift (QKL k3)": (lambda r: _last(r, "drift/qkl_k3"), False),
    "final entropy": (lambda r: _last(r, "entropy"), False),
}


def _drift_digits(values) -> int:
    v = _finite(values)
    return 1 if v.size == 0 or np.max(np.abs(v)) >= 1 else 3


def _sampled_keys(runs: Sequence[dict]) -> list[str]:
    """Sampled-evaluation keys of the final average ('pass@1', 'pass@4', ...), if any."""
    keys = {k for r in runs if r["evals"] for k in r["evals"][-1]["average"]
            if k.startswith("pass@")}
    return sorted(keys, key=lambda k: int(k.split("@")[1]))


def _row(cells: Sequence[str]) -> str:
    """One markdown table row: '| a | b |'."""
    return "| " + " | ".join(cells) + " |"


def _header(cells: Sequence[str]) -> list[str]:
    """A table's header row and its delimiter row, one '---' per header cell."""
    return [_row(cells), "|" + "---|" * len(cells)]


def accuracy_table(runs: Sequence[dict]) -> list[str]:
    sets = sorted({k for r in runs for k in eval_table(r).get("final", {}) if k != "average"})
    sampled = _sampled_keys(runs)
    lines = _header(["method", "seeds", "initial avg", "final avg", "best avg"]
                    + [f"final avg {k}" for k in sampled] + [f"final {s}" for s in sets])
    for name, rs in group(runs).items():
        tabs = [t for t in (eval_table(r) for r in rs) if t]
        cell = lambda part, key: fmt(*mean_ci([t[part].get(key, np.nan) for t in tabs]))
        finals = [r["evals"][-1]["average"] for r in rs if r["evals"]]
        lines.append(_row([name, str(len(rs)), cell("initial", "average"),
                           cell("final", "average"), cell("best", "average")]
                          + [fmt(*mean_ci([f.get(k) for f in finals])) for k in sampled]
                          + [cell("final", s) for s in sets]))
    return lines


def stability_table(runs: Sequence[dict], collapse_drop: float,
                    entropy_floor: float) -> list[str]:
    lines = ["| method | collapses | collapse steps | final drift (QKL k3) | max drift | "
             "final entropy | min entropy | final response length |",
             "|" + "---|" * 8]
    for name, rs in group(runs).items():
        steps = [collapse_step(r, collapse_drop, entropy_floor) for r in rs]
        drift = [_last(r, "drift/qkl_k3") for r in rs]
        maxdrift = [_max(r, "drift/qkl_k3") for r in rs]
        ent = [_last(r, "entropy") for r in rs]
        minent = [_min(r, "entropy") for r in rs]
        length = [_last(r, "response_len_mean") for r in rs]
        dd = _drift_digits(drift + maxdrift)
        lines.append(
            f"| {name} | {sum(s is not None for s in steps)}/{len(rs)} | "
            f"{', '.join(str(s) for s in steps if s is not None) or '-'} | "
            f"{fmt(*mean_ci(drift), pct=False, digits=dd)} | "
            f"{fmt(*mean_ci(maxdrift), pct=False, digits=dd)} | "
            f"{fmt(*mean_ci(ent), pct=False, digits=3)} | "
            f"{fmt(*mean_ci(minent), pct=False, digits=3)} | "
            f"{fmt(*mean_ci(length), pct=False)} |")
    return lines


def cost_table(runs: Sequence[dict]) -> list[str]:
    """Seconds per RL step by phase: the median over a run's steps (robust to the
    first step's compilation and to evaluation pauses), then mean ± CI over seeds."""
    keys = ("time/rollout", "time/ref", "time/update")
    lines = ["| method | rollout s/step | reference forward s/step | update s/step | "
             "total s/step |", "|" + "---|" * 5]
    for name, rs in group(runs).items():
        per = {k: [float(np.median(series(r, k)[1])) if series(r, k)[1].size else None
                   for r in rs] for k in keys}
        tot = [sum(v) if all(x is not None for x in v) else None
               for v in zip(*(per[k] for k in keys))]
        lines.append(f"| {name} | " + " | ".join(fmt(*mean_ci(per[k]), pct=False, digits=3)
                                                for k in keys)
                     + f" | {fmt(*mean_ci(tot), pct=False, digits=3)} |")
    return lines


def seed_table(runs: Sequence[dict], collapse_drop: float, entropy_floor: float) -> list[str]:
    """One row per run: the per-seed values behind the mean ± CI cells, and its wall time."""
    sampled = [k for k in _sampled_keys(runs) if k == "pass@1"]
    lines = ["| method | seed | initial avg | final avg | best avg | "
             + "".join(f"initial {k} | final {k} | " for k in sampled)
             + "final drift | max drift | final entropy | min entropy | collapse step | "
             "wall s |", "|" + "---|" * (11 + 2 * len(sampled))]
    num = lambda v, digits: "n/a" if v is None or not np.isfinite(v) else f"{v:.{digits}f}"
    pct = lambda v: num(None if v is None else 100 * v, 1)
    for name, rs in group(runs).items():
        for r in sorted(rs, key=lambda r: r["config"].get("train", {}).get("seed", 0)):
            t = eval_table(r)
            acc = lambda part: t.get(part, {}).get("average") if t else None
            first = r["evals"][0]["average"] if r["evals"] else {}
            last = r["evals"][-1]["average"] if r["evals"] else {}
            step = collapse_step(r, collapse_drop, entropy_floor)
            lines.append(
                f"| {name} | {r['config'].get('train', {}).get('seed', 0)} | "
                f"{pct(acc('initial'))} | {pct(acc('final'))} | {pct(acc('best'))} | "
                + "".join(f"{pct(first.get(k))} | {pct(last.get(k))} | " for k in sampled)
                + f"{num(_last(r, 'drift/qkl_k3'), 3)} | {num(_max(r, 'drift/qkl_k3'), 3)} | "
                f"{num(_last(r, 'entropy'), 3)} | {num(_min(r, 'entropy'), 3)} | "
                f"{'-' if step is None else step} | "
                f"{num(r.get('wall_s'), 0)} |")
    return lines


def effect_table(runs: Sequence[dict], comparisons: Sequence[tuple[str, str]]) -> list[str]:
    by = group(runs)
    lines = ["| comparison | quantity | difference (95% CI) | seed SD | d = diff / SD | seeds |",
             "|" + "---|" * 6]
    for a, b in comparisons:
        if a not in by or b not in by:
            continue
        for label, (fn, pct) in QUANTITIES.items():
            e = effect([fn(r) for r in by[a]], [fn(r) for r in by[b]])
            if not np.isfinite(e["diff"]):
                continue
            scale = 100.0 if pct else 1.0
            digits = 1 if pct else 3
            ci = ("n/a" if not np.isfinite(e["half"]) else
                  f"[{(e['diff'] - e['half']) * scale:+.{digits}f}, "
                  f"{(e['diff'] + e['half']) * scale:+.{digits}f}]")
            sd = "n/a" if not np.isfinite(e["sd"]) else f"{e['sd'] * scale:.{digits}f}"
            d = "n/a" if not np.isfinite(e["d"]) and not np.isinf(e["d"]) else f"{e['d']:+.2f}"
            lines.append(f"| {a} − {b} | {label} | {e['diff'] * scale:+.{digits}f} {ci} | "
                         f"{sd} | {d} | {e['n'][0]} vs {e['n'][1]} |")
    return lines


def markdown(runs: Sequence[dict], collapse_drop: float = 0.15, entropy_floor: float = 0.05,
             comparisons: Sequence[tuple[str, str]] = ()) -> str:
    notes = methods(runs)[1]
    lines = [*notes, ""] if notes else []
    lines += accuracy_table(runs)
    lines += ["", "Accuracies are held-out greedy pass@1 in percent (pass@k: from sampled "
              "evaluation), mean ± 95% CI over seeds (Student t; no ± with one seed).", "",
              "Stability and drift:", ""]
    lines += stability_table(runs, collapse_drop, entropy_floor)
    lines += ["", f"A collapse is an evaluation whose accuracy is more than "
              f"{collapse_drop * 100:.0f} points below the run's best so far, or a step whose "
              f"response entropy is below {entropy_floor}; 'collapse steps' lists the first "
              "such step of each collapsed run.", "", "Cost per RL step (seconds, median over "
              "steps; wall-clock, so only comparable between runs on an equally loaded "
              "machine):", ""]
    lines += cost_table(runs)
    eff = effect_table(runs, comparisons)
    if len(eff) > 2:
        lines += ["", "Effect sizes against seed noise (difference of seed means, accuracy in "
                  "points; 95% Welch CI; seed SD is the pooled standard deviation over seeds):",
                  ""] + eff
    walls = [r.get("wall_s") for r in runs]
    timed = [w for w in walls if w is not None]
    lines += ["", "Per run (accuracy in percent; wall s is the run's wall time under "
              "`erpo sweep`, summed over its segments if it was resumed):", ""]
    lines += seed_table(runs, collapse_drop, entropy_floor)
    if timed:
        lines += ["", f"Wall time: {sum(timed):,.0f} s over {len(timed)} runs"
                  + (f" ({len(walls) - len(timed)} runs not timed)." if len(timed) < len(walls)
                     else ".")]
    return "\n".join(lines)


def plot(runs: Sequence[dict], out_dir: str | Path, keys=PLOT_KEYS) -> list[Path]:
    """One PNG per key: a line per method (mean over seeds) with a min-max band."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    out_dir = rundir.path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = []
    groups = group(runs)
    many = len(groups) > 6  # legend beside the axes, fainter bands
    # Distinct styles for up to 40 methods: 20 colours x 2 line styles.
    colors = plt.get_cmap("tab10" if len(groups) <= 10 else "tab20").colors
    styles = [(colors[i % len(colors)], "-" if i < len(colors) else "--")
              for i in range(len(groups))]
    for key, title in keys:
        fig, ax = plt.subplots(figsize=(8.5 if many else 6, 3.6))
        drawn = False
        for (name, rs), (color, style) in zip(groups.items(), styles):
            curves = [series(r, key) for r in rs]
            curves = [c for c in curves if c[0].size]
            if not curves:
                continue
            n = min(len(c[0]) for c in curves)
            steps = curves[0][0][:n]
            vals = np.stack([c[1][:n] for c in curves])
            ax.plot(steps, vals.mean(0), style, color=color, label=f"{name} (n={len(curves)})")
            if len(curves) > 1:
                ax.fill_between(steps, vals.min(0), vals.max(0), alpha=0.1 if many else 0.2,
                                color=color)
            drawn = True
        if drawn:
            ax.set_xlabel("RL step")
            ax.set_title(title)
            if many:
                ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0))
            else:
                ax.legend(fontsize=7)
            fig.tight_layout()
            path = out_dir / f"{key.replace('/', '_')}.png"
            buf = io.BytesIO()
            fig.savefig(buf, format="png", dpi=100)
            rundir.write_atomic(path, buf.getvalue())
            paths.append(path)
        plt.close(fig)
    return paths


def write_report(run_dirs: Sequence[str | Path], out_dir: str | Path, title: str = "Report",
                 **kw) -> Path:
    """REPORT.md (tables, then the plots) and one PNG per plotted key in `out_dir`."""
    return report_runs([load_run(d) for d in run_dirs], out_dir, title, **kw)


def report_runs(runs: Sequence[dict], out_dir: str | Path, title: str = "Report",
                force: bool = False, **kw) -> Path:
    """`write_report` of runs already loaded (`load_run`). An `out_dir` that is a
    file, a training run or holds another kind of output (a demo, an
    evaluation) is refused (rundir.claim_output_dir) unless `force`."""
    out_dir = rundir.path(out_dir)
    methods(runs)   # runs that cannot be grouped are refused before anything is written
    rundir.claim_output_dir(out_dir, "--out", "report", force=force)
    pngs = plot(runs, out_dir)
    text = [f"# {title}", "", markdown(runs, **kw), ""]
    text += [f"![{p.stem}]({p.name})" for p in pngs]
    text += ["", "Runs:", ""] + [f"- `{r['dir']}`" for r in runs]
    path = out_dir / "REPORT.md"
    rundir.write_atomic(path, "\n".join(text) + "\n")
    return path


def add_parser(subparsers) -> None:
    p = subparsers.add_parser("report", help="markdown tables and PNG plots from run directories")
    p.add_argument("runs", nargs="+", help="run directories, or an experiment directory "
                   "(runs/<experiment>) standing for all its <variant>/seed<k> runs")
    p.add_argument("--out", required=True, help="output directory for REPORT.md and PNGs")
    p.add_argument("--force", action="store_true", help="write into an --out that holds a "
                   "demo or an evaluation (never a training run's directory)")
    p.add_argument("--title", default=None, help="default: the --experiment file's, "
                   "else 'erpo-jax report'")
    p.add_argument("--experiment", default=None, metavar="FILE",
                   help="an experiment file (experiments/*.py): its title, COMPARISONS and "
                   "collapse thresholds, as `erpo sweep` reports it; with its committed "
                   "summaries, `erpo report experiments/results/E/runs --experiment "
                   "experiments/E.py --out X` remakes experiments/results/E/REPORT.md")
    p.add_argument("--collapse-drop", type=float, default=None,
                   help="default: the --experiment file's COLLAPSE_DROP, else 0.15")
    p.add_argument("--entropy-floor", type=float, default=None,
                   help="default: the --experiment file's ENTROPY_FLOOR, else 0.05")
    p.add_argument("--baseline", default=None,
                   help="method to compare every other method against (effect sizes)")
    p.add_argument("--write-summaries", default=None, metavar="DIR",
                   help="also write each run's summary to DIR/<method>/seed<k>.json (small, "
                   "committable; `erpo report DIR` then makes the same tables)")
    p.set_defaults(func=_run)


def report_options(mod: ModuleType | None, default_title: str) -> tuple[str, dict]:
    """(title, write_report keywords) of an experiment file: the first line of its
    docstring, its COMPARISONS and any COLLAPSE_DROP / ENTROPY_FLOOR."""
    if mod is None:
        return default_title, {}
    kw = {}
    if getattr(mod, "COMPARISONS", None):
        kw["comparisons"] = list(mod.COMPARISONS)
    for k in ("collapse_drop", "entropy_floor"):
        if hasattr(mod, k.upper()):
            kw[k] = getattr(mod, k.upper())
    return (mod.__doc__ or default_title).strip().splitlines()[0], kw



def _run(args: argparse.Namespace) -> int:
    runs = [load_run(d) for d in expand_run_dirs(args.runs)]
    title, kw = "erpo-jax report", {}
    if args.experiment:
        from erpo_jax.train.config import load_experiment
        title, kw = report_options(load_experiment(args.experiment), Path(args.experiment).stem)
    for k in ("collapse_drop", "entropy_floor"):
        if getattr(args, k) is not None:
            kw[k] = getattr(args, k)
    if args.baseline:
        names = list(group(runs))
        if args.baseline not in names:
            raise ValueError(f"--baseline {args.baseline!r} is not one of the methods {names}.")
        kw["comparisons"] = [(n, args.baseline) for n in names if n != args.baseline]
    path = report_runs(runs, args.out, args.title or title, force=args.force, **kw)
    print(path)
    if args.write_summaries:
        from erpo_jax.tools.run_summary import write_summaries
        for p in write_summaries(runs, args.write_summaries):
            print(p)
    return 0
