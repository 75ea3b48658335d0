"""What every rollout engine shares: how to sample (`SamplingConfig`), what a
rollout is (`Rollout`), its keys and statistics, and what an engine offers
(`Engine`, the interface `rollout.engine` picks an implementation of).

Shapes: B prompts, G samples per prompt, R = B * G rows (prompt-major: row
r = b * G + g), P prompt bucket length, N max new tokens, V vocab.

The log-probability convention. `Rollout.logp[r, t]` is log softmax(logits /
temperature)[token], i.e. under the temperature-scaled distribution BEFORE
top-k / top-p truncation and before the min-new-tokens EOS mask, never
renormalised over the kept set (`choice.choose`). That is exactly what a
teacher-forced recompute `token_logprobs(params, cfg, tokens, mask,
temperature=T)` returns, so the PPO/GRPO ratio is exactly 1 at the first
update on fresh samples. With `greedy=True` the token is the argmax and its
logp is still under softmax(logits / temperature).

Randomness. Row r's key is fold_in(rng, r). With method 'inverse_cdf' it
draws the row's N uniforms at once (uniform t decides token t); with
'gumbel' step t uses the key fold_in(fold_in(rng, r), t). So a row's random
numbers depend only on (rng, global row index, step): sampling G per prompt
equals sampling each prompt repeated G times, and another mesh, engine or
pool gives the same samples, to float rounding: a draw can flip where
rounding moves it across a token boundary. For RL step s pass
`rollout_key(seed_key, s)`; with max_prompts > 0, chunk c of that many
prompts is keyed fold_in(key, c) by every engine.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, ClassVar, NamedTuple, Protocol, Sequence

import jax
import numpy as np

from erpo_jax.model.config import ModelConfig
from erpo_jax.model.sharding import Sharding


@dataclasses.dataclass(frozen=True)
class SamplingConfig:
    """How to sample. Hashable: it is a static argument of the jitted sampler.

    Attributes:
      max_new_tokens: N, the static response length (rows stop early at EOS).
      num_samples: G, samples per prompt (they share the prompt's prefill).
      temperature: divides the logits; > 0.
      top_p: nucleus mass in (0, 1]; 1 = off.
      top_k: keep the k most likely tokens; 0 = off.
      greedy: take the argmax (top_p / top_k / rng are then irrelevant).
      method: how a token is drawn from the (truncated) distribution:
        'inverse_cdf' (one uniform per row, located in the cumulative
        probabilities, blockwise; 2.5x to 35x faster than 'gumbel' on the CPU
        at vocabularies 256 to 152k) or 'gumbel' (argmax of logits plus
        Gumbel noise, one random number per vocabulary entry). Both draw
        exactly from softmax(truncated z); for a given key they give different
        tokens.
      eos_ids: a row is done after emitting any of these (the EOS is kept in
        the response and in its mask).
      min_new_tokens: EOS ids are masked out of the first this-many tokens.
      pad_id: fills prompt padding (left) and response padding (right).
      max_prompt_len: longest accepted prompt; the top length bucket.
      min_bucket: shortest prompt bucket.
      cache_phases: the static engine's decode loop runs in up to this many
        phases on a KV cache that grows between them
        (`static.cache_phase_lengths`), so a step's
        attention reads about the filled slots, not all of them. Measured on
        the CPU (2 cores, random weights, top-k 50, no EOS), one phase against
        four: peer-small 16 x 8 rows, 64 + 128 tokens, 5.87 -> 5.05 s;
        medium-25m 16 x 8, 64 + 256, 33.4 -> 30.5 s. Each phase compiles the
        decode step once more. Logits and log-probs agree with one phase to
        float rounding (the softmax sums run over fewer masked slots), so a
        draw differs only where rounding moves it across a token boundary.
    """

    max_new_tokens: int = 32
    num_samples: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    greedy: bool = False
    method: str = "inverse_cdf"
    eos_ids: tuple[int, ...] = ()
    min_new_tokens: int = 0
    pad_id: int = 0
    max_prompt_len: int = 512
    min_bucket: int = 8
    cache_phases: int = 4

    def __post_init__(self):
        object.__setattr__(self, "eos_ids", tuple(int(e) for e in self.eos_ids))
        if self.max_new_tokens < 1:
            raise ValueError(f"SamplingConfig.max_new_tokens must be >= 1, got {self.max_new_tokens}.")
        if self.num_samples < 1:
            raise ValueError(f"SamplingConfig.num_samples must be >= 1, got {self.num_samples}.")
        if not self.temperature > 0:
            raise ValueError(f"SamplingConfig.temperature must be > 0, got {self.temperature}; "
                             "use greedy=True for argmax decoding.")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"SamplingConfig.top_p must be in (0, 1], got {self.top_p}.")
        if self.top_k < 0:
            raise ValueError(f"SamplingConfig.top_k must be >= 0 (0 = off), got {self.top_k}.")
        if not 0 <= self.min_new_tokens <= self.max_new_tokens:
            raise ValueError(f"SamplingConfig.min_new_tokens ({self.min_new_tokens}) must be in "
                             f"[0, max_new_tokens={self.max_new_tokens}].")
        if self.method not in ("inverse_cdf", "gumbel"):
            raise ValueError(f"SamplingConfig.method is {self.method!r}; use 'inverse_cdf' or "
                             "'gumbel'.")
        if self.cache_phases < 1:
            raise ValueError(f"SamplingConfig.cache_phases must be >= 1, got {self.cache_phases}.")
        if self.max_prompt_len < 1 or self.min_bucket < 1:
            raise ValueError("SamplingConfig.max_prompt_len and min_bucket must be >= 1, got "
                             f"{self.max_prompt_len} and {self.min_bucket}.")

    def check_model(self, cfg: ModelConfig) -> None:
        """Raise a sentence when a token id or the total length does not fit the model."""
        for name, ids in (("eos_ids", self.eos_ids), ("pad_id", (self.pad_id,))):
            bad = [i for i in ids if not 0 <= i < cfg.vocab_size]
            if bad:
                raise ValueError(f"SamplingConfig.{name} {bad} outside the vocabulary "
                                 f"[0, {cfg.vocab_size}).")
        if self.top_k > cfg.vocab_size:
            raise ValueError(f"SamplingConfig.top_k ({self.top_k}) exceeds the vocabulary "
                             f"size {cfg.vocab_size}.")
        total = self.max_prompt_len + self.max_new_tokens
        if total > cfg.max_position_embeddings:
            raise ValueError(
                f"max_prompt_len + max_new_tokens = {total} (in a run config "
                f"data.max_prompt_len + rollout.max_new_tokens) exceeds the model's "
                f"max_position_embeddings ({cfg.max_position_embeddings}): no KV cache slot "
                "holds a position past it; shorten one of them.")


class Rollout(NamedTuple):
    """B x G sampled sequences (R = B * G rows, prompt-major).

    prompt_tokens: int32[R, P] left-padded with pad_id.
    prompt_mask: bool[R, P], True on real prompt tokens.
    response_tokens: int32[R, N] right-padded with pad_id after the EOS.
    response_mask: bool[R, N], True on sampled tokens (EOS included).
    logp: float32[R, N], log-prob of each sampled token under softmax(logits /
      temperature), before top-k/top-p (see the module docstring); 0 on padding.
    lengths: int32[R], number of response tokens (= response_mask.sum(-1)).
    truncated: bool[R], True when the row hit max_new_tokens without an EOS.
    num_steps: int32[], tokens sampled per row before the loop stopped (<= N).
    """

    prompt_tokens: Any
    prompt_mask: Any
    response_tokens: Any
    response_mask: Any
    logp: Any
    lengths: Any
    truncated: Any
    num_steps: Any


def rollout_key(seed_key: jax.Array, rl_step: int | jax.Array) -> jax.Array:
    """The sampling key of RL step `rl_step`: fold_in(seed_key, rl_step)."""
    return jax.random.fold_in(seed_key, rl_step)


def rollout_stats(lengths: np.ndarray, decode_steps: int, slot_steps: int) -> dict:
    """What a rollout cost: decode steps run (forward passes after each
    sample's first token, which comes from the prefill), and token-slot
    utilisation, the tokens those steps sampled over the row slots they ran
    (slots x steps); with both counts, so the statistics of several
    rollouts add up (`dynamic_sampling.engine_stats`)."""
    useful = int(np.maximum(np.asarray(lengths) - 1, 0).sum())
    return {"decode_steps": int(decode_steps),
            "slot_utilization": useful / slot_steps if slot_steps else 1.0,
            "slot_steps": int(slot_steps), "useful_tokens": useful}


def join_rollouts(parts: Sequence[Rollout], pad_id: int) -> Rollout:
    """numpy Rollouts of several calls as one, their prompts left-padded to
    one width; num_steps is the largest."""
    width = max(p.prompt_tokens.shape[1] for p in parts)

    def left_pad(a, fill):
        return np.pad(a, ((0, 0), (width - a.shape[1], 0)), constant_values=fill)

    parts = [p._replace(prompt_tokens=left_pad(p.prompt_tokens, pad_id),
                        prompt_mask=left_pad(p.prompt_mask, False)) for p in parts]
    joined = {f: np.concatenate([getattr(p, f) for p in parts])
              for f in Rollout._fields if f != "num_steps"}
    return Rollout(**joined, num_steps=max(int(p.num_steps) for p in parts))


# ----------------------------------------------------------------------------- the interface


class DecodeLoop(NamedTuple):
    """A decode loop inside one of an engine's programs. XLA's cost analysis
    counts a loop body once, so `erpo plan` compiles one step of it by
    itself (`lower`) and costs the loop from that.

    key: the step's name in `Engine.plan_estimate`'s `step_ms`.
    rows: rows one step decodes; cache_length: KV entries it reads per row.
    steps: the steps a call of the program runs when every row runs to
      max_new_tokens (they are then added into the program's cost); None
      when the engine's schedule decides how many (the step is then costed
      by itself).
    full: this is the step `erpo plan` reports the traffic of (the
      program's largest: the whole cache, the whole pool).
    """

    key: str
    rows: int
    cache_length: int
    steps: int | None
    lower: Callable[[], Any]
    full: bool


class EngineProgram(NamedTuple):
    """One program an engine runs in an RL step, at the shapes it is planned
    for (`Engine.step_programs`).

    part: its name within the engine ('' when a call is one program, named
    as the engine's use, e.g. 'rollout'); shapes: a line for the report;
    lower: () -> jax's Lowered; rows, tokens: what it processes (FLOP
    accounting); loops: its decode loops (`DecodeLoop`).
    """

    part: str
    shapes: str
    lower: Callable[[], Any]
    rows: int
    tokens: int
    loops: tuple[DecodeLoop, ...] = ()


class Engine(Protocol):
    """What every rollout engine offers (`rollout.engine`; the registry is
    `engine.ENGINES`). An engine is built from the model config, a
    `SamplingConfig`, the mesh and the run's rollout settings (nothing that
    reads weights). For the same key every engine returns the same samples,
    to float rounding.

    Prompts are lists of token ids; params are the policy's (arrays, or
    ShapeDtypeStructs in their shardings where something is only lowered).
    """

    name: ClassVar[str]              # the `rollout.engine` value
    cfg: ModelConfig
    sampling: SamplingConfig
    sharding: Sharding | None
    num_traces: int                  # traces of its programs so far
    last_stats: dict                 # the last `sample`'s `rollout_stats`

    @classmethod
    def from_config(cls, cfg: ModelConfig, sampling: SamplingConfig, sharding: Sharding | None,
                    rollout: Any, rows_per_call: int) -> Engine:
        """The engine for a run: rollout, the run's `rollout` config section
        (the engine reads its own fields); rows_per_call, the rows of one
        static call (max_prompts_per_call, or the batch, x G)."""

    def batch_shape(self, num_prompts: int, longest_prompt: int) -> tuple[int, int]:
        """The padded (B', P) a call of these prompts runs at."""

    def prepare(self, prompts: Sequence[Sequence[int]]) -> tuple[np.ndarray, np.ndarray, int]:
        """Validated, left-padded prompts (`prompts.prepare_prompts`)."""

    def lower(self, params, num_prompts: int, longest_prompt: int) -> Any:
        """Its programs for a call at these shapes, lowered (jax's Lowered,
        or [(name, Lowered)] for an engine of several programs)."""

    def compile(self, params, num_prompts: int, longest_prompt: int) -> None:
        """Compile `lower`'s programs ahead of the first call."""

    def compile_sample(self, params, prompts: Sequence[Sequence[int]],
                       max_prompts: int = 0) -> None:
        """Compile what `sample(params, prompts, key, max_prompts)` runs."""

    def run(self, params, prompts: Sequence[Sequence[int]],
            rng: jax.Array) -> tuple[Rollout, int]:
        """(Rollout of device arrays over B' * G rows, the real rows B * G)."""

    def sample(self, params, prompts: Sequence[Sequence[int]], key: jax.Array,
               max_prompts: int = 0) -> Rollout:
        """A Rollout of numpy arrays over exactly len(prompts) * G rows on
        every host; chunk c of max_prompts prompts keyed fold_in(key, c).
        Sets `last_stats`."""

    def step_programs(self, params, num_prompts: int, longest_prompt: int,
                      max_prompts: int = 0, brief: bool = False) -> list[EngineProgram]:
        """The programs `sample` runs for num_prompts prompts of at most
        longest_prompt tokens in chunks of max_prompts, at their largest
        shapes (`train.programs`, `erpo plan`); brief: only the largest of
        each kind (an evaluation's)."""

    def plan_estimate(self, lengths: np.ndarray, num_prompts: int, longest_prompt: int,
                      max_prompts: int, run_ms: Callable[[str], float | None],
                      step_ms: Callable[[str], float | None],
                      step_cost: Callable[[str], tuple[float, float] | None] | None = None,
                      roofline_ms: Callable[[float, float], float] | None = None,
                      prompt_lengths: np.ndarray | None = None) -> dict | None:
        """`erpo plan`'s rollout time for samples of these response lengths
        (sample order): what the engine runs for them, costed by run_ms(part)
        (a call of `step_programs`' program `part`) and step_ms(key) (one step
        of its `DecodeLoop` `key`). For an engine whose compiled step leaves
        work out (a custom kernel's, counted from the engine's own book):
        step_cost(key), the compiled step's (FLOPs, HBM bytes), and
        roofline_ms(flops, bytes), the time of a step with the kernel's added;
        prompt_lengths: each prompt's tokens, for an engine whose cost depends
        on them. A dict with at least decode_steps, slot_utilization and
        estimated_ms; None when a cost is missing."""
