"""tflms: train TensorFlow models larger than the device by rewriting the training step's graph.

The package follows the pipeline, one subpackage a stage::

    ir/            GraphModel: the traced step as a networkx DAG of ops and tensors; the
                   decisions a plan is made of, as frozen data
    emulate/       what TensorFlow will do with it: executor order, Grappler and oneDNN rules,
                   the BFC allocator, the memory simulator
    plan/          SwapPlan (records), candidates, the ordered pass registry
                   (plan/passes), the planner and the autotuner (budget and batch-size search)
    rewrite/       apply a plan to a copy of the TensorFlow graph (host-gated swap-ins)
    report/        plots of predicted memory
    integrations/  tflms.function, LMSCallback, Horovod
    testing/       the two-process test bed, the measurement harness, the model zoo, the demo
    tools/         build_horovod: a Horovod wheel for TensorFlow 2.21

This module only re-exports (``tflms/__init__.pyi`` lists the names); ``import tflms``
imports no TensorFlow until a name that needs it is used.

Example:
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
