"""One RL iteration with LoRA against full fine-tuning, side by side in one run.

    python experiments/profiles/lora_bench.py [--preset medium-25m] [--rank 8] [--reps 2]

The Trainer's own step (`erpo bench`'s rl_iteration: rollout, reward,
advantages, Policy-KL reference forward, update) on a random `preset` model,
full fine-tuning and LoRA of `rank` alternating `--reps` times in this one
process (so both see the same machine); prints each one's steady iteration
and its parts, and the ratio LoRA / full of the medians. Iteration 0 (the
compile) is left out of the steady time.
"""

from __future__ import annotations

import argparse
import json
import statistics

from erpo_jax.tools.bench.rl import rl_iteration


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--preset", default="medium-25m")
    p.add_argument("--rank", type=int, default=8)
    p.add_argument("--prompts", type=int, default=8)
    p.add_argument("--group", type=int, default=4)
    p.add_argument("--prompt-len", type=int, default=64)
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--iters", type=int, default=4)
    p.add_argument("--reps", type=int, default=2)
    p.add_argument("--json", default=None)
    a = p.parse_args(argv)
    spec = dict(preset=a.preset, prompts=a.prompts, group=a.group, prompt_len=a.prompt_len,
                new_tokens=a.new_tokens)
    runs = {"full": [], f"lora r{a.rank}": []}
    for _ in range(a.reps):
        for name, rank in (("full", 0), (f"lora r{a.rank}", a.rank)):
            r = rl_iteration(a.iters, name=name, lora_rank=rank, **spec)
            runs[name].append(r)
            parts = {k: round(v, 3) for k, v in r["steady_breakdown_s"].items()}
            print(f"{name:>10}: steady {r['steady_iter_s']:.3f} s/iter, parts {parts}, "
                  f"peak RSS {r['peak_rss_mib']:.0f} MiB", flush=True)
    med = {k: statistics.median(x["steady_iter_s"] for x in v) for k, v in runs.items()}
    upd = {k: statistics.median(x["steady_breakdown_s"]["time/update"] for x in v)
           for k, v in runs.items()}
    lora_name = f"lora r{a.rank}"
    out = {"spec": {**spec, "rank": a.rank, "iters": a.iters, "reps": a.reps},
           "steady_iter_s": med, "update_s": upd,
           "ratio_iter_lora_over_full": med[lora_name] / med["full"],
           "ratio_update_lora_over_full": upd[lora_name] / upd["full"]}
    print(json.dumps(out, indent=2))
    if a.json:
        with open(a.json, "w") as f:
            json.dump(out, f, indent=2)
    return out


if __name__ == "__main__":
    main()
