"""The embedded task: integer arithmetic with worked steps, for CPU RL runs.

Nothing is downloaded: a seeded generator makes problems whose text a tiny
character-level model (`char_tokenizer.CharTokenizer`, 55 ids) can learn by
SFT in minutes, and whose answers a checker reads exactly
(`erpo_jax.rewards.arithmetic_reward`).

Format (prompt, then solution; the model is trained on
``BOS + prompt + solution + EOS``):

    Q:23+58=?\\n        3+8=11;2+5+1=8;A:81
    Q:52-38=?\\n        12-8=4;5-3-1=1;A:14
    Q:47*6=?\\n         7*6=42;4*6+4=28;A:282
    Q:5+3*4=?\\n        3*4=12;5+2=7;0+1=1;A:17
    Q:(23+58)*4=?\\n    3+8=11;2+5+1=8;=81;1*4=4;8*4=32;A:324

Steps work column by column from the right, one ``;``-terminated step per
column, so each step is a one-digit fact plus the carry ("+1"), borrow
("1x-y-1") or product carry ("+4") read off the step before. ``=81;`` restates
an intermediate result. The final answer follows ``A:``.

Six held-out families play the six benchmarks: `add`, `sub` (a >= b), `mul`
(2-digit x 1-digit), `add_mul` (a+b*c), `paren_mul` ((a+b)*c) and `add_long`
(addition with one digit more than training: length generalisation). The
training mix is the first five at training lengths. `split` makes train and
test sets that never share a prompt.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, Sequence

import numpy as np

from erpo_jax.data.problem import Problem

TRAIN_MAX_DIGITS = 3  # add/sub operands have 1..3 digits in training
MAX_PROMPT_CHARS = 24
MAX_SOLUTION_CHARS = 48


def prompt_text(expr: str) -> str:
    return f"Q:{expr}=?\n"


# ----------------------------------------------------------------------------
# Column-wise step writers. Each returns (steps, value).


Slip = Callable[[], bool] | None


def _digits(n: int, width: int) -> list[int]:
    """Little-endian digits of n, zero-padded to width."""
    return [(n // 10**i) % 10 for i in range(width)]


def _value(digits: Sequence[int], carry: int) -> int:
    return sum(d * 10**i for i, d in enumerate(digits)) + carry * 10 ** len(digits)


def _add(a: int, b: int, slip: Slip = None) -> tuple[list[str], int]:
    """Column steps of a + b (a, b >= 0) and the value they spell. `slip()`, asked
    at each column a carry reaches, True drops that carry (a lost carry)."""
    width = max(len(str(a)), len(str(b)))
    steps, carry, out = [], 0, []
    for x, y in zip(_digits(a, width), _digits(b, width)):
        if carry and slip is not None and slip():
            carry = 0
        s = x + y + carry
        steps.append(f"{x}+{y}" + ("+1" if carry else "") + f"={s}")
        out.append(s % 10)
        carry = s // 10
    return steps, _value(out, carry)


def _sub(a: int, b: int, slip: Slip = None) -> tuple[list[str], int]:
    """Column steps of a - b (a >= b >= 0) and their value; `slip()` True drops a
    borrow owed to the column before (the borrow is taken but never repaid)."""
    if a < b:
        raise ValueError(f"sub_steps needs a >= b, got {a} - {b}")
    width = len(str(a))
    steps, borrow, out = [], 0, []
    for x, y in zip(_digits(a, width), _digits(b, width)):
        if borrow and slip is not None and slip():
            borrow = 0
        take = x - y - borrow < 0
        top = x + 10 if take else x
        steps.append(f"{top}-{y}" + ("-1" if borrow else "") + f"={top - y - borrow}")
        out.append(top - y - borrow)
        borrow = int(take)
    return steps, _value(out, 0)


def _mul(a: int, c: int, slip: Slip = None) -> tuple[list[str], int]:
    """Column steps of a * c (c one digit) and their value; `slip()` True drops the
    tens carried into a column."""
    if not 0 <= c <= 9:
        raise ValueError(f"mul_steps multiplies by one digit, got {c}")
    steps, carry, out = [], 0, []
    for x in _digits(a, len(str(a))):
        if carry and slip is not None and slip():
            carry = 0
        p = x * c + carry
        steps.append(f"{x}*{c}" + (f"+{carry}" if carry else "") + f"={p}")
        out.append(p % 10)
        carry = p // 10
    return steps, _value(out, carry)


def add_steps(a: int, b: int) -> list[str]:
    """Column steps of a + b (a, b >= 0): ``x+y[+1]=s`` from the right."""
    return _add(a, b)[0]


def sub_steps(a: int, b: int) -> list[str]:
    """Column steps of a - b (a >= b >= 0): ``[1]x-y[-1]=d`` from the right,
    a leading ``1`` on x marking a borrow taken by this column."""
    return _sub(a, b)[0]


def mul_steps(a: int, c: int) -> list[str]:
    """Column steps of a * c (c one digit): ``x*c[+k]=p`` from the right,
    k being the previous step's tens."""
    return _mul(a, c)[0]


