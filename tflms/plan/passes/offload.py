"""``offload="optimizer"`` (and ``"weights"``): the optimizer's state and its update on the host, decided
on the graph model.

What the step looks like with the optimizer offloaded (:func:`offload_decisions` decides it from
the step alone, so a plan's ``offload`` option is enough to make it again):

* the **optimizer state**: the variables the step reads and writes only in its update phase
  (Adam's momentums and velocities, SGD's momentums; also the iteration counter and the learning
  rate, which are scalars and may stay where they are) live on the host;
* the **update ops**: every op of the update phase (``GraphModel.phase(op) == "update"``: what
  only follows the gradients) or of the forward phase that only feeds it (the reads of the
  state, the learning rate's casts) that reads no resource handle runs on the host. The ops that read
  a resource (``ReadVariableOp``, ``AssignSubVariableOp``...) are left where TensorFlow's placer
  puts them: beside their variable. So the reads and writes of the host state run on the host,
  and the assign of a weight's new value runs on the device, reading the change the host made;
* each gradient's consumers are then host ops: TensorFlow's partitioner sends the gradient to
  the host as soon as the backward pass made it, and its device buffer is freed once sent.

:func:`with_offload` gives the graph model of the step so placed, for the simulator: the update
ops carry the host as their device (ops on the host allocate no device memory, simulator rule
5), and the offloaded variables are no longer counted in the device's variables (rule 6). The
rewrite places the same ops on the TensorFlow graph (:func:`tflms.rewrite.apply.apply_offload`).
Each tensor that a device op reads from the host (a weight's change, SGD's momentum) is received
by a ``_Recv`` op of the model on the device, which holds it until its assign. Not modelled: a
gradient held on the device after its last reader until the link has sent it.

With ``offload="weights"`` (``offload_decisions(model, weights=True)``) the weights, their reads
and their assigns go to the host as well, and each weight reaches the device through host-gated
copies (:attr:`OffloadDecisions.transfers`, made by :mod:`tflms.plan.passes.offload_weights`):
:func:`with_offload` adds, per copy, the host ``Identity`` that waits for its trigger and the device
op that receives it (a ``_Recv`` named as the rewrite's landing), which the simulator allocates from
the copy's arrival to its group's last reader.

Example on a hand-built step (a weight ``w`` read by the forward pass, its slot ``m`` read and
written only by the update):

    >>> from tflms.ir.graph import GraphModel
    >>> res = [("resource", (), 0, False)]
    >>> f32 = [("float32", (4,), 16, False)]
    >>> ops = [
    ...     {"name": "w", "type": "Placeholder", "inputs": [], "outputs": res},
    ...     {"name": "m", "type": "Placeholder", "inputs": [], "outputs": res},
    ...     {"name": "read", "type": "ReadVariableOp", "inputs": ["w:0"], "outputs": f32},
    ...     {"name": "gradient_tape/g", "type": "Neg", "inputs": ["read:0"], "outputs": f32},
    ...     {"name": "mul", "type": "Mul", "inputs": ["gradient_tape/g:0"], "outputs": f32},
    ...     {"name": "m_add", "type": "AssignAddVariableOp", "inputs": ["m:0", "mul:0"], "outputs": []},
    ...     {"name": "m_read", "type": "ReadVariableOp", "inputs": ["m:0"], "outputs": f32,
    ...      "control_inputs": ["m_add"]},
    ...     {"name": "w_sub", "type": "AssignSubVariableOp", "inputs": ["w:0", "m_read:0"], "outputs": []},
    ... ]
    >>> model = GraphModel.from_ops(ops, variable_bytes=32, variables=[("w:0", 16), ("m:0", 16)])
    >>> d = offload_decisions(model)
    >>> d.ops, d.variables
    (('mul',), ('m:0',))
    >>> placed = with_offload(model, d, "/device:CPU:0")
    >>> placed.variable_bytes, placed.dag.nodes["mul"]["device"], placed.dag.nodes["m_add"]["device"]
    (16, '/device:CPU:0', '/device:CPU:0')
    >>> placed.inputs_of["w_sub"]  # the change of w, received on the device
    ['w:0', 'm_read/tflms_offload_recv_0:0']
"""

