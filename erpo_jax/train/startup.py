"""How every command that runs a model starts, in one place.

`erpo train` (the Trainer), `erpo sft`, `erpo eval` and `erpo inspect-grads`
all begin the same way: check the config before anything is built, point
JAX at the compilation cache, build the mesh, check the config again against
the devices it found (which also resolves `algo.method`), load the policy
and its tokenizer, refuse non-finite weights, and load the task. `start`
is that sequence; a command's own step between the checks and the loading
(a training run takes its directory's lock and checks its config there)
is the `claim` callback.

The reference pass's cache lives where `reference_cache_dir` says, through
`runtime/rundir.py`, so a `gs://` run directory works for every reader.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Sequence

import jax

from erpo_jax.model.config import ModelConfig
from erpo_jax.model.sharding import Sharding
from erpo_jax.rl import reference as ref_lib
from erpo_jax.runtime import compile_cache, rundir
from erpo_jax.train.config import RunConfig, validate
from erpo_jax.train.policy import (build_sharding, check_finite, load_policy,
                                    require_model_dir)
from erpo_jax.train.tasks import Task, Tokenizer, load_task


@dataclasses.dataclass
class Started:
    """What `start` built. cfg: validated against the devices, method resolved."""

    cfg: RunConfig
    sharding: Sharding
    compile_cache: Any
    model_cfg: ModelConfig
    params: Any
    tokenizer: Tokenizer
    task: Task | None


def start(cfg: RunConfig, *, policy: str = "the starting policy", task: bool = True,
          measure_drift: bool = False,
          claim: Callable[[RunConfig, Sharding], None] | None = None) -> Started:
    """Validate, compile cache, mesh, validate on the mesh, `claim(cfg, mesh)`, load
    the policy (named `policy` if its weights are not finite) and, with `task`,
    the task (`measure_drift`: the caller logs query drift, tasks.load_task).
    Whatever `claim` took is the caller's to release if a later step raises."""
    validate(cfg)   # before anything is built: a bad field is one sentence, rc 2
    if cfg.model.init in ("sft", "hf"):   # the model to load exists, before any mesh
        require_model_dir(cfg.model.path)
    cache = compile_cache.configure(cfg.train.compile_cache)
    sharding = build_sharding(cfg)
    cfg = validate(cfg, jax.device_count())
    if claim is not None:
        claim(cfg, sharding)
    model_cfg, params, tok = load_policy(cfg, sharding)
    check_finite(params, f"{policy} ({cfg.model.init} {cfg.model.path})")
    loaded = load_task(cfg, tok, drift=measure_drift) if task else None
    return Started(cfg, sharding, cache, model_cfg, params, tok, loaded)


def reference_cache_dir(cfg: RunConfig):
    """`train.ref_cache_dir`, else `.refcache` beside the run directory (local
    or gs://): sibling runs from one reference share their reference pass."""
    t = cfg.train
    return rundir.path(t.ref_cache_dir) if t.ref_cache_dir else \
        rundir.path(t.out_dir).parent / ".refcache"


def reference_pass(cfg: RunConfig, params, model_cfg: ModelConfig, tokenizer: Tokenizer,
                   task: Task, sharding: Sharding, prompts: Sequence[Sequence[int]],
                   params_hash: str | None = None) -> tuple[ref_lib.ReferenceCache, bool]:
    """(cache, computed): the reference's log-probabilities of `prompts` from
    the run's cache (reference_cache_dir), computed and stored if absent. The
    key is the Trainer's: a sibling reader (inspect-grads) finds its file."""
    t = cfg.train
    return ref_lib.load_or_compute(
        params, model_cfg, prompts, reference_cache_dir(cfg), tokenizer_id=tokenizer.identity,
        template=task.template_id, params_hash=params_hash, batch_size=t.ref_batch_size,
        pad_id=tokenizer.pad_id, chunk_size=cfg.model.logprob_chunk, sharding=sharding,
        progress=t.progress)
