"""tflms: train TensorFlow models larger than the device by rewriting the training step's graph.

One traced step goes through the stages below, each a subpackage of ``tflms`` whose docstring says
what the stage holds; the list is the data flow, and this is the package map:

```text
trace          tf.function's tracing, or Keras's train step (ir/trace.py)     -> ConcreteFunction
ir/            GraphModel: the step as a networkx DAG of ops, levels and phases; the decisions
               a plan is made of (decisions.py: swaps, recomputes, fences, ...)
emulate/       what TensorFlow will do with it: the executor's order (order.py), Grappler's
               constant push-down (grappler.py), oneDNN's fused pairs (fusion.py), the BFC
               allocator (bfc.py); the simulator (simulator.py, static.py, replay.py):
               predicted device memory of the step, with or without a plan
plan/          SwapPlan (records.py), candidates, the ordered pass registry (registry.py):
                 split_sums -> drop_tiles -> recompute -> swaps -> fences -> order_updates
               the passes themselves (passes/: one class a pass, with its planning, its
               replay on the GraphModel and its rewrite of the TensorFlow graph), the
               planner, the autotuner (a budget's knobs) and the capacity search (the
               largest batch)                                                  -> SwapPlan
rewrite/       the plan applied to a copy of the graph: each pass's rewrite, in registry
               order: swap-outs, host-gated swap-ins, clones, ordering edges   -> ConcreteFunction
report/        the predicted memory timeline as a picture, plan summaries
integrations/  tflms.function / tflms.optimize, LMSCallback (one process, or Horovod's mode)
testing/       the test bed, measured processes, your own model measured, the model zoo, the demo
tools/         build_horovod: a Horovod wheel for TensorFlow 2.21
```

Below every stage sit the options (``config.py``), the errors (``errors.py``), device strings
(``_devices.py``) and TensorFlow's private API (``_tf_internal.py``). A module imports only from its
own stage, an earlier one or those (``tests/test_structure.py`` checks it, and that this map names
the stages in that order).

Everything a user calls is re-exported by ``tflms`` itself (``tflms.function``,
``tflms.LMSCallback``, ``tflms.LMSConfig``, ``tflms.Knobs``, ``tflms.SwapPlan``,
``tflms.max_batch_size``, ``tflms.horovod``, ``tflms.testbed``, ...; ``tflms/__init__.pyi`` lists
them); ``import tflms`` imports no TensorFlow until a name that needs it is used.

Examples:
    >>> import tflms
    >>> tflms.LMSConfig().budget
    'auto'
"""

from __future__ import annotations

import lazy_loader

__version__ = "0.1.0"

_getattr, _dir, __all__ = lazy_loader.attach_stub(__name__, __file__)
__all__ = [*__all__, "__version__"]


def __getattr__(name: str) -> object:
    if name not in __all__:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return _getattr(name)


def __dir__() -> list[str]:
    return [*_dir(), "__version__"]
