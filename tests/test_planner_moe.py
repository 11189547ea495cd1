"""The planner on mixtures of experts (`jaxinfer.perf.planner`): the published parameter counts
of the presets, weight bytes equal to a quantized MoE model's arrays, and the bytes a decode
step reads (only the experts its rows route to). No model is loaded except a toy."""

import dataclasses

import jax
import pytest

from jaxinfer.perf import planner
from jaxinfer.perf.planner import PlanConfig

# Published (total, active) parameters and whether the publisher counts the input embedding
# table among the active ones. Qwen3-30B-A3B, Qwen3-235B-A22B: Qwen's model cards ("30.5B in
# total and 3.3B activated", "235B / 22B"; "29.9B non-embedding" for the 30B), both tables
# counted. Mixtral-8x7B: Mistral's "46.7B total, 12.9B active", both tables counted.
# gpt-oss-120b: OpenAI's model card, 116.83B total, 5.13B active, the input embedding not
# counted (a token reads one row of it).
PUBLISHED = {"qwen3-30b-a3b": (30.5e9, 3.3e9, True), "qwen3-235b-a22b": (235e9, 22e9, True),
             "mixtral-8x7b": (46.7e9, 12.9e9, True), "gpt-oss-120b": (116.83e9, 5.13e9, False)}


@pytest.mark.parametrize("name", sorted(PUBLISHED))
def test_total_and_active_parameters_match_the_published_counts(name):
    c = planner.MODEL_PRESETS[name]
    total, active, with_embedding = PUBLISHED[name]
    ours = c.num_active_params(input_embedding=with_embedding)
    assert c.num_params() == pytest.approx(total, rel=0.01)
    if name == "qwen3-30b-a3b":
        # 3,353,032,704 to the parameter: Qwen's figures are truncated to one decimal (30.53B
        # total shows as 30.5B, 29.91B non-embedding as 29.9B), so 3.35B shows as 3.3B, 1.6%
        # below the count. Check the count against the truncation and 3.35B to 1%.
        assert int(ours / 1e8) / 10 == 3.3 and ours == pytest.approx(3.35e9, rel=0.01)
        non_embedding = c.num_params() - 2 * c.vocab_size * c.embed_dim
        assert non_embedding == pytest.approx(29.9e9, rel=0.01)
    else:
        assert ours == pytest.approx(active, rel=0.01)


@pytest.mark.parametrize("kind,group", [("int8", 0), ("int4", 16)])
def test_moe_weight_bytes_are_the_model_arrays_bytes(kind, group):
    """A quantized toy with every mixture feature (dense layer, shared expert, router and expert
    biases, sinks, o bias): the planner's bytes on one chip are exactly its arrays' bytes."""
    from flax import nnx

    from jaxinfer.model import Llama, init_params
    from jaxinfer.model.quant import array_bytes
    from tests.helpers import toy_config

    config = toy_config(num_layers=3, ffn_dim=64, head_dim=16, num_experts=8,
                        experts_per_token=2, expert_ffn_dim=32, shared_expert_ffn_dim=32,
                        dense_layers=(1,), router_bias=True, expert_bias=True, o_bias=True,
                        attention_sinks=True, weight_dtype=kind, int4_group_size=group or 32)
    model = Llama(config, init_params(dataclasses.replace(config, weight_dtype=None)))
    leaves = jax.tree.leaves(nnx.state(model))
    assert planner.weight_bytes_per_chip(config, 1)[0] == sum(
        array_bytes(x.shape, x.dtype) for x in leaves)


def test_a_decode_step_reads_only_the_experts_its_rows_route_to():
    """Qwen3-30B-A3B (E 128, k 8, 48 mixture layers) bf16 on one H100: at batch 1 a step reads
    8 experts per layer, at batch B the expected E (1 - (1 - k/E)^B); the rest of the weights
    whole (the untied input table excepted), as for a dense model."""
    c = planner.MODEL_PRESETS["qwen3-30b-a3b"]
    one_expert = 3 * 2048 * 768 * 2  # bf16 gate, up, down
    assert planner.expert_bytes_per_chip(c, 1) == one_expert
    assert c.expected_experts(1) == pytest.approx(8)
    assert c.expected_experts(16) == pytest.approx(128 * (1 - (120 / 128) ** 16))
    assert c.expected_experts(4096) == pytest.approx(128)

    def plan(slots):
        return planner.plan(PlanConfig(model="qwen3-30b-a3b", chip="h100", num_chips=1,
                                       max_slots=slots, max_seq_len=1024))

    p1, p16 = plan(1), plan(16)
    weights, embed = planner.weight_bytes_per_chip(c, 1)
    kv = planner.kv_bytes_per_token_per_chip(c, 1, 2)
    for p, rows in ((p1, 1), (p16, 16)):
        touched = c.expected_experts(rows)
        assert p.decode_experts == pytest.approx(touched)
        unread = 48 * (128 - touched) * one_expert
        assert p.decode_bytes == pytest.approx(weights - embed - unread + kv * 512 * rows
                                               + kv * rows)
    assert p1.expert_bytes == 48 * 128 * one_expert
    # At batch 1 the weights read are the active ones less the input table: ~3.04B x 2 bytes
    # (norms counted at 2 bytes as the planner does for a bf16 model).
    active = c.num_active_params(input_embedding=False) * 2
    assert p1.decode_bytes - kv * 513 == pytest.approx(active, rel=1e-3)
    text = planner.format_plan(p16)
    assert "30.53B, 3.35B active per token" in text
    assert f"reads {p16.decode_experts:.1f} of 128 experts per mixture layer" in text


