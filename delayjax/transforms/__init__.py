"""What to do with a stale gradient: Optax gradient transformations."""

from delayjax.transforms._adaptive_steps import DelayAdaptiveState as DelayAdaptiveState
from delayjax.transforms._adaptive_steps import delay_adaptive_sgd as delay_adaptive_sgd
from delayjax.transforms._aggregation import AccumulateSumState as AccumulateSumState
from delayjax.transforms._aggregation import accumulate_sum as accumulate_sum
from delayjax.transforms._aggregation import fed_async as fed_async
from delayjax.transforms._aggregation import fed_buff as fed_buff
from delayjax.transforms._async_adam import apam as apam
from delayjax.transforms._async_adam import async_adam as async_adam
from delayjax.transforms._block_coordinate import BlockCoordinateState as BlockCoordinateState
from delayjax.transforms._block_coordinate import apcd as apcd
from delayjax.transforms._block_coordinate import asysbcdvr as asysbcdvr
from delayjax.transforms._block_coordinate import block_coordinate as block_coordinate
from delayjax.transforms._block_coordinate import block_index as block_index
from delayjax.transforms._coded import GradientCode as GradientCode
from delayjax.transforms._coded import GradientCodeState as GradientCodeState
from delayjax.transforms._coded import decode_gradient_code as decode_gradient_code
from delayjax.transforms._dap import DapSgd as DapSgd
from delayjax.transforms._dap import dap_sgd as dap_sgd
from delayjax.transforms._dap import dap_svrg as dap_svrg
from delayjax.transforms._dap import tap_sgd as tap_sgd
from delayjax.transforms._dana import DanaSlimState as DanaSlimState
from delayjax.transforms._dana import DanaState as DanaState
from delayjax.transforms._dana import dana as dana
from delayjax.transforms._dana import dana_slim as dana_slim
from delayjax.transforms._dc_asgd import DelayCompensatedState as DelayCompensatedState
from delayjax.transforms._dc_asgd import DelayCompensationState as DelayCompensationState
from delayjax.transforms._dc_asgd import PerWorkerDelayCompensationState as PerWorkerDelayCompensationState
from delayjax.transforms._dc_asgd import delay_compensated as delay_compensated
from delayjax.transforms._dc_asgd import delay_compensation as delay_compensation
from delayjax.transforms._delayed_nesterov import DelayedNesterovState as DelayedNesterovState
from delayjax.transforms._delayed_nesterov import delayed_nesterov as delayed_nesterov
from delayjax.transforms._fragments import PerFragmentState as PerFragmentState
from delayjax.transforms._fragments import fragment_of_leaves as fragment_of_leaves
from delayjax.transforms._fragments import per_fragment as per_fragment
from delayjax.transforms._gem import GemState as GemState
from delayjax.transforms._gem import gem as gem
from delayjax.transforms._hooks import CountsContributions as CountsContributions
from delayjax.transforms._hooks import HasWorkerRows as HasWorkerRows
from delayjax.transforms._hooks import KeepsDelayWindow as KeepsDelayWindow
from delayjax.transforms._hooks import NeedsRuntimeInputs as NeedsRuntimeInputs
from delayjax.transforms._hooks import ReadsParams as ReadsParams
from delayjax.transforms._hooks import check_schedule as check_schedule
from delayjax.transforms._hooks import read_params as read_params
from delayjax.transforms._hooks import runtime_inputs as runtime_inputs
from delayjax.transforms._hooks import worker_capacity as worker_capacity
from delayjax.transforms._mindthestep import mindthestep as mindthestep
from delayjax.transforms._mindthestep import mindthestep_weight as mindthestep_weight
from delayjax.transforms._momentum import explicit_momentum as explicit_momentum
from delayjax.transforms._momentum import implicit_momentum as implicit_momentum
from delayjax.transforms._momentum_compensation import MomentumCompensationState as MomentumCompensationState
from delayjax.transforms._momentum_compensation import momentum_compensation as momentum_compensation
from delayjax.transforms._pipeline_remedies import PipeMareCorrectionState as PipeMareCorrectionState
from delayjax.transforms._pipeline_remedies import PipeMareState as PipeMareState
from delayjax.transforms._pipeline_remedies import ReadsStageWeights as ReadsStageWeights
from delayjax.transforms._pipeline_remedies import SpecTrainState as SpecTrainState
from delayjax.transforms._pipeline_remedies import pipemare as pipemare
from delayjax.transforms._pipeline_remedies import spectrain as spectrain
from delayjax.transforms._pipeline_remedies import stage_read as stage_read
from delayjax.transforms._off_policy import Correction as Correction
from delayjax.transforms._off_policy import discard_stale as discard_stale
from delayjax.transforms._off_policy import importance_weighting as importance_weighting
from delayjax.transforms._off_policy import m2po as m2po
from delayjax.transforms._off_policy import no_correction as no_correction
from delayjax.transforms._off_policy import policy_gradient_loss as policy_gradient_loss
from delayjax.transforms._off_policy import ppo_clip as ppo_clip
from delayjax.transforms._off_policy import truncated_is as truncated_is
from delayjax.transforms._per_contribution import PerContributionState as PerContributionState
from delayjax.transforms._per_contribution import per_contribution as per_contribution
from delayjax.transforms._quantize import quantize_float as quantize_float
from delayjax.transforms._compression import Compressor as Compressor
from delayjax.transforms._compression import ErrorFeedbackState as ErrorFeedbackState
from delayjax.transforms._compression import PerWorkerErrorFeedbackState as PerWorkerErrorFeedbackState
from delayjax.transforms._compression import PerWorkerPowerSgdState as PerWorkerPowerSgdState
from delayjax.transforms._compression import PowerSgdState as PowerSgdState
from delayjax.transforms._compression import RandomKeyState as RandomKeyState
from delayjax.transforms._compression import error_feedback as error_feedback
from delayjax.transforms._compression import message_bytes as message_bytes
from delayjax.transforms._compression import powersgd as powersgd
from delayjax.transforms._compression import qsgd as qsgd
from delayjax.transforms._compression import random_k as random_k
from delayjax.transforms._compression import top_k as top_k
from delayjax.transforms._hsag import HsagState as HsagState
from delayjax.transforms._hsag import hsag as hsag
from delayjax.transforms._prox_asaga import ProxAsagaState as ProxAsagaState
from delayjax.transforms._prox_asaga import prox_asaga as prox_asaga
from delayjax.transforms._proximal import ProximalState as ProximalState
from delayjax.transforms._proximal import prox_box as prox_box
from delayjax.transforms._proximal import prox_elastic_net as prox_elastic_net
from delayjax.transforms._proximal import prox_l1 as prox_l1
from delayjax.transforms._proximal import proximal as proximal
from delayjax.transforms._prox_svrg import prox_svrcd as prox_svrcd
from delayjax.transforms._prox_svrg import prox_svrg as prox_svrg
from delayjax.transforms._staleness import scale_by_staleness as scale_by_staleness
from delayjax.transforms._staleness import staleness_weight as staleness_weight
from delayjax.transforms._variance_reduction import SagaScalarsState as SagaScalarsState
from delayjax.transforms._variance_reduction import SagaState as SagaState
from delayjax.transforms._variance_reduction import SvrgState as SvrgState
from delayjax.transforms._variance_reduction import saga as saga
from delayjax.transforms._variance_reduction import svrg as svrg
from delayjax.transforms._weight_prediction import WeightPredictionState as WeightPredictionState
from delayjax.transforms._weight_prediction import weight_prediction as weight_prediction
from delayjax.transforms._zeno import ZenoState as ZenoState
from delayjax.transforms._zeno import zeno_plus_plus as zeno_plus_plus

