"""`erpo plan`: the Trainer's programs compiled by XLA's TPU compiler for a
small topology (v5e-4, 16 GiB per chip) on this CPU host, and its verdict."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from erpo_jax.tools import plan as plan_lib
from erpo_jax.model.config import PRESETS

pytestmark = pytest.mark.skipif(plan_lib.libtpu_missing() is not None,
                                reason=str(plan_lib.libtpu_missing()))

ROOT = Path(__file__).resolve().parents[1]
# A random tiny model, 4 prompts x 2 samples, 16 + 8 tokens, Policy-KL on (so
# the reference forward is planned too) and pass@k sampling at evaluation.
TINY = ["model.init=random", "model.preset=tiny", "train.batch_size=4",
        "rollout.group_size=2", "data.max_prompt_len=16", "rollout.max_new_tokens=8",
        "train.ref_batch_size=4", "loss.beta_policy=0.04", "train.eval_n=2",
        "train.eval_k=1,2", "mesh.shape=1,-1,1"]


def _cli(tmp_path, *args):
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    out = tmp_path / "plan.json"
    proc = subprocess.run([sys.executable, "-m", "erpo_jax.cli", "plan", "--topology", "v5e-4",
                           "--json", str(out), *args], capture_output=True, text=True,
                          env=env, cwd=ROOT, timeout=1200)
    return proc, (json.loads(out.read_text()) if out.exists() else None)


def test_plan_compiles_every_program_of_a_tiny_run_for_v5e_4(tmp_path):
    proc, rep = _cli(tmp_path, *TINY)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert rep["chips"] == 4 and rep["mesh"] == {"data": 1, "fsdp": 4, "tensor": 1}
    assert rep["tpu"]["hbm_gib"] == 16 and rep["fits"] is True
    names = [p["name"] for p in rep["programs"]]
    assert names == ["rollout", "reference forward", "update", "eval greedy", "eval sampled",
                     "reference pass"]
    assert any("collectives" in n for n in rep["notes"])
    # 4 queries per micro-batch over a data-parallel size of 4: the update
    # and the reference forward run each group's query once on the TPU too.
    assert rep["query_group"] == 2
    for p in rep["programs"]:
        b = p["bytes"]
        assert set(b) == {"argument", "output", "temp", "alias", "generated_code"}
        assert p["peak_bytes"] == (b["argument"] + b["output"] - b["alias"] + b["temp"]
                                   + b["generated_code"])
        assert p["fits"] is True and p["peak_gib"] < p["limit_gib"] == pytest.approx(16 * 0.95)
        assert p["flops"] > 0 and p["xla_flops"] > 0 and p["bytes_accessed"] > 0
        assert p["estimated_ms"] == pytest.approx(1e3 * max(p["flops"] / 197e12,
                                                            p["bytes_accessed"] / 819e9))
    by = {p["name"]: p for p in rep["programs"]}
    # The update donates its state: the aliased bytes are at least the
    # parameters and two Adam moments of this chip's shard (float32).
    params_per_chip = rep["params"] * 4 / 4
    assert by["update"]["bytes"]["alias"] >= 3 * params_per_chip * 0.9
    assert 0 < by["update"]["estimated_mfu"] <= 1
    step = by["rollout"]["decode_step"]
    # One decode step reads every weight and the whole KV cache at least once.
    assert step["bytes_accessed"] >= step["minimum_bytes"] > 0
    assert step["minimum_bytes"] == step["weights_bytes"] + step["kv_cache_bytes"]


def test_plan_costs_each_cache_phase_of_the_rollout(tmp_path):
    """128 + 300 tokens: the decode loop runs in three cache phases (256, 384
    and 427 slots on the TPU, whose lengths are multiples of 128). The plan
    compiles a decode step for each: a step on a shorter cache reads less,
    and the rollout's bytes (every row to max_new_tokens) come out below the
    same rollout with one phase on the whole cache."""
    long = [a for a in TINY if not a.startswith(("data.max_prompt_len",
                                                 "rollout.max_new_tokens"))]
    long += ["data.max_prompt_len=128", "rollout.max_new_tokens=300"]
    proc, rep = _cli(tmp_path, *long, "--only", "rollout")
    assert proc.returncode == 0, proc.stderr[-2000:]
    (p,) = rep["programs"]
    phases = p["decode_phases"]
    assert [(q["cache_length"], q["steps"]) for q in phases] == [(256, 128), (384, 128), (427, 43)]
    reads = [q["bytes_accessed"] for q in phases]
    assert reads == sorted(reads) and reads[0] < reads[-1] == p["decode_step"]["bytes_accessed"]
    assert reads[0] < p["decode_step"]["mean_bytes_accessed"] < reads[-1]
    assert "over its 3 cache phases" in proc.stdout
    proc1, rep1 = _cli(tmp_path, *long, "rollout.cache_phases=1", "--only", "rollout")
    assert proc1.returncode == 0, proc1.stderr[-2000:]
    (p1,) = rep1["programs"]
    assert [q["cache_length"] for q in p1["decode_phases"]] == [427]
    assert p1["decode_step"]["bytes_accessed"] == reads[-1]
    assert p["bytes_accessed"] < p1["bytes_accessed"]


def test_plan_estimates_both_rollout_engines_on_a_length_distribution(tmp_path):
    """The continuous engine's programs (its inserts and its decode loop,
    4 slots for 8 samples) compile for v5e-4, and the rollout estimate of
    each engine on one draw of lognormal lengths is its schedule costed by
    its compiled programs: the static calls to their longest response, the
    continuous engine's decode steps and inserts as `schedule` replays them."""
    import numpy as np

    from erpo_jax.rollout.continuous import schedule
    from erpo_jax.rollout.static import static_steps
    spec = "lognormal:4:0.8"
    proc, rep = _cli(tmp_path, *TINY, "rollout.engine=continuous", "rollout.slots=4",
                     "--only", "rollout", "--lengths", spec)
    assert proc.returncode == 0, proc.stderr[-2000:]
    by = {p["name"]: p for p in rep["programs"]}
    assert list(by) == ["rollout insert 0", "rollout insert 4", "rollout decode 4"]
    assert all(p["fits"] and p["group"] == "rollout" for p in by.values())
    est = rep["rollout_estimate"]
    lengths = plan_lib.sample_lengths(spec, 8, 8)
    sched = schedule(lengths, 4, 0, [4], 2, [0, 4])
    assert est["engine"] == "continuous" and est["decode_steps"] == sched["steps"]
    # A decode step is costed by itself (its loop's program counts the body once).
    step = by["rollout decode 4"]
    assert step["step_bytes_accessed"] > 0 and step["decode_step"]["minimum_bytes"] > 0
    assert step["step_ms"] == pytest.approx(1e3 * max(step["step_flops"] / 197e12,
                                                      step["step_bytes_accessed"] / 819e9))
    ms = sum(k * by[f"rollout decode {n}"]["step_ms"] for n, k in sched["steps_by_size"].items())
    ms += sum(k * by[f"rollout insert {q}"]["estimated_ms"]
              for (q, _), k in sched["inserts"].items())
    assert est["estimated_ms"] == pytest.approx(ms)
    assert est["slot_utilization"] == pytest.approx((lengths - 1).sum() / sched["slot_steps"])
    assert "rollout estimate (continuous engine)" in proc.stdout
    # The largest pool: the room the largest rollout program leaves, in slots of
    # a slot's cache per chip: 16 + 8 entries aligned to 128, each 2 layers x K, V
    # x 2 heads x 16 float32 = 512 bytes, spread over the 4 data shards.
    pool, limit = rep["pool_capacity"], 16 * 2**30 * (1 - rep["margin"])
    assert pool["free_bytes"] == pytest.approx(limit - max(p["peak_bytes"] for p in by.values()))
    assert pool["slot_bytes"] == 128 * 512 / 4 and pool["slots_now"] == 4
    assert pool["slots"] == 4 + 4 * int(pool["free_bytes"] // (4 * pool["slot_bytes"]))
    assert f"rollout.slots={pool['slots']:,}" in proc.stdout

    proc, rep = _cli(tmp_path, *TINY, "rollout.engine=static",
                     "--only", "rollout", "--lengths", spec)
    assert proc.returncode == 0, proc.stderr[-2000:]
    est = rep["rollout_estimate"]
    assert est["engine"] == "static" and est["decode_steps"] == static_steps(lengths, 8)
    assert "pool_capacity" not in rep      # its calls' rows are rollout.max_prompts_per_call's
    assert np.isfinite(est["estimated_ms"]) and est["estimated_ms"] > 0
    bad, _ = _cli(tmp_path, *TINY, "--only", "rollout", "--lengths", "uniform:3")
    assert bad.returncode == 2 and "lognormal:MEDIAN:SIGMA" in bad.stderr


def test_plan_estimates_the_paged_engine_from_its_page_book(tmp_path):
    """The paged engine's programs compile for v5e-4 (its inserts and its
    decode loop); the estimate replays its schedule on drawn response and
    prompt lengths and adds the pages the page table names, and the
    attention FLOPs on the entries the slots hold, to the compiled step's
    bytes and FLOPs before taking its roofline. Prompts of about 6 tokens
    in a 256-token bucket: the inserts prefill at 128, the shortest prefill
    length, each costed by that program."""
    from erpo_jax.rollout.paged import schedule
    spec, prompts = "lognormal:4:0.8", "lognormal:6:0.3"
    tiny = [a for a in TINY if not a.startswith("data.max_prompt_len")]
    proc, rep = _cli(tmp_path, *tiny, "data.max_prompt_len=256", "rollout.engine=paged",
                     "rollout.slots=4", "rollout.page_size=8", "--only", "rollout",
                     "--lengths", spec, "--prompt-lengths", prompts)
    assert proc.returncode == 0, proc.stderr[-2000:]
    by = {p["name"]: p for p in rep["programs"]}
    assert list(by) == ["rollout insert 0", "rollout insert 4 at 128", "rollout insert 4",
                        "rollout decode 4"]
    assert by["rollout insert 4 at 128"]["flops"] < by["rollout insert 4"]["flops"]
    est = rep["rollout_estimate"]
    lengths = plan_lib.sample_lengths(spec, 8, 8)
    plen = plan_lib.sample_lengths(prompts, 4, 256, seed=1)
    # 4 slots, one per data shard (mesh 1 x 4 x 1), of 256 + 8 tokens in pages
    # of 8: 32 prompt and 2 own pages each, 34 pages a shard.
    sched = schedule(lengths, plen, 2, 4, 4, 34, 8, 8, 0, [0, 4], lambda n: 128)
    assert est["engine"] == "paged" and est["decode_steps"] == sched["steps"]
    assert {t for (q, t) in sched["inserts"] if q} == {128}
    assert est["insert_ms"] == pytest.approx(sum(
        k * by["rollout insert " + (f"{q} at {t}" if q else "0")]["estimated_ms"]
        for (q, t), k in sched["inserts"].items()))
    assert est["mean_prompt_length"] == pytest.approx(plen.mean())
    # Compiled at the 256 bucket; a batch of the drawn prompts runs at theirs.
    assert est["prompt_bucket"] == 256 and est["drawn_longest_prompt"] == plen.max()
    assert est["drawn_bucket"] == max(8, 1 << (int(plen.max()) - 1).bit_length()) < 256
    assert f"runs at the {est['drawn_bucket']}-token bucket, not the compiled 256" in proc.stdout
    assert est["kv_read_per_step_bytes"] >= est["kv_held_per_step_bytes"] > 0
    assert 0 < est["step_ms"] and est["step_ratio"] > 0
    step = by["rollout decode 4"]
    assert "decode_step" not in step      # its traffic is the estimate's, not the whole cache's
    # The step's roofline with the kernel's pages and FLOPs (counted from the
    # page table) added to the compiled step's: time, not a sum of times.
    tpu = rep["tpu"]
    assert est["step_bytes"] == pytest.approx(
        step["step_bytes_accessed"] + est["kv_read_per_step_bytes"], rel=1e-9)
    assert est["step_flops"] == pytest.approx(step["step_flops"] + est["kv_flops_per_step"],
                                              rel=1e-9)
    # Per entry a slot holds: q . k and p . v (4 x head_dim FLOPs) for each of the
    # 2 query heads of a KV head, against key + value (2 x head_dim float32).
    tiny = PRESETS["tiny"]
    per_kv = tiny.num_heads // tiny.num_kv_heads
    assert est["kv_flops_per_step"] == pytest.approx(
        est["kv_held_per_step_bytes"] * 4 * per_kv / (2 * 4), rel=1e-9)
    assert est["kv_flops_per_step"] > 0
    assert est["step_ms"] == pytest.approx(1e3 * max(est["step_flops"] / tpu["peak_flops"],
                                                     est["step_bytes"] / tpu["hbm_bytes_per_s"]))
    assert est["decode_ms"] == pytest.approx(est["decode_steps"] * est["step_ms"])
    assert "rollout estimate (paged engine)" in proc.stdout and "page table" in proc.stdout
    # rollout.kv_pages=0: the pages grow with the slots (a slot's 34 pages of 8 entries).
    pool = rep["pool_capacity"]
    assert pool["slot_bytes"] == 34 * 8 * 512 / 4 and pool["slots"] > 4
    bad, _ = _cli(tmp_path, *TINY, "--only", "rollout", "--prompt-lengths", "x")
    assert bad.returncode == 2 and "--prompt-lengths 'x'" in bad.stderr


def test_plan_reports_an_oversized_rollout_as_not_fitting(tmp_path):
    """32768 rows x 4095 cache slots of a float32 KV cache: 16 GiB per chip of
    cache alone, more than a v5e chip's 16 GiB less the margin (the TPU
    compiler refuses it; the report carries its numbers)."""
    big = [a for a in TINY if not a.startswith(("train.batch_size", "data.max_prompt_len",
                                                "rollout.max_new_tokens"))]
    proc, rep = _cli(tmp_path, *big, "train.batch_size=4096", "rollout.group_size=8",
                     "data.max_prompt_len=2048", "rollout.max_new_tokens=2048",
                     "--only", "rollout")
    assert proc.returncode == plan_lib.NO_FIT, proc.stderr[-2000:]
    assert [p["name"] for p in rep["programs"]] == ["rollout"]
    (p,) = rep["programs"]
    assert p["fits"] is False and p["peak_gib"] > p["limit_gib"]
    assert "The rollout does not fit" in proc.stderr and "GiB over" in proc.stderr


def test_unknown_program_name_in_only_is_named(tmp_path):
    proc, rep = _cli(tmp_path, *TINY, "--only", "updat")
    assert proc.returncode != 0 and rep is None
    assert "'updat' is no program of this run" in proc.stderr
    assert "reference pass" in proc.stderr   # the names it could have been


def test_topology_table_names_and_unknown_name():
    t = plan_lib.topology("v5litepod-16")
    assert (t.chips, t.hosts, t.hbm_gib) == (16, 4, 16)
    assert {"v4-8", "v4-16", "v5e-8", "v5e-16", "v5p-8", "v6e-8"} <= set(plan_lib.TOPOLOGIES)
    with pytest.raises(ValueError, match="v4-8"):
        plan_lib.topology("v9-8")


def _peak(cfg, top, names):
    return max(plan_lib.program_peaks(cfg, top, names))


@pytest.mark.slow
def test_suggest_finds_the_boundary_where_programs_stop_fitting():
    """--suggest's two searches, against a usable HBM set between the peaks of
    the smallest and largest candidate (from the compiler, not hard-coded):
    the suggested value fits and the next candidate beyond it does not."""
    from erpo_jax.train.config import load_config
    top = plan_lib.topology("v5e-4")
    base = [a for a in TINY if not a.startswith(("train.batch_size", "data.max_prompt_len",
                                                 "rollout.max_new_tokens", "train.eval_"))]
    cfg = load_config(None, [*base, "train.batch_size=8", "data.max_prompt_len=64",
                             "rollout.max_new_tokens=64"])
    hbm = top.hbm_gib * plan_lib.GIB
    between = lambda lo, hi: 1 - (lo + hi) / 2 / hbm     # the margin that puts the limit there

    calls = plan_lib.call_candidates(cfg, top)
    assert calls == [4, 8]
    at = lambda k: plan_lib._with(cfg, "rollout", max_prompts_per_call=k)
    lo, hi = (_peak(at(k), top, plan_lib.SAMPLERS) for k in (calls[0], calls[-1]))
    assert hi > lo
    margin = between(lo, hi)
    k = plan_lib.largest_call(cfg, top, margin)
    assert k in calls[:-1], k
    assert plan_lib.fits(at(k), top, margin, plan_lib.SAMPLERS)
    assert not plan_lib.fits(at(calls[calls.index(k) + 1]), top, margin, plan_lib.SAMPLERS)

    micros = plan_lib.micro_candidates(cfg, top)
    assert micros[0] == 1 and len(micros) >= 3
    mb = lambda k: plan_lib._with(cfg, "optim", micro_batches=k)
    hi, lo = (_peak(mb(k), top, ("update",)) for k in (micros[0], micros[-1]))
    assert hi > lo
    margin = between(lo, hi)
    k = plan_lib.smallest_micro(cfg, top, margin)
    assert k in micros[1:], k
    assert plan_lib.fits(mb(k), top, margin, ("update",))
    assert not plan_lib.fits(mb(micros[micros.index(k) - 1]), top, margin, ("update",))


def test_kv_memory_takes_a_share_of_a_chips_memory():
    """rollout.kv_memory: the pages a share of one chip's memory holds, in
    whole pages per data shard. For a TPU compiled for ahead of time (no
    memory to ask) the chip's HBM comes from its kind: 16 GiB on v5e. On
    the CPU, which reports none, and for a share too small for one sample,
    one sentence naming the field."""
    from erpo_jax.model.config import PRESETS
    from erpo_jax.model.sharding import Sharding
    from erpo_jax.rollout.paged import PagedEngine
    from erpo_jax.rollout.types import SamplingConfig
    from erpo_jax.runtime.mesh import chip_memory_bytes, make_mesh
    cfg = PRESETS["tiny"]
    sc = SamplingConfig(num_samples=2, max_new_tokens=8, temperature=1.0, max_prompt_len=16)
    devices = plan_lib.topology("v5e-4").devices()
    assert chip_memory_bytes(devices[0]) == 16 * 2**30
    sh = Sharding(make_mesh((4, 1, 1), devices))
    entry = 2 * 2 * 2 * 16 * 4 / 4      # layers x K, V x heads x head size x float32 / 4 shards
    engine = PagedEngine(cfg, sc, sh, slots=4, page_size=8, kv_memory=1e-4)
    assert engine.kv_pages == int(1e-4 * 16 * 2**30 // (4 * 8 * entry)) * 4 == 1676
    assert engine.pages_per_shard(16) == 419
    with pytest.raises(ValueError, match=r"rollout.kv_memory is 1e-09: .* holds 0 pages of 8 "
                                         r"entries per data shard, and one sample needs 4"):
        PagedEngine(cfg, sc, sh, slots=4, page_size=8, kv_memory=1e-9)
    with pytest.raises(ValueError, match=r"rollout.kv_memory is 0.3.*reports none \(the CPU\): "
                                         r"set rollout.kv_pages"):
        PagedEngine(cfg, sc, slots=4, page_size=8, kv_memory=0.3)


def test_pool_capacity_counts_slots_or_pages_per_chip():
    """The largest pool in the room a chip has left, without compiling: whole
    steps of the data-parallel size (continuous, and paged with
    rollout.kv_pages = 0, whose pages grow with its slots) or of pages (paged
    at a set kv_pages, whose slots wait on its pages)."""
    from erpo_jax.model.config import PRESETS
    from erpo_jax.rollout.continuous import ContinuousEngine
    from erpo_jax.rollout.paged import PagedEngine
    from erpo_jax.rollout.types import SamplingConfig
    cfg = PRESETS["tiny"]
    sc = SamplingConfig(num_samples=2, max_new_tokens=8, temperature=1.0, max_prompt_len=16)
    entry = 2 * 2 * 2 * 16 * 4          # layers x K, V x heads x head size x float32
    cont = ContinuousEngine(cfg, sc, slots=4)
    one = cont.cache_length(16) * entry
    assert cont.pool_capacity(16, 10.5 * one) == {"slots": 14, "slots_now": 4, "slot_bytes": one}
    assert cont.pool_capacity(16, -1.0)["slots"] == 4
    paged = PagedEngine(cfg, sc, slots=4, page_size=8)
    assert paged.pool_capacity(16, 3 * 4 * 8 * entry)["slots"] == 7    # 2 prompt + 2 own pages
    fixed = PagedEngine(cfg, sc, slots=4, page_size=8, kv_pages=16)
    cap = fixed.pool_capacity(16, 5.5 * 8 * entry)
    assert cap["kv_pages"] == 21 and cap["kv_pages_now"] == 16 and cap["slots_at_longest"] == 5
