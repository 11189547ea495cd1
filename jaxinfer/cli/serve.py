"""`jaxinfer-serve`: an OpenAI-compatible HTTP server on the engine.

  jaxinfer-serve                                   # the embedded SmolLM2-135M-Instruct
  jaxinfer-serve --config=configs/smollm2-135m.yaml --port=8000 --api_key=secret

The same config flags and `--config` YAML as `jaxinfer-generate` (model, mesh, cache, engine;
the sampling flags are the defaults of absent request fields only for `--max_new_tokens`, the
max_tokens of a request that gives none). The address is checked and listened on first: a port
outside [0, 65535], a host that does not resolve or an address in use stops the server before
the model loads (one line naming the flag, exit status 2; `--port=0` picks a free port, which
the "ready" line names). The HTTP server then starts (`/health` answers 503 while loading); the
engine thread loads the model and compiles, on several threads, the step variants one request
of up to `--warmup_common_len` tokens uses, then `/health` answers 200 and a "ready" line goes
to stderr, while the other variants compile in the background (`--warmup`; a request that needs
one of those first waits for it). A model that cannot load with this config stops the server
with one line naming the problem (exit status 2); an engine that fails later, 1. SIGTERM or
SIGINT: stop accepting connections, let running requests finish for `--grace_period_s`, abort
the rest (each stream ends with its "abort" chunk and [DONE]), exit 0 at once (during warm-up:
warm-up stops first, after the compiles under way).

Multi-host (`--multihost`, every process runs the same command): process 0 serves HTTP and
schedules, and sends each device call to the other processes, which make the same calls
(`jaxinfer.serve.multihost`); when process 0 shuts down, they exit too.
"""

from __future__ import annotations

import dataclasses
import signal
import socket
import sys
import threading
import time

from absl import app, flags

from jaxinfer.cli import flags as jflags

FLAGS = flags.FLAGS
flags.DEFINE_string("host", "127.0.0.1", "Address to listen on (0.0.0.0: every interface).")
flags.DEFINE_integer("port", 8000, "Port to listen on.")
flags.DEFINE_string("served_model_name", None,
                    "Model id of the API (/v1/models, the requests' 'model'); unset = the "
                    "checkpoint's file or directory name.")
flags.DEFINE_string("api_key", None, "Bearer token every /v1 request must send; unset = open.")
flags.DEFINE_integer("max_waiting_requests", 256,
                     "Samples admitted beyond the engine's slots; more get 429 + Retry-After.")
flags.DEFINE_float("grace_period_s", 30.0,
                   "On SIGTERM/SIGINT: seconds running requests get to finish before abort.")
flags.DEFINE_bool("warmup", True,
                  "Compile every step variant: the common ones before reporting ready, the "
                  "rest in the background.")
flags.DEFINE_integer("warmup_common_len", 256,
                     "With --warmup: report ready once the variants one request of up to this "
                     "many tokens (prompt and output) uses on an idle server are compiled.")
flags.DEFINE_bool("warmup_prompt_logprobs", False,
                  "With --warmup, also compile the prompt-logprob variants (`echo` with "
                  "`logprobs` on /v1/completions, as lm-eval's loglikelihood tasks send): about "
                  "doubles warm-up; without it the first such request per chunk and page "
                  "bucket compiles.")
jflags.define_compilation_cache_flag()
jflags.define_flags()

# The widest top logprobs a request may ask for when --max_top_logprobs is unset (OpenAI's
# completions limit); each step computes this many for every row.
DEFAULT_TOP_LOGPROBS = 5


def served_name(run) -> str:
    if FLAGS.served_model_name:
        return FLAGS.served_model_name
    if run.model_path:
        return run.model_path.rstrip("/").rsplit("/", 1)[-1]
    return "SmolLM2-135M-Instruct"


def _make_engine(run, name: str, url: str, *, broadcast: bool, stopping: threading.Event):
    """The engine, loaded and warmed up (runs on the engine thread); with `broadcast` (process
    0 of a multi-host server) its device calls go to every process. A shutdown (`stopping`)
    ends warm-up early, and the server is then never reported ready."""
    from jaxinfer.engine.llm import load_llm
    from jaxinfer.serve.multihost import Broadcaster

    t0 = time.perf_counter()
    engine = load_llm(run).engine
    if broadcast:
        engine.runner = Broadcaster(engine.runner)
    loaded = time.perf_counter()
    common = _start_warmup(engine, stopping) if FLAGS.warmup else 0
    if not stopping.is_set():
        print(f"[jaxinfer] ready: {name} at {url}/v1 (loaded in {loaded - t0:.1f}s, compiled "
              f"{common} common step variants in {time.perf_counter() - loaded:.1f}s)",
              file=sys.stderr, flush=True)
    return engine


def _start_warmup(engine, stopping: threading.Event) -> int:
    """Starts compiling every step variant (`Engine.start_warmup`) and waits for those of
    one request of up to --warmup_common_len tokens; returns how many those are. A line goes
    to stderr when all are compiled. A shutdown (`stopping`) starts no further compile."""
    t0 = time.perf_counter()

    def done():
        print(f"[jaxinfer] compiled all {warm.num_variants} step variants in "
              f"{time.perf_counter() - t0:.1f}s", file=sys.stderr, flush=True)

    warm = engine.start_warmup(common_len=FLAGS.warmup_common_len,
                               prompt_logprobs=FLAGS.warmup_prompt_logprobs, on_done=done,
                               cancelled=stopping.is_set)
    warm.wait(warm.ready)
    return warm.num_ready_variants


