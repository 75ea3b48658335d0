"""Foundation: HF parity, export round trip, KV cache, chunked log-probs, errors."""

import json
import struct

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from erpo_jax.model import hf as hf_lib
from erpo_jax.model import model as M
from erpo_jax.model.config import ModelConfig, from_hf_config
from erpo_jax.model.logprobs import token_logprobs
from hf_models import KINDS, build_tiny_hf

torch = pytest.importorskip("torch")


@pytest.fixture(scope="module", params=KINDS)
def tiny(request, tmp_path_factory):
    path = tmp_path_factory.mktemp(request.param)
    hf_model = build_tiny_hf(request.param, path)
    cfg, params = hf_lib.load_hf(path)
    return request.param, path, hf_model, cfg, params


def _left_padded_batch(vocab, seed=0):
    rng = np.random.RandomState(seed)
    lengths = [5, 12, 9]
    T = max(lengths)
    toks = np.zeros((len(lengths), T), np.int64)
    mask = np.zeros((len(lengths), T), np.int64)
    for i, n in enumerate(lengths):
        toks[i, T - n:] = rng.randint(1, vocab, n)
        mask[i, T - n:] = 1
    return toks, mask


def _hf_logits(hf_model, toks, mask):
    with torch.no_grad():
        pos = np.maximum(np.cumsum(mask, -1) - 1, 0)
        return hf_model(input_ids=torch.tensor(toks), attention_mask=torch.tensor(mask),
                        position_ids=torch.tensor(pos)).logits.numpy()


def test_logits_match_transformers(tiny):
    kind, _, hf_model, cfg, params = tiny
    assert cfg.family == kind
    toks, mask = _left_padded_batch(cfg.vocab_size)
    ours, _ = M.forward(params, cfg, jnp.asarray(toks), attn_mask=jnp.asarray(mask))
    diff = np.abs(np.asarray(ours) - _hf_logits(hf_model, toks, mask))[mask.astype(bool)]
    assert diff.max() <= 1e-4, (kind, diff.max())


def _greedy_with_cache(params, cfg, toks, mask, n_new):
    B, T = toks.shape
    cache = M.init_cache(cfg, B, T + n_new)
    step = jax.jit(lambda p, t, pos, m, c: M.forward(p, cfg, t, pos, m, c))
    pos = M.positions_from_mask(jnp.asarray(mask))
    logits, cache = step(params, jnp.asarray(toks), pos, jnp.asarray(mask), cache)
    last_pos = pos[:, -1:]
    out = []
    nxt = jnp.argmax(logits[:, -1], -1)[:, None]
    for _ in range(n_new):
        out.append(np.asarray(nxt[:, 0]))
        last_pos = last_pos + 1
        logits, cache = step(params, nxt, last_pos, jnp.ones_like(nxt), cache)
        nxt = jnp.argmax(logits[:, -1], -1)[:, None]
    return np.stack(out, 1)


def test_llama_fixture_has_a_frequency_in_every_rope_band():
    """The llama3 rule leaves high frequencies alone, divides low ones by
    `factor` and interpolates the band between: the parity fixture must have
    a frequency in each, and our inverse frequencies must equal HF's."""
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    from hf_models import tiny_hf_config
    hf = tiny_hf_config("llama")
    sc = hf.rope_scaling
    cfg = from_hf_config(hf.to_dict())
    assert cfg.rope_scaling.kind == "llama3"
    head_dim = hf.hidden_size // hf.num_attention_heads
    inv = 1.0 / sc["rope_theta"] ** (np.arange(0, head_dim, 2) / head_dim)
    wavelen = 2 * np.pi / inv
    orig = sc["original_max_position_embeddings"]
    high, low = orig / sc["high_freq_factor"], orig / sc["low_freq_factor"]
    bands = {"high (unscaled)": wavelen < high, "smoothed": (wavelen >= high) & (wavelen <= low),
             "low (divided by factor)": wavelen > low}
    assert all(np.sum(m) >= 1 for m in bands.values()), {k: int(np.sum(m)) for k, m in bands.items()}
    want = ROPE_INIT_FUNCTIONS["llama3"](hf, "cpu")[0].double().numpy()
    np.testing.assert_allclose(np.asarray(M.rope_inv_freq(cfg)), want, rtol=1e-6)
    for name, m in bands.items():   # each band is transformed as the rule says
        ratio = want[m] / inv[m]
        if name.startswith("high"):
            np.testing.assert_allclose(ratio, 1.0, rtol=1e-6)
        elif name.startswith("low"):
            np.testing.assert_allclose(ratio, 1.0 / sc["factor"], rtol=1e-6)
        else:
            assert np.all((ratio > 1.0 / sc["factor"] + 1e-3) & (ratio < 1.0 - 1e-3)), ratio


