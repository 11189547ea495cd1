"""`jaxinfer-plan`: per-chip memory, largest batch and roofline times for a model on N chips.

  jaxinfer-plan --model=llama-3.1-70b --chip=v5e --num_chips=16 --max_slots=8 \\
      --max_seq_len=2048 --weight_dtype=int8 --kv_dtype=int8

Tensor parallel over all chips unless --mesh=data:D,model:M (or, for a mixture of experts,
--mesh=data:D,expert:E,model:M). Every assumption of the model
(sharding, memory, decode/prefill/ICI times) is in `jaxinfer.perf.planner`'s docstring. Needs no
accelerator and loads no weights. Bad input ends with one clear line and exit 2.
"""

from __future__ import annotations

import json

from absl import app, flags

from jaxinfer.cli import flags as jflags
from jaxinfer.perf import planner

# (flag = PlanConfig field, kind, help). Flags default to None ("not set": the field's default).
FLAG_TABLE: list[tuple[str, str, str]] = [
    ("model", "str", f"Architecture preset: {', '.join(planner.MODEL_PRESETS)}."),
    ("chip", "str", f"Chip: {', '.join(planner.CHIP_ALIASES)}."),
    ("num_chips", "int", "Chips in all (data x expert x model)."),
    ("max_slots", "int", "Sequences decoded together (the batch) over all replicas."),
    ("max_seq_len", "int", "Prompt + generated tokens per sequence (KV capacity per slot)."),
    ("weight_dtype", "str", "bfloat16 (default), float32, int8 or int4 (counted with their "
     "scales)."),
    ("int4_group", "int", "int4: weights per scale and offset (default 128, TPU/GPU's)."),
    ("int8_group", "int", "int8: 0 (default) a scale per output channel; 32 a GGUF's groups "
     "(1.25 bytes per weight)."),
    ("int8_matrices", "list", "int4: the layer matrices stored int8 instead (of qkv, o, "
     "gate_up, down), as an int4 load of a GGUF keeps those its 4-bit mix stores wider "
     "(default none)."),
    ("kv_dtype", "str", "bfloat16 (default), int8 or float32."),
    ("efficiency", "float", "Fraction of HBM bandwidth and peak FLOP/s achieved (default 0.85)."),
    ("prompt_len", "int", "Prompt tokens for the prefill estimate (default min(2048, "
     "max_seq_len))."),
    ("mesh", "str", "'auto' (tensor parallel over all chips), 'data:D,model:M' or "
     "'data:D,expert:E,model:M' (a mixture's experts split over E)."),
    ("page_size", "int", "KV cache page size in tokens (default 16)."),
    ("context_len", "int", "Decode context per sequence (default max_seq_len / 2, the mean)."),
    ("hybrid_kv", "bool", "Sliding-window layers hold only their window's pages (default "
     "true; false: full-length pages for every layer)."),
    ("num_speculative_tokens", "int", "Drafts verified per step with speculative decoding "
     "(default 0: none); counts the acceptance's memory."),
]
REQUIRED = ("model", "chip", "num_chips", "max_slots", "max_seq_len")

FLAGS = flags.FLAGS
_DEFINE = {"str": flags.DEFINE_string, "int": flags.DEFINE_integer, "float": flags.DEFINE_float,
           "bool": flags.DEFINE_bool, "list": flags.DEFINE_list}


def define_flags() -> None:
    """Defines this CLI's flags (at `run`, not at import: `--max_slots`, `--mesh` and
    `--max_seq_len` mean something else to `jaxinfer-generate`, whose flags a process that
    imports both may hold)."""
    for name, kind, help_ in FLAG_TABLE:
        _DEFINE[kind](name, None, help_)
    flags.DEFINE_bool("json", False, "Print the plan as one JSON object instead of the table.")


def plan_config_from_flags() -> planner.PlanConfig:
    """The PlanConfig the flags ask for; a missing required flag raises ValueError."""
    missing = [f"--{name}" for name in REQUIRED if getattr(FLAGS, name) is None]
    if missing:
        raise ValueError(f"missing {', '.join(missing)}; valid models: "
                         f"{', '.join(planner.MODEL_PRESETS)}; valid chips: "
                         f"{', '.join(planner.CHIP_ALIASES)}")
    values = {name: getattr(FLAGS, name) for name, _, _ in FLAG_TABLE}
    return planner.PlanConfig(**{k: v for k, v in values.items() if v is not None})


@jflags.reporting_errors("jaxinfer-plan")
def main(argv: list[str]) -> int:
    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments: {argv[1:]}")
    result = planner.plan(plan_config_from_flags())
    print(json.dumps(result.as_dict()) if FLAGS.json else planner.format_plan(result))
    return 0


def run() -> None:
    jflags.run_app(main, define_flags, doc=__doc__)


if __name__ == "__main__":
    run()
