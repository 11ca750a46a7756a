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
import math
import weakref
from collections.abc import Iterable, Mapping, Sequence
from typing import Any, NamedTuple

import networkx as nx

__all__ = [
    "TensorInfo",
    "GraphModel",
    "BACKWARD_SCOPES",
    "UPDATE_OP_TYPES",
    "ALIAS_OP_TYPES",
    "SUM_OP_TYPES",
    "with_recomputes",
    "with_orders",
    "with_constant_pushdown",
    "PUSHDOWN_FAMILIES",
]

#: Name-scope components under which TensorFlow builds gradient ops.
BACKWARD_SCOPES = ("gradient_tape", "gradients")

#: Op types that write variables: the optimizer update.
UPDATE_OP_TYPES = frozenset({"AssignVariableOp", "AssignSubVariableOp", "AssignAddVariableOp"})

#: Sums. Grappler's arithmetic optimizer folds a tree of them into one ``AddN`` (``AddOpsRewrite``)
#: only where no member has a control edge, so a control edge on one (a fence, an order) can
#: change how the sum associates, and the step's numbers.
SUM_OP_TYPES = frozenset({"Add", "AddV2", "AddN"})

#: A filter gradient and a bias gradient of the same output gradient, which oneDNN's graph pass
#: (TensorFlow's CPU build) runs as one kernel (``_MklNativeConv2DBackpropFilterWithBias``),
#: unless a path joins the two: then each runs alone, and the bias gradient's bits change
#: (``tests/test_tf_internals.py``). No order or trigger of a plan may join them
#: (:func:`fused_partners`). The rule holds for every device: a GPU does not fuse the two, so a
#: plan for one may go without an order it could have had (none seen so far).
FUSED_GRADIENT_TYPES = ("Conv2DBackpropFilter", "BiasAddGrad")

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

    def schedule(self) -> list[str]:
        """The simulated execution order: TensorFlow's executor, run on one thread.

        When an op finishes, the successors it makes ready run next, depth first:
        the executor keeps the last ready op on its own thread (see
        :func:`ready_order`). Deterministic: ties follow graph order.
        """
        return ready_order(self)

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
    def from_func_graph(cls, graph: Any, batch_size: int | None = None) -> GraphModel:
        """Build from a TensorFlow ``FuncGraph`` (or any ``tf.Graph``)."""
        records = []
        for op in graph.get_operations():
            outs = []
            for t in op.outputs:
                shape, dtype = t.shape, t.dtype
                dims = tuple(shape.as_list()) if shape.rank is not None else None
                nbytes, est = estimate_bytes(dims, dtype.size if dtype.is_numpy_compatible else 0, batch_size)
                outs.append((dtype.name, dims, nbytes, est))
            records.append(
                {
                    "name": op.name,
                    "type": op.type,
                    "device": op.device,
                    "inputs": [t.name for t in op.inputs],
                    "outputs": outs,
                    "control_inputs": [c.name for c in op.control_inputs],
                }
            )
        handles = {id(external): internal.name for external, internal in getattr(graph, "captures", ())}
        var_bytes, variables = 0, []
        for v in getattr(graph, "variables", ()):
            if v.shape.is_fully_defined():
                nbytes = v.shape.num_elements() * v.dtype.size
                var_bytes += nbytes
                variables.append((handles.get(id(getattr(v, "handle", None)), ""), nbytes))
        # In the order the step first reads them (graph.variables' order is not deterministic).
        first = {f"{rec['name']}:0": i for i, rec in enumerate(records)}
        variables.sort(key=lambda v: (first.get(v[0], len(first)), v[1]))
        return cls.from_ops(records, variable_bytes=var_bytes, name=getattr(graph, "name", ""), variables=variables)

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
        after = _reach(dag.successors, scoped - loop_inputs) - scoped  # fed by gradient ops
        before = _reach(dag.predecessors, scoped)  # feeding gradient ops
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


