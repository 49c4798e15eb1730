"""dj.transforms.check_schedule: a run too short for fed_buff's buffer is refused, a delay window shorter than the
run's staleness is warned about, wherever the state sits in the optimizer."""

import warnings

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import delayjax as dj

check_schedule = dj.transforms.check_schedule
PARAMS = {"w": jnp.zeros(3), "b": jnp.zeros(())}


def test_a_buffer_larger_than_the_run_never_steps_and_is_refused():
  """The premise, then the check: 40 contributions into buffer_size=1000 give 40 zero updates."""
  tx = dj.fed_buff(optax.sgd(1.0), buffer_size=1000)
  state = tx.init(PARAMS)
  delta = jax.tree.map(jnp.ones_like, PARAMS)
  for _ in range(40):
    u, state = tx.update(delta, state, PARAMS, staleness=0)
    assert all(not np.any(np.asarray(x)) for x in jax.tree.leaves(u))
  with pytest.raises(ValueError, match=r"^dj\.fed_buff\(\.\.\., buffer_size=1000\) takes its first step at "
                                       r"contribution 1000 \(buffer_size=1000 but the run has 40 contributions\)"):
    check_schedule(tx.init(PARAMS), num_contributions=40, max_staleness=0)


def test_a_buffer_the_run_fills_is_accepted():
  tx = dj.fed_buff(optax.sgd(1.0), buffer_size=3)
  state = tx.init(PARAMS)
  check_schedule(state, num_contributions=3, max_staleness=100)
  delta = jax.tree.map(jnp.ones_like, PARAMS)
  for _ in range(3):
    u, state = tx.update(delta, state, PARAMS, staleness=0)
  # The third delta completes the buffer: the server step is -(-mean delta) = +1.
  np.testing.assert_allclose(u["w"], np.ones(3))


@pytest.mark.parametrize("wrap", [
    lambda tx: optax.chain(optax.scale(-0.5), tx),
    dj.per_contribution,
    lambda tx: dj.delayed(tx, dj.delays.constant(2)),
    lambda tx: optax.MultiSteps(tx, 2),
], ids=["chain", "per_contribution", "delayed", "MultiSteps"])
def test_the_buffer_is_found_inside_wrappers(wrap):
  state = wrap(dj.fed_buff(optax.sgd(1.0), buffer_size=50)).init(PARAMS)
  with pytest.raises(ValueError, match=r"buffer_size=50 but the run has 49 contributions"):
    check_schedule(state, num_contributions=49, max_staleness=0)
  check_schedule(state, num_contributions=50, max_staleness=0)


def test_accumulate_sum_names_its_k_and_an_injected_buffer_is_checked_at_its_initial_value():
  with pytest.raises(ValueError, match=r"dj\.accumulate_sum\(\.\.\., k=8\) .*\(k=8 but the run has 7 contributions\)"):
    check_schedule(dj.accumulate_sum(optax.sgd(0.1), 8).init(PARAMS), num_contributions=7, max_staleness=0)
  injected = optax.inject_hyperparams(dj.fed_buff)(optax.sgd(0.1), buffer_size=100)
  with pytest.raises(ValueError, match=r"buffer_size=100 but the run has 4 contributions"):
    check_schedule(injected.init(PARAMS), num_contributions=4, max_staleness=0)
  # Traced (abstract) initial values cannot be read: nothing to check, no error.
  check_schedule(jax.eval_shape(injected.init, PARAMS), num_contributions=4, max_staleness=0)


def test_the_recorded_buffer_size_leaves_the_state_structure_alone():
  """Only the arrays define the state: buffers of 2 and 3 (and an injected one) share one tree structure, so
  jit caches, scan carries and checkpoints are unchanged."""
  two, three = (dj.fed_buff(optax.sgd(0.1), buffer_size=k).init(PARAMS) for k in (2, 3))
  assert jax.tree.structure(two) == jax.tree.structure(three)
  assert len(jax.tree.leaves(two)) == len(jax.tree.leaves(dj.fed_buff(optax.sgd(0.1), buffer_size=2).init(PARAMS)))
  injected = optax.inject_hyperparams(dj.fed_buff)(optax.sgd(0.1), buffer_size=2).init(PARAMS)
  assert jax.tree.structure(injected.inner_state) == jax.tree.structure(two)


def test_a_delay_window_shorter_than_the_staleness_is_warned_about():
  """The premise, then the check: with max_delay=4 a gradient 5 updates stale gets step 0."""
  tx = dj.delay_adaptive_sgd(0.1, 10.0, max_delay=4)
  u, _ = tx.update(jax.tree.map(jnp.ones_like, PARAMS), tx.init(PARAMS), staleness=5)
  np.testing.assert_array_equal(u["w"], np.zeros(3))
  state = optax.chain(dj.per_contribution(tx), optax.identity()).init(PARAMS)
  with pytest.warns(UserWarning, match=r"max_delay=4\) keeps the last 4 steps, but the run's max_staleness is 9: "
                                       r"gradients staler than 4 get step 0"):
    check_schedule(state, num_contributions=10, max_staleness=9)
  with warnings.catch_warnings():
    warnings.simplefilter("error")
    check_schedule(state, num_contributions=10, max_staleness=4)


@pytest.mark.parametrize("kwargs, error, match", [
    (dict(num_contributions=-1, max_staleness=0), ValueError, r"num_contributions must be an integer >= 0, got -1"),
    (dict(num_contributions=3, max_staleness=-2), ValueError, r"max_staleness must be an integer >= 0, got -2"),
    (dict(num_contributions="40", max_staleness=0), TypeError, r"num_contributions must be an integer, got '40'"),
    (dict(num_contributions=4, max_staleness=1.5), TypeError, r"max_staleness must be an integer, got 1.5"),
])
def test_bad_arguments_name_themselves(kwargs, error, match):
  with pytest.raises(error, match=match):
    check_schedule(optax.sgd(0.1).init(PARAMS), **kwargs)


def test_it_is_exported_with_the_hooks_not_at_top_level():
  assert dj.transforms.check_schedule is check_schedule
  assert not hasattr(dj, "check_schedule")
