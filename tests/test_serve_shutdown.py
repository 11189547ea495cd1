"""`jaxinfer-serve` as a process: SIGTERM during a streaming load ends it within the grace
period with exit status 0 and no traceback; the streams that were running end cleanly (their
last event is [DONE], whether they finished or were aborted at the deadline)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx

from tests.helpers import free_port, tiny_smollm_dir

ROOT = Path(__file__).resolve().parent.parent
GRACE_S = 3


def _stream(url: str, max_tokens: int, out: list) -> None:
    body = {"model": "tiny", "prompt": "Tell me a story.", "max_tokens": max_tokens,
            "ignore_eos": True, "stream": True}
    lines = []
    try:
        with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=60) as r:
            lines = [line for line in r.iter_lines() if line.startswith("data: ")]
    except httpx.HTTPError as e:
        lines.append(f"error: {e!r}")
    out.append(lines)


def test_sigterm_during_streaming_load_exits_zero(tmp_path):
    model = tiny_smollm_dir(str(tmp_path / "tiny"))
    port = free_port()
    env = {**os.environ, "XLA_FLAGS": "--xla_backend_optimization_level=0"}  # one device
    env["JAX_PLATFORMS"] = "cpu"
    log = tmp_path / "serve.log"
    with open(log, "w") as f:
        proc = subprocess.Popen(
            [sys.executable, "-m", "jaxinfer.cli.serve", f"--model_path={model}",
             f"--port={port}", "--served_model_name=tiny", "--max_seq_len=192",
             "--max_slots=4", "--prefill_buckets=32", "--nowarmup", f"--grace_period_s={GRACE_S}",
             f"--compilation_cache_dir={ROOT / '.xla-test-cache'}"],
            cwd=ROOT, env=env, stdout=f, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 120
        while True:
            assert proc.poll() is None, log.read_text()
            assert time.monotonic() < deadline, log.read_text()
            try:
                if httpx.get(f"{url}/health").status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        # Short streams finish within the grace period; long ones are aborted at its end.
        streams: list = []
        threads = [threading.Thread(target=_stream, args=(url, n, streams))
                   for n in (8, 16, 150, 150, 150, 150)]
        for t in threads:
            t.start()
        time.sleep(1.0)
        start = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        status = proc.wait(timeout=GRACE_S + 20)
        took = time.monotonic() - start
        for t in threads:
            t.join(10)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    text = log.read_text()
    assert status == 0, text
    assert took < GRACE_S + 10, (took, text)
    assert "Traceback" not in text, text
    assert len(streams) == len(threads)
    for lines in streams:
        assert lines and lines[-1] == "data: [DONE]" or any("error" in x for x in lines), lines
        assert all("error" not in json.loads(x[6:]) for x in lines[:-1]
                   if x.startswith("data: {")), lines
