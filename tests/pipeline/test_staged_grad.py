"""``dj.staged_value_and_grad``: jax.grad with equal versions, a NumPy backward pass with different ones."""

import functools
import os
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import delayjax as dj

sys.path.insert(0, os.path.dirname(__file__))
from pipeline_reference import explicit_grad, mlp_problem  # noqa: E402


def plain_loss(stages, loss_fn, params, batch):
  h = batch["x"]
  for f, p in zip(stages, params):
    h = f(p, h)
  return loss_fn(h, batch)


@pytest.mark.parametrize("backward", ["recompute", "stored"])
def test_equal_versions_are_jax_grad_bit_for_bit(backward):
  stages, loss_fn, params, data = mlp_problem(3)
  batch = jax.tree.map(lambda a: a[:16], data)
  fn = dj.staged_value_and_grad(stages, loss_fn, backward=backward)
  ref = jax.jit(jax.value_and_grad(lambda ps: plain_loss(stages, loss_fn, ps, batch)))
  fn = jax.jit(fn)
  loss, grads = fn(params, params, batch)
  loss_ref, grads_ref = ref(params)
  np.testing.assert_array_equal(loss, loss_ref)
  jax.tree.map(np.testing.assert_array_equal, list(grads), grads_ref)


def test_different_versions_match_a_numpy_backward_pass():
  """Two stages: h = tanh(x W0 + b0), out = h W1 + b1, loss = sum((out - y)^2) / (2B)."""
  rng = np.random.default_rng(1)
  B = 7
  x, y = rng.normal(size=(B, 4)), rng.normal(size=(B, 2))
  fwd = [{"w": rng.normal(size=(4, 5)), "b": rng.normal(size=5)}, {"w": rng.normal(size=(5, 2)), "b": rng.normal(size=2)}]
  bwd = [{"w": rng.normal(size=(4, 5)), "b": rng.normal(size=5)}, {"w": rng.normal(size=(5, 2)), "b": rng.normal(size=2)}]

  a0 = x @ fwd[0]["w"] + fwd[0]["b"]
  h = np.tanh(a0)
  out = h @ fwd[1]["w"] + fwd[1]["b"]
  loss = np.sum((out - y) ** 2) / (2 * B)
  d_out = (out - y) / B
  g1 = {"w": h.T @ d_out, "b": d_out.sum(0)}
  d_h = d_out @ bwd[1]["w"].T  # the backward weights of stage 1 carry the cotangent
  a0_b = x @ bwd[0]["w"] + bwd[0]["b"]  # stage 0's VJP at its backward weights, on its forward input x
  d_a0 = d_h * (1 - np.tanh(a0_b) ** 2)
  g0 = {"w": x.T @ d_a0, "b": d_a0.sum(0)}

  stages = [lambda p, h: jnp.tanh(h @ p["w"] + p["b"]), lambda p, h: h @ p["w"] + p["b"]]
  loss_fn = lambda out, batch: jnp.sum((out - batch["y"]) ** 2) / (2 * B)  # noqa: E731
  f32 = lambda t: jax.tree.map(lambda a: jnp.asarray(a, jnp.float32), t)  # noqa: E731
  batch = f32({"x": x, "y": y})
  got_loss, got = jax.jit(dj.staged_value_and_grad(stages, loss_fn))(f32(fwd), f32(bwd), batch)
  np.testing.assert_allclose(got_loss, loss, rtol=1e-5)
  for k, want in enumerate([g0, g1]):
    for name in ("w", "b"):
      np.testing.assert_allclose(got[k][name], want[name], rtol=2e-5, atol=2e-6)


