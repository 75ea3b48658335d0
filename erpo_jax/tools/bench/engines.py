"""`erpo bench --sections engines`: the three rollout engines on the same
samples where response lengths vary, side by side in one run.

The lengths come from the model, not from the sampler: a random model whose
head is flattened (logits scaled down) with a set of EOS ids of mass about
4 / N, so each step ends a response with probability about 4 / N and the
lengths are about geometric with mean N / 4 (capped at N). That is an EOS
logit bias on a near-uniform next-token distribution.

The engines get the same prompts and key and the same memory: the static
engine runs calls of `slots / G` prompts (`max_prompts_per_call`, its KV
cache `slots` rows), the continuous and paged engines a pool of `slots`
slots keyed as those calls (the paged engine's pages by default hold every
slot's longest prompt and response, `page_size` entries each; on the CPU its
attention is the pure-JAX path over the pages). So they draw the same samples, to float rounding: a draw can
flip where rounding moves it across a token boundary (checked here:
`same_samples`), and the table compares only the schedule: decode steps,
token-slot utilisation (tokens sampled by decode steps / (slots x steps))
and wall time, best of `repeats` interleaved calls after a warm-up that
compiles.
"""

from __future__ import annotations

import dataclasses
import time

import jax
import numpy as np

from erpo_jax.model import model as model_lib
from erpo_jax.model.config import PRESETS
from erpo_jax.rollout.continuous import ContinuousEngine
from erpo_jax.rollout.paged import PagedEngine
from erpo_jax.rollout.static import StaticEngine
from erpo_jax.rollout.types import SamplingConfig


def eos_set(vocab: int, new_tokens: int, first: int = 3) -> tuple[int, ...]:
    """EOS ids whose share of a near-uniform distribution is about 4 / N."""
    k = max(1, round(4 * vocab / new_tokens))
    return tuple(range(first, first + k))


def bench_engines(preset: str = "peer-small", prompts: int = 32, group: int = 8,
                  new_tokens: int = 256, slots: int = 64, prompt_lens=(16, 64),
                  head_scale: float = 0.1, repeats: int = 2, seed: int = 0,
                  top_k: int = 50, page_size: int = 16) -> dict:
    cfg = dataclasses.replace(PRESETS[preset],
                              max_position_embeddings=max(PRESETS[preset].max_position_embeddings,
                                                          prompt_lens[1] + new_tokens + 8))
    params = model_lib.init_params(cfg, jax.random.key(seed))
    # Flatten the next-token distribution: scale the head (the embedding, when tied).
    flat = "lm_head" if "lm_head" in params else "embed"
    params = {**params, flat: params[flat] * head_scale}
    rng = np.random.default_rng(seed)
    eos = eos_set(cfg.vocab_size, new_tokens)
    batch = [rng.integers(eos[-1] + 1, cfg.vocab_size, size=int(n)).tolist()
             for n in rng.integers(prompt_lens[0], prompt_lens[1] + 1, size=prompts)]
    sc = SamplingConfig(max_new_tokens=new_tokens, num_samples=group, eos_ids=eos, top_k=top_k,
                        max_prompt_len=prompt_lens[1])
    per_call = max(1, slots // group)
    engines = {"static": StaticEngine(cfg, sc),
               "continuous": ContinuousEngine(cfg, sc, slots=slots),
               "paged": PagedEngine(cfg, sc, slots=slots, page_size=page_size)}
    key = jax.random.key(seed + 1)
    outs, walls, stats = {}, {n: [] for n in engines}, {}
    for name, e in engines.items():            # warm-up: compiles
        outs[name] = e.sample(params, batch, key, per_call)
    for _ in range(repeats):                   # interleaved
        for name, e in engines.items():
            t0 = time.perf_counter()
            e.sample(params, batch, key, per_call)
            walls[name].append(time.perf_counter() - t0)
            stats[name] = dict(e.last_stats)
    a = outs["static"]
    same = all(bool(np.array_equal(a.response_tokens, b.response_tokens)
                    and np.array_equal(a.lengths, b.lengths))
               for b in (outs["continuous"], outs["paged"]))
    lengths = a.lengths
    rows = {n: {**stats[n], "wall_s": min(walls[n]), "walls_s": walls[n]} for n in engines}
    s, c, pg = rows["static"], rows["continuous"], rows["paged"]
    return {
        "preset": preset,
        "params_m": sum(x.size for x in jax.tree_util.tree_leaves(params)) / 1e6,
        "samples": prompts * group, "group": group, "new_tokens": new_tokens, "slots": slots,
        "static_rows_per_call": per_call * group, "eos_ids": len(eos),
        "length_mean": float(lengths.mean()), "length_median": float(np.median(lengths)),
        "truncated_frac": float(a.truncated.mean()), "same_samples": same,
        "engines": rows,
        "steps_ratio": c["decode_steps"] / s["decode_steps"],
        "wall_ratio": c["wall_s"] / s["wall_s"],
        "paged_steps_ratio": pg["decode_steps"] / s["decode_steps"],
        "paged_wall_ratio": pg["wall_s"] / s["wall_s"],
        "paged_vs_continuous_wall": pg["wall_s"] / c["wall_s"], "page_size": page_size,
    }


def print_table(r: dict) -> None:
    print(f"\nRollout engines, varied lengths: {r['preset']}, {r['samples']} samples "
          f"(G {r['group']}), N {r['new_tokens']}, {r['slots']} slots / static calls of "
          f"{r['static_rows_per_call']} rows; lengths mean {r['length_mean']:.1f}, median "
          f"{r['length_median']:.0f}, {100 * r['truncated_frac']:.1f}% truncated; same samples: "
          f"{'yes' if r['same_samples'] else 'NO'}")
    print(f"{'engine':<12}{'decode steps':>14}{'slot util':>11}{'wall s':>9}")
    for name, x in r["engines"].items():
        print(f"{name:<12}{x['decode_steps']:>14,}{100 * x['slot_utilization']:>10.1f}%"
              f"{x['wall_s']:>9.2f}")
    print(f"continuous / static: decode steps {r['steps_ratio']:.3f}, wall {r['wall_ratio']:.3f}")
    print(f"paged / static: decode steps {r['paged_steps_ratio']:.3f}, wall "
          f"{r['paged_wall_ratio']:.3f}; paged / continuous wall "
          f"{r['paged_vs_continuous_wall']:.3f} (pages of {r['page_size']})")