def test_greedy_tokens_match_transformers(tiny):
    kind, _, hf_model, cfg, params = tiny
    toks, mask = _left_padded_batch(cfg.vocab_size, seed=1)
    ours = _greedy_with_cache(params, cfg, toks, mask, 16)
    with torch.no_grad():
        ref = hf_model.generate(input_ids=torch.tensor(toks), attention_mask=torch.tensor(mask),
                                max_new_tokens=16, min_new_tokens=16, do_sample=False,
                                pad_token_id=0, eos_token_id=None).numpy()[:, toks.shape[1]:]
    np.testing.assert_array_equal(ours, ref)


def test_cached_decode_equals_full_forward(tiny):
    _, _, _, cfg, params = tiny
    toks, mask = _left_padded_batch(cfg.vocab_size, seed=2)
    B, T = toks.shape
    full, _ = M.forward(params, cfg, jnp.asarray(toks), attn_mask=jnp.asarray(mask))
    pos = M.positions_from_mask(jnp.asarray(mask))
    cache = M.init_cache(cfg, B, T + 3)
    split = 6
    parts = []
    l, cache = M.forward(params, cfg, jnp.asarray(toks[:, :split]), pos[:, :split],
                         jnp.asarray(mask[:, :split]), cache)
    parts.append(l)
    for t in range(split, T):
        l, cache = M.forward(params, cfg, jnp.asarray(toks[:, t:t + 1]), pos[:, t:t + 1],
                             jnp.asarray(mask[:, t:t + 1]), cache)
        parts.append(l)
    cached = np.concatenate([np.asarray(p) for p in parts], 1)
    m = mask.astype(bool)
    assert np.abs(cached - np.asarray(full))[m].max() <= 1e-5
    assert int(cache.index) == T


@pytest.mark.long(when=lambda p: p["remat"] and p["tiny"] != "qwen2")   # remat: Qwen2 by default
@pytest.mark.parametrize("remat", [False, True])
def test_scanned_and_unrolled_layers_agree(tiny, remat):
    """The layer scan and the unrolled layers are one model: equal logits and
    equal gradients for the stacked parameters, with and without remat."""
    import dataclasses
    _, _, _, cfg, params = tiny
    toks, mask = (jnp.asarray(a) for a in _left_padded_batch(cfg.vocab_size, seed=3))
    out = {}
    for scan in (True, False):
        c = dataclasses.replace(cfg, scan_layers=scan, remat=remat)
        assert c.scans_layers is scan
        loss = lambda p: jnp.sum(token_logprobs(p, c, toks, mask, chunk_size=None).logp * mask[:, 1:])
        fn = jax.jit(jax.value_and_grad(loss))
        # The switch takes effect: only the scanned program loops over layers.
        assert ("while" in fn.lower(params).as_text()) is scan
        out[scan] = fn(params)
    assert abs(float(out[True][0]) - float(out[False][0])) <= 1e-4 * abs(float(out[True][0]))
    for a, b in zip(jax.tree_util.tree_leaves(out[True][1]), jax.tree_util.tree_leaves(out[False][1])):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-4, atol=1e-6)
    assert ModelConfig(num_layers=4).scans_layers is False
    assert ModelConfig(num_layers=5).scans_layers is True


