"""Reading a compiled program's optimised HLO text (`Compiled.as_text()`): which instructions
move a weight or a KV pool every step, and what XLA's "bytes accessed" counts beside HBM
traffic (`jaxinfer.proof.aot` module doc). Only top-level instructions count: a fusion's body
is one kernel, what it moves inside stays on chip."""

from __future__ import annotations

import math
import re

import jax

_DTYPE_BITS = {"pred": 8, "s8": 8, "u8": 8, "s4": 4, "u4": 4, "bf16": 16, "f16": 16, "s16": 16,
               "u16": 16, "f32": 32, "s32": 32, "u32": 32, "f64": 64, "s64": 64, "u64": 64}
_ARRAY = re.compile(r"\b(pred|[su](?:4|8|16|32|64)|bf16|f16|f32|f64)\[([\d,]*)\]")
_NAME = re.compile(r"^\s*(?:ROOT\s+)?%?([\w.\-]+)\s*=\s*")
_OPCODE = re.compile(r"\s*([\w\-]+)\(")
_COMPUTATION = re.compile(r"^\s*(?:ENTRY\s+)?%?([\w.\-]+)\s.*\{\s*$")
# Collectives that bring other chips' data (a weight gathered): reported wherever the result
# lands, TPU VMEM included. The async forms: all-gather-start (XLA:GPU), async-start of a
# computation holding one, and XLA:TPU's async collective fusions (a fusion whose computation
# holds the collective, its result a tuple of buffers).
COLLECTIVES = ("all-gather", "all-to-all", "all-gather-start", "all-gather-done")
# A dynamic slice of a stacked weight or pool outside a fusion is a copy of one layer's row.
MOVES = (*COLLECTIVES, "copy", "transpose", "copy-start", "dynamic-slice")


