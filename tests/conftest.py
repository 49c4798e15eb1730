"""Test set-up: 8 host CPU devices for multi-device tests, strict dtype promotion."""

import contextlib
import os

# Must be set before JAX initializes its backends.
os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8").strip()

import jax  # noqa: E402
import pytest  # noqa: E402

# Silent float64/float32 or int/float mixes are bugs in a library; make them fail in tests.
jax.config.update("jax_numpy_dtype_promotion", "strict")


def pytest_configure(config):
  config.addinivalue_line(
      "markers",
      "standard_promotion: the test runs third-party code that is not strict-promotion clean (e.g. "
      "optax.adam's bias correction mixes float and int32)")


@pytest.fixture(autouse=True)
def _promotion_mode(request):
  marked = request.node.get_closest_marker("standard_promotion") is not None
  with jax.numpy_dtype_promotion("standard") if marked else contextlib.nullcontext():
    yield
