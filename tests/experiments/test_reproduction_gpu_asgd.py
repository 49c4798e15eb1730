"""experiments.gpu_asgd: the workers are the pipelines' makespans, and every spec computes the same gradients."""

import math

import numpy as np
import pytest

from experiments import gpu_asgd

CONFIG = dict(gpu_asgd.SCALES["quick"], steps=48)


def test_worker_times_are_each_workers_own_gpipe_makespans():
  """With equal stage times, every minibatch takes (m + K - 1)(t_f + t_b); worker w is the same in every spec."""
  K, m = CONFIG["stages"], CONFIG["microbatches"]
  hand = (m + K - 1) * (CONFIG["forward"] + CONFIG["backward"])
  table = gpu_asgd.worker_times(dict(CONFIG, stage_shape=1e12), 3)  # gamma of huge shape: the mean, to 1e-5
  np.testing.assert_allclose(table, hand, rtol=1e-4)
  random = gpu_asgd.worker_times(CONFIG, 4)
  np.testing.assert_array_equal(random[:2], gpu_asgd.worker_times(CONFIG, 2))
  assert random.shape == (4, CONFIG["steps"]) and np.all(random >= hand * 0.3)
  assert len(np.unique(random[:, 0])) == 4  # each worker's pipeline draws its own stage times


def test_every_spec_computes_the_same_number_of_gradients():
  for spec in gpu_asgd.specs(CONFIG):
    sched = gpu_asgd.schedule(CONFIG, spec, 0)
    assert int(np.count_nonzero(sched.contributes)) == CONFIG["steps"], spec["key"]
    expected = CONFIG["steps"] // spec["workers"] if spec["paradigm"] == "bsp" else CONFIG["steps"]
    assert sched.num_updates == expected, spec["key"]
    if spec["paradigm"] == "bsp" or spec["workers"] == 1:
      assert int(sched.staleness.max()) == 0
    else:
      assert int(sched.staleness.max()) >= spec["workers"] - 1
    # Each gradient took its worker's pipeline minibatch time (ASP never waits).
    if spec["paradigm"] == "asp":
      ev = sched.extras
      table = gpu_asgd.worker_times(CONFIG, spec["workers"])
      for w in range(spec["workers"]):
        mine = ev["event_worker"] == w
        took = (ev["event_end_time"] - ev["event_read_time"])[mine]
        np.testing.assert_allclose(took, table[w, np.arange(mine.sum()) % CONFIG["steps"]], rtol=1e-9)


def test_speedup_claim_is_the_per_seed_log_ratio_against_half_of_m():
  def row(paradigm, workers, times):
    return {"paradigm": paradigm, "workers": workers, "speedup": 1.0,
            "per_seed": {"time_to_target_bound": dict(enumerate(times))}}

  m = CONFIG["workers"]
  summary = {"pipe-M1": row("asp", 1, [100.0, 120.0, 90.0, 110.0]),
             "gpu-asgd-M2": row("asp", 2, [60.0, 70.0, 50.0, 60.0]),
             f"gpu-asgd-M{m}": row("asp", m, [30.0, 32.0, 28.0, 30.0]),
             f"sync-pipe-M{m}": row("bsp", m, [50.0, 55.0, 45.0, 52.0])}
  assert gpu_asgd.speedups(summary, f"gpu-asgd-M{m}") == pytest.approx(
      {0: math.log(100 / 30), 1: math.log(120 / 32), 2: math.log(90 / 28), 3: math.log(110 / 30)})
  assert gpu_asgd._speedup(summary).verdict == "held"
  assert gpu_asgd._faster_than_sync(summary).verdict == "held"
  assert gpu_asgd._more_clients(summary).verdict == "held"
  summary[f"gpu-asgd-M{m}"] = row("asp", m, [60.0, 65.0, 55.0, 62.0])  # about 1.8x: below M / 2 = 2
  assert gpu_asgd._speedup(summary).verdict == "not held"
