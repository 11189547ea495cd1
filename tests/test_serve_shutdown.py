"""`jaxinfer-serve` as a process: its address flags, and SIGTERM.

SIGTERM during a streaming load ends the process with exit status 0 and no traceback; every
choice of every running stream ends with a chunk carrying its finish reason ("length" for one
that finished in time, "abort" for the rest), then [DONE]. SIGTERM while
the server warms up ends warm-up early: the server is never reported ready. Bad address flags
stop the server before the model loads. The time bounds are generous (a loaded 2-core machine
compiles the steps that `--nowarmup` leaves for the first requests); the assertions are about
behaviour.
"""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest

from tests.helpers import free_port, tiny_smollm_dir

ROOT = Path(__file__).resolve().parent.parent
# No grace period: every stream still running at SIGTERM is aborted at once, so which finish
# reason each gets does not depend on the machine's speed (a LONG one is always aborted).
GRACE_S = 0
SLACK_S = 60  # beyond the grace period: a step in flight on a loaded machine, process exit
SHORT, LONG = 8, 480  # max_tokens (the context is 512)
SERVE_FLAGS = ["--served_model_name=tiny", "--max_seq_len=512", "--max_slots=4",
               "--prefill_buckets=32", f"--grace_period_s={GRACE_S}",
               f"--compilation_cache_dir={ROOT / '.xla-test-cache'}"]


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> str:
    return tiny_smollm_dir(str(tmp_path_factory.mktemp("tiny")))


def _start(model: str, log: Path, *flags: str, port: int = 0) -> subprocess.Popen:
    """jaxinfer-serve on 127.0.0.1 at `port` (0: the system picks a free one, which the
    "ready" line names), one CPU device; its stdout and stderr go to `log`."""
    env = {**os.environ, "XLA_FLAGS": "--xla_backend_optimization_level=0",
           "JAX_PLATFORMS": "cpu"}
    with open(log, "w") as f:
        return subprocess.Popen(
            [sys.executable, "-m", "jaxinfer.cli.serve", f"--model_path={model}", f"--port={port}",
             *SERVE_FLAGS, *flags], cwd=ROOT, env=env, stdout=f, stderr=subprocess.STDOUT)


def _ready_url(proc: subprocess.Popen, log: Path, timeout_s: float = 300) -> str:
    """The URL of the "ready" line, which the server prints once it listens and has loaded."""
    deadline = time.monotonic() + timeout_s
    while True:
        found = re.search(r"ready: tiny at (http://\S+)/v1", log.read_text())
        if found:
            return found.group(1)
        assert proc.poll() is None and time.monotonic() < deadline, log.read_text()
        time.sleep(0.2)


def _stream(url: str, body: dict, started: threading.Event, out: list) -> None:
    """One streamed completion: its SSE payloads (JSON, or "[DONE]"), or the client error."""
    events = []
    try:
        with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=300) as r:
            started.set()  # the response began: the server holds the request
            for line in r.iter_lines():
                if line.startswith("data: "):
                    events.append(line[6:] if line == "data: [DONE]" else json.loads(line[6:]))
    except httpx.HTTPError as e:
        events.append(f"client error: {e!r}")
    finally:
        started.set()
    out.append((body, events))


def _check_stream(body: dict, events: list) -> None:
    """Each choice's last chunk carries its finish reason (then nothing for it), then [DONE]."""
    assert events and events[-1] == "[DONE]", (body, events[-3:])
    reasons = {}
    for chunk in events[:-1]:
        assert "error" not in chunk, chunk
        for choice in chunk["choices"]:
            assert choice["index"] not in reasons, (body, chunk)
            if choice["finish_reason"] is not None:
                reasons[choice["index"]] = choice["finish_reason"]
    expected = {"abort"} if body["max_tokens"] == LONG else {"length", "abort"}
    assert set(reasons) == set(range(body.get("n", 1))), (body, reasons)
    assert set(reasons.values()) <= expected, (body, reasons)


