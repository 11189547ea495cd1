"""Trains an EAGLE-3 (or EAGLE) draft head for a target by self-distillation
(`jaxinfer.train.draft_head`; docs/architecture.md, decision 19) and exports it in the
published layout.

The target answers chat prompts with the serving engine; its own tokens and features are the
training data, and the head's layer starts as the target's last layer (--init_layer). The
prompts are `jaxinfer.train.prompts`' (templates x subjects in the package: nothing is
downloaded; at most 2,304 for training) or a file of your own (--prompts_file,
--held_out_file: e.g. the first user turns of a chat dataset, as text lines or JSONL). Each
training prompt gets its greedy answer and, with --samples_per_prompt=N, N - 1 more drawn at
--temperature. Held-out acceptance (mean tokens per verification of greedy chain speculation
with R = --eval_depth, replayed on the held-out subjects' answers) is reported before training
and every --eval_every steps, beside the same replay on as many training answers (a head that
replays those much better than new ones wants more data); the training state (head params +
optimizer state) is saved with orbax under --ckpt_dir at each report; the per-step history goes
to --out/history.jsonl and its plot (loss per step, both acceptances) to --out/loss.svg; the
head goes to --out
(config.json + model.safetensors), which --draft_head_path reads:

  python scripts/train_draft_head.py --out=/tmp/smollm2-eagle3   # ~52 min on 2 CPU cores
  python scripts/train_draft_head.py --out=/tmp/smollm2-eagle3 --mesh=data:8  # a TPU slice
  jaxinfer-generate --speculative_method=eagle --draft_head_path=/tmp/smollm2-eagle3 \\
      --num_speculative_tokens=4 --prompt="Write a short poem about comets."

--model_path: any checkpoint the loader reads (default: the embedded SmolLM2-135M-Instruct).
--mesh: the devices to use, as the other CLIs spell it: the answers are generated with the
serving engine on that mesh, their features recorded on it (`draft_head.record`), and each
training batch is split over "data" with the head replicated (`draft_head.fit`);
--batch_size must divide by the data axis.
--answers: a JSON file of the generated answers; a run that finds it (written by an earlier run
with the same model, prompts, samples and --max_new_tokens) reads them instead of generating,
so runs that differ only in their training flags skip the generation (a third of the default
run).
"""

from __future__ import annotations

import hashlib
import json
import os
import time

import numpy as np
import orbax.checkpoint as ocp
from absl import app, flags
from flax import nnx
from tqdm import tqdm

from jaxinfer.checkpoint.eagle import save_draft_head
from jaxinfer.checkpoint.loading import load_model, load_tokenizer
from jaxinfer.cli.prompt_file import FORMATS, read_prompt_file
from jaxinfer.config import EngineConfig, RunConfig, SamplingConfig
from jaxinfer.engine.llm import LLM
from jaxinfer.model.eagle import EagleHead, HeadConfig, head_params
from jaxinfer.sharding import describe, make_mesh
from jaxinfer.train import draft_head as train
from jaxinfer.train.loss_plot import write_loss_svg
from jaxinfer.train.prompts import chat_prompts

FLAGS = flags.FLAGS
flags.DEFINE_string("model_path", None, "Target checkpoint; unset = the embedded SmolLM2.")
flags.DEFINE_enum("kind", "eagle3", ["eagle3", "eagle"], "Head layout.")
flags.DEFINE_integer("num_prompts", 1200, "Training prompts: of chat_prompts, or the first of "
                     "--prompts_file (unset there: all of them).", lower_bound=1)
flags.DEFINE_integer("num_held_out", 24, "Held-out prompts: of the held-out subjects, or the "
                     "first of --held_out_file (unset there: all of them).", lower_bound=1)
flags.DEFINE_string("prompts_file", None, "Training prompts from a file, as jaxinfer-generate "
                    "reads one: text (one prompt per line) or JSONL (a \"prompt\" per record: "
                    "text, chat-templated, or token ids, used as they are); unset = the "
                    "package's chat_prompts.")
flags.DEFINE_string("held_out_file", None, "Held-out prompts from a file, read as "
                    "--prompts_file; unset = the package's held-out subjects.")
