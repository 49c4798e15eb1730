"""Asynchronous proximal SGD in its two forms: the prox on the server (TAP-SGD) or on the workers (DAP-SGD)."""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
import optax

from delayjax.transforms._extra_args import like_updates
from delayjax.transforms._hyperparams import check_number, check_positive_rate
from delayjax.transforms._proximal import ProxFn, proximal
from delayjax.transforms._variance_reduction import svrg


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

  **Asyn-ProxSGD.** The same rule is Zhu, Niu and Li's asynchronous proximal
  SGD for *nonconvex* :math:`F` (smooth, Lipschitz gradient) plus a convex,
  possibly nonsmooth :math:`R`: a worker pulls the model, computes a
  minibatch gradient :math:`G` of :math:`F` there and pushes it; the server
  takes :math:`x_{k+1} = \text{prox}_{\eta R}(x_k - \eta G)`. Where an update
  combines several contributions (K-async, n-softsync schedules),
  ``dj.simulate`` applies their minibatch-weighted mean: a minibatch whose
  samples each have their own delay, the form in which analyses of
  asynchronous SGD (Lian et al. 2015) write the update:

  .. math::

    x_{k+1} = \text{prox}_{\eta_k R}\Big(x_k - \frac{\eta_k}{N}
    \sum_{i=1}^{N} \nabla F(x_{k - \tau(k, i)}; \xi_{k, i})\Big)

  Without convexity the iterates are measured by the proximal gradient
  mapping :math:`\|x - \text{prox}_{\eta R}(x - \eta \nabla F(x))\| / \eta`
  (``dj.analysis.gradient_mapping_norm``), for which they prove an ergodic
  :math:`O(1/\sqrt K)` rate after :math:`K` updates under bounded delays and
  a constant minibatch size, and near-linear speed-up in the number of
  workers. What is confirmed: the rate and the speed-up, and a parameter
  server whose workers compute stochastic gradients at the model they
  pulled, as their abstract and introduction state them. Their algorithm
  box, the per-sample-delay form of their analysis and their step-size
  condition (a step that shrinks as the delay bound grows) could not be
  read from a reachable source: the rule above is delayjax's reading of the
  method, the standard proximal step at the server, and the step-size
  constants are not restated here.
  ``tests/methods/test_methods_async_prox.py`` checks this rule through
  ``dj.simulate`` on a nonconvex loss against a float64 NumPy
  re-implementation.

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

    Zhu, Niu, Li, `Asynchronous Stochastic Proximal Methods for Nonconvex
    Nonsmooth Optimization <https://arxiv.org/abs/1802.08880>`_, arXiv 2018.
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


def _step_at_read(worker: optax.GradientTransformation) -> optax.GradientTransformationExtraArgs:
  """The pseudo-gradient ``-(w_read + d) + w_read = -d`` of ``worker``'s one step ``d`` from the stale read
  (``stale_params``; ``params`` when synchronous), from a fresh worker state: what a DAP worker pushes."""

  def init_fn(params):
    del params
    return optax.EmptyState()

  def update_fn(updates, state, params=None, *, stale_params=None, **extra_args):
    del extra_args
    # Inside optax.masked / multi_transform, the part of the (whole) stale parameters under this group.
    read = params if stale_params is None else like_updates("stale_params", stale_params, updates)
    if read is None:
      raise ValueError("dap_svrg needs params (or stale_params): the proximal step is taken at the parameters read.")
    step, _ = worker.update(updates, worker.init(read), read)
    return jax.tree.map(jnp.negative, step), state

  return optax.GradientTransformationExtraArgs(init_fn, update_fn)


