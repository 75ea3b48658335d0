"""What every `erpo bench` section shares: the section names, the per-mode
sizes, the peak host RSS."""

from __future__ import annotations

import resource

import jax

SECTIONS = ("matmul_peak", "regularizer", "mfu", "sampler", "engines", "rl_iteration",
            "memory")

# Per-mode sizes. "test" is the smallest (the test suite), "quick" < 1 minute.
MODES = {
    "test": dict(peak_n=512, reg_preset="tiny", reg_layers=1, reg_shape=(2, 2, 8, 8),
                 reg_repeats=2,
                 mfu_preset="tiny", mfu_shape=(4, 32), mfu_repeats=2,
                 sampler=dict(presets=("tiny",), batches=(2,), new_tokens=4, repeats=1,
                              torch_threads=1),
                 engines=dict(preset="tiny", prompts=4, group=2, new_tokens=16, slots=4,
                              prompt_lens=(4, 8), repeats=1),
                 rl=[dict(name="tiny", preset="tiny", prompts=4, group=2, prompt_len=16,
                          new_tokens=4, iters=2)]),
    "quick": dict(peak_n=1024, reg_preset="tiny", reg_layers=1, reg_shape=(8, 4, 32, 32),
                  reg_repeats=7,
                  mfu_preset="medium-25m", mfu_shape=(4, 128), mfu_repeats=2,
                  sampler=dict(presets=("tiny",), batches=(1, 32, 128), new_tokens=16,
                               repeats=1, torch_threads=1),
                  engines=dict(preset="peer-small", prompts=16, group=8, new_tokens=128,
                               slots=32, repeats=1),
                  rl=[dict(name="tiny", preset="tiny", prompts=8, group=4, prompt_len=32,
                           new_tokens=32, iters=4)]),
    "full": dict(peak_n=2048, reg_preset="medium-25m", reg_shape=(4, 4, 64, 64),
                 reg_repeats=7, mfu_preset="medium-25m", mfu_shape=(8, 256), mfu_repeats=3,
                 sampler=dict(presets=("tiny", "medium-25m"), batches=(1, 32, 128),
                              new_tokens=32, repeats=2),
                 engines=dict(preset="peer-small", prompts=32, group=8, new_tokens=256,
                              slots=64, repeats=2),
                 rl_cached=True,
                 rl=[dict(name="tiny", preset="tiny", prompts=8, group=4, prompt_len=32,
                          new_tokens=32, iters=12),
                     dict(name="medium", preset="medium-25m", prompts=64, group=8,
                          prompt_len=128, new_tokens=256, iters=2, micro_batches=16)]),
}
BETA_POLICY, BETA_QUERY = 0.04, 0.1


def peak_rss_mib() -> float:
    """The process's peak resident set so far, MiB (Linux reports KiB)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0


def _block(x):
    return jax.block_until_ready(x)


def host() -> dict:
    """The machine a report was measured on: CPU model and cores (Linux), OS."""
    import os
    import platform
    from erpo_jax.runtime.compile_cache import cpuinfo
    cpu = cpuinfo("model name") or platform.processor() or platform.machine()
    return {"cpu": cpu, "cores": os.cpu_count(), "system": platform.platform()}
