"""What a user does by mistake never corrupts a run (issue 36): `erpo eval` into
its own directory, one run per directory, output paths checked before the work,
the right cause named, no tracebacks, and overrides anywhere on the line.

Everything here is refused before a model is built, except the evaluations of
the session's tiny SFT model."""

from __future__ import annotations

import dataclasses
import json
import os
import signal
import socket
import subprocess
import sys
import time

import pytest

from erpo_jax.train import startup
from erpo_jax import cli
from erpo_jax.runtime import run_lock, rundir
from erpo_jax.train import loop

from tiny_runs import TINY

RANDOM = [*TINY, "train.tensorboard=false"]


def _err(capsys) -> str:
    err = capsys.readouterr().err.strip()
    assert "Traceback" not in err
    return err


def _fake_run(d):
    """A training run's directory as `erpo train` leaves it (no model needed)."""
    d.mkdir(parents=True)
    (d / "config.json").write_text("{}")
    (d / "metrics.jsonl").write_text(json.dumps({"step": 1, "reward_mean": 0.5}) + "\n")
    (d / "evals.jsonl").write_text(json.dumps({"step": 0, "average": {"greedy_acc": 0.1}}) + "\n")
    return {p.name: p.read_bytes() for p in d.iterdir()}


def _no_model_built(monkeypatch):
    from erpo_jax.train import policy

    def refuse(*a, **k):
        raise AssertionError("a model was loaded before the output path was checked")
    monkeypatch.setattr(policy, "load_policy", refuse)
    monkeypatch.setattr(startup, "load_policy", refuse)


# ----------------------------------------------------------------------------- 1. eval


def test_eval_writes_beside_the_model_and_into_a_run_only_when_asked(sft_model, tmp_path,
                                                                     capsys):
    run = tmp_path / "run"
    before = _fake_run(run)
    # The repro of the issue: the config's train.out_dir is a run; eval no longer writes there.
    assert cli.main(["eval", "--checkpoint", str(sft_model), *TINY,
                     f"train.out_dir={run}"]) == 0
    dirs = sorted(p for p in sft_model.parent.iterdir() if p.name.startswith("model-eval-test"))
    assert len(dirs) == 1 and (dirs[0] / "evals.jsonl").is_file()
    assert json.loads((dirs[0] / "eval_config.json").read_text())["model"] == str(sft_model)
    assert {p.name: p.read_bytes() for p in run.iterdir()} == before
    # Again: the same directory, holding the latest evaluation once.
    assert cli.main(["eval", "--checkpoint", str(sft_model), *TINY]) == 0
    assert len(rundir.read_jsonl(dirs[0] / "evals.jsonl")) == 1
    # --into-run records it as an eval of the run, never as a training step.
    assert cli.main(["eval", "--checkpoint", str(sft_model), *TINY, "--into-run",
                     f"train.out_dir={run}"]) == 0
    now = {p.name: p.read_bytes() for p in run.iterdir()}
    assert {k: now[k] for k in before} == before
    [row] = rundir.read_jsonl(run / "external_evals.jsonl")
    assert row["model"] == str(sft_model) and row["sets"] and "step" not in row
    assert len(list(run.glob("external_eval_*.json"))) == 1


def test_eval_refuses_a_run_directory_as_out_before_the_work(tmp_path, capsys, monkeypatch):
    _no_model_built(monkeypatch)
    run = tmp_path / "run"
    before = _fake_run(run)
    assert cli.main(["eval", *RANDOM, "--out", str(run)]) == 2
    err = _err(capsys)
    assert f"--out {run} is a training run's directory" in err and "--into-run" in err
    assert {p.name: p.read_bytes() for p in run.iterdir()} == before
    assert cli.main(["eval", *RANDOM, "--into-run", "--out", str(tmp_path)]) == 2
    assert "holds no training run" in _err(capsys)


# ----------------------------------------------------------------------------- 2. one run per dir


HOLD = ("import sys, time\nfrom erpo_jax.runtime.run_lock import RunLock\n"
        "lock = RunLock(sys.argv[1], 'erpo train')\nprint('held', flush=True)\ntime.sleep(600)\n")


