"""Rollout engines: the continuous-batching engine returns the static sampler's
samples (same tokens, log-probs to float rounding, same masks, lengths and
truncation flags) whatever its pool size and refill order, sharded or not,
keyed as the static engine's calls of max_prompts_per_call; the seam's
config field and the bad inputs it refuses."""

from __future__ import annotations

import jax
import numpy as np
import pytest

from erpo_jax.model import model as model_lib
from erpo_jax.model.config import ModelConfig
from erpo_jax.model.sharding import Sharding, make_mesh
from erpo_jax.rollout.continuous import ContinuousEngine
from erpo_jax.rollout.paged import PagedEngine
from erpo_jax.rollout.engine import ENGINES, make_engine
from erpo_jax.rollout.static import StaticEngine
from erpo_jax.rollout.types import SamplingConfig

from engine_checks import all_gather_sizes, assert_same_samples, collective_sizes

CFG = ModelConfig()          # the tiny preset: vocab 256, 2 layers
KEY = jax.random.key(7)
# 16 of 256 tokens end a response: with the flattened head below, lengths are
# about geometric with mean 16, so a batch has EOS at step 0 and rows that hit
# max_new_tokens.
EOS = tuple(range(5, 21))


@pytest.fixture(scope="module")
def params():
    p = model_lib.init_params(CFG, jax.random.key(0))
    return {**p, "lm_head": p["lm_head"] * 0.5}


def _prompts(n: int, seed: int = 0, vocab: int = CFG.vocab_size):
    rng = np.random.default_rng(seed)
    return [rng.integers(21, vocab, size=k).tolist() for k in rng.integers(2, 14, size=n)]


SC = SamplingConfig(max_new_tokens=40, num_samples=4, eos_ids=EOS, top_k=50)
PROMPTS = _prompts(7)     # 28 samples: no pool size below divides them


@pytest.fixture(scope="module")
def static_run(params):
    sampler = StaticEngine(CFG, SC)
    return sampler.sample(params, PROMPTS, KEY), sampler.last_stats


@pytest.fixture(scope="module")
def static_out(static_run):
    return static_run[0]


def test_the_batch_has_varied_lengths(static_out):
    """The premise of the equality tests: EOS at step 0, rows at max_new_tokens."""
    lengths = static_out.lengths
    assert lengths.min() == 1 and lengths.max() == SC.max_new_tokens, lengths
    assert static_out.truncated.any() and not static_out.truncated.all()


# Below, at and above G = 4; 3 and 64 with ERPO_LONG_TESTS=1.
@pytest.mark.long(when=lambda p: p["slots"] in (3, 64))
@pytest.mark.parametrize("slots", [1, 3, 4, 9, 64])
def test_continuous_equals_static_for_any_pool(params, static_run, slots):
    static_out, static_stats = static_run
    engine = ContinuousEngine(CFG, SC, slots=slots)
    out = engine.sample(params, PROMPTS, KEY)
    assert_same_samples(static_out, out, f"slots={slots}")
    stats = engine.last_stats
    # Every decode step samples a token for at least one slot.
    useful = int((static_out.lengths - 1).sum())
    assert stats["decode_steps"] <= useful
    # The schedule `erpo plan` replays from lengths alone is the one the engine ran.
    plan = engine.schedule(out.lengths, len(PROMPTS))
    assert stats["decode_steps"] == plan["steps"]
    assert stats["slot_utilization"] == pytest.approx(useful / plan["slot_steps"])
    # Refilled (and, draining, shrunk) pools idle less than the static call's rows.
    assert stats["slot_utilization"] > static_stats["slot_utilization"]


def test_refill_order_does_not_change_samples(params, static_out):
    """Refilling after every finished sample or only when half the pool is
    free reorders which slot runs which sample, not the samples."""
    for refill in (1, 4):
        out = ContinuousEngine(CFG, SC, slots=8, refill=refill).sample(params, PROMPTS, KEY)
        assert_same_samples(static_out, out, f"refill={refill}")


@pytest.mark.parametrize("change", [dict(method="gumbel", top_k=0, top_p=0.9),
                                    dict(greedy=True, min_new_tokens=3),
                                    dict(max_new_tokens=1)])
def test_continuous_equals_static_other_samplings(params, change):
    sc = SamplingConfig(**{**SC.__dict__, **change})
    want = StaticEngine(CFG, sc).sample(params, PROMPTS, KEY)
    got = ContinuousEngine(CFG, sc, slots=5).sample(params, PROMPTS, KEY)
    assert_same_samples(want, got, str(change))


