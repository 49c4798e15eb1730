"""A slow, obviously correct reference for ``dj.simulate``, and the small problems its tests use.

The reference follows the schedule one update at a time, keeps every version's
parameters and optimizer state, computes each contribution's gradient at the
parameters its worker read (``read_params`` of that version's state), draws
the same minibatches through ``minibatch_indices``, and applies the updates
with the extra arguments ``simulate`` documents. Local-SGD workers run their
local steps one by one in a Python loop; server inputs are computed at each
version's parameters on ``server_minibatch_indices``. Variance reduction:
the SVRG snapshot of update ``u`` is the version at which ``u``'s epoch began
(``snapshot_every``), the full gradient is taken over the whole data there,
and a snapshot that an update left out could not take is taken by the next
applied one; SAGA is given exactly the examples of the kept contributions
(no padding), with their per-example gradients.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax

import delayjax as dj
from delayjax.runtime._sampling import minibatch_indices, server_minibatch_indices, shard_table


def assert_trees_close(a, b, **tol):
  """Leaf by leaf ``np.testing.assert_allclose`` of two pytrees of the same structure."""
  for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
    np.testing.assert_allclose(np.asarray(x), np.asarray(y), **tol)


def round_robin_stale_reads(updates: int, tau: int, seed: int) -> tuple[dj.cluster.Schedule, np.ndarray]:
  """A stale-read schedule and its delays: update ``t`` by worker ``t mod (tau + 1)``, read at version ``t - d_t``,
  ``d_t`` uniform on ``{0..tau}`` (NumPy, ``seed``) and at most ``t``."""
  workers = tau + 1
  t = np.arange(updates)
  delays = np.minimum(np.random.default_rng(seed).integers(0, tau + 1, updates), t)
  contributes = np.zeros((updates, workers), bool)
  read_version = np.full((updates, workers), -1, np.int64)
  contributes[t, t % workers] = True
  read_version[t, t % workers] = t - delays
  return dj.cluster.Schedule(time=t.astype(np.float64), contributes=contributes, read_version=read_version,
                             wait=np.zeros(workers), paradigm="round-robin stale reads"), delays


def regression_problem(num_examples: int = 48, dim: int = 3, seed: int = 0):
  """A tiny linear regression: data, a loss, initial parameters (two leaves)."""
  rng = np.random.default_rng(seed)
  x = rng.standard_normal((num_examples, dim)).astype(np.float32)
  y = (x @ np.arange(1, dim + 1, dtype=np.float32) + 0.5).astype(np.float32)

  def loss_fn(params, batch):
    pred = batch["x"] @ params["w"] + params["b"]
    return jnp.mean((pred - batch["y"]) ** 2)

  params = {"w": jnp.zeros((dim,), jnp.float32), "b": jnp.zeros((), jnp.float32)}
  return {"x": x, "y": y}, loss_fn, params


def numpy_per_contribution(data, schedule, push, *, lr, batch_size, seed):
  """The server loop of a per-contribution rule on :func:`regression_problem`, in float64 NumPy.

  For each update, the contributions in the runtime's order (the stalest read first, then the lowest worker):
  worker ``m``'s mean gradient over its ``num_batches`` minibatches (drawn through ``minibatch_indices``) at the
  version ``w_read`` it read, turned into its push by ``push(m, g, w, w_read)`` (which keeps whatever per-worker
  state the rule has), averaged with the ``num_batches`` weights and applied as ``w - lr * step``. Returns the final
  parameters, ``w`` then ``b`` in one vector.
  """
  x, y = data["x"].astype(np.float64), data["y"].astype(np.float64)
  n, dim = x.shape
  versions = [np.zeros(dim + 1)]
  drawn = np.zeros(schedule.num_workers, np.int64)  # minibatches each worker drew so far

  def gradient(w, u, m):
    grads = []
    for _ in range(schedule.num_batches[u, m]):
      idx = np.asarray(minibatch_indices(seed, u, int(m), int(drawn[m]), num_examples=n, batch_size=batch_size))
      drawn[m] += 1
      err = x[idx] @ w[:dim] + w[dim] - y[idx]
      grads.append(np.concatenate([2 * x[idx].T @ err / batch_size, [2 * err.mean()]]))
    return np.mean(grads, axis=0)

  for u in range(schedule.num_updates):
    w = versions[-1]
    workers = np.flatnonzero(schedule.contributes[u])
    reads = schedule.read_version[u, workers]
    order = np.lexsort((workers, reads))
    weights = schedule.num_batches[u, workers][order].astype(np.float64)
    weights /= weights.sum()
    step = np.zeros_like(w)
    for k, j in enumerate(order):
      m, w_read = workers[j], versions[reads[j]]
      step += weights[k] * push(m, gradient(w_read, u, m), w, w_read)
    versions.append(w - lr * step)
  return versions[-1]


class ProbeState(NamedTuple):
  count: jax.Array  # int32 (): updates applied
  last: Any  # like params: the last update, which the read hook looks ahead by
  per_worker: jax.Array  # int32 [M]: updates credited to each worker
  staleness_sum: jax.Array  # int32 (): sum of staleness seen

  def read_params(self, params, worker):
    # A DANA-like look-ahead that depends on the state and on the worker, so a
    # runtime that reads raw parameters, or the wrong version, is caught.
    scale = 0.5 + 0.25 * worker.astype(jnp.float32) / 8.0
    return jax.tree.map(lambda p, d: p + scale * d, params, self.last)


def probe(learning_rate: float, num_workers: int):
  """Uses every extra argument: ``-lr / (1 + staleness) * g + 0.1 (stale_params - params)``."""

  def init_fn(params):
    return ProbeState(jnp.zeros((), jnp.int32), jax.tree.map(jnp.zeros_like, params),
                      jnp.zeros((num_workers,), jnp.int32), jnp.zeros((), jnp.int32))

  def update_fn(grads, state, params, *, staleness, stale_params, worker, **extra):
    del extra
    scale = learning_rate / (1.0 + staleness.astype(jnp.float32))
    updates = jax.tree.map(lambda g, p, s: -scale * g + 0.1 * (s - p), grads, params, stale_params)
    return updates, ProbeState(state.count + 1, updates, state.per_worker.at[worker].add(1),
                               state.staleness_sum + staleness)

  return optax.GradientTransformationExtraArgs(init_fn, update_fn)


def reference(loss_fn, tx, params, data, schedule: dj.cluster.Schedule, *, batch_size: int,
              sampling: str = "iid", seed: int = 0, skip_nonfinite: bool = False, shards=None,
              has_aux: bool = False, local_steps=None, local_optimizer=None, snapshot_every=None,
              sample_terms=None, group_versions=None, leaf_groups=None, keep_local_state=False):
  """Returns (params, opt_state, losses [U], nonfinite [(u, m)], versions).

  ``local_steps``: ``None`` or one int per worker, with ``local_optimizer``;
  ``keep_local_state``: each worker's local optimizer continues from the
  state its previous contribution ended with (first: the initial params').
  ``group_versions`` ``[U, M, G]`` and ``leaf_groups`` (one group per
  parameter leaf): per-leaf reads, each leaf from its group's version; the
  staleness passed is then a pytree, one per leaf.
  """
  tx = optax.with_extra_args_support(tx)
  num_examples = jax.tree.leaves(data)[0].shape[0]
  num_updates, num_workers = schedule.contributes.shape
  rows, sizes = (shard_table(shards, num_examples, num_workers, num_workers) if sampling == "shard"
                 else (np.zeros((num_workers, 1), np.int32), np.ones(num_workers, np.int32)))
  value_and_grad = jax.jit(jax.value_and_grad(loss_fn, has_aux=has_aux))
  update = jax.jit(lambda g, s, p, tau, sp, m, extra: tx.update(g, s, p, staleness=tau, stale_params=sp,
                                                                 worker=m, **extra))
  reads = jax.jit(dj.read_params)
  versions = [(params, tx.init(params))]
  inputs = dj.runtime_inputs(versions[0][1])
  assert set(inputs) <= {"zeno_grad", "full_grad", "snapshot_grad", "sample_grads", "sample_indices",
                         "sample_mask", "sample_scalars", "sample_features"}, inputs
  grad_fn = jax.jit(jax.grad(loss_fn, has_aux=has_aux))

  def grad_at(w, batch):
    out = grad_fn(w, batch)
    return out[0] if has_aux else out

  if "full_grad" in inputs:
    epoch = snapshot_every or -(-2 * num_examples // batch_size)
  snapshot_due = False
  if local_steps is not None:
    local_optimizer = optax.with_extra_args_support(local_optimizer)
    local_update = jax.jit(local_optimizer.update)
    worker_states = [local_optimizer.init(params) for _ in range(num_workers)]
  drawn = np.zeros(num_workers, np.int64)
  losses, nonfinite = [], []
  for u in range(num_updates):
    w_u, s_u = versions[u]
    contributions = []
    for m in range(num_workers):
      if not schedule.contributes[u, m]:
        continue
      v = int(schedule.read_version[u, m])
      w_v, s_v = versions[v]
      w_read = reads(s_v, w_v, jnp.int32(m))
      tau = u - v
      if group_versions is not None:
        group_reads = [jax.tree.leaves(reads(versions[g][1], versions[g][0], jnp.int32(m)))
                       for g in group_versions[u, m]]
        w_read = jax.tree.unflatten(jax.tree.structure(w_v),
                                    [group_reads[g][i] for i, g in enumerate(leaf_groups)])
        tau = jax.tree.unflatten(jax.tree.structure(w_v),
                                 [jnp.int32(u - group_versions[u, m, g]) for g in leaf_groups])
      nb = int(schedule.num_batches[u, m])

      def mean_gradient(w, first_draw):
        grads, batch_losses = [], []
        for b in range(nb):
          idx = minibatch_indices(seed, u, m, first_draw + b, num_examples=num_examples,
                                  batch_size=batch_size, sampling=sampling, shard=rows[m],
                                  shard_size=sizes[m])
          out, g = value_and_grad(w, jax.tree.map(lambda x: jnp.asarray(x)[idx], data))
          batch_losses.append(out[0] if has_aux else out)
          grads.append(g)
          samples.extend(np.asarray(idx).tolist())
        return sum(batch_losses) / nb, jax.tree.map(lambda *gs: sum(gs[1:], gs[0]) / jnp.float32(nb), *grads)

      def mean_gradient_at(w, first_draw):
        # The same minibatches as mean_gradient's, at other parameters.
        grads = []
        for b in range(nb):
          idx = minibatch_indices(seed, u, m, first_draw + b, num_examples=num_examples,
                                  batch_size=batch_size, sampling=sampling, shard=rows[m],
                                  shard_size=sizes[m])
          grads.append(grad_at(w, jax.tree.map(lambda x: jnp.asarray(x)[idx], data)))
        return jax.tree.map(lambda *gs: sum(gs[1:], gs[0]) / jnp.float32(nb), *grads)

      samples = []
      extras = {}

      if local_steps is None:
        loss, g = mean_gradient(w_read, drawn[m])
        if "snapshot_grad" in inputs:
          extras["snapshot_grad"] = mean_gradient_at(versions[u - u % epoch][0], drawn[m])
        if "sample_indices" in inputs:
          extras["samples"] = samples
        if "sample_grads" in inputs:
          extras["sample_grads"] = [grad_at(w_read, jax.tree.map(lambda x: jnp.asarray(x)[i:i + 1], data))
                                    for i in samples]
        if "sample_scalars" in inputs:
          terms = [sample_terms(w_read, jax.tree.map(lambda x: jnp.asarray(x)[i:i + 1], data)) for i in samples]
          extras["sample_scalars"] = [t[0][0] for t in terms]
          extras["sample_features"] = [jax.tree.map(lambda a: a[0], t[1]) for t in terms]
        drawn[m] += nb
      else:
        # H local steps from the read parameters; the push is minus the sum of the local updates.
        state = worker_states[m] if keep_local_state else local_optimizer.init(w_read)
        w, total = w_read, jax.tree.map(jnp.zeros_like, w_read)
        for h in range(int(local_steps[m])):
          step_loss, step_grad = mean_gradient(w, drawn[m])
          drawn[m] += nb
          loss = step_loss if h == 0 else loss
          delta, state = local_update(step_grad, state, w)
          w = optax.apply_updates(w, delta)
          total = jax.tree.map(lambda t, d: t + d, total, delta)
        g = jax.tree.map(lambda t: -t, total)
        worker_states[m] = state
      finite = all(bool(jnp.all(jnp.isfinite(x))) for x in jax.tree.leaves(g))
      if not finite:
        nonfinite.append((u, m))
      contributions.append(dict(m=m, tau=tau, nb=nb, g=g, loss=loss, w_read=w_read, finite=finite, **extras))
    total = sum(c["nb"] for c in contributions)
    losses.append(sum(np.float32(c["nb"] / total) * np.float32(c["loss"]) for c in contributions))
    kept = [c for c in contributions if c["finite"] or not skip_nonfinite]
    refresh = "full_grad" in inputs and (u % epoch == 0 or snapshot_due)
    if not kept:
      snapshot_due = refresh
      versions.append((w_u, s_u))
      continue
    snapshot_due = False
    kept_total = sum(c["nb"] for c in kept)

    def mean_of(name):
      return jax.tree.map(lambda *gs: sum(gs), *[
          jax.tree.map(lambda x, c=c: (jnp.float32(c["nb"]) / jnp.float32(kept_total)) * x, c[name])
          for c in kept])

    g = mean_of("g")
    stalest_first = sorted(kept, key=lambda c: (-max(int(t) for t in jax.tree.leaves(c["tau"])), c["m"]))
    stalest = stalest_first[0]
    extra = {}
    if "full_grad" in inputs:
      extra["refresh"] = jnp.asarray(refresh)
      extra["full_grad"] = grad_at(w_u, data) if refresh else jax.tree.map(jnp.zeros_like, w_u)
    if "snapshot_grad" in inputs:
      extra["snapshot_grad"] = mean_of("snapshot_grad")
    if "sample_indices" in inputs:
      extra["sample_indices"] = jnp.asarray([i for c in stalest_first for i in c["samples"]], jnp.int32)
    for name in ("sample_grads", "sample_scalars", "sample_features"):
      if name in inputs:
        extra[name] = jax.tree.map(lambda *gs: jnp.stack(gs), *[gi for c in stalest_first for gi in c[name]])
    if "zeno_grad" in inputs:
      idx = server_minibatch_indices(seed, u, num_examples=num_examples, batch_size=batch_size)
      out = grad_fn(w_u, jax.tree.map(lambda x: jnp.asarray(x)[idx], data))
      extra["zeno_grad"] = out[0] if has_aux else out
    updates, s_new = update(g, s_u, w_u, jax.tree.map(jnp.int32, stalest["tau"]), stalest["w_read"],
                            jnp.int32(stalest["m"]), extra)
    versions.append((optax.apply_updates(w_u, updates), s_new))
  params_out, state_out = versions[-1]
  return params_out, state_out, np.asarray(losses, np.float32), nonfinite, versions


def hand_schedule(num_workers: int, num_updates: int, *, group: int = 1, spread: float = 1.0,
                  latency: float = 0.0, max_batches: int = 1, seed: int = 0) -> dj.cluster.Schedule:
  """An event-driven schedule independent of ``dj.cluster``.

  Workers read the current version, compute (random durations, ``spread`` = 0
  for equal speeds), and read again at once; their push reaches the server
  ``latency`` later. The server turns every ``group`` pushes into one update
  (sooner if a worker pushes twice). With ``latency > 0`` workers read before
  their previous push is applied, which needs more than one slot per worker.
  """
  rng = np.random.default_rng(seed)
  events = []  # (time, kind, worker, read_version, batches); kind 0 = arrival, 1 = read
  for m in range(num_workers):
    events.append((0.0, 1, m, 0, 0))
  contributes = np.zeros((num_updates, num_workers), bool)
  read_version = np.full((num_updates, num_workers), -1, np.int64)
  num_batches = np.zeros((num_updates, num_workers), np.int64)
  time = np.zeros(num_updates)
  version, pending = 0, {}

  def flush(t):
    nonlocal version
    for m, (v, nb) in pending.items():
      contributes[version, m], read_version[version, m], num_batches[version, m] = True, v, nb
    time[version] = t
    pending.clear()
    version += 1

  while version < num_updates:
    events.sort()
    t, kind, m, v, nb = events.pop(0)
    if kind == 1:
      nb = int(rng.integers(1, max_batches + 1))
      duration = nb * (1.0 + spread * rng.exponential())
      events.append((t + duration, 1, m, 0, 0))
      events.append((t + duration + latency, 0, m, version, nb))
    else:
      if m in pending:
        flush(t)
        if version >= num_updates:
          break
      pending[m] = (v, nb)
      if len(pending) == group:
        flush(t)
  return dj.cluster.Schedule(time=time, contributes=contributes, read_version=read_version,
                             wait=np.zeros(num_workers), num_batches=num_batches)


def round_robin(num_workers: int, num_updates: int) -> dj.cluster.Schedule:
  """Equal-speed ASP: update ``u`` comes from worker ``u mod M``, read at ``max(0, u - M + 1)``."""
  u = np.arange(num_updates)
  contributes = np.zeros((num_updates, num_workers), bool)
  read_version = np.full((num_updates, num_workers), -1, np.int64)
  contributes[u, u % num_workers] = True
  read_version[u, u % num_workers] = np.maximum(0, u - num_workers + 1)
  return dj.cluster.Schedule(time=u.astype(np.float64), contributes=contributes, read_version=read_version,
                             wait=np.zeros(num_workers))


def multiprocess_case(mesh=None):
  """The run shared by the two-process test and its single-process twin, on ``mesh``."""
  data, loss_fn, params = regression_problem(num_examples=64)
  schedule = hand_schedule(8, 40, spread=1.0, seed=5)
  return loss_fn, probe(0.05, 8), params, data, schedule, dict(
      sampling=dj.Sampling(batch_size=4), seed=3, execution=dj.Execution(mesh=mesh, chunk_size=2))


def killed_case():
  """The run of the kill -9 test: Adam (two moments and a count to restore) on ASP, a checkpoint every chunk.

  About 30 chunks, so that a killed process still has chunks left on a fast machine, where a chunk and
  its save take a few tens of milliseconds and the test waits up to 0.3 s after a chunk before killing.
  """
  data, loss_fn, params = regression_problem()
  schedule = dj.cluster.simulate(dj.cluster.asp(), dj.cluster.workers(4), num_updates=256, seed=0)
  return loss_fn, optax.adam(0.05), params, data, schedule, dict(
      sampling=dj.Sampling(batch_size=8), seed=1, execution=dj.Execution(chunk_size=4))


# Names of the programs compiled so far in this process, by one listener (JAX 0.8 cannot remove one): each
# program JAX's in-memory caches did not serve is lowered to MLIR and then compiled, or read from the
# persistent compilation cache the test session shares (tests/conftest.py), where XLA reports no compile.
COMPILED: list[str] = []
jax.monitoring.register_event_duration_secs_listener(
    lambda event, *_, fun_name=None, **__: COMPILED.append(str(fun_name))
    if event == "/jax/core/compile/jaxpr_to_mlir_module_duration" else None)


def compiled_by(fn: Any) -> tuple[list[str], Any]:
  """The names of the programs compiled (or read from the persistent cache) during ``fn()``, and its result."""
  before = len(COMPILED)
  result = fn()
  return COMPILED[before:], result
