"""`erpo bench --peer tunix`: the RL iteration of google-tunix 0.1.7 and of the
Trainer on the same configs, interleaved and repeated in one run.

The peer is `../shared/peers/tunix_grpo.py` run in its own venv
(`../shared/peers/setup_tunix.sh` makes it; `$TUNIX_VENV` overrides where).
Both sides run in fresh processes, one at a time, alternating which goes first,
on the same configs:

  tiny : Qwen3-style (q/k norm, tied embeddings), 2 layers, vocab 256, embed 64,
         MLP 128, 4 heads / 2 KV heads, head_dim 16; 8 prompts x 4 samples,
         32 prompt + 32 new tokens.
  small: 4 layers, vocab 8192, embed 256, MLP 1024, 8 heads / 4 KV heads,
         head_dim 32; 16 prompts x 8 samples, 64 prompt + 128 new tokens.

Both: GRPO, beta 0.04 with the reference forward every step, AdamW(1e-3,
weight decay 1e-4, no clipping), temperature 0.9, top-k 50, one optimizer step
per rollout (erpo-jax runs the small config's update in 4 micro-batches: the
same optimizer step; see CONFIGS). Iteration time is the whole synchronous iteration (rollout,
reward, reference, update); the steady value of one process is the median of
its iterations from the third on (the peer script's own steady mean also skips
two). Each repetition gives one ratio erpo-jax / tunix; the report carries the
median and the range over repetitions, and the update's MFU against the
matmul peak measured in the same run.
"""

from __future__ import annotations

import json
import math
import os
import statistics
import subprocess
import sys
from pathlib import Path

from erpo_jax.model.config import PRESETS

# name -> (our preset, prompts, group, prompt_len, new_tokens); the peer script's SIZES.
# micro_batches is how erpo-jax runs the same update (optim.micro_batches: the
# gradient summed over equal row chunks, one optimizer step): the small
# config's 128 rows x 192 tokens in one piece need 6.9 GiB of temporaries, which
# glibc maps afresh and faults in page by page on every call; in 4 chunks of 32
# rows they are 1.8 GiB, kept between calls (see runtime/host_malloc.py).
CONFIGS = {
    "tiny": dict(preset="peer-tiny", prompts=8, group=4, prompt_len=32, new_tokens=32,
                 micro_batches=1),
    "small": dict(preset="peer-small", prompts=16, group=8, prompt_len=64, new_tokens=128,
                  micro_batches=4),
    # The small shapes with 256 new tokens and EOS-varied lengths: both sides add
    # VARIED_EOS_BIAS to the EOS logit of a near-uniform random model, with no
    # top-k, so a response ends at EOS with probability about 4 / 256 per step
    # (tunix: `tunix_varied.py`; erpo-jax: `bench_trainer(eos_bias=...)`, the
    # continuous engine).
    "varied": dict(preset="peer-small", prompts=16, group=8, prompt_len=64, new_tokens=256,
                   micro_batches=4),
}
# exp(bias / temperature) = 4 (V - 1) / N at V = 8192, N = 256, temperature 0.9.
VARIED_EOS_BIAS = round(0.9 * math.log(4 * 8191 / 256), 3)
VARIED = dict(top_k=0, engine="continuous", eos_bias=VARIED_EOS_BIAS)
# What the peer script fixes, applied to the Trainer's config.
MATCH = dict(beta_policy=0.04, temperature=0.9, top_k=50,
             optim=dict(lr=1e-3, weight_decay=1e-4, max_grad_norm=0.0))
STEADY_FROM = 2
_WALL_LINE = "per-iteration wall (s):"

_OURS = """
import json, sys
from erpo_jax.tools import bench
r = bench.rl_iteration(**json.loads(sys.argv[1]))
print("RESULT " + json.dumps(r))
"""


REPO = Path(__file__).resolve().parents[3]   # the checkout (this is erpo_jax/tools/bench/peer.py)


