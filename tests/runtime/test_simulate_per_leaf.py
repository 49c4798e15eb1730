"""dj.simulate with per-leaf delay models: each group of parameter leaves is read at its own stale version."""

import os
import sys

import jax
import numpy as np
import optax
import pytest

import delayjax as dj

sys.path.insert(0, os.path.dirname(__file__))
from simulate_reference import reference, regression_problem  # noqa: E402

BATCH = 4


def _stale_reads(model, params, num_updates, seed):
  """The schedule, each group's read versions and each leaf's group, drawn one update at a time."""
  models = model.models
  key = jax.random.fold_in(jax.random.key(seed), 0)
  draws = np.array([[int(d) for d in jax.tree.leaves(model.sample(jax.random.fold_in(key, t), t))]
                    for t in range(num_updates)])
  num_workers = model.max_delay + 1
  u = np.arange(num_updates)
  versions = np.full((num_updates, num_workers, draws.shape[1]), -1, np.int64)
  versions[u, u % num_workers] = np.maximum(0, u[:, None] - draws)
  contributes = np.zeros((num_updates, num_workers), bool)
  read_version = np.full((num_updates, num_workers), -1, np.int64)
  contributes[u, u % num_workers] = True
  read_version[u, u % num_workers] = versions[u, u % num_workers].min(axis=1)
  schedule = dj.cluster.Schedule(time=u.astype(np.float64), contributes=contributes, read_version=read_version,
                                 wait=np.zeros(num_workers))
  # Groups follow the order of the model tree's leaves; {"b": ..., "w": ...} flattens b first.
  names = sorted(models)
  leaf_groups = tuple(names.index(name) for name in sorted(params))
  return schedule, versions, leaf_groups


def _tx():
  # Uses the per-leaf staleness (lr / tau per leaf) and the stale parameters (DC-ASGD's correction).
  return optax.chain(dj.delay_compensation(lam=0.5), dj.scale_by_staleness("inverse"), optax.sgd(0.05))


@pytest.mark.parametrize("models", [
    {"w": dj.delays.uniform(5), "b": dj.delays.constant(1)},
    {"w": dj.delays.constant(0), "b": dj.delays.geometric(0.3, 6)},
])
def test_per_leaf_stale_reads_match_the_sequential_reference(models):
  data, loss_fn, params = regression_problem()
  source = dj.delays.per_leaf(models)
  result = dj.simulate(loss_fn, _tx(), params, data, source, num_updates=40, sampling=dj.Sampling(batch_size=BATCH),
                       seed=3)
  schedule, versions, leaf_groups = _stale_reads(source, params, 40, seed=3)
  ref_params, ref_state, ref_loss, _, _ = reference(loss_fn, _tx(), params, data, schedule, batch_size=BATCH,
                                                    seed=3, group_versions=versions, leaf_groups=leaf_groups)
  # The two groups were read at different versions, so the test sees per-leaf reads.
  assert np.any(versions[..., 0] != versions[..., 1])
  np.testing.assert_array_equal(result.history.staleness, np.max(schedule.staleness, axis=1))
  for a, b in zip(jax.tree.leaves((result.params, result.opt_state)), jax.tree.leaves((ref_params, ref_state)),
                  strict=True):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=2e-5, atol=2e-6)
  np.testing.assert_allclose(result.history.loss, ref_loss, rtol=1e-5, atol=1e-6)


def test_equal_per_leaf_delays_are_the_shared_delay_model():
  data, loss_fn, params = regression_problem()
  shared = dj.simulate(loss_fn, _tx(), params, data, dj.delays.constant(3), num_updates=30,
                       sampling=dj.Sampling(batch_size=BATCH))
  per_leaf = dj.simulate(loss_fn, _tx(), params, data,
                         dj.delays.per_leaf({"w": dj.delays.constant(3), "b": dj.delays.constant(3)}),
                         num_updates=30, sampling=dj.Sampling(batch_size=BATCH))
  for a, b in zip(jax.tree.leaves(shared.params), jax.tree.leaves(per_leaf.params), strict=True):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


@pytest.mark.slow
def test_per_leaf_reads_on_eight_devices_and_across_resume(tmp_path):
  data, loss_fn, params = regression_problem()
  source = dj.delays.per_leaf({"w": dj.delays.uniform(6), "b": dj.delays.uniform(2)})
  kw = dict(num_updates=36, sampling=dj.Sampling(batch_size=BATCH), seed=1)
  # The one-device run is in chunks of 4 (one compiled program serves it, the interrupted and the resumed run).
  whole = dj.simulate(loss_fn, _tx(), params, data, source, execution=dj.Execution(chunk_size=4), **kw)
  multi = dj.simulate(loss_fn, _tx(), params, data, source,
                      execution=dj.Execution(mesh=jax.make_mesh((8,), ("workers",))), **kw)
  for a, b in zip(jax.tree.leaves(whole.params), jax.tree.leaves(multi.params), strict=True):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-6)

  def stop(info):
    if info["chunk"] == 2:
      raise KeyboardInterrupt

  with pytest.raises(KeyboardInterrupt):
    dj.simulate(loss_fn, _tx(), params, data, source, execution=dj.Execution(chunk_size=4),
                checkpoint=dj.Checkpoint(tmp_path), record=dj.Record(callback=stop), **kw)
  resumed = dj.simulate(loss_fn, _tx(), params, data, source, execution=dj.Execution(chunk_size=4),
                        checkpoint=dj.Checkpoint(tmp_path), **kw)
  for a, b in zip(jax.tree.leaves((whole.params, whole.opt_state)),
                  jax.tree.leaves((resumed.params, resumed.opt_state)), strict=True):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