def test_max_prompts_keys_as_the_static_calls(params):
    """With max_prompts_per_call the continuous engine draws what the static
    engine's calls of that many prompts draw (chunk c keyed fold_in(key, c)),
    in one pool over all prompts."""
    want = StaticEngine(CFG, SC).sample(params, PROMPTS, KEY, max_prompts=3)
    engine = ContinuousEngine(CFG, SC, slots=6)
    got = engine.sample(params, PROMPTS, KEY, max_prompts=3)
    # The static calls padded their prompts to their own buckets; joined, the
    # width is the longest call's, as the continuous engine's one call.
    assert_same_samples(want, got, "max_prompts=3")


def test_max_prompts_equal_to_the_prompts_keys_as_one_call(params, static_out):
    """max_prompts_per_call equal to the number of prompts: the static engine
    makes one unchunked call (keys fold_in(key, r), not chunk 0's
    fold_in(fold_in(key, 0), r)), and the continuous engine keys its samples
    the same: the boundary of `0 < max_prompts < B` in `ContinuousEngine.run`."""
    n = len(PROMPTS)
    want = StaticEngine(CFG, SC).sample(params, PROMPTS, KEY, max_prompts=n)
    assert_same_samples(static_out, want, "static max_prompts=len(prompts)")
    got = ContinuousEngine(CFG, SC, slots=6).sample(params, PROMPTS, KEY, max_prompts=n)
    np.testing.assert_array_equal(want.response_tokens, got.response_tokens,
                                  err_msg="max_prompts=len(prompts)")
    assert_same_samples(want, got, "max_prompts=len(prompts)")


def test_no_retrace_and_a_handful_of_programs(params):
    engine = ContinuousEngine(CFG, SC, slots=6)
    engine.sample(params, PROMPTS, KEY)
    traces = engine.num_traces
    # Each program traced once at most: start, weights, the insert sizes and,
    # per pool size, its decode and shrink (8 here).
    listed = engine.programs(params, len(PROMPTS), max(map(len, PROMPTS)), every=True)
    assert traces <= len(listed) <= 8, (traces, [n for n, _, _ in listed])
    engine.sample(params, PROMPTS, jax.random.key(8))
    assert engine.num_traces == traces


@pytest.mark.long(when=lambda p: p["mesh"] == (1, 1, 1))   # one device: long variant
@pytest.mark.parametrize("mesh", [(4, 2, 1), (2, 1, 2), (1, 1, 1)])
def test_sharded_equals_static(params, static_out, mesh):
    """On meshes of 8, 4 and one device (a one-device run: the head's
    sharding is then the replicated one)."""
    sh = Sharding(make_mesh(mesh, jax.devices()[:int(np.prod(mesh))]))
    p = jax.device_put(params, model_lib.param_shardings(CFG, sh))
    out = ContinuousEngine(CFG, SC, sh, slots=8).sample(p, PROMPTS, KEY)
    assert_same_samples(static_out, out, f"mesh={mesh}")


def test_bad_pools_are_refused_naming_the_field():
    sh = Sharding(make_mesh((4, 1, 1)))
    with pytest.raises(ValueError, match=r"rollout.slots \(6\).*multiple of the data-parallel "
                                         r"size 4.*Set it to 8"):
        ContinuousEngine(CFG, SC, sh, slots=6)
    with pytest.raises(ValueError, match="rollout.engine is 'vllm'; the engines are 'static', "
                                         "'continuous'"):
        make_engine("vllm", CFG, SC)
    assert set(ENGINES) == {"static", "continuous", "paged"}
    # A cache that cannot hold the longest prompt and response: refused as the
    # engine is built, before anything compiles.
    long = SamplingConfig(max_new_tokens=100, max_prompt_len=CFG.max_position_embeddings)
    for name in ENGINES:
        with pytest.raises(ValueError, match=r"data.max_prompt_len \+ rollout.max_new_tokens\) "
                                             r"exceeds the model's max_position_embeddings"):
            make_engine(name, CFG, long, slots=4)
    # The automatic pool: the static engine's rows per call, on the data axes.
    assert make_engine("continuous", CFG, SC, sh, rows_per_call=10).slots == 12


