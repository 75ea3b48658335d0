"""The host allocator setting: a program's temporaries are reused across calls
instead of being page-faulted in afresh (glibc only)."""

import subprocess
import sys

import pytest

PROBE = r"""
import resource, sys
import erpo_jax
from erpo_jax.runtime import host_malloc
import jax, jax.numpy as jnp

@jax.jit
def f(x):   # a 32 MiB temporary inside the program (a thread's heap holds 64)
    y = jnp.sin(x[:, None] * jnp.arange(1024, dtype=jnp.float32))     # materialised for the dot
    return y @ jnp.ones((1024, 4), jnp.float32)

x = jnp.ones((8192,), jnp.float32)
for _ in range(20):   # worker threads' heaps have held the temporary
    f(x).block_until_ready()
faults = lambda: resource.getrusage(resource.RUSAGE_SELF).ru_minflt
per_call = []
for _ in range(15):
    before = faults()
    f(x).block_until_ready()
    per_call.append(faults() - before)
print(host_malloc.applied(), sorted(per_call)[7])   # the median call
"""


def _probe(env_value):
    env = {"JAX_PLATFORMS": "cpu", "PATH": "/usr/bin:/bin"}
    if env_value is not None:
        env["ERPO_JAX_HOST_MALLOC"] = env_value
    out = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True,
                         env=env, timeout=300)
    assert out.returncode == 0, out.stderr
    applied, faults = out.stdout.split()
    return applied == "True", int(faults)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc mallopt")
def test_temporaries_are_not_faulted_in_on_every_call():
    applied, faults = _probe(None)
    assert applied
    off_applied, off_faults = _probe("default")
    assert not off_applied
    # 32 MiB is 8,192 pages: without the setting each call faults them in again.
    assert off_faults > 4000, off_faults
    assert faults < 500, faults


def test_a_program_over_the_trim_threshold_gets_a_note(monkeypatch):
    from erpo_jax.runtime import host_malloc
    monkeypatch.setattr(host_malloc, "_applied", True)
    # The small peer config's update in one piece (7,038 MiB of temporaries).
    note = host_malloc.large_temporaries_note("update", 7038 << 20, 1)
    assert "6.9 GiB" in note and "optim.micro_batches=4 or more (it is 1)" in note
    assert host_malloc.large_temporaries_note("update", 1808 << 20, 4) is None
    monkeypatch.setattr(host_malloc, "_applied", False)   # defaults: nothing is kept anyway
    assert host_malloc.large_temporaries_note("update", 7038 << 20, 1) is None
