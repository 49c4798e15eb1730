"""Off-policy corrections against hand computation and a NumPy re-implementation of each rule."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import delayjax as dj
from delayjax.transforms._off_policy import m2po_mask


def _softmax(z):
  e = np.exp(z - z.max(axis=-1, keepdims=True))
  return e / e.sum(axis=-1, keepdims=True)


def _logp(logits, states, actions):
  return jax.nn.log_softmax(logits)[states, actions]


def _grad(correction, logits, behaviour, states, actions, advantages, mask=None):
  """The gradient of the learner's loss with respect to a tabular policy's logits [S, A]."""
  blogp = _logp(jnp.asarray(behaviour), states, actions)
  loss = lambda z: dj.policy_gradient_loss(correction, _logp(z, states, actions), blogp, advantages, mask)
  return np.asarray(jax.grad(loss)(jnp.asarray(logits)), np.float64)


def _numpy_grad(weight_fn, logits, behaviour, states, actions, advantages, normalizer):
  """-(1/normalizer) sum_i w_i A_i grad log pi(a_i|s_i), with grad_{z_s} log pi(a|s) = e_a - pi(.|s)."""
  pi, mu = _softmax(np.asarray(logits, np.float64)), _softmax(np.asarray(behaviour, np.float64))
  ratio = pi[states, actions] / mu[states, actions]
  w = weight_fn(ratio, np.asarray(advantages, np.float64))
  g = np.zeros_like(pi)
  for i, (s, a) in enumerate(zip(states, actions)):
    g[s] -= w[i] * advantages[i] * (np.eye(pi.shape[1])[a] - pi[s])
  return g / normalizer


def test_importance_weighted_step_on_a_two_action_bandit_by_hand():
  # Current policy logits (0.3, -0.2), behaviour policy uniform; three samples, advantage r - mean(r).
  theta = np.array([[0.3, -0.2]])
  p0 = np.exp(0.3) / (np.exp(0.3) + np.exp(-0.2))
  pi = np.array([p0, 1 - p0])
  actions, rewards = np.array([0, 1, 0]), np.array([1.0, 0.0, 1.0])
  adv = rewards - rewards.mean()  # (1/3, -2/3, 1/3)
  # grad of E[r] estimate: mean_i (pi(a_i) / 0.5) A_i (e_{a_i} - pi); the loss is its negative.
  by_hand = -np.mean([(pi[a] / 0.5) * A * (np.eye(2)[a] - pi) for a, A in zip(actions, adv)], axis=0)
  got = _grad(dj.importance_weighting(), theta, np.zeros((1, 2)), jnp.zeros(3, jnp.int32),
              jnp.asarray(actions, jnp.int32), jnp.asarray(adv, jnp.float32))
  np.testing.assert_allclose(got[0], by_hand, rtol=1e-6)
  # One SGD step of size 1 moves the logits by minus that gradient: action 0 (rewarded twice) gains.
  assert by_hand[0] < 0 < by_hand[1]


def _batch(seed, states=3, actions=4, size=32, drift=0.7):
  rng = np.random.default_rng(seed)
  behaviour = rng.normal(size=(states, actions))
  logits = behaviour + drift * rng.normal(size=(states, actions))
  s = rng.integers(0, states, size)
  mu = _softmax(behaviour)
  a = np.array([rng.choice(actions, p=mu[k]) for k in s])
  adv = rng.normal(size=size)
  return logits, behaviour, s, a, adv


def _ppo_weight(eps):
  def w(r, A):
    # d/dtheta min(rA, clip(r)A) = r A grad log pi where the unclipped term is the minimum, else 0.
    active = np.where(A >= 0, r <= 1 + eps, r >= 1 - eps)
    return np.where(active, r, 0.0)
  return w


def _numpy_m2po_keep(log_ratio, tau):
  q = log_ratio ** 2
  keep = np.ones(q.size, bool)
  while q[keep].mean() > tau and keep.sum() > 1:
    largest = np.flatnonzero(keep)[np.argmax(q[keep])]
    keep[largest] = False
  return keep


@pytest.mark.fast_compile
@pytest.mark.parametrize("name", ["none", "is", "tis", "ppo", "m2po"])
@pytest.mark.parametrize("seed", [0])
def test_correction_gradients_match_numpy(name, seed):
  logits, behaviour, s, a, adv = _batch(seed)
  size = adv.size
  if name == "m2po":
    log_ratio = (np.log(_softmax(logits)[s, a]) - np.log(_softmax(behaviour)[s, a]))
    keep = _numpy_m2po_keep(log_ratio, 0.04)
    assert 0 < keep.sum() < size  # the batch is stale enough for the mask to act
  rules = {
      "none": (dj.no_correction(), lambda r, A: np.ones_like(r)),
      "is": (dj.importance_weighting(), lambda r, A: r),
      "tis": (dj.truncated_is(1.5), lambda r, A: np.minimum(r, 1.5)),
      "ppo": (dj.ppo_clip(0.2), _ppo_weight(0.2)),
      "m2po": (dj.m2po(0.04), lambda r, A: np.where(keep, r, 0.0)),
  }
  correction, weight = rules[name]
  got = _grad(correction, logits, behaviour, jnp.asarray(s), jnp.asarray(a), jnp.asarray(adv, jnp.float32))
  want = _numpy_grad(weight, logits, behaviour, s, a, adv, size)
  np.testing.assert_allclose(got, want, rtol=2e-5, atol=1e-7)


def test_at_zero_staleness_every_correction_is_the_on_policy_gradient():
  logits, _, s, a, adv = _batch(3)
  want = _grad(dj.no_correction(), logits, logits, jnp.asarray(s), jnp.asarray(a), jnp.asarray(adv, jnp.float32))
  for c in (dj.importance_weighting(), dj.truncated_is(1.0), dj.ppo_clip(0.1), dj.m2po(0.04)):
    got = _grad(c, logits, logits, jnp.asarray(s), jnp.asarray(a), jnp.asarray(adv, jnp.float32))
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-8)


def test_discard_stale_drops_samples_and_averages_over_the_kept():
  logits, behaviour, s, a, adv = _batch(4)
  staleness = np.random.default_rng(0).integers(0, 6, adv.size)
  mask = dj.discard_stale(jnp.asarray(staleness), 2)
  np.testing.assert_array_equal(np.asarray(mask), staleness <= 2)
  got = _grad(dj.truncated_is(2.0), logits, behaviour, jnp.asarray(s), jnp.asarray(a),
              jnp.asarray(adv, jnp.float32), mask)
  keep = staleness <= 2
  want = _numpy_grad(lambda r, A: np.where(keep, np.minimum(r, 2.0), 0.0), logits, behaviour, s, a, adv,
                     keep.sum())
  np.testing.assert_allclose(got, want, rtol=2e-5, atol=1e-7)
  nothing = dj.discard_stale(jnp.full(adv.size, 9), 2)
  zero = _grad(dj.no_correction(), logits, behaviour, jnp.asarray(s), jnp.asarray(a),
               jnp.asarray(adv, jnp.float32), nothing)
  np.testing.assert_array_equal(zero, 0.0)


def test_m2po_mask_keeps_all_when_the_moment_is_small_and_one_at_least():
  np.testing.assert_array_equal(np.asarray(m2po_mask(jnp.array([0.1, -0.1, 0.05]), 0.04)), True)
  np.testing.assert_array_equal(np.asarray(m2po_mask(jnp.array([3.0, 2.0, 4.0]), 0.04)), [False, True, False])


def test_losses_are_the_same_under_jit():
  logits, behaviour, s, a, adv = _batch(5)
  lp, blp = _logp(jnp.asarray(logits), s, a), _logp(jnp.asarray(behaviour), s, a)
  for c in (dj.importance_weighting(), dj.truncated_is(), dj.ppo_clip(), dj.m2po()):
    eager = dj.policy_gradient_loss(c, lp, blp, jnp.asarray(adv, jnp.float32))
    jitted = jax.jit(dj.policy_gradient_loss, static_argnums=0)(c, lp, blp, jnp.asarray(adv, jnp.float32))
    assert eager.dtype == jnp.float32
    np.testing.assert_allclose(np.asarray(jitted), np.asarray(eager), rtol=1e-6)


@pytest.mark.parametrize("make, message", [
    (lambda: dj.truncated_is(0.0), "cap"),
    (lambda: dj.truncated_is("2"), "cap"),
    (lambda: dj.ppo_clip(-0.1), "epsilon"),
    (lambda: dj.m2po(float("nan")), "threshold"),
    (lambda: dj.discard_stale(jnp.zeros(3), -1), "max_staleness"),
    (lambda: dj.discard_stale(jnp.zeros(3), 1.5), "max_staleness"),
])
def test_bad_hyperparameters_are_refused(make, message):
  with pytest.raises(ValueError, match=message):
    make()


def test_bad_loss_inputs_are_refused():
  x = jnp.zeros(3)
  with pytest.raises(TypeError, match="correction"):
    dj.policy_gradient_loss("is", x, x, x)
  with pytest.raises(ValueError, match="one length"):
    dj.policy_gradient_loss(dj.no_correction(), x, jnp.zeros(4), x)


def test_a_correction_that_uses_the_staleness_gets_each_samples_lag():
  # J_i = 0.8^{tau_i} r_i-bar A_i log pi(a_i): the NumPy gradient weighs each sample by 0.8^{tau_i} r_i.
  logits, behaviour, s, a, adv = _batch(6)
  lag = np.random.default_rng(1).integers(0, 5, adv.size)

  def objective(logp, behaviour_logp, advantages, staleness):
    weight = jax.lax.stop_gradient(jnp.exp(logp - behaviour_logp)) * 0.8 ** staleness.astype(logp.dtype)
    return weight * jax.lax.stop_gradient(advantages) * logp

  decay = dj.Correction(objective, "decay", uses_staleness=True)
  blogp = _logp(jnp.asarray(behaviour), s, a)
  loss = lambda z, tau: dj.policy_gradient_loss(decay, _logp(z, s, a), blogp, jnp.asarray(adv, jnp.float32),
                                                staleness=tau)
  got = np.asarray(jax.grad(loss)(jnp.asarray(logits), jnp.asarray(lag)), np.float64)
  want = _numpy_grad(lambda r, A: 0.8 ** lag * r, logits, behaviour, s, a, adv, adv.size)
  np.testing.assert_allclose(got, want, rtol=2e-5, atol=1e-7)
  # A scalar lag is every sample's.
  scalar = np.asarray(jax.grad(loss)(jnp.asarray(logits), 3), np.float64)
  np.testing.assert_allclose(scalar, _numpy_grad(lambda r, A: 0.8 ** 3 * r, logits, behaviour, s, a, adv, adv.size),
                             rtol=2e-5, atol=1e-7)


def test_the_built_in_corrections_ignore_the_staleness_bit_for_bit():
  logits, behaviour, s, a, adv = _batch(7)
  lp, blp, A = _logp(jnp.asarray(logits), s, a), _logp(jnp.asarray(behaviour), s, a), jnp.asarray(adv, jnp.float32)
  lag = jnp.asarray(np.random.default_rng(2).integers(0, 9, adv.size))
  for c in (dj.no_correction(), dj.importance_weighting(), dj.truncated_is(), dj.ppo_clip(), dj.m2po()):
    assert not c.uses_staleness
    without = jax.grad(lambda z: dj.policy_gradient_loss(c, _logp(z, s, a), blp, A))(jnp.asarray(logits))
    with_lag = jax.grad(lambda z: dj.policy_gradient_loss(c, _logp(z, s, a), blp, A, staleness=lag))(
        jnp.asarray(logits))
    np.testing.assert_array_equal(np.asarray(with_lag), np.asarray(without))
    np.testing.assert_array_equal(np.asarray(dj.policy_gradient_loss(c, lp, blp, A, staleness=lag)),
                                  np.asarray(dj.policy_gradient_loss(c, lp, blp, A)))


def test_a_correction_that_uses_the_staleness_refuses_to_run_without_it():
  x = jnp.zeros(3)
  lagged = dj.Correction(lambda lp, blp, adv, staleness: lp * staleness, "lagged", uses_staleness=True)
  with pytest.raises(ValueError, match="lagged.*staleness="):
    dj.policy_gradient_loss(lagged, x, x, x)
  with pytest.raises(ValueError, match="staleness must be a scalar"):
    dj.policy_gradient_loss(lagged, x, x, x, staleness=jnp.zeros(4, jnp.int32))
  with pytest.raises(TypeError, match="uses_staleness"):
    dj.policy_gradient_loss(dj.Correction(lambda *a: a[0], "bad", uses_staleness=1), x, x, x)
