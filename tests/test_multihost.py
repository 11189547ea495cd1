"""Multi-host for real: 2 processes on this machine, 2 fake CPU devices each, joined by
`jax.distributed` (the `--multihost` path, `sharding.maybe_initialize_distributed`) with gloo
CPU collectives, serve the toy model over a model:4 mesh spanning both processes. Process 0
alone writes the greedy tokens, which equal a single-process, single-device run's; also with
the model restored from an orbax checkpoint, each process reading only its devices' shards."""

from __future__ import annotations

import json
import os
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


@pytest.mark.parametrize("source", ["memory", "orbax"])
def test_two_processes_match_single_process(tmp_path, source):
    args = []
    if source == "orbax":
        from jaxinfer.checkpoint.orbax import save_orbax
        from jaxinfer.checkpoint.weights import Checkpoint

        config, params = multihost_worker.toy_config_and_params()
        save_orbax(Checkpoint(config=config, params=params, path="toy", format="memory",
                              metadata={}), str(tmp_path / "orbax"))
        args = [str(tmp_path / "orbax")]
    _, outs, expected = _run_workers(tmp_path, args, lambda: multihost_worker.run()[1])
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


def _run_workers(tmp_path: Path, args: list[str], reference):
    """Runs 2 worker processes (`tests/multihost_worker.py ARGS`, each with its output path
    first, except that `--serve` stays first) and, meanwhile, `reference()` here. Fails with
    the workers' logs unless both exit 0. Returns (processes, output paths, reference())."""
    port = _free_port()
    procs, logs, outs = [], [], []
    for i in range(2):
        # Proxy variables can hang the coordinator's gRPC (jax warns): all traffic is loopback.
        env = {k: v for k, v in os.environ.items()
               if not k.startswith(("JAX_", "TPU_")) and "_proxy" not in k.lower()}
        env.update(JAX_PLATFORMS="cpu", XLA_FLAGS="--xla_force_host_platform_device_count=2",
                   JAX_COORDINATOR_ADDRESS=f"127.0.0.1:{port}", JAX_NUM_PROCESSES="2",
                   JAX_PROCESS_ID=str(i))
        logs.append(tmp_path / f"worker-{i}.log")
        outs.append(tmp_path / f"out-{i}.json")
        mode = args[:1] if args[:1] == ["--serve"] else []
        with open(logs[i], "w") as log:
            procs.append(subprocess.Popen(
                [sys.executable, str(ROOT / "tests" / "multihost_worker.py"), *mode,
                 str(outs[i]), *args[len(mode):]],
                cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT))
    deadline = time.monotonic() + TIMEOUT_S
    timed_out = False
    try:
        expected = reference()  # meanwhile, in this process: one device, no mesh
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
    report = "\n".join(f"--- worker {i} (rc {p.returncode}):\n{_tail(logs[i])}"
                       for i, p in enumerate(procs))
    if timed_out:
        pytest.fail(f"workers still running after {TIMEOUT_S}s: killed\n{report}")
    assert all(p.returncode == 0 for p in procs), report
    return procs, outs, expected


def test_two_process_server_matches_single_process(tmp_path):
    """Multi-host serving: process 0 serves HTTP and broadcasts each device call; process 1
    follows. Requests sent to process 0 get the single-process outputs, and both processes
    exit 0 once process 0 has shut its server down and ended the followers."""
    from tests.helpers import tiny_smollm_dir

    model_dir = tiny_smollm_dir(str(tmp_path / "tiny"))

    def reference():
        from jaxinfer.config import SamplingConfig
        from jaxinfer.engine.llm import load_llm

        llm = load_llm(multihost_worker.serve_config(model_dir))
        return [c.text for c in llm.generate(
            multihost_worker.SERVE_PROMPTS,
            SamplingConfig(max_new_tokens=multihost_worker.SERVE_TOKENS, ignore_eos=True),
            use_tqdm=False)]

    _, outs, expected = _run_workers(tmp_path, ["--serve", model_dir], reference)
    assert not outs[1].exists(), "process 1 must not write outputs"
    got = json.loads(outs[0].read_text())
    assert got["process_count"] == 2
    assert got["texts"] == expected
