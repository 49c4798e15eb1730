"""dj.delayed replaying a cluster Schedule, against an event-by-event NumPy reference."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import delayjax as dj
from delayjax.runtime._replay import plan_replay

DIM = 4
A = np.diag(np.linspace(0.5, 1.5, DIM)).astype(np.float32)
B = np.linspace(-1.0, 1.0, DIM).astype(np.float32)
LR, BETA, LAM = 0.1, 0.5, 0.3


def grad_np(w):
  return A @ w - B


def numpy_reference(schedule):
  """Update u averages its contributions, each the gradient at the version it read (NumPy, float64).

  The inner rule is DC-ASGD-c then heavy-ball SGD, with stale parameters and staleness taken from the
  stalest contribution (ties: lowest worker).
  """
  versions = [np.zeros(DIM)]
  m = np.zeros(DIM)
  for u in range(schedule.num_updates):
    workers = np.flatnonzero(schedule.contributes[u])
    reads = schedule.read_version[u, workers]
    weights = schedule.num_batches[u, workers].astype(np.float64)
    g = sum(wt * grad_np(versions[v]) for wt, v in zip(weights, reads)) / weights.sum()
    w = versions[-1]
    w_read = versions[reads.min()]
    g = g + LAM * g * g * (w - w_read)
    m = BETA * m + g
    versions.append(w - LR * m)
  return np.stack(versions)


def train_with_replay(schedule, inner):
  """An unchanged training loop: each call computes the gradient at the current params."""
  tx = dj.delayed(inner, schedule)
  params = jnp.zeros(DIM)
  state = tx.init(params)
  update = jax.jit(tx.update)
  seen = [np.asarray(params)]
  for _ in range(int(schedule.contributes.sum())):
    u, state = update(jnp.asarray(A) @ params - jnp.asarray(B), state, params)
    params = optax.apply_updates(params, u)
    seen.append(np.asarray(params))
  return params, state, seen


SCHEDULES = {
    "bsp": lambda: dj.cluster.simulate(dj.cluster.bsp(), dj.cluster.workers(3, seed=0), 12, seed=0),
    "asp": lambda: dj.cluster.simulate(dj.cluster.asp(), dj.cluster.workers(4, seed=1), 20, seed=0),
    "ssp": lambda: dj.cluster.simulate(dj.cluster.ssp(1), dj.cluster.workers(4, speed=[1, 1, 2, 4], seed=2),
                                       20, seed=0),
    "k_async": lambda: dj.cluster.simulate(dj.cluster.k_async(2), dj.cluster.workers(4, seed=3), 15, seed=0),
    "softsync": lambda: dj.cluster.simulate(dj.cluster.softsync(2), dj.cluster.workers(4, seed=1), 15, seed=0),
}


@pytest.mark.parametrize("name", SCHEDULES)
def test_replay_matches_event_by_event_reference(name):
  schedule = SCHEDULES[name]()
  inner = optax.chain(dj.delay_compensation(LAM), optax.sgd(LR, momentum=BETA))
  _, state, seen = train_with_replay(schedule, inner)
  versions = numpy_reference(schedule)
  # Call c is the c-th read, in order of version: the loop must be handed exactly that version.
  read_versions = np.sort(schedule.read_version[schedule.contributes])
  np.testing.assert_allclose(np.stack(seen[:-1]), versions[read_versions], rtol=1e-5, atol=1e-6)
  np.testing.assert_allclose(seen[-1], versions[-1], rtol=1e-5, atol=1e-6)
  assert int(state.count) == int(schedule.contributes.sum())


@pytest.mark.parametrize("tau", [1, 3])
def test_equal_speed_asp_replay_equals_constant_delay(tau):
  schedule = dj.cluster.simulate(dj.cluster.asp(), dj.cluster.workers(tau + 1, compute="constant"), 30, seed=0)
  assert np.all(schedule.staleness[tau:][schedule.contributes[tau:]] == tau)
  inner = optax.sgd(0.1, momentum=0.9)
  _, _, replayed = train_with_replay(schedule, inner)
  tx = dj.delayed(inner, dj.delays.constant(tau))
  params, state = jnp.zeros(DIM), tx.init(jnp.zeros(DIM))
  # The replay's last call also applies the updates still in flight; constant(tau) never does.
  for t in range(len(replayed) - 2):
    u, state = jax.jit(tx.update)(jnp.asarray(A) @ params - jnp.asarray(B), state, params)
    params = optax.apply_updates(params, u)
    np.testing.assert_allclose(params, replayed[t + 1], rtol=1e-6, atol=1e-7)


def test_inner_sees_the_schedules_staleness_and_worker():
  schedule = SCHEDULES["softsync"]()

  def record(updates, state, params=None, *, staleness=None, worker=None, **extra):
    del params, extra
    return jax.tree.map(lambda g: jnp.zeros_like(g).at[0].set(staleness.astype(g.dtype))
                        .at[1].set(worker.astype(g.dtype)), updates), state

  tx = dj.delayed(optax.GradientTransformationExtraArgs(lambda p: optax.EmptyState(), record), schedule)
  params = jnp.zeros(DIM)
  state = tx.init(params)
  plan = plan_replay(schedule)
  for c in range(int(schedule.contributes.sum())):
    u, state = tx.update(jnp.ones(DIM), state, params)
    if plan.num_updates[c] == 1:
      upd = plan.first_update[c]
      contributing = np.flatnonzero(schedule.contributes[upd])
      stal = upd - schedule.read_version[upd, contributing]
      stalest = contributing[np.argmax(stal)]  # argmax takes the lowest worker on ties
      np.testing.assert_array_equal(np.asarray(u)[:2], [stal.max(), stalest])


@pytest.mark.standard_promotion
def test_calls_past_the_schedule_apply_nothing():
  schedule = SCHEDULES["asp"]()[:6]
  tx = dj.delayed(optax.adam(0.1), schedule)
  params = jnp.ones(DIM)
  state = tx.init(params)
  for _ in range(int(schedule.contributes.sum())):
    _, state = tx.update(jnp.ones(DIM), state, params)
  before = state.inner_state
  u, state = tx.update(jnp.ones(DIM), state, params)
  np.testing.assert_array_equal(u, np.zeros(DIM))
  jax.tree.map(np.testing.assert_array_equal, state.inner_state, before)


def test_plan_uses_few_slots_and_applies_every_update_once():
  for make in SCHEDULES.values():
    schedule = make()
    plan = plan_replay(schedule)
    applied = np.concatenate([np.arange(f, f + n) for f, n in zip(plan.first_update, plan.num_updates)])
    np.testing.assert_array_equal(applied, np.arange(schedule.num_updates))
    assert plan.num_slots <= 2 * schedule.num_workers


def test_bad_input():
  schedule = SCHEDULES["asp"]()
  tx = dj.delayed(optax.sgd(0.1), schedule)
  with pytest.raises(TypeError, match="worker"):
    tx.update(jnp.ones(DIM), tx.init(jnp.ones(DIM)), jnp.ones(DIM), worker=1)
  with pytest.raises(ValueError, match="structure of params"):
    tx.update({"a": jnp.ones(DIM)}, tx.init(jnp.ones(DIM)), jnp.ones(DIM))
  empty = dj.cluster.Schedule(time=[0.0, 1.0], contributes=[[True], [False]], read_version=[[0], [-1]],
                              wait=[0.0])
  with pytest.raises(ValueError, match="update 1 has no contribution"):
    dj.delayed(optax.sgd(0.1), empty)