def test_export_round_trip(tiny, tmp_path):
    kind, path, hf_model, cfg, params = tiny
    out = hf_lib.export_hf(params, cfg, tmp_path / "export")
    # HF -> ours -> HF: byte-identical tensors.
    src = hf_lib.open_safetensors(path)
    dst = hf_lib.open_safetensors(out)
    assert set(src) == set(dst)
    for name in src:
        a, b = src[name][name], dst[name][name]
        assert a.dtype == b.dtype and a.shape == b.shape, name
        assert a.tobytes() == b.tobytes(), name
    # ours -> HF directory -> transformers loads it -> same logits.
    import transformers as tf
    reloaded = tf.AutoModelForCausalLM.from_pretrained(str(out), dtype=torch.float32).eval()
    toks, mask = _left_padded_batch(cfg.vocab_size, seed=3)
    ours, _ = M.forward(params, cfg, jnp.asarray(toks), attn_mask=jnp.asarray(mask))
    diff = np.abs(np.asarray(ours) - _hf_logits(reloaded, toks, mask))[mask.astype(bool)]
    assert diff.max() <= 1e-4


def test_export_generated_config_and_sharded_files(tmp_path):
    cfg = ModelConfig(family="llama", qk_norm=False, tie_word_embeddings=False)
    params = M.init_params(cfg, jax.random.key(3))
    out = hf_lib.export_hf(params, cfg, tmp_path / "ours", max_shard_bytes=200_000)
    assert (out / "model.safetensors.index.json").is_file()
    cfg2, params2 = hf_lib.load_hf(out)
    assert cfg2 == cfg
    jax.tree_util.tree_map(np.testing.assert_array_equal, params, params2)


def _model_and_rows():
    """(cfg, params, tokens [3, 41], mask with row 0 left-padded by 7) for the head tests."""
    cfg = ModelConfig(vocab_size=512)
    params = M.init_params(cfg, jax.random.key(0))
    toks = jax.random.randint(jax.random.key(1), (3, 41), 0, cfg.vocab_size)
    mask = jnp.ones_like(toks).at[0, :7].set(0)
    return cfg, params, toks, mask


def test_token_logprobs_chunked_equals_unchunked():
    cfg, params, toks, mask = _model_and_rows()
    full = token_logprobs(params, cfg, toks, mask, temperature=0.8, chunk_size=None)
    chunked = token_logprobs(params, cfg, toks, mask, temperature=0.8, chunk_size=16)
    # To 1e-6 relative (the entropy is ~6 here, where a float32 ulp is 5e-7 and the
    # two layouts sum the 512 vocabulary terms in different orders).
    for a, b in zip(full, chunked):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=1e-6, rtol=1e-6)
    # The values are the log-softmax of the full logits.
    logits, _ = M.forward(params, cfg, toks, attn_mask=mask)
    ref = jax.nn.log_softmax(logits[:, :-1] / 0.8)
    ref = jnp.take_along_axis(ref, toks[:, 1:, None], -1)[..., 0]
    np.testing.assert_allclose(np.asarray(chunked.logp), np.asarray(ref), atol=1e-5)
    ref1 = jnp.take_along_axis(jax.nn.log_softmax(logits[:, :-1]), toks[:, 1:, None], -1)[..., 0]
    np.testing.assert_allclose(np.asarray(chunked.logp_t1), np.asarray(ref1), atol=1e-5)


