"""Every use of TensorFlow private internals lives here (checked on TF 2.21).

A TensorFlow upgrade that breaks tflms should break only this module, and
``tests/test_tf_internals.py`` pins each fact used here.

* ``importer.import_graph_def_for_function`` imports the step's GraphDef into a
  *new* FuncGraph: the user's ConcreteFunction and its graph are never edited.
* ``FuncGraph.add_capture`` re-binds the captured variables in order;
  ``handle_data_util.copy_handle_data`` keeps their resource shapes/dtypes;
  ``FuncGraph._add_function_recursive`` carries nested (while/cond) functions.
* ``ConcreteFunction.from_func_graph(graph, function_type, attrs)`` builds a new
  callable with the original signature.
* ``Operation._update_input`` rewires a consumer; ``Operation._add_control_input``
  attaches a swap-in's trigger; ``Operation._set_attr`` marks
  swap ops with ``_grappler_do_not_remove`` (otherwise Grappler deletes swap-ins
  and merges swap-outs).
* ``Graph._create_op_internal`` makes a recompute's clone of a forward op (same type,
  attributes and op def, other inputs and name).
* ``op_def_registry.get`` tells whether an op type exists (``tflms.config``).
* ``context.context().function_call_options`` (thread-local) carries the ``ConfigProto``
  with which the runtime instantiates a function called under it (eagerly, or the call
  op traced under it): :func:`memory_optimization` sets Grappler's memory optimizer
  to ``MANUAL`` there, and turns its layout optimizer off where it would convert
  (:func:`layout_converts`).
* Keras 3 (TensorFlow backend) internals used by ``LMSCallback`` (``keras_*``
  functions below; pinned by ``tests/integrations/test_keras.py``): ``Model._make_function`` and
  ``_jit_compile`` to install the rewritten step, ``_resolve_auto_jit_compile``,
  ``_flatten_layers``/``_symbolic_build`` to build a model before broadcasting it, and
  what Keras's ``train_step`` uses (``_call_has_training_arg``, ``_compute_loss``,
  ``_loss_tracker``, ``keras.src``'s ``unscale_loss_for_distribution``).
* tf-keras 2.x internals used by ``LMSCallback`` with a tf-keras model (``tf_keras_*``
  functions below; pinned by ``tests/integrations/test_tf_keras.py``): ``Model._train_counter``,
  ``_steps_per_execution`` and ``_minimum_control_deps`` and ``reduce_per_replica`` of
  ``tf_keras.src.engine.training``, to run the step as ``make_train_function`` does.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import tensorflow as tf
from tensorflow.core.framework import attr_value_pb2
from tensorflow.python.eager.polymorphic_function.concrete_function import ConcreteFunction
from tensorflow.python.framework import func_graph as func_graph_module
from tensorflow.python.framework import importer
from tensorflow.python.ops import handle_data_util
from tensorflow.python.util import nest

__all__ = [
    "ConcreteFunction",
    "copy_graph",
    "rebuild",
    "must_compile_with_xla",
    "set_attr",
    "update_input",
    "add_control_input",
    "clone_op",
    "replace_control_input",
    "grappler_optimize",
    "profile_step",
    "profile_kernels",
    "ran_graphs",
    "memory_optimization",
    "layout_converts",
    "rewrite_options",
    "op_type_registered",
    "keras_make_function",
    "keras_auto_jit_compile",
    "keras_layers_built",
    "keras_symbolic_build",
    "keras_call_has_training_arg",
    "keras_compute_loss",
    "keras_loss_tracker",
    "keras_unscale_loss_for_distribution",
]


def copy_graph(cf: ConcreteFunction) -> Any:
    """A fresh, editable FuncGraph equal to ``cf.graph`` (same op names, captures, outputs).

    The GraphDef of ``cf.graph`` (library functions included) is imported into a
    new FuncGraph; inputs, captures (with their resource handle data), outputs,
    control outputs, variables and nested functions are carried over, and each tensor gets
    ``cf.graph``'s static shape (the import infers shapes before the captures have their handle
    data, so a variable's shape, and what follows from it, would be unknown).
    """
    src = cf.graph
    graph = func_graph_module.FuncGraph(src.name, structured_input_signature=src.structured_input_signature)
    with graph.as_default():
        importer.import_graph_def_for_function(src.as_graph_def(), name="")
    by_name = graph.get_tensor_by_name
    n_args = len(src.inputs) - len(src.captures)
    graph.inputs = [by_name(t.name) for t in src.inputs[:n_args]]
    for external, internal in src.captures:
        placeholder = by_name(internal.name)
        if internal.dtype == tf.resource:
            handle_data_util.copy_handle_data(internal, placeholder)
        graph.add_capture(external, placeholder)
    for op in src.get_operations():
        for t in op.outputs:
            by_name(t.name).set_shape(t.shape)
    graph.outputs = [by_name(t.name) for t in src.outputs]
    graph.control_outputs = [graph.get_operation_by_name(op.name) for op in src.control_outputs]
    graph.variables = src.variables
    for f in src._functions.values():  # noqa: SLF001 - nested functions (while/cond bodies)
        graph._add_function_recursive(f)  # noqa: SLF001
    flat = nest.flatten(src.structured_outputs, expand_composites=True)
    graph.structured_outputs = nest.pack_sequence_as(
        src.structured_outputs,
        [by_name(t.name) if isinstance(t, tf.Tensor) else t for t in flat],
        expand_composites=True,
    )
    return graph


def must_compile_with_xla(cf: ConcreteFunction) -> bool:
    """True when ``cf`` was traced by ``tf.function(jit_compile=True)`` (``_XlaMustCompile``)."""
    attr = cf.function_def.attr
    return "_XlaMustCompile" in attr and bool(attr["_XlaMustCompile"].b)


def rebuild(cf: ConcreteFunction, graph: Any) -> ConcreteFunction:
    """A callable ConcreteFunction over the edited ``graph`` with ``cf``'s signature."""
    return ConcreteFunction.from_func_graph(graph, cf.function_type, attrs={})


