"""KL estimators k1/k2/k3 (d = logp_ref - logp), clamp, masking and KL-in-reward."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from erpo_jax.rl import kl


def test_reference_values():
    # k3(d) = exp(d) - d - 1, the method page's definition (verl's low_var_kl and
    # OpenRLHF's k3 compute the same function of d = ref - logp).
    assert float(kl.k3(jnp.float32(0.2))) == pytest.approx(math.exp(0.2) - 1.2, abs=1e-7)
    assert float(kl.k3(jnp.float32(0.2))) == pytest.approx(0.0214028, abs=1e-7)
    assert float(kl.k3(jnp.float32(-1.0))) == pytest.approx(0.3678794, abs=1e-7)
    # The numbers 0.0187308 and 0.7182818 are k3 at log-ratio logp - ref = 0.2
    # and -1.0, i.e. at d = -0.2 and d = +1.0.
    assert float(kl.kl_estimate(jnp.float32(0.2), jnp.float32(0.0), "k3")) == pytest.approx(
        0.0187308, abs=1e-7)
    assert float(kl.kl_estimate(jnp.float32(-1.0), jnp.float32(0.0), "k3")) == pytest.approx(
        0.7182818, abs=1e-7)
    assert float(kl.k2(jnp.float32(-1.0))) == 0.5
    assert float(kl.k2(jnp.float32(1.0))) == 0.5
    assert float(kl.k1(jnp.float32(0.3))) == pytest.approx(-0.3)


def test_estimators_float32_nonnegative_and_zero_at_equal():
    d = jnp.linspace(-5.0, 5.0, 101, dtype=jnp.bfloat16)
    for name in ("k1", "k2", "k3"):
        assert kl.kl_from_diff(d, name).dtype == jnp.float32
    assert bool(jnp.all(kl.kl_from_diff(d, "k3") >= 0))
    assert bool(jnp.all(kl.kl_from_diff(d, "k2") >= 0))
    for name in ("k1", "k2", "k3"):
        assert float(kl.kl_from_diff(jnp.zeros(()), name)) == 0.0
        # zero gradient at d = 0 for k2 and k3 (minimum), -1 for k1
    assert float(jax.grad(lambda x: kl.k3(x))(0.0)) == 0.0
    assert float(jax.grad(lambda x: kl.k2(x))(0.0)) == 0.0


def test_clamp():
    d = jnp.array([-30.0, 0.5, 30.0])
    out = kl.kl_from_diff(d, "k3", clamp=10.0)
    assert float(out.max()) == 10.0
    assert float(out[1]) == pytest.approx(math.exp(0.5) - 1.5, rel=1e-6)
    assert float(kl.kl_from_diff(jnp.float32(-30.0), "k1", clamp=10.0)) == 10.0
    assert float(kl.kl_from_diff(jnp.float32(30.0), "k1", clamp=10.0)) == -10.0
    with pytest.raises(ValueError, match="clamp must be positive"):
        kl.kl_from_diff(d, "k3", clamp=0.0)


def test_unknown_estimator():
    with pytest.raises(ValueError, match="Unknown KL estimator 'k4'"):
        kl.get_estimator("k4")


def test_masked_garbage_gives_no_nan():
    logp = jnp.array([[-1.0, -2.0, -3.0]])
    ref = jnp.array([[-1.5, jnp.inf, -jnp.inf]])  # garbage where masked out
    mask = jnp.array([[True, False, False]])
    f = lambda lp: jnp.sum(kl.kl_estimate(lp, ref, "k3", mask))
    val, g = jax.value_and_grad(f)(logp)
    assert np.isfinite(float(val)) and bool(jnp.all(jnp.isfinite(g)))
    assert float(val) == pytest.approx(math.exp(-0.5) + 0.5 - 1, rel=1e-6)
    assert g[0, 1] == 0 and g[0, 2] == 0


def test_kl_penalized_rewards():
    rewards = jnp.array([1.0, 0.0])
    logp = jnp.array([[0.0, -1.0, -1.0, 0.0], [0.0, -2.0, 0.0, 0.0]])
    ref = jnp.array([[0.0, -1.5, -0.5, 0.0], [0.0, -1.0, 0.0, 0.0]])
    mask = jnp.array([[False, True, True, False], [False, True, False, False]])
    seq = kl.kl_penalized_rewards(rewards, logp, ref, mask, beta=0.1, name="k1")
    # k1 = logp - ref: row 0: 0.5 - 0.5 = 0 ; row 1: -1
    np.testing.assert_allclose(seq, [1.0, 0.1], atol=1e-6)
    tok = kl.kl_penalized_rewards(rewards, logp, ref, mask, beta=0.1, name="k1", token_level=True)
    np.testing.assert_allclose(tok, [[0, -0.05, 1.05, 0], [0, 0.1, 0, 0]], atol=1e-6)
    np.testing.assert_allclose(jnp.sum(tok, -1), seq, atol=1e-6)
