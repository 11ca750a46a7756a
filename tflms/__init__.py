"""tflms: train TensorFlow models larger than GPU memory by swapping activations to the host.

The data flow, one module a stage::

    trace        tf.function tracing (TensorFlow's)           -> ConcreteFunction
    graph        tflms.graph      GraphModel: networkx DAG of ops, levels, phases
    simulate     tflms.simulator  predicted device memory of a step (+ plan)
    plan         tflms.candidates which tensors may be swapped (only swaps that free memory)
                 tflms.recompute  which candidates to recompute instead (cost model)
                 tflms.sums       gradient sums added as their terms arrive (split_sums)
                 tflms.tiles      gradient tiles of a per-channel value left out (drop_tiles)
                 tflms.planner    SwapPlan (tflms.plan): what to swap, where it comes back
                 tflms.autotune   the plan's knobs for a memory budget
                 tflms.schedule   ordering edges that lower the peak (a memory-aware schedule)
    rewrite      tflms.rewrite    apply a SwapPlan (sum chains, tiles, recompute clones, swap-ins gated on the host)
    rebuild      tflms._tf_internal  a new ConcreteFunction (all private TF use is here)
    integrations tflms.core (optimize, @tflms.function), tflms.keras (LMSCallback),
                 tflms.horovod (horovodrun)
    measure      tflms.testbed, tflms.measure: real device memory without a GPU

Public API (imported lazily: ``import tflms`` does not import TensorFlow until a
name that needs it is used)::

    tflms.function      # tf.function with LMS: @tflms.function(swapout_threshold=40)
    tflms.optimize      # (concrete_function, config) -> (new_concrete_function, plan)
    tflms.LMSConfig     # the validated options
    tflms.LMSCallback   # Keras 3 model.fit: callbacks=[tflms.LMSCallback(...)]
    tflms.SwapPlan      # the plan: summary(), to_json(), from_json()
    tflms.simulate      # predicted device memory of a GraphModel (+ plan)
    tflms.GraphModel    # a traced step as a networkx DiGraph
    tflms.max_batch_size  # largest batch whose predicted peak fits a budget
    tflms.plot_memory   # PNG of the predicted memory timeline before/after a plan (plan.plot(path))
    tflms.testbed       # the real-memory test bed (two processes, no GPU needed)
    tflms.manual_memory_optimizer  # call steps without Grappler's AddN accumulation rewrite
"""

from __future__ import annotations

from ._util import lazy_exports

__version__ = "0.1.0"

# name -> submodule that defines it
_EXPORTS = {
    "BatchSizeResult": "autotune",
    "max_batch_size": "autotune",
    "LMSConfig": "config",
    "LMSFunction": "core",
    "function": "core",
    "manual_memory_optimizer": "core",
    "optimize": "core",
    "resolve_device": "core",
    "BudgetError": "errors",
    "LMSWarning": "errors",
    "TflmsError": "errors",
    "GraphModel": "graph",
    "LMSCallback": "keras",
    "Fence": "plan",
    "Order": "plan",
    "Recompute": "plan",
    "Sum": "sums",
    "Swap": "plan",
    "SwapIn": "plan",
    "SwapPlan": "plan",
    "make_plan": "planner",
    "plot_memory": "plot",
    "MemoryProfile": "simulator",
    "Simulator": "simulator",
    "simulate": "simulator",
}

__all__ = sorted(_EXPORTS) + ["__version__"]


# A submodule not imported yet is imported too (``tflms.autotune.keras_train_step`` after ``import tflms``).
__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS, globals(), submodules=True)
