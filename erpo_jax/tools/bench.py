"""`erpo bench`: what a step, a rollout and an RL iteration cost, side by side in one run.

    python -m erpo_jax.tools.bench --quick --out bench.json     # under a minute on 2 CPU cores
    python -m erpo_jax.tools.bench --out bench.json             # full grid (the medium RL iteration
                                                          # alone takes many minutes on CPU)
    python -m erpo_jax.tools.bench --gpu --out gpu.json         # 0.5B-shaped bf16 model (GPU/TPU)

Sections (each row of the JSON carries the peak host RSS of the process so far):

  matmul_peak   FLOP/s of a large jitted matmul: this machine's attainable peak.
  regularizer   one real `build_update` step for no KL, ERPO (Query-KL + likelihood
                weights) and GRPO + Policy-KL (step plus the jitted reference
                forward, as the loop runs it): XLA FLOPs and interleaved wall time.
  mfu           train-step model FLOPs / time / matmul peak on medium-25m.
  sampler       decode tokens/s at several batches (erpo_jax.rollout.bench).
  rl_iteration  rollout + reward + advantages + reference + update through the
                Trainer's own `_rl_batch` / `_update`.
  memory        per-device bytes of parameters, AdamW state, KV cache and
                activations for the real-scale configs, from shapes and the
                sharding RULES.

XLA FLOPs: `cost_analysis()` counts a while-loop body once, whatever its trip
count, so FLOPs are taken on a copy of the timed config with one layer, one
micro-batch and an unchunked LM head (every loop runs once: the count is exact).
The regularizer's extra work does not grow with depth, so the 1-layer ratio is
an upper bound on the L-layer one.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import resource
import statistics
import tempfile
import time
from pathlib import Path
from unittest import mock

import jax
import jax.numpy as jnp
import numpy as np

from erpo_jax.runtime import xla_options
from erpo_jax.model.config import PRESETS, ModelConfig
from erpo_jax.rl.loss import LossConfig

SECTIONS = ("matmul_peak", "regularizer", "mfu", "sampler", "rl_iteration", "memory")

# Per-mode sizes. "test" is the smallest (the test suite), "quick" < 1 minute.
MODES = {
    "test": dict(peak_n=512, reg_preset="tiny", reg_layers=1, reg_shape=(2, 2, 8, 8),
                 reg_repeats=2,
                 mfu_preset="tiny", mfu_shape=(4, 32), mfu_repeats=2,
                 sampler=dict(presets=("tiny",), batches=(2,), new_tokens=4, repeats=1,
                              torch_threads=1),
                 rl=[dict(name="tiny", preset="tiny", prompts=4, group=2, prompt_len=16,
                          new_tokens=4, iters=2)]),
    "quick": dict(peak_n=1024, reg_preset="tiny", reg_layers=1, reg_shape=(8, 4, 32, 32),
                  reg_repeats=7,
                  mfu_preset="medium-25m", mfu_shape=(4, 128), mfu_repeats=2,
                  sampler=dict(presets=("tiny",), batches=(1, 32, 128), new_tokens=16,
                               repeats=1, torch_threads=1),
                  rl=[dict(name="tiny", preset="tiny", prompts=8, group=4, prompt_len=32,
                           new_tokens=32, iters=4)]),
    "full": dict(peak_n=2048, reg_preset="medium-25m", reg_shape=(4, 4, 64, 64),
                 reg_repeats=7, mfu_preset="medium-25m", mfu_shape=(8, 256), mfu_repeats=3,
                 sampler=dict(presets=("tiny", "medium-25m"), batches=(1, 32, 128),
                              new_tokens=32, repeats=2),
                 rl_cached=True,
                 rl=[dict(name="tiny", preset="tiny", prompts=8, group=4, prompt_len=32,
                          new_tokens=32, iters=12),
                     dict(name="medium", preset="medium-25m", prompts=64, group=8,
                          prompt_len=128, new_tokens=256, iters=2, micro_batches=16)]),
}
BETA_POLICY, BETA_QUERY = 0.04, 0.1


def peak_rss_mib() -> float:
    """The process's peak resident set so far, MiB (Linux reports KiB)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0


def _block(x):
    return jax.block_until_ready(x)


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


