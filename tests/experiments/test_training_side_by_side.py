"""experiments._training.side_by_side and shared_progress: a batch's separate calls computed at once, one progress."""

import os
import threading
import time

import pytest

from experiments import _training


@pytest.fixture
def two_cpus(monkeypatch):
  monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1}, raising=False)


def test_the_calls_run_at_once_and_their_results_keep_the_calls_order(two_cpus):
  # Each call waits for the other at the barrier: it passes only if both run at the same time.
  barrier = threading.Barrier(2, timeout=10)

  def call(value):
    barrier.wait()
    return value

  assert _training.side_by_side([lambda: call("first"), lambda: call("second"), lambda: "third"]) == [
      "first", "second", "third"]


def test_the_calls_run_under_the_callers_jax_config(two_cpus):
  import jax

  def settings():
    return str(getattr(jax.config.jax_numpy_dtype_promotion, "value", jax.config.jax_numpy_dtype_promotion)), bool(
        jax.config.jax_enable_x64)

  with jax.numpy_dtype_promotion("standard"), jax.enable_x64(True):
    inside = _training.side_by_side([settings, settings])
  with jax.numpy_dtype_promotion("strict"), jax.enable_x64(False):
    strict = _training.side_by_side([settings, settings])
  assert inside == [("standard", True)] * 2 and strict == [("strict", False)] * 2


def test_one_cpu_calls_them_in_order(monkeypatch):
  monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0}, raising=False)
  order = []
  assert _training.side_by_side([lambda: order.append(threading.current_thread()) or 1,
                                 lambda: order.append(threading.current_thread()) or 2]) == [1, 2]
  assert order == [threading.main_thread()] * 2


def test_a_failing_call_is_raised_once_every_call_has_ended(two_cpus):
  ended = []

  def slow():
    time.sleep(0.2)
    ended.append(True)
    return 1

  def failing():
    raise ValueError("the first call failed")

  with pytest.raises(ValueError, match="the first call failed"):
    _training.side_by_side([failing, slow])
  assert ended == [True]


def test_shared_progress_tells_the_sums_of_the_parts_heard_from():
  told = []
  first, second = _training.shared_progress(lambda done, total: told.append((done, total)), 2)
  first(10, 40)
  second(5, 80)
  first(40, 40)
  second(80, 80)
  assert told == [(10, 40), (15, 120), (45, 120), (120, 120)]
