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
  engines       the static and continuous rollout engines on the same samples
                of model-made varied lengths: decode steps, slot utilisation,
                wall (`engines`).
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

Modules, one per kind of section: `step` (matmul_peak, regularizer, mfu),
`rl` (rl_iteration, the cold/warm compilation cache), `memory` (the hand
formula), `peer` (`--peer tunix`); `common` holds the sizes per mode. The
sampler section is `erpo_jax.rollout.bench`. This module runs them and prints.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import jax
import jax.numpy as jnp

from erpo_jax.tools.bench.common import MODES, SECTIONS, host, peak_rss_mib
from erpo_jax.tools.bench.memory import REAL_SCALE, memory_estimate
from erpo_jax.tools.bench.rl import first_iteration_cached, rl_iteration
from erpo_jax.tools.bench.step import matmul_peak, regularizer_cost, train_mfu
from erpo_jax.tools.bench.step import model_flops_per_step  # noqa: F401 (erpo plan, peer)


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
    if res.get("engines"):
        from erpo_jax.tools.bench import engines as bench_engines
        bench_engines.print_table(res["engines"])
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
        from erpo_jax.tools.bench import peer as bench_peer
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
           "jax": jax.__version__, "host": host()}
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
    if "engines" in sections:
        from erpo_jax.tools.bench.engines import bench_engines
        say("rollout engines, varied lengths ...")
        res["engines"] = bench_engines(**m["engines"])
    if "rl_iteration" in sections and peer is not None:
        from erpo_jax.tools.bench import peer as bench_peer
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
    e = res.get("engines")
    if e:
        c = e["engines"]["continuous"]
        add("engines_steps_ratio", e["steps_ratio"], "<= 0.5", e["steps_ratio"] <= 0.5)
        add("engines_wall_ratio", e["wall_ratio"], "<= 0.6", e["wall_ratio"] <= 0.6)
        add("engines_slot_utilization", c["slot_utilization"], ">= 0.75",
            c["slot_utilization"] >= 0.75)
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
                        "(erpo_jax/tools/bench/peer.py)")
    p.add_argument("--peer-sizes", nargs="+", choices=["tiny", "small", "varied"],
                   default=["tiny", "small"])
    p.add_argument("--peer-reps", type=int, default=3, help="interleaved repetitions")
    p.add_argument("--peer-iters", type=int, default=6, help="RL iterations per process")
    p.add_argument("--no-share-query", action="store_true",
                   help="run every response row's query whole in our update and reference "
                        "forward (model.share_query=false), as the peer does")
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
            sizes=tuple(args.peer_sizes), reps=args.peer_reps, iters=args.peer_iters,
            share_query=not args.no_share_query)
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
