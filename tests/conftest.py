"""Test set-up: 8 fake CPU devices, full-precision float32 matmuls, and a
per-session persistent compilation cache (many tests compile identical
programs, e.g. the same update step for several advantage estimators)."""

import os
import tempfile

# Must happen before jax is imported anywhere.
os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
os.environ.setdefault("JAX_PLATFORMS", "cpu")
# Subprocesses (CLI and multi-process tests) leave ~/.cache alone.
os.environ.setdefault("ERPO_JAX_COMPILE_CACHE", "off")

import jax  # noqa: E402

jax.config.update("jax_default_matmul_precision", "highest")
jax.config.update("jax_compilation_cache_dir", tempfile.mkdtemp(prefix="erpo-jax-xla-cache-"))
jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.5)
jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
