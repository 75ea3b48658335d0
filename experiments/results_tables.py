"""RESULTS.md's tables, from the run summaries committed in experiments/results/*/runs.

    .venv/bin/python experiments/results_tables.py            # every table, in order
    .venv/bin/python experiments/results_tables.py drift      # one of them

Each table is printed under a `<!-- table: NAME -->` line, as RESULTS.md holds
it; `tests/test_results_tables.py` checks that RESULTS.md holds every one of
them verbatim, so no number in a table can drift from the committed runs.
The summaries are written by `erpo sweep` (report/runs/, copied here with the
REPORT.md) and read by `erpo report`, whose helpers compute every cell.
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np

from erpo_jax.tools import report

RESULTS = Path(__file__).resolve().parent / "results"
LABELS = {"grpo+policy_kl": "GRPO + Policy-KL", "no_kl": "no KL", "erpo": "ERPO"}
TEMPERATURES = (1.2, 1.5)
ABLATION_CHANGES = {
    "erpo": "nothing: QKL k3, β_q = 0.1, likelihood weights",
    "beta_q0.02": "β_q = 0.02",
    "beta_q0.5": "β_q = 0.5",
    "qkl+uniform": "uniform weights",
    "qkl+typicality": "typicality weights",
    "qkl_k2": "Query-KL estimator k2",
    "noqkl+likelihood": "no Query-KL (weights only)",
    "noqkl+typicality": "no Query-KL, typicality weights",
    "noqkl+uniform": "no Query-KL, uniform (= GRPO, no KL)",
    "ppo+erpo": "PPO (GAE, learned critic) + ERPO",
    "ppo+no_kl": "PPO, no KL",
    "reinforce_pp+erpo": "REINFORCE++ + ERPO",
    "reinforce_pp+no_kl": "REINFORCE++, no KL",
}
SWEEPS = (("main_comparison", "main comparison"),
          ("high_temperature", "high temperature (T = 1.2, 1.5)"),
          ("long_horizon", "long horizon"), ("ablations", "ablations"))


def runs(experiment: str) -> dict[str, list[dict]]:
    """{variant: its runs, by seed} from experiments/results/<experiment>/runs."""
    found = report.expand_run_dirs([RESULTS / experiment / "runs"])
    by = report.group([report.load_run(p) for p in found])
    return {k: sorted(v, key=lambda r: r["config"]["train"]["seed"]) for k, v in by.items()}


def _pct(values) -> str:
    return report.fmt(*report.mean_ci(values))


def _num(values, digits: int = 3) -> str:
    return report.fmt(*report.mean_ci(values), pct=False, digits=digits)


def _per_seed(values, digits: int = 3) -> str:
    return " / ".join(f"{v:.{digits}f}" for v in values)


def _drifts(rs) -> list[float]:
    """Each run's last held-out query drift (QKL k3)."""
    return [report._last(r, "drift/qkl_k3") for r in rs]


def _final(r, key: str):
    """A final-evaluation average: 'greedy_acc' or a sampled 'pass@k'."""
    return r["evals"][-1]["average"].get(key)


def _eval_at(r, step: int, key: str = "greedy_acc"):
    return next(e["average"].get(key) for e in r["evals"] if e["step"] == step)


def main_table() -> list[str]:
    by = runs("main_comparison")
    lines = ["| method | final greedy pass@1 | final sampled pass@1 | final pass@4 |",
             "|---|---|---|---|"]
    for m, label in LABELS.items():
        rs = by[m]
        lines.append(f"| {label} | {_pct([_final(r, 'greedy_acc') for r in rs])} | "
                     f"{_pct([_final(r, 'pass@1') for r in rs])} | "
                     f"{_pct([_final(r, 'pass@4') for r in rs])} |")
    return lines


