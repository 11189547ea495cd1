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
        with open(logs[i], "w") as log:
            procs.append(subprocess.Popen(
                [sys.executable, str(ROOT / "tests" / "multihost_worker.py"), str(outs[i]),
                 *args],
                cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT))
    deadline = time.monotonic() + TIMEOUT_S
    timed_out = False
    try:
        # Meanwhile the reference, in this process: one device, no mesh.
        expected = multihost_worker.run()[1]
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
