"""Training on top of the engine: draft heads for speculative decoding (`draft_head`), on
prompts that ship with the package (`prompts`)."""
