"""Custom Pallas kernels, each with a plain-jnp reference of the same signature (jax only)."""