from __future__ import annotations

import dataclasses

import networkx as nx

from ...ir.decisions import Swap
from ...ir.graph import GraphModel, op_records, reach
from .offload_weights import weight_in_name, weight_side, weight_transfers

__all__ = [
    "OffloadDecisions",
    "offload_decisions",
    "recv_name",
    "weight_landing_name",
    "with_offload",
    "FUSED_UPDATE_PREFIX",
    "CONTROL_FLOW_TYPES",
]

#: Op types of a fused update (``ResourceApplyAdam``...): one op reads the weight and its slots
#: together, so the slots cannot live apart from the weight.
FUSED_UPDATE_PREFIX = ("ResourceApply", "ResourceSparseApply")
#: Control flow in the update phase (a ``LossScaleOptimizer``'s finite check, a gradient
#: accumulation's condition): the ops inside its branches are not placed, so it is refused.
CONTROL_FLOW_TYPES = frozenset({"If", "StatelessIf", "While", "StatelessWhile", "Case", "StatelessCase"})


@dataclasses.dataclass(frozen=True)
class OffloadDecisions:
    """What ``offload="optimizer"`` places on the host, by name.

    Attributes:
        ops: the update ops that run on the host (no resource input), in graph order; with
            ``offload="weights"`` also the forward ops of the weight side that read no resource
            (:func:`tflms.plan.passes.offload_weights.weight_side`).
        variables: the captured variables (their handle tensors) that live on the host: the
            optimizer's state (what only the update reads and writes), and with
            ``offload="weights"`` the weights too, in the order of ``model.variables``.
        resource_ops: the ops on those variables (their reads and writes), which TensorFlow
            places beside them; the graph model places them on the host too.
        weights: with ``offload="weights"``, the weights' handle tensors (of ``variables``).
        transfers: with ``offload="weights"``, the host-gated copies of the weights to the
            device (:func:`tflms.plan.passes.offload_weights.weight_transfers`).
    """

    ops: tuple[str, ...]
    variables: tuple[str, ...]
    resource_ops: tuple[str, ...]
    weights: tuple[str, ...] = ()
    transfers: tuple[Swap, ...] = ()


def _resource_inputs(model: GraphModel, op: str) -> list[str]:
    return [t for t in model.inputs_of[op] if model.tensors[t].dtype == "resource"]


def _update_side(model: GraphModel) -> list[str]:
    """The update phase that follows the gradients and what only feeds it (the reads of the
    optimizer's state, its learning rate's casts), in graph order; never a backward op (a gradient
    feeds only the update too)."""
    dag = model.dag
    backward = {n for n, p in dag.nodes(data="phase") if p == "backward"}
    # What follows the gradients: not a BatchNorm's moving-statistics update (an update by its
    # op type, fed by the forward pass only), which stays with the forward pass.
    side = {n for n in reach(dag.successors, backward) if dag.nodes[n]["phase"] == "update"}
    for n in reversed(list(nx.topological_sort(dag))):
        succ = list(dag.successors(n))
        if n not in side and succ and dag.nodes[n]["phase"] == "forward" and all(m in side for m in succ):
            side.add(n)
    return [n for n in dag if n in side]


