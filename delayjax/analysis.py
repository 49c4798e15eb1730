r"""Delayed SGD on a quadratic: exact discrete-time moments, and what its continuous-time model predicts.

The process: SGD with a constant delay :math:`\tau` on the one-dimensional
quadratic :math:`f(x) = \frac h2 x^2` with additive gradient noise,

.. math::

  x_{k+1} = x_k - \eta\,\big(h\, x_{k-\tau} + \xi_k\big), \qquad
  \mathbb E\,\xi_k = 0,\ \mathbb E\,\xi_k^2 = \sigma^2 \text{ i.i.d.},

with :math:`x_j = x_0` for :math:`j \le 0` (``dj.simulate`` with
``dj.delays.constant(tau)`` reads version :math:`\max(0, k - \tau)`). A
:math:`d`-dimensional quadratic with a diagonal (or diagonalizable) Hessian
and independent noise per eigen-direction is :math:`d` such processes.

**Exact (discrete time).** The mean follows :math:`m_{k+1} = m_k - \eta h\,
m_{k-\tau}` (:func:`mean_path`); it contracts per update by the spectral
radius :math:`\rho` of the companion matrix of :math:`z^{\tau+1} - z^\tau +
\eta h` (:func:`contraction`), stable iff :math:`\eta h < 2\sin(\pi/(2(2\tau
+ 1)))` (:func:`stable_learning_rate`). :math:`\rho` is smallest at the
critically damped step :math:`\eta^\star h = \tau^\tau/(\tau+1)^{\tau+1}`
(the double root :math:`z = \tau/(\tau+1)`; :func:`optimal_learning_rate`).
The stationary variance :math:`\gamma_0` solves the :math:`\tau + 1`
linear equations of the autocovariances :math:`\gamma_j =
\text{Cov}(x_k, x_{k-j})` (:func:`stationary_variance`):

.. math::

  \gamma_j = \gamma_{j-1} - \eta h\, \gamma_{|\tau + 1 - j|}\ (1 \le j \le \tau), \qquad
  0 = (\eta h)^2 \gamma_0 - 2\eta h\, \gamma_\tau + \eta^2\sigma^2,

which for :math:`\tau = 0` gives :math:`\eta\sigma^2 / (h(2 - \eta h))`.

**Continuous time.** With :math:`t = k\eta`, the delayed SDE

.. math::

  dX_t = -h\, X_{t - r}\, dt + \sqrt{\eta}\,\sigma\, dW_t, \qquad r = \tau\eta,

matches the process's first two moments to first order in :math:`\eta`.
Its mean solves the delay differential equation :math:`\dot m = -h\,
m(t - r)` (:func:`sde_mean_path`), whose rightmost characteristic root is
:math:`\lambda = W_0(-hr)/r` (Lambert's :math:`W`), so the predicted
contraction per update is :math:`e^{\eta\,\text{Re}\lambda}`
(:func:`sde_contraction`), fastest at :math:`hr = 1/e`, i.e. :math:`\eta^\star
= 1/(e h \tau)` (:func:`sde_optimal_learning_rate`). Its stationary variance
is Küchler and Mensch's, for :math:`hr < \pi/2` (:func:`sde_stationary_variance`):

.. math::

  \text{Var}\, X_\infty = \frac{\eta\sigma^2}{2h}\, \frac{1 + \sin(hr)}{\cos(hr)}.

The two agree as :math:`\eta \to 0` at fixed :math:`\tau` (the variance's
relative error is about :math:`\eta h / 2`); they part where :math:`\eta h`
is not small: the SDE has no stability limit at :math:`\tau = 0` and puts
the limit at :math:`\eta h \tau = \pi/2` where the discrete process has
:math:`2\sin(\pi/(2(2\tau+1)))\,\tau`, and its optimal step
:math:`1/(eh\tau)` exceeds the exact :math:`\tau^\tau/((\tau+1)^{\tau+1}h)`
by a factor that tends to 1 only as :math:`\tau` grows (1.47 at
:math:`\tau = 1`, 1.03 at :math:`\tau = 32`).

What is confirmed and what is delayjax's: An, Lu and Ying model ASGD by a
stochastic modified equation "of Langevin type" and derive an optimal
mini-batching from it by solving an optimal control problem of that SME;
**only the paper's abstract and the opening of its introduction could be
read here** (the copies of arXiv 1805.08244 reachable here stop there), so their SME's
exact form and their batch schedule are not implemented, and the SME used
here is not theirs. Modelling ASGD by a *stochastic delay* differential
equation, as above, is He, Meng, Chen, Ma and Liu's approach: they write
ASGD as :math:`x_{k+1} = x_k - \eta_k\, g_{M_k}(b, x_{k - l_k})` (a
mini-batch gradient of size :math:`b` read :math:`l_k` updates late),
approximate it by such an equation, bound the approximation error in the
number of updates and the mini-batch size, and derive convergence rates
from its moments; only their introduction's opening and a summary of the
paper could be read here, so the equation's form above (a constant delay,
additive noise :math:`\sqrt{\eta}\,\sigma\, dW_t`) is delayjax's, not
checked against theirs. The delayed SDE above, its moments as computed
here, the exact discrete-time moments and the two optimal steps are delayjax's
derivation (the stationary variance of the linear delayed SDE is Küchler
and Mensch's result); every formula is checked in
``tests/methods/test_methods_analysis.py`` against an independent
computation (a Lyapunov solve, a spectral-radius minimization, the
small-step limit) and against ``dj.simulate`` runs.

**Elastic consistency.** :func:`elastic_consistency` measures, from a run's
recorded true parameters :math:`x_t` and the parameters :math:`v_t` each
update's gradient was computed at, Nadiradze et al.'s elastic-consistency
constant :math:`B` (:math:`\mathbb E\|x_t - v_t\|^2 \le \eta^2 B^2`).

**Stationarity of composite problems.** :func:`gradient_mapping_norm` is the
norm of the proximal gradient mapping :math:`\|x - \text{prox}_{\eta
h}(x - \eta \nabla f(x))\| / \eta`, the measure in which the
convergence of proximal methods on nonconvex :math:`f + h` is stated (Zhu,
Niu and Li's Asyn-ProxSGD, ``dj.tap_sgd``): zero exactly at the stationary
points of :math:`f + h`, and :math:`\|\nabla f(x)\|` when :math:`h = 0`.

References:
  An, Lu, Ying, `Stochastic Modified Equations for the Asynchronous
  Stochastic Gradient Descent <https://arxiv.org/abs/1805.08244>`_,
  Information and Inference 2020.

  He, Meng, Chen, Ma, Liu, `Differential Equations for Modeling
  Asynchronous Algorithms <https://arxiv.org/abs/1805.02991>`_, IJCAI 2018.

  Küchler, Mensch, Langevin's stochastic differential equation extended by
  a time-delayed term, Stochastics and Stochastic Reports 40, 1992.
"""

