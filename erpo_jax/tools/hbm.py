"""HBM traffic of a compiled TPU program, read from its optimized HLO.

Why not XLA's own count. `compiled.cost_analysis()["bytes accessed"]` adds
up every operand and result of every instruction in whichever memory the
compiler placed it. On TPU the compiler stages a decode step's weights into
on-chip VMEM before the matmul that reads them (`slice-start` /
`copy-start` into a layout with memory space S(1) or S(3), then a
`ConcatBitcast`), and its count then charges a weight once for the HBM read,
again for the VMEM write, again for each VMEM read. Measured on v4: a
[128, 1536] x [1536, 2240] bf16 matmul per chip is charged 5.0x its weight's
bytes. A decode step reads each weight once, so that count overstated its
traffic by about 3 GiB per chip on the 1.5B v4-8 plan (issue 48).

What this counts. Each top-level instruction's operands and result that the
compiler placed in HBM (memory space 0, no `S(n)` in the layout), once:
- a fusion's parameter that the fused computation only slices, dynamic-slices
  or gathers counts the slices' bytes; one it updates in place (the buffer
  operand of a scatter or dynamic-update-slice) counts the update's bytes, as
  does such a fusion's result (each in-place result of a multi-output
  fusion's tuple too); any other parameter counts whole;
- a `slice-start` / `copy-start` counts what it moves out of HBM;
- bitcasts, tuples, parameters, constants and the `*-done` halves count 0;
- operands named in `skip` (a custom call's operand whose reads are counted
  elsewhere, e.g. a paged-attention kernel's page pool) count 0.
Loops (`while`) count their body once per instruction, like XLA's analysis;
the caller multiplies where it knows the trip count. Collectives count their
HBM operands and results; their ICI time is not in it. This is a count of the
compiler's placement, not a measurement of the chip.
"""

from __future__ import annotations

import re
from typing import Callable, NamedTuple

_DTYPE_BYTES = {"pred": 1, "s8": 1, "u8": 1, "f8e4m3fn": 1, "f8e5m2": 1, "s16": 2, "u16": 2,
                "bf16": 2, "f16": 2, "s32": 4, "u32": 4, "f32": 4, "s64": 8, "u64": 8,
                "f64": 8, "c64": 8, "c128": 16}
# One array shape with its optional layout: dtype[dims]{layout}.
_ARRAY = re.compile(r"\b(" + "|".join(_DTYPE_BYTES) + r")\[([0-9,]*)\](\{[^{}]*\})?")
_INSTR = re.compile(r"^\s*(?:ROOT )?%([\w.\-]+) = (.+?) ([a-z][\w\-]*)\((.*)$")
_COMP = re.compile(r"^(ENTRY )?%([\w.\-]+) \(.*\{\s*$")
_FREE = {"parameter", "constant", "get-tuple-element", "tuple", "bitcast", "copy-done",
         "slice-done", "after-all", "partition-id", "replica-id", "opt-barrier",
         "all-gather-done", "all-reduce-done", "collective-permute-done", "send-done",
         "recv-done"}
_SLICING = {"slice", "dynamic-slice", "gather"}
_IN_PLACE = {"scatter", "dynamic-update-slice"}


class Array(NamedTuple):
    bytes: int
    hbm: bool      # in memory space 0


class Instr(NamedTuple):
    name: str
    arrays: tuple    # of Array: the result (a tuple result: its leaves)
    op: str
    operands: tuple  # operand names
    calls: str       # the fused / called computation, '' if none
    target: str      # a custom call's target, '' if none
    text: str


def _arrays(shape_text: str) -> tuple:
    out = []
    for dtype, dims, layout in _ARRAY.findall(shape_text):
        n = 1
        for d in filter(None, dims.split(",")):
            n *= int(d)
        out.append(Array(n * _DTYPE_BYTES[dtype], "S(" not in (layout or "")))
    return tuple(out)


def _operand_names(rest: str) -> tuple:
    """The operand list of an instruction: the text up to its closing paren."""
    depth, end = 1, len(rest)
    for i, ch in enumerate(rest):
        depth += ch == "("
        depth -= ch == ")"
        if depth == 0:
            end = i
            break
    return tuple(re.findall(r"%([\w.\-]+)", rest[:end]))


def parse(hlo_text: str) -> tuple[dict, str]:
    """({computation: [Instr]}, entry computation's name) of an HLO module's text."""
    comps: dict[str, list] = {}
    entry, current = "", None
    for line in hlo_text.splitlines():
        m = _COMP.match(line)
        if m:
            current = m.group(2)
            comps[current] = []
            if m.group(1):
                entry = current
            continue
        if current is None:
            continue
        if line.startswith("}"):
            current = None
            continue
        m = _INSTR.match(line)
        if not m:
            continue
        name, shape, op, rest = m.groups()
        calls = re.search(r"\bcalls=%([\w.\-]+)", rest)
        target = re.search(r'custom_call_target="([^"]*)"', rest)
        comps[current].append(Instr(name, _arrays(shape), op, _operand_names(rest),
                                    calls.group(1) if calls else "",
                                    target.group(1) if target else "", line))
    if not entry:
        raise ValueError("no ENTRY computation in the HLO text")
    return comps, entry