def test_a_second_run_on_a_directory_is_refused_and_a_killed_holder_frees_it(tmp_path, capsys,
                                                                             monkeypatch):
    run = tmp_path / "run"
    run.mkdir()
    env = dict(os.environ, PYTHONPATH=os.getcwd(), JAX_PLATFORMS="cpu")
    holder = subprocess.Popen([sys.executable, "-c", HOLD, str(run)], stdout=subprocess.PIPE,
                              text=True, env=env)
    try:
        assert holder.stdout.readline().strip() == "held"
        loaded = []
        monkeypatch.setattr(startup, "load_policy", lambda *a: loaded.append(a) or 1 / 0)
        assert cli.main(["train", *RANDOM, f"train.out_dir={run}"]) == 2
        err = _err(capsys)
        assert err.startswith("erpo train: config field train.out_dir:") and len(
            err.splitlines()) == 1
        assert f"pid {holder.pid}" in err and socket.gethostname() in err and "started" in err
        assert not loaded and not (run / "config.json").exists()
        with pytest.raises(ValueError, match=f"pid {holder.pid}"):
            run_lock.RunLock(run, "erpo sft")
    finally:
        holder.send_signal(signal.SIGKILL)
        holder.wait()
    # SIGKILL left the file behind, but not the lock: the rerun takes it.
    assert (run / run_lock.LOCK_FILE).exists()
    lock = run_lock.RunLock(run, "erpo train")
    assert json.loads((run / run_lock.LOCK_FILE).read_text())["pid"] == os.getpid()
    with pytest.raises(ValueError, match=f"pid {os.getpid()}"):   # also within one process
        run_lock.RunLock(run, "erpo train")
    lock.close()
    run_lock.RunLock(run, "erpo train").close()


def test_the_lock_on_gs_is_a_lease(tmp_path, monkeypatch):
    from test_rundir import fake_gcs
    run = "gs://bucket/exp/run"
    with fake_gcs(str(tmp_path / "root")):
        lock = run_lock.RunLock(run, "erpo train")
        with pytest.raises(ValueError, match=f"pid {os.getpid()}.*stale 600 s after"):
            run_lock.RunLock(run, "erpo train")
        lock.close()
        assert not rundir.path(f"{run}/{run_lock.LOCK_FILE}").exists()
        obj = rundir.path(f"{run}/{run_lock.LOCK_FILE}")
        fresh = {"host": "tpu-vm-7", "pid": 1, "started": "then", "renewed": time.time()}
        rundir.write_json(obj, fresh)
        with pytest.raises(ValueError, match="host tpu-vm-7, pid 1"):
            run_lock.RunLock(run, "erpo train")
        # Not renewed for a lease: the holder is gone (a preempted VM); taken over.
        rundir.write_json(obj, {**fresh, "renewed": time.time() - 2 * run_lock.LEASE_S})
        run_lock.RunLock(run, "erpo train").close()
        # This host's holder whose process is gone: taken over at once.
        dead = subprocess.Popen([sys.executable, "-c", "pass"])
        dead.wait()
        rundir.write_json(obj, {**fresh, "host": socket.gethostname(), "pid": dead.pid})
        run_lock.RunLock(run, "erpo train").close()


# ----------------------------------------------------------------------------- 6. outputs first


def test_output_paths_are_checked_before_the_work(tmp_path, capsys, monkeypatch):
    _no_model_built(monkeypatch)
    f = tmp_path / "results.json"
    f.write_text("{}")
    assert cli.main(["eval", *RANDOM, "--out", str(f)]) == 2
    assert f"--out {f} is a file, not a directory" in _err(capsys)
    from erpo_jax.train import inspect_grads
    monkeypatch.setattr(inspect_grads, "inspect_run", lambda *a, **k: 1 / 0)
    assert cli.main(["inspect-grads", "--config", "x.json", "--checkpoint", str(tmp_path),
                     "--json", str(tmp_path)]) == 2
    assert f"--json {tmp_path} is a directory" in _err(capsys)
    assert cli.main(["inspect-grads", "--json", str(f / "r.json")]) == 2   # under a file
    assert f"--json {f / 'r.json'}: its folder cannot be made" in _err(capsys)