__all__ = [
    "accumulate_sum",
    "AccumulateSumState",
    "apam",
    "apcd",
    "async_adam",
    "asysbcdvr",
    "block_coordinate",
    "block_index",
    "BlockCoordinateState",
    "check_schedule",
    "CountsContributions",
    "dana",
    "dana_slim",
    "DanaSlimState",
    "DanaState",
    "dap_sgd",
    "dap_svrg",
    "DapSgd",
    "decode_gradient_code",
    "delay_adaptive_sgd",
    "delay_compensated",
    "DelayCompensatedState",
    "delay_compensation",
    "DelayAdaptiveState",
    "DelayCompensationState",
    "delayed_nesterov",
    "DelayedNesterovState",
    "explicit_momentum",
    "fed_async",
    "fed_buff",
    "gem",
    "GemState",
    "GradientCode",
    "GradientCodeState",
    "HasWorkerRows",
    "hsag",
    "HsagState",
    "implicit_momentum",
    "KeepsDelayWindow",
    "mindthestep",
    "mindthestep_weight",
    "momentum_compensation",
    "MomentumCompensationState",
    "NeedsRuntimeInputs",
    "per_contribution",
    "PerContributionState",
    "PerWorkerDelayCompensationState",
    "pipemare",
    "PipeMareCorrectionState",
    "PipeMareState",
    "prox_asaga",
    "prox_box",
    "prox_elastic_net",
    "prox_l1",
    "ProxAsagaState",
    "proximal",
    "prox_svrcd",
    "prox_svrg",
    "ProximalState",
    "quantize_float",
    "Compressor",
    "ErrorFeedbackState",
    "PerWorkerErrorFeedbackState",
    "PerWorkerPowerSgdState",
    "PowerSgdState",
    "RandomKeyState",
    "error_feedback",
    "message_bytes",
    "powersgd",
    "qsgd",
    "random_k",
    "top_k",
    "read_params",
    "ReadsParams",
    "ReadsStageWeights",
    "runtime_inputs",
    "saga",
    "SagaScalarsState",
    "SagaState",
    "scale_by_staleness",
    "spectrain",
    "SpecTrainState",
    "stage_read",
    "staleness_weight",
    "svrg",
    "SvrgState",
    "tap_sgd",
    "worker_capacity",
    "weight_prediction",
    "WeightPredictionState",
    "zeno_plus_plus",
    "ZenoState",
    "Correction",
    "discard_stale",
    "importance_weighting",
    "m2po",
    "no_correction",
    "policy_gradient_loss",
    "ppo_clip",
    "truncated_is",
    "PerFragmentState",
    "fragment_of_leaves",
    "per_fragment",
]