flags.DEFINE_enum("prompts_format", "auto", list(FORMATS), "Format of the prompt files (auto: "
                  "*.jsonl and *.ndjson are JSONL, anything else text).")
flags.DEFINE_integer("samples_per_prompt", 1, "Answers per training prompt: its greedy answer, "
                     "then this many less one drawn at --temperature (more text from the "
                     "same prompts).", lower_bound=1)
flags.DEFINE_float("temperature", 0.8, "Temperature of the drawn answers "
                   "(--samples_per_prompt > 1).", lower_bound=0.0)
flags.DEFINE_integer("max_new_tokens", 128, "Tokens the target answers each prompt with.")
flags.DEFINE_integer("max_slots", 32, "Answers the engine generates at once.")
flags.DEFINE_integer("seq_len", 192, "Tokens per training sequence (prompt + answer, cut).")
flags.DEFINE_integer("draft_vocab", 4096, "EAGLE-3 draft vocabulary (most frequent tokens).")
flags.DEFINE_integer("steps", 1200, "Optimizer steps.")
flags.DEFINE_integer("batch_size", 8, "Sequences per step.")
flags.DEFINE_float("lr", 1e-3, "AdamW peak learning rate.")
flags.DEFINE_integer("warmup", 30, "Warm-up steps.")
flags.DEFINE_integer("depth", 3, "Training-time-test steps (1: EAGLE's single step).")
flags.DEFINE_float("feature_noise", 0.0, "EAGLE's feature augmentation: uniform noise of this "
                   "amplitude (relative to each feature vector's RMS) on the target's features "
                   "in training; 0: none.")
flags.DEFINE_integer("eval_every", 200, "Steps between held-out acceptance reports.")
flags.DEFINE_integer("eval_depth", 4, "R of the replayed chains.")
flags.DEFINE_integer("seed", 0, "Seed of the head's init and the batches.")
flags.DEFINE_string("init_layer", "last", "The head's layer starts as this layer of the target: "
                    "'last', a layer index, or 'random' (normal(0, 0.02), norms 1).")
flags.DEFINE_string("out", None, "Directory the head is exported to.", required=True)
flags.DEFINE_string("answers", None, "JSON file of the generated answers: read if it exists "
                    "(same model, prompts, samples and --max_new_tokens), else written.")
flags.DEFINE_string("ckpt_dir", None, "Orbax training-state directory; unset = --out/state.")
flags.DEFINE_string("mesh", None, "Device mesh 'data:D' (batches split over data, the head "
                    "replicated; the target's weights by the sharding rules, so "
                    "'data:D,model:M' splits them over model); unset = one device.")

flags.register_multi_flags_validator(
    ["samples_per_prompt", "temperature"],
    lambda f: f["samples_per_prompt"] == 1 or f["temperature"] > 0,
    "--samples_per_prompt > 1 draws answers: it needs --temperature > 0 (greedy answers to one "
    "prompt are all the same)")


def _target_params(model, ckpt, layer: int | None) -> dict[str, np.ndarray]:
    """The target's embedding, final norm and LM head (canonical) a new head starts from, and
    the arrays of its layer `layer` (None: none; the checkpoint's canonical params)."""
    out = {"embed": np.asarray(model.embed[...], np.float32),
           "final_norm": np.asarray(model.final_norm[...], np.float32)}
    if not model.config.tie_embeddings:
        out["lm_head"] = np.asarray(model.lm_head[...], np.float32)
    if layer is not None:
        out.update({k: v for k, v in ckpt.params.items() if k.startswith(f"layers.{layer}.")})
    return out


def _init_layer(num_layers: int) -> int | None:
    """The target layer --init_layer names (None: 'random')."""
    value = FLAGS.init_layer
    if value == "random":
        return None
    if value == "last":
        return num_layers - 1
    if not value.isdigit() or int(value) >= num_layers:
        raise app.UsageError(f"--init_layer={value!r}: valid are 'last', 'random' and the "
                             f"target's layers 0 to {num_layers - 1}")
    return int(value)