def set_attr(op: Any, name: str, value: bool | str) -> None:
    """Set attribute ``name`` of graph op ``op`` to a bool or string (``Operation._set_attr``)."""
    av = attr_value_pb2.AttrValue(b=value) if isinstance(value, bool) else attr_value_pb2.AttrValue(s=value.encode())
    op._set_attr(name, av)  # noqa: SLF001


def set_device(op: Any, device: str) -> None:
    """Place graph op ``op`` on ``device`` (``Operation._set_device``; ``tf.device`` only places
    ops made inside it)."""
    op._set_device(device)  # noqa: SLF001


def keras_base_optimizer() -> Any:
    """Keras 3's optimizer base class (``keras.src.optimizers.base_optimizer.BaseOptimizer``),
    whose backend-neutral ``add_variable_from_reference`` places a slot by the device scope."""
    import keras

    return keras.src.optimizers.base_optimizer.BaseOptimizer


def update_input(op: Any, index: int, tensor: Any) -> None:
    """Make ``tensor`` input ``index`` of graph op ``op`` (``Operation._update_input``)."""
    op._update_input(index, tensor)  # noqa: SLF001


def add_control_input(op: Any, control: Any) -> None:
    """Make graph op ``op`` wait for ``control`` (``Operation._add_control_input``)."""
    op._add_control_input(control)  # noqa: SLF001


def replace_control_input(op: Any, old: Any, new: Any) -> None:
    """Make graph op ``op`` wait for ``new`` instead of ``old`` (``Operation._remove_all_control_inputs``)."""
    controls = [new if c is old else c for c in op.control_inputs]
    op._remove_all_control_inputs()  # noqa: SLF001
    op._add_control_inputs(controls)  # noqa: SLF001


def clone_op(graph: Any, op: Any, inputs: list, name: str) -> Any:
    """A new op in ``graph`` like ``op`` (type, attributes except colocation) reading ``inputs``,
    named exactly ``name`` (``Graph._create_op_internal``); ``ValueError`` if the name is taken."""
    attrs = {k: v for k, v in op.node_def.attr.items() if k != "_class"}
    with graph.name_scope(None):
        new = graph._create_op_internal(  # noqa: SLF001
            op.type, inputs, dtypes=[t.dtype for t in op.outputs], name=name, attrs=attrs, op_def=op.op_def
        )
    if new.name != name:
        raise ValueError(f"tflms: cannot name the clone of {op.name!r} {name!r}: that name is taken ({new.name!r})")
    return new


