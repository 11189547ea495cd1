"""Multi-host for real: 2 processes on this machine, 2 fake CPU devices each, joined by
`jax.distributed` (the `--multihost` path, `sharding.maybe_initialize_distributed`) with gloo
CPU collectives, serve the toy model over a model:4 mesh spanning both processes. Process 0
alone writes the greedy tokens, which equal a single-process, single-device run's; also with
the model restored from an orbax checkpoint, each process reading only its devices' shards.
And `jaxinfer-serve --multihost` as a user starts it on a slice: one command per process, also
serving LoRA adapters (one loaded at run time); `jaxinfer-generate --multihost` with adapters."""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests import multihost_worker

ROOT = Path(__file__).resolve().parent.parent
TIMEOUT_S = 240


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _tail(path: Path, n: int = 3000) -> str:
    text = path.read_text(errors="replace") if path.exists() else "(no log)"
    return "\n".join(line for line in text[-n:].splitlines() if not line.startswith("[Gloo]"))


# CI runs the two-process server (test_two_process_server_matches_single_process), whose
# processes step the same engine; these CLI runs are slow.
@pytest.mark.parametrize("source", [pytest.param("memory", marks=pytest.mark.slow),
                                    pytest.param("orbax", marks=pytest.mark.slow)])
def test_two_processes_match_single_process(tmp_path, source):
    args = []
    if source == "orbax":
        from jaxinfer.checkpoint.orbax import save_orbax
        from jaxinfer.checkpoint.weights import Checkpoint

        config, params = multihost_worker.toy_config_and_params()
        save_orbax(Checkpoint(config=config, params=params, path="toy", format="memory",
                              metadata={}), str(tmp_path / "orbax"))
        args = [str(tmp_path / "orbax")]
    outs = [tmp_path / f"out-{i}.json" for i in range(2)]
    expected = _run_workers(
        tmp_path, lambda i: [sys.executable, str(ROOT / "tests" / "multihost_worker.py"),
                             str(outs[i]), *args],
        lambda procs: multihost_worker.run()[1])  # meanwhile here: one device, no mesh
    assert not outs[1].exists(), "process 1 must not write outputs"
    got = json.loads(outs[0].read_text())
    assert got["process_count"] == 2 and got["global_devices"] == 4 and got["local_devices"] == 2
    # The KV pool is split over all 4 devices, so each process holds only 2 of its shards.
    assert got["k_pages_spec"][0] == "model" and not any(got["k_pages_spec"][1:])
    assert got["k_pages_local_shards"] == 2 and not got["k_pages_fully_addressable"]
    # ... and so is every model-split weight, also when restored from orbax.
    assert got["ffn_spec"][0] == "model" and got["ffn_local_shards"] == 2
    assert not got["ffn_fully_addressable"]
    assert got["token_ids"] == expected


def _env(port: int, process: int, **extra: str) -> dict[str, str]:
    # Proxy variables can hang the coordinator's gRPC (jax warns): all traffic is loopback.
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("JAX_", "TPU_")) and "_proxy" not in k.lower()}
    env.update(JAX_PLATFORMS="cpu",
               XLA_FLAGS="--xla_force_host_platform_device_count=2 "
                         "--xla_cpu_use_fusion_emitters=false "
                         "--xla_cpu_parallel_codegen_split_count=1",  # as tests/conftest.py
               JAX_DISABLE_MOST_OPTIMIZATIONS="1",  # as tests/conftest.py
               JAX_COORDINATOR_ADDRESS=f"127.0.0.1:{port}", JAX_NUM_PROCESSES="2",
               JAX_PROCESS_ID=str(process), JAX_CPU_COLLECTIVES_IMPLEMENTATION="gloo",
               JAX_DEFAULT_MATMUL_PRECISION="highest",  # as tests/conftest.py
               **extra)
    return env


