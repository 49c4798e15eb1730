"""Asynchronous proximal SGD in its two forms: the prox on the server (TAP-SGD) or on the workers (DAP-SGD)."""

from __future__ import annotations

from typing import NamedTuple

import optax

from delayjax.transforms._hyperparams import check_number, check_positive_rate
from delayjax.transforms._proximal import ProxFn, proximal


class DapSgd(NamedTuple):
  """DAP-SGD as the three arguments of ``dj.simulate`` that realize it (see :func:`dap_sgd`)."""

  server: optax.GradientTransformation  # tx: adds the workers' deltas, w <- w + s delta
  worker: optax.GradientTransformation  # local_optimizer: a prox-gradient step at the stale read
  local_steps: int  # 1: each contribution is one worker step


def _check_prox(prox: ProxFn) -> None:
  if not callable(prox):
    raise TypeError(f"prox must be a callable (x, step) -> x such as dj.prox_l1(0.1), got {prox!r}.")


def tap_sgd(prox: ProxFn, learning_rate: float | optax.Schedule) -> optax.GradientTransformationExtraArgs:
  r"""TAP-SGD: asynchronous proximal SGD whose server applies the prox after the stale gradient step.

  For :math:`\min_w F(w) + R(w)`, a worker reads version :math:`v = u - \tau_u`
  and pushes a stochastic gradient of :math:`F` there; the server applies

  .. math::

    w_{u+1} = \text{prox}_{\gamma R}\big(w_u - \gamma\, \nabla f_{i_u}(w_{u - \tau_u})\big)

  It is ``optax.chain(optax.sgd(lr), dj.proximal(prox, lr))`` as the server
  transformation of ``dj.simulate`` with plain gradient workers. The server
  does the step and the prox (the "traditional" form of Li et al., whose
  master "carries much of the computation load"); :func:`dap_sgd` moves the
  prox to the workers.

  Args:
    prox: ``(x, step) -> prox_{step R}(x)`` on pytrees, e.g.
      :func:`~delayjax.transforms.prox_l1`.
    learning_rate: :math:`\gamma > 0`, a float, a scalar array or a schedule
      of the update count.

  Returns:
    An ``optax.GradientTransformationExtraArgs`` that needs ``params``.

  Examples:
    >>> import jax.numpy as jnp
    >>> import delayjax as dj
    >>> tx = dj.tap_sgd(dj.prox_l1(1.0), 0.5)
    >>> w = jnp.array([2.0, 0.2])
    >>> u, _ = tx.update(jnp.array([1.0, 0.0]), tx.init(w), w)
    >>> w + u  # soft-threshold [1.5, 0.2] by 0.5
    Array([1., 0.], dtype=float32)

  References:
    Li, Xu, Zhong, Ling, `Make Workers Work Harder: Decoupled Asynchronous
    Proximal Stochastic Gradient Descent <https://arxiv.org/abs/1605.06619>`_,
    arXiv 2016.
  """
  _check_prox(prox)
  learning_rate = check_positive_rate("learning_rate", learning_rate)
  return optax.chain(optax.sgd(learning_rate), proximal(prox, learning_rate))