# ----------------------------------------------------------------------------- 8. the right cause


def test_the_resume_hint_only_where_a_run_can_resume(tmp_path, capsys, monkeypatch):
    def full_disk(cfg, on_step=None):
        raise OSError(28, "No space left on device")
    monkeypatch.setattr(loop, "train", full_disk)
    run = tmp_path / "run"
    assert cli.main(["train", *RANDOM, f"train.out_dir={run}"]) == 1
    assert "rerun" not in _err(capsys)                       # nothing to resume from
    (run / "checkpoints" / "4").mkdir(parents=True)
    assert cli.main(["train", *RANDOM, f"train.out_dir={run}"]) == 1
    assert "intact up to the last checkpoint" in _err(capsys)
    monkeypatch.undo()
    # An out_dir that is a file, a missing --config: no run exists, no resume hint.
    f = tmp_path / "file"
    f.write_text("")
    assert cli.main(["train", *RANDOM, f"train.out_dir={f}"]) == 1
    err = _err(capsys)
    assert str(f) in err and "rerun" not in err
    assert cli.main(["train", "--config", str(tmp_path / "nope.json")]) == 2
    err = _err(capsys)
    assert "nope.json does not exist" in err and "rerun" not in err


# ----------------------------------------------------------------------------- 9. no tracebacks


def _files(tmp_path):
    (tmp_path / "wrong_type.json").write_text('{"train": {"steps": "abc"}}')
    (tmp_path / "not_json.json").write_text('{"train": ')
    (tmp_path / "section.json").write_text('{"train": 3}')
    (tmp_path / "syntax.py").write_text("def get_config(:\n")
    (tmp_path / "no_cpu.py").write_text("from erpo_jax.train.config import RunConfig\n\n\n"
                                        "def get_config():\n    return RunConfig()\n")
    (tmp_path / "train.jsonl").write_text('{"question": "1+1", "answer": "2"}\n')
    run = tmp_path / "sft_run"
    (run / "model").mkdir(parents=True)
    (run / "model" / "config.json").write_text("{}")
    return tmp_path


