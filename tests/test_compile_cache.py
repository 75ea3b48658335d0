"""The persistent compilation cache: which directory a setting names, that a
user's own JAX setting wins, and that a rerun loads every program from the
cache and trains bit-identically to the run that compiled them."""

import warnings
from pathlib import Path

import jax
import pytest

from erpo_jax.runtime import compile_cache
from erpo_jax.tools import bench


def test_resolve(monkeypatch):
    monkeypatch.delenv(compile_cache.ENV, raising=False)
    assert compile_cache.resolve("off") is None
    auto = Path(compile_cache.resolve("auto"))
    assert auto.parent == Path(compile_cache.DEFAULT_DIR).expanduser()
    assert auto.name == compile_cache.machine_tag()    # one directory per kind of machine
    assert compile_cache.resolve("~/x") == str(Path("~/x").expanduser())
    monkeypatch.setenv(compile_cache.ENV, "off")
    assert compile_cache.resolve("auto") is None
    assert compile_cache.resolve("/tmp/explicit") == "/tmp/explicit"  # a path beats the env
    monkeypatch.setenv(compile_cache.ENV, "/tmp/from-env")
    assert compile_cache.resolve("auto") == "/tmp/from-env"


def test_machine_tag_separates_instruction_sets():
    avx512 = compile_cache.machine_tag("fpu sse2 avx2 avx512f avx512bw")
    avx2 = compile_cache.machine_tag("fpu sse2 avx2")
    assert avx512 != avx2
    assert avx512 == compile_cache.machine_tag("fpu sse2 avx2 avx512f avx512bw")
    assert compile_cache.machine_tag() == compile_cache.machine_tag()


def test_user_setting_wins():
    # conftest points JAX at a per-session directory; no train.compile_cache moves it.
    current = jax.config.jax_compilation_cache_dir
    assert current
    assert compile_cache.configure("off") == current
    assert compile_cache.configure("/tmp/somewhere-else") == current
    assert jax.config.jax_compilation_cache_dir == current


def test_unwritable_directory_turns_the_cache_off(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    current = jax.config.jax_compilation_cache_dir
    jax.config.update("jax_compilation_cache_dir", None)
    try:
        with pytest.warns(UserWarning, match="compilation cache off: cannot create"):
            assert compile_cache.configure(str(blocker / "cache")) is None
        assert jax.config.jax_compilation_cache_dir is None
    finally:
        jax.config.update("jax_compilation_cache_dir", current)


def test_rerun_loads_every_program_and_trains_identically():
    spec = bench.MODES["test"]["rl"][0]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        r = bench.first_iteration_cached(spec, iters=2)
    cold, warm = r["cold"], r["warm"]
    # The cold run compiles and writes the trainer's programs ...
    assert cold["cache_hits"] == 0 and cold["files_written"] >= 3, cold
    # ... the warm run finds every one of them and compiles nothing new.
    assert warm["cache_misses"] == 0 and warm["files_written"] == 0, warm
    assert warm["cache_hits"] >= cold["files_written"], (cold, warm)
    assert warm["losses"] == cold["losses"]  # bit-identical floats
    for x in (cold, warm):
        assert set(x) >= {"setup_s", "first_iter_s", "steady_iter_s", "process_s"}
