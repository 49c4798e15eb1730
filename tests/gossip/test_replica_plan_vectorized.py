"""The array-operation replica planner of ``dj.simulate_gossip`` gives exactly the plans of the
one-event-at-a-time reference (``replica_plan_reference.py``), table by table, on random gossip schedules."""

from __future__ import annotations

import numpy as np
import pytest

import delayjax as dj
from delayjax.runtime._replica_plan import make_plan
from tests.gossip import replica_plan_reference

C, T = dj.cluster, dj.topology


def assert_same_plan(new, old):
  for name in old._fields:
    a, b = getattr(new, name), getattr(old, name)
    if name == "tables":
      assert sorted(a) == sorted(b)
      for key in b:
        assert a[key].dtype == b[key].dtype and a[key].shape == b[key].shape, key
        np.testing.assert_array_equal(a[key], b[key], err_msg=key)
    elif isinstance(b, np.ndarray):
      np.testing.assert_array_equal(a, b, err_msg=name)
    else:
      assert a == b, (name, a, b)


PARADIGMS = {
    "ad_psgd_ring": lambda m: C.ad_psgd(T.ring(m)),
    "ad_psgd": lambda m: C.ad_psgd(),
    "d_psgd_ring": lambda m: C.d_psgd(T.ring(m)),
    "d_psgd_complete": lambda m: C.d_psgd(T.complete(m)),
    "d_psgd_exponential": lambda m: C.d_psgd(T.exponential(m)),
    "sgp0": lambda m: C.sgp(0),
    "sgp2": lambda m: C.sgp(2),
    "allreduce": lambda m: C.allreduce(),
    "gossipgrad": lambda m: C.gossipgrad(seed=1),
}


@pytest.mark.parametrize("paradigm", sorted(PARADIGMS))
def test_gossip_schedules(paradigm):
  rng = np.random.default_rng(sorted(PARADIGMS).index(paradigm))
  for seed in range(2):
    num_workers = int(rng.choice([4, 6, 8, 12]))
    workers = C.workers(num_workers, compute=str(rng.choice(["exponential", "constant"])),
                        comm=float(rng.choice([0.0, 0.3, 1.5])), seed=seed)
    failures = C.failures(drop=0.2) if paradigm.startswith(("ad_psgd", "d_psgd")) and seed else None
    schedule = C.simulate_gossip(PARADIGMS[paradigm](num_workers), workers, int(rng.integers(5, 25)), seed=seed,
                                 failures=failures)
    for devices, phases in ((1, None), (2, None), (int(rng.choice([1, 2, 4])), int(rng.choice([1, 2, 4])))):
      assert_same_plan(make_plan(schedule, phases=phases, num_devices=devices),
                       replica_plan_reference.make_plan(schedule, phases=phases, num_devices=devices))
