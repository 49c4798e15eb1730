"""Time models: distributions of the seconds one gradient takes to compute or to communicate.

Each model is a small frozen object with a ``mean`` and a ``sample(rng, size)``
that draws non-negative float64 seconds from a ``numpy.random.Generator``.
A latency (``comm``) may be 0; a compute time may not: ``dj.cluster.workers``
refuses a compute model that draws only 0 (a constant ``<= 0``, a uniform
with ``high = 0``), and the compute times it draws are strictly positive
(exponential, gamma and log-normal draws are, with their factories'
positive parameters; a draw of exactly 0, of probability zero, is taken as
the smallest positive float).
Models are parametrized by their mean so that swapping one for another keeps
the cluster's average speed. ``as_time_model`` turns the short forms users
write (a name, a number) into a model.
"""

from __future__ import annotations

import abc
import dataclasses
import math
from typing import Any, Union

import numpy as np

from delayjax._checks import check_float

__all__ = [
    "TimeModel", "Constant", "Uniform", "Exponential", "Gamma", "LogNormal",
    "constant", "uniform", "exponential", "gamma", "lognormal", "as_time_model", "TIME_MODEL_NAMES",
]


class TimeModel(abc.ABC):
  """A distribution of non-negative durations in simulated seconds."""

  @property
  @abc.abstractmethod
  def mean(self) -> float:
    """The expected duration of one draw."""

  @abc.abstractmethod
  def sample(self, rng: np.random.Generator, size: Any) -> np.ndarray:
    """Draws float64 durations of shape ``size``."""


@dataclasses.dataclass(frozen=True)
class Constant(TimeModel):
  """Every draw is ``value`` seconds."""

  value: float

  def __post_init__(self):
    check_float("value", self.value, minimum=0.0)

  @property
  def mean(self) -> float:
    return float(self.value)

  def sample(self, rng: np.random.Generator, size: Any) -> np.ndarray:
    del rng
    return np.full(size, float(self.value), np.float64)


@dataclasses.dataclass(frozen=True)
class Uniform(TimeModel):
  """Draws uniformly in ``[low, high)``."""

  low: float
  high: float

  def __post_init__(self):
    low = check_float("low", self.low, minimum=0.0)
    high = check_float("high", self.high, minimum=0.0)
    if high < low:
      raise ValueError(f"high must be >= low, got low={low}, high={high}.")

  @property
  def mean(self) -> float:
    return 0.5 * (float(self.low) + float(self.high))

  def sample(self, rng: np.random.Generator, size: Any) -> np.ndarray:
    return rng.uniform(float(self.low), float(self.high), size)


@dataclasses.dataclass(frozen=True)
class Exponential(TimeModel):
  """Exponential durations with the given mean (memoryless: the usual straggler-free model)."""

  scale: float = 1.0

  def __post_init__(self):
    check_float("mean", self.scale, minimum=0.0, strict_minimum=True)

  @property
  def mean(self) -> float:
    return float(self.scale)

  def sample(self, rng: np.random.Generator, size: Any) -> np.ndarray:
    return rng.exponential(float(self.scale), size)


@dataclasses.dataclass(frozen=True)
class Gamma(TimeModel):
  """Gamma durations with shape ``k`` and the given mean (``k = 1`` is exponential; large ``k`` is tight)."""

  shape: float
  scale: float

  def __post_init__(self):
    check_float("shape", self.shape, minimum=0.0, strict_minimum=True)
    check_float("scale", self.scale, minimum=0.0, strict_minimum=True)

  @property
  def mean(self) -> float:
    return float(self.shape) * float(self.scale)

  def sample(self, rng: np.random.Generator, size: Any) -> np.ndarray:
    return rng.gamma(float(self.shape), float(self.scale), size)


@dataclasses.dataclass(frozen=True)
class LogNormal(TimeModel):
  """Log-normal durations: ``exp(N(mu, sigma^2))``, heavy-tailed like measured step times."""

  mu: float
  sigma: float

  def __post_init__(self):
    check_float("mu", self.mu)
    check_float("sigma", self.sigma, minimum=0.0)

  @property
  def mean(self) -> float:
    return math.exp(float(self.mu) + 0.5 * float(self.sigma) ** 2)

  def sample(self, rng: np.random.Generator, size: Any) -> np.ndarray:
    return rng.lognormal(float(self.mu), float(self.sigma), size)


def constant(value: float = 1.0) -> Constant:
  """Every gradient takes exactly ``value`` seconds."""
  return Constant(check_float("value", value, minimum=0.0))


def uniform(low: float = 0.5, high: float = 1.5) -> Uniform:
  """Durations uniform in ``[low, high)`` (default: mean 1)."""
  return Uniform(check_float("low", low, minimum=0.0), check_float("high", high, minimum=0.0))


def exponential(mean: float = 1.0) -> Exponential:
  """Exponential durations with the given ``mean`` (default 1 second)."""
  return Exponential(check_float("mean", mean, minimum=0.0, strict_minimum=True))


def gamma(shape: float = 2.0, mean: float = 1.0) -> Gamma:
  """Gamma durations with shape ``shape`` and mean ``mean`` (scale ``mean / shape``)."""
  shape = check_float("shape", shape, minimum=0.0, strict_minimum=True)
  mean = check_float("mean", mean, minimum=0.0, strict_minimum=True)
  return Gamma(shape, mean / shape)


def lognormal(mean: float = 1.0, sigma: float = 0.5) -> LogNormal:
  """Log-normal durations with mean ``mean`` and log-space standard deviation ``sigma``."""
  mean = check_float("mean", mean, minimum=0.0, strict_minimum=True)
  sigma = check_float("sigma", sigma, minimum=0.0)
  return LogNormal(math.log(mean) - 0.5 * sigma**2, sigma)


_FACTORIES = {
    "constant": constant, "uniform": uniform, "exponential": exponential,
    "gamma": gamma, "lognormal": lognormal,
}
TIME_MODEL_NAMES: tuple[str, ...] = tuple(_FACTORIES)

TimeModelLike = Union[TimeModel, str, float, int]


def as_time_model(name: str, value: Any) -> TimeModel:
  """Turns a model, a distribution name (default parameters) or a number of seconds into a model.

  Args:
    name: the argument name used in error messages.
    value: a ``TimeModel``; one of ``TIME_MODEL_NAMES`` (with the defaults of
      the factory of that name, e.g. ``"exponential"`` has mean 1); or a
      non-negative number of seconds (a constant).
  """
  if isinstance(value, TimeModel):
    return value
  if isinstance(value, str):
    if value not in _FACTORIES:
      raise ValueError(
          f"{name} must be a time model or one of {', '.join(map(repr, TIME_MODEL_NAMES))}; got {value!r}.")
    return _FACTORIES[value]()
  if isinstance(value, (int, float, np.integer, np.floating)) and not isinstance(value, bool):
    return Constant(check_float(name, value, minimum=0.0))
  raise TypeError(
      f"{name} must be a time model (e.g. dj.cluster.exponential(1.0)), a distribution name or a number "
      f"of seconds; got {value!r} of type {type(value).__name__}.")