@pytest.mark.parametrize("chunk", [None, 16])
def test_token_logprobs_last_scores_only_the_response_columns(chunk):
    cfg, params, toks, mask = _model_and_rows()
    full = token_logprobs(params, cfg, toks, mask, temperature=0.8, chunk_size=chunk)
    part = token_logprobs(params, cfg, toks, mask, temperature=0.8, chunk_size=chunk, last=19)
    for a, b in zip(full, part):
        assert b.shape == a.shape == (3, 40)
        np.testing.assert_allclose(np.asarray(b[:, -19:]), np.asarray(a[:, -19:]),
                                   atol=1e-6, rtol=1e-6)
        assert np.all(np.asarray(b[:, :-19]) == 0.0)
    # The head runs on the last 19 positions only: no [3, 40, V] logits.
    hlo = jax.jit(lambda p: token_logprobs(p, cfg, toks, mask, chunk_size=None, last=19).logp
                  ).lower(params).as_text()
    assert "3x19x512" in hlo and "3x40x512" not in hlo
    with pytest.raises(ValueError, match="last=41 must be in"):
        token_logprobs(params, cfg, toks, mask, last=41)


@pytest.mark.parametrize("chunk", [None, 16])
def test_token_logprobs_response_columns_scores_each_part_at_its_temperature(chunk):
    cfg, params, toks, mask = _model_and_rows()
    full = token_logprobs(params, cfg, toks, mask, temperature=0.8, chunk_size=chunk)
    split = token_logprobs(params, cfg, toks, mask, temperature=0.8, chunk_size=chunk,
                           response_columns=19)
    close = lambda a, b: np.testing.assert_allclose(np.asarray(a), np.asarray(b),
                                                    atol=1e-6, rtol=1e-6)
    close(split.logp[:, -19:], full.logp[:, -19:])
    close(split.entropy[:, -19:], full.entropy[:, -19:])
    close(split.logp_t1[:, :-19], full.logp_t1[:, :-19])
    for a in (split.logp[:, :-19], split.entropy[:, :-19], split.logp_t1[:, -19:]):
        assert np.all(np.asarray(a) == 0.0)
    # Each column takes one log-softmax: the logits at temperature 0.8 cover
    # only the 19 response columns (an elementwise divide of [3, 19, V]).
    hlo = jax.jit(lambda p: token_logprobs(p, cfg, toks, mask, temperature=0.8, chunk_size=None,
                                           response_columns=19)).lower(params).as_text()
    assert "3x19x512" in hlo and "3x21x512" in hlo and "3x40x512" not in hlo
    # No gradient reaches the head from a query column through logp or entropy.
    g = jax.grad(lambda p: jnp.sum(token_logprobs(p, cfg, toks, mask, temperature=0.8,
                                                  chunk_size=chunk, response_columns=19).logp))
    g_last = jax.grad(lambda p: jnp.sum(token_logprobs(p, cfg, toks, mask, temperature=0.8,
                                                       chunk_size=chunk, last=19).logp))
    for a, b in zip(jax.tree_util.tree_leaves(g(params)), jax.tree_util.tree_leaves(g_last(params))):
        close(a, b)
    with pytest.raises(ValueError, match="response_columns=41 must be in"):
        token_logprobs(params, cfg, toks, mask, response_columns=41)
    with pytest.raises(ValueError, match="not both"):
        token_logprobs(params, cfg, toks, mask, response_columns=4, last=4)


def _grouped_rows(vocab, P=3, G=4, Q=9, R=7, seed=0):
    """A rollout's layout: P left-padded queries of different lengths, each
    repeated for G right-padded responses of different lengths."""
    rng = np.random.default_rng(seed)
    toks = np.zeros((P * G, Q + R), np.int32)
    mask = np.zeros((P * G, Q + R), bool)
    for p in range(P):
        qlen = [Q, 4, 2][p % 3]
        query = rng.integers(1, vocab, qlen)
        for g in range(G):
            n, rlen = p * G + g, int(rng.integers(1, R + 1))
            toks[n, Q - qlen:Q] = query
            toks[n, Q:Q + rlen] = rng.integers(1, vocab, rlen)
            mask[n, Q - qlen:Q + rlen] = True
    return jnp.asarray(toks), jnp.asarray(mask)


