"""Sampler throughput: generated tokens/s of the KV-cache sampler beside
transformers' PyTorch `generate` on the same weights and a no-cache baseline.

    python -m erpo_jax.rollout.bench            # tiny + medium-25m, batch 1/32/128 (minutes)
    python -m erpo_jax.rollout.bench --quick    # a smaller grid (well under a minute)

All three columns decode greedily with no EOS, so every row produces exactly
`new_tokens` tokens from a `prompt_len`-token prompt; tokens/s = batch *
new_tokens / wall time of the whole call (prefill included), best of
`repeats` after one warm-up call (compilation excluded).

The no-cache baseline is one jitted loop that re-runs the model over the full
fixed-size [B, prompt_len + new_tokens] buffer at every step (masked), as a
cacheless sampler must to keep static shapes. Its cost per step is constant,
so it is timed over `nocache_steps` steps only and reported per token.
"""

from __future__ import annotations

import argparse
import dataclasses
import tempfile
import time

import jax
import jax.numpy as jnp
import numpy as np

from erpo_jax.model import model as model_lib
from erpo_jax.model.config import PRESETS, ModelConfig
from erpo_jax.rollout.static import StaticEngine
from erpo_jax.rollout.types import SamplingConfig


def _best_time(fn, repeats: int) -> float:
    fn()  # warm-up: compilation, allocator, torch kernels
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def _nocache_fn(cfg: ModelConfig, prompt_len: int, total_len: int, steps: int):
    """Jitted greedy loop without a cache: fn(params, tokens int32[B, total_len],
    mask bool[B, total_len]) -> tokens, re-running the whole buffer each step."""

    def run(params, tokens, mask):
        def step(t, carry):
            tokens, mask = carry
            logits, _ = model_lib.forward(params, cfg, tokens,
                                          model_lib.positions_from_mask(mask), mask)
            nxt = jnp.argmax(logits[:, prompt_len - 1 + t], axis=-1).astype(jnp.int32)
            tokens = jax.lax.dynamic_update_slice(tokens, nxt[:, None], (0, prompt_len + t))
            mask = jax.lax.dynamic_update_slice(mask, jnp.ones_like(nxt[:, None], bool),
                                                (0, prompt_len + t))
            return tokens, mask

        return jax.lax.fori_loop(0, steps, step, (tokens, mask))[0]

    return jax.jit(run)


def _hf_model(params, cfg: ModelConfig):
    """transformers model with our weights (via an exported checkpoint), or None
    when torch is not installed."""
    try:
        import torch
        import transformers
    except ImportError:
        return None
    from erpo_jax.model.hf import export_hf
    transformers.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()
    with tempfile.TemporaryDirectory() as d:
        export_hf(params, cfg, d)
        model = transformers.AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32)
    return model.eval()


def _pick_torch_threads(run_short, candidates) -> int:
    """The torch intra-op thread count that runs `run_short` fastest. On a
    shared CPU, OpenMP threads that wait for a descheduled sibling can make
    torch an order of magnitude slower than one thread; the comparison is
    against transformers at its best."""
    import torch
    best, best_t = candidates[0], float("inf")
    for n in candidates:
        torch.set_num_threads(n)
        t = _best_time(run_short, 1)
        if t < best_t:
            best, best_t = n, t
    torch.set_num_threads(best)
    return best


