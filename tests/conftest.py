"""Test set-up: 8 host CPU devices for multi-device tests, strict dtype promotion."""

import os

# Must be set before JAX initializes its backends.
os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8").strip()

import jax  # noqa: E402

# Silent float64/float32 or int/float mixes are bugs in a library; make them fail in tests.
jax.config.update("jax_numpy_dtype_promotion", "strict")
