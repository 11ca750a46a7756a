"""Jobs that run in a measured process (:func:`tflms.testing.measured.run_measured`), shared by the
test bed's tests and the benchmarks: ``run_measured("tflms.testing.jobs:offload_gpt", {...})``.

:func:`offload_gpt` (the zoo's GPT, plain or with its optimizer or weights offloaded),
:func:`keras_hub_gpt2_fit` (KerasHub's GPT-2 through ``model.fit``), :func:`resnet_steps` (the
zoo's ResNet50 through a step or ``model.fit``, plain or with tflms) and :func:`twoinput_fit` (the
zoo's two-input model with its own ``train_step``): each returns plain JSON data.
"""

from __future__ import annotations

from typing import Any

__all__ = ["keras_hub_gpt2_fit", "offload_gpt", "resnet_steps", "twoinput_fit"]


def offload_gpt(
    layers: int = 8,
    batch: int = 2,
    seq: int = 64,
    offload: bool | str = False,
    steps: int = 3,
    budget: str | None = "64GiB",
    min_bytes: int | None = None,
    serialize: bool | None = None,
    swapout_window: int | str | None = "auto",
) -> dict[str, Any]:
    """The GPT of tflms.testing.zoo with ``layers`` blocks, Adam: one warm-up step and ``steps`` more,
    plain (``tf.function``, the Adam state beside the weights) or with ``offload="optimizer"``
    (``offload=True`` too: the state made on the host worker) or ``offload="weights"`` (the
    model made there as well), through ``tflms.function`` with
    ``budget`` (by default one that swaps nothing: the offload alone; a lower one swaps activations
    too, and ``None`` every candidate; those of ``min_bytes`` or more when given, with the
    memory-aware schedule unless ``serialize=False``; at most ``swapout_window`` swap-outs in
    flight when it is a number, tflms's default ``"auto"``: no limit on a CPU). Returns
    ``losses``, the steady-state measured ``peak`` (warm-up excluded), the ``predicted`` peak of
    the step that ran and the peak of its ``requested`` bytes (the simulator's, without the
    allocator emulation), the median ``step_seconds`` and the weights' bytes."""
    import time

    import numpy as np
    import tensorflow as tf

    from ..config import Knobs
    from ..emulate.simulator import Simulator
    from ..integrations.function import function
    from ..ir.graph import GraphModel
    from ..plan.registry import replay
    from . import testbed
    from .zoo import build

    offload = "optimizer" if offload is True else (offload or None)
    tf.config.experimental.enable_op_determinism()
    # offload="weights": the model is made on the host worker (its weights may not fit the device).
    with tf.device(testbed.HOST if offload == "weights" else testbed.DEVICE):
        model, x, y, step = build("gpt", batch, seq, layers=layers, offload_host=testbed.HOST if offload else None)
    with tf.device(testbed.DEVICE):
        x, y = tf.identity(x), tf.identity(y)
    if offload:
        knobs = {} if min_bytes is None else {"min_bytes": min_bytes}
        knobs.update({} if serialize is None else {"serialize": serialize})
        knobs.update({} if swapout_window == "auto" else {"swapout_window": swapout_window})
        run = function(
            step, device=testbed.DEVICE, host=testbed.HOST, offload=offload, budget=budget, knobs=Knobs(**knobs)
        )
        plan = run.get_plan(x, y)
        # The plan replayed on a plain trace of the step is the step that runs (its peak is the plan's).
        model_of_step = GraphModel.from_func_graph(tf.function(step).get_concrete_function(x, y).graph)
        sim, swaps = Simulator(replay(model_of_step, plan), testbed.HOST), plan.swaps
        predicted = plan.peak_bytes_after
    else:
        run = tf.function(step)
        cf = run.get_concrete_function(x, y)
        sim, swaps = Simulator(GraphModel.from_func_graph(cf.graph), testbed.HOST), ()
        predicted = sim.peak()
    requested = sim.requested_peak(swaps)
    peaks, losses, seconds = [], [], []
    with tf.device(testbed.DEVICE):
        for _ in range(1 + steps):
            testbed.reset_peak()
            start = time.perf_counter()
            losses.append(float(run(x, y)))
            seconds.append(time.perf_counter() - start)
            peaks.append(testbed.memory()["peak"])
    weights = sum(int(np.prod(v.shape)) * 4 for v in model.trainable_variables)
    plan = run.get_plan(x, y) if offload else None
    return {
        "swaps": 0 if plan is None else len(plan.swaps),
        "losses": losses,
        "peak": max(peaks[1:]),
        "peaks": peaks,
        "predicted": int(predicted),
        "requested": int(requested),
        "step_seconds": float(np.median(seconds[1:])),
        "weight_bytes": weights,
    }


