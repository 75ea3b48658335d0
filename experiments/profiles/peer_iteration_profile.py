"""Where one RL iteration of `erpo bench --peer`'s configs spends its time.

Builds the Trainer exactly as `erpo bench --peer tunix` does (same preset, rows,
lengths, beta, sampling and optimizer), runs `--warm` iterations, then traces
one more with `jax.profiler` and adds the trace's events up by HLO op, per
program (rollout, reference, update). Prints the top ops of each program with
their share of that program's time.

    python experiments/profiles/peer_iteration_profile.py small [--top 25] [--trace DIR]
    python experiments/profiles/peer_iteration_profile.py tiny --update-calls 10

--update-calls N traces N update calls on one batch instead, and prints per
op its fastest and its median call: the sum of the minima against the sum
of the medians is how much of the update's op time is contention.
"""

from __future__ import annotations

import argparse
import collections
import gzip
import json
import os
import re
import statistics
import tempfile
import time
from pathlib import Path

from erpo_jax.tools.bench.peer import CONFIGS, MATCH
from erpo_jax.tools.bench.rl import bench_trainer


def op_events(trace_dir: Path):
    """(module, HLO op, microseconds) of each op event in the perfetto trace
    of the CPU backend, whose op events carry their module (`jit_<function>`)
    and op name."""
    path = next(trace_dir.rglob("perfetto_trace.json.gz"))
    events = json.loads(gzip.decompress(path.read_bytes()))
    events = events["traceEvents"] if isinstance(events, dict) else events
    for e in events:
        args = e.get("args") or {}
        if e.get("ph") == "X" and "hlo_op" in args and "hlo_module" in args:
            yield args["hlo_module"], args["hlo_op"], e["dur"]


def op_times(trace_dir: Path) -> dict[str, dict[str, float]]:
    """program -> {HLO op: microseconds} summed over the trace."""
    out: dict[str, dict[str, float]] = collections.defaultdict(collections.Counter)
    for module, op, dur in op_events(trace_dir):
        out[module][op] += dur
    return out


def op_descriptions(dump_dir: Path) -> dict[str, dict[str, str]]:
    """module -> {op: "shape  source op"} from XLA's optimized-HLO dumps, so a
    fusion's name in the trace can be read as what it computes."""
    out: dict[str, dict[str, str]] = {}
    line_re = re.compile(r"^\s*(?:ROOT )?%?([\w.\-]+) = (\S+) ")
    src_re = re.compile(r'op_name="([^"]*)"')
    for f in dump_dir.glob("*.cpu_after_optimizations.txt"):
        module = f.name.split(".", 2)[1]
        ops = out.setdefault(module, {})
        for line in f.read_text().splitlines():
            m = line_re.match(line)
            if m and m.group(1) not in ops:
                src = src_re.search(line)
                src = src.group(1) if src else ""
                ops[m.group(1)] = f"{m.group(2)[:40]}  {src.split('/', 1)[-1][-70:]}"
    return out


def op_spread(trace_dir: Path, module: str = "jit_update") -> dict[str, list[float]]:
    """op -> its durations (us) over the traced calls of `module`."""
    out: dict[str, list[float]] = collections.defaultdict(list)
    for m, op, dur in op_events(trace_dir):
        if m == module:
            out[op].append(dur)
    return out


def update_calls(trainer, n: int, warm: int, trace: Path, top: int) -> None:
    """Trace n update calls on step `warm`'s batch; print each op's min and median."""
    import jax
    batch, cb, *_ = trainer._rl_batch(warm)
    walls = []
    with jax.profiler.trace(str(trace), create_perfetto_trace=True):
        for i in range(n):
            t0 = time.perf_counter()
            trainer._update(batch, cb, warm + i)
            walls.append(time.perf_counter() - t0)
    ops = op_spread(trace)
    mins = sum(min(v) for v in ops.values())
    meds = sum(statistics.median(v) for v in ops.values())
    print(f"{n} update calls: wall {min(walls) * 1e3:.1f}-{max(walls) * 1e3:.1f} ms; "
          f"{sum(map(len, ops.values())) / n:.0f} ops per call; per op, the sum of the "
          f"fastest calls {mins / 1e3:.1f} ms, of the medians {meds / 1e3:.1f} ms")
    for name, v in sorted(ops.items(), key=lambda kv: -statistics.median(kv[1]))[:top]:
        print(f"  {name:36s} min {min(v):8.1f}  median {statistics.median(v):8.1f}  "
              f"max {max(v):8.1f} us")


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("size", choices=sorted(CONFIGS))
    ap.add_argument("--warm", type=int, default=2, help="untraced iterations first")
    ap.add_argument("--top", type=int, default=25)
    ap.add_argument("--trace", default=None, help="keep the trace here")
    ap.add_argument("--update-calls", type=int, default=0,
                    help="trace this many update calls instead of one iteration")
    args = ap.parse_args(argv)
    dump = Path(tempfile.mkdtemp(prefix="erpo-hlo-"))
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") +
                               f" --xla_dump_to={dump} --xla_dump_hlo_as_text")
    import jax   # after XLA_FLAGS: the dump names what each traced op computes

    spec = {**CONFIGS[args.size], **MATCH, "name": args.size,
            "iters": args.warm + 1 + args.update_calls, "mesh": (1, 1, 1)}
    trace = Path(args.trace or tempfile.mkdtemp(prefix="erpo-prof-"))
    with bench_trainer(**spec) as (trainer, _):
        for step in range(args.warm):
            batch, cb, *_ = trainer._rl_batch(step)
            trainer._update(batch, cb, step)
        if args.update_calls:
            update_calls(trainer, args.update_calls, args.warm, trace, args.top)
            return
        with jax.profiler.trace(str(trace), create_perfetto_trace=True):
            t0 = time.perf_counter()
            batch, cb, _, part, _ = trainer._rl_batch(args.warm)
            t1 = time.perf_counter()
            trainer._update(batch, cb, args.warm)
            t2 = time.perf_counter()
    print(f"{args.size}: iteration {t2 - t0:.3f} s (update {t2 - t1:.3f} s; "
          + ", ".join(f"{k} {v:.3f} s" for k, v in part.items()) + f"); trace in {trace}")
    what = op_descriptions(dump)
    for prog, ops in sorted(op_times(trace).items(), key=lambda kv: -sum(kv[1].values())):
        total = sum(ops.values())
        print(f"\n{prog}: {total / 1e6:.3f} s in {len(ops)} ops")
        desc = what.get(prog, {})
        for name, us in ops.most_common(args.top):
            print(f"  {us / 1e3:10.1f} ms  {100 * us / total:5.1f}%  {name:<28} {desc.get(name, '')}")


if __name__ == "__main__":
    main()
