r"""Coded workers: each push is a fixed linear combination of the gradients of the data parts a worker holds.

The worker's side of a gradient code (``dj.GradientCode``): the data are
split into ``n`` equal, contiguous parts; worker :math:`m` computes the
gradient of each of its ``n - k + 1`` parts at the parameters it read and
pushes their combination with its row of the encoding matrix. The server
decodes the full gradient from whichever ``k`` workers arrived
(``dj.decode_gradient_code``), so under ``dj.cluster.k_sync(k)`` the run is
full-batch gradient descent, however the stragglers fall.
"""

from __future__ import annotations

import hashlib
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from delayjax.runtime._workers import Worker
from delayjax.transforms._coded import GradientCode

__all__ = ["Coded"]


class Coded(Worker):
  r"""A gradient-code worker: the combination, with its row of :math:`B`, of its data parts' gradients.

  With ``code`` a :class:`~delayjax.GradientCode` of :math:`n` workers
  tolerating :math:`s = n - k` stragglers, ``data`` (a pytree of arrays with
  a leading axis of :math:`N` examples, :math:`N` a multiple of :math:`n`)
  is split into the contiguous parts :math:`D_p` = examples
  :math:`[pN/n, (p+1)N/n)`. A contribution of worker :math:`m` that read
  :math:`\tilde w` pushes

  .. math::

    c_m = \sum_{j=0}^{s} B_{m, p_j}\, \nabla \ell(\tilde w; D_{p_j}),
    \qquad p_j = (m + j) \bmod n,

  :math:`\nabla \ell(\tilde w; D_p)` the gradient of the run's loss (a
  mean over the batch) on the whole part: no minibatch is drawn, so
  ``dj.Sampling`` plays no part. The push's loss is the mean of the parts'
  losses. With ``optax.chain(dj.decode_gradient_code(code), optax.sgd(lr))``
  under ``dj.cluster.k_sync(k)`` on :math:`n` workers every update is
  :math:`w \leftarrow w - \text{lr}\, \nabla F(w)`, :math:`F` the loss over
  all of ``data``: full-batch gradient descent whichever :math:`k` workers
  arrive first. A worker's work is :math:`s + 1` parts, so its compute time
  in the cluster model should be :math:`s + 1` times an uncoded worker's
  (``dj.cluster.workers(..., speed=1 / (s + 1))``).

  With ``k = n`` (:math:`B = I`) each worker pushes its own part's gradient:
  the runtime's average over all :math:`n` is the full gradient (synchronous
  GD), and the average over the first :math:`k < n` under ``k_sync`` is the
  uncoded scheme that ignores the stragglers (inexact).

  **Only the paper's abstract could be read here** (PMLR and arXiv
  abstract pages, arXiv 2201.12990; the full text was not reachable): it
  encodes the partial derivatives themselves, decodes them from the workers
  that arrive, and compresses the codewords lossily. What is built is the
  library's closest exact construction, not the paper's algorithm: the
  cyclic gradient code of Tandon et al. (the encoding and the any-:math:`k`
  decoding are theirs), with no lossy compression of the messages (the
  paper's compression trades exactness, which this plug-in keeps) and no
  iterative (peeling) decoding of single messages as they arrive.

  Args:
    code: the :class:`~delayjax.GradientCode`; its ``num_workers`` must be
      the schedule's.
    data: the examples to split into the code's parts (usually
      ``dj.simulate``'s ``data``), a pytree of arrays with one leading axis
      of :math:`N`, a multiple of ``code.num_workers``.

  References:
    Soto, Ilmer, Guan, Li, `Lightweight Projective Derivative Codes for
    Compressed Asynchronous Gradient Descent <https://arxiv.org/abs/2201.12990>`_,
    ICML 2022.

    Tandon, Lei, Dimakis, Karampatziakis, `Gradient Coding: Avoiding
    Stragglers in Distributed Learning <https://proceedings.mlr.press/v70/tandon17a.html>`_,
    ICML 2017.
  """

  def __init__(self, code: GradientCode, data: Any):
    if not isinstance(code, GradientCode):
      raise TypeError(f"Coded.code must be a dj.GradientCode (e.g. dj.GradientCode(8, k=6)), got "
                      f"{type(code).__name__} {code!r}.")
    leaves = jax.tree.leaves(data)
    if not leaves:
      raise ValueError("Coded.data must hold at least one array with a leading [examples] axis, got no arrays.")
    sizes = {np.shape(x)[0] if np.ndim(x) else None for x in leaves}
    if len(sizes) != 1 or None in sizes:
      raise ValueError(f"Coded.data's arrays must share one leading [examples] axis, got shapes "
                       f"{[np.shape(x) for x in leaves]}.")
    (size,) = sizes
    if size == 0 or size % code.num_workers:
      raise ValueError(f"Coded.data must hold a positive multiple of code.num_workers = {code.num_workers} "
                       f"examples (equal parts), got {size}.")
    # Kept as given: made JAX arrays when traced, in the precision the run has then (float64 under x64).
    self.code, self.data = code, data
    self.part_size = size // code.num_workers
    self._digest = _data_digest(self.data)

  def __repr__(self) -> str:
    return f"Coded({self.code!r}, data with {self.part_size * self.code.num_workers} examples)"

  def bind(self, num_workers, padded_workers):
    if num_workers != self.code.num_workers:
      raise ValueError(f"Coded.code has num_workers={self.code.num_workers}, but the schedule has {num_workers} "
                       f"workers; build the code for the schedule's workers.")
    return self

  def contribute(self, ctx, read, state):
    n, size = self.code.num_workers, self.part_size
    # Padding lanes (idle workers beyond n) never contribute; keep their indices in range.
    worker = jnp.minimum(ctx.worker, n - 1)
    row = jnp.asarray(self.code.matrix)[worker]
    losses, message = [], None
    for j in range(self.code.stragglers + 1):
      part = (worker + j) % n
      batch = jax.tree.map(lambda x: jax.lax.dynamic_slice_in_dim(jnp.asarray(x), part * size, size), self.data)
      loss, grad = ctx.value_and_grad(read, batch)
      weight = row[part]
      term = jax.tree.map(lambda g: weight.astype(g.dtype) * g, grad)
      message = term if message is None else jax.tree.map(jnp.add, message, term)
      losses.append(loss)
    return jnp.mean(jnp.stack(losses)), {"grad": message}, ()

  def identity(self):
    return {"code": (self.code.num_workers, self.code.k, self.code.seed), "coded_data": self._digest}

  def requests_allowed(self):
    return False


def _data_digest(data: Any) -> str:
  """A digest of ``data``'s structure, shapes, dtypes and values: the run's numbers depend on all of them."""
  digest = hashlib.sha256(str(jax.tree.structure(data)).encode())
  for leaf in jax.tree.leaves(data):
    array = np.asarray(leaf)
    digest.update(f"{array.shape}{array.dtype}".encode())
    digest.update(np.ascontiguousarray(array).tobytes())
  return digest.hexdigest()
