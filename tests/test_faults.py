"""Faults and bad inputs, as a user meets them: each ends in one sentence and a
documented exit code, and the run directory stays resumable (issue 18)."""

import json
import os
import resource
import signal
import subprocess
import sys

import jax
import numpy as np
import pytest

from erpo_jax.train import startup
from erpo_jax import cli
from erpo_jax.runtime import rundir
from erpo_jax.train.config import load_config
from erpo_jax.train.loop import train

RANDOM = ["model.init=random", "model.preset=tiny", "data.n_train=64", "data.n_test=4",
          "rollout.group_size=2", "rollout.max_new_tokens=8", "train.batch_size=8",
          "train.eval_every=0", "train.drift_every=0", "train.progress=false",
          "train.eval_max_problems=4", "train.drift_queries=4", "optim.lr=1e-3",
          "train.tensorboard=false"]


def _args(out, *extra):
    return [*RANDOM, f"train.out_dir={out}", f"train.ref_cache_dir={out.parent / 'refcache'}",
            *extra]


def _steps(path):
    return [r["step"] for r in rundir.read_jsonl(path)]


def _cli(args, tmp_path, **kw):
    """`erpo <args>` in a fresh process: (rc, stdout, stderr)."""
    env = dict(os.environ, PYTHONPATH=os.getcwd())
    p = subprocess.run([sys.executable, "-m", "erpo_jax.cli", *args], capture_output=True,
                       text=True, env=env, timeout=600, cwd=os.getcwd(), **kw)
    return p.returncode, p.stdout, p.stderr


# ----------------------------------------------------------------------------- bad inputs

BAD_INPUTS = [
    ("mesh.shape=1,8", "mesh.shape"),
    ("train.eval_temperature=0", "train.eval_temperature"),
    ("rollout.top_k=-1", "rollout.top_k"),
    ("rollout.cache_phases=0", "rollout.cache_phases"),
    ("rollout.kv_memory=1.0", "rollout.kv_memory"),
    ("rollout.kv_memory=0.3 rollout.kv_pages=64", "rollout.kv_memory"),   # names both
    ("optim.lr=inf", "optim.lr"),
    ("optim.lr=nan", "optim.lr"),
    ("loss.beta_query=nan", "loss.beta_query"),
    ("optim.b1=1.0", "optim.b1"),
    ("optim.b2=-0.1", "optim.b2"),
    ("optim.max_grad_norm=-1", "optim.max_grad_norm"),
    ("optim.warmup_steps=-5", "optim.warmup_steps"),
    ("train.keep_checkpoints=0", "train.keep_checkpoints"),
    ("train.drift_every=2 train.drift_queries=0", "train.drift_queries"),
    ("algo.weight_tau=nan", "algo.weight_tau"),
    # Count fields (issue 36): 0 or -1 is refused, not a silent slice or a Sampler error.
    ("train.eval_max_problems=-1", "train.eval_max_problems"),
    ("train.eval_max_problems=0", "train.eval_max_problems"),
    ("model.logprob_chunk=0", "model.logprob_chunk"),
    ("train.ref_batch_size=0", "train.ref_batch_size"),
    ("data.n_train=0", "data.n_train"),
    ("data.n_test=0", "data.n_test"),
    ("train.seed=-1", "train.seed"),
    ("data.seed=-1", "data.seed"),
    ("data.n_drift=-1", "data.n_drift"),
    ("data.n_drift=4", "data.n_drift"),   # the arithmetic task holds no training rows out
    ("model.param_dtype=float13", "model.param_dtype"),
    ("model.compute_dtype=fp8", "model.compute_dtype"),
    ("data.eval_benchmarks=gsm8k,nope", "data.eval_benchmarks"),
    # The stability techniques (issue 35).
    ("loss.pg_loss=cispo", "loss.pg_loss"),
    ("loss.pg_loss=kl_cov loss.kl_cov_ratio=0", "loss.kl_cov_ratio"),
    ("loss.pg_loss=clip_cov loss.clip_cov_ub=0.5", "loss.clip_cov_lb"),   # names both
    ("loss.kl_target=0.01", "loss.kl_target"),   # adapts beta_policy, which is 0
    ("algo.advantage=dr_grpo rollout.group_size=1 algo.filter_groups=true", "algo.filter_groups"),
    ("algo.filter_max_batches=-1", "algo.filter_max_batches"),   # 0 = no cap
    ("algo.filter_on_short=drop", "algo.filter_on_short"),
    ("loss.kl_horizon=0", "loss.kl_horizon"),
    ("algo.overlong_buffer=1000", "algo.overlong_buffer"),
    ("algo.overlong_penalty=-1", "algo.overlong_penalty"),
    # Issue 49 item 8: a model directory that is not there, named before a mesh is built.
    ("model.init=sft model.path=/nonexistent/erpo/model", "model.path"),
]