def with_recomputes(model: GraphModel, recomputes: Sequence[Any]) -> GraphModel:
    """``model`` with the clones of ``recomputes`` (:class:`tflms.plan.Recompute`) added, and
    each group's consumers reading its clones; ``model`` itself when there are none.

    Per group, each op of the chain gets a clone named :meth:`Recompute.clone`, reading the
    clones before it and the original tensors otherwise, with a control edge from the
    group's trigger: the ops the rewrite adds (:mod:`tflms.rewrite`), so that the planner
    and the simulator see the step as it will run.
    """
    if not recomputes:
        return model
    tensors = model.tensors
    records = _records(model)
    for rc in recomputes:
        for k, group in enumerate(rc.groups):
            for name in rc.ops:
                inputs = [rc.clone_tensor(t, k) if tensors[t].op in rc.ops else t for t in model.inputs_of[name]]
                clone = rc.clone(name, k)
                records[clone] = {**records[name], "name": clone, "inputs": inputs, "control_inputs": [group.trigger]}
            for consumer, index in group.consumers:
                if records[consumer]["inputs"][index] != rc.tensor:
                    raise ValueError(
                        f"The recompute of {rc.tensor!r} does not fit this model: input {index} of {consumer!r} "
                        f"is {records[consumer]['inputs'][index]!r}. Make the plan from this model."
                    )
                records[consumer]["inputs"][index] = rc.output(k)
    return GraphModel.from_ops(
        records.values(), variable_bytes=model.variable_bytes, name=model.name, variables=model.variables
    )


def with_orders(model: GraphModel, orders: Sequence[Any]) -> GraphModel:
    """``model`` with a control edge ``after -> op`` for each of ``orders``
    (:class:`tflms.plan.Order`), as the rewrite adds them; ``model`` itself when there are none."""
    if not orders:
        return model
    ordered = _with_order_edges(model, orders)
    ordered._annotate()  # noqa: SLF001 (this module's class)
    return ordered


def _with_order_edges(model: GraphModel, orders: Sequence[Any]) -> GraphModel:
    """:func:`with_orders` without recomputing the levels: each node keeps ``model``'s
    ``level`` (stale where an order lengthens a path) and ``phase`` (an order runs from one
    backward op to another, which changes no op's phase). For the simulator, which reads
    neither levels nor anything else that an order could change but the edges."""
    dag = model.dag.copy()  # new attribute dicts: a later _annotate sets the copy's levels
    for o in orders:
        if dag.has_edge(o.after, o.op):
            dag.edges[o.after, o.op]["control"] = True
        else:
            dag.add_edge(o.after, o.op, tensors=(), control=True)
    return dataclasses.replace(model, dag=dag)  # tensors and inputs are unchanged: an order is no data


def _records(model: GraphModel) -> dict[str, dict[str, Any]]:
    """``model``'s ops as the records of :meth:`GraphModel.from_ops` (fresh lists), by name, in graph order."""
    dag, tensors = model.dag, model.tensors
    return {
        name: {
            "name": name,
            "type": data["type"],
            "device": data["device"],
            "inputs": list(model.inputs_of[name]),
            "outputs": [(t.dtype, t.shape, t.bytes, t.estimated) for t in map(tensors.get, model.outputs_of[name])],
            "control_inputs": [u for u in dag.predecessors(name) if dag.edges[u, name]["control"]],
        }
        for name, data in dag.nodes(data=True)
    }


#: Grappler's constant push-down (``ConstantFolding::ConstantPushDown`` in TF 2.21's
#: ``constant_folding.cc``), commutative case: op types of one associative family.
PUSHDOWN_FAMILIES = {"Mul": "Mul", "Add": "Add", "AddV2": "Add"}
_CONSTANT_OP_TYPES = frozenset({"Const", "HostConst"})


