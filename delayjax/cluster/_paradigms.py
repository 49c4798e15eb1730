"""Synchronization paradigms: when a worker may read, and which pushes form one update.

Each paradigm is a small frozen dataclass built by a lower-case factory
(``ssp(3)``); ``simulate`` runs it. All share the cluster semantics of
:class:`~delayjax.cluster.Schedule`: update ``u`` is applied to server version
``u`` and produces version ``u + 1``; a worker reading when ``u`` updates have
been applied reads version ``u``; every worker has at most one gradient in
flight (read, compute, push, read again); every gradient is applied at most
once. Pushes that happen at the same simulated second are processed in worker
index order, and each push is followed at once by the pusher's next read when
the paradigm lets it read. The simulation ends the moment update ``U - 1`` is
applied.

A schedule stores one read version per worker and update, so a paradigm in
which one worker could put two gradients read at *different* versions into
one update cannot be recorded exactly; ``softsync`` and ``k_batch_async`` say
in their docstrings how they stay exact.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

from delayjax._checks import check_choice, check_float, check_int

__all__ = [
    "Paradigm", "BSP", "ASP", "SSP", "DSSP", "PSP", "KSync", "KAsync", "KBatchSync", "KBatchAsync",
    "SoftSync", "BackupWorkers", "AdaSync", "ElasticBSP", "PredictiveCutoff", "GBA", "Pisces",
    "bsp", "asp", "ssp", "dssp", "psp", "k_sync", "k_async", "k_batch_sync", "k_batch_async",
    "softsync", "backup_workers", "adasync", "elastic_bsp", "predictive_cutoff", "gba", "pisces",
]


class Paradigm:
  """Base class of the synchronization paradigms (frozen dataclasses)."""

  def check(self, num_workers: int) -> None:
    """Raises a ``ValueError`` if the paradigm cannot run on ``num_workers`` workers."""

  def __str__(self) -> str:
    fields = ", ".join(f"{f.name}={getattr(self, f.name)}" for f in dataclasses.fields(self))  # type: ignore[arg-type]
    return f"{_NAMES[type(self)]}({fields})"


def _check_at_most(name: str, value: int, limit: int, what: str) -> None:
  if value > limit:
    raise ValueError(f"{name} must be <= {what} ({limit}), got {value}.")


@dataclasses.dataclass(frozen=True)
class _CountsMinibatches(Paradigm):
  """A paradigm that applies an update after ``k >= 1`` minibatches."""

  k: int

  def __post_init__(self):
    check_int("k", self.k, minimum=1)


@dataclasses.dataclass(frozen=True)
class _CountsWorkers(_CountsMinibatches):
  """A paradigm that applies an update after ``k`` gradients from distinct workers: ``k <= M``."""

  def check(self, num_workers: int) -> None:
    _check_at_most("k", self.k, num_workers, "the number of workers")


@dataclasses.dataclass(frozen=True)
class BSP(Paradigm):
  """Bulk synchronous parallel: every update averages one fresh gradient from each of the ``M`` workers.

  Rule: in round ``r`` all workers read version ``r``; update ``r`` is applied
  when the last of the ``M`` gradients arrives; workers that finished early
  wait for it. Staleness is always 0. (It is ``k_sync(M)``.)

  References:
    Valiant, `A bridging model for parallel computation
    <https://doi.org/10.1145/79173.79181>`_, Communications of the ACM 1990
  """


@dataclasses.dataclass(frozen=True)
class ASP(Paradigm):
  """Asynchronous parallel (Hogwild!/Downpour-style): each push is an update; no worker ever waits.

  Rule: a worker pushes, its gradient is applied at once as one update, and
  it reads the new version. With ``M`` equally fast workers the staleness is
  ``M - 1`` after the first round.

  References:
    Dean et al., `Large Scale Distributed Deep Networks
    <https://papers.nips.cc/paper/4687-large-scale-distributed-deep-networks>`_, NIPS 2012
  """


@dataclasses.dataclass(frozen=True)
class SSP(Paradigm):
  """Stale synchronous parallel: each push is an update; fast workers wait for the slowest.

  Rule: a worker's clock ``c`` counts its pushes. After a push it may start
  its next iteration only if the slowest worker's clock is ``>= c - s``;
  otherwise it waits until that holds.

  Attributes:
    staleness: ``s >= 0``.

  References:
    Ho, Cipar, Cui, Kim, Lee, Gibbons, Gibson, Ganger, Xing, `More Effective
    Distributed ML via a Stale Synchronous Parallel Parameter Server
    <https://papers.nips.cc/paper/4894-more-effective-distributed-ml-via-a-stale-synchronous-parallel-parameter-server>`_,
    NIPS 2013
  """

  staleness: int

  def __post_init__(self):
    check_int("staleness", self.staleness, minimum=0)


@dataclasses.dataclass(frozen=True)
class DSSP(Paradigm):
  """Dynamic SSP: SSP whose threshold the fastest worker may raise from ``s_lower`` up to ``s_upper``.

  Rule (on a push from worker ``p``, which is applied at once as one update;
  ``t_p`` is ``p``'s clock after it, ``g = t_p - t_slowest``):

  1. if ``r_p > 0``: ``r_p -= 1`` and ``p`` continues;
  2. else if ``g <= s_lower``: ``p`` continues;
  3. else if ``p`` is a fastest worker (``t_p`` is the largest clock): the
     controller picks ``r*`` extra iterations; if ``r* > 0``, ``p`` continues
     and ``r_p = r* - 1`` more may follow without a check;
  4. otherwise ``p`` waits until ``g <= s_lower``.

  Controller: with ``Delta_p`` and ``Delta_q`` the last push intervals of
  ``p`` and of the slowest worker ``q`` (lowest index among those with the
  smallest clock; a first interval counts from time 0, and a ``q`` that has
  not pushed yet uses the time elapsed since time 0),
  ``r*`` is the smallest ``i`` in ``0..R`` minimising
  ``min_j |t + i Delta_p - (t_q + j Delta_q)|`` over ``j = 1..s_upper - s_lower + 1``,
  where ``t`` is now and ``t_q`` is ``q``'s last push time. ``R = min(s_upper -
  s_lower, s_upper - g + 1)``, so no worker ever starts an iteration more than
  ``s_upper`` clocks ahead of the slowest.

  The threshold in force for each push (``s_lower``, or ``g - 1 + r*`` under a
  grant, kept for the grant's iterations) is recorded per update in
  ``extras["threshold"]``; it lies in ``[s_lower, s_upper]``.

  Attributes:
    s_lower: the base threshold ``s_L >= 0``.
    s_upper: the largest threshold ``s_U >= s_L``.

  References:
    Zhao, An, Liu, Chen, `Dynamic Stale Synchronous Parallel Distributed
    Training for Deep Learning <https://arxiv.org/abs/1908.11848>`_, ICDCS 2019.
    The rule follows the paper's description of the server; the controller's
    bound ``R`` that keeps the gap below ``s_upper`` is this library's reading.
  """

  s_lower: int
  s_upper: int

  def __post_init__(self):
    lower = check_int("s_lower", self.s_lower, minimum=0)
    upper = check_int("s_upper", self.s_upper, minimum=0)
    if lower > upper:
      raise ValueError(f"s_lower must be <= s_upper, got s_lower={lower}, s_upper={upper}.")


@dataclasses.dataclass(frozen=True)
class PSP(Paradigm):
  """Probabilistic synchronous parallel: the SSP barrier checked on a random sample of workers.

  Rule: a worker's clock ``c`` counts its pushes; each push is applied at
  once as one update. After a push, worker ``p`` at clock ``c`` draws a
  sample of ``beta = sample_size`` distinct workers uniformly, without
  replacement, from all ``M`` (itself included) and may start its next
  iteration only if no worker of the sample lags more than ``s = staleness``
  clocks behind it (the smallest clock in the sample is ``>= c - s``);
  otherwise it waits, on that same sample, until that holds, and then reads
  the version of that moment. ``s = 0`` is the authors' pBSP and ``s > 0`` their
  pSSP; with ``beta = M`` the sample is everyone and PSP is exactly
  ``ssp(s)``. A small sample rarely holds a straggler, so fast workers wait
  less than under SSP, at the price of a staleness that SSP's bound no
  longer limits.

  The sample of the ``k``-th push that draws one (every push but the last
  update's; none when ``beta = M``) is the ``beta`` workers with the smallest
  of ``M`` uniform keys, the ``k``-th ``M`` draws of ``numpy.random.default_rng``
  on the second of the two streams ``SeedSequence(seed)`` (``[seed,
  workers.seed]`` when the workers have a seed) spawns; the durations come
  from the first.

  Attributes:
    sample_size: ``1 <= beta <= M``.
    staleness: ``s >= 0``.

  References:
    Wang, Catterall, Mortier, `Probabilistic Synchronous Parallel
    <https://arxiv.org/abs/1709.07772>`_, arXiv 2017. **Only the paper's
    abstract (and the opening of its introduction) could be read here**: a
    sampling primitive added to the BSP and SSP barriers improves the
    convergence speed and scalability of SGD. The rule above is the authors'
    formal statement in the Distributed Computing chapter of their Owl book
    (ocaml.xyz/book/distributed.html):
    "at the barrier control point, a worker samples beta out of P workers
    without replacement. If a single one of these lags more than s steps
    behind the current worker then it waits". That a waiting worker keeps
    its sample, rather than drawing a new one at each check, is this
    library's reading.
  """

  sample_size: int
  staleness: int

  def __post_init__(self):
    check_int("sample_size", self.sample_size, minimum=1)
    check_int("staleness", self.staleness, minimum=0)

  def check(self, num_workers: int) -> None:
    _check_at_most("sample_size", self.sample_size, num_workers, "the number of workers")


@dataclasses.dataclass(frozen=True)
class KSync(_CountsWorkers):
  """K-sync SGD: every update uses the first ``K`` fresh gradients; the other computations are cancelled.

  Rule: in round ``r`` all workers read version ``r``; update ``r`` is
  applied when ``K`` gradients have arrived (ties by worker index); the other
  ``M - K`` computations are cancelled at that moment (``dropped``) and every
  worker reads version ``r + 1``.

  Attributes:
    k: ``1 <= K <= M``.

  References:
    Dutta, Joshi, Ghosh, Dube, Nagpurkar, `Slow and Stale Gradients Can Win
    the Race: Error-Runtime Trade-offs in Distributed SGD
    <https://arxiv.org/abs/1803.01113>`_, AISTATS 2018
  """


@dataclasses.dataclass(frozen=True)
class KAsync(_CountsWorkers):
  """K-async SGD: apply as soon as any ``K`` gradients have arrived (possibly stale); only they re-read.

  Rule: pushes accumulate; the ``K``-th push applies them as one update. A
  worker that pushed waits until its gradient has been applied, then reads;
  the others keep computing. Each update has exactly ``K`` contributions,
  from distinct workers.

  Attributes:
    k: ``1 <= K <= M``.

  References:
    Dutta, Joshi, Ghosh, Dube, Nagpurkar, `Slow and Stale Gradients Can Win
    the Race: Error-Runtime Trade-offs in Distributed SGD
    <https://arxiv.org/abs/1803.01113>`_, AISTATS 2018
  """


@dataclasses.dataclass(frozen=True)
class KBatchSync(_CountsMinibatches):
  """K-batch-sync SGD: all workers compute minibatches at one version; the first ``K`` minibatches form the update.

  Rule: in round ``r`` all workers read version ``r`` and compute minibatches
  back to back, all at version ``r``; update ``r`` is applied when ``K``
  minibatches in total have arrived (a worker may contribute several:
  ``num_batches``); the minibatches still being computed are cancelled
  (``dropped``) and every worker reads version ``r + 1``. ``K`` may exceed
  ``M``, since minibatches, not workers, are counted.

  Attributes:
    k: ``K >= 1``.

  References:
    Dutta, Joshi, Ghosh, Dube, Nagpurkar, `Slow and Stale Gradients Can Win
    the Race: Error-Runtime Trade-offs in Distributed SGD
    <https://arxiv.org/abs/1803.01113>`_, AISTATS 2018
  """


@dataclasses.dataclass(frozen=True)
class KBatchAsync(_CountsMinibatches):
  """K-batch-async SGD: apply after any ``K`` minibatches; workers push and re-read without waiting.

  Rule: a worker pushes each minibatch and reads the current version at once;
  the ``K``-th minibatch pushed since the last update applies them all as one
  update. Several minibatches of one worker read at the same version are one
  contribution with ``num_batches > 1``.

  Exactness restriction: if a worker finishes a minibatch while the pending
  update already holds a minibatch of that worker read at a *different*
  version, the paper's rule would put two read versions of one worker into
  one update, which a :class:`Schedule` cannot record. Here that worker
  instead waits (holding its gradient) until the pending update is applied
  and then pushes into the next update (pushes held this way are taken in the
  order they arrived). This only happens to a worker that finished two
  minibatches inside one aggregation window after a stale one.

  Attributes:
    k: ``K >= 1`` (may exceed ``M``: minibatches are counted).

  References:
    Dutta, Joshi, Ghosh, Dube, Nagpurkar, `Slow and Stale Gradients Can Win
    the Race: Error-Runtime Trade-offs in Distributed SGD
    <https://arxiv.org/abs/1803.01113>`_, AISTATS 2018
  """


@dataclasses.dataclass(frozen=True)
class SoftSync(Paradigm):
  """n-softsync: the server averages every ``c = floor(M / n)`` gradients into one update; learners never wait.

  Rule: exactly ``k_batch_async(floor(M / n))``: a learner pushes and reads
  the current version at once; every ``c``-th push applies the ``c``
  gradients received since the last update as one (averaged) update. Mean
  staleness is about ``n``; ``n = M`` is ASP. The same exactness restriction
  as ``k_batch_async`` applies (a learner whose stale gradient is in the
  pending update holds its next gradient until that update is applied).

  Attributes:
    n: ``1 <= n <= M``.

  References:
    Zhang, Gupta, Lian, Liu, `Staleness-aware Async-SGD for Distributed Deep
    Learning <https://arxiv.org/abs/1511.05950>`_, IJCAI 2016
  """

  n: int

  def __post_init__(self):
    check_int("n", self.n, minimum=1)

  def check(self, num_workers: int) -> None:
    _check_at_most("n", self.n, num_workers, "the number of workers (so that floor(M / n) >= 1)")


@dataclasses.dataclass(frozen=True)
class BackupWorkers(Paradigm):
  """Synchronous SGD with ``b`` backup workers: each update uses the first ``N = M - b`` fresh gradients.

  Rule: update ``u`` is applied when ``N`` gradients read at version ``u``
  have arrived; a worker whose gradient was applied waits for that update
  and then reads. A gradient that arrives after its version's update (read
  at an older version) is dropped, and its worker reads the current version
  at once; the computation is not interrupted (as in TensorFlow's
  ``SyncReplicasOptimizer``). So of the gradients read at each version all but
  the first ``N`` are dropped: exactly ``b`` per update when every worker takes
  part in every round (e.g. equal speeds), fewer when a straggler misses a
  whole round.

  Attributes:
    b: ``0 <= b < M``.

  References:
    Chen, Pan, Monga, Bengio, Jozefowicz, `Revisiting Distributed Synchronous
    SGD <https://arxiv.org/abs/1604.00981>`_, ICLR workshop 2016
  """

  b: int

  def __post_init__(self):
    check_int("b", self.b, minimum=0)

  def check(self, num_workers: int) -> None:
    if self.b >= num_workers:
      raise ValueError(f"b must be < the number of workers ({num_workers}) so that N = M - b >= 1, got {self.b}.")


@dataclasses.dataclass(frozen=True)
class AdaSync(Paradigm):
  """AdaSync: K-sync whose ``K`` grows as the loss falls, ``K = ceil(sqrt(F(w_0) / F(w_t)) K_0)``.

  Rule: ``k_sync(K)`` with ``K`` changed only between chunks of a
  :class:`~delayjax.cluster.Simulation`: the first ``feedback(loss)`` sets
  ``F(w_0)``; each later one sets ``K = clip(ceil(sqrt(F(w_0) / loss) K_0), 1,
  M)`` for the next chunk. ``K`` per update is recorded in ``extras["k"]``.
  Without feedback it is ``k_sync(K_0)``.

  Attributes:
    k0: the initial ``K_0``, ``1 <= K_0 <= M``.

  References:
    Dutta, Joshi, Ghosh, Dube, Nagpurkar, `Slow and Stale Gradients Can Win
    the Race: Error-Runtime Trade-offs in Distributed SGD
    <https://arxiv.org/abs/1803.01113>`_, AISTATS 2018 (the rule for ``K``
    follows the form given there; unverified against the journal version).
  """

  k0: int

  def __post_init__(self):
    check_int("k0", self.k0, minimum=1)

  def check(self, num_workers: int) -> None:
    _check_at_most("k0", self.k0, num_workers, "the number of workers")


@dataclasses.dataclass(frozen=True)
class ElasticBSP(Paradigm):
  """ElasticBSP: BSP whose barrier comes every few iterations, at a time predicted to make workers wait least.

  Rule: the run is a sequence of periods, each ending in a barrier at which
  every worker waits for the others and then all read the same version.
  When a period starts at time ``t0``, the server predicts each worker's next
  iteration end times ``t0 + k Delta_p``, ``k = 1..R``, from ``Delta_p``,
  the mean duration of worker ``p``'s iterations so far (the first period,
  with nothing observed, has ``k_p = 1`` for all: a BSP round). Among the
  ``M R`` predicted points it finds the shortest time window ``[T - w, T]``
  holding at least one point of every worker (smallest ``w``, then earliest
  ``T``; one pass over the sorted points), and worker ``p`` runs
  ``k_p = max{k <= R : t0 + k Delta_p <= T}`` iterations in the period.
  Within the period a push is applied at once as one update and its worker
  reads the new version (as in ASP); after its ``k_p``-th push it waits at
  the barrier, which opens when the last worker arrives. So every gradient
  is applied in the period it was read in, and its staleness is below the
  period's ``sum_p k_p <= M R`` pushes. The period of each update is
  recorded in ``extras["period"]``.

  Attributes:
    lookahead: ``R >= 1``, the most iterations a worker runs between two
      barriers (``R = 1``: one iteration per period).

  References:
    Zhao, Papagelis, An, Chen, Liu, Hu, `Elastic Bulk Synchronous Parallel
    Model for Distributed Deep Learning <https://arxiv.org/abs/2001.01347>`_,
    ICDM 2019; and `ZipLine: an optimized algorithm for the elastic bulk
    synchronous parallel model <https://doi.org/10.1007/s10994-021-06064-w>`_,
    Machine Learning 2021. Confirmed from the papers' abstracts: the server
    estimates each worker's future iteration end times at run time and a
    one-pass algorithm over all workers' estimated points picks the future
    synchronization time that minimizes waiting, with a tunable lookahead.
    This library's construction (the papers' full text was not reachable):
    the mean-duration predictor, the shortest covering window as the
    waiting objective with its tie rule, the choice of ``k_p``, ASP within
    a period, and the first period as a BSP round.
  """

  lookahead: int

  def __post_init__(self):
    check_int("lookahead", self.lookahead, minimum=1)


@dataclasses.dataclass(frozen=True)
class PredictiveCutoff(Paradigm):
  """Synchronous SGD whose cutoff is chosen online, each update, to maximize gradients per second.

  Rule: in round ``r`` all workers read version ``r``. The server predicts
  the order statistics of this round's durations, ``hat d_(k)`` for ``k =
  1..M``, from the last ``window`` rounds, picks ``K_r = argmax_k k / hat
  d_(k)`` (the smallest on ties), and applies update ``r`` when the
  ``K_r``-th gradient arrives, at ``t_r + d_(K_r)``; the slower workers'
  computations are cancelled and dropped and everyone reads the new version
  (``k_sync(K_r)``). The predicted cutoff time ``hat d_(K_r)`` and ``K_r``
  are recorded per update in ``extras["cutoff"]`` and ``extras["k"]``.

  The model is empirical: ``hat d_(k)`` is the mean of the ``k``-th
  smallest duration over the rounds of the window that observed it (a round
  observes its ``K_r`` fastest; the others are only known to exceed its
  cutoff). An order statistic no round of the window observed is predicted
  at the largest cutoff of the window, a lower bound, so it looks cheap and
  gets tried: the server keeps probing larger ``K``. The first round, with
  nothing observed, waits for everyone (``K_0 = M``).

  What it achieves: when the best ``K`` changes during the run (stragglers
  that come and go) it beats every fixed ``K`` of ``k_sync`` and every
  ``backup_workers(b)`` in gradients per simulated second (8 workers, 4 of
  them 10x slower for the first 300 s: 3.55 against at best 3.48); on
  stationary durations it must learn the best fixed ``K`` and keeps probing,
  and stays a few percent below it (8 workers, i.i.d. lognormal: 5.10
  against 5.22 with ``window=20``; a longer window comes closer).

  Attributes:
    window: ``>= 1`` past rounds the model averages.

  References:
    Teng, Wood, `Bayesian Distributed Stochastic Gradient Descent
    <https://proceedings.neurips.cc/paper/2018/hash/86b20716fbd5b253d27cec43127089bc-Abstract.html>`_,
    NeurIPS 2018. Confirmed from the paper's abstract: a synchronous server
    chooses a cutoff beyond which slow workers' gradients are ignored, from
    predicted run times (there a deep generative model with amortized
    inference, fitted to the cluster), to raise gradient throughput over a
    static cutoff. The throughput objective ``k / hat d_(k)``, the empirical
    order-statistics model with its treatment of cut-off durations and the
    first round are this library's construction.
  """

  window: int = 20

  def __post_init__(self):
    check_int("window", self.window, minimum=1)


@dataclasses.dataclass(frozen=True)
class GBA(Paradigm):
  r"""Global batch gradients aggregation: the server applies the synchronous global batch, gathered asynchronously.

  Rule (a parameter server with a gradient buffer and tokens): a worker reads
  the current version ``v`` and receives the token ``v`` with its batch; it
  computes its gradient and pushes it with its token without blocking, and
  reads again at once (so fast workers compute more gradients than
  stragglers). The server buffers the pushes; the ``G``-th gradient pushed
  since the last update applies the ``G`` buffered gradients as one update,
  their mean, ``G`` being the number of local batches in the synchronous
  job's global batch. A gradient's token gives its staleness at the update
  it enters, ``tau = u - token``; the server decays the gradients whose
  staleness exceeds a threshold ``iota`` before averaging. The decay is a
  transformation at the head of the server's chain, not part of the schedule::

    tx = optax.chain(dj.per_contribution(dj.scale_by_staleness("hinge", a=1.0, b=iota)), base_optimizer)

  which weighs a gradient ``s(tau) = 1`` for ``tau <= iota`` and
  ``1 / (1 + (tau - iota))`` beyond, and divides the weighted sum by ``G``
  (``per_contribution`` weights the contributions by their minibatches).

  So with ``G = M`` workers of equal speed every update holds one gradient
  from each worker, as the synchronous (all-reduce) job it replaces, with
  the same global batch and hyper-parameters; since a pusher reads before
  the buffer it joined is applied, all but the last pusher of an update are
  1 stale in the next, and with ``iota >= 1`` the decay leaves them whole.
  With stragglers an update still averages ``G`` gradients, and a
  straggler's gradient grows stale and is decayed.

  Schedule: the pushes and updates are exactly those of
  ``k_batch_async(G)``, with its exactness restriction (a worker whose
  gradient read at another version is already in the pending buffer holds
  its next push until that update is applied, so that one update never
  holds two read versions of one worker); several gradients of one worker
  read at the same version are one contribution with ``num_batches > 1``.
  The restriction makes fast workers wait where the paper's do not: each
  contributes to one buffer the gradients of a single read version, so with
  ``G`` above the fast workers' share of a buffer the straggler's pushes fill
  it (4 workers, one 6x slower, ``G = 5``: the fast ones are blocked 90% of
  the time). With gradients that straggle at random (8 workers, ``G = 8``,
  probability 0.05, 10x slower) it still takes half the time of ``bsp()``.

  Attributes:
    global_batch: ``G >= 1``, the gradients (local batches) per update.

  References:
    Su, Zhang, Cai, Ren, Wang, Yi, Song, Chen, Deng, Xu, Qu, Zheng, `GBA: A
    Tuning-free Approach to Switch between Synchronous and Asynchronous
    Training for Recommendation Models <https://arxiv.org/abs/2205.11048>`_,
    NeurIPS 2022. **Only the paper's abstract, the caption of its figure of
    the token-control mechanism and one paragraph of its appendix could be
    read here**: the server aggregates gradients with the global batch size
    of the synchronous training ("every M gradients would be aggregated in
    the buffer before the PSs apply them"); workers report each gradient
    with a token indicating its data staleness, without blocking, so fast
    workers ingest more data than stragglers; a token-control process
    assembles the gradients and decays those with severe staleness. The
    token as the read version, the mean of the buffer, and the decay function
    (the hinge above, with the threshold ``iota`` as its knee) are this
    library's construction of what the paper's text (not reachable here)
    specifies.
  """

  global_batch: int

  def __post_init__(self):
    check_int("global_batch", self.global_batch, minimum=1)


@dataclasses.dataclass(frozen=True)
class Pisces(Paradigm):
  r"""Pisces: asynchronous federated learning with utility-guided client selection and an adaptive aggregation pace.

  The workers are the ``N`` clients; at most ``C`` (``concurrency``) train at
  once. A selected client reads the current version, trains (its time model
  gives how long) and pushes; its update waits in the server's buffer, and the
  client cannot be selected again until the buffer is applied. The server
  applies the whole buffer as one update (each client's contribution with its
  own read version), then and after every push fills the free slots from the
  idle clients (neither training nor buffered).

  **Selection** (exploration-exploitation, as Oort). A client is *explored*
  once it has pushed. To select ``n`` clients, draw ``e ~ Binomial(n,
  \epsilon)``, explore ``min(#unexplored, e)`` and exploit the rest; then
  :math:`\epsilon \leftarrow \max(\epsilon\,\delta, \epsilon_{\min})`. The
  exploited clients are the explored idle ones of highest score

  .. math::

     \mathrm{score}_i = \frac{U_i}{(\bar\tau_i + 1)^{\beta}},

  where :math:`U_i` is the client's statistical utility (Oort's
  :math:`|B_i|\sqrt{\frac{1}{|B_i|}\sum_{k \in B_i} \mathrm{Loss}(k)^2}`) and
  :math:`\bar\tau_i` the mean staleness of its last ``window`` applied
  updates (0 before any), so clients likely to be stale are de-prioritized;
  the explored clients are ordered by a random permutation before the
  (stable) sort, so ties break at random; the clients to explore are drawn
  uniformly without replacement from the unexplored idle clients.

  **Pace.** The server applies a non-empty buffer as soon as

  .. math::

     t - t_{\mathrm{last}} \ge I = \frac{\max_{i \in \mathrm{running}} \hat L_i}{b},

  where :math:`\hat L_i` is client ``i``'s last measured latency (read to
  push) and ``b`` the staleness bound (``C`` by default): while the slowest
  running client trains, at most about ``b`` updates are applied, which
  bounds its staleness. With no client running, ``I = 0``. A client not yet
  measured counts with the largest latency measured so far (the authors'
  code uses a fixed constant for it, 180 s; this scale-free choice is the
  library's). ``aggregate_every=K`` replaces the pace with FedBuff's rule
  (apply the buffer when it holds ``K`` updates) and ``selection="random"``
  replaces the score with uniform selection among the idle clients: the
  baselines and ablations of the paper on the same simulator.

  Order of events: pushes are taken in ``(time, worker)`` order; after each
  push, and at each due time of the pace, the server first applies the
  buffer if it is due (the pace measured without clients selected at that
  instant), then selects. Staleness weighting of the aggregated updates is
  the server's transformation, the artifact's
  :math:`1/(\tau + 1)^{\beta}` with the contribution's own staleness::

    tx = optax.chain(dj.per_contribution(dj.scale_by_staleness("polynomial", a=0.5)), optax.sgd(server_lr))

  Randomness (the ``seed``'s second stream, ``rng``): per selection of ``n
  >= 1`` clients, ``rng.binomial(n, epsilon)``, ``rng.permutation`` of the
  explored idle clients (in worker order), then ``rng.choice(unexplored idle,
  count, replace=False)`` if any are to be explored; with ``selection="random"``,
  one ``rng.choice(idle, n, replace=False)``.

  The utilities are given once, for the whole schedule (it is planned
  before training): the artifact refreshes :math:`U_i` from the losses of
  each of the client's local trainings. Measure them, e.g., from the initial
  model's per-example losses on each client's data. Left out: the
  artifact's optional speed term in the score (off in its configurations)
  and its robustness filter (DBSCAN on the reported losses).

  Attributes:
    concurrency: ``C``, clients training at once, ``1 <= C <= N``.
    utility: ``N`` non-negative statistical utilities, or ``None`` for all 1.
    beta: the staleness penalty exponent, ``>= 0`` (0.5 in the artifact's runs).
    staleness_bound: ``b >= 1``, or ``None`` for ``C``.
    explore: the initial exploration factor :math:`\epsilon` in ``[0, 1]``.
    explore_decay: :math:`\delta` in ``(0, 1]``.
    min_explore: :math:`\epsilon_{\min}` in ``[0, 1]``.
    window: the number of a client's last staleness values averaged, ``>= 1``.
    selection: ``"pisces"`` (the score) or ``"random"`` (uniform).
    aggregate_every: ``None`` (Pisces' pace) or ``K >= 1`` (FedBuff's buffer).

  References:
    Jiang, Wang, Li, Li, `Pisces: Efficient Federated Learning via Guided
    Asynchronous Training <https://arxiv.org/abs/2206.09264>`_, ACM SoCC 2022.
    **Only the paper's abstract could be read here**: selection by a score
    of data utility and staleness, and a pace of aggregation that bounds the
    gap between the selected clients and the server. The rules above follow
    the authors' artifact (github.com/SamuelGong/Pisces,
    ``plato/client_managers/sirius.py``: the score, the exploration, the
    pacer ``I = max latency / b`` with ``b = C``; defaults ``epsilon = 0.9``,
    ``delta = 0.98``, ``epsilon_min = 0.3``, ``beta = 0.5``, ``window = 5``
    from its configurations). The artifact's server wakes up periodically;
    here the same rules run event by event.
  """

  concurrency: int
  utility: Any = None
  beta: float = 0.5
  staleness_bound: Any = None
  explore: float = 0.9
  explore_decay: float = 0.98
  min_explore: float = 0.3
  window: int = 5
  selection: str = "pisces"
  aggregate_every: Any = None

  def __post_init__(self):
    check_int("concurrency", self.concurrency, minimum=1)
    if self.utility is not None:
      if isinstance(self.utility, (str, bytes)) or not hasattr(self.utility, "__len__"):
        raise TypeError(f"utility must be a sequence of non-negative numbers (one per client) or None, "
                        f"got {self.utility!r}.")
      values = tuple(check_float(f"utility[{i}]", u, minimum=0.0) for i, u in enumerate(self.utility))
      object.__setattr__(self, "utility", values)
    check_float("beta", self.beta, minimum=0.0)
    if self.staleness_bound is not None:
      check_int("staleness_bound", self.staleness_bound, minimum=1)
    check_float("explore", self.explore, minimum=0.0, maximum=1.0)
    check_float("explore_decay", self.explore_decay, minimum=0.0, maximum=1.0, strict_minimum=True)
    check_float("min_explore", self.min_explore, minimum=0.0, maximum=1.0)
    check_int("window", self.window, minimum=1)
    check_choice("selection", self.selection, ("pisces", "random"))
    if self.aggregate_every is not None:
      check_int("aggregate_every", self.aggregate_every, minimum=1)

  @property
  def bound(self) -> int:
    """The staleness bound ``b`` the pace uses."""
    return self.concurrency if self.staleness_bound is None else self.staleness_bound

  def check(self, num_workers: int) -> None:
    _check_at_most("concurrency", self.concurrency, num_workers, "the number of workers (clients)")
    if self.utility is not None and len(self.utility) != num_workers:
      raise ValueError(f"utility must hold one value per worker ({num_workers}), got {len(self.utility)}.")
    if self.aggregate_every is not None:
      _check_at_most("aggregate_every", self.aggregate_every, self.concurrency, "the concurrency")

  def __str__(self) -> str:
    utility = None if self.utility is None else f"[{len(self.utility)} values, sum {math.fsum(self.utility):.6g}]"
    return (f"pisces(concurrency={self.concurrency}, utility={utility}, beta={self.beta}, "
            f"staleness_bound={self.staleness_bound}, explore={self.explore}, explore_decay={self.explore_decay}, "
            f"min_explore={self.min_explore}, window={self.window}, selection={self.selection}, "
            f"aggregate_every={self.aggregate_every})")


_NAMES = {
    BSP: "bsp", ASP: "asp", SSP: "ssp", DSSP: "dssp", PSP: "psp", KSync: "k_sync", KAsync: "k_async",
    KBatchSync: "k_batch_sync", KBatchAsync: "k_batch_async", SoftSync: "softsync",
    BackupWorkers: "backup_workers", AdaSync: "adasync", ElasticBSP: "elastic_bsp",
    PredictiveCutoff: "predictive_cutoff", GBA: "gba", Pisces: "pisces",
}


def bsp() -> BSP:
  """Bulk synchronous parallel (see :class:`BSP`)."""
  return BSP()


def asp() -> ASP:
  """Asynchronous parallel (see :class:`ASP`)."""
  return ASP()


def ssp(staleness: int) -> SSP:
  """Stale synchronous parallel with threshold ``staleness`` (see :class:`SSP`)."""
  return SSP(staleness)


def dssp(s_lower: int = 3, s_upper: int = 15) -> DSSP:
  """Dynamic SSP with thresholds in ``[s_lower, s_upper]`` (see :class:`DSSP`)."""
  return DSSP(s_lower, s_upper)


def psp(sample_size: int, staleness: int) -> PSP:
  """Probabilistic SSP: the SSP barrier on ``sample_size`` random workers (see :class:`PSP`)."""
  return PSP(sample_size, staleness)


def k_sync(k: int) -> KSync:
  """K-sync SGD (see :class:`KSync`)."""
  return KSync(k)


def k_async(k: int) -> KAsync:
  """K-async SGD (see :class:`KAsync`)."""
  return KAsync(k)


def k_batch_sync(k: int) -> KBatchSync:
  """K-batch-sync SGD (see :class:`KBatchSync`)."""
  return KBatchSync(k)


def k_batch_async(k: int) -> KBatchAsync:
  """K-batch-async SGD, restricted to what a schedule records exactly (see :class:`KBatchAsync`)."""
  return KBatchAsync(k)


def softsync(n: int) -> SoftSync:
  """n-softsync (see :class:`SoftSync`)."""
  return SoftSync(n)


def backup_workers(b: int) -> BackupWorkers:
  """Synchronous SGD with ``b`` backup workers (see :class:`BackupWorkers`)."""
  return BackupWorkers(b)


def adasync(k0: int) -> AdaSync:
  """AdaSync, K-sync with ``K`` raised from ``k0`` by loss feedback (see :class:`AdaSync`)."""
  return AdaSync(k0)


def elastic_bsp(lookahead: int) -> ElasticBSP:
  """ElasticBSP: a barrier every ``<= lookahead`` iterations, placed to minimize waiting (see :class:`ElasticBSP`)."""
  return ElasticBSP(lookahead)


def predictive_cutoff(window: int = 20) -> PredictiveCutoff:
  """Synchronous SGD with a cutoff time predicted from the last ``window`` rounds (see :class:`PredictiveCutoff`)."""
  return PredictiveCutoff(window)


def gba(global_batch: int) -> GBA:
  """Global batch gradients aggregation: ``global_batch`` asynchronous gradients per update (see :class:`GBA`)."""
  return GBA(global_batch)


def pisces(concurrency: int, utility: Any = None, *, beta: float = 0.5, staleness_bound: int | None = None,
           explore: float = 0.9, explore_decay: float = 0.98, min_explore: float = 0.3, window: int = 5,
           selection: str = "pisces", aggregate_every: int | None = None) -> Pisces:
  """Pisces: ``concurrency`` clients at once, chosen by utility and staleness, adaptive pace (see :class:`Pisces`)."""
  return Pisces(concurrency, utility, beta, staleness_bound, explore, explore_decay, min_explore, window, selection,
                aggregate_every)