def drift_table() -> list[str]:
    by = runs("main_comparison")
    seeds = [r["config"]["train"]["seed"] for r in by["erpo"]]
    lines = ["| method | " + " | ".join(f"seed {s}" for s in seeds) + " |",
             "|---|" + "---|" * len(seeds)]
    for m, label in LABELS.items():
        lines.append(f"| {label} | " + " | ".join(f"{d:.3f}" for d in _drifts(by[m])) + " |")
    return lines


def temperature_table() -> list[str]:
    rows = [(1.0, runs("main_comparison"), "{m}")]
    hot = runs("high_temperature")
    rows += [(t, hot, "{m}-T" + str(t)) for t in TEMPERATURES]
    lines = ["| T | method | final greedy pass@1 | final sampled pass@1 | final drift | "
             "final entropy |", "|---|---|---|---|---|---|"]
    for t, by, pattern in rows:
        for m, label in LABELS.items():
            rs = by[pattern.format(m=m)]
            ent = np.mean([report._last(r, "entropy") for r in rs])
            lines.append(f"| {t:.1f} | {label} | {_pct([_final(r, 'greedy_acc') for r in rs])} | "
                         f"{_pct([_final(r, 'pass@1') for r in rs])} | "
                         f"{_num(_drifts(rs))} | {ent:.3f} |")
    return lines


def long_horizon_table() -> list[str]:
    by = runs("long_horizon")
    lines = ["| method | greedy pass@1 at 60 → 240 | sampled pass@1 at 240 | drift at 240 | "
             "max drift | min entropy |", "|---|---|---|---|---|---|"]
    for m, label in LABELS.items():
        rs = by[m]
        at60 = np.mean([_eval_at(r, 60) for r in rs])
        lines.append(
            f"| {label} | {100 * at60:.1f} → {_pct([_final(r, 'greedy_acc') for r in rs])} | "
            f"{_pct([_final(r, 'pass@1') for r in rs])} | "
            f"{_per_seed(_drifts(rs))} | "
            f"{_per_seed([report._max(r, 'drift/qkl_k3') for r in rs])} | "
            f"{_per_seed([report._min(r, 'entropy') for r in rs])} |")
    return lines


def ablations_table() -> list[str]:
    by = runs("ablations")
    lines = ["| variant | what changes | final drift, per seed | final greedy pass@1 | "
             "best greedy pass@1 |", "|---|---|---|---|---|"]
    for name, change in ABLATION_CHANGES.items():
        rs = by[name]
        tabs = [report.eval_table(r) for r in rs]
        lines.append(f"| {name} | {change} | "
                     f"{_per_seed(_drifts(rs))} | "
                     f"{_pct([t['final']['average'] for t in tabs])} | "
                     f"{_pct([t['best']['average'] for t in tabs])} |")
    return lines


def wall_table() -> list[str]:
    lines = ["| sweep | runs | wall |", "|---|---:|---:|"]
    total_n = total_s = 0
    for exp, label in SWEEPS:
        rs = [r for v in runs(exp).values() for r in v]
        if exp == "high_temperature":   # its T = 1.0 variants repeat the main comparison
            rs = [r for r in rs if not r["name"].endswith("-T1.0")]
        s = sum(r["wall_s"] for r in rs)
        total_n, total_s = total_n + len(rs), total_s + s
        lines.append(f"| {label} | {len(rs)} | {s:,.0f} s |")
    lines.append(f"| **total** | **{total_n}** | **{total_s:,.0f} s "
                 f"({int(total_s // 3600)} h {int(total_s % 3600 // 60)} min)** |")
    return lines


TABLES = {"wall": wall_table, "main": main_table, "drift": drift_table,
          "temperature": temperature_table, "long_horizon": long_horizon_table,
          "ablations": ablations_table}


def render(name: str) -> str:
    return f"<!-- table: {name} -->\n" + "\n".join(TABLES[name]()) + "\n"


def main(argv: list[str]) -> int:
    names = argv or list(TABLES)
    unknown = [n for n in names if n not in TABLES]
    if unknown:
        print(f"unknown table(s) {unknown}; choose from {list(TABLES)}", file=sys.stderr)
        return 2
    print("\n".join(render(n) for n in names))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
