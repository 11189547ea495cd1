"""Capacity planner (`jaxinfer.perf.planner`, `jaxinfer-plan`): a published number, hand arithmetic,
capacity edges, bad input, the CLI. No model is loaded and no device is used."""

import dataclasses
import json
import os
import subprocess
import sys

import jax
import pytest

from jaxinfer.cli import plan as plan_cli
from jaxinfer.perf import planner, roofline
from jaxinfer.perf.planner import PlanConfig

GIB = 1 << 30


def test_llama_70b_int8_on_v5e_16_matches_jax_llm_examples():
    """Published: jax-ml/jax-llm-examples, llama3/README.md, "Inference performance results",
    table "data parallelism = 1 and tensor parallelism = 16": Llama 3.1-70B on TPU v5e-16,
    batch size 8, context length 2048, 159 tok/s, HBM BW util 85.18% ("max tok/s").

    What we take that row to mean, and why:
    - 159 tok/s is per sequence (decode steps per second), not the sum over the 8 rows: at 159
      steps/s the weights alone (~4.4 GB per chip in int8) move at 159 x 4.4e9 = 0.85 x 819 GB/s,
      which is the 85.18% the table reports; 159 tokens/s in total would be 20 steps/s, 11% of
      the bandwidth. So the check compares the planner's tokens/s per sequence with 159.
    - int8 weights and int8 KV: llama3/configs.py sets quant_layer=True and quant_cache=True and
      main.py runs with QUANT = True. Their embedding and LM head stay bf16 and their int8
      tensors carry bf16 scales; the planner counts every weight at 1 byte and no scales, which
      reads 66 MB less per chip (1.4% of the step) than they do.
    - "context length" 2048 is the KV cache size (max_seq_len). The README does not say at which
      fill the decode was timed, so the planner uses its own assumption, the mean context 1024
      (1024 tokens of int8 KV per row, 20 KiB per token per chip). For the record, the same
      prediction at an empty cache is 152.5 tok/s and at a full one 142.0 (-10.7%).
    - Tensor parallel over all 16 chips: the 8 kv heads are each replicated 2x (one per chip),
      as their kv_heads axis is sharded over 8 devices of the (1, 8, 2) mesh.
    The planner gives 147.1 tok/s (-7.5%): its bytes per step include the replicated K/V
    projections and a 0.2 ms bandwidth-only ICI term, and its efficiency applies to all of it.
    """
    cfg = PlanConfig(model="llama-3.1-70b", chip="v5e", num_chips=16, max_slots=8,
                     max_seq_len=2048, weight_dtype="int8", kv_dtype="int8", efficiency=0.85,
                     page_size=32)  # int8 pages on TPU: a multiple of int8's 32-row tile
    p = planner.plan(cfg)
    assert p.decode_context == 1024
    assert p.kv_heads_per_chip == 1 and p.kv_replication == 2
    assert abs(p.tokens_per_s_per_seq / 159 - 1) < 0.10, p.tokens_per_s_per_seq
    assert p.tokens_per_s_total == pytest.approx(8 * p.tokens_per_s_per_seq)
    # The memory-bound part alone: the weights read dominate.
    assert p.decode_memory_s > 10 * max(p.decode_compute_s, p.decode_ici_s)


@pytest.mark.parametrize("name", ["smollm2-135m",
                                  pytest.param("gemma3-270m", marks=pytest.mark.slow)])
def test_packaged_model_presets_match_their_gguf(name, request):
    """The literal preset equals the config read from the GGUF's metadata (`config_from_gguf`,
    the function the loader uses). Gemma's is the session's loaded model's: its reader parses a
    262k-token vocabulary, which the Gemma tests' fixture has paid for already."""
    from jaxinfer.checkpoint import gguf
    from jaxinfer.checkpoint.weights import resolve_model_path

    if name == "gemma3-270m":
        loaded = request.getfixturevalue("gemma3_scanned")[0].config
    else:
        reader = gguf.open_reader(resolve_model_path(name))
        loaded = gguf.config_from_gguf(gguf.read_metadata(reader),
                                       {t.name for t in reader.tensors})
    preset = planner.MODEL_PRESETS[name]
    assert dataclasses.replace(preset, dtype=loaded.dtype) == loaded