def with_constant_pushdown(model: GraphModel) -> tuple[GraphModel, list[tuple[str, str]]]:
    """``model`` as TensorFlow runs it after Grappler's constant push-down, and the rewritten ``(parent, child)`` pairs.

    Grappler rewrites ``C * (X * Y)`` (``C`` a ``Const``, the inner product read only by
    the outer one) into ``X * (C * Y)``, and likewise for ``+``. Where ``Y`` is a forward
    tensor and ``X`` a gradient, the inner op then reads forward tensors only, so the
    executor runs it in the forward pass and its output lives until the backward pass:
    Keras's attention (``softmax * scale``) and GELU gradients, measured on the test bed.
    The conditions are Grappler's: the five ops on one device (an unplaced op counts as
    the same), ``X`` the child's first input unless that is a constant, the parent's
    constant no larger than ``X`` (when both shapes are known), no 16-bit floats,
    repeated until nothing changes. Names and every other op are unchanged; ``model``
    itself is returned when nothing applies.

    >>> f32 = lambda *s: ("float32", s, 4 * (s[0] if s else 1), False)
    >>> ops = [
    ...     {"name": "y", "type": "Softmax", "inputs": [], "outputs": [f32(8)]},
    ...     {"name": "x", "type": "Relu", "inputs": ["y:0"], "outputs": [f32(8)]},
    ...     {"name": "c", "type": "Const", "inputs": [], "outputs": [f32()]},
    ...     {"name": "k", "type": "Mul", "inputs": ["x:0", "y:0"], "outputs": [f32(8)]},
    ...     {"name": "p", "type": "Mul", "inputs": ["k:0", "c:0"], "outputs": [f32(8)]},
    ... ]
    >>> pushed, pairs = with_constant_pushdown(GraphModel.from_ops(ops))
    >>> pairs, pushed.inputs_of["p"], pushed.inputs_of["k"]
    ([('p', 'k')], ['x:0', 'k:0'], ['c:0', 'y:0'])
    """
    from .devices import device_key

    records = _records(model)
    tensors = model.tensors
    readers: dict[str, int] = {}
    for rec in records.values():
        for t in rec["inputs"]:
            readers[t] = readers.get(t, 0) + 1

    def op_of(tensor: str) -> dict[str, Any]:
        return records[tensor.rsplit(":", 1)[0]]

    def constant(tensor: str) -> bool:
        return op_of(tensor)["type"] in _CONSTANT_OP_TYPES

    def too_large(c: str, x: str) -> bool:
        c_shape, x_shape = tensors[c].shape, tensors[x].shape
        if c_shape is None or x_shape is None:
            return False
        if None not in c_shape and None not in x_shape and math.prod(c_shape) > math.prod(x_shape):
            return True
        return bool(c_shape) and any(
            cd is not None and xd is not None and cd > xd for cd, xd in zip(c_shape, x_shape, strict=False)
        )

    pairs: list[tuple[str, str]] = []
    changed = True
    while changed:
        changed = False
        for parent in records.values():
            family = PUSHDOWN_FAMILIES.get(parent["type"])
            if family is None or len(parent["inputs"]) != 2:
                continue
            left, right = parent["inputs"]
            if constant(left) == constant(right):
                continue
            c, inner = (left, right) if constant(left) else (right, left)
            child = op_of(inner)
            if (
                PUSHDOWN_FAMILIES.get(child["type"]) != family
                or len(child["inputs"]) != 2
                or sum(readers.get(t, 0) for t in model.outputs_of[child["name"]]) != 1
                or tensors[inner].dtype in ("float16", "bfloat16")
            ):
                continue
            a, b = child["inputs"]
            if constant(a) and constant(b):
                continue
            x, y = (b, a) if constant(a) else (a, b)
            keys = {device_key(r["device"]) for r in (parent, child, op_of(c), op_of(x), op_of(y))}
            if len(keys - {None}) > 1 or (not constant(y) and too_large(c, x)):
                continue
            parent["inputs"], child["inputs"] = [x, inner], [c, y]
            pairs.append((parent["name"], child["name"]))
            changed = True
    if not pairs:
        return model, pairs
    pushed = GraphModel.from_ops(
        records.values(), variable_bytes=model.variable_bytes, name=model.name, variables=model.variables
    )
    return pushed, pairs


#: Per DAG: (node count when made, the fused pairs, the context edges of the last
#: :func:`_fused_reach`, its result or None). A model's DAG is not edited once made; the node
#: count is a cheap guard (as for ``_READY_STRUCTURES``).
_FUSED: weakref.WeakKeyDictionary[nx.DiGraph, tuple[int, dict[str, frozenset[str]], tuple, dict | None]] = (
    weakref.WeakKeyDictionary()
)


