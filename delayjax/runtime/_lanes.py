"""What one lane of ``dj.simulate``'s step computes: a contribution's minibatches, and its worker plug-in's push.

The server step (``_simulate._server_step``) runs one lane per contribution
under ``jax.vmap``. This module owns what a lane sees of the run: its
minibatches (``dj.Sampling``, drawn by ``_sampling.minibatch_indices``), the
loss and its gradient, and the :class:`~delayjax.runtime._workers.WorkerContext`
it hands the worker plug-in, which decides what the contribution is
(``Worker.contribute``). It also computes the inputs the *server* draws for an
update (Zeno's server minibatch, SVRG's full gradient), which need the same
loss and data.
"""

from __future__ import annotations

from typing import Any, Callable

import jax
import jax.numpy as jnp

from delayjax.runtime._sampling import contribution_key, minibatch_indices, server_minibatch_indices
from delayjax.runtime._workers import UpdateContext, Worker, WorkerContext

__all__ = ["Lanes"]


class Lanes:
  """A run's lane computation (static: built once per traced step).

  Args:
    loss_fn: the run's loss, ``loss_fn(params, batch)``, returning ``loss``
      or ``(loss, aux)`` (``has_aux``).
    worker: the bound worker plug-in.
    inputs: the runtime inputs ``tx`` requests (``dj.runtime_inputs``).
    num_examples, batch_size, sampling: the data set size and ``dj.Sampling``.
    max_batches: the most minibatches one contribution draws per group.
    full_batch_size: SVRG's full-gradient chunk (``Gradient.full_batch_size``).
  """

  def __init__(self, *, loss_fn: Callable[..., Any], has_aux: bool, worker: Worker, inputs: tuple[str, ...],
               num_examples: int, batch_size: int, sampling: str, max_batches: int, full_batch_size: int | None):
    self.loss_fn, self.has_aux, self.worker, self.inputs = loss_fn, has_aux, worker, inputs
    self.num_examples, self.batch_size, self.sampling = num_examples, batch_size, sampling
    self.max_batches, self.full_batch_size = max_batches, full_batch_size

  def grad(self, w: Any, batch: Any) -> Any:
    """The gradient of the loss (aux dropped) at ``w`` on ``batch``."""
    out = jax.grad(self.loss_fn, has_aux=self.has_aux)(w, batch)
    return out[0] if self.has_aux else out

  def value_and_grad(self, w: Any, batch: Any) -> tuple[jax.Array, Any]:
    """The loss (float32, aux dropped) and its gradient at ``w`` on ``batch``."""
    out, grad = jax.value_and_grad(self.loss_fn, has_aux=self.has_aux)(w, batch)
    loss = out[0] if self.has_aux else out
    return jnp.asarray(loss).astype(jnp.float32), grad

  def full_gradient(self, w: Any, data: Any, weights: Any = None) -> Any:
    r"""The gradient of ``loss_fn`` over all the data: at once, or by ``full_batch_size`` examples.

    With ``weights`` (``[num_examples]``), :math:`\frac1n \sum_i c_i \nabla f_i(w)`, :math:`f_i` the loss on
    example :math:`i` alone (``dj.hsag``'s sum over the examples outside its SAGA set).
    """
    n, size = self.num_examples, self.full_batch_size
    if size is None or size >= n:
      return self.grad(w, data) if weights is None else self._weighted_grad(w, data, weights, n)
    # Chunks of the mean loss, weighted by their share of the examples: the mean over all of them.
    whole, rest = divmod(n, size)
    chunks = jax.tree.map(lambda x: x[:whole * size].reshape((whole, size) + x.shape[1:]), data)
    if weights is None:
      total = jax.lax.map(lambda chunk: self.grad(w, chunk), chunks)
      total = jax.tree.map(lambda g: jnp.sum(g, axis=0) * jnp.asarray(size / n, g.dtype), total)
    else:
      parts = (chunks, weights[:whole * size].reshape(whole, size))
      total = jax.tree.map(lambda g: jnp.sum(g, axis=0),
                           jax.lax.map(lambda part: self._weighted_grad(w, part[0], part[1], n), parts))
    if rest:
      tail_data = jax.tree.map(lambda x: x[whole * size:], data)
      if weights is None:
        tail = jax.tree.map(lambda g: g * jnp.asarray(rest / n, g.dtype), self.grad(w, tail_data))
      else:
        tail = self._weighted_grad(w, tail_data, weights[whole * size:], n)
      total = jax.tree.map(lambda t, g: t + g, total, tail)
    return total

  def _weighted_grad(self, w: Any, batch: Any, weights: Any, n: int) -> Any:
    r""":math:`\frac1n \sum_j c_j \nabla f_j(w)` over the examples of ``batch``: one backward pass of the
    per-example losses (each example a batch of one), weighted."""
    def total(p):
      def one(ex):
        out = self.loss_fn(p, jax.tree.map(lambda x: x[None], ex))
        return out[0] if self.has_aux else out
      losses = jax.vmap(one)(batch)
      return jnp.sum(weights.astype(losses.dtype) * losses) / jnp.asarray(n, losses.dtype)
    return jax.grad(total)(w)

  def server_inputs(self, data: Any, seed: Any, params: Any, update: Any, refresh: Any,
                    full_weights: Any = None) -> dict[str, Any]:
    """The server inputs ``tx`` requested, at the server parameters ``params`` of ``update``.

    Every input that needs a minibatch uses the update's one server minibatch. ``full_weights``: per-example
    weights of the full gradient (``None``: the plain mean; see :meth:`full_gradient`).
    """
    out = {}
    if "zeno_grad" in self.inputs:
      idx = server_minibatch_indices(seed, update, num_examples=self.num_examples, batch_size=self.batch_size)
      out["zeno_grad"] = self.grad(params, jax.tree.map(lambda x: x[idx], data))
    if "full_grad" in self.inputs:
      # A cond, not a where: the full gradient costs a pass over the data and is due once an epoch;
      # its predicate comes from the host tables, the same on every device.
      out["full_grad"] = jax.lax.cond(refresh, lambda p: self.full_gradient(p, data, full_weights),
                                      lambda p: jax.tree.map(jnp.zeros_like, p), params)
      out["refresh"] = refresh
    return out

  def group(self, minibatch: Callable[[Any, Any], tuple[Any, Any]], w: Any, draw: Any, batches: Any,
            terms: Callable[..., Any] | None) -> tuple[jax.Array, dict[str, Any]]:
    """The mean loss and payload of one group of a lane's minibatches (draws ``draw .. draw + n - 1``).

    ``terms(w, batch, indices) -> (loss, summed, stacked)`` gives one
    minibatch's loss, its entries averaged over the group (gradients) and its
    per-example entries (concatenated); the default is the gradient alone.
    """
    if terms is None:
      def terms(w, batch, idx):
        loss, grad = self.value_and_grad(w, batch)
        return loss, {"grad": grad}, {}

    samples = self.max_batches * self.batch_size
    if self.max_batches == 1:
      loss, summed, stacked = terms(w, *minibatch(draw, 0))
      valid = jnp.ones((self.batch_size,), jnp.bool_)
    else:
      # Every lane draws max_batches minibatches and keeps its first `batches`: one static shape for all lanes.
      def body(acc, b):
        loss, summed, stacked = terms(w, *minibatch(draw, b))
        keep = b < batches
        acc_loss, acc_summed = acc
        acc_loss = acc_loss + jnp.where(keep, loss, 0.0)
        acc_summed = jax.tree.map(lambda a, g: a + jnp.where(keep, g, jnp.zeros((), g.dtype)), acc_summed, summed)
        return (acc_loss, acc_summed), stacked

      shapes = jax.eval_shape(lambda: terms(w, *minibatch(draw, 0)))[1]
      zero_sums = jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), shapes)
      (loss, summed), stacked = jax.lax.scan(body, (jnp.zeros((), jnp.float32), zero_sums),
                                             jnp.arange(self.max_batches, dtype=jnp.int32))
      loss = loss / batches.astype(jnp.float32)
      summed = jax.tree.map(lambda g: g / batches.astype(g.dtype), summed)
      stacked = jax.tree.map(lambda x: x.reshape((samples,) + x.shape[2:]), stacked)
      valid = jnp.repeat(jnp.arange(self.max_batches) < batches, self.batch_size)
    if "sample_indices" in stacked:
      stacked["sample_valid"] = valid
    return loss, {**summed, **stacked}

  def push(self, data: Any, seed: Any, stale: Any, snap: Any, update: Any, worker: Any, draw: Any, batches: Any,
           shard_row: Any, shard_size: Any, local_state: Any,
           examples: Any = None) -> tuple[jax.Array, dict[str, Any], Any]:
    """A lane's contribution, as the worker plug-in computes it from the parameters read (``stale``).

    ``examples``: ``None``, or int32 ``[max_batches, batch_size]``, the indices of the contribution's first group
    of minibatches drawn on the host (``_sampling.lane_examples``, the same indices), which the lane then takes
    instead of drawing them here; later groups (local steps) are still drawn here."""
    def minibatch(at, b):
      idx = minibatch_indices(seed, update, worker, at + b, num_examples=self.num_examples,
                              batch_size=self.batch_size, sampling=self.sampling, shard=shard_row,
                              shard_size=shard_size)
      return jax.tree.map(lambda x: x[idx], data), idx

    def first_group(at, b):
      if examples is None:
        return minibatch(at, b)
      return jax.tree.map(lambda x: x[examples[b]], data), examples[b]

    def gradient(w, h, terms=None):
      # Group h of the contribution's minibatches: draws h * batches, ..., h * batches + batches - 1.
      if isinstance(h, int) and h == 0:
        return self.group(first_group, w, draw, batches, terms)
      return self.group(minibatch, w, draw + h * batches, batches, terms)

    ctx = WorkerContext(gradient=gradient, worker=worker, update=update, key=contribution_key(seed, update, worker, draw),
                        value_and_grad=self.value_and_grad, minibatch=lambda b: first_group(draw, b),
                        inputs=self.inputs, snapshot=snap)
    return self.worker.contribute(ctx, stale, local_state)

  def at_update(self, seed: Any, params: Any, payloads: list[Any], update: Any, workers: Any,
                staleness: list[Any]) -> tuple[list[jax.Array], list[Any]]:
    """Each contribution of an update as the worker plug-in's ``at_update`` makes it at the server's
    ``params`` (the learner's side of a worker that pushes data, not a gradient)."""
    losses, out = [], []
    for k, payload in enumerate(payloads):
      ctx = UpdateContext(worker=workers[k], update=update, staleness=staleness[k],
                          # A key of the contribution's own (the k-th of the update), apart from its push's.
                          key=jax.random.fold_in(contribution_key(seed, update, workers[k], 0), 1 + k),
                          value_and_grad=self.value_and_grad)
      loss, payload = self.worker.at_update(ctx, params, payload)
      losses.append(jnp.asarray(loss).astype(jnp.float32))
      out.append(payload)
    return losses, out