@pytest.mark.parametrize("name", list(planner.MODEL_PRESETS))
def test_presets_on_one_chip_agree_with_roofline(name):
    for dtype, nbytes in (("bfloat16", 2), ("float32", 4)):
        config = dataclasses.replace(planner.MODEL_PRESETS[name], weight_dtype=dtype)
        total, embed = planner.weight_bytes_per_chip(config, 1)
        assert total == roofline.weight_bytes(config, nbytes)
        assert embed == config.vocab_size * config.embed_dim * nbytes
    for nbytes in (1, 2, 4):
        assert (planner.kv_bytes_per_token_per_chip(config, 1, nbytes)
                == roofline.kv_bytes_per_token(config, nbytes))


@pytest.mark.parametrize("kind,int4_group,int8_group,int8_matrices", [
    ("int8", 32, 0, ()), ("int8", 32, 16, ()), ("int4", 16, 0, ()), ("int4", 32, 16, ()),
    ("int4", 32, 16, ("qkv", "down")), ("int4", 16, 0, ("o", "gate_up"))])
@pytest.mark.parametrize("tied", [True, False])
def test_quantized_weight_bytes_are_the_model_arrays_bytes(kind, int4_group, int8_group,
                                                           int8_matrices, tied):
    """On one chip the planner's quantized weight bytes are exactly the nbytes of a quantized
    toy model's arrays (values, scales, offsets; int8 tables; f32 norms and biases), int4's
    groups of 32 clamped to the o projection's head dim of 16, and int4 models with some
    matrices int8 (`int8_matrices`, as an int4 load of a GGUF's 4-bit mix keeps them)."""
    from flax import nnx

    from jaxinfer.model import Llama, init_params
    from jaxinfer.model.quant import array_bytes
    from tests.helpers import toy_config

    config = toy_config(weight_dtype=kind, int4_group_size=int4_group,
                        int8_group_size=int8_group, tie_embeddings=tied, qkv_bias=not tied,
                        ffn_dim=64, head_dim=16, int8_matrices=int8_matrices)
    model = Llama(config, init_params(dataclasses.replace(config, weight_dtype=None)))
    leaves = jax.tree.leaves(nnx.state(model))
    assert planner.weight_bytes_per_chip(config, 1)[0] == sum(
        array_bytes(x.shape, x.dtype) for x in leaves)


def test_int8_matrices_are_counted_and_checked():
    """A plan of int4 weights with the MLP's matrices int8 (a Gemma 3 Q4_K_M's mix) weighs
    between all-int4 and all-int8; a name that is not a stored matrix is refused."""
    kw = dict(model="gemma3-270m", chip="v5e", num_chips=1, max_slots=4, max_seq_len=1024,
              int8_group=32, int4_group=32)
    sizes = [planner.plan(PlanConfig(**kw, weight_dtype=w, int8_matrices=m)).weight_bytes
             for w, m in (("int4", ()), ("int4", ["gate_up", "down"]), ("int8", ()))]
    assert sizes[0] < sizes[1] < sizes[2]
    with pytest.raises(ValueError, match=r"int8_matrices: 'mlp' is not one of qkv, o, gate_up"):
        PlanConfig(**kw, weight_dtype="int4", int8_matrices=("mlp",))


