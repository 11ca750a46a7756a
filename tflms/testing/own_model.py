"""Measuring your own model on the test bed: :func:`measure_model` trains it plain and with tflms,
per step, each way in its own measured process."""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import importlib
import json
import os
import tempfile
import time
from collections.abc import Callable, Mapping
from typing import Any

from ..config import parse_bytes
from .measured import MeasuredResult, _pickled_request, oom_message, run_measured
from .testbed import TestBedError, devices, memory, reset_peak

__all__ = ["ModelMeasurement", "ModelRun", "WAYS", "measure_model"]

#: What :func:`measure_model` can run: the step as written, and the step rewritten by tflms.
WAYS = ("plain", "lms")


@dataclasses.dataclass(frozen=True)
class ModelRun:
    """One way (``'plain'`` or ``'lms'``) of :func:`measure_model`: its measured process and steps.

    ``status`` is the measured process's (:attr:`MeasuredResult.status`: ``'ok'``,
    ``'oom'``, ``'budget'`` or ``'error'``; ``result`` has its ``error`` output, ``oom``
    report and what it ``raised``). Per step, the warm-up steps included and in order:
    ``peaks`` (bytes: the device's measured peak during the step), ``held`` (bytes in use on
    the device as the step began: weights, optimizer slots, and any input data held in device
    memory), ``losses`` and ``seconds`` (the step's wall time). A run that failed part way
    keeps the steps it finished. ``loaded`` is the device's bytes in use once the factory had
    returned (the model and the data it made, before any step). ``predicted`` and
    ``predicted_plain`` are the simulator's peaks of the rewritten and the plain step
    (``'lms'`` only, from its plan; None otherwise), ``n_swaps`` the plan's number of swapped
    tensors and ``budget_text`` which budget it was made for.
    """

    way: str
    status: str
    result: MeasuredResult
    warmup: int
    peaks: list[int] = dataclasses.field(default_factory=list)
    held: list[int] = dataclasses.field(default_factory=list)
    losses: list[float | None] = dataclasses.field(default_factory=list)
    loaded: int | None = None
    predicted: int | None = None
    predicted_plain: int | None = None
    n_swaps: int | None = None
    seconds: list[float] = dataclasses.field(default_factory=list)
    budget_text: str = ""

    @property
    def ok(self) -> bool:
        return self.status == "ok"

    @property
    def peak(self) -> int | None:
        """The steady-state peak: the largest measured peak after the warm-up steps (None without one)."""
        steady = self.peaks[self.warmup :]
        return max(steady) if steady else None


@dataclasses.dataclass(frozen=True)
class ModelMeasurement:
    """What :func:`measure_model` measured: a :class:`ModelRun` per way, ``runs[way]`` or ``m[way]``."""

    runs: dict[str, ModelRun]
    cap: int | None = None

    def __getitem__(self, way: str) -> ModelRun:
        return self.runs[way]

    def summary(self) -> str:
        """A table: per way its status, steady-state peak, bytes in use as its last step began (before
        any step: once the factory had returned), last loss, predicted peak (``'lms'``), and what went
        wrong where it did.

        >>> r = MeasuredResult("ok")
        >>> m = ModelMeasurement({"plain": ModelRun("plain", "ok", r, 1, [3 << 20, 2 << 20], [1 << 20] * 2,
        ...                                         [0.5, 0.25], 1 << 20)})
        >>> print(m.summary())
        way    status   peak (MiB)   held (MiB)   last loss   predicted (MiB)
        plain  ok              2.0          1.0      0.2500                 -
        """
        mib = lambda n: "-" if n is None else f"{n / 2**20:.1f}"  # noqa: E731
        head = ("way", "status", "peak (MiB)", "held (MiB)", "last loss", "predicted (MiB)")
        lines = ["{:6} {:6} {:>12} {:>12} {:>11} {:>17}".format(*head)]
        for way, run in self.runs.items():
            loss = next((f"{v:.4f}" for v in reversed(run.losses) if v is not None), "-")
            held = run.held[-1] if run.held else run.loaded
            line = f"{way:6} {run.status:6} {mib(run.peak):>12} {mib(held):>12} {loss:>11} {mib(run.predicted):>17}"
            if not run.ok:
                line += f"  ({len(run.peaks)} steps done: {_what_went_wrong(run.result)})"
            lines.append(line)
        return "\n".join(lines)