def model_flops_per_step(cfg: ModelConfig, rows: int, T: int) -> float:
    """Training FLOPs of one step over [rows, T] tokens (remat not counted):
    6 * P_mm * tokens + 12 * L * H * K * T^2 * rows, where P_mm are the
    matmul parameters (everything but the embedding table, which is a lookup;
    the LM head counts once even if tied) and the second term is the QK^T and
    PV attention matmuls over the full T x T square (our attention computes
    it, masked), forward x1 + backward x2."""
    p_mm = cfg.num_params() - cfg.vocab_size * cfg.hidden_size
    if cfg.tie_word_embeddings:
        p_mm += cfg.vocab_size * cfg.hidden_size
    attn = 12 * cfg.num_layers * cfg.num_heads * cfg.head_dim * T * T * rows
    return 6.0 * p_mm * rows * T + attn


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


# ----------------------------------------------------------------------------- RL iteration


def _padded_task_loader(width: int):
    """load_task, with each training prompt left-filled with spaces (after its
    BOS) to exactly `width` tokens, so the rollout has the benchmark's prompt length."""
    from erpo_jax.train import tasks as tasks_lib

    def load(cfg, tokenizer):
        task = tasks_lib.load_task(cfg, tokenizer)
        filler = tokenizer.encode_prompt(" ")[-1]
        task.train_prompts = [p[:1] + [filler] * (width - len(p)) + p[1:]
                              for p in task.train_prompts]
        return task
    return load


def rl_iteration(name: str, preset: str, prompts: int, group: int, prompt_len: int,
                 new_tokens: int, iters: int, micro_batches: int = 1,
                 beta_policy: float = BETA_POLICY, mesh=(-1, 1, 1),
                 compile_cache: str = "off", temperature: float = 1.0, top_k: int = 0,
                 optim: dict | None = None) -> dict:
    """Time `iters` RL steps through the Trainer's own `_rl_batch` + `_update`
    (rollout, arithmetic exact-match reward, GRPO advantages, the reference
    forward for Policy-KL, the update). Iteration 0 includes compilation;
    setup_s is the Trainer's construction (policy, task, reference pass), during
    which the update already compiles in the background (train.compile_ahead),
    so setup_s + first_iter_s is the time to the first finished step.
    mesh: (data, fsdp, tensor), the Trainer's default (all devices on data).
    compile_cache: train.compile_cache; 'off' (the default) measures cold
    compiles whatever the user's cache holds (see `first_iteration_cached`).
    temperature, top_k, optim (OptimSection fields): as a peer runs them."""
    from erpo_jax.train import loop as loop_lib
    from erpo_jax.train.config import (AlgoSection, DataSection, MeshSection, ModelSection,
                                       OptimSection, RolloutSection, RunConfig, TrainSection)
    with tempfile.TemporaryDirectory() as tmp:
        cfg = RunConfig(
            name=f"bench-{name}", model=ModelSection(init="random", preset=preset),
            data=DataSection(n_train=max(64, prompts), n_test=4, max_prompt_len=prompt_len),
            rollout=RolloutSection(group_size=group, max_new_tokens=new_tokens,
                                   temperature=temperature, top_k=top_k),
            algo=AlgoSection(method="grpo_policy_kl" if beta_policy > 0 else "no_kl"),
            loss=LossConfig(beta_policy=beta_policy),
            optim=OptimSection(micro_batches=micro_batches, **(optim or {})),
            mesh=MeshSection(tuple(mesh)),
            train=TrainSection(steps=iters, batch_size=prompts, out_dir=f"{tmp}/run",
                               eval_every=0, drift_every=0, drift_queries=4,
                               eval_max_problems=4, progress=False,
                               ref_cache_dir=f"{tmp}/ref", compile_cache=compile_cache))
        t0 = time.perf_counter()
        with mock.patch.object(loop_lib, "load_task", _padded_task_loader(prompt_len)):
            trainer = loop_lib.Trainer(cfg)
        setup = time.perf_counter() - t0
        try:
            times, parts, losses = [], [], []
            for step in range(iters):
                t0 = time.perf_counter()
                batch, cb, info, part, ro = trainer._rl_batch(step)
                t1 = time.perf_counter()
                losses.append(trainer._update(batch, cb, step)["loss"])
                times.append(time.perf_counter() - t0)
                parts.append({**part, "time/update": time.perf_counter() - t1})
            ref_calls, cache_dir = trainer.ref_forward_calls, trainer.compile_cache
        finally:
            trainer.close()
    steady = times[1:] or times
    breakdown = {k: statistics.median(p[k] for p in parts[1:] or parts) for k in parts[0]}
    return {"name": name, "preset": preset, "prompts": prompts, "group": group,
            "prompt_len": prompt_len, "new_tokens": new_tokens, "beta_policy": beta_policy,
            "micro_batches": micro_batches, "iters": iters, "setup_s": setup,
            "first_iter_s": times[0], "steady_iter_s": statistics.median(steady),
            "steady_breakdown_s": breakdown, "first_breakdown_s": parts[0], "ref_forward_calls": ref_calls,
            "iter_s": times, "parts": parts,
            "path": "Trainer._rl_batch + Trainer._update", "peak_rss_mib": peak_rss_mib(),
            "losses": losses, "compile_cache": cache_dir}


