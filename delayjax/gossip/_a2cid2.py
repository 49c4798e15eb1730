"""A2CiD2: a continuous momentum for asynchronous pairwise gossip (Nabli, Belilovsky, Oyallon, NeurIPS 2023)."""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from delayjax._checks import check_float
from delayjax.gossip._method import PARAMS, GossipMethod, optimizer_step, params_themselves


class A2CiD2State(NamedTuple):
  """Per-replica state of :func:`a2cid2`."""

  tilde: Any  # pytree like params: the momentum twin x~, equal to the initial params at the start


def _flow(params: Any, tilde: Any, eta: float, dt: jax.Array, time_unit: float) -> tuple[Any, Any]:
  """Both variables after ``dt`` of ``d/dt (x, x~) = eta [[-1, 1], [1, -1]] (x, x~)``.

  ``expm(eta [[-1, 1], [1, -1]] t) = [[1 - c, c], [c, 1 - c]]``, ``c = (1 - exp(-2 eta t)) / 2``, written
  as ``x + c (x~ - x)`` so that equal variables stay exactly equal (one replica is plain training).
  """
  c = 0.5 * (1.0 - jnp.exp(-2.0 * eta * dt.astype(jnp.float32) / time_unit))

  def pair(x, t):
    d = t - x
    k = c.astype(x.dtype)
    return x + k * d, t - k * d

  out = jax.tree.map(pair, params, tilde)
  outer = jax.tree.structure(params)
  x, t = jax.tree.transpose(outer, jax.tree.structure((0, 0)), out)
  return x, t


def a2cid2(eta: float, beta_tilde: float, *, time_unit: float = 1.0) -> GossipMethod:
  r"""A2CiD2: asynchronous pairwise averaging accelerated by a continuous local momentum.

  Each replica keeps a twin :math:`\tilde x_i` of its parameters (equal to
  them at the start). Between its events the pair follows the linear flow

  .. math::

    \frac{d}{dt}\begin{pmatrix} x_i \\ \tilde x_i \end{pmatrix}
    = \eta \begin{pmatrix} -1 & 1 \\ 1 & -1 \end{pmatrix}
      \begin{pmatrix} x_i \\ \tilde x_i \end{pmatrix}, \qquad
    \begin{pmatrix} x_i \\ \tilde x_i \end{pmatrix} \leftarrow
    \exp\!\Big(\eta \begin{pmatrix} -1 & 1 \\ 1 & -1 \end{pmatrix} \frac{\Delta t}{T}\Big)
    \begin{pmatrix} x_i \\ \tilde x_i \end{pmatrix}

  applied lazily at the replica's next ``GRAD`` or ``MIX`` (:math:`\Delta t`
  the simulated time since its previous one, :math:`T` = ``time_unit``). A
  ``GRAD`` applies the optimizer's update to both variables,
  :math:`(u, s_i) = \text{tx.update}(g_i, s_i, x_i)`,
  :math:`x_i \leftarrow x_i + u`, :math:`\tilde x_i \leftarrow \tilde x_i + u`;
  a pairwise ``MIX`` of :math:`i` and :math:`j` (every member first advanced to
  the event's time) does

  .. math::

    \tilde x_i \leftarrow \tilde x_i + \tilde\beta\,(x_j - x_i), \qquad
    x_i \leftarrow \tfrac12 (x_i + x_j)

  (late messages, a schedule's ``lag > 0``, are refused), and for a group
  mix with weights :math:`W` the library uses the weighted mean difference,
  :math:`\tilde x_i \leftarrow \tilde x_i + \tilde\beta\,
  (\sum_j W_{ij} x_j - x_i) / (1 - W_{ii})`, then :math:`x_i \leftarrow
  \sum_j W_{ij} x_j` (for a pair the rule above).

  Checked against the authors' code (``AdelNabli/ACiD``): ``acid_ode`` mixes
  the pair by ``torch.linalg.matrix_exp(ode_matrix * (t_new - t_old) /
  delta_t_grad)`` with ``ode_matrix = [[-eta, eta], [eta, -eta]]``, at every
  gradient step (``ADP.step``) and every communication (``do_send`` /
  ``do_recv``), before ``params_com_tilde.add_(beta_tilde * (params_other -
  params_com))`` and ``params_com.lerp_(params_other, 0.5)``; the gradient
  step subtracts the same ``lr * momentum_buffer`` from both variables.
  Differences: the code normalizes time by a running mean of the gradient
  time (``delta_t_grad``), here a fixed ``time_unit`` (e.g. the mean compute
  time); and the code sends a peer's parameters *before* that peer's own
  flow step, whereas here both members are advanced to the event's time
  first, as in the paper's continuous-time model. ``eta`` and ``beta_tilde``
  come from the graph (:func:`acid_constants`). With one replica
  :math:`\tilde x = x` throughout and this is plain training with ``tx``.

  Args:
    eta: :math:`\eta \ge 0`, the flow's rate.
    beta_tilde: :math:`\tilde\beta \ge 0`, the twin's step at a mix.
    time_unit: :math:`T > 0`, the simulated seconds that count as one unit of
      the flow's time.

  Returns:
    A :class:`GossipMethod` with an :class:`A2CiD2State` per replica.

  References:
    Nabli, Belilovsky, Oyallon, `A2CiD2: Accelerating Asynchronous
    Communication in Decentralized Deep Learning
    <https://arxiv.org/abs/2306.08289>`_, NeurIPS 2023
  """
  eta = check_float("eta", eta, minimum=0.0)
  beta_tilde = check_float("beta_tilde", beta_tilde, minimum=0.0)
  time_unit = check_float("time_unit", time_unit, minimum=0.0, strict_minimum=True)

  def init(params):
    return A2CiD2State(jax.tree.map(jnp.array, params))

  def apply(tx, grads, opt_state, params, extra, dt):
    params, tilde = _flow(params, extra.tilde, eta, dt, time_unit)
    new, opt_state = optimizer_step(tx, grads, opt_state, params)
    update = jax.tree.map(jnp.subtract, new, params)
    # The twin takes the same step as the parameters (the code's `params_com_tilde.add_(mom, alpha=-lr)`).
    tilde = jax.tree.map(jnp.add, tilde, update)
    return new, opt_state, A2CiD2State(tilde)

  def message(params, extra):
    # Members are advanced to the event's time by the runtime's `advance` before messages are taken.
    del extra
    return params

  def receive(params, extra, mixed, self_weight, dt):
    del dt
    share = 1.0 - self_weight
    scale = jnp.where(share > 0, beta_tilde / jnp.where(share > 0, share, 1.0), 0.0)
    tilde = jax.tree.map(lambda t, m, x: t + scale.astype(x.dtype) * (m - x), extra.tilde, mixed, params)
    return mixed, A2CiD2State(tilde)

  def advance(params, extra, dt):
    params, tilde = _flow(params, extra.tilde, eta, dt, time_unit)
    return params, A2CiD2State(tilde)

  # The twin's step takes the receiver's own share out of the mixed messages as its current parameters, which a
  # late message of its own would not be.
  return GossipMethod("a2cid2", init, params_themselves, apply, message, receive, mixes=PARAMS, advance=advance,
                      late_messages=False)


