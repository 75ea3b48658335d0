"""The one-time reference pass: cached reference query log-probs and weights.

Before training, the reference model runs once over every training query and
records log pi_ref(x_t | x_<t) at temperature 1 for each query token t >= 2.
During training the reference model is never run for Query-KL: each batch
reads its slice of this cache. From the same numbers come the per-query
scores s(x) and the dataset-static weights (`erpo_jax.rl.weights`).

The cache lives on disk under a key made of the reference weights' hash, the
tokenizer, the prompt template, the dataset (the query token ids) and the
numerics (model config with its dtypes, LM-head chunking, batch layout, mesh), so a run
with the same key reuses it without running the model and a run whose key
differs recomputes it: a stale cache is never read.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import io
import json
from typing import Any, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from erpo_jax.runtime import rundir, xla_options
from erpo_jax.runtime.distributed import broadcast_from_primary, to_host
from erpo_jax.runtime.progress import progress_bar
from erpo_jax.model.config import ModelConfig
from erpo_jax.model.logprobs import token_logprobs
from erpo_jax.model.sharding import Sharding
from erpo_jax.rl import weights as weights_lib

FORMAT_VERSION = 2  # 2: the key includes the numerics (`numerics_id`)


@dataclasses.dataclass
class ReferenceCache:
    """Reference query log-probs of Q queries, stored ragged.

    logp: float32[sum_q (m_q - 1)]; offsets: int64[Q + 1]; query q's values
    (targets x_2..x_m) are logp[offsets[q]:offsets[q+1]].
    key: the cache key these values belong to.
    """

    logp: np.ndarray
    offsets: np.ndarray
    key: str

    @property
    def num_queries(self) -> int:
        return len(self.offsets) - 1

    def row(self, q: int) -> np.ndarray:
        return self.logp[self.offsets[q]:self.offsets[q + 1]]

    def scores(self) -> np.ndarray:
        """float64[Q] s(x) = mean reference log-prob over each query's tokens."""
        counts = np.diff(self.offsets)
        # Prefix sums, not np.add.reduceat: reduceat rejects an index equal to
        # the length, which a one-token (zero-target) last query produces.
        csum = np.concatenate([[0.0], np.cumsum(self.logp.astype(np.float64))])
        sums = csum[self.offsets[1:]] - csum[self.offsets[:-1]]
        s = sums / np.maximum(counts, 1)
        if np.any(counts > 0):
            s = np.where(counts > 0, s, s[counts > 0].mean())
        return s

    def weights(self, scheme: str = "likelihood", tau: float = 1.0,
                w_min: float = weights_lib.W_MIN, w_max: float = weights_lib.W_MAX) -> np.ndarray:
        """float32[Q] dataset-static per-query weights (mean 1 over the set)."""
        return weights_lib.query_weights(self.scores(), scheme, tau, w_min, w_max
                                         ).astype(np.float32)

    def batch_layout(self, query_index: Sequence[int], query_width: int,
                     total_width: int) -> np.ndarray:
        """float32[N, total_width - 1] aligned with `token_logprobs` output.

        Row i holds query `query_index[i]` left-padded to `query_width` slots,
        followed by its response. Query token j (0-based) of a length-m query
        sits at slot query_width - m + j, so its target position in the
        log-prob array is query_width - m + j - 1, for j = 1..m-1.
        """
        out = np.zeros((len(query_index), total_width - 1), np.float32)
        for i, q in enumerate(query_index):
            vals = self.row(int(q))
            m = len(vals) + 1
            if m > query_width:
                raise ValueError(f"query {q} has {m} tokens but the batch layout has only "
                                 f"{query_width} query slots.")
            start = query_width - m
            out[i, start:start + len(vals)] = vals
        return out


def params_digest(params: Any) -> str:
    """blake2b of every parameter leaf (path, dtype, shape and bytes)."""
    h = hashlib.blake2b(digest_size=20)
    for path, leaf in jax.tree_util.tree_flatten_with_path(params)[0]:
        arr = to_host(leaf)
        h.update(jax.tree_util.keystr(path).encode())
        h.update(f"{arr.dtype}{arr.shape}".encode())
        h.update(np.ascontiguousarray(arr).view(np.uint8).data)
    return h.hexdigest()


def dataset_digest(queries: Sequence[Sequence[int]]) -> str:
    h = hashlib.blake2b(digest_size=20)
    for q in queries:
        h.update(np.asarray(q, np.int64).tobytes())
        h.update(b"|")
    return h.hexdigest()


def numerics_id(cfg: ModelConfig, *, chunk_size: int | None = 512, batch_size: int = 64,
                pad_id: int = 0, sharding: Sharding | None = None) -> dict:
    """Everything besides weights, tokenizer, template and data that can change the
    reference log-probs: the model config (architecture, param/compute dtypes,
    remat, layer scan), the LM-head chunking, the pass's batch layout (in bf16
    the rounding depends on it) and the mesh (it changes reduction order)."""
    mesh = None if sharding is None else {str(k): int(v) for k, v in sharding.mesh.shape.items()}
    return {"model": dataclasses.asdict(cfg), "chunk_size": chunk_size, "batch_size": batch_size,
            "pad_id": pad_id, "mesh": mesh}


def cache_key(params_hash: str, tokenizer_id: str, template: str,
              queries: Sequence[Sequence[int]], numerics: dict | None = None) -> str:
    """The key a cached reference pass is valid for (numerics: `numerics_id`)."""
    blob = json.dumps({"v": FORMAT_VERSION, "params": params_hash, "tokenizer": tokenizer_id,
                       "template": template, "data": dataset_digest(queries),
                       "numerics": numerics}, sort_keys=True, default=str)
    return hashlib.sha256(blob.encode()).hexdigest()


