"""Bad input fails early with a message naming the argument, what was given and what is allowed."""

import math

import numpy as np
import pytest

import delayjax as dj
from delayjax.cluster._simulate import record_bytes_per_update

C = dj.cluster


@pytest.mark.parametrize("make,error,match", [
    (lambda: C.workers(0), ValueError, r"num_workers must be an integer >= 1, got 0"),
    (lambda: C.workers(-3), ValueError, r"num_workers must be an integer >= 1, got -3"),
    (lambda: C.workers(2.5), TypeError, r"num_workers must be an integer, got 2.5"),
    (lambda: C.exponential(-1.0), ValueError, r"mean must be > 0.0, got -1.0"),
    (lambda: C.exponential(math.nan), ValueError, r"mean must be finite, got nan"),
    (lambda: C.gamma(shape=2.0, mean=0.0), ValueError, r"mean must be > 0.0, got 0.0"),
    (lambda: C.gamma(shape=-1.0), ValueError, r"shape must be > 0.0, got -1.0"),
    (lambda: C.lognormal(mean=-2.0), ValueError, r"mean must be > 0.0, got -2.0"),
    (lambda: C.lognormal(sigma=-0.1), ValueError, r"sigma must be >= 0.0, got -0.1"),
    (lambda: C.constant(-1.0), ValueError, r"value must be >= 0.0, got -1.0"),
    (lambda: C.constant(math.nan), ValueError, r"value must be finite, got nan"),
    (lambda: C.uniform(2.0, 1.0), ValueError, r"high must be >= low, got low=2.0, high=1.0"),
    (lambda: C.workers(2, compute=-1.0), ValueError, r"compute must be >= 0.0, got -1.0"),
    (lambda: C.workers(2, compute=math.nan), ValueError, r"compute must be finite, got nan"),
    (lambda: C.workers(2, comm=-0.5), ValueError, r"comm must be >= 0.0, got -0.5"),
    (lambda: C.workers(2, compute="weibull"), ValueError,
     r"compute must be a time model or one of 'constant', 'uniform', 'exponential', 'gamma', 'lognormal'; "
     r"got 'weibull'"),
    (lambda: C.workers(2, comm="pareto"), ValueError, r"comm must be a time model or one of .*got 'pareto'"),
    (lambda: C.workers(2, compute=object()), TypeError, r"compute must be a time model .* got <object"),
    (lambda: C.workers(3, compute=["gamma", "gamma"]), ValueError,
     r"compute as a sequence must have one model per worker \(3\), got 2"),
    (lambda: C.workers(2, compute=["gamma", -1.0]), ValueError, r"compute\[1\] must be >= 0.0, got -1.0"),
    (lambda: C.workers(2, speed=[1.0, 0.0]), ValueError, r"speed must be finite and > 0 for every worker"),
    (lambda: C.workers(2, speed=[1.0, math.nan]), ValueError, r"speed must be finite and > 0"),
    (lambda: C.workers(3, speed=[1.0, 2.0]), ValueError, r"speed must be a number or have one entry per worker \(3\)"),
    (lambda: C.replay([[1.0, -1.0]]), ValueError, r"times must be finite and > 0 seconds .*got -1.0"),
    (lambda: C.replay([[1.0, math.nan]]), ValueError, r"times must be finite and > 0 seconds .*got nan"),
    (lambda: C.replay([[1.0, 0.0]]), ValueError, r"times must be finite and > 0 seconds .*got 0.0"),
    (lambda: C.workers(1, compute=[[0.0, 0.0]]), ValueError, r"compute \(measured times to replay\): times must be "
     r"finite and > 0"),
    (lambda: C.workers(2, compute=0.0), ValueError, r"compute must be a compute time > 0 seconds .*got the constant 0.0"),
    (lambda: C.workers(2, compute=C.constant(0.0)), ValueError, r"compute must be a compute time > 0 seconds"),
    (lambda: C.workers(2, compute=[1.0, C.constant(0.0)]), ValueError, r"compute\[1\] must be a compute time > 0"),
    (lambda: C.workers(2, compute=C.uniform(0.0, 0.0)), ValueError,
     r"compute must draw compute times > 0 seconds, got uniform\(low=0.0, high=0.0\)"),
    (lambda: C.replay([1.0, 2.0]), ValueError, r"times must be a non-empty 2-D array .* got shape \(2,\)"),
    (lambda: C.workers(3, compute=np.ones((2, 4))), ValueError,
     r"compute replay times must have one row per worker \(3\), got shape \(2, 4\)"),
    (lambda: C.random_stragglers(1.5), ValueError, r"probability must be <= 1.0, got 1.5"),
    (lambda: C.random_stragglers(0.1, slowdown=0.5), ValueError, r"slowdown must be >= 1.0, got 0.5"),
    (lambda: C.straggler_window(5.0, 1.0), ValueError, r"stop must be >= start, got start=5.0, stop=1.0"),
    (lambda: C.workers(2, stragglers=C.random_stragglers(0.1, workers=[5])), ValueError,
     r"workers must be indices in 0..1, got \(5,\)"),
    (lambda: C.workers(2, stragglers=["often"]), TypeError, r"stragglers must be random_stragglers"),
    (lambda: C.ssp(-1), ValueError, r"staleness must be an integer >= 0, got -1"),
    (lambda: C.dssp(5, 3), ValueError, r"s_lower must be <= s_upper, got s_lower=5, s_upper=3"),
    (lambda: C.dssp(-1, 3), ValueError, r"s_lower must be an integer >= 0, got -1"),
    (lambda: C.k_sync(0), ValueError, r"k must be an integer >= 1, got 0"),
    (lambda: C.k_async(0), ValueError, r"k must be an integer >= 1, got 0"),
    (lambda: C.k_batch_sync(0), ValueError, r"k must be an integer >= 1, got 0"),
    (lambda: C.k_batch_async(-2), ValueError, r"k must be an integer >= 1, got -2"),
    (lambda: C.softsync(0), ValueError, r"n must be an integer >= 1, got 0"),
    (lambda: C.backup_workers(-1), ValueError, r"b must be an integer >= 0, got -1"),
    (lambda: C.psp(0, 1), ValueError, r"sample_size must be an integer >= 1, got 0"),
    (lambda: C.adasync(0), ValueError, r"k0 must be an integer >= 1, got 0"),
    (lambda: C.ssp(1.5), TypeError, r"staleness must be an integer, got 1.5"),
])
def test_bad_construction(make, error, match):
  with pytest.raises(error, match=match):
    make()


