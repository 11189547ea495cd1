"""Checkpoints in: GGUF, Hugging Face safetensors and orbax readers, their quant formats, the
tokenizer, and `loading` (run config -> model + tokenizer)."""
