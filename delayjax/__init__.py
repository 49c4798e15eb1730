"""delayjax: delayed-gradient optimization in JAX.

Optax transformations that decide what to do with a stale gradient, models and
cluster simulations that say where delays come from, and runtimes that train
under them exactly.
"""

from delayjax import analysis as analysis
from delayjax import cluster as cluster
from delayjax import delays as delays
from delayjax import gossip as gossip
from delayjax import problems as problems
from delayjax import topology as topology
from delayjax import workers as workers
from delayjax.runtime import Checkpoint as Checkpoint
from delayjax.runtime import Execution as Execution
from delayjax.runtime import Record as Record
from delayjax.runtime import Runs as Runs
from delayjax.runtime import Sampling as Sampling
from delayjax.runtime import apply_gradients as apply_gradients
from delayjax.runtime import delayed as delayed
from delayjax.runtime import dylu_local_steps as dylu_local_steps
from delayjax.runtime import growing_batches as growing_batches
from delayjax.runtime import simulate as simulate
from delayjax.runtime import simulate_gossip as simulate_gossip
from delayjax.runtime import simulate_pipeline as simulate_pipeline
from delayjax.runtime import staged_value_and_grad as staged_value_and_grad
from delayjax.transforms import accumulate_sum as accumulate_sum
from delayjax.transforms import apam as apam
from delayjax.transforms import apcd as apcd
from delayjax.transforms import asysbcdvr as asysbcdvr
from delayjax.transforms import async_adam as async_adam
from delayjax.transforms import block_coordinate as block_coordinate
from delayjax.transforms import dana as dana
from delayjax.transforms import dana_slim as dana_slim
from delayjax.transforms import dap_sgd as dap_sgd
from delayjax.transforms import dap_svrg as dap_svrg
from delayjax.transforms import decode_gradient_code as decode_gradient_code
from delayjax.transforms import delay_adaptive_sgd as delay_adaptive_sgd
from delayjax.transforms import delay_compensated as delay_compensated
from delayjax.transforms import delay_compensation as delay_compensation
from delayjax.transforms import delayed_nesterov as delayed_nesterov
from delayjax.transforms import explicit_momentum as explicit_momentum
from delayjax.transforms import fed_async as fed_async
from delayjax.transforms import fed_buff as fed_buff
from delayjax.transforms import gem as gem
from delayjax.transforms import GradientCode as GradientCode
from delayjax.transforms import hsag as hsag
from delayjax.transforms import implicit_momentum as implicit_momentum
from delayjax.transforms import mindthestep as mindthestep
from delayjax.transforms import mindthestep_weight as mindthestep_weight
from delayjax.transforms import momentum_compensation as momentum_compensation
from delayjax.transforms import per_fragment as per_fragment
from delayjax.transforms import quantize_float as quantize_float
from delayjax.transforms import Compressor as Compressor
from delayjax.transforms import error_feedback as error_feedback
from delayjax.transforms import message_bytes as message_bytes
from delayjax.transforms import powersgd as powersgd
from delayjax.transforms import qsgd as qsgd
from delayjax.transforms import random_k as random_k
from delayjax.transforms import top_k as top_k
from delayjax.transforms import fragment_of_leaves as fragment_of_leaves
from delayjax.transforms import pipemare as pipemare
from delayjax.transforms import Correction as Correction
from delayjax.transforms import discard_stale as discard_stale
from delayjax.transforms import importance_weighting as importance_weighting
from delayjax.transforms import m2po as m2po
from delayjax.transforms import no_correction as no_correction
from delayjax.transforms import policy_gradient_loss as policy_gradient_loss
from delayjax.transforms import ppo_clip as ppo_clip
from delayjax.transforms import truncated_is as truncated_is
from delayjax.transforms import per_contribution as per_contribution
from delayjax.transforms import prox_asaga as prox_asaga
from delayjax.transforms import prox_box as prox_box
from delayjax.transforms import prox_elastic_net as prox_elastic_net
from delayjax.transforms import prox_l1 as prox_l1
from delayjax.transforms import proximal as proximal
from delayjax.transforms import prox_svrcd as prox_svrcd
from delayjax.transforms import prox_svrg as prox_svrg
from delayjax.transforms import read_params as read_params
from delayjax.transforms import runtime_inputs as runtime_inputs
from delayjax.transforms import saga as saga
from delayjax.transforms import scale_by_staleness as scale_by_staleness
from delayjax.transforms import spectrain as spectrain
from delayjax.transforms import staleness_weight as staleness_weight
from delayjax.transforms import svrg as svrg
from delayjax.transforms import tap_sgd as tap_sgd
from delayjax.transforms import worker_capacity as worker_capacity
from delayjax.transforms import weight_prediction as weight_prediction
from delayjax.transforms import zeno_plus_plus as zeno_plus_plus

__version__ = "0.1.0"

__all__ = [
    "__version__",
    "accumulate_sum",
    "analysis",
    "apam",
    "apcd",
    "apply_gradients",
    "async_adam",
    "asysbcdvr",
    "block_coordinate",
    "Checkpoint",
    "cluster",
    "dana",
    "dana_slim",
    "dap_sgd",
    "dap_svrg",
    "decode_gradient_code",
    "delay_adaptive_sgd",
    "delay_compensated",
    "delay_compensation",
    "delayed",
    "delayed_nesterov",
    "delays",
    "dylu_local_steps",
    "Execution",
    "explicit_momentum",
    "fed_async",
    "fed_buff",
    "gem",
    "gossip",
    "GradientCode",
    "growing_batches",
    "hsag",
    "implicit_momentum",
    "mindthestep",
    "mindthestep_weight",
    "momentum_compensation",
    "per_contribution",
    "pipemare",
    "problems",
    "prox_asaga",
    "prox_box",
    "prox_elastic_net",
    "prox_l1",
    "proximal",
    "prox_svrcd",
    "prox_svrg",
    "read_params",
    "Record",
    "Runs",
    "runtime_inputs",
    "saga",
    "Sampling",
    "scale_by_staleness",
    "simulate",
    "simulate_gossip",
    "simulate_pipeline",
    "spectrain",
    "staged_value_and_grad",
    "staleness_weight",
    "svrg",
    "tap_sgd",
    "topology",
    "worker_capacity",
    "workers",
    "weight_prediction",
    "zeno_plus_plus",
    "Correction",
    "discard_stale",
    "importance_weighting",
    "m2po",
    "no_correction",
    "policy_gradient_loss",
    "ppo_clip",
    "truncated_is",
    "fragment_of_leaves",
    "per_fragment",
    "quantize_float",
    "Compressor",
    "error_feedback",
    "message_bytes",
    "powersgd",
    "qsgd",
    "random_k",
    "top_k",
]
