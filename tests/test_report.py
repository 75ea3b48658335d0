"""`erpo report` on small finished runs: the table's numbers are the runs' numbers.

The runs are written in the trainer's format (config.json, metrics.jsonl with
one row per step, evals.jsonl with one row per evaluation); a run produced by
the real trainer goes through the same report in test_experiments.py.
"""

import json
import math
import re

import numpy as np
import pytest
from scipy import stats

from erpo_jax.tools import report

SETS = ("add", "mul")


def _write_run(path, name, seed, accs, drift, entropy, steps=4):
    """accs: [(step, {set: acc})]; drift/entropy: value per step (list of `steps`)."""
    path.mkdir(parents=True)
    cfg = {"name": name, "train": {"seed": seed, "steps": steps, "eval_every": 2}}
    (path / "config.json").write_text(json.dumps(cfg))
    rows = [{"step": s + 1, "accuracy": 0.5, "reward_mean": 0.4, "entropy": entropy[s],
             "response_len_mean": 10.0 + s, "drift/qkl_k3": drift[s], "time/rollout": 0.3,
             "time/ref": 0.1 if "kl" in name else 0.0, "time/update": 1.0}
            for s in range(steps)]
    (path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    evals = [{"step": s, "sets": {k: {"greedy_acc": v, "n_problems": 10} for k, v in a.items()},
              "average": {"greedy_acc": float(np.mean(list(a.values()))),
                          "pass@4": 0.7 + 0.1 * seed}} for s, a in accs]
    (path / "evals.jsonl").write_text("".join(json.dumps(e) + "\n" for e in evals))


@pytest.fixture
def runs(tmp_path):
    """Two methods x two seeds; 'erpo' seed 1 collapses (accuracy drop of 0.3)."""
    spec = {
        ("erpo", 0): ([0.5, 0.6], [0.7, 0.8], [0.6, 0.8]),
        ("erpo", 1): ([0.5, 0.5], [0.9, 0.9], [0.5, 0.6]),
        ("grpo+policy_kl", 0): ([0.5, 0.4], [0.6, 0.5], [0.55, 0.45]),
        ("grpo+policy_kl", 1): ([0.5, 0.6], [0.5, 0.5], [0.55, 0.5]),
    }
    dirs = []
    for (name, seed), (a0, a2, a4) in spec.items():
        accs = [(0, dict(zip(SETS, a0))), (2, dict(zip(SETS, a2))), (4, dict(zip(SETS, a4)))]
        d = tmp_path / name / f"seed{seed}"
        drift = [0.01 * (s + 1) * (1 if name == "erpo" else 3) + 0.001 * seed for s in range(4)]
        entropy = [0.5, 0.4, 0.3, 0.2 + 0.01 * seed]
        _write_run(d, name, seed, accs, drift, entropy)
        dirs.append(d)
    return tmp_path, dirs, spec


def _cells(md: str, method: str) -> list[str]:
    line = next(x for x in md.splitlines() if x.startswith(f"| {method} |"))
    return [c.strip() for c in line.strip("|").split("|")]


def _ci(values):
    v = np.asarray(values, float)
    return v.mean(), stats.t.ppf(0.975, len(v) - 1) * v.std(ddof=1) / math.sqrt(len(v))


def test_table_numbers_match_the_runs(runs):
    root, dirs, spec = runs
    path = report.write_report(dirs, root / "out", title="t",
                               comparisons=[("erpo", "grpo+policy_kl")])
    md = path.read_text()
    for method in ("erpo", "grpo+policy_kl"):
        cells = _cells(md, method)
        header = [c.strip() for c in md.splitlines()[2].strip("|").split("|")]
        assert header[:5] == ["method", "seeds", "initial avg", "final avg", "best avg"]
        seeds = [spec[(method, s)] for s in (0, 1)]
        final_avg = [np.mean(x[2]) for x in seeds]
        best_avg = [max(np.mean(x[0]), np.mean(x[1]), np.mean(x[2])) for x in seeds]
        final_mul = [x[2][1] for x in seeds]
        m, h = _ci(final_avg)
        assert cells[1] == "2"
        assert cells[3] == f"{100 * m:.1f} ± {100 * h:.1f}"
        m, h = _ci(best_avg)
        assert cells[4] == f"{100 * m:.1f} ± {100 * h:.1f}"
        m, h = _ci(final_mul)
        assert cells[header.index("final mul")] == f"{100 * m:.1f} ± {100 * h:.1f}"
        m, h = _ci([0.7, 0.8])
        assert cells[header.index("final avg pass@4")] == f"{100 * m:.1f} ± {100 * h:.1f}"
    # The stability table: erpo seed 1 falls from 0.9 to 0.55 at step 4; nothing else does.
    assert _cells(md.split("Stability")[1], "erpo")[1:3] == ["1/2", "4"]
    assert _cells(md.split("Stability")[1], "grpo+policy_kl")[1:3] == ["0/2", "-"]
    drift = _cells(md.split("Stability")[1], "erpo")[3]
    m, h = _ci([0.04, 0.041])
    assert drift == f"{m:.3f} ± {h:.3f}"
    # Cost table: the reference forward appears only where Policy-KL is on.
    cost = md.split("Cost per RL step")[1]
    assert _cells(cost, "erpo")[2] == "0.000 ± 0.000"
    assert _cells(cost, "grpo+policy_kl")[2] == "0.100 ± 0.000"


def test_effect_size_is_welch_difference_against_seed_noise(runs):
    root, dirs, spec = runs
    md = report.write_report(dirs, root / "out", comparisons=[("erpo", "grpo+policy_kl")]
                             ).read_text()
    row = next(x for x in md.splitlines() if x.startswith("| erpo − grpo+policy_kl | final avg"))
    a = [np.mean(spec[("erpo", s)][2]) for s in (0, 1)]
    b = [np.mean(spec[("grpo+policy_kl", s)][2]) for s in (0, 1)]
    res = stats.ttest_ind(a, b, equal_var=False)
    lo, hi = res.confidence_interval(0.95)
    diff = np.mean(a) - np.mean(b)
    sd = math.sqrt((np.var(a, ddof=1) + np.var(b, ddof=1)) / 2)
    cells = [c.strip() for c in row.strip("|").split("|")]
    assert cells[2] == f"{100 * diff:+.1f} [{100 * lo:+.1f}, {100 * hi:+.1f}]"
    assert cells[3] == f"{100 * sd:.1f}"
    assert cells[4] == f"{diff / sd:+.2f}"


def test_rank_test_is_scipys_exact_mann_whitney_and_counts_ties_half():
    rng = np.random.default_rng(0)
    for n, m in [(5, 5), (3, 3), (4, 6), (5, 3)]:
        a, b = rng.normal(size=n), rng.normal(size=m) + 0.8
        got = report.rank_test(a, b)
        want = stats.mannwhitneyu(a, b, method="exact", alternative="two-sided")
        assert got["u"] == want.statistic and math.isclose(got["p"], want.pvalue)
    # Closed forms: full separation at 5 vs 5 is 2 of the C(10, 5) = 252 splits;
    # a drift tail of any size leaves the ranks, and so p, as they were.
    assert math.isclose(report.rank_test([1, 2, 3, 4, 5], [6, 7, 8, 9, 10])["p"], 2 / 252)
    assert report.rank_test([1, 2, 3, 4, 5], [6, 7, 8, 9, 1e6]) == \
        report.rank_test([1, 2, 3, 4, 5], [6, 7, 8, 9, 10])
    # Ties count half: equal samples give U = nm/2 and p = 1.
    assert report.rank_test([1, 1, 1], [1, 1, 1]) == {"u": 4.5, "p": 1.0, "n": (3, 3)}
    # One tie across groups, checked against a hand enumeration of the 20 splits.
    import itertools
    pooled = [0.5, 1.0, 2.0, 1.0, 3.0, 4.0]
    def u(idx):
        return sum((pooled[i] > pooled[j]) + 0.5 * (pooled[i] == pooled[j])
                   for i in idx for j in range(6) if j not in idx)
    far = abs(u((0, 1, 2)) - 4.5)
    want = np.mean([abs(u(c) - 4.5) >= far for c in itertools.combinations(range(6), 3)])
    assert report.rank_test(pooled[:3], pooled[3:])["p"] == want


def test_pngs_and_collapse_definition(runs):
    root, dirs, _ = runs
    out = root / "out"
    path = report.write_report(dirs, out)
    for key in ("eval_average", "accuracy", "reward_mean", "drift_qkl_k3", "entropy",
                "response_len_mean"):
        png = out / f"{key}.png"
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n", key
        assert f"![{key}]({key}.png)" in path.read_text()
    # Entropy floor: the first step below it is the collapse step.
    run = report.load_run(dirs[0])
    assert report.collapse_step(run, collapse_drop=1.0, entropy_floor=0.35) == 3
    assert report.collapse_step(run, collapse_drop=1.0, entropy_floor=0.0) is None
    # A drop is measured from the best so far, not from the final best.
    run["evals"] = [{"step": s, "sets": {}, "average": {"greedy_acc": a}}
                    for s, a in [(0, 0.2), (1, 0.5), (2, 0.3), (3, 0.9)]]
    assert report.collapse_step(run, collapse_drop=0.15, entropy_floor=0.0) == 2


def test_cli_expands_an_experiment_directory(runs, capsys):
    import argparse
    root, dirs, _ = runs
    parser = argparse.ArgumentParser()
    report.add_parser(parser.add_subparsers())
    args = parser.parse_args(["report", str(root), "--out", str(root / "cli"), "--baseline",
                              "grpo+policy_kl"])
    assert args.func(args) == 0
    md = (root / "cli" / "REPORT.md").read_text()
    assert re.search(r"\| erpo − grpo\+policy_kl \| best avg acc \|", md)
    assert all(f"`{d}`" in md for d in dirs)
    args = parser.parse_args(["report", str(root), "--out", str(root / "x"), "--baseline", "nope"])
    with pytest.raises(ValueError, match="--baseline 'nope'"):
        args.func(args)


def _table_rows(md: str) -> list[list[str]]:
    """Every markdown table in `md` as its rows' cell counts, table by table."""
    tables, cur = [], []
    for line in md.splitlines() + [""]:
        if line.startswith("|"):
            assert line.endswith("|"), line
            cur.append(line)
        elif cur:
            tables.append(cur)
            cur = []
    return tables


def _check_tables(md: str) -> int:
    tables = _table_rows(md)
    for t in tables:
        counts = [len(row.strip().strip("|").split("|")) for row in t]
        assert len(set(counts)) == 1, (counts, t)
        assert re.fullmatch(r"\|(---\|)+", t[1]), t[1]
        assert all(c.strip() for c in t[0].strip("|").split("|")), t[0]  # no empty header cell
    return len(tables)


@pytest.mark.parametrize("evals", ["none", "no_sets", "sets"])
def test_every_table_is_valid_markdown_with_or_without_evaluations(runs, evals):
    """Issue 36 item 12: runs without evaluations gave the accuracy table 6 header cells
    (a trailing empty one) and 5 delimiter cells; every row of every table has one count."""
    root, dirs, _ = runs
    for d in dirs:
        if evals == "none":
            (d / "evals.jsonl").unlink()
        elif evals == "no_sets":
            rows = [json.loads(x) for x in (d / "evals.jsonl").read_text().splitlines()]
            for r in rows:
                r["sets"] = {}
                r["average"] = {"greedy_acc": r["average"]["greedy_acc"]}
            (d / "evals.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    md = report.write_report(dirs, root / "out", comparisons=[("erpo", "grpo+policy_kl")]
                             ).read_text()
    assert _check_tables(md) >= 3


# ----------------------------------------------------------------------------- issue 49


def _full_config(name, seed, out_dir, *overrides):
    """A resolved config as `erpo train` saves it (config.json), with its data_rows."""
    from erpo_jax.train.config import config_dict, load_config
    from erpo_jax.train.methods import resolve_method
    cfg = config_dict(resolve_method(load_config(None, [f"train.seed={seed}",
                                                        f"train.out_dir={out_dir}",
                                                        *overrides])))
    return {**cfg, "name": name, "data_rows": {"train": 4000, "held_out": {}, "dropped": {},
                                               "eval": {"add": 10}}}


def _run_with_config(path, cfg, accs=(0.5, 0.6)):
    _write_run(path, cfg["name"], cfg["train"]["seed"],
               [(0, dict(zip(SETS, accs))), (4, dict(zip(SETS, accs)))],
               [0.01] * 4, [0.5] * 4)
    (path / "config.json").write_text(json.dumps(cfg))


def test_runs_are_seeds_of_one_method_only_when_their_configs_differ_in_the_seed_alone(
        tmp_path, capsys):
    """Issue 49 item 5: `erpo report runs/a runs/b` of plain GRPO and ERPO + DAPO,
    both seed 0 and both named 'run' (any two CLI runs without --config), printed
    one method with 'seeds 2'. They are two methods, named by the fields that
    differ; seeds of one config (with their own out_dir, progress bar and
    data_rows) are one method; the same config and seed twice is refused."""
    from erpo_jax import cli
    a, b = tmp_path / "a", tmp_path / "b"
    _run_with_config(a, _full_config("run", 0, a))
    _run_with_config(b, _full_config("run", 0, b, "algo.method=erpo", "algo.filter_groups=true",
                                     "loss.eps_high=0.28"))
    md = report.write_report([a, b], tmp_path / "out").read_text()
    rows = [x for x in md.splitlines() if x.startswith("| run")]
    label_a = ("run (algo.filter_groups=false, algo.method=custom, algo.weight_scheme=uniform, "
               "loss.beta_query=0.0, loss.eps_high=0.2)")
    label_b = ("run (algo.filter_groups=true, algo.method=erpo, algo.weight_scheme=likelihood, "
               "loss.beta_query=0.1, loss.eps_high=0.28)")
    assert _cells(md, label_a)[1] == "1" and _cells(md, label_b)[1] == "1"
    assert not any(r.startswith("| run |") for r in rows)
    assert "The runs named 'run' differ in more than the seed (algo.filter_groups" in md
    # Seeds: only the seed, out_dir, progress and the recorded data_rows differ.
    c = tmp_path / "c"
    cfg = _full_config("run", 1, c, "train.progress=false")
    cfg["data_rows"]["train"] = 3999
    _run_with_config(c, cfg)
    md = report.write_report([a, c], tmp_path / "out2").read_text()
    assert _cells(md, "run")[1] == "2" and "differ in more than" not in md
    # The same method and seed twice cannot be two seeds: rc 2, naming both.
    d = tmp_path / "d"
    _run_with_config(d, _full_config("run", 0, d))
    assert cli.main(["report", str(a), str(d), "--out", str(tmp_path / "out3")]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "Traceback" not in err
    assert f"{a} and {d} are both seed 0 of the same method (run)" in err
    assert not (tmp_path / "out3").exists()
