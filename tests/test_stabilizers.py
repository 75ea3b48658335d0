"""The stability techniques ERPO is compared with (issue 35): the adaptive
Policy-KL controller, DAPO's dynamic sampling and overlong shaping, each
against its closed form or a hand loop, and a trainer run with all of them
on (and Clip-Cov) that resumes bit for bit."""

import json
import os
import signal

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from erpo_jax.model import model as M
from erpo_jax.model.config import ModelConfig
from erpo_jax.rl import dynamic_sampling as ds
from erpo_jax.rl import kl_control
from erpo_jax.rl.loss import LossConfig, loss_terms
from erpo_jax.rl.overlong import overlong_penalty
from erpo_jax.rl.shaping import shaped_advantages
from erpo_jax.rl.synthetic import synthetic_batch
from erpo_jax.rollout.sampler import Rollout
from erpo_jax.model.logprobs import token_logprobs
from erpo_jax.train import train_step as S
from erpo_jax.train.config import AlgoSection, load_config
from erpo_jax.train.loop import Trainer, train
from tiny_runs import ANSWERING, rl_args


# ----------------------------------------------------------------------------- adaptive KL


def test_the_controller_is_the_proportional_rule_with_its_clip():
    # error = clip(kl / target - 1, -0.2, 0.2); beta *= 1 + error * n / horizon
    for kl, want in ((0.02, 0.1 * (1 + 0.2 * 64 / 640)),     # clipped at +0.2
                     (0.011, 0.1 * (1 + 0.1 * 64 / 640)),
                     (0.009, 0.1 * (1 - 0.1 * 64 / 640)),
                     (0.0, 0.1 * (1 - 0.2 * 64 / 640))):     # clipped at -0.2
        got = float(kl_control.adapt(0.1, kl, 64, 0.01, 640.0))
        np.testing.assert_allclose(got, want, rtol=1e-6)


def test_the_update_uses_and_adapts_the_coefficient_in_its_state():
    cfg = ModelConfig()
    params = M.init_params(cfg, jax.random.key(0))
    batch = synthetic_batch(params, cfg, 3, num_queries=4, group_size=2, query_width=5,
                            response_width=5, with_ref_logp=True)
    lc = LossConfig(beta_policy=0.05, kl_target=0.001, kl_horizon=100.0)
    tx = optax.sgd(0.0)   # the parameters stay: both updates see the same policy
    upd = S.build_update(cfg, lc, AlgoSection(), tx, micro_batches=2, group_size=2)
    st = token_logprobs(params, cfg, batch.tokens, batch.attn_mask)
    _, m = loss_terms(st, batch, lc)
    kl = float(m["policy_kl"])   # the whole batch's token mean (micro-batches by share)
    state = S.init_state(jax.tree.map(jnp.copy, params), tx, kl_coef=0.05)
    state, out = upd(state, batch, None)
    want = float(kl_control.adapt(0.05, kl, 8, 0.001, 100.0))
    np.testing.assert_allclose(float(state.kl_coef), want, rtol=1e-5)
    np.testing.assert_allclose(float(out["term_policy_kl"]), 0.05 * kl, rtol=1e-4)
    assert float(out["kl_coef"]) == np.float32(0.05) and state.kl_coef.dtype == jnp.float32
    # The next update's term scales with the adapted value (no recompile: a traced scalar).
    state, out2 = upd(state, batch, None)
    np.testing.assert_allclose(float(out2["term_policy_kl"]), want * kl, rtol=1e-4)
    assert upd._cache_size() == 1


def test_reward_mode_shapes_with_the_given_coefficient():
    rs = np.random.default_rng(0)
    m = jnp.asarray(rs.random((8, 6)) < 0.7)
    old, ref = (jnp.asarray(rs.normal(size=(8, 6)), jnp.float32) for _ in range(2))
    r = jnp.asarray(rs.integers(0, 2, 8), jnp.float32)
    lc = LossConfig(beta_policy=0.05, policy_kl_mode="reward", kl_target=0.01)
    a = AlgoSection(advantage="grpo")
    s1, a1 = shaped_advantages(r, m, old, ref, loss_cfg=lc, algo=a, group_size=4,
                               beta=jnp.float32(0.3))
    lc3 = LossConfig(beta_policy=0.3, policy_kl_mode="reward")
    s2, a2 = shaped_advantages(r, m, old, ref, loss_cfg=lc3, algo=a, group_size=4)
    np.testing.assert_array_equal(np.asarray(s1), np.asarray(s2))
    np.testing.assert_array_equal(np.asarray(a1), np.asarray(a2))