@pytest.mark.parametrize("argv,says", [
    (["train", "--config", "{d}/wrong_type.json"],
     "config field train.steps: expects an integer, got 'abc' (in {d}/wrong_type.json)."),
    (["train", "--config", "{d}/not_json.json"], "config file {d}/not_json.json is not valid JSON"),
    (["train", "--config", "{d}/section.json"], "config field train: is a section"),
    (["train", "--config", "{d}/syntax.py"], "config file {d}/syntax.py has a syntax error at "
                                             "line 1"),
    (["train", "--config", "{d}/no_cpu.py", "--cpu"],
     "config file {d}/no_cpu.py defines no get_cpu_config()"),
    (["train", "--cpu"], "--cpu picks the config file's get_cpu_config(), but no --config"),
    (["train", *RANDOM, "data.eval_benchmarks=gsm8k,nope"],
     "config field data.eval_benchmarks: 'nope' is not a benchmark"),
    (["train", *RANDOM, "train.steps"], "override 'train.steps' has no '='"),
    (["sweep", "experiments/main_comparison.py", "--seeds", "a,b", "--cpu", "--dry-run"],
     "--seeds 'a,b': give comma-separated non-negative integers"),
    (["train", *RANDOM, "model.init=sft", "model.path={d}/sft_run"],
     "config field model.path: model.path {d}/sft_run is a run directory, not a model "
     "directory; its exported model is {d}/sft_run/model"),
    (["eval", *RANDOM, "--checkpoint", "{d}/sft_run"],
     "--checkpoint {d}/sft_run is a run directory, not a model directory; its exported model "
     "is {d}/sft_run/model"),
    (["inspect-grads", "--config", "{d}/no_cpu.py", "--checkpoint", "{d}/sft_run"],
     "--checkpoint {d}/sft_run is a run directory"),
    # Issue 49 item 8: --only naming no variant selected every variant; an unknown one exited 1.
    (["sweep", "experiments/main_comparison.py", "--only", "", "--cpu", "--dry-run"],
     "--only names no variant; give comma-separated variant names of main_comparison ("),
    (["sweep", "experiments/main_comparison.py", "--only", ",", "--cpu", "--dry-run"],
     "--only names no variant"),
    (["sweep", "experiments/main_comparison.py", "--only", "nope", "--cpu", "--dry-run"],
     "--only nope: not a variant of main_comparison"),
    # Issue 49 item 8: eval with no evaluation set printed {} and exited 0.
    (["eval", *RANDOM, "data.task=jsonl", "data.train_file={d}/train.jsonl"],
     "config field data.eval_benchmarks: is empty, so this JSONL task has no evaluation set"),
    # A model directory that is not there: named before a mesh is built.
    (["eval", *RANDOM, "--checkpoint", "{d}/nowhere"],
     "--checkpoint {d}/nowhere does not exist: it is not a model directory"),
    (["train", *RANDOM, "model.init=sft", "model.path={d}/sft_run/model/sub"],
     "config field model.path: {d}/sft_run/model/sub does not exist: it is not a model "
     "directory"),
    (["train", *RANDOM, "model.init=hf", "model.path={d}"],
     "config field model.path: {d} has no config.json: it is not a model directory"),
])
def test_bad_input_is_one_sentence_rc_2(tmp_path, capsys, monkeypatch, argv, says):
    d = _files(tmp_path)
    _no_model_built(monkeypatch)
    monkeypatch.setattr(startup, "build_sharding", lambda cfg: 1 / 0)
    argv = [a.replace("{d}", str(d)) for a in argv]
    assert cli.main(argv) == 2
    err = _err(capsys)
    assert len(err.splitlines()) == 1 and err.startswith(f"erpo {argv[0]}: ")
    assert says.replace("{d}", str(d)) in err


# ----------------------------------------------------------------------------- 10. the CLI


def test_overrides_are_accepted_anywhere_on_the_line(tmp_path, capsys):
    args = cli._parse(["eval", "--config", "F", "--checkpoint", "D", "train.eval_n=2", "--cpu",
                       "train.eval_k=1,2", "--out", "O", "rollout.top_k=3"])
    assert args.overrides == ["train.eval_n=2", "train.eval_k=1,2", "rollout.top_k=3"]
    assert (args.config, args.checkpoint, args.cpu, args.out) == ("F", "D", True, "O")
    # Applied in order, after --config: the last group's field is the one refused.
    cfg = _files(tmp_path) / "no_cpu.py"
    assert cli.main(["train", "train.steps=3", "--config", str(cfg),
                     "train.eval_max_problems=0"]) == 2
    assert "config field train.eval_max_problems" in _err(capsys)
    with pytest.raises(SystemExit):   # a stray flag is still argparse's error
        cli._parse(["train", "--config", "F", "a.b=1", "--nope"])


def test_the_unread_fields_are_removed_and_old_config_files_still_load(tmp_path, capsys):
    """train.log_every and train.samples_per_eval were read by nothing: removed. A
    config.json written with them loads (they are dropped), a resume is not refused
    over them, and an override of one is refused naming it."""
    from erpo_jax.train.config import (REMOVED_FIELDS, RunConfig, TrainSection, config_dict,
                                       load_config, normalized)
    names = {f.name for f in dataclasses.fields(TrainSection)}
    assert "log_every" not in names and "samples_per_eval" not in names
    assert set(REMOVED_FIELDS) == {"train.log_every", "train.samples_per_eval"}
    old = config_dict(RunConfig())
    old["train"].update(log_every=5, samples_per_eval=8)
    (tmp_path / "config.json").write_text(json.dumps(old))
    assert load_config(str(tmp_path / "config.json")) == RunConfig()
    assert normalized(old) == config_dict(RunConfig())
    (tmp_path / "checkpoints" / "2").mkdir(parents=True)
    rundir.record_config(tmp_path, config_dict(RunConfig()), normalized, resuming=True,
                         allow_change=False, start_step=2)   # not refused
    assert cli.main(["train", *RANDOM, "train.log_every=5"]) == 2
    err = _err(capsys)
    assert len(err.splitlines()) == 1 and "config field train.log_every: was removed" in err


