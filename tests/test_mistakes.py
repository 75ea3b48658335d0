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
