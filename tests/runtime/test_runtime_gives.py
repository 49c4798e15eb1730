"""What the runtime gives a transformation and an evaluation beyond the gradient: the loss and the state.

A transformation that needs the loss (``value=``, as
optax.contrib.reduce_on_plateau): at zero staleness (one worker) dj.simulate
must equal the plain Optax loop that passes each minibatch's loss as
``value``; the replica runtime, which does not pass it, refuses such a ``tx``
by name. An evaluation that needs the optimizer state (schedule-free's
evaluation parameters) reads it with ``dj.Record(eval_state=True)``.
"""

import os
import sys

import jax
import numpy as np
import optax
import pytest

import delayjax as dj
from delayjax.runtime._sampling import minibatch_indices

sys.path.insert(0, os.path.dirname(__file__))
from simulate_reference import regression_problem, round_robin  # noqa: E402

BATCH = 4


def _tx():
  # A short patience and a strong cut, so that the plateau rule acts within the run.
  return optax.chain(optax.sgd(0.02), optax.contrib.reduce_on_plateau(factor=0.5, patience=2, accumulation_size=1))


# reduce_on_plateau multiplies its int32 count by a float32 average, which the suite's strict promotion refuses.
@pytest.mark.fast_compile
@pytest.mark.slow
@jax.numpy_dtype_promotion("standard")
def test_the_update_loss_is_passed_as_value_and_matches_the_optax_loop():
  data, loss_fn, params = regression_problem()
  num_updates = 30
  res = dj.simulate(loss_fn, _tx(), params, data, round_robin(1, num_updates), seed=1,
                    sampling=dj.Sampling(batch_size=BATCH))
  tx = _tx()
  w, state = params, tx.init(params)
  for u in range(num_updates):
    idx = minibatch_indices(1, u, 0, u, num_examples=len(data["y"]), batch_size=BATCH)
    batch = jax.tree.map(lambda x: x[np.asarray(idx)], data)
    loss, grad = jax.value_and_grad(loss_fn)(w, batch)
    updates, state = tx.update(grad, state, w, value=loss)
    w = optax.apply_updates(w, updates)
  # The plateau rule acted: its scale fell below 1.
  assert float(state[1].scale) < 1.0
  np.testing.assert_allclose(float(res.opt_state[1].scale), float(state[1].scale))
  for a, b in zip(jax.tree.leaves(res.params), jax.tree.leaves(w), strict=True):
    np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7)


def test_the_replica_runtime_refuses_a_tx_that_needs_value():
  data, loss_fn, params = regression_problem()
  sched = dj.cluster.simulate_gossip(dj.cluster.d_psgd(dj.topology.ring(4)), dj.cluster.workers(4, seed=0),
                                     num_steps=4, seed=0)
  with pytest.raises(ValueError, match=r"needs the extra argument value=.*dj.simulate_gossip does not pass"):
    dj.simulate_gossip(loss_fn, _tx(), dj.gossip.d_psgd(), params, data, sched, sampling=dj.Sampling(batch_size=BATCH))


def test_eval_fn_can_read_the_optimizer_state_for_schedule_free_evaluation_parameters():
  data, loss_fn, params = regression_problem()
  tx = optax.contrib.schedule_free_sgd(0.05)

  def eval_fn(params, opt_state):
    evaluated = optax.contrib.schedule_free_eval_params(opt_state, params)
    return {"loss": loss_fn(evaluated, data), "plain": loss_fn(params, data)}

  res = dj.simulate(loss_fn, tx, params, data, round_robin(2, 20), seed=1, sampling=dj.Sampling(batch_size=BATCH),
                    record=dj.Record(eval_fn=eval_fn, every=10, eval_state=True))
  # The last evaluation is the one a hand evaluation of the final state gives.
  final = eval_fn(res.params, res.opt_state)
  np.testing.assert_allclose(res.history.eval_metrics["loss"][-1], final["loss"], rtol=1e-6)
  # Schedule-free's evaluation parameters are not the iterate it trains.
  assert not np.allclose(res.history.eval_metrics["loss"][1:], res.history.eval_metrics["plain"][1:])
  with pytest.raises(ValueError, match="eval_state=True has no effect without Record.eval_fn"):
    dj.Record(eval_state=True)
  sched = dj.cluster.simulate_gossip(dj.cluster.d_psgd(dj.topology.ring(4)), dj.cluster.workers(4, seed=0),
                                     num_steps=4, seed=0)
  with pytest.raises(ValueError, match="eval_state=True is defined for dj.simulate only"):
    dj.simulate_gossip(loss_fn, optax.sgd(0.1), dj.gossip.d_psgd(), params, data, sched,
                       record=dj.Record(eval_fn=eval_fn, eval_state=True))


def test_a_flax_train_state_that_drops_worker_is_told_to_use_dj_apply_gradients():
  from flax.training import train_state

  data, loss_fn, params = regression_problem()
  tx = optax.chain(dj.delay_compensation(0.5, adaptive=True, num_workers=2), optax.sgd(0.1))
  state = train_state.TrainState.create(apply_fn=None, params=params, tx=tx)
  grads = jax.grad(loss_fn)(params, data)
  with pytest.raises(ValueError, match=r"needs the extra argument stale_params=.*dj.apply_gradients\(state, grads="):
    state.apply_gradients(grads=grads)
  new = dj.apply_gradients(state, grads=grads, stale_params=params, worker=1, staleness=0)
  updates, _ = tx.update(grads, tx.init(params), params, stale_params=params, worker=1, staleness=0)
  for a, b in zip(jax.tree.leaves(new.params), jax.tree.leaves(optax.apply_updates(params, updates)), strict=True):
    np.testing.assert_array_equal(a, b)
