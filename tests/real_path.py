"""A tiny real-path fixture, built here (no download): a byte-level BPE
tokenizer in Hugging Face format with a Qwen2.5-style chat template and a
generation_config.json, a Qwen2.5-architecture checkpoint saved by
transformers, and a math JSONL of arithmetic word problems with GSM8K-style
worked answers (``... #### 7``)."""

from __future__ import annotations

import json
import random
from pathlib import Path

# Qwen2.5's layout: a default system turn, then <|im_start|>role\ncontent<|im_end|>\n
# per message, and the assistant header as the generation prompt.
CHAT_TEMPLATE = (
    "{%- if messages[0]['role'] == 'system' -%}"
    "{{ '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}"
    "{%- set rest = messages[1:] -%}"
    "{%- else -%}"
    "{{ '<|im_start|>system\\nYou are a helpful assistant.<|im_end|>\\n' }}"
    "{%- set rest = messages -%}"
    "{%- endif -%}"
    "{%- for m in rest -%}"
    "{{ '<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>\\n' }}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{ '<|im_start|>assistant\\n' }}{%- endif -%}"
)
SPECIALS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
NAMES = ("Tom", "Ana", "Sam", "Mia")
ITEMS = ("apples", "books", "coins", "pens")


def word_problems(n: int, seed: int = 0, max_operand: int = 4) -> list[dict]:
    """`n` addition word problems with GSM8K-style answers (a + b, operands in
    [1, max_operand])."""
    rng = random.Random(seed)
    rows = []
    for i in range(n):
        a, b = rng.randint(1, max_operand), rng.randint(1, max_operand)
        name, item = rng.choice(NAMES), rng.choice(ITEMS)
        rows.append({"id": i,
                     "question": f"{name} has {a} {item} and gets {b} more. "
                                 f"How many {item} does {name} have?",
                     "answer": f"{name} has {a} + {b} = <<{a}+{b}={a + b}>>{a + b} {item}.\n"
                               f"#### {a + b}"})
    return rows


def write_jsonl(rows: list[dict], path: Path) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def benchmark_questions(root: Path, per_set: int = 40) -> list[str]:
    """Questions of the six benchmark files (the BPE's training text)."""
    from erpo_jax.data.benchmarks import BENCHMARKS, load_benchmark
    return [p.question for name in BENCHMARKS for p in load_benchmark(name, root).problems[:per_set]]


def build_tokenizer(out_dir: Path, texts: list[str], vocab_size: int = 512):
    """A byte-level BPE trained on `texts`, saved as a transformers fast tokenizer."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast
    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=list(SPECIALS),
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    bpe.train_from_iterator(texts, trainer)
    tok = PreTrainedTokenizerFast(tokenizer_object=bpe, eos_token="<|im_end|>",
                                  pad_token="<|endoftext|>", chat_template=CHAT_TEMPLATE,
                                  additional_special_tokens=["<|im_start|>"])
    tok.save_pretrained(str(out_dir))
    return tok


def write_generation_config(out_dir: Path, tok) -> None:
    """Qwen's stop ids: <|im_end|> (the turn end) and <|endoftext|>."""
    ids = [tok.convert_tokens_to_ids(t) for t in ("<|im_end|>", "<|endoftext|>")]
    (out_dir / "generation_config.json").write_text(json.dumps(
        {"eos_token_id": ids, "pad_token_id": ids[1], "do_sample": False}))


def build_model(out_dir: Path, vocab_size: int, seed: int = 0):
    """A random Qwen2.5-architecture model (q/k/v bias, GQA, tied embeddings),
    saved with save_pretrained."""
    import torch
    import transformers as tf
    torch.manual_seed(seed)
    cfg = tf.Qwen2Config(vocab_size=vocab_size, hidden_size=64, intermediate_size=128,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                         max_position_embeddings=2048, rms_norm_eps=1e-6, rope_theta=10000.0,
                         tie_word_embeddings=True, use_sliding_window=False)
    model = tf.Qwen2ForCausalLM(cfg).float().eval()
    model.save_pretrained(str(out_dir), safe_serialization=True)
    return model


def build_checkpoint(out_dir: Path, benchmarks_dir: Path, problems: list[dict]) -> Path:
    """Tokenizer + model in one directory, as a downloaded checkpoint would be."""
    out_dir.mkdir(parents=True, exist_ok=True)
    texts = benchmark_questions(benchmarks_dir) + [r["question"] + "\n" + r["answer"]
                                                   for r in problems]
    # The template's and instruction's words, often enough to become merges.
    texts += 50 * ["Please reason step by step, and put your final answer within \\boxed{}. "
                   "The answer is \\boxed{12}. system user assistant You are a helpful "
                   "assistant."]
    tok = build_tokenizer(out_dir, texts)
    build_model(out_dir, vocab_size=-(-len(tok) // 64) * 64)
    write_generation_config(out_dir, tok)   # after save_pretrained, which writes its own
    return out_dir
