"""``model.fit`` under ``horovodrun``: :class:`HorovodLMSCallback`, :class:`tflms.LMSCallback`
with ``horovod=True`` and Horovod's own options (the behaviour is
:class:`tflms.integrations.horovod.fit.HorovodFit`'s)."""

from __future__ import annotations

from typing import Any

from ...config import LMSConfig
from ..keras import LMSCallback, TrainStep
from .fit import HorovodFit, averaging_train_step

__all__ = ["HorovodLMSCallback", "averaging_train_step"]


class HorovodLMSCallback(LMSCallback):
    """:class:`tflms.LMSCallback` for data-parallel ``model.fit`` under ``horovodrun``.

    ``tflms.LMSCallback(horovod=True, ...)`` makes one of these (as does
    ``tflms.integrations.horovod.HorovodLMSCallback(...)``); arguments, attributes and epoch logs
    are :class:`tflms.LMSCallback`'s, except that ``train_step`` must average the
    gradients itself (see below), ``verbose`` prints on rank 0 only, the memory
    entries of the epoch logs are this rank's own (not averaged like the other
    logs) and ``fingerprint`` is the plan fingerprint that every rank was checked to
    share (``None`` before the first step). Without Horovod initialised, in a
    process not started by ``horovodrun``, it trains exactly like one rank
    (bit for bit like Keras's own ``fit``, plus LMS).

    Start every rank with ``horovodrun``, call :func:`tflms.integrations.horovod.init` first,
    then ``fit`` as usual. The callback

    * averages the gradients over the ranks inside the rewritten step
      (:func:`averaging_train_step`, i.e. Keras's ``train_step`` plus
      :func:`tflms.integrations.horovod.allreduce_gradients`; loss scaling, ``sample_weight``,
      ``class_weight``, metrics as in Keras). Sparse gradients (``tf.IndexedSlices``,
      e.g. an ``Embedding``'s) are densified and allreduced like the others; pass
      ``sparse_as_dense=False`` to allgather their looked-up rows instead (see
      :func:`tflms.integrations.horovod.allreduce_gradients` for when that moves less);
    * broadcasts rank 0's model and optimizer variables (building the optimizer,
      and a subclassed model that was never called, first) at the first ``fit`` of
      each model in this process, whichever callback object runs it, so ranks may
      build their models from different seeds; a later ``fit`` broadcasts nothing
      (only the variables of a new optimizer after a re-``compile``). To
      re-synchronise weights you changed on one rank, call
      ``tflms.integrations.horovod.broadcast_variables(model.variables + model.optimizer.variables)``;
    * averages the logs over the ranks, in place, at every batch end (one eager
      allreduce of a few numbers per ``train_function`` call) and at every epoch
      end (validation included), so ``History`` is the same on every rank. Place
      it *before* callbacks that read the logs (``EarlyStopping``,
      ``ReduceLROnPlateau``, ``ModelCheckpoint``) so that every rank takes the
      same decision; Keras's own ``History`` and progress bar come after it;
    * silences the progress bar on every rank but 0 (it sets ``verbose`` to 0 in
      the parameters Keras hands the callbacks, before Keras's ``ProgbarLogger``
      reads them);
    * checks, after the first step, that every rank made the same plan
      (:func:`tflms.integrations.horovod.assert_same_plan`), and warns when the traced step
      holds no Horovod allreduce.

    A model compiled with ``run_eagerly=True`` trains without LMS, with a
    :class:`tflms.LMSWarning`, and its gradients are still averaged.

    What stays yours: shard the data so that every rank runs the *same number of
    steps* (a rank with an extra batch waits forever in the allreduce); scale the
    learning rate (e.g. by ``tflms.integrations.horovod.size()``) if you want; save and print on
    rank 0 (:func:`tflms.integrations.horovod.is_root`). Epoch logs are means of the per-rank
    values: exact for mean metrics (loss, accuracy) with equal per-rank batches,
    approximate for others (e.g. AUC, precision). ``BatchNormalization`` moving
    statistics (and other non-trainable state updated in the forward pass) stay
    per rank: each rank normalises with its own batch's statistics and keeps its
    own moving averages, so evaluate/save on rank 0 (or broadcast them).
    ``model.evaluate`` outside ``fit`` returns this rank's numbers: average them
    with ``tflms.integrations.horovod.average_logs(model.evaluate(..., return_dict=True))``. A model
    that overrides ``train_step`` must average its gradients itself, with
    ``grads = tflms.integrations.horovod.allreduce_gradients(grads)`` before
    ``apply_gradients``, and say so with ``train_step=MyModel.train_step``
    (called as ``train_step(model, data)``); the callback then does all the rest.

    Args:
        sparse_as_dense: ``True`` (default): densify ``tf.IndexedSlices`` gradients
            before the allreduce; ``False``: allgather their values and indices. Used
            by :func:`averaging_train_step` only: with a ``train_step=`` of yours, pass
            it to your :func:`tflms.horovod.allreduce_gradients` call instead
            (``sparse_as_dense=False`` with ``train_step=`` raises ``ValueError``).
        config, verbose, train_step, horovod, xla, manual_memory_optimizer, layout_optimizer, options: as
            :class:`tflms.LMSCallback`.

    Raises:
        TypeError, ValueError: as :class:`tflms.LMSCallback`; ``TypeError`` also for a
            ``sparse_as_dense`` that is not a bool; ``ValueError`` also for
            ``horovod=False``, ``sparse_as_dense=False`` with ``train_step=``, and at
            train begin for a model that overrides ``train_step`` (unless
            ``train_step=`` is given) or a distribution strategy with several replicas.
        RuntimeError: in a process started by ``horovodrun`` before
            :func:`tflms.integrations.horovod.init`.
        tflms.integrations.horovod.PlanMismatchError: when the ranks made different plans
            (raised on every rank after the first step).

    Example (``train.py``, run with ``horovodrun -np 2 -H localhost:2 python train.py``)::

        import keras
        import numpy as np
        import tensorflow as tf

        import tflms
        import tflms.integrations.horovod as lms_hvd

        lms_hvd.init()  # first, before TensorFlow initialises the GPUs
        gpus = tf.config.list_physical_devices("GPU")
        if gpus:  # one GPU per rank
            tf.config.set_visible_devices(gpus[lms_hvd.local_rank()], "GPU")

        # The same global data on every rank (replace with yours), then one shard per
        # rank with the same number of whole batches on every rank.
        rng = np.random.default_rng(0)
        x = rng.normal(size=(4096, 64, 64, 3)).astype("float32")
        y = rng.integers(0, 10, size=(4096,))
        batch = 32
        per_rank = len(x) // (lms_hvd.size() * batch) * batch
        lo = lms_hvd.rank() * per_rank
        x, y = x[lo : lo + per_rank], y[lo : lo + per_rank]

        model = keras.applications.ResNet50(weights=None, input_shape=(64, 64, 3), classes=10)
        model.compile(
            optimizer=keras.optimizers.SGD(0.01 * lms_hvd.size(), momentum=0.9),  # LR scaling: yours
            loss="sparse_categorical_crossentropy",
            metrics=["accuracy"],
            jit_compile=False,  # XLA would drop the swap ops
        )
        # = tflms.LMSCallback(horovod=True, ...)
        lms = lms_hvd.HorovodLMSCallback(knobs=tflms.Knobs(swapout_threshold=40), verbose=True)
        history = model.fit(x, y, batch_size=batch, epochs=3, callbacks=[lms])  # the LMS callback first
        # history.history is the same on every rank; only rank 0 printed (and the plan, verbose=True).
        if lms_hvd.is_root():
            print(f"{len(lms.plan.swaps)} tensors swapped per step; history: {history.history}")
            model.save("model.keras")
    """

    def __init__(
        self,
        config: LMSConfig | None = None,
        *,
        sparse_as_dense: bool = True,
        verbose: bool | int = 0,
        train_step: TrainStep | None = None,
        horovod: bool = True,
        xla: str = "disable",
        manual_memory_optimizer: bool = True,
        layout_optimizer: bool = False,
        **options: Any,
    ) -> None:
        if horovod is not True:
            raise ValueError(
                "HorovodLMSCallback always trains under Horovod; use tflms.LMSCallback(horovod=False) instead. "
                f"Received: horovod={horovod!r}"
            )
        mode = HorovodFit(sparse_as_dense)  # checks sparse_as_dense first
        if train_step is not None and not sparse_as_dense:
            raise ValueError(
                "sparse_as_dense=False applies to the callback's own train step, and a train_step= of yours "
                "averages its gradients itself: pass it there, e.g. "
                "`tflms.horovod.allreduce_gradients(grads, sparse_as_dense=False)`. "
                f"Received: sparse_as_dense=False with train_step={train_step!r}"
            )
        calls = {"manual_memory_optimizer": manual_memory_optimizer, "layout_optimizer": layout_optimizer}
        super().__init__(config, verbose=verbose, train_step=train_step, horovod=True, xla=xla, **calls, **options)
        self._mode = mode

    @property
    def sparse_as_dense(self) -> bool:
        """Whether :func:`averaging_train_step` densifies sparse gradients before the allreduce."""
        return self._mode.sparse_as_dense
