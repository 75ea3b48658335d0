"""Mutation check: break one property at a time in a copy of the code and run
the tests that claim to guard it. Not part of the default suite.

    python -m tests.mutations               # every mutation (tens of minutes on 2 cores)
    python -m tests.mutations --only pg_sign,grpo_batch_std
    python -m tests.mutations --list
    python -m tests.mutations --baseline    # first check the guards pass unmutated

Each mutation replaces one exact piece of source text (it must occur exactly
once, else the mutation is reported `stale`: the code moved and the entry
needs updating). A mutation is `killed` when its guarding tests fail, and
`SURVIVED` when they pass. The programs that no mutation touches are shared
between runs through one persistent compilation cache.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PG = "tests/test_pg_path.py::"
PG_WIRING = PG + "test_rewards_vary_within_groups_and_become_the_advantages"
PG_SIGN = PG + "test_update_raises_the_log_prob_of_the_rewarded_responses"
PG_QKL = PG + "test_update_gradient_carries_the_query_kl_term"
PG_WEIGHTS = PG + "test_pg_term_scales_with_the_query_weights"
RESUME = "tests/test_train.py::test_sigterm_resume_is_bit_identical"


@dataclass(frozen=True)
class Mutation:
    name: str
    what: str
    path: str
    old: str
    new: str
    guards: tuple[str, ...]


MUTATIONS = [
    Mutation("pg_sign", "the trainer negates the advantages", "erpo_jax/train/loop.py",
             "batch = batch._replace(advantages=np.asarray(adv, np.float32)",
             "batch = batch._replace(advantages=-np.asarray(adv, np.float32)", (PG_SIGN,)),
    Mutation("weights_ignored", "the trainer's batches carry weight 1 for every query",
             "erpo_jax/train/loop.py",
             "query_weight=np.asarray(weights, np.float32)[rows_query]",
             "query_weight=np.ones(len(rows_query), np.float32)", (PG_WEIGHTS,)),
    Mutation("weights_uniform_at_start", "the trainer's query weights are all 1",
             "erpo_jax/train/loop.py",
             "self.weights = self.ref_cache.weights(",
             "self.weights = 1 + 0 * self.ref_cache.weights(", (PG_WIRING,)),
    Mutation("resume_from_scratch", "on resume, ignore the checkpoint and retrain from step 0",
             "erpo_jax/train/loop.py", "self._latest = latest = self.ckpt.latest_step()",
             "self._latest = latest = None",
             (RESUME,)),
    Mutation("resume_loses_data_position", "on resume, the data iterator's position is not "
             "restored", "erpo_jax/train/loop.py", "self.iterator.set_state(meta[\"data\"])",
             "pass", (RESUME,)),
    Mutation("grpo_batch_std", "GRPO divides by the batch std, not each group's",
             "erpo_jax/rl/advantages.py",
             "std = jnp.sqrt(jnp.sum(c * c, axis=-1, keepdims=True) / max(G - 1, 1))",
             "std = jnp.sqrt(jnp.sum(c * c) / max(c.size - 1, 1))", ("tests/test_advantages.py",)),
    Mutation("rope_mid_band_unscaled", "the Llama-3 RoPE middle frequency band left unscaled",
             "erpo_jax/model/model.py", "inv = jnp.where(is_mid, mid, scaled)", "inv = scaled",
             ("tests/test_model.py",)),
    Mutation("update_drops_query_kl", "the update drops the Query-KL term",
             "erpo_jax/train/train_step.py",
             "loss = sum(shares[k] * terms[k] for k in terms)",
             "loss = sum(shares[k] * terms[k] for k in terms if k != \"query_kl\")", (PG_QKL,)),
    Mutation("micro_batch_equal_shares", "micro-batches weighted equally, not by their share "
             "of each term's normaliser", "erpo_jax/train/train_step.py",
             "shares = {k: cnt[k] / totals[k] for k in cnt}",
             "shares = {k: 1.0 / n_micro for k in cnt}",
             ("tests/test_train.py::test_micro_batch_accumulation_is_exact",)),
    Mutation("loss_ignores_query_weight", "the PG surrogate is not multiplied by the weight",
             "erpo_jax/rl/terms/pg.py",
             "per_token = per_token * f32(batch.query_weight)[:, None]",
             "per_token = per_token", ("tests/test_loss.py",)),
    Mutation("no_ratio_clip", "the PG ratio is never clipped",
             "erpo_jax/rl/policy_losses/base.py",
             "pg = jnp.maximum(pg_unclipped, pg_clipped)", "pg = pg_unclipped",
             ("tests/test_loss.py",)),
    Mutation("clip_cov_keeps_gradient", "Clip-Cov's chosen tokens keep their gradient",
             "erpo_jax/rl/policy_losses/clip_cov.py", "pg = jnp.where(chosen, 0.0, pg)",
             "pg = jnp.where(chosen, jax.lax.stop_gradient(pg), pg)",
             ("tests/test_loss_terms.py",)),
    Mutation("kl_cov_bottom_k", "KL-Cov penalises the lowest-covariance tokens",
             "erpo_jax/rl/policy_losses/kl_cov.py", "jnp.where(rm, -cov, jnp.inf)",
             "jnp.where(rm, cov, jnp.inf)", ("tests/test_loss_terms.py",)),
    Mutation("kl_control_unclipped", "the adaptive KL controller's error is not clipped",
             "erpo_jax/rl/kl_control.py",
             "error = jnp.clip(jnp.asarray(kl, jnp.float32) / target - 1.0, -ERROR_CLIP, ERROR_CLIP)",
             "error = jnp.asarray(kl, jnp.float32) / target - 1.0",
             ("tests/test_stabilizers.py::test_the_controller_is_the_proportional_rule_with_its_clip",)),
    Mutation("filter_keeps_flat_groups", "dynamic sampling keeps groups whose rewards agree",
             "erpo_jax/rl/dynamic_sampling.py", "return r.max(axis=1) != r.min(axis=1)",
             "return np.ones(len(r), bool)", ("tests/test_stabilizers.py",)),
    Mutation("k3_is_k2", "the k3 KL estimator computes k2", "erpo_jax/rl/kl.py",
             "return jnp.expm1(d) - d", "return 0.5 * jnp.square(d)", ("tests/test_kl.py",)),
    Mutation("decode_gathers_weights", "a decode step runs under the training (FSDP) rules",
             "erpo_jax/rollout/static.py",
             "stationary = model_lib.decode_sharding(cfg, sharding)",
             "stationary = sharding",
             ("tests/test_sampler.py::test_decode_step_moves_activations_not_weights",)),
    Mutation("insert_gathers_weights", "an insert's prefill runs under the training (FSDP) rules",
             "erpo_jax/rollout/continuous.py",
             "sharding=model_lib.decode_sharding(cfg, sh))", "sharding=sh)",
             ("tests/test_engines.py::test_continuous_decode_moves_activations_not_weights",)),
    Mutation("prefill_first_columns", "an insert prefills its rows' first T columns, not the last",
             "erpo_jax/rollout/continuous.py",
             "tokens[rows, P - T:], mask[rows, P - T:]", "tokens[rows, :T], mask[rows, :T]",
             ("tests/test_paged_engine.py::"
              "test_inserts_prefill_at_the_shortest_length_holding_their_prompts",)),
    Mutation("paged_shrink_across_shards", "the paged pool halves by its live slots alone, "
             "moving slots to another shard's pages", "erpo_jax/rollout/paged.py",
             "    per = live.size // shards\n",
             "    if live.sum() <= live.size // 2:\n        return np.concatenate("
             "[np.flatnonzero(live), np.flatnonzero(~live)])[:live.size // 2]\n"
             "    per = live.size // shards\n",
             ("tests/test_paged_engine.py::"
              "test_the_pool_drains_shard_by_shard_and_draws_the_same_samples",)),
    Mutation("weights_not_unit_mean", "per-query weights are not rescaled to mean 1",
             "erpo_jax/rl/weights.py", "w = raw / raw.mean()", "w = raw",
             ("tests/test_weights.py",)),
]


def _copy_repo(dst: Path) -> None:
    """The working tree's tracked and untracked, not ignored, files."""
    files = subprocess.run(["git", "ls-files", "-co", "--exclude-standard", "-z"], cwd=REPO,
                           capture_output=True, check=True).stdout.decode().split("\0")
    for f in filter(None, files):
        src = REPO / f
        if src.is_file():
            (dst / f).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, dst / f)


