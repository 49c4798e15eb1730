"""Argument checks shared by every layer: each error names the argument, what was given and what is allowed."""

from __future__ import annotations

import math
import numbers
from typing import Any

import numpy as np


def check_int(name: str, value: Any, *, minimum: int | None = None) -> int:
  """Returns ``value`` as a Python int, or raises naming ``name``."""
  if isinstance(value, bool) or not isinstance(value, numbers.Integral):
    raise TypeError(f"{name} must be an integer, got {value!r} of type {type(value).__name__}.")
  value = int(value)
  if minimum is not None and value < minimum:
    raise ValueError(f"{name} must be an integer >= {minimum}, got {value}.")
  return value


def check_float(
    name: str,
    value: Any,
    *,
    minimum: float | None = None,
    maximum: float | None = None,
    strict_minimum: bool = False,
    strict_maximum: bool = False,
) -> float:
  """Returns ``value`` as a finite Python float within bounds, or raises naming ``name``."""
  if isinstance(value, bool) or not isinstance(value, numbers.Real):
    raise TypeError(f"{name} must be a real number, got {value!r} of type {type(value).__name__}.")
  value = float(value)
  if not math.isfinite(value):
    raise ValueError(f"{name} must be finite, got {value}.")
  if minimum is not None:
    if strict_minimum and value <= minimum:
      raise ValueError(f"{name} must be > {minimum}, got {value}.")
    if not strict_minimum and value < minimum:
      raise ValueError(f"{name} must be >= {minimum}, got {value}.")
  if maximum is not None:
    if strict_maximum and value >= maximum:
      raise ValueError(f"{name} must be < {maximum}, got {value}.")
    if not strict_maximum and value > maximum:
      raise ValueError(f"{name} must be <= {maximum}, got {value}.")
  return value


def check_choice(name: str, value: Any, allowed: tuple[str, ...]) -> str:
  """Returns ``value`` if it is one of ``allowed``, or raises naming ``name``."""
  if value not in allowed:
    raise ValueError(f"{name} must be one of {', '.join(map(repr, allowed))}; got {value!r}.")
  return value


def check_bool(name: str, value: Any) -> bool:
  """Returns ``value`` if it is a bool (``True``/``False``, NumPy's included), or raises naming ``name``.

  Strings such as ``"False"`` are refused: they are truthy, so taking them would do the opposite of what
  they say.
  """
  if not isinstance(value, (bool, np.bool_)):
    raise TypeError(f"{name} must be a bool, got {type(value).__name__} {value!r}.")
  return bool(value)


def check_seed(name: str, value: Any) -> int:
  """Returns ``value`` as an int in ``[0, 2**32)``, or raises naming ``name`` (no silent wrap-around)."""
  value = check_int(name, value, minimum=0)
  if value >= 2**32:
    raise ValueError(f"{name} must be an integer below 2**32 = {2**32}, got {value}.")
  return value


def check_number_array(expected: str, value: Any, kinds: str = "biuf") -> np.ndarray:
  """``value`` as a float64 array, or a TypeError saying ``expected`` (e.g. "w must be an array of numbers of
  shape [d]") and what was given, when it does not hold numbers of the dtype kinds ``kinds``."""
  if value is None or isinstance(value, (str, bytes, dict, set)):
    raise TypeError(f"{expected}, got {type(value).__name__} {value!r}.")
  try:
    array = np.asarray(value)
  except (TypeError, ValueError) as e:  # ragged nested sequences
    raise TypeError(f"{expected}, got {type(value).__name__} that is not an array ({e}).") from None
  if array.dtype.kind not in kinds:
    raise TypeError(f"{expected}, got {type(value).__name__} with entries of dtype {array.dtype}.")
  return array.astype(np.float64)
