"""Custom Pallas kernels, each with a plain-jnp reference of the same signature. Imports only jax."""