def offload_decisions(model: GraphModel, weights: bool = False) -> OffloadDecisions:
    """The ops and variables that ``offload="optimizer"`` puts on the host (see the module doc);
    with ``weights=True`` those of ``offload="weights"`` (:mod:`tflms.plan.passes.offload_weights`).

    Raises ``ValueError`` for an update this offload cannot split: a fused ``ResourceApply*`` op
    (one op on the weight and its slots, as TensorFlow's legacy optimizers make) or control flow
    in the update (a ``LossScaleOptimizer``, gradient accumulation); and for a step without an
    update (no variable is written after the backward pass).
    """
    dag = model.dag
    value = "weights" if weights else "optimizer"
    update = _update_side(model)
    fused = [n for n in update if dag.nodes[n]["type"].startswith(FUSED_UPDATE_PREFIX)]
    flow = [n for n in update if dag.nodes[n]["type"] in CONTROL_FLOW_TYPES]
    if fused or flow:
        what = (
            f"fused update ops that read a weight and its slots in one op ({fused[0]!r}, {dag.nodes[fused[0]]['type']})"
            if fused
            else f"control flow in its update ({flow[0]!r}, {dag.nodes[flow[0]]['type']}: e.g. a LossScaleOptimizer)"
        )
        raise ValueError(
            f"offload={value!r} cannot offload this step's optimizer: the step has {what}. Use a Keras 3 "
            "optimizer such as Adam, AdamW or SGD (those checked: tflms.integrations.offload.CHECKED_OPTIMIZERS) "
            f"without loss scaling or gradient accumulation, or offload=None. Received: offload={value!r}"
        )
    handles = {t for t, _ in model.variables}
    users: dict[str, set[str]] = {}
    for op in dag:
        for t in _resource_inputs(model, op):
            users.setdefault(t, set()).add(op)
    # A variable whose every reader and writer is an update op: the optimizer's state.
    in_update = set(update)
    state = tuple(t for t, _ in model.variables if t in users and users[t] <= in_update)
    written = any(dag.nodes[n]["type"] in ("AssignVariableOp", "AssignSubVariableOp", "AssignAddVariableOp")
                  for n in update)  # fmt: skip
    if not written or not handles:
        raise ValueError(
            f"offload={value!r} found no optimizer update in this step: no variable is written after the "
            "backward pass. Offload a training step (forward, gradients and the optimizer's apply_gradients in "
            f"one function), or pass offload=None. Received: offload={value!r}"
        )
    ops = tuple(n for n in update if not _resource_inputs(model, n) and dag.nodes[n]["type"] != "Placeholder")
    if weights:
        return _weight_decisions(model, update, state, ops)
    state_set = set(state)
    resource_ops = tuple(n for n in dag if any(t in state_set for t in _resource_inputs(model, n)))
    return OffloadDecisions(ops, state, resource_ops)


def _weight_decisions(
    model: GraphModel, update: list[str], state: tuple[str, ...], ops: tuple[str, ...]
) -> OffloadDecisions:
    """:func:`offload_decisions` with ``weights=True``: the weights are the variables that an op of
    ``update`` writes; they, their reads, the weight side and every op (not of the backward pass)
    that only feeds the host's ops (AdamW's decay of a weight, ``w * wd * lr``) move to the host."""
    dag = model.dag
    writes = ("AssignVariableOp", "AssignSubVariableOp", "AssignAddVariableOp")
    written = {model.inputs_of[n][0] for n in update if dag.nodes[n]["type"] in writes}
    state_set = set(state)
    listed = [t for t, _ in model.variables]  # the trainable ones; a non-trainable one may be unlisted
    weights = tuple([t for t in listed if t in written and t not in state_set]) + tuple(
        sorted(t for t in written if t not in state_set and t not in listed)
    )
    on_host = set(weights) | set(state)
    resource_ops = tuple(n for n in dag if any(t in on_host for t in _resource_inputs(model, n)))
    side = weight_side(model, weights, update)
    placed = set(ops) | set(side) | set(resource_ops)
    for n in reversed(list(nx.topological_sort(dag))):  # the update's ops that only feed the host
        succ = list(dag.successors(n))
        if (
            n not in placed
            and succ
            and dag.nodes[n]["phase"] != "backward"
            and dag.nodes[n]["type"] != "Placeholder"
            and not _resource_inputs(model, n)
            and all(m in placed for m in succ)
        ):
            placed.add(n)
    host_ops = tuple(n for n in dag if n in placed and n not in resource_ops)
    transfers = weight_transfers(model, side, placed)
    variables = tuple(t for t, _ in model.variables if t in on_host)
    return OffloadDecisions(host_ops, variables, resource_ops, weights, transfers)


