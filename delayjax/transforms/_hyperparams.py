"""Learning rates that may be floats, schedules, or arrays injected by ``optax.inject_hyperparams``."""

from __future__ import annotations

from typing import Any, Callable, Union

import jax
import jax.numpy as jnp
import numpy as np

from delayjax._checks import check_float

LearningRate = Union[float, jax.Array, Callable[[jax.Array], jax.Array]]


def check_positive_rate(name: str, value: Any) -> Any:
  """A float > 0, a schedule, or a scalar array; a traced value cannot be checked and passes as is."""
  if callable(value) or isinstance(value, jax.core.Tracer):
    return value
  if isinstance(value, (jax.Array, np.ndarray, np.generic)):
    if np.ndim(value) != 0:
      raise ValueError(f"{name} must be a scalar, got shape {np.shape(value)}.")
    value = float(value)
  return check_float(name, value, minimum=0.0, strict_minimum=True)


def rate_at(learning_rate: LearningRate, count: jax.Array) -> Any:
  """The learning rate of the update with index ``count``."""
  return learning_rate(count) if callable(learning_rate) else learning_rate


def descend(step: Any, update: jax.Array) -> jax.Array:
  """``-step * update`` in the update's dtype, with Optax's arithmetic.

  A Python float multiplies as in ``optax.scale(-lr)``; an array (a schedule's
  value, an injected hyper-parameter) is cast to the update's dtype first, as
  ``optax.scale_by_schedule`` does.
  """
  if isinstance(step, float):
    return -step * update
  return jnp.asarray(-step, update.dtype) * update
