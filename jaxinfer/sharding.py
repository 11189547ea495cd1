"""Device meshes and the logical-axis sharding rules (docs/architecture.md, decision 8).

A mesh has the axes ("data", "model"), and ("data", "expert", "model") when the spec names an
expert axis: `--mesh=data:D,expert:E,model:M` (any part may be omitted: size 1), or `auto`
(every device on "model"). Every weight and the KV pool carry logical axis names
(`nnx.Param(out_sharding=...)`, `kv_cache.PAGES_AXES`); ONE table, `RULES`, maps a logical axis
to a mesh axis or to a tuple of them (the dimension split over their product; an axis the mesh
lacks counts as size 1). For an array the rule gives a PartitionSpec, with two adjustments,
both decided per array and logged:

- a dimension the mesh axes do not divide is replicated instead (e.g. SmolLM2's 3 kv heads on
  a 4-way model axis: attention weights and KV pages replicated, MLP and vocab still split);
- a mesh axis used by two dimensions of one array is a collision: refused with an error.

Tensor parallelism: query/kv heads, the FFN and the vocabulary are split over "expert" x
"model" (`TENSOR`: on a mesh without an expert axis, "model"); the activations follow by XLA's
sharding propagation (GSPMD), which inserts the all-reduces after the attention output and down
projections. The KV pool splits over kv heads like the weights that write it. The "data" axis
is a batch axis for slot-major arrays (`batch` rule), and splits the paged pool by pages
(`pages` rule): each data shard holds the pages of its own group of slots (`kv_cache` module
doc), so D data shards hold D times the sequences a single one can.

Expert parallelism: a mixture layer's experts split over "expert" and each expert's FFN over
"model" (`expert`, `expert_ffn` rules), so a chip holds E / expert of the experts with
F / model of each one's FFN; the router stays whole. Everything else treats the expert axis as
more tensor parallelism ("expert-tensor parallel"): attention heads and the KV pool split over
all expert x model chips instead of being copied on each expert shard. The mixture itself runs
under `shard_map` (`jaxinfer.model.moe`: why its combine is one all-reduce). An expert count
the axis does not divide is refused before any weight loads (`ModelConfig.check_mesh`).

Placement: jit compiles once per set of argument shardings and compares them as written
(`P("model")` and `P("model", None)` are two keys, an uncommitted array a third), so an array
must reach a step in the same sharding whether the host built it, a warm-up made it up or the
previous step returned it. The device-side arrays of the steps (weights, KV pool, slot state,
sampling rows, a drafter's proposals) have one spelling (`named`: trailing Nones dropped, as jax
spells a jit's outputs), one door (`place`) and one pin (`constrain`: a step returns what the
next one takes in the sharding `place` gives it, so placing it again moves nothing). Each
array's spec comes from one function of its shape and the mesh, used by both. (The small
host-built inputs of a step go to it as numpy arrays, which need no sharding:
`engine.runner.ModelRunner.host`.)
"""

from __future__ import annotations

import contextlib
import logging
import math
from collections.abc import Callable, Sequence

import jax
import numpy as np
from jax.sharding import AbstractMesh, Mesh, NamedSharding, Sharding, SingleDeviceSharding
from jax.sharding import PartitionSpec as P

AXES = ("data", "expert", "model")
TENSOR = ("expert", "model")  # the tensor-parallel axes: heads, FFN and vocabulary split over both

Rule = str | tuple[str, ...] | None

# logical axis -> mesh axis, or a tuple of mesh axes (None = replicated). The one table.
RULES: dict[str, Rule] = {
    "vocab": TENSOR,
    "q_heads": TENSOR,
    "kv_heads": TENSOR,
    "ffn": TENSOR,
    "expert": "expert",  # a mixture's experts (`jaxinfer.model.moe`)
    "expert_ffn": "model",  # each expert's FFN
    "router": None,  # the router's expert logits: whole on every chip (each row's top-k)
    "embed": None,
    "head_dim": None,
    "qkv": None,
    "gate_up": None,
    "lora": None,  # the LoRA pool's adapter slots (`jaxinfer.model.lora`)
    "lora_rank": None,
    "norm": None,
    "pages": "data",
    "page_offset": None,
    "batch": "data",
    # The scanned layout's stacks (`jaxinfer.model.layers`): never split, so each step of the
    # scan reads its layer's weights and pool whole on the chips that hold them.
    "layers": None,
}