def check_port(port: int) -> None:
    if not 0 <= port <= 65535:
        raise ValueError(f"--port={port}: must be in [0, 65535] (0: a free port the system "
                         "picks)")


def listen(host: str, port: int) -> socket.socket:
    """A socket listening at `host` (a name or an address, resolved here) and `port`, before
    the model loads: an address that cannot be served stops the server at once, naming the
    flag (ValueError), and the "ready" line comes only from a server already listening."""
    check_port(port)
    try:
        family, kind, proto, _, address = socket.getaddrinfo(
            host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)[0]
    except UnicodeError:  # an empty or over-long label: "a..b", "-x"
        raise ValueError(f"--host={host}: not a host name or IP address") from None
    except socket.gaierror as e:
        raise ValueError(f"--host={host}: cannot resolve it ({e.strerror})") from None
    sock = socket.socket(family, kind, proto)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn does
    try:
        sock.bind(address)
        sock.listen()
    except OSError as e:
        sock.close()
        raise ValueError(f"--host={host} --port={port}: cannot listen there "
                         f"({e.strerror or e})") from None
    return sock


def _url(host: str, sock: socket.socket) -> str:
    port = sock.getsockname()[1]
    return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"


@jflags.reporting_errors("jaxinfer-serve")
def main(argv: list[str]) -> int:
    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments: {argv[1:]}")
    run = jflags.resolve_config()
    check_port(FLAGS.port)
    if FLAGS["max_top_logprobs"].value is None and run.engine.max_top_logprobs == 0:
        run = dataclasses.replace(run, engine=dataclasses.replace(
            run.engine, max_top_logprobs=max(run.engine.max_top_logprobs, DEFAULT_TOP_LOGPROBS)))
    from jaxinfer.serve.server import ServerConfig

    name = served_name(run)
    config = ServerConfig(served_model_name=name, api_key=FLAGS.api_key,
                          max_waiting_requests=FLAGS.max_waiting_requests,
                          default_max_tokens=run.sampling.max_new_tokens)
    jflags.skip_absent_tpu()
    import jax

    from jaxinfer.sharding import maybe_initialize_distributed

    jflags.use_compilation_cache()
    maybe_initialize_distributed(run.multihost)
    multihost = jax.process_count() > 1
    if multihost and run.engine.speculative_method != "none":
        raise ValueError(f"speculative_method={run.engine.speculative_method!r} is not served "
                         "multi-host (its drafter's device calls are not broadcast); use none")
    if multihost and jax.process_index() != 0:
        return _follow(run)
    sock = listen(FLAGS.host, FLAGS.port)
    from jaxinfer.serve.app import serve
    from jaxinfer.serve.server import Server

    # The engine thread calls this once `server` exists (when uvicorn starts).
    server = Server(lambda: _make_engine(run, name, _url(FLAGS.host, sock), broadcast=multihost,
                                         stopping=server.engine_loop.stopping), config)
    # uvicorn handles SIGTERM/SIGINT (graceful shutdown), then raises the signal again for the
    # handler it found: these make that a no-op, so the process ends with status 0.
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: None)
    serve(server, sock=sock, grace_s=FLAGS.grace_period_s)
    loop = server.engine_loop
    if multihost and loop.engine is not None:
        loop.engine.runner.close()  # ends the other processes' `follow`
    return _failure_status(loop)


def _failure_status(loop) -> int:
    """The exit status once the server has stopped: 0, unless the engine thread failed (the
    server then stops by itself, `serve.app.GracefulServer.on_tick`). A model that could not
    load with this config (a ValueError before ready, e.g. --max_seq_len past the model's
    context) is bad input: one line, status 2 (`reporting_errors`); any other failure: 1."""
    if loop.error is None:
        return 0
    if isinstance(loop.exception, (ValueError, FileNotFoundError)) and not loop.ready.is_set():
        raise loop.exception
    print(f"jaxinfer-serve: error: the engine failed: {loop.error}", file=sys.stderr)
    return 1


def _follow(run) -> int:
    """A process other than 0 of a multi-host server: the same engine, whose device calls
    process 0 sends (`jaxinfer.serve.multihost`), and the same warm-up, which makes none;
    ends when process 0 shuts down."""
    from jaxinfer.engine.llm import load_llm
    from jaxinfer.serve import multihost

    signal.signal(signal.SIGTERM, lambda *_: None)  # process 0's shutdown ends this one
    engine = load_llm(run).engine
    if FLAGS.warmup:  # the same executables as process 0's, compiled here
        engine.start_warmup(common_len=FLAGS.warmup_common_len,
                            prompt_logprobs=FLAGS.warmup_prompt_logprobs)
    calls = multihost.follow(engine.runner)
    print(f"[jaxinfer] follower done after {calls} device calls", file=sys.stderr)
    return 0


def run() -> None:
    jflags.run_app(main, doc=__doc__, skip_teardown=True)


if __name__ == "__main__":
    run()
