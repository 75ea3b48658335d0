"""JAX's persistent compilation cache for `erpo train`, `erpo sft` and `erpo eval`.

A run compiles the same few programs (rollout, reference forward, advantages,
update) every time it starts; with the cache on disk a rerun of an unchanged
config loads them instead of compiling (tiny CPU config: ~6 s of compiles
become a few hundred milliseconds; for a real model it is minutes). The
cache key covers the program, the shapes and shardings, the backend and the
compiler flags, so a changed config compiles afresh and never reuses a stale
executable.

Which directory (first match wins):
  1. JAX's own setting, if the user made one (`JAX_COMPILATION_CACHE_DIR` or
     `jax.config.update("jax_compilation_cache_dir", ...)`): left untouched.
  2. `train.compile_cache`: a path, or "off".
  3. "auto" (the default): `$ERPO_JAX_COMPILE_CACHE` (a path or "off") if set,
     else `~/.cache/erpo_jax/jax_cache/<machine>`, where <machine> names the
     architecture and a digest of the CPU's feature flags and the jaxlib
     version. A home directory shared by different machines (a cluster) then
     never hands one CPU code compiled for another's instruction set, nor one
     jaxlib another's executables.
A directory that cannot be created turns the cache off with a warning; a run
never fails because of it.
"""

from __future__ import annotations

import hashlib
import os
import platform
import warnings
from pathlib import Path

import jax

ENV = "ERPO_JAX_COMPILE_CACHE"
DEFAULT_DIR = "~/.cache/erpo_jax/jax_cache"
# Programs that compile faster than this are not worth a disk entry (JAX's
# default, 1 s, would skip a tiny model's reference forward and advantages).
MIN_COMPILE_SECONDS = 0.2


def cpuinfo(*fields: str) -> str:
    """The first of `fields` that /proc/cpuinfo lists, its value ('' where none is)."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.split(":")[0].strip() in fields:
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return ""


def _cpu_flags() -> str:
    """The CPU's feature flags as the kernel lists them ('' where it does not)."""
    return cpuinfo("flags", "Features")


def machine_tag(cpu_flags: str | None = None) -> str:
    """'<arch>-<12 hex>': the architecture, and a digest of the CPU flags and jaxlib version."""
    import jaxlib
    flags = _cpu_flags() if cpu_flags is None else cpu_flags
    digest = hashlib.sha256(f"{flags}|jaxlib {jaxlib.__version__}".encode()).hexdigest()[:12]
    return f"{platform.machine() or 'unknown'}-{digest}"


def resolve(setting: str) -> str | None:
    """The directory `setting` ('auto', 'off' or a path) names, or None for off."""
    if setting == "auto":
        setting = os.environ.get(ENV, "") or str(Path(DEFAULT_DIR) / machine_tag())
    if setting.strip().lower() in ("off", "none", "0", "false", ""):
        return None
    return str(Path(setting).expanduser())


def configure(setting: str = "auto") -> str | None:
    """Turn the persistent compilation cache on per `setting`; returns the
    directory in use (None when off). Call before the programs compile."""
    from jax.experimental.compilation_cache import compilation_cache as cc

    current = jax.config.jax_compilation_cache_dir
    if current:
        return current
    path = resolve(setting)
    if path is None:
        return None
    try:
        Path(path).mkdir(parents=True, exist_ok=True)
    except OSError as e:
        warnings.warn(f"compilation cache off: cannot create {path} ({e}); set train.compile_cache "
                      f"(or ${ENV}) to a writable directory, or to 'off'.", stacklevel=2)
        return None
    # JAX decides once, at its first compile, whether a cache is in use; a
    # process that already compiled something must be told to decide again.
    cc.reset_cache()
    jax.config.update("jax_compilation_cache_dir", path)
    if jax.config.jax_persistent_cache_min_compile_time_secs == 1.0:   # JAX's default
        jax.config.update("jax_persistent_cache_min_compile_time_secs", MIN_COMPILE_SECONDS)
    return path