def test_quantized_bytes_per_weight_of_an_8b_layer():
    """Per weight of the 8B's layers: int8 per channel ~1, GGUF-grouped int8 1.25, int4 at
    groups of 128 0.5625 and at 32 0.75 (values + f32 scale and offset per group)."""
    base = planner.MODEL_PRESETS["llama-3.1-8b"]
    layer = dict(num_layers=1, vocab_size=1)  # the tables' share is then negligible

    def per_weight(**kw):
        config = dataclasses.replace(base, **layer, **kw)
        matrices = config.num_params() - config.layer_norm_params() - 2 * config.embed_dim - 1
        return planner.weight_bytes_per_chip(config, 1)[0] / matrices

    assert per_weight(weight_dtype="int8") == pytest.approx(1.0, abs=0.002)
    assert per_weight(weight_dtype="int8", int8_group_size=32) == pytest.approx(1.25, abs=0.002)
    assert per_weight(weight_dtype="int4", int4_group_size=128) == pytest.approx(0.5625,
                                                                                 abs=0.002)
    assert per_weight(weight_dtype="int4", int4_group_size=32) == pytest.approx(0.75, abs=0.002)
    plan = planner.plan(PlanConfig(model="llama-3.1-8b", chip="v5e", num_chips=4, max_slots=8,
                                   max_seq_len=2048, weight_dtype="int4"))
    bf16 = planner.plan(PlanConfig(model="llama-3.1-8b", chip="v5e", num_chips=4, max_slots=8,
                                   max_seq_len=2048))
    assert 3.0 < bf16.weight_bytes / plan.weight_bytes < 3.6


def test_llama_preset_sizes():
    # Parameter counts the model names promise (HF model cards: 1.24B, 3.21B, 8.03B, 70.6B, 406B).
    billions = {k: v.num_params() / 1e9 for k, v in planner.MODEL_PRESETS.items()}
    assert billions["llama-3.2-1b"] == pytest.approx(1.236, abs=0.01)
    assert billions["llama-3.2-3b"] == pytest.approx(3.213, abs=0.01)
    assert billions["llama-3.1-8b"] == pytest.approx(8.030, abs=0.01)
    assert billions["llama-3.1-70b"] == pytest.approx(70.554, abs=0.01)
    assert billions["llama-3.1-405b"] == pytest.approx(405.85, abs=0.1)


def test_kv_heads_replicate_when_the_model_axis_outgrows_them():
    c = planner.MODEL_PRESETS["llama-3.1-70b"]  # K = 8, L = 80, H = 128
    per_head = 2 * 80 * 128 * 2  # bf16
    assert [planner.kv_bytes_per_token_per_chip(c, m, 2) for m in (1, 2, 4, 8, 16, 32)] == [
        8 * per_head, 4 * per_head, 2 * per_head, per_head, per_head, per_head]
    smol = planner.MODEL_PRESETS["smollm2-135m"]  # K = 3: 2 heads on the fullest of 2 chips
    assert planner.kv_bytes_per_token_per_chip(smol, 2, 2) == 2 * 30 * 2 * 64 * 2


def test_memory_by_hand_smollm2_on_two_v5e():
    """SmolLM2-135M (D 576, L 30, N 9, K 3, H 64, F 1536, V 49152, tied), bf16, 2 chips."""
    cfg = PlanConfig(model="smollm2-135m", chip="v5e", num_chips=2, max_slots=4, max_seq_len=100)
    p = planner.plan(cfg)
    # Per chip: N 9 -> 5, K 3 -> 2, F 1536 -> 768, V 49152 -> 24576.
    # Layer: 576*64*(5 + 2*2) + 5*64*576 + 3*576*768 + 2*576 = 331,776 + 184,320 + 1,327,104
    # + 1,152 = 1,844,352; x 30 = 55,330,560; + embedding 24576*576 = 14,155,776; + norm 576.
    assert p.weight_bytes == 2 * 69_486_912
    # KV: 2 * 30 * 2 heads * 64 * 2 B = 15,360 B per token; ceil(100/16) = 7 pages = 112 tokens.
    assert p.kv_bytes_per_slot == 112 * 15_360
    assert p.kv_bytes == 4 * 112 * 15_360
    # Activations, f32: per token 2*576 + (2*5 + 2*2)*64 + 3*768 = 4,352 values x 100 prompt
    # tokens; scores 5 heads x 100 x 100; logits 4 rows x 24576.
    assert p.activation_bytes == 4 * (4_352 * 100 + 5 * 100 * 100 + 4 * 24_576)
    assert p.reserve_bytes == int(0.05 * 16 * GIB)
    assert p.free_bytes == 16 * GIB - (p.weight_bytes + p.kv_bytes + p.activation_bytes
                                       + p.reserve_bytes)
    # Decode at the mean context 50: weights (tied: the table is the LM head, read) + KV.
    assert p.decode_context == 50
    assert p.decode_bytes == p.weight_bytes + 15_360 * 50 * 4 + 15_360 * 4
    assert p.decode_memory_s == pytest.approx(p.decode_bytes / (0.85 * 819e9))
    # ICI: 2 all-reduces x 30 layers of 4 rows x 576 bf16 over 2 chips at 200 GB/s one way.
    assert p.decode_ici_s == pytest.approx(60 * (2 * 1 / 2) * 4 * 576 * 2 / 200e9)
    assert p.prefill_compute_s == pytest.approx(
        roofline.prefill_flops(planner.MODEL_PRESETS["smollm2-135m"], 100) / 2 / (0.85 * 197e12))