log = logging.getLogger(__name__)

Specs = Callable[[object, Mesh | AbstractMesh], object]  # (tree, mesh) -> its specs (or a prefix)


def parse_mesh(spec: str, num_devices: int) -> dict[str, int]:
    """'data:D,expert:E,model:M' (any part may be omitted: size 1) or 'auto' -> the mesh axes'
    sizes in `AXES` order: {"data": D, "model": M}, with "expert": E between them when the
    spec names it."""
    if spec == "auto":
        return {"data": 1, "model": num_devices}
    sizes: dict[str, int] = {}
    for part in spec.split(","):
        name, sep, value = part.partition(":")
        name = name.strip()
        if not sep or name not in AXES:
            raise ValueError(f"--mesh={spec!r}: bad part {part!r}; expected "
                             f"'data:D,expert:E,model:M' with axes {AXES}, or 'auto'")
        if name in sizes:
            raise ValueError(f"--mesh={spec!r}: axis {name!r} given twice")
        try:
            sizes[name] = int(value)
        except ValueError:
            raise ValueError(f"--mesh={spec!r}: size {value!r} of {name!r} is not an "
                             "integer") from None
        if sizes[name] <= 0:
            raise ValueError(f"--mesh={spec!r}: size of {name!r} must be >= 1")
    sizes = {a: sizes.get(a, 1) for a in AXES if a != "expert" or a in sizes}
    total = math.prod(sizes.values())
    if total > num_devices:
        product = " x ".join(sizes)
        raise ValueError(f"--mesh={spec!r} needs {total} devices but only {num_devices} exist "
                         f"({jax.default_backend()}); valid meshes have {product} <= "
                         f"{num_devices}")
    return sizes


def make_mesh(spec: str, devices: Sequence[jax.Device] | None = None) -> Mesh:
    """The mesh of `spec` (`parse_mesh`: ("data", "model") or ("data", "expert", "model")) over
    the first devices it needs, model the fastest-varying axis (auto axis types, so jit
    propagates shardings through the model)."""
    devices = list(devices if devices is not None else jax.devices())
    sizes = parse_mesh(spec, len(devices))
    n = math.prod(sizes.values())
    grid = np.asarray(devices[:n], dtype=object).reshape(tuple(sizes.values()))
    return Mesh(grid, tuple(sizes))


def _mesh_axes(rule: Rule, mesh: Mesh | AbstractMesh) -> tuple[str, ...]:
    """The axes of `rule` that split on `mesh`: named in it and of size > 1 there (an axis of
    `AXES` the mesh lacks counts as size 1; any other name is an error in the rules)."""
    names = (rule,) if isinstance(rule, str) else tuple(rule or ())
    for name in names:
        if name not in AXES and name not in mesh.shape:
            raise ValueError(f"rule -> {name!r}: no such mesh axis in {tuple(mesh.shape)}")
    return tuple(a for a in names if mesh.shape.get(a, 1) > 1)


def shards(mesh: Mesh | AbstractMesh, entry: str | tuple[str, ...] | None) -> int:
    """How many ways a PartitionSpec `entry` (None, a mesh axis or a tuple of them) splits a
    dimension on `mesh`."""
    names = (entry,) if isinstance(entry, str) else tuple(entry or ())
    return math.prod(mesh.shape[a] for a in names)


