"""Runtime inputs: extra arguments that dj.simulate computes because a transformation's state asks for them."""

import os
import sys
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import delayjax as dj

sys.path.insert(0, os.path.dirname(__file__))
from simulate_reference import assert_trees_close, hand_schedule, probe, reference, regression_problem  # noqa: E402

BATCH = 4


class _Requests(NamedTuple):
  value: Any

  def runtime_inputs(self):
    return ("svrg_grad", "zeno_grad")


def test_runtime_inputs_are_found_anywhere_in_a_state():
  params = jnp.zeros(2)
  zeno = dj.zeno_plus_plus(0.1)
  assert dj.runtime_inputs(optax.sgd(0.1).init(params)) == ()
  assert dj.runtime_inputs(zeno.init(params)) == ("zeno_grad",)
  nested = optax.chain(optax.clip(1.0), optax.MultiSteps(zeno, every_k_schedule=2)).init(params)
  assert dj.runtime_inputs(nested) == ("zeno_grad",)
  # Inside another requesting state too, each name once, sorted.
  assert dj.runtime_inputs(_Requests(zeno.init(params))) == ("svrg_grad", "zeno_grad")


def test_unknown_runtime_inputs_are_refused():
  data, loss_fn, params = regression_problem()

  def init_fn(p):
    return _Requests(jax.tree.map(jnp.zeros_like, p))

  def update_fn(updates, state, params=None, **extra):
    return updates, state

  tx = optax.GradientTransformationExtraArgs(init_fn, update_fn)
  with pytest.raises(ValueError, match=r"tx requests runtime inputs that dj.simulate cannot compute: \['svrg_grad'\]"):
    dj.simulate(loss_fn, tx, params, data, dj.delays.constant(1), num_updates=4,
                sampling=dj.Sampling(batch_size=BATCH))


def test_server_minibatch_is_its_own_documented_stream():
  kw = dict(num_examples=1000, batch_size=16)
  for u in (0, 7):
    key = jax.random.fold_in(jax.random.fold_in(jax.random.key(3), 2), u)
    expected = jax.random.randint(key, (16,), 0, 1000, dtype=jnp.int32)
    np.testing.assert_array_equal(dj.runtime.server_minibatch_indices(3, u, **kw), expected)
    # Not a draw of any worker at that update.
    for m in range(4):
      for draw in range(4):
        assert not np.array_equal(expected, dj.runtime.minibatch_indices(3, u, m, draw, **kw))


@pytest.mark.parametrize("inner", ["sgd", "probe"])
def test_zeno_plus_plus_matches_reference(inner):
  """zeno_grad at the server parameters of each update, on its server minibatch; with a probe as inner
  optimizer, stale_params, worker and a read hook all pass through Zeno++'s state as well."""
  data, loss_fn, params = regression_problem()
  schedule = hand_schedule(4, 30, group=2, max_batches=2, seed=21)
  tx = dj.zeno_plus_plus(0.05, rho=0.002, inner=None if inner == "sgd" else probe(0.05, 4))
  result = dj.simulate(loss_fn, tx, params, data, schedule, sampling=dj.Sampling(batch_size=BATCH), seed=5)
  ref_params, ref_state, ref_loss, _, _ = reference(loss_fn, tx, params, data, schedule, batch_size=BATCH, seed=5)
  # Some candidates were rejected and some accepted, or the test would not tell much.
  assert 0 < int(ref_state.accepted) < int(ref_state.count)
  np.testing.assert_array_equal(result.opt_state.accepted, ref_state.accepted)
  np.testing.assert_array_equal(result.opt_state.count, ref_state.count)
  assert_trees_close(result.params, ref_params, rtol=1e-5, atol=1e-6)
  assert_trees_close(result.opt_state, ref_state, rtol=1e-5, atol=1e-6)
  np.testing.assert_allclose(result.history.loss, ref_loss, rtol=1e-5, atol=1e-6)


@pytest.mark.slow
def test_zeno_plus_plus_on_eight_devices():
  """Every device computes zeno_grad in the replicated server loop; the run is the one-device run."""
  data, loss_fn, params = regression_problem()
  schedule = hand_schedule(6, 24, seed=22)
  tx = dj.zeno_plus_plus(0.05, rho=0.002)
  single = dj.simulate(loss_fn, tx, params, data, schedule, sampling=dj.Sampling(batch_size=BATCH))
  multi = dj.simulate(loss_fn, tx, params, data, schedule, sampling=dj.Sampling(batch_size=BATCH),
                      execution=dj.Execution(mesh=jax.make_mesh((8,), ("workers",))))
  assert multi.stats["num_devices"] == 8
  np.testing.assert_array_equal(multi.opt_state.accepted, single.opt_state.accepted)
  assert_trees_close(multi.params, single.params, rtol=1e-5, atol=1e-6)
