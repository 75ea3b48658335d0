"""BENCHMARKS.md's targets table from a committed `erpo bench --out` report.

    .venv/bin/python experiments/profiles/bench_targets.py experiments/results/bench/targets.json

Every target is a ratio measured in the same run (against the peer, the same
run's matmul peak, the no-KL step, transformers); seconds are context, with the
machine the report names.
"""

from __future__ import annotations

import json
import sys

# target key -> (what is compared, how the ratio is read)
LABELS = {
    "erpo_flops_ratio": "ERPO / no-KL train step, XLA FLOPs",
    "erpo_wall_ratio": "ERPO / no-KL train step, wall (interleaved)",
    "train_mfu": "train-step MFU (model FLOPs / same-run matmul peak)",
    "rl_tiny_vs_tunix": "RL iteration / google-tunix's, tiny config (steady)",
    "rl_small_vs_tunix": "RL iteration / google-tunix's, small config (steady)",
    "sampler_tiny_b32_vs_hf": "sampler tokens/s / transformers', tiny, batch 32",
    "sampler_medium-25m_b32_vs_hf": "sampler tokens/s / transformers', medium-25m, batch 32",
    "rl_tiny_first_s": "first RL iteration, cold compile (s)",
    "rl_tiny_first_warm_cache_s": "first RL iteration, programs from the compilation cache (s)",
}


def rows(report: dict) -> list[str]:
    peer = (report.get("peer") or {}).get("configs") or {}
    out = ["| target | goal | measured | met? |", "|---|---|---|---|"]
    for key, t in report["targets"].items():
        value = f"{100 * t['value']:.1f}%" if key == "train_mfu" else f"{t['value']:.4f}"
        size = key[3:-9] if key.endswith("_vs_tunix") else None
        if size in peer:   # the ratio's spread over the interleaved repetitions
            value += f" [{peer[size]['ratio_min']:.3f}, {peer[size]['ratio_max']:.3f}]"
        out.append(f"| {LABELS.get(key, key)} | {t['goal']} | {value} | "
                   f"{'**met**' if t['met'] else 'not met'} |")
    return out


def main(paths: list[str]) -> int:
    for p in paths:
        report = json.load(open(p))
        peak = report.get("matmul_peak", {}).get("flops_per_s")
        h = report.get("host", {})
        print(f"`{p}`: {report.get('date', '?')}, {h.get('cpu', '?')} ({h.get('cores', '?')} "
              f"cores), jax {report.get('jax', '?')} on {report.get('backend', '?')}"
              + (f"; same-run matmul peak {peak / 1e9:.0f} GFLOP/s." if peak else "."))
        print()
        print("\n".join(rows(report)))
        print()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
