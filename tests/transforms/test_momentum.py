"""implicit_momentum / explicit_momentum (Mitliagkas et al., asynchrony begets momentum)."""

import numpy as np
import pytest

import delayjax as dj


@pytest.mark.parametrize("m", [1, 2, 4, 10, 64])
def test_implicit_momentum_of_m_workers(m):
  assert dj.implicit_momentum(m) == pytest.approx(1.0 - 1.0 / m, abs=1e-15)


def test_implicit_momentum_of_geometric_staleness_is_its_q():
  for m in (2, 5, 16):
    q = 1.0 - 1.0 / m
    probs = (1 - q) * q ** np.arange(4000)
    probs /= probs.sum()
    assert dj.implicit_momentum(staleness_probs=probs) == pytest.approx(q, rel=1e-9)


def test_round_robin_staleness_matches_worker_count():
  # M round-robin workers: every gradient has staleness M - 1.
  probs = np.zeros(8)
  probs[7] = 1.0
  assert dj.implicit_momentum(staleness_probs=probs) == pytest.approx(dj.implicit_momentum(8))


def test_explicit_momentum_values_and_sign():
  assert dj.explicit_momentum(0.9, 1) == pytest.approx(0.9)
  assert dj.explicit_momentum(0.9, 10) == pytest.approx(0.0, abs=1e-15)
  assert dj.explicit_momentum(0.9, 20) == pytest.approx(-0.05)
  assert dj.explicit_momentum(0.9, 20, clip=True) == 0.0
  assert dj.explicit_momentum(0.0, 1000) > -1.0
  # The total (explicit + implicit) is the target whenever it is not clipped.
  for m in (1, 3, 7, 50):
    assert dj.explicit_momentum(0.95, m) + dj.implicit_momentum(m) == pytest.approx(0.95)


@pytest.mark.parametrize("kwargs, err, match", [
    ({"target": 1.0, "num_workers": 2}, ValueError, "target must be < 1"),
    ({"target": -0.1, "num_workers": 2}, ValueError, "target must be >= 0.0"),
    ({"target": 0.9, "num_workers": 0}, ValueError, "num_workers must be an integer >= 1"),
    ({"target": 0.9}, ValueError, "exactly one of num_workers and staleness_probs"),
    ({"target": 0.9, "num_workers": 2, "staleness_probs": [1.0]}, ValueError, "exactly one"),
    ({"target": 0.9, "staleness_probs": [0.5, 0.2]}, ValueError, "sum to 1"),
    ({"target": 0.9, "staleness_probs": [1.5, -0.5]}, ValueError, "non-negative"),
    ({"target": 0.9, "staleness_probs": []}, ValueError, "non-empty 1-D"),
    ({"target": 0.9, "num_workers": 2, "clip": 1}, TypeError, "clip must be a bool"),
])
def test_bad_arguments(kwargs, err, match):
  with pytest.raises(err, match=match):
    dj.explicit_momentum(**kwargs)