def spec_for(name: str, axes: Sequence[str | None], shape: Sequence[int],
             mesh: Mesh | AbstractMesh, rules: dict[str, Rule] = RULES) -> P:
    """PartitionSpec of array `name` with logical `axes` and `shape` on `mesh` (see module doc).
    A dimension split over several mesh axes gets them as a tuple, over one its name."""
    if len(axes) != len(shape):
        raise ValueError(f"{name}: {len(axes)} logical axes {tuple(axes)} for shape "
                         f"{tuple(shape)}")
    out, used = [], {}
    for axis, dim in zip(axes, shape):
        if axis is not None and axis not in rules:
            raise ValueError(f"{name}: logical axis {axis!r} has no rule; known: {sorted(rules)}")
        mesh_axes = _mesh_axes(rules.get(axis) if axis is not None else None, mesh)
        if not mesh_axes:
            out.append(None)
            continue
        for mesh_axis in mesh_axes:
            if mesh_axis in used:
                raise ValueError(f"{name}: logical axes {used[mesh_axis]!r} and {axis!r} both "
                                 f"map to mesh axis {mesh_axis!r} (a collision); fix RULES")
            used[mesh_axis] = axis
        entry = mesh_axes[0] if len(mesh_axes) == 1 else mesh_axes
        if dim % shards(mesh, entry):
            log.info("%s: %s=%d not divisible by %s=%d: replicated", name, axis, dim, entry,
                     shards(mesh, entry))
            out.append(None)
            continue
        out.append(entry)
    return P(*out)


def split_of(axis: str, dim: int, mesh: Mesh | AbstractMesh) -> str | tuple[str, ...] | None:
    """The PartitionSpec entry `spec_for` gives a dimension of size `dim` with logical `axis`
    on `mesh` (None: whole on every chip), for code that builds the spec of an array the
    rules place, e.g. a `shard_map` over the kv heads of the pool."""
    return spec_for(axis, (axis,), (dim,), mesh)[0]


def rule_shards(axis: str, mesh: Mesh | AbstractMesh | None) -> int:
    """How many chips the rule of logical `axis` spreads it over on `mesh` (a dimension they
    divide; 1 without a mesh): e.g. the tensor-parallel size, expert x model, for `kv_heads`."""
    if mesh is None or mesh.empty:
        return 1
    return math.prod(mesh.shape[a] for a in _mesh_axes(RULES[axis], mesh))


def narrow_kv_rules(axes: Sequence[str | None]) -> dict[str, Rule]:
    """RULES for a leaf of a model that is restored before its kv heads are duplicated to the
    tensor-parallel axes (`jaxinfer.model.kv_heads`): its `kv_heads` axis cannot split over them,
    so a leaf that has one splits its `embed` axis (or, without one, `head_dim`) there instead of
    being whole on every chip (70B's fused qkv on v5e-16: 0.8 GiB per chip instead of 12.5);
    the widening then reshards it into the duplicated layout."""
    if "kv_heads" not in axes:
        return RULES
    spare = "embed" if "embed" in axes else "head_dim"
    return {**RULES, "kv_heads": None, spare: RULES["kv_heads"]}


def param_shardings(model, mesh: Mesh, rules: dict[str, Rule] | Callable[
        [Sequence[str | None]], dict[str, Rule]] = RULES) -> dict:
    """NamedSharding for every leaf of `steps.split_model(model)[1]` (same nested dict).
    `rules`: a table, or a function of a leaf's logical axes that returns its table."""
    from flax import nnx

    _, state = nnx.split(model)
    specs = nnx.to_pure_dict(nnx.get_partition_spec(state))
    values = nnx.to_pure_dict(state)
    paths = jax.tree_util.tree_flatten_with_path(values)[0]
    flat_specs = jax.tree.leaves(specs, is_leaf=lambda x: isinstance(x, P))
    out = []
    for (path, value), axes in zip(paths, flat_specs, strict=True):
        name = jax.tree_util.keystr(path)
        table = rules(tuple(axes)) if callable(rules) else rules
        out.append(named(mesh, spec_for(name, tuple(axes), value.shape, mesh, table)))
    return jax.tree.unflatten(jax.tree.structure(values), out)


def vocab_last(x, mesh: Mesh | AbstractMesh) -> P:
    """Spec of an array whose last axis is the vocabulary (logits, draft probabilities, penalty
    counts): split by the `vocab` rule, every other axis whole."""
    return spec_for("vocab-last", (None,) * (x.ndim - 1) + ("vocab",), x.shape, mesh)


def whole(tree, mesh: Mesh | AbstractMesh) -> P:
    """Spec of every array of `tree`: replicated (a spec prefix of the whole tree)."""
    return P()


