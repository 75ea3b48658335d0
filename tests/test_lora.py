"""LoRA (model/lora.py): zero adapters are the base bit for bit; the adapters'
gradient is LoRA's chain rule of the full gradient, and an update moves them
alone; Query-KL's exact zeros hold; every engine samples the adapted policy
as the merged weights; the adapters shard as their base layers; a LoRA run on
an HF checkpoint trains, resumes bit-identically after SIGTERM, refuses
another base, exports a merged model and PEFT adapters that `peft` loads to
the merged model's logits; the bad settings are refused naming the field."""

from __future__ import annotations

import dataclasses
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from erpo_jax import cli
from erpo_jax.model import lora
from erpo_jax.model import model as model_lib
from erpo_jax.model.config import LORA_TARGETS, ModelConfig
from erpo_jax.model.sharding import Sharding, make_mesh
from erpo_jax.rl.loss import LossConfig
from erpo_jax.train.config import ConfigError, load_config

from engine_checks import assert_same_samples
from tiny_runs import rl_args

CFG = ModelConfig(lora_rank=4, lora_alpha=8.0)   # tiny: vocab 256, 2 layers, every target
BASE_CFG = lora.base_config(CFG)


@pytest.fixture(scope="module")
def params():
    """Base weights and adapters with B drawn (a moved policy, not step 0)."""
    p = model_lib.init_params(CFG, jax.random.key(0))
    ad = lora.adapters(p)
    keys = iter(jax.random.split(jax.random.key(1), 64))
    ad = jax.tree_util.tree_map(lambda x: x if not jnp.all(x == 0) else
                                0.05 * jax.random.normal(next(keys), x.shape), ad)
    return lora.attach(lora.base(p), ad)


def test_zero_adapters_are_the_base_bit_for_bit():
    """B = 0 at the start: the merged weights are the base's bit for bit, and
    so are the adapted model's logits computed op by op (scanned and
    unrolled). A compiled program of the adapted model is another program:
    XLA fuses the base's reductions (the q/k RMSNorm after k + 0) another
    way, so there the logits and the grouped query pass agree to float32
    rounding, which is checked too."""
    tok = jax.random.randint(jax.random.key(2), (4, 9), 0, 256)
    mask = jnp.ones(tok.shape, bool)
    for scan in (True, False):
        cfg = dataclasses.replace(CFG, scan_layers=scan)
        base_cfg = lora.base_config(cfg)
        p = model_lib.init_params(cfg, jax.random.key(0))
        b = lora.base(p)
        assert all(bool(jnp.all(x == 0)) for k, x in _leaves(lora.adapters(p))
                   if k.endswith(lora.B_SUFFIX))
        for (k, x), (_, y) in zip(_leaves(lora.merge(p, cfg)), _leaves(b)):
            np.testing.assert_array_equal(np.asarray(x), np.asarray(y), err_msg=k)
        with jax.disable_jit():
            got = model_lib.forward(p, cfg, tok)[0]
            want = model_lib.forward(b, base_cfg, tok)[0]
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
        f = jax.jit(lambda p, c: model_lib.forward(p, c, tok)[0], static_argnums=1)
        np.testing.assert_allclose(f(p, cfg), f(b, base_cfg), atol=2e-6, rtol=0)
        h = jax.jit(lambda p, c: model_lib.hidden_states_grouped(p, c, tok, mask, group_size=2,
                                                                 query_width=4), static_argnums=1)
        for x, y in zip(h(p, cfg), h(b, base_cfg)):
            np.testing.assert_allclose(np.asarray(x), np.asarray(y), atol=2e-6, rtol=0)


def _leaves(tree):
    return [(str(path[-1].key), x) for path, x in jax.tree_util.tree_flatten_with_path(tree)[0]]


def _loss(cfg, batch, loss_cfg):
    from erpo_jax.model.logprobs import token_logprobs
    from erpo_jax.rl.loss import loss_terms

    def f(p):
        stats = token_logprobs(p, cfg, batch.tokens, batch.attn_mask, chunk_size=None)
        terms, _ = loss_terms(stats, batch, loss_cfg)
        return sum(terms.values())
    return f


