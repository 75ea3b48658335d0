"""erpo-jax: Environment-Regularized Policy Optimization for RLVR in JAX."""

from erpo_jax.runtime import host_malloc as _host_malloc

__version__ = "0.1.0"

_host_malloc.configure()