from __future__ import annotations

import math
from typing import Any, NamedTuple

import jax
import numpy as np

from delayjax import _memory
from delayjax._checks import check_float, check_int


def _check_path_fits(what: str, num_floats: int) -> None:
  """Refuses (naming ``what``) a float64 array of ``num_floats`` entries that cannot fit in host memory."""
  _memory.check_fits(what, 8 * num_floats, _memory.available_memory())


def _check_companion_fits(tau: int, function: str) -> None:
  """Refuses a ``tau`` whose ``[tau + 1, tau + 1]`` float64 matrix (and LAPACK's working copy) cannot fit."""
  _check_path_fits(f"{function} with tau={tau} (a float64 [tau + 1, tau + 1] matrix and LAPACK's working copy)",
                   2 * (tau + 1) ** 2)


def _check(curvature: float, learning_rate: float, tau: int) -> tuple[float, float, int]:
  h = check_float("curvature", curvature, minimum=0.0, strict_minimum=True)
  eta = check_float("learning_rate", learning_rate, minimum=0.0, strict_minimum=True)
  return h, eta, check_int("tau", tau, minimum=0)


def _companion(a: float, tau: int) -> np.ndarray:
  """The matrix of ``(x_k, ..., x_{k-tau}) -> (x_{k+1}, ..., x_{k+1-tau})`` for ``x_{k+1} = x_k - a x_{k-tau}``."""
  out = np.zeros((tau + 1, tau + 1))
  out[0, 0] = 1.0
  out[0, tau] -= a
  out[np.arange(1, tau + 1), np.arange(tau)] = 1.0
  return out


