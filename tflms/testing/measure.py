"""Measure a training step's real device peak on the test bed, next to the prediction.

:func:`measure_step` runs inside a measured process (see :mod:`tflms.testing.testbed`):
it builds one of :data:`tflms.testing.zoo.MODELS` with fixed seeds and synthetic data, traces an
Adam training step, optionally rewrites it with tflms (the process's device and
host, :func:`tflms.testing.testbed.devices`), trains a few steps and returns the measured
peak of each step, the losses and the simulator's predictions, as plain JSON data.
:func:`measure` starts such a process for you, on the test bed or (``gpu=True``) on GPU 0::

    >>> r = measure("cnn", batch=8, steps=2)                      # doctest: +SKIP
    >>> r.value["plain"]["peak"], r.value["lms"]["peak"], r.value["lms"]["predicted"]  # doctest: +SKIP

Used by the real-memory tests, ``benchmarks/simulator_accuracy.py``,
``benchmarks/testbed_capacity.py`` and ``tflms demo``. :func:`anatomy_step` (what a
measured peak holds, next to the simulator's live buffers) serves
``benchmarks/peak_anatomy.py``. :func:`timed_steps` times steps and reads GPU 0's peak for the
GPU benchmarks (``benchmarks/gpu.py``, ``gpu_offload.py``, ``gpu_throughput.py``).
"""

from __future__ import annotations

import functools
import json
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from ..config import CALL_SETTINGS, check_int, keyword_options
from .measured import MeasuredResult, run_measured
from .zoo import MODELS, build

if TYPE_CHECKING:
    from ..ir.graph import GraphModel

__all__ = [
    "measure_step",
    "measure",
    "peak_anatomy",
    "replay_allocations",
    "recorded_order",
    "anatomy_step",
    "timed_steps",
]


#: ``swapout_window`` of the ``'lms_fenced'`` mode of :func:`measure_step`: with four swap-outs in
#: flight every step of the 8-block encoder (batch 32) is within 4 % of its prediction
#: (benchmarks/results/fences.json, the test bed).
FENCE_WINDOW = 4


#: The modes :func:`measure_step` measures.
MEASURE_MODES = (
    "plain", "lms", "lms_device_gated", "lms_recompute", "lms_fenced", "lms_serialized", "lms_unordered",
    "lms_split_sums", "lms_ordered_updates",
)  # fmt: skip


def _as_tflms_calls(options: dict[str, Any] | None) -> tuple[bool, bool]:
    """``(Grappler's memory optimizer at MANUAL, its layout optimizer off)``: how ``tflms.function``
    calls a step it rewrote, with the call settings in ``options`` (``manual_memory_optimizer``,
    ``layout_optimizer``, which a plan does not record) and ``tflms.function``'s defaults for the
    others."""
    import inspect

    from ..integrations.function import function

    params = inspect.signature(function).parameters
    found = {name: (options or {}).get(name, params[name].default) for name in CALL_SETTINGS}
    return found["manual_memory_optimizer"], not found["layout_optimizer"]


def _optimize_options(options: dict[str, Any] | None) -> dict[str, Any]:
    """Keyword arguments of :func:`tflms.optimize` from flat ``options`` (option and knob names side
    by side, JSON-safe; call settings left out: they are :func:`_as_tflms_calls`'s)."""
    return keyword_options({k: v for k, v in (options or {}).items() if k not in CALL_SETTINGS})


