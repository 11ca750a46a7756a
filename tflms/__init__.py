"""tflms: train TensorFlow models larger than GPU memory by swapping activations to the host.

Public API::

    tflms.function      # tf.function with LMS: @tflms.function(swapout_threshold=40)
    tflms.optimize      # (concrete_function, config) -> (new_concrete_function, plan)
    tflms.LMSConfig     # the validated options
    tflms.LMSCallback   # Keras 3 model.fit: callbacks=[tflms.LMSCallback(...)]
    tflms.SwapPlan      # the plan: summary(), to_json(), from_json()
    tflms.simulate      # predicted device memory of a GraphModel (+ plan)
    tflms.GraphModel    # a traced step as a networkx DiGraph
"""

from .config import LMSConfig
from .core import LMSFunction, function, optimize, resolve_device
from .errors import LMSWarning
from .graph import GraphModel
from .keras import LMSCallback
from .plan import Swap, SwapIn, SwapPlan
from .planner import make_plan
from .simulator import MemoryProfile, simulate

__version__ = "0.1.0"

__all__ = [
    "LMSCallback",
    "LMSConfig",
    "LMSFunction",
    "LMSWarning",
    "GraphModel",
    "MemoryProfile",
    "Swap",
    "SwapIn",
    "SwapPlan",
    "function",
    "make_plan",
    "optimize",
    "resolve_device",
    "simulate",
    "__version__",
]
