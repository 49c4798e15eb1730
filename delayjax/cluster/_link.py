"""A network link: a communication time that grows with the message, for ``workers(comm=...)``."""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import numpy as np

from delayjax._checks import check_float
from delayjax.cluster._distributions import Constant, TimeModel, as_time_model

__all__ = ["Link", "link"]


@dataclasses.dataclass(frozen=True)
class Link(TimeModel):
  """A push's communication time: a latency plus the message's bytes over the bandwidth.

  Build it with :func:`link`. Attributes:
    bandwidth: bytes per second (``> 0``; ``inf`` for no transfer time).
    message_bytes: bytes of one push (``>= 0``).
    latency: the time model of the latency (a constant 0 by default).
  """

  bandwidth: float
  message_bytes: float
  latency: TimeModel = Constant(0.0)

  @property
  def transfer(self) -> float:
    """The seconds to send one message, ``message_bytes / bandwidth``."""
    return 0.0 if math.isinf(self.bandwidth) else float(self.message_bytes) / float(self.bandwidth)

  @property
  def mean(self) -> float:
    return self.latency.mean + self.transfer

  def sample(self, rng: np.random.Generator, size: Any) -> np.ndarray:
    # The latency draws what it draws (a constant draws nothing): a link changes no other draw of the worker.
    return self.latency.sample(rng, size) + self.transfer


def link(bandwidth: float, message_bytes: float, latency: Any = 0.0) -> Link:
  r"""A link whose communication time per push grows with the message: ``latency + message_bytes / bandwidth``.

  .. math::  l = \lambda + \frac{b}{B}

  with :math:`\lambda` the latency (a number of seconds or any time model,
  drawn per push), :math:`b` the bytes of one push and :math:`B` the
  bandwidth in bytes per second: the :math:`\alpha`-:math:`\beta` cost of
  one message. Pass it as the communication model of the workers,
  ``dj.cluster.workers(M, comm=dj.cluster.link(B, b))`` (or one per
  worker, for links of different speeds); it is added to every push like
  any ``comm`` model. The push's bytes come from the update it carries:
  ``dj.message_bytes(params)`` for a dense one, ``dj.message_bytes(params,
  compressor)`` for one compressed by ``dj.top_k``, ``dj.qsgd``,
  ``dj.powersgd``, ... Where a worker also pulls the parameters over the
  same link, add their bytes to ``message_bytes``.

  Args:
    bandwidth: :math:`B > 0`, bytes per second; ``float("inf")`` for none
      (then only the latency counts).
    message_bytes: :math:`b \ge 0`, bytes of one push.
    latency: :math:`\lambda`: seconds (a number ``>= 0``), a distribution
      name or a time model such as ``dj.cluster.exponential(0.01)``.

  Returns:
    A frozen :class:`Link` (a ``TimeModel``).

  Raises:
    TypeError, ValueError: naming the argument, for a bandwidth that is not
      a positive number, bytes below 0, or a latency that is not a time model.

  Examples:
    >>> import delayjax as dj
    >>> net = dj.cluster.link(bandwidth=1e6, message_bytes=38_440, latency=0.001)
    >>> round(net.mean, 6)  # 0.001 + 38440 / 1e6
    0.03944
    >>> dj.cluster.workers(4, compute=1.0, comm=net).mean_time().tolist()
    [1.03944, 1.03944, 1.03944, 1.03944]

  References:
    **Only the abstract and the introduction of the paper were reachable
    here;** it models a step's time from the message size and the network's
    bandwidth to decide when compression pays, which this link lets a
    simulated cluster do.
    Agarwal, Wang, Venkataraman, Papailiopoulos, `On the Utility of Gradient
    Compression in Distributed Training Systems <https://arxiv.org/abs/2103.00543>`_,
    MLSys 2022.
  """
  if isinstance(bandwidth, (int, float, np.integer, np.floating)) and not isinstance(bandwidth, bool) \
      and math.isinf(bandwidth) and bandwidth > 0:
    bandwidth = math.inf
  else:
    bandwidth = check_float("bandwidth", bandwidth, minimum=0.0, strict_minimum=True)
  message_bytes = check_float("message_bytes", message_bytes, minimum=0.0)
  return Link(bandwidth, message_bytes, as_time_model("latency", latency))
