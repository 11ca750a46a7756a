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
"""

from __future__ import annotations

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
    "grappler_optimize",
]


def copy_graph(cf: ConcreteFunction) -> Any:
    """A fresh, editable FuncGraph equal to ``cf.graph`` (same op names, captures, outputs).

    The GraphDef of ``cf.graph`` (library functions included) is imported into a
    new FuncGraph; inputs, captures (with their resource handle data), outputs,
    control outputs, variables and nested functions are carried over.
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
    av = attr_value_pb2.AttrValue(b=value) if isinstance(value, bool) else attr_value_pb2.AttrValue(s=value.encode())
    op._set_attr(name, av)  # noqa: SLF001


def update_input(op: Any, index: int, tensor: Any) -> None:
    op._update_input(index, tensor)  # noqa: SLF001


def add_control_input(op: Any, control: Any) -> None:
    op._add_control_input(control)  # noqa: SLF001


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