def _what_went_wrong(result: MeasuredResult) -> str:
    """One line of what a failed measured process said: the out-of-memory line, or the first line of
    what it raised, or the last line of its output."""
    message = (result.raised or {}).get("message", "")
    said = (oom_message(message) or oom_message(result.error)) if result.status == "oom" else None
    if not said:
        lines = [line for line in (message or result.error).splitlines() if line.strip()]
        said = (lines[0] if message else lines[-1]) if lines else ""
    return " ".join(said.split())[:240]


def measure_model(
    factory: str | Callable[..., Any],
    kwargs: Mapping[str, Any] | None = None,
    *,
    steps: int = 3,
    warmup: int = 1,
    cap: int | str | None = None,
    options: Mapping[str, Any] | None = None,
    batch_size: int | None = None,
    ways: tuple[str, ...] | list[str] = WAYS,
    seed: int | None = 0,
    timeout: float = 1800.0,
    gpu: bool = False,
) -> ModelMeasurement:
    """Train your own model on the test bed, plain and with tflms, and measure each step's device peak.

    ``factory`` is ``'package.module:function'`` or a picklable callable (see
    :func:`run_measured`); ``factory(**kwargs)`` runs in the measured process and returns
    either

    * ``(model, x)`` or ``(model, x, y)``: a compiled Keras model and its training data, as
      ``model.fit`` takes them (arrays with ``batch_size`` given here, or a ``tf.data.Dataset``
      of batches as ``x``). It is trained with ``model.fit`` one step per epoch (so each step's
      loss is exact), plain, and with :class:`tflms.LMSCallback` (``options``, and
      ``batch_size``, on this process's device and host). Keras starts data of known size
      again when it runs out; a generator or a dataset of unknown size must yield
      ``warmup + steps`` batches (``Dataset.repeat()`` makes any dataset do); or
    * a training step: a callable ``step(*args)`` that trains one step and returns its loss
      (a scalar; of a tuple, list or dict its first value or its ``'loss'``), alone or as
      ``(step, args)``. It is traced with ``tf.function`` (plain) and :func:`tflms.function`
      (``options``).

    Each way in ``ways`` runs in its own fresh measured process (:func:`run_measured`), under
    ``cap`` if given, so a way that runs out of memory, or dies of it, does not stop the
    others, and the ways do not share memory. ``seed`` (``keras.utils.set_random_seed``, before
    the factory is called) gives every way the same weights and data. Per step the device's
    peak is reset before and read after it. On the test bed the device is this machine's CPU:
    every tensor the factory makes there (a ``tf.constant``, and arrays that ``model.fit``
    converts to tensors) is device memory and counts against ``cap``, where on a GPU the input
    data would stay in host memory: see :attr:`ModelRun.loaded` and :attr:`ModelRun.held`.

    Returns a :class:`ModelMeasurement`: per way a :class:`ModelRun` with its status (``'ok'``,
    ``'oom'``, ``'budget'`` for a :class:`tflms.BudgetError` from ``options['budget']``,
    ``'error'``), per-step peaks and losses, and what it raised. Nothing the factory or the
    training does is raised here; bad arguments are.

    Example (``mypkg/models.py`` defines ``build() -> (model, x, y)``)::

        m = tflms.testbed.measure_model("mypkg.models:build", batch_size=64, cap="2GiB")
        print(m.summary())
        m["plain"].status, m["lms"].peak, m["lms"].losses
    """
    from ..config import CALL_SETTINGS, LMSConfig, check_int

    if isinstance(factory, str):
        if factory.count(":") != 1:
            raise ValueError(
                f"factory must be 'package.module:function' or a picklable callable. Received: factory={factory!r}"
            )
    elif callable(factory):
        _pickled_request(factory, "factory")  # refused here, not in the measured process
    else:
        raise TypeError(
            f"factory must be 'package.module:function' or a picklable callable. Received: factory={factory!r}"
        )
    check_int("steps", steps, 1)
    check_int("warmup", warmup, 0)
    check_int("batch_size", batch_size, 1, allow_none=True)
    check_int("seed", seed, 0, allow_none=True)
    if isinstance(ways, str) or not ways or any(w not in WAYS for w in ways) or len(set(ways)) != len(ways):
        raise ValueError(f"ways must be a non-empty list of distinct ways of {WAYS}. Received: ways={ways!r}")
    if kwargs is not None and not isinstance(kwargs, Mapping):
        raise TypeError(f"kwargs must be a mapping of the factory's keyword arguments. Received: kwargs={kwargs!r}")
    if options is not None and not isinstance(options, Mapping):
        raise TypeError(
            "options must be a mapping of tflms.LMSConfig fields (knobs in 'knobs': tflms.Knobs(...)) and "
            f"call settings of tflms.function. Received: options={options!r}"
        )
    options = dict(options or {})
    taken = sorted({"device", "host"} & set(options))
    if taken:
        raise ValueError(
            f"options must not set {' or '.join(taken)}: measure_model runs the step on the measured process's "
            f"device and host (tflms.testbed.devices()). Received: options={options!r}"
        )
    # Unknown or invalid options, and knobs outside tflms.Knobs, are refused here.
    LMSConfig.from_options(**{k: v for k, v in options.items() if k not in CALL_SETTINGS})
    runs: dict[str, ModelRun] = {}
    for way in ways:
        with tempfile.TemporaryDirectory(prefix="tflms-measure-") as tmp:
            progress = os.path.join(tmp, "steps.jsonl")
            target = functools.partial(
                _measure_way,
                factory,
                dict(kwargs or {}),
                way=way,
                steps=steps,
                warmup=warmup,
                options=options,
                batch_size=batch_size,
                seed=seed,
                progress=progress,
            )
            result = run_measured(target, cap=cap, timeout=timeout, gpu=gpu)
            records = _read_records(progress)
        runs[way] = _model_run(way, result, records, warmup)
    return ModelMeasurement(runs, None if cap is None else parse_bytes(cap, "cap") // 2**20 * 2**20)


def _read_records(path: str) -> list[dict[str, Any]]:
    """The JSON lines a measured process of :func:`measure_model` wrote (the last may be cut off)."""
    records = []
    with contextlib.suppress(FileNotFoundError), open(path) as f:
        for line in f:
            with contextlib.suppress(json.JSONDecodeError):
                records.append(json.loads(line))
    return records


def _model_run(way: str, result: MeasuredResult, records: list[dict[str, Any]], warmup: int) -> ModelRun:
    info: dict[str, Any] = {}
    steps = []
    for record in records:
        if "step" in record:
            steps.append(record)
        else:
            info.update(record)
    return ModelRun(
        way,
        result.status,
        result,
        warmup,
        peaks=[s["peak"] for s in steps],
        held=[s["held"] for s in steps],
        losses=[s["loss"] for s in steps],
        loaded=info.get("loaded"),
        predicted=info.get("predicted"),
        predicted_plain=info.get("predicted_plain"),
        n_swaps=info.get("n_swaps"),
        seconds=[s["seconds"] for s in steps if "seconds" in s],
        budget_text=info.get("budget_text", ""),
    )


def _loss_of(out: Any) -> float | None:
    """A training step's loss from what it returned: a scalar, a dict's ``'loss'``, a sequence's first."""
    if isinstance(out, Mapping):
        out = out.get("loss")
    elif isinstance(out, (tuple, list)):
        out = out[0] if out else None
    try:
        return float(out)
    except (TypeError, ValueError):
        return None


def _measure_way(
    factory: str | Callable[..., Any],
    kwargs: dict[str, Any],
    *,
    way: str,
    steps: int,
    warmup: int,
    options: dict[str, Any],
    batch_size: int | None,
    seed: int | None,
    progress: str,
) -> bool:
    """One way of :func:`measure_model`, in its measured process: build, train, and write a JSON line
    per step (and one of what the run was) to ``progress`` as it goes."""
    import keras

    if seed is not None:
        keras.utils.set_random_seed(seed)
    make = factory
    if isinstance(factory, str):
        module_name, _, attr = factory.partition(":")
        make = getattr(importlib.import_module(module_name), attr)
    device, host = devices()
    log = open(progress, "a", buffering=1)  # line-buffered: what was written survives a crash

    def write(record: dict[str, Any]) -> None:
        log.write(json.dumps(record) + "\n")
        log.flush()

    built = make(**kwargs)
    write({"loaded": memory()["current"]})
    total = warmup + steps
    if isinstance(built, tuple) and built and isinstance(built[0], keras.Model):
        plan = _fit_model(built, way, total, warmup, steps, options, batch_size, device, host, write)
    else:
        plan = _run_step(built, way, total, options, device, host, write)
    if plan is not None:
        write({"predicted": plan.peak_bytes_after, "predicted_plain": plan.peak_bytes_before})
        write({"n_swaps": len(plan.swaps), "budget_text": plan.budget_text})
    log.close()
    return True


def _step_meter(write: Callable[[dict[str, Any]], None]) -> Any:
    """A Keras callback that writes, per training step (``fit`` runs one per epoch), the bytes held
    as it begins, its peak, its loss and its seconds; its ``done`` counts the steps written."""
    import keras

    class StepMeter(keras.callbacks.Callback):
        """Per training step (``fit`` runs one per epoch): the bytes held as it begins, its peak, its loss."""

        def __init__(self) -> None:
            super().__init__()
            self.done = 0
            self.step: dict[str, Any] = {}

        def on_train_batch_begin(self, batch: int, logs: dict | None = None) -> None:
            self.step = {"step": self.done, "held": memory()["current"]}
            reset_peak()
            self.start = time.perf_counter()

        def on_train_batch_end(self, batch: int, logs: dict | None = None) -> None:
            self.step["seconds"] = time.perf_counter() - self.start
            self.step["peak"] = memory()["peak"]

        def on_epoch_end(self, epoch: int, logs: dict | None = None) -> None:
            if "peak" in self.step:  # else no step ran in this epoch: the data ran out
                write({**self.step, "loss": _loss_of(logs or {})})
                self.step = {}
                self.done += 1

    return StepMeter()


def _fit_model(
    built: tuple[Any, ...],
    way: str,
    total: int,
    warmup: int,
    steps: int,
    options: dict[str, Any],
    batch_size: int | None,
    device: str,
    host: str,
    write: Callable[[dict[str, Any]], None],
) -> Any:
    """:func:`_measure_way` for a factory's ``(model, x[, y])``: ``total`` steps of ``model.fit``, one
    an epoch, each written by :func:`_step_meter`; the plan (with ``way == "lms"``) or None."""
    from ..config import Knobs
    from ..integrations.keras import LMSCallback

    if len(built) not in (2, 3):
        raise TypeError(
            "the factory must return (model, x), (model, x, y), a training step or (step, args). "
            f"Received: a tuple of {len(built)}"
        )
    model, x, y = built[0], built[1], built[2] if len(built) == 3 else None
    if not model.compiled:
        raise ValueError(f"the factory's model must be compiled (model.compile). Received: model={model.name!r}")
    meter = _step_meter(write)
    callbacks: list[Any] = [meter]
    lms = None
    if way == "lms":
        lms_options = dict(options)
        knobs = lms_options.get("knobs", Knobs())
        if batch_size and knobs.batch_size is None:
            lms_options["knobs"] = knobs.replace(batch_size=batch_size)
        lms = LMSCallback(device=device, host=host, **lms_options)
        callbacks.insert(0, lms)
    fit_kwargs: dict[str, Any] = {"batch_size": batch_size} if batch_size else {}
    model.fit(x, y, epochs=total, steps_per_epoch=1, shuffle=False, verbose=0, callbacks=callbacks, **fit_kwargs)
    if meter.done < total:
        raise TestBedError(
            f"fit ran {meter.done} of warmup + steps = {total} steps: the factory's data ran out. Keras starts "
            "data of known size (arrays, most datasets) again, but a generator or a dataset of unknown size "
            "must yield warmup + steps batches (Dataset.repeat() makes any dataset do). "
            f"Received: warmup={warmup}, steps={steps}"
        )
    return None if lms is None else lms.plan


def _run_step(
    built: Any,
    way: str,
    total: int,
    options: dict[str, Any],
    device: str,
    host: str,
    write: Callable[[dict[str, Any]], None],
) -> Any:
    """:func:`_measure_way` for a factory's training step or ``(step, args)``: ``total`` calls of the
    step as a ``tf.function`` (with ``way == "lms"``, tflms's), each written; the plan or None."""
    import tensorflow as tf

    from ..integrations.function import function as lms_function

    step, args = built, ()
    if isinstance(built, tuple) and len(built) == 2 and callable(built[0]) and isinstance(built[1], (tuple, list)):
        step, args = built[0], tuple(built[1])
    if not callable(step):
        raise TypeError(
            "the factory must return (model, x), (model, x, y) with a compiled keras.Model, a training "
            f"step or (step, args). Received: {type(built).__name__}"
        )
    fn = lms_function(step, device=device, host=host, **options) if way == "lms" else tf.function(step)
    with tf.device(device):
        for i in range(total):
            held = memory()["current"]
            reset_peak()
            start = time.perf_counter()
            loss = _loss_of(fn(*args))  # a float: the step has finished
            seconds = time.perf_counter() - start
            write({"step": i, "held": held, "peak": memory()["peak"], "loss": loss, "seconds": seconds})
    return fn.get_plan(*args) if way == "lms" else None
