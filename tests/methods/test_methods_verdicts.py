"""The paired intervals and verdicts the methods' reproductions decide their claims with."""

import math

import numpy as np
from scipy import stats

from experiments.generalization import paired_interval, verdict
from experiments.sme import band


def test_paired_interval_is_the_t_interval():
  d = np.array([0.3, -0.1, 0.5, 0.2, 0.4])
  mean, low, high = paired_interval(d)
  want = stats.t.interval(0.95, d.size - 1, loc=d.mean(), scale=stats.sem(d))
  np.testing.assert_allclose([mean, low, high], [d.mean(), *want], rtol=1e-12)
  assert all(math.isnan(v) for v in paired_interval([1.0])[1:])
  assert math.isnan(paired_interval([1.0, float("nan")])[1])


def test_verdicts_hold_fail_or_stay_inconclusive():
  assert verdict(-0.3, -0.1, -1) is True
  assert verdict(0.1, 0.3, -1) is False
  assert verdict(-0.1, 0.2, -1) is None  # a tie is inconclusive
  assert verdict(float("nan"), 1.0, 1) is None
  assert band(0.95, 1.05, 0.9, 1.1) is True
  assert band(0.5, 0.7, 0.9, 1.1) is False
  assert band(0.85, 1.0, 0.9, 1.1) is None
