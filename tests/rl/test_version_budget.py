"""dj.cluster.version_budget: admission by version against a brute-force reference of its rule."""

import numpy as np
import pytest

import delayjax as dj


def _reference(times, num_updates, budget):
  """The rule, scanning every worker at every step: [(time, worker, read version)] of the updates."""
  num, n = times.shape
  next_push = times[:, 0].copy()
  read_v, count = [0] * num, [0] * num
  arrived, out = set(), []
  while len(out) < num_updates:
    computing = [w for w in range(num) if w not in arrived]
    m = min(computing, key=lambda w: (next_push[w], w))
    t = next_push[m]
    arrived.add(m)
    while arrived and len(out) < num_updates:
      c = min(arrived, key=lambda w: (read_v[w], w))
      u = len(out)
      # The others, oldest first, must each fit: the i-th (from 1) is applied at u + i at the earliest.
      others = sorted(read_v[w] for w in range(num) if w != c)
      if any(v < u + i - budget for i, v in enumerate(others, start=1)):
        break
      out.append((t, c, read_v[c]))
      arrived.remove(c)
      read_v[c] = u + 1
      count[c] += 1
      next_push[c] = t + times[c, count[c] % n]
  return out


@pytest.mark.parametrize("budget", [3, 4, 7])
def test_matches_the_rule_and_keeps_every_push_within_the_budget(budget):
  rng = np.random.default_rng(budget)
  times = rng.integers(1, 9, (4, 50)).astype(np.float64)  # integer seconds: many simultaneous pushes
  sched = dj.cluster.simulate(dj.cluster.version_budget(budget), dj.cluster.workers(4, compute=times), 300)
  u, m = np.nonzero(sched.contributes)
  got = list(zip(sched.time[u].tolist(), m.tolist(), sched.read_version[u, m].tolist()))
  assert got == _reference(times, 300, budget)
  staleness = sched.staleness[sched.contributes]
  assert staleness.max() == budget  # the budget binds
  np.testing.assert_allclose(sched.busy + sched.wait, sched.time[-1])
  assert np.all(sched.dropped == 0)


def test_the_smallest_budget_applies_pushes_in_read_order_and_a_huge_one_is_asp():
  workers = dj.cluster.workers(5, compute="exponential")
  ordered = dj.cluster.simulate(dj.cluster.version_budget(4), workers, 500, seed=1)
  u, m = np.nonzero(ordered.contributes)
  assert np.all(np.diff(ordered.read_version[u, m]) >= 0)
  asp = dj.cluster.simulate(dj.cluster.asp(), workers, 500, seed=1)
  free = dj.cluster.simulate(dj.cluster.version_budget(10 ** 6), workers, 500, seed=1)
  for field in ("time", "contributes", "read_version", "wait", "busy"):
    np.testing.assert_array_equal(getattr(free, field), getattr(asp, field))
  for key in asp.extras:
    np.testing.assert_array_equal(free.extras[key], asp.extras[key])


def test_bad_budgets_are_refused():
  with pytest.raises(ValueError, match="num_workers - 1 = 3"):
    dj.cluster.simulate(dj.cluster.version_budget(2), dj.cluster.workers(4), 10)
  with pytest.raises(TypeError, match="max_staleness"):
    dj.cluster.version_budget(2.5)
  with pytest.raises(ValueError, match="max_staleness"):
    dj.cluster.version_budget(-1)
