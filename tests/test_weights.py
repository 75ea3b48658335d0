"""Dataset-static per-query weights: schemes, clipping + unit mean, tau monotonicity."""

import numpy as np
import pytest

from erpo_jax.rl import weights as W


def _scores(n=64, seed=0):
    return np.random.default_rng(seed).normal(-3.0, 0.8, n)


def test_uniform_is_all_ones():
    w = W.query_weights(_scores(), "uniform", w_min=0.5, w_max=2.0)
    assert w.dtype == np.float32
    np.testing.assert_array_equal(w, np.ones(64, np.float32))


@pytest.mark.parametrize("scheme", ["likelihood", "typicality"])
@pytest.mark.parametrize("tau", [0.25, 1.0, 4.0])
def test_mean_one_and_range(scheme, tau):
    w = W.query_weights(_scores(), scheme, tau=tau, w_min=0.5, w_max=2.0)
    assert w.mean() == pytest.approx(1.0, abs=1e-6)
    assert w.min() >= 0.5 and w.max() <= 2.0
    if tau == 0.25:  # the bounds are active here
        assert w.min() == 0.5 or w.max() == 2.0


def test_unclipped_is_plain_normalisation_and_order_kept():
    s = _scores()
    z = (s - s.mean()) / s.std()
    w = W.query_weights(s, "likelihood", tau=2.0, w_min=0.0, w_max=np.inf)
    raw = np.exp(z / 2.0)
    np.testing.assert_allclose(w, raw / raw.mean(), rtol=1e-5)
    wc = W.query_weights(s, "likelihood", tau=0.3, w_min=0.2, w_max=3.0)
    order = np.argsort(s)
    assert np.all(np.diff(wc[order]) >= 0)  # clipping keeps the ranking (ties allowed)


def test_likelihood_tau_moves_weights_monotonically():
    s = _scores()
    hi, lo = np.argmax(s), np.argmin(s)
    taus = [0.5, 1.0, 2.0, 4.0, 8.0]
    ws = [W.query_weights(s, "likelihood", tau=t, w_min=0.0, w_max=np.inf) for t in taus]
    top = [w[hi] for w in ws]
    bottom = [w[lo] for w in ws]
    spread = [w.std() for w in ws]
    assert all(a > b for a, b in zip(top, top[1:]))
    assert all(a < b for a, b in zip(bottom, bottom[1:]))
    assert all(a > b for a, b in zip(spread, spread[1:]))


def test_typicality_favours_the_typical():
    s = np.array([-5.0, -3.0, -3.0, -3.1, -2.9, -1.0])
    w = W.query_weights(s, "typicality", tau=1.0, w_min=0.0, w_max=np.inf)
    assert w[2] > w[0] and w[2] > w[-1]
    assert w[0] == pytest.approx(w[-1], rel=1e-5)  # symmetric in z


def test_query_scores_and_degenerate_sets():
    lp = np.array([[0.0, -1.0, -3.0, 9.0], [0.0, -2.0, 9.0, 9.0], [7.0, 7.0, 7.0, 7.0]])
    m = np.array([[False, True, True, False], [False, True, False, False], [False] * 4])
    s = W.query_scores(lp, m)
    np.testing.assert_allclose(s[:2], [-2.0, -2.0])
    assert s[2] == pytest.approx(-2.0)  # no query targets -> the set mean (z = 0)
    np.testing.assert_array_equal(W.query_weights(s, "likelihood"), np.ones(3, np.float32))
    # extreme tau must not overflow
    w = W.query_weights(_scores(), "likelihood", tau=1e-3, w_min=0.1, w_max=10.0)
    assert np.all(np.isfinite(w)) and w.mean() == pytest.approx(1.0, abs=1e-5)


def test_bad_arguments():
    with pytest.raises(ValueError, match="w_min <= 1 <= w_max"):
        W.query_weights(_scores(), w_min=1.5, w_max=2.0)
    with pytest.raises(ValueError, match="Unknown query weight scheme 'flat'"):
        W.query_weights(_scores(), "flat")
    with pytest.raises(ValueError, match="tau must be positive"):
        W.query_weights(_scores(), tau=0.0)
