"""Argument checks shared by every layer: each error names the argument, what was given and what is allowed."""

from __future__ import annotations

import math
import numbers
from typing import Any


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
  if maximum is not None and value > maximum:
    raise ValueError(f"{name} must be <= {maximum}, got {value}.")
  return value


def check_choice(name: str, value: Any, allowed: tuple[str, ...]) -> str:
  """Returns ``value`` if it is one of ``allowed``, or raises naming ``name``."""
  if value not in allowed:
    raise ValueError(f"{name} must be one of {', '.join(map(repr, allowed))}; got {value!r}.")
  return value