def grappler_optimize(cf: ConcreteFunction, device: str, config: Any = None) -> Any:
    """The GraphDef Grappler makes of ``cf``'s body, as the runtime would see it.

    The function runtime places ops before Grappler runs, so unplaced ops are put
    on ``device`` (the device the function is called on) first; without placement
    Grappler keeps cross-device Identity ops it would otherwise delete. The
    function's outputs are the fetch nodes. Used to check that swap ops survive.
    """
    from tensorflow.core.protobuf import config_pb2, meta_graph_pb2
    from tensorflow.python.grappler import tf_optimizer

    def full(dev: str) -> str:
        spec = tf.DeviceSpec.from_string(dev)
        return tf.DeviceSpec(
            job="localhost", replica=0, task=0, device_type=spec.device_type, device_index=spec.device_index
        ).to_string()

    graph = cf.graph
    graph_def = graph.as_graph_def()
    default = full(device)
    for node in graph_def.node:
        node.device = full(node.device) if node.device else default
    meta = meta_graph_pb2.MetaGraphDef(graph_def=graph_def)
    fetch = meta_graph_pb2.CollectionDef()
    for t in graph.outputs:
        fetch.node_list.value.append(t.name)
    for op in graph.control_outputs:
        fetch.node_list.value.append(op.name)
    meta.collection_def["train_op"].CopyFrom(fetch)
    return tf_optimizer.OptimizeGraph(config or config_pb2.ConfigProto(), meta)


@contextlib.contextmanager
def memory_optimization(
    level: str | None, keep_explicit: bool = False, layout_off: bool = False, device: str | None = None
) -> Iterator[None]:
    """Within it, functions are instantiated with Grappler's memory optimizer at ``level``, a
    ``RewriterConfig.MemOptType`` name (``'MANUAL'``: why, :func:`tflms.integrations.function.manual_memory_optimizer`),
    and with ``layout_off=True`` with Grappler's layout optimizer off where it would convert
    layouts on ``device``, the device the function is called on (:func:`layout_converts`; why:
    the argument ``layout_optimizer`` of :func:`tflms.function`); ``device=None`` is the device scope in effect when the
    context is entered. Where it would convert nothing (a CPU device, no ``cpu_layout_conversion``)
    the layout setting is left as it is, so that the step runs with the same ``ConfigProto`` as a
    plain call. The rest of the current ``ConfigProto`` is kept. ``level=None`` and
    ``layout_off=False`` change nothing.

    ``keep_explicit=True`` keeps what the caller set: a memory level other than Grappler's
    default (``DEFAULT_MEM_OPT``), and a layout optimizer turned on explicitly (``ON``,
    ``AGGRESSIVE`` or an ``EXPERIMENTAL_*`` mode: anything but ``DEFAULT`` and ``OFF``)."""
    from tensorflow.core.protobuf import rewriter_config_pb2

    if level is None and not layout_off:
        yield
        return
    rewriter = rewriter_config_pb2.RewriterConfig
    config = _call_config()
    options = config.graph_options.rewrite_options
    fields: dict[str, int] = {}
    if level is not None and not (keep_explicit and options.memory_optimization != rewriter.DEFAULT_MEM_OPT):
        fields["memory_optimization"] = rewriter.MemOptType.Value(level)
    if (
        layout_off
        and not (keep_explicit and options.layout_optimizer not in (rewriter.DEFAULT, rewriter.OFF))
        and layout_converts(device, config)
    ):
        fields["layout_optimizer"] = rewriter.OFF
    with _rewritten(config, fields):
        yield


