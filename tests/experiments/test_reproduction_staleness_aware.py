"""experiments.staleness_aware: the alpha0/tau spread claim, and the schedules the seeds' runs share a program with."""

import numpy as np
import pytest

from experiments import staleness_aware as sa

CONFIG = dict(sa.SCALES["quick"])


def _summary(errors):
  """Rows ``{rule}-n{n}`` with per-seed test errors (fractions), ``errors[key]`` a list over seeds."""
  return {key: {"n": int(key.split("-n")[1]), "rule": key.split("-")[0],
                "per_seed": {"test_error": dict(enumerate(values))}}
          for key, values in errors.items()}


def test_lrtau_spread_is_the_per_seed_range_over_n_in_points():
  """Per seed: the largest minus the smallest alpha0/tau error over n, in points, against the 5-point margin."""
  errors = {"lrtau-n1": [0.030, 0.050, 0.025], "lrtau-n5": [0.033, 0.047, 0.031],
            "lrtau-n30": [0.075, 0.047, 0.039]}
  result = sa._lrtau_robust(_summary(errors))
  spreads = [100 * (max(e) - min(e)) for e in zip(*errors.values())]
  c = result.comparison
  assert c.n == 3 and c.mean == pytest.approx(np.mean(spreads))
  tight = {k: [v + 0.001 * i for i in range(6)] for k, v in (("lrtau-n1", 0.03), ("lrtau-n5", 0.031),
                                                              ("lrtau-n30", 0.032))}
  assert sa._lrtau_robust(_summary(tight)).verdict == "held"
  wide = {"lrtau-n1": [0.03] * 4, "lrtau-n5": [0.03] * 4, "lrtau-n30": [0.15, 0.16, 0.14, 0.15]}
  assert sa._lrtau_robust(_summary(wide)).verdict == "not held"


def test_shared_program_schedules_match_the_runs_own_largest_contribution():
  """``like`` may only hold schedules with the run's most minibatches per contribution (dj.simulate refuses
  others); 1-softsync's seeds differ in it, and the cached schedule is the one each seed's run simulates."""
  updates = CONFIG["steps"] // CONFIG["learners"]
  cluster = (1, CONFIG["learners"], CONFIG["compute"], updates)
  most = {s: int(sa.schedule(*cluster, s).num_batches.max()) for s in range(4)}
  assert len(set(most.values())) > 1
  assert sa.schedule(*cluster, 0) is sa.schedule(*cluster, 0)
  assert all(m >= 1 for m in most.values())
