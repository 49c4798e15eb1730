"""``dj.simulate_pipeline`` against the slow sequential reference and against synchronous minibatch SGD."""

import os
import sys

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import delayjax as dj

sys.path.insert(0, os.path.dirname(__file__))
from pipeline_reference import (assert_trees_close, explicit_grad, mlp_problem, reference,  # noqa: E402
                                stored_dense_grad)


@pytest.mark.parametrize("K,weights,m,backward", [(3, "latest", 2, "recompute"), (2, "vertical_sync", 1, "recompute"),
                                                  (3, "latest", 2, "stored")])
def test_matches_the_sequential_reference(K, weights, m, backward):
  """The reference computes "stored" by hand for these dense stages (PipeDream without weight stashing)."""
  stages, loss_fn, params, data = mlp_problem(K)
  U = 5
  sched = dj.cluster.pipeline("1f1b", K, U, num_microbatches=m, weights=weights)
  tx = optax.sgd(0.3, momentum=0.5)
  result = dj.simulate_pipeline(stages, loss_fn, tx, params, data, sched, sampling=dj.Sampling(batch_size=8), seed=4,
                                execution=dj.Execution(chunk_size=2), backward=backward)
  want, losses, _ = reference(stages, loss_fn, tx, params, data, sched, batch_size=8, seed=4,
                              grad={"recompute": explicit_grad, "stored": stored_dense_grad}[backward])
  assert_trees_close(result.params, want)
  np.testing.assert_allclose(result.history.loss, losses, rtol=2e-6)
  np.testing.assert_array_equal(result.history.forward_staleness,
                                np.arange(U)[:, None] - sched.forward_version.reshape(U, m, K).min(axis=1))


def test_synchronous_pipeline_is_minibatch_sgd():
  """GPipe with m micro-batches of B examples: SGD on the mean loss of the m B examples, evaluated as it goes."""
  stages, loss_fn, params, data = mlp_problem(2)
  m, B, U = 3, 5, 4
  sched = dj.cluster.pipeline("gpipe", 2, U, num_microbatches=m)

  def full_loss(ps, batch):
    h = batch["x"]
    for f, p in zip(stages, ps):
      h = f(p, h)
    return loss_fn(h, batch)

  result = dj.simulate_pipeline(stages, loss_fn, optax.sgd(0.5), params, data, sched,
                                sampling=dj.Sampling(batch_size=B), seed=1,
                                record=dj.Record(eval_fn=lambda ps: {"loss": full_loss(ps, data)}, every=2))
  ps, evals = list(params), [full_loss(params, data)]
  step = jax.jit(jax.grad(lambda ps, batch: jnp.mean(jax.vmap(lambda b: full_loss(ps, b))(batch))))
  for u in range(U):
    idx = jnp.stack([dj.runtime.minibatch_indices(1, u, j, 0, num_examples=64, batch_size=B) for j in range(m)])
    g = step(ps, jax.tree.map(lambda a: a[idx], data))
    ps = [jax.tree.map(lambda p, gg: p - 0.5 * gg, p, gk) for p, gk in zip(ps, g)]
    if (u + 1) % 2 == 0:
      evals.append(full_loss(ps, data))
  assert_trees_close(result.params, ps, rtol=1e-5, atol=1e-6)
  np.testing.assert_array_equal(result.history.eval_update, [0, 2, 4])
  np.testing.assert_allclose(result.history.eval_metrics["loss"], evals, rtol=1e-5)
  np.testing.assert_allclose(result.history.time, sched.update_time.max(axis=1))


def test_bad_arguments():
  stages, loss_fn, params, data = mlp_problem(2)
  sched = dj.cluster.pipeline("gpipe", 3, 2)
  with pytest.raises(ValueError, match="num_stages=3"):
    dj.simulate_pipeline(stages, loss_fn, optax.sgd(0.1), params, data, sched, sampling=dj.Sampling(batch_size=4))
  with pytest.raises(TypeError, match="schedule"):
    dj.simulate_pipeline(stages, loss_fn, optax.sgd(0.1), params, data, dj.delays.constant(2),
                         sampling=dj.Sampling(batch_size=4))
  sched = dj.cluster.pipeline("gpipe", 2, 2)
  with pytest.raises(ValueError, match="batch_size"):
    dj.simulate_pipeline(stages, loss_fn, optax.sgd(0.1), params, data, sched, sampling=dj.Sampling(batch_size=0))
  with pytest.raises(ValueError, match="backward"):
    dj.simulate_pipeline(stages, loss_fn, optax.sgd(0.1), params, data, sched, sampling=dj.Sampling(batch_size=4),
                         backward="latest")
  with pytest.raises(ValueError, match="'x'"):
    dj.simulate_pipeline(stages, loss_fn, optax.sgd(0.1), params, {"inputs": data["x"]}, sched,
                         sampling=dj.Sampling(batch_size=4))


