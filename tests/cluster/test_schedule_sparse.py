"""Sparse schedules: the contributions in compressed rows, the dense views built from them, old files."""

import os

import numpy as np
import pytest

import delayjax as dj

C = dj.cluster

PARADIGMS = [C.asp(), C.bsp(), C.ssp(2), C.dssp(1, 4), C.psp(2, 1), C.k_sync(2), C.k_async(2),
             C.k_batch_sync(5), C.k_batch_async(3), C.softsync(2), C.backup_workers(1), C.adasync(2)]


@pytest.mark.parametrize("paradigm", PARADIGMS, ids=str)
def test_sparse_contributions_are_the_entries_of_the_dense_views(paradigm):
  s = C.simulate(paradigm, C.workers(4, compute="lognormal"), 200, seed=1)
  u, m = np.nonzero(s.contributes)
  c = s.contributions
  np.testing.assert_array_equal(c.update, u)
  np.testing.assert_array_equal(c.worker, m)
  np.testing.assert_array_equal(c.read_version, s.read_version[u, m])
  np.testing.assert_array_equal(c.num_batches, s.num_batches[u, m])
  np.testing.assert_array_equal(c.staleness, s.staleness[u, m])
  np.testing.assert_array_equal(np.diff(s.offsets), s.contributes.sum(axis=1))
  np.testing.assert_array_equal(s.max_staleness, s.staleness.max(axis=1))
  assert s.num_contributions == s.contributes.sum()
  for view, dtype in (("contributes", bool), ("read_version", np.int64), ("num_batches", np.int64),
                      ("staleness", np.int64)):
    assert getattr(s, view).dtype == dtype and getattr(s, view).shape == (200, 4)
    assert getattr(s, view) is getattr(s, view) and not getattr(s, view).flags.writeable   # built once
  # The same schedule built from its dense arrays is equal, and so is one built from the rows.
  dense = C.Schedule(time=s.time, contributes=s.contributes, read_version=s.read_version, wait=s.wait,
                     num_batches=s.num_batches, dropped=s.dropped, busy=s.busy, paradigm=s.paradigm,
                     extras=s.extras)
  rows = C.Schedule.from_contributions(s.time, s.offsets, c.worker, c.read_version, s.wait, num_workers=4,
                                       num_batches=c.num_batches, dropped=s.dropped, busy=s.busy,
                                       paradigm=s.paradigm, extras=s.extras)
  assert dense == s and rows == s


def test_without_events_the_contributions_and_totals_are_the_same():
  w = C.workers(5, compute="exponential")
  for paradigm in (C.asp(), C.k_sync(3), C.backup_workers(1)):
    full = C.simulate(paradigm, w, 300, seed=2)
    lean = C.simulate(paradigm, w, 300, seed=2, record_events=False)
    assert not any(k.startswith("event_") for k in lean.extras)
    for field in ("time", "offsets", "wait", "busy", "dropped"):
      np.testing.assert_array_equal(getattr(lean, field), getattr(full, field))
    for a, b in zip(lean.contributions, full.contributions):
      np.testing.assert_array_equal(a, b)
  with pytest.raises(TypeError, match="record_events must be a bool, got 1"):
    C.simulate(C.asp(), w, 10, record_events=1)


