"""GEM, gradient energy matching (Hermans & Louppe 2018): each worker's step rescaled to a target momentum SGD."""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

from delayjax._sharding import stacked_zeros
from delayjax.transforms._extra_args import check_worker, nan_unless, require_extra
from delayjax.transforms._hooks import table_rows
from delayjax.transforms._hyperparams import check_number, check_static_int, coefficient
from delayjax.transforms._rows import after_reads, written_row


class GemState(NamedTuple):
  """State of :func:`gem`: per worker, its momentum proxy and the server parameters at its last commit."""

  momentum: Any  # pytree, [num_workers, *shape] per leaf: row m is worker m's m_m = mu m_m - lr g
  pulled: Any  # pytree, [num_workers, *shape] per leaf: row m is the server parameters worker m last pulled

  def worker_capacity(self) -> int | None:
    return table_rows(self.momentum)


def gem(
    learning_rate: float | jax.Array,
    momentum: float | jax.Array = 0.9,
    kappa: float | jax.Array = 1.0,
    *,
    num_workers: int,
    eps: float | jax.Array = 1e-12,
    max_scale: float | jax.Array = 5.0,
) -> optax.GradientTransformationExtraArgs:
  r"""GEM: rescales each worker's step so the workers' collective energy matches a target momentum SGD.

  For a gradient :math:`g` of worker :math:`m`, committed while the server
  holds :math:`x`:

  .. math::

    \Delta = -\eta\, g, \qquad
    p_m \leftarrow \mu\, p_m + \Delta, \qquad
    \pi = \operatorname{clip}\!\left(
      \frac{\kappa\, |p_m| - |x - \tilde x_m|}{|\Delta + \epsilon|},\ 0,\ \pi_{max}\right),
    \qquad u = \pi \odot \Delta, \qquad \tilde x_m \leftarrow x

  elementwise. :math:`p_m` is the worker's *proxy*: the velocity that
  sequential SGD with momentum :math:`\mu` would have on this worker's
  gradients, the target whose energy the asynchronous system should not
  exceed. :math:`x - \tilde x_m` is how far the server moved since worker
  :math:`m`'s previous commit (the other workers' updates and its own last
  one): the energy the system already spent. The step :math:`\Delta` gets
  whatever energy is left, never a negative scale, at most
  :math:`\pi_{max}` times (5 in the authors' code, "for numerical
  stability"). :math:`\kappa` amplifies the proxy (the authors' script
  uses 1 and notes that 2 worked well).

  The worker's gradient is computed at its local model, the server model it
  pulled plus its own step; on an ASP schedule that is the server model it
  reads right after its push, which ``dj.simulate`` hands it. :math:`\tilde
  x_m` starts at the initial parameters (the workers' first pull).

  **Source of the rule.** Only the abstract of the paper was reachable; the
  rule above follows the authors' code (the ``Worker`` class of
  ``code/gem.py`` in github.com/montefiore-institute/gradient-energy-matching):
  the order of the momentum update, the pull, :math:`\epsilon` added to
  :math:`\Delta` before the absolute value, and the clip to
  :math:`[0, 5]`.

  This is a complete optimizer: its output is the server's step (add it
  with ``optax.apply_updates``), so chain no SGD after it.

  Args:
    learning_rate: :math:`\eta > 0`.
    momentum: :math:`\mu` of the target momentum SGD, in ``[0, 1)``.
    kappa: :math:`\kappa \ge 0`, the proxy's amplification.
    num_workers: the number of workers (sizes the per-worker rows); the
      ``worker`` extra argument selects the row.
    eps: :math:`\epsilon \ge 0`, added to :math:`\Delta` before the division
      (the authors' ``10e-13``).
    max_scale: :math:`\pi_{max} > 0`.

  Returns:
    An ``optax.GradientTransformationExtraArgs`` that needs ``params`` (the
    server's parameters) and the ``worker`` extra argument.

  Examples:
    >>> import jax.numpy as jnp
    >>> import delayjax as dj
    >>> tx = dj.gem(0.1, momentum=0.5, num_workers=2)
    >>> x = jnp.zeros(1)
    >>> state = tx.init(x)
    >>> # The server has not moved since worker 0's first pull: pi = |p| / |Delta| = 1.
    >>> u, state = tx.update(jnp.array([1.0]), state, x, worker=0)
    >>> u
    Array([-0.1], dtype=float32)

  References:
    Hermans, Louppe, `Gradient Energy Matching for Distributed Asynchronous
    Gradient Descent <https://arxiv.org/abs/1805.08469>`_, 2018; the rule as
    in the authors' code (github.com/montefiore-institute/gradient-energy-matching).
  """
  lr = check_number("learning_rate", learning_rate, minimum=0.0, strict_minimum=True)
  mu = check_number("momentum", momentum, minimum=0.0, maximum=1.0, strict_maximum=True)
  kappa = check_number("kappa", kappa, minimum=0.0)
  eps = check_number("eps", eps, minimum=0.0)
  max_scale = check_number("max_scale", max_scale, minimum=0.0, strict_minimum=True)
  num_workers = check_static_int("num_workers", num_workers, minimum=1)

  def init_fn(params):
    return GemState(momentum=jax.tree.map(lambda p: stacked_zeros(p, num_workers), params),
                    pulled=jax.tree.map(lambda p: stacked_zeros(p, num_workers) + p, params))

  def update_fn(updates, state, params=None, *, worker=None, **extra_args):
    del extra_args
    params = require_extra("gem", "params", params, "the server's parameters")
    m, in_range = check_worker("gem", worker, num_workers)
    steps = jax.tree.map(lambda g: -coefficient(lr, g.dtype) * g, updates)
    table = written_row(state.momentum, m, lambda old: jax.tree.map(
        lambda p, d: coefficient(mu, p.dtype) * p + d, old, steps))

    def scaled(d, proxy, x, pulled):
      moved = jnp.abs(x - pulled[m])
      pi = (coefficient(kappa, d.dtype) * jnp.abs(proxy[m]) - moved) / jnp.abs(d + coefficient(eps, d.dtype))
      pi = jnp.clip(pi, 0.0, coefficient(max_scale, d.dtype))
      return nan_unless(in_range, 1.0, d.dtype) * pi * d

    out = jax.tree.map(scaled, steps, table, params, state.pulled)
    # The pull of this commit replaces the row read above: written after every output computed from it.
    index = after_reads(m, num_workers, out)
    pulled = jax.tree.map(lambda t, x: t.at[index].set(x.astype(t.dtype)), state.pulled, params)
    return out, GemState(momentum=table, pulled=pulled)

  return optax.GradientTransformationExtraArgs(init_fn, update_fn)
