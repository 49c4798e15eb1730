"""Staleness-model step sizes: re-weight the modelled staleness distribution to a target momentum (MindTheStep)."""

from __future__ import annotations

from typing import Sequence

import jax
import jax.numpy as jnp
import optax

from delayjax.transforms._hyperparams import LearningRate, check_number, check_positive_rate, coefficient
from delayjax.transforms._momentum import implicit_momentum
from delayjax.transforms._staleness import StalenessFn, scale_by_staleness


def mindthestep_weight(
    num_workers: int | None = None,
    *,
    staleness_probs: Sequence[float] | None = None,
    target_momentum: float,
) -> StalenessFn:
  r"""The staleness weight that turns the modelled staleness distribution into one of a target momentum.

  The staleness is modelled as geometric, :math:`P(\tau = l) = (1 - q) q^l`,
  with :math:`q` from :func:`implicit_momentum` (:math:`q = 1 - 1/M` for
  :math:`M` workers, or the mean-matching :math:`q` of a measured
  ``staleness_probs``). The weight is the ratio of a geometric target of
  parameter :math:`\mu^*` to that model:

  .. math::

    s(\tau) = \frac{(1 - \mu^*)\, {\mu^*}^{\tau}}{(1 - q)\, q^{\tau}}
            = \frac{1 - \mu^*}{1 - q} \Big(\frac{\mu^*}{q}\Big)^{\tau}

  so that, under the model, the expected weight is one
  (:math:`\sum_l P(l)\, s(l) = 1`: the expected step is the base step) and
  the weighted staleness distribution :math:`P(l)\, s(l)` is the geometric
  distribution of parameter :math:`\mu^*`, which in Mitliagkas et al.'s
  expected-update model is SGD with momentum :math:`\mu^*` instead of
  :math:`q`. ``target_momentum`` must lie in :math:`[0, q]`, so the weight
  never grows with the staleness; :math:`\mu^* = q` gives :math:`s \equiv 1`,
  :math:`\mu^* = 0` applies only fresh gradients, scaled by :math:`1/(1-q)`.
  With one worker (:math:`q = 0`) the only target is 0 and :math:`s(0) = 1`.

  Why a weight and not a transformation of its own: it is a rule for
  :func:`scale_by_staleness` (``dj.scale_by_staleness(dj.mindthestep_weight(...))``),
  so it composes with any base optimizer; :func:`mindthestep` is that rule
  in front of SGD.

  Source and status: MindTheStep-AsyncPSGD (Bäckström et al.) derives
  staleness-dependent step sizes from a model of the staleness
  distribution given the number of workers. Its exact step-size rule could
  **not** be verified: the paper's text was not reachable with the search
  tools available (searched: the title, arXiv 1911.03444, the authors, and
  the method name, in web pages, documentation, code and issues; no copy
  or reference code was found). The rule above is delayjax's construction
  of that idea — exact re-weighting of a geometric staleness model to a
  target implicit momentum — not the paper's verified formula; the
  properties it claims (unit expected weight, geometric weighted
  distribution of parameter :math:`\mu^*`) are pinned by the tests.

  Args:
    num_workers: :math:`M \ge 1`, for the model :math:`q = 1 - 1/M`.
    staleness_probs: alternatively, the measured staleness distribution
      (``staleness_probs[l]`` = :math:`P(\tau = l)`). Exactly one of the two.
    target_momentum: :math:`\mu^*`, in :math:`[0, q]`.

  Returns:
    A jittable function from int32 staleness to float32 weights.

  Examples:
    >>> import jax.numpy as jnp
    >>> import delayjax as dj
    >>> s = dj.mindthestep_weight(4, target_momentum=0.5)  # q = 0.75
    >>> s(jnp.arange(3, dtype=jnp.int32))  # 2 * (2/3)^tau
    Array([2.        , 1.3333334 , 0.88888896], dtype=float32)

  References:
    Bäckström, Papatriantafilou, Tsigas, `MindTheStep-AsyncPSGD: Adaptive
    Asynchronous Parallel Stochastic Gradient Descent
    <https://arxiv.org/abs/1911.03444>`_, IEEE BigData 2019;
    Mitliagkas, Zhang, Hadjis, Ré, `Asynchrony begets Momentum, with an
    Application to Deep Learning <https://arxiv.org/abs/1605.09774>`_,
    Allerton 2016.
  """
  q = implicit_momentum(num_workers, staleness_probs=staleness_probs)
  target = check_number("target_momentum", target_momentum, minimum=0.0)
  if not isinstance(target, jax.core.Tracer) and float(target) > q:
    raise ValueError(
        f"target_momentum must be in [0, {q}] (the modelled implicit momentum: the weight may damp stale "
        f"gradients, not amplify them), got {float(target)}.")
  if isinstance(target, float):
    scale = (1.0 - target) / (1.0 - q)
    # q = 0 forces target = 0: only fresh gradients exist under the model, and they keep their weight.
    ratio = target / q if q > 0.0 else 0.0
  else:
    # An array (injected or swept): the same formulas in float32.
    target = coefficient(target, jnp.float32)
    scale = (1.0 - target) / jnp.float32(1.0 - q)
    ratio = target / jnp.float32(q) if q > 0.0 else jnp.zeros([], jnp.float32)

  def weight(tau):
    tau = jnp.asarray(tau, jnp.int32)
    # Explicit at tau = 0 so a zero ratio gives scale there, not 0 ** 0.
    decay = jnp.where(tau == 0, 1.0, jnp.power(coefficient(ratio, jnp.float32), tau.astype(jnp.float32)))
    return (coefficient(scale, jnp.float32) * decay).astype(jnp.float32)

  return weight


