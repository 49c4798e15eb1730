"""Applying a per-gradient rule to each contribution of an update before they are combined."""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

# The runtime inputs a per-contribution stage asks for: each contribution's gradient, staleness,
# stale parameters, worker and weight in its update, on a leading contribution axis.
CONTRIBUTION_INPUTS = ("contribution_grads", "contribution_stale_params", "contribution_staleness",
                       "contribution_weights", "contribution_workers")


class PerContributionState(NamedTuple):
  """State of :func:`per_contribution`."""

  inner: Any  # the state of the transformation applied to each contribution

  def runtime_inputs(self) -> tuple[str, ...]:
    # Only the runtime knows an update's contributions: ask it for each one's inputs.
    return CONTRIBUTION_INPUTS


def per_contribution(tx: optax.GradientTransformation) -> optax.GradientTransformationExtraArgs:
  r"""Applies ``tx`` to each contribution of an update with its own staleness, then combines them.

  An update :math:`u` may average several contributions :math:`g_{u,m}`
  (n-softsync, K-async, K-batch, FedBuff), each computed by its worker
  :math:`m` at its own stale parameters :math:`\tilde w_{u,m}`, with
  staleness :math:`\tau_{u,m}` and weight :math:`n_{u,m}` (its minibatches).
  Where a paper defines its rule per gradient (Zhang et al.'s
  :math:`\alpha_0 / \tau` per gradient, DC-ASGD's correction with each
  worker's own backup weights), place this stage at the head of the chain:

  .. math::

    (d_{u,k}, s^{(k+1)}) = \text{tx.update}(g_{u,m_k}, s^{(k)}, w_u,\
      \text{staleness}=\tau_{u,m_k},\ \text{stale\_params}=\tilde w_{u,m_k},\
      \text{worker}=m_k), \qquad
    d_u = \sum_k \frac{n_{u,m_k}}{\sum_{k'} n_{u,m_{k'}}}\, d_{u,k}

  with :math:`s^{(0)}` the state before the update and :math:`s^{(K)}` the
  state after it: ``tx``'s state is threaded through the contributions in
  the update's order (the runtime's order: stalest first, the lowest worker
  index among equally stale ones), so per-worker state such as DC-ASGD-a's
  mean squares sees every gradient of its worker. The rest of the chain sees
  :math:`d_u`. Contributions left out of an update (``skip_nonfinite``)
  neither change the state nor count in the weights. With one contribution
  per update (ASP, the stale-read model) this is ``tx`` itself, bit for bit.

  ``dj.simulate`` passes the per-contribution inputs (the runtime inputs
  ``contribution_grads``, ``contribution_staleness``,
  ``contribution_stale_params``, ``contribution_workers`` and
  ``contribution_weights``, each with a leading contribution axis). Called
  without them (a hand-written loop, ``dj.delayed``: one gradient per call),
  the update is a single contribution and ``tx`` is applied to it directly
  with the call's ``staleness``, ``stale_params`` and ``worker``. Other extra
  arguments reach ``tx`` unchanged for every contribution.

  Args:
    tx: the per-gradient transformation, e.g. ``dj.scale_by_staleness("inverse")``
      or ``dj.delay_compensation(lam, adaptive=True, num_workers=M)``.

  Returns:
    An ``optax.GradientTransformationExtraArgs``.

  Raises:
    TypeError: if ``tx`` is not an ``optax.GradientTransformation`` (found
      here, not at the first update inside a compiled run).

  Examples:
    >>> import jax.numpy as jnp, optax
    >>> import delayjax as dj
    >>> tx = optax.chain(dj.per_contribution(dj.scale_by_staleness("inverse")), optax.sgd(1.0))
    >>> state = tx.init(jnp.zeros(1))
    >>> # One update made of a fresh gradient and one 4 updates stale, g = 1 each:
    >>> grads = jnp.ones((2, 1))
    >>> updates, state = tx.update(
    ...     jnp.ones(1), state, jnp.zeros(1), contribution_grads=grads,
    ...     contribution_staleness=jnp.array([0, 4]), contribution_stale_params=jnp.zeros((2, 1)),
    ...     contribution_workers=jnp.array([0, 1]), contribution_weights=jnp.array([0.5, 0.5]))
    >>> float(updates[0])  # -(1 / 1 + 1 / 4) / 2
    -0.625

  References:
    Zhang et al., `Staleness-aware Async-SGD for Distributed Deep Learning
    <https://arxiv.org/abs/1511.05950>`_, IJCAI 2016 (the learning rate is
    set per gradient, :math:`\alpha_0 / \tau`, before averaging).

    Zheng et al., `Asynchronous Stochastic Gradient Descent with Delay
    Compensation <https://arxiv.org/abs/1609.08326>`_, ICML 2017 (each
    gradient corrected with its worker's backup weights).
  """
  if not isinstance(tx, optax.GradientTransformation):
    raise TypeError(f"tx must be an optax transformation (an optax.GradientTransformation such as "
                    f"dj.scale_by_staleness('inverse')), got {type(tx).__name__} {tx!r}.")
  tx = optax.with_extra_args_support(tx)

  def contribution_update(grad, inner, params, tau, stale, worker, extra_args):
    return tx.update(grad, inner, params, staleness=tau, stale_params=stale, worker=worker, **extra_args)

  # Traced, the contributions of an update (and the runtime's several traces of one run) call one jitted
  # function, traced once for its shapes rather than once per contribution: error feedback around top-k or
  # PowerSGD over 8 contributions took about a second of tracing a run. XLA inlines the call.
  traced_update = jax.jit(contribution_update)

  def init_fn(params):
    return PerContributionState(inner=tx.init(params))

  def update_fn(updates, state, params=None, *, contribution_grads=None, contribution_staleness=None,
                contribution_stale_params=None, contribution_workers=None, contribution_weights=None,
                **extra_args):
    given = dict(contribution_grads=contribution_grads, contribution_staleness=contribution_staleness,
                 contribution_stale_params=contribution_stale_params, contribution_workers=contribution_workers,
                 contribution_weights=contribution_weights)
    if all(v is None for v in given.values()):
      out, inner = tx.update(updates, state.inner, params, **extra_args)
      return out, PerContributionState(inner=inner)
    missing = [k for k, v in given.items() if v is None]
    if missing:
      # A part of the contributions would be taken as absent (or fail inside the trace): all or none.
      raise ValueError(f"per_contribution got {sorted(set(given) - set(missing))} without {missing}; pass all five "
                       f"contribution inputs ({', '.join(CONTRIBUTION_INPUTS)}) or none.")
    for name in ("staleness", "stale_params", "worker"):
      extra_args.pop(name, None)
    num = jnp.shape(contribution_weights)[0]

    # A lone contribution keeps tx's own trace (the single-contribution case below is tx itself, bit for bit). The
    # jitted step takes the extra arguments as arrays: a Python value among them (a string, a number the rule
    # branches on) would be refused or traced there, so such a call goes through tx's own trace too.
    traced = any(isinstance(x, jax.core.Tracer) for x in jax.tree.leaves(given))
    arrays = all(isinstance(x, jax.Array) for x in jax.tree.leaves(extra_args))
    step = traced_update if num > 1 and traced and arrays else contribution_update

    def apply(k, inner):
      grad, stale, tau = (jax.tree.map(lambda x: x[k], t) for t in (
          contribution_grads, contribution_stale_params, contribution_staleness))
      return step(grad, inner, params, tau, stale, contribution_workers[k], extra_args)

    if num == 1:
      # A lone contribution is the whole update (a runtime skips an update that keeps none): tx's own
      # result, with no product nor select that could change how XLA rounds it.
      out, inner = apply(0, state.inner)
      return out, PerContributionState(inner=inner)
    inner, total = state.inner, None
    # A static, small number of contributions (the most any update of the run has): unrolled.
    for k in range(num):
      out, new_inner = apply(k, inner)
      weight = contribution_weights[k]
      kept = weight > 0
      # Absent contributions (weight 0) leave the state as it was and add nothing.
      inner = jax.tree.map(lambda n, o: jnp.where(kept, n, o), new_inner, inner)
      term = jax.tree.map(lambda d: jnp.where(kept, weight.astype(d.dtype) * d, jnp.zeros((), d.dtype)), out)
      total = term if total is None else jax.tree.map(jnp.add, total, term)
    return total, PerContributionState(inner=inner)

  return optax.GradientTransformationExtraArgs(init_fn, update_fn)
