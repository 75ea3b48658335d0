"""Sharding: meshes on 8 fake devices, the logical table, and loading into a mesh."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding

from erpo_jax.model import model as M
from erpo_jax.model.config import ModelConfig
from erpo_jax.model.logprobs import token_logprobs
from erpo_jax.model.sharding import RULES, Sharding, logical_to_spec, make_mesh

CFG = ModelConfig(qkv_bias=True, qk_norm=True)


@pytest.fixture(scope="module")
def reference():
    params = M.init_params(CFG, jax.random.key(0))
    toks = jax.random.randint(jax.random.key(1), (8, 16), 0, CFG.vocab_size)
    mask = jnp.ones_like(toks).at[:, :3].set(0)
    logits, _ = M.forward(params, CFG, toks, attn_mask=mask)
    return params, toks, mask, np.asarray(logits)


@pytest.mark.parametrize("shape", [(8, 1, 1), (2, 2, 2), (1, 4, 2)])
def test_sharded_forward_matches_single_device(reference, shape):
    assert len(jax.devices()) == 8
    params, toks, mask, want = reference
    sh = Sharding(make_mesh(shape))
    sharded = M.init_params(CFG, jax.random.key(0), sh)
    # Same values as the unsharded init, and each leaf carries the table's sharding.
    jax.tree_util.tree_map(np.testing.assert_array_equal, params, sharded)
    axes = M.param_logical_axes(CFG)
    flat_axes = dict(jax.tree_util.tree_flatten_with_path(
        axes, is_leaf=lambda x: isinstance(x, tuple))[0])
    for path, leaf in jax.tree_util.tree_flatten_with_path(sharded)[0]:
        expected = NamedSharding(sh.mesh, logical_to_spec(flat_axes[path], RULES))
        assert leaf.sharding.is_equivalent_to(expected, leaf.ndim), jax.tree_util.keystr(path)
    batch = sh.named(("batch", None))
    fwd = jax.jit(lambda p, t, m: M.forward(p, CFG, t, attn_mask=m, sharding=sh)[0])
    got = fwd(sharded, jax.device_put(toks, batch), jax.device_put(mask, batch))
    valid = np.asarray(mask, bool)
    assert np.abs(np.asarray(got) - want)[valid].max() <= 1e-5
    lp = jax.jit(lambda p, t, m: token_logprobs(p, CFG, t, m, chunk_size=8, sharding=sh).logp)
    ref_lp = token_logprobs(params, CFG, toks, mask, chunk_size=8).logp
    np.testing.assert_allclose(np.asarray(lp(sharded, toks, mask)), np.asarray(ref_lp), atol=1e-5)


def test_embed_and_heads_are_actually_split():
    sh = Sharding(make_mesh((1, 4, 2)))
    params = M.init_params(CFG, jax.random.key(0), sh)
    q = params["layers"]["attn"]["q_proj"]  # [L, D, H, K]: D over fsdp, H over tensor
    assert q.addressable_shards[0].data.shape == (2, 64 // 4, 4 // 2, 16)


def test_load_hf_straight_into_mesh(tmp_path):
    pytest.importorskip("torch")
    from erpo_jax.model.hf import load_hf
    from hf_models import build_tiny_hf
    build_tiny_hf("qwen3", tmp_path)
    cfg, plain = load_hf(tmp_path)
    sh = Sharding(make_mesh((2, 2, 2)))
    _, sharded = load_hf(tmp_path, sharding=sh)
    jax.tree_util.tree_map(np.testing.assert_array_equal, plain, sharded)
    want = M.param_shardings(cfg, sh)
    jax.tree_util.tree_map(lambda a, s: assert_equiv(a, s), sharded, want)


def assert_equiv(a, s):
    assert a.sharding.is_equivalent_to(s, a.ndim)


def test_impossible_mesh_is_a_clear_error():
    with pytest.raises(ValueError, match="needs 16 devices but only 8"):
        make_mesh((4, 2, 2))
    with pytest.raises(ValueError, match="not divisible"):
        make_mesh((-1, 3, 1))


def test_indivisible_shape_names_both_numbers():
    cfg = ModelConfig(num_heads=6, num_kv_heads=3, head_dim=16)
    with pytest.raises(ValueError, match=r"[kv]_proj.*size 3.*not divisible by the 2"):
        M.param_shardings(cfg, Sharding(make_mesh((4, 1, 2))))


def test_two_logical_axes_on_one_mesh_axis_is_rejected():
    rules = dict(RULES, vocab="fsdp")
    with pytest.raises(ValueError, match="'vocab' and 'embed' both map to mesh axis 'fsdp'"):
        logical_to_spec(("vocab", "embed"), rules, "embed")


@pytest.mark.parametrize("tied", [False, True])
def test_vocab_parallel_logprob_gradients_match_single_device(tied):
    # On a mesh, the log-prob pass computes the LM head vocabulary-parallel
    # (logprobs.vocab_parallel): the same log-probs, entropies and gradients
    # (every parameter, the head's included) as on one device.
    from erpo_jax.model.logprobs import vocab_parallel
    cfg = ModelConfig(qkv_bias=True, qk_norm=True, tie_word_embeddings=tied)
    sh = Sharding(make_mesh((2, 2, 2)))
    assert vocab_parallel(cfg, sh) and not vocab_parallel(cfg, None)
    toks = jax.random.randint(jax.random.key(1), (8, 16), 0, cfg.vocab_size)
    mask = jnp.ones_like(toks).at[:, :3].set(0)
    w = jax.random.normal(jax.random.key(2), (3, 8, 15))

    def loss(p, s):
        out = token_logprobs(p, cfg, toks, mask, temperature=0.7, chunk_size=4, sharding=s)
        return sum(jnp.sum(a * wi) for a, wi in zip(out, w))

    params = M.init_params(cfg, jax.random.key(0))
    want_l, want_g = jax.value_and_grad(loss)(params, None)
    sharded = M.init_params(cfg, jax.random.key(0), sh)
    got_l, got_g = jax.jit(jax.value_and_grad(lambda p: loss(p, sh)))(sharded)
    np.testing.assert_allclose(float(got_l), float(want_l), rtol=1e-5)
    for path, g in jax.tree_util.tree_flatten_with_path(got_g)[0]:
        r = dict(jax.tree_util.tree_flatten_with_path(want_g)[0])[path]
        np.testing.assert_allclose(np.asarray(g), np.asarray(r), rtol=1e-4, atol=1e-5,
                                   err_msg=jax.tree_util.keystr(path))


def test_grouped_query_logprobs_on_a_mesh_match_single_device():
    # model.share_query on a mesh: each group's query runs once on the
    # devices that hold its rows (4 queries over a data-parallel size of 4),
    # with the same log-probs and gradients as every row whole on one device.
    sh = Sharding(make_mesh((2, 2, 2)))
    assert sh.data_size == 4
    G, Q, R = 2, 10, 6
    query = jax.random.randint(jax.random.key(1), (4, Q), 1, CFG.vocab_size)
    toks = jnp.concatenate([jnp.repeat(query, G, axis=0),
                            jax.random.randint(jax.random.key(2), (8, R), 1, CFG.vocab_size)], 1)
    mask = jnp.ones_like(toks, bool).at[:2, :4].set(False).at[5, -2:].set(False)
    w = jax.random.normal(jax.random.key(3), (3, 8, Q + R - 1)) * (mask[:, :-1] & mask[:, 1:])

    def loss(p, s, g):
        out = token_logprobs(p, CFG, toks, mask, temperature=0.7, chunk_size=4, sharding=s,
                             response_columns=R, group_size=g)
        return sum(jnp.sum(a * wi) for a, wi in zip(out, w))

    params = M.init_params(CFG, jax.random.key(0))
    want_l, want_g = jax.value_and_grad(loss)(params, None, 1)
    sharded = M.init_params(CFG, jax.random.key(0), sh)
    got_l, got_g = jax.jit(jax.value_and_grad(lambda p: loss(p, sh, G)))(sharded)
    np.testing.assert_allclose(float(got_l), float(want_l), rtol=1e-5)
    for path, g in jax.tree_util.tree_flatten_with_path(got_g)[0]:
        r = dict(jax.tree_util.tree_flatten_with_path(want_g)[0])[path]
        np.testing.assert_allclose(np.asarray(g), np.asarray(r), rtol=1e-4, atol=1e-5,
                                   err_msg=jax.tree_util.keystr(path))