# The layer's per-architecture parts (biases, QK-norm) are checked scanned per kind
# by test_scanned_and_unrolled_layers_agree; the scan and remat variants of the
# grouped forward run on Qwen2 by default and on every kind with ERPO_LONG_TESTS=1.
@pytest.mark.long(when=lambda p: (p["scan"] or p["remat"]) and p["tiny"] != "qwen2")
@pytest.mark.parametrize("scan,remat", [(False, False), (True, False), (True, True)])
def test_grouped_query_forward_is_the_same_function(tiny, scan, remat):
    """Running each group's query once (`group_size`) gives every row's log-probs,
    entropies and query likelihoods, and their gradients, as running every row
    whole does; the hidden states agree at every real position."""
    import dataclasses
    _, _, _, cfg, params = tiny
    cfg = dataclasses.replace(cfg, scan_layers=scan, remat=remat)
    G, Q, R = 4, 9, 7
    toks, mask = _grouped_rows(cfg.vocab_size, G=G, Q=Q, R=R)
    h, _ = M.hidden_states(params, cfg, toks, None, mask)
    hq, hr = M.hidden_states_grouped(params, cfg, toks, mask, group_size=G, query_width=Q)
    m = np.asarray(mask)[..., None]
    close = lambda a, b, tol=2e-5: np.testing.assert_allclose(np.asarray(a), np.asarray(b),
                                                              atol=tol, rtol=tol)
    close(np.where(m[::G, :Q], hq, 0), np.where(m[::G, :Q], h[::G, :Q], 0))
    close(np.where(m[:, Q:], hr, 0), np.where(m[:, Q:], h[:, Q:], 0))
    valid = np.asarray(mask[:, :-1] & mask[:, 1:])
    for kw in (dict(response_columns=R), dict(last=R)):
        one = token_logprobs(params, cfg, toks, mask, temperature=0.7, chunk_size=5, **kw)
        grouped = token_logprobs(params, cfg, toks, mask, temperature=0.7, chunk_size=5,
                                 group_size=G, **kw)
        for a, b in zip(one, grouped):
            close(np.where(valid, b, 0), np.where(valid, a, 0))

    def loss(p, group_size):
        s = token_logprobs(p, cfg, toks, mask, temperature=0.7, chunk_size=5,
                           response_columns=R, group_size=group_size)
        return jnp.sum(jnp.where(valid, s.logp + 0.1 * s.entropy + 0.3 * s.logp_t1, 0.0))

    g1, gG = (jax.jit(jax.grad(loss), static_argnums=1)(params, n) for n in (1, G))
    for a, b in zip(jax.tree_util.tree_leaves(g1), jax.tree_util.tree_leaves(gG)):
        close(b, a, 1e-4)


def test_grouped_query_forward_divides_the_query_work():
    """The compiled forward of groups of 8 with a 48-token query and 16-token
    responses does the query's layers once per group: about (6 + 16) / 64 of
    the per-row forward's FLOPs, measured by XLA's cost analysis."""
    cfg = ModelConfig(vocab_size=512)
    params = M.init_params(cfg, jax.random.key(0))
    G, Q, R = 8, 48, 16
    toks, mask = _grouped_rows(cfg.vocab_size, P=2, G=G, Q=Q, R=R)
    flops = {}
    for n in (1, G):
        fn = jax.jit(lambda p, n=n: token_logprobs(p, cfg, toks, mask, chunk_size=None,
                                                   response_columns=R, group_size=n).logp_t1)
        flops[n] = fn.lower(params).compile().cost_analysis()["flops"]
    assert flops[G] < 0.6 * flops[1], flops
    with pytest.raises(ValueError, match="16 rows are not whole groups of group_size=3"):
        token_logprobs(params, cfg, toks, mask, last=R, group_size=3)
    with pytest.raises(ValueError, match="exactly one of `last` and `response_columns`"):
        token_logprobs(params, cfg, toks, mask, group_size=G)