def measure_step(
    model: str,
    batch: int,
    size: int | None = None,
    modes: tuple[str, ...] | list[str] = ("plain", "lms"),
    steps: int = 3,
    options: dict[str, Any] | None = None,
    warmup: int = 1,
    memory_optimizer: str = "auto",
) -> dict[str, Any]:
    """Train ``warmup + steps`` steps of ``model`` per mode in this measured process; return measurements.

    ``modes`` are ``'plain'`` (the traced step as is) and ``'lms'`` (rewritten by
    :func:`tflms.optimize` with ``options``, on the measured process's device and host,
    :func:`tflms.testing.testbed.devices`). Every mode starts from the same weights and optimizer
    state, in this one process: TensorFlow's CPU kernels are not bit-reproducible across
    processes (a plain ResNet50 step's numbers differ from one process to the next), so only
    steps in one process can be compared exactly.

    The first ``warmup`` steps are not counted in ``peak``: a function's first call
    instantiates it (on the test bed also its host half, in the host process), so its peak is
    not the steady state's: a rewritten step's first peak can be well above its later ones, a
    plain step's is mostly below them. ``first_peak`` keeps it.

    Returns ``{'model', 'batch', 'size', 'plain_predicted', MODE: {...}}`` where each mode
    has ``peak`` (the steady-state peak: the largest measured per-step peak after the
    warm-up, bytes), ``first_peak``, ``peaks`` and ``losses`` (every step, the warm-up
    included), ``step_seconds``, ``predicted`` (the simulator's peak of the step that ran),
    ``manual_memory_optimizer`` (whether its steps ran at ``MANUAL``; see below),
    ``layout_optimizer_off`` (whether they ran with Grappler's layout optimizer off: the
    rewritten steps with ``memory_optimizer='auto'``, as ``tflms.function`` calls them) and, for
    ``'lms'``, ``n_swaps``, ``n_swap_ins``, ``n_fences``, ``n_orders``, ``swapped_bytes`` and the plan's ``options``.
    ``'lms_device_gated'`` applies the same plan with the swap-ins on the device, where a swap-in
    does not wait for its trigger (see :func:`tflms.rewrite.apply.apply_plan`): the negative control.
    ``'lms_fenced'`` is ``'lms'`` with ``swapout_window=``:data:`FENCE_WINDOW` (the same swaps,
    plus fences). ``'lms_serialized'`` is ``'lms'`` with ``serialize=True`` (the same swaps, plus
    the memory-aware schedule's orders, counted in ``n_orders``; the default),
    ``'lms_unordered'`` with ``serialize=False`` (the swaps alone). Three modes add a pass to the
    policy of ``options`` (``'default'`` if they name none): ``'lms_split_sums'`` ``split_sums``
    (:mod:`tflms.plan.passes.sums`; its entry's ``n_sums`` counts them), ``'lms_ordered_updates'``
    ``order_updates`` (each variable update waits for the reads of its variable, so that
    TensorFlow does not copy the variable first) and ``'lms_recompute'`` ``recompute``
    (:mod:`tflms.plan.passes.recompute`); its entry also has ``n_recomputes`` and
    ``recomputed_bytes``. Every ``lms`` mode's entry
    has the plan's predicted ``link_seconds`` and ``recompute_seconds``.

    ``memory_optimizer='auto'`` (default) calls each step as a user gets it: the plain step
    with TensorFlow's setting, the rewritten ones as ``tflms.function`` calls them (within
    :func:`tflms.manual_memory_optimizer` unless ``options`` has
    ``manual_memory_optimizer=False``). ``'manual'`` runs every step of every mode within it
    (Grappler's memory optimizer at ``MANUAL``: no rewrite of ``AddN`` ops into accumulations,
    and no device memory held for them between steps); ``'default'`` leaves TensorFlow's
    setting for every step. Only ``'auto'`` turns Grappler's layout optimizer off for the
    rewritten steps (``tflms.function``'s ``layout_optimizer``; on a CPU it changes nothing unless asked
    to convert). A step's peak includes what the functions of earlier modes hold
    between steps (e.g. the zeros of such a rewrite).
    """
    import tensorflow as tf

    from ..emulate.simulator import Simulator
    from ..ir.graph import GraphModel
    from . import testbed

    _check_measure_args(modes, steps, warmup, memory_optimizer)
    tf.config.experimental.enable_op_determinism()
    device, host = testbed.devices()
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
        "memory_optimizer": memory_optimizer,
    }
    plans: dict[str, Any] = {}  # by options
    for i, mode in enumerate(modes):
        for v, value in zip(state, initial):
            v.assign(value)
        entry: dict[str, Any] = {}
        step = cf
        manual = memory_optimizer == "manual"
        layout_off = False
        if mode.startswith("lms"):
            step, plan = _lms_step(mode, cf, options, plans, device, host)
            entry.update(_plan_entry(plan))
            if memory_optimizer == "auto":
                manual, layout_off = _as_tflms_calls(_mode_options(mode, options))
        else:
            entry["predicted"] = plain_predicted
        run = _run_steps(step, x, y, device, warmup + steps, manual=manual, layout_off=layout_off)
        entry.update(
            manual_memory_optimizer=manual, layout_optimizer_off=layout_off, peak=max(run["peaks"][warmup:]), **run
        )
        result[mode if mode not in result else f"{mode}_{i}"] = entry
    return result


