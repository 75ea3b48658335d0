"""Advantage estimators (closed-form numbers, all-equal groups, GAE) and the PPO critic."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from erpo_jax.model.config import ModelConfig
from erpo_jax.rl import advantages as A
from erpo_jax.rl import critic, estimators
from erpo_jax.rl.synthetic import random_params

REWARDS = [1.0, 0.0, 0.0, 1.0, 1.0, 0.0, 0.0, 0.0]


def test_grpo_reference_numbers():
    a = np.asarray(A.grpo(jnp.array([REWARDS]), eps=1e-6))[0]
    r = np.array(REWARDS)
    np.testing.assert_allclose(a[r == 1], 1.207612, atol=1e-6)
    np.testing.assert_allclose(a[r == 0], -0.724567, atol=1e-6)
    assert a.dtype == np.float32


def test_grpo_normalises_each_group_by_its_own_mean_and_std():
    # Three groups of 4 with different means (0.25, 1, 3) and stds (ddof 1):
    #   [1, 0, 0, 0]: deviations 0.75, -0.25 x3; var = (0.5625 + 3 * 0.0625) / 3 = 0.25, std 0.5
    #   [2, 0, 1, 1]: deviations 1, -1, 0, 0;    var = 2 / 3, std = sqrt(2/3) = 0.8164966
    #   [3, 3, 3, 3]: all equal, advantages exactly 0
    r = jnp.array([[1.0, 0.0, 0.0, 0.0], [2.0, 0.0, 1.0, 1.0], [3.0, 3.0, 3.0, 3.0]])
    want = np.array([[0.75 / 0.5, -0.25 / 0.5, -0.25 / 0.5, -0.25 / 0.5],
                     [1 / 0.8164966, -1 / 0.8164966, 0.0, 0.0],
                     [0.0, 0.0, 0.0, 0.0]])
    a = np.asarray(A.grpo(r, eps=1e-6))
    np.testing.assert_allclose(a, want, atol=1e-5)
    assert np.all(a[2] == 0.0)
    np.testing.assert_array_equal(
        estimators.compute_advantages("grpo", r.reshape(-1), group_size=4), a)


def test_rloo_reference_numbers():
    a = np.asarray(A.rloo(jnp.array([REWARDS])))[0]
    r = np.array(REWARDS)
    np.testing.assert_allclose(a[r == 1], 0.714286, atol=1e-6)
    np.testing.assert_allclose(a[r == 0], -0.428571, atol=1e-6)


def test_group_mean_baselines_and_flat_input():
    r = jnp.array([REWARDS, [3.0, 1.0, 2.0, 2.0, 0.0, 0.0, 0.0, 0.0]])
    for name in ("dr_grpo", "reinforce"):
        a = estimators.compute_advantages(name, r)
        np.testing.assert_allclose(a, r - r.mean(axis=1, keepdims=True), atol=1e-6)
    flat = estimators.compute_advantages("grpo", r.reshape(-1), group_size=8)
    np.testing.assert_array_equal(flat, A.grpo(r))
    assert flat.shape == (2, 8)


def test_all_equal_group_gives_exact_zero():
    # 0.1 * 3 / 3 != 0.1 in floating point: the guard must make it exactly 0.
    r = jnp.array([[0.1, 0.1, 0.1], [0.7, 0.7, 0.7], [1.0, 0.0, 0.5]], jnp.float32)
    for name in ("grpo", "dr_grpo", "rloo", "reinforce"):
        a = np.asarray(estimators.compute_advantages(name, r))
        assert np.all(np.isfinite(a)), name
        assert np.all(a[:2] == 0.0), name
        assert np.any(a[2] != 0.0), name
    a = np.asarray(A.reinforce_pp(r, group_baseline=True))
    assert np.all(a[:2] == 0.0) and np.all(np.isfinite(a))
    a = np.asarray(A.reinforce_pp(jnp.full((2, 4), 0.3)))
    assert np.all(a == 0.0)
    # Single-response groups: Bessel std is undefined; GRPO must give 0, not NaN.
    assert np.all(np.asarray(A.grpo(jnp.array([[1.0], [0.0]]))) == 0.0)


def test_reinforce_pp_whitens_over_batch():
    r = jnp.array([[1.0, 0.0, 0.0, 1.0], [1.0, 1.0, 1.0, 0.0]])
    a = np.asarray(A.reinforce_pp(r, eps=0.0))
    assert a.mean() == pytest.approx(0.0, abs=1e-6)
    assert a.std() == pytest.approx(1.0, abs=1e-6)
    c = np.asarray(r - r.mean(axis=1, keepdims=True))
    b = np.asarray(A.reinforce_pp(r, group_baseline=True, eps=0.0))
    np.testing.assert_allclose(b, c / c.std(), atol=1e-6)


def test_bad_inputs():
    with pytest.raises(ValueError, match="group_size"):
        A.grpo(jnp.ones(8))
    with pytest.raises(ValueError, match="cannot be split into groups of 3"):
        A.grpo(jnp.ones(8), group_size=3)
    with pytest.raises(ValueError, match="at least 2 responses"):
        A.rloo(jnp.ones((4, 1)))
    with pytest.raises(ValueError, match="Unknown advantage estimator 'ppo'"):
        estimators.get("ppo")
    with pytest.raises(ValueError, match="Unknown advantage estimator 'ppo'"):
        estimators.compute_advantages("ppo", jnp.ones((2, 2)))
    with pytest.raises(ValueError, match="needs critic values"):
        estimators.compute_advantages("gae", jnp.ones((2, 2)))
    critics = [n for n, e in estimators.ESTIMATORS.items() if e.needs_critic]
    assert critics == ["gae"] and estimators.get("gae").formula is A.gae


def test_every_registered_estimator_names_its_formula():
    """The registry is the one list: each entry carries its pure function from
    rl/advantages.py, and compute_advantages by name calls exactly it."""
    r = jnp.array([REWARDS, [3.0, 1.0, 2.0, 2.0, 0.0, 0.0, 0.0, 0.0]])
    for name, est in estimators.ESTIMATORS.items():
        assert est.formula is getattr(A, est.formula.__name__), name
        if not est.needs_critic:
            np.testing.assert_array_equal(estimators.compute_advantages(name, r),
                                          est.formula(r), err_msg=name)


def _gae_loop(r, v, m, gamma, lam):
    """Reference GAE: walk each row's response tokens backwards in plain Python."""
    adv = np.zeros_like(r)
    for n in range(r.shape[0]):
        idx = np.flatnonzero(m[n])
        last = 0.0
        for i in reversed(range(len(idx))):
            t = idx[i]
            nv = v[n, idx[i + 1]] if i + 1 < len(idx) else 0.0
            delta = r[n, t] + gamma * nv - v[n, t]
            last = delta + gamma * lam * last
            adv[n, t] = last
    return adv