def layout_converts(device: str | None = None, config: Any = None) -> bool:
    """Whether Grappler's layout optimizer, left on, may convert the layouts of ops placed on
    ``device`` and add ``Transpose`` ops at the edges of what it converted.

    It converts on a GPU (to NCHW, or NHWC for half precision on Tensor Cores); on a CPU
    only where ``config`` (a ``ConfigProto``; default: the thread's function call options)
    asks for a conversion (``rewrite_options.cpu_layout_conversion``, e.g. ``NCHW_TO_NHWC``).
    Otherwise its CPU pass returns the graph unchanged (``GenericLayoutOptimizer::Optimize``).
    Any other device type, or a string that names no one device, is answered ``True``
    (unknown: assume it may convert).
    ``device=None`` is the device scope in effect (``tf.device``), and without one the device
    the runtime places unplaced ops on: the first GPU, else the CPU.
    """
    from tensorflow.core.protobuf import rewriter_config_pb2
    from tensorflow.python.eager import context

    from ._devices import parse

    if config is None:
        config = _call_config()
    if device is None:
        device = context.context().device_name or ""
    try:
        kind = parse(device).type if device else None
    except ValueError:  # not one device (a wildcard): assume it may convert
        return True
    if kind is None:
        kind = "GPU" if tf.config.list_logical_devices("GPU") else "CPU"
    if kind.upper() != "CPU":
        return True
    conversion = config.graph_options.rewrite_options.cpu_layout_conversion
    return conversion != rewriter_config_pb2.RewriterConfig.NO_CONVERSION_ON_CPU


def _call_config() -> Any:
    """A copy of the ``ConfigProto`` of the thread's function call options."""
    from tensorflow.core.protobuf import config_pb2
    from tensorflow.python.eager import context

    config = config_pb2.ConfigProto()
    serialized = context.context().function_call_options.config_proto_serialized
    if serialized:
        config.ParseFromString(serialized)
    return config


@contextlib.contextmanager
def rewrite_options(**fields: int) -> Iterator[None]:
    """Within it, functions are instantiated with these ``RewriterConfig`` fields set
    (``cpu_layout_conversion=NCHW_TO_NHWC``, ``layout_optimizer=OFF``, ...) on the thread's
    function call options; the rest of its ``ConfigProto`` is kept. No fields: no change."""
    if not fields:
        yield
        return
    with _rewritten(_call_config(), fields):
        yield


@contextlib.contextmanager
def _rewritten(config: Any, fields: dict[str, int]) -> Iterator[None]:
    """:func:`rewrite_options` on ``config``, the thread's call options' ``ConfigProto`` as read."""
    from tensorflow.python.eager import context

    if not fields:
        yield
        return
    ctx = context.context()
    previous = ctx.function_call_options
    for name, value in fields.items():
        setattr(config.graph_options.rewrite_options, name, value)
    ctx.function_call_options = context.FunctionCallOptions(executor_type=previous.executor_type, config_proto=config)
    try:
        yield
    finally:
        ctx.function_call_options = previous


def ran_graphs(fn: Any) -> list[Any]:
    """Call ``fn()`` once; the ``GraphDef`` of every partition the function runtime ran for it.

    The graphs as executed: after Grappler, partitioning and the passes after it (oneDNN's
    layout rewrite). The runtime reports them when it instantiates a function, so only a
    function's first call has any (``context.enable_graph_collection`` and
    ``export_run_metadata``).
    """
    from tensorflow.python.eager import context

    ctx = context.context()
    ctx.enable_graph_collection()
    try:
        fn()
        metadata = ctx.export_run_metadata()
    finally:
        ctx.disable_graph_collection()
    return [pg for fg in metadata.function_graphs for pg in fg.partition_graphs]


def profile_step(fn: Any) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """Call ``fn()`` once under TensorFlow's profiler: its allocators' events and the kernels it ran.

    Read from the profiler's XSpace (``xplane_pb2``, TensorFlow's own copy of the protocol
    buffer). Returns ``(allocations, kernels)``, each in time order:

    * the BFC allocator records a ``MemoryAllocation``/``MemoryDeallocation`` event per
      chunk while a profiler runs (``bfc_allocator.cc``), with the op that asked for it
      (``tf_op``), its region type (``output``, ``temp``...) and the allocator's bytes in
      use after it. Each record: ``time_ns``, ``kind`` (``'alloc'`` or ``'free'``),
      ``allocator``, ``addr``, ``bytes`` (the chunk), ``requested``, ``in_use``, ``op``,
      ``region``, ``shape``;
    * the executor's threads (lines named ``tf_Compute...``) record one event per kernel,
      named ``'<op>:<kernel type>'``. Each record: ``time_ns`` (start), ``duration_ns``,
      ``op``, ``type``, ``thread``.
    """
    return _space_records(_profiled_space(fn))


