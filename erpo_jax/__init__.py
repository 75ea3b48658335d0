"""erpo-jax: Environment-Regularized Policy Optimization for RLVR in JAX."""

__version__ = "0.1.0"
