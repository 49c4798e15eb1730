"""Admission by version: a staleness budget that makes the learner wait instead of discarding samples."""

from __future__ import annotations

import dataclasses

from delayjax._checks import check_int
from delayjax.cluster._paradigms import Paradigm

__all__ = ["VersionBudget", "version_budget"]


@dataclasses.dataclass(frozen=True)
class VersionBudget(Paradigm):
  r"""Asynchronous pushes admitted by version: no push is ever staler than ``max_staleness``.

  Rule: each push is one update, as in ASP, but the server applies the
  arrived push of *oldest read version* first, and applies it as update
  :math:`u` only if the other gradients not yet applied (in flight or
  arrived) can all still be applied within the budget, oldest first: the
  :math:`i`-th oldest of them (:math:`i = 1, 2, \dots`) read a version
  :math:`\ge u + i - k`; otherwise it waits for the pushes that would fall
  out of it. A
  worker whose push waits is blocked (its wait counts) and reads the new
  version once its push is applied. So every contribution has staleness
  :math:`u - v \le k` and none is discarded: the learner waits for long
  samples rather than dropping them. This is PRIME-RL's ``max_async_level``
  (the trainer at step :math:`n` uses rollouts of policy :math:`\ge n - k`)
  on a cluster whose pushes arrive in any order.

  After the first round each version is read by exactly one worker (the one
  whose push made it), so :math:`M - 1` other gradients are always pending
  and the budget needs :math:`k \ge M - 1`; :math:`k = M - 1` applies the
  pushes in the order they were read, and :math:`k \to \infty` is ASP.

  Attributes:
    max_staleness: :math:`k \ge M - 1`.

  References:
    PrimeIntellect-ai/prime-rl, asynchronous off-policy training with
    ``max_async_level``; Intellect-2 team, `INTELLECT-2: A Reasoning Model
    Trained Through Globally Decentralized Reinforcement Learning
    <https://arxiv.org/abs/2505.07291>`_, 2025.
  """

  max_staleness: int

  def __post_init__(self):
    check_int("max_staleness", self.max_staleness, minimum=0)

  def check(self, num_workers: int) -> None:
    if self.max_staleness < num_workers - 1:
      raise ValueError(
          f"version_budget's max_staleness must be >= num_workers - 1 = {num_workers - 1}: each version is read "
          f"by one worker, so {num_workers - 1} other gradients are always pending and a smaller budget could "
          f"never apply an update; got max_staleness={self.max_staleness}.")

  def __str__(self) -> str:
    return f"version_budget(max_staleness={self.max_staleness})"


def version_budget(max_staleness: int) -> VersionBudget:
  """Asynchronous pushes admitted by version, so none is staler than ``max_staleness`` (:class:`VersionBudget`)."""
  return VersionBudget(max_staleness)