def _space_records(space: Any) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """:func:`profile_step`'s records of a profiler's ``XSpace``."""
    kinds = {"MemoryAllocation": "alloc", "MemoryDeallocation": "free"}
    records, kernels = [], []
    for plane in space.planes:
        names = {k: v.name for k, v in plane.event_metadata.items()}
        stat_names = {k: v.name for k, v in plane.stat_metadata.items()}
        for line in plane.lines:
            compute = line.name.startswith("tf_Compute")
            for event in line.events:
                name = names.get(event.metadata_id, "")
                time_ns = line.timestamp_ns + event.offset_ps // 1000
                kind = kinds.get(name)
                if kind is None:
                    if compute and ":" in name:
                        op, op_type = name.rsplit(":", 1)
                        kernels.append(
                            {
                                "time_ns": time_ns,
                                "duration_ns": event.duration_ps // 1000,
                                "op": op,
                                "type": op_type,
                                "thread": line.name,
                            }
                        )
                    continue
                stats: dict[str, Any] = {}
                for st in event.stats:
                    which = st.WhichOneof("value")
                    if which == "ref_value":
                        value: Any = stat_names.get(st.ref_value, "")
                    else:
                        value = getattr(st, which or "str_value")
                    stats[stat_names.get(st.metadata_id, "")] = value
                records.append(
                    {
                        "time_ns": time_ns,
                        "kind": kind,
                        "allocator": str(stats.get("allocator_name", "")),
                        "addr": int(stats.get("addr", 0)),
                        "bytes": int(stats.get("allocation_bytes", 0)),
                        "requested": int(stats.get("requested_bytes", 0)),
                        "in_use": int(stats.get("bytes_allocated", 0)),
                        "op": str(stats.get("tf_op", "")),
                        "region": str(stats.get("region_type", "")),
                        "shape": str(stats.get("shape", "")),
                    }
                )
    records.sort(key=lambda r: r["time_ns"])
    kernels.sort(key=lambda r: r["time_ns"])
    return records, kernels


def _profiled_space(fn: Any) -> Any:
    """Call ``fn()`` once under TensorFlow's profiler; the profiler's ``XSpace``."""
    import glob
    import tempfile

    from tensorflow.tsl.profiler.protobuf import xplane_pb2

    with tempfile.TemporaryDirectory(prefix="tflms-profile-") as logdir:
        tf.profiler.experimental.start(logdir)
        try:
            fn()
        finally:
            tf.profiler.experimental.stop()
        space = xplane_pb2.XSpace()
        for path in glob.glob(f"{logdir}/**/*.xplane.pb", recursive=True):
            with open(path, "rb") as f:
                space.MergeFromString(f.read())
    return space


def _annotated_op(annotation: str) -> tuple[str, str] | None:
    """``(op, type)`` from a GPU kernel's annotation: the innermost ``name:type`` of
    ``outer::inner`` (TensorFlow's ``ScopedAnnotation`` of the launching op), any ``#...#``
    metadata left out; ``None`` when there is none."""
    inner = annotation.split("::")[-1].split("#")[0]
    if ":" not in inner:
        return None
    op, op_type = inner.rsplit(":", 1)
    return (op, op_type) if op else None