def fused_partners(model: GraphModel) -> dict[str, frozenset[str]]:
    """The ops of ``model`` that oneDNN fuses in pairs (:data:`FUSED_GRADIENT_TYPES`), each with
    its partners: a ``Conv2DBackpropFilter`` and the ``BiasAddGrad`` ops of its output gradient
    (its input 2), both ways. Do not modify the result (kept per DAG).

    >>> out = [("float32", (4, 8), 128, False)]
    >>> m = GraphModel.from_ops([
    ...     {"name": "dy", "type": "Fill", "inputs": [], "outputs": out},
    ...     {"name": "x", "type": "Fill", "inputs": [], "outputs": out},
    ...     {"name": "s", "type": "Const", "inputs": [], "outputs": [("int32", (4,), 16, False)]},
    ...     {"name": "gradients/w", "type": "Conv2DBackpropFilter", "inputs": ["x:0", "s:0", "dy:0"], "outputs": out},
    ...     {"name": "gradients/b", "type": "BiasAddGrad", "inputs": ["dy:0"], "outputs": out},
    ... ])
    >>> {op: sorted(p) for op, p in fused_partners(m).items()}
    {'gradients/b': ['gradients/w'], 'gradients/w': ['gradients/b']}
    >>> joins_fused(m, [("gradients/b", "gradients/w")]), joins_fused(m, [("x", "gradients/w")])
    (True, False)
    """
    known = _FUSED.get(model.dag)
    if known is not None and known[0] == model.dag.number_of_nodes():
        return known[1]
    filters, biases = FUSED_GRADIENT_TYPES
    partners: dict[str, set[str]] = {}
    for op, kind in model.dag.nodes(data="type"):
        if kind != biases or not model.inputs_of[op]:
            continue
        for c, i in model.tensors[model.inputs_of[op][0]].consumers:
            if i == 2 and model.dag.nodes[c]["type"] == filters:
                partners.setdefault(op, set()).add(c)
                partners.setdefault(c, set()).add(op)
    result = {op: frozenset(p) for op, p in partners.items()}
    _FUSED[model.dag] = (model.dag.number_of_nodes(), result, (), None)
    return result


def joins_fused(model: GraphModel, edges: Iterable[tuple[str, str]], context: Iterable[tuple[str, str]] = ()) -> bool:
    """Whether adding ``edges`` (``(before, after)`` pairs) to ``model``'s DAG, with the edges of
    ``context`` already there (e.g. the swap-ins' triggers), makes a path from one op of a fused
    pair (:func:`fused_partners`) to its partner: a path through at least one of ``edges``,
    which may start and end anywhere along the way.

    >>> out = [("float32", (4,), 16, False)]
    >>> m = GraphModel.from_ops([
    ...     {"name": "dy", "type": "Fill", "inputs": [], "outputs": out},
    ...     {"name": "b", "type": "BiasAddGrad", "inputs": ["dy:0"], "outputs": out},
    ...     {"name": "x", "type": "Neg", "inputs": ["b:0"], "outputs": out},
    ...     {"name": "y", "type": "Neg", "inputs": ["dy:0"], "outputs": out},
    ...     {"name": "w", "type": "Conv2DBackpropFilter", "inputs": ["y:0", "dy:0", "dy:0"], "outputs": out},
    ...     {"name": "z", "type": "Neg", "inputs": ["dy:0"], "outputs": out},
    ... ])
    >>> joins_fused(m, [("x", "y")]), joins_fused(m, [("y", "x")]), joins_fused(m, [("y", "w")], [("b", "y")])
    (True, False, True)
    >>> joins_fused(m, [("x", "z")]), joins_fused(m, [("z", "w")]), joins_fused(m, [("x", "z"), ("z", "w")])
    (False, False, True)
    """
    context = tuple(context)
    reached_by = _fused_reach(model, context)
    edges = list(edges)
    starts: dict[str, list[str]] = {}
    for u, v in edges:
        if u in reached_by:  # a fused op reaches the edge's start (or is it)
            starts.setdefault(u, []).append(v)
    if not starts:
        return False
    successors = _successors_with(model, [*context, *edges])
    partners = fused_partners(model)
    for u, vs in starts.items():
        targets = {q for p in reached_by[u] for q in partners[p]}
        seen: set[str] = set()
        frontier = list(vs)
        while frontier:  # _reach, stopping at a target
            n = frontier.pop()
            if n in targets:
                return True
            if n not in seen:
                seen.add(n)
                frontier.extend(successors(n))
    return False


