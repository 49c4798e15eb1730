"""Per-layer optimizers: delayjax transformations inside optax.multi_transform and optax.masked.

Optax hides the other groups' updates and parameters behind MaskedNode but
passes extra arguments whole; each transformation takes the part of a
tree-valued extra argument under its group. The reference applies each
group's optimizer by hand to its own sub-tree, with the sub-trees of the
extra arguments.
"""

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import delayjax as dj

from remedy_checks import random_like

PARAMS = {"a": jnp.array([0.5, -1.0, 2.0]), "b": {"w": jnp.array([[1.0, -2.0], [0.5, 0.25]])},
          "c": jnp.array([3.0, -0.5])}
LABELS = {"a": "delayed", "b": {"w": "plain"}, "c": "delayed"}
MINE = ("a", "c")  # the leaves of the "delayed" group


def subtree(tree):
  return {k: tree[k] for k in MINE}


def extras(params, step):
  """Every tree-valued extra argument, as a runtime passes it: whole trees like the parameters."""
  return {"stale_params": jax.tree.map(lambda p: 0.8 * p - 0.1, params),
          "staleness": {"a": jnp.int32(step % 3), "b": {"w": jnp.int32(1)}, "c": jnp.int32(2)},
          "worker": jnp.int32(step % 2),
          "zeno_grad": random_like(params, 100 + step),
          "snapshot_grad": random_like(params, 200 + step),
          "full_grad": random_like(params, 300 + step),
          "sample_indices": jnp.array([step % 4, (step + 1) % 4], jnp.int32),
          "sample_grads": jax.tree.map(lambda p: jnp.stack([p, -0.5 * p]) + step, params),
          "sample_snapshot_grads": jax.tree.map(lambda p: jnp.stack([0.5 * p, p]) - step, params)}


def sub_extras(kwargs):
  return {k: (v if k in ("worker", "sample_indices") else subtree(v)) for k, v in kwargs.items()}


# Transformations that take tree-valued extra arguments, each in front of SGD.
DELAYED = {
    "delay_compensation": lambda: dj.delay_compensation(0.5),
    "delay_compensation_a": lambda: dj.delay_compensation(2.0, adaptive=True, num_workers=2),
    "scale_by_staleness": lambda: dj.scale_by_staleness("polynomial", a=1.0),
    "fed_async": lambda: dj.fed_async(0.5, "hinge", a=1.0, b=0),
    "zeno_plus_plus": lambda: dj.zeno_plus_plus(0.1, inner=optax.identity()),
    "svrg": dj.svrg,
    "saga": lambda: dj.saga(4),
    "hsag": lambda: dj.hsag(4, [1, 3]),
    "prox_svrg": lambda: dj.prox_svrg(dj.prox_l1(0.1), 0.2),
    "dap_svrg": lambda: dj.dap_svrg(dj.prox_l1(0.1), 0.2, server_rate=0.5),
    "delay_adaptive_sgd": lambda: dj.delay_adaptive_sgd(1.0, 1.5),
}


@pytest.mark.parametrize("name", DELAYED)
def test_multi_transform_equals_each_group_by_hand(name):
  tx = optax.multi_transform({"delayed": optax.chain(DELAYED[name](), optax.sgd(0.1)), "plain": optax.sgd(0.3)},
                             LABELS)
  mine = optax.chain(DELAYED[name](), optax.sgd(0.1))
  plain = optax.sgd(0.3)
  params = PARAMS
  state, mine_state, plain_state = tx.init(params), mine.init(subtree(params)), plain.init(params["b"])
  update = jax.jit(lambda g, s, p, kw: tx.update(g, s, p, **kw))
  for step in range(3):
    grads, kwargs = random_like(params, step), extras(params, step)
    got, state = update(grads, state, params, kwargs)
    want, mine_state = mine.update(subtree(grads), mine_state, subtree(params), **sub_extras(kwargs))
    want_b, plain_state = plain.update(grads["b"], plain_state, params["b"])
    chex.assert_trees_all_close(subtree(got), want, rtol=1e-6, atol=1e-7)
    chex.assert_trees_all_close(got["b"], want_b, rtol=1e-6, atol=1e-7)
    params = optax.apply_updates(params, got)


