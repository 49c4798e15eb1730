"""``dj.simulate_pipeline`` with one stage per device on a ``stages`` mesh axis, against the same run on one device."""

import os
import sys

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import PartitionSpec as P

import delayjax as dj
from delayjax.runtime import _engine

sys.path.insert(0, os.path.dirname(__file__))
from pipeline_reference import assert_trees_close, mlp_problem  # noqa: E402


def _mesh(K):
  return jax.make_mesh((K,), ("stages",), devices=jax.devices()[:K])


class _Stop(Exception):
  pass


def _stop_after(updates):
  def callback(info):
    if info["updates_done"] == updates:
      raise _Stop
  return callback


@pytest.mark.slow
def test_one_stage_per_device_resumes_to_the_bits_of_one_device(monkeypatch, tmp_path):
  """A 4-stage MLP (stages of different shapes) on 4 devices, interrupted after two chunks and resumed: the
  same bits as the uninterrupted run on one device, each stage's versions and optimizer state held by its own
  device only."""
  K = 4
  stages, loss_fn, params, data = mlp_problem(K)
  sched = dj.cluster.pipeline("1f1b", K, 8, num_microbatches=2, weights="latest")
  tx = optax.sgd(0.3, momentum=0.5)
  evaluate = lambda ps: {"w0": jnp.sum(ps[0]["w"]), "b3": jnp.sum(ps[3]["b"])}  # noqa: E731
  kwargs = dict(sampling=dj.Sampling(batch_size=8), seed=4, execution=dj.Execution(chunk_size=3),
                record=dj.Record(eval_fn=evaluate, every=3))
  on_mesh = dict(kwargs, execution=dj.Execution(mesh=_mesh(K), chunk_size=3))
  one = dj.simulate_pipeline(stages, loss_fn, tx, params, data, sched, **kwargs)

  placed = []
  chunk_function = _engine.chunk_function

  def spy(program, mesh):
    fn = chunk_function(program, mesh)

    def call(carry, constants, tables):  # the carry is donated: note where its pieces are before the call
      placed.append([(x.sharding.spec, sorted((s.device.id, s.index[0].start, s.data.shape[0])
                                              for s in x.addressable_shards)) for x in jax.tree.leaves(carry)])
      return fn(carry, constants, tables)
    return call

  monkeypatch.setattr(_engine, "chunk_function", spy)
  with pytest.raises(_Stop):
    dj.simulate_pipeline(stages, loss_fn, tx, params, data, sched, checkpoint=dj.Checkpoint(str(tmp_path)),
                         **dict(on_mesh, record=dj.Record(eval_fn=evaluate, every=3, callback=_stop_after(6))))
  # Device k holds row k (stage k's versions and state) and nothing of the other stages.
  assert placed[0] and placed[0] == [(P("stages"), [(jax.devices()[k].id, k, 1) for k in range(K)])] * len(placed[0])
  # The one-stage-per-device checkpoint is another layout: refused on one device, not misread.
  with pytest.raises(ValueError):
    dj.simulate_pipeline(stages, loss_fn, tx, params, data, sched, checkpoint=dj.Checkpoint(str(tmp_path)), **kwargs)
  spread = dj.simulate_pipeline(stages, loss_fn, tx, params, data, sched, checkpoint=dj.Checkpoint(str(tmp_path)),
                                **on_mesh)
  jax.tree.map(np.testing.assert_array_equal, spread.params, one.params)
  jax.tree.map(np.testing.assert_array_equal, spread.opt_states, one.opt_states)
  np.testing.assert_array_equal(spread.history.loss, one.history.loss)
  np.testing.assert_array_equal(spread.history.eval_update, [0, 3, 6, 8])
  jax.tree.map(np.testing.assert_array_equal, spread.history.eval_metrics, one.history.eval_metrics)


@pytest.mark.slow
def test_read_remedies_and_stored_backward_under_the_mesh():
  """PipeMare (a read direction stored with every version, backward passes stepping back along it) with
  PipeDream's un-stashed backward pass on 2 devices: the one-device run to a few float32 ulps (the
  multiply-adds are fused differently in the two programs)."""
  K = 2
  stages, loss_fn, params, data = mlp_problem(K)
  sched = dj.cluster.pipeline("1f1b", K, 6, weights="latest")
  tx = dj.pipemare(0.2, warmup_steps=4, momentum=0.5, discrepancy_decay=0.1)
  kwargs = dict(sampling=dj.Sampling(batch_size=8), seed=3, backward="stored")
  one = dj.simulate_pipeline(stages, loss_fn, tx, params, data, sched, execution=dj.Execution(chunk_size=3), **kwargs)
  spread = dj.simulate_pipeline(stages, loss_fn, tx, params, data, sched,
                                execution=dj.Execution(mesh=_mesh(K), chunk_size=3), **kwargs)
  assert_trees_close(spread.params, one.params, rtol=1e-6, atol=1e-7)
  assert_trees_close(spread.opt_states, one.opt_states, rtol=1e-6, atol=1e-7)
  np.testing.assert_allclose(spread.history.loss, one.history.loss, rtol=1e-6)


def test_a_mesh_must_hold_one_stage_per_device():
  stages, loss_fn, params, data = mlp_problem(2)
  sched = dj.cluster.pipeline("gpipe", 2, 2)
  run = lambda mesh: dj.simulate_pipeline(stages, loss_fn, optax.sgd(0.1), params, data, sched,  # noqa: E731
                                          sampling=dj.Sampling(batch_size=4), execution=dj.Execution(mesh=mesh))
  with pytest.raises(ValueError, match="num_stages=2"):
    run(_mesh(4))
  with pytest.raises(ValueError, match="'stages'"):
    run(jax.make_mesh((2,), ("workers",), devices=jax.devices()[:2]))
  with pytest.raises(TypeError, match="mesh"):
    run("stages")