def _successors_with(model: GraphModel, edges: Sequence[tuple[str, str]]) -> Any:
    """The successors of an op in ``model``'s DAG with ``edges`` added (ops outside it included)."""
    extra: dict[str, list[str]] = {}
    for u, v in edges:
        extra.setdefault(u, []).append(v)

    def successors(n: str) -> list[str]:
        return [*model.dag.successors(n), *extra.get(n, ())] if n in model.dag else extra.get(n, [])

    return successors


def _fused_reach(model: GraphModel, context: tuple[tuple[str, str], ...]) -> dict[str, frozenset[str]]:
    """Each op that an op of a fused pair reaches (itself included) in ``model``'s DAG with the
    ``context`` edges, with the fused ops that reach it; kept for the last context per DAG. In a
    Keras step their descendants are few (a gradient's way to its variable's update)."""
    partners = fused_partners(model)
    known = _FUSED[model.dag]
    if known[2] == context and known[3] is not None:
        return known[3]
    successors = _successors_with(model, context)
    reached: dict[str, set[str]] = {}
    for p in partners:
        for n in _reach(successors, {p}) | {p}:
            reached.setdefault(n, set()).add(p)
    result = {n: frozenset(ps) for n, ps in reached.items()}
    _FUSED[model.dag] = (known[0], partners, context, result)
    return result


def _reach(neighbours: Any, sources: set[str]) -> set[str]:
    """Nodes reachable from ``sources`` (excluded) through ``neighbours``."""
    seen: set[str] = set()
    frontier = [m for n in sources for m in neighbours(n)]
    while frontier:
        n = frontier.pop()
        if n not in seen:
            seen.add(n)
            frontier.extend(neighbours(n))
    return seen - sources


def ready_order(model: GraphModel, extra_edges: Iterable[tuple[str, str]] = ()) -> list[str]:
    """An order of the ops that follows TensorFlow's executor (depth first).

    First the ops that only feed the optimizer's update (reads of its slots, its
    learning rate): the executor starts every op without inputs at once. Then a stack
    of ready ops: after an op runs, the successors it made ready are pushed, the first
    in graph order on top, so it runs next; ops that were ready earlier wait below.
    Grappler removes ``IdentityN`` ops, so a consumer of one waits only for the ops
    whose outputs it reads through it (Keras's optimizer passes every gradient through
    one ``IdentityN``; each variable's update then runs as soon as its own gradient
    exists, as profiled steps show): the order is topological except for the edges out
    of ``IdentityN`` ops. ``extra_edges``: ``(u, v)`` pairs taken as edges too (the
    order of the model with those control edges, without building it).

    >>> f32 = ("float32", (1,), 4, False)
    >>> op = lambda name, kind, *inputs: {"name": name, "type": kind, "inputs": list(inputs), "outputs": [f32]}
    >>> ops = [op("x", "Relu"), op("gradient_tape/g1", "Relu", "x:0"), op("u1", "AssignSubVariableOp", "n:0"),
    ...        op("gradient_tape/g2", "Relu", "gradient_tape/g1:0"),
    ...        {**op("n", "IdentityN", "gradient_tape/g1:0", "gradient_tape/g2:0"), "outputs": [f32, f32]},
    ...        op("u2", "AssignSubVariableOp", "n:1")]
    >>> ready_order(GraphModel.from_ops(ops))  # u1 runs before g2: it waits for g1 only
    ['x', 'gradient_tape/g1', 'u1', 'gradient_tape/g2', 'n', 'u2']
    """
    dag = model.dag
    index, succ, pending, early = _ready_structure(dag)
    pending = dict(pending)
    extra = list(extra_edges)
    if extra:
        succ = dict(succ)  # the lists of the edges' sources are replaced, never changed in place
        for u, v in extra:
            if v not in succ[u]:
                succ[u] = sorted([*succ[u], v], key=index.__getitem__)
                pending[v] += 1
    # What only feeds the optimizer's update (reads of its slots, its learning rate) runs first:
    # the executor starts every op without inputs at once, and each variable's update runs as
    # soon as its gradient exists.
    order = list(early)
    for n in early:
        for c in succ[n]:
            pending[c] -= 1
    skip = set(early)
    stack = sorted((n for n in dag if pending[n] == 0 and n not in skip), key=index.__getitem__, reverse=True)
    while stack:
        n = stack.pop()
        order.append(n)
        ready = [c for c in succ[n] if _done(pending, c)]
        stack.extend(reversed(ready))
    return order


