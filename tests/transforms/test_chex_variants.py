"""At zero staleness delayjax's remedies are their synchronous counterparts, with and without jit (chex.variants)."""

import chex
import jax.numpy as jnp
import optax

import delayjax as dj

PARAMS = {"w": jnp.array([0.5, -1.0, 2.0], jnp.float32), "b": jnp.array(0.25, jnp.float32)}
GRADS = {"w": jnp.array([0.1, 0.2, -0.3], jnp.float32), "b": jnp.array(-0.5, jnp.float32)}


class ZeroStalenessIsSynchronous(chex.TestCase):

  def _check(self, remedy):
    tx = optax.chain(remedy, optax.sgd(0.1, momentum=0.9))
    reference = optax.sgd(0.1, momentum=0.9)
    state, ref_state = tx.init(PARAMS), reference.init(PARAMS)
    step = self.variant(lambda g, s, p: tx.update(g, s, p, staleness=jnp.int32(0), stale_params=p, worker=jnp.int32(0)))
    ref_step = self.variant(reference.update)
    for _ in range(3):
      updates, state = step(GRADS, state, PARAMS)
      ref_updates, ref_state = ref_step(GRADS, ref_state, PARAMS)
      chex.assert_trees_all_equal(updates, ref_updates)

  @chex.variants(with_jit=True, without_jit=True)
  def test_scale_by_staleness(self):
    self._check(dj.scale_by_staleness("inverse"))

  @chex.variants(with_jit=True, without_jit=True)
  def test_delay_compensation(self):
    self._check(dj.delay_compensation(2.0, adaptive=True, num_workers=2))
