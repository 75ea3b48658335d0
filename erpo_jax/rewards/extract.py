"""Extract the final answer from a model response, as a string.

Extraction is pure string work (no sympy, no eval): it runs in the caller's
process and is bounded by `max_chars`. Deciding whether the extracted string
is *equal* to a gold answer is the verifier's job (`math_verify_pool.py`).

Order of preference (the first rule that finds something wins):

1. the last ``\\boxed{...}`` or ``\\fbox{...}`` with balanced braces
   (also the brace-less ``\\boxed 5`` form);
2. GSM8K style ``#### 42`` (the last one, up to the end of its line);
3. ``The answer is ...`` / ``answer is: ...`` (the last one, up to the end of
   its line, surrounding ``$`` and a trailing period removed);
4. the configured fallbacks, in order (e.g. ``"last_number"``).

Only the last `max_chars` characters of a response are looked at: final
answers sit at the end, and this keeps a 1 MB response as cheap as a short one.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Callable, Sequence

# Default window: long enough for any real final answer plus the text around
# it, short enough that every rule below is O(window) on hostile input.
DEFAULT_MAX_CHARS = 4096

_BOX_COMMANDS = ("\\boxed", "\\fbox")
_BRACE_RE = re.compile(r"[{}]")
_HASH_RE = re.compile(r"####[ \t]*([^\n]*)")
_ANSWER_IS_RE = re.compile(r"answer\s+is\s*:?[ \t]*([^\n]*)", re.IGNORECASE)
_NUMBER_RE = re.compile(r"-?\d{1,3}(?:,\d{3})+(?:\.\d+)?|-?\d+(?:\.\d+)?|-?\.\d+")
# How many `\boxed` occurrences (from the end) are tried before giving up: a
# response made of thousands of unclosed `\boxed{` would otherwise cost
# O(occurrences * window).
_MAX_BOX_CANDIDATES = 32


def to_text(response: str | bytes) -> str:
    """Decode a response to `str`; invalid UTF-8 becomes U+FFFD, never an error."""
    if isinstance(response, bytes | bytearray | memoryview):
        return bytes(response).decode("utf-8", errors="replace")
    if isinstance(response, str):
        return response
    raise TypeError(
        f"response must be str or bytes, got {type(response).__name__}; "
        "decode token ids with the tokenizer before scoring"
    )


def _balanced_group(text: str, open_pos: int) -> str | None:
    """Content of the brace group opening at `text[open_pos] == '{'`, or None.

    Iterative scan over braces only (regex jumps over other characters), so
    10^4 nested braces cost 2*10^4 steps and no recursion.
    """
    depth = 0
    for m in _BRACE_RE.finditer(text, open_pos):
        if m.group() == "{":
            depth += 1
        else:
            depth -= 1
            if depth == 0:
                return text[open_pos + 1 : m.start()]
    return None


def last_boxed(text: str) -> str | None:
    """Content of the last well-formed ``\\boxed{..}`` / ``\\fbox{..}`` in `text`.

    An unclosed last box (a truncated response) falls back to the previous
    well-formed one. Returns None when there is none.
    """
    starts = []
    for cmd in _BOX_COMMANDS:
        pos = text.rfind(cmd)
        tries = 0
        while pos != -1 and tries < _MAX_BOX_CANDIDATES:
            starts.append((pos, cmd))
            pos = text.rfind(cmd, 0, pos)
            tries += 1
    starts.sort(reverse=True)
    for pos, cmd in starts[:_MAX_BOX_CANDIDATES]:
        i = pos + len(cmd)
        if i < len(text) and text[i].isalpha():
            continue  # e.g. \boxedtext: another command, not a box
        j = i
        while j < len(text) and text[j] in " \t":
            j += 1
        if j < len(text) and text[j] == "{":
            content = _balanced_group(text, j)
            if content is not None:
                return content.strip()
        elif j > i:
            # `\boxed 5`: the argument is the next whitespace/`$`-delimited token.
            m = re.match(r"[^\s$]+", text[j:])
            if m:
                return m.group().strip()
    return None


def after_hashes(text: str) -> str | None:
    """GSM8K style: what follows the last ``####`` on its line, or None."""
    matches = _HASH_RE.findall(text)
    for value in reversed(matches):
        value = value.strip()
        if value:
            return value
    return None


def _strip_answer_decor(value: str) -> str:
    value = value.strip()
    value = value.rstrip(".").strip()
    if len(value) >= 2 and value.startswith("$") and value.endswith("$"):
        value = value.strip("$").strip()
    elif value.startswith("\\(") and value.endswith("\\)"):
        value = value[2:-2].strip()
    return value.rstrip(".").strip()


def after_answer_is(text: str) -> str | None:
    """What follows the last ``answer is`` / ``answer is:`` on its line, or None."""
    matches = _ANSWER_IS_RE.findall(text)
    for value in reversed(matches):
        value = _strip_answer_decor(value)
        if value:
            return value
    return None


def last_number(text: str) -> str | None:
    """The last number in `text` (``-1,234.5`` style), or None."""
    found = None
    for found in _NUMBER_RE.finditer(text):
        pass
    return None if found is None else found.group()


FALLBACKS: dict[str, Callable[[str], str | None]] = {
    "last_number": last_number,
}


@dataclasses.dataclass(frozen=True)
class ExtractConfig:
    """How final answers are found.

    max_chars: only the last `max_chars` characters are searched (None: all).
    use_boxed / use_hashes / use_answer_is: switch the standard rules.
    fallbacks: names from `FALLBACKS`, tried in order when no standard rule
      matched. Default none: an RL reward should pay for the asked-for format.
    """

    max_chars: int | None = DEFAULT_MAX_CHARS
    use_boxed: bool = True
    use_hashes: bool = True
    use_answer_is: bool = True
    fallbacks: Sequence[str] = ()

    def __post_init__(self):
        unknown = [f for f in self.fallbacks if f not in FALLBACKS]
        if unknown:
            raise ValueError(
                f"unknown extraction fallback(s) {unknown}; choose from {sorted(FALLBACKS)}"
            )
        if self.max_chars is not None and self.max_chars <= 0:
            raise ValueError(f"max_chars must be positive or None, got {self.max_chars}")


def extract_answer(response: str | bytes, config: ExtractConfig = ExtractConfig()) -> str | None:
    """The final answer of `response` as a string, or None if it gives none."""
    text = to_text(response)
    if config.max_chars is not None and len(text) > config.max_chars:
        text = text[-config.max_chars :]
    rules: list[Callable[[str], str | None]] = []
    if config.use_boxed:
        rules.append(last_boxed)
    if config.use_hashes:
        rules.append(after_hashes)
    if config.use_answer_is:
        rules.append(after_answer_is)
    rules.extend(FALLBACKS[name] for name in config.fallbacks)
    for rule in rules:
        value = rule(text)
        if value:
            return value
    return None
