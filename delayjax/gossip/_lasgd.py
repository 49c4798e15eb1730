"""LASGD: local steps that never wait, and an all-reduce of the models that runs behind them (Avidor 2022)."""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from delayjax.gossip._method import PARAMS, GossipMethod, params_themselves, plain_apply


class LASGDState(NamedTuple):
  """Per-replica state of :func:`lasgd`."""

  anchor: Any  # pytree like params: the model right after the replica's last merge (params at the start)


def lasgd() -> GossipMethod:
  r"""LASGD: an all-reduce of snapshots in the background, merged with the local progress made meanwhile.

  Replica :math:`i` trains its model :math:`x_i` with its own optimizer and
  never waits (a ``GRAD`` is ``tx`` at :math:`x_i`, as in local SGD). It
  also keeps :math:`a_i`, its model right after its last merge (``params`` at
  the start): the snapshot it contributes to the all-reduce in flight. A
  ``PARAMS`` mix (the all-reduce completing, weights :math:`W`, :math:`1/M`
  on ``dj.cluster.lasgd``'s schedule) averages the snapshots, and each
  receiving replica keeps the progress it made while the all-reduce ran:

  .. math::

    x_i \leftarrow \sum_j W_{ij}\, a_j + (x_i - a_i), \qquad a_i \leftarrow x_i

  after which the next all-reduce starts from the new :math:`a_i`. With one
  replica the merge changes nothing (plain training with ``tx``); in
  lockstep rounds where each all-reduce overlaps exactly one local step
  (``READ``, ``GRAD``, ``MIX``), it is :math:`x_i^{k+1} = \bar x^k + u_i^k`,
  which is DC-S3GD without compensation (``dc_s3gd(0)``) and D-PSGD on the
  complete graph (both on ``READ``, ``MIX``, ``GRAD`` rounds with
  :math:`W = \tfrac1M`; ``tests/gossip/test_lasgd.py`` pins the three
  against each other and against a NumPy loop). What differs from them is
  the asynchrony: a fast replica makes many local steps during one
  all-reduce, a slow one few, and nobody waits for anyone.

  **Only the paper's abstract could be read here**: it confirms an
  asynchronous decentralized algorithm in which workers do not wait for
  each other and all-reduce is what synchronizes the models (unlike gossip's
  sparse averaging). The rule above (the all-reduce carries each replica's
  snapshot, taken when its previous all-reduce completed; the merge adds
  the progress made since the snapshot to the average), and the schedule
  ``dj.cluster.lasgd`` (back-to-back all-reduces, local steps that never
  wait), are the library's construction of that description, not the
  paper's verified algorithm.

  A mix's messages are the snapshots :math:`a_j` the replicas keep, so the
  schedule's mixes carry no lag; a schedule with late messages is refused
  (``late_messages=False``): aging a snapshot again would mix models that
  are neither current nor the ones being merged.

  Returns:
    A :class:`GossipMethod` with a :class:`LASGDState` per replica.

  Examples:
    >>> import delayjax as dj
    >>> dj.gossip.lasgd().name
    'lasgd'

  References:
    Avidor, Tal Israel, `Locally Asynchronous Stochastic Gradient Descent for
    Decentralised Deep Learning <https://arxiv.org/abs/2203.13085>`_, arXiv 2203.13085, 2022
  """

  def init(params):
    return LASGDState(jax.tree.map(jnp.array, params))

  def message(params, extra):
    del params
    return extra.anchor

  def receive(params, extra, mixed, self_weight, dt):
    del self_weight, dt
    merged = jax.tree.map(lambda m, x, a: m + (x - a), mixed, params, extra.anchor)
    return merged, LASGDState(merged)

  return GossipMethod("lasgd", init, params_themselves, plain_apply, message, receive, mixes=PARAMS,
                      late_messages=False)
