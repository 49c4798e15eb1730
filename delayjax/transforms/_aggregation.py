"""Aggregating stale contributions: summed accumulation (Aji & Heafield), FedAsync and FedBuff."""

from __future__ import annotations

import dataclasses
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

from delayjax.transforms._extra_args import check_updates_like, like_updates, require_extra
from delayjax.transforms._hyperparams import check_number, coefficient, descend
from delayjax.transforms._staleness import Rule, broadcast_staleness, rule_parameters, scale_by_staleness, staleness_weight


@jax.tree_util.register_static
@dataclasses.dataclass(frozen=True, eq=False)
class StepEvery:
  """Static metadata of an accumulating state: the transformation, its argument and ``K`` (``None`` if traced).

  It lets :func:`delayjax.transforms.check_schedule` refuse a run too short
  for one inner step. It is a pytree node without leaves, and every
  ``StepEvery`` compares (and prints) equal: it is not part of the state's
  identity, so states with different ``K``, or with ``K`` injected as an
  array, keep one tree structure (``jit`` caches, ``lax.scan`` carries,
  checkpoints, ``optax.inject_hyperparams``), as they did without it.
  """

  transformation: str = "accumulate_sum"
  argument: str = "k"
  value: int | None = None

  def __eq__(self, other: object) -> bool:
    return isinstance(other, StepEvery)

  def __hash__(self) -> int:
    return hash(StepEvery)

  def __repr__(self) -> str:
    return "StepEvery()"


class AccumulateSumState(NamedTuple):
  """State of :func:`accumulate_sum` (and of the buffer of :func:`fed_buff`)."""

  count: jax.Array  # shape=(), int32: contributions summed since the last inner step, in [0, k)
  summed: Any  # pytree like params: their sum
  inner_state: Any  # the inner optimizer's state, untouched between inner steps
  every: StepEvery = StepEvery()  # static: which transformation and K (no leaves)

  def contributions_per_step(self) -> tuple[str, str, int] | None:
    """``(the call, the name of its K, K)`` (see ``dj.transforms.check_schedule``), or ``None`` if ``K`` was traced."""
    every = self.every
    if every.value is None:
      return None
    return f"dj.{every.transformation}(..., {every.argument}={every.value})", every.argument, every.value


def accumulate_sum(
    inner: optax.GradientTransformation,
    k: int | jax.Array,
) -> optax.GradientTransformationExtraArgs:
  r"""Sums ``k`` asynchronous gradients, then takes one step of ``inner``.

  .. math::

    G \leftarrow G + g_t; \qquad
    u_t = \begin{cases} \text{inner}(G),\ G \leftarrow 0 & \text{on every } k\text{-th call} \\
    0 & \text{otherwise} \end{cases}

  This is the remedy of Aji & Heafield (2019): the server sums the gradients
  of several asynchronous pushes and applies them as one update, so a
  Transformer trained with Adam sees one larger, less stale step instead of
  many small ones. On the other calls the update is exactly zero and the
  inner state is left untouched.

  Difference from ``optax.MultiSteps``: ``MultiSteps`` hands the inner
  optimizer the *mean* of the ``k`` gradients; this hands it their *sum*.
  The input of the inner step is therefore exactly ``k`` times larger. For a
  linear inner optimizer (``optax.sgd`` without or with momentum) the update
  is ``k`` times ``MultiSteps``'s (up to rounding: ``MultiSteps`` keeps a
  running mean), i.e. the learning rate is effectively multiplied by ``k``;
  for Adam (scale-invariant up to ``eps``) the two agree up to ``eps``.

  Extra arguments are passed through to ``inner`` from the call that
  completes the sum (the summed gradients carry mixed staleness; an inner
  transformation that needs one staleness gets the latest push's).

  With ``k=1`` the inner optimizer is applied to every gradient: the result
  is ``inner``'s bit for bit.

  Args:
    inner: the optimizer applied to each sum (e.g. ``optax.adam(lr)``).
    k: how many gradients to sum per inner step, an integer ``>= 1`` (or an
      integer scalar array, e.g. injected by ``optax.inject_hyperparams``).

  Returns:
    An ``optax.GradientTransformationExtraArgs``.

  Examples:
    >>> import jax.numpy as jnp, optax
    >>> import delayjax as dj
    >>> tx = dj.accumulate_sum(optax.sgd(0.1), k=2)
    >>> params = jnp.zeros(1)
    >>> state = tx.init(params)
    >>> u1, state = tx.update(jnp.array([1.0]), state, params)
    >>> u2, state = tx.update(jnp.array([3.0]), state, params)
    >>> u1, u2  # nothing, then -0.1 * (1 + 3)
    (Array([0.], dtype=float32), Array([-0.4], dtype=float32))

  References:
    Aji, Heafield, `Making Asynchronous Stochastic Gradient Descent Work for
    Transformers <https://arxiv.org/abs/1906.03496>`_, Workshop on Neural
    Generation and Translation (WNGT) 2019.
  """
  return _accumulate_sum(inner, k, "accumulate_sum", "k")