def _run_workers(tmp_path: Path, command, during, **env: str):
    """Starts 2 worker processes (`command(i)` -> argv of process i, with the variables `env`
    set; process i logs to tmp_path/worker-i.log) and, meanwhile, calls `during(processes)`
    here. Fails with the workers' logs unless both exit 0 within TIMEOUT_S. Returns `during`'s
    result."""
    port = _free_port()
    procs, logs = [], []
    for i in range(2):
        logs.append(tmp_path / f"worker-{i}.log")
        with open(logs[i], "w") as log:
            procs.append(subprocess.Popen(command(i), cwd=ROOT, env=_env(port, i, **env),
                                          stdout=log, stderr=subprocess.STDOUT))
    deadline = time.monotonic() + TIMEOUT_S
    timed_out = False

    def report() -> str:
        return "\n".join(f"--- worker {i} (rc {p.returncode}):\n{_tail(logs[i])}"
                         for i, p in enumerate(procs))

    try:
        try:
            result = during(procs)
        except BaseException as e:
            raise AssertionError(f"{e!r}\n{report()}") from e
        while any(p.poll() is None for p in procs):
            # A failed worker leaves the other waiting in a collective: stop at the first error.
            if any(p.returncode for p in procs):
                break
            if time.monotonic() > deadline:
                timed_out = True
                break
            time.sleep(0.5)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    if timed_out:
        pytest.fail(f"workers still running after {TIMEOUT_S}s: killed\n{report()}")
    assert all(p.returncode == 0 for p in procs), report()
    for log in logs:
        assert "Traceback" not in log.read_text(errors="replace"), report()
    return result


SERVE_PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time", "Hi"]
SERVE_TOKENS = 8
SERVE_FLAGS = ["--mesh=data:1,model:4", "--max_seq_len=64", "--max_slots=4",
               "--prefill_buckets=16", "--max_num_batched_tokens=32"]


def _single_process_llm(model_dir: str, adapters: dict[str, str] | None = None, **engine):
    """The engine SERVE_FLAGS describe in this process, on one device (the reference the
    2-process runs must equal), with `adapters` (name -> PEFT directory) registered and the
    engine options `engine` (a LoRA pool's) added."""
    from jaxinfer.config import CacheConfig, EngineConfig, RunConfig
    from jaxinfer.engine.llm import load_llm

    llm = load_llm(RunConfig(model_path=model_dir, cache=CacheConfig(max_seq_len=64),
                             engine=EngineConfig(max_slots=4, prefill_buckets=(16,),
                                                 max_num_batched_tokens=32, **engine)))
    for name, path in (adapters or {}).items():
        llm.engine.add_lora(name, path)
    return llm


def _ask(url: str, models: tuple[str, ...] = ("test",) * len(SERVE_PROMPTS)) -> list[str]:
    """SERVE_PROMPTS through the server, all at once, prompt i to model `models[i]` (the base
    model's served name or an adapter's); the last one streamed."""
    import concurrent.futures

    import httpx

    def one(i: int) -> str:
        body = {"model": models[i], "prompt": SERVE_PROMPTS[i], "max_tokens": SERVE_TOKENS,
                "temperature": 0, "ignore_eos": True}
        if i < len(SERVE_PROMPTS) - 1:
            return httpx.post(f"{url}/v1/completions", json=body, timeout=120).json()[
                "choices"][0]["text"]
        text = ""
        with httpx.stream("POST", f"{url}/v1/completions", json={**body, "stream": True},
                          timeout=120) as r:
            for line in r.iter_lines():
                if line.startswith("data: {"):
                    text += json.loads(line[6:])["choices"][0]["text"]
        return text

    with concurrent.futures.ThreadPoolExecutor(len(SERVE_PROMPTS)) as pool:
        return list(pool.map(one, range(len(SERVE_PROMPTS))))


def _wait_healthy(url: str, procs, deadline: float) -> None:
    import httpx

    while True:
        assert all(p.poll() is None for p in procs), "a server process exited while starting"
        assert time.monotonic() < deadline, "the server did not become healthy"
        try:
            if httpx.get(f"{url}/health", timeout=5).status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.5)


