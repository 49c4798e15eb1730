"""What a worker computes: the worker plug-ins of ``dj.simulate(..., worker=...)``.

``Gradient`` (the default) pushes the minibatch gradient at the parameters it
read, with the inputs a transformation requests; ``LocalSteps`` runs local
optimizer steps and pushes the pseudo-gradient; ``Rollouts`` generates its
batch (rollouts) at the parameters it read and lets the learner correct for
their staleness (asynchronous RL); ``StreamingDiLoCo`` syncs fragments of the
parameters in turn, overlapped with inner steps; ``Byzantine`` is ``Gradient``
with an attack (given workers, or a fraction of the pushes, push a sign-flipped
or random gradient), to test Byzantine-tolerant rules; ``Coded`` pushes a gradient
code's combination of its data parts' gradients, which ``dj.decode_gradient_code``
decodes into the full gradient from any ``k`` of the ``n`` workers. A new kind is a
subclass of ``Worker`` (see ``delayjax.runtime._workers`` for the protocol).
"""

from delayjax.runtime._byzantine import Byzantine as Byzantine
from delayjax.runtime._coded import Coded as Coded
from delayjax.runtime._rollouts import Rollouts as Rollouts
from delayjax.runtime._streaming import StreamingDiLoCo as StreamingDiLoCo
from delayjax.runtime._workers import Gradient as Gradient
from delayjax.runtime._workers import LocalSteps as LocalSteps
from delayjax.runtime._workers import Worker as Worker
from delayjax.runtime._workers import WorkerContext as WorkerContext

__all__ = ["Byzantine", "Coded", "Gradient", "LocalSteps", "Rollouts", "StreamingDiLoCo", "Worker", "WorkerContext"]