def test_adapter_gradient_is_the_chain_rule_of_the_full_gradient(params):
    """The ERPO + Policy-KL loss's gradient on the adapters is LoRA's chain rule
    of the full fine-tuning gradient G at the merged weights W + s A B:
    dA = s G B^T (over W's output axes), dB = s A^T G (over its input axes)."""
    from erpo_jax.rl.synthetic import synthetic_batch
    merged = lora.merge(params, CFG)
    batch = synthetic_batch(merged, BASE_CFG, 0, num_queries=2, group_size=2)
    loss_cfg = LossConfig(beta_query=0.1, beta_policy=0.05)
    g_full = jax.jit(jax.grad(_loss(BASE_CFG, batch, loss_cfg)))(merged)
    frozen = lora.base(params)
    g_ad = jax.jit(jax.grad(lambda a: _loss(CFG, batch, loss_cfg)(lora.attach(frozen, a))))(
        lora.adapters(params))
    s = lora.scale(CFG)
    checked = 0
    for module, names in (("attn", LORA_TARGETS[:4]), ("mlp", LORA_TARGETS[4:])):
        for name in names:
            k = lora.n_in(name)
            a = params["layers"][module][name + lora.A_SUFFIX]
            b = params["layers"][module][name + lora.B_SUFFIX]
            G = g_full["layers"][module][name]
            want_a = s * jax.vmap(lambda g, b: jnp.tensordot(
                g, b, (tuple(range(k, g.ndim)), tuple(range(1, b.ndim)))))(G, b)
            want_b = s * jax.vmap(lambda a, g: jnp.tensordot(
                a, g, (tuple(range(k)), tuple(range(k)))))(a, G)
            got_a = g_ad["layers"][module][name + lora.A_SUFFIX]
            got_b = g_ad["layers"][module][name + lora.B_SUFFIX]
            scale_a, scale_b = float(jnp.max(jnp.abs(want_a))), float(jnp.max(jnp.abs(want_b)))
            assert scale_a > 0 and scale_b > 0, name
            np.testing.assert_allclose(got_a, want_a, atol=2e-5 * scale_a, rtol=1e-4,
                                       err_msg=name)
            np.testing.assert_allclose(got_b, want_b, atol=2e-5 * scale_b, rtol=1e-4,
                                       err_msg=name)
            checked += 1
    assert checked == len(LORA_TARGETS)


@pytest.mark.parametrize("base_dtype", ["float32", "bfloat16"])
def test_an_update_moves_the_adapters_alone(params, base_dtype):
    """One AdamW update with weight decay (which would move any parameter the
    optimizer held): every base leaf is bit for bit as it was (stored in
    float32 or bfloat16), every float32 adapter moved, and the optimizer's
    moments exist for the adapters only."""
    from erpo_jax.rl.synthetic import synthetic_batch
    from erpo_jax.train import train_step as S
    from erpo_jax.train.config import AlgoSection, OptimSection
    batch = synthetic_batch(lora.merge(params, CFG), BASE_CFG, 0, num_queries=4, group_size=2)
    tx, _ = S.make_optimizer(OptimSection(lr=1e-2, weight_decay=0.1), 10)
    cfg = dataclasses.replace(CFG, param_dtype=base_dtype)
    params = lora.attach(jax.tree_util.tree_map(lambda x: x.astype(base_dtype),
                                                lora.base(params)), lora.adapters(params))
    before = jax.device_get(params)
    state = S.init_state(jax.tree_util.tree_map(jnp.copy, params), tx, model_cfg=cfg)
    moments = [(x.shape, x.dtype) for x in jax.tree_util.tree_leaves(state.opt_state) if x.ndim]
    assert sorted(moments) == sorted(2 * [(x.shape, jnp.float32) for x in
                                          jax.tree_util.tree_leaves(lora.adapters(params))])
    upd = S.build_update(cfg, LossConfig(beta_query=0.1, beta_policy=0.05), AlgoSection(), tx,
                         micro_batches=2, group_size=2)
    state, metrics = upd(state, batch, None)
    assert float(metrics["update_skipped"]) == 0 and float(metrics["grad_norm"]) > 0
    after = jax.device_get(state.params)
    for (k, x), (_, y) in zip(_leaves(lora.base(before)), _leaves(lora.base(after))):
        np.testing.assert_array_equal(x, y, err_msg=k)
        assert y.dtype == jnp.dtype(base_dtype), k
    for (k, x), (_, y) in zip(_leaves(lora.adapters(before)), _leaves(lora.adapters(after))):
        assert not np.array_equal(x, y) and y.dtype == np.float32, k


