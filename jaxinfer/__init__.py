"""jaxinfer: LLM inference on JAX — exact, measured, readable."""

__version__ = "0.1.0"
