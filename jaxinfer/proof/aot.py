"""The whole engine compiled ahead of time for hardware this machine does not have, and checked.

`check(AotConfig(...))` builds the model from abstract weights (`Llama.abstract`: shapes and
dtypes, nothing allocated), an `Engine` on a mesh of the target's compile-only devices (a TPU
topology from `jax.experimental.topologies` with libtpu, or a compile-only sm_90a CUDA device
with the jax CUDA plugin), and runs the engine's own warm-up (`jaxinfer.engine.warmup`) on it.
The runner of an abstract model holds `jax.ShapeDtypeStruct`s in the shardings its arrays
would have, and invokes each jitted step through a `Compiler` instead of running it, so every
executable the warm-up would compile on the hardware (`mixed_forward` per variant, one
`mixed_sample` for every chunk bucket, `verify_forward` / `verify_sample` with a speculative
method, the forks' page copy) is compiled by the real XLA:TPU / XLA:GPU pipeline (Mosaic /
Triton kernels included) from the engine's own arguments and shardings. Nothing runs.

What is measured, per executable (per device: the SPMD program of one chip):
- compile seconds; `memory_analysis()`: arguments, outputs, aliases (outputs written into a
  donated argument's buffer), temporaries and generated code;
- `cost_analysis()`: FLOPs and "bytes accessed". XLA's bytes accessed is the sum, over the
  top-level HLO instructions of one chip's program (a fusion counts as one), of the bytes of
  its operands read plus its output written. It counts one chip, not the slice (the probe's
  "2.3x one chip's weights" is the rest of this list, not other chips). Beside the HBM traffic
  a roofline counts, it counts (i) a gather's whole table: the input embedding shard is
  counted in full although a decode reads B rows of it, and again as the tied LM head; (ii) a
  Pallas kernel (a custom call) with every operand whole: each layer's K/V pool on this chip,
  whatever pages the kernel's DMAs read (a kernel that declares its traffic as a
  `pl.CostEstimate`, the TPU quantized matmul, is counted as that and is not among these);
  (iii) on TPU, the weights XLA stages into VMEM
  (memory space S(1)) with asynchronous copies, slices and relayout custom calls: the on-chip
  write of each staging besides its HBM read. `decode_bytes_like_roofline` removes (i) less
  the rows read, (ii) in favour of the live KV the kernel reads, and (iii), read from the
  optimised HLO (`whole_operand_bytes`), and compares that with the planner's roofline bytes
  (weights once + live KV read + new KV written, per chip); both numbers are reported.
- the optimised HLO scanned for all-gather / all-to-all / copy / transpose (and dynamic-slice)
  instructions outside fusions whose result is shaped like a weight (its global or per-chip
  shape, any dim order; with scanned layers also one layer's row of a stack) or like a KV pool
  (or one layer's row of a stacked one): a weight gathered or copied, or the pool copied, every
  step. A scanned layer reading its weights from the stack is a dynamic slice XLA:TPU fuses
  into the matmul or stages into VMEM (memory space S(1)), not a copy in HBM.

Loops (scanned layers, `ModelConfig.scan_layers`): XLA's cost analysis counts a while loop's
body once whatever its trip count (measured on the 8B decode step for v5e: the same bytes at 4
and at 8 layers). `hlo_scan.loop_bytes` adds what it leaves out: the body's bytes by XLA's rules,
read from the optimised HLO, times the trips beyond the first (the trip count from XLA's
known_trip_count, or from the loop's induction variable on XLA:TPU), and the kernel operands,
gathered tables and staged bytes above count once per trip too, so the decode-bytes check holds
the scanned step to the same bound as the unrolled one (the two counts agree within 2% on
`tests/test_aot.py`'s toy). Where a trip count cannot be read the check is "n/a". The moves
check then also covers one layer's row of every stack (a layer's weights or pool sliced out to
HBM).

The engine's peak per device is the largest executable's arguments + outputs - aliases +
temporaries + generated code, plus the engine's resident device arrays (`ModelRunner.resident`)
that are not among that executable's arguments (the slot state while the forward runs).

Checks (`_checks`): it fits HBM less the planner's runtime reserve, within 10% of the planner's
per-chip prediction; no weight-sized gather / copy / transpose; decode bytes accessed <= 1.15x
roofline; the donated pool aliased (alias bytes >= the pool on each chip, no pool-sized copy,
nor a copy of one layer's row of a stacked pool).
"""

from __future__ import annotations

import dataclasses
import math
import re
import time
from typing import Any

import jax
import numpy as np