@pytest.mark.parametrize("overrides, mesh, slots", [
    (["train.batch_size=5", "rollout.group_size=4"], None, 20),
    (["train.batch_size=5", "rollout.group_size=3"], (4, 1, 1), 16),   # 15 rounded up to 4s
    (["train.batch_size=6", "rollout.group_size=4", "rollout.max_prompts_per_call=2"],
     None, 8)])
def test_the_trainers_automatic_pool_is_b_times_g(overrides, mesh, slots):
    """rollout.slots=0: the continuous engine the Trainer samples with
    (`Programs.sampler`) has the static engine's rows per call, B x G (or
    max_prompts_per_call x G), rounded up to the data-parallel size; a pool
    of B slots would draw the same samples up to G times slower."""
    from erpo_jax.train.config import RunConfig, apply_overrides
    from erpo_jax.train.programs import Programs
    cfg = apply_overrides(RunConfig(), ["rollout.engine=continuous", "rollout.slots=0",
                                        "rollout.max_new_tokens=16", "data.max_prompt_len=16",
                                        *overrides])
    sh = None if mesh is None else Sharding(make_mesh(mesh, jax.devices()[:int(np.prod(mesh))]))
    progs = Programs(cfg, CFG, sh, eos_ids=EOS, pad_id=0)
    assert isinstance(progs.sampler, ContinuousEngine)
    assert progs.sampler.slots == slots


def test_config_validation_names_engine_fields():
    from erpo_jax.train.config import RunConfig, apply_overrides, validate
    for bad, match in (("rollout.engine=vllm", "rollout.engine.*'static', 'continuous', 'paged'"),
                       ("rollout.slots=-1", "rollout.slots.*>= 0"),
                       ("rollout.refill=-2", "rollout.refill.*>= 0")):
        with pytest.raises(ValueError, match=match):
            validate(apply_overrides(RunConfig(), [bad]))
    # Against the mesh, before the policy loads: 6 slots over 4 data-parallel devices.
    with pytest.raises(ValueError, match=r"config field rollout.slots: is 6, not a multiple of "
                                         r"the data-parallel size 4.*set it to 8"):
        validate(apply_overrides(RunConfig(), ["rollout.engine=continuous", "rollout.slots=6",
                                               "mesh.shape=-1,1,1", "train.batch_size=16"]), 4)
    validate(apply_overrides(RunConfig(), ["rollout.engine=static", "rollout.slots=6",
                                           "mesh.shape=-1,1,1", "train.batch_size=16"]), 4)


def test_arithmetic_checkpoint(sft_model):
    """The session's SFT'd arithmetic checkpoint on its own task's prompts,
    4 samples each at temperature 1 (answers of several lengths, EOS-ended):
    continuous pools smaller and larger than G, neither dividing the 40
    samples, and a paged pool (pages of 8) draw the static engine's samples.
    (A pool of G, and a second paged pool, on a trained checkpoint: test_real_path's
    test_continuous_and_paged_engines_equal_static_on_the_chat_checkpoint;
    on random weights, test_continuous_equals_static_for_any_pool[4] and
    test_paged_engine's pool sizes.)"""
    from erpo_jax.model.hf import load_hf
    from erpo_jax.train.config import RunConfig, apply_overrides
    from erpo_jax.train.tasks import load_task, load_tokenizer
    tok = load_tokenizer(sft_model)
    task = load_task(apply_overrides(RunConfig(), ["data.n_train=64", "data.n_test=4"]), tok)
    cfg, p = load_hf(sft_model)
    sc = SamplingConfig(max_new_tokens=40, num_samples=4, eos_ids=tok.eos_ids,
                        pad_id=tok.pad_id, max_prompt_len=64)
    prompts = task.train_prompts[:10]
    want = StaticEngine(cfg, sc).sample(p, prompts, KEY)
    assert len(set(want.lengths)) > 3 and want.lengths.min() < sc.max_new_tokens, want.lengths
    for slots in (3, 7):
        got = ContinuousEngine(cfg, sc, slots=slots).sample(p, prompts, KEY)
        assert_same_samples(want, got, f"arithmetic slots={slots}")
    got = PagedEngine(cfg, sc, slots=3, page_size=8).sample(p, prompts, KEY)
    assert_same_samples(want, got, "arithmetic paged slots=3")