def default_paths() -> tuple[Path, Path]:
    """(peer script, peer venv's python): `$ERPO_PEERS_DIR` or ../shared/peers beside
    the checkout, and `$TUNIX_VENV` or the place setup_tunix.sh uses."""
    peers = Path(os.environ.get("ERPO_PEERS_DIR", REPO.parent / "shared" / "peers"))
    venv = Path(os.environ.get("TUNIX_VENV",
                               Path.home() / ".cache" / "erpo-peers" / "tunix-venv"))
    return peers / "tunix_grpo.py", venv / "bin" / "python"


def missing_peer(script: Path, python: Path) -> str | None:
    """Why the peer cannot run (a sentence saying how to fix it), or None."""
    if not script.is_file():
        return (f"the peer script {script} is missing; set ERPO_PEERS_DIR to the folder "
                "holding tunix_grpo.py")
    if not python.is_file():
        return (f"the peer's venv is missing ({python.parent.parent}); make it with "
                f"`bash {script.parent / 'setup_tunix.sh'}` (about a minute, 1.6 GB), "
                "or set TUNIX_VENV to an existing one")
    return None


def _clean_env(**extra) -> dict:
    """This process's environment without what would change the child's devices or
    imports (the test suite's fake devices, our PYTHONPATH)."""
    env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "PYTHONPATH")}
    env.update(JAX_PLATFORMS="cpu", **extra)
    return env


def steady(iter_s: list[float]) -> float:
    return statistics.median(iter_s[STEADY_FROM:] or iter_s)


def parse_peer(stdout: str) -> list[float]:
    """The per-iteration wall times the peer script prints (a JSON-shaped list)."""
    for line in stdout.splitlines():
        if line.startswith(_WALL_LINE):
            return [float(x) for x in json.loads(line[len(_WALL_LINE):])]
    raise RuntimeError(f"bench --peer: no '{_WALL_LINE}' line in the peer's output:\n"
                       f"{stdout[-2000:]}")


def run_peer(size: str, iters: int, script: Path, python: Path, timeout: float = 1800) -> dict:
    if size == "varied":
        cmd = [str(python), str(Path(__file__).with_name("tunix_varied.py")), str(script),
               str(iters)]
        env = _clean_env(PEER_EOS_BIAS=str(VARIED_EOS_BIAS),
                         PEER_NEW_TOKENS=str(CONFIGS[size]["new_tokens"]))
    else:
        cmd, env = [str(python), str(script), str(iters)], _clean_env(PEER_SIZE=size)
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env)
    if proc.returncode:
        raise RuntimeError(f"bench --peer: tunix ({size}) exited {proc.returncode}:\n"
                           f"{proc.stderr[-3000:]}")
    it = parse_peer(proc.stdout)
    return {"iter_s": it, "steady_s": steady(it)}


def run_ours(size: str, iters: int, timeout: float = 1800, share_query: bool = True) -> dict:
    spec = {**CONFIGS[size], **MATCH, **(VARIED if size == "varied" else {}), "name": size,
            "iters": iters, "mesh": (1, 1, 1), "share_query": share_query}
    repo = str(REPO)
    proc = subprocess.run([sys.executable, "-c", _OURS, json.dumps(spec)], capture_output=True,
                          text=True, timeout=timeout,
                          env=_clean_env(PYTHONPATH=repo, ERPO_JAX_COMPILE_CACHE="off"))
    lines = [x for x in proc.stdout.splitlines() if x.startswith("RESULT ")]
    if proc.returncode or not lines:
        raise RuntimeError(f"bench --peer: erpo-jax ({size}) exited {proc.returncode}:\n"
                           f"{proc.stderr[-3000:]}")
    r = json.loads(lines[-1][len("RESULT "):])
    return {"iter_s": r["iter_s"], "steady_s": steady(r["iter_s"]),
            "update_s": statistics.median(p["time/update"] for p in r["parts"][STEADY_FROM:]
                                          or r["parts"]),
            "breakdown_s": r["steady_breakdown_s"]}