def bucket(n: int, minimum: int = 8) -> int:
    """The padded width of a reference-pass batch whose longest row has n tokens."""
    return max(minimum, 1 << (max(n, 1) - 1).bit_length())



@functools.lru_cache(maxsize=None)
def make_pass_fn(cfg: ModelConfig, chunk_size: int | None, sharding: Sharding | None = None):
    """Jitted (params, tokens, mask) -> float32[N, T-1] log-probs at temperature 1
    (`logp_t1`): the program of the one-time reference pass."""
    def run(p, tokens, mask):
        return token_logprobs(p, cfg, tokens, mask, temperature=1.0, chunk_size=chunk_size,
                              sharding=sharding).logp_t1

    return jax.jit(run, compiler_options=xla_options.for_steps())


def compute_reference(params, cfg: ModelConfig, queries: Sequence[Sequence[int]], *,
                      batch_size: int = 64, pad_id: int = 0, chunk_size: int | None = 512,
                      sharding: Sharding | None = None, progress: bool = True,
                      key: str = "") -> ReferenceCache:
    """Run the reference model once over every query (batched, jitted, bucketed).

    queries: token-id lists (chat template included), each of length >= 1.
    Batches hold queries of similar length, padded on the left to a power-of-two
    width, so only a handful of shapes compile.
    """
    if not queries:
        raise ValueError("compute_reference: the training set has no queries.")
    lengths = np.array([len(q) for q in queries])
    if lengths.min() < 1:
        raise ValueError(f"compute_reference: query {int(lengths.argmin())} is empty.")
    if sharding is not None and batch_size % sharding.data_size:
        raise ValueError(f"reference batch size {batch_size} is not divisible by the "
                         f"data-parallel size {sharding.data_size}.")
    order = np.argsort(lengths, kind="stable")
    offsets = np.zeros(len(queries) + 1, np.int64)
    offsets[1:] = np.cumsum(np.maximum(lengths - 1, 0))
    flat = np.zeros(offsets[-1], np.float32)

    run = make_pass_fn(cfg, chunk_size, sharding)
    batches = [order[i:i + batch_size] for i in range(0, len(order), batch_size)]
    # On a terminal a bar that goes when done; elsewhere one line at the end.
    bar = progress_bar(len(batches), desc="reference pass", unit="batch", leave=False,
                       every_n=len(batches)) if progress else None
    for idx in batches:
        width = bucket(int(lengths[idx].max()) + 1)
        tokens = np.full((batch_size, width), pad_id, np.int32)
        mask = np.zeros((batch_size, width), bool)
        for r, q in enumerate(idx):
            tokens[r, width - lengths[q]:] = queries[q]
            mask[r, width - lengths[q]:] = True
        mask[len(idx):, -1] = True  # filler rows: one real token, ignored
        if sharding is not None:
            rows = sharding.named(("batch", None))
            tokens, mask = jax.device_put(tokens, rows), jax.device_put(mask, rows)
        lp = to_host(run(params, jnp.asarray(tokens), jnp.asarray(mask)))
        for r, q in enumerate(idx):
            n = lengths[q] - 1
            flat[offsets[q]:offsets[q + 1]] = lp[r, width - 1 - n:width - 1]
        if bar is not None:
            bar.update(1)
    if bar is not None:
        bar.close()
    return ReferenceCache(flat, offsets, key)


def load_or_compute(params, cfg: ModelConfig, queries: Sequence[Sequence[int]], cache_dir,
                    *, tokenizer_id: str, template: str, params_hash: str | None = None,
                    **kwargs) -> tuple[ReferenceCache, bool]:
    """(cache, computed): reuse the on-disk cache whose key matches, else compute it.

    Only process 0 reads and writes the file (atomic rename); in a multi-host
    run it broadcasts what it read.
    """
    params_hash = params_hash or params_digest(params)
    numerics = numerics_id(cfg, **{k: kwargs[k] for k in ("chunk_size", "batch_size", "pad_id",
                                                          "sharding") if k in kwargs})
    key = cache_key(params_hash, tokenizer_id, template, queries, numerics)
    path = rundir.path(cache_dir) / f"refpass-{key[:24]}.npz"
    # Process 0 decides and shares what it read: every process must run the
    # same jitted programs, and worker disks need not hold the file.
    found = np.zeros(1, np.int32)
    logp = offsets = None
    if jax.process_index() == 0 and path.exists():
        with np.load(io.BytesIO(path.read_bytes()), allow_pickle=False) as f:
            if str(f["key"]) == key and len(f["offsets"]) == len(queries) + 1:
                found[0], logp, offsets = 1, f["logp"], f["offsets"]
    if int(broadcast_from_primary(found)[0]):
        if jax.process_count() > 1:
            n_flat = int(broadcast_from_primary(np.asarray([0 if logp is None else len(logp)]))[0])
            logp = broadcast_from_primary(logp if logp is not None else np.zeros(n_flat, np.float32))
            offsets = broadcast_from_primary(offsets if offsets is not None
                                             else np.zeros(len(queries) + 1, np.int64))
        return ReferenceCache(logp, offsets, key), False
    cache = compute_reference(params, cfg, queries, key=key, **kwargs)
    if jax.process_index() == 0:
        buf = io.BytesIO()
        np.savez(buf, logp=cache.logp, offsets=cache.offsets, key=np.array(key))
        rundir.write_atomic(path, buf.getvalue())
    return cache, True
