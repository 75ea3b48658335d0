"""The RL loop: rollout -> reward -> advantages -> update -> metrics -> checkpoint.

Per RL step s: take B queries (the data iterator at position s), sample G
responses each with the rollout key fold_in(seed, s), score them, compute
advantages, run the reference over the responses only if Policy-KL is on,
then update for `optim.epochs` passes over `optim.num_minibatches` shuffled
mini-batches of whole groups. Query-KL reads the cached reference pass and
never runs the reference model.
"""

from __future__ import annotations

import signal
import threading
import time
import warnings
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from erpo_jax.runtime import host_malloc, xla_options
from erpo_jax.data.iterator import QueryBatchIterator
from erpo_jax.model.sharding import Sharding
from erpo_jax.rl import critic as critic_lib
from erpo_jax.rl import assemble, dynamic_sampling, kl_control
from erpo_jax.rl import reference as ref_lib
from erpo_jax.rl.batch import RLBatch, masks_from_layout
from erpo_jax.rl.loss import LossConfig as LossConfigDefaults
from erpo_jax.rl.query_kl import query_kl
from erpo_jax.rollout.types import rollout_key
from erpo_jax.runtime import rundir
from erpo_jax.runtime.run_lock import RunLock
from erpo_jax.runtime.progress import progress_bar
from erpo_jax.train import checkpoint as ckpt_lib
from erpo_jax.train import resume as resume_lib
from erpo_jax.train import startup
from erpo_jax.train import train_step as step_lib
from erpo_jax.train.config import ConfigError, RunConfig, config_dict, normalized
from erpo_jax.train.evaluate import Evaluator, keep_evals, write_eval
from erpo_jax.train.methods import describe as describe_method
from erpo_jax.runtime.distributed import to_host
from erpo_jax.train.host import sample
from erpo_jax.train.metrics import MetricsWriter
from erpo_jax.train.policy import (ADAPTER_SUBDIR, MODEL_SUBDIR, check_finite,
                                   export_adapter, export_policy)
from erpo_jax.train.programs import Programs
from erpo_jax.train.tasks import Task

# `erpo train` exits with this code when SIGTERM stopped it after saving a
# checkpoint (EX_TEMPFAIL: rerunning the same command resumes); 0 means done.
PREEMPTED_EXIT_CODE = 75


def resume_command() -> str:
    """The command line that started this process, as `erpo ...`."""
    import shlex
    import sys
    return shlex.join(["erpo", *sys.argv[1:]])


class Preempted(Exception):
    """Raised inside the loop when SIGTERM arrived (after the checkpoint is saved)."""


def _put(tree, sharding: Sharding | None):
    """Every array of `tree` (numpy, rows first; None leaves stay None) on the
    devices, rows over "batch", in one transfer."""
    leaves, treedef = jax.tree_util.tree_flatten(tree)
    leaves = [np.asarray(x) for x in leaves]
    where = None if sharding is None else [sharding.named(("batch", None)[:x.ndim])
                                           for x in leaves]
    return jax.tree_util.tree_unflatten(treedef, jax.device_put(leaves, where))


