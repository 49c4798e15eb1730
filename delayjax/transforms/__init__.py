"""What to do with a stale gradient: Optax gradient transformations."""

from delayjax.transforms._adaptive_steps import DelayAdaptiveState as DelayAdaptiveState
from delayjax.transforms._adaptive_steps import delay_adaptive_sgd as delay_adaptive_sgd
from delayjax.transforms._aggregation import AccumulateSumState as AccumulateSumState
from delayjax.transforms._aggregation import accumulate_sum as accumulate_sum
from delayjax.transforms._aggregation import fed_async as fed_async
from delayjax.transforms._aggregation import fed_buff as fed_buff
from delayjax.transforms._async_adam import apam as apam
from delayjax.transforms._async_adam import async_adam as async_adam
from delayjax.transforms._dana import DanaState as DanaState
from delayjax.transforms._dana import dana as dana
from delayjax.transforms._dc_asgd import DelayCompensationState as DelayCompensationState
from delayjax.transforms._dc_asgd import delay_compensation as delay_compensation
from delayjax.transforms._delayed_nesterov import DelayedNesterovState as DelayedNesterovState
from delayjax.transforms._delayed_nesterov import delayed_nesterov as delayed_nesterov
from delayjax.transforms._hooks import NeedsRuntimeInputs as NeedsRuntimeInputs
from delayjax.transforms._hooks import ReadsParams as ReadsParams
from delayjax.transforms._hooks import read_params as read_params
from delayjax.transforms._hooks import runtime_inputs as runtime_inputs
from delayjax.transforms._momentum import explicit_momentum as explicit_momentum
from delayjax.transforms._momentum import implicit_momentum as implicit_momentum
from delayjax.transforms._staleness import scale_by_staleness as scale_by_staleness
from delayjax.transforms._staleness import staleness_weight as staleness_weight
from delayjax.transforms._zeno import ZenoState as ZenoState
from delayjax.transforms._zeno import zeno_plus_plus as zeno_plus_plus