def test_deleting_config_json_does_not_bypass_the_config_guard(tmp_path):
    """With config.json gone, the last start in config_history.jsonl is what a
    resumed run's config is checked against."""
    from erpo_jax.train.config import config_dict, load_config, normalized
    old = config_dict(load_config(None, ["optim.lr=5e-5"]))
    new = config_dict(load_config(None, ["optim.lr=0.5"]))
    rundir.record_config(tmp_path, old, normalized, resuming=False, allow_change=False,
                         start_step=0)
    (tmp_path / "config.json").unlink()
    with pytest.raises(ValueError, match=r"config field train.allow_config_change: .*"
                                         r"optim.lr: 5e-05 -> 0.5.*config_history.jsonl"):
        rundir.record_config(tmp_path, new, normalized, resuming=True, allow_change=False,
                             start_step=3)
    assert not (tmp_path / "config.json").exists()
    rundir.record_config(tmp_path, old, normalized, resuming=True, allow_change=False,
                         start_step=3)   # the same config resumes
    assert rundir.read_json(tmp_path / "config.json") == old


def test_recorded_row_counts_in_config_json_neither_block_a_resume_nor_loading(tmp_path):
    """config.json's data_rows (what a start trained on and held out) is a
    record, not a field: the same config resumes against it, and the file
    loads as a config (erpo train --config runs/x/config.json)."""
    from erpo_jax.train.config import ConfigError, config_dict, load_config, normalized
    cfg = config_dict(load_config(None, ["optim.lr=5e-5"]))
    rows = {"train": 92, "held_out": {"drift (data.n_drift)": 8}, "dropped": {},
            "eval": {}}
    record = rundir.check_config(tmp_path, cfg, normalized, resuming=False, allow_change=False,
                                 start_step=0)
    rundir.write_config(record, {"data_rows": rows})
    saved = rundir.read_json(tmp_path / "config.json")
    assert saved["data_rows"] == rows
    assert rundir.read_jsonl(tmp_path / "config_history.jsonl")[-1]["config"]["data_rows"] == rows
    again = rundir.check_config(tmp_path, cfg, normalized, resuming=True, allow_change=False,
                                start_step=4)
    assert again.changed == ()
    assert config_dict(load_config(str(tmp_path / "config.json"))) == cfg
    (tmp_path / "bad.json").write_text(json.dumps({**cfg, "data_rowz": rows}))
    with pytest.raises(ConfigError, match="data_rowz"):   # only the recorded keys are skipped
        load_config(str(tmp_path / "bad.json"))


@pytest.mark.parametrize("command", ["train", "sft"])
def test_a_failed_start_leaves_no_new_config_json(tmp_path, capsys, monkeypatch, command):
    """A start that fails after the config check (here: the policy does not load)
    leaves config.json and config_history.jsonl as they were: none, or the last
    start's."""

    def broken(*a, **k):
        raise ValueError("model.path: the policy does not load (test)")
    monkeypatch.setattr(startup, "load_policy", broken)
    run = tmp_path / "run"
    assert cli.main([command, *RANDOM, f"train.out_dir={run}"]) == 1
    assert "the policy does not load" in _err(capsys)
    assert not (run / "config.json").exists()
    assert not (run / "config_history.jsonl").exists()
    # A run whose last start recorded its config keeps it through a failed start
    # with another config.
    before = {}
    for name, text in (("config.json", '{"train": {"steps": 1}}'),
                       ("config_history.jsonl", '{"config": {"train": {"steps": 1}}}\n')):
        (run / name).write_text(text)
        before[name] = text
    assert cli.main([command, *RANDOM, f"train.out_dir={run}", "train.steps=7"]) == 1
    assert {n: (run / n).read_text() for n in before} == before