def _concrete_int(value: Any) -> int | None:
  """``value`` as a Python int when it is concrete (a number or a concrete scalar array), else ``None``."""
  if isinstance(value, jax.core.Tracer):
    return None
  return int(value)


def _accumulate_sum(inner: optax.GradientTransformation, k: Any, transformation: str,
                    argument: str) -> optax.GradientTransformationExtraArgs:
  """:func:`accumulate_sum`, its ``k`` checked and recorded under the name the caller gave it."""
  if not isinstance(inner, optax.GradientTransformation):
    raise TypeError(f"inner must be an optax.GradientTransformation (e.g. optax.adam(1e-3)), got "
                    f"{type(inner).__name__} {inner!r}.")
  k = check_number(argument, k, minimum=1, integer=True)
  inner = optax.with_extra_args_support(inner)
  every = StepEvery(transformation, argument, _concrete_int(k))

  def init_fn(params):
    return AccumulateSumState(
        count=jnp.zeros([], jnp.int32),
        summed=jax.tree.map(jnp.zeros_like, params),
        inner_state=inner.init(params),
        every=every)

  def update_fn(updates, state, params=None, **extra_args):
    check_updates_like(f"dj.{transformation}", updates, state.summed, "sum")
    summed = jax.tree.map(lambda s, g: s + g, state.summed, updates)
    step = state.count + 1 >= k
    # The inner step is computed on every call and selected, so the function has one trace.
    inner_updates, inner_state = inner.update(summed, state.inner_state, params, **extra_args)
    out = jax.tree.map(lambda u: jnp.where(step, u, jnp.zeros_like(u)), inner_updates)
    new_state = AccumulateSumState(
        count=jnp.where(step, jnp.zeros([], jnp.int32), state.count + 1),
        summed=jax.tree.map(lambda s: jnp.where(step, jnp.zeros_like(s), s), summed),
        # jnp.where leaf by leaf rather than lax.cond over whole trees: a cond breaks under shard_map.
        inner_state=optax.tree_utils.tree_where(step, inner_state, state.inner_state),
        every=every)
    return out, new_state

  return optax.GradientTransformationExtraArgs(init_fn, update_fn)


