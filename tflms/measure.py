"""Measure a training step's real device peak on the test bed, next to the prediction.

:func:`measure_step` runs inside a measured process (see :mod:`tflms.testbed`):
it builds one of :data:`MODELS` with fixed seeds and synthetic data, traces an
Adam training step, optionally rewrites it with tflms (device
:data:`tflms.testbed.DEVICE`, host :data:`tflms.testbed.HOST`), trains a few
steps and returns the measured peak of each step, the losses and the simulator's
predictions, as plain JSON data. :func:`measure` starts such a process for you::

    >>> r = measure("cnn", batch=8, steps=2)                      # doctest: +SKIP
    >>> r.value["plain"]["peak"], r.value["lms"]["peak"], r.value["lms"]["predicted"]  # doctest: +SKIP

Used by the real-memory tests, ``benchmarks/simulator_accuracy.py``,
``benchmarks/testbed_capacity.py`` and ``tflms demo``.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from .config import check_int
from .testbed import MeasuredResult, run_measured

__all__ = ["MODELS", "build", "measure_step", "measure"]


def _cnn(size: int) -> Any:
    import keras

    L = keras.layers
    layers: list[Any] = [keras.Input((size, size, 3))]
    for filters in (32, 32, 64, 64, 128):
        layers += [L.Conv2D(filters, 3, padding="same"), L.BatchNormalization(), L.ReLU()]
        if filters != 32 or len(layers) > 4:
            layers.append(L.MaxPooling2D())
    layers += [L.GlobalAveragePooling2D(), L.Dense(10)]
    return keras.Sequential(layers)


def _resnet50(size: int) -> Any:
    import keras

    return keras.applications.ResNet50(
        weights=None, input_shape=(size, size, 3), classes=10, classifier_activation=None
    )


def _densenet121(size: int) -> Any:
    import keras

    return keras.applications.DenseNet121(
        weights=None, input_shape=(size, size, 3), classes=10, classifier_activation=None
    )


def _transformer(seq: int, dim: int = 256, heads: int = 8, layers: int = 2) -> Any:
    import keras

    L = keras.layers
    inp = keras.Input((seq, dim))
    h = inp
    for _ in range(layers):
        a = L.MultiHeadAttention(num_heads=heads, key_dim=dim // heads)(h, h)
        h = L.LayerNormalization()(h + a)
        f = L.Dense(dim * 4, activation="gelu")(h)
        h = L.LayerNormalization()(h + L.Dense(dim)(f))
    out = L.Dense(10)(L.GlobalAveragePooling1D()(h))
    return keras.Model(inp, out)


#: name -> (builder(size), default size, input shape from size). ``size`` is the image
#: side for CNNs and the sequence length for the transformer (width 256, 2 blocks).
MODELS: dict[str, tuple[Callable[[int], Any], int, Callable[[int], tuple[int, ...]]]] = {
    "cnn": (_cnn, 64, lambda s: (s, s, 3)),
    "resnet50": (_resnet50, 96, lambda s: (s, s, 3)),
    "densenet121": (_densenet121, 64, lambda s: (s, s, 3)),
    "transformer": (_transformer, 256, lambda s: (s, 256)),
}


def build(name: str, batch: int, size: int | None = None, seed: int = 0) -> tuple[Any, Any, Any, Callable]:
    """``(model, x, y, train_step)`` for a model of :data:`MODELS`, seeded and deterministic."""
    import keras
    import numpy as np
    import tensorflow as tf

    if name not in MODELS:
        raise ValueError(f"unknown model for measuring; use one of {', '.join(MODELS)}. Received: name={name!r}")
    builder, default, shape_of = MODELS[name]
    size = size or default
    keras.utils.set_random_seed(seed)
    model = builder(size)
    optimizer = keras.optimizers.Adam(1e-3)
    optimizer.build(model.trainable_variables)
    loss_fn = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    rng = np.random.default_rng(seed)
    x = tf.constant(rng.normal(size=(batch, *shape_of(size))).astype("float32"))
    y = tf.constant(rng.integers(0, 10, size=(batch,)).astype("int32"))

    def train_step(x: Any, y: Any) -> Any:
        with tf.GradientTape() as tape:
            loss = loss_fn(y, model(x, training=True))
        grads = tape.gradient(loss, model.trainable_variables)
        optimizer.apply_gradients(zip(grads, model.trainable_variables))
        return loss

    train_step.optimizer = optimizer
    return model, x, y, train_step


def measure_step(
    model: str,
    batch: int,
    size: int | None = None,
    modes: tuple[str, ...] | list[str] = ("plain", "lms"),
    steps: int = 3,
    options: dict[str, Any] | None = None,
    warmup: int = 1,
) -> dict[str, Any]:
    """Train ``warmup + steps`` steps of ``model`` per mode in this measured process; return measurements.

    ``modes`` are ``'plain'`` (the traced step as is) and ``'lms'`` (rewritten by
    :func:`tflms.optimize` with ``options``, device :data:`~tflms.testbed.DEVICE`, host
    :data:`~tflms.testbed.HOST`). Every mode starts from the same weights and optimizer
    state, in this one process: TensorFlow's CPU kernels are not bit-reproducible across
    processes here (plain steps of ResNet50 differ in the 6th digit from one process to
    the next), so only runs in one process can be compared exactly.

    The first ``warmup`` steps are not counted in ``peak``: a function's first call
    instantiates it (on the test bed also its host half, in the host process), and the
    rewritten step's first peak measured up to 1.8x its later ones (ResNet50 96² b48:
    926 MiB, then 509-604 MiB), while the plain step's first peak was the lowest.

    Returns ``{'model', 'batch', 'size', 'plain_predicted', MODE: {...}}`` where each mode
    has ``peak`` (the steady-state peak: the largest measured per-step peak after the
    warm-up, bytes), ``first_peak``, ``peaks`` and ``losses`` (every step, the warm-up
    included), ``step_seconds``, ``predicted`` (the simulator's peak of the step that ran) and, for
    ``'lms'``, ``n_swaps``, ``n_swap_ins``, ``swapped_bytes`` and the plan's ``options``.
    ``'lms_device_gated'`` applies the same plan with the swap-ins on the device (as tflms
    0.1 did; see :func:`tflms.rewrite.apply_plan`): the negative control.
    ``'lms_recompute'`` is ``'lms'`` with ``recompute=True`` (:mod:`tflms.recompute`);
    its entry also has ``n_recomputes`` and ``recomputed_bytes``. Every ``lms`` mode's entry
    has the plan's predicted ``link_seconds`` and ``recompute_seconds``.
    """
    import tensorflow as tf

    from . import _tf_internal as tfi
    from . import testbed
    from .core import optimize
    from .graph import GraphModel
    from .rewrite import apply_plan
    from .simulator import Simulator

    check_int("steps", steps, 1)
    check_int("warmup", warmup, 0)
    unknown = sorted(set(modes) - {"plain", "lms", "lms_device_gated", "lms_recompute"})
    if unknown or not modes:
        raise ValueError(
            "modes must be a non-empty list of 'plain', 'lms', 'lms_device_gated' and 'lms_recompute'. "
            f"Received: modes={modes!r}"
        )
    tf.config.experimental.enable_op_determinism()
    keras_model, x, y, train_step = build(model, batch, size)
    state = list(keras_model.variables) + list(train_step.optimizer.variables)
    initial = [v.numpy() for v in state]
    cf = tf.function(train_step).get_concrete_function(x, y)
    plain_predicted = Simulator(GraphModel.from_func_graph(cf.graph)).peak()
    result: dict[str, Any] = {
        "model": model,
        "batch": batch,
        "size": size or MODELS[model][1],
        "plain_predicted": plain_predicted,
    }
    for i, mode in enumerate(modes):
        for v, value in zip(state, initial):
            v.assign(value)
        entry: dict[str, Any] = {}
        step = cf
        if mode.startswith("lms"):
            extra = {"recompute": True} if mode == "lms_recompute" else {}
            step, plan = optimize(cf, device=testbed.DEVICE, host=testbed.HOST, **{**(options or {}), **extra})
            if mode == "lms_device_gated":  # the negative control: tflms 0.1's swap-in placement
                graph = tfi.copy_graph(cf)
                apply_plan(graph, plan, testbed.DEVICE, testbed.HOST, swap_in_on="device")
                step = tfi.rebuild(cf, graph)
            entry.update(
                predicted=plan.peak_bytes_after,
                n_swaps=len(plan.swaps),
                n_swap_ins=plan.n_swap_ins,
                swapped_bytes=plan.swapped_bytes,
                n_recomputes=len(plan.recomputes),
                recomputed_bytes=plan.recomputed_bytes,
                link_seconds=plan.link_seconds,
                recompute_seconds=plan.recompute_seconds,
                options=dict(plan.options),
            )
        else:
            entry["predicted"] = plain_predicted
        peaks, losses, seconds = [], [], []
        for _ in range(warmup + steps):
            testbed.reset_peak()
            t0 = time.perf_counter()
            with tf.device(testbed.DEVICE):
                loss = float(step(x, y).numpy())
            seconds.append(time.perf_counter() - t0)
            peaks.append(testbed.memory()["peak"])
            losses.append(loss)
        entry.update(peak=max(peaks[warmup:]), first_peak=peaks[0], peaks=peaks, losses=losses, step_seconds=seconds)
        result[mode if mode not in result else f"{mode}_{i}"] = entry
    return result


def measure(
    model: str, batch: int, *, cap: int | str | None = None, timeout: float = 1800.0, **kwargs: Any
) -> MeasuredResult:
    """:func:`measure_step` in a fresh measured process (see :func:`tflms.testbed.run_measured`)."""
    return run_measured(
        "tflms.measure:measure_step", {"model": model, "batch": batch, **kwargs}, cap=cap, timeout=timeout
    )
