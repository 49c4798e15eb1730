"""The array-operation planner of ``dj.simulate`` gives exactly the plans of the one-contribution-at-a-time
reference (``plan_reference.py``), field by field, on random schedules of every kind it meets."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

import delayjax as dj
from delayjax.runtime import _waves
from delayjax.runtime._waves import plan_steps
from tests.runtime import plan_reference


def assert_same_plan(new, old):
  for field in dataclasses.fields(old):
    a, b = getattr(new, field.name), getattr(old, field.name)
    if isinstance(b, np.ndarray):
      assert a.dtype == b.dtype and a.shape == b.shape, (field.name, a.dtype, b.dtype, a.shape, b.shape)
      np.testing.assert_array_equal(a, b, err_msg=field.name)
    else:
      assert a == b, (field.name, a, b)


PARADIGMS = {
    "asp": dj.cluster.asp,
    "ssp2": lambda: dj.cluster.ssp(2),
    "bsp": dj.cluster.bsp,
    "ksync": lambda: dj.cluster.k_sync(2),
    "kasync": lambda: dj.cluster.k_async(2),
    "kbatch": lambda: dj.cluster.k_batch_sync(3),
    "backup": lambda: dj.cluster.backup_workers(1),
    "softsync": lambda: dj.cluster.softsync(2),
}


def cluster_schedule(paradigm, num_workers, num_updates, seed, compute="exponential"):
  return dj.cluster.simulate(PARADIGMS[paradigm](), dj.cluster.workers(num_workers, compute=compute, seed=seed),
                             num_updates=num_updates, seed=seed)


def both(schedule, num_workers, num_devices=1, **kwargs):
  workers = -(-num_workers // num_devices) * num_devices
  new = plan_steps(schedule, workers, num_devices, **kwargs)
  old = plan_reference.plan_steps(schedule, workers, num_devices, **kwargs)
  assert_same_plan(new, old)
  return new


@pytest.mark.parametrize("paradigm", sorted(PARADIGMS))
def test_cluster_schedules(paradigm):
  rng = np.random.default_rng(sorted(PARADIGMS).index(paradigm))
  for seed in range(3):
    num_workers = int(rng.choice([3, 4, 7, 16]))
    schedule = cluster_schedule(paradigm, num_workers, int(rng.integers(50, 400)), seed,
                                compute=str(rng.choice(["exponential", "constant", "uniform"])))
    both(schedule, num_workers)
    both(schedule, num_workers, num_devices=int(rng.choice([2, 4])))
    both(schedule, num_workers, lanes=int(rng.integers(1, num_workers + 2)))


def test_local_steps_sequential_workers_and_epochs():
  rng = np.random.default_rng(7)
  for seed in range(4):
    num_workers = int(rng.choice([3, 5, 8]))
    paradigm = ["asp", "ssp2", "ksync", "kbatch"][seed]
    schedule = cluster_schedule(paradigm, num_workers, 300, seed)
    devices = int(rng.choice([1, 2]))
    padded = -(-num_workers // devices) * devices
    steps = rng.integers(1, 4, padded)
    epoch = int(rng.integers(5, 40))
    both(schedule, num_workers, devices, local_steps=steps, sequential_workers=True)
    both(schedule, num_workers, devices, not_before=np.arange(300) // epoch * epoch)
    both(schedule, num_workers, devices, local_steps=steps, sequential_workers=True, lanes=2,
         not_before=np.arange(300) // epoch * epoch)


def stale_read_schedule(max_delays, num_updates, seed):
  """A stale-read schedule as ``dj.simulate`` builds one from a delay model (one contribution per update, from
  worker ``u mod (D + 1)``), with uniform delays drawn by NumPy; per group when ``max_delays`` has several."""
  rng = np.random.default_rng(seed)
  t = np.arange(num_updates)
  versions = np.maximum(0, t[:, None] - rng.integers(0, np.asarray(max_delays) + 1, (num_updates, len(max_delays))))
  num_workers = max(max_delays) + 1
  schedule = dj.cluster.Schedule.from_contributions(
      t.astype(np.float64), np.arange(num_updates + 1), t % num_workers, versions.min(axis=1),
      np.zeros(num_workers), num_workers=num_workers)
  return schedule, versions


def random_schedule(rng, num_workers, num_updates, max_delay):
  """Updates of 0 to 3 distinct workers, each read at most ``max_delay`` versions before: workers read
  again while older gradients wait, so the plans need several slots."""
  sizes = rng.integers(0, min(3, num_workers) + 1, num_updates)
  sizes[0] = max(sizes[0], 1)
  worker = np.concatenate([np.sort(rng.choice(num_workers, k, replace=False)) for k in sizes])
  update = np.repeat(np.arange(num_updates), sizes)
  read = np.maximum(0, update - rng.integers(0, max_delay + 1, update.size))
  return dj.cluster.Schedule.from_contributions(
      np.arange(num_updates, dtype=np.float64), np.concatenate([[0], np.cumsum(sizes)]), worker, read,
      np.zeros(num_workers), num_workers=num_workers, num_batches=rng.integers(1, 3, update.size))


def test_stale_reads_and_per_leaf_groups():
  for seed, max_delay in enumerate([5, 12, 0, 3]):
    schedule, _ = stale_read_schedule([max_delay], 400, seed)
    both(schedule, schedule.num_workers)
    both(schedule, schedule.num_workers, num_devices=2)
  for seed in range(3):
    schedule, versions = stale_read_schedule([4, 2, 7], 300, seed)
    both(schedule, schedule.num_workers, group_versions=versions)
    both(schedule, schedule.num_workers, num_devices=2, group_versions=versions, lanes=3)


def test_many_workers_and_updates_without_contributions():
  schedule = cluster_schedule("asp", 64, 1500, 0)
  both(schedule, 64)
  both(schedule, 64, num_devices=8)
  # Updates 0, 3, 4 and 7 have no contribution.
  offsets = np.array([0, 0, 2, 3, 3, 3, 5, 6, 6])
  sparse = dj.cluster.Schedule.from_contributions(
      np.arange(8.0), offsets, np.array([0, 1, 2, 0, 1, 2]), np.array([0, 0, 1, 2, 3, 5]), np.zeros(3),
      num_workers=3)
  for lanes in (None, 1, 2):
    both(sparse, 3, lanes=lanes)
    both(sparse, 4, num_devices=2, lanes=lanes)


def test_random_schedules_that_need_several_slots():
  rng = np.random.default_rng(11)
  slots = set()
  for _ in range(40):
    num_workers = int(rng.choice([2, 3, 4, 8, 16]))
    schedule = random_schedule(rng, num_workers, int(rng.integers(5, 200)), int(rng.integers(0, 20)))
    devices = int(rng.choice([1, 2]))
    kwargs = {"lanes": int(rng.integers(1, num_workers + 3))} if rng.random() < 0.3 else {}
    if rng.random() < 0.3:
      kwargs.update(local_steps=rng.integers(1, 4, -(-num_workers // devices) * devices), sequential_workers=True)
    if rng.random() < 0.3:
      epoch = int(rng.integers(2, 50))
      kwargs["not_before"] = np.arange(schedule.num_updates) // epoch * epoch
    slots.add(both(schedule, num_workers, devices, **kwargs).num_slots)
  assert max(slots) >= 4  # the slot search is exercised


def test_chunk_tables_are_the_reference_dense_tables():
  """The plan keeps its reads as one flat list; ``tables`` must still give every chunk the reference's
  ``[steps, most reads of a step]`` rows (padded with worker ``num_workers``), past the last step too."""
  cases = [(cluster_schedule("asp", 64, 600, 1), 64, {}), (cluster_schedule("ssp2", 7, 300, 2), 8, {"num_devices": 2})]
  schedule, versions = stale_read_schedule([4, 2, 7], 300, 5)
  cases.append((schedule, schedule.num_workers, {"group_versions": versions}))
  for schedule, num_workers, kwargs in cases:
    new = plan_steps(schedule, num_workers, **kwargs)
    old, dense = plan_reference.plan_steps(schedule, num_workers, dense_reads=True, **kwargs)
    assert_same_plan(new, old)
    steps, width = dense["read_worker"].shape
    assert new.read_width == width and new.read_worker.size < dense["read_worker"].size
    for first, count in [(0, steps), (0, 7), (steps - 5, 9), (steps + 2, 3)]:
      rows = new.tables(first, count)
      for name, fill in (("read_worker", num_workers), ("read_slot", 0), ("read_group", 0)):
        want = np.full((count, width), fill, np.int32)
        part = dense[name][first:first + count]
        want[:part.shape[0]] = part
        np.testing.assert_array_equal(rows[name], want, err_msg=name)
      for name in ("lane_worker", "upd_pos", "read_begin", "read_end", "read_first"):
        want = getattr(old, name)[first:first + count]
        np.testing.assert_array_equal(rows[name][:want.shape[0]], want, err_msg=name)


def test_more_steps_than_contributions_per_lane():
  """Reads of the newest version only: one gradient per step whatever the width, so the placement's step
  tables outgrow their first size (contributions / lanes)."""
  schedule, _ = stale_read_schedule([0], 400, 0)
  for lanes in (2, 8):
    assert both(schedule, schedule.num_workers, lanes=lanes).num_steps == 400


def test_one_device_placement_is_the_general_placement():
  """The one-device placement (free lanes and pointers in one table, steps only, lanes and versions found
  afterwards, placed in pieces as the lane choice continues it) gives the steps, lanes and versions of the general
  placement loop (devices and predecessors), which ``after = -1`` everywhere forces."""
  rng = np.random.default_rng(23)
  for case in range(60):
    num_workers = int(rng.choice([1, 2, 4, 16]))
    num_updates = int(rng.integers(1, 300))
    if case % 3 == 0:
      schedule = random_schedule(rng, num_workers, num_updates, int(rng.integers(0, 20)))
    else:
      paradigm = ["asp", "ssp2", "softsync", "ksync"][case % (4 if num_workers >= 2 else 2)]
      schedule = cluster_schedule(paradigm, num_workers, num_updates, case)
    cu, ready = schedule.contributions.update, schedule.contributions.read_version
    if rng.random() < 0.3:  # epochs (SVRG): computed no earlier than the update's epoch start
      epoch = int(rng.integers(2, 40))
      ready = np.maximum(ready, cu // epoch * epoch)
    lanes = int(rng.integers(1, num_workers + 3))
    step, versions, lane = _waves._assign_steps(cu, ready, np.zeros_like(cu), 1, lanes, np.full(cu.size, -1))
    placement = _waves._Placement(lanes, int(rng.integers(0, cu.size + 1)))
    cuts = np.sort(rng.integers(0, cu.size + 1, 2))
    for lo, hi in zip([0, *cuts], [*cuts, cu.size]):
      assert placement.extend(cu[lo:hi], ready[lo:hi])
    new_step, new_lane, new_versions = placement.finish(cu)
    np.testing.assert_array_equal(new_step, step)
    np.testing.assert_array_equal(new_lane, lane)
    np.testing.assert_array_equal(new_versions, versions)
    # A cost limit stops both, or neither.
    limit = (len(versions) - int(rng.integers(0, 3))) * (lanes + _waves._STEP_COST)
    stopped = not _waves._Placement(lanes, cu.size).extend(cu, ready, limit)
    assert stopped == (_waves._assign_steps(cu, ready, np.zeros_like(cu), 1, lanes, np.full(cu.size, -1), limit)
                       is None)


def test_lane_choice_placement_is_continued(monkeypatch):
  """Past the updates the lane choice plans, the chosen width's placement of them is continued with the
  rest (one device) or redone (elsewhere): the plans are still the reference's."""
  monkeypatch.setattr(_waves, "_CHOICE_UPDATES", 37)
  monkeypatch.setattr(plan_reference, "_CHOICE_UPDATES", 37)
  rng = np.random.default_rng(5)
  for seed, paradigm in enumerate(["asp", "ssp2", "softsync", "ksync", "asp"]):
    num_workers = int(rng.choice([2, 4, 16]))
    both(cluster_schedule(paradigm, num_workers, 250, seed), num_workers)
  both(random_schedule(rng, 8, 200, 12), 8)
  both(cluster_schedule("asp", 4, 200, 9), 4, not_before=np.arange(200) // 30 * 30)
  # Elsewhere (several devices, workers in sequence) the choice's placement is reused only when whole.
  both(cluster_schedule("ssp2", 8, 200, 4), 8, num_devices=2)
  both(cluster_schedule("asp", 4, 200, 6), 4, local_steps=np.full(4, 2), sequential_workers=True)
  monkeypatch.setattr(_waves, "_CHOICE_UPDATES", 200)
  monkeypatch.setattr(plan_reference, "_CHOICE_UPDATES", 200)
  both(cluster_schedule("ssp2", 8, 200, 4), 8, num_devices=2)