from jaxinfer import config as cfg
from jaxinfer.engine import spec_tree, steps
from jaxinfer.engine.engine import Engine
from jaxinfer.engine.warmup import warmup
from jaxinfer.model import Llama, quant
from jaxinfer.perf import planner
from jaxinfer.proof.hlo_scan import (
    array_shapes,
    loop_bytes,
    shape_moves,
    whole_operand_bytes,
)
from jaxinfer.sharding import parse_mesh
from pallas_kernels.platform import GPU_TARGETS

GIB = 1 << 30
TPU_CHIPS = ("v4", "v5e", "v5p", "v6e")
GPU_CHIPS = ("h100", "h200")
DECODE_BYTES_LIMIT = 1.15  # decode bytes accessed / roofline bytes
PLANNER_TOLERANCE = 0.10  # |peak - planner| / planner
PAGE_CHOICES = ("all", "ends", "largest")  # `AotConfig.pages`
# The engine's jitted step functions (`AotConfig.compile_only`).
STEP_FUNCTIONS = tuple(f.__name__ for f in (steps.mixed_forward, steps.mixed_sample,
                                            steps.verify_forward, steps.verify_sample,
                                            steps.copy_pages, spec_tree.commit_path))



# ----- targets ----------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class Target:
    """Compile-only devices: `name` as given, `chip` a planner chip name, `topology` the
    `jax.experimental.topologies` description (every host's devices), `num_hosts` the
    processes its devices belong to."""

    name: str
    chip: str
    platform: str
    topology: Any
    num_hosts: int

    @property
    def num_chips(self) -> int:
        return len(self.topology.devices)


def resolve_target(name: str) -> Target:
    """'v5e:2x2' (a TPU topology libtpu knows: chip v4 | v5e | v5p | v6e, then its shape) or
    'gpu:h100' / 'gpu:h200' (one compile-only sm_90a device; needs the jax CUDA plugin)."""
    from jax.experimental import topologies

    chip, sep, shape = name.partition(":")
    gpus = ", ".join("gpu:" + g for g in GPU_CHIPS)
    if chip == "gpu":
        if shape not in GPU_CHIPS:
            raise ValueError(f"unknown GPU {shape!r} in target {name!r}; valid: {gpus}")
        try:
            topo = topologies.get_topology_desc(shape, "cuda", target_config=GPU_TARGETS[shape],
                                                topology="1x1x1")
        except (NotImplementedError, RuntimeError) as e:
            raise ValueError(f"target {name!r} needs the jax CUDA plugin for compile-only "
                             f"devices (pip install 'jax[cuda13]'): {e}") from None
        return Target(name, shape, target_platform(name), topo, 1)
    if chip not in TPU_CHIPS or not sep or not re.fullmatch(r"\d+(x\d+){1,2}", shape):
        raise ValueError(f"unknown target {name!r}; valid: a TPU topology <chip>:<shape> with "
                         f"chip one of {', '.join(TPU_CHIPS)} and a shape like 2x2, 4x4, 2x2x1 "
                         f"(e.g. v5e:2x2, v6e:2x4), or {gpus}")
    try:
        topo = topologies.get_topology_desc(name, platform="tpu")
    except Exception as e:  # libtpu's error for a shape it has no slice of
        raise ValueError(f"TPU topology {name!r} is not one libtpu knows "
                         f"({str(e).splitlines()[0]}); e.g. v5e:2x2, v5e:4x4, v6e:2x4") from None
    hosts = len({d.process_index for d in topo.devices})
    return Target(name, chip, target_platform(name), topo, hosts)


def target_mesh(target: Target, mesh_spec: str | None) -> jax.sharding.Mesh:
    """The mesh of `mesh_spec` ('data:D,expert:E,model:M' as `sharding.parse_mesh` reads it;
    None or 'auto': tensor parallel) over all the target's chips; one that does not use exactly
    them raises."""
    from jax.experimental import topologies

    n = target.num_chips
    try:
        sizes = parse_mesh(mesh_spec or "auto", n)
    except ValueError as e:
        raise ValueError(f"{e} (target {target.name!r})") from None
    if math.prod(sizes.values()) != n:
        product = " x ".join(f"{a} {v}" for a, v in sizes.items())
        letters = " x ".join(a[0].upper() for a in sizes)
        raise ValueError(f"mesh {mesh_spec!r} = {product} does not cover target "
                         f"{target.name!r} ({n} chips): valid meshes have {letters} = {n}, "
                         "or auto")
    shape, axes = tuple(sizes.values()), tuple(sizes)
    if target.platform == "cuda":
        grid = np.asarray(target.topology.devices, dtype=object).reshape(shape)
        return jax.sharding.Mesh(grid, axes)
    return topologies.make_mesh(target.topology, shape, axes)


