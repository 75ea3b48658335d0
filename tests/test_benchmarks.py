"""Tests for erpo_jax/data/benchmarks.py and templates.py against the published files."""

import json
import pytest

from erpo_jax.data import benchmarks as bm
from erpo_jax.data.templates import DEFAULT_INSTRUCTION, chat_prompt, format_prompt, plain_prompt
from benchmark_files import benchmarks_dir, require


ROOT = benchmarks_dir()


@pytest.fixture(scope="module")
def benchmark_root():
    return require(ROOT)


# A test that reads the files: fails in CI when they are missing, else skips.
needs_data = pytest.mark.usefixtures("benchmark_root")

PUBLISHED_ROWS = {
    "gsm8k": 1319,
    "math500": 500,
    "aime24": 30,
    "amc23": 40,
    "minerva_math": 272,
    "olympiadbench": 675,
}


@pytest.fixture(scope="module")
def loaded(benchmark_root):
    return bm.load_all_benchmarks(benchmark_root)


@needs_data
def test_published_row_counts_and_every_row_has_gold(loaded):
    assert set(loaded) == set(PUBLISHED_ROWS)
    for name, want in PUBLISHED_ROWS.items():
        problems, skipped = loaded[name]
        assert (len(problems), skipped) == (want, 0), name
        assert bm.BENCHMARKS[name].rows == want
        assert all(p.answer.strip() and p.question.strip() for p in problems), name
        assert all(p.source == name for p in problems)
        assert len({p.id for p in problems}) == want, f"{name}: ids not unique"


def _raw_rows(name):
    with open(ROOT / bm.BENCHMARKS[name].path, encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


@needs_data
def test_spot_checked_golds(loaded):
    gsm = loaded["gsm8k"].problems
    assert gsm[0].answer == "18" and gsm[0].question.startswith("Janet")
    assert gsm[2].answer == "70000"  # '70,000' style commas are stripped
    assert all("," not in p.answer for p in gsm)
    assert loaded["amc23"].problems[0].answer == "27"
    assert loaded["amc23"].problems[15].answer == "-1"
    assert loaded["aime24"].problems[0].answer == "204"
    m5 = loaded["math500"].problems
    assert m5[0].answer == r"\left( 3, \frac{\pi}{2} \right)"
    assert m5[2].answer == r"\frac{14}{3}"
    assert loaded["minerva_math"].problems[0].answer == "1.6"
    ob = loaded["olympiadbench"].problems
    assert ob[1].answer == r"\frac{1}{2 n+2}" and ob[2].answer == "2^{1009}"
    assert all("$" not in p.answer.replace(r"\$", "") for p in ob)


@needs_data
def test_golds_agree_with_a_second_reading_of_the_raw_rows(loaded):
    # math500 stores the gold twice: last \boxed{} and after "The answer is: ".
    for p, row in zip(loaded["math500"].problems, _raw_rows("math500")):
        tail = row["answer"].rsplit("The answer is: ", 1)[1].strip()
        assert p.answer.replace(" ", "") == tail.replace(" ", ""), p.id
    for p, row in zip(loaded["gsm8k"].problems, _raw_rows("gsm8k")):
        assert float(p.answer) == float(row["answer"].split("####")[-1].replace(",", ""))
    for p, row in zip(loaded["amc23"].problems, _raw_rows("amc23")):
        assert float(p.answer) == row["answer"]


def test_gold_readers():
    assert bm.gsm8k_gold("x\n#### 1,234") == "1234"
    assert bm.number_gold(27.0) == "27" and bm.number_gold(2.5) == "2.5" and bm.number_gold(-3) == "-3"
    assert bm.math500_gold("no box. The answer is: 7") == "7"
    assert bm.boxed_gold(r"so \boxed{\frac{a}{b}} \mathrm{~cm}") == r"\frac{a}{b}"
    assert bm.olympiad_gold(["$1$", "$2$"]) == "1, 2"
    for reader, bad in ((bm.gsm8k_gold, "no marker"), (bm.number_gold, None), (bm.boxed_gold, r"\boxed{1"),
                        (bm.olympiad_gold, []), (bm.number_gold, float("nan"))):
        with pytest.raises(ValueError):
            reader(bad)


def _write_jsonl(path, rows):
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))