def _check_measure_args(modes: Sequence[str], steps: int, warmup: int, memory_optimizer: str) -> None:
    """Raise ``ValueError`` for the arguments :func:`measure_step` does not take."""
    check_int("steps", steps, 1)
    check_int("warmup", warmup, 0)
    if memory_optimizer not in ("auto", "default", "manual"):
        raise ValueError(
            f"memory_optimizer must be 'auto', 'default' or 'manual'. Received: memory_optimizer={memory_optimizer!r}"
        )
    unknown = sorted(set(modes) - set(MEASURE_MODES))
    if unknown or not modes:
        raise ValueError(
            f"modes must be a non-empty list of {', '.join(map(repr, MEASURE_MODES[:-1]))} and {MEASURE_MODES[-1]!r}. "
            f"Received: modes={modes!r}"
        )


#: The options each ``lms_*`` mode of :func:`measure_step` sets over the caller's.
_MODE_OPTIONS: dict[str, dict[str, Any]] = {
    "lms_fenced": {"swapout_window": FENCE_WINDOW},
    "lms_serialized": {"serialize": True},
    "lms_unordered": {"serialize": False},
}
#: The pass each ``lms_*`` mode of :func:`measure_step` adds to the caller's policy (``'default'`` if none).
_MODE_PASSES = {"lms_recompute": "recompute", "lms_split_sums": "split_sums", "lms_ordered_updates": "order_updates"}


def _mode_options(mode: str, options: dict[str, Any] | None) -> dict[str, Any]:
    """The options of the ``lms`` mode ``mode`` of :func:`measure_step`: ``options`` with the mode's."""
    found = {**(options or {}), **_MODE_OPTIONS.get(mode, {})}
    if mode in _MODE_PASSES:
        policy = found.get("policy", "default")
        found["policy"] = (*((policy,) if isinstance(policy, str) else policy), _MODE_PASSES[mode])
    return found


def _lms_step(
    mode: str, cf: Any, options: dict[str, Any] | None, plans: dict[str, Any], device: str, host: str
) -> tuple[Any, Any]:
    """``(step, plan)`` of the ``lms`` mode ``mode`` of :func:`measure_step`; ``plans`` (by options)
    keeps the plans made, so that ``'lms_device_gated'`` reuses the plan of an earlier ``'lms'`` mode."""
    from .. import _tf_internal as tfi
    from ..integrations.function import optimize
    from ..rewrite.apply import apply_plan

    found = _mode_options(mode, options)
    key = json.dumps(found, sort_keys=True, default=repr)
    step = cf
    if mode == "lms_device_gated" and key in plans:  # the plan of an earlier 'lms' mode: not made twice
        plan = plans[key]
    else:
        step, plan = optimize(cf, device=device, host=host, **_optimize_options(found))
        plans[key] = plan
    if mode == "lms_device_gated":  # the negative control: the swap-ins on the device
        graph = tfi.copy_graph(cf)
        apply_plan(graph, plan, device, host, swap_in_on="device")
        step = tfi.rebuild(cf, graph)
    return step, plan