def update_flops(size: str, share_query: bool = True) -> float:
    """The FLOPs the update executes on config `size`: with share_query each
    group's query runs once (what the Trainer does by default)."""
    from erpo_jax.tools.bench.step import model_flops_per_step
    c = CONFIGS[size]
    group = c["group"] if share_query else 1
    return model_flops_per_step(PRESETS[c["preset"]], c["prompts"] * c["group"],
                                c["prompt_len"] + c["new_tokens"], group, c["prompt_len"])


def compare(sizes=("tiny", "small"), reps: int = 3, iters: int = 6, peak_flops: float | None = None,
            paths: tuple[Path, Path] | None = None, say=print, share_query: bool = True) -> dict:
    """Interleaved repetitions of both sides per size; ratios = ours / peer per repetition.
    share_query: the Trainer's model.share_query (each group's query run once
    in the update and the reference forward; off = every row whole, as the
    peer does)."""
    script, python = paths or default_paths()
    why = missing_peer(script, python)
    if why:
        say(f"bench --peer: {why}; running erpo-jax alone (no ratios).")
    out = {"peer": "google-tunix 0.1.7", "script": str(script), "reps": reps, "iters": iters,
           "steady_from_iteration": STEADY_FROM, "peer_missing": why, "share_query": share_query,
           "configs": {}}
    for size in sizes:
        ours, peer = [], []
        for rep in range(reps):
            order = ("ours", "peer") if rep % 2 == 0 else ("peer", "ours")
            for side in order:
                if side == "peer" and why:
                    continue
                say(f"  {size} rep {rep + 1}/{reps}: {'erpo-jax' if side == 'ours' else 'tunix'}")
                if side == "ours":
                    ours.append(run_ours(size, iters, share_query=share_query))
                else:
                    peer.append(run_peer(size, iters, script, python))
        row = {**CONFIGS[size], "ours": ours, "peer": peer,
               "ours_steady_s": statistics.median(x["steady_s"] for x in ours)}
        if peer:
            ratios = [o["steady_s"] / p["steady_s"] for o, p in zip(ours, peer)]
            row.update(peer_steady_s=statistics.median(x["steady_s"] for x in peer),
                       ratios=ratios, ratio=statistics.median(ratios),
                       ratio_min=min(ratios), ratio_max=max(ratios))
        if peak_flops:
            flops = update_flops(size, share_query)
            upd = statistics.median(x["update_s"] for x in ours)
            row.update(update_flops=flops, update_s=upd, update_mfu=flops / upd / peak_flops)
        out["configs"][size] = row
    return out


def print_table(res: dict) -> None:
    print(f"\nRL iteration vs {res['peer']} (same configs, fresh processes, interleaved; "
          f"{res['reps']} repetitions x {res['iters']} iterations, steady = median from "
          f"iteration {res['steady_from_iteration'] + 1}; erpo-jax with model.share_query="
          f"{'on' if res.get('share_query', True) else 'off'}, update MFU on the FLOPs it "
          "executes)")
    print(f"{'config':<8}{'erpo-jax s':>12}{'tunix s':>10}{'ratio':>8}{'range':>16}"
          f"{'update s':>10}{'update MFU':>12}")
    for size, r in res["configs"].items():
        peer = f"{r['peer_steady_s']:>10.4f}" if "ratio" in r else f"{'-':>10}"
        if "ratio" in r:
            spread = f"[{r['ratio_min']:.3f}, {r['ratio_max']:.3f}]"
            ratio = f"{r['ratio']:>8.3f}{spread:>16}"
        else:
            ratio = f"{'-':>8}{'-':>16}"
        mfu = (f"{r['update_s']:>10.4f}{100 * r['update_mfu']:>11.1f}%"
               if "update_mfu" in r else "")
        print(f"{size:<8}{r['ours_steady_s']:>12.4f}{peer}{ratio}{mfu}")
    if res["peer_missing"]:
        print(f"(no peer: {res['peer_missing']})")