# ----- the run to compile -----------------------------------------------------------------------
@dataclasses.dataclass(frozen=True, kw_only=True)
class AotConfig:
    """One compile check. model: a planner preset (`planner.MODEL_PRESETS`); run: the run config
    (a configs/*.yaml merged over the defaults, `run_config`): its dtype, weight_dtype, mesh,
    cache and engine are used (the model path is not: the weights are abstract). pages: "all"
    compiles every page bucket of the warm-up, "ends" only the smallest and largest of each
    other shape, "largest" only the largest (the memory peak); the others differ only in a
    static page count, and their outputs are taken from a compiled one. decode_only likewise
    skips the prompt-chunk variants, and chunks keeps only the prompt-chunk variants of those
    chunk buckets (e.g. (512,): the production chunk, whose temporaries are the prefill's
    peak). compile_only names the step functions to compile (`STEP_FUNCTIONS`; None: all): a
    check of the model pass alone (the pool written in place, a chunk's temporaries) need not
    wait for the sampling programs, which touch neither the weights nor the pool; the others
    are traced for their outputs only (`traced_outputs`: what is not an argument rolled forward
    comes without a sharding, so leave out only steps whose other outputs the host alone reads,
    as the samples), and the report's checks cover what was compiled."""

    model: str
    target: str
    run: cfg.RunConfig = dataclasses.field(default_factory=cfg.RunConfig)
    pages: str = "all"
    max_len: int | None = None  # the warm-up's: requests up to this many tokens (None: all)
    num_layers: int | None = None  # fewer layers of the preset's shape (a quick check)
    decode_only: bool = False  # compile no prompt-chunk variant (T > 0) of mixed_step
    chunks: tuple[int, ...] | None = None  # prompt-chunk buckets to compile (None: all)
    compile_only: tuple[str, ...] | None = None  # step functions to compile (None: all)

    def __post_init__(self):
        planner.model_preset(self.model)
        if self.pages not in PAGE_CHOICES:
            raise ValueError(f"pages={self.pages!r} must be one of {', '.join(PAGE_CHOICES)}")
        buckets = self.run.engine.prefill_buckets
        if self.chunks is not None and not set(self.chunks) <= set(buckets):
            raise ValueError(f"chunks={self.chunks}: valid chunk buckets are the run's "
                             f"prefill_buckets {tuple(buckets)}")
        unknown = set(self.compile_only or ()) - set(STEP_FUNCTIONS)
        if unknown or self.compile_only == ():
            raise ValueError(f"compile_only={self.compile_only}: valid step functions are "
                             f"{', '.join(STEP_FUNCTIONS)} (at least one)")
        method = self.run.engine.speculative_method
        if method not in ("none", "ngram"):
            raise ValueError(f"speculative_method={method!r}: the compile check builds no draft "
                             "model; valid: none, ngram")


def run_config(path: str | None, **overrides: Any) -> cfg.RunConfig:
    """A RunConfig from a YAML run config (None: defaults) with dotted `overrides`
    ({"engine.max_slots": 16, "mesh": "data:2,model:2"}) applied after it."""
    run = cfg.RunConfig()
    if path:
        data, lines = cfg.load_yaml(path)
        data.pop("preset", None)
        run = cfg.merge(run, data, source=f"config file {path}", lines=lines)
    nested: dict[str, Any] = {}
    for key, value in overrides.items():
        *sections, name = key.split(".")
        node = nested
        for section in sections:
            node = node.setdefault(section, {})
        node[name] = value
    return cfg.merge(run, nested, source="overrides") if nested else run


def model_config(aot: AotConfig) -> cfg.ModelConfig:
    """The preset at the run's dtypes (bf16 unless the run says otherwise), as a float
    checkpoint loaded for the target would be (int4's group: `quant.default_int4_group`)."""
    preset = planner.model_preset(aot.model)
    group = quant.default_int4_group(target_platform(aot.target), "hf",
                                     (preset.embed_dim, preset.ffn_dim))
    return dataclasses.replace(preset, dtype=aot.run.dtype or "bfloat16",
                               weight_dtype=aot.run.weight_dtype,
                               num_layers=aot.num_layers or preset.num_layers,
                               int4_group_size=group,
                               scan_layers=cfg.resolve_scan_layers(
                                   aot.run.scan_layers, target_platform(aot.target)))


def target_platform(name: str) -> str:
    """The platform of target `name` ('gpu:h100': "cuda", a TPU topology: "tpu")."""
    return "cuda" if name.partition(":")[0] == "gpu" else "tpu"


