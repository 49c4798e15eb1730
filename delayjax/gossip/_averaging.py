"""Gossip averaging methods: D-PSGD, AD-PSGD, GossipGraD and Stochastic Gradient Push."""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from delayjax.gossip._method import (GRADS, PARAMS, GossipMethod, no_extra, optimizer_step, params_themselves,
                                     plain_apply, replace_params)


def d_psgd() -> GossipMethod:
  r"""Decentralized parallel SGD: each replica averages its model with its neighbours' and steps on its own gradient.

  On replica :math:`i` with parameters :math:`x_i` and optimizer state
  :math:`s_i`, a ``READ`` takes :math:`g_i = \nabla f_i(x_i)` at the model it
  holds then, a ``GRAD`` applies it through the replica's own optimizer to its
  *current* model, and a ``PARAMS`` mix replaces every receiving member by

  .. math::

    x_i \leftarrow \sum_j W_{ij}\, x_j, \qquad
    (u, s_i) = \text{tx.update}(g_i, s_i, x_i), \quad x_i \leftarrow x_i + u

  with the schedule's weights :math:`W` (doubly stochastic for D-PSGD). The
  optimizer state is never mixed. In synchronous rounds ``READ``, ``MIX``,
  ``GRAD`` this is Lian et al.'s
  :math:`x_i^{k+1} = \sum_j W_{ij} x_j^k - \gamma \nabla f_i(x_i^k)` for
  ``tx = optax.sgd(gamma)``; in rounds ``READ``, ``GRAD``, ``MIX`` on a
  complete graph with :math:`W = \tfrac1M \mathbf{1}\mathbf{1}^\top` it is
  all-reduce SGD. With one replica it is plain training with ``tx``.

  Returns:
    A :class:`GossipMethod`.

  References:
    Lian, Zhang, Zhang, Hsieh, Zhang, Liu, `Can Decentralized Algorithms
    Outperform Centralized Algorithms? A Case Study for Decentralized Parallel
    Stochastic Gradient Descent <https://arxiv.org/abs/1705.09056>`_, NeurIPS 2017
  """
  return GossipMethod("d_psgd", no_extra, params_themselves, plain_apply, params_themselves, replace_params)


def ad_psgd() -> GossipMethod:
  r"""Asynchronous decentralized parallel SGD: D-PSGD's rule on an asynchronous schedule of pairwise averages.

  The rule is :func:`d_psgd`'s; what makes it AD-PSGD is the schedule: each
  replica computes a gradient at the model it read while, meanwhile, pairs of
  replicas average atomically, :math:`x_i, x_j \leftarrow (x_i + x_j)/2`, so
  the gradient is applied to a model that may have been mixed since it was
  read. As in the authors' reference code (``gossip/ad_psgd.py`` of
  ``facebookresearch/stochastic_gradient_push``: the gossip process holds the
  model, steps it with ``torch.optim.SGD`` with momentum, Nesterov and weight
  decay on each gradient the training process hands over, and averages it
  with a peer's), the optimizer state (momentum) belongs to each replica's
  local copy and is not averaged: pass that optimizer as ``tx``, e.g.
  ``optax.chain(optax.add_decayed_weights(1e-4), optax.sgd(0.1, momentum=0.9,
  nesterov=True))``.

  Returns:
    A :class:`GossipMethod`.

  References:
    Lian, Zhang, Zhang, Liu, `Asynchronous Decentralized Parallel Stochastic
    Gradient Descent <https://arxiv.org/abs/1710.06952>`_, ICML 2018
  """
  return d_psgd()._replace(name="ad_psgd")