def _plan_entry(plan: Any) -> dict[str, Any]:
    """What :func:`measure_step` reports of the plan of an ``lms`` mode."""
    return {
        "predicted": plan.peak_bytes_after,
        "n_swaps": len(plan.swaps),
        "n_swap_ins": plan.n_swap_ins,
        "n_fences": len(plan.fences),
        "n_orders": len(plan.orders),
        "swapped_bytes": plan.swapped_bytes,
        "n_recomputes": len(plan.recomputes),
        "recomputed_bytes": plan.recomputed_bytes,
        "n_sums": len(plan.sums),
        "link_seconds": plan.link_seconds,
        "recompute_seconds": plan.recompute_seconds,
        "options": dict(plan.options),
    }


def _run_steps(step: Any, x: Any, y: Any, device: str, n: int, *, manual: bool, layout_off: bool) -> dict[str, Any]:
    """Call ``step(x, y)`` ``n`` times on ``device``: ``first_peak``, ``peaks``, ``losses`` and
    ``step_seconds`` (the test bed's peak is reset before each step)."""
    import tensorflow as tf

    from .. import _tf_internal as tfi
    from . import testbed

    peaks, losses, seconds = [], [], []
    for _ in range(n):
        testbed.reset_peak()
        t0 = time.perf_counter()
        with tf.device(device), tfi.memory_optimization("MANUAL" if manual else None, layout_off=layout_off):
            loss = float(step(x, y).numpy())
        seconds.append(time.perf_counter() - t0)
        peaks.append(testbed.memory()["peak"])
        losses.append(loss)
    return {"first_peak": peaks[0], "peaks": peaks, "losses": losses, "step_seconds": seconds}


def measure(
    model: str,
    batch: int,
    *,
    cap: int | str | None = None,
    timeout: float = 1800.0,
    gpu: bool = False,
    **kwargs: Any,
) -> MeasuredResult:
    """:func:`measure_step` in a fresh measured process (see :func:`tflms.testbed.run_measured`):
    on the test bed, or on GPU 0 with ``gpu=True`` (``cap``: a real limit of its memory)."""
    return run_measured(
        "tflms.testing.measure:measure_step",
        {"model": model, "batch": batch, **kwargs},
        cap=cap,
        timeout=timeout,
        gpu=gpu,
    )


def timed_steps(
    fn: Callable[..., Any], args: Sequence[Any], steps: int, losses: list[float], gpu: bool = True
) -> tuple[float, int | None]:
    """Time ``steps`` calls of ``fn(*args)``, each loss appended to ``losses`` as a float, from a
    reset of GPU 0's peak when ``gpu``: ``(seconds per step, GPU 0's peak in bytes since the
    reset)``, the peak None without ``gpu``. Warm-up steps are the caller's, before."""
    import tensorflow as tf

    if gpu:
        tf.config.experimental.reset_memory_stats("GPU:0")
    t0 = time.perf_counter()
    for _ in range(steps):
        losses.append(float(fn(*args)))
    seconds = (time.perf_counter() - t0) / steps
    peak = int(tf.config.experimental.get_memory_info("GPU:0")["peak"]) if gpu else None
    return seconds, peak


def _events_of(records: list[dict[str, Any]], allocator: str | None) -> tuple[str, list[int]]:
    """``(allocator, indices of its events in records)``; by default the allocator with the most events."""
    from collections import Counter

    if allocator is None:
        counts = Counter(r["allocator"] for r in records)
        if not counts:
            raise ValueError("records must hold at least one allocator event. Received: records=[]")
        allocator = counts.most_common(1)[0][0]
    mine = [i for i, r in enumerate(records) if r["allocator"] == allocator]
    if not mine:
        raise ValueError(f"no event of allocator {allocator!r} in records")
    return allocator, mine