def test_sigterm_during_streaming_load_exits_zero(model, tmp_path):
    log = tmp_path / "serve.log"
    proc = _start(model, log, "--nowarmup")
    try:
        url = _ready_url(proc, log)
        assert httpx.get(f"{url}/health").status_code == 200
        bodies = [{"model": "tiny", "prompt": "Tell me a story.", "max_tokens": n,
                   "ignore_eos": True, "stream": True, **extra}
                  for n, extra in ((SHORT, {}), (SHORT, {"n": 2}), (LONG, {}), (LONG, {"n": 2}),
                                   (LONG, {}))]
        streams: list = []
        started = [threading.Event() for _ in bodies]
        threads = [threading.Thread(target=_stream, args=(url, body, event, streams))
                   for body, event in zip(bodies, started)]
        for t in threads:
            t.start()
        for event in started:  # SIGTERM once the server holds every request
            assert event.wait(300), log.read_text()
        start = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        status = proc.wait(timeout=GRACE_S + SLACK_S)
        took = time.monotonic() - start
        for t in threads:
            t.join(60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    text = log.read_text()
    assert status == 0, text
    assert "Traceback" not in text and "timeout graceful shutdown exceeded" not in text, text
    assert took < GRACE_S + SLACK_S, (took, text)
    assert len(streams) == len(bodies)
    for body, events in streams:
        _check_stream(body, events)


def test_sigterm_during_warmup_ends_it_and_exits_zero(model, tmp_path):
    """SIGTERM as soon as the HTTP server answers (503 while the engine thread loads the model
    and warms up every variant of a 512-token context): warm-up stops at its next variant and
    the server never says it is ready."""
    log = tmp_path / "serve.log"
    port = free_port()
    proc = _start(model, log, port=port)
    try:
        deadline = time.monotonic() + 300
        while True:
            assert proc.poll() is None and time.monotonic() < deadline, log.read_text()
            try:
                if httpx.get(f"http://127.0.0.1:{port}/health").status_code == 503:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(0.1)
        start = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        status = proc.wait(timeout=SLACK_S)
        took = time.monotonic() - start
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    text = log.read_text()
    assert status == 0, text
    assert "ready" not in text and "Traceback" not in text, text
    assert took < SLACK_S, (took, text)


@pytest.mark.parametrize("flags, message", [
    (["--port=70000"], "--port=70000: must be in [0, 65535]"),
    (["--port=-1"], "--port=-1: must be in [0, 65535]"),
    (["--host=not..a..host"], "--host=not..a..host: not a host name or IP address"),
    (["--host=no-such-host.invalid"], "--host=no-such-host.invalid: cannot resolve it"),
    (["--port={busy}"], "--host=127.0.0.1 --port={busy}: cannot listen there (Address already "
                        "in use)"),
])
def test_bad_address_flags_stop_before_the_model_loads(model, flags, message):
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        flags = [f.format(busy=port) for f in flags]
        proc = subprocess.run(
            [sys.executable, "-m", "jaxinfer.cli.serve", f"--model_path={model}", *SERVE_FLAGS,
             *flags], cwd=ROOT, env={**os.environ, "JAX_PLATFORMS": "cpu"},
            capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2, proc.stderr
    lines = proc.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith(
        f"jaxinfer-serve: error: {message.format(busy=port)}"), proc.stderr


def test_a_model_that_cannot_load_with_the_config_stops_the_server(model, tmp_path):
    """--max_seq_len past the model's context (512) is found when the engine thread loads the
    model: the server stops by itself, with one line naming the value and exit status 2."""
    log = tmp_path / "serve.log"
    proc = _start(model, log, "--max_seq_len=2048")
    try:
        assert proc.wait(timeout=300) == 2, log.read_text()
    finally:
        proc.kill()
    lines = log.read_text().strip().splitlines()
    assert lines[-1].startswith("jaxinfer-serve: error: ") and "2048" in lines[-1], lines
    assert "Traceback" not in log.read_text()