def contraction(curvature: float, learning_rate: float, tau: int) -> float:
  r"""The exact per-update contraction :math:`\rho` of the mean (the spectral radius; :math:`\ge 1`: unstable).

  Examples:
    >>> from delayjax import analysis
    >>> round(analysis.contraction(1.0, 0.25, 1), 6)  # the critically damped step of tau = 1: rho = 1/2
    0.5
  """
  h, eta, tau = _check(curvature, learning_rate, tau)
  _check_companion_fits(tau, "contraction")
  return float(np.max(np.abs(np.linalg.eigvals(_companion(eta * h, tau)))))


def stable_learning_rate(curvature: float, tau: int) -> float:
  r"""The exact stability limit: the mean converges iff :math:`\eta < 2\sin(\pi/(2(2\tau+1)))/h`."""
  h, _, tau = _check(curvature, 1.0, tau)
  return 2.0 * math.sin(math.pi / (2 * (2 * tau + 1))) / h


def optimal_learning_rate(curvature: float, tau: int) -> float:
  r"""The step minimizing the exact contraction: :math:`\tau^\tau / ((\tau+1)^{\tau+1} h)` (:math:`1/h` at 0).

  Examples:
    >>> from delayjax import analysis
    >>> analysis.optimal_learning_rate(1.0, 1), analysis.optimal_learning_rate(2.0, 0)
    (0.25, 0.5)
  """
  h, _, tau = _check(curvature, 1.0, tau)
  return math.exp(tau * math.log(tau) - (tau + 1) * math.log(tau + 1)) / h if tau else 1.0 / h


def mean_path(curvature: float, learning_rate: float, tau: int, x0: float, num_updates: int) -> np.ndarray:
  r"""The exact mean :math:`m_0 .. m_U`: :math:`m_{k+1} = m_k - \eta h\, m_{\max(0, k-\tau)}`, float64 ``[U + 1]``."""
  h, eta, tau = _check(curvature, learning_rate, tau)
  x0 = check_float("x0", x0)
  steps = check_int("num_updates", num_updates, minimum=0)
  _check_path_fits(f"mean_path with num_updates={steps} (a float64 [num_updates + 1] path)", steps + 1)
  m = np.empty(steps + 1)
  m[0] = x0
  for k in range(steps):
    m[k + 1] = m[k] - eta * h * m[max(0, k - tau)]
  return m


def stationary_variance(curvature: float, noise_var: float, learning_rate: float, tau: int) -> float:
  r"""The exact stationary variance :math:`\gamma_0` of delayed SGD (``inf`` if the step is not stable).

  Solves the module's autocovariance equations (:math:`\tau + 1` unknowns).

  Args:
    curvature: :math:`h > 0`.
    noise_var: :math:`\sigma^2 \ge 0`, the gradient noise's variance.
    learning_rate: :math:`\eta > 0`.
    tau: the constant delay :math:`\tau \ge 0`.

  Returns:
    :math:`\gamma_0`, a float (``inf`` where :math:`\eta h` is at or beyond
    :func:`stable_learning_rate`).

  Examples:
    >>> from delayjax import analysis
    >>> round(analysis.stationary_variance(1.0, 1.0, 0.1, 0), 6)  # eta s2 / (h (2 - eta h)) = 0.1 / 1.9
    0.052632
  """
  h, eta, tau = _check(curvature, learning_rate, tau)
  s2 = check_float("noise_var", noise_var, minimum=0.0)
  _check_companion_fits(tau, "stationary_variance")
  if contraction(h, eta, tau) >= 1.0:
    return math.inf
  a = eta * h
  lhs = np.zeros((tau + 1, tau + 1))
  rhs = np.zeros(tau + 1)
  for j in range(1, tau + 1):  # gamma_j - gamma_{j-1} + a gamma_{|tau + 1 - j|} = 0
    lhs[j - 1, j] += 1.0
    lhs[j - 1, j - 1] -= 1.0
    lhs[j - 1, abs(tau + 1 - j)] += a
  lhs[tau, 0] += a * a  # a^2 gamma_0 - 2 a gamma_tau = -eta^2 s2
  lhs[tau, tau] -= 2.0 * a
  rhs[tau] = -eta * eta * s2
  return float(np.linalg.solve(lhs, rhs)[0])