def peak_anatomy(records: list[dict[str, Any]], allocator: str | None = None) -> dict[str, Any]:
    """What the allocator held at its largest ``in_use`` among ``records``.

    ``records`` are allocator events in time order, as :func:`tflms._tf_internal.profile_step`
    returns them; ``allocator`` picks one by name (default: the one with the most events).
    Returns ``{'allocator', 'in_use', 'requested', 'op', 'index', 'live', 'before'}``: ``op``
    made the allocation that reached the peak (record ``index``); ``live`` lists the chunks
    allocated during the records and not yet freed then (``op``, ``bytes``, ``requested``,
    ``region``, ``shape``), largest first; ``requested`` is what their ops asked for (the
    chunks without the allocator's rounding and unsplit rests); ``before`` is what the
    allocator held that the records did not allocate (e.g. the variables): ``in_use`` minus
    the live chunks.

    >>> rec = lambda kind, addr, nbytes, in_use, op: {"kind": kind, "allocator": "a", "addr": addr,
    ...     "bytes": nbytes, "requested": nbytes - 6, "in_use": in_use, "op": op, "region": "output", "shape": ""}
    >>> recs = [rec("alloc", 1, 256, 1256, "x"), rec("alloc", 2, 512, 1768, "y"), rec("free", 2, 512, 1256, "")]
    >>> a = peak_anatomy(recs)
    >>> a["in_use"], a["requested"], a["op"], a["before"], [c["op"] for c in a["live"]]
    (1768, 756, 'y', 1000, ['y', 'x'])
    """
    allocator, mine = _events_of(records, allocator)
    index = max(mine, key=lambda i: (records[i]["in_use"], -i))  # the first event at the peak
    in_use = records[index]["in_use"]
    chunks: dict[int, dict[str, Any]] = {}  # replayed up to it
    for i in mine[: mine.index(index) + 1]:
        r = records[i]
        if r["kind"] == "alloc":
            chunks[r["addr"]] = r
        else:
            chunks.pop(r["addr"], None)
    held = sorted(
        ({k: c[k] for k in ("op", "bytes", "requested", "region", "shape")} for c in chunks.values()),
        key=lambda c: (-c["bytes"], c["op"]),
    )
    return {
        "allocator": allocator,
        "in_use": in_use,
        "requested": sum(c["requested"] for c in held),
        "op": records[index]["op"],
        "index": index,
        "live": held,
        "before": in_use - sum(c["bytes"] for c in held),
    }