def profile_kernels(fn: Any, allocations: bool = False) -> list[dict[str, Any]]:
    """Call ``fn()`` once under TensorFlow's profiler; every kernel it ran, in time order.

    Each record: ``time_ns`` (start), ``duration_ns``, ``op``, ``type``, ``thread`` and
    ``source``: ``'executor'`` for the executor's threads' records (lines ``tf_Compute...``,
    as :func:`profile_step` reads them: on a CPU the op's compute time; on a GPU the time to
    enqueue its kernels), ``'device'`` for the kernels a GPU ran (the planes ``/device:GPU:N``,
    one line per stream; the op read from the kernel's ``tf_op`` or ``kernel_annotation``
    stat; memory copies, ``Memcpy...`` events, are left out: they are transfers, not compute).
    With ``allocations``, the BFC allocators' allocations (as :func:`profile_step` reads them,
    ``kind == 'alloc'``) are in the list too, with ``source`` ``'allocator'``.
    """
    space = _profiled_space(fn)
    records = _space_records(space)[0] if allocations else []
    kernels = [{**r, "source": "allocator"} for r in records if r["kind"] == "alloc"]
    for plane in space.planes:
        names = {k: v.name for k, v in plane.event_metadata.items()}
        stat_names = {k: v.name for k, v in plane.stat_metadata.items()}
        device = plane.name.startswith("/device:GPU")
        for line in plane.lines:
            executor = line.name.startswith("tf_Compute")
            if not executor and not device:
                continue
            for event in line.events:
                name = names.get(event.metadata_id, "")
                if device:
                    if name.startswith("Memcpy"):
                        continue
                    found = None
                    for st in event.stats:
                        if stat_names.get(st.metadata_id, "") in ("tf_op", "kernel_annotation"):
                            which = st.WhichOneof("value")
                            text = stat_names.get(st.ref_value, "") if which == "ref_value" else str(getattr(st, which))
                            found = found or _annotated_op(text)
                    if found is None:
                        continue
                    op, op_type = found
                elif name.count(":") == 1:  # an op's 'name:type', not the executor's own 'ExecutorState::Process'
                    op, op_type = name.rsplit(":", 1)
                else:
                    continue
                kernels.append(
                    {
                        "time_ns": line.timestamp_ns + event.offset_ps // 1000,
                        "duration_ns": event.duration_ps // 1000,
                        "op": op,
                        "type": op_type,
                        "thread": f"{plane.name}/{line.name}" if device else line.name,
                        "source": "device" if device else "executor",
                    }
                )
    kernels.sort(key=lambda r: r["time_ns"])
    return kernels


# -- TensorFlow's op registry (tflms.config) -------------------------------------------


def allocator_limit(device_type: str, index: int) -> int | None:
    """The memory limit, in bytes, of this process's allocator for the local device
    ``device_type:index`` as TensorFlow reports it (``device_lib``'s ``memory_limit``: for a
    GPU, the allocator's limit, a ``memory_limit`` of a logical device included), or ``None``
    where TensorFlow has no such device."""
    from tensorflow.python.client import device_lib

    for d in device_lib.list_local_devices():
        if d.device_type == device_type and d.name.rsplit(":", 1)[-1] == str(index):
            return int(d.memory_limit) or None
    return None


def op_type_registered(op_type: str) -> bool:
    """Whether TensorFlow knows the op type ``op_type`` (private ``op_def_registry.get``)."""
    from tensorflow.python.framework import op_def_registry

    return op_def_registry.get(op_type) is not None


# -- Keras 3 internals (tflms.integrations.keras, tflms.integrations.horovod.callback;
#    pinned in tests/integrations/test_keras.py) --
# Imported inside the functions: a step without Keras never imports it through this module.


def keras_make_function(model: Any, step: Any, jit_compile: bool) -> Any:
    """``Model._make_function(step)`` with ``Model._jit_compile`` set to ``jit_compile`` meanwhile."""
    saved = model._jit_compile  # noqa: SLF001 - read once by _make_function when it wraps the step
    model._jit_compile = jit_compile  # noqa: SLF001
    try:
        return model._make_function(step)  # noqa: SLF001
    finally:
        model._jit_compile = saved  # noqa: SLF001


def keras_steps_per_execution(model: Any) -> int:
    """How many batches one call of Keras's train function runs (``Model.steps_per_execution``)."""
    return int(getattr(model, "steps_per_execution", 1) or 1)


def keras_run_step(model: Any, step: Any, data: Any) -> Any:
    """Run ``step(data)`` as Keras's ``one_step_on_data`` does (``trainer.py``, TensorFlow backend):
    optional inputs (``tf.experimental.Optional``) as ``None``, the step under the model's
    distribution strategy, its outputs reduced across replicas."""
    from keras.src import tree
    from keras.src.backend.tensorflow.trainer import reduce_per_replica

    data = tree.map_structure(lambda i: None if isinstance(i, tf.experimental.Optional) else i, data)
    strategy = model.distribute_strategy
    return reduce_per_replica(strategy.run(step, args=(data,)), strategy, reduction="auto")


