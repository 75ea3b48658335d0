"""`erpo demo` (the README's first command, issue 37): the reference model it
ships is the slip testbed's, the rebuild command makes the same file, the demo
logs lines a person can read when redirected, and (ERPO_LONG_TESTS=1, with
the rebuild) a rerun gives the same numbers."""

import dataclasses
import hashlib
import json
import os
import re
import subprocess
import sys

import pytest

from erpo_jax.tools import demo, presets
from erpo_jax.tools.presets import slip_sft_config
from erpo_jax.train.config import RunConfig, config_dict, from_dict, normalized

REF = demo.REFERENCE


def _sha256(path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _comparable(cfg: RunConfig) -> dict:
    """A config without where it wrote and whether it drew a progress bar."""
    return config_dict(dataclasses.replace(cfg, train=dataclasses.replace(
        cfg.train, out_dir="", progress=True)))


def test_the_shipped_reference_is_slip_sft_config_and_its_readme_hash():
    saved = json.loads((REF / "sft_config.json").read_text())
    assert saved["data_rows"]["train"] == 20000   # trained on every generated row
    assert _comparable(from_dict(RunConfig, normalized(saved))) == _comparable(slip_sft_config())
    hashes = re.findall(r"\b[0-9a-f]{64}\b", (REF / "README.md").read_text())
    assert hashes == [_sha256(REF / "model.safetensors")]
    # It is the model its config describes: the arith-medium preset's shapes.
    from erpo_jax.model.config import PRESETS
    hf = json.loads((REF / "config.json").read_text())
    medium = PRESETS["arith-medium"]
    assert (hf["num_hidden_layers"], hf["hidden_size"]) == (medium.num_layers, medium.hidden_size)


@pytest.mark.long   # a 900-step SFT, about 9 minutes on 2 cores
def test_rebuilding_the_reference_gives_the_shipped_file(tmp_path):
    from erpo_jax.train.sft import run_sft
    cfg = slip_sft_config(str(tmp_path / "sft"))
    run_sft(dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, progress=False)))
    assert _sha256(tmp_path / "sft" / "model" / "model.safetensors") == \
        _sha256(REF / "model.safetensors")


def _quick_demo(out):
    env = dict(os.environ, PYTHONPATH=os.getcwd())
    p = subprocess.run([sys.executable, "-m", "erpo_jax.cli", "demo", "--quick", "--out",
                        str(out)], capture_output=True, text=True, env=env, timeout=900)
    assert p.returncode == 0, p.stderr[-3000:]
    return p.stdout + p.stderr


def _numbers(out) -> dict:
    """Every run's evaluations and metrics, less the wall times."""
    got = {}
    for method in demo.METHODS:
        rows = [json.loads(x) for x in (out / method / "metrics.jsonl").read_text().splitlines()]
        got[method] = {"metrics": [{k: v for k, v in r.items() if not k.startswith("time/") and k != "tokens_per_sec"}
                                   for r in rows],
                       "evals": (out / method / "evals.jsonl").read_text()}
    return got


def test_the_quick_demo_logs_lines_and_a_summary(tmp_path):
    _check_quick_demo(tmp_path / "a")


@pytest.mark.long   # a rerun of the trainer is bit-identical by default in test_compile_cache
def test_a_quick_demo_rerun_gives_the_same_numbers(tmp_path):
    table = _check_quick_demo(tmp_path / "a")
    # Deterministic on one CPU type and JAX version: a rerun's numbers are the same.
    _quick_demo(tmp_path / "b")
    assert _numbers(tmp_path / "b") == _numbers(tmp_path / "a")
    table_b = [x for x in (tmp_path / "b" / "SUMMARY.md").read_text().splitlines()
               if x.startswith("| ")][:5]
    assert table_b == table


def _check_quick_demo(out) -> list[str]:
    """Run the quick demo into `out`, check its log and SUMMARY.md; the summary's table."""
    log = _quick_demo(out)
    assert "\r" not in log
    assert "the slip testbed" in log and f"shipped in {REF}" in log
    for method in demo.METHODS:   # each run's progress: one line per step of 2
        assert [x.split(",")[0] for x in log.splitlines() if x.startswith(f"{method}: ")] == \
            [f"{method}: 1/2 steps (50%)", f"{method}: 2/2 steps (100%)"]
    summary = (out / "SUMMARY.md").read_text()
    assert demo.ONE_SEED in summary and "slip testbed" in summary.splitlines()[0]
    table = [x for x in summary.splitlines() if x.startswith("| ")][:5]
    assert [x.split("|")[1].strip() for x in table[1:]] == \
        ["reference (the SFT model, step 0)"] + [demo.LABELS[m] for m in demo.METHODS]
    assert (out / "eval_average.png").is_file()
    # The slip testbed's entropy is low by nature: a collapse is its accuracy drop.
    assert f"response entropy is below {presets.SLIP_ENTROPY_FLOOR};" in summary
    return table