def _lambert_w0(z: complex) -> complex:
  """The principal branch of Lambert's W at ``z`` (Halley's iteration from the branch-point series)."""
  p = np.sqrt(complex(2.0 * (math.e * z + 1.0)))
  w = -1.0 + p - p * p / 3.0 if abs(p) < 1.5 else complex(np.log(complex(z)))
  for _ in range(100):
    ew = np.exp(w)
    f = w * ew - z
    if f == 0:
      break
    step = f / (ew * (w + 1.0) - (w + 2.0) * f / (2.0 * w + 2.0))
    w -= step
    if abs(step) < 1e-15 * (1.0 + abs(w)):
      break
  return complex(w)


def sde_contraction(curvature: float, learning_rate: float, tau: int) -> float:
  r"""The delayed SDE's per-update contraction of the mean: :math:`\exp(\eta\, \text{Re}\, W_0(-h\tau\eta)/(\tau\eta))`.

  :math:`e^{-\eta h}` at :math:`\tau = 0`; :math:`\ge 1` where the model
  is unstable (:math:`h\tau\eta \ge \pi/2`).
  """
  h, eta, tau = _check(curvature, learning_rate, tau)
  if tau == 0:
    return math.exp(-eta * h)
  return math.exp(_lambert_w0(-h * tau * eta).real / tau)


def sde_optimal_learning_rate(curvature: float, tau: int) -> float:
  r"""The step minimizing :func:`sde_contraction`: :math:`1/(e h \tau)` (:math:`\tau \ge 1`; at 0 there is none).

  Examples:
    >>> from delayjax import analysis
    >>> round(analysis.sde_optimal_learning_rate(1.0, 1), 6)  # 1 / e
    0.367879
  """
  h, _, tau = _check(curvature, 1.0, tau)
  if tau == 0:
    raise ValueError("tau must be >= 1: without delay the continuous-time model contracts faster at every larger "
                     "step, so it has no optimal step.")
  return 1.0 / (math.e * h * tau)


def sde_stationary_variance(curvature: float, noise_var: float, learning_rate: float, tau: int) -> float:
  r"""The delayed SDE's stationary variance, :math:`\frac{\eta\sigma^2}{2h} \frac{1 + \sin(h\tau\eta)}{\cos(h\tau\eta)}`.

  ``inf`` where :math:`h\tau\eta \ge \pi/2` (no stationary law).

  Examples:
    >>> from delayjax import analysis
    >>> analysis.sde_stationary_variance(1.0, 1.0, 0.1, 0)  # eta s2 / (2 h)
    0.05
  """
  h, eta, tau = _check(curvature, learning_rate, tau)
  s2 = check_float("noise_var", noise_var, minimum=0.0)
  hr = h * tau * eta
  if hr >= math.pi / 2:
    return math.inf
  return eta * s2 / (2.0 * h) * (1.0 + math.sin(hr)) / math.cos(hr)


