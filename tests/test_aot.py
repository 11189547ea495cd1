"""The whole engine compiled deviceless for a TPU slice (and an sm_90a GPU where the jax CUDA
plugin is installed) at Llama-3.2-1B's layer shapes (head dim 64, 32 query and 8 kv heads; on
TPU its pool is stored lane-packed, two tokens to a 128-lane row, as the Mosaic kernels read
it), two layers deep, with the three checks of `jaxinfer.proof.aot` asserted: it fits as
planned, no weight is gathered or copied per step, the decode step's traffic is near its
roofline, and the donated KV pool is aliased and never relaid out; in both layouts of the layer
stack."""

import jax
import pytest

from jaxinfer.proof import aot
from tests.helpers import require_cuda_compiler

# page 32: a lane-packed bf16 page of H = 64 is then 16 rows, whole VMEM tiles
SMALL = {"engine.max_slots": 8, "cache.max_seq_len": 128, "cache.page_size": 32,
         "engine.prefill_buckets": [32], "engine.max_num_batched_tokens": 64}


def _check(target: str, mesh: str, **overrides):
    run = aot.run_config(None, **{**SMALL, "mesh": mesh, **overrides})
    # max_len 16: one page bucket; a decode and a prompt-chunk variant of each step
    return aot.check(aot.AotConfig(model="llama-3.2-1b", target=target, run=run, max_len=16,
                                   num_layers=2), log=lambda _: None)


def _assert_checks(report):
    failed = [(name, detail) for name, ok, detail in report.checks if ok is not True
              and not (ok is None and report.target.platform != "tpu")]
    assert not failed, failed
    names = [name for name, _, _ in report.checks]
    assert len(names) == 5, names
    forwards = [e for e in report.executables if e.name == "mixed_forward"]
    assert {e.static["chunk"] for e in forwards} == {0, 32}
    assert all(e.alias_bytes >= report.pool_bytes for e in forwards)


@pytest.mark.parametrize("scan_layers, weight_dtype", [
    ("false", None), ("true", None), pytest.param("true", "int4", marks=pytest.mark.slow)])
def test_tpu_slice_compiles_and_passes_the_checks(scan_layers, weight_dtype):
    """Both layouts; scanned (the TPU default): the layers a scan over the stacked weights, the
    pool a stacked array threaded through it: aliased in every forward, never copied nor
    relaid out, no layer's weights or pool row sliced out to HBM (the moves check covers one
    row of every stack), and the decode step's bytes, the scan's trips counted, within the
    unrolled layout's bound; also with native int4 weights."""
    report = _check("v5e:2x2", "data:1,model:4", scan_layers=scan_layers,
                    weight_dtype=weight_dtype)
    _assert_checks(report)
    assert report.target.platform == "tpu" and report.mesh == {"data": 1, "model": 4}
    assert aot.model_config(report.aot).scan_layers == (scan_layers == "true")


@pytest.mark.parametrize("scan_layers", ["false", "true"])
def test_int8_pool_with_two_kv_heads_per_chip_is_updated_in_place(scan_layers):
    """Llama-3.1-8B's heads (8 kv heads: two per chip on model:4) with an int8 pool on v5e:2x2,
    two layers deep: the decode step writes each chip's two kv heads' codes and scales into the
    donated pool in place, in both layouts; a scatter spanning both heads makes XLA:TPU relay
    the int8 pool out and back, a copy of the pool per layer per step. The write does not
    depend on how many pages the step reads, nor on the sampling: one page bucket (max_len 16)
    of the model pass and the page copy are compiled."""
    run = aot.run_config(None, **{
        "mesh": "data:1,model:4", "cache.dtype": "int8", "cache.page_size": 32,
        "cache.max_seq_len": 256, "engine.max_slots": 4, "engine.prefill_buckets": [32],
        "engine.max_num_batched_tokens": 64, "scan_layers": scan_layers})
    report = aot.check(aot.AotConfig(model="llama-3.1-8b", target="v5e:2x2", run=run,
                                     num_layers=2, max_len=16, decode_only=True,
                                     compile_only=("mixed_forward", "copy_pages")),
                       log=lambda _: None)
    checks = {name: (ok, detail) for name, ok, detail in report.checks}
    assert checks["KV pool donated and aliased"][0], checks["KV pool donated and aliased"]
    assert not [m for e in report.executables for m in e.moves], report.executables
    assert {e.name for e in report.executables} == {"mixed_forward", "copy_pages"}


