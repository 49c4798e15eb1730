"""A slow sequential reference for pipeline training, and a small staged MLP to test with.

The reference keeps every version of every stage in a Python list and
computes each micro-batch's gradient with an explicit backward loop of
``jax.vjp`` calls (not ``dj.staged_value_and_grad``'s custom VJP).
"""

from __future__ import annotations

import functools
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
import optax

import delayjax as dj


def mlp_problem(num_stages: int = 3, seed: int = 0, width: int = 6, n: int = 64):
  """A ``num_stages``-stage tanh MLP (the last stage linear) on a random 3-class problem."""
  rng = np.random.default_rng(seed)
  sizes = [5] + [width] * (num_stages - 1) + [3]
  params = [{"w": jnp.asarray(rng.normal(size=(a, b)) / np.sqrt(a), jnp.float32),
             "b": jnp.asarray(0.1 * rng.normal(size=b), jnp.float32)} for a, b in zip(sizes[:-1], sizes[1:])]

  def hidden(p, h):
    return jnp.tanh(h @ p["w"] + p["b"])

  def last(p, h):
    return h @ p["w"] + p["b"]

  stages = [hidden] * (num_stages - 1) + [last]

  def loss_fn(h, batch):
    return optax.softmax_cross_entropy_with_integer_labels(h, batch["y"]).mean()

  data = {"x": jnp.asarray(rng.normal(size=(n, 5)), jnp.float32), "y": jnp.asarray(rng.integers(0, 3, n), jnp.int32)}
  return stages, loss_fn, params, data


@functools.partial(jax.jit, static_argnames=("num_examples", "batch_size"))
def _indices(seed, update, micro, *, num_examples, batch_size):
  return dj.runtime.minibatch_indices(seed, update, micro, 0, num_examples=num_examples, batch_size=batch_size)


def explicit_grad(stages, loss_fn, forward_params, backward_params, batch):
  """Forward at ``forward_params`` keeping each stage's input, then VJPs at ``backward_params``."""
  inputs, h = [], batch["x"]
  for f, p in zip(stages, forward_params):
    inputs.append(h)
    h = f(p, h)
  loss, ct = jax.value_and_grad(loss_fn)(h, batch)
  grads = [None] * len(stages)
  for k in reversed(range(len(stages))):
    _, vjp = jax.vjp(stages[k], backward_params[k], inputs[k])
    grads[k], ct = vjp(ct)
  return loss, grads


def stored_dense_grad(stages, loss_fn, forward_params, backward_params, batch):
  """PipeDream without stashing, by hand for ``mlp_problem``'s stages (``tanh(h W + b)``, the last linear): the
  forward pass's activations, the backward weights only where the cotangent crosses a ``W``."""
  inputs, outputs, h = [], [], batch["x"]
  for f, p in zip(stages, forward_params):
    inputs.append(h)
    h = f(p, h)
    outputs.append(h)
  loss, ct = jax.value_and_grad(loss_fn)(h, batch)
  grads = [None] * len(stages)
  for k in reversed(range(len(stages))):
    delta = ct if k == len(stages) - 1 else ct * (1 - outputs[k] ** 2)
    grads[k] = {"w": inputs[k].T @ delta, "b": delta.sum(0)}
    ct = delta @ backward_params[k]["w"].T
  return loss, grads


def reference(stages, loss_fn, tx, params, data, schedule, *, batch_size, seed=0,
              read: Callable[[int, int, int, int, str, list, list], Any] | None = None, grad=explicit_grad):
  """Trains update by update; ``read(k, u, fv, bv, pass, versions_k, states_k)`` may override the weights read,
  ``grad`` computes a micro-batch's gradient (``explicit_grad`` or ``stored_dense_grad``)."""
  K, m, U = schedule.num_stages, schedule.num_microbatches, schedule.num_updates
  tx = optax.with_extra_args_support(tx)
  versions = [[p] for p in params]
  states = [[tx.init(p)] for p in params]
  num_examples = data["x"].shape[0]
  grad_fn = jax.jit(functools.partial(grad, tuple(stages), loss_fn))
  update_fn = jax.jit(tx.update)
  losses = []
  for u in range(U):
    all_grads, all_losses, first_forward = [], [], None
    for j in range(m):
      n = u * m + j
      fv, bv = schedule.forward_version[n], schedule.backward_version[n]
      if read is None:
        fps = [versions[k][fv[k]] for k in range(K)]
        bps = [versions[k][bv[k]] for k in range(K)]
      else:
        fps = [read(k, u, int(fv[k]), int(bv[k]), "forward", versions[k], states[k]) for k in range(K)]
        bps = [read(k, u, int(fv[k]), int(bv[k]), "backward", versions[k], states[k]) for k in range(K)]
      idx = _indices(seed, u, j, num_examples=num_examples, batch_size=batch_size)
      batch = jax.tree.map(lambda a: a[idx], data)
      loss, grads = grad_fn(fps, bps, batch)
      all_losses.append(loss)
      all_grads.append(grads)
      if j == 0:
        first_forward = fps
    losses.append(float(np.mean(all_losses)))
    for k in range(K):
      g = jax.tree.map(lambda *gs: jnp.mean(jnp.stack(gs), axis=0), *[gr[k] for gr in all_grads])
      n0 = u * m
      upd, state = update_fn(g, states[k][-1], versions[k][u],
                             staleness=jnp.int32(u - schedule.forward_version[n0, k]),
                             backward_staleness=jnp.int32(u - schedule.backward_version[n0, k]),
                             stale_params=first_forward[k])
      versions[k].append(optax.apply_updates(versions[k][u], upd))
      states[k].append(state)
  return [v[-1] for v in versions], np.array(losses), versions


def assert_trees_close(a, b, rtol=2e-6, atol=2e-7):
  for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
    np.testing.assert_allclose(np.asarray(x), np.asarray(y), rtol=rtol, atol=atol)
