"""Replaying a cluster ``Schedule`` in an unchanged training loop (``dj.delayed(inner, schedule)``)."""

from __future__ import annotations

import heapq
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax

from delayjax.cluster._schedule import Schedule
from delayjax.runtime._buffers import check_update_call, rings
from delayjax.runtime._engine import check_worker_capacity
from delayjax.transforms._hooks import runtime_inputs

_COMPUTED = ("staleness", "stale_params", "worker")


class ReplayPlan(NamedTuple):
  """Host-side tables that map training-loop calls to a schedule's reads and updates.

  Call ``c`` is the ``c``-th read of the schedule (reads ordered by version,
  then worker). Its gradient goes to slot ``slot[c]``; the call then applies
  updates ``first_update[c] .. first_update[c] + num_updates[c] - 1``.
  """

  slot: np.ndarray  # int32 [C]
  first_update: np.ndarray  # int32 [C]
  num_updates: np.ndarray  # int32 [C]
  contrib_slot: np.ndarray  # int32 [U, K]: the slots an update averages (padding: 0)
  contrib_weight: np.ndarray  # float32 [U, K]: num_batches of each contribution (padding: 0)
  stalest_slot: np.ndarray  # int32 [U]: slot of the stalest contribution (ties: lowest worker)
  staleness: np.ndarray  # int32 [U]: the largest staleness in the update
  worker: np.ndarray  # int32 [U]: worker of the stalest contribution
  num_slots: int
  contrib_staleness: np.ndarray  # int32 [U, K]: each contribution's staleness (padding: 0)
  contrib_worker: np.ndarray  # int32 [U, K]: each contribution's worker (padding: 0)


def plan_replay(schedule: Schedule) -> ReplayPlan:
  """Builds the replay tables of ``schedule`` (NumPy, once, on the host).

  Raises:
    ValueError: if an update of the schedule has no contribution.
  """
  contributes = schedule.contributes
  empty = ~contributes.any(axis=1)
  if np.any(empty):
    raise ValueError(f"schedule update {int(np.argmax(empty))} has no contribution; every update needs one.")
  num_updates = schedule.num_updates
  u_of, m_of = np.nonzero(contributes)
  v_of = schedule.read_version[u_of, m_of]
  order = np.lexsort((m_of, v_of))  # reads by version, then worker
  u_of, m_of, v_of = u_of[order], m_of[order], v_of[order]
  num_calls = u_of.shape[0]

  # Call c applies every update below the next read's version: those updates' reads all came before.
  next_version = np.append(v_of[1:], num_updates)
  end = np.maximum.accumulate(next_version)
  start = np.concatenate([[0], end[:-1]])
  apply_call = np.empty(num_updates, np.int64)
  for c in np.flatnonzero(end > start):
    apply_call[start[c]:end[c]] = c

  # A read holds its slot from its call until the call that applies its update (inclusive).
  slot = np.empty(num_calls, np.int64)
  free: list[int] = []
  busy: list[tuple[int, int]] = []
  num_slots = 0
  for c in range(num_calls):
    while busy and busy[0][0] < c:
      heapq.heappush(free, heapq.heappop(busy)[1])
    if free:
      slot[c] = heapq.heappop(free)
    else:
      slot[c] = num_slots
      num_slots += 1
    heapq.heappush(busy, (int(apply_call[u_of[c]]), int(slot[c])))

  width = int(contributes.sum(axis=1).max())
  contrib_slot = np.zeros((num_updates, width), np.int32)
  contrib_weight = np.zeros((num_updates, width), np.float32)
  stalest_slot = np.zeros(num_updates, np.int32)
  staleness = np.zeros(num_updates, np.int32)
  worker = np.zeros(num_updates, np.int32)
  contrib_staleness = np.zeros((num_updates, width), np.int32)
  contrib_worker = np.zeros((num_updates, width), np.int32)
  filled = np.zeros(num_updates, np.int64)
  # Stalest first (then lowest worker), so column 0 is the contribution that speaks for the update.
  for c in np.lexsort((m_of, v_of)):
    u = u_of[c]
    k = filled[u]
    contrib_slot[u, k] = slot[c]
    contrib_weight[u, k] = schedule.num_batches[u, m_of[c]]
    contrib_staleness[u, k], contrib_worker[u, k] = u - v_of[c], m_of[c]
    if k == 0:
      stalest_slot[u], staleness[u], worker[u] = slot[c], u - v_of[c], m_of[c]
    filled[u] += 1
  return ReplayPlan(
      slot=slot.astype(np.int32), first_update=start.astype(np.int32),
      num_updates=(end - start).astype(np.int32), contrib_slot=contrib_slot, contrib_weight=contrib_weight,
      stalest_slot=stalest_slot, staleness=staleness, worker=worker, num_slots=num_slots,
      contrib_staleness=contrib_staleness, contrib_worker=contrib_worker)