def named(mesh: Mesh | None, spec: P) -> Sharding:
    """The sharding of `spec` on `mesh` (None: the first device), in the one spelling the engine
    uses: trailing Nones dropped, which is how jax spells the shardings of a jit's outputs."""
    if mesh is None:
        return SingleDeviceSharding(jax.devices()[0])
    parts = list(spec)
    while parts and parts[-1] is None:
        parts.pop()
    return NamedSharding(mesh, P(*parts))


def placement(tree, specs: Specs, mesh: Mesh | None):
    """The shardings of `tree` on `mesh` by `specs(tree, mesh)` (a tree like `tree`, or one
    sharding for all of it); with no mesh, the first device for all of it."""
    if mesh is None:
        return named(None, P())
    return jax.tree.map(lambda s: named(mesh, s), specs(tree, mesh),
                        is_leaf=lambda s: isinstance(s, P))


def place(tree, shardings):
    """`tree` with each array committed to its sharding (`shardings`: one for all, or a tree
    like `tree`). Host arrays, uncommitted arrays and arrays anywhere else move in one
    `jax.device_put` (an array already laid out that way only changes its label: no copy); an
    array already there is returned as it is. An abstract leaf (`jax.ShapeDtypeStruct`, e.g. an
    abstract model's weight) gets the sharding attached and allocates nothing: the argument of
    an ahead-of-time compile."""
    leaves, treedef = jax.tree.flatten(tree)
    targets = ([shardings] * len(leaves) if isinstance(shardings, Sharding)
               else treedef.flatten_up_to(shardings))
    for i, (x, s) in enumerate(zip(leaves, targets)):
        if isinstance(x, jax.ShapeDtypeStruct):
            leaves[i] = jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s)
    moving = [i for i, (x, s) in enumerate(zip(leaves, targets))
              if not isinstance(x, jax.ShapeDtypeStruct)
              and not (isinstance(x, jax.Array) and x.committed and x.sharding == s)]
    if moving:
        moved = jax.device_put([leaves[i] for i in moving], [targets[i] for i in moving])
        for i, x in zip(moving, moved):
            leaves[i] = x
    return treedef.unflatten(leaves)


def constrain(tree, specs: Specs):
    """Inside a traced step: `tree` pinned to `specs(tree, context mesh)`, so the step returns it
    in the sharding `placement` gives it; `tree` itself without a context mesh (one device)."""
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty:
        return tree
    return jax.lax.with_sharding_constraint(tree, specs(tree, mesh))


def data_shards(mesh: Mesh | None = None) -> int:
    """The size of the "data" axis of `mesh`, or of the context mesh (`jax.set_mesh`, inside a
    traced step); 1 without one. The engine splits its slots and KV pool into this many parts."""
    if mesh is None:
        mesh = jax.sharding.get_abstract_mesh()
    return mesh.shape["data"] if "data" in mesh.axis_names else 1


def mesh_context(mesh: Mesh | None):
    """`jax.set_mesh(mesh)`, or a no-op context for None (one device)."""
    return contextlib.nullcontext() if mesh is None else jax.set_mesh(mesh)


def describe(mesh: Mesh) -> str:
    return " x ".join(f"{k}={v}" for k, v in mesh.shape.items()) + (
        f" ({math.prod(mesh.shape.values())} {mesh.devices.flat[0].platform} devices)")


def maybe_initialize_distributed(multihost: bool) -> bool:
    """`jax.distributed.initialize()` when asked for, or on a multi-worker TPU VM slice
    (TPU_WORKER_HOSTNAMES names more than one host). Returns whether it ran.

    On a TPU slice (or SLURM, Open MPI, k8s) jax detects the coordinator, process count and id
    itself. Elsewhere set JAX_COORDINATOR_ADDRESS (host:port of process 0; jax reads it),
    JAX_NUM_PROCESSES and JAX_PROCESS_ID (read here: jax 0.10 does not)."""
    import os

    hosts = os.environ.get("TPU_WORKER_HOSTNAMES", "")
    if multihost or len([h for h in hosts.split(",") if h]) > 1:
        kwargs = {}
        for name, env in (("num_processes", "JAX_NUM_PROCESSES"),
                          ("process_id", "JAX_PROCESS_ID")):
            if os.environ.get(env):
                kwargs[name] = int(os.environ[env])
        jax.distributed.initialize(**kwargs)
        return True
    return False