# ----------------------------------------------------------------------------- DAPO


def test_overlong_penalty_is_the_linear_ramp_over_the_buffer():
    got = overlong_penalty(np.arange(11), max_new_tokens=10, buffer=4, factor=1.0)
    np.testing.assert_allclose(got, [0, 0, 0, 0, 0, 0, 0, -0.25, -0.5, -0.75, -1.0])
    np.testing.assert_allclose(overlong_penalty([10, 8], 10, 4, factor=0.5), [-0.5, -0.25])
    for bad in (0, 11):
        with pytest.raises(ValueError, match="overlong_buffer"):
            overlong_penalty([3], 10, bad)


def _rollout(B, G, P, tag):
    R = B * G
    return Rollout(prompt_tokens=np.full((R, P), tag, np.int32), prompt_mask=np.ones((R, P), bool),
                   response_tokens=np.arange(R)[:, None] * 10 + tag + np.zeros((R, 3), np.int32),
                   response_mask=np.ones((R, 3), bool), logp=np.zeros((R, 3), np.float32),
                   lengths=np.full(R, 3), truncated=np.zeros(R, bool), num_steps=3)


def test_dynamic_sampling_keeps_varied_groups_in_draw_order_and_fills_when_short():
    G = 2
    r1 = np.array([1, 1, 0, 1, 0, 0], np.float32)   # groups: flat, varied, flat
    r2 = np.array([0, 1, 1, 1, 1, 0], np.float32)   # varied, flat, varied
    v = [ds.varied_groups(r1, G), ds.varied_groups(r2, G)]
    assert [x.tolist() for x in v] == [[False, True, False], [True, False, True]]
    assert ds.choose_groups(v, 3) == ([(0, 1), (1, 0), (1, 2)], 0)
    assert ds.choose_groups(v, 2) == ([(0, 1), (1, 0)], 0)
    # Too few varied groups: the first flat ones fill the batch, in draw order.
    assert ds.choose_groups(v[:1], 3) == ([(0, 0), (0, 1), (0, 2)], 2)
    # Rows of two draws with different prompt widths: left-padded to the widest.
    a, b = _rollout(3, G, 2, tag=7), _rollout(3, G, 4, tag=9)
    ro = ds.select([a, b], [(0, 1), (1, 0), (1, 2)], G, pad_id=0)
    assert ro.prompt_tokens.shape == (6, 4)
    np.testing.assert_array_equal(ro.prompt_tokens[0], [0, 0, 7, 7])
    np.testing.assert_array_equal(ro.prompt_mask[0], [False, False, True, True])
    np.testing.assert_array_equal(ro.prompt_tokens[2], [9, 9, 9, 9])
    np.testing.assert_array_equal(ro.response_tokens[:, 0], [27, 37, 9, 19, 49, 59])


# ----------------------------------------------------------------------------- a run with all of them


def _checkpoint(run_dir, step):
    import orbax.checkpoint as ocp
    from erpo_jax.train.checkpoint import Checkpointer
    ck = Checkpointer(run_dir / "checkpoints")
    try:
        restored = ck.manager.restore(step, args=ocp.args.Composite(
            state=ocp.args.StandardRestore(), meta=ocp.args.JsonRestore()))
    finally:
        ck.close()
    return ([np.asarray(x) for x in jax.tree_util.tree_leaves(restored["state"])],
            dict(restored["meta"]))


