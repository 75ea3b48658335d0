"""Run summaries (erpo_jax/tools/run_summary.py): `erpo report` over the small
committed files makes the same tables as over the run directories."""

import argparse
import json

import numpy as np
import pytest

from erpo_jax.tools import report, run_summary


def _write_run(path, name, seed, steps=240):
    """A run in the trainer's format; drift is logged every 5th step, evals every 60."""
    rng = np.random.default_rng(seed + 10 * len(name))
    path.mkdir(parents=True)
    cfg = {"name": name, "train": {"seed": seed, "steps": steps}}
    (path / "config.json").write_text(json.dumps(cfg))
    rows = []
    for s in range(1, steps + 1):
        r = {"step": s, "accuracy": rng.uniform(), "reward_mean": rng.uniform(),
             "entropy": rng.uniform(0.03, 0.5), "response_len_mean": rng.uniform(10, 30),
             "time/rollout": rng.uniform(0.2, 0.4), "time/ref": 0.1 * ("kl" in name),
             "time/update": rng.uniform(0.5, 1.0), "loss": rng.normal(),
             "grad_norm": rng.uniform()}
        if s % 5 == 0:
            r["drift/qkl_k3"] = rng.uniform(0, 0.2)
        rows.append(r)
    (path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    evals = [{"step": s, "sets": {k: {"greedy_acc": rng.uniform(), "n_problems": 100}
                                  for k in ("add", "mul")},
              "average": {"greedy_acc": rng.uniform(), "pass@1": rng.uniform(),
                          "pass@4": rng.uniform()}} for s in range(0, steps + 1, 60)]
    (path / "evals.jsonl").write_text("".join(json.dumps(e) + "\n" for e in evals))
    # An interrupted and resumed run: two segments, as `erpo sweep` records them.
    (path / "sweep_wall.jsonl").write_text(
        json.dumps({"state": "interrupted", "wall_s": 10.0 + seed}) + "\n"
        + json.dumps({"state": "ok", "wall_s": 20.5}) + "\n")


@pytest.fixture
def runs(tmp_path):
    dirs = []
    for name in ("erpo", "grpo+policy_kl", "no_kl"):
        for seed in (0, 1, 2):
            d = tmp_path / "runs" / name / f"seed{seed}"
            _write_run(d, name, seed)
            dirs.append(d)
    return tmp_path, dirs


def test_report_from_summaries_equals_report_from_runs(runs):
    root, dirs = runs
    parser = argparse.ArgumentParser()
    report.add_parser(parser.add_subparsers())
    summaries = root / "summaries"
    args = parser.parse_args(["report", str(root / "runs"), "--out", str(root / "a"),
                              "--baseline", "no_kl", "--write-summaries", str(summaries)])
    assert args.func(args) == 0
    files = sorted(summaries.glob("*/seed*.json"))
    assert len(files) == 9
    assert max(f.stat().st_size for f in files) < 64_000   # 240 steps
    args = parser.parse_args(["report", str(summaries), "--out", str(root / "b"),
                              "--baseline", "no_kl"])
    assert args.func(args) == 0
    # The whole report, down to the list of runs it was made from.
    assert (root / "a" / "REPORT.md").read_text() == (root / "b" / "REPORT.md").read_text()
    md = (root / "b" / "REPORT.md").read_text()
    assert "| erpo − no_kl | final drift (QKL k3) |" in md
    # Per-seed values and wall times (10 + seed + 20.5 s each) are in the report.
    full = report.load_run(dirs[1])
    assert full["wall_s"] == 31.5
    drift = report.series(full, "drift/qkl_k3")[1]
    row = next(line for line in md.splitlines() if line.startswith("| erpo | 1 |"))
    assert f"| {drift[-1]:.3f} | {drift.max():.3f} |" in row and row.endswith("| 32 |")
    assert f"Wall time: {3 * (30.5 + 31.5 + 32.5):,.0f} s over 9 runs." in md
    # Every value the report reads comes back, and nothing else is kept.
    full, back = report.load_run(dirs[0]), report.load_run(files[0])
    for key in run_summary.METRIC_KEYS:
        np.testing.assert_array_equal(report.series(full, key)[1], report.series(back, key)[1])
    assert back["evals"] == full["evals"] and "loss" not in back["metrics"][0]


def test_bad_summary_is_named(tmp_path):
    bad = tmp_path / "erpo" / "seed0.json"
    bad.parent.mkdir()
    bad.write_text('{"format": 99}')
    with pytest.raises(ValueError, match="seed0.json is not a run summary of format 1"):
        report.load_run(bad)
    bad.write_text("{")
    with pytest.raises(ValueError, match="not a readable run summary"):
        report.load_run(bad)