# ----- compiling through the engine's warm-up ---------------------------------------------------
def _bytes_per_device(tree) -> int:
    """Bytes one device holds of the abstract arrays in `tree` (sharded ones: one shard)."""
    total = 0
    for x in jax.tree.leaves(tree):
        if isinstance(x, jax.ShapeDtypeStruct) and x.sharding is not None:
            shape = x.sharding.shard_shape(x.shape)
            total += quant.array_bytes(shape, x.dtype)
    return total


@dataclasses.dataclass
class Executable:
    """One compiled step function: its static arguments and XLA's analyses (per device)."""

    name: str
    static: dict
    compile_s: float
    compile_cpu_s: float  # the process's CPU seconds over the compile: on a shared machine, the
    # comparable figure (wall time grows with the load)
    argument_bytes: int
    output_bytes: int
    alias_bytes: int
    temp_bytes: int
    code_bytes: int
    placed_argument_bytes: int  # of its arguments, the device-placed ones (not host inputs)
    flops: float
    bytes_accessed: float  # XLA's count: a loop's body once
    loop_bytes: int | None  # what it leaves out: a loop body's further trips (None: unknown)
    custom_call_operand_bytes: int  # operands of Pallas kernels (custom calls) it runs
    gathered_table_bytes: int  # weight tables XLA counts whole where a gather reads rows
    staged_bytes: int  # written into TPU VMEM by staging copies (counted besides the HBM read)
    moves: list[str]  # all-gather / copy / transpose of a weight or a pool layer (`shape_moves`)

    @property
    def peak_bytes(self) -> int:
        return (self.argument_bytes + self.output_bytes - self.alias_bytes + self.temp_bytes
                + self.code_bytes)


class CompileFailure(Exception):
    """The target's compiler refused a step (the message names it and gives the first line of
    the compiler's error)."""


class Compiler:
    """A `steps.Call` that compiles a jitted step function from its (abstract) arguments and
    returns its outputs as abstract arrays in the shardings the executable gives them, so the
    warm-up hands them to the next step as it would the real ones. Each distinct call compiles
    once. A call whose static variant (`static`: its static arguments, chunk size, draft width)
    `wanted` refuses reuses the outputs of the same function's last compile instead (the
    variants of one step function differ in static counts, not in their outputs' shapes).
    A function `compiles` refuses is never compiled: its outputs come from its trace
    (`traced_outputs`).
    """

    def __init__(self, *, weight_bytes: int, wanted=lambda static: True,
                 compiles=lambda name: True, log=print):
        self.wanted = wanted
        self.compiles = compiles
        self.weight_bytes = weight_bytes  # smallest weight shard: what counts as weight-sized
        self.shapes: dict[tuple[int, ...], str] = {}  # what a move must not move (`shape_moves`)
        self.log = log
        self.executables: list[Executable] = []
        self.skipped = 0
        self._done: dict[Any, Any] = {}
        self._last: dict[str, Any] = {}

    def __call__(self, fn, *args, **kwargs):
        name = fn.__name__
        key = (name, tuple(sorted(kwargs.items())), _signature(args))
        if key in self._done:
            return self._done[key]
        static = {k: v for k, v in kwargs.items() if not _is_array(v)}
        for x in args:  # the shapes that make a variant
            if isinstance(x, steps.MixedBatch) and x.chunk_tokens is not None:
                static["chunk"] = x.chunk_tokens.shape[0]
            if isinstance(x, steps.VerifyBatch):
                static["width"] = x.draft_ids.shape[1]
        if name in self._last and not self.wanted(static):
            self.skipped += 1
            return self._last[name]
        if not self.compiles(name):
            self.skipped += 1
            self._done[key] = traced_outputs(fn, args, kwargs)
            return self._done[key]
        self.log(f"compiling {name} {static} ...")
        t0, c0 = time.perf_counter(), time.process_time()
        try:
            compiled = fn.trace(*args, **kwargs).lower().compile()
        except jax.errors.JaxRuntimeError as e:  # e.g. RESOURCE_EXHAUSTED: a result to report
            raise CompileFailure(f"{name} {static}: {str(e).strip().splitlines()[0]}") from e
        seconds = (time.perf_counter() - t0, time.process_time() - c0)
        self.executables.append(self._analyse(name, static, seconds, compiled, args, kwargs))
        out = jax.tree.map(lambda o, s: jax.ShapeDtypeStruct(o.shape, o.dtype, sharding=s),
                           compiled.out_info, compiled.output_shardings)
        self._done[key] = self._last[name] = out
        return out

    def _analyse(self, name, static, seconds, compiled, args, kwargs) -> Executable:
        mem = compiled.memory_analysis()
        cost = compiled.cost_analysis() or {}
        if isinstance(cost, list):
            cost = cost[0] if cost else {}
        hlo = compiled.as_text()
        kernels, gathered, staged = whole_operand_bytes(hlo, self.weight_bytes)
        return Executable(
            name=name, static=static, compile_s=seconds[0], compile_cpu_s=seconds[1],
            argument_bytes=mem.argument_size_in_bytes, output_bytes=mem.output_size_in_bytes,
            alias_bytes=mem.alias_size_in_bytes, temp_bytes=mem.temp_size_in_bytes,
            code_bytes=mem.generated_code_size_in_bytes,
            placed_argument_bytes=_bytes_per_device((args, kwargs)),
            flops=float(cost.get("flops", 0.0)),
            bytes_accessed=float(cost.get("bytes accessed", 0.0)), loop_bytes=loop_bytes(hlo),
            custom_call_operand_bytes=kernels, gathered_table_bytes=gathered,
            staged_bytes=staged,
            moves=shape_moves(hlo, self.shapes))


