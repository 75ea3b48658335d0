"""Issue 49, items 1-3: every config change a resume admits either resumes by
its stated rule (train/resume.py) or is refused in one sentence with the run
directory byte for byte as it was; dynamic sampling on and off across a
resume continues from the data iterator's position; engine-only changes
resume without train.allow_config_change and are recorded."""

import json
import shutil

import pytest

from erpo_jax.train.config import ConfigError, load_config
from erpo_jax.train.loop import train
from tiny_runs import rl_args

ALLOW = "train.allow_config_change=true"


def _files(run):
    return {p.relative_to(run).as_posix(): p.read_bytes() for p in sorted(run.rglob("*"))
            if p.is_file() and p.name != "run.lock"}


def _rows(run):
    return {r["step"]: r for r in map(json.loads, (run / "metrics.jsonl").read_text()
                                      .splitlines())}


def _history(run):
    return [json.loads(x) for x in (run / "config_history.jsonl").read_text().splitlines()]


def _position(run, step):
    from erpo_jax.train.checkpoint import Checkpointer
    ck = Checkpointer(run / "checkpoints")
    try:
        return ck.meta(step)["data"]["step"]
    finally:
        ck.close()


@pytest.fixture(scope="module")
def base_run(sft_model, tmp_path_factory):
    """Two steps of GRPO + Policy-KL (beta 0.04) with a checkpoint at each step."""
    root = tmp_path_factory.mktemp("resume")
    run = root / "base"
    args = ["loss.beta_policy=0.04", "train.ckpt_every=1", "train.keep_checkpoints=5"]
    assert train(load_config(None, rl_args(sft_model, run, "train.steps=2", *args)))[
        "status"] == "done"
    return sft_model, root, run, args


def _resume(base_run, name, steps, *change, src=None):
    sft_model, root, run, args = base_run
    dst = root / name
    shutil.copytree(src or run, dst)
    cfg = load_config(None, rl_args(sft_model, dst, f"train.steps={steps}", *args, *change))
    return dst, cfg


def test_adaptive_kl_added_removed_and_reset_on_resume(base_run):
    run, cfg = _resume(base_run, "kl_on", 3, ALLOW, "loss.kl_target=0.01",
                       "loss.kl_horizon=16")
    assert train(cfg)["status"] == "done"
    rows = _rows(run)
    assert rows[3]["kl_coef"] == pytest.approx(0.04)     # starts from beta_policy
    assert rows[3]["kl_coef_next"] != rows[3]["kl_coef"]
    assert "loss.kl_target" in _history(run)[-1]["changed"]
    # From that adaptive run: beta_policy changed -> the controller restarts from it.
    reset, cfg = _resume(base_run, "kl_reset", 4, ALLOW, "loss.kl_target=0.01",
                         "loss.kl_horizon=16", "loss.beta_policy=0.1", src=run)
    assert train(cfg)["status"] == "done"
    assert _rows(reset)[4]["kl_coef"] == pytest.approx(0.1)
    # And removed: Policy-KL fixed, no coefficient in the state or the metrics.
    off, cfg = _resume(base_run, "kl_off", 4, ALLOW, src=run)
    assert train(cfg)["status"] == "done"
    assert "kl_coef" not in _rows(off)[4] and _rows(off)[4]["term_policy_kl"] > 0


def test_dynamic_sampling_on_and_off_across_a_resume_never_repeats_a_batch(base_run):
    on, cfg = _resume(base_run, "filter_on", 3, ALLOW, "algo.filter_groups=true",
                      "algo.filter_on_short=pad", "algo.filter_max_batches=3")
    assert train(cfg)["status"] == "done"
    drawn = int(_rows(on)[3]["filter/batches"])
    assert _position(on, 2) == 2 and _position(on, 3) == 2 + drawn
    off, cfg = _resume(base_run, "filter_off", 4, ALLOW, src=on)
    assert train(cfg)["status"] == "done"
    assert _position(off, 4) == 2 + drawn + 1   # not step 4's own position


@pytest.mark.parametrize("change", [("loss.pg_loss=clip_cov", "loss.clip_cov_ratio=0.05"),
                                    ("loss.pg_loss=kl_cov",)])
def test_a_policy_loss_change_resumes(base_run, change):
    run, cfg = _resume(base_run, change[0].split("=")[1], 3, ALLOW, *change)
    assert train(cfg)["status"] == "done"
    assert "cov_selected_frac" in _rows(run)[3]


def test_adding_a_critic_is_refused_with_the_run_untouched(base_run):
    run, cfg = _resume(base_run, "critic", 3, ALLOW, "algo.advantage=gae")
    before = _files(run)
    with pytest.raises(ConfigError, match=r"algo.advantage: the checkpoint .* holds no critic"):
        train(cfg)
    assert _files(run) == before


@pytest.mark.parametrize("change", [("rollout.engine=static",),
                                    ("rollout.engine=continuous", "rollout.slots=16",
                                     "rollout.refill=2")])
def test_engine_changes_resume_without_allow_config_change_and_are_recorded(base_run, change):
    # Resumed from step 1 (its step-2 checkpoint removed): train.steps stays as it was.
    run, cfg = _resume(base_run, "engine_" + str(len(change)), 2, *change)
    shutil.rmtree(run / "checkpoints" / "2")
    assert train(cfg)["status"] == "done"
    assert sorted(_rows(run)) == [1, 2]
    changed = _history(run)[-1]["changed"]
    for c in change:   # recorded, 'auto' -> 'static' too
        assert c.split("=")[0] in changed, (c, changed)