def dap_svrg(prox: ProxFn, learning_rate: float, server_rate: float | optax.Schedule = 1.0
             ) -> optax.GradientTransformationExtraArgs:
  r"""DAP-SVRG: DAP-SGD's proximal step at the stale read, on SVRG's variance-reduced gradient.

  For :math:`\min_w F(w) + R(w)` with :math:`F = \frac1n \sum_i f_i`, an
  epoch fixes a snapshot :math:`\tilde w` and :math:`\mu = \nabla F(\tilde
  w)` (:func:`svrg`); a worker that read version :math:`v = u - \tau_u`
  takes :func:`dap_sgd`'s proximal step there with the SVRG estimate in
  place of the stochastic gradient, and the server adds the difference,
  scaled by :math:`s_u` (``server_rate``):

  .. math::

    g_u = \nabla f_{B_u}(w_v) - \nabla f_{B_u}(\tilde w) + \mu, \qquad
    \delta_u = \text{prox}_{\gamma R}\big(w_v - \gamma\, g_u\big) - w_v, \qquad
    w_{u+1} = w_u + s_u\, \delta_u

  The variance of :math:`g_u` vanishes at the optimum, so for strongly convex
  :math:`F` a constant :math:`\gamma` converges linearly where DAP-SGD stalls
  at its noise floor. As for DAP-SGD, where the prox sets a coordinate to
  zero that coordinate follows :math:`x_{u+1} = x_u - s\, x_{u-\tau}`, stable
  only for :math:`s < 2\sin(\pi / (2(2\tau + 1)))`: under staleness take
  :math:`s < 1` (``tests/methods/test_methods_dap_svrg.py`` shows the linear
  rate with :math:`s = 0.4`, :math:`\tau \le 3`).

  It is one transformation for ``dj.simulate``'s server,
  ``optax.chain(dj.svrg(), step, optax.sgd(server_rate))``, where ``step``
  is the worker's proximal step (:func:`dap_sgd`'s ``worker``) taken from
  ``stale_params``: a step at the read depends only on the read and
  :math:`g_u`, so computing it on the server gives the worker's numbers (for
  DAP-SGD, those of ``dap_sgd`` with ``dj.workers.LocalSteps``, to rounding;
  tested), and the SVRG inputs are then the default worker's
  (``dj.workers.Gradient(snapshot_every=m)``)::

    tx = dj.dap_svrg(dj.prox_l1(lam), lr, server_rate=0.4)
    dj.simulate(loss_fn, tx, params, data, delays, worker=dj.workers.Gradient(snapshot_every=m))

  ``loss_fn`` is the smooth part :math:`F` only. An update that combines
  several contributions (n-softsync, K-async) takes the step from the first
  (stalest) contribution's read on their mean estimate.

  **Provenance: only the paper's abstract could be read when this was
  written (DAP-SGD with an SVRG estimator; workers evaluate the proximal
  operator; linear convergence for strongly convex problems). The rule
  above is :func:`dap_sgd`'s reading of DAP-SGD with :func:`svrg`'s estimator
  and epochs; the paper's epoch length, snapshot option and step conditions
  are not restated here.**

  Args:
    prox: ``(x, step) -> prox_{step R}(x)`` on pytrees, e.g.
      :func:`~delayjax.transforms.prox_l1`.
    learning_rate: :math:`\gamma > 0`, a float or a scalar array.
    server_rate: :math:`s_u > 0`, a float, a scalar array or a schedule of the update count.

  Returns:
    An ``optax.GradientTransformationExtraArgs`` that needs ``params``,
    ``stale_params`` (``params`` when absent: no staleness) and
    :func:`svrg`'s extra arguments.

  Examples:
    >>> import jax.numpy as jnp
    >>> import delayjax as dj
    >>> tx = dj.dap_svrg(dj.prox_l1(1.0), 0.5)
    >>> w = jnp.array([2.0, 0.2])
    >>> # epoch start at w: g = 3 - 3 + mu = [1, 0]; delta = soft([1.5, 0.2], 0.5) - w
    >>> u, _ = tx.update(jnp.array([3.0, 0.0]), tx.init(w), w, snapshot_grad=jnp.array([3.0, 0.0]),
    ...                  full_grad=jnp.array([1.0, 0.0]))
    >>> u
    Array([-1. , -0.2], dtype=float32)

  References:
    Huo, Gu, Huang, `Decoupled Asynchronous Proximal Stochastic Gradient
    Descent with Variance Reduction <https://arxiv.org/abs/1609.06804>`_,
    arXiv 2016.

    Li, Xu, Zhong, Ling, `Make Workers Work Harder: Decoupled Asynchronous
    Proximal Stochastic Gradient Descent <https://arxiv.org/abs/1605.06619>`_,
    arXiv 2016.
  """
  dap = dap_sgd(prox, learning_rate, server_rate)
  return optax.chain(svrg(), _step_at_read(dap.worker), dap.server)
