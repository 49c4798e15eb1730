"""The drop-in wrapper: any Optax optimizer, delayed, in an unchanged training loop."""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax

from delayjax import delays as delays_lib
from delayjax._checks import check_bool, check_seed
from delayjax._memory import available_memory, check_fits, format_bytes
from delayjax._sharding import stacked_zeros
from delayjax.cluster._schedule import Schedule
from delayjax.runtime._buffers import check_update_call
from delayjax.runtime._replay import replay

_COMPUTED = ("staleness", "stale_params")


class DelayedState(NamedTuple):
  """State of :func:`delayed`. ``R = max_delay + 1`` slots; call ``t`` writes slot ``t mod R``."""

  count: jax.Array  # shape=(), int32: calls so far
  key: jax.Array  # shape=(2,), uint32: base PRNG key of the delay draws
  issued: jax.Array  # shape=(R,), int32: the call that wrote each slot, -1 if empty
  delay: Any  # int32 [R] (one delay per call), or a pytree of int32 [R] like params (per-leaf delays)
  worker: jax.Array  # shape=(R,), int32: the worker the call that wrote each slot named, -1 if none
  grads: Any  # pytree like params, each leaf [R, *shape]: gradients waiting to be applied
  stale_params: Any  # pytree like params, each leaf [R, *shape]: params at each slot's call; () if not kept
  inner_state: Any  # the wrapped optimizer's state


def _release_order(issued: jax.Array, delay: jax.Array, t: jax.Array, num_steps: int):
  """Slots released at call ``t`` in issue order: (slot index [K], active [K]).

  A slot is released when the call that wrote it plus its delay equals ``t``.
  Step ``k`` gets the k-th released slot; steps past the number released are
  inactive (their slot index is irrelevant).
  """
  released = (issued >= 0) & (issued + delay == t)
  # Unreleased slots sort last; released ones by the call that wrote them.
  sort_key = jnp.where(released, issued, jnp.iinfo(jnp.int32).max)
  order = jnp.argsort(sort_key)[:num_steps].astype(jnp.int32)
  active = jnp.arange(num_steps, dtype=jnp.int32) < jnp.sum(released, dtype=jnp.int32)
  return order, active


def _masked(active: jax.Array, new: Any, old: Any) -> Any:
  return jax.tree.map(lambda n, o: jnp.where(active, n, o), new, old)


def _check_grads(grads: Any, params: Any) -> None:
  """Raises a ValueError naming ``grads`` when its tree or a leaf's shape differs from ``params``'s.

  The gradients are written into rings shaped like the parameters; without
  this check a mismatch surfaces as a JAX broadcasting error, or, where the
  shapes broadcast (a ``[1]`` gradient for a ``[3]`` parameter), is silently
  spread over the ring slot. ``params=None`` is left to the call's own check.
  """
  if params is None:
    return
  grads_tree, params_tree = jax.tree.structure(grads), jax.tree.structure(params)
  if grads_tree != params_tree:
    raise ValueError(f"grads (the first argument of update) must have the tree structure of params "
                     f"{params_tree}; got {grads_tree}.")
  for (path, g), p in zip(jax.tree_util.tree_leaves_with_path(grads), jax.tree.leaves(params)):
    if jnp.shape(g) != jnp.shape(p):
      raise ValueError(f"grads (the first argument of update) must have the shapes of params: at "
                       f"{jax.tree_util.keystr(path) or 'the root'} grads has shape {jnp.shape(g)} and params "
                       f"{jnp.shape(p)}.")


def _nbytes(tree: Any) -> int:
  """Bytes of the arrays of ``tree`` (concrete, traced or ``jax.ShapeDtypeStruct``), from their shapes."""
  return sum(int(np.prod(jnp.shape(x), dtype=np.int64)) * jnp.dtype(jnp.result_type(x)).itemsize
             for x in jax.tree.leaves(tree))


def _device_memory() -> tuple[int | None, str]:
  """Bytes free on the default device for new arrays, and what that figure is.

  An accelerator that reports ``memory_stats()['bytes_limit']`` gives that
  limit less what is in use; otherwise (a CPU) the host's available memory.
  """
  device = jax.devices()[0]
  try:
    stats = device.memory_stats()
  except (AttributeError, NotImplementedError, jax.errors.JaxRuntimeError):
    stats = None
  if stats and "bytes_limit" in stats:
    free = int(stats["bytes_limit"]) - int(stats.get("bytes_in_use", 0))
    return free, f"free memory of {device.device_kind} (bytes_limit less bytes_in_use)"
  return available_memory(), "available host memory (MemAvailable)"


