"""Test set-up: 8 fake CPU devices, full-precision float32 matmuls, and a
per-session persistent compilation cache (many tests compile identical
programs, e.g. the same update step for several advantage estimators)."""

import os
import tempfile

# Must happen before jax is imported anywhere.
os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
os.environ.setdefault("JAX_PLATFORMS", "cpu")
# ERPO_JAX_TEST_XLA_CACHE: one cache shared by several sessions (tests/mutations.py).
# Set here in the pytest-xdist controller, so both workers inherit one cache and a
# program one of them compiled is loaded by the other.
_CACHE = os.environ.get("ERPO_JAX_TEST_XLA_CACHE") or tempfile.mkdtemp(prefix="erpo-jax-xla-cache-")
os.environ["ERPO_JAX_TEST_XLA_CACHE"] = _CACHE
# Subprocesses (CLI and multi-process tests) share one cache of the session's
# too, never ~/.cache: most of them compile the same tiny trainer's programs.
os.environ.setdefault("ERPO_JAX_COMPILE_CACHE", os.path.join(_CACHE, "subprocesses"))

import jax  # noqa: E402

jax.config.update("jax_default_matmul_precision", "highest")
jax.config.update("jax_compilation_cache_dir", _CACHE)
jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.5)
jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)


import pytest  # noqa: E402

# The longest test files (seconds of one core, from `pytest --durations`), handed
# to the workers first: under --dist loadfile a file runs whole on one worker, and
# a long file dealt out last leaves the other worker idle until it ends.
LONGEST_FIRST = ("test_train.py", "test_model.py", "test_lora.py", "test_engines.py",
                 "test_faults.py", "test_real_path.py", "test_sampler.py", "test_plan.py",
                 "test_method_run.py", "test_bench.py", "test_experiments.py",
                 "test_readme_example.py", "test_demo.py", "test_multihost_train.py",
                 "test_paged_engine.py", "test_resume_changes.py", "test_stabilizers.py",
                 "test_sharding.py", "test_mistakes.py", "test_loss_terms.py",
                 "test_attention.py", "test_chaos.py", "test_results_tables.py",
                 "test_bench_peer.py")


LONG = os.environ.get("ERPO_LONG_TESTS") == "1"


def pytest_configure(config):
    # pytest-xdist deals the files out by their number of tests unless told
    # not to (its --loadscope-reorder is on by default), which puts the long
    # files of one or two tests (test_multihost_train.py, test_demo.py) last:
    # the workers get them in LONGEST_FIRST's order instead.
    if hasattr(config.option, "loadscopereorder"):
        config.option.loadscopereorder = False


def _is_long(item) -> bool:
    """`@pytest.mark.long`: a longer variant of a property a default test checks
    too; `@pytest.mark.long(when=f)`: the parametrized cases whose params f(params)
    calls long. Deselected unless ERPO_LONG_TESTS=1."""
    mark = item.get_closest_marker("long")
    if mark is None:
        return False
    when = mark.kwargs.get("when")
    return when is None or bool(when(getattr(item, "callspec", None) and item.callspec.params))


def pytest_collection_modifyitems(config, items):
    if not LONG:
        long = [item for item in items if _is_long(item)]
        if long:
            config.hook.pytest_deselected(items=long)
            items[:] = [item for item in items if not _is_long(item)]
    rank = {name: i for i, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))   # stable: file order kept


@pytest.fixture(scope="session")
def sft_model(tmp_path_factory):
    """The exported model directory of a tiny SFT run (tests/tiny_runs.py),
    made once per session and shared by every trainer test. Under
    pytest-xdist the workers share one: the first to need it builds it in
    the session's directory (under a file lock), the other waits and reads it."""
    import fcntl

    from erpo_jax import cli
    from tiny_runs import sft_args
    if os.environ.get("PYTEST_XDIST_WORKER") is None:
        out = tmp_path_factory.mktemp("sft")
        assert cli.main(sft_args(out)) == 0
    else:
        out = tmp_path_factory.getbasetemp().parent / "sft"
        with open(str(out) + ".lock", "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)   # released as the file closes
            done = out.parent / "sft.done"   # written once the build passed
            if not done.is_file():
                assert cli.main(sft_args(out)) == 0
                done.write_text("")
    assert (out / "model" / "config.json").is_file()
    assert (out / "model" / "erpo_tokenizer.json").is_file()
    return out / "model"