def test_gpt_oss_compiles_its_sinks_into_the_kernels_and_reads_its_table_in_place():
    """gpt-oss-120b on v6e, two layers (a sliding-window and a full-attention one): its
    attention sinks run in the Pallas kernels (the decode kernel and, for the prompt chunk,
    the ragged one; Mosaic, over the lane-packed H = 64 pool), and its embedding, 2880 wide
    (not a multiple of 128), is read in place: XLA:TPU would lay the shards out column-major
    (the layout that pads least) and copy the whole table into rows every step for the row
    gather, so the engine commits it row-major (`steps.split_model`). No weight-sized move."""
    run = aot.run_config("configs/gpt-oss-120b-v6e-8.yaml", **{
        "engine.max_slots": 8, "cache.max_seq_len": 128, "engine.prefill_buckets": [32],
        "engine.prefill_chunk_size": 32, "engine.max_num_batched_tokens": 64})
    report = aot.check(aot.AotConfig(model="gpt-oss-120b", target="v6e:2x4", run=run,
                                     num_layers=2, max_len=16,
                                     compile_only=("mixed_forward",)), log=lambda _: None)
    config = aot.model_config(report.aot)
    assert config.attention_sinks and config.embed_dim % 128 != 0
    forwards = report.executables
    assert {e.static["chunk"] for e in forwards} == {0, 32}
    assert all(e.static["attention_impl"] == "pallas" for e in forwards), forwards
    assert not [m for e in forwards for m in e.moves], forwards


def test_int4_expert_scales_of_six_groups_are_read_in_place():
    """Qwen3-30B-A3B's int4 experts on v6e: the down projection's scales are [L, E, 6, D] (an
    FFN of 768 in groups of 128), whose 6 rows XLA:TPU would lay out column-major and copy
    into rows every step for the grouped-matmul kernel; committed row-major
    (`steps.split_model`), they are read in place: no weight-sized move."""
    run = aot.run_config("configs/qwen3-30b-a3b-v6e-4.yaml", **{
        "engine.max_slots": 8, "cache.max_seq_len": 128, "weight_dtype": "int4"})
    report = aot.check(aot.AotConfig(model="qwen3-30b-a3b", target="v6e:2x2", run=run,
                                     num_layers=2, max_len=16, decode_only=True,
                                     compile_only=("mixed_forward",)), log=lambda _: None)
    config = aot.model_config(report.aot)
    assert config.weight_dtype == "int4" and config.expert_ffn_dim // 128 % 8 != 0
    assert not [m for e in report.executables for m in e.moves], report.executables