def _file_prompts(file_flag: str, num_flag: str) -> list[str | list[int]]:
    """The prompts of the file --<file_flag> names, the first --<num_flag> of them if that flag
    is given. A line that is not a prompt, or that sets sampling (the answers' sampling is this
    script's), is skipped and reported; a file that cannot be read, or has no prompt left,
    stops the run."""
    path, base = FLAGS[file_flag].value, SamplingConfig()
    try:
        records = read_prompt_file(path, base, fmt=FLAGS.prompts_format, flag=file_flag)
    except ValueError as e:
        raise app.UsageError(str(e)) from None
    prompts, errors = [], []
    for r in records:
        if r.error:
            errors.append(r.error)
        elif r.sampling != base:
            errors.append(f"{r.where}: sampling fields are not used here (every prompt gets "
                          f"its greedy answer and --samples_per_prompt - 1 drawn ones)")
        else:
            prompts.append(r.prompt)
    if errors:
        print(f"{path}: skipped {len(errors)} line(s); the first: {errors[0]}")
    if FLAGS[num_flag].present:
        prompts = prompts[:FLAGS[num_flag].value]
    if not prompts:
        raise app.UsageError(f"--{file_flag}={path} holds no usable prompt")
    return prompts


def _prompts() -> tuple[list, list, dict]:
    """(training prompts, held-out prompts, what identifies them in --answers' key)."""
    key = {}
    if FLAGS.prompts_file:
        train_prompts = _file_prompts("prompts_file", "num_prompts")
        key["prompts_file"] = _digest(FLAGS.prompts_file)
    else:
        train_prompts = _package_prompts("num_prompts", "prompts_file", seed=FLAGS.seed)
    if FLAGS.held_out_file:
        held_prompts = _file_prompts("held_out_file", "num_held_out")
        key["held_out_file"] = _digest(FLAGS.held_out_file)
    else:
        held_prompts = _package_prompts("num_held_out", "held_out_file", held_out=True)
    return train_prompts, held_prompts, key


def _package_prompts(num_flag: str, file_flag: str, **kwargs) -> list[str]:
    try:
        return chat_prompts(FLAGS[num_flag].value, **kwargs)
    except ValueError as e:
        raise app.UsageError(f"--{num_flag}: {e}; --{file_flag} reads more") from None


def _digest(path: str) -> str:
    with open(path, "rb") as f:
        return hashlib.sha256(f.read()).hexdigest()


def _answers(model, ckpt, mesh, prompts: tuple[list, list, dict]) -> tuple[list, list]:
    """(training, held-out) (prompt ids, answer ids) pairs of `_prompts()`: read from --answers
    when it holds this run's, else generated by the serving engine (and written to --answers).
    Training answers: every prompt's greedy one, then the drawn ones; held-out answers are
    greedy (the acceptance replay is greedy speculation)."""
    train_prompts, held_prompts, source = prompts
    key = {"model": FLAGS.model_path or "default", "num_prompts": len(train_prompts),
           "num_held_out": len(held_prompts), "seed": FLAGS.seed,
           "max_new_tokens": FLAGS.max_new_tokens, **source}
    if FLAGS.samples_per_prompt > 1:
        key.update(samples_per_prompt=FLAGS.samples_per_prompt, temperature=FLAGS.temperature)
    if FLAGS.answers and os.path.exists(FLAGS.answers):
        with open(FLAGS.answers) as f:
            saved = json.load(f)
        if saved["key"] != key:
            raise ValueError(f"--answers={FLAGS.answers} holds the answers of {saved['key']}, "
                             f"not of this run's {key}: pass another file")
        print(f"read {len(saved['train'])} + {len(saved['held_out'])} answers from "
              f"{FLAGS.answers}")
        return saved["train"], saved["held_out"]
    t0 = time.perf_counter()
    llm = LLM(model, load_tokenizer(ckpt), engine=EngineConfig(max_slots=FLAGS.max_slots),
              mesh=mesh)
    seqs, errors = train.generate(llm, train_prompts, max_new_tokens=FLAGS.max_new_tokens,
                                  samples=FLAGS.samples_per_prompt,
                                  temperature=FLAGS.temperature, seed=FLAGS.seed)
    held_seqs, held_errors = train.generate(llm, held_prompts,
                                            max_new_tokens=FLAGS.max_new_tokens)
    for errs, which in ((errors, "training"), (held_errors, "held-out")):
        if errs:
            print(f"the engine refused {len(errs)} {which} prompt(s); the first: {errs[0]}")
    if not seqs or not held_seqs:
        raise app.UsageError("no training or no held-out answer was generated")
    print(f"generated {len(seqs)} + {len(held_seqs)} answers in "
          f"{time.perf_counter() - t0:.0f} s")
    if FLAGS.answers:
        with open(FLAGS.answers, "w") as f:
            json.dump({"key": key, "train": seqs, "held_out": held_seqs}, f)
    return seqs, held_seqs