_CHILD = """
import json, sys
from jax import monitoring
from erpo_jax.tools import bench
counts = {"cache_hits": 0, "cache_misses": 0}
def count(name, **kw):
    key = name.rsplit("/", 1)[-1]
    if name.startswith("/jax/compilation_cache/") and key in counts:
        counts[key] += 1
monitoring.register_event_listener(count)
r = bench.rl_iteration(**json.loads(sys.argv[1]))
print("RESULT " + json.dumps({**r, **counts}))
"""


def first_iteration_cached(spec: dict, iters: int = 3) -> dict:
    """The RL iteration of `spec` (an entry of MODES[...]['rl']) in two fresh
    processes sharing an empty persistent compilation cache: 'cold' compiles
    and fills it, 'warm' (a rerun of the same config) loads the programs.
    Each: setup_s, first_iter_s, steady_iter_s, losses (identical in both),
    the cache's hits and misses, files_written (new cache entries) and
    process_s (the whole process, imports included).

    Both processes write every program, however fast it compiled (JAX's
    minimum compile time set to 0): with the usual threshold a program that
    compiles just under it on a loaded host is not written, and the warm run
    compiles it again (seen as a flaky 'warm run missed 1-2 programs')."""
    import os
    import subprocess
    import sys
    out = {}
    env = {**os.environ, "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0"}
    with tempfile.TemporaryDirectory() as cache:
        child = {**spec, "iters": iters, "compile_cache": cache}
        for run in ("cold", "warm"):
            before = set(Path(cache).iterdir())
            t0 = time.perf_counter()
            proc = subprocess.run([sys.executable, "-c", _CHILD, json.dumps(child)],
                                  capture_output=True, text=True, env=env)
            wall = time.perf_counter() - t0
            lines = [x for x in proc.stdout.splitlines() if x.startswith("RESULT ")]
            if proc.returncode or not lines:
                raise RuntimeError(f"bench: the {run} compile-cache run failed "
                                   f"(exit {proc.returncode}):\n{proc.stderr[-3000:]}")
            r = json.loads(lines[-1][len("RESULT "):])
            keep = ("setup_s", "first_iter_s", "steady_iter_s", "losses", "cache_hits",
                    "cache_misses")
            out[run] = {**{k: r[k] for k in keep}, "process_s": wall,
                        "files_written": len(set(Path(cache).iterdir()) - before)}
    return {"name": spec["name"], "iters": iters, **out}


# ----------------------------------------------------------------------------- memory

# Real-scale settings: (preset, hardware, devices, HBM GiB/device, mesh (data, fsdp,
# tensor), rollout rows, prompt + new tokens, rows per device per micro-batch).
REAL_SCALE = [
    ("qwen2.5-math-1.5b", "TPU v4-8", 4, 32.0, (1, 4, 1), 512, (512, 1024), 4),
    ("qwen2.5-7b", "TPU v5e-16", 16, 16.0, (1, 16, 1), 512, (512, 1024), 1),
]
_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}


def _per_device_param_bytes(cfg: ModelConfig, mesh: dict, dtype_bytes: int) -> float:
    from erpo_jax.model import model as model_lib
    from erpo_jax.model.sharding import RULES, axis_size, logical_to_spec
    logical = model_lib.param_logical_axes(cfg)
    shapes = model_lib.abstract_params(cfg)
    total = 0.0
    is_leaf = lambda x: isinstance(x, tuple) and all(isinstance(a, (str, type(None))) for a in x)
    for ax, leaf in zip(jax.tree_util.tree_leaves(logical, is_leaf=is_leaf),
                        jax.tree_util.tree_leaves(shapes)):
        split = 1
        for m in logical_to_spec(ax, RULES):
            split *= axis_size(_FakeMesh(mesh), m)
        total += np.prod(leaf.shape) * dtype_bytes / split
    return total