def test_train_help_says_where_every_field_is_and_config_show_lists_them(tmp_path, capsys):
    """`erpo train --help` names `erpo config --show`, which prints every field of the
    resolved config (file, overrides, method) with its value and, where the source
    documents it, its doc."""
    from erpo_jax.train.config import RunConfig, config_dict
    for command in ("train", "sft", "eval"):
        with pytest.raises(SystemExit) as e:
            cli.main([command, "--help"])
        assert e.value.code == 0
        assert "erpo config --show" in " ".join(capsys.readouterr().out.split()), command
    cfg = _files(tmp_path) / "no_cpu.py"
    assert cli.main(["config", "--show", "--config", str(cfg), "train.steps=3",
                     "algo.method=erpo"]) == 0
    out = capsys.readouterr().out.splitlines()
    shown = {x.split(" = ")[0]: x for x in out if not x.startswith("#")}

    def leaves(d, prefix=""):
        for k, v in d.items():
            yield from leaves(v, f"{prefix}{k}.") if isinstance(v, dict) else [f"{prefix}{k}"]
    assert set(shown) == set(leaves(config_dict(RunConfig())))
    assert shown["train.steps"] == "train.steps = 3"
    assert shown["loss.beta_query"].startswith("loss.beta_query = 0.1   # Query-KL coefficient")
    assert "# verifier processes." in shown["reward.workers"]                    # a docstring
    assert "# passes over each rollout" in shown["optim.epochs"]                # a comment
    assert "(resolves to 'static')" in shown["rollout.engine"]
    assert cli.main(["config", "--show", "train.stepz=3"]) == 2
    assert "config field train.stepz" in _err(capsys)


# ----------------------------------------------------------------------------- issue 49


def _tree(d):
    """Every file under `d` with its bytes."""
    return {str(p.relative_to(d)): p.read_bytes() for p in sorted(d.rglob("*")) if p.is_file()}


def _one_sentence(capsys, command) -> str:
    err = _err(capsys)
    assert len(err.splitlines()) == 1 and err.startswith(f"erpo {command}: "), err
    assert "Errno" not in err, err
    return err


def _fake_outputs(tmp_path):
    """A demo (its marker and one run), a legacy demo (SUMMARY.md), a report, a
    training run and a file, as the commands leave them."""
    from erpo_jax.tools import demo
    outs = {}
    d = tmp_path / "demo"
    _fake_run(d / "erpo")   # a --quick demo's run: 2 steps from the shipped reference
    (d / "erpo" / "config.json").write_text(json.dumps(
        {"name": "erpo", "train": {"steps": 2}, "model": {"path": str(demo.REFERENCE)}}))
    (d / "erpo_output.json").write_text(json.dumps(
        {"kind": "demo", "settings": {"quick": True, "reference": str(demo.REFERENCE)}}))
    (d / "SUMMARY.md").write_text("# erpo-jax CPU demo\n")
    (d / "eval_average.png").write_bytes(b"\x89PNG demo")
    outs["demo"] = d
    old = tmp_path / "old_demo"
    old.mkdir()
    (old / "SUMMARY.md").write_text("# erpo-jax CPU demo\n")
    outs["old_demo"] = old
    r = tmp_path / "report"
    r.mkdir()
    (r / "REPORT.md").write_text("# Report\n")
    (r / "eval_average.png").write_bytes(b"\x89PNG report")
    outs["report"] = r
    _fake_run(tmp_path / "run")
    outs["run"] = tmp_path / "run"
    (tmp_path / "file").write_text("x")
    outs["file"] = tmp_path / "file"
    return outs