def main(argv):
    del argv
    t0 = time.perf_counter()
    mesh = make_mesh(FLAGS.mesh) if FLAGS.mesh else None
    if mesh is not None:
        print(f"mesh: {describe(mesh)}")
    if FLAGS["temperature"].present and FLAGS.samples_per_prompt == 1:
        raise app.UsageError("--temperature is the drawn answers' (--samples_per_prompt > 1); "
                             "with one answer per prompt it is the greedy one")
    prompts = _prompts()  # a bad prompt file stops the run before the model loads
    model, ckpt = load_model(RunConfig(model_path=FLAGS.model_path))
    init_layer = _init_layer(model.config.num_layers)  # a bad one stops the run here
    seqs, held_seqs = _answers(model, ckpt, mesh, prompts)
    vocab = model.config.vocab_size
    size = min(FLAGS.draft_vocab, vocab) if FLAGS.kind == "eagle3" else None
    config = HeadConfig.for_target(model.config, kind=FLAGS.kind, draft_vocab_size=size)
    data = train.record(model, seqs, config, seq_len=FLAGS.seq_len, mesh=mesh)
    held = train.record(model, held_seqs, config, seq_len=FLAGS.seq_len, mesh=mesh)
    d2t = train.draft_vocab(data, size, vocab) if FLAGS.kind == "eagle3" else None
    head = EagleHead(config, train.init_head_params(
        config, _target_params(model, ckpt, init_layer), d2t=d2t, seed=FLAGS.seed,
        from_layer=init_layer))
    before = train.untrained_acceptance(head, model, held, FLAGS.eval_depth)
    print(f"held-out acceptance before training: {before:.3f} tokens per verification")
    os.makedirs(FLAGS.out, exist_ok=True)
    state_dir = os.path.abspath(FLAGS.ckpt_dir or os.path.join(FLAGS.out, "state"))
    manager = ocp.CheckpointManager(state_dir, options=ocp.CheckpointManagerOptions(
        max_to_keep=2))
    history_file = open(os.path.join(FLAGS.out, "history.jsonl"), "w")
    bar = tqdm(total=FLAGS.steps, desc="training")

    def save(step, params, opt_state):
        manager.save(step, args=ocp.args.StandardSave(
            {"params": nnx.to_pure_dict(params), "opt_state": opt_state}))

    def log(record, state):
        bar.update(1)
        bar.set_postfix(loss=f"{record['loss']:.3f}")
        history_file.write(json.dumps(record) + "\n")
        if "acceptance" in record:
            tqdm.write(f"step {record['step']}: loss {record['loss']:.3f}, held-out acceptance "
                       f"{record['acceptance']:.3f} (on as many training answers: "
                       f"{record['train_acceptance']:.3f})")
            save(record["step"], *state)

    cfg = train.TrainConfig(steps=FLAGS.steps, batch_size=FLAGS.batch_size, lr=FLAGS.lr,
                            warmup=FLAGS.warmup, depth=FLAGS.depth,
                            feature_noise=FLAGS.feature_noise, eval_every=FLAGS.eval_every,
                            eval_depth=FLAGS.eval_depth, seed=FLAGS.seed)
    trained, history, _ = train.fit(head, model, data, held, cfg, log=log, mesh=mesh)
    bar.close()
    manager.wait_until_finished()
    history_file.close()
    write_loss_svg(history, os.path.join(FLAGS.out, "loss.svg"),
                   title=f"{FLAGS.kind} head, {FLAGS.steps} steps")
    save_draft_head(FLAGS.out, config, head_params(trained))
    print(f"held-out acceptance: {before:.3f} -> {history[-1]['acceptance']:.3f}; head in "
          f"{FLAGS.out}, training state in {state_dir}; {time.perf_counter() - t0:.0f} s")


if __name__ == "__main__":
    app.run(main)