class Trainer:
    """Owns everything a run needs; `run()` trains to `train.steps` (resuming if it can)."""

    def __init__(self, cfg: RunConfig):
        # A constructor that raises must not leave the compile-ahead thread
        # running: the interpreter would abort at exit (rc 134) and hide the error.
        self._compiling, self._ahead_done = None, threading.Event()
        try:
            self._build(cfg)
        except BaseException:
            self.close()
            raise

    def _claim(self, cfg: RunConfig, sharding: Sharding) -> None:
        """The run directory, between the config checks and the model load: its
        lock (one run per directory, before anything is written there) and the
        config check against the run it resumes."""
        t = cfg.train
        self.primary = jax.process_index() == 0
        self.run_dir = rundir.path(t.out_dir)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        if self.primary:
            self.lock = RunLock(self.run_dir, "erpo train")
        self.ckpt = ckpt_lib.Checkpointer(self.run_dir / "checkpoints", t.keep_checkpoints,
                                          t.ckpt_every)
        self._latest = latest = self.ckpt.latest_step()
        self._config_record = None
        # What the config changes do to the checkpoint's state (train/resume.py):
        # a change that cannot resume is refused here, before anything is written.
        self._resume = None
        if latest is not None:
            old, _ = rundir.last_config(self.run_dir)
            self._resume = resume_lib.plan(_saved_config(old), cfg)
        if self.primary:
            # Checked now, written once the start has succeeded (a failed start
            # leaves config.json and config_history.jsonl as they were).
            self._config_record = rundir.check_config(
                self.run_dir, config_dict(cfg), normalized, resuming=latest is not None,
                allow_change=t.allow_config_change, start_step=latest or 0)
            print(describe_method(cfg), flush=True)
            if cfg.loss.adaptive_kl:
                print(f"[erpo] {kl_control.describe_reach(cfg)}.", flush=True)
            for note in self._resume.notes if self._resume else ():
                print(f"[erpo] {note}.", flush=True)
            for note in _no_effect(cfg):
                print(f"[erpo] WARNING: {note}.", flush=True)

    def _build(self, cfg: RunConfig) -> None:
        s = startup.start(cfg, measure_drift=True, claim=self._claim)
        cfg = self.cfg = s.cfg   # method resolved
        t, a = cfg.train, cfg.algo
        self.compile_cache, self.sharding = s.compile_cache, s.sharding
        self.model_cfg, params, self.tokenizer = s.model_cfg, s.params, s.tokenizer
        self.task: Task = s.task
        if t.eval_every > 0 and not self.task.eval_sets:
            raise ConfigError(
                f"config field train.eval_every: is {t.eval_every}, but the task has no "
                "evaluation set (data.eval_benchmarks is empty and train.eval_split is not "
                "'validation'); name benchmarks in data.eval_benchmarks, evaluate on data.n_val "
                "rows with train.eval_split=validation, or set train.eval_every=0.")
        latest, config_record = self._latest, self._config_record
        self.base_hash = None
        if self.model_cfg.lora_rank:
            self._check_base(latest, params)
        self.G, self.B = cfg.rollout.group_size, t.batch_size
        self.ref_forward_calls = 0

        self.programs = progs = Programs(cfg, self.model_cfg, self.sharding,
                                         self.tokenizer.eos_ids, self.tokenizer.pad_id)
        self.recipe = progs.recipe
        if progs.query_group_note and self.primary:
            print(f"[erpo] {progs.query_group_note}; each response row runs its own query.",
                  flush=True)
        critic = None
        if progs.has_critic:
            critic = critic_lib.init_critic(self.model_cfg, jax.random.key(t.seed), params)
        self.state = progs.init_state(params, critic)
        self.update, self.sampler = progs.update, progs.sampler
        self.ref_logp_fn, self.t1_logp_fn = progs.ref_logp_fn, progs.t1_logp_fn
        self.advantages_fn, self.values_fn = progs.advantages_fn, progs.values_fn
        self._shapes_rewards = progs.shapes_rewards
        self.iterator = QueryBatchIterator(len(self.task.train), self.B, t.seed)
        self.start_step = 0 if latest is None else latest
        self._next_indices = None   # (step, indices) prepared while the last update ran
        self._ahead_position = None   # the iterator position compile-ahead read its prompts at
        self._started = None   # (step, iterator position) of the step being drawn
        if t.compile_ahead and jax.process_count() == 1:
            if latest is not None:
                # The first prompts are at the checkpoint's iterator position,
                # which the restore below sets: read it now, so the thread
                # compiles the width of the prompts the step will sample.
                try:
                    self.iterator.set_state(self.ckpt.meta(latest)["data"])
                except Exception:  # noqa: BLE001 - unreadable: the restore below says why
                    pass
            self._compiling = threading.Thread(target=self._compile_ahead,
                                               args=(self.start_step,), daemon=True)
            self._compiling.start()

        # One-time reference pass (the initial policy is the reference; with
        # LoRA the base, under the base config).
        ref0, ref_cfg = progs.reference_params(params), progs.ref_cfg
        phash = self.base_hash or ref_lib.params_digest(ref0)
        self.ref_cache, _ = startup.reference_pass(cfg, ref0, ref_cfg, self.tokenizer,
                                                   self.task, self.sharding,
                                                   self.task.train_prompts, phash)
        self.weights = self.ref_cache.weights(a.weight_scheme, a.weight_tau, a.weight_min,
                                              a.weight_max)
        self.drift_prompts = self.task.prompts(self.task.drift_set[:t.drift_queries])
        self.drift_cache = None   # the held-out queries' reference pass, only if drift is logged
        self.drift_floor = {}
        if t.drift_every > 0:
            self.drift_cache, _ = startup.reference_pass(cfg, ref0, ref_cfg,
                                                         self.tokenizer, self.task, self.sharding,
                                                         self.drift_prompts, phash)
            # The drift of the reference itself: what rounding alone reads (in
            # bf16 the reference pass's batch layout and the drift's differ).
            # Logged next to every drift value, so bf16 drift can be read.
            self.drift_floor = {f"{k}_floor": v for k, v in self.drift(params).items()}
            if self.primary:
                print(f"[erpo] drift floor (policy = reference, compute dtype "
                      f"{self.model_cfg.compute_dtype}): " + ", ".join(
                          f"{k} {v:.3g}" for k, v in self.drift_floor.items()), flush=True)
        # The reference weights stay in memory only if a per-step term needs them.
        need_ref = self.recipe.needs_ref_logp or t.policy_kl_metric
        # Distinct buffers (the policy's are donated to the update): one jitted
        # copy of the tree, not an eager op per leaf shape that would each
        # compile. With LoRA none: the reference is the policy's frozen base
        # (`_reference_params`).
        self.ref_params = jax.jit(lambda p: jax.tree_util.tree_map(jnp.copy, p),
                                  compiler_options=xla_options.for_once())(params) \
            if need_ref and not self.model_cfg.lora_rank else None
        self.evaluator = Evaluator(self.model_cfg, self.task, cfg, self.sharding,
                                   samplers=(progs.eval_greedy, progs.eval_sampled))
        self.seed_key = jax.random.key(t.seed)
        self._rollout_seed = jax.random.fold_in(self.seed_key, 1)   # once, not every step
        self.writer = MetricsWriter(self.run_dir, self.primary, t.tensorboard)
        if latest is not None:
            meta = self._restore(latest)
            self.start_step = int(meta["step"])
            self.iterator.set_state(meta["data"])
        if self.primary:   # every per-step file holds what the checkpoint covers, once
            rundir.write_config(config_record, {"data_rows": self.task.data_rows()})
            s0 = self.start_step
            self.writer.truncate_after(s0)
            keep_evals(self.run_dir, lambda s: s <= s0 if s0 > 0 else False)
        self._last_drift = float("nan")
        self.nonfinite_in_a_row = int(self.state.nonfinite)
        self._stop = False

    def _check_base(self, latest: int | None, params) -> None:
        """LoRA: hash the frozen base (`base_hash`, kept in every checkpoint's
        meta) and, resuming, refuse a base other than the checkpoint's before
        anything compiles: its adapters were trained on that one."""
        from erpo_jax.model import lora
        self.base_hash = ref_lib.params_digest(lora.base(params))
        if latest is None:
            return
        try:
            saved = self.ckpt.meta(latest).get("base_hash")
        except Exception:  # noqa: BLE001 - unreadable: the restore says why
            return
        if saved is not None and saved != self.base_hash:
            raise ConfigError(
                f"config field model.path: the base model at {self.cfg.model.path} is not the "
                f"one the LoRA checkpoint of step {latest} in {self.ckpt.directory} was trained "
                f"on (base hash {self.base_hash[:12]}, the checkpoint's {saved[:12]}); resume "
                "with the checkpoint's base model or start anew with another train.out_dir.")

    def _checkpointed(self, state):
        """What a checkpoint holds of `state`: with LoRA the adapters without
        the frozen base (whose hash is in the meta), else all of it."""
        if not self.model_cfg.lora_rank:
            return state
        return state.replace(params=step_lib.trainable(state.params, self.model_cfg))

    def _restore(self, latest: int) -> dict:
        """Restore the newest intact checkpoint into self.state; return its meta.

        A latest checkpoint that cannot be read while an older one can is
        corrupt (a truncated file): it is moved to <out_dir>/broken_checkpoints
        and the run resumes from the older one, saying so and which steps it
        redoes. Single-process runs only: with several processes moving files
        under the others is not safe, so those are refused with the command."""
        def why(e):
            cause = str(ckpt_lib.root_cause(e)).strip().split(". ")[:1] or [""]
            return f"{type(e).__name__}: {cause[0][:200]}"
        plan = self._resume
        like = self._checkpointed(self.state)
        if plan is not None and plan.ckpt_kl_coef != (like.kl_coef is not None):
            # Restore into the checkpoint's own layout, then apply the plan.
            like = like.replace(kl_coef=jax.device_put(np.float32(0), like.step.sharding)
                                if plan.ckpt_kl_coef else None)
        try:
            state, meta, broken = self.ckpt.restore_newest_intact(like)
        except Exception as e:  # noqa: BLE001 - a sentence, not orbax's traceback
            raise ValueError(
                f"the checkpoint of step {latest} in {self.ckpt.directory} does not fit the "
                f"model and optimizer this config builds ({why(e)}), and no older one does; "
                "resume with the config it was made with, or start anew with another "
                "train.out_dir.") from None
        step = int(meta["step"])
        if broken:
            steps = ", ".join(str(s) for s, _ in broken)
            many = "s" if len(broken) > 1 else ""
            said = (f"the checkpoint{many} of step{many} {steps} in {self.ckpt.directory} cannot "
                    f"be restored ({why(broken[0][1])})")
            if jax.process_count() > 1:
                moves = "; ".join(f"mv {self.ckpt.directory / str(s)} "
                                  f"{self.run_dir / 'broken_checkpoints' / str(s)}"
                                  for s, _ in broken)
                raise ValueError(f"{said}; the one of step {step} is intact: move the broken "
                                 f"one aside ({moves}) and rerun the same command to resume "
                                 f"from step {step}.")
            if self.primary:
                for s, _ in broken:
                    self.ckpt.set_aside(s)
                print(f"[erpo] {said}; moved to {self.run_dir / 'broken_checkpoints'}, "
                      f"resuming from step {step}, the newest intact checkpoint: steps "
                      f"{step + 1}-{broken[0][0]} are redone.", flush=True)
        if self.model_cfg.lora_rank:   # the adapters back on this run's base
            state = state.replace(params=step_lib.with_trainable(
                self.state.params, state.params, self.model_cfg))
        if plan is not None and plan.kl_coef != "keep":
            coef = self.programs.init_state_kl_coef() if plan.kl_coef == "start" else None
            state = state.replace(kl_coef=coef)
        self.state = state
        check_finite(self.state.params, f"the checkpoint of step {step} in "
                     f"{self.ckpt.directory}")
        return meta

    # ------------------------------------------------------------------ pieces

    def _draw_at(self, step: int) -> int:
        """The iterator position of step `step`'s first batch of prompts, for
        the next step to run: the iterator's position, which counts the
        batches drawn (one a step, or dynamic sampling's draws) and which the
        checkpoint holds. Never the step number: a run that turned dynamic
        sampling on or off on resume would otherwise train on batches again."""
        started = self._started
        return started[1] if started is not None and started[0] == step else self.iterator.step

    def _prompts_at(self, step: int) -> list:
        """Token ids of step `step`'s (first) training prompts (the iterator is not moved)."""
        return [self.task.train_prompts[i] for i in self.iterator.batch_at(self._draw_at(step))]

    def update_arguments(self, step: int):
        """Abstract (state, mini-batch, critic batch) of step `step`'s update
        calls: the rollout's width is the length bucket of that step's longest
        prompt plus max_new_tokens (what `_rl_batch` and `_update` produce)."""
        return self.programs.update_arguments(self.state, self._width_at(step))

    def _width_at(self, step: int) -> int:
        prompts = self._prompts_at(step)
        return (self.sampler.batch_shape(len(prompts), max(len(p) for p in prompts))[1]
                + self.sampler.sampling.max_new_tokens)

    def _compile_ahead(self, step: int) -> None:
        """Compile step `step`'s rollout, reference forward (with Policy-KL)
        and update for its shapes, in the order the step needs them (runs in
        a thread while the reference pass runs; the programs land in jit's
        cache, so the first real calls reuse them; `_ahead_done` is set when
        the rollout and reference forward are done). A failure only costs the
        overlap: that program compiles when it first runs."""
        try:
            for name, job in self._ahead_jobs(step):
                if name == "update":
                    self._ahead_done.set()
                try:
                    job()
                except Exception as e:  # noqa: BLE001 - never let the warm-up kill a run
                    warnings.warn(f"compile-ahead of the {name} failed ({type(e).__name__}: "
                                  f"{e}); it compiles when it first runs.", stacklevel=1)
        except Exception as e:  # noqa: BLE001
            warnings.warn(f"compile-ahead failed ({type(e).__name__}: {e}); programs compile "
                          "when they first run.", stacklevel=1)
        finally:
            self._ahead_done.set()

    def _ahead_jobs(self, step: int) -> list:
        """(name, compile function) for step `step`, in the order the step runs them."""
        state, batch, critic = self.update_arguments(step)
        self._ahead_position = self._draw_at(step)
        prompts = self._prompts_at(step)
        jobs = [("rollout", lambda: self.sampler.compile_sample(
            state.params, prompts, self.cfg.rollout.max_prompts_per_call))]
        T = batch.tokens.shape[1]
        if self.recipe.needs_ref_logp:
            jobs.append(("reference forward",
                         lambda: self.programs.lower_reference_forward(state.params, T).compile()))
        jobs.append(("advantages", lambda: self.programs.lower_advantages(T).compile()))
        jobs.append(("update", lambda: self._note_memory(
            "update", self.update.lower(state, batch, critic).compile())))
        return jobs

    def _note_memory(self, name: str, compiled) -> None:
        """Log when a compiled CPU program's temporaries are more than the host
        allocator keeps between calls (`host_malloc.large_temporaries_note`)."""
        if jax.default_backend() != "cpu":
            return
        try:
            temp = compiled.memory_analysis().temp_size_in_bytes
        except Exception:  # noqa: BLE001 - an estimate only; some backends have none
            return
        note = host_malloc.large_temporaries_note(name, temp, self.cfg.optim.micro_batches)
        if note:
            print(f"[erpo] {note}", flush=True)

    def _wait_for_compile(self, everything: bool = True) -> None:
        """Block until the compile-ahead thread is done (everything=False: until
        what a rollout and reference forward need is)."""
        if self._compiling is None:
            return
        if not everything:
            self._ahead_done.wait()
            return
        self._compiling.join()
        self._compiling = None

    def _sample(self, idx, key):
        prompts = [self.task.train_prompts[i] for i in idx]
        return sample(self.sampler, self.state.params, prompts, key,
                      self.cfg.rollout.max_prompts_per_call)

    def _score(self, ro, idx):
        """(task rewards float32[R], reasons) of rollout `ro` of prompts `idx`."""
        texts = self.tokenizer.decode_responses(ro.response_tokens, ro.response_mask)
        golds = [self.task.train[i].answer for i in idx for _ in range(self.G)]
        rewards, reasons = self.task.reward_fn(texts, golds)
        return np.asarray(rewards, np.float32), list(reasons)

    def _draw(self, idx, key, times: dict) -> dynamic_sampling.Draw:
        """Sample and score prompts `idx` with `key` (one draw of a step)."""
        t0 = time.perf_counter()
        ro = self._sample(idx, key)
        stats = dict(self.sampler.last_stats)
        t1 = time.perf_counter()
        rewards, reasons = self._score(ro, idx)
        if jax.process_count() > 1 and self.recipe.filter_groups:
            # Every process must keep the same groups and draw as often: process
            # 0's rewards decide (a verifier timeout can differ between hosts).
            from jax.experimental import multihost_utils
            rewards = np.asarray(multihost_utils.broadcast_one_to_all(rewards))
        times["time/rollout"] = times.get("time/rollout", 0.0) + t1 - t0
        times["time/reward"] = times.get("time/reward", 0.0) + time.perf_counter() - t1
        return dynamic_sampling.Draw(ro, np.asarray(idx), rewards, reasons, stats)

    def _rl_batch(self, step: int):
        """(batch, critic batch, metrics, times, rollout) of step `step`: the
        draws (dynamic sampling's, or one), the reference forward dispatched
        before the scoring where it can overlap it, and `assemble.build_batch`."""
        self._wait_for_compile(everything=False)
        cfg, G, rec = self.cfg, self.G, self.recipe
        ahead = self._next_indices
        first = self._draw_at(step)
        self._started = (step, first)   # a second call for the step draws the same
        idx = (ahead[1] if ahead is not None and ahead[0] == step
               else self.iterator.batch_at(first))
        key = rollout_key(self._rollout_seed, step)
        times = {"time/ref": 0.0}
        select = lambda draws: dynamic_sampling.select(
            draws, cfg.algo, batch_size=self.B, group_size=G, pad_id=self.tokenizer.pad_id,
            step=step)
        pending = None
        if rec.filter_groups:
            draws = dynamic_sampling.draw_step(
                lambda i, k: self._draw(i, k, times), self.iterator.batch_at, first, key,
                filter_groups=True, batch_size=self.B, group_size=G,
                limit=dynamic_sampling.max_draws(cfg.algo, self.iterator.batches_per_epoch),
                first_idx=idx)
            try:
                sel = select(draws)
            except dynamic_sampling.ShortBatch as e:
                raise self._stopped_short(step, e) from None
            self.iterator.step = first + len(draws)
            base = assemble.layout(sel, self.ref_cache, self.weights, G)
            pending = self._dispatch_reference(base, sel.rollout, times)
        else:
            # The reference forward is dispatched before the rewards and read
            # after them: the two overlap.
            self.iterator.step = first + 1
            t0 = time.perf_counter()
            ro = self._sample(idx, key)
            stats = dict(self.sampler.last_stats)
            times["time/rollout"] = time.perf_counter() - t0
            base = assemble.rollout_to_batch(ro, np.zeros(ro.response_tokens.shape[0],
                                                          np.float32), idx, self.ref_cache,
                                             self.weights, G)
            pending = self._dispatch_reference(base, ro, times)
            t0 = time.perf_counter()
            rewards, reasons = self._score(ro, idx)
            times["time/reward"] = time.perf_counter() - t0
            sel = select([dynamic_sampling.Draw(ro, np.asarray(idx), rewards, reasons, stats)])
        t0 = time.perf_counter()
        ref_logp = None if pending is None else to_host(pending)
        times["time/ref"] += time.perf_counter() - t0
        values_fn = None
        if rec.needs_critic:
            values_fn = lambda tok, m: to_host(self.values_fn(
                self.state.critic, *_put((tok, m), self.sharding)))
        out = assemble.build_batch(
            sel, cfg, rec, ref_cache=self.ref_cache, weights=self.weights,
            advantages_fn=self.advantages_fn, ref_logp=ref_logp,
            kl_coef=self.state.kl_coef if rec.adaptive_kl else None, values_fn=values_fn,
            query_group=self.programs.query_group, base=base)
        return out.batch, out.critic_batch, out.info, times, sel.rollout

    def _reference_params(self):
        """The reference's weights: the copy of the start, or with LoRA the
        current state's base (the same buffers as the policy's; the update
        donates the state, so they are read from it at each use)."""
        if self.model_cfg.lora_rank:
            return self.programs.reference_params(self.state.params)
        return self.ref_params

    def _dispatch_reference(self, base: RLBatch, ro, times: dict):
        """The reference's response log-probs of `base`'s rows, dispatched (a
        device array; None without Policy-KL)."""
        if not self.recipe.needs_ref_logp:
            return None
        t0 = time.perf_counter()
        out = self.ref_logp_fn(self._reference_params(), *_put((base.tokens, base.attn_mask),
                                                      self.sharding),
                               last=ro.response_tokens.shape[1])
        self.ref_forward_calls += 1
        times["time/ref"] += time.perf_counter() - t0
        return out

    def _stopped_short(self, step: int, e: Exception) -> Exception:
        """Dynamic sampling stopped step `step` short ('error'): the finished
        steps are saved first, so the run resumes where it stopped."""
        saved = ""
        if step > 0 and self.ckpt.latest_step() != step:
            self.iterator.step = self._draw_at(step)   # the step's first position
            self._save(step, force=True)
        if step > 0:
            saved = (f" Steps 1-{step} are saved in {self.ckpt.directory}; rerunning with the "
                     "change (and train.allow_config_change=true) resumes from there.")
        return dynamic_sampling.ShortBatch(f"{e}{saved}")

    def _update(self, batch: RLBatch, critic_batch, step: int) -> dict:
        self._wait_for_compile()
        o, G, B = self.cfg.optim, self.G, self.B
        rng = np.random.default_rng([self.cfg.train.seed, 3, step])
        per_mb = B // o.num_minibatches
        # Rows a term reads: a mini-batch of dynamic sampling's filler groups
        # only (no mask set) carries no signal and takes no optimizer step.
        live = np.asarray(batch.response_mask).any(-1) | np.asarray(batch.query_mask).any(-1)
        metrics, idle = [], 0
        for _ in range(o.epochs):
            order = rng.permutation(B)
            for k in range(o.num_minibatches):
                q = order[k * per_mb:(k + 1) * per_mb]
                rows = (q[:, None] * G + np.arange(G)[None, :]).reshape(-1)
                if not live[rows].any():
                    idle += 1
                    continue
                mb, cb = _put(jax.tree_util.tree_map(lambda x: np.asarray(x)[rows],
                                                     (batch, critic_batch)), self.sharding)
                self.state, m = self.update(self.state, mb, cb)
                metrics.append(m)
        # While the updates run: the next step's prompt indices (host work).
        self._next_indices = (step + 1, self.iterator.batch_at(self._draw_at(step + 1)))
        host = jax.device_get(metrics)   # every number of the step in one transfer
        if not host:
            return {"filter/idle_minibatches": float(idle)}
        counters = host[-1]
        self.nonfinite_in_a_row = int(counters["nonfinite_in_a_row"])
        out = {k: float(np.mean([h[k] for h in host])) for k in host[0]
               if k not in ("skipped_total", "nonfinite_in_a_row")}
        out["nonfinite_skipped_total"] = float(counters["skipped_total"])
        # The sampler/trainer mismatch from the step's first update: its first
        # pass runs the policy that sampled, so log r is exactly the mismatch.
        out.update({k: float(v) for k, v in host[0].items() if k.startswith("mismatch/")})
        if "kl_coef" in out:   # the coefficient the step started and ended with
            out["kl_coef"], out["kl_coef_next"] = (float(host[0]["kl_coef"]),
                                                   float(host[-1]["kl_coef_next"]))
        if idle:
            out["filter/idle_minibatches"] = float(idle)
        return out

    def drift(self, params=None) -> dict:
        """Query drift: QKL (k3, k1) of `params` (default: the current policy) on the
        held-out query set."""
        if self.drift_cache is None:
            raise RuntimeError("Trainer.drift needs the held-out queries' reference pass, made "
                               "at construction only when train.drift_every > 0.")
        prompts = self.drift_prompts
        width = ref_lib.bucket(max(len(p) for p in prompts))
        n = len(prompts)
        dp = self.sharding.data_size
        rows = -(-n // dp) * dp
        tokens = np.full((rows, width), self.tokenizer.pad_id, np.int32)
        mask = np.zeros((rows, width), bool)
        for i in range(rows):
            p = prompts[min(i, n - 1)]
            tokens[i, width - len(p):], mask[i, width - len(p):] = p, True
        qmask, _ = masks_from_layout(mask, width)
        idx = [min(i, n - 1) for i in range(rows)]
        ref = self.drift_cache.batch_layout(idx, width, width)
        params = self.state.params if params is None else params
        lp = to_host(self.t1_logp_fn(params, *_put((tokens, mask), self.sharding)))
        gid = jnp.asarray(idx, jnp.int32)
        args = (jnp.asarray(lp), jnp.asarray(ref), jnp.asarray(qmask), gid)
        return {"drift/qkl_k3": float(query_kl(*args, "k3")),
                "drift/qkl_k1": float(query_kl(*args, "k1"))}

    def _policy_kl_metric(self, batch: RLBatch) -> dict:
        from erpo_jax.rl.kl import kl_estimate
        tok, m = _put((batch.tokens, batch.attn_mask), self.sharding)
        last = self.sampler.sampling.max_new_tokens   # the response columns
        ref = jnp.asarray(to_host(self.ref_logp_fn(self._reference_params(), tok, m, last=last)))
        cur = jnp.asarray(to_host(self.programs.policy_logp_fn(self.state.params, tok, m,
                                                               last=last)))
        rm = jnp.asarray(batch.response_mask)
        k = kl_estimate(cur, ref, "k3", rm)
        return {"drift/policy_kl_k3": float(jnp.sum(k) / jnp.maximum(jnp.sum(rm), 1))}

    # ------------------------------------------------------------------ the loop

    def _on_sigterm(self, signum, frame):
        self._stop = True

    def _agreed_stop(self) -> bool:
        """True when any process got SIGTERM: all must save the same step together."""
        if jax.process_count() == 1:
            return self._stop
        from jax.experimental import multihost_utils
        flags = multihost_utils.process_allgather(np.asarray([self._stop], np.int32))
        return bool(np.any(flags))

    def run(self, on_step=None) -> dict:
        """Train from the current step to train.steps.

        on_step: optional callback(step, metrics_row) after each step's metrics
        are written (custom logging, or a test that interrupts the run).
        Returns {'status': 'done' | 'preempted', 'step', 'eval', 'ref_forward_calls'}.
        """
        t, cfg = self.cfg.train, self.cfg
        old = signal.signal(signal.SIGTERM, self._on_sigterm) if _main_thread() else None
        bar = None
        if t.progress and self.primary:
            bar = progress_bar(t.steps, self.start_step, desc=cfg.name)
        last_eval = None
        try:
            if self.start_step == 0 and t.eval_every > 0:
                last_eval = self._evaluate(0)
            for step in range(self.start_step, t.steps):
                t_start = time.perf_counter()
                batch, cb, info, times, ro = self._rl_batch(step)
                t0 = time.perf_counter()
                upd = self._update(batch, cb, step)
                times["time/update"] = time.perf_counter() - t0
                done = step + 1
                row = {**info, **upd, **times}
                n_tok = float(np.sum(ro.lengths) + ro.prompt_mask.sum())
                row["tokens_per_sec"] = n_tok / max(time.perf_counter() - t_start, 1e-9)
                if t.drift_every > 0 and done % t.drift_every == 0:
                    row.update({**self.drift(), **self.drift_floor})
                    if t.policy_kl_metric:
                        row.update(self._policy_kl_metric(batch))
                row = self.writer.write(done, row)
                if on_step is not None:
                    on_step(done, row)
                self._last_drift = row.get("drift/qkl_k3", self._last_drift)
                if bar is not None:
                    shown = {"reward": f"{row['reward_mean']:.3f}", "acc": f"{row['accuracy']:.3f}"}
                    if not np.isnan(self._last_drift):   # the last measured value, once there is one
                        shown["drift"] = f"{self._last_drift:.4f}"
                    bar.set_postfix(**shown)
                    bar.update(1)
                if self.nonfinite_in_a_row >= t.max_nonfinite:
                    raise FloatingPointError(
                        f"{self.nonfinite_in_a_row} consecutive updates had a non-finite loss or "
                        f"gradient (limit train.max_nonfinite={t.max_nonfinite}); parameters were "
                        f"left untouched by each. {_nonfinite_cause(row, cfg.loss)}")
                if t.eval_every > 0 and (done % t.eval_every == 0 or done == t.steps):
                    last_eval = self._evaluate(done)
                stop = self._agreed_stop()
                self._save(done, force=stop or done == t.steps)
                if stop:
                    raise Preempted()
        except Preempted:
            if self.primary:
                print(f"SIGTERM: saved step {self.ckpt.latest_step()} in {self.ckpt.directory}; "
                      f"to resume, run the same command again: {resume_command()}", flush=True)
            return {"status": "preempted", "step": self.ckpt.latest_step(),
                    "ref_forward_calls": self.ref_forward_calls}
        finally:
            if bar is not None:
                bar.close()
            if old is not None:
                signal.signal(signal.SIGTERM, old)
            self.writer.close()
        model_dir = self.export()
        return {"status": "done", "step": t.steps, "eval": last_eval,
                "ref_forward_calls": self.ref_forward_calls, "model_dir": model_dir}

    def export(self) -> str:
        """The current policy as a Hugging Face directory `<out_dir>/model`
        (weights, config.json, tokenizer, generation_config.json; an HF starting
        model keeps its own config.json), local or gs://. With LoRA that is the
        merged model, and `<out_dir>/adapter` holds the adapters in PEFT's
        format (adapter_config.json, adapter_model.safetensors)."""
        out = self.run_dir / MODEL_SUBDIR
        params = to_host(self.state.params)   # every process joins the gather
        if self.primary:
            try:
                export_policy(params, self.model_cfg, self.tokenizer, self.cfg, out)
                if self.model_cfg.lora_rank:   # and the adapters as PEFT loads them
                    export_adapter(params, self.model_cfg, self.cfg, self.run_dir / ADAPTER_SUBDIR)
            except OSError as e:
                raise OSError(e.errno, f"exporting the final policy to {out} failed "
                              f"({e.strerror or e}); the checkpoint of step {self.cfg.train.steps} "
                              "holds it, and rerunning the same command exports it again") from e
        return str(out)

    def _save(self, step: int, force: bool = False) -> None:
        meta = {"step": step, "seed_key": ckpt_lib.key_to_list(self.seed_key),
                "data": self.iterator.get_state()}
        if self.model_cfg.lora_rank:
            meta["base_hash"] = self.base_hash
        try:
            self.ckpt.save(step, self._checkpointed(self.state), meta, force=force)
        except Exception as e:  # noqa: BLE001 - one sentence instead of orbax's traceback
            raise ckpt_lib.SaveFailed(self.ckpt.directory, step, self.ckpt.latest_step(), e) \
                from None

    def _evaluate(self, step: int) -> dict:
        res = self.evaluator.evaluate(self.state.params, jax.random.fold_in(self.seed_key, 2),
                                      step)
        if self.primary:
            write_eval(self.run_dir, res)
        return res

    def close(self) -> None:
        """Release what was built (also of a half-built Trainer whose constructor raised)."""
        self._wait_for_compile()
        for part in ("task", "ckpt", "lock"):
            if getattr(self, part, None) is not None:
                getattr(self, part).close()


def _no_effect(cfg: RunConfig) -> list[str]:
    """Settings that can have no effect in this config (start-up warnings)."""
    o, lc = cfg.optim, cfg.loss
    out = []
    on_policy = o.epochs == 1 and o.num_minibatches == 1
    default = LossConfigDefaults
    if on_policy and lc.pg_loss != "kl_cov" and (lc.eps_low, lc.eps_high) != (
            default.eps_low, default.eps_high):
        out.append(f"loss.eps_low={lc.eps_low:g} / loss.eps_high={lc.eps_high:g} clip the "
                   "ratio to the sampling policy, which is 1 (to rounding) with one epoch of "
                   "one mini-batch: the clip never acts; set optim.num_minibatches or "
                   "optim.epochs above 1 for it to")
    if on_policy and lc.pg_loss == "kl_cov":
        out.append("loss.pg_loss=kl_cov penalises |log r|, which is 0 (to rounding) with one "
                   "epoch of one mini-batch: it acts as plain -A r; set optim.num_minibatches "
                   "or optim.epochs above 1 for it to act")
    return out


def _nonfinite_cause(row: dict, loss_cfg) -> str:
    """What to change after non-finite updates: the terms whose value was
    non-finite and their coefficients, else the learning rate or the data."""
    from erpo_jax.rl.terms import TERMS
    bad = []
    for name, term in TERMS.items():
        v = row.get(f"term_{name}")
        if v is not None and not np.isfinite(v):
            coef = (f" (loss.{term.coef}={getattr(loss_cfg, term.coef):g})"
                    if term.coef is not None else "")
            bad.append(f"term {name} is {v}{coef}")
    if not bad:
        return "Lower optim.lr or check the data."
    return ("The loss's " + ", ".join(bad) + ": lower that coefficient (a finite loss needs "
            "finite terms), or lower optim.lr.")


def _saved_config(data: dict | None) -> RunConfig | None:
    """The method-resolved RunConfig of a run's recorded config.json (None
    when there is none or it no longer reads as a config)."""
    if data is None:
        return None
    from erpo_jax.train.config import from_dict
    from erpo_jax.train.methods import resolve_method
    try:
        return resolve_method(from_dict(RunConfig, normalized(data)))
    except (TypeError, ValueError):
        return None


def _main_thread() -> bool:
    import threading
    return threading.current_thread() is threading.main_thread()


def train(cfg: RunConfig, on_step=None) -> dict[str, Any]:
    trainer = Trainer(cfg)
    try:
        return trainer.run(on_step)
    finally:
        trainer.close()
