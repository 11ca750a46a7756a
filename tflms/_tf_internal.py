"""Every use of TensorFlow private internals lives here (checked on TF 2.21).

A TensorFlow upgrade that breaks tflms should break only this module, and
``tests/test_tf_internals.py`` pins each fact used here.

* ``function_def_to_graph`` turns the step's FunctionDef into a *new* FuncGraph:
  the user's ConcreteFunction and its graph are never edited.
* ``FuncGraph.add_capture`` re-binds the captured variables in order.
* ``ConcreteFunction.from_func_graph(graph, function_type, attrs)`` builds a new
  callable with the original signature.
* ``Operation._update_input`` rewires a consumer; ``Operation._set_attr`` marks
  swap ops with ``_grappler_do_not_remove`` (otherwise Grappler deletes swap-ins
  and merges swap-outs).
"""

from __future__ import annotations

from typing import Any

import tensorflow as tf
from tensorflow.core.framework import attr_value_pb2
from tensorflow.python.eager.polymorphic_function.concrete_function import ConcreteFunction
from tensorflow.python.framework import function_def_to_graph
from tensorflow.python.util import nest

__all__ = [
    "ConcreteFunction",
    "copy_graph",
    "rebuild",
    "set_attr",
    "update_input",
    "grappler_optimize",
]


def copy_graph(cf: ConcreteFunction) -> Any:
    """A fresh, editable FuncGraph equal to ``cf.graph`` (same op names, captures, outputs)."""
    src = cf.graph
    graph = function_def_to_graph.function_def_to_graph(
        cf.function_def,
        structured_input_signature=src.structured_input_signature,
        propagate_device_spec=True,
        include_library_functions=True,
    )
    n_captures = len(src.captures)
    inputs = list(graph.inputs)
    n_args = len(inputs) - n_captures
    graph.inputs = inputs[:n_args]
    for (external, _), placeholder in zip(src.captures, inputs[n_args:]):
        graph.add_capture(external, placeholder)
    graph.variables = src.variables
    # Outputs correspond by position; rebuild the structured outputs from them.
    by_id = {id(t): graph.outputs[i] for i, t in enumerate(src.outputs)}
    flat = nest.flatten(src.structured_outputs, expand_composites=True)
    graph.structured_outputs = nest.pack_sequence_as(
        src.structured_outputs,
        [by_id.get(id(t), t) if isinstance(t, tf.Tensor) else t for t in flat],
        expand_composites=True,
    )
    return graph


def rebuild(cf: ConcreteFunction, graph: Any) -> ConcreteFunction:
    """A callable ConcreteFunction over the edited ``graph`` with ``cf``'s signature."""
    return ConcreteFunction.from_func_graph(graph, cf.function_type, attrs={})


def set_attr(op: Any, name: str, value: bool | str) -> None:
    av = attr_value_pb2.AttrValue(b=value) if isinstance(value, bool) else attr_value_pb2.AttrValue(s=value.encode())
    op._set_attr(name, av)  # noqa: SLF001


def update_input(op: Any, index: int, tensor: Any) -> None:
    op._update_input(index, tensor)  # noqa: SLF001


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
