"""Asynchronous adaptive methods: APAM (asynchronous AMSGrad) and staleness-aware Adam."""

from __future__ import annotations

from typing import Any

import jax
import optax

from delayjax.transforms._hyperparams import LearningRate, check_number, check_positive_rate
from delayjax.transforms._staleness import Rule, rule_parameters, scale_by_staleness


def _with_standard_promotion(tx: optax.GradientTransformation) -> optax.GradientTransformationExtraArgs:
  # optax's bias correction raises a Python float to an int32 power; that is optax's own
  # arithmetic, so it runs under standard promotion and these optimizers also work for users
  # (and tests) that turn strict promotion on.
  def init_fn(params):
    with jax.numpy_dtype_promotion("standard"):
      return tx.init(params)

  def update_fn(updates, state, params=None, **extra_args):
    del extra_args
    with jax.numpy_dtype_promotion("standard"):
      return tx.update(updates, state, params)

  return optax.GradientTransformationExtraArgs(init_fn, update_fn)


def _check_betas(b1: Any, b2: Any, eps: Any) -> tuple[Any, Any, Any]:
  b1 = check_number("b1", b1, minimum=0.0, maximum=1.0, strict_maximum=True)
  b2 = check_number("b2", b2, minimum=0.0, maximum=1.0, strict_maximum=True)
  return b1, b2, check_number("eps", eps, minimum=0.0)


def _chain(scaling: optax.GradientTransformation, learning_rate: LearningRate, staleness_rule: Rule | None,
           rule_kwargs: dict[str, Any]) -> optax.GradientTransformationExtraArgs:
  links = [_with_standard_promotion(scaling)]
  rule_kwargs = rule_parameters(**rule_kwargs)
  if staleness_rule is not None:
    links.append(scale_by_staleness(staleness_rule, **rule_kwargs))
  elif rule_kwargs:
    raise TypeError(f"staleness rule arguments {sorted(rule_kwargs)} given without staleness_rule.")
  links.append(optax.scale_by_learning_rate(learning_rate))
  return optax.chain(*links)


def async_adam(
    learning_rate: LearningRate,
    b1: float = 0.9,
    b2: float = 0.999,
    eps: float = 1e-8,
    *,
    staleness_rule: Rule | None = None,
    a: float | jax.Array | None = None,
    b: float | jax.Array | None = None,
    value: float | jax.Array | None = None,
    threshold: int | jax.Array | None = None,
) -> optax.GradientTransformationExtraArgs:
  r"""Asynchronous Adam: the stale gradient enters both moments; optionally a staleness-scaled step.

  The master applies each pushed gradient :math:`\tilde g_k = g(x_{k - \tau_k})`,
  computed at stale parameters, as Adam would a fresh one — both the first
  and the second moment are updated with the stale gradient, as APAM
  prescribes for its AMSGrad master (see :func:`apam`):

  .. math::

    m_k = \beta_1 m_{k-1} + (1 - \beta_1) \tilde g_k, \quad
    v_k = \beta_2 v_{k-1} + (1 - \beta_2) \tilde g_k^2, \quad
    u_k = -\alpha\, s(\tau_k)\, \frac{\hat m_k}{\sqrt{\hat v_k} + \epsilon}

  with Adam's bias corrections :math:`\hat m, \hat v`. With
  ``staleness_rule`` the step is additionally scaled by
  :math:`s(\tau_k)` (a :func:`staleness_weight` rule, e.g. ``"inverse"``
  for Zhang et al.'s :math:`\alpha_0/\tau`), per leaf when ``staleness`` is a
  pytree; without it :math:`s = 1`.

  With ``staleness=0`` (or no ``staleness_rule``) the result is
  ``optax.adam(learning_rate, b1, b2, eps)`` bit for bit: the moment
  arithmetic *is* Optax's (``optax.scale_by_adam``).

  Args:
    learning_rate: :math:`\alpha`, a number ``> 0``, a scalar array or an Optax schedule.
    b1: first-moment decay, in ``[0, 1)``.
    b2: second-moment decay, in ``[0, 1)``.
    eps: added to the denominator, ``>= 0``. ``b1``, ``b2`` and ``eps`` are
      numbers or scalar arrays.
    staleness_rule: optional step scaling :math:`s(\tau)`.
    a, b, value, threshold: its parameters (see :func:`staleness_weight`).

  Returns:
    An ``optax.GradientTransformationExtraArgs``; it needs ``staleness`` only
    with a ``staleness_rule``.

  Examples:
    >>> import jax.numpy as jnp
    >>> import delayjax as dj
    >>> tx = dj.async_adam(0.1, b1=0.5, b2=0.75, eps=0.0, staleness_rule="inverse")
    >>> u, _ = tx.update(jnp.array([3.0]), tx.init(jnp.zeros(1)), staleness=4)
    >>> u  # Adam's first step is -lr * sign(g); 1/tau = 1/4
    Array([-0.025], dtype=float32)

  References:
    Xu, Xu, Yan, Sutcher-Shepard, Grinberg, Chen, `Parallel and Distributed
    Asynchronous Adaptive Stochastic Gradient Methods
    <https://arxiv.org/abs/2002.09095>`_, Mathematical Programming
    Computation (arXiv 2020);
    Kingma, Ba, `Adam: A Method for Stochastic Optimization
    <https://arxiv.org/abs/1412.6980>`_, ICLR 2015.
  """
  learning_rate = check_positive_rate("learning_rate", learning_rate)
  b1, b2, eps = _check_betas(b1, b2, eps)
  return _chain(optax.scale_by_adam(b1, b2, eps), learning_rate, staleness_rule,
                dict(a=a, b=b, value=value, threshold=threshold))