def _problem(family: str, i: int, expr: str, value: int, steps: Sequence[str]) -> Problem:
    solution = ";".join([*steps, f"A:{value}"])
    return Problem(f"{family}/{i:06d}", prompt_text(expr), str(value), family, solution)


# ----------------------------------------------------------------------------
# Families: (rng, n) -> list[Problem].


def _operand(rng: np.random.Generator, ndigits: int) -> int:
    lo = 0 if ndigits == 1 else 10 ** (ndigits - 1)
    return int(rng.integers(lo, 10**ndigits))


def _operands(rng: np.random.Generator, min_digits: int, max_digits: int) -> tuple[int, int]:
    return tuple(_operand(rng, int(rng.integers(min_digits, max_digits + 1))) for _ in range(2))


def gen_add(rng, n, *, min_digits=1, max_digits=TRAIN_MAX_DIGITS, family="add"):
    """a + b, each operand 1..3 digits (by default)."""
    out = []
    for i in range(n):
        a, b = _operands(rng, min_digits, max_digits)
        out.append(_problem(family, i, f"{a}+{b}", a + b, add_steps(a, b)))
    return out


def gen_sub(rng, n, *, min_digits=1, max_digits=TRAIN_MAX_DIGITS):
    """a - b with a >= b, each operand 1..3 digits."""
    out = []
    for i in range(n):
        a, b = sorted(_operands(rng, min_digits, max_digits), reverse=True)
        out.append(_problem("sub", i, f"{a}-{b}", a - b, sub_steps(a, b)))
    return out


def gen_mul(rng, n):
    """a * c with a two digits and c in 2..9."""
    out = []
    for i in range(n):
        a, c = int(rng.integers(10, 100)), int(rng.integers(2, 10))
        out.append(_problem("mul", i, f"{a}*{c}", a * c, mul_steps(a, c)))
    return out


def gen_add_mul(rng, n):
    """a + b * c (precedence): a 1..2 digits, b and c one digit."""
    out = []
    for i in range(n):
        a = _operand(rng, int(rng.integers(1, 3)))
        b, c = int(rng.integers(1, 10)), int(rng.integers(1, 10))
        p = b * c
        steps = [f"{b}*{c}={p}", *add_steps(a, p)]
        out.append(_problem("add_mul", i, f"{a}+{b}*{c}", a + p, steps))
    return out


def gen_paren_mul(rng, n):
    """(a + b) * c: a, b 1..2 digits with a + b <= 99, c in 2..9."""
    out = []
    for i in range(n):
        while True:
            a, b = _operands(rng, 1, 2)
            if a + b <= 99:
                break
        c = int(rng.integers(2, 10))
        s = a + b
        steps = [*add_steps(a, b), f"={s}", *mul_steps(s, c)]
        out.append(_problem("paren_mul", i, f"({a}+{b})*{c}", s * c, steps))
    return out