def test_compile_only_traces_the_other_steps_for_their_outputs():
    """A step left uncompiled (`AotConfig.compile_only`) hands on its outputs from its trace:
    what it rolls forward (an argument's tree) in that argument's shardings, as a compiled step
    returns it, the rest without one; a name that is no step function is refused."""
    import jax.numpy as jnp
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    from jaxinfer.sharding import make_mesh

    mesh = make_mesh("data:8")  # auto axes, as the engine's
    rows = NamedSharding(mesh, P("data"))
    state = {"tokens": jax.ShapeDtypeStruct((8,), jnp.int32, sharding=rows),
             "seen": jax.ShapeDtypeStruct((8, 4), jnp.bool_, sharding=rows)}
    logits = jax.ShapeDtypeStruct((8, 16), jnp.float32, sharding=rows)

    @jax.jit
    def sample(state, logits):
        tokens = jnp.argmax(logits, -1).astype(jnp.int32)
        return {**state, "tokens": tokens}, (tokens, logits.max(-1))

    rolled, samples = aot.traced_outputs(sample, (state, logits), {})
    assert rolled["tokens"].sharding == rows and rolled["seen"].sharding == rows
    assert [(x.shape, x.sharding) for x in samples] == [((8,), None), ((8,), None)]
    with pytest.raises(ValueError, match="compile_only=.*valid step functions are mixed_forward"):
        aot.AotConfig(model="llama-3.1-8b", target="v5e:2x2", compile_only=("mixed_sampel",))


def test_gpu_sm90a_compiles_and_passes_the_checks():
    require_cuda_compiler()
    _assert_checks(_check("gpu:h100", "auto"))


def test_int4_prompt_chunk_temporaries_hold_the_dequantized_copy_the_planner_counts():
    """One 8B-shaped layer with native int4 weights (groups of 128) on v5e:2x2, model:4: the
    512-token prompt chunk dequantizes each matrix before its dot, and its step's temporaries
    exceed the decode step's by one bf16 copy of gate_up's shard, what the planner counts
    (`planner.dequantized_weight_bytes`: 4096 x 2 x 3584 x 2 bytes = 56 MiB; measured 57.4);
    a decode-sized step (<= 256 rows) counts none. Only the model pass is compiled."""
    from jaxinfer.perf import planner

    run = aot.run_config(None, **{
        "mesh": "data:1,model:4", "weight_dtype": "int4", "engine.max_slots": 4,
        "cache.max_seq_len": 1024, "cache.page_size": 32, "engine.prefill_buckets": [512],
        "engine.prefill_chunk_size": 512, "engine.max_num_batched_tokens": 516})
    report = aot.check(aot.AotConfig(model="llama-3.1-8b", target="v5e:2x2", run=run,
                                     max_len=16, num_layers=1, pages="largest",
                                     compile_only=("mixed_forward",)),
                       log=lambda _: None)
    forwards = {e.static["chunk"]: e for e in report.executables if e.name == "mixed_forward"}
    config = aot.model_config(report.aot)
    copy = planner.dequantized_weight_bytes(config, 4, 512)
    assert config.int4_group_size == 128 and copy == 4096 * 2 * 3584 * 2
    assert planner.dequantized_weight_bytes(config, 4, 256) == 0
    extra = forwards[512].temp_bytes - forwards[0].temp_bytes
    assert copy <= extra <= 1.1 * copy, (extra, copy)


def test_shape_moves_finds_a_gathered_weight():
    """The scan is not blind: an all-gather of a weight's shape outside fusions is reported; a
    VMEM staging copy of it and a copy of an activation are not."""
    hlo = """ENTRY %main (p: bf16[2048,512]) -> bf16[2048,2048] {
  %p = bf16[2048,512]{1,0:T(8,128)} parameter(0)
  %all-gather.1 = bf16[2048,2048]{1,0:T(8,128)} all-gather(%p), dimensions={1}, \
metadata={op_name="params['layers'][0]['o']"}
  %copy.2 = bf16[512,2048]{1,0:T(8,128)S(1)} copy(%p)
  %copy.3 = f32[8,512]{1,0} copy(%p)
}"""
    moves = aot.shape_moves(hlo, {(2048, 2048): "weight", (512, 2048): "weight"})
    assert moves == ["all-gather bf16[2048,2048] weight (params['layers'][0]['o'])"]