def test_speculative_acceptance_memory_by_hand():
    """8B (V 128256) on v5e:2x2 as data:2 x model:2, 60 slots, R = 4 drafts: the acceptance
    runs over all 60 slots x 5 positions: one f32 distribution whole (the kernel's input) plus
    ACCEPTANCE_SPLIT_COPIES split over the 2-way model axis. It is larger than the forward's
    activations, so it is the workspace: the batch that fits shrinks, and R = 0 counts none."""
    base = dict(model="llama-3.1-8b", chip="v5e", num_chips=4, mesh="data:2,model:2",
                max_seq_len=4096, page_size=32, prompt_len=512)
    spec = planner.plan(PlanConfig(max_slots=56, num_speculative_tokens=4, **base))
    rows = 56 * 5
    assert spec.acceptance_bytes == 4 * rows * (128_256 + planner.ACCEPTANCE_SPLIT_COPIES * 64_128)
    assert spec.acceptance_bytes > spec.activation_bytes
    assert spec.free_bytes == 16 * GIB - (spec.weight_bytes + spec.kv_bytes
                                          + spec.acceptance_bytes + spec.reserve_bytes)
    plain = planner.plan(PlanConfig(max_slots=56, **base))
    assert plain.acceptance_bytes == 0
    assert plain.free_bytes - spec.free_bytes == spec.acceptance_bytes - spec.activation_bytes
    # XLA:TPU measured 15.55 GiB per chip for 60 slots (docs/benchmarks.md): 60 do not fit.
    assert spec.largest_batch == 56 and plain.largest_batch == 60
    with pytest.raises(ValueError, match="holds at most 56 slots"):
        planner.plan(PlanConfig(max_slots=60, num_speculative_tokens=4, **base))


def test_untied_embedding_is_not_read_by_a_decode_step():
    p = planner.plan(PlanConfig(model="llama-3.1-8b", chip="h100", num_chips=1, max_slots=1,
                                max_seq_len=2, weight_dtype="int8", kv_dtype="int8"))
    c = planner.MODEL_PRESETS["llama-3.1-8b"]
    kv = roofline.kv_bytes_per_token(c, 1) + 2 * c.num_layers * c.num_kv_heads * 4  # + scales
    weights, embed = planner.weight_bytes_per_chip(planner.stored_model(p.config), 1)
    assert embed == c.vocab_size * (c.embed_dim + 4)  # int8 rows and their f32 scales
    assert p.decode_bytes == weights - embed + kv * 1 + kv
    int8 = c.num_params() - c.vocab_size * c.embed_dim  # one byte each, scales besides
    assert int8 < weights - embed < 1.001 * int8
    assert p.decode_ici_s == 0 and p.prefill_ici_s == 0


def test_int8_kv_counts_its_scales_padded_to_tpu_lanes():
    """An int8 pool's token: H int8 values and an f32 scale per kv head, for K and V; on TPU
    the scales' [.., page_size] rows pad to 128 lanes (page 32: 16 bytes a scale)."""
    c = planner.MODEL_PRESETS["llama-3.1-70b"]
    values = 2 * c.num_layers * 1 * c.head_dim  # one kv head per chip at M = 16

    def per_token(chip, page):
        return planner.kv_cache_bytes_per_token_per_chip(c, 16, "int8", page_size=page,
                                                         chip=planner.chip_spec(chip).name)

    assert per_token("h100", 32) == values + 2 * c.num_layers * 4
    assert per_token("v5e", 128) == values + 2 * c.num_layers * 4
    assert per_token("v5e", 32) == values + 2 * c.num_layers * 16
    assert planner.kv_cache_bytes_per_token_per_chip(
        c, 16, "bfloat16", page_size=32, chip="tpu-v5e") == 2 * values