def test_token_logprobs_chunked_never_builds_full_logits():
    cfg = ModelConfig(vocab_size=4096, hidden_size=32, intermediate_size=32, num_layers=1,
                      num_heads=2, num_kv_heads=1, head_dim=16)
    params = M.abstract_params(cfg)
    toks = jax.ShapeDtypeStruct((2, 257), jnp.int32)
    fn = lambda p, t: token_logprobs(p, cfg, t, chunk_size=32).logp.sum()
    hlo = jax.jit(jax.grad(fn)).lower(params, toks).as_text()
    assert "2,256,4096" not in hlo and "2x256x4096" not in hlo
    assert "2,32,4096" in hlo or "2x32x4096" in hlo


def test_bfloat16_policy_keeps_logits_float32():
    cfg = ModelConfig(param_dtype="bfloat16", compute_dtype="bfloat16", remat=True)
    params = M.init_params(cfg, jax.random.key(0))
    assert all(x.dtype == jnp.bfloat16 for x in jax.tree_util.tree_leaves(params))
    toks = jnp.ones((2, 8), jnp.int32)
    logits, _ = M.forward(params, cfg, toks)
    assert logits.dtype == jnp.float32
    out = token_logprobs(params, cfg, toks, chunk_size=4)
    assert out.logp.dtype == jnp.float32 and bool(jnp.isfinite(out.logp).all())
    g = jax.grad(lambda p: token_logprobs(p, cfg, toks, chunk_size=4).logp.sum())(params)
    assert all(bool(jnp.isfinite(x.astype(jnp.float32)).all()) for x in jax.tree_util.tree_leaves(g))


def test_legacy_config_keys():
    hf = {"architectures": ["LlamaForCausalLM"], "vocab_size": 32, "hidden_size": 16,
          "intermediate_size": 32, "num_hidden_layers": 1, "num_attention_heads": 2,
          "rope_theta": 1234.0, "torch_dtype": "bfloat16",
          "rope_scaling": {"type": "llama3", "factor": 2.0, "low_freq_factor": 1.0,
                           "high_freq_factor": 4.0, "original_max_position_embeddings": 64}}
    cfg = from_hf_config(hf)
    assert cfg.rope_theta == 1234.0 and cfg.rope_scaling.kind == "llama3"
    assert cfg.rope_scaling.factor == 2.0 and cfg.param_dtype == "bfloat16"
    assert cfg.num_kv_heads == 2 and cfg.head_dim == 8 and not cfg.qkv_bias


# ----------------------------------------------------------------------------- errors


def _rewrite_tensors(ckpt_dir, edit):
    """Load model.safetensors into memory, apply edit(dict of arrays), write it back."""
    from erpo_jax.model.safetensors_io import SafetensorsFile, save_file
    f = SafetensorsFile(ckpt_dir / "model.safetensors")
    tensors = {k: np.array(f[k]) for k in f.keys()}
    del f  # release the memory map before the file is replaced
    edit(tensors)
    save_file(tensors, ckpt_dir / "model.safetensors")


def _copy_checkpoint(src, dst):
    import shutil
    shutil.copytree(src, dst)
    return dst