def test_shape_moves_finds_a_layer_row_sliced_out_of_a_stack():
    """With scanned layers a layer's weights (or pool row) copied out of its stack to HBM is a
    dynamic slice outside the matmul's fusion: reported, unit leading dim and all; staged into
    VMEM (S(1)) it is not."""
    hlo = """ENTRY %main (p: bf16[4,2048,512], i: s32[]) -> bf16[1,2048,512] {
  %p = bf16[4,2048,512]{2,1,0:T(8,128)} parameter(0)
  %i = s32[] parameter(1)
  %z = s32[] constant(0)
  %dynamic-slice_fusion = bf16[1,2048,512]{2,1,0:T(8,128)} fusion(%p, %i), kind=kLoop, \
calls=%fused_slice
  %dynamic-slice_fusion.1 = bf16[1,2048,512]{2,1,0:T(8,128)S(1)} fusion(%p, %i), kind=kLoop, \
calls=%fused_slice
}
%fused_slice (a: bf16[4,2048,512], b: s32[]) -> bf16[1,2048,512] {
  %a = bf16[4,2048,512]{2,1,0} parameter(0)
  %b = s32[] parameter(1)
  %c = s32[] constant(0)
  ROOT %dynamic-slice.3 = bf16[1,2048,512]{2,1,0} dynamic-slice(%a, %b, %c, %c), \
dynamic_slice_sizes={1,2048,512}
}"""
    stack = jax.ShapeDtypeStruct((4, 2048, 512), jax.numpy.bfloat16)
    assert aot.shape_moves(hlo, aot.array_shapes([stack], "weight")) == []
    moves = aot.shape_moves(hlo, aot.array_shapes([stack], "weight", rows=True))
    assert moves == ["fusion:dynamic-slice bf16[1,2048,512] weight"]


def test_shape_moves_finds_a_weight_relaid_out_by_a_reshape():
    """A reshape XLA keeps (not a bitcast) of a weight rewrites it in a new layout every step:
    XLA:TPU's for a mixture's stacked gate/up experts [E, D, 2, F] (tiled (2, 128)) merged to
    the grouped matmul's [E, D, 2F] (tiled (8, 128)). Reported by the operand's shape; a
    bitcast of it and a reshape of an activation are not."""
    hlo = """ENTRY %main (p: bf16[32,2048,2,768]) -> bf16[32,2048,1536] {
  %p = bf16[32,2048,2,768]{3,2,1,0:T(2,128)(2,1)} parameter(0), \
metadata={op_name="params['layers'][0]['experts_gate_up']"}
  %reshape.1 = bf16[32,2048,1536]{2,1,0:T(8,128)(2,1)} reshape(%p), \
metadata={op_name="jit(mixed_forward)/mlp/experts/shard_map/reshape"}
  %bitcast.2 = bf16[32,2048,1536]{2,1,0} bitcast(%p)
  %a = f32[64,2048]{1,0} parameter(1)
  %reshape.3 = f32[64,2,1024]{2,1,0} reshape(%a)
}"""
    moves = aot.shape_moves(hlo, {(2, 32, 768, 2048): "weight"})
    assert moves == ["reshape bf16[32,2048,2,768] weight "
                     "(jit(mixed_forward)/mlp/experts/shard_map/reshape)"], moves