def test_hybrid_kv_counts_the_local_layers_window_only():
    """Gemma 3 270M at 8k: 3 global layers keep 512 pages a slot, the 15 local ones the
    engine's default window pool, ceil((512 - 1 + 256) / 16) + 1 = 49 pages; without the
    hybrid pool all 18 layers keep 512."""
    config = dict(model="gemma3-270m", chip="v5e", num_chips=1, max_slots=8, max_seq_len=8192)
    hybrid, full = (planner.plan(PlanConfig(**config, hybrid_kv=h)) for h in (True, False))
    token = 2 * 256 * 2  # K and V, one kv head of 256, bf16, per layer
    assert full.kv_bytes_per_slot == 18 * 8192 * token
    assert hybrid.kv_bytes_per_slot == (3 * 8192 + 15 * 49 * 16) * token
    assert hybrid.largest_batch > 3.9 * full.largest_batch
    llama = dict(config, model="llama-3.2-1b")  # no sliding window: the flag changes nothing
    assert (planner.plan(PlanConfig(**llama, hybrid_kv=True)).kv_bytes_per_slot
            == planner.plan(PlanConfig(**llama, hybrid_kv=False)).kv_bytes_per_slot)


@pytest.mark.parametrize("mesh,num_chips", [("auto", 8), ("data:2,model:4", 8)])
def test_largest_batch_fits_and_one_more_does_not(mesh, num_chips):
    base = PlanConfig(model="llama-3.1-8b", chip="v5e", num_chips=num_chips, max_slots=1,
                      max_seq_len=8192, mesh=mesh)
    largest = planner.plan(base).largest_batch
    data = planner.parse_mesh(mesh, num_chips)[0]
    assert largest > 0 and largest % data == 0
    at_largest = planner.plan(dataclasses.replace(base, max_slots=largest))
    assert at_largest.free_bytes >= 0
    with pytest.raises(ValueError, match=f"max_slots={largest + 1} does not fit.*at most "
                                         f"{largest} slots"):
        planner.plan(dataclasses.replace(base, max_slots=largest + 1))


def test_weights_that_do_not_fit_name_a_mesh_that_does():
    cfg = PlanConfig(model="llama-3.1-405b", chip="v5e", num_chips=16, max_slots=8,
                     max_seq_len=2048)
    with pytest.raises(ValueError, match=r"does not fit even at batch 1.*--mesh=data:1,model:64"):
        planner.plan(cfg)
    p = planner.plan(dataclasses.replace(cfg, num_chips=64))
    assert p.largest_batch >= 8


@pytest.mark.parametrize("kwargs,match", [
    ({"model": "llama-9"}, r"unknown model 'llama-9'; valid models: smollm2-135m, llama-3.2-1b"),
    ({"chip": "v7"}, r"unknown chip 'v7'; valid chips: v4, v5e, v5p, v6e, h100, h200"),
    ({"weight_dtype": "int2"},
     r"weight_dtype='int2' is not one of float32, bfloat16, int8, int4"),
    ({"int4_group": 33}, r"int4_group=33 must be a positive even number"),
    ({"kv_dtype": "fp8"}, r"kv_dtype='fp8'"),
    ({"num_chips": 0}, r"num_chips=0 must be >= 1"),
    ({"max_seq_len": 200_000}, r"max_seq_len=200000 exceeds llama-3.1-8b's context"),
    ({"efficiency": 1.5}, r"efficiency=1.5 must be in \(0, 1\]"),
    ({"prompt_len": 5000}, r"prompt_len=5000 must be in \[1, max_seq_len=4096\]"),
    ({"mesh": "data:3,model:4"}, r"data 3 x model 4 = 12 chips, but num_chips=8"),
    ({"mesh": "model:8"}, r"must be 'auto' or 'data:D,model:M'"),
    ({"context_len": 4097}, r"context_len=4097 must be in \[0, max_seq_len=4096\]"),
    ({"num_speculative_tokens": -1}, r"num_speculative_tokens=-1 must be >= 0"),
])
def test_bad_input_is_one_clear_error(kwargs, match):
    base = {"model": "llama-3.1-8b", "chip": "v5p", "num_chips": 8, "max_slots": 4,
            "max_seq_len": 4096}
    with pytest.raises(ValueError, match=match):
        planner.plan(PlanConfig(**(base | kwargs)))