def test_gae_matches_reference_loop():
    rs = np.random.default_rng(0)
    m = np.zeros((3, 9), bool)
    m[0, 2:7] = True
    m[1, 4:9] = True
    m[2, 1:3] = True
    r = np.where(m, rs.standard_normal((3, 9)), 0.0).astype(np.float32)
    v = rs.standard_normal((3, 9)).astype(np.float32)
    adv, ret = A.gae(jnp.asarray(r), jnp.asarray(v), jnp.asarray(m), gamma=0.9, lam=0.8)
    want = _gae_loop(r, v, m, 0.9, 0.8)
    np.testing.assert_allclose(adv, want, atol=1e-5)
    np.testing.assert_allclose(ret, np.where(m, want + v, 0.0), atol=1e-5)
    w, _ = A.gae(jnp.asarray(r), jnp.asarray(v), jnp.asarray(m), gamma=0.9, lam=0.8, whiten=True)
    assert float(jnp.sum(jnp.where(m, w, 0.0))) == pytest.approx(0.0, abs=1e-4)


def test_gae_outcome_reward_with_zero_values():
    m = jnp.array([[False, True, True, True, False]])
    adv, _ = A.gae(jnp.array([2.0]), jnp.zeros((1, 5)), m, gamma=1.0, lam=1.0)
    np.testing.assert_allclose(adv, [[0, 2, 2, 2, 0]])


# ----------------------------------------------------------------------------- critic


def test_value_loss_clipped_numbers():
    v = jnp.array([[1.0, 0.0]])
    old = jnp.array([[0.0, 0.0]])
    ret = jnp.array([[2.0, 5.0]])
    m = jnp.array([[True, False]])
    loss, met = critic.value_loss(v, old, ret, m, clip_eps=0.2)
    # unclipped (1-2)^2 = 1; clipped v = 0.2 -> (0.2-2)^2 = 3.24 -> max 3.24, times 0.5
    assert float(loss) == pytest.approx(1.62, rel=1e-6)
    assert float(met["value_clip_frac"]) == 1.0
    loss, _ = critic.value_loss(v, old, ret, m, clip_eps=None)
    assert float(loss) == pytest.approx(0.5)


def test_critic_values_aligned_and_trainable():
    cfg = ModelConfig()  # the shared tiny config: its init compiles once per session
    trunk = random_params(cfg, 0)
    params = critic.init_critic(cfg, None, trunk_params=trunk)
    assert params["trunk"] is not trunk
    tokens = jnp.array([[0, 5, 6, 7, 8], [1, 2, 3, 4, 0]], jnp.int32)
    mask = jnp.array([[0, 1, 1, 1, 1], [1, 1, 1, 1, 0]], bool)
    resp = jnp.array([[False, False, True, True], [False, True, True, False]])
    returns = jnp.ones((2, 4))

    @jax.jit
    def step(p):
        (l, met), g = jax.value_and_grad(critic.critic_loss_fn, has_aux=True)(
            p, cfg, tokens, mask, resp, jnp.zeros((2, 4)), returns, None)
        v = critic.values(p, cfg, tokens, mask)
        return l, v, jax.tree.map(lambda a, b: a - 0.01 * b, p, g), g

    l0, v, params, g = step(params)
    assert v.shape == (2, 4) and v.dtype == jnp.float32
    assert bool(jnp.all(v == 0.0))  # zero-initialised head
    assert float(l0) == 0.5
    assert float(jnp.abs(g["value_head"]["kernel"]).sum()) > 0
    l1, _, _, _ = step(params)
    assert float(l1) < float(l0)
