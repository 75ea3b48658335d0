"""BENCHMARKS.md section 5's tables from `erpo plan --json` reports.

    .venv/bin/python experiments/profiles/plan_table.py experiments/results/plan/*.json
"""

from __future__ import annotations

import json
import sys

GIB = 2 ** 30


def main(paths: list[str]) -> None:
    reports = [json.load(open(p)) for p in paths]
    print("| config | topology | program | peak GiB/chip | usable GiB | formula GiB | fits "
          "| FLOPs/chip | est. ms | compile s |")
    print("|---|---|---|---:|---:|---:|---|---:|---:|---:|")
    for r in reports:
        for p in r["programs"]:
            formula = f"{p['formula_gib']:.2f}" if p.get("formula_gib") is not None else ""
            print(f"| {r['config']} | {r['topology']} | {p['name']} ({p['shapes']}) "
                  f"| {p['peak_gib']:.2f} | {p['limit_gib']:.2f} | {formula} "
                  f"| {'yes' if p['fits'] else 'NO'} | {p['flops']:.3g} "
                  f"| {p['estimated_ms']:,.0f} ({p['bound']}) | {p['compile_s']:.0f} |")
    print()
    print("| config | topology | sampler | one decode step reads GiB/chip | minimum GiB "
          "(weights + KV once) | ratio | update est. MFU |")
    print("|---|---|---|---:|---:|---:|---:|")
    for r in reports:
        mfu = next((p["estimated_mfu"] for p in r["programs"] if "estimated_mfu" in p), None)
        for p in r["programs"]:
            d = p.get("decode_step")
            if d:
                print(f"| {r['config']} | {r['topology']} | {p['name']} "
                      f"| {d['bytes_accessed'] / GIB:.2f} | {d['minimum_bytes'] / GIB:.2f} "
                      f"| {d['ratio']:.2f}x | {'' if mfu is None else f'{mfu:.0%}'} |")


if __name__ == "__main__":
    main(sys.argv[1:])