def test_shape_moves_finds_async_weight_gathers():
    """Asynchronous gathers have tuple-typed results: a real XLA:TPU program (compiled
    deviceless for v5e:2x2) that gathers four weight shards while it multiplies, its async
    collective fusions and its gather into VMEM (S(1)) all reported; and the XLA:GPU forms,
    all-gather-start and an async-start of an all-to-all, in XLA's text format."""
    import jax
    import jax.numpy as jnp
    from jax.experimental import topologies
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    mesh = topologies.make_mesh(topologies.get_topology_desc("v5e:2x2", platform="tpu"),
                                (1, 4), ("data", "model"))
    split, whole = NamedSharding(mesh, P(None, "model")), NamedSharding(mesh, P())
    weights = [jax.ShapeDtypeStruct((2048, 2048), jnp.bfloat16, sharding=split)] * 4

    def layers(x, *ws):
        for w in ws:
            x = jnp.tanh(x @ jax.lax.with_sharding_constraint(w, whole))
        return x

    x = jax.ShapeDtypeStruct((1024, 2048), jnp.bfloat16, sharding=whole)
    hlo = jax.jit(layers, out_shardings=whole).trace(x, *weights).lower().compile().as_text()
    shapes = {(512, 2048): "weight", (2048, 2048): "weight"}
    moves = aot.shape_moves(hlo, shapes)
    assert "all-gather bf16[2048,2048] weight (jit(layers)/sharding_constraint)" in moves
    assert any(m.startswith("fusion:all-gather bf16[2048,2048] weight") for m in moves), moves
    gpu = """ENTRY %main (p: f32[8,256,256]) -> f32[16,256,256] {
  %p = f32[8,256,256]{2,1,0} parameter(0)
  %ag-start = (f32[8,256,256]{2,1,0}, f32[16,256,256]{2,1,0}) all-gather-start(\
f32[8,256,256]{2,1,0} %p), channel_id=1, replica_groups={{0,1}}, dimensions={0}, \
metadata={op_name="params['layers'][0]['down']"}
  %ag-done = f32[16,256,256]{2,1,0} all-gather-done((f32[8,256,256]{2,1,0}, \
f32[16,256,256]{2,1,0}) %ag-start)
  %a2a-start = ((f32[8,256,256]{2,1,0}), f32[8,256,256]{2,1,0}) async-start(%p), \
calls=%async_computation.1
}
%async_computation.1 (q: f32[8,256,256]) -> f32[8,256,256] {
  %q = f32[8,256,256]{2,1,0} parameter(0)
  ROOT %a2a = f32[8,256,256]{2,1,0} all-to-all(%q), channel_id=2, dimensions={0}
}"""
    moves = aot.shape_moves(gpu, {(8, 256, 256): "weight", (16, 256, 256): "weight"})
    assert moves == ["all-gather-start f32[16,256,256] weight (params['layers'][0]['down'])",
                     "all-gather-done f32[16,256,256] weight",
                     "async-start:all-to-all f32[8,256,256] weight",
                     "all-to-all f32[8,256,256] weight"], moves


def _toy_layers(scan: bool, num_layers: int):
    """A layer stack's decode step: per layer a K/V row written into a stacked pool [L, S, D]
    at the layer's row, the row read back, and a matmul with the layer's weights."""
    import jax.numpy as jnp

    def layer(x, w, pool, i, t):
        pool = jax.lax.dynamic_update_slice(pool, x[None, :1].astype(pool.dtype), (i, t, 0))
        kv = jax.lax.dynamic_index_in_dim(pool, i, keepdims=False)
        return jnp.tanh(x @ w) + (x @ kv.T) @ kv, pool

    def step(x, ws, pool, t):
        if not scan:
            for i in range(num_layers):
                x, pool = layer(x, ws[i], pool, i, t)
            return x, pool

        def body(carry, w):
            x, pool, i = carry
            x, pool = layer(x, w, pool, i, t)
            return (x, pool, i + 1), None

        (x, pool, _), _ = jax.lax.scan(body, (x, pool, 0), ws)
        return x, pool

    return jax.jit(step, donate_argnums=2)