def test_continuous_decode_moves_activations_not_weights(params, monkeypatch):
    """The continuous engine's decode loop on an FSDP mesh gathers no weight,
    as the static sampler's step (test_sampler's twin): every all-gather is
    activation-sized; under the training rules it would gather every weight.
    And its MLP kernels split their hidden axis (`model.decode_layout`), so
    no chip exchanges the [slots, intermediate] activations: down's output
    is the one sum. Under the training layout gate's and up's are summed
    across chips in every layer (one all-reduce of the pair). An insert's
    prefill of a few prompts is weight-stationary too: under the training
    rules it would gather every weight for 4 prompts."""
    sharding = Sharding(make_mesh((1, 4, 1), jax.devices()[:4]))
    sc = SamplingConfig(max_new_tokens=8, num_samples=2, eos_ids=EOS)
    engine = ContinuousEngine(CFG, sc, sharding, slots=8)
    abstract = jax.tree_util.tree_map(
        lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s),
        params, model_lib.param_shardings(CFG, sharding))
    per_layer = [a.shape[1:] for a in jax.tree_util.tree_leaves(params["layers"])]
    smallest_matrix = min(int(np.prod(s)) for s in per_layer if len(s) >= 2)
    assert 8 * CFG.hidden_size <= smallest_matrix / 2, "shapes too close to tell apart"
    hidden = 8 * CFG.intermediate_size              # [slots, intermediate]
    assert sharding.decode_mlp_axes(CFG.intermediate_size) == ("fsdp",)

    def compiled(name="decode 8"):
        engine._programs.clear()
        program = dict((n, f) for n, _, f in engine.programs(abstract, 8, 8))[name]
        return program().compile().as_text()

    hlo = compiled()
    sizes = all_gather_sizes(hlo)
    assert sizes and max(sizes) < smallest_matrix, (sizes, smallest_matrix)
    # An insert of 4 prompts gathers activations ([4 x 8 tokens, hidden] is as
    # large as the smallest kernel here): 36% of the layers' weights on this
    # tiny model, against all of them and more under the training rules (below).
    layer_weights = CFG.num_layers * sum(int(np.prod(s)) for s in per_layer if len(s) >= 2)
    assert sum(all_gather_sizes(compiled("insert 4"))) < layer_weights / 2
    assert max(collective_sizes(hlo, "all-reduce")) < hidden
    with monkeypatch.context() as m:   # the training layout of the MLP kernels
        m.setattr(Sharding, "decode_mlp_axes", lambda self, size: None)
        summed = collective_sizes(compiled(), "all-reduce")
    assert sum(n >= hidden for n in summed) >= CFG.num_layers, summed
    monkeypatch.setattr(Sharding, "weight_stationary", lambda self, mlp_axes=None: self)
    assert sum(n >= smallest_matrix for n in all_gather_sizes(compiled())) >= 4 * CFG.num_layers
    assert sum(all_gather_sizes(compiled("insert 4"))) >= layer_weights


def test_auto_picks_paged_where_its_attention_is_the_tpu_kernel():
    """rollout.engine=auto: on the real path the paged engine on a TPU mesh
    whose model the Pallas kernel serves (head size a multiple of 128), the
    continuous engine on the CPU, on a TPU with another head size, or with
    the kernel turned off; the static engine on the arithmetic task."""
    import dataclasses

    from erpo_jax.rollout.engine import engine_name
    from erpo_jax.tools import plan as plan_lib
    from erpo_jax.train.config import RunConfig, apply_overrides
    if plan_lib.libtpu_missing() is not None:
        pytest.skip(plan_lib.libtpu_missing())
    tpu = Sharding(make_mesh((4, 1, 1), plan_lib.topology("v5e-4").devices()))
    qwen = dataclasses.replace(CFG, head_dim=128)
    assert qwen.head_dim == 128 and CFG.head_dim % 128
    real = apply_overrides(RunConfig(), ["data.task=jsonl"])
    assert engine_name(real, tpu, qwen) == "paged"
    assert engine_name(real, tpu) == "paged"
    assert engine_name(real, None, qwen) == "continuous"         # this CPU host
    assert engine_name(real, tpu, CFG) == "continuous"
    dense = apply_overrides(RunConfig(), ["data.task=jsonl", "rollout.paged_attention=dense"])
    assert engine_name(dense, tpu, qwen) == "continuous"
    assert engine_name(RunConfig(), tpu, qwen) == "static"
    chosen = apply_overrides(RunConfig(), ["data.task=jsonl", "rollout.engine=continuous"])
    assert engine_name(chosen, tpu, qwen) == "continuous"
