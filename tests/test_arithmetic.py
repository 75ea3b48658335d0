"""Tests for the embedded arithmetic task and its character tokenizer."""

import re

import numpy as np
import pytest

from erpo_jax.data import arithmetic as ar
from erpo_jax.data.char_tokenizer import ALPHABET, CharTokenizer
from erpo_jax.rewards.arithmetic_reward import arithmetic_rewards

PROMPT_RE = {
    "add": re.compile(r"Q:(\d+)\+(\d+)=\?\n"),
    "add_long": re.compile(r"Q:(\d{4})\+(\d{4})=\?\n"),
    "sub": re.compile(r"Q:(\d+)-(\d+)=\?\n"),
    "mul": re.compile(r"Q:(\d\d)\*(\d)=\?\n"),
    "add_mul": re.compile(r"Q:(\d+)\+(\d)\*(\d)=\?\n"),
    "paren_mul": re.compile(r"Q:\((\d+)\+(\d+)\)\*(\d)=\?\n"),
}
STEP_RE = re.compile(r"(\d+)([+*-])(\d+)(?:([+-])(\d+))?=(\d+)")


def _expected(p):
    """The answer recomputed with Python integers from the prompt's operands."""
    m = PROMPT_RE[p.source].fullmatch(p.question)
    assert m, (p.source, p.question)
    x = [int(g) for g in m.groups()]
    return {
        "add": lambda: x[0] + x[1],
        "add_long": lambda: x[0] + x[1],
        "sub": lambda: x[0] - x[1],
        "mul": lambda: x[0] * x[1],
        "add_mul": lambda: x[0] + x[1] * x[2],
        "paren_mul": lambda: (x[0] + x[1]) * x[2],
    }[p.source]()


def _check_steps(solution):
    """Every step is a true one-line fact."""
    *steps, final = solution.split(";")
    assert final.startswith("A:")
    for step in steps:
        if step.startswith("="):
            assert step[1:].isdigit()
            continue
        m = STEP_RE.fullmatch(step)
        assert m, step
        a, op, b, op2, c, result = m.groups()
        value = {"+": int(a) + int(b), "-": int(a) - int(b), "*": int(a) * int(b)}[op]
        if op2:
            value = value + int(c) if op2 == "+" else value - int(c)
        assert value == int(result), step


@pytest.fixture(scope="module")
def splits():
    return ar.split(seed=7, n_train=3000, n_test=100)


def test_split_is_deterministic_and_seeded(splits):
    again = ar.split(seed=7, n_train=3000, n_test=100)
    assert again == splits
    other = ar.split(seed=8, n_train=3000, n_test=100)
    assert [p.question for p in other.train] != [p.question for p in splits.train]
    assert [p.question for p in other.test["add"]] != [p.question for p in splits.test["add"]]
    rng_a, rng_b = np.random.default_rng(3), np.random.default_rng(3)
    for gen in ar.TEST_FAMILIES.values():
        assert gen(rng_a, 20) == gen(rng_b, 20)


def test_no_train_test_overlap(splits):
    train_prompts = {p.question for p in splits.train}
    assert set(splits.test) == set(ar.TEST_FAMILIES)
    for family, problems in splits.test.items():
        assert len(problems) == 100
        prompts = [p.question for p in problems]
        assert len(set(prompts)) == len(prompts), f"{family}: duplicate test prompts"
        assert not train_prompts & set(prompts), family
        assert all(p.source == family for p in problems)
    # mul has 720 distinct problems: training would cover them all without hold-out.
    big = ar.split(seed=1, n_train=5000, n_test=200, train_mix={"mul": 1.0}, test_families=["mul"])
    assert len(big.test["mul"]) == 200 and len(big.train) == 5000
    ar.check_disjoint(big.train, big.test)
    with pytest.raises(ValueError, match="also appear in training"):
        ar.check_disjoint(big.train, {"mul": big.train[:1]})
    with pytest.raises(ValueError, match="lower n_test"):
        ar.split(seed=0, n_train=10, n_test=800, test_families=["mul"])


def test_training_mix_lengths_and_families(splits):
    counts = {f: sum(p.source == f for p in splits.train) for f in ar.TRAIN_MIX}
    assert all(400 < c < 800 for c in counts.values()), counts
    assert not any(p.source == "add_long" for p in splits.train)
    assert len({p.id for p in splits.train}) == len(splits.train)
    for p in splits.train:
        assert len(p.question) <= ar.MAX_PROMPT_CHARS and len(p.solution) <= ar.MAX_SOLUTION_CHARS, p
    max_train_digits = max(len(d) for p in splits.train for d in re.findall(r"\d+", p.question))
    assert max_train_digits == ar.TRAIN_MAX_DIGITS
    assert all(len(d) == ar.TRAIN_MAX_DIGITS + 1 for p in splits.test["add_long"]
               for d in re.findall(r"\d+", p.question))