@pytest.mark.parametrize("platform", ["cpu", "tpu"])
def test_loop_bytes_count_a_scans_trips_as_the_unrolled_layers(platform):
    """XLA counts a while loop's body once: with `loop_bytes` the scanned stack's bytes
    accessed agree with the unrolled stack's within 2%, the trip count read from XLA:CPU's
    known_trip_count and from XLA:TPU's induction variable (which it does not annotate)."""
    import jax.numpy as jnp
    from jax.experimental import topologies
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    from jaxinfer.proof.hlo_scan import loop_bytes, run_counts

    num_layers, sharding, dtype = 6, None, jnp.float32
    if platform == "tpu":
        topo = topologies.get_topology_desc("v5e:2x2", platform="tpu")
        sharding = NamedSharding(topologies.make_mesh(topo, (4,), ("x",)), P())
        dtype = jnp.bfloat16
    args = [jax.ShapeDtypeStruct(s, d, sharding=sharding) for s, d in [
        ((8, 512), dtype), ((num_layers, 512, 512), dtype), ((num_layers, 64, 512), dtype),
        ((), jnp.int32)]]
    counted = {}
    for scan in (False, True):
        compiled = _toy_layers(scan, num_layers).trace(*args).lower().compile()
        cost = compiled.cost_analysis()
        cost = cost[0] if isinstance(cost, list) else cost
        hlo = compiled.as_text()
        counted[scan] = cost["bytes accessed"] + loop_bytes(hlo)
        trips = sorted(n for n in run_counts(hlo).values() if n != 1)
        assert trips == ([num_layers, num_layers + 1] if scan else []), trips
        assert ("known_trip_count" in hlo) == (scan and platform == "cpu")
    weights = num_layers * 512 * 512 * jnp.dtype(dtype).itemsize
    assert counted[False] > weights
    assert abs(counted[True] / counted[False] - 1) < 0.02, counted


def test_loop_bytes_unknown_without_a_trip_count():
    """A loop whose condition is not a counted compare: its trip count is unknown, and so the
    bytes the cost analysis leaves out (the decode-bytes check then says n/a)."""
    from jaxinfer.proof.hlo_scan import loop_bytes

    def until_small(x):
        return jax.lax.while_loop(lambda x: x.sum() > 1.0, lambda x: x * 0.5, x)

    hlo = jax.jit(until_small).lower(jax.numpy.ones((4, 4))).compile().as_text()
    assert " while(" in hlo and loop_bytes(hlo) is None


@pytest.mark.parametrize("target, match", [
    ("v9z:2x2", "unknown target 'v9z:2x2'.*v5e"),
    ("gpu:a100", "unknown GPU 'a100'.*gpu:h100"),
    ("v5e", "unknown target 'v5e'"),
    ("v5e:3x7", "v5e:3x7"),
])
def test_bad_target_names_the_valid_ones(target, match):
    with pytest.raises(ValueError, match=match):
        aot.resolve_target(target)


def test_mesh_that_does_not_cover_the_topology():
    target = aot.resolve_target("v5e:2x2")
    with pytest.raises(ValueError, match=r"data 1 x model 2 does not cover.*D x M = 4"):
        aot.target_mesh(target, "data:1,model:2")
    with pytest.raises(ValueError, match="needs 8 devices"):
        aot.target_mesh(target, "data:2,model:4")


def test_config_that_cannot_fit_says_by_how_much_and_the_largest_batch():
    run = aot.run_config(None, **{"mesh": "data:1,model:4", "engine.max_slots": 512,
                                  "cache.max_seq_len": 8192})
    with pytest.raises(ValueError, match=r"cannot fit: .* GiB over .*largest batch that fits "
                                         r"is max_slots=\d+"):
        aot.check(aot.AotConfig(model="llama-3.1-8b", target="v5e:2x2", run=run))


def test_decode_only_plans_the_decode_rows_activations_not_a_prompt_chunks():
    """`decode_only` compiles no prompt-chunk variant, so the planner's prediction it is checked
    against counts the decode rows' activations alone (a prompt chunk's are larger)."""
    from jaxinfer.perf import planner

    target = aot.resolve_target("v5e:2x2")
    mesh = aot.target_mesh(target, "data:1,model:4")
    run = aot.run_config(None, **{"mesh": "data:1,model:4", "engine.max_slots": 8})
    every, decode = (aot.planner_prediction(aot.AotConfig(
        model="llama-3.1-8b", target="v5e:2x2", run=run, decode_only=only), target, mesh)
        for only in (False, True))
    config = aot.model_config(aot.AotConfig(model="llama-3.1-8b", target="v5e:2x2", run=run))
    assert decode["activation_bytes"] == planner.activation_bytes(config, 4, 0, 8)
    assert every["activation_bytes"] == planner.activation_bytes(
        config, 4, run.engine.chunk_size, 8) > decode["activation_bytes"]
    assert every["total_bytes"] - decode["total_bytes"] == (
        every["activation_bytes"] - decode["activation_bytes"])