def test_stored_backward_is_pipedreams_without_stashing():
  """Two stages of two dense layers each, under vmap over micro-batches with their own versions: the backward
  pass on the forward pass's activations, the backward weights only where a cotangent crosses a W, by hand in
  NumPy; not the recomputed form."""
  rng = np.random.default_rng(3)
  M, B, sizes = 2, 6, [4, 5, 5, 3, 2]
  layer = lambda a, b: {"w": rng.normal(size=(M, a, b)) * 0.7, "b": rng.normal(size=(M, b)) * 0.3}  # noqa: E731
  fwd = [[layer(4, 5), layer(5, 5)], [layer(5, 3), layer(3, 2)]]
  bwd = [[layer(4, 5), layer(5, 5)], [layer(5, 3), layer(3, 2)]]
  x, y = rng.normal(size=(M, B, 4)), rng.normal(size=(M, B, 2))

  def numpy_grads(i):
    flat_f = [layer[j] for stage in fwd for j in range(2) for layer in [stage]]
    flat_f = [{n: v[i] for n, v in lay.items()} for lay in flat_f]
    flat_b = [{n: v[i] for n, v in lay.items()} for stage in bwd for lay in stage]
    acts = [x[i]]
    for j, lay in enumerate(flat_f):
      z = acts[-1] @ lay["w"] + lay["b"]
      acts.append(z if j == 3 else np.tanh(z))
    ct, grads = (acts[-1] - y[i]) / B, [None] * 4
    for j in reversed(range(4)):
      delta = ct if j == 3 else ct * (1 - acts[j + 1] ** 2)
      grads[j] = {"w": acts[j].T @ delta, "b": delta.sum(0)}
      ct = delta @ flat_b[j]["w"].T
    return [grads[:2], grads[2:]]

  def stage(last):
    def apply(p, h):
      h = jnp.tanh(h @ p[0]["w"] + p[0]["b"])
      h = h @ p[1]["w"] + p[1]["b"]
      return h if last else jnp.tanh(h)
    return apply

  stages = [stage(False), stage(True)]
  loss_fn = lambda out, batch: jnp.sum((out - batch["y"]) ** 2) / (2 * B)  # noqa: E731
  f32 = lambda t: jax.tree.map(lambda a: jnp.asarray(a, jnp.float32), t)  # noqa: E731
  run = lambda backward: jax.jit(jax.vmap(dj.staged_value_and_grad(stages, loss_fn, backward=backward)))(  # noqa: E731
      f32(fwd), f32(bwd), f32({"x": x, "y": y}))[1]
  stored, recomputed = run("stored"), run("recompute")
  for i in range(M):
    want = numpy_grads(i)
    for k in range(2):
      for j in range(2):
        for name in ("w", "b"):
          np.testing.assert_allclose(stored[k][j][name][i], want[k][j][name], rtol=2e-5, atol=2e-6)
  assert not np.allclose(recomputed[0][0]["w"], stored[0][0]["w"], rtol=1e-2)


def test_three_stages_match_explicit_vjps_under_vmap():
  stages, loss_fn, params, data = mlp_problem(3, seed=2)
  other = jax.tree.map(lambda p: p * 0.7 + 0.05, params)
  batches = jax.tree.map(lambda a: a[:24].reshape((3, 8) + a.shape[1:]), data)
  fn = dj.staged_value_and_grad(stages, loss_fn)
  losses, grads = jax.jit(jax.vmap(fn, in_axes=(None, None, 0)))(params, other, batches)
  explicit = jax.jit(functools.partial(explicit_grad, stages, loss_fn))
  for i in range(3):
    batch = jax.tree.map(lambda a: a[i], batches)
    loss, want = explicit(params, other, batch)
    np.testing.assert_allclose(losses[i], loss, rtol=1e-6)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a[i], b, rtol=1e-5, atol=1e-6), list(grads), want)


def test_bad_arguments():
  stages, loss_fn, params, data = mlp_problem(2)
  with pytest.raises(TypeError, match="stage_fns"):
    dj.staged_value_and_grad([], loss_fn)
  with pytest.raises(ValueError, match="backward must be one of"):
    dj.staged_value_and_grad(stages, loss_fn, backward="latest")
  fn = dj.staged_value_and_grad(stages, loss_fn)
  with pytest.raises(ValueError, match="backward_params"):
    fn(params, params[:1], data)