def traced_outputs(fn, args, kwargs):
    """The outputs of jitted `fn` on abstract `args` without compiling it: shapes and dtypes
    from its trace; an output that is an argument rolled forward (the same tree of shapes and
    dtypes: the donated pool or slot state) in that argument's shardings, as the engine's
    compiled steps return it (tests/test_recompiles.py checks it); the others (the samples,
    which only the host reads) as the trace types them (on the engine's meshes, whose axes are
    auto, without a sharding)."""
    def signature(tree) -> tuple:
        leaves, treedef = jax.tree.flatten(tree)
        return (treedef,) + tuple((getattr(x, "shape", None), getattr(x, "dtype", None))
                                  for x in leaves)

    rolled = {signature(a): a for a in args if jax.tree.leaves(a)}

    def placed(out):
        arg = rolled.get(signature(out))
        if arg is None:
            return out
        return jax.tree.map(lambda o, a: jax.ShapeDtypeStruct(
            o.shape, o.dtype, sharding=getattr(a, "sharding", None)), out, arg)

    out = fn.trace(*args, **kwargs).out_info
    return tuple(placed(o) for o in out) if isinstance(out, tuple) else placed(out)


def _is_array(x) -> bool:
    return isinstance(x, (jax.ShapeDtypeStruct, np.ndarray, jax.Array)) or (
        dataclasses.is_dataclass(x) and not isinstance(x, type))


def _signature(args) -> tuple:
    leaves, treedef = jax.tree.flatten(args)
    return (str(treedef),) + tuple(
        (tuple(np.shape(x)), str(np.dtype(x.dtype)) if hasattr(x, "dtype") else type(x).__name__,
         getattr(x, "sharding", None)) for x in leaves)


# ----- the check --------------------------------------------------------------------------------
@dataclasses.dataclass
class Report:
    """Everything `check` found; `checks` are (name, passed, detail), passed None where the
    target's compiler does not report what the check needs."""

    aot: AotConfig
    target: Target
    mesh: dict
    executables: list[Executable]
    skipped: int
    variants: int
    resident_bytes: int
    pool_bytes: int  # the KV pool on one chip
    peak_bytes: int
    hbm_bytes: int
    reserve_bytes: int
    planner_bytes: dict
    decode: Executable | None
    roofline_bytes: float
    checks: list[tuple[str, bool | None, str]]

    @property
    def ok(self) -> bool:
        return all(passed is not False for _, passed, _ in self.checks)


def build_engine(aot: AotConfig, mesh, compiler: Compiler, target: Target) -> Engine:
    """The engine of `aot.run` on `mesh` over an abstract model, its steps compiled by
    `compiler`. attention_impl auto -> pallas (the target is an accelerator, as
    `attention.resolve_impl` resolves it there)."""
    engine_cfg, config = aot.run.engine, model_config(aot)
    if engine_cfg.attention_impl == "auto":
        engine_cfg = dataclasses.replace(engine_cfg, attention_impl="pallas")
    model = Llama.abstract(config)
    return Engine(model, None, cache=aot.run.cache, engine=engine_cfg, mesh=mesh, call=compiler)


