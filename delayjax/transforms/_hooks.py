"""Hooks through which a transformation tells a runtime what a worker reads.

Most transformations let workers read the current server parameters. Some
(DANA's look-ahead) send a worker other parameters. Such a transformation keeps
a state object with a ``read_params(params, worker)`` method; the runtimes find
it anywhere inside an optimizer state (through ``optax.chain``,
``inject_hyperparams``, ``MultiSteps`` and ``dj.delayed``) with
:func:`read_params`.
"""

from __future__ import annotations

from typing import Any, Protocol, runtime_checkable

import jax


@runtime_checkable
class ReadsParams(Protocol):
  """An optimizer state that defines the parameters a worker reads."""

  def read_params(self, params: Any, worker: Any) -> Any:
    ...


def _defines_read(x: Any) -> bool:
  return isinstance(x, ReadsParams) and not isinstance(x, type)


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
  found = [x for x in jax.tree.leaves(opt_state, is_leaf=_defines_read) if _defines_read(x)]
  if len(found) > 1:
    raise ValueError(
        f"at most one transformation in a chain may define the parameters workers read, found "
        f"{len(found)}: {[type(x).__name__ for x in found]}.")
  return found[0].read_params(params, worker) if found else params