def replay_allocations(
    records: list[dict[str, Any]], allocator: str | None = None, limit: int | None = None
) -> dict[str, Any]:
    """The simulator's allocator emulation (its rule 8) run on a recorded sequence of allocations.

    ``records`` are allocator events in time order (:func:`tflms._tf_internal.profile_step`);
    ``allocator`` picks one by name (default: the one with the most events). What that
    allocator held before the first event is placed first, as one chunk, as the simulator
    places the variables; frees of chunks allocated before the records are skipped. So the
    emulation gets the step's real requests in their real order, and its chunk peak against
    the measured one (``in_use``) tells how far the emulated allocator alone is from
    TensorFlow's. ``limit`` caps the emulated allocator's regions as a real memory cap does.

    Returns ``{'allocator', 'peak', 'measured', 'out_of_memory'}``: ``peak`` and ``measured``
    are the emulated and recorded largest chunk bytes in use (what was held before
    included); ``out_of_memory`` is None or ``{'index', 'op', 'requested'}`` of the first
    request the emulation could not place under ``limit`` (``peak`` is then up to it).

    >>> rec = lambda kind, addr, req, in_use: {"kind": kind, "allocator": "a", "addr": addr,
    ...     "bytes": req, "requested": req, "in_use": in_use, "op": f"op{addr}"}
    >>> recs = [rec("alloc", 1, 1 << 20, 1 << 20), rec("alloc", 2, 1 << 20, 2 << 20),
    ...         rec("free", 1, 1 << 20, 1 << 20), rec("alloc", 3, 3 << 19, 5 << 19)]
    >>> r = replay_allocations(recs)  # the first region is 2 MiB: the 1.5 MiB request needs a new one
    >>> r["peak"] >> 10, r["measured"] >> 10, r["out_of_memory"]
    (2560, 2560, None)
    >>> replay_allocations(recs, limit=3 << 20)["out_of_memory"]  # 1 MiB left under the limit
    {'index': 3, 'op': 'op3', 'requested': 1572864}
    """
    from ..emulate.bfc import BFCAllocator, OutOfMemory

    allocator, indices = _events_of(records, allocator)
    mine = [records[i] for i in indices]
    first = mine[0]
    before = first["in_use"] - (first["bytes"] if first["kind"] == "alloc" else -first["bytes"])
    bfc = BFCAllocator(before, limit)
    chunk: dict[Any, int] = {}
    peak, failed = 0, None
    for index, r in enumerate(mine):
        if r["kind"] == "alloc":
            try:
                chunk[r["addr"]] = bfc.alloc(max(r["requested"], 1))
            except OutOfMemory:
                failed = {"index": index, "op": r["op"], "requested": r["requested"]}
                break
            peak = max(peak, bfc.in_use)
        elif r["addr"] in chunk:
            bfc.release(chunk.pop(r["addr"]))
    return {
        "allocator": allocator,
        "peak": before + peak,
        "measured": max(r["in_use"] for r in mine),
        "out_of_memory": failed,
    }


def recorded_order(model: GraphModel, kernels: list[dict[str, Any]]) -> list[str]:
    """The ops of ``model`` in the order a profiled step started them: a schedule for :class:`tflms.Simulator`.

    ``kernels`` are the executor's kernel records (:func:`tflms._tf_internal.profile_step`;
    ``time_ns``, ``op``). An op with no record (Grappler removed or fused it) starts with
    the latest of its predecessors, and so does a recorded op that started before one of
    them (only Grappler's rewrite can make it so); ties follow a topological order of
    ``model``. An ``IdentityN`` is no predecessor here, the op of the input it passes on
    is: Grappler removes it and its consumers read its inputs. (Keras 3's optimizer passes
    every gradient through one ``IdentityN``, and the runtime starts each variable's update
    as soon as that variable's gradient exists.) So the result is a topological order of
    ``model`` except for the edges out of ``IdentityN`` ops.

    >>> from tflms.ir.graph import GraphModel
    >>> f32 = ("float32", (1,), 4, False)
    >>> ops = [{"name": n, "type": "Relu", "inputs": i, "outputs": [f32]}
    ...        for n, i in (("a", []), ("b", ["a:0"]), ("c", ["a:0"]), ("d", ["b:0", "c:0"]))]
    >>> recorded_order(GraphModel.from_ops(ops), [{"time_ns": 0, "op": "a"}, {"time_ns": 5, "op": "c"},
    ...                                           {"time_ns": 9, "op": "b"}])
    ['a', 'c', 'b', 'd']
    """
    import networkx as nx

    dag = model.dag
    started: dict[str, int] = {}
    for k in kernels:
        started.setdefault(k["op"], k["time_ns"])
    topo = list(nx.topological_sort(dag))
    rank = {op: i for i, op in enumerate(topo)}

    def source(tensor: str) -> str:
        """The op whose output ``tensor`` is as run: an ``IdentityN`` passes on its input."""
        op, index = tensor.rsplit(":", 1)
        while dag.nodes[op]["type"] == "IdentityN":
            op, index = model.inputs_of[op][int(index)].rsplit(":", 1)
        return op

    t: dict[str, int] = {}
    for op in topo:
        waits_for = {source(name) for name in model.inputs_of[op]}
        waits_for.update(p for p in dag.predecessors(op) if dag.edges[p, op]["control"])
        after = max((t[p] for p in waits_for), default=0)
        t[op] = max(started.get(op, after), after)
    return sorted(topo, key=lambda op: (t[op], rank[op]))