def test_two_process_server_matches_single_process(tmp_path):
    """`jaxinfer-serve --multihost` in 2 processes: process 0 serves HTTP and broadcasts each
    device call; process 1 follows. Requests sent to process 0 get the single-process outputs;
    on SIGTERM process 0 shuts its server down and ends the follower: both exit 0, no
    traceback."""
    from tests.helpers import tiny_smollm_dir

    model_dir = tiny_smollm_dir(str(tmp_path / "tiny"))
    http_port = _free_port()
    url = f"http://127.0.0.1:{http_port}"

    def command(i: int) -> list[str]:
        return [sys.executable, "-m", "jaxinfer.cli.serve", "--multihost",
                f"--model_path={model_dir}", *SERVE_FLAGS, f"--port={http_port}",
                "--served_model_name=test", "--grace_period_s=10",
                f"--compilation_cache_dir={ROOT / '.xla-test-cache'}"]

    def during(procs) -> tuple[list[str], list[str]]:
        from jaxinfer.config import SamplingConfig

        expected = [c.text for c in _single_process_llm(model_dir).generate(
            SERVE_PROMPTS, SamplingConfig(max_new_tokens=SERVE_TOKENS, ignore_eos=True),
            use_tqdm=False)]
        _wait_healthy(url, procs, time.monotonic() + TIMEOUT_S)
        got = _ask(url)
        procs[0].send_signal(signal.SIGTERM)
        return got, expected

    got, expected = _run_workers(tmp_path, command, during)
    assert got == expected


def _compiles(log: Path) -> list[str]:
    """The functions of the executables a worker made so far (JAX_LOG_COMPILES), in order."""
    return re.findall(r"Finished XLA compilation of jit\((\w+)\)", log.read_text(errors="replace"))


def _wait_for(log: Path, line: str, procs) -> None:
    deadline = time.monotonic() + TIMEOUT_S
    while line not in log.read_text(errors="replace"):
        assert all(p.poll() is None for p in procs), f"a worker exited before {line!r}"
        assert time.monotonic() < deadline, f"no {line!r} in {log}"
        time.sleep(0.5)


def test_two_process_server_serves_lora_adapters(tmp_path):
    """LoRA adapters on a 2-process server (`--multihost`, the pool sharded over the model:4
    mesh spanning both): requests for an adapter given at start (`--lora_modules`), one loaded
    at run time through `POST /v1/load_lora_adapter` (sent to process 0 only: the pool write
    reaches process 1 through the broadcast) and the base model run in one batch and each gets
    the single-process outputs, with nothing compiled after the first adapter paged in (the
    step variants warm); an unloaded adapter is a 404."""
    import httpx

    from jaxinfer.checkpoint.weights import load_checkpoint
    from tests.helpers import tiny_smollm_dir, write_peft_adapter

    model_dir = tiny_smollm_dir(str(tmp_path / "tiny"))
    config = load_checkpoint(model_dir).config
    adapters = {"a": write_peft_adapter(str(tmp_path / "a"), config, rank=4, seed=1),
                "b": write_peft_adapter(str(tmp_path / "b"), config, rank=8, seed=2, targets=(
                    "q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj",
                    "down_proj"))}
    lora_flags = [f"--lora_modules=a={adapters['a']}", "--max_loras=2", "--max_lora_rank=8"]
    http_port = _free_port()
    url = f"http://127.0.0.1:{http_port}"
    before, after = ("test", "a", "test", "a"), ("a", "b", "test", "b")

    def command(i: int) -> list[str]:
        return [sys.executable, "-m", "jaxinfer.cli.serve", "--multihost",
                f"--model_path={model_dir}", *SERVE_FLAGS, *lora_flags, f"--port={http_port}",
                "--served_model_name=test", "--grace_period_s=10",
                f"--compilation_cache_dir={ROOT / '.xla-test-cache'}"]

    def during(procs):
        from jaxinfer.config import SamplingConfig

        llm = _single_process_llm(model_dir, adapters, max_loras=2, max_lora_rank=8)
        sc = SamplingConfig(max_new_tokens=SERVE_TOKENS, ignore_eos=True)
        expected = [[c.text for c in llm.generate(
            SERVE_PROMPTS, sc, lora=[None if m == "test" else m for m in models],
            use_tqdm=False)] for models in (before, after)]
        _wait_healthy(url, procs, time.monotonic() + TIMEOUT_S)
        _wait_for(log, "[jaxinfer] compiled all", procs)  # the background warm-up
        got = [_ask(url, before)]  # pages in a: compiles the pool write
        warm = _compiles(log)
        r = httpx.post(f"{url}/v1/load_lora_adapter", timeout=60,
                       json={"lora_name": "b", "lora_path": adapters["b"]})
        assert r.status_code == 200, r.text
        got.append(_ask(url, after))
        compiled = _compiles(log)[len(warm):]
        r = httpx.post(f"{url}/v1/unload_lora_adapter", json={"lora_name": "a"}, timeout=60)
        assert r.status_code == 200, r.text
        gone = httpx.post(f"{url}/v1/completions", timeout=60,
                          json={"model": "a", "prompt": "Hi", "max_tokens": 2})
        procs[0].send_signal(signal.SIGTERM)
        return got, expected, gone.status_code, compiled

    log = tmp_path / "worker-0.log"
    got, expected, gone, compiled = _run_workers(tmp_path, command, during,
                                                 JAX_LOG_COMPILES="1")
    # The adapters matter: a's text differs from the base model's, b's from a's.
    assert expected[0][0] != expected[1][0] and expected[0][1] != expected[1][1]
    assert got == expected and gone == 404
    # The adapter loaded at run time pages into the pool's other slot: same shapes, the step
    # variants all warm, the pool write compiled by a's: nothing compiles.
    assert compiled == [], compiled


