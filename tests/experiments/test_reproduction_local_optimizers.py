"""experiments.local_optimizers: the recipe pushes the worker's own Adam step, and the claims' direction."""

import jax.numpy as jnp
import numpy as np
import optax

from experiments import local_optimizers


def test_the_recipe_adds_the_workers_step_unscaled():
  tx, worker = local_optimizers.local_optimizers(optax.adam(1e-3))
  assert worker.steps == 1 and worker.keep_state
  push = {"w": jnp.array([0.5, -2.0])}
  update, _ = tx.update(push, tx.init(push))
  np.testing.assert_allclose(update["w"], -push["w"])


def _row(**per_seed):
  return {k: float(np.mean(list(v.values()))) for k, v in per_seed.items()} | {"per_seed": per_seed}


def test_the_penalty_claim_is_one_sided_against_half_a_point():
  seeds = range(6)
  asgd = {s: 0.04 + 0.001 * s for s in seeds}
  close = {s: 0.041 + 0.001 * s + 0.0002 * (s % 2) for s in seeds}   # +0.1 points
  worse = {s: 0.06 + 0.001 * s + 0.0002 * (s % 2) for s in seeds}    # +2 points
  loss = {s: 0.2 + 0.01 * s for s in seeds}
  lower = {s: 0.15 + 0.01 * s + 0.001 * (s % 2) for s in seeds}
  summary = {"asgd": _row(test_error=asgd, train_loss=loss), "delayed": _row(test_error=worse, train_loss=loss),
             "delayed-local": _row(test_error=close, train_loss=lower)}
  verdicts = {c.name: c.check(summary).verdict for c in local_optimizers.CLAIMS}
  assert verdicts == {"local-beats-delayed": "held", "negligible-penalty": "held"}
  summary["delayed-local"] = _row(test_error=worse, train_loss=loss | {0: 0.3})
  verdicts = {c.name: c.check(summary).verdict for c in local_optimizers.CLAIMS}
  assert verdicts["negligible-penalty"] == "not held"