class _FakeMesh:
    """Just the `.shape` mapping that sharding.axis_size reads (no devices needed)."""

    def __init__(self, shape: dict):
        self.shape = shape


def memory_estimate(preset: str, hardware: str, devices: int, hbm_gib: float, mesh_shape,
                    rollout_rows: int, lengths, micro_rows: int, param_dtype="float32",
                    compute_dtype="bfloat16", chunk: int = 512) -> dict:
    """Per-device GiB of each state, from shapes (see BENCHMARKS.md for the formulas)."""
    cfg = dataclasses.replace(PRESETS[preset], param_dtype=param_dtype,
                              compute_dtype=compute_dtype)
    mesh = dict(zip(("data", "fsdp", "tensor"), mesh_shape))
    dp, tp = mesh["data"] * mesh["fsdp"], mesh["tensor"]
    pb, cb = _BYTES[param_dtype], _BYTES[compute_dtype]
    G = 2 ** 30
    params = _per_device_param_bytes(cfg, mesh, pb)
    opt = 2 * _per_device_param_bytes(cfg, mesh, 4)
    P, Nn = lengths
    T = P + Nn
    L, D, F, H, N, K, V = (cfg.num_layers, cfg.hidden_size, cfg.intermediate_size,
                           cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.vocab_size)
    kv = 2 * L * (rollout_rows / dp) * (T - 1) * (N / min(tp, N)) * K * cb
    m = micro_rows
    per_layer = (m * T * cb * (4 * D + (3 * H * K + 3 * N * K) / tp + 4 * F / tp)
                 + m * (H / tp) * T * T * (4 + cb))
    head = 3 * m * min(chunk, T) * (V / tp) * 4
    act_remat = L * m * T * D * cb + per_layer + head
    act_full = L * per_layer + head
    train_remat = params + params + opt + act_remat   # params + grads + moments + activations
    train_full = params + params + opt + act_full
    rollout = params + kv
    row = {"preset": preset, "hardware": hardware, "devices": devices, "hbm_gib": hbm_gib,
           "mesh": mesh, "param_dtype": param_dtype, "compute_dtype": compute_dtype,
           "params_b": cfg.num_params() / 1e9, "rollout_rows": rollout_rows,
           "prompt_plus_new": list(lengths), "micro_rows_per_device": m,
           "gib": {"params": params / G, "grads": params / G, "adam_moments": opt / G,
                   "kv_cache": kv / G, "activations_remat": act_remat / G,
                   "activations_no_remat": act_full / G, "train_peak_remat": train_remat / G,
                   "train_peak_no_remat": train_full / G, "rollout_peak": rollout / G,
                   "reference_params_if_policy_kl": params / G}}
    row["fits_remat"] = bool(max(train_remat, rollout) / G <= hbm_gib)
    row["fits_no_remat"] = bool(max(train_full, rollout) / G <= hbm_gib)
    return row


# ----------------------------------------------------------------------------- the run


