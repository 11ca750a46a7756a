"""The one core call and the decorator over it.

* :func:`optimize`: traced step -> graph model -> plan -> rewritten copy -> new
  ConcreteFunction (the integrations all go through it);
* :func:`function` / :class:`LMSFunction`: ``tf.function`` with LMS, one rewritten
  function per input signature, with :meth:`LMSFunction.memory_report`;
* device helpers: :func:`resolve_device` (which device LMS relieves), :func:`check_host`,
  :func:`device_memory` (measured memory where the device reports it);
* :func:`paused_gc`, used around every pass;
* :func:`manual_memory_optimizer`: call steps with Grappler's memory optimizer at ``MANUAL``.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import threading
import warnings
import weakref
from collections.abc import Callable
from typing import Any, overload

import tensorflow as tf

from .. import _tf_internal as tfi
from .._util import paused_gc
from ..config import LMSConfig, resolve_budget, resolve_swapout_window
from ..emulate.simulator import Simulator
from ..errors import BudgetError, LMSWarning
from ..ir.graph import GraphModel
from ..plan.passes.offload import OffloadDecisions, offload_decisions, with_offload
from ..plan.planner import empty_plan, make_plan
from ..plan.profiles import AUTO_PROFILE, auto_profile_path, profile_of_call
from ..plan.records import SwapPlan, format_bytes
from ..plan.registry import PASSES
from ..rewrite.apply import apply_offload, apply_plan, is_rewritten
from .devices import check_host, device_memory, device_memory_limit, no_device_message, resolve_device
from .recovery import FALLBACK_REASON, Recovering
from .signature import signature_text, unknown_dimensions

__all__ = [
    "optimize",
    "function",
    "LMSFunction",
    "resolve_device",
    "check_host",
    "device_memory",
    "paused_gc",
    "manual_memory_optimizer",
]

log = logging.getLogger("tflms")

#: Callables ``edit(graph, plan, device)`` applied to each rewritten graph before it is rebuilt:
#: a test's way into the rewritten step (:mod:`tflms.testing.faults`). Empty in use.
AFTER_REWRITE: list[Callable[[Any, SwapPlan, str], None]] = []

# Rebuilt functions -> their plan, so that optimizing one again changes nothing.
_REWRITTEN: weakref.WeakKeyDictionary[Any, SwapPlan] = weakref.WeakKeyDictionary()


def manual_memory_optimizer() -> contextlib.AbstractContextManager[None]:
    """A context in which steps are called (and instantiated) with Grappler's memory optimizer at ``MANUAL``.

    By default that optimizer rewrites an ``AddN`` of more than two inputs, when its static
    estimate puts the step's peak above 80 % of the device's memory (a CPU device reports
    256 MiB), into an accumulation: a temporary variable that each input is added to as it
    arrives, initialised from a constant of zeros of the sum's size. The constant stays in
    device memory while the function exists, and the sum's order varies from run to run.
    ``MANUAL`` turns that rewrite off (see the README's "Grappler's AddN rewrite").

    The setting is read when a function is instantiated: call a step always within it, or
    never (outside it, the same function is instantiated a second time, with the default).
    ``tflms.function`` and ``tflms.LMSCallback`` call their steps within it already
    (their argument ``manual_memory_optimizer``, default ``True``); wrap the calls of a step from
    :func:`tflms.optimize` yourself.

    Example:
        >>> import tensorflow as tf
        >>> import tflms
        >>> @tf.function
        ... def total(x):
        ...     return tf.math.add_n([tf.sin(x), tf.cos(x), tf.tanh(x)])
        >>> with tflms.manual_memory_optimizer():
        ...     y = total(tf.ones((2, 2)))
        >>> float(y[0, 0]) == float(tf.sin(1.0) + tf.cos(1.0) + tf.tanh(1.0))
        True
    """
    return tfi.memory_optimization("MANUAL")


def optimize(
    concrete_function: Any, config: LMSConfig | None = None, *, copy: bool = True, **options: Any
) -> tuple[Any, SwapPlan]:
    """Plan and apply LMS to a traced step: ``(new_concrete_function, plan)``.

    The given function and its graph are not modified: the rewrite works on a
    copy of the graph. ``copy=False`` edits ``concrete_function.graph`` itself,
    which saves the copy (the slowest part of the pass on large graphs); the given
    function still runs the plain step, but its ``.graph`` then shows the swap ops.
    ``tflms.function`` does this on the traces it makes itself. When the plan is
    empty, when no device is available (a warning says so), or when the function
    is already rewritten, the given function is returned unchanged.

    Example (a small CNN's Adam step; without a GPU, or ``device=``, a warning says
    the step runs unrewritten, and ``new_cf`` is ``cf``):
        >>> import tflms
        >>> from tflms.testing.zoo import build
        >>> model, x, y, train_step = build("cnn", batch=8, size=32)
        >>> cf = tf.function(train_step).get_concrete_function(x, y)
        >>> new_cf, plan = tflms.optimize(cf, knobs=tflms.Knobs(swapout_threshold=20))
        >>> len(plan.swaps) > 0 and plan.peak_bytes_after < plan.peak_bytes_before
        True
        >>> loss = new_cf(x, y)
    """
    config = LMSConfig.from_options(config, **options)
    if not isinstance(concrete_function, tfi.ConcreteFunction):
        raise TypeError(
            "optimize expects a tf ConcreteFunction, e.g. tf.function(f).get_concrete_function(*args). "
            f"Received: concrete_function={concrete_function!r}"
        )
    known = _REWRITTEN.get(concrete_function)
    if known is not None:
        return concrete_function, known
    _refuse_xla(concrete_function, config)
    with paused_gc():
        new_cf, plan, _ = _optimize(concrete_function, config, copy, stacklevel=3)
    return new_cf, plan


def _refuse_xla(concrete_function: Any, config: LMSConfig | None = None) -> None:
    if config is not None and config.devices:
        from .placement import refuse_xla

        refuse_xla(config, tfi.must_compile_with_xla(concrete_function), repr(concrete_function.name.decode()))
    if config is not None and config.offload and tfi.must_compile_with_xla(concrete_function):
        raise ValueError(
            f"offload={config.offload!r} cannot place the update of a step compiled with XLA: XLA compiles the whole "
            "step for one device. Trace it without XLA: tf.function(step) or tf.function(step, "
            f"jit_compile=False). Received: offload={config.offload!r} with jit_compile=True"
        )
    if tfi.must_compile_with_xla(concrete_function):
        raise ValueError(
            "tflms cannot rewrite a step compiled with XLA: XLA would drop the swap ops. Trace it without "
            "XLA: tf.function(step) or tf.function(step, jit_compile=False). "
            f"Received: a function with jit_compile=True ({concrete_function.name.decode()!r})"
        )


def _optimize(
    concrete_function: Any, config: LMSConfig, copy: bool, stacklevel: int, sizes_from: Any = None
) -> tuple[Any, SwapPlan, str | None]:
    """:func:`optimize`'s work: ``(new_cf, plan, device the rewrite targets or None)``.

    ``stacklevel`` makes a warning point at the user's frame (1 = this function). ``sizes_from``: a
    trace of the same step with the concrete shapes of a call, which sizes the tensors whose size
    ``concrete_function`` leaves unknown (:meth:`GraphModel.from_func_graph`).
    """
    graph = concrete_function.graph
    sizing = None if sizes_from is None else sizes_from.graph
    model = GraphModel.from_func_graph(graph, batch_size=config.knobs.batch_size, sizes_from=sizing)
    unknown = unknown_dimensions(concrete_function, batch_known=config.knobs.batch_size is not None)
    if unknown and sizes_from is None and not is_rewritten(graph):
        warnings.warn(
            f"tflms: {graph.name} was traced with inputs of unknown size ({'; '.join(unknown)}), so the plan "
            f"sizes an unknown leading dimension as batch_size={config.knobs.batch_size or 1} and any other "
            "unknown dimension as 1, and may swap too little. Call the step with concrete shapes (no "
            "input_signature with None, no reduce_retracing: tflms.function plans each shape it is called "
            "with), or pass batch_size=<the batch size> where only the batch dimension is unknown. "
            f"Received: batch_size={config.knobs.batch_size!r}",
            LMSWarning,
            stacklevel=stacklevel,
        )
    if is_rewritten(graph):
        reason = "the function is already rewritten by tflms; left unchanged"
        return concrete_function, empty_plan(model, config, Simulator(model, config.host).peak(), reason), None
    if config.devices:  # a placement instead of swaps (tflms.integrations.placement)
        from .placement import placed_function

        new_cf, plan = placed_function(concrete_function, model, config, copy)
        _REWRITTEN[new_cf] = plan
        return new_cf, plan, config.devices[0]
    # A device or host that does not exist is an error even when nothing is swapped.
    device = resolve_device(config)
    check_host(config)
    offload = _offload(model, graph, config)
    if offload is not None:
        model = with_offload(model, offload, config.host)
    limit, source = device_memory_limit(device) if device else (None, "no device")
    auto = config.budget == "auto"
    config, budget_text = resolve_budget(config, limit, source)
    try:
        plan = make_plan(model, resolve_swapout_window(config, device))
    except BudgetError as err:
        # budget="auto" keeps a margin below the limit that the closed loop may find it does not
        # need: a plan predicted under the limit itself is tried, watched by the recovery.
        if not auto or limit is None or err.best_peak_bytes > limit:
            raise
        warnings.warn(
            f"tflms: {graph.name}: no plan is predicted within {budget_text}; the best is predicted at "
            f"{format_bytes(err.best_peak_bytes)}, within the device's limit, so the step is planned for the "
            "limit itself. If it runs out of memory, the step is undone and planned again for less (recovery).",
            LMSWarning,
            stacklevel=stacklevel,
        )
        config, budget_text = config.replace(budget=limit), f"budget {format_bytes(limit)}: the limit ({source})"
        plan = make_plan(model, resolve_swapout_window(config, device))
    plan = plan.with_budget_text(budget_text)
    if offload is None and not any(getattr(plan, p.field) for p in PASSES):  # the plan changes nothing
        return concrete_function, plan, None
    if device is None:
        warnings.warn(no_device_message(), LMSWarning, stacklevel=stacklevel)
        return concrete_function, plan, None
    new_graph = tfi.copy_graph(concrete_function) if copy else graph
    new_graph.name = f"{graph.name}_tflms"
    if offload is not None:
        apply_offload(new_graph, offload.ops, config.host, offload.transfers, device)
    counts = apply_plan(new_graph, plan, device=device, host=config.host)
    for edit in AFTER_REWRITE:
        edit(new_graph, plan, device)
    new_cf = tfi.rebuild(concrete_function, new_graph)
    _REWRITTEN[new_cf] = plan
    log.info("tflms: %s: %s", graph.name, budget_text)
    added = ", ".join(f"{kind} {n}" for kind, n in counts.items() if n)  # by kind, one pass after the other
    log.info("tflms: %s: ops added on %s/%s: %s", graph.name, device, config.host, added or "none")
    return new_cf, plan, device


def _offload(model: GraphModel, graph: Any, config: LMSConfig) -> OffloadDecisions | None:
    """The placements of ``offload="optimizer"`` or ``"weights"`` (checked against where the
    optimizer's state and the weights live), or ``None`` without an offload."""
    if config.offload is None:
        return None
    from .offload import check_state_on_host, check_weights_on_host

    decisions = offload_decisions(model, weights=config.offload == "weights")
    weights = set(decisions.weights)
    check_state_on_host(graph, [t for t in decisions.variables if t not in weights], config.host)
    if weights:
        check_weights_on_host(graph, decisions.weights, config.host)
    return decisions


class LMSFunction(Recovering):
    """A callable like ``tf.function`` whose traced steps are rewritten by tflms.

    One rewritten ConcreteFunction per input signature, cached. Made by
    :func:`tflms.function`.
    """

    def __init__(
        self,
        python_function: Callable[..., Any],
        config: LMSConfig,
        input_signature: Any = None,
        reduce_retracing: bool = False,
        _owns_traces: bool | None = None,
        *,
        manual_memory_optimizer: bool = True,
        layout_optimizer: bool = False,
    ) -> None:
        self._config = config
        check_call_settings(manual_memory_optimizer=manual_memory_optimizer, layout_optimizer=layout_optimizer)
        self._manual_memory_optimizer = manual_memory_optimizer
        self._layout_optimizer = layout_optimizer
        if isinstance(python_function, tf.types.experimental.PolymorphicFunction):
            if config.devices:
                from .placement import refuse_xla

                refuse_xla(config, bool(getattr(python_function, "_jit_compile", None)), f"fn={python_function!r}")
            if getattr(python_function, "_jit_compile", None) and config.offload:
                raise ValueError(
                    f"offload={config.offload!r} cannot place the update of a tf.function compiled with XLA: XLA "
                    "compiles the whole step for one device. Pass the plain function or "
                    "tf.function(fn, jit_compile=False). "
                    f"Received: offload={config.offload!r} with fn={python_function!r} and jit_compile=True"
                )
            if getattr(python_function, "_jit_compile", None):
                raise ValueError(
                    "tflms.function cannot rewrite a tf.function compiled with XLA: XLA would drop the swap "
                    "ops. Pass the plain function or tf.function(fn, jit_compile=False). "
                    f"Received: fn={python_function!r} with jit_compile=True"
                )
            # The user's tf.function: its traces are theirs, so rewrite copies.
            self._tf_function = python_function
            self.python_function = python_function.python_function
            self._owns_traces = bool(_owns_traces)
        else:
            self._owns_traces = True
            self._tf_function = tf.function(
                python_function, input_signature=input_signature, reduce_retracing=reduce_retracing
            )
            self.python_function = python_function
        self._cache: dict[Any, tuple[Any, SwapPlan, str | None]] = {}
        self._profiled: set[Any] = set()  # traces planned again with a profile of their first call
        self._init_recovery()
        self._sizes: dict[Any, Any] = {}  # trace -> a trace with a call's concrete shapes, or None
        self._lock = threading.Lock()
        self._warned_eager = False
        self._bound: weakref.WeakKeyDictionary[Any, LMSFunction] = weakref.WeakKeyDictionary()
        functools.update_wrapper(self, self.python_function)

    @property
    def config(self) -> LMSConfig:
        return self._config

    def _entry(self, args: tuple, kwargs: dict) -> tuple[Any, SwapPlan, str | None]:
        return self._traced_entry(args, kwargs)[1]

    def _traced_entry(self, args: tuple, kwargs: dict) -> tuple[Any, tuple[Any, SwapPlan, str | None]]:
        """``(trace, (rewritten function, plan, device or None))`` for these arguments."""
        cf = self._tf_function.get_concrete_function(*args, **kwargs)
        entry = self._cache.get(cf)
        if entry is None:
            with self._lock:
                entry = self._cache.get(cf)
                if entry is None:
                    known = _REWRITTEN.get(cf)
                    if known is not None:
                        entry = (cf, known, None)
                    else:
                        _refuse_xla(cf, self._config)
                        self._sizes[cf] = self._sizing_trace(cf, args, kwargs)
                        with paused_gc():
                            # user -> __call__ / get_plan / ... -> _entry -> _optimize
                            # op_profile="auto" plans the trace again after its first call: keep it unedited.
                            copy = not self._owns_traces or self.profiles_calls
                            entry = _optimize(cf, self._config, copy, stacklevel=4, sizes_from=self._sizes[cf])
                    self._cache[cf] = entry
        return cf, entry

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if tf.config.functions_run_eagerly():
            if not self._warned_eager:
                self._warned_eager = True
                warnings.warn(
                    "tflms: tf.config.run_functions_eagerly(True) is set, so the step runs eagerly "
                    "without LMS. Turn it off to swap tensors.",
                    LMSWarning,
                    stacklevel=2,
                )
            return self.python_function(*args, **kwargs)
        cf, (new_cf, plan, device) = self._traced_entry(args, kwargs)
        if self._watched_device(cf) is None or not tf.executing_eagerly():
            # No device (or a placement), or traced into a caller's function: the caller runs the call.
            return self._run(new_cf, device, args, kwargs)
        if self.profiles_calls and device is not None and cf not in self._profiled:  # only a rewritten step
            out: list[Any] = []
            kernels = tfi.profile_kernels(lambda: out.append(self._run_recovering(cf, args, kwargs)), allocations=True)
            self.replan_with_kernels(kernels, [cf])
            return out[0]
        return self._run_recovering(cf, args, kwargs)

    def _watched_device(self, cf: Any) -> str | None:
        """The device whose memory the recovery watches for trace ``cf``: the rewrite's, or for a step
        left unrewritten (predicted to fit) the device it would have been rewritten for; ``None`` for
        a placement over several devices (not watched) or where no device is known."""
        device = self._cache[cf][2]
        if self._config.devices:
            return None
        if device is None:
            try:
                device = resolve_device(self._config)
            except ValueError:
                return None
        return device

    def _replan(self, cf: Any, config: LMSConfig) -> tuple[Any, SwapPlan, str | None]:
        """A new entry for trace ``cf``, planned with ``config`` on an unedited trace."""
        fresh = self._fresh_trace(cf)  # never edit ``cf`` itself: the plain step falls back to it
        return _optimize(fresh, config, copy=fresh is cf, stacklevel=6, sizes_from=self._sizes.get(cf))

    def _sizing_trace(self, cf: Any, args: tuple, kwargs: dict) -> Any:
        """A trace of the step with the concrete shapes of ``args`` and ``kwargs``, where trace ``cf``
        leaves sizes unknown (an ``input_signature`` with ``None``, ``fit``'s relaxed batches) and
        the call's arguments are concrete tensors; else ``None``."""
        if not unknown_dimensions(cf) or not tf.executing_eagerly():
            return None  # nothing to size, or traced into a caller's function (symbolic arguments)
        if any(isinstance(a, tf.TypeSpec) for a in tf.nest.flatten((args, kwargs))):
            return None  # get_plan(TensorSpec(...)): no concrete shapes
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return tf.function(self.python_function).get_concrete_function(*args, **kwargs)

    def _fresh_trace(self, cf: Any) -> Any:
        """An unedited trace of the same signature as ``cf`` (``tflms.function`` rewrites its own
        traces in place), for planning again."""
        if not is_rewritten(cf.graph):
            return cf
        args, kwargs = cf.structured_input_signature
        return tf.function(self.python_function).get_concrete_function(*args, **kwargs)

    def _run(self, new_cf: Any, device: str | None, args: tuple, kwargs: dict) -> Any:
        level = "MANUAL" if self._manual_memory_optimizer else None
        # Only for a rewritten step, and only where the layout optimizer would convert on its device.
        layout_off = device is not None and not self._layout_optimizer
        with tfi.memory_optimization(level, keep_explicit=True, layout_off=layout_off, device=device):
            if device is None:
                return new_cf(*args, **kwargs)
            with tf.device(device):
                return new_cf(*args, **kwargs)

    @property
    def profiles_calls(self) -> bool:
        """Whether the first rewritten call of each signature is profiled (``op_profile='auto'``)."""
        return self._config.knobs.op_profile == AUTO_PROFILE

    def replan_with_kernels(self, kernels: list[dict[str, Any]], traces: list[Any] | None = None) -> list[SwapPlan]:
        """Plan again, with the op times of one profiled call (``kernels``:
        :func:`tflms._tf_internal.profile_kernels`), each rewritten trace in ``traces`` (default:
        all) that has not been profiled yet; ``op_profile='auto'`` calls this after a signature's
        first call. The profile is saved (:func:`tflms.plan.profiles.auto_profile_path`) and the
        new plan's ``op_profile`` knob names it. Returns the new plans."""
        new_plans = []
        with self._lock:
            for cf in list(self._cache) if traces is None else traces:
                entry = self._cache.get(cf)
                if entry is None or cf in self._profiled or entry[2] is None or entry[1].reason == FALLBACK_REASON:
                    continue  # not rewritten, or the plain step the recovery fell back to
                self._profiled.add(cf)
                _, plan, device = entry
                model = plan.model
                profile = profile_of_call(
                    kernels, ops=set(model.dag) if model is not None else None, device=device, function=plan.function
                )
                path = auto_profile_path(plan.function, signature_text(cf), device)
                profile.save(path)
                # The config of the plan that runs (the recovery may have planned it for less memory).
                config = self._trace_configs.get(cf, self._config).with_knobs(op_profile=path)
                fresh = self._fresh_trace(cf)
                with paused_gc():
                    entry = _optimize(
                        fresh,
                        config,
                        fresh is cf and not self._owns_traces,
                        stacklevel=4,
                        sizes_from=self._sizes.get(cf),
                    )
                if entry[1].swaps != plan.swaps or entry[1].recomputes != plan.recomputes:
                    self._probation.pop(cf, None)  # a new plan: on probation again
                    self._plan_peaks.pop(cf, None)
                self._cache[cf] = entry
                log.info("tflms: %s: planned again with the op times of its first call (%s)", plan.function, path)
                new_plans.append(entry[1])
        return new_plans

    def get_concrete_function(self, *args: Any, **kwargs: Any) -> Any:
        """The rewritten ConcreteFunction for these arguments (traced and planned on first use)."""
        return self._traced_entry(args, kwargs)[1][0]

    def get_plan(self, *args: Any, **kwargs: Any) -> SwapPlan:
        """The :class:`~tflms.SwapPlan` for these arguments' input signature."""
        return self._traced_entry(args, kwargs)[1][1]

    def _measured_device(self, args: tuple, kwargs: dict) -> str | None:
        device = self._entry(args, kwargs)[2] if args or kwargs else None
        return device or self._config.device or resolve_device(self._config)

    def reset_peak(self, *args: Any, **kwargs: Any) -> None:
        """Reset the compute device's measured peak (where the device reports memory)."""
        device = self._measured_device(args, kwargs)
        if device is not None and device_memory(device) is not None:
            tf.config.experimental.reset_memory_stats(device)

    def memory_report(self, *args: Any, **kwargs: Any) -> dict[str, Any]:
        """The device's measured peak since :meth:`reset_peak`, next to the plan's predictions.

        ``{'device', 'measured_peak_bytes', 'predicted_peak_bytes', 'predicted_plain_peak_bytes'}``
        for these arguments' signature. ``measured_peak_bytes`` is ``None`` where the device
        does not report memory: a CPU reports it only in a process started with
        ``TF_CPU_ALLOCATOR_USE_BFC=true`` (see :mod:`tflms.testing.testbed`); a GPU always does.
        """
        plan = self.get_plan(*args, **kwargs)
        device = self._measured_device(args, kwargs)
        info = device_memory(device) if device is not None else None
        return {
            "device": device,
            "measured_peak_bytes": None if info is None else int(info["peak"]),
            "predicted_peak_bytes": plan.peak_bytes_after,
            "predicted_plain_peak_bytes": plan.peak_bytes_before,
        }

    @property
    def plans(self) -> list[SwapPlan]:
        """Plans of every signature traced so far, in tracing order (see :attr:`plans_by_signature`)."""
        return [plan for _, plan, _ in self._cache.values()]

    @property
    def plans_by_signature(self) -> dict[str, SwapPlan]:
        """Each traced input signature, as text (e.g. ``'x: float32[64, 64], y: int32[64]'``), and its plan."""
        return {signature_text(cf): plan for cf, (_, plan, _) in self._cache.items()}

    def __get__(self, instance: Any, owner: Any = None) -> Any:
        if instance is None:
            return self
        bound = self._bound.get(instance)
        if bound is None:
            bound = LMSFunction(
                self._tf_function.__get__(instance, owner),
                self._config,
                _owns_traces=self._owns_traces,
                manual_memory_optimizer=self._manual_memory_optimizer,
                layout_optimizer=self._layout_optimizer,
            )
            self._bound[instance] = bound
        return bound

    def __repr__(self) -> str:
        return f"<tflms.LMSFunction {getattr(self.python_function, '__name__', '?')} {self._config}>"


def check_call_settings(**settings: Any) -> None:
    """Raise ``ValueError`` naming a call setting (``manual_memory_optimizer``, ``layout_optimizer``)
    that is not a bool."""
    for name, value in settings.items():
        if not isinstance(value, bool):
            raise ValueError(f"{name} must be True or False. Received: {name}={value!r}")


@overload
def function(
    fn: Callable[..., Any],
    *,
    config: LMSConfig | None = None,
    input_signature: Any = None,
    reduce_retracing: bool = False,
    manual_memory_optimizer: bool = True,
    layout_optimizer: bool = False,
    **options: Any,
) -> LMSFunction: ...
@overload
def function(
    fn: None = None,
    *,
    config: LMSConfig | None = None,
    input_signature: Any = None,
    reduce_retracing: bool = False,
    manual_memory_optimizer: bool = True,
    layout_optimizer: bool = False,
    **options: Any,
) -> Callable[[Callable[..., Any]], LMSFunction]: ...


def function(
    fn: Callable[..., Any] | None = None,
    *,
    config: LMSConfig | None = None,
    input_signature: Any = None,
    reduce_retracing: bool = False,
    manual_memory_optimizer: bool = True,
    layout_optimizer: bool = False,
    **options: Any,
) -> Any:
    """``tf.function`` with large model support.

    Use as ``@tflms.function``, ``@tflms.function(budget="6GiB")``,
    ``@tflms.function(knobs=tflms.Knobs(swapout_threshold=40))`` or
    ``tflms.function(fn, config=cfg)``. Keyword options are those of
    :class:`tflms.LMSConfig` (a knob goes in ``knobs=tflms.Knobs(...)``; its name alone raises
    ``TypeError``); ``input_signature`` and ``reduce_retracing`` go to ``tf.function``. ``fn`` may
    itself be a ``tf.function``.

    Two settings say how the rewritten step is called; they change no plan, and are not among a
    plan's options (:data:`tflms.config.CALL_SETTINGS`):

    * ``manual_memory_optimizer``: when ``True`` (default), the step is called within
      :func:`tflms.manual_memory_optimizer` (Grappler's memory optimizer at ``MANUAL``):
      Grappler's default level may rewrite a large ``AddN`` into an accumulation whose constant
      of zeros stays in device memory, which the plan's predicted peak does not count. A level
      set by the caller's own ``function_call_options`` is kept.
    * ``layout_optimizer``: when ``False`` (default), a step tflms rewrote is called with
      Grappler's layout optimizer off where it would convert layouts on the step's device: on a
      GPU, where it converts convolutions to NCHW and adds ``Transpose`` ops at the edges of what
      it converted, activation-sized buffers that the plan does not count and that can exhaust
      the device's memory (docs, "TensorFlow interactions"); on a CPU device only where the call
      options ask it to convert (``cpu_layout_conversion``). On a CPU device without that, the
      layout optimizer converts nothing, and the setting is left as it is: the rewritten step runs
      with the ``ConfigProto`` of a plain ``tf.function`` call. ``True``: TensorFlow's setting
      (on by default) everywhere. A layout optimizer the caller turned on explicitly is kept.

    :class:`tflms.LMSCallback` takes both too. Steps from :func:`tflms.optimize` are called by the
    caller, who can do the same: ``with tflms.manual_memory_optimizer():`` around the calls, and on
    a GPU ``tf.config.optimizer.set_experimental_options({"layout_optimizer": False})``.

    Example (``build`` makes a small CNN, Adam and data; the decorator works on any step):
        >>> import tflms
        >>> from tflms.testing.zoo import build
        >>> model, x, y, plain_step = build("cnn", batch=8, size=32)
        >>> @tflms.function(knobs=tflms.Knobs(swapout_threshold=20, swapin_ahead=4))
        ... def train_step(x, y):
        ...     return plain_step(x, y)
        >>> loss = train_step(x, y)
        >>> print(train_step.get_plan(x, y).summary().splitlines()[0])  # doctest: +ELLIPSIS
        tflms plan for ...: ... tensors swapped (... out, ... swap-ins), ... ops
    """
    cfg = LMSConfig.from_options(config, **options)
    check_call_settings(manual_memory_optimizer=manual_memory_optimizer, layout_optimizer=layout_optimizer)

    def wrap(f: Callable[..., Any]) -> LMSFunction:
        if not callable(f):
            raise TypeError(f"tflms.function expects a callable. Received: fn={f!r}")
        return LMSFunction(
            f,
            cfg,
            input_signature=input_signature,
            reduce_retracing=reduce_retracing,
            manual_memory_optimizer=manual_memory_optimizer,
            layout_optimizer=layout_optimizer,
        )

    return wrap if fn is None else wrap(fn)