def test_every_flag_maps_to_a_plan_config_field():
    fields = {f.name for f in dataclasses.fields(PlanConfig)}
    names = [name for name, _, _ in plan_cli.FLAG_TABLE]
    assert sorted(names) == sorted(fields)
    assert set(plan_cli.REQUIRED) <= fields


def _plan_cli(*args):
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    return subprocess.run([sys.executable, "-m", "jaxinfer.cli.plan", *args],
                          capture_output=True, text=True, timeout=120, env=env)


def test_cli_prints_the_table_and_json():
    args = ["--model=llama-3.1-70b", "--chip=v5e", "--num_chips=16", "--max_slots=8",
            "--max_seq_len=2048", "--weight_dtype=int8", "--kv_dtype=int8"]
    r = _plan_cli(*args)
    assert r.returncode == 0, r.stderr
    for text in ("mesh data=1 x model=16", "weights and KV sharded over the 16 model-axis",
                 "each of the 8 kv heads replicated 2x", "per-chip memory (16.00 GiB HBM)",
                 "KV pages", "activations/workspace", "free", "largest batch at max_seq_len 2048",
                 "prefill 2048 tokens", "mean context 1024", "tok/s per sequence"):
        assert text in r.stdout, (text, r.stdout)
    r = _plan_cli(*args, "--json")
    assert r.returncode == 0, r.stderr
    record = json.loads(r.stdout)
    assert abs(record["tokens_per_s_per_seq"] / 159 - 1) < 0.10
    assert record["config"]["weight_dtype"] == "int8"


@pytest.mark.parametrize("args,match", [
    (["--model=llama-3.1-70b", "--chip=tpu9", "--num_chips=16", "--max_slots=8",
      "--max_seq_len=2048"], "unknown chip 'tpu9'; valid chips: v4, v5e"),
    (["--model=llama-3.1-405b", "--chip=v5e", "--num_chips=16", "--max_slots=8",
      "--max_seq_len=2048"], "does not fit even at batch 1; 8 slots fit on 64 chips"),
    (["--chip=v5e"], "missing --model, --num_chips, --max_slots, --max_seq_len; valid models"),
])
def test_cli_bad_input_exits_2_with_one_line(args, match):
    r = _plan_cli(*args)
    assert r.returncode == 2
    assert r.stdout == ""
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("jaxinfer-plan: error: ")
    assert match in lines[0], lines[0]


@pytest.mark.parametrize("kind", ["float32", "int8"])
def test_lora_pool_bytes_are_the_pools_arrays(kind):
    """A model with a LoRA pool weighs its arrays' bytes, the pool's (float) included."""
    from flax import nnx

    from jaxinfer.model import Llama, init_params
    from jaxinfer.model.quant import array_bytes
    from tests.helpers import toy_config

    config = toy_config(weight_dtype=kind, ffn_dim=64, head_dim=16, lora_slots=3, lora_rank=4)
    model = Llama(config, init_params(dataclasses.replace(config, weight_dtype=None)))
    leaves = jax.tree.leaves(nnx.state(model))
    pool = sum(array_bytes(x.shape, x.dtype) for x in jax.tree.leaves(
        nnx.state(model, lambda path, _: str(path[-1]).startswith("lora_"))))
    assert pool > 0
    assert planner.weight_bytes_per_chip(config, 1)[0] == sum(
        array_bytes(x.shape, x.dtype) for x in leaves)