def acid_constants(topology: Any, rate: float = 1.0) -> tuple[float, float]:
  r"""A2CiD2's :math:`(\eta, \tilde\beta)` for a graph and a communication rate, as the authors' code sets them.

  With :math:`W_{ij} = A_{ij} / \sum_k A_{ik}` (``A`` the adjacency, counts
  allowed for repeated neighbours) and the Laplacian
  :math:`L = \text{rate}\,(I - W)`: :math:`\chi_1 = 1/\lambda_2(L)` (its
  smallest positive eigenvalue), :math:`\chi_2 = \max_{(i,j) \in E} \tfrac12
  (e_i - e_j)^\top L^+ (e_i - e_j)` (the largest effective resistance of an
  edge), and

  .. math::  \eta = \frac{1}{2\sqrt{\chi_1 \chi_2}}, \qquad \tilde\beta = \frac12 \sqrt{\chi_1 / \chi_2}

  (``compute_acid_constants`` in ``utils/graph_utils.py`` of
  ``AdelNabli/ACiD``, the paper's Proposition 3.6).

  Args:
    topology: a ``dj.topology.Topology``, or a square adjacency matrix of a
      connected undirected graph.
    rate: expected communications per gradient step (``rate_com``), > 0.

  Returns:
    ``(eta, beta_tilde)`` as Python floats.

  Examples:
    >>> import delayjax as dj
    >>> eta, beta_tilde = dj.gossip.acid_constants(dj.topology.ring(8))
    >>> round(eta, 4), round(beta_tilde, 4)
    (0.2893, 0.9877)

  References:
    Nabli, Belilovsky, Oyallon, `A2CiD2: Accelerating Asynchronous
    Communication in Decentralized Deep Learning
    <https://arxiv.org/abs/2306.08289>`_, NeurIPS 2023
  """
  rate = check_float("rate", rate, minimum=0.0, strict_minimum=True)
  adjacency = getattr(topology, "adjacency", topology)
  try:
    adjacency = None if isinstance(adjacency, (str, bytes)) else np.asarray(adjacency)
  except (TypeError, ValueError):
    adjacency = None
  if adjacency is None or adjacency.dtype.kind not in "biuf":
    raise TypeError(f"topology must be a dj.topology.Topology or a square adjacency matrix of numbers, got "
                    f"{topology!r}.")
  adjacency = adjacency.astype(np.float64)
  if adjacency.ndim != 2 or adjacency.shape[0] != adjacency.shape[1] or adjacency.shape[0] < 2:
    raise ValueError(f"topology must be a Topology or a square adjacency matrix of >= 2 nodes, got shape "
                     f"{adjacency.shape}.")
  if np.any(adjacency < 0) or not np.allclose(adjacency, adjacency.T) or np.any(np.diag(adjacency) != 0):
    raise ValueError("topology must be undirected: a symmetric, non-negative adjacency without self-loops.")
  degree = adjacency.sum(axis=1)
  if np.any(degree == 0):
    raise ValueError(f"topology has isolated nodes {np.flatnonzero(degree == 0).tolist()}; it must be connected.")
  laplacian = rate * (np.eye(adjacency.shape[0]) - adjacency / degree[:, None])
  # L is not symmetric on an irregular graph, so its eigenvalues are taken from the symmetric matrix it is similar
  # to, rate (I - D^-1/2 A D^-1/2) (eigvalsh of L itself would read only one triangle); the same on regular graphs.
  scale = 1.0 / np.sqrt(degree)
  eigenvalues = np.linalg.eigvalsh(rate * (np.eye(adjacency.shape[0]) - scale[:, None] * adjacency * scale[None, :]))
  if eigenvalues[1] <= 1e-12 * rate:
    raise ValueError("topology must be connected (the Laplacian's second eigenvalue is 0).")
  chi_1 = 1.0 / eigenvalues[1]
  pinv = np.linalg.pinv(laplacian)
  i, j = np.nonzero(np.triu(adjacency))
  resistance = 0.5 * (pinv[i, i] + pinv[j, j] - pinv[i, j] - pinv[j, i])
  chi_2 = float(resistance.max())
  return float(0.5 / np.sqrt(chi_1 * chi_2)), float(0.5 * np.sqrt(chi_1 / chi_2))