def fed_async(
    mixing: float | jax.Array = 0.9,
    rule: Rule = "constant",
    *,
    a: float | jax.Array | None = None,
    b: float | jax.Array | None = None,
    value: float | jax.Array | None = None,
    threshold: int | jax.Array | None = None,
) -> optax.GradientTransformationExtraArgs:
  r"""FedAsync: mixes a stale client model into the server model.

  .. math::

    x \leftarrow (1 - \alpha_t)\, x + \alpha_t\, x_{new}, \qquad
    \alpha_t = \alpha \, s(t - \tau)

  **Input convention.** ``updates`` is the client's *delta*
  :math:`\Delta = x_{new} - x_{read}`: the client's new model minus the
  stale server model it started from (``stale_params``, version
  :math:`\tau`), so :math:`x_{new} = x_{read} + \Delta`. The output is the
  server update :math:`\alpha_t (x_{new} - x) = \alpha_t (\Delta - (x - x_{read}))`.
  A runtime that feeds gradients can turn them into deltas of one local SGD
  step with ``optax.chain(optax.scale(-client_lr), dj.fed_async(...))``.

  :math:`t - \tau` is the ``staleness`` extra argument (a scalar, or per
  leaf) and :math:`s` a rule of :func:`staleness_weight`: FedAsync's rules
  are ``"constant"`` (:math:`s = 1`), ``"polynomial"``
  (:math:`(t - \tau + 1)^{-a}`) and ``"hinge"`` (1 if
  :math:`t - \tau \le b`, else :math:`1 / (a (t - \tau - b) + 1)`), as in
  the authors' code. Every call is a server step, so the runtime's
  staleness (updates since the read) is already the number of server
  versions since the read, the unit of the paper.

  With ``staleness=0`` and ``stale_params=params`` the update is
  :math:`\alpha \Delta`, bit for bit ``optax.scale(mixing)``; with
  ``mixing=1`` the server simply takes the client's model.

  Per client update: FedAsync weights each client's model by its own
  staleness. When one server update combines several client deltas,
  ``dj.per_contribution(dj.fed_async(...))`` mixes each in with its own
  staleness and read parameters; used directly, this sees one (combined)
  delta, with one staleness and one ``stale_params``.

  Args:
    mixing: :math:`\alpha`, in ``(0, 1]``.
    rule: the staleness function :math:`s` (a :func:`staleness_weight` rule).
    a, b, value, threshold: its parameters (e.g. ``a=0.5`` for ``"polynomial"``).

  Returns:
    An ``optax.GradientTransformationExtraArgs`` that needs ``params`` and the
    ``staleness`` and ``stale_params`` extra arguments.

  Examples:
    >>> import jax.numpy as jnp
    >>> import delayjax as dj
    >>> tx = dj.fed_async(0.5, "polynomial", a=1.0)
    >>> x, x_read = jnp.array([1.0]), jnp.array([0.0])
    >>> u, _ = tx.update(jnp.array([3.0]), tx.init(x), x, staleness=1, stale_params=x_read)
    >>> u  # x_new = 3, alpha_t = 0.5 / 2, update = 0.25 * (3 - 1)
    Array([0.5], dtype=float32)

  References:
    Xie, Koyejo, Gupta, `Asynchronous Federated Optimization
    <https://arxiv.org/abs/1903.03934>`_, 2019;
    the rules follow the authors' code (github.com/xcgoner/async_fl).
  """
  mixing = check_number("mixing", mixing, minimum=0.0, maximum=1.0, strict_minimum=True)
  weight = staleness_weight(rule, **rule_parameters(a=a, b=b, value=value, threshold=threshold))

  def init_fn(params):
    del params
    return optax.EmptyState()

  def update_fn(updates, state, params=None, *, staleness=None, stale_params=None, **extra_args):
    del extra_args
    params = require_extra("fed_async", "params", params)
    stale_params = require_extra("fed_async", "stale_params", stale_params)
    stale_params = like_updates("stale_params", stale_params, updates)
    taus = broadcast_staleness(staleness, updates)

    def mix(delta, x, x_read, tau):
      alpha_t = (coefficient(mixing, jnp.float32) * weight(tau)).astype(delta.dtype)
      # Delta - (x - x_read) rather than x_read + Delta - x: exact when x_read == x.
      return alpha_t * (delta - (x - x_read))

    return jax.tree.map(mix, updates, params, stale_params, taus), state

  return optax.GradientTransformationExtraArgs(init_fn, update_fn)