def _run_guards(root: Path, guards, env, timeout: float) -> tuple[str, float, str]:
    t0 = time.perf_counter()
    cmd = [sys.executable, "-m", "pytest", *guards, "-x", "-q", "-p", "no:cacheprovider"]
    try:
        r = subprocess.run(cmd, cwd=root, env=env, capture_output=True, text=True,
                           timeout=timeout)
    except subprocess.TimeoutExpired:
        return "timeout", time.perf_counter() - t0, ""
    lines = (r.stdout + r.stderr).strip().splitlines()
    tail = [x for x in lines if x.startswith(("FAILED", "ERROR"))] or lines[-1:]
    # pytest: 1 = tests failed; anything else but 0 (interrupted, usage or
    # internal error, no tests, a signal) says nothing about the mutation.
    status = {0: "passed", 1: "failed"}.get(r.returncode, f"error (rc {r.returncode})")
    return status, time.perf_counter() - t0, tail[0][:160] if tail else ""


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--only", default="", help="comma-separated mutation names")
    ap.add_argument("--list", action="store_true")
    ap.add_argument("--baseline", action="store_true",
                    help="first run every selected guard on the unmutated copy")
    ap.add_argument("--timeout", type=float, default=1200.0, help="seconds per run")
    args = ap.parse_args(argv)
    chosen = [m for m in MUTATIONS if not args.only or m.name in args.only.split(",")]
    if args.list or not chosen:
        for m in MUTATIONS:
            print(f"{m.name:28s} {m.what}  [{' '.join(m.guards)}]")
        return 0 if chosen else 2
    work = Path(tempfile.mkdtemp(prefix="erpo-mutations-"))
    env = dict(os.environ, PYTHONPATH=str(work / "repo"),
               ERPO_JAX_TEST_XLA_CACHE=str(work / "xla-cache"))
    bench = REPO.parent / "shared" / "data" / "benchmarks"
    if "ERPO_BENCHMARKS_DIR" not in env and bench.is_dir():
        env["ERPO_BENCHMARKS_DIR"] = str(bench)   # the copy does not sit beside shared/
    root = work / "repo"
    _copy_repo(root)
    rows, bad = [], 0
    try:
        if args.baseline:
            guards = sorted({g for m in chosen for g in m.guards})
            status, secs, tail = _run_guards(root, guards, env, args.timeout * 2)
            print(f"baseline: {status} in {secs:.0f} s ({tail})", flush=True)
            if status != "passed":
                return 1
        for m in chosen:
            f = root / m.path
            text = f.read_text()
            n = text.count(m.old)
            if n != 1:
                rows.append((m, "stale", 0.0, f"the text occurs {n} times in {m.path}"))
            else:
                f.write_text(text.replace(m.old, m.new))
                try:
                    status, secs, tail = _run_guards(root, m.guards, env, args.timeout)
                finally:
                    f.write_text(text)
                verdict = {"failed": "killed", "passed": "SURVIVED"}.get(status, status)
                rows.append((m, verdict, secs, tail))
            _, verdict, secs, tail = rows[-1]
            bad += verdict != "killed"
            print(f"{m.name:28s} {verdict:9s} {secs:6.0f} s  {tail}", flush=True)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    print("\n| mutation | guarding tests | result |\n|---|---|---|")
    for m, verdict, _, _ in rows:
        print(f"| {m.what} (`{m.name}`) | {', '.join(f'`{g}`' for g in m.guards)} | {verdict} |")
    print(f"\n{len(rows) - bad} of {len(rows)} killed.")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
