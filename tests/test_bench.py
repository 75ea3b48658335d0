"""`erpo bench` produces every field (its numbers are not checked: speed is for
BENCHMARKS.md, never for a test). Runs the smallest mode, every section."""

import json

import jax.numpy as jnp
import numpy as np
import pytest

from erpo_jax.tools import bench
from erpo_jax.model.config import PRESETS


def test_bench_test_mode_produces_every_field(tmp_path):
    out = tmp_path / "bench.json"
    res = bench.main(["--mode", "test", "--no-hf", "--out", str(out)])
    assert json.loads(out.read_text())["mode"] == "test"
    for key in ("date", "backend", "devices", "host", "peak_rss_mib", "total_s", "targets",
                *bench.SECTIONS):
        assert key in res, key
    assert res["matmul_peak"]["flops_per_s"] > 0
    r = res["regularizer"]
    for v in ("no_kl", "erpo", "policy_kl"):
        assert r["wall_s"][v] > 0 and r["xla_flops_1layer"][v] > 0
    # Policy-KL adds the reference forward's FLOPs; ERPO adds only elementwise work.
    assert r["policy_kl_over_no_kl_flops"] > r["erpo_over_no_kl_flops"] >= 1.0
    m = res["mfu"]
    assert m["model_flops"] > 0 and 0 < m["mfu"] and m["wall_s"]["update"] > 0
    rows = res["sampler"]["rows"]
    assert rows and all(x["jax_kv_cache"] > 0 and x["jax_no_cache"] > 0 for x in rows)
    e = res["engines"]
    assert e["same_samples"] and set(e["engines"]) == {"static", "continuous", "paged"}
    assert all(x["decode_steps"] > 0 and 0 < x["slot_utilization"] <= 1 and x["wall_s"] > 0
               for x in e["engines"].values())
    (rl,) = res["rl_iteration"]
    assert rl["first_iter_s"] > 0 and rl["steady_iter_s"] > 0
    assert rl["ref_forward_calls"] == rl["iters"]  # Policy-KL: one reference forward per step
    assert set(rl["steady_breakdown_s"]) == {"time/rollout", "time/reward", "time/ref",
                                             "time/update"}
    assert len(res["memory"]) == len(bench.REAL_SCALE)
    for x in res["memory"]:
        assert all(v > 0 for v in x["gib"].values()) and isinstance(x["fits_remat"], bool)
    for name in ("erpo_flops_ratio", "erpo_wall_ratio", "train_mfu", "rl_tiny_first_s",
                 "engines_steps_ratio", "engines_slot_utilization"):
        assert name in res["targets"], name


def test_gpu_mode_code_path_runs_at_a_tiny_shape():
    """The path experiments/gpu_bench.sh runs (bf16 model vs bf16 matmul peak),
    here on CPU at the tiny shape."""
    res = bench.run_gpu("tiny", "bfloat16", rows=4, T=16, batches=(2,), new_tokens=4,
                        prompt_len=8, peak_n=256, verbose=False)
    assert res["matmul_peak"]["dtype"] == "bfloat16"
    assert res["mfu"]["dtype"] == "bfloat16" and res["mfu"]["mfu"] > 0
    assert res["sampler"]["rows"][0]["jax_kv_cache"] > 0
    assert res["sampler"]["settings"]["dtype"] == "bfloat16"


def test_memory_estimate_matches_hand_count():
    """Parameters of qwen2.5-7b on a 16-way fsdp mesh: every matrix is split 16
    ways along its embed axis; norms and biases stay whole."""
    cfg = PRESETS["qwen2.5-7b"]
    row = bench.memory_estimate("qwen2.5-7b", "v5e-16", 16, 16.0, (1, 16, 1), 512, (512, 1024), 1)
    D, L = cfg.hidden_size, cfg.num_layers
    whole = L * (2 * D + (cfg.num_heads + 2 * cfg.num_kv_heads) * cfg.head_dim) + D
    split = cfg.num_params() - whole
    expect = (split / 16 + whole) * 4 / 2 ** 30
    np.testing.assert_allclose(row["gib"]["params"], expect, rtol=1e-9)
    np.testing.assert_allclose(row["gib"]["adam_moments"], 2 * expect, rtol=1e-9)
    # KV cache: 2 (k, v) x L x rows/16 x (T-1) x kv_heads x head_dim x bf16.
    kv = 2 * L * 512 / 16 * 1535 * cfg.num_kv_heads * cfg.head_dim * jnp.dtype(jnp.bfloat16).itemsize
    np.testing.assert_allclose(row["gib"]["kv_cache"], kv / 2 ** 30, rtol=1e-9)


def test_model_flops_formula():
    cfg = PRESETS["tiny"]
    p_mm = cfg.num_params() - cfg.vocab_size * cfg.hidden_size
    attn = 12 * cfg.num_layers * cfg.num_heads * cfg.head_dim * 32 * 32 * 4
    assert bench.model_flops_per_step(cfg, 4, 32) == 6 * p_mm * 4 * 32 + attn
    assert bench.model_flops_per_step(cfg, 4, 32, 1, 20) == bench.model_flops_per_step(cfg, 4, 32)


def test_model_flops_with_a_shared_query_follow_the_compiler():
    # Groups of 8 rows with a 40-token query run once per group: the
    # formula's share of the per-row FLOPs is the compiler's, to 2%, for the
    # log-prob forward (unrolled layers, one LM-head chunk, so XLA's cost
    # analysis counts every dot once; a model wide enough that the
    # elementwise work it also counts is small: at hidden size 64 it moves
    # the share by 8%).
    import jax
    from erpo_jax.model import model as M
    from erpo_jax.model.logprobs import token_logprobs
    cfg = PRESETS["arith-medium"]
    assert not cfg.scans_layers
    params = M.init_params(cfg, jax.random.key(0))
    rows, G, Q, R = 16, 8, 40, 24
    toks = jax.random.randint(jax.random.key(1), (rows // G, Q + R), 1, cfg.vocab_size)
    toks = jnp.repeat(toks, G, axis=0).at[:, Q:].set(
        jax.random.randint(jax.random.key(2), (rows, R), 1, cfg.vocab_size))
    xla = {}
    for g in (1, G):
        fn = jax.jit(lambda p, g=g: token_logprobs(p, cfg, toks, chunk_size=None,
                                                   response_columns=R, group_size=g).logp)
        xla[g] = fn.lower(params).compile().cost_analysis()["flops"]
    formula = (bench.model_flops_per_step(cfg, rows, Q + R, G, Q)
               / bench.model_flops_per_step(cfg, rows, Q + R))
    assert formula < 0.7
    np.testing.assert_allclose(xla[G] / xla[1], formula, rtol=0.02)
    with pytest.raises(ValueError, match="16 rows in groups of 3"):
        bench.model_flops_per_step(cfg, rows, Q + R, 3, Q)
