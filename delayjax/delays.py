"""Where delays come from (1): per-update delay models.

A delay model draws, for update (or call) ``t``, a delay ``d_t`` in
``{0, ..., max_delay}``. Models are small frozen objects; ``sample(key, step)``
is a pure JAX function (jittable, usable inside ``lax.scan`` and ``vmap``), and
the same ``key`` and ``step`` always give the same delay. ``max_delay`` is a
static Python int that sizes every buffer built on the model. ``pmf()`` gives
the exact distribution of one draw, for tests and summaries.

How the delay is realized depends on the consumer (see ``dj.delayed`` and
``dj.simulate``): on the *apply* side (the gradient of call ``t`` is applied at
call ``t + d_t``) or on the *read* side (update ``t`` uses a gradient computed
at version ``t - d_t``). For ``constant`` delays the two coincide.

Example::

  >>> import jax
  >>> import delayjax as dj
  >>> model = dj.delays.uniform(4)
  >>> int(model.sample(jax.random.key(0), 7)) in range(5)
  True
"""

from __future__ import annotations

import abc
import dataclasses
import re
from typing import Any, Callable, ClassVar, Mapping, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from delayjax._checks import check_float, check_int
from delayjax._memory import available_memory, check_fits

__all__ = [
    "DelayModel", "Constant", "Uniform", "Geometric", "Categorical", "Trace", "PerLeaf", "Torn",
    "constant", "uniform", "geometric", "categorical", "trace", "per_leaf", "torn", "by_path", "path_name",
    "leaf_models", "sample_for", "MAX_DELAY",
]

# Delays, and the max_delay + 1 slots a buffer needs for them, are int32 in the traced code (steps, versions,
# ring indices): a larger one would wrap around to another delay instead of failing.
MAX_DELAY = 2**31 - 2


def _check_delay(name: str, value: Any) -> int:
  """``value`` as a Python int in ``[0, MAX_DELAY]``, or a TypeError / ValueError naming ``name``."""
  value = check_int(name, value, minimum=0)
  if value > MAX_DELAY:
    raise ValueError(f"{name} must be an integer in [0, 2**31 - 2 = {MAX_DELAY}] (delays and the max_delay + 1 "
                     f"buffer slots they need are int32), got {value}.")
  return value


def _pmf_zeros(model: Any, size: int) -> np.ndarray:
  """float64 zeros ``[size]`` for a ``pmf``, refused by name when they cannot fit in memory."""
  check_fits(f"{model!r}.pmf(): its table of {size} probabilities", 8 * size, available_memory())
  return np.zeros(size)


def _numbers(name: str, values: Any, what: str) -> np.ndarray:
  """``values`` as a 1-D NumPy array of real numbers (not booleans, strings or objects), or an error naming ``name``."""
  try:
    array = None if values is None or isinstance(values, (str, bytes)) else np.asarray(values)
  except (ValueError, TypeError) as error:
    raise TypeError(f"{name} must be a non-empty 1-D sequence of {what}, got {values!r} ({error}).") from None
  if array is None or array.ndim == 0:
    raise TypeError(f"{name} must be a non-empty 1-D sequence of {what}, got {values!r} of type "
                    f"{type(values).__name__}.")
  if array.ndim != 1 or array.shape[0] < 1:
    raise ValueError(f"{name} must be a non-empty 1-D sequence, got shape {array.shape}.")
  if array.dtype.kind not in "iuf":
    raise TypeError(f"{name} must hold {what}, got entries of dtype {array.dtype} (e.g. {array.tolist()[0]!r}); booleans "
                    f"and strings are not numbers here.")
  return array