def test_dc_asgd_on_some_layers_and_sgd_on_the_rest_by_hand():
  """The example of per-layer optimizers: DC-ASGD on the labelled layers, against its rule in NumPy."""
  lam, lr = 0.5, 0.1
  tx = optax.multi_transform({"delayed": optax.chain(dj.delay_compensation(lam), optax.sgd(lr)),
                              "plain": optax.sgd(lr)}, LABELS)
  grads, stale = random_like(PARAMS, 0), jax.tree.map(lambda p: 0.5 * p, PARAMS)
  got, _ = tx.update(grads, tx.init(PARAMS), PARAMS, stale_params=stale)
  for k in MINE:
    g, w, w_bak = (np.asarray(t[k], np.float64) for t in (grads, PARAMS, stale))
    np.testing.assert_allclose(got[k], -lr * (g + lam * g * g * (w - w_bak)), rtol=1e-6)
  np.testing.assert_allclose(got["b"]["w"], -lr * np.asarray(grads["b"]["w"]), rtol=1e-6)


@pytest.mark.parametrize("compatible", [False, True])
def test_masked_takes_the_masked_part_of_extra_arguments(compatible):
  mask = {"a": True, "b": {"w": False}, "c": True}
  tx = optax.masked(dj.delay_compensation(0.5), mask, mask_compatible_extra_args=compatible)
  grads, kwargs = random_like(PARAMS, 1), extras(PARAMS, 1)
  got, _ = tx.update(grads, tx.init(PARAMS), PARAMS, stale_params=kwargs["stale_params"])
  ref = dj.delay_compensation(0.5)
  want, _ = ref.update(subtree(grads), ref.init(subtree(PARAMS)), subtree(PARAMS),
                       stale_params=subtree(kwargs["stale_params"]))
  chex.assert_trees_all_equal(subtree(got), want)
  np.testing.assert_array_equal(got["b"]["w"], grads["b"]["w"])  # outside the mask: passed through


def test_a_tree_that_matches_no_group_is_still_refused():
  tx = optax.multi_transform({"delayed": dj.delay_compensation(0.5), "plain": optax.identity()}, LABELS)
  with pytest.raises(ValueError, match="stale_params must have the structure of the updates"):
    tx.update(PARAMS, tx.init(PARAMS), PARAMS, stale_params={"a": PARAMS["a"]})
  with pytest.raises(ValueError, match=r"stale_params leaves must have the shapes of the updates.*'c'"):
    tx.update(PARAMS, tx.init(PARAMS), PARAMS, stale_params={**PARAMS, "c": jnp.ones(5)})


def test_dana_in_one_group_reads_its_look_ahead_and_the_rest_as_they_are():
  tx = optax.multi_transform({"delayed": dj.dana(0.1, momentum=0.5, num_workers=2), "plain": optax.sgd(0.3)},
                             LABELS)
  dana = dj.dana(0.1, momentum=0.5, num_workers=2)
  state, dana_state = tx.init(PARAMS), dana.init(subtree(PARAMS))
  for step in range(2):
    grads = random_like(PARAMS, step)
    _, state = tx.update(grads, state, PARAMS, worker=step)
    _, dana_state = dana.update(subtree(grads), dana_state, subtree(PARAMS), worker=step)
  read = dj.read_params(state, PARAMS, worker=0)
  chex.assert_trees_all_close(subtree(read), dj.read_params(dana_state, subtree(PARAMS), worker=0), rtol=1e-6)
  chex.assert_trees_all_equal(read["b"], PARAMS["b"])
  assert dj.worker_capacity(state) == 2
