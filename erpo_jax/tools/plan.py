"""`erpo plan`: compile every per-step program of a run for a Cloud TPU topology,
on this (CPU) host, with XLA's TPU compiler, and report what each needs.

    erpo plan --config experiments/real_scale.py --topology v4-8 [--json out.json]
    erpo plan --config FILE --topology v5e-16 --suggest

It needs libtpu (`pip install -e '.[test]'` or the `tpu` extra), never a TPU:
`jax.experimental.topologies` gives abstract TPU devices, a mesh over them
holds the config's mesh, and the Trainer's own programs (`train.programs`)
are lowered on ShapeDtypeStructs in their NamedShardings and compiled. A
multi-host topology compiles as the one SPMD program over all chips that
`jax.distributed` runs on it.

Per program and per chip it reports the compiler's memory analysis
(arguments, outputs, temporaries, aliased (donated) bytes, generated code),
the peak = arguments + outputs - aliased + temporaries + code against the
chip's HBM less a stated margin, the compiler's FLOPs, the bytes it moves to
and from HBM, and a roofline time estimate max(FLOPs / peak FLOP/s, bytes /
HBM bandwidth).

Bytes are HBM traffic counted from the compiled program's own placement
(`tools.hbm`: each top-level instruction's operands and results in HBM, once),
reported as `hbm_bytes` and used as `bytes_accessed`. XLA's "bytes accessed"
(kept as `xla_bytes_accessed`) also counts on-chip VMEM traffic: the TPU
compiler stages a decode step's weights into VMEM and that count then charges
each weight about 5 times (issue 48), so it overstated a decode step by ~3
GiB per chip on the 1.5B v4-8 plan. Plans before session 18 used it.

XLA's cost analysis counts the body of every loop once: the decode loop, the
layer scan, the micro-batch scan, the LM-head chunks. So the estimates are
built as follows, and labelled as estimates:
- rollout and evaluation: the engine's programs (`Engine.step_programs`),
  each decode loop's step compiled by itself (`DecodeLoop`). A loop whose
  steps a call fixes (the static engine's cache phases, every row assumed
  to run to max_new_tokens: an upper bound, as is counting each loop's body
  in the program's numbers too) adds them to the program's numbers; a loop
  whose steps the engine's schedule decides (the continuous engine's pool)
  reports its step's cost, which the rollout estimate multiplies out
  (`Engine.plan_estimate`);
- update, reference forward, reference pass (layer scans): FLOPs are the
  model FLOPs from the shapes (`bench.model_flops_per_step`: 6 (2 forward-only)
  x matmul parameters x tokens + attention, plus one forward more with
  remat; the update's and the reference forward's with each group's query
  counted once under model.share_query), bytes from the compiled program
  (a lower bound: a loop body once), so their time is the compute bound;
- collectives (all-gathers, reduce-scatters over ICI or DCN) are in neither.

For a pool engine (continuous, paged) it also reports the largest pool that
fits (`pool_capacity`): the room the largest compiled rollout program leaves,
in slots of one slot's cache per chip (or, at a set rollout.kv_pages, in
pages). That is an extrapolation from one compiled pool, labelled as one;
`erpo plan rollout.slots=N` compiles the pool it names.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import re
import sys
import time
from pathlib import Path

from erpo_jax.runtime.mesh import CHIP_HBM_GIB
from erpo_jax.tools.hbm import hbm_bytes, paged_kernel_pages

GIB = 2 ** 30

# Cloud TPU documentation, one page per generation (the "System architecture"
# / specifications table of each): https://cloud.google.com/tpu/docs/v4,
# .../v5e, .../v5p, .../v6e. Per chip: HBM capacity, HBM bandwidth, peak
# bf16 FLOP/s. Checked against those pages on 2026-12-01: v4 275 TFLOP/s,
# 32 GiB, 1200 GB/s; v5e 197, 16 GiB, 819; v5p 459, 95 GB, 2765; v6e 918,
# 32 GB, 1638. (v5p's and v6e's pages write "GB"; taken as GiB, like v4's.)
SOURCE = ("Cloud TPU docs, per-chip specifications: cloud.google.com/tpu/docs/v4, "
          "/v5e, /v5p, /v6e")
_CHIPS = {  # generation: (topology prefix, chip config, HBM GiB, peak bf16 TFLOP/s, HBM GB/s)
    "v4": ("v4", "megacore", CHIP_HBM_GIB["TPU v4"], 275, 1200),
    "v5e": ("v5e", "default", CHIP_HBM_GIB["TPU v5 lite"], 197, 819),
    "v5p": ("v5p", "megacore", CHIP_HBM_GIB["TPU v5"], 459, 2765),
    "v6e": ("v6e", "default", CHIP_HBM_GIB["TPU v6 lite"], 918, 1638),
}


@dataclasses.dataclass(frozen=True)
class Topology:
    """A Cloud TPU type: its chips and what each can do."""

    name: str
    generation: str
    topology: str            # get_topology_desc's name, e.g. 'v4:2x2x1'
    chips_per_host: tuple    # host bounds, e.g. (2, 2, 1)
    chips: int
    hosts: int
    hbm_gib: float           # per chip
    peak_flops: float        # bf16 FLOP/s per chip
    hbm_bytes_per_s: float   # per chip

    def devices(self) -> list:
        """Abstract TPU devices of this topology (needs libtpu, no TPU)."""
        # Several processes may plan at once (libtpu otherwise holds a lock
        # file for the whole process lifetime); none of them touches a chip.
        os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
        from jax.experimental import topologies
        prefix, chip_config = _CHIPS[self.generation][:2]
        desc = topologies.get_topology_desc(
            topology_name=self.topology, platform="tpu", chip_config_name=chip_config,
            chips_per_host_bounds=self.chips_per_host, num_slices=1)
        return list(desc.devices)


def _topology(name, gen, grid, host, chips, hosts):
    _, _, hbm, tflops, gbs = _CHIPS[gen]
    return Topology(name, gen, f"{gen}:{grid}", host, chips, hosts, hbm, tflops * 1e12, gbs * 1e9)


# Name -> topology. v4/v5p names count TensorCores (2 per chip, one JAX device
# per chip with megacore); v5e/v6e names count chips; hosts hold 4 chips
# (8 for single-host v5e/v6e slices). Columns: name, chip grid, host bounds,
# chips, hosts.
_SLICES = """
v4-8 2x2x1 2,2,1 4 1    v4-16 2x2x2 2,2,1 8 2    v4-32 2x2x4 2,2,1 16 4
v5e-4 2x2 2,2,1 4 1     v5e-8 2x4 2,4,1 8 1      v5e-16 4x4 2,2,1 16 4    v5e-32 4x8 2,2,1 32 8
v5p-8 2x2x1 2,2,1 4 1   v5p-16 2x2x2 2,2,1 8 2
v6e-4 2x2 2,2,1 4 1     v6e-8 2x4 2,4,1 8 1      v6e-16 4x4 2,2,1 16 4
"""


def _parse_slices(text: str) -> dict:
    words = text.split()
    out = {}
    for i in range(0, len(words), 5):
        name, grid, host, chips, hosts = words[i:i + 5]
        gen = name.split("-")[0]
        out[name] = _topology(name, gen, grid, tuple(int(x) for x in host.split(",")),
                              int(chips), int(hosts))
    return out


TOPOLOGIES = _parse_slices(_SLICES)


def topology(name: str) -> Topology:
    key = name.strip().lower().replace("v5litepod", "v5e")
    if key not in TOPOLOGIES:
        raise ValueError(f"--topology {name!r} is not one of {sorted(TOPOLOGIES)} "
                         "(v5litepod-N is v5e-N).")
    return TOPOLOGIES[key]


def libtpu_missing() -> str | None:
    """None when the TPU compiler can be loaded, else why not (one sentence)."""
    try:
        import libtpu  # noqa: F401
    except ImportError:
        return "libtpu is not installed (pip install -e '.[test]' or '.[tpu]')"
    return None


# ----------------------------------------------------------------------------- analysis


def _model_flops(model_cfg, rows: int, T: int, train: bool, group: int = 1,
                 query_width: int = 0) -> float:
    from erpo_jax.tools.bench import model_flops_per_step
    f = model_flops_per_step(model_cfg, rows, T, group, query_width)
    if not train:
        return f / 3
    return f * (4 / 3 if model_cfg.remat else 1.0)


_OOM = re.compile(r"RESOURCE_EXHAUSTED: .*?required for (.+?) \(([\d.]+)([KMGT])\) exceeds "
                  r"available HBM \(([\d.]+)([KMGT])\)", re.S)
_UNIT = {"K": 2 ** 10, "M": 2 ** 20, "G": 2 ** 30, "T": 2 ** 40}


def _limit_bytes(top: Topology, margin: float) -> float:
    """What a program may use per chip: the HBM less the margin."""
    return top.hbm_gib * GIB * (1 - margin)


def _measure(lowered, top: Topology, margin: float) -> dict:
    """The compiled program's memory and cost; when the compiler itself refuses
    (more than the chip's HBM), its own numbers, with `fits` false."""
    t0 = time.perf_counter()
    try:
        compiled = lowered.compile()
    except Exception as e:  # noqa: BLE001 - only the TPU compiler's out-of-memory is a verdict
        m = _OOM.search(str(e))
        if m is None:
            raise
        need = float(m.group(2)) * _UNIT[m.group(3)]
        return {"compile_s": round(time.perf_counter() - t0, 1), "bytes": None,
                "peak_bytes": need, "peak_gib": need / GIB,
                "limit_gib": _limit_bytes(top, margin) / GIB, "fits": False,
                "compiler_error": f"{m.group(1)} need {m.group(2)}{m.group(3)}, the compiler "
                                  f"allows {m.group(4)}{m.group(5)}",
                "xla_flops": None, "xla_bytes_accessed": None, "hbm_bytes": None}
    secs = time.perf_counter() - t0
    m = compiled.memory_analysis()
    cost = compiled.cost_analysis()
    cost = cost[0] if isinstance(cost, (list, tuple)) else cost
    mem = {"argument": m.argument_size_in_bytes, "output": m.output_size_in_bytes,
           "temp": m.temp_size_in_bytes, "alias": m.alias_size_in_bytes,
           "generated_code": m.generated_code_size_in_bytes}
    peak = mem["argument"] + mem["output"] - mem["alias"] + mem["temp"] + mem["generated_code"]
    limit = _limit_bytes(top, margin)
    return {"compile_s": round(secs, 1), "bytes": mem, "peak_bytes": peak,
            "peak_gib": peak / GIB, "limit_gib": limit / GIB, "fits": peak <= limit,
            "xla_flops": float(cost.get("flops", 0.0)),
            "xla_bytes_accessed": float(cost.get("bytes accessed", 0.0)),
            "hbm_bytes": float(hbm_bytes(compiled.as_text(), paged_kernel_pages))}


# Chat-templated MATH prompts: about 100 tokens at the median and under 200
# for 90% of problems (issue 48; MATH500 problems: median 148 characters, 90th
# percentile 386), a lognormal with median 100 and sigma ln 2 / 1.2816.
PROMPT_LENGTHS = "lognormal:100:0.54"


def plan(cfg, top: Topology, margin: float = 0.05, only: tuple = (), say=print,
         decode_step: bool = True, strict_only: bool = False,
         lengths: str = "lognormal:800:0.8", prompt_lengths: str = PROMPT_LENGTHS) -> dict:
    """Compile every per-step program of `cfg` for `top`; the report (a dict).
    only: program names to compile (default all; with strict_only, a name
    that is no program of this run is an error, else skipped); decode_step: also compile
    one decode step of each sampler, for its traffic and the rollout's time
    estimate (a verdict alone does not need it); lengths: the response-length
    distribution of the rollout-time estimate (`rollout_estimate`);
    prompt_lengths: its prompts' (the paged engine's pages hold real tokens).

    JAX's persistent compilation cache is off meanwhile: an executable for
    abstract TPU devices can never be loaded on this host (reading one back
    only warns), so writing them would only fill the cache."""
    import jax
    from jax.experimental.compilation_cache import compilation_cache as cc
    was = jax.config.jax_enable_compilation_cache
    # JAX decides once per process whether a cache is in use: reset makes it decide again.
    jax.config.update("jax_enable_compilation_cache", False)
    cc.reset_cache()
    try:
        report = _plan(cfg, top, margin, only, say, decode_step, strict_only)
        report.pop("_progs", None)
        if lengths:
            est = rollout_estimate(report, cfg, top, lengths, prompt_lengths)
            if est is not None:
                report["rollout_estimate"] = est
                say(estimate_line(est))
        pool = pool_capacity(report, cfg, top, margin)
        if pool is not None:
            report["pool_capacity"] = pool
            say(pool_line(pool))
        report.pop("_engine", None)
        report.pop("_costs", None)
        return report
    finally:
        jax.config.update("jax_enable_compilation_cache", was)
        cc.reset_cache()


def _plan(cfg, top: Topology, margin: float, only: tuple, say, decode_step: bool,
          strict_only: bool = False) -> dict:
    from erpo_jax.runtime.distributed import plan_mesh
    from erpo_jax.model import lora as lora_lib
    from erpo_jax.model.config import PRESETS, from_hf_config
    from erpo_jax.model.hf import read_config
    from erpo_jax.model.sharding import Sharding, make_mesh
    from erpo_jax.train.config import validate
    from erpo_jax.train.programs import Programs

    devices = top.devices()
    shape = plan_mesh(len(devices), len(devices) // top.hosts, *cfg.mesh.shape).shape
    validate(cfg, len(devices))
    mesh = make_mesh(shape, devices)
    m = cfg.model
    numerics = dict(param_dtype=m.param_dtype, compute_dtype=m.compute_dtype, remat=m.remat,
                    scan_layers=m.scan_layers)
    hf_dir = Path(m.path) if m.init in ("hf", "sft") else None
    if hf_dir is not None and (hf_dir / "config.json").is_file():
        model_cfg, shapes_from = from_hf_config(read_config(hf_dir), **numerics), str(hf_dir)
    else:
        if m.preset not in PRESETS:
            raise ValueError(f"config field model.preset: {m.preset!r} is not one of "
                             f"{sorted(PRESETS)} (and model.path has no config.json).")
        model_cfg = dataclasses.replace(PRESETS[m.preset], **numerics)
        shapes_from = f"preset {m.preset}"
    if m.lora_rank:   # the base's shapes with the run's adapters (train.policy.load_policy)
        model_cfg = dataclasses.replace(model_cfg, lora_rank=m.lora_rank,
                                        lora_alpha=float(m.lora_alpha),
                                        lora_targets=tuple(m.lora_targets))
    # Token ids change no shape: any valid EOS and pad id compile the same programs.
    progs = Programs(cfg, model_cfg, Sharding(mesh), eos_ids=(0,), pad_id=0)
    chips = len(devices)
    N = cfg.rollout.max_new_tokens
    report = {"config": cfg.name, "topology": top.name, "tpu": dataclasses.asdict(top),
              "source": SOURCE, "mesh": dict(zip(("data", "fsdp", "tensor"), shape)),
              "chips": chips, "hosts": top.hosts, "model": shapes_from,
              "params": model_cfg.num_params(), "margin": margin,
              "lora": ({"rank": model_cfg.lora_rank, "alpha": model_cfg.lora_alpha,
                        "targets": list(model_cfg.lora_target_names),
                        "adapter_params": lora_lib.count(model_cfg)}
                       if model_cfg.lora_rank else None),
              "notes": ["per chip; peak = arguments + outputs - aliased + temporaries + code",
                        "collectives (ICI/DCN all-gathers, reduce-scatters) are not in the "
                        "roofline", "estimated_ms is a roofline estimate, not a measurement",
                        "XLA counts each loop body once; see `erpo_jax.tools.plan` for the estimates"],
              "query_group": progs.query_group, "programs": []}
    # ms per call of each engine program and per step of each decode loop, by
    # (engine use, part or loop key), for the rollout estimate.
    costs = {"runs": {}, "steps": {}}
    if progs.query_group_note:
        report["notes"].append(progs.query_group_note)
    planned = progs.planned()
    unknown = sorted(set(only) - {p.name for p in planned} - {p.group for p in planned})
    if unknown and strict_only:
        raise ValueError(f"erpo plan --only: {', '.join(map(repr, unknown))} is no program of "
                         f"this run; its programs are {', '.join(p.name for p in planned)}.")
    for prog in planned:
        if only and prog.name not in only and prog.group not in only:
            continue
        say(f"compiling {prog.name} ({prog.shapes}) for {top.name} ...")
        row = {"name": prog.name, "shapes": prog.shapes, **_measure(prog.lower(), top, margin)}
        if row["xla_flops"] is None:   # the compiler refused it: no cost to estimate
            report["programs"].append(row)
            say(f"  {prog.name:<18} DOES NOT FIT: {row['compiler_error']}")
            continue
        if prog.engine is not None:   # a rollout engine's program
            row["flops"], row["bytes_accessed"] = row["xla_flops"], row["hbm_bytes"]
            if prog.part:
                row["part"], row["group"] = prog.part, prog.group
            costs["runs"][prog.group, prog.part] = _roofline_ms(row["xla_flops"],
                                                                row["hbm_bytes"], top)
            if decode_step:
                _cost_loops(row, prog, progs, model_cfg, mesh, top, margin, costs["steps"])
        else:
            train = prog.name == "update"
            T = prog.tokens // prog.rows
            # The update and the reference forward run each group's query once.
            shared = (progs.query_group, T - N) if prog.name in ("update",
                                                                "reference forward") else (1, 0)
            row["flops"] = _model_flops(model_cfg, prog.rows, T, train, *shared) / chips
            row["bytes_accessed"] = row["hbm_bytes"]
        t_c, t_m = row["flops"] / top.peak_flops, row["bytes_accessed"] / top.hbm_bytes_per_s
        row["estimated_ms"] = 1e3 * max(t_c, t_m)
        row["bound"] = "compute" if t_c >= t_m else "memory"
        if prog.name == "update":
            model = _model_flops(model_cfg, prog.rows, prog.tokens // prog.rows, False,
                                 *shared) * 3
            row["estimated_mfu"] = model / chips / top.peak_flops / (row["estimated_ms"] / 1e3)
        formula = _formula_gib(cfg, prog, top, shape, progs.sharding.data_size)
        if formula is not None:
            row["formula_gib"] = formula
        report["programs"].append(row)
        say(_line(row))
    bad = [p for p in report["programs"] if not p["fits"]]
    report["fits"] = not bad
    report["_progs"], report["_engine"], report["_costs"] = progs, progs.sampler, costs
    report["verdict"] = ("every program fits" if not bad else " ".join(
        f"The {p['name']} does not fit: it needs {p['peak_gib']:.2f} GiB per chip, "
        f"{p['peak_gib'] - p['limit_gib']:.2f} GiB over the {p['limit_gib']:.2f} GiB usable "
        f"({top.hbm_gib:g} GiB HBM less a {margin:.0%} margin)." for p in bad))
    return report


def _roofline_ms(flops: float, nbytes: float, top: Topology) -> float:
    """A roofline time: max(FLOPs / peak FLOP/s, bytes / HBM bandwidth), in ms."""
    return 1e3 * max(flops / top.peak_flops, nbytes / top.hbm_bytes_per_s)


def _cost_loops(row: dict, prog, progs, model_cfg, mesh, top: Topology, margin: float,
                step_costs: dict) -> None:
    """Compile one step of each of the program's decode loops by itself (its
    loop body counted once, with what the compiler stages around the loop,
    in the program's own numbers) and put their costs into `row`: a loop
    whose steps a call fixes (`DecodeLoop.steps`) adds them to the program's
    FLOPs and bytes (`decode_phases`); one the schedule runs reports its
    step (`step_ms`). The full loop's step gets `decode_step`, its traffic
    against the minimum. step_costs[(use, loop key)]: each step's (FLOPs,
    HBM bytes)."""
    phases, full = [], None
    for loop in prog.loops:
        step = _measure(loop.lower(), top, margin)
        ms = _roofline_ms(step["xla_flops"], step["hbm_bytes"], top)
        step_costs[prog.group, loop.key] = (step["xla_flops"], step["hbm_bytes"])
        if loop.steps is None:
            row["step_flops"], row["step_bytes_accessed"] = (step["xla_flops"],
                                                             step["hbm_bytes"])
            row["step_xla_bytes_accessed"] = step["xla_bytes_accessed"]
            row["step_ms"] = ms
        else:
            phases.append({"cache_length": loop.cache_length, "steps": loop.steps,
                           "flops": step["xla_flops"],
                           "bytes_accessed": step["hbm_bytes"],
                           "xla_bytes_accessed": step["xla_bytes_accessed"],
                           "peak_gib": step["peak_gib"], "compile_s": step["compile_s"]})
        if loop.full:
            full = _decode_traffic(step, progs, loop.rows, model_cfg, mesh, loop.cache_length)
    if full is not None:
        row["decode_step"] = full
    if phases:
        row["decode_phases"] = phases
        steps = sum(p["steps"] for p in phases)
        if full is not None:
            full["mean_bytes_accessed"] = sum(
                p["steps"] * p["bytes_accessed"] for p in phases) / max(1, steps)
        # The program's own numbers plus its loops' steps (set last, as the row's totals).
        flops = row.pop("flops") + sum(p["steps"] * p["flops"] for p in phases)
        nbytes = row.pop("bytes_accessed") + sum(p["steps"] * p["bytes_accessed"] for p in phases)
        row["flops"], row["bytes_accessed"] = flops, nbytes


def sample_lengths(spec: str, samples: int, cap: int, seed: int = 0, flag: str = "--lengths"):
    """Response lengths int[samples] drawn from `spec`, 'lognormal:MEDIAN:SIGMA'
    (rounded, at least 1, capped at max_new_tokens), with a fixed seed."""
    import math

    import numpy as np
    from erpo_jax.train.config import ConfigError
    kind, *args = spec.split(":")
    try:
        median, sigma = (float(a) for a in args) if kind == "lognormal" else (0.0, 0.0)
    except ValueError:
        median = 0.0
    if not (1 <= median < math.inf and 0 <= sigma < math.inf):
        raise ConfigError(f"{flag} {spec!r} is no length distribution: use "
                          "lognormal:MEDIAN:SIGMA with a finite MEDIAN >= 1 and a finite "
                          "SIGMA >= 0, e.g. lognormal:800:0.8.")
    rng = np.random.default_rng(seed)
    return np.clip(np.round(rng.lognormal(np.log(median), sigma, samples)), 1, cap).astype(int)


def rollout_estimate(report: dict, cfg, top: Topology, spec: str,
                     prompt_spec: str = PROMPT_LENGTHS) -> dict | None:
    """The rollout's time per RL step on response lengths drawn from `spec`
    (one fixed draw of batch x group lengths), from the compiled programs:
    what the rollout engine runs for those lengths (`Engine.plan_estimate`),
    each program call and each decode step costed by its compiled program
    (the roofline of `_plan`'s numbers for it):

    static: each call of max_prompts_per_call prompts runs its program (the
      prefill, and each phase's loop body once) plus, for its longest
      response, one decode step per token after the first, each costed on
      its cache phase's compiled step;
    continuous: the engine's schedule of those lengths (`ContinuousEngine.
      schedule`: decode steps at each pool size, inserts at each prompt
      count), each costed by its compiled program (a decode program's loop
      body is one step).

    None when the rollout's programs were not compiled (--only) or their
    decode steps were not (decode_step=False)."""
    import numpy as np
    r, B = cfg.rollout, cfg.train.batch_size
    G, N = r.group_size, r.max_new_tokens
    lengths = sample_lengths(spec, B * G, N)
    engine, costs = report["_engine"], report["_costs"]
    step = lambda key: costs["steps"].get(("rollout", key))   # (FLOPs, HBM bytes)
    roofline = lambda flops, nbytes: _roofline_ms(flops, nbytes, top)
    out = {"lengths": spec, "samples": int(lengths.size), "mean_length": float(lengths.mean()),
           "median_length": float(np.median(lengths)),
           "truncated_frac": float(np.mean(lengths >= N)), "engine": engine.name}
    prompts = sample_lengths(prompt_spec, B, cfg.data.max_prompt_len, seed=1)
    est = engine.plan_estimate(lengths, B, cfg.data.max_prompt_len, r.max_prompts_per_call,
                               lambda part: costs["runs"].get(("rollout", part)),
                               lambda key: roofline(*step(key)) if step(key) else None,
                               step_cost=step, roofline_ms=roofline,
                               prompt_lengths=prompts)
    if est is None:
        return None
    out.update(est)
    # The bucket a batch of the drawn prompts runs at, against the compiled one.
    out["prompt_bucket"] = engine.batch_shape(B, cfg.data.max_prompt_len)[1]
    out["drawn_longest_prompt"] = int(prompts.max())
    out["drawn_bucket"] = engine.batch_shape(B, int(prompts.max()))[1]
    return out


def pool_capacity(report: dict, cfg, top: Topology, margin: float) -> dict | None:
    """The largest pool of a pool engine (continuous, paged) whose rollout
    programs fit: the room the largest compiled rollout program leaves under
    the limit, filled with what one more slot (or, at a set rollout.kv_pages,
    one more page) takes per chip (`ContinuousEngine.pool_capacity`). An
    extrapolation from the compiled peak, labelled as one; None for the static
    engine or when the rollout was not compiled."""
    engine = report.get("_engine")
    peaks = [p["peak_bytes"] for p in report["programs"] if p["name"].startswith("rollout")]
    if engine is None or not peaks or not hasattr(engine, "pool_capacity"):
        return None
    _, P = engine.batch_shape(cfg.train.batch_size, cfg.data.max_prompt_len)
    free = _limit_bytes(top, margin) - max(peaks)
    return {"engine": engine.name, "free_bytes": free, "prompt_bucket": P,
            "samples_per_step": cfg.train.batch_size * cfg.rollout.group_size,
            **engine.pool_capacity(P, free)}


def pool_line(c: dict) -> str:
    room = f"{c['free_bytes'] / GIB:.2f} GiB/chip left by the largest rollout program"
    if "kv_pages" in c:
        return (f"largest pool that fits ({c['engine']} engine, extrapolated from the compiled "
                f"peak; `erpo plan rollout.kv_pages=N` checks it): rollout.kv_pages="
                f"{c['kv_pages']:,} (now {c['kv_pages_now']:,}; {room}), "
                f"{c['slots_at_longest']} samples at their longest at once")
    return (f"largest pool that fits ({c['engine']} engine, extrapolated from the compiled "
            f"peak; `erpo plan rollout.slots=N` checks it): rollout.slots={c['slots']:,} "
            f"(now {c['slots_now']:,}; {room}, {c['slot_bytes'] / 2**20:.1f} MiB a slot); an "
            f"RL step has {c['samples_per_step']:,} samples")


def estimate_line(e: dict) -> str:
    line = (f"rollout estimate ({e['engine']} engine) on {e['samples']} responses of "
            f"{e['lengths']} lengths (mean {e['mean_length']:.0f}, median "
            f"{e['median_length']:.0f}, {100 * e['truncated_frac']:.1f}% at the cap): "
            f"{e['decode_steps']:,} decode steps, slot utilisation "
            f"{100 * e['slot_utilization']:.0f}%, ~{e['estimated_ms'] / 1e3:.1f} s per RL step")
    if "step_ratio" in e:   # an engine whose kernel's reads the compiler does not count
        line += (f"; a decode step reads ~{e['step_bytes'] / 2**30:.2f} GiB/chip (the kernel's "
                 f"{e['kv_read_per_step_bytes'] / 2**30:.2f} counted from the page table) "
                 f"against {e['step_minimum_bytes'] / 2**30:.2f} GiB of weights and held KV: "
                 f"{e['step_ratio']:.2f}x (prompts {e['mean_prompt_length']:.0f} tokens on "
                 f"average)")
    if e.get("drawn_bucket", 0) < e.get("prompt_bucket", 0):
        line += (f". The drawn prompts' longest is {e['drawn_longest_prompt']} tokens: a batch "
                 f"of them runs at the {e['drawn_bucket']}-token bucket, not the compiled "
                 f"{e['prompt_bucket']} (data.max_prompt_len={e['drawn_bucket']} estimates "
                 "there)")
    return line


def _formula_gib(cfg, prog, top: Topology, mesh_shape, data_size: int) -> float | None:
    """The hand formula's per-chip GiB for the rollout and the update
    (`bench.memory_estimate`), a cross-check of the compiler's peak; None for
    other programs and for models that are no preset."""
    from erpo_jax.model.config import PRESETS
    from erpo_jax.tools.bench import memory_estimate
    m = cfg.model
    if prog.name not in ("rollout", "update") or m.preset not in PRESETS or m.lora_rank:
        return None   # (the formula is full fine-tuning's)
    micro = max(1, prog.rows // max(1, cfg.optim.micro_batches) // data_size)
    est = memory_estimate(m.preset, top.name, top.chips, top.hbm_gib, mesh_shape,
                          prog.rows if prog.name == "rollout" else 1,
                          (cfg.data.max_prompt_len, cfg.rollout.max_new_tokens), micro,
                          m.param_dtype, m.compute_dtype)["gib"]
    return est["rollout_peak"] if prog.name == "rollout" else est["train_peak_remat"]


def _decode_traffic(step: dict, progs, rows: int, model_cfg, mesh,
                    cache_length: int | None = None) -> dict:
    """One decode step's HBM bytes against the minimum: every weight (in
    the compute dtype, which the sampler's decode loop reads: a copy made
    once per call, `model.in_compute_dtype`) and the whole KV cache read
    once (per chip). The minimum assumes each chip reads only its own weight
    shard, which the sampler's weight-stationary decode step does
    (`static` module docstring); an FSDP step that gathers the weights
    reads the whole model on every chip."""
    import math

    import jax
    params = progs.abstract_params()
    cd = jax.numpy.dtype(model_cfg.jnp_compute_dtype).itemsize
    weights = sum(math.prod(x.sharding.shard_shape(x.shape)) * min(x.dtype.itemsize, cd)
                  for x in jax.tree_util.tree_leaves(params))
    cfg = progs.cfg
    S = cache_length or cfg.data.max_prompt_len + cfg.rollout.max_new_tokens - 1
    kv_heads_split = mesh.shape["tensor"] if model_cfg.num_kv_heads % mesh.shape["tensor"] == 0 \
        else 1
    data = progs.sharding.data_size
    kv = (2 * model_cfg.num_layers * rows / data * S * model_cfg.num_kv_heads / kv_heads_split
          * model_cfg.head_dim * cd)
    minimum = weights + kv
    return {"bytes_accessed": step["hbm_bytes"], "minimum_bytes": minimum,
            "xla_bytes_accessed": step["xla_bytes_accessed"],
            "weights_bytes": weights, "kv_cache_bytes": kv,
            "ratio": step["hbm_bytes"] / minimum, "flops": step["xla_flops"],
            "peak_gib": step["peak_gib"], "compile_s": step["compile_s"]}


def _line(p: dict) -> str:
    s = (f"  {p['name']:<18} peak {p['peak_gib']:7.2f} / {p['limit_gib']:.2f} GiB  "
         f"{'fits' if p['fits'] else 'DOES NOT FIT'}  {p['flops']:.3g} FLOP  "
         f"~{p['estimated_ms']:.1f} ms ({p['bound']}-bound estimate)  "
         f"compiled in {p['compile_s']:.0f} s")
    if "estimated_mfu" in p:
        s += f"  est. MFU {p['estimated_mfu']:.0%}"
    if "decode_step" in p:
        d = p["decode_step"]
        s += (f"\n  {'':<18} one decode step reads {d['bytes_accessed'] / GIB:.2f} GiB vs "
              f"{d['minimum_bytes'] / GIB:.2f} GiB minimum (weights + KV cache once): "
              f"{d['ratio']:.2f}x")
        phases = p.get("decode_phases", [])
        if len(phases) > 1:
            s += (f"\n  {'':<18} on the whole cache; over its {len(phases)} cache phases ("
                  + ", ".join(f"{q['steps']} steps on {q['cache_length']} slots" for q in phases)
                  + f") a step reads {d['mean_bytes_accessed'] / GIB:.2f} GiB on average")
    return s


def table(report: dict) -> str:
    """The report as a markdown table (the BENCHMARKS.md format)."""
    head = ("| program | shapes | peak GiB/chip | usable HBM GiB | fits | FLOPs/chip | "
            "est. ms | bound | compile s |\n|---|---|---|---|---|---|---|---|---|")
    num = lambda p, k, f: format(p[k], f) if p.get(k) is not None else "-"
    rows = [f"| {p['name']} | {p['shapes']} | {p['peak_gib']:.2f} | {p['limit_gib']:.1f} | "
            f"{'yes' if p['fits'] else '**no**'} | {num(p, 'flops', '.3g')} | "
            f"{num(p, 'estimated_ms', '.0f')} | {p.get('bound', '-')} | {p['compile_s']:.0f} |"
            for p in report["programs"]]
    return "\n".join([head, *rows])


# ----------------------------------------------------------------------------- --suggest


SAMPLERS = ("rollout", "eval greedy", "eval sampled")


_PEAKS: dict[tuple, list[float]] = {}   # (config, topology, programs) -> peak bytes each


def program_peaks(cfg, top: Topology, names: tuple) -> list[float]:
    """The peak bytes per chip of the programs `names` of cfg on `top`, compiled once
    per process (a search asks about the same candidate more than once)."""
    key = (repr(cfg), top.name, tuple(names))
    if key not in _PEAKS:
        rep = plan(cfg, top, 0.0, only=names, say=lambda s: None, decode_step=False)
        _PEAKS[key] = [p["peak_bytes"] for p in rep["programs"]]
    return _PEAKS[key]


def fits(cfg, top: Topology, margin: float, names: tuple) -> bool:
    """Whether the programs `names` of cfg fit `top` less `margin` (compiled, quietly;
    a program the compiler refused has a peak above the whole HBM)."""
    return max(program_peaks(cfg, top, names)) <= _limit_bytes(top, margin)


def _with(cfg, section: str, **kw):
    return dataclasses.replace(cfg, **{section: dataclasses.replace(getattr(cfg, section), **kw)})


def _bisect(values: list, ok, want_largest: bool):
    """The largest (or smallest) of sorted `values` for which ok(v), assuming
    ok is monotone (true below / above a threshold); None when none is."""
    lo, hi, best = 0, len(values) - 1, None
    while lo <= hi:
        mid = (lo + hi) // 2
        if ok(values[mid]):
            best = values[mid]
            lo, hi = (mid + 1, hi) if want_largest else (lo, mid - 1)
        else:
            lo, hi = (lo, mid - 1) if want_largest else (mid + 1, hi)
    return best


def call_candidates(cfg, top: Topology) -> list[int]:
    """rollout.max_prompts_per_call values to try: multiples of the
    data-parallel size up to train.batch_size, ascending."""
    from erpo_jax.runtime.distributed import plan_mesh
    shape = plan_mesh(top.chips, top.chips // top.hosts, *cfg.mesh.shape).shape
    dp, B = shape[0] * shape[1], cfg.train.batch_size
    return list(range(dp, B + 1, dp)) or [B]


def micro_candidates(cfg, top: Topology) -> list[int]:
    """optim.micro_batches values the config validates with, ascending."""
    from erpo_jax.train.config import validate
    queries = cfg.train.batch_size // cfg.optim.num_minibatches
    out = []
    for k in range(1, queries + 1):
        if queries % k == 0:
            try:
                validate(_with(cfg, "optim", micro_batches=k), top.chips)
                out.append(k)
            except ValueError:
                pass
    return out


def largest_call(cfg, top: Topology, margin: float = 0.05):
    """The largest rollout.max_prompts_per_call whose samplers fit (None: none does)."""
    return _bisect(call_candidates(cfg, top), lambda k: fits(
        _with(cfg, "rollout", max_prompts_per_call=k), top, margin, SAMPLERS), want_largest=True)


def smallest_micro(cfg, top: Topology, margin: float = 0.05):
    """The smallest optim.micro_batches whose update fits (None: none does)."""
    return _bisect(micro_candidates(cfg, top), lambda k: fits(
        _with(cfg, "optim", micro_batches=k), top, margin, ("update",)), want_largest=False)


def suggest(cfg, top: Topology, margin: float = 0.05, say=print) -> list[str]:
    """Overrides: the largest rollout.max_prompts_per_call whose samplers fit and
    the smallest optim.micro_batches whose update fits, found by compiling
    candidates (bisection; fitting is assumed monotone in each)."""
    best_calls = largest_call(cfg, top, margin)
    say(f"largest rollout.max_prompts_per_call that fits: {best_calls}")
    best_micro = smallest_micro(cfg, top, margin)
    say(f"smallest optim.micro_batches that fits: {best_micro}")
    out = []
    if best_calls is not None:
        out.append(f"rollout.max_prompts_per_call={best_calls}")
    if best_micro is not None:
        out.append(f"optim.micro_batches={best_micro}")
    return out


# ----------------------------------------------------------------------------- CLI


NO_FIT = 3   # the exit status when a program does not fit (1 stays a crash)


def add_parser(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser("plan", help="compile every per-step program for a Cloud TPU "
                              "topology on this host and report memory, FLOPs, a roofline "
                              "(exit status 3 when a program does not fit)")
    p.add_argument("--config", default=None, help="experiment file (.py with get_config) or .json")
    p.add_argument("--cpu", action="store_true", help="use the file's get_cpu_config()")
    p.add_argument("overrides", nargs="*", help="section.field=value overrides")
    p.add_argument("--topology", required=True, help=f"one of {', '.join(TOPOLOGIES)}")
    p.add_argument("--json", default=None, help="also write the report here")
    p.add_argument("--margin", type=float, default=0.05,
                   help="fraction of HBM kept free (runtime, fragmentation); default 0.05")
    p.add_argument("--only", default="", help="comma-separated program names to compile "
                   "(rollout, reference forward, update, eval greedy, eval sampled, "
                   "reference pass); default all")
    p.add_argument("--prompt-lengths", default=PROMPT_LENGTHS,
                   help="prompt lengths of the rollout-time estimate (the paged engine's "
                        "pages hold a prompt's real tokens): lognormal:MEDIAN:SIGMA "
                        f"(default {PROMPT_LENGTHS}: chat-templated MATH prompts)")
    p.add_argument("--lengths", default="lognormal:800:0.8",
                   help="response lengths of the rollout-time estimate: lognormal:MEDIAN:SIGMA "
                   "(capped at rollout.max_new_tokens); default lognormal:800:0.8")
    p.add_argument("--suggest", action="store_true", help="find the largest "
                   "rollout.max_prompts_per_call and smallest optim.micro_batches that fit")
    p.set_defaults(func=run)
    return p


def run(args: argparse.Namespace) -> int:
    from erpo_jax.train.config import load_config
    top = topology(args.topology)
    missing = libtpu_missing()
    if missing:
        print(f"erpo plan: {missing}; it is what compiles for a TPU on this host.",
              file=sys.stderr)
        return 2
    cfg = load_config(args.config, args.overrides, cpu=args.cpu)
    sample_lengths(args.lengths, 1, 1)   # a bad spec is refused before anything compiles
    sample_lengths(args.prompt_lengths, 1, 1, flag="--prompt-lengths")
    print(f"{cfg.name} on {top.name}: {top.chips} chips on {top.hosts} host(s), "
          f"{top.hbm_gib:g} GiB HBM, {top.peak_flops / 1e12:g} TFLOP/s bf16, "
          f"{top.hbm_bytes_per_s / 1e9:g} GB/s per chip ({SOURCE})", flush=True)
    only = tuple(x.strip() for x in args.only.split(",") if x.strip())
    report = plan(cfg, top, args.margin, only=only, say=lambda s: print(s, flush=True),
                  strict_only=True, lengths=args.lengths, prompt_lengths=args.prompt_lengths)
    print("Per chip. Estimated ms: roofline max(FLOPs / peak, bytes / bandwidth), an "
          "estimate; collectives are not in it.")
    if args.suggest:
        report["suggest"] = suggest(cfg, top, args.margin)
        print("paste: " + " ".join(report["suggest"]))
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(report, indent=2))
    if not report["fits"]:
        print(f"erpo plan: {report['verdict']}", file=sys.stderr)
        return NO_FIT
    print(report["verdict"])
    return 0