def gen_add_long(rng, n):
    """Length generalisation: a + b with both operands one digit longer than
    anything in training (4 digits)."""
    d = TRAIN_MAX_DIGITS + 1
    return gen_add(rng, n, min_digits=d, max_digits=d, family="add_long")


Generator = Callable[[np.random.Generator, int], list[Problem]]

# The six held-out test families, in a fixed order (their seed streams depend on it).
TEST_FAMILIES: dict[str, Generator] = {
    "add": gen_add,
    "sub": gen_sub,
    "mul": gen_mul,
    "add_mul": gen_add_mul,
    "paren_mul": gen_paren_mul,
    "add_long": gen_add_long,
}
# The training mix: every family at training lengths, equal weights.
TRAIN_MIX: dict[str, float] = {"add": 1.0, "sub": 1.0, "mul": 1.0, "add_mul": 1.0, "paren_mul": 1.0}


# ----------------------------------------------------------------------------
# Slipped demonstrations: a reference that is often right, but not reliably.

_EXPR = {"add": r"(\d+)\+(\d+)", "sub": r"(\d+)-(\d+)", "mul": r"(\d+)\*(\d+)",
         "add_mul": r"(\d+)\+(\d+)\*(\d+)", "paren_mul": r"\((\d+)\+(\d+)\)\*(\d+)"}


def slipped(problem: Problem, rng: np.random.Generator, p: float) -> Problem:
    """`problem` whose worked solution drops each carry or borrow it has with
    probability p, every later step and the final answer following from the slip
    (a lost carry, a borrow never repaid). The gold answer stays the true value,
    so only what SFT imitates changes: trained on these, a model carries at a
    rate of about 1 - p, and with p > 1/2 its greedy answer is wrong on exactly
    the problems that need a carry, while sampling still finds the right one."""
    import re
    family = problem.source
    m = re.fullmatch(_EXPR.get(family, "$^") + r"=\?\n", problem.question[2:])
    if m is None:
        raise ValueError(f"slipped: {problem.id} is not a training-family problem "
                         f"({family!r}, {problem.question!r})")
    nums = [int(g) for g in m.groups()]
    slip = lambda: bool(rng.random() < p)
    if family == "add":
        steps, value = _add(*nums, slip)
    elif family == "sub":
        steps, value = _sub(*nums, slip)
    elif family == "mul":
        steps, value = _mul(*nums, slip)
    elif family == "add_mul":
        a, b, c = nums
        steps, value = _add(a, b * c, slip)
        steps = [f"{b}*{c}={b * c}", *steps]
    else:   # paren_mul
        a, b, c = nums
        first, total = _add(a, b, slip)
        then, value = _mul(total, c, slip)
        steps = [*first, f"={total}", *then]
    return dataclasses.replace(problem, solution=";".join([*steps, f"A:{value}"]))


# ----------------------------------------------------------------------------
# Train / test split.


@dataclasses.dataclass(frozen=True)
class ArithmeticSplits:
    train: list[Problem]
    test: dict[str, list[Problem]]  # family -> problems, unique prompts
    # training family -> validation problems (unique prompts, in neither train nor test)
    val: dict[str, list[Problem]] = dataclasses.field(default_factory=dict)


def _reid(p: Problem, split: str, i: int) -> Problem:
    return dataclasses.replace(p, id=f"{p.source}/{split}/{i:06d}")


def _unique_set(gen: Generator, rng: np.random.Generator, n: int, family: str,
                split_name: str = "test", exclude: frozenset[str] = frozenset()) -> list[Problem]:
    seen: dict[str, Problem] = {}
    for _ in range(50):
        for p in gen(rng, max(2 * (n - len(seen)), 16)):
            if len(seen) < n and p.question not in exclude:
                seen.setdefault(p.question, p)
        if len(seen) == n:
            return [_reid(p, split_name, i) for i, p in enumerate(seen.values())]
    knob = "n_test" if split_name == "test" else "n_val or n_test"
    raise ValueError(
        f"could not draw {n} distinct {family!r} {split_name} problems (got {len(seen)}); "
        f"the family has fewer distinct problems than that: lower {knob}"
    )