STALENESS_COUNTS = ("updates", "versions")


def server_versions_behind(staleness: jax.Array, buffered: jax.Array, buffer_size: Any) -> jax.Array:
  r"""Server versions behind, from a staleness counted in calls: :math:`\lceil (\tau - c) / K \rceil^+`.

  A delta that arrives as call :math:`n` (``n`` calls already made) was
  computed at the model read after call :math:`n - \tau`. The server takes
  a step on every :math:`K`-th call, so after :math:`m` calls it is at
  version :math:`\lfloor m / K \rfloor`, and with :math:`c = n \bmod K`
  deltas in the buffer the delta is
  :math:`\lfloor n/K \rfloor - \lfloor (n - \tau)/K \rfloor = \max(0, \lceil (\tau - c)/K \rceil)`
  versions behind. Exact while :math:`K` stays constant (a traced ``K``
  that changes during a run is converted with its current value).
  """
  tau = jnp.asarray(staleness, jnp.int32)
  k = jnp.asarray(buffer_size, jnp.int32)
  # floor((tau - c + K - 1) / K) is the ceiling for tau > c; jnp's floor division rounds toward -inf.
  return jnp.maximum((tau - buffered + k - 1) // k, 0)


def fed_buff(
    server_optimizer: optax.GradientTransformation,
    buffer_size: int | jax.Array = 10,
    rule: Rule = "polynomial",
    *,
    a: float | jax.Array | None = None,
    b: float | jax.Array | None = None,
    value: float | jax.Array | None = None,
    threshold: int | jax.Array | None = None,
    staleness_counts: str = "updates",
) -> optax.GradientTransformationExtraArgs:
  r"""FedBuff: buffers ``K`` staleness-weighted client deltas, then one server step.

  .. math::

    B \leftarrow B + s(\tau_i)\, \Delta_i; \qquad
    \text{every } K\text{-th delta:}\quad u = \text{server}\!\left(-\tfrac{1}{K} B\right),\ B \leftarrow 0

  ``updates`` is a client delta :math:`\Delta_i = x_{new} - x_{read}` (as
  in :func:`fed_async`). The default weight is
  :math:`s(\tau) = 1/\sqrt{1 + \tau}` (``"polynomial"`` with ``a=0.5``).
  The server optimizer receives the *pseudo-gradient*
  :math:`-\bar\Delta = -B/K`, so ``optax.sgd(eta_g, momentum=beta)`` gives
  FedBuff's server step :math:`x \leftarrow x + \eta_g \bar\Delta` with
  server momentum. On the other calls the update is exactly zero and the
  server optimizer's state is untouched.

  **Staleness is counted in server versions.** In the paper and in the
  authors' FLSim, :math:`\tau_i` is the number of *server steps* since
  client :math:`i` read the model (FLSim's model sequence number grows by
  one per server step, not per arrival). The delayjax runtimes pass the
  number of *calls* (client arrivals) since the read. With
  ``staleness_counts="updates"`` (the default) this transformation converts
  it: with :math:`c` deltas already in the buffer, a delta :math:`\tau`
  calls stale is :math:`\max(0, \lceil (\tau - c)/K \rceil)` versions stale
  (:func:`server_versions_behind`; exact for a constant :math:`K`). Pass
  ``staleness_counts="versions"`` when the caller already counts versions.

  Built from ``scale_by_staleness(rule)``, ``optax.scale(-1/K)`` and
  ``accumulate_sum(server_optimizer, K)``; the state is that chain's.
  Per-leaf staleness is accepted. With ``buffer_size=1`` every call is a
  server step, the two counts agree, and with ``staleness=0`` the result
  is ``server_optimizer`` applied to :math:`-\Delta`, bit for bit.

  Per client update: FedBuff weights each client delta by its own
  staleness as it enters the buffer, which this transformation does when
  each call brings one delta (ASP and the stale-read model). When the
  runtime combines several deltas into one call (n-softsync, K-async
  schedules), ``dj.per_contribution(dj.fed_buff(...))`` weights each with
  its own staleness; the runtime's staleness then counts its updates, not
  the calls this transformation sees, and the conversion above is not
  exact: pass ``staleness_counts="versions"`` with a staleness you count.

  Args:
    server_optimizer: the server's optimizer (e.g. ``optax.sgd(0.7, 0.9)``).
    buffer_size: :math:`K`, the number of deltas per server step, an
      integer ``>= 1`` (or an integer scalar array).
    rule: the staleness weight :math:`s` (a :func:`staleness_weight` rule).
    a, b, value, threshold: its parameters; ``"polynomial"`` defaults to ``a=0.5``.
    staleness_counts: what the ``staleness`` extra argument counts:
      ``"updates"`` (calls since the read, as the delayjax runtimes pass it;
      converted to server versions) or ``"versions"`` (server steps since the
      read; used as given).

  Returns:
    An ``optax.GradientTransformationExtraArgs`` that needs the ``staleness``
    extra argument.

  Examples:
    >>> import jax.numpy as jnp, optax
    >>> import delayjax as dj
    >>> tx = dj.fed_buff(optax.sgd(1.0), buffer_size=2)
    >>> x = jnp.zeros(1)
    >>> state = tx.init(x)
    >>> # A delta read 3 calls ago, the buffer now empty: the server stepped twice since (ceil(3 / 2)).
    >>> u1, state = tx.update(jnp.array([2.0]), state, x, staleness=3)
    >>> u2, state = tx.update(jnp.array([1.0]), state, x, staleness=0)
    >>> u1, u2  # 2 versions behind: (2 / sqrt(3) + 1) / 2
    (Array([0.], dtype=float32), Array([1.0773503], dtype=float32))

  References:
    Nguyen, Malik, Zhan, Yousefpour, Rabbat, Malek, Huba, `Federated Learning
    with Buffered Asynchronous Aggregation <https://arxiv.org/abs/2106.06639>`_,
    AISTATS 2022; the staleness unit follows the authors' code
    (github.com/facebookresearch/FLSim, ``ModelSequenceNumberTracker``).
  """
  if not isinstance(server_optimizer, optax.GradientTransformation):
    raise TypeError(f"server_optimizer must be an optax.GradientTransformation (e.g. optax.sgd(0.7)), got "
                    f"{type(server_optimizer).__name__} {server_optimizer!r}.")
  if staleness_counts not in STALENESS_COUNTS:
    raise ValueError(f"staleness_counts must be one of {STALENESS_COUNTS}, got {staleness_counts!r}.")
  buffer_size = check_number("buffer_size", buffer_size, minimum=1, integer=True)
  # -1/K as optax.scale(-1.0 / K) computes it for a Python int, cast to each update's dtype for an array K.
  inverse = 1.0 / buffer_size if isinstance(buffer_size, int) else 1.0 / coefficient(buffer_size, jnp.float32)
  chain = optax.chain(
      scale_by_staleness(rule, a=a, b=b, value=value, threshold=threshold),
      optax.stateless(lambda updates, params=None: jax.tree.map(lambda u: descend(inverse, u), updates)),
      _accumulate_sum(server_optimizer, buffer_size, "fed_buff", "buffer_size"),
  )
  if staleness_counts == "versions":
    return chain

  def update_fn(updates, state, params=None, *, staleness=None, **extra_args):
    taus = broadcast_staleness(staleness, updates)
    buffered = state[2].count  # deltas in the buffer before this one: the call index modulo K
    versions = jax.tree.map(lambda t: server_versions_behind(t, buffered, buffer_size), taus)
    return chain.update(updates, state, params, staleness=versions, **extra_args)

  return optax.GradientTransformationExtraArgs(chain.init, update_fn)