@pytest.mark.slow
def test_verify_step_on_a_data_and_model_mesh_compiles_for_tpu():
    """n-gram speculation on data:2 x model:2: verify_forward and the Pallas acceptance kernel
    (run whole on each device: XLA's partitioner refuses a Mosaic kernel) compile, gather no
    weight and alias the pool."""
    report = _check("v5e:2x2", "data:2,model:2", **{"engine.speculative_method": "ngram",
                                                    "engine.num_speculative_tokens": 2})
    names = {(e.name, e.static.get("kernel")) for e in report.executables}
    assert ("verify_forward", None) in names and ("verify_sample", "pallas") in names
    checks = {name: ok for name, ok, _ in report.checks}
    assert checks["no weight gathered/copied"] and checks["KV pool donated and aliased"]


def test_loop_bytes_count_a_relaid_out_stacks_slice_not_the_stack():
    """XLA:TPU relays a scanned int8 stack out (T(32,128) -> T(8,128)) inside the fusion that
    takes the layer's slice, through a nested copy fusion: a loop fusion computes only the
    elements it outputs, so it reads the slice (4 MiB), not the stack (376 MiB); a fusion that
    uses the relaid-out stack whole reads all of it."""
    from jaxinfer.proof.hlo_scan import _computation_bytes, _computations, _result_sizes

    def module(use: str) -> str:
        return f"""%copy_fusion (input: s8[94,8,128,4096]) -> s8[94,8,128,4096] {{
  %input = s8[94,8,128,4096]{{3,2,1,0:T(32,128)(4,1)}} parameter(0)
  ROOT %copy.60 = s8[94,8,128,4096]{{3,2,1,0:T(8,128)(4,1)}} copy(%input)
}}

%fused (p0: s8[94,8,128,4096], p1: s32[]) -> s8[1,8,128,4096] {{
  %p0 = s8[94,8,128,4096]{{3,2,1,0:T(32,128)(4,1)}} parameter(0)
  %relaid = s8[94,8,128,4096]{{3,2,1,0:T(8,128)(4,1)}} fusion(%p0), kind=kLoop, calls=%copy_fusion
  %p1 = s32[] parameter(1)
  %z = s32[] constant(0)
  {use}
}}

ENTRY %main (w: s8[94,8,128,4096], i: s32[]) -> s8[1,8,128,4096] {{
  %w = s8[94,8,128,4096]{{3,2,1,0:T(32,128)(4,1)}} parameter(0)
  %i = s32[] parameter(1)
  ROOT %f = s8[1,8,128,4096]{{3,2,1,0:T(8,128)(4,1)}} fusion(%w, %i), kind=kLoop, calls=%fused
}}"""

    sliced = ("ROOT %ds = s8[1,8,128,4096]{3,2,1,0} dynamic-slice(%relaid, %p1, %z, %z, %z), "
              "dynamic_slice_sizes={1,8,128,4096}")
    whole = "ROOT %neg = s8[94,8,128,4096]{3,2,1,0} negate(%relaid)"
    row, stack = 8 * 128 * 4096, 94 * 8 * 128 * 4096
    # what the fusion reads (the slice and its s32 start; or the stack) + its result, a row
    for use, read in ((sliced, row + 4), (whole, stack)):
        comps = _computations(module(use))
        got = _computation_bytes(comps["main"], comps, _result_sizes(comps))
        assert got == read + row, (use, got)
