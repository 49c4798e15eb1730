"""Runs the runtimes refuse before compiling, each of which was silent or obscure before (issue: never silently
wrong, round three): the error names the argument, what was given and what is allowed."""

from __future__ import annotations

import warnings

import jax.numpy as jnp
import numpy as np
import optax
import pytest

import delayjax as dj

X = np.random.default_rng(0).normal(size=(64, 3)).astype(np.float32)
DATA = {"x": X, "y": X.sum(axis=1)}


def _loss(w, batch):
  return jnp.mean((batch["x"] @ w - batch["y"]) ** 2)


def _schedule(num_updates=40):
  return dj.cluster.simulate(dj.cluster.asp(), dj.cluster.workers(4, seed=0), num_updates=num_updates, seed=0)


def test_a_fedbuff_buffer_the_run_never_fills_is_refused_naming_both_numbers():
  with pytest.raises(ValueError, match="buffer_size=1000 but the run has 40 contributions"):
    dj.simulate(_loss, dj.fed_buff(optax.sgd(0.1), buffer_size=1000), jnp.zeros(3), DATA, _schedule())
  # Per contribution, the buffer counts contributions, not updates: one that fits trains.
  tx = dj.per_contribution(dj.fed_buff(optax.sgd(0.1), buffer_size=4))
  result = dj.simulate(_loss, tx, jnp.zeros(3), DATA, _schedule())
  assert float(jnp.sum(jnp.abs(result.params))) > 0


def test_a_delay_window_below_the_schedules_staleness_is_warned_about():
  schedule = _schedule()
  with pytest.warns(UserWarning, match=f"max_delay=1.*max_staleness is {int(schedule.max_staleness.max())}"):
    dj.simulate(_loss, dj.delay_adaptive_sgd(0.1, 1.0, max_delay=1), jnp.zeros(3), DATA, schedule)
  with warnings.catch_warnings():
    warnings.simplefilter("error", UserWarning)
    dj.simulate(_loss, dj.delay_adaptive_sgd(0.1, 1.0, max_delay=int(schedule.max_staleness.max())),
                jnp.zeros(3), DATA, schedule)


def _pipeline(stages, params, loss=lambda h, b: jnp.mean((h - b["y"]) ** 2)):
  sched = dj.cluster.pipeline("1f1b", 2, 10, num_microbatches=2)
  return dj.simulate_pipeline(stages, loss, optax.sgd(0.01), params, DATA, sched, sampling=dj.Sampling(8))


def test_pipeline_stages_that_do_not_compose_are_named_with_their_shapes():
  stage = lambda p, h: h @ p["w"]  # noqa: E731
  with pytest.raises(ValueError, match=r"stage_fns\[1\] fails on its input float32\[8, 3\]"):
    _pipeline([stage, stage], [{"w": jnp.eye(3)}, {"w": jnp.ones(5)}])


def test_a_stage_returning_a_tuple_the_next_cannot_take_is_named():
  with pytest.raises(ValueError, match=r"stage_fns\[1\] fails on its input \('float32\[8, 3\]', 'float32\[8, 3\]'\)"):
    _pipeline([lambda p, h: (h @ p["w"], h), lambda p, h: h @ p["w"]], [{"w": jnp.eye(3)}, {"w": jnp.ones(3)}])
  # A pytree activation the next stage takes is a pipeline like any other.
  result = _pipeline([lambda p, h: (h @ p["w"], h), lambda p, h: (h[0] + h[1]) @ p["w"]],
                     [{"w": jnp.eye(3)}, {"w": jnp.ones(3)}])
  assert np.all(np.isfinite(result.history.loss))


def test_a_pipeline_loss_that_is_not_scalar_is_refused():
  with pytest.raises(ValueError, match="loss_fn\\(h_K, batch\\) must return a real scalar"):
    _pipeline([lambda p, h: h @ p["w"], lambda p, h: h @ p["w"]], [{"w": jnp.eye(3)}, {"w": jnp.ones(3)}],
              loss=lambda h, b: h - b["y"])


def test_a_gossip_eval_fn_that_is_not_scalar_valued_is_refused():
  sched = dj.cluster.simulate_gossip(dj.cluster.d_psgd(dj.topology.ring(4)), dj.cluster.workers(4, seed=0),
                                     num_steps=4, seed=0)
  with pytest.raises(ValueError, match=r"Record.eval_fn must return a pytree of scalars.*\[3\]"):
    dj.simulate_gossip(_loss, optax.sgd(0.1), dj.gossip.d_psgd(), jnp.zeros(3), DATA, sched,
                       record=dj.Record(eval_fn=lambda w: w))


@pytest.mark.parametrize("params", [{}, [], {"w": None}])
def test_parameters_with_nothing_to_train_are_refused(params):
  with pytest.raises((ValueError, TypeError), match="params"):
    dj.simulate(_loss, optax.sgd(0.1), params, DATA, _schedule())


def test_delayed_under_a_runtime_says_to_give_the_runtime_the_inner_transformation():
  with pytest.raises(TypeError, match="give the runtime the inner transformation"):
    dj.simulate(_loss, dj.delayed(optax.sgd(0.1), dj.delays.constant(2)), jnp.zeros(3), DATA, _schedule())


def test_a_method_without_push_sum_on_a_push_sum_schedule_is_refused_and_sgp_conserves_the_mass():
  sched = dj.cluster.simulate_gossip(dj.cluster.sgp(), dj.cluster.workers(4, seed=0), num_steps=6, seed=0)
  for method in (dj.gossip.d_psgd(), dj.gossip.ad_psgd()):
    with pytest.raises(ValueError, match=f"method '{method.name}' has no push-sum weight.*column-stochastic"):
      dj.simulate_gossip(_loss, optax.sgd(0.0), method, jnp.ones(3), DATA, sched)
  # At learning rate 0 identical replicas must stay where they are: push-sum divides the mass out.
  result = dj.simulate_gossip(_loss, optax.sgd(0.0), dj.gossip.sgp(), jnp.ones(3), DATA, sched)
  np.testing.assert_allclose(np.asarray(result.average), np.ones(3), rtol=1e-6)


def test_a_runtime_under_vmap_points_to_batched_runs():
  import jax
  with pytest.raises(TypeError, match=r"dj.simulate got a traced params .*seed=dj.Runs"):
    jax.vmap(lambda w: dj.simulate(_loss, optax.sgd(0.1), w, DATA, _schedule()).params)(jnp.zeros((2, 3)))
