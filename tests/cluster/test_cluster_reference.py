"""The fast simulator agrees event for event with the slow reference in ``cluster_reference.py``."""

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

import delayjax as dj
from delayjax.cluster._paradigms import DSSP
import cluster_reference as ref

C = dj.cluster


def _times(seed: int, num_workers: int, ties: bool) -> np.ndarray:
  rng = np.random.default_rng(seed)
  if ties:
    # Small integers: many pushes at the same second, to pin down the tie rule.
    return rng.integers(1, 4, size=(num_workers, 5)).astype(np.float64)
  speed = rng.uniform(0.3, 1.0, size=(num_workers, 1))
  return rng.exponential(1.0, size=(num_workers, 11)) / speed


def _assert_same(sched: C.Schedule, result: ref.Result) -> None:
  num_updates, num = sched.num_updates, sched.num_workers
  assert len(result.updates) == num_updates
  np.testing.assert_array_equal(sched.time, [t for t, _ in result.updates])
  contributes = np.zeros((num_updates, num), bool)
  read_version = np.full((num_updates, num), -1)
  num_batches = np.zeros((num_updates, num), np.int64)
  for u, (_, contributions) in enumerate(result.updates):
    for m, (v, n) in contributions.items():
      contributes[u, m], read_version[u, m], num_batches[u, m] = True, v, n
  np.testing.assert_array_equal(sched.contributes, contributes)
  np.testing.assert_array_equal(sched.read_version, read_version)
  np.testing.assert_array_equal(sched.num_batches, num_batches)
  events = sorted(result.events, key=lambda e: e[0])  # stable: each worker's events stay in time order
  x = sched.extras
  np.testing.assert_array_equal(x["event_worker"], [e[0] for e in events])
  np.testing.assert_array_equal(x["event_read_time"], [e[1] for e in events])
  np.testing.assert_array_equal(x["event_end_time"], [e[2] for e in events])
  np.testing.assert_array_equal(x["event_update"], [e[3] for e in events])
  np.testing.assert_array_equal(x["event_read_version"], [e[4] for e in events])
  np.testing.assert_allclose(sched.wait, result.wait, rtol=1e-12, atol=1e-9)
  dropped = np.bincount([e[0] for e in events if e[3] == -1], minlength=num)
  np.testing.assert_array_equal(sched.dropped, dropped)


