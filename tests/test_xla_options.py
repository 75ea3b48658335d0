"""Per-program XLA options on the CPU: run-once programs compile at LLVM level
0, per-step programs keep XLA's default, and the environment can set one level."""

import jax
import jax.numpy as jnp
import pytest

from erpo_jax.runtime import xla_options


def test_levels_and_override(monkeypatch):
    monkeypatch.delenv(xla_options.ENV, raising=False)
    assert xla_options.for_once() == {"xla_backend_optimization_level": 0}
    assert xla_options.for_steps() is None
    monkeypatch.setenv(xla_options.ENV, "1")
    assert xla_options.for_steps() == {"xla_backend_optimization_level": 1}
    assert xla_options.for_once() == {"xla_backend_optimization_level": 1}
    # The options are accepted by a real compile and do not change results.
    f = lambda x: jnp.tanh(x) @ x.T
    x = jnp.arange(12.0).reshape(3, 4) / 10
    got = jax.jit(f, compiler_options=xla_options.for_once())(x)
    assert jnp.allclose(got, jax.jit(f)(x), atol=1e-6)
    monkeypatch.setenv(xla_options.ENV, "fast")
    with pytest.raises(ValueError, match=xla_options.ENV):
        xla_options.for_steps()
