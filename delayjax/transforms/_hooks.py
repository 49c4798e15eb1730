"""Hooks through which a transformation tells a runtime what it needs from the run.

Most transformations let workers read the current server parameters. Some
(DANA's look-ahead) send a worker other parameters. Such a transformation keeps
a state object with a ``read_params(params, worker)`` method; the runtimes find
it anywhere inside an optimizer state (through ``optax.chain``,
``inject_hyperparams``, ``MultiSteps`` and ``dj.delayed``) with
:func:`read_params`. The same way, :func:`runtime_inputs` finds the extra
arguments a transformation asks the runtime to compute,
:func:`worker_capacity` the number of workers its per-worker tables hold, and
:func:`check_schedule` whether a run is long and fresh enough for it.

Worker indices out of range. A transformation with per-worker rows (``dj.dana``,
``dj.dana_slim``, ``dj.delay_compensation(adaptive=True, num_workers=M)``)
checks a concrete ``worker`` and raises a ``ValueError``. A traced one (inside
``jit`` or ``lax.scan``) cannot raise, and JAX's indexing would silently clamp
it to the last row; instead, a traced ``worker`` outside ``[0, M)`` makes every
leaf of the update NaN and leaves the tables unchanged, so that the runtimes'
non-finite report (or a NaN in the parameters of a hand-written loop) names the
update. The runtimes avoid it in the first place: they compare the schedule's
number of workers with :func:`worker_capacity` before compiling anything.
"""

from __future__ import annotations

import warnings
from typing import Any, Protocol, runtime_checkable

import jax

from delayjax._checks import check_int


@runtime_checkable
class ReadsParams(Protocol):
  """An optimizer state that defines the parameters a worker reads."""

  def read_params(self, params: Any, worker: Any) -> Any:
    ...


def _defines_read(x: Any) -> bool:
  return isinstance(x, ReadsParams) and not isinstance(x, type)


def _reading_states(opt_state: Any) -> list[Any]:
  """The states inside ``opt_state`` that define ``read_params``."""
  return [x for x in jax.tree.leaves(opt_state, is_leaf=_defines_read) if _defines_read(x)]


def defines_read(opt_state: Any) -> bool:
  """Whether a state inside ``opt_state`` defines ``read_params`` (otherwise workers read the parameters)."""
  return bool(_reading_states(opt_state))


def read_params(opt_state: Any, params: Any, worker: Any = 0) -> Any:
  """The parameters a worker should compute its next gradient at.

  Args:
    opt_state: an optimizer state, possibly nested (chains, wrappers).
    params: the current server parameters.
    worker: the reading worker's index (an int32 scalar).

  Returns:
    ``params`` itself unless a state inside ``opt_state`` defines
    ``read_params``, in which case that state's answer.

  Raises:
    ValueError: if more than one state inside ``opt_state`` defines it.
  """
  found = _reading_states(opt_state)
  if len(found) > 1:
    raise ValueError(
        f"at most one transformation in a chain may define the parameters workers read, found "
        f"{len(found)}: {[type(x).__name__ for x in found]}.")
  return found[0].read_params(params, worker) if found else params


@runtime_checkable
class NeedsRuntimeInputs(Protocol):
  """An optimizer state whose transformation needs extra arguments the runtime must compute."""

  def runtime_inputs(self) -> tuple[str, ...]:
    ...


def _needs_inputs(x: Any) -> bool:
  return isinstance(x, NeedsRuntimeInputs) and not isinstance(x, type)


