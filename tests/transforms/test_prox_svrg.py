"""Async-ProxSVRG, Async-ProxSVRCD (Meng et al.) and the parameter-server SVRG of Zhang, Zheng & Kwok under stale
reads in dj.simulate, against float64 NumPy re-implementations of the papers' loops; and their bad inputs."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import delayjax as dj

N, D, WORKERS, TAU, EPOCH, BATCH, SEED = 48, 6, 4, 3, 16, 2, 7
ETA, LAM = 0.05, 0.2


def _problem():
  rng = np.random.default_rng(3)
  x = rng.standard_normal((N, D))
  y = x @ np.array([1.5, -2.0, 0.0, 0.0, 0.7, 0.0]) + 0.1 * rng.standard_normal(N)
  return x, y


def _schedule(num_updates):
  """Round-robin workers (update t from worker t mod W), each read d_t <= TAU versions back, never before the
  snapshot of its epoch (the stage barrier): version t - min(d_t, t mod EPOCH)."""
  t = np.arange(num_updates)
  d = np.random.default_rng(11).integers(0, TAU + 1, num_updates)
  contributes = np.zeros((num_updates, WORKERS), bool)
  read = np.full((num_updates, WORKERS), -1, np.int64)
  contributes[t, t % WORKERS] = True
  read[t, t % WORKERS] = t - np.minimum(d, t % EPOCH)
  return dj.cluster.Schedule(time=t.astype(np.float64), contributes=contributes, read_version=read,
                             wait=np.zeros(WORKERS), paradigm="stale reads with a barrier per epoch")


def _picks(num_updates, scheme):
  """The minibatch of each update, as dj.Sampling draws it (worker t mod W, its (t div W)-th draw)."""
  shards = np.array_split(np.arange(N), WORKERS)
  rows = []
  for t in range(num_updates):
    m = t % WORKERS
    kw = dict(sampling="shard", shard=jnp.asarray(shards[m], jnp.int32), shard_size=len(shards[m])) \
        if scheme == "shard" else {}
    rows.append(np.asarray(dj.runtime.minibatch_indices(SEED, t, m, t // WORKERS, num_examples=N,
                                                        batch_size=BATCH, **kw)))
  return rows


def _soft(z, step):
  return np.sign(z) * np.maximum(np.abs(z) - step * LAM, 0.0)


def reference(method, num_updates, scheme="iid", blocks=None):
  """The papers' loops, sequentially in float64 NumPy: each stage (EPOCH updates) takes the snapshot (the last
  iterate) and the full gradient there; update t reads its stale version, forms the minibatch's variance-reduced
  gradient and the server steps with the constant rate: plain (Zhang-Zheng-Kwok), then the l1 prox of the whole
  vector (Async-ProxSVRG), or of block ``blocks[t]`` only (Async-ProxSVRCD; the blocks are D//2-coordinate halves)."""
  x, y = _problem()
  picks = _picks(num_updates, scheme)
  reads = _schedule(num_updates).read_version.max(axis=1)
  versions = [np.zeros(D)]
  for t in range(num_updates):
    w = versions[-1]
    if t % EPOCH == 0:
      snap, mu = w, x.T @ (x @ w - y) / N
    xb, yb = x[picks[t]], y[picks[t]]
    w_read = versions[reads[t]]
    v = xb.T @ (xb @ w_read - yb) / BATCH - xb.T @ (xb @ snap - yb) / BATCH + mu
    if method == "zzk":
      new = w - ETA * v
    elif method == "prox_svrg":
      new = _soft(w - ETA * v, ETA)
    else:
      part = slice(0, D // 2) if blocks[t] == 0 else slice(D // 2, D)
      new = w.copy()
      new[part] = _soft(w[part] - ETA * v[part], ETA)
    versions.append(new)
  return versions[-1]


def _simulate(tx, params, loss_fn, scheme="iid", num_updates=3 * EPOCH):
  x, y = _problem()
  sampling = dj.Sampling(batch_size=BATCH, scheme=scheme)
  result = dj.simulate(loss_fn, tx, params, {"x": jnp.asarray(x), "y": jnp.asarray(y)}, _schedule(num_updates),
                       seed=SEED, sampling=sampling, worker=dj.workers.Gradient(snapshot_every=EPOCH))
  return result.params


def _vector_loss(w, batch):
  return 0.5 * jnp.mean((batch["x"] @ w - batch["y"]) ** 2)


def _block_loss(params, batch):
  return _vector_loss(jnp.concatenate([params["a"], params["b"]]), batch)


def test_parameter_server_svrg_of_zhang_zheng_kwok_is_svrg_with_shards_and_a_stage_barrier():
  with jax.enable_x64(True):
    got = _simulate(optax.chain(dj.svrg(), optax.sgd(ETA)), jnp.zeros(D, jnp.float64), _vector_loss, "shard")
  want = reference("zzk", 3 * EPOCH, scheme="shard")
  np.testing.assert_allclose(np.asarray(got), want, rtol=1e-10, atol=1e-12)
  # The shards are seen: every worker's minibatches come from its own quarter of the data.
  picks = _picks(3 * EPOCH, "shard")
  assert all(np.all(p // (N // WORKERS) == t % WORKERS) for t, p in enumerate(picks))
  assert np.linalg.norm(want) > 1.0  # the run went somewhere


def test_async_prox_svrg_is_the_numpy_loop_and_sparse():
  with jax.enable_x64(True):
    got = _simulate(dj.prox_svrg(dj.prox_l1(LAM), ETA), jnp.zeros(D, jnp.float64), _vector_loss)
  want = reference("prox_svrg", 3 * EPOCH)
  np.testing.assert_allclose(np.asarray(got), want, rtol=1e-10, atol=1e-12)
  assert np.any(want == 0.0) and np.linalg.norm(want) > 1.0  # the prox acted, and the run went somewhere


@pytest.mark.parametrize("selection", ["random", "cyclic"])
def test_async_prox_svrcd_is_the_numpy_loop(selection):
  updates = 3 * EPOCH
  blocks = [int(dj.transforms.block_index(jnp.int32(t), 2, selection, SEED)) for t in range(updates)]
  assert 0 < sum(blocks) < updates  # both blocks are drawn
  with jax.enable_x64(True):
    params = {"a": jnp.zeros(D // 2, jnp.float64), "b": jnp.zeros(D - D // 2, jnp.float64)}
    got = _simulate(dj.prox_svrcd(dj.prox_l1(LAM), ETA, selection=selection, seed=SEED), params, _block_loss)
  want = reference("prox_svrcd", updates, blocks=blocks)
  np.testing.assert_allclose(np.concatenate([got["a"], got["b"]]), want, rtol=1e-10, atol=1e-12)


def test_the_recipes_are_their_compositions_bit_for_bit():
  w = {"a": jnp.array([1.0, -0.2]), "b": jnp.array([0.3])}
  g = jax.tree.map(lambda p: jnp.sin(3 * p) + 0.5, w)
  kw = dict(snapshot_grad=jax.tree.map(lambda p: 0.5 * p, w), full_grad=jax.tree.map(jnp.cos, w))
  pairs = [(dj.prox_svrg(dj.prox_l1(0.2), 0.1),
            optax.chain(dj.svrg(), optax.sgd(0.1), dj.proximal(dj.prox_l1(0.2), 0.1))),
           (dj.prox_svrcd(dj.prox_l1(0.2), 0.1, seed=3),
            optax.chain(dj.svrg(), dj.block_coordinate(0.1, dj.prox_l1(0.2), seed=3)))]
  for recipe, composed in pairs:
    s1, s2 = recipe.init(w), composed.init(w)
    for step in range(3):
      u1, s1 = recipe.update(g, s1, w, **kw) if step == 0 else recipe.update(g, s1, w, snapshot_grad=g)
      u2, s2 = composed.update(g, s2, w, **kw) if step == 0 else composed.update(g, s2, w, snapshot_grad=g)
      jax.tree.map(np.testing.assert_array_equal, u1, u2)
      w = optax.apply_updates(w, u1)


@pytest.mark.parametrize("make, error, match", [
    (lambda: dj.prox_svrg("l1", 0.1), TypeError, r"prox_svrg: prox must be a callable .* got str 'l1'"),
    (lambda: dj.prox_svrg(dj.prox_l1(0.1), 0.0), ValueError, "learning_rate"),
    (lambda: dj.prox_svrg(dj.prox_l1(0.1), -1.0), ValueError, "learning_rate"),
    (lambda: dj.prox_svrcd(None, 0.1), TypeError, r"prox_svrcd: prox must be a callable .* got NoneType None"),
    (lambda: dj.prox_svrcd(dj.prox_l1(0.1), 0.0), ValueError, "learning_rate"),
    (lambda: dj.prox_svrcd(dj.prox_l1(0.1), 0.1, selection="greedy"), ValueError, "selection.*greedy"),
    (lambda: dj.prox_svrcd(dj.prox_l1(0.1), 0.1, seed=-1), ValueError, "seed"),
])
def test_bad_arguments_name_the_argument_and_what_is_allowed(make, error, match):
  with pytest.raises(error, match=match):
    make()
