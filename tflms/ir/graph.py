"""The graph model: a traced step as a ``networkx.DiGraph`` of ops.

Nodes are op names with attributes ``type``, ``device``, ``phase`` (``'forward'``,
``'backward'`` or ``'update'``) and ``level`` (topological generation, data and
control edges both counted). An edge ``u -> v`` carries ``tensors`` (the
:class:`TensorInfo` of each tensor of ``u`` that ``v`` reads: name, dtype, static
shape, bytes; empty for a pure control edge) and ``control`` (``True`` when ``v``
has a control input on ``u``). :attr:`GraphModel.tensors` indexes the same
records by tensor name.

The model is plain data built once per traced graph; the planner and simulator
never look at TensorFlow objects.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Mapping, Sequence
from typing import Any, NamedTuple

import networkx as nx

from .._util import paused_gc

__all__ = [
    "TensorInfo",
    "GraphModel",
    "BACKWARD_SCOPES",
    "UPDATE_OP_TYPES",
    "ALIAS_OP_TYPES",
    "SUM_OP_TYPES",
    "with_orders",
    "op_records",
    "copy_dag",
    "func_graph_sizer",
    "reach",
]

#: Name-scope components under which TensorFlow builds gradient ops.
BACKWARD_SCOPES = ("gradient_tape", "gradients")

#: Op types that write variables: the optimizer update.
UPDATE_OP_TYPES = frozenset({"AssignVariableOp", "AssignSubVariableOp", "AssignAddVariableOp"})

#: Sums. Grappler's arithmetic optimizer folds a tree of them into one ``AddN`` (``AddOpsRewrite``)
#: only where no member has a control edge, so a control edge on one (a fence, an order) can
#: change how the sum associates, and the step's numbers.
SUM_OP_TYPES = frozenset({"Add", "AddV2", "AddN"})


#: Op types whose output shares its first input's buffer (no new allocation).
ALIAS_OP_TYPES = frozenset(
    {
        "Identity",
        "IdentityN",
        "Reshape",
        "Squeeze",
        "ExpandDims",
        "StopGradient",
        "Snapshot",
        "ReadVariableOp",
        "EnsureShape",
        "PreventGradient",
    }
)

#: Functional control-flow ops: their bodies are separate functions that tflms never edits.
CONTROL_FLOW_OP_TYPES = frozenset(
    {
        "While",
        "StatelessWhile",
        "If",
        "StatelessIf",
        "Case",
        "StatelessCase",
        "PartitionedCall",
        "StatefulPartitionedCall",
    }
)


class TensorInfo(NamedTuple):
    """Static facts about one tensor of the graph.

    ``shape`` holds ``None`` for unknown dimensions and is ``None`` for unknown rank;
    ``bytes`` is then an estimate (see :func:`estimate_bytes`) and ``estimated`` is set.
    ``consumers`` lists ``(op_name, input_index)`` pairs in graph order.
    """

    name: str
    op: str
    index: int
    dtype: str
    shape: tuple[int | None, ...] | None
    bytes: int
    estimated: bool
    consumers: tuple[tuple[str, int], ...]

    @property
    def rank(self) -> int | None:
        return None if self.shape is None else len(self.shape)


def estimate_bytes(shape: tuple[int | None, ...] | None, itemsize: int, batch_size: int | None) -> tuple[int, bool]:
    """Bytes of a tensor from its static shape: ``(bytes, estimated)``.

    Rule for unknown sizes: an unknown leading dimension counts as ``batch_size``
    (1 when not given), any other unknown dimension as 1, and an unknown rank as a
    scalar. ``estimated`` tells whether any of that was needed.

    >>> estimate_bytes((None, 128), 4, batch_size=32)
    (16384, True)
    >>> estimate_bytes((8, 8), 2, None)
    (128, False)
    """
    if shape is None:
        return itemsize, True
    n, estimated = 1, False
    for i, d in enumerate(shape):
        if d is None:
            estimated = True
            d = (batch_size or 1) if i == 0 else 1
        n *= d
    return n * itemsize, estimated


_BACKWARD_MARKS = tuple(f"/{scope}/" for scope in BACKWARD_SCOPES)


def _phase_of_name(name: str) -> bool:
    """True if a name-scope component (not the op's own name) is a backward scope."""
    scoped = "/" + name
    return any(mark in scoped for mark in _BACKWARD_MARKS)


@dataclasses.dataclass
class GraphModel:
    """A traced step as data: op DAG, tensors, phases, levels and variable bytes."""

    dag: nx.DiGraph
    tensors: dict[str, TensorInfo]
    variable_bytes: int
    inputs_of: dict[str, list[str]]
    outputs_of: dict[str, list[str]]
    name: str = ""
    #: The captured variables: (the tensor of the handle the step reads it through, bytes), in
    #: the order the step first reads them; empty when unknown (hand-built models), where the
    #: simulator places ``variable_bytes`` as one block.
    variables: tuple[tuple[str, int], ...] = ()

    @property
    def levels(self) -> Mapping[str, int]:
        return nx.get_node_attributes(self.dag, "level")

    def phase(self, op: str) -> str:
        return self.dag.nodes[op]["phase"]

    def level(self, op: str) -> int:
        return self.dag.nodes[op]["level"]

    def has_backward(self) -> bool:
        return any(p == "backward" for _, p in self.dag.nodes(data="phase"))

    # ------------------------------------------------------------------ building
    @classmethod
    def from_ops(
        cls,
        ops: Iterable[Mapping[str, Any]],
        variable_bytes: int = 0,
        name: str = "",
        variables: Sequence[tuple[str, int]] = (),
    ) -> GraphModel:
        """Build from plain records, one per op in graph order.

        Each record has ``name``, ``type``, ``inputs`` (tensor names ``op:i``),
        ``outputs`` (list of ``(dtype, shape, bytes, estimated)``) and optionally
        ``control_inputs`` (op names) and ``device``. This is what
        :meth:`from_func_graph` produces from TensorFlow, and what unit tests write by hand.
        """
        records = list(ops)
        consumers: dict[str, list[tuple[str, int]]] = {}
        for rec in records:
            v = rec["name"]
            for i, tname in enumerate(rec["inputs"]):
                consumers.setdefault(tname, []).append((v, i))
        tensors: dict[str, TensorInfo] = {}
        outputs_of: dict[str, list[str]] = {}
        for rec in records:
            names = outputs_of[rec["name"]] = []
            for i, (dtype, shape, nbytes, est) in enumerate(rec["outputs"]):
                tname = f"{rec['name']}:{i}"
                names.append(tname)
                cons = tuple(consumers.get(tname, ()))
                tensors[tname] = TensorInfo(tname, rec["name"], i, dtype, shape, nbytes, est, cons)
        edges: dict[tuple[str, str], dict[str, Any]] = {}
        for rec in records:
            v = rec["name"]
            for tname in rec["inputs"]:
                t = tensors[tname]
                attrs = edges.get((t.op, v))
                if attrs is None:
                    edges[(t.op, v)] = {"tensors": (t,), "control": False}
                else:
                    attrs["tensors"] += (t,)
            for u in rec.get("control_inputs", ()):
                attrs = edges.get((u, v))
                if attrs is None:
                    edges[(u, v)] = {"tensors": (), "control": True}
                else:
                    attrs["control"] = True
        dag = nx.DiGraph()
        dag.add_nodes_from((rec["name"], {"type": rec["type"], "device": rec.get("device", "")}) for rec in records)
        dag.add_edges_from((u, v, d) for (u, v), d in edges.items())
        model = cls(
            dag=dag,
            tensors=tensors,
            variable_bytes=variable_bytes,
            inputs_of={r["name"]: list(r["inputs"]) for r in records},
            outputs_of=outputs_of,
            name=name,
            variables=tuple((str(t), int(b)) for t, b in variables),
        )
        model._annotate()
        return model

    @classmethod
    def from_func_graph(cls, graph: Any, batch_size: int | None = None, sizes_from: Any = None) -> GraphModel:
        """Build from a TensorFlow ``FuncGraph`` (or any ``tf.Graph``). Python's cyclic garbage
        collector is paused meanwhile (the graph's objects would make each collection long).

        ``sizes_from``: another trace of the same step with concrete shapes (a ``tf.Graph``); a
        tensor whose size ``graph`` leaves unknown takes the shape of the tensor of the same name
        and rank there, so that a step traced with unknown sizes (as Keras traces ``fit``'s step)
        is planned for the sizes it runs with."""
        return func_graph_sizer(graph, sizes_from)(batch_size)

    def _annotate(self) -> None:
        """Set ``level`` and ``phase`` on every node."""
        dag = self.dag
        for level, generation in enumerate(nx.topological_generations(dag)):
            for n in generation:
                dag.nodes[n]["level"] = level
        scoped = {n for n in dag if _phase_of_name(n)}
        # while_v2 gives a *forward* loop accumulator inputs (EmptyTensorList) made under the
        # gradient scope; they, and the scoped constants that only feed them, do not make the
        # forward While (or what follows it) backward.
        loop_inputs = {
            n
            for n in scoped
            if dag.nodes[n]["type"] == "EmptyTensorList" and not any(m in scoped for m in dag.successors(n))
        }
        frontier = [p for n in loop_inputs for p in dag.predecessors(n)]
        while frontier:
            p = frontier.pop()
            if p in scoped and p not in loop_inputs and all(m in loop_inputs for m in dag.successors(p)):
                loop_inputs.add(p)
                frontier.extend(dag.predecessors(p))
        after = reach(dag.successors, scoped - loop_inputs) - scoped  # fed by gradient ops
        before = reach(dag.predecessors, scoped)  # feeding gradient ops
        # Ops between gradient ops (e.g. TensorFlow's gradient AddN, outside the
        # gradient_tape/ scope) are backward too; what only follows them is the update.
        backward = scoped | (after & before)
        after -= backward
        for n, data in dag.nodes(data=True):
            if n in backward:
                data["phase"] = "backward"
            elif n in after or data["type"] in UPDATE_OP_TYPES or data["type"].startswith("ResourceApply"):
                data["phase"] = "update"
            else:
                data["phase"] = "forward"


def func_graph_sizer(graph: Any, sizes_from: Any = None) -> Any:
    """``sized(batch_size) -> GraphModel``, each call equal to ``GraphModel.from_func_graph(graph,
    batch_size)``: ``graph`` (a ``FuncGraph`` or any ``tf.Graph``) is read once, and each call only
    sizes its tensors (:func:`estimate_bytes`), for searches over batch sizes
    (:func:`tflms.max_batch_size`). The cyclic garbage collector is paused while it reads and sizes."""
    with paused_gc():
        known = _known_shapes(sizes_from) if sizes_from is not None else {}
        ops = []
        for op in graph.get_operations():
            outs = []
            for t in op.outputs:
                shape, dtype = t.shape, t.dtype
                dims = tuple(shape.as_list()) if shape.rank is not None else None
                if dims is None or None in dims:
                    other = known.get(t.name)
                    if other is not None and (dims is None or len(other) == len(dims)):
                        dims = other
                outs.append((dtype.name, dims, dtype.size if dtype.is_numpy_compatible else 0))
            ops.append(
                (
                    {
                        "name": op.name,
                        "type": op.type,
                        "device": op.device,
                        "inputs": [t.name for t in op.inputs],
                        "control_inputs": [c.name for c in op.control_inputs],
                    },
                    outs,
                )
            )
        handles = {id(external): internal.name for external, internal in getattr(graph, "captures", ())}
        var_bytes, variables = 0, []
        for v in getattr(graph, "variables", ()):
            if v.shape.is_fully_defined():
                nbytes = v.shape.num_elements() * v.dtype.size
                var_bytes += nbytes
                variables.append((handles.get(id(getattr(v, "handle", None)), ""), nbytes))
        # In the order the step first reads them (graph.variables' order is not deterministic).
        first = {f"{rec['name']}:0": i for i, (rec, _) in enumerate(ops)}
        variables.sort(key=lambda v: (first.get(v[0], len(first)), v[1]))
        name = getattr(graph, "name", "")

    def sized(batch_size: int | None = None) -> GraphModel:
        with paused_gc():
            records = [
                {
                    **rec,
                    "outputs": [(dtype, dims, *estimate_bytes(dims, size, batch_size)) for dtype, dims, size in outs],
                }
                for rec, outs in ops
            ]
            return GraphModel.from_ops(records, variable_bytes=var_bytes, name=name, variables=variables)

    return sized


def _known_shapes(graph: Any) -> dict[str, tuple[int, ...]]:
    """The fully known shapes of ``graph``'s tensors, by name."""
    shapes = {}
    for op in graph.get_operations():
        for t in op.outputs:
            if t.shape.rank is not None and t.shape.is_fully_defined():
                shapes[t.name] = tuple(t.shape.as_list())
    return shapes


def with_orders(model: GraphModel, orders: Sequence[Any]) -> GraphModel:
    """``model`` with a control edge ``after -> op`` for each of ``orders``
    (:class:`tflms.ir.decisions.Order`), as the rewrite adds them; ``model`` itself when there are none."""
    if not orders:
        return model
    ordered = with_order_edges(model, orders)
    ordered._annotate()  # noqa: SLF001 (this module's class)
    return ordered


def with_order_edges(model: GraphModel, orders: Sequence[Any]) -> GraphModel:
    """:func:`with_orders` without recomputing the levels: each node keeps ``model``'s
    ``level`` (stale where an order lengthens a path) and ``phase`` (an order runs from one
    backward op to another, which changes no op's phase). For the simulator, which reads
    neither levels nor anything else that an order could change but the edges."""
    dag = copy_dag(model.dag)  # new attribute dicts: a later _annotate sets the copy's levels
    for o in orders:
        if dag.has_edge(o.after, o.op):
            dag.edges[o.after, o.op]["control"] = True
        else:
            dag.add_edge(o.after, o.op, tensors=(), control=True)
    return dataclasses.replace(model, dag=dag)  # tensors and inputs are unchanged: an order is no data


def copy_dag(dag: nx.DiGraph) -> nx.DiGraph:
    """``dag.copy()``: the same nodes, edges and adjacency order, each attribute dict a shallow
    copy, made from ``dag``'s adjacency dicts at once instead of edge by edge through
    ``add_edges_from`` (a step's DAG of 15k-44k ops is copied for each ordering the schedule's
    search keeps). The successor and predecessor dicts share each edge's attribute dict, as
    networkx's own copy does. A subclass of ``nx.DiGraph`` gets ``dag.copy()`` itself."""
    if type(dag) is not nx.DiGraph:
        return dag.copy()
    new = nx.DiGraph()
    new.graph.update(dag.graph)
    new._node.update((n, data.copy()) for n, data in dag._node.items())  # noqa: SLF001
    succ: dict[Any, dict[Any, dict[str, Any]]] = {n: {} for n in dag._node}  # noqa: SLF001
    pred: dict[Any, dict[Any, dict[str, Any]]] = {n: {} for n in dag._node}  # noqa: SLF001
    for u, nbrs in dag._succ.items():  # noqa: SLF001 (in the order networkx's copy adds the edges)
        mine = succ[u]
        for v, edge in nbrs.items():
            mine[v] = pred[v][u] = edge.copy()
    new._succ, new._pred = succ, pred  # noqa: SLF001 (networkx resets its cached views on these)
    return new


def op_records(model: GraphModel) -> dict[str, dict[str, Any]]:
    """``model``'s ops as the records of :meth:`GraphModel.from_ops` (fresh lists), by name, in graph order."""
    dag, tensors, inputs_of, outputs_of = model.dag, model.tensors, model.inputs_of, model.outputs_of
    pred = dag.pred  # per op: {predecessor: edge attributes}, in the order of dag.predecessors
    return {
        name: {
            "name": name,
            "type": data["type"],
            "device": data["device"],
            "inputs": list(inputs_of[name]),
            "outputs": [(t.dtype, t.shape, t.bytes, t.estimated) for t in map(tensors.get, outputs_of[name])],
            "control_inputs": [u for u, edge in pred[name].items() if edge["control"]],
        }
        for name, data in dag.nodes(data=True)
    }


def reach(neighbours: Any, sources: set[str]) -> set[str]:
    """Nodes reachable from ``sources`` (excluded) through ``neighbours``."""
    seen: set[str] = set()
    frontier = [m for n in sources for m in neighbours(n)]
    while frontier:
        n = frontier.pop()
        if n not in seen:
            seen.add(n)
            frontier.extend(neighbours(n))
    return seen - sources
