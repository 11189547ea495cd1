"""The OpenAI-compatible server (docs/architecture.md, decision 11): `engine_loop` (the one
thread that owns the engine and the device), `protocol` (OpenAI request/response shapes and their
mapping onto `SamplingConfig`), `metrics` (Prometheus) and `app` (the FastAPI routes). The
console script is `jaxinfer.cli.serve`."""
