"""Asynchrony begets momentum: the explicit momentum that keeps the total at a target (Mitliagkas et al.)."""

from __future__ import annotations

from typing import Sequence

import numpy as np

from delayjax._checks import check_float
from delayjax.transforms._hyperparams import check_static_int


def implicit_momentum(num_workers: int | None = None, *, staleness_probs: Sequence[float] | None = None) -> float:
  r"""The momentum that asynchrony adds to SGD: :math:`1 - 1/M`, or :math:`\bar\tau / (1 + \bar\tau)`.

  Mitliagkas et al. show that, when the staleness follows the geometric
  distribution :math:`P(\tau = l) = (1 - q) q^l` (what a queue of
  :math:`M` workers with exponential compute times gives, with
  :math:`q = 1 - 1/M`), asynchronous SGD behaves in expectation like SGD
  with momentum :math:`q`. Given ``num_workers`` this returns
  :math:`1 - 1/M`. Given a staleness distribution instead
  (``staleness_probs[l]`` = :math:`P(\tau = l)`), it returns the :math:`q`
  of the geometric distribution with the same mean :math:`\bar\tau`,
  :math:`q = \bar\tau / (1 + \bar\tau)` — exact for geometric staleness,
  a first-order (mean-matching) approximation otherwise; for
  :math:`M` round-robin workers (:math:`\tau = M - 1` always) it gives
  :math:`1 - 1/M` too.

  Args:
    num_workers: :math:`M \ge 1`.
    staleness_probs: probabilities of staleness :math:`0, 1, \dots` (non-negative,
      summing to 1). Exactly one of the two must be given.

  Returns:
    The implicit momentum, in ``[0, 1)``.
  """
  if (num_workers is None) == (staleness_probs is None):
    raise ValueError("give exactly one of num_workers and staleness_probs.")
  if num_workers is not None:
    m = check_static_int("num_workers", num_workers, minimum=1)
    return 1.0 - 1.0 / m
  try:
    p = None if isinstance(staleness_probs, (str, bytes)) else np.asarray(staleness_probs)
  except (TypeError, ValueError):
    p = None
  if p is None or p.dtype.kind not in "iuf":
    raise TypeError(f"staleness_probs must be a sequence of probabilities (numbers), got {staleness_probs!r}.")
  p = p.astype(np.float64)
  if p.ndim != 1 or p.size == 0:
    raise ValueError(f"staleness_probs must be a non-empty 1-D sequence, got shape {p.shape}.")
  bad = ~np.isfinite(p) | (p < 0)
  if np.any(bad):
    raise ValueError(f"staleness_probs must be finite and non-negative, got {p[bad][0].item()} at staleness "
                     f"{int(np.flatnonzero(bad)[0])}.")
  if abs(p.sum() - 1.0) > 1e-6:
    raise ValueError(f"staleness_probs must sum to 1, got sum {p.sum().item()}.")
  mean = float(np.arange(p.size) @ p)
  return mean / (1.0 + mean)


def explicit_momentum(
    target: float,
    num_workers: int | None = None,
    *,
    staleness_probs: Sequence[float] | None = None,
    clip: bool = False,
) -> float:
  r"""The explicit (algorithmic) momentum that keeps the total momentum at ``target`` under asynchrony.

  .. math::

    \mu_{explicit} = \mu_{target} - \mu_{implicit}, \qquad
    \mu_{implicit} = 1 - \tfrac{1}{M}

  (:math:`\mu_{implicit}` from a staleness distribution: see :func:`implicit_momentum`).

  Derivation (delayjax's, from the paper's result): asynchrony contributes
  a momentum term :math:`\mu_{implicit}`; to first order the momentum terms
  of the asynchrony and of the optimizer add up, so the total is
  :math:`\mu_{explicit} + \mu_{implicit}`, and the explicit momentum that
  keeps the total at the target — for example the momentum tuned for
  synchronous training, ``target=0.9`` — is the difference. It decreases as
  :math:`M` grows: ``target=0.9`` gives 0.9 for one worker, 0 for 10 and
  :math:`-0.05` for 20. A **negative** answer means the asynchrony alone
  already exceeds the target; the paper reports that negative algorithmic
  momentum can then help (``optax.sgd(lr, momentum=mu)`` accepts it). With
  ``clip=True`` the answer is clipped at 0 for optimizers that cannot take
  a negative momentum; the total then exceeds the target by the clipped
  amount. The result is always above :math:`-1` (the target is
  :math:`\ge 0` and the implicit momentum :math:`< 1`). The additive model
  is an approximation (the two momenta compose exactly only to first
  order); tune around it.

  Args:
    target: the total momentum wanted, in ``[0, 1)``.
    num_workers: :math:`M`, the number of asynchronous workers.
    staleness_probs: alternatively, the staleness distribution.
    clip: clip a negative answer at 0.

  Returns:
    The explicit momentum, a Python float in ``(-1, 1)``.

  Examples:
    >>> import delayjax as dj
    >>> dj.explicit_momentum(0.9, num_workers=4)
    0.15000000000000002
    >>> dj.explicit_momentum(0.9, num_workers=20), dj.explicit_momentum(0.9, num_workers=20, clip=True)
    (-0.04999999999999993, 0.0)

  References:
    Mitliagkas, Zhang, Hadjis, Ré, `Asynchrony begets Momentum, with an
    Application to Deep Learning <https://arxiv.org/abs/1605.09774>`_,
    Allerton 2016.
  """
  target = check_float("target", target, minimum=0.0, maximum=1.0)
  if target == 1.0:
    raise ValueError("target must be < 1, got 1.0.")
  if not isinstance(clip, bool):
    raise TypeError(f"clip must be a bool, got {clip!r}.")
  mu = target - implicit_momentum(num_workers, staleness_probs=staleness_probs)
  return max(mu, 0.0) if clip else mu
