"""The command lines: `jaxinfer-generate` (generate), `jaxinfer-tts` (tts), `jaxinfer-plan` (plan),
and the one flag table they share (flags)."""