def runtime_inputs(opt_state: Any) -> tuple[str, ...]:
  """The extra arguments that transformations inside ``opt_state`` ask the runtime to compute.

  A transformation whose ``update`` needs an argument that only the runtime
  can compute (it needs the loss, the data or the server's parameters) keeps
  a state object with a ``runtime_inputs(self) -> tuple[str, ...]`` method
  naming those arguments; like ``read_params``, it is found anywhere inside an
  optimizer state (chains, ``inject_hyperparams``, ``MultiSteps``, wrappers),
  and here also inside another requesting state. ``dj.simulate`` computes
  each requested argument once per update and passes it, by name, to
  ``tx.update`` next to ``staleness``, ``stale_params`` and ``worker``; it
  rejects names it does not know. The names it computes today (``dj.simulate``
  documents each exactly):

  - ``"zeno_grad"``: the minibatch gradient of the loss at the server
    parameters the update is applied to, on the update's *server minibatch*,
    for Zeno++.
  - ``"full_grad"`` (with ``refresh``): the full-data gradient at the server
    parameters at the start of each SVRG epoch; ``"snapshot_grad"``: each
    contribution's minibatch gradient at the snapshot, which the requesting
    state gives through a ``snapshot_params()`` method (``dj.svrg``).
  - ``"sample_indices"``, ``"sample_grads"``, ``"sample_mask"``: the
    examples of the update's contributions, their per-example gradients at
    the parameters their workers read, and which entries count (``dj.saga``).
  - ``"contribution_grads"``, ``"contribution_staleness"``,
    ``"contribution_stale_params"``, ``"contribution_workers"``,
    ``"contribution_weights"``: each contribution of the update (stalest
    first) with its own gradient, staleness, stale parameters, worker and
    weight (its ``num_batches`` over the update's total; 0 for padding and
    skipped contributions), on a leading contribution axis
    (``dj.per_contribution``).

  A new input is added by giving it a name here and a computation in the
  runtime; transformations then request it the same way, and no runtime work
  is done for names nobody requests.

  Args:
    opt_state: an optimizer state, possibly nested.

  Returns:
    The requested names, sorted and without repeats (empty if none).
  """
  names: set[str] = set()
  for state in _requesting(opt_state):
    names.update(_requested(state))
  return tuple(sorted(names))


def _requesting(opt_state: Any) -> list[Any]:
  """Every state inside ``opt_state`` that requests runtime inputs, outermost first."""
  found: list[Any] = []

  def visit(x: Any) -> bool:
    # Called on every node while flattening, so nested requests are found too.
    if _needs_inputs(x):
      found.append(x)
    return False

  jax.tree.leaves(opt_state, is_leaf=visit)
  return found


def _requested(state: Any) -> tuple[str, ...]:
  requested = state.runtime_inputs()
  if isinstance(requested, str) or not all(isinstance(n, str) for n in requested):
    raise TypeError(
        f"{type(state).__name__}.runtime_inputs() must return a tuple of argument names (str), got "
        f"{requested!r}.")
  return tuple(requested)


def requesting_states(opt_state: Any, name: str) -> list[Any]:
  """The states inside ``opt_state`` that request the runtime input ``name``."""
  return [state for state in _requesting(opt_state) if name in _requested(state)]


@runtime_checkable
class HasWorkerRows(Protocol):
  """An optimizer state that keeps one row per worker, selected by the ``worker`` extra argument."""

  def worker_capacity(self) -> int | None:
    ...


def _has_rows(x: Any) -> bool:
  return isinstance(x, HasWorkerRows) and not isinstance(x, type)


def worker_capacity(opt_state: Any) -> int | None:
  """The number of workers the per-worker tables inside ``opt_state`` can hold.

  A transformation that keeps one row per worker (``dj.dana``,
  ``dj.dana_slim``, ``dj.delay_compensation`` with ``num_workers``) keeps a
  state object with a ``worker_capacity(self) -> int | None`` method giving
  its number of rows. Like :func:`read_params`, it is found anywhere inside an
  optimizer state (chains, ``inject_hyperparams``, ``MultiSteps``,
  ``dj.delayed``, other wrappers). A runtime that knows how many workers a
  schedule has refuses it before compiling when this is smaller: a traced
  ``worker`` past the table makes the update NaN (see the module docstring).

  Args:
    opt_state: an optimizer state as ``tx.init`` returns it (not stacked on
      a leading axis by ``jax.vmap``), possibly nested; abstract shapes
      (``jax.eval_shape(tx.init, params)``) are enough.

  Returns:
    The smallest number of rows of any per-worker table inside
    ``opt_state``, or ``None`` when there is no such table (any number of
    workers is fine).

  Examples:
    >>> import jax.numpy as jnp, optax
    >>> import delayjax as dj
    >>> tx = optax.chain(dj.delay_compensation(2.0, adaptive=True, num_workers=8), dj.dana(0.1, num_workers=4))
    >>> dj.worker_capacity(tx.init(jnp.zeros(3)))
    4
    >>> print(dj.worker_capacity(optax.sgd(0.1).init(jnp.zeros(3))))
    None
  """
  found: list[int] = []

  def visit(x: Any) -> bool:
    # Called on every node while flattening, so a table inside another state is found too.
    if _has_rows(x):
      rows = x.worker_capacity()
      if rows is not None:
        found.append(int(rows))
    return False

  jax.tree.leaves(opt_state, is_leaf=visit)
  return min(found) if found else None


def table_rows(table: Any) -> int | None:
  """The number of rows (leading axis) of a per-worker table, a pytree of ``[rows, ...]`` leaves."""
  leaves = jax.tree.leaves(table)
  return int(leaves[0].shape[0]) if leaves else None