def test_query_kl_zeros_hold_on_the_adapters(params):
    """inspect-grads' report under LoRA: theta is the adapters; Query-KL's
    logit gradient at response positions and the response terms' at query
    positions are exact zeros, and every term reaches the adapters."""
    from erpo_jax.rl.grad_flow import inspect_gradients
    from erpo_jax.rl.synthetic import synthetic_batch
    batch = synthetic_batch(lora.merge(params, CFG), BASE_CFG, 0, num_queries=2, group_size=2)
    rep = inspect_gradients(params, CFG, batch, LossConfig(), unit=True)
    t = rep["terms"]
    assert t["query_kl"]["logit_grad_response"] == 0.0
    for name in ("pg", "policy_kl", "entropy"):
        assert t[name]["logit_grad_query"] == 0.0, name
    for name in ("pg", "query_kl", "policy_kl"):
        assert t[name]["param_grad_norm"] > 0, name
    assert "LoRA adapters (rank 4" in rep["parameters"]
    groups = set(next(iter(rep["param_grad_by_layer"].values())))
    assert groups == {"layer_0", "layer_1"}   # no embedding, norm or head: they are frozen


@pytest.mark.parametrize("engine", ["static", "continuous", "paged"])
def test_every_engine_samples_the_adapted_policy_as_the_merged_weights(params, engine):
    """The adapters applied in the decode step draw the samples the merged
    weights draw (the same tokens; log-probs to float rounding)."""
    from erpo_jax.rollout.continuous import ContinuousEngine
    from erpo_jax.rollout.paged import PagedEngine
    from erpo_jax.rollout.static import StaticEngine
    from erpo_jax.rollout.types import SamplingConfig
    sc = SamplingConfig(max_new_tokens=12, num_samples=2, eos_ids=tuple(range(5, 21)), top_k=50)
    rng = np.random.default_rng(0)
    prompts = [rng.integers(21, 256, size=k).tolist() for k in (3, 7, 5)]
    key = jax.random.key(3)
    make = {"static": lambda c: StaticEngine(c, sc),
            "continuous": lambda c: ContinuousEngine(c, sc, slots=4),
            "paged": lambda c: PagedEngine(c, sc, slots=4, page_size=4)}[engine]
    want = make(BASE_CFG).sample(lora.merge(params, CFG), prompts, key)
    got = make(CFG).sample(params, prompts, key)
    assert_same_samples(want, got, engine)


def test_adapters_shard_as_their_base_layers(params):
    """On a (data 2, fsdp 2, tensor 2) mesh: A takes its kernel's input axes'
    shardings, B its output axes', the rank axis is whole; a sharded update
    equals the single-device one."""
    from erpo_jax.rl.synthetic import synthetic_batch
    from erpo_jax.train import train_step as S
    from erpo_jax.train.config import AlgoSection, OptimSection
    sh = Sharding(make_mesh((2, 2, 2), jax.devices()[:8]))
    shard = model_lib.param_shardings(CFG, sh)
    at = shard["layers"]["attn"]
    q, qa, qb = (at[n].spec for n in ("q_proj", "q_proj_lora_a", "q_proj_lora_b"))
    assert qa == jax.sharding.PartitionSpec(*q[:2], None)           # [L, embed, r]
    assert qb == jax.sharding.PartitionSpec(q[0], None, *q[2:])     # [L, r, heads, head_dim]
    down = shard["layers"]["mlp"]
    assert down["down_proj_lora_a"].spec[:2] == down["down_proj"].spec[:2]
    batch = synthetic_batch(lora.merge(params, CFG), BASE_CFG, 0, num_queries=4, group_size=2)
    loss_cfg = LossConfig(beta_query=0.1, beta_policy=0.05)
    tx, _ = S.make_optimizer(OptimSection(lr=1e-2), 10)
    outs = []
    for sharding in (None, sh):
        p = params if sharding is None else jax.device_put(params, shard)
        state = S.init_state(jax.tree_util.tree_map(jnp.copy, p), tx, sharding=sharding,
                             model_cfg=CFG)
        upd = S.build_update(CFG, loss_cfg, AlgoSection(), tx, group_size=2, sharding=sharding,
                             state_shardings=None if sharding is None else
                             S.shardings_of(state))
        b = batch if sharding is None else jax.device_put(
            batch, jax.tree_util.tree_map(lambda x: sh.named(("batch",) + (None,) * (x.ndim - 1)),
                                          batch))
        state, _ = upd(state, b, None)
        outs.append(jax.device_get(lora.adapters(state.params)))
    for (k, x), (_, y) in zip(_leaves(outs[0]), _leaves(outs[1])):
        np.testing.assert_allclose(x, y, atol=2e-6, rtol=1e-5, err_msg=k)


