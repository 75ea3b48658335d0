"""BENCHMARKS.md "Session 16" to "Session 18" tables from `erpo plan --only
rollout --json` reports of the rollout engines
(experiments/results/plan/engines/). A decode step's bytes are its HBM
traffic counted from the compiled program (`erpo_jax/tools/hbm.py`), XLA's
own count beside it; the paged engine's step adds the pages the kernel
copies, counted from the page table (its `rollout_estimate`), and is set
against weights plus the KV the slots hold. The last table is each pool
engine's largest pool that fits (`erpo plan`'s `pool_capacity`, extrapolated
from the compiled peak), beside the pool each report compiled.

    .venv/bin/python experiments/profiles/engine_plan_table.py experiments/results/plan/engines/*.json
"""

from __future__ import annotations

import json
import re
import sys

GIB = 2 ** 30


def bucket(report: dict) -> int:
    """The prompt bucket the report's rollout programs were compiled at."""
    if "prompt_bucket" in report.get("rollout_estimate", {}):
        return report["rollout_estimate"]["prompt_bucket"]
    sizes = [int(t) for p in report["programs"]
             for t in re.findall(r"(\d+) (?:prompt \+|tokens into)", p["shapes"])]
    return max(sizes)


def main(paths: list[str]) -> None:
    reports = [json.load(open(p)) for p in paths]
    print("| config | topology | engine | slots | prompt bucket | decode steps per RL step "
          "| slot utilisation "
          "| rollout est. s per RL step | of which inserts s | largest program peak GiB/chip "
          "| one decode step reads GiB/chip, HBM (x minimum) | XLA's count GiB/chip |")
    print("|---|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for r in sorted(reports, key=lambda r: (r["config"], r["rollout_estimate"]["engine"],
                                            r["rollout_estimate"].get("slots", 0), bucket(r))):
        e = r["rollout_estimate"]
        peak = max(p["peak_gib"] for p in r["programs"])
        decode = next(p for p in r["programs"] if "step_bytes_accessed" in p or
                      "decode_step" in p)
        step = decode.get("decode_step")
        if "step_ratio" in e:   # the compiled step's HBM bytes plus the kernel's, from the page table
            nbytes = decode["step_bytes_accessed"] + e["kv_read_per_step_bytes"]
            ratio = nbytes / e["step_minimum_bytes"]
            xla = decode["step_xla_bytes_accessed"]
        else:
            nbytes, ratio, xla = step["bytes_accessed"], step["ratio"], step["xla_bytes_accessed"]
        inserts = f"{e['insert_ms'] / 1e3:.1f}" if "insert_ms" in e else "-"
        print(f"| {r['config']} | {r['topology']} | {e['engine']} | {e.get('slots', '-')} "
              f"| {bucket(r):,} | {e['decode_steps']:,} "
              f"| {100 * e['slot_utilization']:.0f}% | {e['estimated_ms'] / 1e3:.1f} "
              f"| {inserts} | {peak:.2f} | {nbytes / GIB:.2f} ({ratio:.2f}x) | {xla / GIB:.2f} |")
    print()
    print("| config | topology | program | peak GiB/chip | est. ms per call (per step for "
          "a decode) | compile s |")
    print("|---|---|---|---:|---:|---:|")
    for r in reports:
        for p in r["programs"]:
            ms = p.get("step_ms", p["estimated_ms"])
            print(f"| {r['config']} | {r['topology']} | {p['name']} ({p['shapes']}) "
                  f"| {p['peak_gib']:.2f} | {ms:,.1f} | {p['compile_s']:.0f} |")
    pools = [r for r in reports if "pool_capacity" in r]
    if pools:
        print()
        print("| config | topology | engine | pool compiled | GiB/chip left by its largest "
              "rollout program | largest pool that fits (extrapolated) | samples per RL step |")
        print("|---|---|---|---:|---:|---:|---:|")
    for r in pools:
        c = r["pool_capacity"]
        if "kv_pages" in c:
            now, most = f"{c['kv_pages_now']:,} pages", (f"{c['kv_pages']:,} pages "
                                                         f"({c['slots_at_longest']} samples)")
        else:
            now, most = f"{c['slots_now']} slots", f"{c['slots']:,} slots"
        print(f"| {r['config']} | {r['topology']} | {c['engine']} | {now} "
              f"| {c['free_bytes'] / GIB:.2f} | {most} | {c['samples_per_step']:,} |")


if __name__ == "__main__":
    main(sys.argv[1:])