def _array_bytes(dtype: str, dims: str) -> int:
    """Bytes of an HLO array: 4-bit types two per byte, as XLA stores them."""
    return -(-_DTYPE_BITS[dtype] * math.prod(int(d) for d in dims.split(",") if d) // 8)


def _instruction(line: str) -> tuple[str, str, str] | None:
    """(name, result text, opcode) of an HLO instruction line, or None. The result is an array
    (`bf16[8,128]{1,0:T(8,128)}`) or a tuple of them, nested or not (`(bf16[2,4]{1,0},
    bf16[8,4]{1,0}) all-gather-start(...)`: async collectives, copy-start)."""
    m = _NAME.match(line)
    if not m:
        return None
    rest = line[m.end():]
    end = _closing(rest) if rest.startswith("(") else len((rest.split(None, 1) or [""])[0])
    op = _OPCODE.match(rest, end)
    return (m.group(1), rest[:end], op.group(1)) if end and op else None


def _closing(text: str) -> int:
    """The index just past the parenthesis that closes the one `text` opens (0: unclosed)."""
    depth = 0
    for i, ch in enumerate(text):
        depth += {"(": 1, ")": -1}.get(ch, 0)
        if not depth:
            return i + 1
    return 0


def _top_level(hlo: str):
    """(instruction name, result text, opcode, line) of every instruction outside fused
    computations (a fusion's body is one kernel: what it moves inside stays in registers)."""
    fused = False
    for line in hlo.splitlines():
        head = _COMPUTATION.match(line) if line[:1] not in ("", " ", "\t") else None
        if head:
            fused = "fused" in head.group(1) or "fusion" in head.group(1)
            continue
        parsed = _instruction(line)
        if parsed and not fused:
            yield (*parsed, line)


def shape_moves(hlo: str, shapes: dict[tuple[int, ...], str]) -> list[str]:
    """The all-gather / all-to-all / copy / transpose / dynamic-slice instructions of `hlo`
    (outside fusions, or a fusion that is only one of them), and the async collectives
    (`COLLECTIVES`), whose result (or, for a tuple, its largest such array) is shaped like one
    of `shapes` (`shape_key` -> a label, e.g. "weight" for every weight's global and per-chip
    shape): 'opcode dtype[dims] label (metadata op_name)' each. A copy, transpose or slice into
    TPU memory space S(1) (VMEM, on-chip) is a staging copy of what a kernel reads, not a second
    HBM copy; a collective there still brings the data from other chips."""
    roots, holds = _fusion_roots(hlo), _collective_computations(hlo)
    out = []
    for _, result, opcode, line in _top_level(hlo):
        called = re.search(r"calls=%?([\w.\-]+)", line)
        if called and called.group(1) in holds:
            opcode = f"{opcode}:{holds[called.group(1)]}"
        elif opcode == "fusion":
            opcode = f"fusion:{roots.get(called.group(1))}" if called else opcode
        kind = opcode.split(":")[-1]
        if kind not in MOVES or (kind not in COLLECTIVES and re.search(r"S\(1\)\}", result)):
            continue
        matches = [(_array_bytes(dtype, dims), dtype, dims, label)
                   for dtype, dims in _ARRAY.findall(result)
                   if (label := shapes.get(shape_key(int(d) for d in dims.split(",") if d)))]
        if matches:
            _, dtype, dims, label = max(matches)
            name = re.search(r'op_name="([^"]*)"', line)
            out.append(f"{opcode} {dtype}[{dims}] {label}"
                       + (f" ({name.group(1)})" if name else ""))
    return out


def _collective_computations(hlo: str) -> dict[str, str]:
    """Computation name -> the collective (`COLLECTIVES`) it holds, for every computation
    holding one: the body of an async collective fusion or async-start."""
    out, current = {}, None
    for line in hlo.splitlines():
        head = _COMPUTATION.match(line) if line[:1] not in ("", " ", "\t") else None
        if head:
            current = head.group(1)
            continue
        parsed = _instruction(line)
        if parsed and current and parsed[2] in COLLECTIVES:
            out.setdefault(current, parsed[2])
    return out


def shape_key(dims) -> tuple[int, ...]:
    """An array's dims in any order, unit dims dropped (a slice of one layer keeps its unit
    leading dim)."""
    return tuple(sorted(d for d in dims if d != 1))


def array_shapes(tree, label: str, *, rows: bool = False) -> dict[tuple[int, ...], str]:
    """`shape_key`s of the global and per-device dims of every abstract array (ndim >= 2) of
    `tree`; with `rows`, also of one row along their leading axis (a stack's layer: the
    scanned layout's stacks are never split along it)."""
    out = {}
    for x in jax.tree.leaves(tree):
        if not (isinstance(x, jax.ShapeDtypeStruct) and len(x.shape) >= 2):
            continue
        shapes = [x.shape] + ([x.sharding.shard_shape(x.shape)] if x.sharding is not None
                              else [])
        for shape in shapes + ([s[1:] for s in shapes if len(s) > 2] if rows else []):
            out[shape_key(shape)] = label
    return out


def whole_operand_bytes(hlo: str, min_bytes: int) -> tuple[int, int, int]:
    """What XLA's bytes accessed counts beside the HBM traffic it stands for, outside fusions:
    (the operands of the Pallas kernels' custom calls that declare no cost estimate, every
    operand whole (one that declares it, the quantized matmul, counts its own DMA traffic,
    which is HBM traffic); the weight-sized tables (>= `min_bytes`) a gather reads rows of, less
    the rows it outputs; the bytes staged into TPU VMEM, memory space S(1), by asynchronous
    copies and slices and relayout custom calls, whose on-chip write is counted besides their
    HBM read)."""
    sizes = {}
    for name, result, _, _ in _top_level(hlo):
        arrays = _ARRAY.findall(result)
        if len(arrays) == 1 and not result.startswith("("):
            sizes[name] = _array_bytes(*arrays[0])
    roots = _fusion_roots(hlo, "gather")
    kernels = gathered = staged = 0
    for name, result, opcode, line in _top_level(hlo):
        operands = re.findall(r"%([\w.\-]+)", line.split(f" {opcode}(", 1)[1].split("), ", 1)[0])
        kernel = re.search(r'custom_call_target="(tpu_custom_call|__gpu\$xla\.gpu\.triton)',
                           line)
        if opcode == "custom-call" and kernel:
            if "cost_estimate" not in line:
                kernels += sum(sizes.get(o, 0) for o in operands)
        elif opcode in ("copy-done", "slice-done", "custom-call") and "S(1)}" in result:
            staged += sizes.get(name, 0)
        called = re.search(r"calls=%?([\w.\-]+)", line)
        if opcode == "gather" or (opcode == "fusion" and called
                                  and roots.get(called.group(1)) == "gather"):
            tables = [sizes.get(o, 0) for o in operands if sizes.get(o, 0) >= min_bytes]
            out = sum(_array_bytes(*a) for a in _ARRAY.findall(result))
            gathered += max(0, sum(tables) - out) if tables else 0
    return kernels, gathered, staged


def _fusion_roots(hlo: str, opcode: str | None = None) -> dict[str, str]:
    """Computation name -> the opcode of its ROOT instruction; with `opcode`, only those that
    hold an instruction of that opcode, mapped to it."""
    roots, current = {}, None
    for line in hlo.splitlines():
        head = _COMPUTATION.match(line) if line[:1] not in ("", " ", "\t") else None
        if head:
            current = head.group(1)
            continue
        parsed = _instruction(line)
        if parsed and current and opcode is not None and parsed[2] == opcode:
            roots[current] = opcode
        elif parsed and current and opcode is None and line.lstrip().startswith("ROOT"):
            roots[current] = parsed[2]
    return roots