def sde_mean_path(curvature: float, learning_rate: float, tau: int, x0: float, num_updates: int,
                  substeps: int = 64) -> np.ndarray:
  r"""The delayed SDE's mean at :math:`t = k\eta`, :math:`k = 0..U`: :math:`\dot m = -h\, m(t - \tau\eta)`, :math:`m = x_0` on :math:`[-\tau\eta, 0]`.

  Integrated by Euler's method with ``substeps`` steps per update (error
  :math:`O(\eta h / \text{substeps})`), float64 ``[U + 1]``.
  """
  h, eta, tau = _check(curvature, learning_rate, tau)
  x0 = check_float("x0", x0)
  steps = check_int("num_updates", num_updates, minimum=0)
  n = check_int("substeps", substeps, minimum=1)
  _check_path_fits(f"sde_mean_path with num_updates={steps} x substeps={n} (a float64 [num_updates * substeps + 1] "
                   "path and its [num_updates + 1] samples)", steps * n + steps + 2)
  dt, lag = eta / n, tau * n
  m = np.empty(steps * n + 1)
  m[0] = x0
  for i in range(steps * n):
    m[i + 1] = m[i] - dt * h * m[max(0, i - lag)]
  return m[::n].copy()


class ElasticConsistency(NamedTuple):
  r"""What :func:`elastic_consistency` measured on one run.

  Attributes:
    gap: float64 ``[T]``, :math:`\|x_t - v_t\|` for each update.
    b_max: :math:`\max_t \|x_t - v_t\| / \eta`, the constant that bounds every
      update of this run.
    b_rms: :math:`\sqrt{\tfrac1T \sum_t \|x_t - v_t\|^2} / \eta`, the constant
      of the time-averaged mean-square gap (what the convergence theorems'
      sums over :math:`t` use).
  """

  gap: np.ndarray
  b_max: float
  b_rms: float


def _stacked(name: str, tree: Any) -> list[np.ndarray]:
  """The leaves of ``tree`` as float64 ``[T, -1]`` arrays, or an error naming ``name``."""
  leaves = jax.tree.leaves(tree)
  if not leaves:
    raise ValueError(f"{name} must hold at least one array with a leading [T] axis, got {tree!r}.")
  out = []
  for x in leaves:
    x = np.asarray(x)
    if x.ndim < 1 or x.dtype.kind not in "iuf":
      raise TypeError(f"{name} must hold real arrays with a leading [T] axis (one row per update), got one of "
                      f"shape {x.shape} and dtype {x.dtype}.")
    if x.shape[0] == 0:
      raise ValueError(f"{name} must hold at least one update (a leading [T] axis of length >= 1), got shape "
                       f"{x.shape}.")
    out.append(x.reshape(x.shape[0], int(np.prod(x.shape[1:], dtype=np.int64))).astype(np.float64))
  return out