class DelayModel(abc.ABC):
  """A distribution of integer delays in ``{0, ..., max_delay}``."""

  # The integer fields a compiled draw may take as arguments, with ``_sample_with(key, step, *values)`` the draw
  # ``sample`` makes with them (in integers only): ``dj.simulate`` then compiles one draw for every model of the
  # class, e.g. for each bound of a sweep over ``uniform(s)``, where it would compile one per model (``constant``'s
  # and ``uniform``'s own delays are drawn on the host with Threefry keys, compiling nothing).
  _drawn_with: ClassVar[tuple[str, ...]] = ()

  @property
  @abc.abstractmethod
  def max_delay(self) -> int:
    """The largest delay the model can draw (a static Python int)."""

  @abc.abstractmethod
  def sample(self, key: jax.Array, step: Any) -> jax.Array:
    """Draws the delay of update ``step`` as an int32 scalar."""

  @abc.abstractmethod
  def pmf(self) -> np.ndarray:
    """float64 ``[max_delay + 1]``: the probability of each delay for one draw."""

  @property
  def is_constant(self) -> bool:
    """Whether every draw gives the same delay (so one gradient is released per call)."""
    return False

  def mean(self) -> float:
    """The expected delay of one draw."""
    p = self.pmf()
    return float(np.dot(np.arange(p.shape[0]), p))


@dataclasses.dataclass(frozen=True)
class Constant(DelayModel):
  """Every update has delay ``tau``."""

  tau: int

  def __post_init__(self):
    object.__setattr__(self, "tau", _check_delay("tau", self.tau))

  @property
  def max_delay(self) -> int:
    return int(self.tau)

  @property
  def is_constant(self) -> bool:
    return True

  _drawn_with = ("tau",)

  @staticmethod
  def _sample_with(key, step, tau):
    del key, step
    return jnp.asarray(tau, jnp.int32)

  def sample(self, key, step):
    return self._sample_with(key, step, self.tau)

  def pmf(self):
    p = _pmf_zeros(self, self.tau + 1)
    p[self.tau] = 1.0
    return p

  def mean(self) -> float:
    return float(self.tau)


@dataclasses.dataclass(frozen=True)
class Categorical(DelayModel):
  """Delay ``k`` with probability ``probs[k]``, independently for each update."""

  probs: tuple[float, ...]

  def __post_init__(self):
    probs = _numbers("probs", self.probs, "probabilities").astype(np.float64)
    if probs.shape[0] > MAX_DELAY + 1:
      raise ValueError(f"probs must have at most 2**31 - 1 = {MAX_DELAY + 1} entries (delays are int32), got "
                       f"{probs.shape[0]}.")
    if not np.all(np.isfinite(probs)) or np.any(probs < 0) or probs.sum() <= 0:
      raise ValueError(f"probs must be finite, non-negative and not all zero, got {probs.tolist()}.")
    nonzero = np.flatnonzero(probs)
    probs = probs[: nonzero[-1] + 1] / probs.sum()
    object.__setattr__(self, "probs", tuple(probs.tolist()))

  @property
  def max_delay(self) -> int:
    return len(self.probs) - 1

  def sample(self, key, step):
    del step
    with np.errstate(divide="ignore"):
      logits = np.log(np.asarray(self.probs))
    return jax.random.categorical(key, jnp.asarray(logits, jnp.float32)).astype(jnp.int32)

  def pmf(self):
    return np.asarray(self.probs)


@dataclasses.dataclass(frozen=True)
class Uniform(DelayModel):
  """Delay uniform on ``{0, ..., s}`` with ``s = max_delay`` (the SSP-style bound of Dai et al. 2019)."""

  s: int

  def __post_init__(self):
    object.__setattr__(self, "s", _check_delay("max_delay", self.s))

  @property
  def max_delay(self) -> int:
    return int(self.s)

  @property
  def is_constant(self) -> bool:
    return self.s == 0

  _drawn_with = ("s",)

  @staticmethod
  def _sample_with(key, step, s):
    del step
    return jax.random.randint(key, (), 0, s + 1, dtype=jnp.int32)

  def sample(self, key, step):
    return self._sample_with(key, step, self.s)

  def pmf(self):
    p = _pmf_zeros(self, self.s + 1)
    p[:] = 1.0 / (self.s + 1)
    return p

  def mean(self) -> float:
    return 0.5 * self.s


