r"""One fragment of the parameters per update: the outer optimizer of Streaming DiLoCo."""

from __future__ import annotations

from typing import Any, NamedTuple, Sequence

import jax
import jax.numpy as jnp
import optax

__all__ = ["PerFragmentState", "per_fragment", "fragment_of_leaves"]


class PerFragmentState(NamedTuple):
  count: jax.Array  # shape=(), int32: updates applied so far; update u updates fragment u mod P
  inner: tuple[Any, ...]  # tx's state of each fragment's leaves (a list of the fragment's leaves, in order)


def fragment_of_leaves(params: Any, num_fragments: int) -> tuple[int, ...]:
  """Contiguous fragments: the leaves of ``params`` (in ``jax.tree`` order) cut into ``num_fragments`` runs of
  nearly equal length (the first ones one leaf longer), e.g. groups of consecutive layers."""
  if isinstance(num_fragments, bool) or not isinstance(num_fragments, int) or num_fragments < 1:
    raise ValueError(f"num_fragments must be an int >= 1, got {num_fragments!r}.")
  count = len(jax.tree.leaves(params))
  if num_fragments > count:
    raise ValueError(f"num_fragments must be at most the number of leaves of params ({count}), got "
                     f"{num_fragments}: a fragment holds at least one leaf.")
  base, extra = divmod(count, num_fragments)
  out: list[int] = []
  for p in range(num_fragments):
    out += [p] * (base + (p < extra))
  return tuple(out)


def _check_fragments(fragments: Sequence[int], num_leaves: int | None = None) -> tuple[tuple[int, ...], int]:
  fragments = tuple(fragments)
  if not fragments or any(isinstance(f, bool) or not isinstance(f, int) or f < 0 for f in fragments):
    raise ValueError(f"fragments must be a non-empty sequence of ints >= 0, one per leaf, got {fragments!r}.")
  num = max(fragments) + 1
  if set(fragments) != set(range(num)):
    raise ValueError(f"fragments must use every fragment 0 .. {num - 1} at least once, got {fragments!r}.")
  if num_leaves is not None and len(fragments) != num_leaves:
    raise ValueError(f"fragments must give one fragment per leaf of params ({num_leaves} leaves), got "
                     f"{len(fragments)}.")
  return fragments, num


def per_fragment(tx: optax.GradientTransformation, fragments: Sequence[int]) -> optax.GradientTransformationExtraArgs:
  r"""Applies ``tx`` to one fragment of the parameters per update, in turn; each fragment keeps its own state.

  With the leaves split into fragments :math:`F_0, \dots, F_{P-1}`, update
  :math:`u` updates fragment :math:`p = u \bmod P` only:

  .. math::

    (\Delta_{F_p}, s^{(p)}) \leftarrow \text{tx.update}(g_{F_p}, s^{(p)}, w_{F_p}), \qquad
    \Delta_{F_q} = 0,\ s^{(q)} \text{ unchanged } (q \ne p)

  This is Streaming DiLoCo's outer step: fragment :math:`p` synchronizes on
  its own offset, every :math:`P` updates, with an outer optimizer (e.g.
  Nesterov momentum) of its own. With one fragment it *is* ``tx``.
  ``dj.workers.StreamingDiLoCo`` pushes, for update :math:`u`, the outer
  gradient of fragment :math:`u \bmod P` (zero elsewhere). Every update must
  reach the transformation (BSP: every update has contributions).

  Args:
    tx: the outer optimizer, e.g. ``optax.sgd(0.7, momentum=0.9, nesterov=True)``.
    fragments: one fragment index per leaf of the parameters (``jax.tree``
      order), every index ``0 .. P - 1`` used; :func:`fragment_of_leaves` cuts
      them into contiguous runs.

  Returns:
    An ``optax.GradientTransformationExtraArgs`` (extra arguments go to ``tx``).

  References:
    Douillard, Donchev, Rush, Kale, Sinha, Ballé, Kuncoro, Ranzato, Szlam,
    Lampinen, `Streaming DiLoCo with overlapping communication: Towards a
    Distributed Free Lunch <https://arxiv.org/abs/2501.18512>`_, 2025.
  """
  if not isinstance(tx, optax.GradientTransformation):
    raise TypeError(f"tx must be an optax.GradientTransformation, got {type(tx).__name__}.")
  fragments, num = _check_fragments(fragments)
  tx = optax.with_extra_args_support(tx)

  def split(tree):
    leaves = jax.tree.leaves(tree)
    _check_fragments(fragments, len(leaves))
    return [[x for x, f in zip(leaves, fragments) if f == p] for p in range(num)]

  def init_fn(params):
    return PerFragmentState(jnp.zeros((), jnp.int32), tuple(tx.init(part) for part in split(params)))

  def update_fn(updates, state, params=None, **extra_args):
    if params is None:
      raise ValueError("per_fragment needs params (tx.update(grads, state, params)).")
    active = state.count % num
    grads, weights = split(updates), split(params)
    new_states, outs = [], []
    for p in range(num):
      out, new = tx.update(grads[p], state.inner[p], weights[p], **extra_args)
      on = active == p
      # Every fragment's step is computed and the active one kept: a where, not a cond, over the state.
      new_states.append(jax.tree.map(lambda n, o: jnp.where(on, n, o), new, state.inner[p]))
      outs.append([jnp.where(on, x, jnp.zeros_like(x)) for x in out])
    position = [0] * num
    flat = []
    for f in fragments:
      flat.append(outs[f][position[f]])
      position[f] += 1
    return (jax.tree.unflatten(jax.tree.structure(updates), flat),
            PerFragmentState(state.count + 1, tuple(new_states)))

  return optax.GradientTransformationExtraArgs(init_fn, update_fn)