def apam(
    learning_rate: LearningRate,
    b1: float = 0.9,
    b2: float = 0.999,
    eps: float = 1e-8,
    *,
    bias_correction: bool = True,
    staleness_rule: Rule | None = None,
    a: float | jax.Array | None = None,
    b: float | jax.Array | None = None,
    value: float | jax.Array | None = None,
    threshold: int | jax.Array | None = None,
) -> optax.GradientTransformationExtraArgs:
  r"""APAM: asynchronous parallel AMSGrad, the master's update on a stale gradient.

  The master of APAM runs AMSGrad on each gradient as it arrives, whatever
  version of the parameters it was computed at:

  .. math::

    m_k = \beta_1 m_{k-1} + (1 - \beta_1) \tilde g_k, \quad
    v_k = \beta_2 v_{k-1} + (1 - \beta_2) \tilde g_k^2, \quad
    \hat v_k = \max(\hat v_{k-1}, v_k), \quad
    u_k = -\alpha\, s(\tau_k)\, \frac{m_k}{\sqrt{\hat v_k} + \epsilon}

  with :math:`\tilde g_k = g(x_{k - \tau_k})`. The paper's analysis asks
  for nothing else from the master (its guarantee needs bounded
  staleness); the optional :math:`s(\tau)` scaling is delayjax's, off by
  default. Source: the APAM project page and abstract ("an async-parallel
  adaptive SGM based on AMSGrad", master-worker, master updates on delayed
  gradients); the algorithm box itself (image) could not be read, so
  ``bias_correction=True`` keeps Optax's AMSGrad (bias-corrected moments,
  maximum over the corrected :math:`v`) and ``False`` gives Reddi et al.'s
  original, uncorrected form written above.

  With ``staleness=0`` (or no ``staleness_rule``) the result is
  ``optax.amsgrad`` with the same bias-correction flags, bit for bit.

  Args:
    learning_rate: :math:`\alpha`, a number ``> 0``, a scalar array or an Optax schedule.
    b1: first-moment decay, in ``[0, 1)``.
    b2: second-moment decay, in ``[0, 1)``.
    eps: added to the denominator, ``>= 0``. ``b1``, ``b2`` and ``eps`` are
      numbers or scalar arrays.
    bias_correction: correct both moments for their zero start (Optax's default).
    staleness_rule: optional step scaling :math:`s(\tau)`.
    a, b, value, threshold: its parameters (see :func:`staleness_weight`).

  Returns:
    An ``optax.GradientTransformationExtraArgs``.

  Examples:
    >>> import jax.numpy as jnp
    >>> import delayjax as dj
    >>> tx = dj.apam(0.1, b1=0.5, b2=0.75, eps=0.0)
    >>> u, _ = tx.update(jnp.array([-2.0]), tx.init(jnp.zeros(1)), staleness=3)
    >>> u  # the first step is -lr * sign(g)
    Array([0.1], dtype=float32)

  References:
    Xu, Xu, Yan, Sutcher-Shepard, Grinberg, Chen, `Parallel and Distributed
    Asynchronous Adaptive Stochastic Gradient Methods
    <https://arxiv.org/abs/2002.09095>`_, Mathematical Programming
    Computation (arXiv 2020);
    Reddi, Kale, Kumar, `On the Convergence of Adam and Beyond
    <https://openreview.net/forum?id=ryQu7f-RZ>`_, ICLR 2018.
  """
  learning_rate = check_positive_rate("learning_rate", learning_rate)
  b1, b2, eps = _check_betas(b1, b2, eps)
  if not isinstance(bias_correction, bool):
    raise TypeError(f"bias_correction must be a bool, got {bias_correction!r}.")
  scaling = optax.scale_by_amsgrad(b1, b2, eps, bias_correction_mu=bias_correction,
                                   bias_correction_nu=bias_correction)
  return _chain(scaling, learning_rate, staleness_rule, dict(a=a, b=b, value=value, threshold=threshold))