@runtime_checkable
class CountsContributions(Protocol):
  """An optimizer state that takes one inner step every ``K`` contributions (``dj.fed_buff``, ``dj.accumulate_sum``)."""

  def contributions_per_step(self) -> tuple[str, str, int] | None:
    """``(the call, e.g. "dj.fed_buff(..., buffer_size=10)", the argument's name, K)``, or ``None`` if unknown."""
    ...


@runtime_checkable
class KeepsDelayWindow(Protocol):
  """An optimizer state that keeps the last ``D`` steps and gives a gradient staler than ``D`` no step."""

  def delay_window(self) -> int | None:
    """``D``, the past steps kept, or ``None`` if unknown."""
    ...


def _visit(opt_state: Any, protocol: type) -> list[Any]:
  """Every state inside ``opt_state`` (through chains, wrappers, other states) that follows ``protocol``."""
  found: list[Any] = []

  def visit(x: Any) -> bool:
    if isinstance(x, protocol) and not isinstance(x, type):
      found.append(x)
    return False

  jax.tree.leaves(opt_state, is_leaf=visit)
  return found


def check_schedule(opt_state: Any, *, num_contributions: int, max_staleness: int) -> None:
  """Refuses a run on which the transformations inside ``opt_state`` would silently do nothing.

  A runtime calls it before compiling, with what its schedule implies. Two
  cases, found anywhere inside the state (chains, ``inject_hyperparams``,
  ``MultiSteps``, ``dj.delayed``, ``dj.per_contribution``, like
  :func:`worker_capacity`):

  - ``dj.fed_buff(..., buffer_size=K)`` (and ``dj.accumulate_sum(..., k=K)``)
    takes its first server step at the ``K``-th contribution. A run with
    fewer returns zero updates throughout and ends where it started, which
    looks like a converged run: a ``ValueError``.
  - ``dj.delay_adaptive_sgd(..., max_delay=D)`` keeps ``D`` past steps and
    gives a gradient staler than ``D`` a step of 0 (its window cannot be
    checked). When the run's staleness can exceed ``D`` those gradients are
    skipped, and a run whose gradients are all that stale takes zero
    steps: a ``UserWarning`` (a run can be right to skip its few stalest
    gradients, so this is not an error).

  A ``K`` injected as a traced array cannot be checked and is skipped.

  Args:
    opt_state: an optimizer state as ``tx.init`` returns it, possibly
      nested; abstract shapes (``jax.eval_shape(tx.init, params)``) are
      enough.
    num_contributions: how many contributions the run gives the
      transformations (per update, or per contribution under
      ``dj.per_contribution``), an integer ``>= 0``.
    max_staleness: the largest staleness in the run, an integer ``>= 0``.

  Raises:
    ValueError: if an accumulating state's ``K`` exceeds ``num_contributions``.
    TypeError, ValueError: if ``num_contributions`` or ``max_staleness`` is
      not an integer, or is negative.

  Warns:
    UserWarning: if a delay window ``D`` is smaller than ``max_staleness``.

  Examples:
    >>> import jax.numpy as jnp, optax
    >>> import delayjax as dj
    >>> state = dj.fed_buff(optax.sgd(1.0), buffer_size=1000).init(jnp.zeros(3))
    >>> dj.transforms.check_schedule(state, num_contributions=40, max_staleness=3)
    Traceback (most recent call last):
    ...
    ValueError: dj.fed_buff(..., buffer_size=1000) takes its first step at contribution 1000 ...
  """
  num_contributions = check_int("num_contributions", num_contributions, minimum=0)
  max_staleness = check_int("max_staleness", max_staleness, minimum=0)
  for state in _visit(opt_state, CountsContributions):
    found = state.contributions_per_step()
    if found is None:
      continue
    described, argument, k = found
    if k > num_contributions:
      raise ValueError(
          f"{described} takes its first step at contribution {k} ({argument}={k} but the run has "
          f"{num_contributions} contributions): every update would be zero; use {argument} <= "
          f"{num_contributions} or a longer run.")
  for state in _visit(opt_state, KeepsDelayWindow):
    window = state.delay_window()
    if window is not None and window < max_staleness:
      warnings.warn(
          f"dj.delay_adaptive_sgd(..., max_delay={window}) keeps the last {window} steps, but the run's "
          f"max_staleness is {max_staleness}: gradients staler than {window} get step 0, and a run of such "
          f"gradients stalls with zero steps; use max_delay >= {max_staleness}.", UserWarning, stacklevel=2)
