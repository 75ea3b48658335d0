"""`erpo bench` sections on one train step: the matmul peak, the regularizer's
cost (no KL vs ERPO vs Policy-KL) and the train-step MFU; and the model FLOPs
formula that `erpo plan` and the peer comparison use too."""

from __future__ import annotations

import dataclasses
import statistics
import time

import jax
import jax.numpy as jnp

from erpo_jax.runtime import xla_options
from erpo_jax.model.config import PRESETS, ModelConfig
from erpo_jax.rl.loss import LossConfig
from erpo_jax.tools.bench.common import BETA_POLICY, BETA_QUERY, _block, peak_rss_mib

# ----------------------------------------------------------------------------- peak


def matmul_peak(n: int = 2048, dtype=jnp.float32, repeats: int = 5) -> dict:
    """Best FLOP/s of a jitted [n, n] @ [n, n] matmul (a chain of 4, so dispatch
    overhead is amortised on fast devices)."""
    a = jax.random.normal(jax.random.key(0), (n, n), dtype)
    b = jax.random.normal(jax.random.key(1), (n, n), dtype) / n ** 0.5
    f = jax.jit(lambda a, b: (((a @ b) @ b) @ b) @ b)
    _block(f(a, b))
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        _block(f(a, b))
        best = min(best, time.perf_counter() - t0)
    return {"n": n, "dtype": jnp.dtype(dtype).name, "flops_per_s": 4 * 2 * n ** 3 / best,
            "peak_rss_mib": peak_rss_mib()}


# ----------------------------------------------------------------------------- train step


def model_flops_per_step(cfg: ModelConfig, rows: int, T: int, group: int = 1,
                         query_width: int = 0) -> float:
    """Training FLOPs of one step over [rows, T] tokens (remat not counted):
    6 * P_mm * tokens + 12 * L * H * K * T^2 * rows, where P_mm are the
    matmul parameters (everything but the embedding table, which is a lookup;
    the LM head counts once even if tied) and the second term is the QK^T and
    PV attention matmuls over the full T x T square (our attention computes
    it, masked), forward x1 + backward x2.

    group > 1: the rows are groups of `group` responses sharing a query of
    `query_width` columns that runs once per group (`model.share_query`):
    tokens = rows/group * Q + rows * (T - Q), and the attention square is
    rows/group * Q^2 (the query's) + rows * (T - Q) * T (the responses')."""
    p_mm = cfg.num_params() - cfg.vocab_size * cfg.hidden_size
    if cfg.tie_word_embeddings:
        p_mm += cfg.vocab_size * cfg.hidden_size
    per_head = 12 * cfg.num_layers * cfg.num_heads * cfg.head_dim
    if group > 1:
        if rows % group or not 0 < query_width < T:
            raise ValueError(f"model_flops_per_step: {rows} rows in groups of {group} with a "
                             f"query of {query_width} of {T} columns")
        P, Q = rows // group, query_width
        return 6.0 * p_mm * (P * Q + rows * (T - Q)) + per_head * (P * Q * Q + rows * (T - Q) * T)
    return 6.0 * p_mm * rows * T + per_head * T * T * rows


def _train_setup(cfg: ModelConfig, shape, seed: int = 0):
    """(params, ref_params, synthetic batch) for queries x group x (Q + R) tokens."""
    from erpo_jax.rl.synthetic import perturb, random_params, synthetic_batch
    B, G, Q, R = shape
    params = random_params(cfg, seed)
    ref = perturb(params, seed + 1, 0.5)
    batch = synthetic_batch(params, cfg, seed, num_queries=B, group_size=G, query_width=Q,
                            response_width=R, ref_params=ref)
    return params, ref, batch


def _variants(batch, ref_fn, ref_params):
    """name -> (LossConfig, batch, per-step prepare(batch) or None)."""
    uniform = batch._replace(query_weight=jnp.ones_like(batch.query_weight))
    with_ref = lambda b: b._replace(ref_logp=ref_fn(ref_params, b.tokens, b.attn_mask))
    return {
        "no_kl": (LossConfig(), uniform._replace(ref_logp=None), None),
        "erpo": (LossConfig(beta_query=BETA_QUERY), batch._replace(ref_logp=None), None),
        "policy_kl": (LossConfig(beta_policy=BETA_POLICY), uniform, with_ref),
    }


def _build(cfg, loss_cfg, group, chunk):
    from erpo_jax.train.config import AlgoSection, OptimSection
    from erpo_jax.train.train_step import build_update, make_optimizer
    tx, _ = make_optimizer(OptimSection(), 1000)
    return tx, build_update(cfg, loss_cfg, AlgoSection(), tx, group_size=group, temperature=1.0,
                            chunk_size=chunk)


def _xla_flops(cfg: ModelConfig, shape) -> dict:
    """Exact XLA FLOPs per variant on a 1-layer copy of cfg (see the module docstring)."""
    from erpo_jax.train.train_step import init_state, make_logprob_fn
    one = dataclasses.replace(cfg, num_layers=1)
    params, ref, batch = _train_setup(one, shape)
    ref_fn = make_logprob_fn(one, 1.0, None)
    out = {}
    for name, (lc, b, prep) in _variants(batch, ref_fn, ref).items():
        tx, update = _build(one, lc, shape[1], None)
        state = init_state(params, tx)
        if prep is not None:
            b = b._replace(ref_logp=jax.ShapeDtypeStruct(b.old_logp.shape, jnp.float32))
        flops = update.lower(state, b, None).compile().cost_analysis()["flops"]
        if prep is not None:
            flops += ref_fn.lower(ref, b.tokens, b.attn_mask).compile().cost_analysis()["flops"]
        out[name] = float(flops)
    return out


