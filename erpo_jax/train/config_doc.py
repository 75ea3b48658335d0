"""`erpo config --show`: every config field with its resolved value and its doc.

A field's doc is read from its section's source: the `name: ...` entry of the
section's docstring (continued by indented lines; `a, b: ...` documents both),
else the `# ...` comment lines just above the field or at the end of its line.
"""

from __future__ import annotations

import dataclasses
import inspect
import io
import re
import textwrap
import tokenize

from erpo_jax.rollout.engine import engine_name
from erpo_jax.train.config import RunConfig

_ENTRY = re.compile(r"^([A-Za-z_][A-Za-z0-9_]*(?:\s*,\s*[A-Za-z_][A-Za-z0-9_]*)*)\s*:\s*(.*)$")


def _docstring_entries(cls) -> dict[str, str]:
    """'name: text' entries of a section's docstring (indented lines continue one)."""
    doc = inspect.getdoc(cls) or ""
    out, names = {}, None
    for line in doc.splitlines():
        m = _ENTRY.match(line)
        if m and not line.startswith(" "):
            names = [n.strip() for n in m.group(1).split(",")]
            for n in names:
                out[n] = m.group(2).strip()
        elif names and line.startswith(" ") and line.strip():
            for n in names:
                out[n] = f"{out[n]} {line.strip()}"
        else:
            names = None
    return out


def _comment_entries(cls) -> dict[str, str]:
    """Comments above a field's line (a contiguous block) or at its end."""
    try:
        src = textwrap.dedent(inspect.getsource(cls))
    except (OSError, TypeError):
        return {}
    lines = src.splitlines()
    out = {}
    fields = {f.name for f in dataclasses.fields(cls)}
    for i, line in enumerate(lines):
        m = re.match(r"^\s+([A-Za-z_][A-Za-z0-9_]*)\s*:", line)
        if not m or m.group(1) not in fields or m.group(1) in out:
            continue
        above, j = [], i - 1
        while j >= 0 and lines[j].strip().startswith("#"):
            above.insert(0, lines[j].strip().lstrip("#").strip())
            j -= 1
        trailing = ""
        try:
            for tok in tokenize.generate_tokens(io.StringIO(line.strip() + "\n").readline):
                if tok.type == tokenize.COMMENT:
                    trailing = tok.string.lstrip("#").strip()
        except (tokenize.TokenError, IndentationError):
            pass
        text = " ".join(above + ([trailing] if trailing else []))
        if text:
            out[m.group(1)] = text
    return out


def field_docs(cls=RunConfig, prefix: str = "") -> dict[str, str]:
    """Dotted field name -> its doc ('' where the source says nothing)."""
    docs = {**_comment_entries(cls), **_docstring_entries(cls)}
    out = {}
    for f in dataclasses.fields(cls):
        name = f"{prefix}{f.name}"
        typ = f.type if isinstance(f.type, type) else None
        default = f.default if f.default is not dataclasses.MISSING else None
        section = type(default) if dataclasses.is_dataclass(default) else typ
        if section is not None and dataclasses.is_dataclass(section):
            out.update(field_docs(section, name + "."))
        else:
            out[name] = docs.get(f.name, "")
    return out


def _leaves(obj, prefix: str = ""):
    for f in dataclasses.fields(obj):
        v, name = getattr(obj, f.name), f"{prefix}{f.name}"
        if dataclasses.is_dataclass(v):
            yield from _leaves(v, name + ".")
        else:
            yield name, v


def show_lines(cfg: RunConfig, docs: bool = True) -> list[str]:
    """'section.field = value' for every field, each with its doc as a comment."""
    text = field_docs() if docs else {}
    lines, section = [], None
    for name, v in _leaves(cfg):
        head = name.split(".")[0] if "." in name else ""
        if head != section:
            section = head
            lines.append(f"# [{head or 'run'}]")
        value = list(v) if isinstance(v, tuple) else v
        line = f"{name} = {value!r}"
        if name == "rollout.engine" and v == "auto":
            line += f"   (resolves to {engine_name(cfg)!r})"
        if text.get(name):
            doc = text[name].replace("\b", "\\b")   # '\boxed' in a docstring that is not raw
            line += f"   # {doc}"
        lines.append(line)
    return lines