W3 = C.workers(3)


@pytest.mark.parametrize("paradigm,match", [
    (C.k_sync(4), r"k must be <= the number of workers \(3\), got 4"),
    (C.k_async(5), r"k must be <= the number of workers \(3\), got 5"),
    (C.backup_workers(3), r"b must be < the number of workers \(3\) so that N = M - b >= 1, got 3"),
    (C.psp(4, 1), r"sample_size must be <= the number of workers \(3\), got 4"),
    (C.softsync(4), r"n must be <= the number of workers .*\(3\), got 4"),
    (C.adasync(4), r"k0 must be <= the number of workers \(3\), got 4"),
])
def test_paradigm_too_big_for_the_cluster(paradigm, match):
  with pytest.raises(ValueError, match=match):
    C.simulate(paradigm, W3, 10)


def test_k_batch_forms_may_count_more_minibatches_than_workers():
  sched = C.simulate(C.k_batch_sync(7), W3, 10)
  np.testing.assert_array_equal(sched.num_batches.sum(axis=1), 7)


@pytest.mark.parametrize("call,error,match", [
    (lambda: C.simulate(C.asp(), W3, 0), ValueError, r"num_updates must be an integer >= 1, got 0"),
    (lambda: C.simulate(C.asp(), W3, -5), ValueError, r"num_updates must be an integer >= 1, got -5"),
    (lambda: C.simulate(C.asp(), W3, 10.0), TypeError, r"num_updates must be an integer, got 10.0"),
    (lambda: C.simulate(C.asp(), W3, 10, seed=-1), ValueError, r"seed must be an integer >= 0, got -1"),
    (lambda: C.simulate("asp", W3, 10), TypeError,
     r"paradigm must be a paradigm such as dj.cluster.ssp\(3\), got 'asp'"),
    (lambda: C.simulate(C.asp(), 3, 10), TypeError, r"workers must be built with dj.cluster.workers\(...\), got 3"),
    (lambda: C.Simulation(C.asp(), W3), TypeError, r"paradigm must be one of bsp\(\), k_sync\(k\), .* got asp\(\)"),
    (lambda: C.Simulation(C.bsp(), W3).run(0), ValueError, r"num_updates must be an integer >= 1, got 0"),
    (lambda: C.Simulation(C.adasync(1), W3).feedback(-1.0), ValueError, r"loss must be > 0.0, got -1.0"),
    (lambda: C.Simulation(C.adasync(1), W3).feedback(math.nan), ValueError, r"loss must be finite, got nan"),
])
def test_bad_simulation_arguments(call, error, match):
  with pytest.raises(error, match=match):
    call()


@pytest.mark.parametrize("call, match", [
    (lambda: C.simulate(C.asp(), W3, 10**15), r"^num_updates=1000000000000000 with asp\(\) on 3 workers: .*needs"),
    (lambda: C.simulate(C.bsp(), W3, 10**13, record_events=False), r"^num_updates=10000000000000 with bsp\(\)"),
    (lambda: C.Simulation(C.bsp(), W3).run(10**14), r"^num_updates=100000000000000 with bsp\(\)"),
    (lambda: C.simulate_gossip(C.allreduce(), W3, 10**14), r"^num_steps=100000000000000 on 3 replicas"),
    (lambda: C.pipeline("gpipe", 4, 10**12), r"^num_updates=1000000000000 x num_microbatches=1 on num_stages=4"),
])
def test_a_run_whose_record_cannot_fit_is_refused_before_it_starts(call, match):
  """These were accepted and grew until the machine ran out of memory."""
  with pytest.raises(ValueError, match=match + r".*bytes\), more than the .* of available host memory\."):
    call()


def _recorded_bytes(sched: C.Schedule) -> int:
  c = sched.contributions
  return sched.time.nbytes + 8 * (sched.num_updates + 1) + c.worker.nbytes + c.read_version.nbytes + sum(
      v.nbytes for k, v in sched.extras.items() if k.startswith("event_"))


@pytest.mark.parametrize("paradigm", [C.asp(), C.ssp(1), C.psp(2, 1), C.dssp(0, 2), C.k_async(2), C.k_batch_async(3),
                                      C.softsync(1), C.backup_workers(1), C.bsp(), C.k_sync(2), C.k_batch_sync(4),
                                      C.adasync(2), C.elastic_bsp(2), C.predictive_cutoff(3)], ids=str)
@pytest.mark.parametrize("record_events", [True, False])
def test_the_memory_estimate_is_a_lower_bound_of_the_record(paradigm, record_events):
  """The refusal above fires only for a run that could not fit: the estimate never exceeds what is recorded."""
  sched = C.simulate(paradigm, W3, 300, record_events=record_events)
  assert 300 * record_bytes_per_update(paradigm, 3, record_events) <= _recorded_bytes(sched)
