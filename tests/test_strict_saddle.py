"""dj.problems.strict_saddle: its gradient, Hessians, saddle and minima against closed forms and autodiff."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from delayjax import analysis, problems

H = [-1.5, 0.25, 1.0, 4.0]
LAM = 0.5


def reference_value(x, h=H, lam=LAM):
  """f(x) = sum_i h_i x_i^2 / 2 + lam (sum_i x_i^2)^2 / 4, written out term by term."""
  sq = sum(v * v for v in x)
  return sum(hi * v * v for hi, v in zip(h, x)) / 2 + lam * sq * sq / 4


def test_value_and_gradient_match_the_written_out_form_and_autodiff():
  p = problems.strict_saddle(H, lam=LAM)
  rng = np.random.default_rng(0)
  for x in rng.standard_normal((5, len(H))):
    assert p.value(x) == pytest.approx(reference_value(x), rel=1e-14)
    # Central differences of the written-out form, and JAX's own gradient of the JAX value.
    fd = np.array([(reference_value(x + 1e-6 * e) - reference_value(x - 1e-6 * e)) / 2e-6 for e in np.eye(len(H))])
    np.testing.assert_allclose(p.grad(x), fd, rtol=1e-7, atol=1e-8)
    with jax.enable_x64():
      auto = jax.grad(p.value)(jnp.asarray(x, jnp.float64))
      np.testing.assert_allclose(p.grad(x), np.asarray(auto), rtol=1e-13)
      np.testing.assert_allclose(p.hessian(x), np.asarray(jax.hessian(p.value)(jnp.asarray(x))), rtol=1e-12,
                                 atol=1e-12)


def test_the_origin_is_a_strict_saddle_with_hessian_h():
  p = problems.strict_saddle(H, lam=LAM)
  zero = np.zeros(len(H))
  assert p.value(zero) == 0.0 and not np.any(p.grad(zero))
  np.testing.assert_array_equal(p.hessian(zero), np.diag(H))
  assert np.linalg.eigvalsh(p.hessian(zero))[0] == H[0] < 0


def test_minima_hessians_and_value_match_the_closed_form():
  p = problems.strict_saddle(H, lam=LAM)
  r = math.sqrt(1.5 / LAM)
  np.testing.assert_allclose(p.minima, [[r, 0, 0, 0], [-r, 0, 0, 0]], rtol=1e-15)
  assert p.min_value == pytest.approx(-1.5 ** 2 / (4 * LAM), rel=1e-15)
  np.testing.assert_allclose(p.min_hessian_eigenvalues, [3.0, 1.75, 2.5, 5.5], rtol=1e-15)
  assert p.smoothness == 5.5
  for x in p.minima:
    np.testing.assert_allclose(p.grad(x), 0.0, atol=1e-15)
    assert p.value(x) == pytest.approx(p.min_value, rel=1e-15)
    np.testing.assert_allclose(np.sort(np.linalg.eigvalsh(p.hessian(x))), np.sort(p.min_hessian_eigenvalues),
                               rtol=1e-12)
  # Global: no random point is lower, and plain gradient descent from near the saddle ends at a minimum.
  rng = np.random.default_rng(1)
  assert min(p.value(x) for x in 3 * rng.standard_normal((2000, len(H)))) > p.min_value
  x = np.array([1e-3, 0.3, -0.2, 0.1])
  for _ in range(5000):
    x = x - 0.1 * p.grad(x)
  np.testing.assert_allclose(x, p.minima[0], atol=1e-9)


def test_jax_float32_inputs_agree_with_float64_numpy():
  p = problems.strict_saddle(H, lam=LAM)
  x = np.random.default_rng(2).standard_normal(len(H))
  x32 = jnp.asarray(x, jnp.float32)
  assert p.value(x32).dtype == jnp.float32 and p.grad(x32).dtype == jnp.float32
  np.testing.assert_allclose(np.asarray(p.grad(x32)), p.grad(x), rtol=1e-5)
  np.testing.assert_allclose(np.asarray(p.hessian(x32)), p.hessian(x), rtol=1e-5, atol=1e-6)


def test_the_saddle_escape_reproduction_uses_the_exact_delay_bound():
  """The reproduction's delay bound is the largest tau with lr * L < 2 sin(pi / (2 (2 tau + 1)))."""
  from experiments import saddle_escape

  config = dict(saddle_escape.SCALES["quick"])
  lipschitz = saddle_escape.problem(config).smoothness
  assert lipschitz == max(2.0, config["h_max"] + 1.0)  # max(-2 h_0, h_max - h_0) with h_0 = -1
  bound = saddle_escape.tau_stable(config)
  assert config["lr"] * lipschitz < 2 * math.sin(math.pi / (2 * (2 * bound + 1)))
  assert config["lr"] * lipschitz >= 2 * math.sin(math.pi / (2 * (2 * bound + 3)))
  assert analysis.stable_learning_rate(lipschitz, bound + 1) <= config["lr"]
  # The sweep crosses the bound: its largest M is beyond it, linear_up_to within it.
  assert max(config["workers"]) - 1 > bound >= config["linear_up_to"] - 1


@pytest.mark.parametrize("eigenvalues, lam, error, message", [
    ([1.0, 2.0], 1.0, ValueError, "negative first entry"),
    ([-1.0, -2.0], 1.0, ValueError, "positive others"),
    ([-1.0, 0.0], 1.0, ValueError, "got [-1.0, 0.0]"),
    ([[-1.0, 2.0]], 1.0, ValueError, "1-D array of d >= 1 finite numbers, got shape (1, 2)"),
    ([], 1.0, ValueError, "got shape (0,)"),
    ([-1.0, float("nan")], 1.0, ValueError, "finite numbers"),
    ("abc", 1.0, TypeError, "eigenvalues must be an array of numbers"),
    ([-1.0, 2.0], 0.0, ValueError, "lam"),
    ([-1.0, 2.0], -1.0, ValueError, "lam"),
    ([-1.0, 2.0], "1", TypeError, "lam must be a real number"),
])
def test_bad_input_names_the_argument_and_what_is_allowed(eigenvalues, lam, error, message):
  with pytest.raises(error, match=None) as e:
    problems.strict_saddle(eigenvalues, lam=lam)
  assert message in str(e.value)


def test_the_problem_keeps_its_own_copy():
  h = np.array(H)
  p = problems.strict_saddle(h, lam=LAM)
  h[0] = 5.0
  assert p.eigenvalues[0] == H[0] and not p.eigenvalues.flags.writeable
