"""How it runs: the drop-in ``delayed`` wrapper and the wave-parallel simulator."""

from delayjax.runtime._batch_growth import batch_growth as batch_growth
from delayjax.runtime._batch_growth import growing_batches as growing_batches
from delayjax.runtime._delayed import DelayedState as DelayedState
from delayjax.runtime._delayed import delayed as delayed
from delayjax.runtime._flax import apply_gradients as apply_gradients
from delayjax.runtime._local import dylu_local_steps as dylu_local_steps
from delayjax.runtime._options import Checkpoint as Checkpoint
from delayjax.runtime._options import Execution as Execution
from delayjax.runtime._options import Record as Record
from delayjax.runtime._options import Runs as Runs
from delayjax.runtime._options import Sampling as Sampling
from delayjax.runtime._pipeline import PipelineHistory as PipelineHistory
from delayjax.runtime._pipeline import PipelineResult as PipelineResult
from delayjax.runtime._pipeline import simulate_pipeline as simulate_pipeline
from delayjax.runtime._pipeline import staged_value_and_grad as staged_value_and_grad
from delayjax.runtime._replicas import GossipHistory as GossipHistory
from delayjax.runtime._replicas import GossipResult as GossipResult
from delayjax.runtime._replicas import simulate_gossip as simulate_gossip
from delayjax.runtime._sampling import minibatch_indices as minibatch_indices
from delayjax.runtime._sampling import server_minibatch_indices as server_minibatch_indices
from delayjax.runtime._simulate import History as History
from delayjax.runtime._simulate import SimulationResult as SimulationResult
from delayjax.runtime._simulate import schedule_from_delays as schedule_from_delays
from delayjax.runtime._simulate import simulate as simulate

__all__ = [
    "apply_gradients",
    "batch_growth",
    "Checkpoint",
    "delayed",
    "DelayedState",
    "dylu_local_steps",
    "Execution",
    "GossipHistory",
    "GossipResult",
    "growing_batches",
    "History",
    "minibatch_indices",
    "PipelineHistory",
    "PipelineResult",
    "Record",
    "Runs",
    "Sampling",
    "schedule_from_delays",
    "server_minibatch_indices",
    "simulate",
    "simulate_gossip",
    "simulate_pipeline",
    "SimulationResult",
    "staged_value_and_grad",
]
