"""experiments/RESULTS.md's tables are what experiments/results_tables.py makes from
the committed run summaries, and each experiment's committed REPORT.md is what
`erpo report --experiment` makes from them: every reported number traces to a
committed file."""

import argparse
import importlib.util
from pathlib import Path

import pytest

from erpo_jax.tools import report

EXP = Path(__file__).resolve().parent.parent / "experiments"


def _tables():
    spec = importlib.util.spec_from_file_location("results_tables", EXP / "results_tables.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.mark.parametrize("name", list(_tables().TABLES))
def test_results_md_holds_the_table_made_from_the_summaries(name):
    table = _tables().render(name)
    text = (EXP / "RESULTS.md").read_text()
    assert table in text, (f"RESULTS.md's '{name}' table differs from what "
                           f"`python experiments/results_tables.py {name}` prints:\n{table}")


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
