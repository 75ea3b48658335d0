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
from erpo_jax.rollout.types import Rollout
from erpo_jax.model.logprobs import token_logprobs
from erpo_jax.train import train_step as S
from erpo_jax.train.config import AlgoSection, load_config
from erpo_jax.train.loop import Trainer, train
from tiny_runs import ANSWERING, rl_args


# ----------------------------------------------------------------------------- adaptive KL


def test_the_controller_is_the_proportional_rule_with_its_clip():
    # error = clip(kl / target - 1, -0.2, 0.2); beta *= 1 + error * min(n / horizon, 1)
    for kl, want in ((0.02, 0.1 * (1 + 0.2 * 64 / 640)),     # clipped at +0.2
                     (0.011, 0.1 * (1 + 0.1 * 64 / 640)),
                     (0.009, 0.1 * (1 - 0.1 * 64 / 640)),
                     (0.0, 0.1 * (1 - 0.2 * 64 / 640))):     # clipped at -0.2
        got = float(kl_control.adapt(0.1, kl, 64, 0.01, 640.0))
        np.testing.assert_allclose(got, want, rtol=1e-6)


def test_the_controller_stays_positive_whatever_the_horizon():
    # n = 128 samples, horizon 1: the unbounded rule multiplies by 1 - 0.2 * 128 < 0.
    beta = 0.04
    for _ in range(50):
        beta = float(kl_control.adapt(beta, 0.0, 128, 100.0, 1.0))
        assert beta > 0
    np.testing.assert_allclose(beta, 0.04 * 0.8 ** 50, rtol=1e-4)
    np.testing.assert_allclose(float(kl_control.adapt(0.04, 1e3, 128, 0.01, 1.0)), 0.048,
                               rtol=1e-6)


def test_the_run_header_states_how_far_the_controller_can_move():
    from erpo_jax.train.config import apply_overrides, RunConfig
    base = ["loss.beta_policy=0.04", "loss.kl_target=0.01", "train.batch_size=16",
            "rollout.group_size=8", "optim.num_minibatches=4", "train.steps=100"]
    # The study's old setting: 4 updates of 32 samples, horizon 10,000.
    cfg = apply_overrides(RunConfig(), base)
    r = kl_control.reach(cfg)
    assert (r["samples"], r["updates"]) == (32, 4)
    np.testing.assert_allclose(r["step"], (1 + 0.2 * 32 / 10000) ** 4, rtol=1e-9)
    np.testing.assert_allclose(r["per_100"], (1 + 0.2 * 32 / 10000) ** 400, rtol=1e-9)
    line = kl_control.describe_reach(cfg)
    assert "x1.003 per step" in line and "x1.292 per 100 steps" in line and "WARNING" in line
    moving = apply_overrides(RunConfig(), base + ["loss.kl_horizon=64"])
    r = kl_control.reach(moving)
    np.testing.assert_allclose(r["step"], 1.1 ** 4, rtol=1e-9)
    assert "WARNING" not in kl_control.describe_reach(moving)


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
    ro = ds.concat_chosen([a, b], [(0, 1), (1, 0), (1, 2)], G, pad_id=0)
    assert ro.prompt_tokens.shape == (6, 4)
    np.testing.assert_array_equal(ro.prompt_tokens[0], [0, 0, 7, 7])
    np.testing.assert_array_equal(ro.prompt_mask[0], [False, False, True, True])
    np.testing.assert_array_equal(ro.prompt_tokens[2], [9, 9, 9, 9])
    np.testing.assert_array_equal(ro.response_tokens[:, 0], [27, 37, 9, 19, 49, 59])


def test_a_short_batch_is_filled_with_the_first_flat_groups_in_draw_order():
    # More flat groups than the batch needs: the first ones fill it, not the last.
    v = [np.array([False, True, False, False]), np.array([False, False, True, False])]
    assert ds.choose_groups(v, 4) == ([(0, 0), (0, 1), (0, 2), (1, 2)], 2)