def test_report_and_demo_refuse_another_things_directory_and_a_file(tmp_path, capsys,
                                                                    monkeypatch):
    """Issue 49 items 4 and 8: `erpo report --out DIR` where DIR held a demo replaced
    its PNGs; `erpo demo --out DIR` wrote into a training run; `erpo demo --out
    FILE` printed a raw errno naming a subpath. Each is refused in one sentence
    naming what is there and the way out, before anything is written (rc 2);
    --force writes over another kind of output, never over a training run."""
    _no_model_built(monkeypatch)
    monkeypatch.setattr(loop, "train", lambda *a, **k: 1 / 0)   # the demo must not start
    outs = _fake_outputs(tmp_path)
    src = tmp_path / "src" / "seed0"
    _fake_run(src)
    (src / "evals.jsonl").write_text(json.dumps({"step": 0, "sets": {},
                                                 "average": {"greedy_acc": 0.1}}) + "\n")
    before = {k: _tree(v) if v.is_dir() else v.read_bytes() for k, v in outs.items()}
    for kind, says in (("demo", "holds a demo (erpo demo); give another --out, or pass --force"),
                       ("old_demo", "holds a demo (erpo demo)"),
                       ("run", "is a training run's directory, and a report (erpo report) "
                               "never writes into a run; give another --out"),
                       ("file", "is a file, not a directory; give another --out")):
        assert cli.main(["report", str(src), "--out", str(outs[kind])]) == 2, kind
        assert f"--out {outs[kind]} {says}" in _one_sentence(capsys, "report")
    for kind, says in (("report", "holds a report (erpo report); give another --out, or pass "
                                  "--force"),
                       ("run", "is a training run's directory, and a demo (erpo demo) never "
                               "writes into a run"),
                       ("file", "is a file, not a directory; give another --out")):
        assert cli.main(["demo", "--quick", "--out", str(outs[kind])]) == 2, kind
        assert f"--out {outs[kind]} {says}" in _one_sentence(capsys, "demo")
    assert cli.main(["demo", "--quick", "--out", str(outs["run"]), "--force"]) == 2
    _one_sentence(capsys, "demo")
    now = {k: _tree(v) if v.is_dir() else v.read_bytes() for k, v in outs.items()}
    assert now == before
    # Where overwriting is what the user means.
    assert cli.main(["report", str(src), "--out", str(outs["demo"]), "--force"]) == 0
    assert (outs["demo"] / "REPORT.md").is_file()
    capsys.readouterr()


def test_a_demo_after_a_quick_demo_names_what_demo_takes(tmp_path, capsys, monkeypatch):
    """Issue 49 item 8: `erpo demo --out DIR` after a `--quick` demo there told the
    user to set train.allow_config_change or train.out_dir, which `erpo demo`
    does not take. Refused before any run starts, naming the demo there and
    what demo takes; the same demo again is reused; --force starts it over."""
    import shutil

    from erpo_jax.tools import demo
    ran = []
    monkeypatch.setattr(loop, "train", lambda cfg, **k: ran.append(cfg) or 1 / 0)
    outs = _fake_outputs(tmp_path)
    d = outs["demo"]
    before = _tree(d)
    assert cli.main(["demo", "--out", str(d)]) == 2
    err = _one_sentence(capsys, "demo")
    assert f"--out {d} holds a --quick demo, and this is a full demo; give another --out, " \
           "or pass --force to replace it (erpo demo takes --out DIR, --quick, " \
           "--rebuild-reference and --force)" in err
    assert "allow_config_change" not in err and "train.out_dir" not in err
    assert not ran and _tree(d) == before
    # A demo written before the marker: its runs' config.json say what it was.
    old = tmp_path / "legacy"
    shutil.copytree(d, old)
    (old / "erpo_output.json").unlink()
    assert cli.main(["demo", "--out", str(old)]) == 2
    assert "holds a --quick demo, and this is a full demo" in _one_sentence(capsys, "demo")
    # The same demo again is what it resumes (the runs start: here, the stub fails).
    with pytest.raises(ZeroDivisionError):
        cli.main(["demo", "--quick", "--out", str(d)])
    assert len(ran) == 1 and ran[0].train.out_dir == str(d / demo.METHODS[0])
    # --force: the old demo's runs are deleted, the new demo recorded.
    with pytest.raises(ZeroDivisionError):
        cli.main(["demo", "--out", str(d), "--force"])
    assert not (d / "erpo").exists()
    assert json.loads((d / "erpo_output.json").read_text())["settings"]["quick"] is False