def elastic_consistency(true_params: Any, read_params: Any, learning_rate: float) -> ElasticConsistency:
  r"""The elastic-consistency constant of a run: how far each update's read is from the true parameters, in steps.

  Nadiradze et al. write a distributed SGD run as the sequence
  :math:`x_{t+1} = x_t - \eta\, \tilde g(v_t)` of *true* parameters (every
  gradient applied so far, in order), each gradient computed at the *view*
  :math:`v_t` its worker read, and call the run elastically consistent with
  constant :math:`B` when

  .. math::

    \mathbb E \|x_t - v_t\|^2 \le \eta^2 B^2 \quad \text{for every } t.

  Given one run's :math:`x_t` and :math:`v_t`, this returns
  :math:`\|x_t - v_t\|` per update, :math:`B_{\max} = \max_t \|x_t - v_t\| /
  \eta` and :math:`B_{\text{rms}} = (\tfrac1T \sum_t \|x_t - v_t\|^2)^{1/2} /
  \eta` (averaged over seeds, :math:`B_{\text{rms}}^2` estimates the
  time-averaged expectation that the theorems' sums over :math:`t` need). With
  ``dj.simulate`` and ``optax.sgd(eta)``, :math:`x_t` is the server's version
  :math:`t` and :math:`v_t` the update's ``stale_params`` (its read: stale,
  per leaf or torn). A delay bound :math:`\tau` with
  :math:`\mathbb E\|\tilde g\|^2 \le M^2` gives :math:`B \le \tau M`
  (:math:`x_t - v_t` is at most :math:`\tau` steps, per coordinate for a
  torn read), the paper's constant for bounded-staleness (SSP) and
  asynchronous shared-memory schemes.

  **Only the abstract of the paper could be read here**: the definition
  above is the form the abstract describes (a bound on the distance between
  the parameters a worker reads and the true ones, in units of the step);
  its exact statement in the paper is not confirmed.

  Args:
    true_params: a pytree of arrays with a leading ``[T]`` axis: :math:`x_t`.
    read_params: the same tree and shapes: :math:`v_t`.
    learning_rate: :math:`\eta > 0`.

  Returns:
    An :class:`ElasticConsistency`.

  Raises:
    TypeError, ValueError: trees or shapes that differ, non-real or
      scalar leaves, a learning rate that is not a positive number.

  Examples:
    >>> import numpy as np
    >>> from delayjax import analysis
    >>> x = np.arange(6.0)[:, None] * np.array([[-0.3, -0.4]])  # constant gradient (3, 4), eta 0.1
    >>> v = x[np.maximum(0, np.arange(6) - 2)]  # each read 2 updates old
    >>> m = analysis.elastic_consistency(x, v, 0.1)
    >>> m.gap.round(6).tolist(), round(m.b_max, 6)
    ([0.0, 0.5, 1.0, 1.0, 1.0, 1.0], 10.0)

  References:
    Nadiradze, Markov, Chatterjee, Kungurtsev, Alistarh, `Elastic
    Consistency: A Practical Consistency Model for Distributed Stochastic
    Gradient Descent <https://arxiv.org/abs/2001.05918>`_, AAAI 2021.
  """
  eta = check_float("learning_rate", learning_rate, minimum=0.0, strict_minimum=True)
  if jax.tree.structure(true_params) != jax.tree.structure(read_params):
    raise ValueError(f"read_params must have the tree of true_params {jax.tree.structure(true_params)}, got "
                     f"{jax.tree.structure(read_params)}.")
  xs, vs = _stacked("true_params", true_params), _stacked("read_params", read_params)
  for i, (x, v) in enumerate(zip(xs, vs)):
    if x.shape != v.shape or np.shape(jax.tree.leaves(true_params)[i]) != np.shape(jax.tree.leaves(read_params)[i]):
      raise ValueError(f"read_params must have the shapes of true_params: leaf {i} has shape "
                       f"{np.shape(jax.tree.leaves(read_params)[i])}, true_params "
                       f"{np.shape(jax.tree.leaves(true_params)[i])}.")
  if len({x.shape[0] for x in xs}) != 1:
    raise ValueError(f"true_params' leaves must share their leading [T] axis, got lengths "
                     f"{sorted({x.shape[0] for x in xs})}.")
  gap = np.sqrt(sum(np.sum((x - v) ** 2, axis=1) for x, v in zip(xs, vs)))
  return ElasticConsistency(gap=gap, b_max=float(gap.max() / eta), b_rms=float(np.sqrt(np.mean(gap ** 2)) / eta))