def test_the_dth_draw_of_a_step_samples_the_next_position_with_the_folded_key():
    seen = []
    G, B = 2, 3

    def sample_and_score(idx, key):
        seen.append((idx.tolist(), key))
        flat = np.zeros(B * G, np.float32)
        flat[:G] = [0, 1] if len(seen) == 3 else [1, 1]   # the third draw has a varied group
        return ds.Draw(_rollout(B, G, 2, tag=len(seen)), idx, flat, ["x"] * (B * G), {})

    batch_at = lambda pos: np.arange(pos * B, (pos + 1) * B)
    key = jax.random.key(5)
    draws = ds.draw_step(sample_and_score, batch_at, 7, key, filter_groups=True, batch_size=1,
                         group_size=G, limit=10)
    assert len(draws) == 3
    assert [i for i, _ in seen] == [batch_at(7).tolist(), batch_at(8).tolist(),
                                    batch_at(9).tolist()]
    data = lambda k: jax.random.key_data(k).tolist()
    assert data(seen[0][1]) == data(key)
    for d in (1, 2):
        assert data(seen[d][1]) == data(jax.random.fold_in(key, d))
    # Without filtering: one draw, at the step's position and key.
    seen.clear()
    assert len(ds.draw_step(sample_and_score, batch_at, 4, key, filter_groups=False,
                            batch_size=1, group_size=G, limit=10)) == 1
    assert seen[0][0] == batch_at(4).tolist()


def _draws(rewards_per_draw, G, lengths=None):
    out = []
    for d, r in enumerate(rewards_per_draw):
        r = np.asarray(r, np.float32)
        ro = _rollout(len(r) // G, G, 2, tag=d + 1)
        if lengths is not None:
            ro = ro._replace(lengths=np.asarray(lengths[d]))
        out.append(ds.Draw(ro, np.arange(len(r) // G) + 10 * d, r, ["ok"] * len(r),
                           {"decode_steps": 5 + d, "slot_steps": 40, "useful_tokens": 10 * d,
                            "slot_utilization": 10 * d / 40}))
    return out


def test_a_step_short_of_varied_groups_stops_or_pads_as_configured():
    import dataclasses
    G = 2
    draws = _draws([[1, 1, 0, 1], [0, 0, 1, 1]], G)   # one varied group in two draws
    a = AlgoSection(filter_groups=True, filter_max_batches=2)
    with pytest.raises(ds.ShortBatch, match=r"found 1 groups .* train.batch_size=2 step 4 "
                       r".*algo.filter_max_batches=2.*algo.filter_on_short=pad"):
        ds.select(draws, a, batch_size=2, group_size=G, pad_id=0, step=3)
    sel = ds.select(draws, dataclasses.replace(a, filter_on_short="pad"), batch_size=2,
                    group_size=G, pad_id=0, step=3)
    assert sel.filler.tolist() == [True, False] and sel.idx.tolist() == [0, 1]
    assert sel.info["filter/short"] == 1 and sel.info["filter/batches"] == 2
    # The engine's statistics cover both draws, as the rollout time does.
    assert sel.info["rollout/decode_steps"] == 11
    assert sel.info["rollout/slot_utilization"] == pytest.approx(10 / 80)
    assert sel.info["rollout/prompts_sampled"] == 4


class _NoCache:
    """A reference cache of zeros (what build_batch reads: batch_layout)."""

    def batch_layout(self, rows, P, T):
        return np.zeros((len(rows), T - 1), np.float32)


def _advantages_fn(cfg):
    def fn(rewards, mask, old, ref, beta=None):
        return shaped_advantages(jnp.asarray(rewards), jnp.asarray(mask), old, ref,
                                 loss_cfg=cfg.loss, algo=cfg.algo,
                                 group_size=cfg.rollout.group_size, beta=beta)
    return fn


def _dapo_cfg(*extra):
    from erpo_jax.train.config import apply_overrides, RunConfig
    return apply_overrides(RunConfig(), ["rollout.group_size=2", "rollout.max_new_tokens=3",
                                         "train.batch_size=2", "algo.filter_groups=true",
                                         "algo.filter_on_short=pad", "algo.overlong_buffer=2",
                                         *extra])


def test_filler_groups_carry_no_signal_whatever_the_shaping():
    from erpo_jax.rl import assemble
    from erpo_jax.rl.recipe import recipe
    cfg = _dapo_cfg()
    G = 2
    # Group 0 is flat in accuracy but its lengths differ inside the overlong
    # buffer (1 and 3 of 3 tokens): under shaping its rewards differ.
    draws = _draws([[1, 1, 0, 1]], G, lengths=[[1, 3, 1, 1]])
    sel = ds.select(draws, cfg.algo, batch_size=2, group_size=G, pad_id=0, step=0)
    assert sel.filler.tolist() == [True, False]
    out = assemble.build_batch(sel, cfg, recipe(cfg), ref_cache=_NoCache(),
                               weights=np.ones(40, np.float32),
                               advantages_fn=_advantages_fn(cfg))
    b = out.batch
    assert out.rewards[0] != out.rewards[1]   # the length signal is there...
    assert np.all(np.asarray(b.advantages)[:G] == 0.0)   # ...and reaches nothing
    assert not np.asarray(b.response_mask)[:G].any() and not np.asarray(b.query_mask)[:G].any()
    assert np.asarray(b.response_mask)[G:].any() and np.all(np.asarray(b.advantages)[G:] != 0)
    # Its tokens are not in the token mean: the loss is the varied group's alone.
    logits = jnp.asarray(np.random.default_rng(0).normal(size=b.tokens.shape[:1] + (
        b.tokens.shape[1] - 1, 32)), jnp.float32)
    from erpo_jax.rl.loss import loss_from_stats, stats_from_logits
    from erpo_jax.rl.batch import as_jax
    lc = LossConfig(beta_query=0.5)
    whole = loss_from_stats(stats_from_logits(logits, jnp.asarray(b.tokens[:, 1:])),
                            as_jax(b), lc)[0]
    keep = lambda x: None if x is None else np.asarray(x)[G:]
    part = as_jax(type(b)(*[keep(x) for x in b])._replace(group_id=np.arange(G) * 0))
    alone = loss_from_stats(stats_from_logits(logits[G:], jnp.asarray(b.tokens[G:, 1:])),
                            part, lc)[0]
    np.testing.assert_allclose(float(whole), float(alone), rtol=1e-6)


def test_the_overlong_penalty_lowers_the_reward_of_a_long_response():
    from erpo_jax.rl import assemble
    from erpo_jax.rl.recipe import recipe
    cfg = _dapo_cfg("algo.filter_groups=false", "algo.overlong_penalty=0.5")
    draws = _draws([[1, 1, 1, 0]], 2, lengths=[[1, 3, 2, 1]])
    sel = ds.select(draws, cfg.algo, batch_size=2, group_size=2, pad_id=0, step=0)
    out = assemble.build_batch(sel, cfg, recipe(cfg), ref_cache=_NoCache(),
                               weights=np.ones(40, np.float32),
                               advantages_fn=_advantages_fn(cfg))
    # Buffer 2 of 3 tokens: 0 at length 1, -0.25 at 2, -0.5 at 3 (factor 0.5).
    np.testing.assert_allclose(out.rewards, [1.0, 0.5, 0.75, 0.0])
    adv = np.asarray(out.batch.advantages)
    assert adv[0] > 0 > adv[1]   # same task reward: the longer answer is pushed down


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
              "algo.filter_on_short=pad", "algo.overlong_buffer=8"]
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
                 "clip=[0.8, 1.28]", "dynamic sampling (<= 10 batches/step; a short step stops the run)",
                 "overlong shaping (last 8 tokens, penalty 1)"):
        assert part in line, (part, line)
    plain = describe(RunConfig())
    assert "pg_loss" not in plain and "dynamic" not in plain and "clip=" not in plain


