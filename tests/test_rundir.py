"""Run-directory files: torn last lines, atomic rewrites, each step once, the
config check on resume, and the same code on a gs:// path (epath's mock backend
mapping gs:// onto a temporary directory)."""

import contextlib
import json
import os
import warnings

import numpy as np
import pytest

from erpo_jax.runtime import rundir
from erpo_jax.tools import report, sweep
from erpo_jax.train.config import RunConfig, config_dict, load_config, normalized
from erpo_jax.train.evaluate import keep_evals, write_eval
from erpo_jax.train.metrics import MetricsWriter, read_metrics

TORN = '{"step": 3, "reward_mean": 0.'   # a row cut by a crash or a full disk


def _metrics(run_dir, steps, torn=True):
    run_dir.mkdir(parents=True, exist_ok=True)
    text = "".join(json.dumps({"step": s, "reward_mean": s / 10}) + "\n" for s in steps)
    (run_dir / "metrics.jsonl").write_text(text + (TORN if torn else ""))


def test_readers_skip_a_torn_last_line_and_say_so(tmp_path):
    _metrics(tmp_path, [1, 2])
    with pytest.warns(UserWarning, match="torn last line"):
        assert [r["step"] for r in read_metrics(tmp_path)] == [1, 2]
    (tmp_path / "config.json").write_text(json.dumps(config_dict(RunConfig())))
    with pytest.warns(UserWarning, match="torn last line"):
        assert [r["step"] for r in report.load_run(tmp_path)["metrics"]] == [1, 2]
    # A bad line that is not the last is corruption, not an interrupted write.
    (tmp_path / "metrics.jsonl").write_text(TORN + "\n" + json.dumps({"step": 1}) + "\n")
    with pytest.raises(ValueError, match="line 1 of .*metrics.jsonl is not JSON"):
        read_metrics(tmp_path)


def test_truncate_after_drops_the_torn_line_and_the_redone_steps(tmp_path):
    _metrics(tmp_path, [1, 2, 1, 2, 3])   # a restart that appended to the old file
    with pytest.warns(UserWarning, match="torn"):
        MetricsWriter(tmp_path, tensorboard=False).truncate_after(2)
    rows = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2]
    assert not [p for p in os.listdir(tmp_path) if ".tmp" in p]


def test_an_interrupted_rewrite_leaves_the_old_file(tmp_path, monkeypatch):
    _metrics(tmp_path, [1, 2, 3], torn=False)
    before = (tmp_path / "metrics.jsonl").read_bytes()

    def crash(*a):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(rundir.os, "replace", crash)
    with pytest.raises(OSError):
        MetricsWriter(tmp_path, tensorboard=False).truncate_after(1)
    assert (tmp_path / "metrics.jsonl").read_bytes() == before
    assert sorted(os.listdir(tmp_path)) == ["metrics.jsonl"]   # no temp file left behind