def test_a_dense_view_too_large_is_refused_and_the_rest_works_without_it(tmp_path):
  # One contribution per update, as ASP makes, from a million workers: [4096, 1e6] would be 30 GiB.
  num_updates, num_workers = 4096, 1_000_000
  rng = np.random.default_rng(0)
  worker = rng.integers(0, num_workers, num_updates)
  version = np.maximum(np.arange(num_updates) - rng.integers(0, 50, num_updates), 0)
  s = C.Schedule.from_contributions(np.arange(1.0, num_updates + 1), np.arange(num_updates + 1), worker,
                                    version, np.zeros(num_workers), num_workers=num_workers, paradigm="big")
  for view in ("contributes", "read_version", "num_batches", "staleness"):
    with pytest.raises(ValueError, match=rf"schedule.{view} .*\[4096, 1000000\].*4,096,000,000 entries"):
      getattr(s, view)
  tau = np.arange(num_updates) - version
  np.testing.assert_array_equal(s.staleness_histogram(), np.bincount(tau))
  np.testing.assert_array_equal(s.max_staleness, tau)
  assert s.mean_staleness() == pytest.approx(tau.mean())
  assert "1000000 workers" in s.summary()
  path = tmp_path / "big.npz"
  s.save(path)
  assert C.Schedule.load(path) == s
  rest = C.Schedule.from_contributions(
      s.time[1000:], s.offsets[1000:] - 1000, worker[1000:], np.maximum(version[1000:] - 1000, 0),
      np.zeros(num_workers), num_workers=num_workers, paradigm="big")
  joined = C.concatenate([s[:1000], rest])
  np.testing.assert_array_equal(joined.contributions.read_version[1000:], np.maximum(version[1000:], 1000))


@pytest.mark.parametrize("change, match", [
    (dict(offsets=[0, 1, 1]), r"offsets must be non-decreasing from 0 with shape \[num_updates \+ 1\] = \[4\]"),
    (dict(offsets=[0, 2, 1, 3]), "offsets must be non-decreasing"),
    (dict(worker=[0, 3, 1]), r"worker must be in 0..2, got 0..3"),
    (dict(offsets=[0, 2, 2, 3], worker=[1, 1, 0]), "worker must be increasing within each update"),
    (dict(read_version=[0, 2, 1]), r"read_version\[1, 1\] = 2 is not a version available at update 1"),
    (dict(worker=[0, 1]), r"worker must have one entry per contribution, shape \(3,\), got \(2,\)"),
    (dict(num_batches=[1, 0, 1]), "num_batches must be positive"),
    (dict(num_workers=0), "at least one worker, got num_workers=0"),
])
def test_sparse_rows_are_checked(change, match):
  args = dict(offsets=[0, 1, 2, 3], worker=[0, 1, 2], read_version=[0, 0, 1], num_workers=3)
  args.update(change)
  with pytest.raises(ValueError, match=match):
    C.Schedule.from_contributions([1.0, 2.0, 3.0], args.pop("offsets"), args.pop("worker"),
                                  args.pop("read_version"), np.zeros(max(args["num_workers"], 1)), **args)


DENSE_FILES = os.path.join(os.path.dirname(__file__), "data", "dense_format")
FILE_PARADIGMS = {
    "asp": C.asp(), "bsp": C.bsp(), "ssp": C.ssp(1), "dssp": C.dssp(1, 3), "psp": C.psp(2, 1),
    "k_sync": C.k_sync(2), "k_async": C.k_async(2), "k_batch_sync": C.k_batch_sync(4),
    "k_batch_async": C.k_batch_async(2), "softsync": C.softsync(3), "backup_workers": C.backup_workers(1),
    "adasync": C.adasync(2),
}


@pytest.mark.parametrize("name", sorted(FILE_PARADIGMS))
def test_schedules_saved_by_the_dense_code_load_and_equal_todays(name):
  # Written by Schedule.save before schedules were sparse (dense [U, M] arrays), from
  # simulate(paradigm, workers(3, compute="lognormal", stragglers=straggler_window(2, 6, 3, workers=[1])),
  # 30, seed=11): today's simulator gives the same schedule, bit for bit, and the file still loads.
  path = os.path.join(DENSE_FILES, f"{name}.npz")
  with np.load(path) as data:
    assert "contributes" in data.files and data["contributes"].shape == (30, 3)
    dense = {k: data[k] for k in ("contributes", "read_version", "num_batches")}
  loaded = C.Schedule.load(path)
  w = C.workers(3, compute="lognormal", stragglers=C.straggler_window(2.0, 6.0, 3.0, workers=[1]))
  assert loaded == C.simulate(FILE_PARADIGMS[name], w, 30, seed=11)
  for view, value in dense.items():
    np.testing.assert_array_equal(getattr(loaded, view), value)