def planner_prediction(aot: AotConfig, target: Target, mesh, rows: int | None = None) -> dict:
    """The planner's per-chip bytes for this run (`planner` module doc) at `rows` slots per data
    shard (default: the config's): weights, KV pages, activations (for the engine's largest
    pass: a prompt chunk beside the decode rows; the decode rows alone when `decode_only`
    compiles no chunk variant) or, with a drafter, the speculative acceptance's sampling
    program where it is larger, and the runtime reserve of the chip's HBM."""
    model, cache = model_config(aot), aot.run.cache.resolved(model_config(aot))
    e = aot.run.engine
    if e.max_loras:  # the LoRA pool, which the engine adds to the model
        model = dataclasses.replace(model, lora_slots=e.max_loras, lora_rank=e.max_lora_rank)
    mp, ep = tensor_parallel(mesh.shape)
    rows = rows or -(-aot.run.engine.max_slots // mesh.shape["data"])
    weights, _ = planner.weight_bytes_per_chip(model, mp, ep)
    slot = cache.pages_per_seq * cache.page_size * planner.kv_cache_bytes_per_token_per_chip(
        model, mp, cache.dtype or model.dtype, page_size=cache.page_size,
        chip=planner.chip_spec(target.chip).name)  # an int8 pool's scales included
    hbm = planner.chip_spec(target.chip).memory_bytes
    prompt_len = 0 if aot.decode_only else aot.run.engine.chunk_size
    act = planner.activation_bytes(model, mp, prompt_len, rows, ep)
    accept = planner.acceptance_bytes(
        model, mp, rows * mesh.shape["data"],
        e.spec_width if e.speculative_method != "none" else 0)
    return {"weight_bytes": weights, "kv_bytes": rows * slot, "activation_bytes": act,
            "acceptance_bytes": accept, "total_bytes": weights + rows * slot + max(act, accept),
            "kv_bytes_per_slot": slot,
            "hbm_bytes": hbm, "reserve_bytes": int(planner.RUNTIME_RESERVE_FRACTION * hbm)}


def tensor_parallel(mesh_shape) -> tuple[int, int]:
    """(the tensor-parallel chips, expert x model; the expert axis) of a mesh's shape, as the
    planner counts them."""
    ep = mesh_shape.get("expert", 1)
    return ep * mesh_shape["model"], ep


def largest_batch(aot: AotConfig, target: Target, mesh) -> int:
    """The most slots (a multiple of the data axis) whose planned bytes fit HBM less the
    reserve; 0 when not even one per data shard does."""
    def fits(rows: int) -> bool:
        p = planner_prediction(aot, target, mesh, rows)
        return p["total_bytes"] <= p["hbm_bytes"] - p["reserve_bytes"]

    return planner.largest_fitting(fits) * mesh.shape["data"]


def check_fits_planned(aot: AotConfig, target: Target, mesh) -> None:
    """Raises ValueError before any compile when the planner already says the run cannot fit:
    by how much, and the largest batch that would."""
    p = planner_prediction(aot, target, mesh)
    budget = p["hbm_bytes"] - p["reserve_bytes"]
    if p["total_bytes"] > budget:
        raise ValueError(
            f"{aot.model} with max_slots={aot.run.engine.max_slots} at max_seq_len="
            f"{aot.run.cache.resolved(model_config(aot)).max_seq_len} on {target.name} (mesh "
            f"{dict(mesh.shape)}) cannot fit: {p['total_bytes'] / GIB:.2f} GiB per chip (weights "
            f"{p['weight_bytes'] / GIB:.2f}, KV {p['kv_bytes'] / GIB:.2f}, activations "
            f"{p['activation_bytes'] / GIB:.2f}, acceptance {p['acceptance_bytes'] / GIB:.2f}) "
            f"is {(p['total_bytes'] - budget) / GIB:.2f} GiB "
            f"over the {budget / GIB:.2f} GiB a chip has after the runtime reserve; the largest "
            f"batch that fits is max_slots={largest_batch(aot, target, mesh)}")


def smallest_weight_bytes(params) -> int:
    """Per-chip bytes of the smallest weight matrix (ndim >= 2) of the abstract params."""
    sizes = [_bytes_per_device(x) for x in jax.tree.leaves(params) if len(x.shape) >= 2]
    return min(sizes)


def check(aot: AotConfig, log=print) -> Report:
    """Compiles every step variant of `aot.run`'s warm-up for `aot.target` and checks it
    (module doc). Bad input (target, mesh, config) raises ValueError naming it."""
    target = resolve_target(aot.target)
    mesh = target_mesh(target, aot.run.mesh)
    check_fits_planned(aot, target, mesh)
    compiler = Compiler(weight_bytes=0, log=log)
    engine = build_engine(aot, mesh, compiler, target)
    runner = engine.runner
    compiler.weight_bytes = smallest_weight_bytes(runner.params)
    stacked = model_config(aot).scan_layers
    layers = runner.params["layers"]  # the per-layer arrays (stacks when scanned)
    compiler.shapes = {
        **array_shapes(runner.kv.k_pages, "KV pool", rows=stacked),
        **array_shapes({k: v for k, v in runner.params.items() if k != "layers"}, "weight"),
        **array_shapes(layers, "weight", rows=stacked)}
    compiler.wanted = _variant_filter(aot, engine)
    if aot.compile_only is not None:
        compiler.compiles = set(aot.compile_only).__contains__
    log(f"{aot.model} on {target.name} ({target.num_chips} chips, {target.num_hosts} hosts), "
        f"mesh {dict(mesh.shape)}, attention {runner.attention_impl}")
    try:
        variants = warmup(engine, aot.max_len)
    except CompileFailure as e:
        return _failed_report(aot, target, mesh, compiler, str(e))
    resident = _bytes_per_device(runner.resident())
    pool = _bytes_per_device((runner.kv.k_pages, runner.kv.v_pages))
    peak = max(e.peak_bytes + max(0, resident - e.placed_argument_bytes)
               for e in compiler.executables)
    plan = planner_prediction(aot, target, mesh)
    decode = _decode_executable(compiler.executables)
    roofline = _roofline_bytes(aot, engine, mesh, decode)
    report = Report(aot=aot, target=target, mesh=dict(mesh.shape),
                    executables=compiler.executables, skipped=compiler.skipped, variants=variants,
                    resident_bytes=resident, pool_bytes=pool, peak_bytes=peak,
                    hbm_bytes=plan["hbm_bytes"], reserve_bytes=plan["reserve_bytes"],
                    planner_bytes=plan, decode=decode, roofline_bytes=roofline, checks=[])
    report.checks = _checks(report, engine)
    return report


def _failed_report(aot: AotConfig, target: Target, mesh, compiler: Compiler,
                   error: str) -> Report:
    """The report of a run whose compile failed: what compiled before, and the failure."""
    plan = planner_prediction(aot, target, mesh)
    return Report(aot=aot, target=target, mesh=dict(mesh.shape),
                  executables=compiler.executables, skipped=compiler.skipped, variants=0,
                  resident_bytes=0, pool_bytes=0, peak_bytes=0, hbm_bytes=plan["hbm_bytes"],
                  reserve_bytes=plan["reserve_bytes"], planner_bytes=plan, decode=None,
                  roofline_bytes=0.0, checks=[("compiles", False, error)])


def _variant_filter(aot: AotConfig, engine: Engine):
    """Which static variants to compile (`AotConfig.pages`, `.decode_only`, `.chunks`)."""
    from jaxinfer.engine.warmup import page_buckets

    pick = {"all": lambda b: b, "ends": lambda b: (b[0], b[-1]),
            "largest": lambda b: b[-1:]}[aot.pages]
    # a step with a prompt chunk has its own page buckets (`BatchBuilder.chunk_pages`)
    kept = {chunked: pick(page_buckets(engine, aot.max_len, chunk=chunked))
            for chunked in (False, True)}

    def wanted(static: dict) -> bool:
        chunk = static.get("chunk", 0)
        if static.get("num_pages_read", kept[chunk > 0][0]) not in kept[chunk > 0]:
            return False
        if chunk and aot.chunks is not None and chunk not in aot.chunks:
            return False
        return not (aot.decode_only and chunk > 0)

    return wanted


def _decode_executable(executables: list[Executable]) -> Executable | None:
    """The decode step (mixed_forward with no prompt chunk: T = 0) at its largest page
    bucket: the step a serving engine runs most."""
    decodes = [e for e in executables if e.name == "mixed_forward" and e.static.get("chunk") == 0]
    return max(decodes, key=lambda e: e.static["num_pages_read"], default=None)


def _roofline_bytes(aot: AotConfig, engine: Engine, mesh, decode: Executable | None) -> float:
    """The planner's decode-step HBM bytes per chip at the decode executable's page bucket:
    the weights once (less the input embedding shard when untied: a decode gathers B rows of
    it; less the experts its rows are expected not to route to) + every row's KV read over the
    bucket's pages + the rows' new KV written."""
    if decode is None:
        return 0.0
    model, cache = model_config(aot), engine.cache_config
    mp, ep = tensor_parallel(mesh.shape)
    rows = -(-aot.run.engine.max_slots // mesh.shape["data"])
    weights, embed = planner.weight_bytes_per_chip(model, mp, ep)
    kv_token = planner.kv_bytes_per_token_per_chip(
        model, mp, planner.DTYPE_BYTES[cache.dtype or model.dtype])
    read = (weights if model.tie_embeddings else weights - embed) \
        - planner.unread_expert_bytes(model, mp, rows, ep)
    live = rows * decode.static["num_pages_read"] * cache.page_size * kv_token
    return read + live + rows * kv_token


def live_kv_bytes(report: Report, engine: Engine) -> float:
    """The KV the decode executable's attention reads (its share of the roofline bytes)."""
    model, cache = model_config(report.aot), engine.cache_config
    rows = -(-report.aot.run.engine.max_slots // report.mesh["data"])
    kv_token = planner.kv_bytes_per_token_per_chip(
        model, tensor_parallel(report.mesh)[0], planner.DTYPE_BYTES[cache.dtype or model.dtype])
    return rows * report.decode.static["num_pages_read"] * cache.page_size * kv_token


def decode_bytes_like_roofline(report: Report, engine: Engine) -> float:
    """XLA's bytes accessed of the decode step, with what it counts for the Pallas kernels (every
    operand whole: each layer's pool) replaced by the live KV they read (module doc)."""
    d = report.decode
    like = d.bytes_accessed + d.loop_bytes - d.gathered_table_bytes - d.staged_bytes
    if not d.custom_call_operand_bytes:
        return like
    return like - d.custom_call_operand_bytes + live_kv_bytes(report, engine)


def _checks(r: Report, engine: Engine) -> list[tuple[str, bool | None, str]]:
    gib = lambda b: f"{b / GIB:.2f} GiB"  # noqa: E731
    budget = r.hbm_bytes - r.reserve_bytes
    predicted = r.planner_bytes["total_bytes"]
    out = [("fits HBM", r.peak_bytes <= budget,
            f"peak {gib(r.peak_bytes)} per chip <= {gib(budget)} (HBM {gib(r.hbm_bytes)} less "
            f"{gib(r.reserve_bytes)} reserve); "
            + (f"over by {gib(r.peak_bytes - budget)}" if r.peak_bytes > budget
               else f"{gib(budget - r.peak_bytes)} free")),
           ("matches planner", abs(r.peak_bytes - predicted) <= PLANNER_TOLERANCE * predicted,
            f"peak {gib(r.peak_bytes)} vs planner {gib(predicted)} "
            f"({(r.peak_bytes / predicted - 1) * 100:+.1f}%, limit "
            f"±{PLANNER_TOLERANCE:.0%})")]
    moves = sorted({m for e in r.executables for m in e.moves if " weight" in m})
    out.append(("no weight gathered/copied", not moves,
                "none" if not moves else f"{len(moves)} kinds: {', '.join(moves[:6])}"))
    if r.decode is not None and not r.decode.bytes_accessed:
        out.append(("decode bytes <= 1.15x roofline", None,
                    f"n/a: XLA reports no cost analysis for {r.target.name} (deviceless)"))
    elif r.decode is not None and r.decode.loop_bytes is None:
        out.append(("decode bytes <= 1.15x roofline", None,
                    "n/a: a loop whose trip count the optimised HLO does not give (module doc)"))
    elif r.decode is not None:
        like = decode_bytes_like_roofline(r, engine)
        out.append(("decode bytes <= 1.15x roofline", like <= DECODE_BYTES_LIMIT * r.roofline_bytes,
                    f"{like / 1e9:.3f} GB ({like / r.roofline_bytes:.3f}x) vs roofline "
                    f"{r.roofline_bytes / 1e9:.3f} GB at {r.decode.static['num_pages_read']} "
                    f"pages; XLA counted {r.decode.bytes_accessed / 1e9:.3f} GB"
                    + (f" + {r.decode.loop_bytes / 1e9:.3f} GB in loop trips it leaves out"
                       if r.decode.loop_bytes else "") + ", of which "
                    f"{r.decode.custom_call_operand_bytes / 1e9:.3f} GB kernel operands, "
                    f"{r.decode.gathered_table_bytes / 1e9:.3f} GB gathered tables, "
                    f"{r.decode.staged_bytes / 1e9:.3f} GB staged in VMEM"))
    forwards = [e for e in r.executables if e.name.endswith("_forward")
                or e.name == "copy_pages"]
    short = [e for e in forwards if e.alias_bytes < r.pool_bytes]
    pool_copies = [m for e in forwards for m in e.moves if " KV pool" in m]
    out.append(("KV pool donated and aliased", not short and not pool_copies,
                f"pool {gib(r.pool_bytes)} per chip; min alias "
                f"{gib(min((e.alias_bytes for e in forwards), default=0))} over "
                f"{len(forwards)} executables" + (f"; pool-sized copies: {pool_copies[:3]}"
                                                  if pool_copies else "")))
    return out