def with_offload(model: GraphModel, decisions: OffloadDecisions, host: str) -> GraphModel:
    """``model`` as the step runs with ``decisions`` applied: the update ops and the ops on the
    offloaded variables on ``host`` (they allocate no device memory), the offloaded variables out
    of ``variables`` and ``variable_bytes``, and each tensor a device op reads from them received
    by a ``_Recv`` op on the device (named :func:`recv_name`; a weight's change, which the device
    holds from its arrival to its assign). ``model`` itself is not changed."""
    if not decisions.ops and not decisions.variables:
        return model
    placed = set(decisions.ops) | set(decisions.resource_ops)
    records = op_records(model)
    after = _transfer_records(records, decisions.transfers, host)
    recv: dict[str, str] = {}  # host tensor -> the device op that receives it (one per tensor, as TensorFlow's)
    for name, rec in records.items():
        if name in placed:
            rec["device"] = host
            continue
        for i, t in enumerate(rec["inputs"]):
            if t.rpartition(":")[0] in placed and model.tensors[t].dtype != "resource":
                rec["inputs"][i] = recv.setdefault(t, recv_name(t)) + ":0"
    ordered = []
    for name, rec in records.items():
        ordered.append(rec)
        ordered.extend(after.get(name, ()))
        for t in model.outputs_of.get(name, ()):
            if t in recv:
                info = model.tensors[t]
                out = (info.dtype, info.shape, info.bytes, info.estimated)
                ordered.append({"name": recv[t], "type": "_Recv", "inputs": [t], "outputs": [out], "device": ""})
    gone = set(decisions.variables)
    kept = tuple(v for v in model.variables if v[0] not in gone)
    freed = sum(b for t, b in model.variables if t in gone)
    return GraphModel.from_ops(ordered, model.variable_bytes - freed, model.name, kept)


def _transfer_records(records: dict[str, dict], transfers: tuple[Swap, ...], host: str) -> dict[str, list[dict]]:
    """Rewire the consumers in ``records`` to the weights' copies of ``transfers``; return the
    records of the copies' ops by the op they follow (the trigger, else the weight's producer):
    per swap-in, a host ``Identity`` that waits for the trigger (:func:`weight_in_name`) and the
    device op that receives its copy (a ``_Recv``, which allocates the bytes, named as the rewrite's
    landing ``Identity``: :func:`weight_landing_name`)."""
    after: dict[str, list[dict]] = {}
    for swap in transfers:
        out = [(swap.dtype, swap.shape, swap.bytes, False)]
        for k, swap_in in enumerate(swap.swap_ins):
            send, land = weight_in_name(swap.tensor, k), weight_landing_name(swap.tensor, k)
            for op, index in swap_in.consumers:
                records[op]["inputs"][index] = f"{land}:0"
            after.setdefault(swap_in.trigger or swap.producer, []).extend(
                [
                    {
                        "name": send,
                        "type": "Identity",
                        "inputs": [swap.tensor],
                        "outputs": out,
                        "device": host,
                        "control_inputs": [swap_in.trigger] if swap_in.trigger else [],
                    },
                    {"name": land, "type": "_Recv", "inputs": [f"{send}:0"], "outputs": out, "device": ""},
                ]
            )
    return after


def weight_landing_name(tensor: str, k: int) -> str:
    """The name of the device op that receives copy ``k`` of weight tensor ``tensor``: a landing's
    (:func:`tflms.rewrite.apply.landing_name`), under the tensor's producer.

    >>> weight_landing_name("dense/Cast/ReadVariableOp:0", 1)
    'dense/Cast/ReadVariableOp/tflms_landing_0_1'
    """
    op, _, index = tensor.rpartition(":")
    return f"{op}/tflms_landing_{index}_{k}"


def recv_name(tensor: str) -> str:
    """The graph model's name of the device op that receives host tensor ``tensor`` (no op of the
    TensorFlow graph: TensorFlow's partitioner adds the receive).

    >>> recv_name("adam/truediv:0")
    'adam/truediv/tflms_offload_recv_0'
    """
    op, _, index = tensor.rpartition(":")
    return f"{op}/tflms_offload_recv_{index}"