# ----------------------------------------------------------------------------- bad input


@pytest.mark.parametrize("override, field, says", [
    (["model.lora_rank=0", "model.lora_targets=[\"q_proj\"]"], "model.lora_rank",
     "give a positive rank"),
    (["model.lora_rank=-2"], "model.lora_rank", "give a positive rank"),
    (["model.lora_rank=4", "model.lora_targets=[\"qkv\"]"], "model.lora_targets",
     "'gate_proj'"),
    (["model.lora_rank=40"], "model.lora_rank", "at most 32"),
    (["model.lora_rank=4", "algo.advantage=gae"], "model.lora_rank", "learned critic"),
    (["model.lora_rank=4", "model.lora_alpha=0"], "model.lora_alpha", "must be > 0"),
])
def test_bad_lora_settings_are_refused_naming_the_field(override, field, says, tmp_path):
    """Each in one sentence before anything compiles (`erpo validate`'s check):
    the tiny preset's smallest targeted dimension is 32 (k and v: 2 heads x 16)."""
    from erpo_jax.train.config import validate
    cfg = load_config(None, ["model.init=random", "model.preset=tiny",
                             f"train.out_dir={tmp_path}", *override])
    with pytest.raises(ConfigError, match=f"config field {field}: .*{says}"):
        validate(cfg)


# ----------------------------------------------------------------------------- a run


@pytest.fixture(scope="module")
def lora_run(sft_model, tmp_path_factory):
    """A 4-step ERPO LoRA run on the session's HF checkpoint, with the
    Policy-KL metric and query drift logged, checkpointed every step."""
    out = tmp_path_factory.mktemp("lora") / "run"
    args = rl_args(sft_model, out, "model.lora_rank=8",
                   "algo.method=erpo", "train.steps=4", "train.ckpt_every=1",
                   "train.keep_checkpoints=5", "train.policy_kl_metric=true", "train.drift_every=2",
                   "optim.lr=5e-3")
    assert cli.main(["train", *args]) == 0
    return out, args


def test_a_lora_run_checkpoints_adapters_and_exports_both_ways(lora_run, sft_model, tmp_path):
    """The checkpoint holds the adapters, their optimizer state and the base's
    hash (no base weights); the merged export loads in transformers, and
    `peft` on the transformers base with <out_dir>/adapter gives its logits."""
    import torch
    import transformers
    from peft import PeftModel
    from erpo_jax.train import checkpoint as ckpt_lib
    out, _ = lora_run
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2, 3, 4]
    assert rows[-1]["drift/policy_kl_k3"] > 0 and rows[-1]["drift/qkl_k3"] > 0   # it moved
    ck = ckpt_lib.Checkpointer(out / "checkpoints")
    meta = ck.meta(4)
    assert len(meta["base_hash"]) == 40
    names = {p.name for p in (out / "checkpoints" / "4" / "state").rglob("*")}
    text = " ".join(names) + (out / "checkpoints" / "4" / "state" / "_METADATA").read_text()
    assert "lora_a" in text and "'q_proj'" not in text and "embed'" not in text
    ck.close()
    adapter = out / "adapter"
    conf = json.loads((adapter / "adapter_config.json").read_text())
    assert conf["r"] == 8 and conf["peft_type"] == "LORA"
    ids = torch.tensor([[3, 17, 22, 9, 41, 5, 30]])
    merged = transformers.AutoModelForCausalLM.from_pretrained(out / "model",
                                                               dtype=torch.float32)
    base = transformers.AutoModelForCausalLM.from_pretrained(sft_model, dtype=torch.float32)
    peft_model = PeftModel.from_pretrained(base, adapter)
    with torch.no_grad():
        want = merged(ids).logits.numpy()
        got = peft_model(ids).logits.numpy()
    np.testing.assert_allclose(got, want, atol=1e-4, rtol=0)
    # And against our own merge of the adapters read back from PEFT's files.
    from erpo_jax.model.hf import load_hf
    cfg, p = load_hf(str(sft_model), param_dtype="float32")
    lcfg = dataclasses.replace(cfg, lora_rank=8)
    ad = lora.load_peft(adapter, lcfg)
    ours = model_lib.forward(lora.merge(lora.attach(p, ad), lcfg), cfg, jnp.asarray(ids.numpy()))[0]
    np.testing.assert_allclose(got, np.asarray(ours), atol=1e-4)


