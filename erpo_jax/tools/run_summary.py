"""Per-run summaries: everything `erpo report` reads from a run, in one small
JSON file that can be committed next to a REPORT.md (run directories, with
checkpoints, TensorBoard events and sampled responses, stay out of git).

A summary holds the run's resolved config, its wall time under `erpo sweep`
(the sum over the segments of an interrupted run), the per-step values of the
metrics the report tables and plots use (columnar: one list per key, `null`
where a step did not log the key) and every evaluation row. `erpo report`
accepts summary files, or a directory of `<method>/seed<k>.json`, wherever it
accepts run directories, and makes the same tables from them.

    erpo report runs/main_comparison --out X --write-summaries experiments/results/main_comparison/runs
    erpo report experiments/results/main_comparison/runs --out X   # from the summaries alone
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

FORMAT = 1
# What report.py reads from metrics.jsonl: the plotted keys and the cost table's;
# and, for the stability techniques (issue 35), the prompts each step sampled
# (dynamic sampling draws more: accuracy at equal samples), the adaptive
# Policy-KL coefficient and the groups dynamic sampling could not fill. A key
# no row has is left out.
METRIC_KEYS = ("accuracy", "reward_mean", "drift/qkl_k3", "entropy", "response_len_mean",
               "time/rollout", "time/ref", "time/update", "rollout/prompts_sampled",
               "kl_coef", "filter/short",
               # issue 47: the coefficient after each step, dynamic sampling's draws and
               # varied groups (the share of short steps, prompts per step)
               "kl_coef_next", "filter/batches", "filter/varied_groups")


def summarize(run: dict[str, Any]) -> dict[str, Any]:
    """The summary of a run as `report.load_run` returns it."""
    rows = run["metrics"]
    keys = [k for k in METRIC_KEYS if any(k in r for r in rows)]
    return {"format": FORMAT, "source": run["dir"], "name": run["name"],
            "wall_s": run.get("wall_s"), "config": run["config"],
            "metrics": {"step": [r["step"] for r in rows],
                        **{k: [r.get(k) for r in rows] for k in keys}},
            "evals": [{k: e[k] for k in ("step", "sets", "average") if k in e}
                      for e in run["evals"]]}


def load_summary(path: str | Path) -> dict[str, Any]:
    """A summary file as a run (the dict `report.load_run` returns)."""
    path = Path(path)
    try:
        s = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise ValueError(f"{path} is not a readable run summary ({e}).") from None
    if not isinstance(s, dict) or s.get("format") != FORMAT:
        raise ValueError(f"{path} is not a run summary of format {FORMAT} (written by "
                         "`erpo report ... --write-summaries DIR`).")
    cols = s["metrics"]
    keys = [k for k in cols if k != "step"]
    metrics = [{"step": step, **{k: cols[k][i] for k in keys if cols[k][i] is not None}}
               for i, step in enumerate(cols["step"])]
    # "dir" is the run directory it was made from, so a report from summaries names
    # the same runs as one from the directories.
    return {"dir": s["source"], "name": s["name"], "config": s["config"], "metrics": metrics,
            "evals": s["evals"], "wall_s": s.get("wall_s")}


def summary_path(out_dir: str | Path, run: dict[str, Any]) -> Path:
    """<out_dir>/<method name>/seed<k>.json."""
    seed = run["config"].get("train", {}).get("seed", 0)
    return Path(out_dir) / run["name"] / f"seed{seed}.json"


def write_summaries(runs, out_dir: str | Path) -> list[Path]:
    """One summary file per run under `out_dir` (compact JSON)."""
    paths = []
    for run in runs:
        p = summary_path(out_dir, run)
        if p in paths:
            raise ValueError(f"two runs map to {p} (same method name and seed): "
                             f"{run['dir']} and an earlier one.")
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text(json.dumps(summarize(run), separators=(",", ":")) + "\n")
        paths.append(p)
    return paths
