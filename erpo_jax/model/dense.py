"""`dense`: the model's weight contraction, with a weight gradient that the
XLA CPU backend computes without a slow transposed fusion.

dense(x, w, n_in) contracts the last n_in axes of x with the first n_in axes
of w: x [*lead, *in] and w [*in, *out] give [*lead, *out]. It is
`jnp.tensordot(x, w, n_in)`, and on accelerators it is exactly that.

Why a custom gradient on the CPU. The weight gradient is dw = x^T g, a
contraction over the lead (token) axes. XLA's CPU dot wants that axis minor in
one operand, and its layout assignment picks the large elementwise cotangent
g to transpose: the elementwise backward of the op before (SiLU, softmax) is
then emitted as one loop fusion writing a transposed [out, tokens] buffer,
which the profile of a train step showed at ~10 ns per element, a third of
the whole backward (experiments/BENCHMARKS.md, section 2). Here the gradient
transposes whichever of x and g is smaller, as its own copy behind an
`optimization_barrier` (so XLA can neither fold it back into the dot nor fuse
the elementwise producer into it), and contracts that with the other one in
its natural layout. The result is the same matrix product, summed in another
order (float rounding differs; tests compare to a tolerance).
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp


def dense(x: jax.Array, w: jax.Array, n_in: int = 1, preferred_element_type=None,
          platform: str | None = None) -> jax.Array:
    """tensordot(x, w, n_in); see the module docstring. platform: the one the
    program is compiled for (`sharding.platform`; default JAX's backend)."""
    if (platform or jax.default_backend()) != "cpu":
        return jnp.tensordot(x, w, n_in, preferred_element_type=preferred_element_type)
    return _dense_cpu(x, w, n_in, preferred_element_type)


@functools.partial(jax.custom_vjp, nondiff_argnums=(2, 3))
def _dense_cpu(x, w, n_in, preferred_element_type):
    return jnp.tensordot(x, w, n_in, preferred_element_type=preferred_element_type)


def _fwd(x, w, n_in, preferred_element_type):
    return _dense_cpu(x, w, n_in, preferred_element_type), (x, w)


def _bwd(n_in, preferred_element_type, res, g):
    x_in, w_in = res
    n_lead, n_out = x_in.ndim - n_in, w_in.ndim - n_in
    # Accumulate in at least float32 (the CPU runtime has no bf16 x bf16 -> f32 dot).
    acc = jnp.promote_types(x_in.dtype, jnp.float32)
    x, w, g = x_in.astype(acc), w_in.astype(acc), g.astype(acc)
    # dx = g . w over the out axes: [*lead, *out] x [*in, *out] -> [*lead, *in].
    dx = jnp.tensordot(g, w, (tuple(range(n_lead, g.ndim)), tuple(range(n_in, w.ndim))))
    lead_x, lead_g = tuple(range(n_lead)), tuple(range(n_lead))
    if math.prod(w.shape[:n_in]) <= math.prod(w.shape[n_in:]):
        # x^T as a standalone copy [*in, *lead], then [*in, *lead] . [*lead, *out].
        xt = jax.lax.optimization_barrier(jnp.moveaxis(x, lead_x, range(n_in, n_in + n_lead)))
        dw = jnp.tensordot(xt, g, (tuple(range(n_in, xt.ndim)), lead_g))
    else:
        # g^T as a standalone copy [*out, *lead]; [*out, *lead] . [*lead, *in],
        # then the small [*out, *in] result is transposed to [*in, *out].
        gt = jax.lax.optimization_barrier(jnp.moveaxis(g, lead_g, range(n_out, n_out + n_lead)))
        dwt = jnp.tensordot(gt, x, (tuple(range(n_out, gt.ndim)), lead_x))
        dw = jnp.moveaxis(dwt, tuple(range(n_out)), tuple(range(n_in, n_in + n_out)))
    return dx.astype(x_in.dtype), dw.astype(w_in.dtype)


_dense_cpu.defvjp(_fwd, _bwd)