def anatomy_step(
    model: str,
    batch: int,
    size: int | None = None,
    mode: str = "lms",
    options: dict[str, Any] | None = None,
    warmup: int = 2,
) -> dict[str, Any]:
    """In a measured process: what one profiled step's measured peak holds, and what the simulator holds.

    Trains ``warmup`` steps of ``model`` (plain, or rewritten by :func:`tflms.optimize` with
    ``options`` for ``mode='lms'``), then one step under the profiler (:func:`peak_anatomy`; the profiler
    slows the step, and on the test bed that changes how long swapped tensors wait for the
    link, so its peak can differ from an unprofiled one, which is also returned). Every
    buffer is sorted into ``forward``, ``backward``, ``update`` (the op's phase in the
    traced step; a recompute clone is a backward op, as the planner simulates it), ``swap``
    (tflms's swap ops, and the transfers' receives, which carry no op name) or ``other``
    (ops Grappler made).

    The rewritten step is called as ``tflms.function`` calls it (within
    :func:`tflms.manual_memory_optimizer` unless ``options`` turn that off), the plain one at
    TensorFlow's setting: ``memory_optimizer`` is ``'auto'``, as in :func:`measure_step`.

    Returns ``{'model', 'batch', 'size', 'mode', 'memory_optimizer', 'measured_peak' (unprofiled),
    'profiled': {'in_use', 'requested', 'variables', 'op', 'op_phase', 'by_phase', 'top'},
    'predicted': {'peak', 'requested', 'variables', 'op', 'op_phase', 'by_phase', 'top'},
    'predicted_at_measured_op', 'recorded_order': {'peak', 'requested', 'ops_recorded', 'ops'},
    'replayed': {'allocator', 'peak', 'measured', 'out_of_memory'}}``:
    bytes per phase at each peak, the 12 largest buffers, the simulator's buffers at the
    position of the op that reached the measured peak (None when that op is not in the
    traced step, e.g. one Grappler made), and the simulator's peaks when it runs the ops in
    the order the profiled step started them (:func:`recorded_order`), and ``'replayed'``: the
    simulator's allocator emulation run on the profiled step's own allocations
    (:func:`replay_allocations`). ``requested`` leaves
    out the allocator's rounding and unsplit rests: predicted, the simulator's requested
    bytes plus the variables; measured, what the live chunks' ops asked for plus what the
    allocator held before the step (``variables``, in chunks).
    """
    import tensorflow as tf

    from ..emulate.simulator import Simulator
    from ..integrations.function import optimize
    from ..ir.graph import GraphModel
    from ..plan.registry import replay
    from . import testbed

    if mode not in ("plain", "lms"):
        raise ValueError(f"mode must be 'plain' or 'lms'. Received: mode={mode!r}")
    check_int("warmup", warmup, 0)
    _, x, y, train_step = build(model, batch, size)
    cf = tf.function(train_step).get_concrete_function(x, y)
    graph_model = GraphModel.from_func_graph(cf.graph)
    step, swaps, host, serialize = cf, (), None, None
    if mode == "lms":
        step, plan = optimize(cf, device=testbed.DEVICE, host=testbed.HOST, **_optimize_options(options))
        swaps, host, serialize = plan.swaps, testbed.HOST, plan.options["serialize"]
        # The step as planned and simulated: with its recompute clones (backward ops).
        graph_model = replay(graph_model, plan)
    sim = Simulator(graph_model, host)
    phase = functools.partial(_phase_of, graph_model)
    # The rewritten step is called as tflms.function calls it.
    manual, layout_off = _as_tflms_calls(options) if mode == "lms" else (False, False)
    measured_peak, records, kernels = _profiled_step(step, x, y, warmup, manual=manual, layout_off=layout_off)
    anatomy = peak_anatomy(records)
    # Recorded starts are ordered on the graph as run (Grappler's push-downs applied).
    in_order = Simulator(graph_model, host, order=recorded_order(sim.executed, kernels))
    profile = sim.profile(swaps)
    pos = {op: i for i, op in enumerate(profile.schedule)}
    at = pos.get(anatomy["op"])
    return {
        "model": model,
        "batch": batch,
        "size": size or MODELS[model][1],
        "mode": mode,
        "serialize": serialize,
        "memory_optimizer": "auto",
        "measured_peak": measured_peak,
        "profiled": {
            "in_use": anatomy["in_use"],
            "requested": anatomy["requested"] + anatomy["before"],
            "variables": anatomy["before"],
            "op": anatomy["op"],
            "op_phase": phase(anatomy["op"]),
            **_phase_summary([(c["op"], phase(c["op"]), c["bytes"]) for c in anatomy["live"]]),
        },
        "predicted": {
            "peak": profile.peak_bytes,
            "requested": sim.requested_peak(swaps),
            "variables": graph_model.variable_bytes,
            **_simulated_at(sim, profile, swaps, phase, pos[profile.peak_op]),
        },
        "predicted_at_measured_op": None if at is None else _simulated_at(sim, profile, swaps, phase, at),
        "recorded_order": {
            "peak": in_order.peak(swaps),
            "requested": in_order.requested_peak(swaps),
            "ops_recorded": len({r["op"] for r in kernels} & set(graph_model.dag)),
            "ops": graph_model.dag.number_of_nodes(),
        },
        "replayed": replay_allocations(records, anatomy["allocator"]),
    }