def keras_hub_gpt2_fit(lms: bool = True) -> dict[str, Any]:
    """KerasHub's ``GPT2CausalLM`` of :mod:`tflms.testing.keras_hub` (vocabulary 5000, 4 layers, 4 heads,
    hidden 256, random weights) through ``model.fit``: 3 Adam steps of batch 8 (128 tokens), plain or
    with ``LMSCallback`` given the test bed's device and host and nothing else (``budget="auto"``: 0.9
    of the process's cap). Returns per step the measured peak (reset as each step begins) and the
    logged loss, the bytes held once the model and Adam's state were built (``loaded``), and with
    ``lms`` the plan the last step ran: swaps, the swapped tensors' shapes, the predicted peaks, the
    budget, and the plans made again after the first calls (``replans``)."""
    import tensorflow as tf

    from ..integrations.keras import LMSCallback
    from . import testbed
    from .keras_hub import gpt2

    tf.config.experimental.enable_op_determinism()
    case = gpt2()
    peaks: list[int] = []
    losses: list[float] = []

    Meter = _step_meter(peaks, losses)

    out: dict[str, Any] = {"loaded": int(testbed.memory()["current"])}
    callbacks: list[Any] = [Meter()]
    cb = LMSCallback(device=testbed.DEVICE, host=testbed.HOST) if lms else None
    if cb is not None:
        callbacks.insert(0, cb)
    case.model.fit(**case.fit_kwargs(), verbose=0, callbacks=callbacks)
    out.update(peaks=peaks, losses=losses)
    if cb is not None:
        plan = cb.plan
        out.update(
            n_plans=len(cb.plans),
            n_swaps=len(plan.swaps),
            swap_shapes=sorted({tuple(s.shape) for s in plan.swaps if s.shape is not None}),
            swapped_bytes=sum(s.bytes for s in plan.swaps),
            predicted=int(plan.peak_bytes_after),
            predicted_plain=int(plan.peak_bytes_before),
            budget=plan.options.get("budget"),
            budget_text=plan.budget_text,
            # Plans made again after the first calls (budget="auto" learns its margin from measured peaks).
            replans=[{k: r.get(k) for k in ("why", "old_budget", "budget")} for r in getattr(cb.step, "replans", [])],
        )
    return out


def _digest(variables: Any) -> str:
    """One sha1 of the variables' bytes, in order: weights compared across processes, bit for bit."""
    import hashlib

    h = hashlib.sha1()
    for v in variables:
        h.update(v.numpy().tobytes())
    return h.hexdigest()


def _plan_summary(plan: Any) -> dict[str, Any]:
    return {
        "predicted": int(plan.peak_bytes_after),
        "predicted_plain": int(plan.peak_bytes_before),
        "n_swaps": len(plan.swaps),
        "budget": plan.options.get("budget"),
        "reason": plan.reason,
    }