def test_eval_refuses_an_out_holding_other_settings_or_another_thing(sft_model, tmp_path,
                                                                     capsys, monkeypatch):
    """Issue 49 item 4: `erpo eval ... --out DIR`, where DIR held an eval made with
    other settings (eval_n=4), replaced its pass@k results with greedy-only ones.
    Refused naming the settings that differ (rc 2), as are a demo's and a
    report's directories; --force replaces the evaluation."""
    from erpo_jax.train.config import load_config
    out = tmp_path / "eval"
    four = load_config(None, [*TINY, "train.eval_n=4", "train.eval_k=1,4"])
    held = {"model": str(sft_model), "settings": cli._eval_settings(four)}
    out.mkdir()
    rundir.write_json(out / "eval_config.json", held)
    (out / "evals.jsonl").write_text(json.dumps({"step": 0, "average": {"pass@4": 0.5}}) + "\n")
    before = _tree(out)
    outs = _fake_outputs(tmp_path)
    base = ["eval", "--checkpoint", str(sft_model), *TINY]
    assert cli.main([*base, "--out", str(out)]) == 2
    err = _one_sentence(capsys, "eval")
    assert f"--out {out} holds an evaluation (erpo eval) made with other settings (" in err
    assert "eval_k: [1, 4] -> [1]" in err and "eval_n: 4 -> 1" in err
    assert "give another --out, or pass --force to replace it" in err
    assert _tree(out) == before
    for kind in ("demo", "report"):
        assert cli.main([*base, "--out", str(outs[kind])]) == 2
        assert f"--out {outs[kind]} holds a {kind} (erpo {kind})" in _one_sentence(capsys,
                                                                                   "eval")
    assert cli.main([*base, "--out", str(out), "--force"]) == 0
    capsys.readouterr()
    assert rundir.read_json(out / "eval_config.json")["settings"]["eval_n"] == 1
    assert [r["step"] for r in rundir.read_jsonl(out / "evals.jsonl")] == [0]
    assert "pass@4" not in rundir.read_jsonl(out / "evals.jsonl")[0]["average"]
    # The same settings again: reused, no --force needed.
    assert cli.main([*base, "--out", str(out)]) == 0
    capsys.readouterr()


def test_plan_refuses_an_infinite_length_distribution(capsys):
    """Issue 49 item 8: `erpo plan --lengths lognormal:800:inf` was accepted and
    estimated from degenerate lengths. Refused in one sentence, rc 2."""
    from erpo_jax.tools import plan
    from erpo_jax.train.config import ConfigError
    for spec in ("lognormal:800:inf", "lognormal:inf:0.8", "lognormal:800:1e400"):
        with pytest.raises(ConfigError, match=r"is no length distribution: .*finite"):
            plan.sample_lengths(spec, 4, 8)
    assert plan.sample_lengths("lognormal:800:0.8", 4, 2000).min() >= 1
    if plan.libtpu_missing():
        pytest.skip(plan.libtpu_missing())
    assert cli.main(["plan", "--topology", "v5e-4", "--lengths", "lognormal:800:inf",
                     "model.init=random", "model.preset=tiny"]) == 2
    got = capsys.readouterr()
    assert got.out == "" and len(got.err.strip().splitlines()) == 1
    assert got.err.startswith("erpo plan: --lengths 'lognormal:800:inf' is no length "
                              "distribution")


def test_a_relative_model_path_outside_the_repo_names_model_path(tmp_path, capsys,
                                                                 monkeypatch):
    """Issue 49 item 8: `main_comparison --cpu` run outside the repo said
    'runs/sft-arith/model: no config.json' without naming model.path, after
    building the mesh. Refused first, naming the field and where a relative
    path is read from."""
    import pathlib
    exp = pathlib.Path(__file__).resolve().parents[1] / "experiments" / "main_comparison.py"
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(startup, "build_sharding", lambda cfg: 1 / 0)
    assert cli.main(["train", "--config", str(exp), "--cpu"]) == 2
    err = _one_sentence(capsys, "train")
    assert err.startswith("erpo train: config field model.path: runs/sft-arith/model does "
                          f"not exist, read from the current directory {tmp_path}")
    assert list(tmp_path.iterdir()) == []