def test_checkpoint_and_resume_are_bit_identical(tmp_path):
  """Interrupted after its second chunk, a run resumes from the engine's checkpoint to the same bits."""
  stages, loss_fn, params, data = mlp_problem(2)
  sched = dj.cluster.pipeline("1f1b", 2, 10, weights="latest")
  tx = dj.pipemare(0.2, warmup_steps=4, momentum=0.5, discrepancy_decay=0.1)
  evaluate = jax.jit(lambda ps: {"w0": jnp.sum(ps[0]["w"])})
  kwargs = dict(sampling=dj.Sampling(batch_size=8), seed=3, execution=dj.Execution(chunk_size=3),
                record=dj.Record(eval_fn=evaluate, every=4))
  full = dj.simulate_pipeline(stages, loss_fn, tx, params, data, sched, **kwargs)

  class Stop(Exception):
    pass

  def stop_after_two(info):
    if info["updates_done"] == 6:
      raise Stop

  with pytest.raises(Stop):
    dj.simulate_pipeline(stages, loss_fn, tx, params, data, sched, checkpoint=dj.Checkpoint(str(tmp_path)),
                         **dict(kwargs, record=dj.Record(eval_fn=evaluate, every=4, callback=stop_after_two)))
  resumed = dj.simulate_pipeline(stages, loss_fn, tx, params, data, sched, checkpoint=dj.Checkpoint(str(tmp_path)),
                                 **kwargs)
  jax.tree.map(np.testing.assert_array_equal, resumed.params, full.params)
  jax.tree.map(np.testing.assert_array_equal, resumed.opt_states, full.opt_states)
  np.testing.assert_array_equal(resumed.history.loss, full.history.loss)
  np.testing.assert_array_equal(resumed.history.eval_update, [0, 4, 8, 10])
  np.testing.assert_array_equal(resumed.history.eval_metrics["w0"], full.history.eval_metrics["w0"])
  # Another seed or learning rate is another run: its checkpoint is refused, not silently continued.
  with pytest.raises(ValueError, match="different run: options differ"):
    dj.simulate_pipeline(stages, loss_fn, tx, params, data, sched, checkpoint=dj.Checkpoint(str(tmp_path)),
                         **{**kwargs, "seed": 4})
  faster = dj.pipemare(0.3, warmup_steps=4, momentum=0.5, discrepancy_decay=0.1)
  with pytest.raises(ValueError, match="different run: tx differ"):
    dj.simulate_pipeline(stages, loss_fn, faster, params, data, sched, checkpoint=dj.Checkpoint(str(tmp_path)),
                         **kwargs)


def test_runs_of_one_program_compile_once():
  """Another seed and a new but equal optimizer reuse the compiled chunk, and give the reference's numbers and
  a fresh compile's bits; another learning rate is another program."""
  from delayjax.runtime import _engine as engine

  stages, loss_fn, params, data = mlp_problem(2)
  sched = dj.cluster.pipeline("1f1b", 2, 4, num_microbatches=2)
  run = lambda seed, lr=0.3: dj.simulate_pipeline(stages, loss_fn, optax.sgd(lr), params, data, sched,  # noqa: E731
                                                  sampling=dj.Sampling(batch_size=8), seed=seed,
                                                  execution=dj.Execution(chunk_size=2))
  engine.clear_cache()
  run(4)
  hits = engine.cache_info()["hits"]
  cached = run(5)
  assert engine.cache_info()["hits"] == hits + 1
  want, losses, _ = reference(stages, loss_fn, optax.sgd(0.3), params, data, sched, batch_size=8, seed=5,
                              grad=explicit_grad)
  assert_trees_close(cached.params, want)
  np.testing.assert_allclose(cached.history.loss, losses, rtol=2e-6)
  engine.clear_cache()
  fresh = run(5)
  for a, b in zip(jax.tree.leaves((cached.params, cached.history.loss)),
                  jax.tree.leaves((fresh.params, fresh.history.loss)), strict=True):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
  misses = engine.cache_info()["misses"]
  run(5, lr=0.1)
  assert engine.cache_info()["misses"] == misses + 1