def resnet_steps(
    batch: int = 48, mode: str = "plain", budget: str | None = None, steps: int = 3, size: int = 96
) -> dict[str, Any]:
    """ResNet50 (``size``², Adam) of tflms.testing.zoo trained ``steps`` steps on one batch, all under
    Grappler's memory optimizer at ``MANUAL`` (as tflms calls its steps): ``mode`` ``'plain'``
    (``tf.function`` of the zoo's step), ``'function'`` (``tflms.function`` of it, the test bed's
    device and host and ``budget`` if given), ``'plain_fit'`` (``model.fit`` of the batch repeated
    ``steps`` times, batch ``batch``, no shuffle) or ``'fit'`` (the same with ``LMSCallback``).
    Returns the losses, the measured peak of each step (reset as it begins), one sha1 of every
    variable of the model and of the optimizer before (``initial``) and after the run, and for the
    tflms modes the ``replans`` (:attr:`tflms.LMSFunction.replans`) and the plans made. Where the
    tflms step ran out of memory in every way its recovery tried, ``error`` is the message of
    the error it raised (the digests are those after it: its writes undone); a plain step's
    out-of-memory error propagates (``run_measured``: status ``'oom'``)."""
    import keras
    import numpy as np
    import tensorflow as tf

    from ..integrations.function import function, manual_memory_optimizer
    from ..integrations.keras import LMSCallback
    from . import testbed
    from .zoo import build

    if mode not in ("plain", "function", "plain_fit", "fit"):
        raise ValueError(f"mode must be 'plain', 'function', 'plain_fit' or 'fit'. Received: mode={mode!r}")
    tf.config.experimental.enable_op_determinism()
    model, x, y, step = build("resnet50", batch, size)
    state = [*model.variables, *step.optimizer.variables]
    options = {} if budget is None else {"budget": budget}
    peaks: list[int] = []
    losses: list[float] = []
    out: dict[str, Any] = {"loaded": int(testbed.memory()["current"]), "initial": _digest(state)}
    lms: Any = None
    with manual_memory_optimizer():
        if mode in ("plain", "function"):
            if mode == "plain":
                run = tf.function(step)
            else:
                run = lms = function(step, device=testbed.DEVICE, host=testbed.HOST, **options)
            with tf.device(testbed.DEVICE):
                for _ in range(steps):
                    testbed.reset_peak()
                    try:
                        losses.append(float(run(x, y)))
                    except tf.errors.ResourceExhaustedError as err:
                        if lms is None:
                            raise
                        out["error"] = err.message
                        break
                    peaks.append(int(testbed.memory()["peak"]))
        else:
            Meter = _step_meter(peaks, losses)

            model.compile(
                optimizer=step.optimizer,
                loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                jit_compile=False,
            )
            callbacks: list[Any] = [Meter()]
            cb = None
            if mode == "fit":
                cb = LMSCallback(device=testbed.DEVICE, host=testbed.HOST, **options)
                callbacks.insert(0, cb)
            xs, ys = (np.concatenate([t.numpy()] * steps) for t in (x, y))
            with tf.device(testbed.DEVICE):
                try:
                    model.fit(xs, ys, batch_size=batch, epochs=1, shuffle=False, verbose=0, callbacks=callbacks)
                except tf.errors.ResourceExhaustedError as err:
                    if cb is None:
                        raise
                    out["error"] = err.message
            lms = None if cb is None else cb.step
    out.update(losses=losses, peaks=peaks, weights=_digest(model.variables), state=_digest(state))
    if lms is not None:
        out.update(
            replans=[{k: v for k, v in r.items() if k != "function"} for r in lms.replans],
            plans=[_plan_summary(p) for p in lms.plans],
        )
    return out


def twoinput_fit(lms: bool = True, batch: int = 32, steps: int = 3, size: int = 128) -> dict[str, Any]:
    """The two-input model of tflms.testing.zoo (a ``size``² image and a 64-wide vector, its own
    ``train_step``, Adam, the sparse cross-entropy) trained by ``model.fit`` on numpy data: ``steps``
    batches of ``batch``, plain or with ``LMSCallback`` given the test bed's device and host and
    nothing else. Returns the measured peak of each step (reset as it begins), its largest
    (``peak``), the logged losses and, with ``lms``, the replans and the plans made."""
    import keras
    import numpy as np
    import tensorflow as tf

    from ..integrations.keras import LMSCallback
    from . import testbed
    from .zoo import build

    tf.config.experimental.enable_op_determinism()
    model, _, _, _ = build("twoinput", batch, size)
    model.compile(
        optimizer=keras.optimizers.Adam(1e-3),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        jit_compile=False,
    )
    rng = np.random.default_rng(0)
    n = batch * steps
    images = rng.normal(size=(n, size, size, 3)).astype("float32")
    vectors = rng.normal(size=(n, 64)).astype("float32")
    labels = rng.integers(0, 10, size=(n,)).astype("int32")
    peaks: list[int] = []
    losses: list[float] = []

    Meter = _step_meter(peaks, losses)

    callbacks: list[Any] = [Meter()]
    cb = LMSCallback(device=testbed.DEVICE, host=testbed.HOST) if lms else None
    if cb is not None:
        callbacks.insert(0, cb)
    with tf.device(testbed.DEVICE):
        model.fit((images, vectors), labels, batch_size=batch, epochs=1, shuffle=False, verbose=0, callbacks=callbacks)
    out: dict[str, Any] = {"peaks": peaks, "peak": max(peaks), "losses": losses}
    if cb is not None and cb.step is not None:
        out.update(
            replans=[{k: v for k, v in r.items() if k != "function"} for r in cb.step.replans],
            plans=[_plan_summary(p) for p in cb.plans],
        )
    return out


def _step_meter(peaks: list[int], losses: list[float]) -> type:
    """A Keras callback class that resets the test bed's device peak as each step begins and, as it
    ends, appends the step's measured peak to ``peaks`` and its logged loss to ``losses``."""
    import keras

    from . import testbed

    class Meter(keras.callbacks.Callback):
        def on_train_batch_begin(self, batch: int, logs: dict | None = None) -> None:
            testbed.reset_peak()

        def on_train_batch_end(self, batch: int, logs: dict | None = None) -> None:
            peaks.append(int(testbed.memory()["peak"]))
            losses.append(float((logs or {})["loss"]))

    return Meter
