"""Issue 17 on the trainer and the CLI, from a tiny SFT checkpoint: the resolved
method in the run header and config.json, the task reward as reward_mean in
reward mode, the bf16 drift floor, and `erpo inspect-grads` on a real batch."""

import json
import shutil

import numpy as np
import pytest

from erpo_jax import cli
from erpo_jax.train.config import load_config, save_config

from tiny_runs import rl_args as _rl

# `sft_model`: the session's tiny SFT checkpoint (conftest.py).


def test_reward_mode_method_header_and_bf16_drift_floor(sft_model, tmp_path, capsys):
    """grpo_policy_kl with the penalty in the reward, bf16 compute: the header and
    config.json name the resolved method; reward_mean is the task reward (binary
    here, so it equals accuracy) and the shaped one is logged apart; every drift
    row carries the floor measured with policy = reference at start-up."""
    out = tmp_path / "run"
    rc = cli.main(["train", *_rl(sft_model, out, "algo.method=grpo_policy_kl",
                                 "loss.policy_kl_mode=reward", "loss.beta_policy=0.5",
                                 "model.compute_dtype=bfloat16", "train.drift_every=1",
                                 "train.steps=2")])
    assert rc == 0
    printed = capsys.readouterr().out
    assert "[erpo] method=grpo_policy_kl, advantage=grpo, policy_kl=0.5 k3 (in the reward), " \
           "query_kl=off, weights=uniform" in printed
    assert "[erpo] drift floor (policy = reference, compute dtype bfloat16)" in printed
    saved = json.loads((out / "config.json").read_text())
    assert saved["algo"]["method"] == "grpo_policy_kl"
    assert saved["algo"]["weight_scheme"] == "uniform" and saved["loss"]["beta_query"] == 0
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    floors = {r["drift/qkl_k3_floor"] for r in rows}
    assert len(floors) == 1 and np.isfinite(floors.pop())
    for r in rows:
        assert r["reward_mean"] == pytest.approx(r["accuracy"], abs=1e-7)
        assert r["reward_shaped_mean"] <= r["reward_mean"] + 1e-7   # k3 >= 0
        assert r["drift/qkl_k3_floor"] >= 0 and "drift/qkl_k1_floor" in r
    # The shaping did act: bf16 sampling and reference log-probs differ.
    assert any(r["reward_shaped_mean"] < r["reward_mean"] for r in rows)


# ----------------------------------------------------------------------------- inspect-grads


def _policy_checkpoint(sft_model, out):
    """A policy that moved away from the reference: the SFT weights plus noise."""
    from erpo_jax.model.hf import export_hf, load_hf
    from erpo_jax.rl.synthetic import perturb
    cfg, params = load_hf(str(sft_model), param_dtype="float32")
    export_hf(perturb(params, 3, 0.3), cfg, out)
    shutil.copy(sft_model / "erpo_tokenizer.json", out / "erpo_tokenizer.json")
    return out


def test_inspect_grads_on_a_real_batch(sft_model, tmp_path, capsys):
    """PPO with Policy-KL in the reward: the tiny SFT model solves nothing, so the
    task rewards are all 0 and only the per-token KL penalty makes the GAE
    advantages (and the PG gradient) non-zero; --unit puts every regulariser in
    the loss at coefficient 1, so all four terms act on a real sampled batch."""
    policy = _policy_checkpoint(sft_model, tmp_path / "policy")
    cfg = load_config(None, _rl(sft_model, tmp_path / "run", "algo.method=custom",
                                "algo.advantage=gae", "loss.beta_policy=0.05",
                                "loss.policy_kl_mode=reward", "loss.beta_query=0.1",
                                "loss.entropy_coef=0.01", "algo.weight_scheme=likelihood",
                                "rollout.temperature=0.8"))
    cfg_file = tmp_path / "config.json"
    save_config(cfg, cfg_file)
    out = tmp_path / "report.json"
    rep = cli.main(["inspect-grads", "--config", str(cfg_file), "--checkpoint", str(policy),
                    "--unit", "--json", str(out)])
    assert rep == 0
    printed = capsys.readouterr().out
    saved = json.loads(out.read_text())
    t = saved["terms"]
    # The exact zeros of the method page, on real sampled responses.
    assert t["query_kl"]["logit_grad_response"] == 0.0
    for name in ("pg", "policy_kl", "entropy"):
        assert t[name]["logit_grad_query"] == 0.0, name
        assert t[name]["logit_grad_response"] > 0, name
    for name in t:
        assert t[name]["logit_grad_other"] == 0.0, name
    assert t["query_kl"]["logit_grad_query"] > 0 and t["query_kl"]["value"] > 0
    # Per-layer norms partition the parameter gradient.
    for name, groups in saved["param_grad_by_layer"].items():
        assert {"embed", "layer_0", "layer_1", "final_norm", "lm_head"} <= set(groups)
        assert sum(v * v for v in groups.values()) == pytest.approx(
            t[name]["param_grad_norm"] ** 2, rel=1e-4)
    assert saved["loss_config"]["beta_query"] == 1.0 and saved["temperature"] == 0.8
    assert "--unit" in saved["source"]["config"] and "gae" in saved["source"]["rewards"]
    src = saved["source"]
    assert str(sft_model) in src["reference"] and "computed now" in src["reference"]
    assert "arithmetic training set" in src["batch"] and "sampled by the checkpoint" in src["batch"]
    assert "SYNTHETIC" not in printed and "|dL/dz| query" in printed and "columns:" in printed
    assert "parameter-gradient norm per layer" in printed and "layer_1" in printed


