"""What the two forms of ``dj.delayed`` share: gradient rings and the checks on an update call."""

from __future__ import annotations

from typing import Any, Iterable

import jax
import jax.numpy as jnp

from delayjax._sharding import stacked_zeros


def rings(tree: Any, num_slots: int) -> Any:
  """Zeros ``[num_slots, *shape]`` per leaf of ``tree``, in the leaf's dtype."""
  return jax.tree.map(lambda p: stacked_zeros(p, num_slots), tree)


def check_update_call(updates: Any, params: Any, extra_args: dict[str, Any], computed: Iterable[str]) -> None:
  """Raises if ``params`` is missing, if the caller passes an argument ``delayed`` computes, or if trees differ."""
  if params is None:
    raise ValueError("delayed needs params: call update(grads, state, params).")
  clash = [k for k in computed if k in extra_args]
  if clash:
    raise TypeError(
        f"dj.delayed computes {clash} itself, so it cannot also be given them: in a hand-written loop, do not "
        f"pass them to its update(); under a runtime (dj.simulate passes staleness, stale_params and worker), "
        f"give the runtime the inner transformation instead: the runtime's schedule already delays it.")
  if jax.tree.structure(updates) != jax.tree.structure(params):
    raise ValueError(
        f"updates must have the structure of params {jax.tree.structure(params)}; got "
        f"{jax.tree.structure(updates)}.")