def test_every_solution_is_right(splits):
    problems = splits.train + [p for ps in splits.test.values() for p in ps]
    edge = [
        ar._problem("add", 0, "999+1", 1000, ar.add_steps(999, 1)),
        ar._problem("sub", 0, "100-1", 99, ar.sub_steps(100, 1)),
        ar._problem("sub", 0, "5-5", 0, ar.sub_steps(5, 5)),
        ar._problem("mul", 0, "99*9", 891, ar.mul_steps(99, 9)),
    ]
    for p in problems + edge:
        want = _expected(p)
        assert p.answer == str(want), p
        assert p.solution.endswith(f"A:{want}"), p
        _check_steps(p.solution)
    rewards, reasons = arithmetic_rewards([(p.solution, p.answer) for p in problems])
    assert rewards.sum() == len(problems) and set(reasons) == {"correct"}


def test_checker_is_exact(splits):
    p = splits.test["add"][0]
    n = int(p.answer)
    pairs = [
        (p.solution, p.answer),
        (p.solution.replace(f"A:{n}", f"A:{n + 1}"), p.answer),
        (p.solution.replace(f"A:{n}", f"A:{n}.0"), p.answer),
        (p.solution.replace(f"A:{n}", f"A:{p.question[2:-3]}"), p.answer),  # the expression itself
        (p.solution.replace(f"A:{n}", "A:"), p.answer),
    ]
    _, reasons = arithmetic_rewards(pairs)
    assert reasons == ["correct", "wrong", "no_answer", "no_answer", "no_answer"]


def test_tokenizer_round_trip(splits):
    tok = CharTokenizer()
    assert tok.vocab_size == 3 + len(ALPHABET) < 64
    assert (tok.pad_id, tok.bos_id, tok.eos_id) == (0, 1, 2) == (tok.pad_token_id, tok.bos_token_id, tok.eos_token_id)
    texts = [ar.training_text(p) for p in splits.train[:64]]
    for t in texts:
        ids = tok.encode(t, add_bos=True, add_eos=True)
        assert ids[0] == tok.bos_id and ids[-1] == tok.eos_id and 0 not in ids
        assert tok.decode(ids) == t
    batch = tok.encode_batch(texts, add_bos=True, add_eos=True)
    assert batch.dtype == np.int32 and batch.shape[0] == 64
    assert tok.batch_decode(batch) == texts
    # After EOS everything is dropped (stop_at_eos) or kept (not).
    junk = np.array([tok.encode("A:12", add_bos=True, add_eos=True) + tok.encode("99")])
    assert tok.batch_decode(junk) == ["A:12"]
    assert tok.batch_decode(junk, stop_at_eos=False) == ["A:1299"]
    left = tok.encode_batch(["Q:1+1=?\n", "Q:12+13=?\n"], pad_left=True)
    assert left[0, 0] == tok.pad_id and tok.batch_decode(left) == ["Q:1+1=?\n", "Q:12+13=?\n"]
    assert tok.batch_decode(np.zeros((2, 0), np.int32)) == ["", ""]


def test_tokenizer_errors():
    tok = CharTokenizer()
    with pytest.raises(ValueError, match=r"'\$' at position 3"):
        tok.encode("Q:1$")
    with pytest.raises(ValueError, match="outside"):
        tok.batch_decode(np.array([[3, tok.vocab_size]]))
    with pytest.raises(ValueError, match="shape"):
        tok.batch_decode(np.array([3, 4]))
    with pytest.raises(ValueError, match="needs 6 tokens"):
        tok.encode_batch(["Q:1+1"], length=4)