def test_a_failed_append_leaves_no_partial_row(tmp_path, monkeypatch):
    _metrics(tmp_path, [1], torn=False)
    before = (tmp_path / "metrics.jsonl").read_bytes()
    real_open = open

    class Full:
        def __init__(self, f):
            self.f = f

        def __getattr__(self, k):
            return getattr(self.f, k)

        def __enter__(self):
            return self

        def __exit__(self, *a):
            self.f.close()

        def write(self, data):   # half the row reaches the disk, then ENOSPC
            self.f.write(data[:len(data) // 2])
            self.f.flush()
            raise OSError(28, "No space left on device")

    monkeypatch.setattr("builtins.open", lambda p, m="r", *a, **k: Full(real_open(p, m, *a, **k))
                        if "a" in m else real_open(p, m, *a, **k))
    with pytest.raises(OSError, match="No space"):
        MetricsWriter(tmp_path, tensorboard=False).write(2, {"reward_mean": 0.5})
    monkeypatch.undo()
    assert (tmp_path / "metrics.jsonl").read_bytes() == before


def test_keep_evals_holds_each_step_once(tmp_path):
    for step in (0, 6, 6, 12):
        write_eval(tmp_path, {"step": step, "sets": {}, "average": {"greedy_acc": step}})
    keep_evals(tmp_path, lambda s: s <= 6)
    rows = rundir.read_jsonl(tmp_path / "evals.jsonl")
    assert [r["step"] for r in rows] == [0, 6]
    assert sorted(p.name for p in tmp_path.glob("eval_*.json")) == ["eval_000000.json",
                                                                      "eval_000006.json"]


def test_a_resumed_config_change_is_refused_with_the_fields(tmp_path):
    old = config_dict(load_config(None, ["optim.lr=5e-5", "rollout.group_size=4"]))
    new = config_dict(load_config(None, ["optim.lr=0.5", "rollout.group_size=4",
                                         "train.progress=false"]))
    rundir.record_config(tmp_path, old, normalized, resuming=False, allow_change=False,
                         start_step=0)
    with pytest.raises(ValueError, match=r"config field train.allow_config_change: .* step 3 "
                                         r".*optim.lr: 5e-05 -> 0.5"):
        rundir.record_config(tmp_path, new, normalized, resuming=True, allow_change=False,
                             start_step=3)
    assert rundir.read_json(tmp_path / "config.json")["optim"]["lr"] == 5e-5   # untouched
    rundir.record_config(tmp_path, new, normalized, resuming=True, allow_change=True,
                         start_step=3)
    hist = rundir.read_jsonl(tmp_path / "config_history.jsonl")
    assert [h["changed"] for h in hist] == [[], ["optim.lr"]]   # train.progress is cosmetic
    assert hist[1]["start_step"] == 3 and hist[1]["config"]["optim"]["lr"] == 0.5


@contextlib.contextmanager
def fake_gcs(root):
    """gs://<bucket>/... read and written under `root` through epath's mock backend."""
    from etils.epath import testing

    def local(p):
        p = os.fspath(p)
        return os.path.join(root, p[len("gs://"):]) if p.startswith("gs://") else p

    def one(fn):
        return lambda orig, p, *a, **k: orig(local(p), *a, **k)

    def two(fn):
        return lambda orig, p, dst, *a, **k: orig(local(p), local(dst), *a, **k)

    def glob(orig, pattern):
        return ["gs://" + os.path.relpath(x, root) for x in orig(local(pattern))]

    with testing.mock_epath(open=one(open), exists=one(0), isdir=one(0), listdir=one(0),
                            makedirs=one(0), mkdir=one(0), remove=one(0), rmtree=one(0),
                            stat=one(0), walk=one(0), glob=glob, rename=two(0),
                            replace=two(0), copy=two(0)):
        yield


def test_run_directory_io_on_gs(tmp_path):
    """Config, metrics, evals, the config check, the report, the reference cache
    and the sweep's skip/resume check, on gs:// paths (a fake bucket here)."""
    from erpo_jax.rl import reference as ref_lib
    root = tmp_path / "bucket-root"
    run = "gs://bucket/exp/grpo/seed0"
    with fake_gcs(str(root)):
        cfg = load_config(None, [f"train.out_dir={run}", "train.steps=2", "train.eval_every=2",
                                 "train.tensorboard=false"])
        rundir.record_config(run, config_dict(cfg), normalized, resuming=False,
                             allow_change=False, start_step=0)
        w = MetricsWriter(run, tensorboard=False)
        for s in (1, 2, 3):
            w.write(s, {"reward_mean": s / 4, "accuracy": 0.5})
        w.truncate_after(2)
        for s in (0, 2):
            write_eval(run, {"step": s, "sets": {"a": {"greedy_acc": 0.5}},
                             "average": {"greedy_acc": 0.5}})
        assert [r["step"] for r in read_metrics(run)] == [1, 2]
        assert sweep.is_finished(run)
        st = sweep.status(sweep.Run("exp", "grpo", 0, cfg))
        assert st == ("done", "")
        changed = sweep.status(sweep.Run("exp", "grpo", 0, load_config(
            None, [f"train.out_dir={run}", "train.steps=3", "train.eval_every=2",
                   "train.tensorboard=false"])))
        assert changed[0] == "stale" and "train.steps" in changed[1]
        assert [r["name"] for r in map(report.load_run, report.expand_run_dirs(
            ["gs://bucket/exp"]))] == ["run"]
        out = report.write_report([run], "gs://bucket/exp/report")
        assert str(out) == "gs://bucket/exp/report/REPORT.md"
        # The reference cache: written once, then read back instead of recomputed.
        import jax
        from erpo_jax.model import model as M
        from erpo_jax.model.config import ModelConfig
        mcfg = ModelConfig()
        params = M.init_params(mcfg, jax.random.key(0))
        kw = dict(tokenizer_id="t", template="plain", batch_size=4, pad_id=0)
        queries = [[5, 6, 7], [8, 9]]
        a, computed = ref_lib.load_or_compute(params, mcfg, queries, "gs://bucket/.refcache", **kw)
        b, again = ref_lib.load_or_compute(params, mcfg, queries, "gs://bucket/.refcache", **kw)
        assert computed and not again
        np.testing.assert_array_equal(a.logp, b.logp)
    # Everything landed in the bucket, nothing in the working directory.
    files = {os.path.relpath(os.path.join(d, f), root) for d, _, fs in os.walk(root) for f in fs}
    for name in ("config.json", "config_history.jsonl", "metrics.jsonl", "evals.jsonl",
                 "eval_000002.json"):
        assert f"bucket/exp/grpo/seed0/{name}" in files, name
    assert "bucket/exp/report/REPORT.md" in files
    assert any(f.startswith("bucket/.refcache/refpass-") for f in files)
    assert not os.path.exists("gs:")


def test_local_only_parts_are_refused_up_front_on_gs():
    from erpo_jax.train.config import validate
    with pytest.raises(ValueError, match="config field train.tensorboard"):
        validate(load_config(None, ["train.out_dir=gs://b/run"]))
    with pytest.raises(ValueError, match="config field model.path: gs://b/m"):
        validate(load_config(None, ["train.out_dir=gs://b/run", "train.tensorboard=false",
                                    "model.init=hf", "model.path=gs://b/m"]))
    with pytest.raises(ValueError, match="--runs-root gs://b: the sweep"):
        sweep.run_sweep([], runs_root="gs://b")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        validate(load_config(None, ["train.out_dir=gs://b/run", "train.tensorboard=false"]))
