"""schedule[:n] is the schedule a run stopped at its n-th update would have recorded."""

import numpy as np
import pytest

import delayjax as dj

PARADIGMS = [dj.cluster.asp(), dj.cluster.ssp(1), dj.cluster.k_sync(3), dj.cluster.dssp(1, 4),
             dj.cluster.k_async(2), dj.cluster.backup_workers(1)]


@pytest.mark.parametrize("paradigm", PARADIGMS, ids=str)
@pytest.mark.parametrize("seed", [0, 1])
def test_cut_equals_a_shorter_run(paradigm, seed):
  cluster = dj.cluster.workers(4, speed=[1.0, 1.0, 2.0, 3.0], seed=seed)
  long = dj.cluster.simulate(paradigm, cluster, 150, seed=seed)
  short = dj.cluster.simulate(paradigm, cluster, 60, seed=seed)
  cut = long[:60]
  for field in ("time", "contributes", "read_version", "num_batches", "dropped", "busy"):
    np.testing.assert_array_equal(getattr(cut, field), getattr(short, field), err_msg=field)
  np.testing.assert_allclose(cut.wait, short.wait, rtol=1e-12, atol=1e-9)
  assert cut.extras.keys() == short.extras.keys()
  for key, value in short.extras.items():
    np.testing.assert_array_equal(cut.extras[key], value, err_msg=key)


def test_cut_bounds():
  schedule = dj.cluster.simulate(dj.cluster.asp(), dj.cluster.workers(3, seed=0), 20, seed=0)
  assert schedule[:100] == schedule
  with pytest.raises(ValueError, match="at least one update"):
    schedule[:0]
  with pytest.raises(TypeError, match=r"schedule\[:n\]"):
    schedule[2:5]