def check_disjoint(train: Sequence[Problem], test: Mapping[str, Sequence[Problem]]) -> None:
    """Raise ValueError if any test prompt also appears in `train`."""
    train_prompts = {p.question for p in train}
    for family, problems in test.items():
        shared = [p.question for p in problems if p.question in train_prompts]
        if shared:
            raise ValueError(
                f"{len(shared)} {family!r} test prompts also appear in training, e.g. {shared[0]!r}"
            )


def split(
    seed: int,
    n_train: int,
    n_test: int = 200,
    *,
    n_val: int = 0,
    train_mix: Mapping[str, float] = TRAIN_MIX,
    test_families: Sequence[str] = tuple(TEST_FAMILIES),
) -> ArithmeticSplits:
    """Seeded training set and held-out test sets that never share a prompt.

    The test sets come first, from their own seed stream (``[seed, 1, k]`` for
    the k-th family of `TEST_FAMILIES`), with distinct prompts; the training
    set is drawn from ``[seed, 0]`` and any draw whose prompt is in a test set
    is dropped and redrawn. Drawing test-first keeps every test set at its full
    size even for families with few distinct problems (`mul` has 720), which
    training would otherwise exhaust. Training may repeat a prompt.

    With `n_val` > 0, each training family also gets n_val validation
    problems (stream ``[seed, 3, k]``, drawn after the test sets and never
    sharing a prompt with them), which training then excludes as it excludes
    the test sets: problems of the training distribution to choose
    coefficients on without looking at the test sets. The test sets do not
    depend on n_val; the training set is the n_val = 0 one only when n_val = 0.

    Returns ArithmeticSplits; `check_disjoint` is asserted before returning.
    """
    unknown = [f for f in [*train_mix, *test_families] if f not in TEST_FAMILIES]
    if unknown:
        raise ValueError(f"unknown arithmetic families {unknown}; choose from {list(TEST_FAMILIES)}")
    test: dict[str, list[Problem]] = {}
    for k, family in enumerate(TEST_FAMILIES):
        if family in test_families:
            rng = np.random.default_rng([seed, 1, k])
            test[family] = _unique_set(TEST_FAMILIES[family], rng, n_test, family)
    held_out = {p.question for ps in test.values() for p in ps}
    val: dict[str, list[Problem]] = {}
    if n_val:
        for k, family in enumerate(TEST_FAMILIES):
            if family in train_mix:
                rng = np.random.default_rng([seed, 3, k])
                val[family] = _unique_set(TEST_FAMILIES[family], rng, n_val, family, "val",
                                          frozenset(held_out))
        held_out |= {p.question for ps in val.values() for p in ps}

    rng = np.random.default_rng([seed, 0])
    names = list(train_mix)
    weights = np.asarray([train_mix[f] for f in names], np.float64)
    counts = rng.multinomial(n_train, weights / weights.sum())
    train: list[Problem] = []
    for family, count in zip(names, counts):
        kept: list[Problem] = []
        for _ in range(100):
            if len(kept) >= count:
                break
            kept += [p for p in TEST_FAMILIES[family](rng, count - len(kept)) if p.question not in held_out]
        if len(kept) < count:
            raise ValueError(
                f"training family {family!r}: test sets hold out (almost) all of its problems; "
                "lower n_test"
            )
        train += kept[:count]
    order = rng.permutation(len(train))
    train = [_reid(train[j], "train", i) for i, j in enumerate(order)]
    check_disjoint(train, test)
    check_disjoint(train, val)
    return ArithmeticSplits(train, test, val)


def training_text(problem: Problem) -> str:
    """Prompt followed by solution: what SFT trains on (add BOS/EOS when encoding)."""
    if problem.solution is None:
        raise ValueError(f"problem {problem.id} has no solution to train on")
    return problem.question + problem.solution