def keras_auto_jit_compile(model: Any) -> bool | None:
    """What Keras's ``jit_compile="auto"`` resolves to here (``Model._resolve_auto_jit_compile``); None: unknown."""
    resolve = getattr(model, "_resolve_auto_jit_compile", None)
    if resolve is None:
        return None
    try:
        return bool(resolve())
    except Exception:  # noqa: BLE001 - a Keras internal: any failure means "cannot tell"
        return None


def keras_layers_built(model: Any) -> bool:
    """Whether every layer of ``model`` is built (``Model._flatten_layers``, Keras's own check)."""
    return all(layer.built for layer in model._flatten_layers())  # noqa: SLF001


def keras_symbolic_build(model: Any, data_batch: Any) -> None:
    """Build ``model`` (and its optimizer) from symbolic ``data_batch`` (``Trainer._symbolic_build``)."""
    model._symbolic_build(data_batch=data_batch)  # noqa: SLF001


def keras_call_has_training_arg(model: Any) -> bool:
    """Whether ``model.call`` takes ``training`` (``Layer._call_has_training_arg``)."""
    return bool(model._call_has_training_arg)  # noqa: SLF001


def keras_compute_loss(model: Any, **kwargs: Any) -> Any:
    """``Trainer._compute_loss(**kwargs)``: the loss ``Model.train_step`` computes (``training=`` aware)."""
    return model._compute_loss(**kwargs)  # noqa: SLF001


def keras_loss_tracker(model: Any) -> Any:
    """The model's loss metric that ``Model.train_step`` updates (``Trainer._loss_tracker``)."""
    return model._loss_tracker  # noqa: SLF001


def keras_unscale_loss_for_distribution(loss: Any) -> Any:
    """``keras.src.losses.loss.unscale_loss_for_distribution(loss)``, as ``Model.train_step`` calls it."""
    from keras.src.losses.loss import unscale_loss_for_distribution

    return unscale_loss_for_distribution(loss)


# -- tf-keras 2.x internals (LMSCallback with a tf-keras model; pinned in tests/integrations/test_tf_keras.py) --
# tf-keras is never imported here unless the model is one of its own (it is then imported already).

_TF_KERAS_TRAINING = "tf_keras.src.engine.training"  # tf-keras's Model, make_train_function, reduce_per_replica


def tf_keras_model(model: Any) -> bool:
    """Whether ``model`` is a tf-keras model (``import tf_keras``, or ``tf.keras`` under
    ``TF_USE_LEGACY_KERAS=1``): an instance of ``tf_keras.src.engine.training.Model``."""
    import sys

    training = sys.modules.get(_TF_KERAS_TRAINING)
    return training is not None and isinstance(model, training.Model)


def tf_keras_counted_step(model: Any, step: Any) -> Any:
    """``step(data) -> logs`` that also counts the step as tf-keras's ``make_train_function``
    (``run_step``) does: ``model._train_counter.assign_add(1)`` after the step's first output
    (``_minimum_control_deps``), in the same traced function."""
    import importlib

    minimum_control_deps = importlib.import_module(_TF_KERAS_TRAINING)._minimum_control_deps  # noqa: SLF001
    counter = model._train_counter  # noqa: SLF001

    def counted_step(data: Any) -> Any:
        outputs = step(data)
        with tf.control_dependencies(minimum_control_deps(outputs)):
            counter.assign_add(1)
        return outputs

    return counted_step


def tf_keras_steps_per_execution(model: Any) -> int:
    """How many batches one call of tf-keras's train function runs now: ``model._steps_per_execution``
    (a variable that ``fit`` lowers for the last partial execution of an epoch)."""
    spe = model._steps_per_execution  # noqa: SLF001
    return 1 if spe is None else max(1, int(spe.numpy().item()))


def tf_keras_run_step(model: Any, step: Any, data: Any) -> Any:
    """Run ``step(data)`` as tf-keras's ``step_function`` does: under the model's distribution
    strategy, its outputs reduced with ``reduce_per_replica`` by ``model.distribute_reduction_method``."""
    import importlib

    reduce_per_replica = importlib.import_module(_TF_KERAS_TRAINING).reduce_per_replica
    strategy = model.distribute_strategy
    outputs = strategy.run(step, args=(data,))
    return reduce_per_replica(outputs, strategy, reduction=model.distribute_reduction_method)