def test_a_lora_run_resumes_bit_identically_and_refuses_another_base(lora_run, sft_model,
                                                                    tmp_path, capsys):
    """Resume from the checkpoint of step 2 (what a SIGTERM leaves) reaches
    the uninterrupted run's adapters and merged model byte for byte, and its
    metrics; the same run dir with another base
    model (the checkpoint's adapters were trained on the first) is refused."""
    import shutil
    out, args = lora_run
    again = tmp_path / "again"
    shutil.copytree(out, again, ignore=shutil.ignore_patterns("3", "4", "model", "adapter",
                                                              "run.lock"))
    lines = (out / "metrics.jsonl").read_text().splitlines()
    (again / "metrics.jsonl").write_text("\n".join(lines[:2]) + "\n")
    new_args = [a if not a.startswith("train.out_dir=") else f"train.out_dir={again}"
                for a in args]
    assert cli.main(["train", *new_args]) == 0
    for f in ("adapter/adapter_model.safetensors", "model/model.safetensors"):
        assert (again / f).read_bytes() == (out / f).read_bytes(), f
    run_rows = lambda path: [{k: v for k, v in json.loads(x).items()
                              if not (k.startswith("time/") or k == "tokens_per_sec")}
                             for x in path.read_text().splitlines()]
    assert run_rows(again / "metrics.jsonl") == run_rows(out / "metrics.jsonl")
    # Another base: the SFT weights perturbed, exported beside.
    from erpo_jax.model.hf import export_hf, load_hf
    from erpo_jax.rl.synthetic import perturb
    cfg, p = load_hf(str(sft_model), param_dtype="float32")
    other = tmp_path / "other"
    export_hf(perturb(p, 5, 0.1), cfg, other)
    shutil.copy(sft_model / "erpo_tokenizer.json", other / "erpo_tokenizer.json")
    moved = [a if not a.startswith("model.path=") else f"model.path={other}" for a in new_args]
    moved = [a if not a.startswith("train.steps=") else "train.steps=6" for a in moved]
    assert cli.main(["train", *moved, "train.allow_config_change=true"]) == 2
    said = capsys.readouterr().err
    assert "config field model.path: the base model at" in said
    assert "is not the one the LoRA checkpoint of step 4" in said
    assert not (again / "checkpoints" / "5").exists()


@pytest.mark.long   # the report's gradients: test_query_kl_zeros_hold_on_the_adapters
def test_inspect_grads_reads_a_runs_peft_adapters(lora_run, tmp_path, capsys):
    """`erpo inspect-grads --checkpoint <out_dir>/adapter`: the policy is the
    base (model.path) with the run's adapters; the gradients are the
    adapters'; Query-KL's response zeros hold on the run's sampled batch."""
    from erpo_jax.train.config import save_config
    out, args = lora_run
    cfg_file, rep_file = tmp_path / "config.json", tmp_path / "report.json"
    save_config(load_config(None, args), cfg_file)
    assert cli.main(["inspect-grads", "--config", str(cfg_file), "--checkpoint",
                     str(out / "adapter"), "--unit", "--json", str(rep_file)]) == 0
    rep = json.loads(rep_file.read_text())
    assert rep["parameters"].startswith("the LoRA adapters (rank 8")
    t = rep["terms"]
    assert t["query_kl"]["logit_grad_response"] == 0.0 and t["query_kl"]["value"] > 0
    assert t["pg"]["logit_grad_query"] == 0.0
    assert t["query_kl"]["param_grad_norm"] > 0
    assert str(out / "adapter") in rep["source"]["model"]
    assert "theta here: the LoRA adapters" in capsys.readouterr().out
