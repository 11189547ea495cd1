"""Reading a compiled program's optimised HLO text (`Compiled.as_text()`): which instructions
move a weight or a KV pool every step, and what XLA's "bytes accessed" counts beside HBM
traffic (`jaxinfer.proof.aot` module doc). Only top-level instructions count: a fusion's body
is one kernel, what it moves inside stays on chip."""

from __future__ import annotations

import dataclasses
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
MOVES = (*COLLECTIVES, "copy", "transpose", "copy-start", "reshape", "dynamic-slice")


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
    shape): 'opcode dtype[dims] label (metadata op_name)' each; and the reshapes whose operand
    is shaped like one (a reshape XLA keeps, rather than a bitcast, rewrites its operand in a
    new physical layout: XLA:TPU's for a weight whose tiling the consumer cannot read). A copy,
    transpose, slice or reshape into TPU memory space S(1) (VMEM, on-chip) is a staging copy of
    what a kernel reads, not a second HBM copy; a collective there still brings the data from
    other chips."""
    roots, holds = _fusion_roots(hlo), _collective_computations(hlo)
    results = {name: result for name, result, _, _ in _top_level(hlo)}
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
        if kind == "reshape":
            operand = re.search(r"reshape\([^%)]*%([\w.\-]+)", line)
            result = results.get(operand.group(1), "") if operand else ""
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
    out = {}
    for current, _, parsed in _instructions(hlo):
        if parsed[2] in COLLECTIVES:
            out.setdefault(current, parsed[2])
    return out


def _instructions(hlo: str):
    """(computation name, line, `_instruction(line)`) for every instruction inside a named
    computation of `hlo`, in order."""
    current = None
    for line in hlo.splitlines():
        head = _COMPUTATION.match(line) if line[:1] not in ("", " ", "\t") else None
        if head:
            current = head.group(1)
            continue
        parsed = _instruction(line)
        if parsed and current:
            yield current, line, parsed


def shape_key(dims) -> tuple[int, ...]:
    """An array's dims in any order, unit dims dropped (a slice of one layer keeps its unit
    leading dim)."""
    return tuple(sorted(d for d in dims if d != 1))


def array_shapes(tree, label: str, *, rows: bool = False) -> dict[tuple[int, ...], str]:
    """`shape_key`s of the global and per-device dims of every abstract array of `tree` that is
    not a vector (norms, biases, sinks: moving one is no bandwidth matter); with `rows`, the
    arrays are stacks [L, ...] (the scanned layout's, never split along L): also one row of
    each, and a stack of vectors [L, X] is vectors too."""
    out = {}
    for x in jax.tree.leaves(tree):
        if not (isinstance(x, jax.ShapeDtypeStruct) and len(x.shape) >= 2 + rows):
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
    copies and slices, relayout custom calls and slicing fusions (a scanned layer's weights
    taken from their stack), whose on-chip write is counted besides their HBM read). Each
    counted as often as its computation runs (`run_counts`: a loop's body once per trip), as
    `loop_bytes` counts the rest."""
    comps = _computations(hlo)
    sizes = _result_sizes(comps)
    runs = run_counts(hlo)
    roots, gathers = _fusion_roots(hlo), _fusion_roots(hlo, "gather")
    kernels = gathered = staged = 0
    for comp, insts in comps.items():
        if comp in comps.fused:
            continue
        times = runs.get(comp) or 1
        for inst in insts:
            line, opcode = inst.line, inst.opcode
            kernel = re.search(
                r'custom_call_target="(tpu_custom_call|__gpu\$xla\.gpu\.triton)', line)
            if opcode == "custom-call" and kernel:
                if "cost_estimate" not in line:
                    kernels += times * sum(sizes.get(o, 0) for o in inst.operands)
            called = re.search(r"calls=%?([\w.\-]+)", line)
            root = roots.get(called.group(1)) if called and opcode == "fusion" else None
            if "S(1)}" in inst.result and (opcode in ("copy-done", "slice-done", "custom-call")
                                           or root in ("dynamic-slice", "slice")):
                staged += times * sizes.get(inst.name, 0)
            if opcode == "gather" or (opcode == "fusion" and called
                                      and gathers.get(called.group(1)) == "gather"):
                tables = [sizes.get(o, 0) for o in inst.operands if sizes.get(o, 0) >= min_bytes]
                out = sum(_array_bytes(*a) for a in _ARRAY.findall(inst.result))
                gathered += times * (max(0, sum(tables) - out) if tables else 0)
    return kernels, gathered, staged


def _fusion_roots(hlo: str, opcode: str | None = None) -> dict[str, str]:
    """Computation name -> the opcode of its ROOT instruction; with `opcode`, only those that
    hold an instruction of that opcode, mapped to it."""
    roots = {}
    for current, line, parsed in _instructions(hlo):
        if opcode is not None and parsed[2] == opcode:
            roots[current] = opcode
        elif opcode is None and line.lstrip().startswith("ROOT"):
            roots[current] = parsed[2]
    return roots


# ----- loops: what XLA's cost analysis counts once ------------------------------------------
@dataclasses.dataclass(frozen=True)
class _Inst:
    """One parsed instruction: name, result text, opcode, the whole line, operand names."""

    name: str
    result: str
    opcode: str
    line: str
    operands: tuple[str, ...]


class _Module(dict):
    """Computation name -> its instructions (`_Inst`), in order; `entry` names the entry
    computation and `fused` the computations fusions call (their bodies are one kernel)."""

    entry: str | None = None
    fused: frozenset = frozenset()


def _computations(hlo: str) -> _Module:
    out, current = _Module(), None
    for line in hlo.splitlines():
        head = _COMPUTATION.match(line) if line[:1] not in ("", " ", "\t") else None
        if head:
            current = head.group(1)
            out[current] = []
            if line.startswith("ENTRY"):
                out.entry = current
            continue
        parsed = _instruction(line)
        if parsed and current is not None:
            out[current].append(_Inst(*parsed, line, _operands(line, parsed[2])))
    out.fused = frozenset(
        m.group(1) for insts in out.values() for i in insts if i.opcode == "fusion"
        for m in [re.search(r"calls=%?([\w.\-]+)", i.line)] if m)
    return out


def _operands(line: str, opcode: str) -> tuple[str, ...]:
    parts = line.split(f" {opcode}(", 1)
    if len(parts) < 2:
        return ()
    text = "(" + parts[1]
    return tuple(re.findall(r"%([\w.\-]+)", text[:_closing(text)]))


def _result_sizes(comps: _Module) -> dict[str, int]:
    """Instruction name -> bytes of its result, for every array-typed (not tuple) result."""
    out = {}
    for insts in comps.values():
        for inst in insts:
            arrays = _ARRAY.findall(inst.result)
            if len(arrays) == 1 and not inst.result.startswith("("):
                out[inst.name] = _array_bytes(*arrays[0])
    return out


def run_counts(hlo: str) -> dict[str, int | None]:
    """Computation name -> how often it runs per run of the program, for the entry (once) and
    what it reaches through while loops (a body `trip_count` times per run of the computation
    holding the loop, the condition once more) and calls (as often as the caller); None below
    a loop whose trip count is unknown. Computations not listed run as XLA counts them."""
    comps = _computations(hlo)
    out: dict[str, int | None] = {}
    todo = [(comps.entry, 1)] if comps.entry else []
    while todo:
        comp, times = todo.pop()
        out[comp] = times
        for inst in comps.get(comp, ()):
            if inst.opcode == "while":
                body = re.search(r"body=%?([\w.\-]+)", inst.line).group(1)
                cond = re.search(r"condition=%?([\w.\-]+)", inst.line).group(1)
                n = trip_count(inst, comp, comps)
                todo.append((body, None if n is None or times is None else times * n))
                todo.append((cond, None if n is None or times is None else times * (n + 1)))
            elif inst.opcode == "call":
                todo.append((re.search(r"to_apply=%?([\w.\-]+)", inst.line).group(1), times))
    return out


def trip_count(loop: _Inst, caller: str, comps: _Module) -> int | None:
    """The trip count of while loop `loop` (in computation `caller`): XLA's known_trip_count
    where it annotates one (XLA:CPU, XLA:GPU), else read from the loop itself (XLA:TPU): the
    condition's root compares an induction variable, tuple element k, less than a constant N;
    the loop's operand starts element k at a constant and the body's root adds a constant step
    to it. None where the loop is not of that form."""
    known = re.search(r'"known_trip_count":\{"n":"(\d+)"', loop.line)
    if known:
        return int(known.group(1))
    cond = re.search(r"condition=%?([\w.\-]+)", loop.line).group(1)
    body = re.search(r"body=%?([\w.\-]+)", loop.line).group(1)
    named = {i.name: i for insts in comps.values() for i in insts}
    root = next((i for i in reversed(comps.get(cond, [])) if "ROOT" in i.line.split("=")[0]),
                None)
    if root is None or root.opcode != "compare" or "direction=LT" not in root.line:
        return None
    index, limit = _element(named, root.operands[0]), _constant(named, root.operands[1])
    init_tuple = named.get(loop.operands[0]) if loop.operands else None
    body_root = next((i for i in reversed(comps.get(body, [])) if "ROOT" in
                      i.line.split("=")[0]), None)
    if None in (index, limit, init_tuple, body_root) or init_tuple.opcode != "tuple" \
            or body_root.opcode != "tuple":
        return None
    init = _constant(named, init_tuple.operands[index])
    step = named.get(body_root.operands[index])
    if init is None or step is None or step.opcode != "add":
        return None
    deltas = [_constant(named, o) for o in step.operands
              if _element(named, o) != index]
    if len(deltas) != 1 or not deltas[0] or deltas[0] < 0:
        return None
    return max(0, -(-(limit - init) // deltas[0]))


def _traced(named: dict[str, _Inst], name: str) -> _Inst | None:
    inst = named.get(name)
    while inst is not None and inst.opcode == "copy" and inst.operands:
        inst = named.get(inst.operands[0])
    return inst


def _element(named, name) -> int | None:
    inst = _traced(named, name)
    if inst is None or inst.opcode != "get-tuple-element":
        return None
    return int(re.search(r"index=(\d+)", inst.line).group(1))


def _constant(named, name) -> int | None:
    inst = _traced(named, name)
    m = inst and inst.opcode == "constant" and re.search(r"constant\((-?\d+)\)", inst.line)
    return int(m.group(1)) if m else None


# Instructions that move no data of their own (a while's or call's traffic is its
# computations'; an async pair's is counted at its start).
_NO_BYTES = ("parameter", "get-tuple-element", "tuple", "bitcast", "constant", "while", "call",
             "conditional", "after-all", "partition-id", "replica-id", "copy-done", "slice-done",
             "all-gather-done", "all-reduce-done", "collective-permute-done", "async-done",
             "send-done", "recv-done")
_SLICES = ("dynamic-slice", "slice", "gather")


def loop_bytes(hlo: str) -> int | None:
    """The bytes accessed XLA's cost analysis leaves out of a program with while loops (it
    counts every computation once, a loop's body once whatever its trip count): each
    computation's bytes by XLA's rules (`_computation_bytes`) times the runs it has beyond
    that one (`run_counts`). 0 without loops; None where a loop's trip count is unknown."""
    comps = _computations(hlo)
    sizes = _result_sizes(comps)
    total = 0
    for comp, times in run_counts(hlo).items():
        if times is None:
            return None
        if times > 1:
            total += (times - 1) * _computation_bytes(comps[comp], comps, sizes)
    return total


def _computation_bytes(insts: list[_Inst], comps: _Module, sizes: dict[str, int]) -> int:
    """Bytes accessed by a computation's instructions, as XLA's cost analysis counts them:
    each instruction's operands read and result written (a fusion as one instruction, an
    operand it only slices as the slices read, a result it updates in place as the update);
    a dynamic slice reads and writes its slice, a dynamic update or scatter (in place) its
    updates (and a scatter its indices); a Pallas kernel that declares its cost estimate its
    declared bytes."""
    total = 0
    for inst in insts:
        if inst.opcode in _NO_BYTES:
            continue
        out = _written_bytes(inst)
        declared = re.search(r'bytes_accessed\\?"?\s*[:=]\s*\\?"?(\d+)', inst.line)
        if inst.opcode == "custom-call" and declared and "cost_estimate" in inst.line:
            total += int(declared.group(1))
        elif inst.opcode == "dynamic-slice":
            total += 2 * out
        elif inst.opcode in _UPDATES:
            indices = inst.operands[len(inst.operands) // 2] if inst.opcode == "scatter" else None
            total += 2 * _update_bytes(inst, sizes) + sizes.get(indices, 0)
        elif inst.opcode == "fusion":
            called = re.search(r"calls=%?([\w.\-]+)", inst.line).group(1)
            update = _in_place_update(comps.get(called, []), sizes)
            total += (update if update is not None else out) + sum(
                _used_bytes(comps, called, k, sizes.get(o, 0))
                for k, o in enumerate(inst.operands))
        else:
            total += out + sum(sizes.get(o, 0) for o in inst.operands)
    return total


def _written_bytes(inst: _Inst) -> int:
    """Bytes of an instruction's result: an async start's output only (its tuple also holds
    the operands, first and parenthesised for a slice-start or async-start, or the source of
    a copy-start), else every array of it."""
    result = inst.result
    if inst.opcode.endswith("-start") and result.startswith("(("):
        result = result[1 + _closing(result[1:]):]
    arrays = [_array_bytes(*a) for a in _ARRAY.findall(result)]
    return max(arrays, default=0) if inst.opcode.endswith("-start") else sum(arrays)


_UPDATES = ("dynamic-update-slice", "scatter")  # written in place: only the updates move


def _update_bytes(inst: _Inst, sizes: dict[str, int]) -> int:
    """The updates' bytes of a dynamic update (operand 1) or a scatter (operands, indices,
    updates: the last half past the indices)."""
    if inst.opcode == "dynamic-update-slice":
        return sizes.get(inst.operands[1], 0)
    n = len(inst.operands) // 2  # scatter(operands..., indices, updates...)
    return sum(sizes.get(o, 0) for o in inst.operands[n + 1:])


def _in_place_update(insts: list[_Inst], sizes: dict[str, int]) -> int | None:
    """The updates' bytes where a fused computation's root is a dynamic update or scatter
    (written in place: only the updates are written), else None."""
    root = next((i for i in reversed(insts) if "ROOT" in i.line.split("=")[0]), None)
    if root is None or root.opcode not in _UPDATES:
        return None
    local = {i.name: sum(_array_bytes(*a) for a in _ARRAY.findall(i.result)) for i in insts}
    return _update_bytes(root, {**sizes, **local})


# Elementwise ops of one operand: inside a fusion they compute only the elements their
# consumers take, so a slice of their result reads only that slice of their operand (XLA:TPU
# fuses a scanned int8 stack's relayout, T(32,128) -> T(8,128), with the layer's slice).
_ELEMENTWISE = ("bitcast", "copy", "convert")


def _used_bytes(comps: _Module, comp: str, index: int, whole: int) -> int:
    """Bytes of parameter `index` (of `whole` bytes) that fused computation `comp` reads: the
    slices it takes where it only slices it (through bitcasts, elementwise relayouts and
    nested fusions), the update region where it only updates it in place, else all of it."""
    insts = comps.get(comp, [])
    sizes = {i.name: sum(_array_bytes(*a) for a in _ARRAY.findall(i.result)) for i in insts}
    param = _parameter(insts, index)
    if param is None:
        return whole
    read, names = 0, {param}
    for inst in insts:
        for k, o in enumerate(inst.operands):
            if o not in names:
                continue
            if inst.opcode in _ELEMENTWISE and len(inst.operands) == 1:
                names.add(inst.name)
            elif inst.opcode in _SLICES and k == 0:
                read += sizes[inst.name]
            elif inst.opcode in _UPDATES and k == 0:
                read += _update_bytes(inst, sizes)
            elif inst.opcode == "fusion":
                nested = re.search(r"calls=%?([\w.\-]+)", inst.line).group(1)
                if _passes_through(comps.get(nested, []), k):
                    names.add(inst.name)  # its result is the operand, relaid out
                else:
                    read += _used_bytes(comps, nested, k, whole)
            else:
                return whole
    return min(read, whole)


def _parameter(insts: list[_Inst], index: int) -> str | None:
    """The name of a computation's parameter `index`; None if it has none."""
    return next((i.name for i in insts if i.opcode == "parameter"
                 and re.search(rf"parameter\({index}\)", i.line)), None)


def _passes_through(insts: list[_Inst], index: int) -> bool:
    """Whether a fused computation's result is its parameter `index` through elementwise ops
    of one operand only (e.g. a relayout copy): its consumers' slices are the parameter's."""
    names = {_parameter(insts, index)}
    for inst in insts:
        if inst.opcode in _ELEMENTWISE and len(inst.operands) == 1 and inst.operands[0] in names:
            names.add(inst.name)
        if "ROOT" in inst.line.split("=")[0]:
            return inst.name in names
    return False