@dataclasses.dataclass(frozen=True)
class Geometric(Categorical):
  """A geometric delay truncated at ``max_delay``: ``P(k) ∝ p (1 - p)^k`` for ``k = 0..max_delay``.

  The mass beyond ``max_delay`` is removed and the rest renormalized (it is not
  piled onto ``max_delay``).
  """

  def __init__(self, p: float, max_delay: int):
    p = check_float("p", p, minimum=0.0, maximum=1.0, strict_minimum=True)
    max_delay = _check_delay("max_delay", max_delay)
    object.__setattr__(self, "p", p)
    # The table is built in blocks and stops at the first block that ends in 0: p (1 - p)^k only decreases,
    # so the rest has underflowed (those delays cannot be drawn). What is kept is allocated twice (float64 here,
    # Python floats in the tuple), so it is sized as it grows: a max_delay that cannot fit is refused by name.
    block, parts, available = 1 << 20, [], available_memory()
    for start in range(0, max_delay + 1, block):
      k = np.arange(start, min(start + block, max_delay + 1))
      parts.append(p * (1.0 - p) ** k)
      check_fits(f"geometric(p={p}, max_delay={max_delay}): its table of at least {start + k.shape[0]} "
                 "probabilities", 48 * (start + k.shape[0]), available)
      if parts[-1][-1] == 0:
        break
    probs = np.concatenate(parts)
    super().__init__(tuple(probs.tolist()))
    # A tiny p can underflow the tail: keep the declared bound either way.
    object.__setattr__(self, "_max_delay", max_delay)

  @property
  def max_delay(self) -> int:
    return self._max_delay

  def pmf(self):
    p = _pmf_zeros(self, self._max_delay + 1)
    p[: len(self.probs)] = self.probs
    return p

  def __repr__(self):
    return f"Geometric(p={self.p}, max_delay={self._max_delay})"


@dataclasses.dataclass(frozen=True)
class Trace(DelayModel):
  """Replays a logged delay sequence: update ``t`` gets ``delays[t mod len(delays)]``.

  At the end of the trace it cycles back to the start (a finite log stands for a
  stationary process); use a trace at least as long as the run to replay it
  once.
  """

  delays: tuple[int, ...]

  def __post_init__(self):
    delays = _numbers("delays", self.delays, "integers")
    if not np.issubdtype(delays.dtype, np.integer):
      if not np.all(np.isfinite(delays)) or np.any(delays != np.round(delays)):
        bad = delays[~np.isfinite(delays) | (delays != np.round(delays))][0]
        raise ValueError(f"delays must be integers (finite, without a fractional part), got {bad.item()!r}.")
    if np.any(delays < 0):
      raise ValueError(f"delays must be >= 0, got a minimum of {delays.min()}.")
    if np.any(delays > MAX_DELAY):
      raise ValueError(f"delays must be integers in [0, 2**31 - 2 = {MAX_DELAY}] (delays and the max_delay + 1 "
                       f"buffer slots they need are int32), got {delays.max().item()}.")
    object.__setattr__(self, "delays", tuple(int(x) for x in delays))

  @property
  def max_delay(self) -> int:
    return max(self.delays)

  @property
  def is_constant(self) -> bool:
    return len(set(self.delays)) == 1

  def sample(self, key, step):
    del key
    if not isinstance(step, jax.core.Tracer):
      # A concrete step is checked: a float would be truncated and a negative one would wrap to the end.
      if isinstance(step, bool) or not np.issubdtype(np.asarray(step).dtype, np.integer) or np.ndim(step) != 0:
        raise TypeError(f"step must be an integer scalar (the update index), got {step!r}.")
      if not 0 <= int(step) <= np.iinfo(np.int32).max:
        raise ValueError(f"step must be in [0, 2**31 - 1] (the update index, int32), got {int(step)}.")
    table = jnp.asarray(self.delays, jnp.int32)
    return table[jnp.asarray(step, jnp.int32) % table.shape[0]]

  def pmf(self):
    return np.bincount(np.asarray(self.delays), minlength=self.max_delay + 1) / len(self.delays)