def gradient_mapping_norm(params: Any, grads: Any, prox: Any, step: float) -> float:
  r"""The norm of the proximal gradient mapping at ``params``: a nonconvex composite problem's stationarity.

  For :math:`\min_x f(x) + h(x)`, :math:`f` smooth and possibly nonconvex,
  :math:`h` convex with a proximal operator, the gradient mapping is

  .. math::

    P_\eta(x) = \frac{1}{\eta}\big(x - \text{prox}_{\eta h}(x - \eta \nabla f(x))\big),

  zero exactly where :math:`0 \in \nabla f(x) + \partial h(x)`, and
  :math:`\nabla f(x)` itself when :math:`h = 0`. Zhu, Niu and Li state
  Asyn-ProxSGD's convergence (``dj.tap_sgd`` under stale reads) as an ergodic
  bound :math:`O(1/\sqrt K)` on :math:`\mathbb E\|P_\eta(x_k)\|^2`. For
  :math:`h = \lambda\|x\|_1` a coordinate is :math:`x_i / \eta` where
  :math:`|x_i - \eta g_i| \le \eta\lambda` (the prox sets it to zero) and
  :math:`g_i + \lambda\,\text{sign}(x_i - \eta g_i)` elsewhere.

  The mapping is evaluated in float64 whatever the dtype of the arrays given
  (``prox`` runs under ``jax.enable_x64``), so that a norm far below the
  parameters' scale is not lost to float32 rounding.

  Only the abstract of Zhu, Niu and Li's paper could be read here: the
  measure above is the standard one of nonconvex stochastic proximal
  methods (Ghadimi, Lan and Zhang's generalized projected gradient); that
  the paper states its rate in exactly this form is not confirmed.

  Args:
    params: :math:`x`, a pytree of real arrays.
    grads: :math:`\nabla f(x)`, the same tree and shapes (the smooth part's
      gradient only, without :math:`h`).
    prox: ``(x, step) -> prox_{step h}(x)`` on pytrees, e.g. ``dj.prox_l1(lam)``.
    step: :math:`\eta > 0`.

  Returns:
    :math:`\|P_\eta(x)\|_2` over all leaves, a Python float.

  Raises:
    TypeError, ValueError: a ``prox`` that is not callable, a ``step`` that is
      not a positive number, trees or shapes of ``grads`` unlike ``params``',
      leaves that are not real arrays.

  Examples:
    >>> import numpy as np
    >>> import delayjax as dj
    >>> x, g = np.array([1.0, 0.05]), np.array([0.5, 0.5])
    >>> round(dj.analysis.gradient_mapping_norm(x, g, dj.prox_l1(0.2), 0.1), 6)  # (0.5 + 0.2, 0.05 / 0.1)
    0.860233

  References:
    Ghadimi, Lan, Zhang, `Mini-batch Stochastic Approximation Methods for
    Nonconvex Stochastic Composite Optimization <https://arxiv.org/abs/1308.6594>`_,
    Mathematical Programming 2016.

    Zhu, Niu, Li, `Asynchronous Stochastic Proximal Methods for Nonconvex
    Nonsmooth Optimization <https://arxiv.org/abs/1802.08880>`_, arXiv 2018.
  """
  if not callable(prox):
    raise TypeError(f"prox must be a callable (x, step) -> x such as dj.prox_l1(0.1), got {prox!r}.")
  eta = check_float("step", step, minimum=0.0, strict_minimum=True)
  if jax.tree.structure(params) != jax.tree.structure(grads):
    raise ValueError(f"grads must have the tree of params {jax.tree.structure(params)}, got "
                     f"{jax.tree.structure(grads)}.")
  xs, gs = jax.tree.leaves(params), jax.tree.leaves(grads)
  if not xs:
    raise ValueError(f"params must hold at least one array, got {params!r}.")
  for i, (x, g) in enumerate(zip(xs, gs)):
    for name, a in (("params", x), ("grads", g)):
      if np.asarray(a).dtype.kind not in "iuf":
        raise TypeError(f"{name} must hold real arrays, got leaf {i} of dtype {np.asarray(a).dtype}.")
    if np.shape(x) != np.shape(g):
      raise ValueError(f"grads must have the shapes of params: leaf {i} has shape {np.shape(g)}, params "
                       f"{np.shape(x)}.")
  treedef = jax.tree.structure(params)
  x64 = [np.asarray(x, np.float64) for x in xs]
  moved_in = jax.tree.unflatten(treedef, [x - eta * np.asarray(g, np.float64) for x, g in zip(x64, gs)])
  with jax.enable_x64(True):
    moved = [np.asarray(m, np.float64) for m in jax.tree.leaves(prox(moved_in, eta))]
  return float(math.sqrt(sum(float(np.sum(((x - m) / eta) ** 2)) for x, m in zip(x64, moved))))
