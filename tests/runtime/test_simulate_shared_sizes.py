"""Runs of one sweep share a compiled program: the plan's sizes are rounded up, and rounding changes no bit."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import delayjax as dj
from delayjax.runtime import _engine as engine
from delayjax.runtime import _simulate
from delayjax.runtime._waves import plan_steps
from simulate_reference import compiled_by

WORKERS = 8
UPDATES = 160


@pytest.fixture(scope="module")
def data():
  rng = np.random.default_rng(0)
  x = rng.normal(size=(96, 5)).astype(np.float32)
  return {"x": x, "y": (x @ rng.normal(size=5) > 0).astype(np.int32)}


def _loss(params, batch):
  logits = jnp.tanh(batch["x"] @ params["w1"]) @ params["w2"]
  return jnp.mean(optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"]))


PARAMS = {"w1": 0.3 * jnp.ones((5, 6), jnp.float32), "w2": 0.1 * jnp.ones((6, 2), jnp.float32)}


def _schedule(paradigm, seed):
  return dj.cluster.simulate(paradigm, dj.cluster.workers(WORKERS, compute="gamma"), UPDATES, seed=seed)


# The plan's own sizes, unrounded (what a program per run would use).
_exact_sizes = functools.partial(_simulate._program_sizes, rounded=False)


def test_seeds_of_a_sweep_share_programs_although_their_plans_differ(data):
  schedules = [_schedule(dj.cluster.asp(), seed) for seed in range(5)]
  plans = [plan_steps(s, WORKERS) for s in schedules]
  exact = {(_exact_sizes(p), p.num_steps) for p in plans}
  rounded = {(_simulate._program_sizes(p), _simulate._shared_length(p.num_steps)) for p in plans}
  # Rounding has boundaries (a plan just past one rounds up to the next size), so a sweep may still
  # compile more than once, but not once per run.
  assert len(rounded) < len(exact) < len(plans) + 1, (rounded, exact)

  def run(i):
    return dj.simulate(_loss, optax.sgd(0.1), PARAMS, data, schedules[i], sampling=dj.Sampling(batch_size=8), seed=i)

  engine.clear_cache()
  compiled = [len(compiled_by(lambda: run(i))[0]) > 0 for i in range(5)]
  assert sum(compiled) == len(rounded), compiled


PARADIGMS = {"asp": dj.cluster.asp(), "softsync": dj.cluster.softsync(3), "ssp": dj.cluster.ssp(2)}
_TX = optax.chain(dj.scale_by_staleness("inverse"), optax.sgd(0.1, momentum=0.5))
_ROUNDED_AND_OWN = {}


def _run(data, schedule, max_memory=None):
  return dj.simulate(_loss, _TX, PARAMS, data, schedule, sampling=dj.Sampling(batch_size=8), seed=1,
                     record=dj.Record(eval_fn=lambda p: {"w": p["w1"].sum()}, every=20),
                     execution=dj.Execution(max_memory=max_memory))


def _rounded_and_own(data, name):
  """A paradigm's schedule, and its run with the rounded sizes and with the plan's own (each compiled once for
  the module: the asp runs serve two tests)."""
  if name not in _ROUNDED_AND_OWN:
    schedule = _schedule(PARADIGMS[name], 3)
    rounded = _run(data, schedule)
    with pytest.MonkeyPatch.context() as m:
      m.setattr(_simulate, "_program_sizes", _exact_sizes)
      m.setattr(_simulate, "_shared_length", lambda n: n)
      engine.clear_cache()
      own = _run(data, schedule)
    _ROUNDED_AND_OWN[name] = schedule, rounded, own
  return _ROUNDED_AND_OWN[name]


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(PARADIGMS))
def test_rounded_sizes_give_the_bits_of_the_plans_own(data, name):
  schedule, rounded, own = _rounded_and_own(data, name)
  plan = plan_steps(schedule, WORKERS)
  assert _simulate._program_sizes(plan) != _exact_sizes(plan)  # the comparison below has rounding to see
  assert own.stats["chunk_size"] <= rounded.stats["chunk_size"]
  for a, b in zip(jax.tree.leaves((rounded.params, rounded.opt_state, rounded.history)),
                  jax.tree.leaves((own.params, own.opt_state, own.history)), strict=True):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_the_rounding_bounds():
  assert [_simulate._shared_length(n) for n in (1, 15, 16, 17, 168, 169, 256, 257)] == [1, 15, 16, 18, 176, 176, 256, 288]
  assert [_simulate._next_power_of_two(n) for n in (1, 2, 3, 11, 12, 16)] == [1, 2, 4, 16, 16, 16]
  for n in range(1, 2000):
    assert n <= _simulate._shared_length(n) <= n * 9 / 8


def test_a_buffer_rounded_past_max_memory_falls_back_to_the_plans_own(data):
  schedule, rounded, own = _rounded_and_own(data, "asp")
  assert own.stats["memory"]["total"] < rounded.stats["memory"]["total"]
  # A limit the plan's own buffer fits but the rounded one does not: the run takes its own size, not an error.
  fitted = _run(data, schedule, max_memory=own.stats["memory"]["total"])
  assert fitted.stats["memory"]["total"] == own.stats["memory"]["total"]
  np.testing.assert_array_equal(fitted.history.loss, rounded.history.loss)
  with pytest.raises(ValueError, match="max_memory"):
    _run(data, schedule, max_memory=own.stats["memory"]["total"] - 1)