def mindthestep(
    learning_rate: LearningRate,
    num_workers: int | None = None,
    *,
    staleness_probs: Sequence[float] | None = None,
    target_momentum: float,
) -> optax.GradientTransformationExtraArgs:
  r"""SGD whose step for a gradient of staleness :math:`\tau` is :math:`\eta\, s(\tau)`, from a staleness model.

  .. math::

    u = -\eta\, s(\tau)\, g, \qquad
    s(\tau) = \frac{1 - \mu^*}{1 - q} \Big(\frac{\mu^*}{q}\Big)^{\tau}

  with :math:`s` from :func:`mindthestep_weight` (see there for the model,
  its properties, and what is and is not verified against the paper). The
  staleness is the ``staleness`` extra argument (scalar or per leaf). It is
  ``optax.chain(dj.scale_by_staleness(s), optax.sgd(learning_rate))``.

  With ``num_workers=1`` (and ``target_momentum=0``) every fresh gradient
  has weight 1 and the update is ``optax.sgd(learning_rate)``'s, bit for
  bit; with ``target_momentum`` equal to the modelled :math:`q` the weight
  is 1 for every staleness.

  Args:
    learning_rate: :math:`\eta`, a number ``> 0``, a scalar array or an Optax
      schedule.
    num_workers: :math:`M \ge 1`, for the model :math:`q = 1 - 1/M` (a Python
      int: with ``optax.inject_hyperparams``, name it in ``static_args``).
    staleness_probs: alternatively, the measured staleness distribution.
    target_momentum: :math:`\mu^*`, in :math:`[0, q]`, a number or a scalar
      array.

  Returns:
    An ``optax.GradientTransformationExtraArgs`` that needs the ``staleness``
    extra argument.

  Examples:
    >>> import jax.numpy as jnp
    >>> import delayjax as dj
    >>> tx = dj.mindthestep(0.1, 4, target_momentum=0.5)
    >>> u, _ = tx.update(jnp.ones(1), tx.init(jnp.zeros(1)), staleness=1)
    >>> u  # -0.1 * 2 * (2/3)
    Array([-0.13333334], dtype=float32)

  References:
    Bäckström, Papatriantafilou, Tsigas, `MindTheStep-AsyncPSGD: Adaptive
    Asynchronous Parallel Stochastic Gradient Descent
    <https://arxiv.org/abs/1911.03444>`_, IEEE BigData 2019.
  """
  learning_rate = check_positive_rate("learning_rate", learning_rate)
  weight = mindthestep_weight(num_workers, staleness_probs=staleness_probs, target_momentum=target_momentum)
  return optax.chain(scale_by_staleness(weight), optax.sgd(learning_rate))