def state_bytes(params: Any, inner: Any, num_slots: int, per_leaf: bool, synchronous: bool,
                store_stale_params: bool) -> tuple[int, int]:
  """The bytes of :func:`delayed`'s state from shapes alone (nothing allocated), and of one ring slot.

  The state holds the call count (int32) and the PRNG key (2 x uint32),
  ``num_slots`` int32 entries for the call that wrote each slot, as many
  delays (per leaf with per-leaf delays) and as many workers, a ring of ``num_slots`` gradients
  shaped like ``params`` (none without delay), the same ring of parameter
  copies with ``store_stale_params``, and the inner optimizer's state
  (``jax.eval_shape``).
  """
  param_bytes = _nbytes(params)
  rings_kept = 0 if synchronous else 1 + int(store_stale_params)
  tables = 4 * num_slots * (2 + (len(jax.tree.leaves(params)) if per_leaf else 1))
  inner_bytes = _nbytes(jax.eval_shape(inner.init, params))
  return 4 + 8 + tables + rings_kept * num_slots * param_bytes + inner_bytes, param_bytes


def _check_init_memory(model: delays_lib.DelayModel, params: Any, inner: Any, num_slots: int, per_leaf: bool,
                       synchronous: bool, store_stale_params: bool) -> None:
  """Refuses, before anything is allocated, a state of :func:`delayed` that cannot fit in memory (see
  :func:`state_bytes`), naming the delay, the bytes needed and the bytes available."""
  needed, param_bytes = state_bytes(params, inner, num_slots, per_leaf, synchronous, store_stale_params)
  available, where = _device_memory()
  rings = ("no rings" if synchronous else "grads and stale_params rings" if store_stale_params else "a grads ring")
  check_fits(f"dj.delayed with delays={model!r} (max_delay={model.max_delay}): its state ({rings} of "
             f"{num_slots} slots x {format_bytes(param_bytes)} of params, with its tables and the inner state)",
             needed, available, where)