def bench_sampler(presets=("tiny", "medium-25m"), batches=(1, 32, 128), prompt_len: int = 16,
                  new_tokens: int = 32, nocache_steps: int = 2, repeats: int = 2,
                  with_hf: bool = True, torch_threads: int | None = None, seed: int = 0,
                  verbose: bool = True, dtype: str | None = None) -> dict:
    """Measure and print generated tokens/s per (preset, batch).

    torch_threads: fixed torch thread count for transformers; None = pick
      the faster of 1 and torch's default per (preset, batch).
    dtype: param and compute dtype of the JAX model (e.g. 'bfloat16' on an
      accelerator); None keeps the preset's (float32). transformers always
      runs float32, so pass with_hf=False with another dtype.
    Returns {"settings": {...}, "rows": [{"preset", "params_m", "batch",
    "jax_kv_cache", "jax_no_cache", "hf_generate" (None without torch),
    "torch_threads", "speedup_vs_hf", "speedup_vs_no_cache"}, ...], "notes"};
    rates in tokens/s.
    """
    rng = np.random.default_rng(seed)
    rows, notes = [], []
    hf_ok = with_hf
    if with_hf:
        try:
            import torch
            default_threads = torch.get_num_threads()
        except ImportError:
            hf_ok = False
            notes.append("torch is not installed: the transformers column is skipped.")
    for name in presets:
        cfg = PRESETS[name]
        if dtype:
            cfg = dataclasses.replace(cfg, param_dtype=dtype, compute_dtype=dtype)
        params = model_lib.init_params(cfg, jax.random.key(seed))
        hf = _hf_model(params, cfg) if hf_ok else None
        sampler = StaticEngine(cfg, SamplingConfig(max_new_tokens=new_tokens, greedy=True,
                                                   max_prompt_len=prompt_len,
                                                   min_bucket=prompt_len))
        steps = min(nocache_steps, new_tokens)
        nocache = _nocache_fn(cfg, prompt_len, prompt_len + new_tokens, steps)
        for B in batches:
            prompts = rng.integers(1, cfg.vocab_size, size=(B, prompt_len)).astype(np.int32)
            key = jax.random.key(seed)
            t_jax = _best_time(lambda: sampler(params, prompts, key), repeats)

            buf = np.zeros((B, prompt_len + new_tokens), np.int32)
            buf[:, :prompt_len] = prompts
            mask = np.zeros(buf.shape, bool)
            mask[:, :prompt_len] = True
            buf, mask = jnp.asarray(buf), jnp.asarray(mask)
            t_nc = _best_time(lambda: jax.block_until_ready(nocache(params, buf, mask)), repeats)

            row = {"preset": name, "params_m": cfg.num_params() / 1e6, "batch": B,
                   "jax_kv_cache": B * new_tokens / t_jax,
                   "jax_no_cache": B * steps / t_nc, "hf_generate": None, "torch_threads": None}
            if hf is not None:
                import torch
                ids = torch.from_numpy(prompts.astype(np.int64))

                def gen(n=new_tokens):
                    with torch.no_grad():
                        out = hf.generate(input_ids=ids, attention_mask=torch.ones_like(ids),
                                          max_new_tokens=n, min_new_tokens=n, do_sample=False,
                                          pad_token_id=0, eos_token_id=None)
                    assert out.shape[1] == prompt_len + n

                if torch_threads is None:
                    threads = _pick_torch_threads(lambda: gen(min(4, new_tokens)),
                                                  sorted({1, default_threads}))
                else:
                    threads = torch_threads
                    torch.set_num_threads(threads)
                row["torch_threads"] = threads
                row["hf_generate"] = B * new_tokens / _best_time(gen, repeats)
            row["speedup_vs_hf"] = (row["jax_kv_cache"] / row["hf_generate"]
                                    if row["hf_generate"] else None)
            row["speedup_vs_no_cache"] = row["jax_kv_cache"] / row["jax_no_cache"]
            rows.append(row)
            if verbose:
                print(f"  measured {name} batch {B}", flush=True)
    result = {"settings": dict(presets=list(presets), batches=list(batches),
                               prompt_len=prompt_len, new_tokens=new_tokens,
                               nocache_steps=nocache_steps, repeats=repeats, dtype=dtype,
                               backend=jax.default_backend(), devices=jax.device_count()),
              "rows": rows, "notes": notes}
    if verbose:
        print_table(result)
    return result


def print_table(result: dict) -> None:
    s = result["settings"]
    print(f"\nSampler throughput, generated tokens/s (greedy, prompt {s['prompt_len']}, "
          f"{s['new_tokens']} new tokens, prefill included; {s['backend']})")
    head = (f"{'model':<12}{'params':>8}{'batch':>7}{'jax kv-cache':>14}{'jax no-cache':>14}"
            f"{'hf generate':>13}{'threads':>8}{'x hf':>7}{'x no-cache':>12}")
    print(head)
    print("-" * len(head))
    fmt = lambda v, spec: "-" if v is None else format(v, spec)
    for r in result["rows"]:
        print(f"{r['preset']:<12}{r['params_m']:>7.1f}M{r['batch']:>7}"
              f"{r['jax_kv_cache']:>14,.0f}{r['jax_no_cache']:>14,.0f}"
              f"{fmt(r['hf_generate'], ',.0f'):>13}{fmt(r['torch_threads'], 'd'):>8}"
              f"{fmt(r['speedup_vs_hf'], '.1f'):>7}"
              f"{r['speedup_vs_no_cache']:>12.1f}")
    for n in result["notes"]:
        print("note:", n)


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="small grid, well under a minute")
    ap.add_argument("--no-hf", action="store_true", help="skip the transformers column")
    ap.add_argument("--new-tokens", type=int, default=None)
    ap.add_argument("--batches", type=int, nargs="+", default=None)
    ap.add_argument("--torch-threads", type=int, default=None,
                    help="fixed torch thread count (default: the faster of 1 and all)")
    args = ap.parse_args(argv)
    kw = dict(with_hf=not args.no_hf)
    if args.quick:
        kw.update(batches=(1, 32), new_tokens=8, nocache_steps=1, repeats=1, torch_threads=1)
    if args.new_tokens:
        kw["new_tokens"] = args.new_tokens
    if args.batches:
        kw["batches"] = tuple(args.batches)
    if args.torch_threads:
        kw["torch_threads"] = args.torch_threads
    return bench_sampler(**kw)


if __name__ == "__main__":
    main()
