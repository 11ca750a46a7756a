from . import horovod, testbed
from .config import Knobs, LMSConfig
from .emulate.simulator import MemoryProfile, Simulator, simulate
from .errors import BudgetError, LMSWarning, TflmsError
from .integrations.function import LMSFunction, function, manual_memory_optimizer, optimize, resolve_device
from .integrations.keras import LMSCallback
from .integrations.offload import build_optimizer, place_weights
from .ir.decisions import Fence, Order, Recompute, Swap, SwapIn
from .ir.graph import GraphModel
from .plan.capacity import BatchSizeResult, max_batch_size
from .plan.planner import make_plan
from .plan.records import SwapPlan
from .report.plot import plot_memory, plot_plan

__version__: str