def _print_tables(res: dict) -> None:
    p = res.get("matmul_peak")
    if p:
        print(f"\nmatmul peak ({p['dtype']} {p['n']}^2): {p['flops_per_s'] / 1e9:,.1f} GFLOP/s")
    r = res.get("regularizer")
    if r:
        print(f"\nRegularizer cost: one update, {r['preset']} ({r['num_layers']} layers), "
              f"{r['rows']} rows x "
              f"{r['tokens_per_row']} tokens (median of {r['repeats']}, interleaved)")
        print(f"{'variant':<12}{'wall ms':>10}{'x no-KL':>9}{'XLA GFLOP (1 layer)':>22}{'x no-KL':>9}")
        for k in ("no_kl", "erpo", "policy_kl"):
            w, f = r["wall_s"][k], r["xla_flops_1layer"][k]
            print(f"{k:<12}{w * 1e3:>10.2f}{w / r['wall_s']['no_kl']:>9.3f}"
                  f"{f / 1e9:>22.4f}{f / r['xla_flops_1layer']['no_kl']:>9.4f}")
    m = res.get("mfu")
    if m:
        w = m["wall_s"]
        print(f"\nTrain-step MFU: {m['preset']} ({m['params_m']:.1f}M, {m['dtype']}), "
              f"{m['rows']} x {m['T']} tokens: {m['model_flops'] / 1e9:.1f} GFLOP "
              f"in {w['update'] * 1e3:.0f} ms = {m['model_flops_per_s'] / 1e9:.1f} GFLOP/s, "
              f"MFU {100 * m['mfu']:.1f}%")
        if "forward" in w:
            print(f"  breakdown: forward {w['forward'] * 1e3:.0f} ms, forward+backward "
                  f"{w['forward_backward'] * 1e3:.0f} ms, whole update {w['update'] * 1e3:.0f} ms")
    if res.get("sampler"):
        from erpo_jax.rollout.bench import print_table
        print_table(res["sampler"])
    rows = res.get("rl_iteration") or []
    if rows:
        print("\nWhole RL iteration (Trainer._rl_batch + _update; Policy-KL beta "
              f"{rows[0]['beta_policy']}, reference forward each step)")
        print(f"{'config':<8}{'prompts x G':>12}{'P + N':>10}{'setup s':>9}{'first s':>9}"
              f"{'steady s':>10}{'rollout':>9}{'reward':>8}{'ref':>8}{'update':>8}")
        for x in rows:
            b = x["steady_breakdown_s"]
            print(f"{x['name']:<8}{x['prompts']:>7} x {x['group']:<3}"
                  f"{x['prompt_len']:>5} +{x['new_tokens']:>4}{x['setup_s']:>9.2f}"
                  f"{x['first_iter_s']:>9.2f}"
                  f"{x['steady_iter_s']:>10.4f}{b['time/rollout']:>9.4f}{b['time/reward']:>8.4f}"
                  f"{b['time/ref']:>8.4f}{b['time/update']:>8.4f}")
    c = res.get("rl_first_cached")
    if c:
        print(f"\nFirst RL iteration ({c['name']}), persistent compilation cache: "
              "two fresh processes")
        print(f"{'cache':<7}{'setup s':>9}{'first s':>9}{'steady s':>10}{'process s':>11}"
              f"{'hits':>6}{'misses':>8}{'written':>9}")
        for run in ("cold", "warm"):
            x = c[run]
            print(f"{run:<7}{x['setup_s']:>9.2f}{x['first_iter_s']:>9.2f}"
                  f"{x['steady_iter_s']:>10.4f}{x['process_s']:>11.1f}"
                  f"{x['cache_hits']:>6}{x['cache_misses']:>8}{x['files_written']:>9}")
    if res.get("peer"):
        from erpo_jax.tools import bench_peer
        bench_peer.print_table(res["peer"])
    mem = res.get("memory") or []
    if mem:
        print("\nPer-device memory, GiB (params fp32, compute bf16; AdamW moments fp32)")
        print(f"{'model':<19}{'hardware':<12}{'params':>7}{'grads':>7}{'adam':>7}{'kv':>7}"
              f"{'act r':>7}{'act nr':>8}{'train r':>8}{'rollout':>8}{'HBM':>6}  fits")
        for x in mem:
            g = x["gib"]
            print(f"{x['preset']:<19}{x['hardware']:<12}{g['params']:>7.2f}{g['grads']:>7.2f}"
                  f"{g['adam_moments']:>7.2f}{g['kv_cache']:>7.2f}{g['activations_remat']:>7.2f}"
                  f"{g['activations_no_remat']:>8.2f}{g['train_peak_remat']:>8.2f}"
                  f"{g['rollout_peak']:>8.2f}{x['hbm_gib']:>6.0f}  "
                  f"remat {'yes' if x['fits_remat'] else 'NO'}, "
                  f"no remat {'yes' if x['fits_no_remat'] else 'NO'}")
    print(f"\npeak host RSS: {res['peak_rss_mib']:,.0f} MiB; total {res['total_s']:.1f} s")