def test_the_expert_ffn_splits_over_the_model_axis():
    """gpt-oss-120b on 8 chips: each chip holds all 128 experts of a layer with 2880 / 8 of
    their FFN (and their biases), and the plan fits v6e-8's 32 GiB in bf16."""
    c = planner.MODEL_PRESETS["gpt-oss-120b"]
    one = planner.expert_bytes_per_chip(c, 8)
    assert one == (2880 * 2 * 360 + 360 * 2880) * 2 + (2 * 360 + 2880) * 2
    p = planner.plan(PlanConfig(model="gpt-oss-120b", chip="v6e", num_chips=8, max_slots=8,
                                max_seq_len=4096))
    assert p.expert_bytes == 36 * 128 * one and p.free_bytes > 0


def test_the_expert_axis_splits_the_experts_and_the_combine_is_an_all_reduce():
    """Qwen3-30B-A3B bf16 on 8 v6e chips as data:1,expert:4,model:2: each chip holds 32 of the
    128 experts with half of each one's FFN (the same bytes as model:8's 128 experts at 1/8 of
    their FFN), attention over all 8 chips; a decode step leaves 3/4 of the unread experts to
    the other expert shards; each layer's two all-reduces (attention out, the mixture's
    combine) of B x D bf16 values over the 8 chips are its ICI bytes."""
    c = planner.MODEL_PRESETS["qwen3-30b-a3b"]
    base = dict(model="qwen3-30b-a3b", chip="v6e", num_chips=8, max_slots=16, max_seq_len=4096)
    ep = planner.plan(PlanConfig(**base, mesh="data:1,expert:4,model:2"))
    tp = planner.plan(PlanConfig(**base, mesh="data:1,model:8"))
    assert planner.parse_mesh("data:1,expert:4,model:2", 8) == (1, 4, 2)
    assert (ep.expert_parallel, ep.model_parallel) == (4, 2)
    half = planner.expert_bytes_per_chip(c, 2)
    assert half == 3 * 2048 * 384 * 2
    assert ep.expert_bytes == 48 * 32 * half == tp.expert_bytes
    assert ep.weight_bytes == tp.weight_bytes and ep.kv_bytes == tp.kv_bytes
    assert planner.unread_expert_bytes(c, 8, 16, 4) == pytest.approx(
        48 * (128 - c.expected_experts(16)) / 4 * half)
    assert ep.decode_bytes == pytest.approx(tp.decode_bytes)
    assert ep.decode_ici_bytes == pytest.approx(2 * 48 * 2 * 7 / 8 * 16 * 2048 * 2)
    assert ep.prefill_ici_bytes == pytest.approx(2 * 48 * 2 * 7 / 8 * 2048 * 2048 * 2)
    text = planner.format_plan(ep)
    for line in ("mesh data=1 x expert=4 x model=2", "sharded over the 8 expert x model chip(s)",
                 "expert parallel: 32 of 128 experts per chip, each with 1/2 of its FFN",
                 "32 of 128 per mixture layer on each chip", "MiB all-reduced per chip"):
        assert line in text, line


def test_expert_meshes_in_errors_and_suggestions():
    base = dict(model="qwen3-235b-a22b", chip="v5e", max_slots=8, max_seq_len=4096,
                weight_dtype="int8")
    with pytest.raises(ValueError, match=r"expert:3 does not divide the model's "
                                         r"num_experts=128"):
        PlanConfig(**base, num_chips=6, mesh="data:1,expert:3,model:2")
    with pytest.raises(ValueError, match=r"data 1 x expert 4 x model 2 = 8 chips, but "
                                         r"num_chips=16"):
        PlanConfig(**base, num_chips=16, mesh="data:1,expert:4,model:2")
    with pytest.raises(ValueError, match=r"int4 experts in groups of 128 along their FFN of 1536 "
                                         r"\(12 groups\) cannot split over model:8"):
        PlanConfig(**{**base, "weight_dtype": "int4"}, num_chips=16, mesh="data:1,expert:2,model:8")
    # a mixture that does not fit is told a mesh with its tensor-parallel chips on the experts
    with pytest.raises(ValueError, match=r"8 slots fit on 32 chips with "
                                         r"--mesh=data:1,expert:32,model:1"):
        planner.plan(PlanConfig(**base, num_chips=16, mesh="data:1,expert:16,model:1"))