def _columns(n, width):
    return [(n // 10 ** i) % 10 for i in range(width)]


def _all_slipped(p):
    """The answer column arithmetic gives when every carry and borrow that reaches
    a column is dropped, from the operands (add, sub, mul)."""
    x, y = (int(g) for g in PROMPT_RE[p.source].fullmatch(p.question).groups())
    w = max(len(str(x)), len(str(y)))
    if p.source == "add":
        cols = [a + b for a, b in zip(_columns(x, w), _columns(y, w))]
        return sum(c % 10 * 10 ** i for i, c in enumerate(cols)) + cols[-1] // 10 * 10 ** w
    if p.source == "sub":
        cols = [(a - b) % 10 for a, b in zip(_columns(x, len(str(x))), _columns(y, len(str(x))))]
        return sum(c * 10 ** i for i, c in enumerate(cols))
    cols = [a * y for a in _columns(x, len(str(x)))]
    return sum(c % 10 * 10 ** i for i, c in enumerate(cols)) + cols[-1] // 10 * 10 ** len(cols)


def test_slipped_demonstrations(splits):
    rng = np.random.default_rng(0)
    train = splits.train
    # p = 0 is the exact solution; the gold answer never changes.
    assert all(ar.slipped(p, rng, 0.0) == p for p in train)
    every = [ar.slipped(p, rng, 1.0) for p in train]
    for p, q in zip(train, every):
        assert (q.question, q.answer) == (p.question, p.answer)
        _check_steps(q.solution)     # each step is still a true fact; only a carry is lost
        if p.source in ("add", "sub", "mul"):
            assert q.solution.endswith(f"A:{_all_slipped(p)}"), (p.question, q.solution)
    assert ar.slipped(ar._problem("add", 0, "58+23", 81, ar.add_steps(58, 23)), rng,
                      1.0).solution == "8+3=11;5+2=7;A:71"
    assert ar.slipped(ar._problem("paren_mul", 0, "(5+9)*6", 84, []), rng,
                      1.0).solution == "5+9=14;=14;4*6=24;1*6=6;A:64"
    # Each carry is lost independently with probability p: among additions with
    # one carry, the fraction with a wrong answer is p (within 4 standard errors).
    one = [p for p in train if p.source == "add" and p.solution.count("+1") == 1]
    wrong = np.mean([ar.slipped(p, rng, 0.3).solution != p.solution for p in one])
    assert abs(wrong - 0.3) < 4 * np.sqrt(0.3 * 0.7 / len(one)), (wrong, len(one))
    with pytest.raises(ValueError, match="not a training-family problem"):
        ar.slipped(splits.test["add_long"][0], rng, 0.5)


def test_sft_slip_changes_only_the_demonstrations():
    from erpo_jax.train.config import RunConfig, apply_overrides, validate
    from erpo_jax.train.tasks import load_task, load_tokenizer
    base = apply_overrides(RunConfig(), ["data.n_train=400", "data.n_test=4"])
    exact = load_task(base, load_tokenizer(None))
    slip = load_task(apply_overrides(base, ["data.sft_slip=0.6"]), load_tokenizer(None))
    assert [(p.question, p.answer) for p in slip.train] == [(p.question, p.answer)
                                                            for p in exact.train]
    assert slip.train_prompts == exact.train_prompts and slip.eval_sets == exact.eval_sets
    changed = sum(a.solution != b.solution for a, b in zip(slip.train, exact.train))
    assert 0 < changed < len(exact.train)
    for bad, match in (("data.sft_slip=1.5", "data.sft_slip.*probability"),
                       ("data.task=jsonl", "data.sft_slip.*set it to 0")):
        with pytest.raises(ValueError, match=match):
            validate(apply_overrides(base, ["data.sft_slip=0.5", bad, "data.train_file=x"]))


def test_validation_split_is_apart_from_train_and_test():
    from erpo_jax.train.config import RunConfig, apply_overrides, validate
    from erpo_jax.train.tasks import load_task, load_tokenizer
    plain = ar.split(seed=3, n_train=3000, n_test=50)
    held = ar.split(seed=3, n_train=3000, n_test=50, n_val=40)
    assert held.test == plain.test and plain.val == {}   # the test sets do not move
    assert list(held.val) == list(ar.TRAIN_MIX)           # training families only
    test_prompts = {p.question for ps in held.test.values() for p in ps}
    for family, problems in held.val.items():
        prompts = [p.question for p in problems]
        assert len(problems) == 40 and len(set(prompts)) == 40, family
        assert not set(prompts) & test_prompts, family
        assert all(p.source == family and "/val/" in p.id for p in problems), family
    ar.check_disjoint(held.train, held.val)
    assert len(held.train) == 3000
    # mul has 720 distinct problems, of which test + validation take 90 here.
    val_mul = {p.question for p in held.val["mul"]}
    assert not val_mul & {p.question for p in held.train}
    with pytest.raises(ValueError, match="distinct 'mul' val problems.*lower n_val"):
        ar.split(seed=0, n_train=10, n_test=400, n_val=400, test_families=["mul"])

    # Through the config: the SFT and RL runs train without the validation problems, and
    # train.eval_split='validation' evaluates (and measures drift) on them, never the test sets.
    base = apply_overrides(RunConfig(), ["data.n_train=2000", "data.n_test=30", "data.n_val=20"])
    tok = load_tokenizer(None)
    on_test, on_val = load_task(base, tok), load_task(
        apply_overrides(base, ["train.eval_split=validation"]), tok)
    assert on_test.train == on_val.train and set(on_test.eval_sets) == set(ar.TEST_FAMILIES)
    assert on_val.eval_sets == {f"val_{f}": ps for f, ps in ar.split(
        0, 2000, 30, n_val=20).val.items()}
    assert {p.question for p in on_val.drift_set} <= {
        p.question for ps in on_val.eval_sets.values() for p in ps}
    for bad, match in (("train.eval_split=validation data.n_val=0", "data.n_val=0 holds out"),
                       ("train.eval_split=dev", "train.eval_split.*'test' or 'validation'"),
                       ("data.n_val=-1", "data.n_val.*>= 0")):
        with pytest.raises(ValueError, match=match):
            validate(apply_overrides(base, bad.split()))
