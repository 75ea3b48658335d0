"""The trainer end to end: CLI smoke runs, bit-exact resume, NaN guard,
exact micro-batch accumulation, and no reference forward without Policy-KL."""

import json
import os
import signal

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from erpo_jax import cli
from erpo_jax.rl.loss import LossConfig
from erpo_jax.train.config import load_config, validate
from erpo_jax.train.loop import Trainer, train
from tiny_runs import ANSWERING, TINY, rl_args


@pytest.mark.parametrize("algo", ["grpo", "dr_grpo", "rloo", "reinforce_pp", "gae"])
def test_cli_train_each_algorithm_with_erpo(sft_model, tmp_path, algo):
    out = tmp_path / algo
    rc = cli.main(["train", *rl_args(sft_model, out, *ANSWERING, f"algo.advantage={algo}",
                                 "train.steps=2", "loss.beta_query=0.1",
                                 "algo.weight_scheme=likelihood")])
    assert rc == 0
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2]
    for r in rows:   # the SFT model earns rewards in some samples of a group, not all
        assert r["zero_var_group_frac"] < 1.0 and 0.0 < r["reward_mean"], r
        assert r["advantage_abs_mean"] > 1e-3 and abs(r["term_pg"]) > 1e-6, r
    for key in ("reward_mean", "accuracy", "clip_frac", "entropy", "query_kl_k3", "grad_norm",
                "lr", "time/rollout", "time/update", "tokens_per_sec", "term_query_kl"):
        assert key in rows[-1], key
    assert rows[-1]["term_query_kl"] >= 0
    assert list((out / "tb").glob("events.out.tfevents.*")), "no TensorBoard event file"
    saved = json.loads((out / "config.json").read_text())
    assert saved["algo"]["advantage"] == algo and saved["loss"]["beta_query"] == 0.1
    if algo == "gae":
        assert "value_loss" in rows[-1]


def test_cli_eval_of_an_exported_model(sft_model, tmp_path, capsys):
    out = tmp_path / "eval"
    rc = cli.main(["eval", "--checkpoint", str(sft_model), "--out", str(out), *TINY])
    assert rc == 0
    rows = [json.loads(x) for x in (out / "evals.jsonl").read_text().splitlines()]
    assert len(rows) == 1 and rows[0]["sets"]
    for name, res in rows[0]["sets"].items():
        assert 0.0 <= res["greedy_acc"] <= 1.0 and res["n_problems"] > 0, (name, res)
    assert '"average"' in capsys.readouterr().out


def _checkpoint(run_dir, step):
    """(state leaves, params leaves, meta) of the checkpoint of `step`, the run's latest."""
    import orbax.checkpoint as ocp
    from erpo_jax.train.checkpoint import Checkpointer
    ck = Checkpointer(run_dir / "checkpoints")
    try:
        assert ck.latest_step() == step
        restored = ck.manager.restore(step, args=ocp.args.Composite(
            state=ocp.args.StandardRestore(), meta=ocp.args.JsonRestore()))
    finally:
        ck.close()
    state = restored["state"]
    params = state["params"] if isinstance(state, dict) else state.params
    return _leaves(state), _leaves(params), dict(restored["meta"])


def _leaves(tree):
    return [np.asarray(x) for x in jax.tree_util.tree_leaves(tree)]


