"""`erpo bench` section rl_iteration: the RL iteration through the Trainer's
own functions, and the first iteration with a cold and a warm compilation
cache."""

from __future__ import annotations

import contextlib
import json
import statistics
import tempfile
import time
from pathlib import Path
from unittest import mock

from erpo_jax.rl.loss import LossConfig
from erpo_jax.tools.bench.common import BETA_POLICY, peak_rss_mib

# ----------------------------------------------------------------------------- RL iteration


def _padded_task_loader(width: int):
    """load_task, with each training prompt left-filled with spaces (after its
    BOS) to exactly `width` tokens, so the rollout has the benchmark's prompt length."""
    from erpo_jax.train import tasks as tasks_lib

    def load(cfg, tokenizer, **kw):
        task = tasks_lib.load_task(cfg, tokenizer, **kw)
        filler = tokenizer.encode_prompt(" ")[-1]
        task.train_prompts = [p[:1] + [filler] * (width - len(p)) + p[1:]
                              for p in task.train_prompts]
        return task
    return load


@contextlib.contextmanager
def bench_trainer(name: str, preset: str, prompts: int, group: int, prompt_len: int,
                  new_tokens: int, iters: int, micro_batches: int = 1,
                  beta_policy: float = BETA_POLICY, mesh=(-1, 1, 1),
                  compile_cache: str = "off", temperature: float = 1.0, top_k: int = 0,
                  optim: dict | None = None, share_query: bool = True, engine: str = "auto",
                  eos_bias: float = 0.0, lora_rank: int = 0):
    """A Trainer on a random `preset` model whose training prompts are padded to
    `prompt_len` tokens (the arithmetic task), yielded with its setup seconds:
    the RL iteration of `rl_iteration` (and of a profile of it) without its timing.
    engine: rollout.engine. eos_bias: added to the sampler's logits of the
    tokenizer's EOS ids (a random model's responses then end at EOS with a
    probability set by the bias: the peer's `varied` config, `tunix_varied.py`;
    the update's log-probs do not see it). lora_rank: model.lora_rank (0: full
    fine-tuning)."""
    from erpo_jax.train import loop as loop_lib
    from erpo_jax.train import startup
    from erpo_jax.train.config import (AlgoSection, DataSection, MeshSection, ModelSection,
                                       OptimSection, RolloutSection, RunConfig, TrainSection)
    with tempfile.TemporaryDirectory() as tmp:
        cfg = RunConfig(
            name=f"bench-{name}", model=ModelSection(init="random", preset=preset,
                                                      share_query=share_query,
                                                      lora_rank=lora_rank),
            data=DataSection(n_train=max(64, prompts), n_test=4, max_prompt_len=prompt_len),
            rollout=RolloutSection(group_size=group, max_new_tokens=new_tokens,
                                   temperature=temperature, top_k=top_k, engine=engine),
            algo=AlgoSection(method="grpo_policy_kl" if beta_policy > 0 else "no_kl"),
            loss=LossConfig(beta_policy=beta_policy),
            optim=OptimSection(micro_batches=micro_batches, **(optim or {})),
            mesh=MeshSection(tuple(mesh)),
            train=TrainSection(steps=iters, batch_size=prompts, out_dir=f"{tmp}/run",
                               eval_every=0, drift_every=0, drift_queries=4,
                               eval_max_problems=4, progress=False,
                               ref_cache_dir=f"{tmp}/ref", compile_cache=compile_cache))
        t0 = time.perf_counter()
        with contextlib.ExitStack() as patches:
            if eos_bias:
                _bias_eos_logits(patches, eos_bias)
            with mock.patch.object(startup, "load_task", _padded_task_loader(prompt_len)):
                trainer = loop_lib.Trainer(cfg)
            try:
                yield trainer, time.perf_counter() - t0
            finally:
                trainer.close()


def _bias_eos_logits(patches: contextlib.ExitStack, bias: float) -> None:
    """Add `bias` to the logits of the arithmetic tokenizer's EOS ids in both
    rollout engines' sampling (for as long as `patches` holds)."""
    import jax.numpy as jnp

    from erpo_jax.rollout import continuous, head, static
    from erpo_jax.train.tasks import load_tokenizer
    eos = jnp.asarray(load_tokenizer(None).eos_ids, jnp.int32)
    plain = head.head_logits

    def biased(h, head, cfg, sharding=None):
        return plain(h, head, cfg, sharding).at[:, eos].add(bias)

    for module in (static, continuous):
        patches.enter_context(mock.patch.object(module, "head_logits", biased))


