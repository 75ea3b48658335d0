"""experiments/RESULTS.md's tables are what experiments/results_tables.py makes from
the committed run summaries, and each experiment's committed REPORT.md is what
`erpo report --experiment` makes from them, and BENCHMARKS.md's targets table is
the committed `erpo bench --out` report's: every reported number traces to a
committed file."""

import argparse
import importlib.util
from pathlib import Path

import pytest

from erpo_jax.tools import report

EXP = Path(__file__).resolve().parent.parent / "experiments"


def _load(path):
    spec = importlib.util.spec_from_file_location(path.stem, path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _tables():
    return _load(EXP / "results_tables.py")


@pytest.mark.parametrize("name", list(_tables().TABLES))
def test_results_md_holds_the_table_made_from_the_summaries(name):
    table = _tables().render(name)
    text = (EXP / "RESULTS.md").read_text()
    assert table in text, (f"RESULTS.md's '{name}' table differs from what "
                           f"`python experiments/results_tables.py {name}` prints:\n{table}")


def test_a_run_without_a_recorded_wall_is_counted_not_summed_as_zero_or_an_error():
    lines = _tables()._wall_lines([("a", [{"wall_s": 10.0}, {"wall_s": None}]),
                                   ("b", [{"wall_s": 5.0}])])
    assert lines[2] == "| a | 2 | 10 s (+ 1 run without a recorded wall) |"
    assert lines[3] == "| b | 1 | 5 s |"
    assert lines[4].startswith("| **total** | **3** | **15 s (0 h 0 min) (+ 1 run without")


@pytest.mark.parametrize("experiment", [p.parent.name for p in
                                        sorted((EXP / "results").glob("*/REPORT.md"))])
def test_committed_report_is_remade_from_its_summaries(experiment, tmp_path):
    parser = argparse.ArgumentParser()
    report.add_parser(parser.add_subparsers())
    args = parser.parse_args(["report", str(EXP / "results" / experiment / "runs"),
                              "--experiment", str(EXP / f"{experiment}.py"),
                              "--out", str(tmp_path)])
    assert args.func(args) == 0
    assert ((tmp_path / "REPORT.md").read_text()
            == (EXP / "results" / experiment / "REPORT.md").read_text())


def test_benchmarks_md_holds_the_targets_table_of_the_committed_bench_report():
    import json
    mod = _load(EXP / "profiles" / "bench_targets.py")
    report = json.loads((EXP / "results" / "bench" / "targets.json").read_text())
    table = "\n".join(mod.rows(report))
    assert table in (EXP / "BENCHMARKS.md").read_text(), table
    # Every target is a ratio against something measured in the same run.
    assert {"erpo_flops_ratio", "erpo_wall_ratio", "train_mfu", "rl_tiny_vs_tunix",
            "rl_small_vs_tunix"} <= set(report["targets"])


def test_slip_testbed_settings_are_what_its_searches_chose():
    """The coefficients and the stress regime the slip testbed runs with are what
    slip_tuning.chosen and slip_search.chosen_regime pick from the committed runs."""
    tables = _tables()
    testbed, stress = _load(EXP / "slip_testbed.py"), _load(EXP / "slip_stress.py")
    tuning, search = _load(EXP / "slip_tuning.py"), _load(EXP / "slip_search.py")
    picked = tuning.chosen([r for rs in tables.runs("slip_tuning").values() for r in rs])
    assert picked == {"grpo+policy_kl": testbed.BETA_POLICY, "erpo": testbed.BETA_QUERY}
    regime = search.chosen_regime([r for rs in tables.runs("slip_search").values() for r in rs])
    assert regime == stress.REGIME


def test_the_stability_grid_heatmap_is_drawn_from_the_committed_runs(tmp_path):
    """The grid's PNG (committed beside its runs) is remade from the summaries."""
    rt = _tables()
    assert rt.GRID_PNG.is_file()
    out = tmp_path / "grid.png"
    assert rt.main(["--grid-png", str(out)]) == 0
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and out.stat().st_size > 10_000


def test_accuracy_at_equal_sampled_responses_reads_the_last_evaluation_within_the_budget():
    """A run that samples twice the prompts per step is read at the last
    evaluation whose prompts sampled so far fit the other side's budget."""
    rt = _tables()

    def run(per_step, accs):   # evaluations at steps 0, 20, 40, ...
        return {"metrics": [{"step": s, "rollout/prompts_sampled": per_step}
                            for s in range(1, 101)],
                "evals": [{"step": 20 * i, "average": {"greedy_acc": a}}
                          for i, a in enumerate(accs)]}

    accs = [0.1, 0.2, 0.3, 0.4, 0.5, 0.6]
    plain, filtering = run(16.0, accs), run(32.0, accs)
    budget = rt._sampled_prompts(plain)[-1]
    assert budget == 1600.0
    assert rt._greedy_within(plain, budget) == (0.6, 100)
    assert rt._greedy_within(filtering, budget) == (0.3, 40)   # 1600 prompts at step 50
    assert rt._greedy_within(filtering, 15.0) == (0.1, 0)      # nothing fits: the reference
