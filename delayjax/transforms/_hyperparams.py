"""Hyper-parameters that may be Python numbers, arrays (``optax.inject_hyperparams``, ``jax.vmap``) or schedules.

Every numeric hyper-parameter of a delayjax transformation goes through
:func:`check_number`: a concrete value (a Python number or a concrete scalar
array) is checked and keeps its clear error; a traced one (the array that
``optax.inject_hyperparams`` passes inside ``jit``, or a ``jax.vmap`` sweep)
cannot be checked and is used as it is. Arithmetic on hyper-parameters casts
the coefficient to the dtype of what it multiplies, the way a Python float
would be, so a Python number and the same value as an array give the same
bits.
"""

from __future__ import annotations

from typing import Any, Callable, Union

import jax
import jax.numpy as jnp
import numpy as np

from delayjax._checks import check_float, check_int

LearningRate = Union[float, jax.Array, Callable[[jax.Array], jax.Array]]


def check_number(
    name: str,
    value: Any,
    *,
    minimum: float | None = None,
    maximum: float | None = None,
    strict_minimum: bool = False,
    strict_maximum: bool = False,
    integer: bool = False,
    schedule: bool = False,
) -> Any:
  """A numeric hyper-parameter, checked when concrete.

  Args:
    name: the argument's name, for errors.
    value: a Python number, a scalar NumPy or JAX array, or (with
      ``schedule``) a callable of the update count.
    minimum, maximum, strict_minimum, strict_maximum: bounds on a concrete
      value, as in :func:`delayjax._checks.check_float`.
    integer: the value must be a whole number, at most ``maximum`` (default
      ``2**31 - 1``: integer hyper-parameters meet int32 counts in the traced
      code, where a larger one would overflow or wrap around).
    schedule: a callable (an Optax schedule) is allowed.

  Returns:
    A Python number as a ``float`` (an ``int`` with ``integer``), an array
    or a schedule as given (a traced array is not checked).

  Raises:
    TypeError: for a value that is none of the above.
    ValueError: for an array that is not a scalar, or a concrete value out
      of bounds.
  """
  if callable(value):
    if schedule:
      return value
    raise TypeError(f"{name} must be a number or a scalar array (not a schedule), got {value!r}.")
  bounds = dict(minimum=minimum, maximum=maximum, strict_minimum=strict_minimum, strict_maximum=strict_maximum)
  if isinstance(value, (jax.Array, np.ndarray, np.generic)):
    if np.ndim(value) != 0:
      raise ValueError(f"{name} must be a scalar, got shape {np.shape(value)}.")
    dtype = np.dtype(value.dtype)
    if not (np.issubdtype(dtype, np.integer) or np.issubdtype(dtype, np.floating)):
      raise TypeError(f"{name} must be a real number, got an array of dtype {dtype}.")
    if isinstance(value, jax.core.Tracer):
      return value
    if integer:
      concrete = float(value) if np.issubdtype(dtype, np.floating) else value.item()
      if isinstance(concrete, float) and not concrete.is_integer():
        raise TypeError(f"{name} must be an integer, got {concrete!r}.")
      _check_integer(name, int(concrete), minimum, maximum)
    else:
      check_float(name, float(value), **bounds)
    return value
  if integer:
    return _check_integer(name, value, minimum, maximum)
  return check_float(name, value, **bounds)


INT32_MAX = 2**31 - 1


def _check_integer(name: str, value: Any, minimum: int | None, maximum: int | None) -> int:
  """``value`` as a Python int in ``[minimum, maximum]`` (``maximum`` default ``2**31 - 1``), or raises naming ``name``."""
  value = check_int(name, value, minimum=minimum)
  limit = INT32_MAX if maximum is None else maximum
  if value > limit:
    low = "" if minimum is None else f"[{minimum}, "
    shown = f"2**31 - 1 = {limit}" if maximum is None else str(limit)
    allowed = f"{low}{shown}]" if low else f"<= {shown}"
    why = " (it meets int32 counts in the traced code)" if maximum is None else ""
    raise ValueError(f"{name} must be an integer {'in ' if low else ''}{allowed}{why}, got {value}.")
  return value


def check_static_int(name: str, value: Any, *, minimum: int | None = None) -> int:
  """An integer that sizes the state (a number of workers, samples or slots): a Python int, never an array,
  at most ``2**31 - 1`` (it indexes int32 rows).

  ``optax.inject_hyperparams`` turns every number it is given into an array
  (traced inside ``jit``); such an argument must be named in its
  ``static_args``, which the error says.
  """
  if isinstance(value, jax.Array):
    raise TypeError(
        f"{name} must be a Python int (it sets the shapes of the optimizer state), got an array; with "
        f"optax.inject_hyperparams, pass static_args=({name!r},).")
  return _check_integer(name, value, minimum, None)


def check_positive_rate(name: str, value: Any) -> Any:
  """A learning rate: a number > 0, a scalar array, or a schedule (see :func:`check_number`)."""
  return check_number(name, value, minimum=0.0, strict_minimum=True, schedule=True)


def coefficient(value: Any, dtype: Any) -> jax.Array:
  """A hyper-parameter (or an expression of them) as a scalar of ``dtype``, as a Python float would be cast."""
  return jnp.asarray(value, dtype)


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