def gossip_grad() -> GossipMethod:
  r"""GossipGraD: replicas average *gradients* with a rotating partner; parameters are never mixed.

  A ``MIX`` combines the members' pending gradients (computed at their last
  ``READ``, not yet applied) and each replica then steps its own model with
  its own optimizer:

  .. math::

    g_i \leftarrow \sum_j W_{ij}\, g_j \quad (\tfrac12 (g_i + g_{\text{recv}})
    \text{ in GossipGraD}), \qquad (u, s_i) = \text{tx.update}(g_i, s_i, x_i),
    \quad x_i \leftarrow x_i + u

  as in ``pytorch/torchdistx``'s ``gossip_grad.py`` communication hook, which
  adds the gradient received from its receive-peer to its own and scales the
  sum by 0.5 before the optimizer step (the partner schedule, rotating with a
  fresh node shuffle every :math:`\lceil \log_2 N \rceil` steps, is the
  gossip schedule's).

  Returns:
    A :class:`GossipMethod` whose mixes combine gradients.

  References:
    Daily, Vishnu, Siegel, Warfel, Amatya, `GossipGraD: Scalable Deep Learning
    using Gossip Communication based Asynchronous Gradient Descent
    <https://arxiv.org/abs/1803.05880>`_, 2018
  """
  return GossipMethod("gossip_grad", no_extra, params_themselves, plain_apply, params_themselves,
                      replace_params, mixes=GRADS)


class PushSumState(NamedTuple):
  """Per-replica state of :func:`sgp`."""

  weight: jax.Array  # shape=(), float32: the push-sum weight w_i, 1 at the start


def _sgp_init(params: Any) -> PushSumState:
  del params
  return PushSumState(jnp.ones((), jnp.float32))


def _debiased(params: Any, extra: PushSumState) -> Any:
  return jax.tree.map(lambda x: x / extra.weight.astype(x.dtype), params)


def _sgp_apply(tx, grads, opt_state, params, extra, dt):
  del dt
  # The optimizer steps the push-sum numerator x, with the gradient taken at z = x / w.
  params, opt_state = optimizer_step(tx, grads, opt_state, params)
  return params, opt_state, extra


def _sgp_message(params: Any, extra: PushSumState) -> tuple[Any, jax.Array]:
  return params, extra.weight


def _sgp_receive(params, extra, mixed, self_weight, dt):
  del params, extra, self_weight, dt
  numerator, weight = mixed
  return numerator, PushSumState(weight)


def sgp() -> GossipMethod:
  r"""Stochastic Gradient Push: push-sum gossip over a directed graph, gradients at the de-biased model.

  Each replica keeps a numerator :math:`x_i` (its ``params``) and a push-sum
  weight :math:`w_i` (1 at the start), and computes its gradients at the
  de-biased model :math:`z_i = x_i / w_i`. A ``GRAD`` steps the numerator
  with the replica's optimizer; a ``PARAMS`` mix (column-stochastic weights:
  each sender splits its mass, messages possibly ``lag`` versions late, as in
  SGP's :math:`\tau`-overlap) mixes numerator and weight alike:

  .. math::

    g_i = \nabla f_i(x_i / w_i), \quad (u, s_i) = \text{tx.update}(g_i, s_i, x_i),
    \quad x_i \leftarrow x_i + u, \qquad
    x_i \leftarrow \sum_j W_{ij}\, x_j, \quad w_i \leftarrow \sum_j W_{ij}\, w_j

  as in the authors' ``gossip/distributed.py``: the forward pass runs on the
  de-biased parameters (``unbias``: divide by ``ps_weight``), the backward
  hook turns them back into numerators (``ps_numerator``) before
  ``optimizer.step()``, and the gossip thread mixes numerators and weights
  with the same mixing weights. With one replica :math:`w = 1` and this is
  plain training with ``tx``.

  Its ``push_sum`` flag lets it run on column-stochastic (push-sum)
  schedules, which the methods without a weight refuse; on a row-stochastic
  one its weight stays 1 and it is D-PSGD (see ``check_method_schedule``).

  Returns:
    A :class:`GossipMethod` with a :class:`PushSumState` per replica.

  References:
    Assran, Loizou, Ballas, Rabbat, `Stochastic Gradient Push for Distributed
    Deep Learning <https://arxiv.org/abs/1811.10792>`_, ICML 2019
  """
  return GossipMethod("sgp", _sgp_init, _debiased, _sgp_apply, _sgp_message, _sgp_receive, mixes=PARAMS,
                      push_sum=True)
