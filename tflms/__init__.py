"""tflms: train TensorFlow models larger than GPU memory by swapping activations to the host.

Public API::

    tflms.function      # tf.function with LMS: @tflms.function(swapout_threshold=40)
    tflms.optimize      # (concrete_function, config) -> (new_concrete_function, plan)
    tflms.LMSConfig     # the validated options
    tflms.LMSCallback   # Keras 3 model.fit: callbacks=[tflms.LMSCallback(...)]
    tflms.SwapPlan      # the plan: summary(), to_json(), from_json()
    tflms.simulate      # predicted device memory of a GraphModel (+ plan)
    tflms.GraphModel    # a traced step as a networkx DiGraph
    tflms.max_batch_size  # largest batch whose predicted peak fits a budget
    tflms.plot_memory   # PNG of the predicted memory timeline before/after a plan (plan.plot(path))
"""

from .autotune import BatchSizeResult, max_batch_size
from .config import LMSConfig
from .core import LMSFunction, function, optimize, resolve_device
from .errors import BudgetError, LMSWarning
from .graph import GraphModel
from .keras import LMSCallback
from .plan import Swap, SwapIn, SwapPlan
from .planner import make_plan
from .plot import plot_memory
from .simulator import MemoryProfile, Simulator, simulate

__version__ = "0.1.0"

__all__ = [
    "LMSCallback",
    "BatchSizeResult",
    "BudgetError",
    "LMSConfig",
    "LMSFunction",
    "LMSWarning",
    "GraphModel",
    "MemoryProfile",
    "Simulator",
    "Swap",
    "SwapIn",
    "SwapPlan",
    "function",
    "make_plan",
    "max_batch_size",
    "optimize",
    "plot_memory",
    "resolve_device",
    "simulate",
    "__version__",
]