class ReplayState(NamedTuple):
  """State of ``dj.delayed(inner, schedule)``."""

  count: jax.Array  # shape=(), int32: calls so far (= reads replayed)
  grads: Any  # pytree like params, each leaf [num_slots, *shape]: gradients read, not yet applied
  stale_params: Any  # pytree like params, each leaf [num_slots, *shape]: the params each was read at
  inner_state: Any  # the wrapped optimizer's state


def replay(inner: optax.GradientTransformationExtraArgs, schedule: Schedule) -> optax.GradientTransformationExtraArgs:
  """The ``Schedule`` form of ``dj.delayed`` (see its docstring)."""
  plan = plan_replay(schedule)
  num_calls = plan.slot.shape[0]

  def init_fn(params):
    inner_state = inner.init(params)
    check_worker_capacity(inner_state, schedule.num_workers, "the schedule (delays)")
    return ReplayState(count=jnp.zeros([], jnp.int32), grads=rings(params, plan.num_slots),
                       stale_params=rings(params, plan.num_slots), inner_state=inner_state)

  def update_fn(updates, state, params=None, **extra_args):
    check_update_call(updates, params, extra_args, _COMPUTED)
    t = state.count
    in_schedule = t < num_calls
    c = jnp.minimum(t, num_calls - 1)
    slot = jnp.asarray(plan.slot)[c]
    write = lambda ring, x: ring.at[slot].set(jnp.where(in_schedule, jnp.asarray(x, ring.dtype), ring[slot]))
    grads = jax.tree.map(write, state.grads, updates)
    stale = jax.tree.map(write, state.stale_params, params)
    first = jnp.asarray(plan.first_update)[c]
    count = jnp.where(in_schedule, jnp.asarray(plan.num_updates)[c], 0)

    def apply(k, carry):
      inner_state, current, total = carry
      u = first + k
      slots = jnp.asarray(plan.contrib_slot)[u]
      weights = jnp.asarray(plan.contrib_weight)[u]

      def mean(ring):
        w = (weights / jnp.sum(weights)).astype(ring.dtype)
        picked = ring[slots]
        w = w.reshape(w.shape + (1,) * (picked.ndim - 1))
        # Padding columns are masked, not multiplied by zero: 0 * inf would poison the mean.
        return jnp.sum(jnp.where(w > 0, w * picked, jnp.zeros_like(picked)), axis=0)

      g = jax.tree.map(mean, grads)
      w_read = jax.tree.map(lambda ring: ring[jnp.asarray(plan.stalest_slot)[u]], stale)
      contributions = {}
      if "contribution_grads" in runtime_inputs(inner_state):
        # dj.per_contribution: each contribution with its own gradient, staleness, read and worker.
        contributions = {
            "contribution_grads": jax.tree.map(lambda ring: ring[slots], grads),
            "contribution_stale_params": jax.tree.map(lambda ring: ring[slots], stale),
            "contribution_staleness": jnp.asarray(plan.contrib_staleness)[u],
            "contribution_workers": jnp.asarray(plan.contrib_worker)[u],
            "contribution_weights": weights / jnp.sum(weights)}
      step, inner_state = inner.update(
          g, inner_state, current, staleness=jnp.asarray(plan.staleness)[u], stale_params=w_read,
          worker=jnp.asarray(plan.worker)[u], **contributions, **extra_args)
      return inner_state, optax.apply_updates(current, step), jax.tree.map(jnp.add, total, step)

    shapes = jax.eval_shape(lambda: inner.update(updates, state.inner_state, params, staleness=jnp.int32(0),
                                                 stale_params=params, worker=jnp.int32(0), **extra_args)[0])
    # Sharded as the updates (a traced value's sharding on Explicit mesh axes; None elsewhere): the loop's carry
    # keeps one type, and the sum is not replicated.
    zeros = jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype, out_sharding=s.sharding), shapes)
    inner_state, _, total = jax.lax.fori_loop(0, count, apply, (state.inner_state, params, zeros))
    return total, ReplayState(count=t + 1, grads=grads, stale_params=stale, inner_state=inner_state)

  return optax.GradientTransformationExtraArgs(init_fn, update_fn)