def delayed(
    inner: optax.GradientTransformation,
    delays: delays_lib.DelayModel | Schedule,
    *,
    seed: int = 0,
    store_stale_params: bool = True,
) -> optax.GradientTransformationExtraArgs:
  r"""Delays the gradients given to an Optax optimizer: a drop-in asynchronous optimizer.

  The training loop is unchanged: it computes a gradient at the current
  parameters and calls ``update``. The gradient :math:`g_t` given at call
  :math:`t` (computed at that call's ``params``, :math:`w_t`) is applied
  through ``inner`` at call :math:`t + d_t`, with :math:`d_t` drawn from
  ``delays``:

  .. math::

    u_{t} = \sum_{s \,:\, s + d_s = t} \text{inner}\big(g_s;\; \text{params}=w^{(k)},
    \; \text{staleness}=d_s,\; \text{stale\_params}=w_s\big)

  Gradients released at the same call are applied one after another in issue
  order (smallest :math:`s` first), each ``inner`` update seeing the
  parameters :math:`w^{(k)}` the previous ones produced, and the call returns
  the sum of their updates. A call that releases none returns zero updates
  and leaves ``inner``'s state untouched. With ``constant(0)`` it is exactly
  ``inner``. Gradients still in flight when training stops are never
  applied.

  This is the delay on the *apply* side. ``dj.simulate`` realizes the same
  model on the *read* side (update :math:`t` uses a gradient computed at
  version :math:`t - d_t`). For ``constant`` delays the two are the same
  process; for random delays they differ (here several gradients can land
  in one call and some calls apply none).

  Per-leaf delays (``delays.per_leaf``) delay each leaf on its own: at step
  :math:`k` of a call each leaf gets its :math:`k`-th released gradient; a
  leaf with fewer releases gets a zero gradient (staleness 0, stale
  parameters = current parameters) at that step, and ``inner``'s state is
  left untouched only at steps where no leaf has a release. With constant
  per-leaf delays every leaf releases exactly one gradient per call once
  its first :math:`d` calls are past, so ``inner`` then sees whole, exact
  gradient trees (layer-wise staleness, pipeline-style delays).

  **Replaying a cluster.** With a ``Schedule`` from ``dj.cluster.simulate``,
  each call is one *read* of the schedule (by version read, then worker) and
  its gradient that read's contribution; the call applies, in order, every
  update whose reads have all been given. An update with several
  contributions passes ``inner`` their mean weighted by ``num_batches``, the
  largest ``staleness``, and the ``stale_params`` and ``worker`` of the
  stalest (lowest worker among ties), as ``dj.simulate`` does; a
  ``dj.per_contribution`` stage gets each contribution with its own. The
  parameters given at each call are then those of the version that read
  saw, so an unchanged loop replays the cluster exactly. The schedule has
  ``contributes.sum()`` reads; the last one's call also applies the updates
  outstanding, and later calls apply nothing. An equal-speed ASP schedule
  with ``M = tau + 1`` workers makes the calls of ``constant(tau)`` but for
  that last one and the staleness of the first ``tau`` updates (``u``, not
  ``tau``).

  **Workers.** A ``worker`` given to ``update`` is kept with its gradient, and
  ``inner`` gets the worker that *computed* the gradient it applies (so
  ``dj.delay_compensation(adaptive=True, num_workers=M)`` updates that
  worker's row). Give it at every call; a gradient given without one takes
  the applying call's. Per-leaf delays refuse it (a step's leaves come from
  different calls).

  Buffers are rings of ``max_delay + 1`` gradients and parameter copies (none
  when ``max_delay`` is 0: ``inner`` is then called directly), each sharded
  as its parameter (a concrete array's ``NamedSharding``, or a traced one's on
  ``Explicit`` mesh axes) with the ring axis unsharded: nothing is gathered.
  It is traced arithmetic without Python control flow on values, so it runs
  under ``jit``, ``lax.scan`` and ``vmap``. With a constant delay one inner
  update is traced per call; otherwise a ``lax.fori_loop`` runs one per
  gradient released (at least one, masked when none is).

  Args:
    inner: the optimizer to delay. It receives the ``staleness`` (int32, or
      a per-leaf pytree) and ``stale_params`` extra arguments (plain Optax
      optimizers ignore them) and any other extra arguments given to
      ``update``. Its state sits in ``DelayedState.inner_state``, so
      ``dj.read_params`` finds a look-ahead hook inside it.
    delays: a model from ``delayjax.delays``, or a ``dj.cluster.Schedule``
      to replay (not ``dj.delays.torn``, a read model of ``dj.simulate``).
    seed: seed of the delay draws; the same seed gives the same delays
      (unused with a ``Schedule``, which is deterministic).
    store_stale_params: keep a ring of parameter copies to pass
      ``stale_params``; turn it off to save ``max_delay + 1`` copies of the
      parameters when ``inner`` does not use them (then ``stale_params`` is
      not passed). A ``Schedule`` replay always keeps them.

  Returns:
    An ``optax.GradientTransformationExtraArgs``; ``update`` needs
    ``params``, and gradients with their tree and shapes (else a
    ``ValueError`` naming ``grads`` and both). ``init`` sizes the state from
    the shapes before allocating it and refuses one that would not fit in
    the default device's free memory (the host's available memory on a CPU),
    naming the delay, the bytes needed and the bytes available.

  Examples:
    >>> import jax.numpy as jnp, optax
    >>> import delayjax as dj
    >>> tx = dj.delayed(optax.sgd(1.0), dj.delays.constant(1))
    >>> params = jnp.array([0.0])
    >>> state = tx.init(params)
    >>> u0, state = tx.update(jnp.array([1.0]), state, params)  # nothing due yet
    >>> u1, state = tx.update(jnp.array([2.0]), state, params)  # applies call 0's gradient
    >>> print(u0, u1)
    [0.] [-1.]

  References:
    Dai, Zhou, Dai, Ho, Xing, `Toward Understanding the Impact of Staleness in
    Distributed Machine Learning <https://arxiv.org/abs/1810.03264>`_, ICLR 2019.
  """
  if not isinstance(inner, optax.GradientTransformation):
    raise TypeError(f"inner must be an optax.GradientTransformation, got {type(inner).__name__}.")
  seed = check_seed("seed", seed)
  store_stale_params = check_bool("store_stale_params", store_stale_params)
  if isinstance(delays, Schedule):
    return _replayed(inner, delays)
  model = delays_lib.check_model("delays", delays)
  if isinstance(model, delays_lib.Torn):
    raise ValueError(
        f"delays={model!r} is a torn read model: it says which version each coordinate of a *read* comes from, "
        f"and dj.delayed realizes delays on the apply side (the loop computes every gradient at the current "
        f"parameters). Use it as dj.simulate's source.")
  setup = _Setup(inner=optax.with_extra_args_support(inner), model=model, seed=seed,
                 store_stale_params=store_stale_params)
  return optax.GradientTransformationExtraArgs(functools.partial(_init, setup), functools.partial(_update, setup))


