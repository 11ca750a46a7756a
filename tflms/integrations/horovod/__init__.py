"""Horovod data parallelism for tflms steps, with Keras 3 variables.

Every rank traces the same step, so tflms plans and rewrites it identically on
every rank (:func:`assert_same_plan` checks that); Horovod's collective ops are
never swapped and never chosen as swap-in triggers (see
:func:`tflms.plan.candidates.is_collective`). Under Horovod, ``tflms.function`` with
``device=None`` uses the local-rank GPU (:func:`tflms.resolve_device`).

Horovod is optional: it is imported lazily, only by the functions that need it,
so ``import tflms.integrations.horovod`` works without it (build it with
``python -m tflms.tools.build_horovod``).

Building blocks (all usable by a custom loop and by a Keras ``fit`` integration).
Without Horovod initialised, in a process not started by ``horovodrun``, each
acts as on a single rank (no collective, no import of Horovod); under
``horovodrun`` before :func:`init` each raises ``RuntimeError``.

* :func:`init`, :func:`rank`, :func:`size`, :func:`local_rank`,
  :func:`local_size`, :func:`is_root`, :func:`is_initialized`: rank helpers
  (``tflms.integrations.horovod.runtime``). ``init(split_cpu=True)`` lets the ranks of a machine
  without GPU swap (each rank's CPU split into ``/device:CPU:1``, the device, and
  ``/device:CPU:0``, the host), to try and test a job.
* :func:`allreduce_gradients`: average a list of gradients with grouped
  allreduces (groups of at most 8 MiB), eagerly or inside a traced step; sparse
  gradients (an ``Embedding``'s ``tf.IndexedSlices``) are densified first unless
  ``sparse_as_dense=False``, which allgathers their rows.
* :class:`DistributedGradientTape`: ``hvd.DistributedGradientTape`` that accepts
  Keras 3 variables (Horovod's raises "'Variable' object has no attribute 'ref'";
  Horovod's own tape also works in a ``@tflms.function`` step when asked for
  ``[v.value for v in model.trainable_variables]``) (``tflms.integrations.horovod.gradients``).
* :func:`broadcast_variables`: ``hvd.broadcast_variables`` that accepts Keras 3
  variables; :func:`backing_variable` (``tflms.integrations.horovod.variables``).
* :func:`average_logs`: average the numeric entries of a Keras ``logs`` dict;
  :func:`allgather_scalar`: one number from every rank (timings, throughput);
  :func:`assert_same_plan`: compare a plan's fingerprint across ranks, raising
  :class:`PlanMismatchError` (``tflms.integrations.horovod.sync``).
* :class:`HorovodLMSCallback`: ``tflms.LMSCallback`` for ``model.fit`` under
  ``horovodrun`` (also what ``tflms.LMSCallback(horovod=True)`` makes), and
  :func:`averaging_train_step`, Keras's ``train_step`` with averaged gradients
  (``tflms.integrations.horovod.callback``; imported, with Keras, on first use).

Example (run with ``horovodrun --gloo -np 2 -H localhost:2 python train.py``)::

    import tflms, tflms.integrations.horovod as lms_hvd
    lms_hvd.init()
    model, opt = make_model(), keras.optimizers.SGD(0.01)
    opt.build(model.trainable_variables)
    lms_hvd.broadcast_variables(model.variables + opt.variables, root_rank=0)

    @tflms.function(knobs=tflms.Knobs(swapout_threshold=40))
    def step(x, y):
        with tf.GradientTape() as tape:
            loss = loss_fn(y, model(x, training=True))
        tape = lms_hvd.DistributedGradientTape(tape)
        grads = tape.gradient(loss, model.trainable_variables)
        opt.apply_gradients(zip(grads, model.trainable_variables))
        return loss

    lms_hvd.assert_same_plan(step.get_plan(x, y))
"""

from __future__ import annotations

from ..._util import lazy_exports
from .gradients import DEFAULT_GROUP_BYTES, DistributedGradientTape, allreduce_gradients
from .runtime import init, is_initialized, is_root, local_rank, local_size, rank, size
from .sync import PlanMismatchError, allgather_scalar, assert_same_plan, average_logs
from .variables import backing_variable, broadcast_variables

# Names of tflms.integrations.horovod.callback, which imports Keras: loaded on first use.
_LAZY = {"HorovodLMSCallback": "callback", "averaging_train_step": "fit"}

__all__ = [
    "PlanMismatchError",
    "allgather_scalar",
    "allreduce_gradients",
    "assert_same_plan",
    "average_logs",
    "averaging_train_step",
    "backing_variable",
    "broadcast_variables",
    "DEFAULT_GROUP_BYTES",
    "DistributedGradientTape",
    "HorovodLMSCallback",
    "init",
    "is_initialized",
    "is_root",
    "local_rank",
    "local_size",
    "rank",
    "size",
]


__getattr__, __dir__ = lazy_exports(__name__, _LAZY, globals())