@pytest.mark.parametrize("override,field", BAD_INPUTS)
def test_bad_input_is_one_line_naming_the_field_rc_2(tmp_path, capsys, override, field,
                                                     monkeypatch):
    built = []
    monkeypatch.setattr(startup, "build_sharding", lambda cfg: built.append(cfg))
    assert cli.main(["train", *_args(tmp_path / "run", *override.split())]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and err.startswith(f"erpo train: config field {field}")
    assert not built, "a mesh was built before the config was validated"
    assert not (tmp_path / "run").exists()


# ----------------------------------------------------------------------------- the run dir


@pytest.fixture(scope="module")
def finished(tmp_path_factory):
    """A random-init run of 4 steps, checkpointed every 2, evaluated every 2."""
    out = tmp_path_factory.mktemp("finished") / "run"
    cfg = load_config(None, _args(out, "train.steps=4", "train.ckpt_every=2",
                                  "train.eval_every=2"))
    assert train(cfg)["status"] == "done"
    return out


def _leaves(run_dir, step):
    import orbax.checkpoint as ocp
    from erpo_jax.train.checkpoint import Checkpointer
    ck = Checkpointer(run_dir / "checkpoints")
    out = ck.manager.restore(step, args=ocp.args.Composite(state=ocp.args.StandardRestore()))
    ck.close()
    return out["state"]


def test_restart_without_a_checkpoint_and_a_kill_during_a_save_hold_each_step_once(
        tmp_path, monkeypatch, finished):
    common = ("train.steps=4", "train.ckpt_every=2", "train.eval_every=2")
    cfg = load_config(None, _args(tmp_path / "run", *common))

    def crash_at(n):
        def on_step(step, row):
            if step == n:
                raise KeyboardInterrupt
        return on_step

    # A crash at step 1: no checkpoint yet, metrics [1] and eval [0] written.
    with pytest.raises(KeyboardInterrupt):
        train(cfg, on_step=crash_at(1))
    assert _steps(tmp_path / "run" / "metrics.jsonl") == [1]
    # A crash inside the save of step 4: checkpoint 2 exists, metrics 1-4 and evals 0, 2, 4.
    from erpo_jax.train import checkpoint as ckpt_lib
    real = ckpt_lib.Checkpointer.save

    def save(self, step, *a, **k):
        if step == 4:
            raise KeyboardInterrupt
        return real(self, step, *a, **k)

    monkeypatch.setattr(ckpt_lib.Checkpointer, "save", save)
    with pytest.raises(KeyboardInterrupt):
        train(cfg)
    monkeypatch.undo()
    assert _steps(tmp_path / "run" / "evals.jsonl") == [0, 2, 4]
    assert train(cfg)["status"] == "done"
    assert _steps(tmp_path / "run" / "metrics.jsonl") == [1, 2, 3, 4]
    assert _steps(tmp_path / "run" / "evals.jsonl") == [0, 2, 4]
    ref = {r["step"]: r for r in rundir.read_jsonl(finished / "metrics.jsonl")}
    for r in rundir.read_jsonl(tmp_path / "run" / "metrics.jsonl"):
        for k, v in r.items():
            if not (k.startswith("time/") or k == "tokens_per_sec"):
                assert ref[r["step"]][k] == v, (r["step"], k)


def test_a_torn_metrics_line_does_not_block_resume(tmp_path, finished, capsys):
    import shutil
    run = tmp_path / "run"
    shutil.copytree(finished, run)
    with open(run / "metrics.jsonl", "a") as f:
        f.write('{"step": 5, "rew')
    args = _args(run, "train.steps=5", "train.ckpt_every=2", "train.eval_every=2",
                 "train.allow_config_change=true")
    with pytest.warns(UserWarning, match="torn last line"):
        assert cli.main(["train", *args]) == 0
    assert _steps(run / "metrics.jsonl") == [1, 2, 3, 4, 5]


def test_resume_with_a_changed_config_is_refused(tmp_path, finished, capsys):
    import shutil
    run = tmp_path / "run"
    shutil.copytree(finished, run)
    base = ("train.steps=4", "train.ckpt_every=2", "train.eval_every=2")
    assert cli.main(["train", *_args(run, *base, "optim.lr=0.5", "rollout.group_size=4")]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1
    assert "optim.lr: 0.001 -> 0.5" in err and "rollout.group_size: 2 -> 4" in err
    assert "train.allow_config_change=true" in err
    assert rundir.read_json(run / "config.json")["optim"]["lr"] == 1e-3


def test_final_policy_is_exported_and_keeps_the_trained_weights(finished):
    from erpo_jax.model.hf import load_hf
    from erpo_jax.train.tasks import load_tokenizer
    model = finished / "model"
    assert (model / "model.safetensors").is_file() and (model / "erpo_tokenizer.json").is_file()
    _, params = load_hf(model)
    trained = _leaves(finished, 4)["params"]
    for a, b in zip(jax.tree_util.tree_leaves(params), jax.tree_util.tree_leaves(trained)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    assert load_tokenizer(model).kind == "char"


def test_rl_from_an_hf_model_exports_a_model_transformers_loads(tmp_path):
    torch = pytest.importorskip("torch")
    import transformers as tf
    from hf_models import build_tiny_hf

    from erpo_jax.model import model as M
    from erpo_jax.model.hf import load_hf
    from erpo_jax.train.tasks import load_tokenizer
    src = tmp_path / "hf"
    build_tiny_hf("qwen2", src)
    load_tokenizer(None).save(src)   # the embedded task's character tokenizer beside it
    out = tmp_path / "run"
    args = [a for a in _args(out, "train.steps=1") if not a.startswith("model.")]
    assert train(load_config(None, [*args, "model.init=hf", f"model.path={src}"]))["status"] \
        == "done"
    exported = tf.AutoModelForCausalLM.from_pretrained(str(out / "model")).float().eval()
    assert type(exported).__name__ == "Qwen2ForCausalLM"
    cfg, params = load_hf(out / "model")
    trained = _leaves(out, 1)["params"]
    for a, b in zip(jax.tree_util.tree_leaves(params), jax.tree_util.tree_leaves(trained)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    toks = np.arange(1, 13, dtype=np.int64)[None]
    with torch.no_grad():
        theirs = exported(input_ids=torch.tensor(toks)).logits.numpy()
    ours, _ = M.forward(trained, cfg, toks.astype(np.int32))
    np.testing.assert_allclose(np.asarray(ours), theirs, atol=1e-4)


def test_corrupt_weights_name_the_tensor(tmp_path, finished, capsys):
    import shutil
    model = tmp_path / "model"
    shutil.copytree(finished / "model", model)
    f = model / "model.safetensors"
    raw = bytearray(f.read_bytes())
    header = int.from_bytes(raw[:8], "little")
    meta = json.loads(raw[8:8 + header])
    name = sorted(k for k in meta if k != "__metadata__")[-1]
    lo, _ = meta[name]["data_offsets"]
    raw[8 + header + lo:8 + header + lo + 16] = b"\xff" * 16   # NaN bit patterns
    f.write_bytes(bytes(raw))
    args = [a for a in _args(tmp_path / "run", "train.steps=1") if not a.startswith("model.")]
    assert cli.main(["train", *args, "model.init=sft", f"model.path={model}"]) == 1
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "non-finite" in err, err
    assert "holds 4 non-finite values" in err


def test_preemption_exits_75_and_prints_the_resume_command(tmp_path, capsys, monkeypatch):
    from erpo_jax.train import metrics
    real = metrics.MetricsWriter.write

    def write(self, step, row):
        out = real(self, step, row)
        if step == 1:
            os.kill(os.getpid(), signal.SIGTERM)
        return out

    monkeypatch.setattr(metrics.MetricsWriter, "write", write)
    monkeypatch.setattr(sys, "argv", ["erpo", "train", "train.steps=3"])
    assert cli.main(["train", *_args(tmp_path / "run", "train.steps=3")]) == 75
    out = capsys.readouterr().out
    assert "saved step 1" in out and "run the same command again: erpo train train.steps=3" in out


def test_progress_bar_shows_the_last_measured_drift(tmp_path, capsys):
    cfg = load_config(None, _args(tmp_path / "run", "train.steps=3", "train.drift_every=2",
                                  "train.progress=true"))
    train(cfg)
    err = capsys.readouterr().err
    assert "drift=" in err and "drift=nan" not in err
    drift = rundir.read_jsonl(tmp_path / "run" / "metrics.jsonl")[1]["drift/qkl_k3"]
    assert f"drift={drift:.4f}" in err.split("3/3")[-1]   # step 3 shows step 2's value


# ----------------------------------------------------------------------------- processes


def test_startup_error_after_the_compile_thread_is_one_sentence(tmp_path, finished):
    """A resume whose checkpoint does not fit (another preset) fails after the
    compile-ahead thread started: rc 1 and a sentence, not an abort (rc 134)."""
    import shutil
    run = tmp_path / "run"
    shutil.copytree(finished, run)
    rc, _, err = _cli(["train", *_args(run, "train.steps=6", "train.ckpt_every=2",
                                       "train.eval_every=2", "model.preset=arith-small",
                                       "train.allow_config_change=true")], tmp_path)
    assert rc == 1, err[-3000:]
    assert "terminate called" not in err and "Traceback" not in err
    assert "the checkpoint of step 4" in err.splitlines()[-1] and "does not fit" in err, \
        err[-3000:]


def _no_big_files():
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)   # a write past the limit gets EFBIG
    resource.setrlimit(resource.RLIMIT_FSIZE, (64 << 10, 64 << 10))


def test_a_failed_checkpoint_save_is_one_sentence(tmp_path):
    """Every file is limited to 64 KiB, as on a disk that fills up: the
    checkpoint (hundreds of KiB) fails to save; the user gets one sentence
    saying what failed, what is intact and how to resume."""
    run = tmp_path / "run"
    # (no compilation cache: its entries would meet the limit first, with a warning)
    rc, _, err = _cli(["train", *_args(run, "train.steps=2", "train.compile_ahead=false",
                                       "train.compile_cache=off")],
                      tmp_path, preexec_fn=_no_big_files)
    assert rc == 1, err[-3000:]
    lines = [x for x in err.splitlines() if x.strip()]
    assert len(lines) <= 3, err[-3000:]
    # Which write meets the limit first depends on how orbax splits its files.
    assert "File too large" in lines[-1], lines[-1]
    assert ("saving the checkpoint of step 2" in lines[-1]
            and "rerunning the same command starts at step 0" in lines[-1]) or (
        "exporting the final policy" in lines[-1] and "rerunning the same command" in lines[-1])
    assert _steps(run / "metrics.jsonl") == [1, 2]


def test_a_library_coroutine_left_unawaited_prints_nothing():
    """A failed save abandons some of orbax's coroutines, and which ones varies
    from run to run (CI once got another one than a failed restore leaves): none
    of them may print a warning under the one-sentence error."""
    code = ("import gc, erpo_jax.train.checkpoint\n"
            "async def _write_some_shard():\n    pass\n"
            "c = _write_some_shard()\ndel c\ngc.collect()\n")
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                       env=dict(os.environ, PYTHONPATH=os.getcwd()), timeout=300)
    assert p.returncode == 0 and p.stderr == "", p.stderr


def test_a_corrupt_latest_checkpoint_falls_back_to_the_newest_intact_one(tmp_path, finished,
                                                                         capsys):
    """A truncated file in the latest checkpoint (issue 36): it is moved aside,
    said so, and the run resumes from the one before, redoing the steps between."""
    import shutil
    run = tmp_path / "run"
    shutil.copytree(finished, run)
    shutil.rmtree(run / "model")
    files = sorted((p for p in (run / "checkpoints" / "4").rglob("*") if p.is_file()),
                   key=lambda p: p.stat().st_size)
    big = files[-1]
    big.write_bytes(big.read_bytes()[:big.stat().st_size // 2])
    capsys.readouterr()
    cfg = load_config(None, _args(run, "train.steps=4", "train.ckpt_every=2",
                                  "train.eval_every=2"))
    seen = []
    assert train(cfg, on_step=lambda s, r: seen.append(s))["status"] == "done"
    out = capsys.readouterr().out
    assert "the checkpoint of step 4" in out and "cannot be restored" in out
    assert "resuming from step 2, the newest intact checkpoint: steps 3-4 are redone" in out
    assert seen == [3, 4] and _steps(run / "metrics.jsonl") == [1, 2, 3, 4]
    assert (run / "broken_checkpoints" / "4").is_dir() and (run / "model").is_dir()
    assert [r["step"] for r in rundir.read_jsonl(run / "evals.jsonl")] == [0, 2, 4]