def test_sigterm_resume_is_bit_identical(sft_model, tmp_path):
    """SIGTERM at step 3 of 6, then the same command: the resumed run starts
    at step 3 with the data position the checkpoint holds, and ends with the
    uninterrupted run's state bit for bit; restarting at step 3 from the
    initial parameters instead ends elsewhere (so the restored state matters)."""
    from erpo_jax.data.iterator import QueryBatchIterator
    # The continuous engine, its 8 slots refilled from 32 samples a step.
    common = [*ANSWERING, "train.steps=6", "loss.beta_query=0.1",
              "algo.weight_scheme=likelihood", "train.ckpt_every=100", "optim.epochs=2",
              "optim.num_minibatches=2", "rollout.engine=continuous", "rollout.slots=8"]
    full = tmp_path / "full"
    assert train(load_config(None, rl_args(sft_model, full, *common)))["status"] == "done"

    cut = tmp_path / "cut"
    cfg = load_config(None, rl_args(sft_model, cut, *common))

    def stop_at_3(step, row):
        if step == 3:
            os.kill(os.getpid(), signal.SIGTERM)

    assert train(cfg, on_step=stop_at_3) == {"status": "preempted", "step": 3,
                                             "ref_forward_calls": 0}
    _, params3, meta = _checkpoint(cut, 3)
    assert meta["step"] == 3
    it = QueryBatchIterator(64, cfg.train.batch_size, cfg.train.seed)
    for _ in range(3):
        next(it)
    assert meta["data"] == it.get_state() and meta["data"]["step"] == 3

    t = Trainer(cfg)
    try:
        assert t.start_step == 3 and t.iterator.step == 3 and int(t.state.step) == 3 * 2 * 2
        for x, y in zip(_leaves(t.state.params), params3):
            np.testing.assert_array_equal(x, y)
        seen = []
        assert t.run(on_step=lambda step, row: seen.append(step))["status"] == "done"
    finally:
        t.close()
    assert seen == [4, 5, 6]

    a, params_full, _ = _checkpoint(full, 6)
    b, _, _ = _checkpoint(cut, 6)
    assert len(a) == len(b)
    for x, y in zip(a, b):
        np.testing.assert_array_equal(x, y)
    rows = lambda d: {r["step"]: r for r in map(json.loads, (d / "metrics.jsonl").read_text()
                                                .splitlines())}
    ra, rb = rows(full), rows(cut)
    assert sorted(rb) == [1, 2, 3, 4, 5, 6]
    # The PG path moved the weights (a step whose groups all agree has none).
    assert sum(ra[s]["advantage_abs_mean"] > 0 for s in ra) >= 3, ra
    for s in (4, 5, 6):
        for k, v in ra[s].items():
            if not (k.startswith("time/") or k == "tokens_per_sec"):
                assert rb[s][k] == v, (s, k)

    # From scratch at the checkpoint's step and data position: the steps and
    # rollout keys are the same, only the starting state is the initial one.
    scratch = tmp_path / "scratch"
    t = Trainer(load_config(None, rl_args(sft_model, scratch, *common)))
    try:
        t.start_step = 3
        t.iterator.set_state(meta["data"])
        assert t.run()["status"] == "done"
        c = _leaves(t.state.params)
    finally:
        t.close()
    assert len(c) == len(params_full)
    assert any(not np.array_equal(x, y) for x, y in zip(params_full, c))


def _tiny_update(micro_batches, nan_injector=None, sgd=False, warmup_steps=0,
                 response_width=None, temperature=1.0, share_query=False, **loss):
    from erpo_jax.model import model as M
    from erpo_jax.model.config import ModelConfig
    from erpo_jax.rl.synthetic import synthetic_batch
    from erpo_jax.train import train_step as S
    from erpo_jax.train.config import AlgoSection, OptimSection
    cfg = ModelConfig()
    params = M.init_params(cfg, jax.random.key(0))
    batch = synthetic_batch(params, cfg, 0, num_queries=4, group_size=2, query_width=6,
                            response_width=6, with_ref_logp=True)
    loss_cfg = LossConfig(**{"beta_policy": 0.05, "beta_query": 0.1, "entropy_coef": 0.01,
                             **loss})
    import optax
    tx, schedule = S.make_optimizer(OptimSection(lr=1e-2, warmup_steps=warmup_steps), 10)
    if sgd:
        tx, schedule = optax.sgd(1.0), None
    state = S.init_state(params, tx)
    upd = S.build_update(cfg, loss_cfg, AlgoSection(), tx, micro_batches=micro_batches,
                         group_size=2, nan_injector=nan_injector, schedule=schedule,
                         response_width=response_width, temperature=temperature,
                         share_query=share_query)
    return params, state, upd, batch


# Every policy loss; the covariance ones with a band and a share wide enough
# that each selects many tokens (a per-micro-batch selection, count or draw
# would then differ from the mini-batch's).
PG_LOSSES = {"ppo_clip": {}, "clip_cov": {"clip_cov_ratio": 0.3, "clip_cov_lb": -10.0,
                                          "clip_cov_ub": 10.0},
             "kl_cov": {"kl_cov_ratio": 0.3}}


def test_every_policy_loss_is_listed_for_the_accumulation_test():
    from erpo_jax.rl.policy_losses import POLICY_LOSSES
    assert sorted(PG_LOSSES) == sorted(POLICY_LOSSES)