def regularizer_cost(preset: str, shape=(8, 4, 32, 32), repeats: int = 7,
                     chunk: int | None = 512, num_layers: int | None = None) -> dict:
    """Wall time (median, interleaved) and XLA FLOPs of one update per variant.

    num_layers: override the preset's depth. With one layer and an LM head that
    fits one chunk, the timed executables are the FLOP-exact ones (one compile
    per variant); otherwise FLOPs come from a 1-layer copy (`_xla_flops`).
    """
    from erpo_jax.train.train_step import init_state, make_logprob_fn
    cfg = PRESETS[preset]
    if num_layers:
        cfg = dataclasses.replace(cfg, num_layers=num_layers)
    B, G, Q, R = shape
    exact = cfg.num_layers == 1 and (chunk is None or chunk >= Q + R - 1)
    params, ref, batch = _train_setup(cfg, shape)
    ref_fn = make_logprob_fn(cfg, 1.0, chunk)
    ref_c = ref_fn.lower(ref, batch.tokens, batch.attn_mask).compile()
    runs, flops = {}, {}
    for name, (lc, b, prep) in _variants(batch, ref_c, ref).items():
        tx, update = _build(cfg, lc, G, chunk)
        state = init_state(jax.tree.map(jnp.copy, params), tx)
        b0 = b if prep is None else prep(b)
        compiled = update.lower(state, b0, None).compile()
        flops[name] = float(compiled.cost_analysis()["flops"])
        if prep is not None:
            flops[name] += float(ref_c.cost_analysis()["flops"])
        runs[name] = [compiled, state, b, prep]
    times = {k: [] for k in runs}
    for i in range(repeats + 1):  # round 0 warms up
        for name, run in runs.items():
            update, state, b, prep = run
            t0 = time.perf_counter()
            if prep is not None:
                b = prep(b)
            state, metrics = update(state, b, None)
            _block(metrics["loss"])
            if i:
                times[name].append(time.perf_counter() - t0)
            run[1] = state
    wall = {k: statistics.median(v) for k, v in times.items()}
    if not exact:
        flops = _xla_flops(cfg, shape)
    return {
        "preset": preset, "num_layers": cfg.num_layers, "rows": B * G,
        "tokens_per_row": Q + R, "repeats": repeats, "wall_s": wall,
        "xla_flops_1layer": flops,
        "erpo_over_no_kl_flops": flops["erpo"] / flops["no_kl"],
        "erpo_over_no_kl_wall": wall["erpo"] / wall["no_kl"],
        "policy_kl_over_no_kl_flops": flops["policy_kl"] / flops["no_kl"],
        "policy_kl_over_no_kl_wall": wall["policy_kl"] / wall["no_kl"],
        "peak_rss_mib": peak_rss_mib(),
    }


def train_mfu(preset: str, rows: int, T: int, peak_flops: float, repeats: int = 3,
              chunk: int | None = 512, dtype: str | None = None, profile_dir=None,
              breakdown: bool = True) -> dict:
    """MFU of the no-KL update on [rows, T] tokens, with a forward / backward
    breakdown (token_logprobs alone, its value_and_grad, the whole update)."""
    from erpo_jax.model.logprobs import token_logprobs
    from erpo_jax.train.train_step import init_state
    cfg = PRESETS[preset]
    if dtype:
        cfg = dataclasses.replace(cfg, param_dtype=dtype, compute_dtype=dtype)
    Q = max(2, T // 4)
    params, ref, batch = _train_setup(cfg, (rows // 2, 2, Q, T - Q))
    batch = batch._replace(ref_logp=None)
    tx, update = _build(cfg, LossConfig(), 2, chunk)
    state = init_state(params, tx)

    def lp_sum(p):
        return jnp.sum(token_logprobs(p, cfg, batch.tokens, batch.attn_mask,
                                      chunk_size=chunk).logp)
    fwd = jax.jit(lp_sum, compiler_options=xla_options.for_steps())
    fwd_bwd = jax.jit(jax.value_and_grad(lp_sum), compiler_options=xla_options.for_steps())
    times = {"forward": [], "forward_backward": [], "update": []} if breakdown else {"update": []}
    for i in range(repeats + 1):
        for name in times:
            t0 = time.perf_counter()
            if name == "update":
                state, m = update(state, batch, None)
                _block(m["loss"])
            else:
                _block((fwd if name == "forward" else fwd_bwd)(state.params))
            if i:
                times[name].append(time.perf_counter() - t0)
    if profile_dir:
        with jax.profiler.trace(str(profile_dir), create_perfetto_trace=True):
            state, m = update(state, batch, None)
            _block(m["loss"])
    wall = {k: statistics.median(v) for k, v in times.items()}
    flops = model_flops_per_step(cfg, rows, T)
    return {"preset": preset, "params_m": cfg.num_params() / 1e6, "rows": rows, "T": T,
            "dtype": cfg.compute_dtype, "model_flops": flops, "wall_s": wall,
            "model_flops_per_s": flops / wall["update"],
            "mfu": flops / wall["update"] / peak_flops, "peak_flops_per_s": peak_flops,
            "formula": "6*P_matmul*tokens + 12*L*H*K*T^2*rows",
            "peak_rss_mib": peak_rss_mib()}
