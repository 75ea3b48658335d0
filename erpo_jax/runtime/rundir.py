"""The files of a run directory, on a local disk or on gs:// (through etils.epath).

A run directory holds config.json (plus config_history.jsonl, one line per
start), metrics.jsonl and evals.jsonl (one JSON row per step), eval_<step>.json,
the final model and orbax's checkpoints/. Every write here survives an
interruption at any instant:

- rewrites are atomic: a temp file in the same directory, flushed and fsynced,
  then renamed over the old one (an object store writes an object whole);
- an appended row is one write; when that write fails (a full disk) the file is
  cut back to where it was, and when the process dies mid-write the torn last
  line is skipped by every reader here, with a warning;
- on resume, `keep_steps` rewrites a per-step file to the rows the checkpoint
  covers, so every step appears exactly once.
"""

from __future__ import annotations

import dataclasses
import json
import os
import uuid
import warnings
from typing import Any, Callable

from etils import epath

REMOTE_PREFIXES = ("gs://", "s3://", "az://")


def path(p: Any) -> epath.Path:
    return epath.Path(p)


def is_remote(p: Any) -> bool:
    return str(p).startswith(REMOTE_PREFIXES)


def write_atomic(p: Any, data: str | bytes) -> None:
    """Replace file `p` by `data` so a reader sees the old or the new file, never a mix."""
    p = path(p)
    data = data.encode() if isinstance(data, str) else data
    p.parent.mkdir(parents=True, exist_ok=True)
    if is_remote(p):   # an object is written whole when its upload closes
        p.write_bytes(data)
        return
    tmp = p.parent / f".{p.name}.tmp-{uuid.uuid4().hex[:8]}"
    try:
        with open(os.fspath(tmp), "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(os.fspath(tmp), os.fspath(p))
    except BaseException:
        if os.path.exists(os.fspath(tmp)):
            os.remove(os.fspath(tmp))
        raise
    _fsync_dir(p.parent)


def _fsync_dir(d: epath.Path) -> None:
    try:
        fd = os.open(os.fspath(d), os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def append_line(p: Any, row: dict) -> None:
    """Append one JSON row to `p`; on failure the file is left as it was."""
    p = path(p)
    line = (json.dumps(row) + "\n").encode()
    if is_remote(p):   # objects cannot be appended to: rewrite the whole (small) file
        old = p.read_bytes() if p.exists() else b""
        write_atomic(p, old + line)
        return
    with open(os.fspath(p), "ab") as f:
        size = f.tell()
        try:
            f.write(line)
            f.flush()
        except BaseException:
            f.truncate(size)
            raise


def read_jsonl(p: Any, warn: bool = True) -> list[dict]:
    """The rows of a JSONL file ([] if absent). A torn last line (an interrupted
    write) is skipped with a warning; a bad line before the last one raises."""
    p = path(p)
    if not p.exists():
        return []
    lines = p.read_bytes().decode(errors="replace").split("\n")
    rows = []
    for i, line in enumerate(lines):
        if not line.strip():
            continue
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError:
            if any(x.strip() for x in lines[i + 1:]):
                raise ValueError(f"line {i + 1} of {p} is not JSON and is not the last line; "
                                 "the file is corrupt: delete that line and retry.") from None
            if warn:
                warnings.warn(f"{p}: ignored a torn last line ({len(line)} bytes, left by an "
                              "interrupted write).", stacklevel=2)
    return rows


def keep_steps(p: Any, keep: Callable[[int], bool]) -> int:
    """Rewrite the per-step file `p` (atomically) with the rows whose step `keep`
    accepts, the first row of each step only. Returns how many rows were dropped."""
    p = path(p)
    if not p.exists():
        return 0
    rows, seen, out = read_jsonl(p), set(), []
    for r in rows:
        s = r.get("step")
        if isinstance(s, int) and keep(s) and s not in seen:
            seen.add(s)
            out.append(r)
    raw = p.read_bytes()
    new = "".join(json.dumps(r) + "\n" for r in out).encode()
    if new != raw:
        write_atomic(p, new)
    return len(rows) - len(out)


def read_json(p: Any) -> Any:
    return json.loads(path(p).read_text())


def write_json(p: Any, obj: Any, **kw) -> None:
    write_atomic(p, json.dumps(obj, **kw))


# ----------------------------------------------------------------------------- the config


# Fields a resumed run may change freely: they do not touch the numbers it computes.
FREE_ON_RESUME = ("train.progress", "train.compile_cache", "train.compile_ahead",
                  "train.allow_config_change", "train.out_dir", "train.ref_cache_dir",
                  # removed fields (train.config.REMOVED_FIELDS), in old config.json files
                  "train.log_every", "train.samples_per_eval")


# Fields that change how fast a run samples, not what (the rollout engines draw
# the same samples, to float rounding): a resume across them is accepted
# without train.allow_config_change and recorded in config_history.jsonl.
SPEED_ON_RESUME = ("rollout.engine", "rollout.slots", "rollout.refill", "rollout.page_size",
                   "rollout.kv_pages", "rollout.paged_attention")


def changed_fields(old: dict, new: dict, prefix: str = "") -> list[tuple[str, Any, Any]]:
    """(dotted field, old value, new value) for every leaf that differs."""
    out = []
    for k in sorted(set(old) | set(new)):
        a, b, name = old.get(k), new.get(k), f"{prefix}{k}"
        if isinstance(a, dict) and isinstance(b, dict):
            out += changed_fields(a, b, name + ".")
        elif a != b:
            out.append((name, a, b))
    return out


def last_config(run_dir: Any) -> tuple[dict | None, str]:
    """The config the run's last start recorded, and where it was read: config.json,
    else the last row of config_history.jsonl (a deleted config.json does not
    make a run with checkpoints look new); (None, '') when neither holds one."""
    run_dir = path(run_dir)
    saved, hist = run_dir / "config.json", run_dir / "config_history.jsonl"
    if saved.exists():
        return read_json(saved), str(saved)
    if hist.exists():
        rows = [r for r in read_jsonl(hist) if isinstance(r, dict)
                and isinstance(r.get("config"), dict)]
        if rows:
            return rows[-1]["config"], f"{hist} (its last row; config.json is missing)"
    return None, ""


@dataclasses.dataclass(frozen=True)
class ConfigRecord:
    """A start's config, checked against the run's (`check_config`) and not yet
    written: `write_config` writes it once the start has succeeded, so a start
    that fails leaves config.json and config_history.jsonl as they were."""
    run_dir: Any
    config: dict
    changed: tuple[str, ...]
    start_step: int


def check_config(run_dir: Any, new: dict, normalize: Callable[[dict], dict], resuming: bool,
                 allow_change: bool, start_step: int) -> ConfigRecord:
    """Check `new` against the run's last recorded config (`last_config`). A
    resumed run (`resuming`: a checkpoint exists) whose config differs in a field
    outside FREE_ON_RESUME and SPEED_ON_RESUME is refused, unless
    `allow_change`, with a ValueError listing the fields; the changes it
    accepts, speed ones included, are recorded. Writes nothing."""
    run_dir = path(run_dir)
    old, where = last_config(run_dir)
    changes = []
    if old is not None:
        changes = [c for c in changed_fields(normalize(old), new)
                   if c[0] not in FREE_ON_RESUME]
    refused = [c for c in changes if c[0] not in SPEED_ON_RESUME]
    if resuming and refused and not allow_change:
        changes = refused
        listed = "; ".join(f"{n}: {a!r} -> {b!r}" for n, a, b in changes[:8])
        more = f" (and {len(changes) - 8} more)" if len(changes) > 8 else ""
        raise ValueError(f"config field train.allow_config_change: {run_dir} holds a checkpoint "
                         f"of step {start_step} made with a different config ({listed}{more}; "
                         f"the old one read from {where}); rerun with the old values, use a new "
                         "train.out_dir, or set train.allow_config_change=true to resume with "
                         "the changes.")
    return ConfigRecord(run_dir, new, tuple(n for n, _, _ in changes), start_step)


def write_config(record: ConfigRecord, recorded: dict | None = None) -> None:
    """Write a checked config (`check_config`) to config.json, with a line in
    config_history.jsonl. recorded: top-level entries that record what the
    start found (train.config.RECORDED_KEYS, e.g. data_rows), written beside
    the fields."""
    import time
    if recorded:
        record = dataclasses.replace(record, config={**record.config, **recorded})
    run_dir = path(record.run_dir)
    write_json(run_dir / "config.json", record.config, indent=2, sort_keys=True)
    hist = run_dir / "config_history.jsonl"
    old_rows = hist.read_bytes() if hist.exists() else b""
    row = {"time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
           "start_step": record.start_step, "changed": list(record.changed),
           "config": record.config}
    write_atomic(hist, old_rows + (json.dumps(row) + "\n").encode())


def record_config(run_dir: Any, new: dict, normalize: Callable[[dict], dict], resuming: bool,
                  allow_change: bool, start_step: int) -> None:
    """`check_config` then `write_config` at once."""
    write_config(check_config(run_dir, new, normalize, resuming, allow_change, start_step))


# ----------------------------------------------------------------------------- outputs


def is_run_dir(p: Any) -> bool:
    """Whether `p` holds a training run (`erpo train` / `erpo sft` wrote there)."""
    p = path(p)
    return any((p / name).exists() for name in ("metrics.jsonl", "checkpoints",
                                                "config_history.jsonl"))


def check_output_file(p: Any, flag: str) -> None:
    """Before the work: refuse an output file path that is a directory or whose
    folder cannot be made, naming `flag` (a ConfigError, rc 2)."""
    from erpo_jax.runtime.errors import ConfigError
    p = path(p)
    if p.is_dir():
        raise ConfigError(f"{flag} {p} is a directory; give the path of a file to write "
                          f"(e.g. {p / 'report.json'}).")
    try:
        p.parent.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise ConfigError(f"{flag} {p}: its folder cannot be made ({e.strerror or e}).") from None
    if not is_remote(p) and not os.access(os.fspath(p.parent), os.W_OK):
        raise ConfigError(f"{flag} {p}: its folder {p.parent} is not writable.")


def check_output_dir(p: Any, flag: str) -> None:
    """Before the work: make output directory `p`, or refuse it (a file, or not
    writable) naming `flag` (a ConfigError, rc 2)."""
    from erpo_jax.runtime.errors import ConfigError
    p = path(p)
    if p.exists() and not p.is_dir():
        raise ConfigError(f"{flag} {p} is a file, not a directory; give a directory to write "
                          "the results in.")
    try:
        p.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise ConfigError(f"{flag} {p} cannot be made ({e.strerror or e}).") from None
    if not is_remote(p) and not os.access(os.fspath(p), os.W_OK):
        raise ConfigError(f"{flag} {p} is not writable.")


# What an output directory holds, so that no command writes into another
# thing's directory: `erpo report` is recognised by its REPORT.md, `erpo eval`
# by its eval_config.json (the model and settings it was made with), `erpo
# demo` by OUTPUT_MARKER, which it writes before its first run (an
# interrupted demo is a demo too) with the settings it runs with.
OUTPUT_MARKER = "erpo_output.json"   # {"kind": "demo", "settings": {...}}
OUTPUT_KINDS = {"report": "a report (erpo report)", "demo": "a demo (erpo demo)",
                "eval": "an evaluation (erpo eval)"}


def output_record(p: Any) -> dict | None:
    """{'kind': one of OUTPUT_KINDS, 'settings': what it was made with, or None
    where the directory does not record it} of output directory `p`, or None
    where it holds none of them."""
    p = path(p)
    marker = p / OUTPUT_MARKER
    if marker.is_file():
        try:
            rec = read_json(marker)
        except (OSError, ValueError):
            rec = None
        if isinstance(rec, dict) and rec.get("kind") in OUTPUT_KINDS:
            return {"kind": rec["kind"], "settings": rec.get("settings")}
    if (p / "eval_config.json").is_file():
        try:
            saved = read_json(p / "eval_config.json")
        except (OSError, ValueError):
            saved = None
        return {"kind": "eval", "settings": saved if isinstance(saved, dict) else None}
    if (p / "SUMMARY.md").is_file():   # a demo written before OUTPUT_MARKER
        return {"kind": "demo", "settings": None}
    if (p / "REPORT.md").is_file():
        return {"kind": "report", "settings": None}
    return None


def write_output_marker(p: Any, kind: str, settings: Any) -> None:
    """Record in output directory `p` that it holds `kind` made with `settings`."""
    write_json(path(p) / OUTPUT_MARKER, {"kind": kind, "settings": settings}, indent=2,
               sort_keys=True)


def _settings_diff(old: Any, new: Any) -> str:
    if isinstance(old, dict) and isinstance(new, dict):
        diff = changed_fields(old, new)
        if diff:
            named = [(n[len("settings."):] if n.startswith("settings.") else n, a, b)
                     for n, a, b in diff]
            more = f"; and {len(named) - 4} more" if len(named) > 4 else ""
            return "; ".join(f"{n}: {a!r} -> {b!r}" for n, a, b in named[:4]) + more
    return f"{old!r} -> {new!r}"


def claim_output_dir(p: Any, flag: str, kind: str, settings: Any = None,
                     force: bool = False, run_hint: str = "") -> None:
    """Before the work: make output directory `p` for output `kind` (one of
    OUTPUT_KINDS), or refuse it in one sentence naming it and the way out (a
    ConfigError, rc 2): a file; a training run's directory (never, `force` or
    not; `run_hint` adds the command's own way out); a directory holding
    another kind of output, or this kind made with other `settings` (compared
    where both are known), unless `force`. The same kind with the same
    settings is reused."""
    from erpo_jax.runtime.errors import ConfigError
    p = path(p)
    what = OUTPUT_KINDS[kind]
    if p.exists() and not p.is_dir():
        raise ConfigError(f"{flag} {p} is a file, not a directory; give another {flag}, a "
                          f"directory to write {what} in.")
    if is_run_dir(p):
        raise ConfigError(f"{flag} {p} is a training run's directory, and {what} never "
                          f"writes into a run; give another {flag}{run_hint}.")
    held = output_record(p) if p.is_dir() else None
    if held is not None and not force:
        if held["kind"] != kind:
            raise ConfigError(f"{flag} {p} holds {OUTPUT_KINDS[held['kind']]}; give another "
                              f"{flag}, or pass --force to write {what} over it.")
        if (settings is not None and held["settings"] is not None
                and held["settings"] != settings):
            raise ConfigError(f"{flag} {p} holds {what} made with other settings "
                              f"({_settings_diff(held['settings'], settings)}); give another "
                              f"{flag}, or pass --force to replace it.")
    check_output_dir(p, flag)