def run_bench(mode: str = "quick", sections=SECTIONS, with_hf: bool = True,
              skip_medium_rl: bool = False, profile_dir=None, verbose: bool = True,
              peer: dict | None = None) -> dict:
    """Run the sections of `mode` ('test', 'quick' or 'full'); return the JSON dict.
    peer: arguments of `bench_peer.compare`; then the rl_iteration section is the
    side-by-side run against the peer on its configs (instead of the mode's)."""
    from erpo_jax.rollout.bench import bench_sampler
    m = MODES[mode]
    t_start = time.perf_counter()
    res = {"mode": mode, "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
           "backend": jax.default_backend(), "devices": jax.device_count(),
           "jax": jax.__version__}
    clock = [time.perf_counter()]

    def say(s):
        if verbose:
            print(f"[{time.perf_counter() - clock[0]:6.1f} s] {s}", flush=True)
    peak = matmul_peak(m["peak_n"])
    res["matmul_peak"] = peak
    if "regularizer" in sections:
        say("regularizer cost ...")
        res["regularizer"] = regularizer_cost(m["reg_preset"], m["reg_shape"], m["reg_repeats"],
                                              num_layers=m.get("reg_layers"))
    if "mfu" in sections:
        say("train-step MFU ...")
        rows, T = m["mfu_shape"]
        res["mfu"] = train_mfu(m["mfu_preset"], rows, T, peak["flops_per_s"], m["mfu_repeats"],
                               profile_dir=profile_dir, breakdown=mode == "full")
    if "sampler" in sections:
        say("sampler ...")
        res["sampler"] = bench_sampler(**m["sampler"], with_hf=with_hf, verbose=False)
        res["sampler"]["peak_rss_mib"] = peak_rss_mib()
    if "rl_iteration" in sections and peer is not None:
        from erpo_jax.tools import bench_peer
        say("RL iteration vs the peer (fresh processes, interleaved) ...")
        res["peer"] = bench_peer.compare(**peer, peak_flops=peak["flops_per_s"], say=say)
    elif "rl_iteration" in sections:
        res["rl_iteration"] = []
        for spec in m["rl"]:
            if skip_medium_rl and spec["name"] == "medium":
                continue
            say(f"RL iteration ({spec['name']}) ...")
            res["rl_iteration"].append(rl_iteration(**spec))
        if m.get("rl_cached"):
            say("RL first iteration, cold and warm compilation cache (two processes) ...")
            res["rl_first_cached"] = first_iteration_cached(m["rl"][0])
    if "memory" in sections:
        res["memory"] = [memory_estimate(*spec) for spec in REAL_SCALE]
    res["peak_rss_mib"] = peak_rss_mib()
    res["total_s"] = time.perf_counter() - t_start
    res["targets"] = targets(res)
    if verbose:
        _print_tables(res)
        for k, v in res["targets"].items():
            print(f"target {k}: {'met' if v['met'] else 'NOT met'} ({v['value']:.4g} vs {v['goal']})")
    return res


def targets(res: dict) -> dict:
    """Each issue-9 target that this run measured: value, goal, met."""
    out = {}

    def add(name, value, goal, ok):
        out[name] = {"value": float(value), "goal": goal, "met": bool(ok)}
    r = res.get("regularizer")
    if r:
        add("erpo_flops_ratio", r["erpo_over_no_kl_flops"], "<= 1.01",
            r["erpo_over_no_kl_flops"] <= 1.01)
        add("erpo_wall_ratio", r["erpo_over_no_kl_wall"], "<= 1.03",
            r["erpo_over_no_kl_wall"] <= 1.03)
    if res.get("mfu"):
        add("train_mfu", res["mfu"]["mfu"], ">= 0.40", res["mfu"]["mfu"] >= 0.40)
    for x in res.get("rl_iteration") or []:
        if x["name"] == "tiny":
            add("rl_tiny_first_s", x["first_iter_s"], "< 3", x["first_iter_s"] < 3.0)
    for size, x in ((res.get("peer") or {}).get("configs") or {}).items():
        if "ratio" in x:
            add(f"rl_{size}_vs_tunix", x["ratio"], "<= 0.5", x["ratio_max"] <= 0.5)
    c = res.get("rl_first_cached")
    if c:  # the same target, on a rerun that finds its programs in the compilation cache
        w = c["warm"]["first_iter_s"]
        add("rl_tiny_first_warm_cache_s", w, "< 3", w < 3.0)
    for x in (res.get("sampler") or {}).get("rows", []):
        if x["batch"] == 32 and x["speedup_vs_hf"] is not None:
            add(f"sampler_{x['preset']}_b32_vs_hf", x["speedup_vs_hf"], ">= 5",
                x["speedup_vs_hf"] >= 5)
    return out