def _phase_of(graph_model: GraphModel, op: str) -> str:
    """The phase :func:`anatomy_step` sorts a buffer of ``op`` into."""
    from ..rewrite.apply import is_landing

    if op in graph_model.dag:
        return graph_model.phase(op)
    # tflms's swap ops; the receive of a transfer allocates in gRPC's thread, with no op annotation.
    return "swap" if not op or op.startswith("tflms_") or is_landing(op) else "other"


def _phase_summary(buffers: list[tuple[str, str, int]]) -> dict[str, Any]:
    """Bytes per phase of ``buffers`` (``(name, phase, bytes)``, largest first), and the 12 largest."""
    by_phase: dict[str, int] = {}
    for _, where, nbytes in buffers:
        by_phase[where] = by_phase.get(where, 0) + nbytes
    return {"by_phase": by_phase, "top": [[name, nbytes] for name, _, nbytes in buffers[:12]]}


def _simulated_at(
    sim: Any, profile: Any, swaps: Sequence[Any], phase: Callable[[str], str], position: int
) -> dict[str, Any]:
    """The simulator's live buffers at ``position`` of its schedule, as :func:`anatomy_step` reports them."""
    buffers = [
        (
            name,
            "swap" if "(swap-in" in name else "update" if "(copied by" in name else phase(name.split(":")[0]),
            nbytes,
        )
        for name, nbytes in sim.live(position, swaps)
    ]
    op = profile.schedule[position]
    return {"op": op, "op_phase": phase(op), **_phase_summary(buffers)}


def _profiled_step(
    step: Any, x: Any, y: Any, warmup: int, *, manual: bool, layout_off: bool
) -> tuple[int, list[dict[str, Any]], list[dict[str, Any]]]:
    """``warmup`` steps, one measured step and one profiled step on the test bed's device:
    ``(measured peak, allocator records, kernel records)``."""
    import tensorflow as tf

    from .. import _tf_internal as tfi
    from . import testbed

    with tf.device(testbed.DEVICE), tfi.memory_optimization("MANUAL" if manual else None, layout_off=layout_off):
        for _ in range(warmup):
            step(x, y)
        testbed.reset_peak()
        step(x, y)
        measured_peak = testbed.memory()["peak"]
        records, kernels = tfi.profile_step(lambda: step(x, y))
    return measured_peak, records, kernels
