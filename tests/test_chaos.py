"""Chaos: K interruptions of a short `erpo train` (SIGTERM or SIGKILL at a
uniformly random moment, some during start-up, and every third trial during a
checkpoint save), each followed by a rerun of the same command. Every rerun
must exit 0 with metrics and evaluations holding each step exactly once, with
the values of an uninterrupted run (timings aside), and the same final
parameters.

K is 2 in the default suite; ERPO_JAX_CHAOS_K=20 runs more, and
ERPO_JAX_CHAOS_SEED=<seed> replays a printed seed:

    ERPO_JAX_CHAOS_K=20 python -m pytest tests/test_chaos.py -s
"""

import os
import random
import signal
import subprocess
import sys
import time

import numpy as np

from erpo_jax.runtime import rundir

K = int(os.environ.get("ERPO_JAX_CHAOS_K", "2"))
SEED = int(os.environ.get("ERPO_JAX_CHAOS_SEED", str(random.SystemRandom().randrange(10**6))))
STEPS = 6

ARGS = ["model.init=random", "model.preset=tiny", "data.n_train=64", "data.n_test=4",
        "rollout.group_size=2", "rollout.max_new_tokens=8", "train.batch_size=8",
        f"train.steps={STEPS}", "train.ckpt_every=2", "train.eval_every=3",
        "train.drift_every=0", "train.progress=false", "train.eval_max_problems=4",
        "optim.lr=1e-3", "train.tensorboard=false"]


def _start(run, cache):
    args = [sys.executable, "-m", "erpo_jax.cli", "train", *ARGS, f"train.out_dir={run}",
            f"train.ref_cache_dir={run / 'refcache'}", f"train.compile_cache={cache}"]
    log = open(run.parent / f"{run.name}.log", "ab")
    env = dict(os.environ, PYTHONPATH=os.getcwd())
    return subprocess.Popen(args, stdout=log, stderr=log, env=env, cwd=os.getcwd())


def _finish(run, cache) -> int:
    run.mkdir(parents=True, exist_ok=True)
    return _start(run, cache).wait(timeout=600)


def _comparable(row):
    return {k: v for k, v in row.items() if not (k.startswith("time/") or k == "tokens_per_sec")}


def _params(run):
    import jax
    import orbax.checkpoint as ocp
    from erpo_jax.train.checkpoint import Checkpointer
    ck = Checkpointer(run / "checkpoints")
    try:
        step = ck.latest_step()
        out = ck.manager.restore(step, args=ocp.args.Composite(state=ocp.args.StandardRestore()))
    finally:
        ck.close()
    return step, [np.asarray(x) for x in jax.tree_util.tree_leaves(out["state"].params
                                                                    if hasattr(out["state"], "params")
                                                                    else out["state"]["params"])]


def _problems(run, ref) -> list[str]:
    out = []
    m = rundir.read_jsonl(run / "metrics.jsonl")
    if [r["step"] for r in m] != list(range(1, STEPS + 1)):
        out.append(f"metrics steps {[r['step'] for r in m]}")
    elif [_comparable(r) for r in m] != [_comparable(r) for r in ref["metrics"]]:
        out.append("metrics values differ from the uninterrupted run")
    e = rundir.read_jsonl(run / "evals.jsonl")
    if e != ref["evals"]:
        out.append(f"evals steps {[r['step'] for r in e]} (or values) differ")
    step, params = _params(run)
    if step != STEPS or len(params) != len(ref["params"]) or any(
            not np.array_equal(a, b) for a, b in zip(params, ref["params"])):
        out.append(f"final checkpoint (step {step}) differs")
    return out


def _interrupt(proc, run, rng, mode, sig, budget):
    """Wait, then send `sig`; returns a description of when it struck."""
    t0 = time.perf_counter()
    if mode == "save":   # the moment orbax has a temporary checkpoint directory open
        ckpts = run / "checkpoints"
        while proc.poll() is None and time.perf_counter() - t0 < budget[0] * 3:
            if ckpts.is_dir() and any("tmp" in p.name for p in ckpts.iterdir()):
                proc.send_signal(sig)
                return f"during a save at {time.perf_counter() - t0:.2f}s"
            time.sleep(0.002)
        return "missed the save (the run ended first)"
    at = rng.uniform(0, budget[0])
    try:
        proc.wait(timeout=at)
        budget[0] = time.perf_counter() - t0   # a whole run from the compilation cache
        return f"after the end ({at:.2f}s; the run took {budget[0]:.2f}s)"
    except subprocess.TimeoutExpired:
        proc.send_signal(sig)
        return f"at {at:.2f}s"


def test_random_interruptions_then_rerun_lose_and_duplicate_nothing(tmp_path):
    print(f"\n[chaos] seed {SEED}, K={K} (replay: ERPO_JAX_CHAOS_SEED={SEED} "
          f"ERPO_JAX_CHAOS_K={K})", flush=True)
    cache = tmp_path / "xla-cache"
    ref_dir = tmp_path / "reference"
    t0 = time.perf_counter()
    assert _finish(ref_dir, cache) == 0, (tmp_path / "reference.log").read_text()[-3000:]
    # Interruptions fall uniformly in [0, budget]: the uninterrupted run's time,
    # compilation included; once a trial's run ends before its interruption (it
    # loaded the programs from the cache), that run's time.
    budget = [time.perf_counter() - t0]
    ref = {"metrics": rundir.read_jsonl(ref_dir / "metrics.jsonl"),
           "evals": rundir.read_jsonl(ref_dir / "evals.jsonl"), "params": _params(ref_dir)[1]}
    rng = random.Random(SEED)
    results = []
    for i in range(K):
        mode = "save" if i % 3 == 2 else "random"
        sig = rng.choice([signal.SIGTERM, signal.SIGKILL])
        run = tmp_path / f"trial{i}"
        run.mkdir()
        proc = _start(run, cache)
        when = _interrupt(proc, run, rng, mode, sig, budget)
        rc1 = proc.wait(timeout=600)
        rc2 = _finish(run, cache)
        problems = [] if rc2 == 0 else [f"rerun rc {rc2}"]
        if rc2 == 0:
            problems = _problems(run, ref)
        results.append(problems)
        print(f"[chaos] trial {i}: {signal.Signals(sig).name} {when}, rc {rc1}, rerun rc {rc2}: "
              f"{'clean' if not problems else '; '.join(problems)}", flush=True)
    clean = sum(not p for p in results)
    print(f"[chaos] {clean}/{K} clean trials (seed {SEED})", flush=True)
    assert clean == K, f"seed {SEED}: {K - clean} of {K} trials failed; logs in {tmp_path}"