def test_bad_row_error_names_file_and_line(tmp_path):
    path = tmp_path / "mini" / "test.jsonl"
    path.parent.mkdir()
    rows = [
        {"q": "one?", "a": "#### 1"},
        {"q": "two?", "a": "#### 2"},
        {"q": "three?"},  # line 3: no answer field
        {"q": "four?", "a": "no marker"},  # line 4: gold can't be read
        "{not json",  # line 5
        {"q": "six?", "a": "#### 6"},
    ]
    _write_jsonl(path, rows)
    with pytest.raises(bm.BadRowError, match=rf"{path}:3: missing field 'a'"):
        bm.load_jsonl(path, "q", "a", bm.gsm8k_gold)
    problems, skipped = bm.load_jsonl(path, "q", "a", bm.gsm8k_gold, skip_bad_rows=True)
    assert skipped == 3
    assert [p.answer for p in problems] == ["1", "2", "6"]
    assert [p.id for p in problems] == ["mini/0", "mini/1", "mini/2"]
    _write_jsonl(path, rows[:2] + rows[3:4])
    with pytest.raises(bm.BadRowError, match=rf"{path}:3: .*####"):
        bm.load_jsonl(path, "q", "a", bm.gsm8k_gold)


@needs_data
def test_missing_paths_and_names_give_clear_errors(tmp_path, monkeypatch):
    with pytest.raises(FileNotFoundError, match="does not exist"):
        bm.load_benchmark("gsm8k", tmp_path)
    with pytest.raises(KeyError, match="unknown benchmark 'gsm9k'"):
        bm.load_benchmark("gsm9k", ROOT)
    monkeypatch.delenv(bm.BENCHMARKS_DIR_ENV, raising=False)
    with pytest.raises(ValueError, match=bm.BENCHMARKS_DIR_ENV):
        bm.load_benchmark("amc23")
    monkeypatch.setenv(bm.BENCHMARKS_DIR_ENV, str(ROOT))
    assert len(bm.load_benchmark("amc23").problems) == 40


def test_gsm8k_tfds_absent_says_where_and_how(tmp_path):
    with pytest.raises(FileNotFoundError) as e:
        bm.load_gsm8k_tfds(tmp_path / "tfds")
    msg = str(e.value)
    assert str(tmp_path / "tfds" / "gsm8k") in msg and "tfds build gsm8k" in msg
    assert not (tmp_path / "tfds").exists()  # nothing was downloaded or created


def test_templates():
    q = "What is 1+1?"
    assert plain_prompt(q) == f"{q}\n{DEFAULT_INSTRUCTION}\n"
    assert plain_prompt(q, None, prefix="Q: ") == "Q: What is 1+1?\n"
    assert format_prompt(q, "plain", instruction="Go.") == f"{q}\nGo.\n"
    with pytest.raises(ValueError, match="unknown prompt template"):
        format_prompt(q, "chatml")

    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel
    from transformers import PreTrainedTokenizerFast

    tok = PreTrainedTokenizerFast(tokenizer_object=Tokenizer(WordLevel({"[UNK]": 0}, unk_token="[UNK]")))
    with pytest.raises(ValueError, match="no chat template"):
        chat_prompt(q, tok)
    tok.chat_template = (
        "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}<|end|>{% endfor %}"
        "{% if add_generation_prompt %}<|assistant|>{% endif %}"
    )
    assert chat_prompt(q, tok) == f"<|user|>{q}\n{DEFAULT_INSTRUCTION}<|end|><|assistant|>"
    assert format_prompt(q, "chat", tokenizer=tok, instruction=None, system="S") == (
        f"<|system|>S<|end|><|user|>{q}<|end|><|assistant|>"
    )


def test_missing_benchmark_files_fail_in_ci_and_skip_with_a_reason_outside(tmp_path,
                                                                          monkeypatch):
    missing = tmp_path / "nowhere" / "gsm8k.jsonl"
    for env in ({"CI": "1"}, {bm.BENCHMARKS_DIR_ENV: str(tmp_path / "nowhere")}):
        monkeypatch.delenv("CI", raising=False)
        monkeypatch.delenv(bm.BENCHMARKS_DIR_ENV, raising=False)
        for k, v in env.items():
            monkeypatch.setenv(k, v)
        with pytest.raises(pytest.fail.Exception, match=f"benchmark file {missing} not found.*"
                                                        "expected in"):
            require(missing)
    monkeypatch.delenv("CI", raising=False)
    monkeypatch.delenv(bm.BENCHMARKS_DIR_ENV, raising=False)
    with pytest.raises(pytest.skip.Exception, match=f"{missing} not found.*outside CI"):
        require(missing)
    assert require(tmp_path) == tmp_path
