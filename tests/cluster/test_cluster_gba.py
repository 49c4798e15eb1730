"""GBA's schedule agrees event for event with the token-server reference in ``gba_reference.py``.

Both run on the same replayed durations, so they must agree exactly: every
update's time, contributions, read versions (the tokens) and minibatch counts,
every gradient's read and push, and every worker's waiting time.
"""

import numpy as np
import pytest

import delayjax as dj
import gba_reference
from delayjax.cluster._simulate import record_bytes_per_update
from test_cluster_psp import _times  # ties, heterogeneous speeds, and one straggler among equals
from test_cluster_reference import _assert_same

C = dj.cluster


def _run(times: np.ndarray, global_batch: int, num_updates: int):
  workers = C.workers(times.shape[0], compute=C.replay(times))
  return C.simulate(C.gba(global_batch), workers, num_updates, seed=0)


@pytest.mark.parametrize("kind", ["ties", "heterogeneous", "one_straggler"])
@pytest.mark.parametrize("global_batch", [1, 2, 4, 5, 7])
@pytest.mark.parametrize("seed", range(3))
def test_matches_reference(kind, global_batch, seed):
  times = _times(kind, seed, 4)
  _assert_same(_run(times, global_batch, 60), gba_reference.gba(times, 60, global_batch))


def test_reference_cases_exercise_the_rule():
  # The comparisons above only mean something if the cases reach every branch of the rule.
  ties = _run(_times("ties", 0, 4), 5, 200)
  assert ties.wait.sum() > 0                  # a push held behind the worker's own buffered gradient
  assert ties.num_batches.max() > 1           # one worker's gradients at one token are one contribution
  straggler = _run(_times("one_straggler", 0, 4), 5, 200)
  assert straggler.staleness.max() >= 3       # the straggler's gradient arrives several updates late


def test_the_exactness_restriction_makes_fast_workers_wait_for_a_straggler():
  # The documented cost of recording one read version per worker and update: with G = 5 on 4 workers, one 6x
  # slower, each fast worker gives a buffer the gradients of one read version, and the straggler fills the rest.
  sched = _run(_times("one_straggler", 0, 4), 5, 200)
  assert sched.wait[:3].min() > 0.85 * sched.time[-1]
  assert sched.wait[3] == 0


def test_global_batch_of_equal_workers_is_the_synchronous_batch():
  # With G = M equally fast workers, every update holds one gradient of each worker, as the synchronous job;
  # the pushers before the last read before the update is applied, so their next gradient is exactly 1 stale.
  workers = C.workers(4, compute=C.replay(np.full((4, 3), 1.5)))
  sched = C.simulate(C.gba(4), workers, 30)
  np.testing.assert_array_equal(sched.contributes, np.ones((30, 4), bool))
  np.testing.assert_array_equal(sched.time, C.simulate(C.bsp(), workers, 30).time)
  tau = sched.staleness
  assert tau[0].max() == 0
  np.testing.assert_array_equal(tau[1:], np.tile([1, 1, 1, 0], (29, 1)))


def test_stragglers_hold_back_fewer_workers_and_every_update_keeps_the_global_batch():
  # Each gradient straggles (10x slower) with probability 0.05: BSP waits for it, GBA averages the G first pushed.
  workers = C.workers(8, compute="gamma", stragglers=C.random_stragglers(0.05, 10.0))
  gba, bsp = C.simulate(C.gba(8), workers, 150, seed=3), C.simulate(C.bsp(), workers, 150, seed=3)
  np.testing.assert_array_equal(gba.num_batches.sum(axis=1), 8)
  assert gba.wait.sum() < bsp.wait.sum() / 2
  assert gba.time[-1] < bsp.time[-1] / 1.5


def test_same_seed_same_schedule():
  workers = C.workers(5, compute="lognormal", speed=[1.0, 1.0, 0.5, 1.0, 0.3])
  a, b = (C.simulate(C.gba(3), workers, 300, seed=11) for _ in range(2))
  np.testing.assert_array_equal(a.time, b.time)
  np.testing.assert_array_equal(a.read_version, b.read_version)


@pytest.mark.parametrize("make,error,message", [
    (lambda: C.gba(0), ValueError, "global_batch must be an integer >= 1, got 0"),
    (lambda: C.gba(-3), ValueError, "global_batch must be an integer >= 1, got -3"),
    (lambda: C.gba(2.5), TypeError, "global_batch must be an integer"),
    (lambda: C.gba("4"), TypeError, "global_batch must be an integer"),
])
def test_bad_arguments(make, error, message):
  with pytest.raises(error, match=message):
    make()


def test_str_names_the_paradigm():
  assert str(C.gba(8)) == "gba(global_batch=8)"
  assert "gba" in C.__all__


@pytest.mark.parametrize("global_batch", [1, 3, 7])
@pytest.mark.parametrize("record_events", [True, False])
def test_the_memory_estimate_is_a_lower_bound_of_the_record(global_batch, record_events):
  # simulate refuses a run whose record cannot fit from this estimate, so it must never exceed what is recorded.
  sched = C.simulate(C.gba(global_batch), C.workers(3, compute="exponential", speed=[1.0, 1.0, 0.3]), 300,
                     record_events=record_events)
  c = sched.contributions
  recorded = sched.time.nbytes + 8 * (sched.num_updates + 1) + c.worker.nbytes + c.read_version.nbytes + sum(
      v.nbytes for k, v in sched.extras.items() if k.startswith("event_"))
  assert 300 * record_bytes_per_update(C.gba(global_batch), 3, record_events) <= recorded