def rl_iteration(iters: int, **spec) -> dict:
    """Time `iters` RL steps through the Trainer's own `_rl_batch` + `_update`
    (rollout, arithmetic exact-match reward, GRPO advantages, the reference
    forward for Policy-KL, the update) of the Trainer `bench_trainer(**spec)`
    builds. Iteration 0 includes compilation; setup_s is the Trainer's
    construction (policy, task, reference pass), during which the update
    already compiles in the background (train.compile_ahead), so setup_s +
    first_iter_s is the time to the first finished step.
    spec: name, preset, prompts, group, prompt_len, new_tokens and optionally
    micro_batches, beta_policy, mesh ((data, fsdp, tensor), the Trainer's
    default puts all devices on data), compile_cache (train.compile_cache;
    'off', the default, measures cold compiles whatever the user's cache holds,
    see `first_iteration_cached`), temperature, top_k, optim (OptimSection
    fields): as a peer runs them."""
    with bench_trainer(iters=iters, **spec) as (trainer, setup):
        times, parts, losses, lengths = [], [], [], []
        for step in range(iters):
            t0 = time.perf_counter()
            batch, cb, info, part, ro = trainer._rl_batch(step)
            t1 = time.perf_counter()
            losses.append(trainer._update(batch, cb, step)["loss"])
            lengths.append(info["response_len_mean"])
            times.append(time.perf_counter() - t0)
            parts.append({**part, "time/update": time.perf_counter() - t1})
        ref_calls, cache_dir = trainer.ref_forward_calls, trainer.compile_cache
        beta_policy, micro_batches = trainer.cfg.loss.beta_policy, trainer.cfg.optim.micro_batches
    steady = times[1:] or times
    breakdown = {k: statistics.median(p[k] for p in parts[1:] or parts) for k in parts[0]}
    return {**{k: spec[k] for k in ("name", "preset", "prompts", "group", "prompt_len",
                                    "new_tokens")}, "beta_policy": beta_policy,
            "micro_batches": micro_batches, "iters": iters, "setup_s": setup,
            "first_iter_s": times[0], "steady_iter_s": statistics.median(steady),
            "steady_breakdown_s": breakdown, "first_breakdown_s": parts[0], "ref_forward_calls": ref_calls,
            "iter_s": times, "parts": parts,
            "path": "Trainer._rl_batch + Trainer._update", "peak_rss_mib": peak_rss_mib(),
            "losses": losses, "compile_cache": cache_dir, "response_len_mean": lengths}


_CHILD = """
import json, sys
from jax import monitoring
from erpo_jax.tools import bench
counts = {"cache_hits": 0, "cache_misses": 0}
def count(name, **kw):
    key = name.rsplit("/", 1)[-1]
    if name.startswith("/jax/compilation_cache/") and key in counts:
        counts[key] += 1
monitoring.register_event_listener(count)
r = bench.rl_iteration(**json.loads(sys.argv[1]))
print("RESULT " + json.dumps({**r, **counts}))
"""


def first_iteration_cached(spec: dict, iters: int = 3) -> dict:
    """The RL iteration of `spec` (an entry of MODES[...]['rl']) in two fresh
    processes sharing an empty persistent compilation cache: 'cold' compiles
    and fills it, 'warm' (a rerun of the same config) loads the programs.
    Each: setup_s, first_iter_s, steady_iter_s, losses (identical in both),
    the cache's hits and misses, files_written (new cache entries) and
    process_s (the whole process, imports included).

    Both processes write every program, however fast it compiled (JAX's
    minimum compile time set to 0): with the usual threshold a program that
    compiles just under it on a loaded host is not written, and the warm run
    compiles it again (seen as a flaky 'warm run missed 1-2 programs')."""
    import os
    import subprocess
    import sys
    out = {}
    env = {**os.environ, "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0"}
    with tempfile.TemporaryDirectory() as cache:
        child = {**spec, "iters": iters, "compile_cache": cache}
        for run in ("cold", "warm"):
            before = set(Path(cache).iterdir())
            t0 = time.perf_counter()
            proc = subprocess.run([sys.executable, "-c", _CHILD, json.dumps(child)],
                                  capture_output=True, text=True, env=env)
            wall = time.perf_counter() - t0
            lines = [x for x in proc.stdout.splitlines() if x.startswith("RESULT ")]
            if proc.returncode or not lines:
                raise RuntimeError(f"bench: the {run} compile-cache run failed "
                                   f"(exit {proc.returncode}):\n{proc.stderr[-3000:]}")
            r = json.loads(lines[-1][len("RESULT "):])
            keep = ("setup_s", "first_iter_s", "steady_iter_s", "losses", "cache_hits",
                    "cache_misses")
            out[run] = {**{k: r[k] for k in keep}, "process_s": wall,
                        "files_written": len(set(Path(cache).iterdir()) - before)}
    return {"name": spec["name"], "iters": iters, **out}