def _replayed(inner: optax.GradientTransformation, schedule: Schedule) -> optax.GradientTransformationExtraArgs:
  """:func:`delayed` replaying a cluster ``Schedule`` (see ``delayjax.runtime._replay``)."""
  replayed = replay(optax.with_extra_args_support(inner), schedule)

  def replay_update(updates, state, params=None, **extra_args):
    _check_grads(updates, params)
    return replayed.update(updates, state, params, **extra_args)

  return optax.GradientTransformationExtraArgs(replayed.init, replay_update)


@dataclasses.dataclass(frozen=True)
class _Setup:
  """What :func:`delayed` fixes when it is called: the inner optimizer, the delay model and the ring sizes."""

  inner: optax.GradientTransformationExtraArgs
  model: delays_lib.DelayModel
  seed: int
  store_stale_params: bool

  @property
  def num_slots(self) -> int:
    return self.model.max_delay + 1

  @property
  def num_steps(self) -> int:
    """Inner updates traced per call: one with a constant delay, else up to one per slot (a ``fori_loop``)."""
    return 1 if self.model.is_constant else self.num_slots

  @property
  def per_leaf(self) -> bool:
    return isinstance(self.model, delays_lib.PerLeaf)

  @property
  def synchronous(self) -> bool:
    # Zero delay buffers nothing: call inner directly, so the result is inner's own arithmetic.
    return self.model.max_delay == 0


def _init(setup: _Setup, params: Any) -> DelayedState:
  delays_lib.leaf_models(setup.model, params)  # a per-leaf tree that does not fit params fails here
  _check_init_memory(setup.model, params, setup.inner, setup.num_slots, setup.per_leaf, setup.synchronous,
                     setup.store_stale_params)
  num_slots = setup.num_slots
  no_delay = jnp.zeros((num_slots,), jnp.int32)
  ring = lambda: jax.tree.map(lambda p: stacked_zeros(p, num_slots), params)
  return DelayedState(
      count=jnp.zeros([], jnp.int32),
      key=jax.random.PRNGKey(setup.seed),
      issued=jnp.full((num_slots,), -1, jnp.int32),
      delay=jax.tree.map(lambda _: no_delay, params) if setup.per_leaf else no_delay,
      worker=jnp.full((num_slots,), -1, jnp.int32),
      grads=() if setup.synchronous else ring(),
      stale_params=ring() if setup.store_stale_params and not setup.synchronous else (),
      inner_state=setup.inner.init(params),
  )


def _check_worker(setup: _Setup, worker: Any) -> jax.Array | None:
  """The ``worker`` given to ``update`` as an int32 scalar (``None`` if not given), or a TypeError / ValueError."""
  if worker is None:
    return None
  if (isinstance(worker, (str, bytes, bool)) or jnp.ndim(worker) != 0
      or not jnp.issubdtype(jnp.result_type(worker), jnp.integer)):
    raise TypeError(f"worker (an extra argument of dj.delayed's update) must be an integer scalar, the index of the "
                    f"worker that computed the gradient; got {worker!r}.")
  if setup.per_leaf and not setup.synchronous:
    raise ValueError(
        f"dj.delayed with per-leaf delays ({setup.model!r}) cannot carry worker: at one inner step each leaf "
        f"applies the gradient of another call, so no one worker computed the gradients inner is given. Use one "
        f"delay model for every leaf, or do not pass worker.")
  return jnp.asarray(worker, jnp.int32)


def _update(setup: _Setup, updates: Any, state: DelayedState, params: Any = None, **extra_args):
  _check_grads(updates, params)
  check_update_call(updates, params, extra_args, _COMPUTED)
  worker = _check_worker(setup, extra_args.pop("worker", None))
  if setup.synchronous:
    return _update_now(setup, updates, state, params, worker, extra_args)
  t = state.count
  slot = t % setup.num_slots
  write = lambda ring, x: ring.at[slot].set(jnp.asarray(x, ring.dtype))
  d = delays_lib.sample_for(setup.model, jax.random.fold_in(state.key, t), t, params)
  written = state._replace(
      count=t + 1,
      issued=state.issued.at[slot].set(t),
      delay=jax.tree.map(write, state.delay, d),
      worker=state.worker.at[slot].set(jnp.int32(-1) if worker is None else worker),
      grads=jax.tree.map(write, state.grads, updates),
      stale_params=jax.tree.map(write, state.stale_params, params) if setup.store_stale_params else ())
  plan = _release_plan(setup, written, t, params)
  inner_state, total = _apply_released(setup, written, plan, params, worker, extra_args)
  return total, written._replace(inner_state=inner_state)