def test_a_run_with_every_technique_logs_them_and_resumes_bit_for_bit(sft_model, tmp_path):
    common = [*ANSWERING, "train.steps=4", "train.ckpt_every=100", "optim.num_minibatches=2",
              "loss.beta_query=0.1", "algo.weight_scheme=likelihood",
              "loss.beta_policy=0.05", "loss.kl_target=0.01", "loss.kl_horizon=100",
              "loss.pg_loss=clip_cov", "loss.clip_cov_ratio=0.01", "loss.eps_high=0.28",
              "algo.filter_groups=true", "algo.filter_max_batches=3",
              "algo.overlong_buffer=8"]
    full = tmp_path / "full"
    assert train(load_config(None, rl_args(sft_model, full, *common)))["status"] == "done"
    rows = [json.loads(x) for x in (full / "metrics.jsonl").read_text().splitlines()]
    for r in rows:
        assert r["rollout/prompts_sampled"] == 8 * r["filter/batches"], r
        assert 1 <= r["filter/batches"] <= 3 and r["reward/overlong_penalty_mean"] <= 0
        assert r["filter/short"] == max(0, 8 - r["filter/varied_groups"])
        assert r["kl_coef"] > 0 and r["cov_selected_frac"] > 0
    assert rows[0]["kl_coef"] != rows[-1]["kl_coef"]   # the controller moved it
    leaves, meta = _checkpoint(full, 4)
    drawn = sum(int(r["filter/batches"]) for r in rows)
    assert drawn > len(rows)   # some step had to draw again
    assert meta["data"]["step"] == drawn    # the iterator counts the batches drawn

    cut = tmp_path / "cut"
    cfg = load_config(None, rl_args(sft_model, cut, *common))

    def stop_at_2(step, row):
        if step == 2:
            os.kill(os.getpid(), signal.SIGTERM)

    assert train(cfg, on_step=stop_at_2)["status"] == "preempted"
    t = Trainer(cfg)
    try:
        assert t.start_step == 2
        assert t.iterator.step == sum(int(r["filter/batches"]) for r in rows[:2])
        t._wait_for_compile()   # compile-ahead read step 3's prompts where the step will
        assert t._ahead_position == t.iterator.step
        assert t.run()["status"] == "done"
    finally:
        t.close()
    cut_leaves, _ = _checkpoint(cut, 4)
    assert len(cut_leaves) == len(leaves)
    for x, y in zip(leaves, cut_leaves):
        np.testing.assert_array_equal(x, y)
    again = {r["step"]: r for r in map(json.loads, (cut / "metrics.jsonl").read_text()
                                       .splitlines())}
    for r in rows[2:]:
        for k, v in r.items():
            if not (k.startswith("time/") or k == "tokens_per_sec"):
                assert again[r["step"]][k] == v, (r["step"], k)


def test_every_stabilizer_preset_is_a_valid_config_of_what_it_names():
    import dataclasses
    from erpo_jax.tools.presets import STABILIZERS, slip_method_config, stabilizer_overrides
    from erpo_jax.train.config import apply_overrides, validate
    seen = {}
    for name in STABILIZERS:
        base, overrides = stabilizer_overrides(name, 40)
        cfg = slip_method_config(base)
        cfg = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, init="random"))
        seen[name] = (validate(apply_overrides(cfg, list(overrides))),)
    for name in ("dapo", "erpo+dapo"):
        c = seen[name][0]
        assert c.loss.eps_high == 0.28 and c.algo.filter_groups and c.algo.overlong_buffer == 8
    assert seen["erpo+dapo"][0].loss.beta_query > 0 and seen["dapo"][0].loss.beta_query == 0
    assert seen["kl_cov"][0].loss.pg_loss == "kl_cov" and seen["clip_cov"][0].loss.pg_loss == \
        "clip_cov"
    assert seen["adaptive_kl"][0].loss.kl_target == 0.01 and seen["adaptive_kl"][0].loss.beta_policy > 0
    assert seen["entropy_bonus"][0].loss.entropy_coef == 1e-3


def test_the_run_header_names_every_technique_that_is_on():
    from erpo_jax.train.config import apply_overrides, RunConfig
    from erpo_jax.train.methods import describe
    cfg = apply_overrides(RunConfig(), [
        "loss.beta_policy=0.04", "loss.kl_target=0.01", "loss.pg_loss=clip_cov",
        "loss.eps_high=0.28", "algo.filter_groups=true", "algo.overlong_buffer=8"])
    line = describe(cfg)
    for part in ("adaptive to target 0.01", "pg_loss=clip_cov (ratio 0.0002, band (1, 5))",
                 "clip=[0.8, 1.28]", "dynamic sampling (<= 4 batches/step)",
                 "overlong shaping (last 8 tokens, penalty 1)"):
        assert part in line, (part, line)
    plain = describe(RunConfig())
    assert "pg_loss" not in plain and "dynamic" not in plain and "clip=" not in plain