def run_gpu(preset: str = "qwen2.5-0.5b", dtype: str = "bfloat16", rows: int = 16, T: int = 1024,
            batches=(1, 32, 128), new_tokens: int = 128, prompt_len: int = 64,
            peak_n: int = 8192, verbose: bool = True) -> dict:
    """Accelerator mode: bf16 matmul peak, train-step MFU and sampler tokens/s of
    a random `preset` model in `dtype` (no transformers column)."""
    from erpo_jax.rollout.bench import bench_sampler
    t_start = time.perf_counter()
    dt = jnp.dtype(dtype)
    res = {"mode": "gpu", "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
           "backend": jax.default_backend(), "devices": jax.device_count(),
           "device_kind": jax.devices()[0].device_kind, "jax": jax.__version__}
    res["matmul_peak"] = matmul_peak(peak_n, dt)
    res["mfu"] = train_mfu(preset, rows, T, res["matmul_peak"]["flops_per_s"], 3, dtype=dtype)
    res["sampler"] = bench_sampler(presets=(preset,), batches=batches, prompt_len=prompt_len,
                                   new_tokens=new_tokens, repeats=2, with_hf=False,
                                   dtype=dtype, verbose=False)
    res["peak_rss_mib"] = peak_rss_mib()
    res["total_s"] = time.perf_counter() - t_start
    if verbose:
        _print_tables(res)
    return res


# ----------------------------------------------------------------------------- CLI


def add_parser(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser("bench", help="benchmarks: regularizer cost, MFU, sampler, RL "
                              "iteration, memory (prints a table, writes JSON)")
    _add_arguments(p)
    p.set_defaults(func=run)
    return p


def _add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--quick", action="store_true", help="the small grid (under a minute on CPU)")
    p.add_argument("--mode", choices=sorted(MODES), default=None,
                   help="size preset (overrides --quick); 'test' is the smallest")
    p.add_argument("--sections", nargs="+", choices=SECTIONS, default=list(SECTIONS))
    p.add_argument("--out", default=None, help="write the results to this JSON file")
    p.add_argument("--no-hf", action="store_true", help="skip the transformers column")
    p.add_argument("--skip-medium-rl", action="store_true",
                   help="full mode without the (slow) medium RL iteration")
    p.add_argument("--profile", default=None, help="write a perfetto trace of one MFU update here")
    p.add_argument("--peer", choices=["tunix"], default=None,
                   help="rl_iteration side by side with google-tunix on its configs "
                        "(erpo_jax/tools/bench_peer.py)")
    p.add_argument("--peer-sizes", nargs="+", choices=["tiny", "small"],
                   default=["tiny", "small"])
    p.add_argument("--peer-reps", type=int, default=3, help="interleaved repetitions")
    p.add_argument("--peer-iters", type=int, default=6, help="RL iterations per process")
    p.add_argument("--gpu", action="store_true", help="accelerator mode (see run_gpu)")
    p.add_argument("--gpu-preset", default="qwen2.5-0.5b")
    p.add_argument("--gpu-rows", type=int, default=16)
    p.add_argument("--gpu-T", type=int, default=1024)
    p.add_argument("--gpu-new-tokens", type=int, default=128)
    p.add_argument("--gpu-batches", type=int, nargs="+", default=[1, 32, 128])
    p.add_argument("--gpu-peak-n", type=int, default=8192)


def run(args: argparse.Namespace) -> dict:
    if args.gpu:
        res = run_gpu(args.gpu_preset, rows=args.gpu_rows, T=args.gpu_T,
                      batches=tuple(args.gpu_batches), new_tokens=args.gpu_new_tokens,
                      peak_n=args.gpu_peak_n)
    else:
        mode = args.mode or ("quick" if args.quick else "full")
        peer = None if args.peer is None else dict(
            sizes=tuple(args.peer_sizes), reps=args.peer_reps, iters=args.peer_iters)
        res = run_bench(mode, tuple(args.sections), with_hf=not args.no_hf,
                        skip_medium_rl=args.skip_medium_rl, profile_dir=args.profile,
                        peer=peer)
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(res, indent=2, default=str))
        print(f"wrote {args.out}")
    return res


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(prog="erpo bench", description=__doc__.split("\n\n")[0])
    _add_arguments(p)
    return run(p.parse_args(argv))


if __name__ == "__main__":
    main()