def _update_now(setup: _Setup, updates: Any, state: DelayedState, params: Any, worker: jax.Array | None,
                extra_args: dict[str, Any]):
  """A call with no delay: ``inner`` on this call's gradient, staleness 0 and the current parameters."""
  zero = jnp.zeros([], jnp.int32)
  kwargs = dict(extra_args, staleness=jax.tree.map(lambda _: zero, params) if setup.per_leaf else zero)
  if setup.store_stale_params:
    kwargs["stale_params"] = params
  if worker is not None:
    kwargs["worker"] = worker
  u, inner_state = setup.inner.update(updates, state.inner_state, params, **kwargs)
  return u, state._replace(count=state.count + 1, inner_state=inner_state)


class _ReleasePlan(NamedTuple):
  """Which slot each leaf takes at each inner step of a call, and which steps are live."""

  orders: Any  # pytree like params of int32 [num_steps]: the slot of step k
  actives: Any  # pytree like params of bool [num_steps]: whether the leaf has a release at step k
  any_active: jax.Array  # bool [num_steps]: whether any leaf has one (the step updates inner's state)
  order: jax.Array | None  # int32 [num_steps]: the shared slot order (one delay for all leaves), else None


def _release_plan(setup: _Setup, state: DelayedState, t: jax.Array, params: Any) -> _ReleasePlan:
  if setup.per_leaf:
    plans = [_release_order(state.issued, dl, t, setup.num_steps) for dl in jax.tree.leaves(state.delay)]
    treedef = jax.tree.structure(state.delay)
    orders = jax.tree.unflatten(treedef, [p[0] for p in plans])
    actives = jax.tree.unflatten(treedef, [p[1] for p in plans])
    any_active = jnp.any(jnp.stack([p[1] for p in plans]), axis=0)
    return _ReleasePlan(orders, actives, any_active, None)
  order, any_active = _release_order(state.issued, state.delay, t, setup.num_steps)
  return _ReleasePlan(jax.tree.map(lambda _: order, params), jax.tree.map(lambda _: any_active, params),
                      any_active, order)


def _pick(ring, o, a, k, otherwise):
  """Row ``o[k]`` of ``ring`` where step ``k`` is live (``a[k]``), else ``otherwise``."""
  return jnp.where(a[k], ring[o[k]], otherwise)


def _apply_released(setup: _Setup, state: DelayedState, plan: _ReleasePlan, params: Any, worker: jax.Array | None,
                    extra_args: dict[str, Any]):
  """Applies the gradients released at this call through ``inner``, in issue order: (inner state, summed update)."""
  inner = setup.inner

  def step(inner_state, current, k):
    g = jax.tree.map(lambda r, o, a: _pick(r, o, a, k, jnp.zeros_like(r[0])), state.grads, plan.orders,
                     plan.actives)
    if setup.per_leaf:
      tau = jax.tree.map(lambda dl, o, a: _pick(dl, o, a, k, jnp.int32(0)), state.delay, plan.orders,
                         plan.actives)
    else:
      tau = _pick(state.delay, plan.order, plan.any_active, k, jnp.int32(0))
    kwargs = dict(extra_args, staleness=tau)
    if setup.store_stale_params:
      kwargs["stale_params"] = jax.tree.map(
          lambda r, o, a, w: _pick(r, o, a, k, w), state.stale_params, plan.orders, plan.actives, current)
    if worker is not None:
      # The worker that computed the gradient; one given without a worker takes this call's.
      computed_by = _pick(state.worker, plan.order, plan.any_active, k, worker)
      kwargs["worker"] = jnp.where(computed_by < 0, worker, computed_by)
    u, new_state = inner.update(g, inner_state, current, **kwargs)
    new_state = _masked(plan.any_active[k], new_state, inner_state)
    u = jax.tree.map(lambda x: jnp.where(plan.any_active[k], x, jnp.zeros_like(x)), u)
    return new_state, u

  inner_state, total = step(state.inner_state, params, 0)
  if setup.num_steps > 1:
    def body(k, carry):
      inner_state, current, total = carry
      inner_state, u = step(inner_state, current, k)
      return inner_state, optax.apply_updates(current, u), jax.tree.map(jnp.add, total, u)

    # Loop only over the gradients actually released: about one per call on average, so the
    # cost does not grow with max_delay (under vmap the loop runs to the batch's maximum, masked).
    num_released = jnp.sum(plan.any_active, dtype=jnp.int32)
    carry = (inner_state, optax.apply_updates(params, total), total)
    inner_state, _, total = jax.lax.fori_loop(1, num_released, body, carry)
  return inner_state, total