@pytest.mark.parametrize("pg_loss", sorted(PG_LOSSES))
def test_micro_batch_accumulation_is_exact(pg_loss):
    # Plain SGD with lr 1: the parameter change is exactly the accumulated gradient.
    loss = {"pg_loss": pg_loss, **PG_LOSSES[pg_loss]}
    _, s1, upd1, batch = _tiny_update(1, sgd=True, **loss)
    _, s2, upd2, _ = _tiny_update(4, sgd=True, **loss)
    n1, m1 = upd1(s1, batch, None)
    n2, m2 = upd2(s2, batch, None)
    if pg_loss != "ppo_clip":
        assert float(m1["cov_selected_frac"]) > 0.2
    assert abs(float(m1["loss"]) - float(m2["loss"])) < 1e-6
    assert abs(float(m1["grad_norm"]) - float(m2["grad_norm"])) < 1e-5
    for a, b in zip(jax.tree_util.tree_leaves(n1.params), jax.tree_util.tree_leaves(n2.params)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=1e-6)


# log r = logp - old_logp per response token: 0.5 leaves [0.9, 1.1], 0.02 does not.
MISMATCH_OFFSETS = (-0.5, -0.02, 0.0, 0.02, 0.5)


def _mismatched(params, batch):
    """The batch with old_logp = logp - offsets (numpy, float64) on its response tokens."""
    from erpo_jax.model.config import ModelConfig
    from erpo_jax.model.logprobs import token_logprobs
    lp = np.asarray(token_logprobs(params, ModelConfig(), batch.tokens, batch.attn_mask).logp)
    rm = np.asarray(batch.response_mask)
    off = np.where(rm, np.random.default_rng(3).choice(MISMATCH_OFFSETS, rm.shape), 0.0)
    old = np.where(rm, lp - off, 0.0).astype(np.float32)
    return batch._replace(old_logp=jnp.asarray(old)), off, rm


@pytest.mark.parametrize("micro_batches", [1, 2])
def test_the_first_pass_mismatch_metrics_are_the_closed_forms(micro_batches):
    """On the update's first pass the ratio is the sampler/trainer mismatch:
    with old_logp = logp - d, the update reports mean |d| over the response
    tokens, the share of tokens with exp(d) outside [0.9, 1.1] and the largest
    per-sequence |sum d|, over the whole mini-batch whatever its micro-batches
    (a plain mean of micro-batch means, or of their maxima, is not these)."""
    # Plain SGD (the metrics are the first pass's, whatever the optimizer): with one
    # micro-batch, the program test_micro_batch_accumulation_is_exact[ppo_clip] compiled.
    params, state, upd, batch = _tiny_update(micro_batches, sgd=True)
    batch, off, rm = _mismatched(params, batch)
    n = rm.sum()
    want = {"mismatch/logp_abs_mean": np.abs(off).sum() / n,
            "mismatch/ratio_out_frac": (np.abs(off) > 0.1).sum() / n,
            "mismatch/seq_logp_abs_max": np.abs(off.sum(-1)).max()}
    _, m = upd(state, batch, None)
    for k, v in want.items():
        np.testing.assert_allclose(float(m[k]), v, rtol=0, atol=2e-5, err_msg=k)
    if micro_batches > 1:   # the batch tells the combinations apart
        halves = np.split(np.arange(rm.shape[0]), micro_batches)
        naive = np.mean([np.abs(off[h]).sum() / rm[h].sum() for h in halves])
        assert abs(naive - want["mismatch/logp_abs_mean"]) > 1e-3
        assert np.mean([np.abs(off[h].sum(-1)).max() for h in halves]) < \
            want["mismatch/seq_logp_abs_max"] - 1e-3


