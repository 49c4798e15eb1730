"""Schedule statistics, save/load, concatenation, and chunked simulations with feedback (AdaSync)."""

import dataclasses

import numpy as np
import pytest

import delayjax as dj

C = dj.cluster


def hand_made() -> C.Schedule:
  # 3 updates, 2 workers; staleness: u0 {0}, u1 {1, 0 (2 batches)}, u2 {2}.
  return C.Schedule(
      time=[1.0, 2.0, 4.0],
      contributes=[[True, False], [True, True], [False, True]],
      read_version=[[0, -1], [0, 1], [-1, 0]],
      num_batches=[[1, 0], [1, 2], [0, 1]],
      wait=[1.0, 0.0], busy=[3.0, 4.0], dropped=[2, 0], paradigm="test")


def test_statistics_of_a_hand_made_schedule():
  s = hand_made()
  np.testing.assert_array_equal(s.staleness_histogram(), [3, 1, 1])   # minibatches: 1 + 2 at tau 0
  assert s.mean_staleness() == pytest.approx((0 + 1 + 0 * 2 + 2) / 5)
  assert s.total_time == 4.0
  assert s.updates_per_second == pytest.approx(0.75)
  np.testing.assert_allclose(s.idle_fraction, [0.25, 0.0])
  assert s.num_dropped == 2


def test_statistics_agree_with_the_dense_staleness():
  s = C.simulate(C.ssp(2), C.workers(6, compute="gamma"), 2000, seed=1)
  tau = s.staleness[s.contributes]
  np.testing.assert_array_equal(s.staleness_histogram(), np.bincount(tau))
  assert s.mean_staleness() == pytest.approx(tau.mean())


def test_summary_and_repr_are_readable():
  s = C.simulate(C.k_sync(3), C.workers(4), 100, seed=0)
  text = s.summary()
  assert "k_sync(k=3)" in text and "100 updates" in text and "4 workers" in text
  assert "dropped gradients: 100" in text
  assert "staleness: mean 0" in text
  r = repr(s)
  assert r.startswith("Schedule(paradigm='k_sync(k=3)'") and "num_updates=100" in r and len(r) < 200


@pytest.mark.parametrize("paradigm", [C.dssp(1, 4), C.k_batch_async(3), C.adasync(2), C.backup_workers(1)])
def test_save_load_round_trips_exactly(tmp_path, paradigm):
  s = C.simulate(paradigm, C.workers(4, compute="lognormal"), 300, seed=3)
  path = tmp_path / "schedule.npz"
  s.save(path)
  loaded = C.Schedule.load(path)
  assert loaded == s
  assert loaded.extras.keys() == s.extras.keys()
  for k, v in s.extras.items():
    assert loaded.extras[k].dtype == v.dtype
  assert loaded != dataclasses.replace(s, paradigm="other")


@pytest.mark.parametrize("paradigm", [C.bsp(), C.k_sync(2), C.k_batch_sync(5), C.adasync(3)])
@pytest.mark.parametrize("chunks", [[300], [1, 299], [100, 57, 143]])
def test_chunks_concatenate_into_the_one_shot_schedule(paradigm, chunks):
  w = C.workers(5, compute="gamma", stragglers=C.straggler_window(10.0, 30.0, 3.0, workers=[1, 2]))
  whole = C.simulate(paradigm, w, sum(chunks), seed=4)
  sim = C.Simulation(paradigm, w, seed=4)
  joined = C.concatenate([sim.run(n) for n in chunks])
  for field in ("time", "contributes", "read_version", "num_batches", "dropped"):
    np.testing.assert_array_equal(getattr(joined, field), getattr(whole, field))
  assert joined.extras.keys() == whole.extras.keys()
  for k in whole.extras:
    np.testing.assert_array_equal(joined.extras[k], whole.extras[k])
  np.testing.assert_allclose(joined.wait, whole.wait, rtol=1e-9)
  np.testing.assert_allclose(joined.busy, whole.busy, rtol=1e-9)


def test_chunks_are_complete_schedules_that_continue_the_clock():
  sim = C.Simulation(C.k_sync(2), C.workers(3), seed=0)
  a, b = sim.run(10), sim.run(10)
  assert b.time[0] >= a.time[-1]
  np.testing.assert_array_equal(b.read_version[b.contributes], np.nonzero(b.contributes)[0])


def test_concatenate_checks_its_inputs():
  a = C.simulate(C.bsp(), C.workers(3), 5)
  with pytest.raises(ValueError, match="num_workers, paradigm and extras"):
    C.concatenate([a, C.simulate(C.bsp(), C.workers(4), 5)])
  with pytest.raises(ValueError, match="non-decreasing"):
    C.concatenate([a, a])   # the second starts its clock at 0 again
  with pytest.raises(TypeError, match="non-empty sequence of Schedule"):
    C.concatenate([])


def test_adasync_raises_k_as_the_loss_falls():
  num_workers, k0 = 8, 2
  sim = C.Simulation(C.adasync(k0), C.workers(num_workers), seed=0)
  losses = [4.0, 4.0, 1.0, 0.25, 0.01]
  chunks, ks = [], []
  for loss in losses:
    sim.feedback(loss)
    ks.append(sim.k)
    chunks.append(sim.run(50))
  # K = ceil(sqrt(F0 / F) K0), clipped to M: 2, 2, 4, 8, then 40 -> 8.
  assert ks == [2, 2, 4, 8, 8]
  sched = C.concatenate(chunks)
  np.testing.assert_array_equal(sched.extras["k"], np.repeat(ks, 50))
  np.testing.assert_array_equal(sched.contributes.sum(axis=1), sched.extras["k"])
  assert np.all(sched.staleness[sched.contributes] == 0)
  # A larger K waits for slower workers: fewer updates per second in later chunks.
  assert chunks[0].updates_per_second > C.concatenate(chunks[3:]).updates_per_second


def test_adasync_without_feedback_is_k_sync():
  w = C.workers(5, compute="uniform")
  a = C.simulate(C.adasync(3), w, 200, seed=2)
  b = C.simulate(C.k_sync(3), w, 200, seed=2)
  for field in ("time", "contributes", "read_version", "wait", "busy", "dropped"):
    np.testing.assert_array_equal(getattr(a, field), getattr(b, field))


def test_feedback_is_ignored_by_fixed_paradigms():
  sim = C.Simulation(C.k_sync(2), C.workers(4), seed=0)
  sim.feedback(10.0)
  sim.feedback(0.1)
  assert sim.k == 2


def test_schedule_rejects_a_version_where_nothing_contributes():
  with pytest.raises(ValueError, match="read_version must be -1 where contributes is false"):
    C.Schedule(time=[1.0], contributes=[[True, False]], read_version=[[0, 0]], wait=[0.0, 0.0])