def _fusion_use(comp: list) -> tuple[dict, int | None]:
    """For a fused computation: {parameter index: bytes it reads, or None for
    all of it}, and the bytes its result writes when its root updates a
    parameter in place (None: the whole result)."""
    by_name = {i.name: i for i in comp}
    params = {}
    for i in comp:
        if i.op == "parameter":
            params[i.name] = int(re.search(r"parameter\((\d+)\)", i.text).group(1))
    users: dict[str, list] = {}
    for i in comp:
        for pos, o in enumerate(i.operands):
            users.setdefault(o, []).append((i, pos))
    reads, updated = {}, None
    for pname, idx in params.items():
        uses = users.get(pname, [])
        if uses and all(u.op in _SLICING | _IN_PLACE and pos == 0 for u, pos in uses):
            # read where sliced; a buffer updated in place is not read
            reads[idx] = sum(sum(a.bytes for a in u.arrays) for u, _ in uses
                             if u.op in _SLICING)
        else:
            reads[idx] = None
    root = next((i for i in comp if i.text.lstrip().startswith("ROOT")), None)

    def written(instr) -> int | None:
        if instr.op in _IN_PLACE:
            # scatter(buffer, indices, updates), dynamic-update-slice(buffer, update, ...)
            upd = by_name.get(instr.operands[2 if instr.op == "scatter" else 1])
            return None if upd is None else sum(a.bytes for a in upd.arrays)
        return sum(a.bytes for a in instr.arrays)

    if root is not None and root.op in _IN_PLACE:
        updated = written(root)
    elif (root is not None and root.op == "tuple"
          and any(by_name[o].op in _IN_PLACE for o in root.operands if o in by_name)):
        # A multi-output fusion updating several buffers in place (a KV cache's layers).
        parts = [written(by_name[o]) if o in by_name else None for o in root.operands]
        updated = None if None in parts else sum(parts)
    return reads, updated


def hbm_bytes(hlo_text: str, skip: Callable[[Instr, int], bool] | None = None) -> int:
    """Bytes the entry computation of `hlo_text` (a compiled TPU program's
    `as_text()`) moves to and from HBM, counted as the module docstring says.
    skip(instr, operand index) -> True leaves that operand out."""
    comps, entry = parse(hlo_text)
    cache: dict[str, tuple] = {}
    total = 0
    for comp_name in _reachable(comps, entry):
        defined = {instr.name: instr for instr in comps[comp_name]}
        for instr in comps[comp_name]:
            total += _instr_bytes(instr, defined, comps, cache, skip)
    return total


def _reachable(comps: dict, entry: str) -> list:
    """The entry computation and the bodies and conditions of its loops,
    branches and calls (recursively): the computations whose instructions
    run at top level."""
    out, todo = [], [entry]
    while todo:
        name = todo.pop()
        if name in out or name not in comps:
            continue
        out.append(name)
        for i in comps[name]:
            if i.op in ("while", "conditional", "call"):
                for group in re.findall(r"\b(?:body|condition|to_apply)=%([\w.\-]+)|"
                                        r"branch_computations=\{([^}]*)\}", i.text):
                    todo += [group[0]] if group[0] else re.findall(r"%([\w.\-]+)", group[1])
    return out


def _instr_bytes(instr: Instr, defined: dict, comps: dict, cache: dict, skip) -> int:
    if instr.op in _FREE or instr.op in ("while", "conditional", "call"):
        return 0

    def operand(pos: int) -> Array | None:
        src = defined.get(instr.operands[pos])
        if src is None or not src.arrays:
            return None
        return Array(sum(a.bytes for a in src.arrays), all(a.hbm for a in src.arrays))

    if instr.op in ("slice-start", "copy-start"):   # ((operand), slice, ...) / (dest, src, ...)
        src = operand(0)
        moved = instr.arrays[1] if instr.op == "slice-start" else instr.arrays[0]
        return moved.bytes if src is not None and src.hbm else 0
    if instr.op == "custom-call" and instr.target == "ConcatBitcast":
        return 0
    if instr.op in _IN_PLACE:   # updates its buffer in place: the update is read and written
        upd = operand(2 if instr.op == "scatter" else 1)
        return 0 if upd is None else 2 * upd.bytes
    n = 0
    reads, written = ({}, None)
    if instr.op == "fusion" and instr.calls in comps:
        if instr.calls not in cache:
            cache[instr.calls] = _fusion_use(comps[instr.calls])
        reads, written = cache[instr.calls]
    for pos in range(len(instr.operands)):
        if skip is not None and skip(instr, pos):
            continue
        src = operand(pos)
        if src is None or not src.hbm:
            continue
        r = reads.get(pos)
        n += src.bytes if r is None else r
    arrays = instr.arrays
    if instr.op.endswith("-start") and len(arrays) > 1:   # (operand, result, ...): the result
        arrays = arrays[1:2]
    out = [a for a in arrays if a.hbm]
    if out:
        n += written if written is not None else sum(a.bytes for a in out)
    return n


def paged_kernel_pages(instr: Instr, pos: int) -> bool:
    """`skip` for the page pool of jax's ragged paged attention kernel (its
    last operand): the kernel reads only the pages a slot's table names, which
    `rollout.paged` counts from its page book, not the pool."""
    return (instr.op == "custom-call" and "ragged_paged_attention" in instr.text
            and pos == len(instr.operands) - 1)