def test_the_step_logs_the_mismatch_of_its_first_update():
    """Trainer._update: every other metric is the mean over the step's
    updates; the mismatch is the first update's (the policy that sampled)."""
    import types
    from erpo_jax.rl.batch import RLBatch
    from erpo_jax.train.config import RunConfig, apply_overrides
    cfg = apply_overrides(RunConfig(), ["optim.epochs=2", "optim.num_minibatches=2"])
    N, T = 4 * 2, 5
    batch = RLBatch(tokens=np.zeros((N, T), np.int32), attn_mask=np.ones((N, T), bool),
                    query_mask=np.zeros((N, T - 1), bool),
                    response_mask=np.ones((N, T - 1), bool),
                    old_logp=np.zeros((N, T - 1), np.float32),
                    advantages=np.zeros(N, np.float32),
                    ref_query_logp=np.zeros((N, T - 1), np.float32),
                    query_weight=np.ones(N, np.float32), group_id=np.arange(N) // 2)
    calls = []

    def update(state, mb, cb):
        calls.append(len(calls))
        i = float(len(calls))
        return state, {"loss": i, "mismatch/logp_abs_mean": i, "mismatch/seq_logp_abs_max": i,
                       "skipped_total": 0, "nonfinite_in_a_row": 0}

    fake = types.SimpleNamespace(
        cfg=cfg, G=2, B=4, sharding=None, state=None, update=update,
        _wait_for_compile=lambda: None, _draw_at=lambda step: 0,
        iterator=types.SimpleNamespace(batch_at=lambda pos: None))
    out = Trainer._update(fake, batch, None, 0)
    assert len(calls) == 4 and out["loss"] == 2.5
    assert out["mismatch/logp_abs_mean"] == out["mismatch/seq_logp_abs_max"] == 1.0


def _assert_same_update(out1, out2):
    """Two updates' (state, metrics): the same metrics and parameters."""
    (n1, m1), (n2, m2) = out1, out2
    for k in m1:
        np.testing.assert_allclose(float(m2[k]), float(m1[k]), rtol=1e-5, atol=1e-7, err_msg=k)
    for a, b in zip(jax.tree_util.tree_leaves(n1.params), jax.tree_util.tree_leaves(n2.params)):
        np.testing.assert_allclose(np.asarray(b), np.asarray(a), atol=1e-6)


def test_update_with_the_response_width_is_the_same_update():
    # The Trainer's update scores query columns at temperature 1 and response
    # columns at the sampling temperature only; on a rollout-layout batch that
    # is the same loss, metrics and parameter change as scoring every column
    # at both temperatures (Policy-KL, Query-KL and entropy all on).
    from erpo_jax.rl.batch import validate_batch
    _, s1, upd1, batch = _tiny_update(2, sgd=True, temperature=0.7)
    _, s2, upd2, _ = _tiny_update(2, sgd=True, temperature=0.7, response_width=6)
    validate_batch(batch, needs_ref_logp=True, response_width=6)
    _assert_same_update(upd1(s1, batch, None), upd2(s2, batch, None))
    # A batch whose masks cross the boundary is refused before it reaches it.
    qm = np.asarray(batch.query_mask).copy()
    assert np.asarray(batch.response_mask)[0, 5]   # row 0's first response target
    qm[0, 5] = True
    bad = batch._replace(query_mask=qm, response_mask=np.asarray(batch.response_mask) & ~qm)
    with pytest.raises(ValueError, match="query_mask marks row 0, position 5, on the wrong side"):
        validate_batch(bad, needs_ref_logp=True, response_width=6)


def test_update_running_each_query_once_is_the_same_update():
    # model.share_query: each micro-batch runs its groups' queries through
    # the model once. Same loss, metrics and parameter change as every row
    # whole (Policy-KL, Query-KL and entropy on), and a batch whose groups
    # do not repeat one query is refused before it reaches the update.
    from erpo_jax.rl.batch import validate_batch
    _, s1, upd1, batch = _tiny_update(2, sgd=True, temperature=0.7, response_width=6)
    _, s2, upd2, _ = _tiny_update(2, sgd=True, temperature=0.7, response_width=6,
                                  share_query=True)
    validate_batch(batch, needs_ref_logp=True, response_width=6, group_size=2)
    _assert_same_update(upd1(s1, batch, None), upd2(s2, batch, None))
    order = np.array([0, 2, 1, 3, 4, 5, 6, 7])      # rows 1 and 2 swap groups
    swapped = jax.tree_util.tree_map(lambda x: None if x is None else np.asarray(x)[order],
                                     batch)
    with pytest.raises(ValueError, match="row 1 differs from row 0 in the query columns"):
        validate_batch(swapped, needs_ref_logp=True, response_width=6, group_size=2)
    with pytest.raises(ValueError, match="share_query needs response_width"):
        _tiny_update(2, share_query=True)


@pytest.mark.parametrize("rows", [8, 6])
def test_reference_forward_in_row_chunks_is_the_same_forward(rows):
    # The Trainer runs the Policy-KL reference forward in as many row chunks
    # as the update's micro-batches (rows j, j + n, ... together); a row count
    # the chunks do not divide runs whole.
    from erpo_jax.model import model as M
    from erpo_jax.model.config import ModelConfig
    from erpo_jax.train.train_step import make_logprob_fn
    cfg = ModelConfig()
    params = M.init_params(cfg, jax.random.key(0))
    toks = jax.random.randint(jax.random.key(1), (rows, 12), 0, cfg.vocab_size)
    mask = jnp.ones_like(toks, bool).at[1, :3].set(False)
    whole = make_logprob_fn(cfg, 0.7, None)(params, toks, mask, last=5)
    chunked = make_logprob_fn(cfg, 0.7, None, row_chunks=4)(params, toks, mask, last=5)
    np.testing.assert_allclose(np.asarray(chunked), np.asarray(whole), atol=1e-6, rtol=1e-6)
    assert np.all(np.asarray(chunked)[:, :-5] == 0.0)
    # Rows in groups of 2 repeating a query: each query runs once, the chunks
    # hold whole groups (groups j, j + n, ...), and the numbers are the same.
    toks = jnp.repeat(toks[::2, :7], 2, axis=0)
    toks = jnp.concatenate([toks, jax.random.randint(jax.random.key(2), (rows, 5), 0,
                                                     cfg.vocab_size)], axis=1)
    mask = jnp.ones_like(toks, bool).at[:2, :3].set(False)
    whole = make_logprob_fn(cfg, 0.7, None)(params, toks, mask, last=5)
    grouped = make_logprob_fn(cfg, 0.7, None, row_chunks=4 if rows == 8 else 3,
                              group_size=2)(params, toks, mask, last=5)
    np.testing.assert_allclose(np.asarray(grouped), np.asarray(whole), atol=1e-6, rtol=1e-6)


def test_nonfinite_gradient_skips_the_update():
    inject = lambda g: jax.tree_util.tree_map(lambda x: x.at[(0,) * x.ndim].set(jnp.nan), g)
    params, state, upd, batch = _tiny_update(1, nan_injector=inject)
    before = jax.tree_util.tree_map(np.asarray, (state.params, state.opt_state))
    new, m = upd(state, batch, None)
    assert float(m["update_skipped"]) == 1.0
    assert int(new.skipped) == 1 and int(new.nonfinite) == 1 and int(new.step) == 0
    assert int(m["skipped_total"]) == 1 and int(m["nonfinite_in_a_row"]) == 1
    after = jax.tree_util.tree_map(np.asarray, (new.params, new.opt_state))
    jax.tree_util.tree_map(np.testing.assert_array_equal, before, after)


def test_update_reports_the_learning_rate_it_applied():
    # Linear warmup from 0 over 4 updates: the first update applies lr 0 and
    # leaves the parameters as they were; the second applies a quarter of the peak.
    params, state, upd, batch = _tiny_update(1, warmup_steps=4)
    leaves = lambda s: [np.asarray(x) for x in jax.tree_util.tree_leaves(s.params)]
    before = leaves(state)
    state, m = upd(state, batch, None)
    assert float(m["lr"]) == 0.0 and int(state.step) == 1
    jax.tree_util.tree_map(np.testing.assert_array_equal, before, leaves(state))
    state, m = upd(state, batch, None)
    assert float(m["lr"]) == pytest.approx(0.25e-2, rel=1e-6)
    assert any(np.any(a != b) for a, b in zip(before, leaves(state)))
    assert int(m["skipped_total"]) == 0 and int(m["nonfinite_in_a_row"]) == 0


def test_invalid_config_names_the_field():
    with pytest.raises(ValueError, match="config field rollout.temperature"):
        validate(load_config(None, ["rollout.temperature=0"]))
    with pytest.raises(ValueError, match="config field optim.lr: expects float"):
        load_config(None, ["optim.lr=fast"])
    with pytest.raises(ValueError, match="RolloutSection has no field 'temp'"):
        load_config(None, ["rollout.temp=1.0"])
    with pytest.raises(ValueError, match="optim.micro_batches.*data-parallel size 8"):
        validate(load_config(None, ["train.batch_size=2", "rollout.group_size=2"]),
                 num_devices=8)
    with pytest.raises(ValueError, match="config field mesh.shape"):
        validate(load_config(None, ["mesh.shape=4,4,4"]), num_devices=8)
    assert cli.main(["train", "loss.eps_low=2"]) == 2


def test_rollout_in_chunks_joins_to_the_whole_batch():
    from erpo_jax.model import model as M
    from erpo_jax.model.config import ModelConfig
    from erpo_jax.rollout.static import StaticEngine
    from erpo_jax.rollout.types import SamplingConfig
    from erpo_jax.train.host import sample
    cfg = ModelConfig()
    params = M.init_params(cfg, jax.random.key(0))
    sampler = StaticEngine(cfg, SamplingConfig(max_new_tokens=4, num_samples=2, greedy=True,
                                               max_prompt_len=32))
    prompts = [[5] * n for n in (3, 12, 4, 20, 7)]  # chunks bucket to widths 16 and 32
    key = jax.random.key(1)
    whole, parts = sample(sampler, params, prompts, key), sample(sampler, params, prompts, key, 2)
    assert parts.prompt_tokens.shape == whole.prompt_tokens.shape == (10, 32)
    for field in ("prompt_tokens", "prompt_mask", "response_tokens", "response_mask",
                  "lengths", "truncated"):
        np.testing.assert_array_equal(getattr(parts, field), getattr(whole, field), field)
    np.testing.assert_allclose(parts.logp, whole.logp, atol=1e-5)


_COMPILE_EVENTS = []


def _on_duration(event, duration, **kwargs):
    if event.startswith("/jax/core/compile/") and kwargs.get("fun_name") in _AHEAD:
        _COMPILE_EVENTS.append((kwargs["fun_name"], event))


# What the Trainer compiles ahead: the update, the rollout, the reference
# forward, the reward shaping + advantages.
_AHEAD = ("jit(update)", "jit(rollout_fn)", "jit(logprob_fn)", "jit(advantages_fn)")


jax.monitoring.register_event_duration_secs_listener(_on_duration)


@pytest.mark.parametrize("extra", [
    ("loss.beta_query=0.1", "algo.weight_scheme=likelihood"),      # ERPO
    # ref_logp, 2 mini-batches; a response length no other test uses, so the
    # reference forward's shape is compiled here first.
    ("loss.beta_policy=0.04", "optim.num_minibatches=2", "rollout.max_new_tokens=12"),
    ("algo.advantage=gae",),                                       # per-token advantages + critic
    # KL-shaped rewards (ERPO_LONG_TESTS=1; test_method_run trains this mode by default)
    pytest.param(("loss.beta_policy=0.04", "loss.policy_kl_mode=reward"), marks=pytest.mark.long),
])
def test_compile_ahead_covers_the_first_step(sft_model, tmp_path, extra):
    """The rollout, reference forward and update compiled in the background for
    step 0's shapes are what the first step uses: nothing of them is lowered
    or compiled inside the step. And the reference model runs once per step
    with Policy-KL, and without it is never run, not even kept in memory."""
    cfg = load_config(None, rl_args(sft_model, tmp_path / "run", "train.steps=1", *extra))
    t = Trainer(cfg)
    try:
        assert t._compiling is not None
        t._wait_for_compile()
        _COMPILE_EVENTS.clear()
        batch, cb, *_ = t._rl_batch(0)
        t._update(batch, cb, 0)
        assert _COMPILE_EVENTS == []
        if "loss.beta_policy=0.04" in extra:
            assert t.ref_params is not None and t.ref_forward_calls == 1
        else:
            assert t.ref_params is None and t.ref_forward_calls == 0
    finally:
        t.close()
    # The switch: with compile_ahead off the first step lowers (and compiles)
    # them. Checked on the ERPO case: the switch does not depend on the config.
    if extra != ("loss.beta_query=0.1", "algo.weight_scheme=likelihood"):
        return
    cfg = load_config(None, rl_args(sft_model, tmp_path / "off", "train.steps=1",
                                "train.compile_ahead=false", *extra))
    t = Trainer(cfg)
    try:
        assert t._compiling is None
        _COMPILE_EVENTS.clear()
        batch, cb, *_ = t._rl_batch(0)
        t._update(batch, cb, 0)
        lowered = {f for f, e in _COMPILE_EVENTS if e.endswith("jaxpr_to_mlir_module_duration")}
        # (jit shares executables between equal closures, so the reference
        # forward compiled by the first Trainer is not lowered again here.)
        assert {"jit(update)", "jit(rollout_fn)", "jit(advantages_fn)"} <= lowered
    finally:
        t.close()