def test_inspect_grads_at_the_reference_reads_the_run_cache(sft_model, tmp_path):
    """The checkpoint is the reference: Query-KL sits at its floor, and the run's
    cache written by the first call is read by the second."""
    from erpo_jax.train.inspect_grads import inspect_run
    cfg = load_config(None, _rl(sft_model, tmp_path / "run", "algo.method=erpo"))
    first = inspect_run(cfg, str(sft_model))
    assert "computed now" in first["source"]["reference"]
    second = inspect_run(cfg, str(sft_model))
    assert "read from the run's cache" in second["source"]["reference"]
    assert first["loss_config"]["beta_query"] == 0.1     # erpo resolved
    assert abs(first["terms"]["query_kl"]["value"]) < 1e-9
    assert first["terms"]["query_kl"]["logit_grad_response"] == 0.0
    for name in ("policy_kl", "entropy"):   # coefficient 0: no gradient anywhere
        assert first["terms"][name]["param_grad_norm"] == 0.0, name
    assert first["terms"] == second["terms"]


def test_inspect_grads_argument_errors(sft_model, capsys):
    with pytest.raises(SystemExit, match="needs both --config"):
        cli.main(["inspect-grads", "--checkpoint", str(sft_model)])
    with pytest.raises(SystemExit, match="--beta-query set the synthetic batch's loss"):
        cli.main(["inspect-grads", "--config", "x.json", "--checkpoint", str(sft_model),
                  "--beta-query", "0.2"])


# ----------------------------------------------------------------------------- the run's batch


def _trainer_batch_at(cfg, step, export_to):
    """Train `cfg` and return the batch the Trainer built at step `step`, with
    the policy of that moment exported to `export_to` (what inspect-grads
    --checkpoint reads)."""
    from erpo_jax.train.loop import Trainer
    from erpo_jax.train.policy import export_policy
    from erpo_jax.runtime.distributed import to_host
    t = Trainer(cfg)
    seen = {}
    build = t._rl_batch

    def recording(s):
        out = build(s)
        if s == step:
            export_policy(to_host(t.state.params), t.model_cfg, t.tokenizer, t.cfg, export_to)
            seen["batch"] = out[0]
        return out

    t._rl_batch = recording
    try:
        assert t.run()["status"] == "done"
    finally:
        t.close()
    return seen["batch"]


@pytest.mark.parametrize("setting", ["dapo_adaptive_reward_kl", "gae"])
def test_inspect_grads_builds_exactly_the_batch_the_trainer_trained_on(sft_model, tmp_path,
                                                                      setting):
    """DAPO (dynamic sampling padded, overlong shaping) with an adaptive
    Policy-KL in the reward, at step 2: the prompts come from the iterator
    position dynamic sampling reached, the shaping from the adapted
    coefficient. GAE at step 0 (the inspector's critic is the Trainer's
    step-0 critic). Every field of the inspector's batch equals the Trainer's."""
    from erpo_jax.train.inspect_grads import inspect_run, run_batch
    extra = {"dapo_adaptive_reward_kl": [
        "rollout.group_size=4", "rollout.max_new_tokens=40", "algo.filter_groups=true",
        "algo.filter_max_batches=3", "algo.filter_on_short=pad", "algo.overlong_buffer=30",
        "loss.eps_high=0.28", "loss.beta_policy=0.05", "loss.policy_kl_mode=reward",
        "loss.kl_target=0.001", "loss.kl_horizon=8", "optim.num_minibatches=2",
        "train.steps=3"],
        "gae": ["rollout.group_size=4", "rollout.max_new_tokens=40", "algo.advantage=gae",
                "loss.beta_query=0.1", "train.steps=1"]}[setting]
    step = 2 if setting.startswith("dapo") else 0
    cfg = load_config(None, _rl(sft_model, tmp_path / "run", *extra))
    policy = tmp_path / "policy"
    want = _trainer_batch_at(cfg, step, policy)
    got, info = run_batch(cfg, str(policy), reference=str(sft_model), step=step)
    if setting.startswith("dapo"):
        rows = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text()
                .splitlines()]
        assert info["position"] == sum(int(r["filter/batches"]) for r in rows[:step]) > step
        assert info["kl_coef"] == rows[step - 1]["kl_coef_next"] != 0.05
    for name, a, b in zip(want._fields, want, got):
        if a is None or b is None:
            assert a is None and b is None, name
            continue
        np.testing.assert_array_equal(np.asarray(b), np.asarray(a), err_msg=name)
    assert np.asarray(want.advantages).any()
    # The report covers the first groups up to one with signal (which groups
    # dynamic sampling's filler takes depends on the draws); fewer is refused.
    G = cfg.rollout.group_size
    signal = np.asarray(want.response_mask).reshape(-1, G * want.response_mask.shape[1]).any(1)
    queries = int(np.argmax(signal)) + 1
    if queries > 1:
        with pytest.raises(ValueError, match="filler .*raise --queries"):
            inspect_run(cfg, str(policy), reference=str(sft_model), step=step,
                        queries=queries - 1)
    rep = inspect_run(cfg, str(policy), reference=str(sft_model), step=step,
                      queries=max(2, queries))
    assert f"step-{step} batch" in rep["source"]["batch"]