def _is_model(x: Any) -> bool:
  return isinstance(x, DelayModel)


@dataclasses.dataclass(frozen=True)
class PerLeaf(DelayModel):
  """A pytree of delay models, one per leaf (or per subtree) of the parameters: layer-wise staleness.

  ``sample`` returns a pytree of int32 delays with the structure of ``models``;
  leaves are drawn independently (each with its own key, folded from the one
  given). Use :func:`leaf_models` to broadcast it against a parameter tree.
  """

  models: Any

  def __post_init__(self):
    leaves = jax.tree.leaves(self.models, is_leaf=_is_model)
    if not leaves:
      raise ValueError("per_leaf needs at least one delay model, got an empty tree.")
    for leaf in leaves:
      if not _is_model(leaf) or isinstance(leaf, PerLeaf):
        raise TypeError(
            f"per_leaf expects a pytree whose leaves are delay models (constant, uniform, ...), "
            f"got a leaf {leaf!r}.")

  @property
  def max_delay(self) -> int:
    return max(m.max_delay for m in jax.tree.leaves(self.models, is_leaf=_is_model))

  @property
  def is_constant(self) -> bool:
    return all(m.is_constant for m in jax.tree.leaves(self.models, is_leaf=_is_model))

  def sample(self, key, step):
    leaves, treedef = jax.tree.flatten(self.models, is_leaf=_is_model)
    draws = [m.sample(jax.random.fold_in(key, i), step) for i, m in enumerate(leaves)]
    return jax.tree.unflatten(treedef, draws)

  def pmf(self):
    raise NotImplementedError("a PerLeaf model has one distribution per leaf: call pmf() on its leaves.")

  def mean(self):
    raise NotImplementedError("a PerLeaf model has one distribution per leaf: call mean() on its leaves.")