def test_corrupted_safetensors_is_a_clear_error(tiny, tmp_path):
    _, path, _, _, _ = tiny
    bad = _copy_checkpoint(path, tmp_path / "bad")
    f = bad / "model.safetensors"
    data = f.read_bytes()
    f.write_bytes(data[: len(data) // 2])  # truncated download
    with pytest.raises(ValueError, match=r"model\.safetensors.*(corrupted|truncated)"):
        hf_lib.load_hf(bad)
    f.write_bytes(struct.pack("<Q", 10**12) + data[8:])  # absurd header length
    with pytest.raises(ValueError, match="header length"):
        hf_lib.load_hf(bad)


def test_missing_tensor_is_named(tiny, tmp_path):
    _, path, _, _, _ = tiny
    bad = _copy_checkpoint(path, tmp_path / "missing")
    _rewrite_tensors(bad, lambda t: t.pop("model.layers.1.mlp.up_proj.weight"))
    with pytest.raises(ValueError, match=r"missing tensor 'model\.layers\.1\.mlp\.up_proj\.weight'"):
        hf_lib.load_hf(bad)


def test_unknown_architecture_and_unmapped_key(tiny, tmp_path):
    _, path, _, _, _ = tiny
    bad = _copy_checkpoint(path, tmp_path / "arch")
    cfg = json.loads((bad / "config.json").read_text())
    cfg["architectures"], cfg["model_type"] = ["MambaForCausalLM"], "mamba"
    (bad / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="Unknown architecture.*Mamba"):
        hf_lib.load_hf(bad)
    extra = _copy_checkpoint(path, tmp_path / "extra")
    _rewrite_tensors(extra, lambda t: t.__setitem__("model.layers.0.mlp.router.weight",
                                                    np.zeros((2, 2), np.float32)))
    with pytest.raises(ValueError, match=r"'model\.layers\.0\.mlp\.router\.weight' matches no"):
        hf_lib.load_hf(extra)


def test_shape_mismatch_is_named(tiny, tmp_path):
    _, path, _, _, _ = tiny
    bad = _copy_checkpoint(path, tmp_path / "shape")
    cfg = json.loads((bad / "config.json").read_text())
    cfg["intermediate_size"] = 100
    (bad / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match=r"mlp\.(gate|up|down)_proj\.weight' has shape .*does not fit"):
        hf_lib.load_hf(bad)


def test_pickle_checkpoints_are_refused(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLM"]}))
    (tmp_path / "pytorch_model.bin").write_bytes(b"\x80\x04not loaded")
    with pytest.raises(ValueError, match="pickle checkpoints are never loaded"):
        hf_lib.open_safetensors(tmp_path)


@pytest.mark.parametrize("x_shape,w_shape,n_in", [
    ((3, 5, 4), (4, 6), 1),          # in < out: the gradient transposes x
    ((3, 5, 8), (8, 2), 1),          # in > out: the gradient transposes g
    ((3, 5, 2, 3), (2, 3, 4), 2),    # two contracted axes (the attention output)
    ((3, 5, 4), (4, 2, 3), 1),       # two output axes (q/k/v projections)
])
def test_dense_gradient_equals_tensordot(x_shape, w_shape, n_in):
    from erpo_jax.model.dense import _dense_cpu, dense
    kx, kw, kg = jax.random.split(jax.random.key(0), 3)
    x, w = jax.random.normal(kx, x_shape), jax.random.normal(kw, w_shape)
    cot = jax.random.normal(kg, x_shape[:len(x_shape) - n_in] + w_shape[n_in:])
    for f in (dense, lambda a, b, n: _dense_cpu(a, b, n, None)):
        y, vjp = jax.vjp(lambda a, b: f(a, b, n_in), x, w)
        y_ref, vjp_ref = jax.vjp(lambda a, b: jnp.tensordot(a, b, n_in), x, w)
        np.testing.assert_allclose(y, y_ref, rtol=1e-6, atol=1e-6)
        for got, want in zip(vjp(cot), vjp_ref(cot)):
            assert got.shape == want.shape
            np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
    # bfloat16 operands with a float32 result (the LM head): gradients keep the operand dtypes.
    xb, wb = x.astype(jnp.bfloat16), w.astype(jnp.bfloat16)
    gx, gw = jax.grad(lambda a, b: _dense_cpu(a, b, n_in, jnp.float32).sum(), (0, 1))(xb, wb)
    rx, rw = jax.grad(lambda a, b: jnp.tensordot(a.astype(jnp.float32), b.astype(jnp.float32),
                                                 n_in).sum(), (0, 1))(xb, wb)
    assert gx.dtype == gw.dtype == jnp.bfloat16
    np.testing.assert_allclose(gx.astype(jnp.float32), rx, rtol=2e-2, atol=2e-2)
    np.testing.assert_allclose(gw.astype(jnp.float32), rw, rtol=2e-2, atol=2e-2)