@pytest.mark.slow  # a CLI run in 2 processes, like the CLI cases above
def test_two_process_generate_serves_lora_adapters(tmp_path):
    """`jaxinfer-generate --multihost` with `--lora_modules` in 2 processes: one JSONL file of
    prompts for two adapters and the base model, through a 1-slot pool (so the adapters page
    in and out: each process makes the same page-ins, in step), gives the single-process
    outputs; process 0 alone writes them."""
    from jaxinfer.checkpoint.weights import load_checkpoint
    from tests.helpers import tiny_smollm_dir, write_peft_adapter

    model_dir = tiny_smollm_dir(str(tmp_path / "tiny"))
    config = load_checkpoint(model_dir).config
    adapters = {"a": write_peft_adapter(str(tmp_path / "a"), config, rank=4, seed=1),
                "b": write_peft_adapter(str(tmp_path / "b"), config, rank=8, seed=2,
                                        targets=("q_proj", "o_proj", "down_proj"))}
    loras = ["a", None, "b", "a"]
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": p, **({"lora": m} if m else {})}) + "\n"
                               for p, m in zip(SERVE_PROMPTS, loras)))
    outs = [tmp_path / f"out-{i}.jsonl" for i in range(2)]

    def command(i: int) -> list[str]:
        return [sys.executable, "-m", "jaxinfer.cli.generate", "--multihost",
                f"--model_path={model_dir}", *SERVE_FLAGS, f"--prompts_file={prompts}",
                f"--output_jsonl={outs[i]}", f"--max_new_tokens={SERVE_TOKENS}",
                "--ignore_eos", "--lora_modules=" + ",".join(f"{k}={v}"
                                                           for k, v in adapters.items()),
                "--max_loras=1", "--max_lora_rank=8",
                f"--compilation_cache_dir={ROOT / '.xla-test-cache'}"]

    def during(procs) -> tuple[list[list[int]], list[list[int]]]:
        from jaxinfer.config import SamplingConfig

        llm = _single_process_llm(model_dir, adapters, max_loras=1, max_lora_rank=8)
        sc = SamplingConfig(max_new_tokens=SERVE_TOKENS, ignore_eos=True)
        return tuple([c.token_ids for c in llm.generate(SERVE_PROMPTS, sc, lora=lora,
                                                        use_tqdm=False)]
                     for lora in (loras, None))

    expected, base = _run_workers(tmp_path, command, during)
    assert not outs[1].exists(), "process 1 must not write outputs"
    got = [json.loads(line) for line in outs[0].read_text().splitlines()]
    assert [r["finish_reason"] for r in got] == ["length"] * len(SERVE_PROMPTS)
    assert [r["token_ids"] for r in got] == expected
    # The adapters matter: each adapter prompt's tokens differ from the base model's.
    assert all(e != b for e, b, m in zip(expected, base, loras) if m)
