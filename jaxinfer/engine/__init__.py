"""The serving engine: scheduler (host-only: request, pages, scheduler), device steps (kv_cache,
sampling, steps, runner), the step loop (batching, engine, spec, warmup, speculative) and the
offline API (llm). Nothing is imported here, so the host-only modules import without jax."""