def dap_sgd(prox: ProxFn, learning_rate: float, server_rate: float | optax.Schedule = 1.0) -> DapSgd:
  r"""DAP-SGD: the workers take the proximal step at their stale read; the server only adds.

  A worker reads version :math:`v = u - \tau_u`, takes the whole proximal
  gradient step there and pushes the difference; the server adds it, scaled
  by :math:`s_u` (``server_rate``, 1 by default: a plain addition):

  .. math::

    \delta_u = \text{prox}_{\gamma R}\big(w_v - \gamma\, \nabla f_{i_u}(w_v)\big) - w_v, \qquad
    w_{u+1} = w_u + s_u\, \delta_u

  Compare TAP-SGD (:func:`tap_sgd`), :math:`w_{u+1} = \text{prox}_{\gamma
  R}(w_u - \gamma \nabla f_{i_u}(w_v))`: without staleness and with
  :math:`s = 1` the two are the same step. Both have the proximal gradient
  fixed points, but under staleness DAP-SGD with :math:`s = 1` need not
  converge to them: where the prox sets a coordinate to zero,
  :math:`\delta_{u,i} = -w_{v,i}`, so that coordinate follows
  :math:`x_{u+1} = x_u - s\, x_{u-\tau}`, delayed gradient descent with
  step times curvature :math:`s`, which is unstable for :math:`s = 1` and
  any :math:`\tau \ge 1` (it is stable for :math:`s < 2\sin(\pi / (2(2\tau
  + 1)))`). An L1-regularized run with exact zeros at the optimum then ends
  on a cycle around it; a server rate :math:`s < 1`, or a decreasing
  schedule, converges (``tests/methods/test_methods_dap.py`` shows both).

  In ``dj.simulate`` this is a local-SGD worker with one local step: the
  worker's optimizer is ``optax.chain(optax.sgd(lr), dj.proximal(prox,
  lr))``, whose one step from :math:`w_v` is exactly
  :math:`w_v + \delta_u`; the runtime pushes :math:`w_v - (w_v + \delta_u) =
  -\delta_u` and the server ``optax.sgd(server_rate)`` adds
  :math:`s_u \delta_u`::

    dap = dj.dap_sgd(dj.prox_l1(lam), lr, server_rate=0.5)
    dj.simulate(loss_fn, dap.server, params, data, delays,
                worker=dj.workers.LocalSteps(dap.local_steps, dap.worker))

  ``loss_fn`` is the smooth part :math:`F` only. An update that combines
  several contributions (n-softsync, K-async) adds their weighted mean
  delta.

  What is confirmed and what is delayjax's construction: the division of
  labour (workers evaluate the proximal operator on the parameters they
  read; the master only performs additions) is the paper's own description
  (its abstract, reachable on arXiv). The exact master rule could not be
  read from a reachable source; the rule above (a constant worker step
  :math:`\gamma` shared by the gradient step and the prox, a master that adds
  the delta scaled by :math:`s_u`) is delayjax's reading of that
  description, and the instability at :math:`s = 1` is delayjax's finding
  for that reading. The worker's optimizer starts afresh for every
  contribution, so :math:`\gamma` is a constant; a diminishing step goes in
  ``server_rate``, whose schedule counts updates.

  Args:
    prox: ``(x, step) -> prox_{step R}(x)`` on pytrees, e.g.
      :func:`~delayjax.transforms.prox_l1`.
    learning_rate: :math:`\gamma > 0`, a float or a scalar array.
    server_rate: :math:`s_u > 0`, a float, a scalar array or a schedule of the update count.

  Returns:
    A :class:`DapSgd`: ``server`` (``tx``), ``worker`` (``local_optimizer``)
    and ``local_steps`` (1) for ``dj.simulate``.

  Examples:
    >>> import jax.numpy as jnp
    >>> import delayjax as dj
    >>> dap = dj.dap_sgd(dj.prox_l1(1.0), 0.5)
    >>> w_read = jnp.array([2.0, 0.2])
    >>> d, _ = dap.worker.update(jnp.array([1.0, 0.0]), dap.worker.init(w_read), w_read)
    >>> d  # prox(w_read - 0.5 g) - w_read = [1, 0] - [2, 0.2]
    Array([-1. , -0.2], dtype=float32)

  References:
    Li, Xu, Zhong, Ling, `Make Workers Work Harder: Decoupled Asynchronous
    Proximal Stochastic Gradient Descent <https://arxiv.org/abs/1605.06619>`_,
    arXiv 2016.
  """
  _check_prox(prox)
  if callable(learning_rate):
    raise TypeError(
        "learning_rate must be a float for dap_sgd: the worker's optimizer starts afresh for every "
        f"contribution, so a schedule would only ever be read at 0 (put a schedule in server_rate); got "
        f"{learning_rate!r}.")
  rate = check_number("learning_rate", learning_rate, minimum=0.0, strict_minimum=True)
  worker = optax.chain(optax.sgd(rate), proximal(prox, rate))
  return DapSgd(server=optax.sgd(check_positive_rate("server_rate", server_rate)), worker=worker, local_steps=1)