def block_ids(shapes: Sequence[tuple[int, ...]], block_size: int) -> list[np.ndarray]:
  """int32 arrays, one per shape: each coordinate's block, ``block_size`` consecutive coordinates of a leaf
  flattened row-major (the last block of a leaf shorter), numbered across the leaves in order."""
  ids, start = [], 0
  for shape in shapes:
    size = int(np.prod(shape, dtype=np.int64))
    ids.append((start + np.arange(size, dtype=np.int64) // block_size).astype(np.int32).reshape(shape))
    start += -(-size // block_size)
  return ids


@dataclasses.dataclass(frozen=True)
class Torn(DelayModel):
  r"""Torn (inconsistent) reads: each block of coordinates of the parameters has its own delay.

  Made by :func:`torn`, which says the rule. ``sample(key, step)`` draws one
  delay per block, int32 ``[num_blocks]``, block ``b`` from ``model`` with the
  key ``fold_in(key, b)`` (blocks independent, as the leaves of ``per_leaf``);
  :func:`sample_for` spreads them over the coordinates, a pytree like the
  parameters. ``pmf()`` and ``mean()`` are one block's.
  """

  model: DelayModel
  block_size: int
  structure: Any  # the parameters' treedef
  shapes: tuple[tuple[int, ...], ...]  # each leaf's shape, in the treedef's order

  def __post_init__(self):
    if not _is_model(self.model) or isinstance(self.model, (PerLeaf, Torn)):
      raise TypeError(f"torn: model must be one delay model from delayjax.delays (constant, uniform, geometric, "
                      f"categorical, trace), not a per_leaf or torn one; got {self.model!r}.")
    object.__setattr__(self, "block_size", check_int("block_size", self.block_size, minimum=1))
    if not self.shapes:
      raise ValueError("torn: params must have at least one array leaf, got an empty tree.")

  @property
  def max_delay(self) -> int:
    return self.model.max_delay

  @property
  def is_constant(self) -> bool:
    return self.model.is_constant

  @property
  def num_blocks(self) -> int:
    """The number of blocks over all leaves, ``ceil(leaf size / block_size)`` per leaf, none spanning two leaves."""
    return sum(-(-int(np.prod(shape, dtype=np.int64)) // self.block_size) for shape in self.shapes)

  def block_ids(self) -> list[np.ndarray]:
    """int32 arrays, one per leaf with its shape: the block of each coordinate (row-major, numbered across
    leaves in the treedef's order)."""
    return block_ids(self.shapes, self.block_size)

  def check_params(self, params: Any, name: str = "params") -> None:
    """Raises a ValueError naming ``name`` when ``params``'s tree or a leaf's shape is not the one ``torn`` was
    made for."""
    structure = jax.tree.structure(params)
    shapes = tuple(tuple(np.shape(x)) for x in jax.tree.leaves(params))
    if structure != self.structure or shapes != self.shapes:
      raise ValueError(
          f"{name} must have the tree and leaf shapes the torn read model was made for ({self.structure}, shapes "
          f"{list(self.shapes)}); got {structure}, shapes {list(shapes)}. Make it with dj.delays.torn(params, ...) "
          f"of these parameters.")

  def sample(self, key, step):
    blocks = jnp.arange(self.num_blocks, dtype=jnp.uint32)
    return jax.vmap(lambda b: self.model.sample(jax.random.fold_in(key, b), step))(blocks).astype(jnp.int32)

  def pmf(self):
    return self.model.pmf()

  def mean(self) -> float:
    return self.model.mean()

  def __repr__(self):
    return f"Torn({self.model!r}, block_size={self.block_size}, num_blocks={self.num_blocks})"


def constant(tau: int) -> Constant:
  """Every update has delay ``tau`` (``tau = 0`` is synchronous)."""
  return Constant(tau)


def uniform(max_delay: int) -> Uniform:
  """Delay uniform on ``{0, ..., max_delay}``, independently per update."""
  return Uniform(max_delay)


def geometric(p: float, max_delay: int) -> Geometric:
  """Delay ``k`` with probability proportional to ``p (1 - p)^k``, truncated at ``max_delay``."""
  return Geometric(p, max_delay)


def categorical(probs: Sequence[float]) -> Categorical:
  """Delay ``k`` with probability ``probs[k] / sum(probs)``, e.g. a measured delay histogram."""
  return Categorical(tuple(_numbers("probs", probs, "probabilities").tolist()))


def trace(delays: Sequence[int]) -> Trace:
  """Replays logged delays in order, cycling at the end."""
  return Trace(tuple(_numbers("delays", delays, "integers").tolist()))


def per_leaf(models: Any) -> PerLeaf:
  """Per-leaf delays: a pytree of models matching (a prefix of) the parameter tree."""
  return PerLeaf(models)


def torn(params: Any, model: DelayModel | int, block_size: int = 1) -> Torn:
  r"""Torn (inconsistent) reads: each coordinate, or block of ``block_size`` coordinates, read at its own version.

  Lock-free shared-memory SGD (Hogwild!) reads the parameters one coordinate
  at a time while other threads write them, so one read mixes versions. With
  this model as ``dj.simulate``'s source, update :math:`t` computes its
  gradient at :math:`	ilde w_t` with

  .. math::

    (	ilde w_t)_i = (w_{\max(0,\, t - d_{t,b(i)})})_i, \qquad d_{t,b} \sim 	ext{model}
    	ext{ independently per block } b,

  :math:`b(i)` the block of coordinate :math:`i`: each leaf flattened
  row-major and cut into blocks of ``block_size`` (the last one shorter; a
  block never spans two leaves). Delays are bounded by ``model.max_delay``
  (the paper's :math:`	au`), and are drawn per update and block from the
  seed, the same for the same seed. ``block_size`` at least a leaf's size
  gives each leaf one version (``per_leaf`` with one model); all blocks'
  delays equal (``constant``) is the consistent read, bit for bit. The
  transformation is given ``staleness``, the update's largest delay (an int32
  scalar), and ``stale_params``, the torn read itself.

  Each block is a read of the parameters' version stored for it, so a run
  costs ``num_blocks`` stores per update: meant for small models (a quadratic,
  a linear model) or coarse blocks.

  **Only the abstract of the paper could be read here**: the read model is
  the library's construction of the one it describes (lock-free SGD whose
  reads mix versions, with a maximum delay); independent delays per block
  stand in for the paper's adversarial scheduler.

  Args:
    params: the parameters (their tree and shapes fix the blocks).
    model: each block's delay model (not ``per_leaf`` or ``torn``), or an
      integer delay (``constant``).
    block_size: coordinates per block, >= 1.

  Returns:
    A :class:`Torn` model for ``dj.simulate``; ``dj.delayed`` (apply-side
    delays) refuses it.

  Raises:
    TypeError, ValueError: a model that is not one, a ``block_size`` below 1,
      parameters without an array leaf; ``dj.simulate`` with parameters of
      another tree or shapes.

  Examples:
    >>> import jax.numpy as jnp
    >>> import delayjax as dj
    >>> model = dj.delays.torn({"w": jnp.zeros((2, 3)), "b": jnp.zeros(3)}, dj.delays.uniform(4), block_size=2)
    >>> model.num_blocks, model.max_delay
    (5, 4)

  References:
    Alistarh, De Sa, Konstantinov, `The Convergence of Stochastic Gradient
    Descent in Asynchronous Shared Memory <https://arxiv.org/abs/1803.08841>`_,
    PODC 2018 (reads whose coordinates come from different versions, each at
    most :math:`	au` updates old).
  """
  model = _as_model("model", model)
  leaves = jax.tree.leaves(params)
  return Torn(model, block_size, jax.tree.structure(params), tuple(tuple(np.shape(x)) for x in leaves))


def path_name(path: Sequence[Any]) -> str:
  """A key path (``jax.tree_util.tree_leaves_with_path``) as ``"blocks/0/attn/w"``: keys, attributes and
  indices joined by ``/``, the form :func:`by_path`'s patterns are matched against."""
  parts = []
  for key in path:
    for field in ("key", "name", "idx"):
      if hasattr(key, field):
        parts.append(str(getattr(key, field)))
        break
    else:
      parts.append(str(key))
  return "/".join(parts)


def _as_model(name: str, value: Any) -> DelayModel:
  if _is_model(value):
    if isinstance(value, PerLeaf):
      raise TypeError(f"{name} must be one delay model or an integer delay, not a per_leaf tree, got {value!r}.")
    return value
  if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
    raise TypeError(f"{name} must be an integer delay >= 0 or a delay model from delayjax.delays, got {value!r}.")
  return Constant(_check_delay(name, int(value)))


def by_path(tree: Any, rules: Mapping[str, Any] | Sequence[tuple[str, Any]] | Callable[[str], Any],
            default: Any = 0) -> Any:
  r"""One delay model per leaf of ``tree``, chosen from the leaf's path: the tree :func:`per_leaf` takes.

  A leaf's path is written as :func:`path_name` writes it (``"blocks/0/attn/w"``
  for ``params["blocks"][0]["attn"]["w"]``). ``rules`` is either

  - regular expressions and delays, ``{pattern: delay}`` or ``[(pattern, delay), ...]``:
    the first pattern that ``re.search`` finds in the path gives the leaf's
    delay, ``default`` when none does; or
  - a function of the path string returning the delay (as marin's
    ``grug_stage_tau`` computes a per-stage profile: the first pipeline stage
    stalest, the last fresh).

  A delay is an integer (``constant(d)``) or a delay model.

  Args:
    tree: the parameters (only their structure and paths are used).
    rules: patterns and delays, or a function of the path.
    default: the delay of a leaf no pattern matches.

  Returns:
    A pytree like ``tree`` of delay models; ``per_leaf(by_path(...))`` is the
    model for ``dj.delayed``, ``dj.simulate`` and ``dj.weight_prediction``.

  Raises:
    TypeError, ValueError: a rule that is not a pattern and a delay, a pattern
      that does not compile, or a delay that is not an integer >= 0 or a model.

  Examples:
    >>> import jax.numpy as jnp
    >>> import delayjax as dj
    >>> params = {"embed": jnp.zeros(4), "blocks": [{"w": jnp.zeros(2)}, {"w": jnp.zeros(2)}], "head": jnp.zeros(3)}
    >>> tree = dj.delays.by_path(params, {r"^embed": 3, r"^blocks/0/": 2, r"^blocks/1/": 1})
    >>> tree["embed"], tree["blocks"][1]["w"], tree["head"]
    (Constant(tau=3), Constant(tau=1), Constant(tau=0))
  """
  default = _as_model("default", default)
  if callable(rules) and not isinstance(rules, Mapping):
    def choose(name: str) -> DelayModel:
      return _as_model(f"the delay rules({name!r}) returned", rules(name))
  else:
    pairs = list(rules.items()) if isinstance(rules, Mapping) else list(rules)
    compiled = []
    for i, pair in enumerate(pairs):
      if not (isinstance(pair, tuple) and len(pair) == 2 and isinstance(pair[0], str)):
        raise TypeError(f"rules must map regular expressions (str) to delays, or be a function of the path; "
                        f"rule {i} is {pair!r}.")
      try:
        pattern = re.compile(pair[0])
      except re.error as e:
        raise ValueError(f"rules: pattern {pair[0]!r} is not a regular expression: {e}.") from None
      compiled.append((pattern, _as_model(f"the delay of pattern {pair[0]!r}", pair[1])))

    def choose(name: str) -> DelayModel:
      return next((model for pattern, model in compiled if pattern.search(name)), default)

  return jax.tree_util.tree_map_with_path(lambda path, _: choose(path_name(path)), tree)


def leaf_models(model: DelayModel, tree: Any) -> Any:
  """Broadcasts ``model`` to one delay model per leaf of ``tree``.

  A plain model is shared by every leaf (one draw per update); a ``PerLeaf``
  model's tree must be a prefix of ``tree``.

  Raises:
    TypeError: if ``model`` is not a delay model.
    ValueError: if a ``PerLeaf`` tree does not match ``tree``.
  """
  if not _is_model(model):
    raise TypeError(f"delays must be a delay model from delayjax.delays, got {model!r}.")
  if not isinstance(model, PerLeaf):
    return jax.tree.map(lambda _: model, tree)
  try:
    return jax.tree.map(lambda m, sub: jax.tree.map(lambda _: m, sub), model.models, tree,
                        is_leaf=_is_model)
  except ValueError as e:
    raise ValueError(
        f"the per-leaf delay tree {jax.tree.structure(model.models, is_leaf=_is_model)} is not a "
        f"prefix of the parameter tree {jax.tree.structure(tree)}: {e}") from None


def check_model(name: str, model: Any) -> DelayModel:
  """Returns ``model`` if it is a delay model, or raises a TypeError naming ``name``."""
  if not _is_model(model):
    raise TypeError(
        f"{name} must be a delay model from delayjax.delays (constant, uniform, geometric, "
        f"categorical, trace, per_leaf), got {model!r}.")
  return model


def sample_for(model: DelayModel, key: jax.Array, step: Any, tree: Any) -> Any:
  """Draws the delay of ``step`` for the parameters ``tree``.

  Returns an int32 scalar for a plain model, and for a ``PerLeaf`` model a
  pytree of int32 scalars with the structure of ``tree``, each leaf carrying
  the draw of the model that covers it (leaves under one model share its
  draw: a layer's weights and biases are equally stale). For a ``Torn``
  model, a pytree like ``tree`` of int32 arrays of the leaves' shapes: each
  coordinate's delay, its block's draw.
  """
  model = check_model("model", model)
  if isinstance(model, Torn):
    model.check_params(tree, "tree")
    draws = model.sample(key, step)
    return jax.tree.unflatten(model.structure, [draws[ids] for ids in model.block_ids()])
  if not isinstance(model, PerLeaf):
    return model.sample(key, step)
  draws = model.sample(key, step)
  return jax.tree.map(lambda d, sub: jax.tree.map(lambda _: d, sub), draws, tree)
