"""The one-time reference pass: cache equals a recompute, keys invalidate, QKL(0) = 0."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from erpo_jax.model import model as M
from erpo_jax.model.config import ModelConfig
from erpo_jax.model.logprobs import token_logprobs
from erpo_jax.rl import reference as ref_lib
from erpo_jax.rl.batch import masks_from_layout
from erpo_jax.rl.query_kl import query_kl

CFG = ModelConfig(vocab_size=64)


@pytest.fixture(scope="module")
def setup():
    params = M.init_params(CFG, jax.random.key(0))
    rng = np.random.RandomState(0)
    queries = [list(rng.randint(1, CFG.vocab_size, n)) for n in [3, 9, 5, 1, 12, 7, 4]]
    return params, queries


def test_cached_values_equal_direct_recompute(setup, tmp_path):
    params, queries = setup
    cache, computed = ref_lib.load_or_compute(params, CFG, queries, tmp_path, tokenizer_id="t",
                                              template="plain", batch_size=4, progress=False)
    assert computed
    # The direct recompute: one jitted forward over the queries right-padded to one
    # width (causal, so a query's own log-probs do not see the padding after it).
    width = max(map(len, queries))
    padded = jnp.asarray([toks + [0] * (width - len(toks)) for toks in queries])
    direct = jax.jit(lambda p, t: token_logprobs(p, CFG, t, chunk_size=None).logp_t1)(
        params, padded)
    for q, toks in enumerate(queries):
        if len(toks) < 2:
            assert len(cache.row(q)) == 0
            continue
        np.testing.assert_allclose(cache.row(q), np.asarray(direct[q, :len(toks) - 1]),
                                   atol=1e-5)
    again, computed = ref_lib.load_or_compute(params, CFG, queries, tmp_path, tokenizer_id="t",
                                              template="plain", batch_size=4, progress=False)
    assert not computed
    np.testing.assert_array_equal(again.logp, cache.logp)


def test_changed_weight_template_or_data_invalidates(setup, tmp_path):
    params, queries = setup
    kw = dict(tokenizer_id="t", template="plain", batch_size=4, progress=False)
    first, _ = ref_lib.load_or_compute(params, CFG, queries, tmp_path, **kw)
    changed = jax.tree_util.tree_map(lambda x: x, params)
    changed["final_norm"]["scale"] = changed["final_norm"]["scale"].at[3].add(0.5)
    second, computed = ref_lib.load_or_compute(changed, CFG, queries, tmp_path, **kw)
    assert computed and second.key != first.key
    assert not np.allclose(second.logp, first.logp)
    _, computed = ref_lib.load_or_compute(params, CFG, queries, tmp_path,
                                          **dict(kw, template="chat"))
    assert computed
    _, computed = ref_lib.load_or_compute(params, CFG, queries[:-1], tmp_path, **kw)
    assert computed


def test_query_kl_from_cache_is_zero_at_step_zero(setup, tmp_path):
    params, queries = setup
    cache, _ = ref_lib.load_or_compute(params, CFG, queries, tmp_path, tokenizer_id="t",
                                       template="plain", batch_size=4, progress=False)
    idx = [1, 4, 2, 6]
    width, resp = 16, 5
    tokens = np.zeros((len(idx), width + resp), np.int32)
    mask = np.zeros_like(tokens, bool)
    for r, q in enumerate(idx):
        tokens[r, width - len(queries[q]):width] = queries[q]
        mask[r, width - len(queries[q]):width + 3] = True
        tokens[r, width:width + 3] = [5, 6, 7]
    qmask, _ = masks_from_layout(mask, width)
    ref = cache.batch_layout(idx, width, width + resp)
    policy = token_logprobs(params, CFG, jnp.asarray(tokens), jnp.asarray(mask)).logp_t1
    gid = jnp.arange(len(idx))
    for est in ("k2", "k3"):
        qkl = float(query_kl(policy, jnp.asarray(ref), jnp.asarray(qmask), gid, est))
        assert abs(qkl) < 1e-10
    # The layout put exactly the cached values under the query mask.
    assert np.count_nonzero(qmask) == sum(len(queries[q]) - 1 for q in idx)


def test_weights_and_scores(setup, tmp_path):
    params, queries = setup
    cache, _ = ref_lib.load_or_compute(params, CFG, queries, tmp_path, tokenizer_id="t",
                                       template="plain", batch_size=4, progress=False)
    s = cache.scores()
    assert s.shape == (len(queries),)
    np.testing.assert_allclose(s[1], cache.row(1).mean(), rtol=1e-6)
    w = cache.weights("likelihood", tau=1.0, w_min=0.2, w_max=3.0)
    assert abs(w.mean() - 1) < 1e-5 and w.min() >= 0.2 and w.max() <= 3.0
    assert np.all(cache.weights("uniform") == 1)


def test_empty_dataset_is_an_error():
    with pytest.raises(ValueError, match="no queries"):
        ref_lib.compute_reference({}, CFG, [])