#: Per DAG: (node count when made, graph-order index, sorted distinct successors as the
#: executor waits (through IdentityN ops), predecessor counts, the update's feeders that run
#: first). The schedule's search orders one DAG many times (``extra_edges``). A model's DAG is
#: not edited once made (``with_orders`` copies it); the node count is a cheap guard.
_READY_STRUCTURES: weakref.WeakKeyDictionary[nx.DiGraph, tuple[int, dict, dict, dict, list]] = (
    weakref.WeakKeyDictionary()
)


def _ready_structure(dag: nx.DiGraph) -> tuple[dict[str, int], dict[str, list[str]], dict[str, int], list[str]]:
    """``ready_order``'s view of ``dag`` (do not modify): remade when its node count changed."""
    size = dag.number_of_nodes()
    hit = _READY_STRUCTURES.get(dag)
    if hit is not None and hit[0] == size:
        return hit[1], hit[2], hit[3], hit[4]
    index = {n: i for i, n in enumerate(dag.nodes)}
    through = _identity_n_sources(dag)
    successors: dict[str, set[str]] = {n: set() for n in dag}
    for u, v, data in dag.edges(data=True):
        if u in through:
            # Grappler removes an IdentityN: its consumers wait only for what they read through it.
            for t in data["tensors"]:
                successors[_through(through, u, t.index)].add(v)
            if not data["control"]:
                continue
        successors[u].add(v)
    succ = {n: sorted(s, key=index.__getitem__) for n, s in successors.items()}
    pending = dict.fromkeys(dag.nodes, 0)
    for n in dag:
        for c in succ[n]:
            pending[c] += 1
    early = _update_feeders(dag, succ)
    _READY_STRUCTURES[dag] = (size, index, succ, pending, early)
    return index, succ, pending, early


def _identity_n_sources(dag: nx.DiGraph) -> dict[str, dict[int, tuple[str, int]]]:
    """Per ``IdentityN`` op: its input index -> (the op that computes that input, its output index)."""
    through: dict[str, dict[int, tuple[str, int]]] = {}
    for n, op_type in dag.nodes(data="type"):
        if op_type == "IdentityN":
            through[n] = {
                i: (p, t.index)
                for p, _, data in dag.in_edges(n, data=True)
                for t in data["tensors"]
                for c, i in t.consumers
                if c == n
            }
    return through


def _through(through: dict[str, dict[int, tuple[str, int]]], op: str, index: int) -> str:
    """The op that computes output ``index`` of ``op``, looking through ``IdentityN`` ops."""
    while op in through and index in through[op]:
        op, index = through[op][index]
    return op


def _update_feeders(dag: nx.DiGraph, succ: dict[str, list[str]]) -> list[str]:
    """Forward ops that feed only update-phase ops and wait for nothing else (``succ``), topologically ordered."""
    topo = list(nx.topological_sort(dag))
    feeds: set[str] = set()
    for n in reversed(topo):
        if dag.nodes[n]["phase"] == "forward" and succ[n]:
            if all(c in feeds or dag.nodes[c]["phase"] == "update" for c in succ[n]):
                feeds.add(n)
    preds: dict[str, list[str]] = {n: [] for n in dag}
    for n, cs in succ.items():
        for c in cs:
            preds[c].append(n)
    early: list[str] = []
    done: set[str] = set()
    for n in topo:
        if n in feeds and all(p in done for p in preds[n]):
            done.add(n)
            early.append(n)
    return early


def _done(pending: dict[str, int], op: str) -> bool:
    pending[op] -= 1
    return pending[op] == 0