def test_a_step_that_stops_short_saves_the_finished_steps_first(sft_model, tmp_path,
                                                                monkeypatch, capsys):
    """DAPO's 'error': from step 2 on every group is flat (the scorer says so),
    so step 2 cannot fill its batch. The run stops with one sentence naming
    the step, the groups found and the fields; step 1 is saved first (no
    checkpoint was due), with the iterator where step 2 starts, and the
    same run resumes from it with 'pad'."""
    from erpo_jax import cli
    run = tmp_path / "short"
    args = rl_args(sft_model, run, *ANSWERING, "train.steps=3", "train.ckpt_every=100",
                   "algo.filter_groups=true", "algo.filter_max_batches=2",
                   "algo.filter_on_short=pad")
    score = Trainer._score

    def flat_after_step_1(self, ro, idx):
        rewards, reasons = score(self, ro, idx)
        if (run / "metrics.jsonl").exists():   # step 1 is written: flat from step 2 on
            rewards = np.zeros_like(rewards)
        return rewards, reasons

    monkeypatch.setattr(Trainer, "_score", flat_after_step_1)
    error = [a if a != "algo.filter_on_short=pad" else "algo.filter_on_short=error"
             for a in args]
    assert cli.main(["train", *error]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1, err
    assert ("found 0 groups with varying rewards of the train.batch_size=8 step 2 needs, in 2 "
            "batches of prompts (algo.filter_max_batches=2)") in err[0]
    assert "algo.filter_on_short=pad" in err[0] and "Steps 1-1 are saved" in err[0]
    rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1]
    leaves, meta = _checkpoint(run, 1)
    assert meta["step"] == 1 and meta["data"]["step"] == rows[0]["filter/batches"]
    # The same run, padded: resumes from step 1; a flat step trains on nothing.
    assert cli.main(["train", *args, "train.allow_config_change=true"]) == 0
    rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2, 3]
    assert rows[1]["filter/short"] == 8 and rows[1]["filter/idle_minibatches"] == 1
    assert "loss" not in rows[1]   # no update ran
