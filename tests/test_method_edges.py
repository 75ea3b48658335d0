"""Edge cases from the review against ERPO_METHOD.md (issue 17): each test here
failed on the code before its fix.

- ReferenceCache.scores() with a one-token last query (np.add.reduceat IndexError);
- k3 at large drift: the log-ratio is clipped before exp, so value and gradient
  stay finite on the Policy-KL and the Query-KL paths, with and without kl_clamp.
"""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from erpo_jax.model.logprobs import TokenLogprobs
from erpo_jax.rl import kl
from erpo_jax.rl.batch import RLBatch
from erpo_jax.rl.loss import LossConfig, loss_terms
from erpo_jax.rl.reference import ReferenceCache


@pytest.mark.parametrize("lengths", [[1, 3, 4], [3, 1, 4], [3, 4, 1], [1], [4, 1, 1]])
def test_scores_with_a_one_token_query_anywhere(lengths):
    """A one-token query (no target) gets the set's mean score wherever it sits,
    including last (reduceat's index == len(logp) used to raise IndexError)."""
    rng = np.random.default_rng(0)
    rows = [-rng.random(max(n - 1, 0)).astype(np.float32) for n in lengths]
    offsets = np.concatenate([[0], np.cumsum([len(r) for r in rows])]).astype(np.int64)
    logp = np.concatenate(rows) if offsets[-1] else np.zeros(0, np.float32)
    s = ReferenceCache(logp, offsets, "k").scores()
    real = [r.astype(np.float64).mean() for r in rows if len(r)]
    fill = np.mean(real) if real else 0.0
    want = [r.astype(np.float64).mean() if len(r) else fill for r in rows]
    np.testing.assert_allclose(s, want, rtol=1e-12)
    assert np.all(np.isfinite(ReferenceCache(logp, offsets, "k").weights("likelihood")))


# ----------------------------------------------------------------------------- clamp before exp

DRIFTS = (20.0, 100.0, 1e4)
LIMIT = 20.0   # verl clips the log-ratio at +-20 before exp
K3_AT_LIMIT = math.expm1(LIMIT) - LIMIT   # 4.85e8


def _drift_batch(d: float):
    """One query (2 targets) + 2 response tokens; the reference is d above the
    policy on every position (ref - logp = d): a policy that moved far away."""
    N, T = 2, 6
    qm = np.zeros((N, T - 1), bool)
    rm = np.zeros((N, T - 1), bool)
    qm[:, 0:2] = True
    rm[:, 2:4] = True
    logp = np.full((N, T - 1), -d - 1.0, np.float32)   # policy log-probs
    ref = np.full((N, T - 1), -1.0, np.float32)         # reference = policy + d
    batch = RLBatch(tokens=jnp.ones((N, T), jnp.int32), attn_mask=jnp.ones((N, T), bool),
                    query_mask=jnp.asarray(qm), response_mask=jnp.asarray(rm),
                    old_logp=jnp.asarray(logp), advantages=jnp.asarray([1.0, -1.0]),
                    ref_query_logp=jnp.asarray(ref), query_weight=jnp.ones(N),
                    group_id=jnp.zeros(N, jnp.int32), ref_logp=jnp.asarray(ref))
    return jnp.asarray(logp), batch


@pytest.mark.parametrize("clamp", [None, 10.0])
@pytest.mark.parametrize("d", DRIFTS)
@pytest.mark.parametrize("path", ["policy_kl", "query_kl"])
def test_k3_at_large_drift_is_finite_and_bounded(path, d, clamp):
    logp, batch = _drift_batch(d)
    cfg = LossConfig(beta_policy=1.0 if path == "policy_kl" else 0.0,
                     beta_query=1.0 if path == "query_kl" else 0.0, kl_clamp=clamp)

    def term(lp):
        stats = TokenLogprobs(lp, jnp.zeros_like(lp), lp)
        return loss_terms(stats, batch, cfg)[0][path]

    value, grad = jax.value_and_grad(term)(logp)
    assert np.isfinite(float(value)) and bool(jnp.all(jnp.isfinite(grad))), (value, grad)
    bound = K3_AT_LIMIT if clamp is None else clamp
    assert 0 < float(value) <= bound * (1 + 1e-6)
    if d > LIMIT or clamp is not None:
        # Past the limit (or the clamp) the estimate is flat: no gradient.
        assert float(jnp.max(jnp.abs(grad))) == 0.0
    else:   # d == 20: still finite, and pointing the policy back toward the reference
        own = batch.response_mask if path == "policy_kl" else batch.query_mask
        assert bool(jnp.all(jnp.where(own, grad < 0, grad == 0)))


def test_k3_below_the_limit_is_unchanged():
    d = jnp.asarray([-19.5, -3.0, 0.0, 0.5, 19.5])
    want = np.expm1(np.float64(d)) - np.float64(d)
    np.testing.assert_allclose(np.asarray(kl.k3(d)), want, rtol=1e-6)
    np.testing.assert_allclose(np.asarray(jax.grad(lambda x: jnp.sum(kl.k3(x)))(d)),
                               np.expm1(np.float64(d)), rtol=1e-6)


# ----------------------------------------------------------------------------- cache key


def test_reference_cache_key_includes_the_numerics(tmp_path):
    """A bf16 run must not read the f32 run's cache (nor one made with other chunking
    or batch layout); the same numerics reuse it."""
    import dataclasses

    from erpo_jax.model import model as M
    from erpo_jax.model.config import ModelConfig
    from erpo_jax.rl import reference as ref_lib
    cfg = ModelConfig(vocab_size=64)
    params = M.init_params(cfg, jax.random.key(0))
    queries = [[3, 4, 5, 6], [7, 8, 9]]
    kw = dict(tokenizer_id="t", template="plain", batch_size=2, progress=False)
    f32, computed = ref_lib.load_or_compute(params, cfg, queries, tmp_path, **kw)
    assert computed
    _, computed = ref_lib.load_or_compute(params, cfg, queries, tmp_path, **kw)
    assert not computed
    bf16 = dataclasses.replace(cfg, compute_dtype="bfloat16")
    other, computed = ref_lib.load_or_compute(params, bf16, queries, tmp_path, **kw)
    assert computed and other.key != f32.key
    _, computed = ref_lib.load_or_compute(params, cfg, queries, tmp_path,
                                          **dict(kw, chunk_size=2))
    assert computed
    _, computed = ref_lib.load_or_compute(params, cfg, queries, tmp_path,
                                          **dict(kw, batch_size=4))
    assert computed