CASES = [
    ("asp", lambda m: C.asp(), lambda t, u, m: ref.asp(t, u)),
    ("ssp0", lambda m: C.ssp(0), lambda t, u, m: ref.ssp(t, u, 0)),
    ("ssp2", lambda m: C.ssp(2), lambda t, u, m: ref.ssp(t, u, 2)),
    ("dssp", lambda m: C.dssp(1, 4), lambda t, u, m: ref.dssp(t, u, 1, 4)),
    ("dssp_equal", lambda m: C.dssp(2, 2), lambda t, u, m: ref.dssp(t, u, 2, 2)),
    ("bsp", lambda m: C.bsp(), lambda t, u, m: ref.k_sync(t, u, m)),
    ("k_sync", lambda m: C.k_sync(max(1, m - 2)), lambda t, u, m: ref.k_sync(t, u, max(1, m - 2))),
    ("k_async", lambda m: C.k_async(2), lambda t, u, m: ref.aggregate(t, u, 2, True)),
    ("k_batch_sync", lambda m: C.k_batch_sync(m + 2), lambda t, u, m: ref.k_batch_sync(t, u, m + 2)),
    ("k_batch_async", lambda m: C.k_batch_async(3), lambda t, u, m: ref.aggregate(t, u, 3, False)),
    ("softsync", lambda m: C.softsync(2), lambda t, u, m: ref.aggregate(t, u, m // 2, False)),
    ("backup", lambda m: C.backup_workers(1), lambda t, u, m: ref.backup(t, u, 1)),
]


@pytest.mark.parametrize("name,paradigm,reference", CASES, ids=[c[0] for c in CASES])
@pytest.mark.parametrize("ties", [False, True])
@pytest.mark.parametrize("seed", range(6))
def test_matches_reference(name, paradigm, reference, ties, seed):
  num_workers = 2 + seed % 4
  times = _times(seed, num_workers, ties)
  num_updates = 60
  sched = C.simulate(paradigm(num_workers), C.workers(num_workers, compute=C.replay(times)), num_updates, seed=seed)
  result = reference(times, num_updates, num_workers)
  _assert_same(sched, result)
  if name.startswith("dssp"):
    np.testing.assert_array_equal(sched.extras["threshold"], result.threshold)


def test_reference_cases_exercise_the_rules():
  # The comparisons above only mean something if the cases hit the interesting branches.
  times = _times(3, 5, False)
  w = C.workers(5, compute=C.replay(times))
  assert C.simulate(C.ssp(2), w, 60).wait.sum() > 0                      # SSP blocks
  assert np.any(C.simulate(C.dssp(1, 4), w, 60).extras["threshold"] > 1)  # DSSP grants
  assert C.simulate(C.backup_workers(1), w, 60).num_dropped > 0           # backups drop
  held = C.simulate(C.k_batch_async(3), w, 200)
  assert held.num_batches.max() > 1 or np.any(held.extras["event_update"] == -2)
  x = held.extras
  # A held push: its gradient ended before the update it joined was applied... and after the previous one.
  applied = x["event_update"] >= 0
  late = x["event_end_time"][applied] < np.r_[0.0, held.time][x["event_update"][applied]]
  assert late.any()


@st.composite
def small_clusters(draw):
  num_workers = draw(st.integers(1, 6))
  width = draw(st.integers(1, 6))
  values = st.sampled_from([0.5, 1.0, 1.5, 2.0, 3.0]) if draw(st.booleans()) else st.floats(0.01, 5.0)
  times = np.array(draw(st.lists(values, min_size=num_workers * width, max_size=num_workers * width)))
  return times.reshape(num_workers, width)


def _random_case(data, num_workers):
  kind = data.draw(st.sampled_from(["asp", "ssp", "dssp", "k_sync", "k_async", "k_batch_sync", "k_batch_async",
                                    "softsync", "backup"]))
  k = data.draw(st.integers(1, num_workers))
  s = data.draw(st.integers(0, 3))
  extra = data.draw(st.integers(0, 4))
  return {
      "asp": (C.asp(), lambda t, u: ref.asp(t, u)),
      "ssp": (C.ssp(s), lambda t, u: ref.ssp(t, u, s)),
      "dssp": (C.dssp(s, s + extra), lambda t, u: ref.dssp(t, u, s, s + extra)),
      "k_sync": (C.k_sync(k), lambda t, u: ref.k_sync(t, u, k)),
      "k_async": (C.k_async(k), lambda t, u: ref.aggregate(t, u, k, True)),
      "k_batch_sync": (C.k_batch_sync(k + extra), lambda t, u: ref.k_batch_sync(t, u, k + extra)),
      "k_batch_async": (C.k_batch_async(k + extra), lambda t, u: ref.aggregate(t, u, k + extra, False)),
      "softsync": (C.softsync(k), lambda t, u: ref.aggregate(t, u, num_workers // k, False)),
      "backup": (C.backup_workers(k - 1), lambda t, u: ref.backup(t, u, k - 1)),
  }[kind]


@settings(max_examples=150, deadline=None)
@given(times=small_clusters(), num_updates=st.integers(1, 40), data=st.data())
def test_matches_reference_on_random_clusters(times, num_updates, data):
  paradigm, reference = _random_case(data, times.shape[0])
  sched = C.simulate(paradigm, C.workers(times.shape[0], compute=C.replay(times)), num_updates)
  result = reference(times, num_updates)
  _assert_same(sched, result)
  if isinstance(paradigm, DSSP):
    np.testing.assert_array_equal(sched.extras["threshold"], result.threshold)
