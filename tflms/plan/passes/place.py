"""Placement: the ops of a step cut into stages, one per device, chosen by the predicted peaks.

What a placement looks like (GPipe's shape, without micro-batches):

* the **forward ops**, in the executor's order (:attr:`tflms.emulate.simulator.Simulator.order`),
  are cut into ``K`` stages of consecutive ops, stage ``k`` on ``devices[k]``;
* each **backward op** goes with the forward op it is the gradient of: its name under the
  gradient scope (``gradient_tape/<forward scope>/...``) names the forward op or scope, as
  TensorFlow builds it (:data:`tflms.ir.graph.BACKWARD_SCOPES`);
* the **variables** stay where the step's variables live, which the model takes to be
  ``devices[0]`` (create the model there: the rewrite does not move variables). The ops on them
  (their reads and writes) are left unplaced, so TensorFlow's placer puts each beside its
  variable; the **update** ops that read no variable run on ``devices[0]`` too, beside the
  optimizer's state, so each gradient is sent there as the backward pass makes it;
* ops without data inputs (constants) go with their first consumer, and an op that no rule places
  (a sum of the backward pass outside any layer's scope) with the ops it feeds, else those feeding it;
* ops that only copy (:data:`COPY_OP_TYPES`: a ``Concatenate``'s ``ConcatV2`` and the ``Slice`` ops
  of its gradient, ``Pack``, ``Split``...) may run on the **host** instead (``host=``): they give the
  same bits on any device, and a device then holds their output (received from the host) or their
  inputs (sent there), not both at once. :func:`place` puts there those that lower the largest
  predicted device peak (``host_ops=None``), or the ones named (``host_ops``); the host's stage
  comes last in the result, after one stage per device.

Each device's peak is predicted by the simulator on the **device model** of the stage
(:func:`device_model`): the ops placed elsewhere allocate nothing there (the simulator's rule 5,
with a device named :data:`ELSEWHERE` in the host's role), and each tensor that an op of the stage
reads from another device is received by a ``_Recv`` op of the stage (one per tensor, as
TensorFlow's partitioner makes one receive per tensor and destination device), which allocates it
on the receiver. The step's arguments are held on ``devices[0]``, where the step is called.

:func:`place` chooses the cut points that minimise the largest predicted device peak (CAPTURE's
objective) by dynamic programming over candidate cut positions, and among cuts of the same largest
peak the one that sends the fewest bytes between devices (the predicted step time's part that the
placement changes, DLPlacer's second objective: the stages run one after another, so the compute
time is the same for every cut). The result is a tuple of :class:`tflms.ir.decisions.Stage`
records, one per device, which a plan holds (``SwapPlan.placement``) and the rewrite applies
(:func:`tflms.rewrite.apply.apply_placement`).

Example on a hand-built step of three layers (the first makes the largest tensor, which its own
gradient and the next layer read: a cut right after it would send it and hold it on both devices):

    >>> from tflms.ir.graph import GraphModel
    >>> f32 = lambda n: ("float32", (n,), 4 * n, False)
    >>> ops = [{"name": "x", "type": "Placeholder", "inputs": [], "outputs": [f32(10)]}]
    >>> prev = "x:0"
    >>> for i, n in enumerate((4000, 100, 100)):
    ...     ops.append({"name": f"l{i}/op", "type": "Relu", "inputs": [prev], "outputs": [f32(n)]})
    ...     prev = f"l{i}/op:0"
    >>> for i in (2, 1, 0):
    ...     ops.append({"name": f"gradient_tape/l{i}/op/grad", "type": "ReluGrad",
    ...                 "inputs": [prev, f"l{i}/op:0"], "outputs": [f32(4)]})
    ...     prev = f"gradient_tape/l{i}/op/grad:0"
    >>> model = GraphModel.from_ops(ops)
    >>> stages = place(model, ["/device:GPU:0", "/device:GPU:1"])
    >>> [s.ops for s in stages]  # doctest: +NORMALIZE_WHITESPACE
    [('gradient_tape/l0/op/grad', 'gradient_tape/l1/op/grad', 'l0/op', 'l1/op', 'x'),
     ('gradient_tape/l2/op/grad', 'l2/op')]
    >>> [s.received_bytes for s in stages]  # l1's output there, l2's gradient back
    [16, 400]
"""

from __future__ import annotations

import functools
import warnings
from collections.abc import Mapping, Sequence

import networkx as nx
import numpy as np

from ..._devices import same_device
from ..._util import format_bytes
from ...config import LINK_BANDWIDTH, LINK_LATENCY, LMSConfig
from ...emulate.costs import op_seconds
from ...emulate.replay import LAG
from ...emulate.simulator import Simulator
from ...errors import BudgetError, LMSWarning
from ...ir.decisions import Stage
from ...ir.graph import ALIAS_OP_TYPES, BACKWARD_SCOPES, GraphModel, op_records
from ..records import SwapPlan

__all__ = [
    "ELSEWHERE",
    "CANDIDATES",
    "COPY_OP_TYPES",
    "HOST_MIN_BYTES",
    "HOST_TRIES",
    "REFINE",
    "REFINE_SLACK",
    "StagePeaks",
    "anchors",
    "device_model",
    "evaluate",
    "forward_order",
    "copy_ops",
    "cut_positions",
    "device_stages",
    "layer_of",
    "place",
    "placement_plan",
    "with_placement",
    "stage_of",
    "step_seconds",
]

#: The device the ops of other stages run on, in a device model: the simulator's ``host``, whose
#: ops allocate nothing on the device simulated. No real device has this name.
ELSEWHERE = "/job:tflms_elsewhere/replica:0/task:0/device:CPU:0"
#: How many cut positions, spread evenly over the forward ops, the search considers per cut.
CANDIDATES = 24
#: How many of the search's best cuts :func:`place` simulates per device before it chooses.
REFINE = 4
#: How far above the search's optimum (a fraction) a cut may be to be simulated.
REFINE_SLACK = 0.35
#: Op types that only copy their inputs' bytes into their outputs: the same bits on any device, so
#: :func:`place` may run them on the host.
COPY_OP_TYPES = frozenset({"ConcatV2", "Pack", "Unpack", "Slice", "Split", "SplitV"})
#: The smallest output (bytes, all outputs together) of a copy-only op that :func:`place` tries on the host.
HOST_MIN_BYTES = 1 << 20
#: How many copy-only ops (the largest) :func:`place` tries on the host, each with a simulation per device.
HOST_TRIES = 8


def _resource_op(model: GraphModel, op: str) -> bool:
    """Whether ``op`` reads or is a resource handle (a variable's op: TensorFlow places it beside the variable)."""
    return model.dag.nodes[op]["type"] == "Placeholder" or any(
        model.tensors[t].dtype == "resource" for t in model.inputs_of[op]
    )


def forward_order(model: GraphModel, order: Sequence[str] | None = None) -> list[str]:
    """The forward ops that a cut places, in the executor's order (``order``, default the
    simulator's schedule of ``model``): not the variables' ops, not ops without data inputs, not
    the forward ops that only feed the update (the optimizer's casts of its hyperparameters, which
    go with the update)."""
    order = Simulator(model).order if order is None else order
    dag, inputs_of = model.dag, model.inputs_of
    update_side: set[str] = set()
    for op in reversed(list(nx.topological_sort(dag))):
        succ = list(dag.successors(op))
        if succ and all(dag.nodes[m]["phase"] == "update" or m in update_side for m in succ):
            update_side.add(op)
    return [
        op
        for op in order
        if dag.nodes[op]["phase"] == "forward"
        and inputs_of[op]
        and op not in update_side
        and not _resource_op(model, op)
    ]


def _backward_key(name: str) -> str | None:
    """What a backward op's name says it is the gradient of: the name after its last gradient
    scope component (``'gradient_tape/model/conv/Conv2D/Grad'`` -> ``'model/conv/Conv2D/Grad'``)."""
    parts = name.split("/")
    marks = [i for i, p in enumerate(parts) if p in BACKWARD_SCOPES]
    return "/".join(parts[marks[-1] + 1 :]) if marks else None


def anchors(model: GraphModel, forward: Sequence[str]) -> dict[str, int]:
    """Each op's anchor: the index in ``forward`` of the forward op whose stage it takes (by the
    rules of the module doc), so that a cut's stages are ``searchsorted(cuts, anchor)``.

    A forward op anchors itself; the variables, their ops, the arguments and the update anchor at 0
    (stage 0); a backward op at the forward op its name names, or the last forward op of the
    longest scope its name names; any other op at the first anchor of the ops it feeds, else the
    last anchor of those feeding it, else 0."""
    dag = model.dag
    anchor: dict[str, int] = {op: i for i, op in enumerate(forward)}
    scopes: dict[str, int] = {}
    for i, op in enumerate(forward):
        parts = op.split("/")
        for j in range(1, len(parts) + 1):
            scopes["/".join(parts[:j])] = i  # the last forward op under each scope (an op is its own)
    for op, phase in dag.nodes(data="phase"):
        if op in anchor:
            continue
        if _resource_op(model, op) or phase == "update":
            anchor[op] = 0
        elif phase == "backward" and (key := _backward_key(op)) is not None:
            parts = key.split("/")
            for j in range(len(parts), 0, -1):
                prefix = "/".join(parts[:j])
                if prefix in anchor and prefix in scopes:
                    anchor[op] = anchor[prefix]
                    break
                if prefix in scopes:
                    anchor[op] = scopes[prefix]
                    break
    order = list(nx.topological_sort(dag))
    for op in reversed(order):
        if op not in anchor:
            fed = [anchor[m] for m in dag.successors(op) if m in anchor]
            if fed:
                anchor[op] = min(fed)
    for op in order:
        if op not in anchor:
            anchor[op] = max((anchor[m] for m in dag.predecessors(op) if m in anchor), default=0)
    return anchor


def stage_of(anchor: Mapping[str, int], cuts: Sequence[int]) -> dict[str, int]:
    """Every op's stage for cut positions ``cuts`` (increasing indices into the forward ops, each
    in ``1..len(forward) - 1``: stage ``k`` holds ``forward[cuts[k-1]:cuts[k]]``), from
    :func:`anchors`."""
    ops = list(anchor)
    stages = np.searchsorted(np.asarray(cuts, dtype=np.int64), np.fromiter(anchor.values(), np.int64), side="right")
    return dict(zip(ops, stages.tolist()))


class StagePeaks:
    """Predicted requested-bytes peaks per device of any placement of one step, counted from the
    plain step's buffers (:meth:`tflms.emulate.simulator.Simulator.buffer_spans`) on its schedule:
    each buffer on the device of the op that makes it, each tensor an op reads from another
    device received there from its producer's position to its last reader's there (rules 2 and
    4; up to that read where the reader writes its output into the received buffer, rule 3), the
    variables on stage 0. A fast model for searches (a few numpy passes per placement);
    :func:`evaluate` simulates the chosen placement per device."""

    def __init__(self, model: GraphModel) -> None:
        sim = Simulator(model)
        ex = sim.executed
        self.ops = list(ex.dag)
        index = {op: i for i, op in enumerate(self.ops)}
        pos = sim.pos
        self.n = len(sim.order)
        spans = sim.buffer_spans()
        in_place = sim.in_place_reads()
        span_of = {t: k for k, (t, _, _, _) in enumerate(spans)}
        root: dict[str, str] = {}  # tensor -> the tensor whose buffer it is (rule 2's aliases)
        source: dict[str, str] = {}  # tensor -> what it reads through IdentityN ops (Grappler removes them)
        types = ex.dag.nodes
        for op in sim.order:
            kind, ins = types[op]["type"], ex.inputs_of[op]
            for i, t in enumerate(ex.outputs_of[op]):
                if kind == "IdentityN" and i < len(ins):
                    source[t] = source.get(ins[i], ins[i])
                    root[t] = root.get(source[t], source[t])
                elif kind in ALIAS_OP_TYPES and ins:
                    root[t] = root.get(ins[0], ins[0])
                else:
                    root[t] = t
        self.own_op = np.array([index[ex.tensors[t].op] for t, _, _, _ in spans], dtype=np.int64)
        self.own = np.array([(a, b, nbytes) for _, a, b, nbytes in spans], dtype=np.int64).reshape(-1, 3)
        reads, tensor_ids = [], []
        ids: dict[str, int] = {}
        for op in sim.order:
            if types[op]["type"] == "IdentityN":
                continue
            for i, t in enumerate(ex.inputs_of[op]):
                t = source.get(t, t)
                info = ex.tensors[t]
                if info.dtype == "resource" or info.op not in pos:
                    continue
                buffer = span_of.get(root.get(t, t), -1)
                taken = (op, i) in in_place
                reads.append((index[info.op], pos[info.op], index[op], pos[op], info.bytes, buffer, taken))
                tensor_ids.append(ids.setdefault(t, len(ids)))
        self.reads = np.array(reads, dtype=np.int64).reshape(-1, 7)
        self.read_tensor = np.array(tensor_ids, dtype=np.int64)
        # Each buffer's last read on one device: where the plain step frees it (rule 3 or 4).
        self.last_read = np.full(len(spans), -1, dtype=np.int64)
        read = self.reads[:, 5] >= 0
        np.maximum.at(self.last_read, self.reads[read, 5], self.reads[read, 3])
        self.variable_bytes = model.variable_bytes

    def peaks(self, stage: Mapping[str, int], n_stages: int) -> np.ndarray:
        """Each stage's predicted peak (requested bytes, variables on stage 0) for ``stage`` (op -> stage)."""
        st = np.array([stage.get(op, 0) for op in self.ops], dtype=np.int64)
        width = self.n + LAG + 3
        timeline = np.zeros(n_stages * width, dtype=np.int64)
        prod_op, prod_pos, read_op, read_pos, nbytes, buffer, in_place = self.reads.T
        away = (st[prod_op] != st[read_op]) & (nbytes > 0)
        # A buffer read on another device after its last read on its own: freed after that one (or
        # once sent), instead of where the plain step frees it.
        owner = st[self.own_op]
        start, end, size = self.own.T
        end = end.copy()
        mine = (buffer >= 0) & (st[read_op] == owner[np.maximum(buffer, 0)])
        remote = np.zeros(len(end), dtype=bool)
        remote[buffer[(buffer >= 0) & ~mine]] = True
        if remote.any():
            last_own = np.full(len(end), -1, dtype=np.int64)
            np.maximum.at(last_own, buffer[mine], read_pos[mine])
            remote &= last_own < self.last_read
            end[remote] = np.maximum(last_own[remote] + 1 + LAG, start[remote] + 1)
        dev = owner * width
        np.add.at(timeline, dev + start, size)
        np.add.at(timeline, dev + end, -size)
        if away.any():
            keys = self.read_tensor[away] * n_stages + st[read_op][away]
            uniq, inverse = np.unique(keys, return_inverse=True)
            last = np.full(uniq.size, -1, dtype=np.int64)
            np.maximum.at(last, inverse, read_pos[away])
            # Taken over by an op that writes its output into it (rule 3): freed as that op runs.
            taken = np.zeros(uniq.size, dtype=bool)
            at_last = read_pos[away] == last[inverse]
            taken[inverse[at_last & (in_place[away] == 1)]] = True
            first = np.zeros(uniq.size, dtype=np.int64)
            first[inverse] = prod_pos[away]
            size = np.zeros(uniq.size, dtype=np.int64)
            size[inverse] = nbytes[away]
            dest = (uniq % n_stages) * width
            np.add.at(timeline, dest + first, size)
            np.add.at(timeline, dest + np.where(taken, last, np.maximum(last + 1 + LAG, first + 1)), -size)
        peaks = np.cumsum(timeline.reshape(n_stages, width), axis=1).max(axis=1)
        peaks[0] += self.variable_bytes
        return peaks


def device_model(model: GraphModel, stage: Mapping[str, int], k: int) -> GraphModel:
    """The step as device ``k`` sees it (the module doc): ops of other stages on :data:`ELSEWHERE`,
    each tensor read from another stage received by a ``_Recv`` op of stage ``k``, the variables
    only on stage 0. Simulate it with ``host=ELSEWHERE``."""
    records = op_records(model)
    recv: dict[str, str] = {}
    for name, rec in records.items():
        if stage[name] != k:
            rec["device"] = ELSEWHERE
            continue
        rec["device"] = ""
        for i, t in enumerate(rec["inputs"]):
            producer = model.tensors[t].op
            if stage[producer] != k and model.tensors[t].dtype != "resource":
                rec["inputs"][i] = recv.setdefault(t, f"{producer}/tflms_place_recv_{t.rpartition(':')[2]}") + ":0"
    ordered = []
    for name, rec in records.items():
        ordered.append(rec)
        for t in model.outputs_of[name]:
            if t in recv:
                info = model.tensors[t]
                out = (info.dtype, info.shape, info.bytes, info.estimated)
                ordered.append({"name": recv[t], "type": "_Recv", "inputs": [t], "outputs": [out], "device": ""})
    if k == 0:
        return GraphModel.from_ops(ordered, model.variable_bytes, model.name, model.variables)
    return GraphModel.from_ops(ordered, 0, model.name, ())


def _crossing(model: GraphModel, stage: Mapping[str, int]) -> tuple[int, int]:
    """``(bytes, transfers)`` sent between stages per step: one transfer per (tensor, receiving stage)."""
    pairs = {
        (t, stage[op])
        for op in model.dag
        for t in model.inputs_of[op]
        if model.tensors[t].dtype != "resource" and stage[model.tensors[t].op] != stage[op]
    }
    return sum(model.tensors[t].bytes for t, _ in pairs), len(pairs)


def evaluate(
    model: GraphModel,
    devices: Sequence[str],
    stage: Mapping[str, int],
    exact: bool = True,
    host: str | None = None,
) -> tuple[Stage, ...]:
    """The :class:`~tflms.ir.decisions.Stage` records of the placement ``stage`` (op -> stage index):
    per device its ops, predicted peak (the allocator's chunks with ``exact``, else the requested
    bytes) and compute seconds, and the bytes it receives per step. Ops of stage ``len(devices)``
    run on ``host``: their stage comes last, simulated the same way (the host's own peak), when
    there are any."""
    seconds = op_seconds(model)
    names = list(devices)
    if host is not None and len(devices) in set(stage.values()):
        names.append(host)
    elif any(s >= len(devices) for s in stage.values()):
        raise ValueError(
            f"the placement puts ops on stage {len(devices)}, the host's, without a host. Received: host={host!r}"
        )
    out = []
    for k, device in enumerate(names):
        ops = tuple(sorted(op for op, s in stage.items() if s == k))
        sim = Simulator(device_model(model, stage, k), ELSEWHERE)
        received = sum(
            model.tensors[t].bytes
            for t in {
                t
                for op in ops
                for t in model.inputs_of[op]
                if model.tensors[t].dtype != "resource" and stage[model.tensors[t].op] != k
            }
        )
        out.append(
            Stage(
                device=device,
                ops=ops,
                peak_bytes=int(sim.peak() if exact else sim.requested_peak()),
                compute_seconds=float(sum(seconds[op] for op in ops)),
                received_bytes=int(received),
            )
        )
    return tuple(out)


def device_stages(placement: Sequence[Stage], host: str | None) -> tuple[Stage, ...]:
    """The stages of ``placement`` that are not on ``host`` (the devices'; the host has no budget)."""
    return tuple(st for st in placement if host is None or not same_device(st.device, host))


def copy_ops(model: GraphModel, min_bytes: int = HOST_MIN_BYTES) -> list[str]:
    """The ops of ``model`` of :data:`COPY_OP_TYPES` whose outputs hold ``min_bytes`` or more
    (not on a variable), largest first (ties by name): those :func:`place` tries on the host."""
    ops = [op for op, kind in model.dag.nodes(data="type") if kind in COPY_OP_TYPES and not _resource_op(model, op)]
    size = {op: sum(model.tensors[t].bytes for t in model.outputs_of[op]) for op in ops}
    return sorted((op for op in ops if size[op] >= min_bytes), key=lambda op: (-size[op], op))


def _largest(placement: Sequence[Stage], k_devices: int) -> int:
    return max(st.peak_bytes for st in placement[:k_devices])


def _on_host(
    model: GraphModel,
    devices: Sequence[str],
    stage: dict[str, int],
    placed: tuple[Stage, ...],
    host: str,
    host_ops: Sequence[str] | None,
    exact: bool,
) -> tuple[Stage, ...]:
    """``placed`` (of ``stage``) with copy-only ops on ``host``: ``host_ops``, or else each of the
    :data:`HOST_TRIES` largest of :func:`copy_ops` that lowers the largest predicted device peak."""
    k_devices = len(devices)
    if host_ops is not None:
        named = list(host_ops)
        bad = [op for op in named if op not in model.dag or model.dag.nodes[op]["type"] not in COPY_OP_TYPES]
        if bad:
            raise ValueError(
                f"host_ops must name ops of the step that only copy ({', '.join(sorted(COPY_OP_TYPES))}); "
                f"{bad[0]!r} is not one. Pass names from copy_ops(model). Received: host_ops={named!r}"
            )
        return evaluate(model, devices, {**stage, **dict.fromkeys(named, k_devices)}, exact, host)
    best = placed
    for op in copy_ops(model)[:HOST_TRIES]:
        trial = {**stage, op: k_devices}
        option = evaluate(model, devices, trial, exact, host)
        if _largest(option, k_devices) < _largest(best, k_devices):
            best, stage = option, trial
    return best


def layer_of(op: str) -> str:
    """The layer an op belongs to, by its name: its first two name-scope components
    (``'model/conv1/Conv2D'`` -> ``'model/conv1'``), or the name itself when it has fewer scopes."""
    parts = op.split("/")
    return "/".join(parts[:2]) if len(parts) > 2 else op


def cut_positions(forward: Sequence[str], candidates: int = CANDIDATES) -> list[int]:
    """Where a cut may fall: ``0``, ``len(forward)`` and up to ``candidates`` indices between them at
    which the layer (:func:`layer_of`) changes, spread evenly. A cut never falls inside a layer:
    TensorFlow fuses the ops of one layer only on one device (oneDNN's fused layer norm, for
    one), so a layer split across devices computes different bits (a transformer's LayerNormalization
    cut between its ``mul_1`` and ``mul_2`` changed the third step's loss in the last place).

    >>> cut_positions(["m/a/x", "m/a/y", "m/b/x", "m/c/x", "m/c/y"], candidates=8)
    [0, 2, 3, 5]
    """
    n = len(forward)
    bounds = [i for i in range(1, n) if layer_of(forward[i]) != layer_of(forward[i - 1])]
    if len(bounds) > candidates:
        picks = np.linspace(0, len(bounds) - 1, candidates)
        bounds = sorted({bounds[int(round(x))] for x in picks})
    return [0, *bounds, n]


def place(
    model: GraphModel,
    devices: Sequence[str],
    *,
    candidates: int = CANDIDATES,
    refine: int = REFINE,
    exact: bool = True,
    host: str | None = None,
    host_ops: Sequence[str] | None = None,
) -> tuple[Stage, ...]:
    """The placement of ``model``'s ops on ``devices`` (two or more) that minimises the largest
    predicted device peak, then the bytes sent between devices (the module doc).

    The cut points are searched over ``candidates`` layer boundaries spread evenly over the forward
    ops (:func:`cut_positions`), by dynamic programming: each stage's peak is predicted once per (start, end) pair by
    :class:`StagePeaks` (requested bytes, the simulator's rules 1-7 on the plain step's
    schedule). The chosen placement is then simulated per device on its device model
    (:func:`evaluate`), and so are up to ``refine - 1`` more of the best cuts by the search's count
    (within :data:`REFINE_SLACK` of its optimum): the one of the lowest largest simulated peak is
    returned. The records hold the allocator's peaks (rule 8) with ``exact``, else the requested bytes.

    With ``host`` (a device string, not one of ``devices``), copy-only ops may then run there (the
    module doc): the ``host_ops`` named (each of :data:`COPY_OP_TYPES`), or with ``host_ops=None``
    each of the :data:`HOST_TRIES` largest of :func:`copy_ops` whose move lowers the largest
    predicted device peak, tried largest first. The host's stage, when it has ops, follows the
    devices' (:func:`device_stages` leaves it out).
    """
    k_devices = len(devices)
    if k_devices < 2:
        raise ValueError(f"place needs two or more devices. Received: devices={list(devices)!r}")
    if host is None and host_ops:
        raise ValueError(f"host_ops needs host= (where they run). Received: host_ops={list(host_ops)!r}, host=None")
    if host is not None and any(same_device(host, d) for d in devices):
        raise ValueError(f"host must not be one of devices. Received: host={host!r}, devices={list(devices)!r}")
    forward = forward_order(model)
    positions = cut_positions(forward, candidates)
    if len(positions) < k_devices + 1:
        raise ValueError(
            f"the step has {len(positions) - 1} layers to cut, fewer than the {k_devices} devices. "
            f"Received: devices={list(devices)!r}"
        )
    anchor = anchors(model, forward)
    shortlist = _cut_shortlist(model, len(forward), positions, anchor, k_devices, refine)
    stages = [stage_of(anchor, [positions[j] for j in c]) for c in shortlist]
    options = [evaluate(model, devices, st, exact) for st in stages]
    chosen = min(
        range(len(options)),
        key=lambda i: (max(s.peak_bytes for s in options[i]), sum(s.received_bytes for s in options[i])),
    )
    if host is None:
        return options[chosen]
    return _on_host(model, devices, stages[chosen], options[chosen], host, host_ops, exact)


def _cut_shortlist(
    model: GraphModel, n: int, positions: Sequence[int], anchor: Mapping[str, int], k_devices: int, refine: int
) -> list[tuple[int, ...]]:
    """The cuts :func:`place` simulates, as indices into ``positions`` (of ``n`` forward ops): the
    search's best first, then up to ``refine - 1`` more within :data:`REFINE_SLACK` of its peak."""
    counts = StagePeaks(model)
    last = len(positions) - 1

    @functools.cache
    def peak(i: int, j: int) -> int:
        """Predicted peak of a stage holding forward[positions[i]:positions[j]] (stage 0 iff i == 0)."""
        cuts = [c for c in (positions[i], positions[j]) if 0 < c < n]
        k = 0 if i == 0 else 1
        return int(counts.peaks(stage_of(anchor, cuts), len(cuts) + 1)[k])

    @functools.cache
    def cut_bytes(i: int) -> int:
        return _crossing(model, stage_of(anchor, [positions[i]]))[0]

    @functools.cache
    def best(k: int, i: int) -> tuple[int, int, tuple[int, ...]]:
        """(largest peak, bytes across the cuts, cut indices) of stages k.. over positions[i:]."""
        if k == k_devices - 1:
            return peak(i, last), 0, ()
        options = []
        for j in range(i + 1, last - (k_devices - 2 - k)):
            rest = best(k + 1, j)
            options.append((max(peak(i, j), rest[0]), cut_bytes(j) + rest[1], (j, *rest[2])))
        return min(options)

    fast_best, _, cut_index = best(0, 0)
    # The search's count misses the allocator's fragmentation and the device models' own schedules
    # (it erred by up to 30 % on a traced CNN): the ``refine`` best cuts within ``REFINE_SLACK`` of
    # its optimum are simulated per device, and the lowest largest peak wins (then the fewest bytes).
    limit = fast_best * (1 + REFINE_SLACK)
    found: list[tuple[int, int, tuple[int, ...]]] = []

    def walk(k: int, i: int, cuts: tuple[int, ...], worst: int) -> None:
        if len(found) >= 4 * refine:
            return
        if k == k_devices - 1:
            if (p := max(worst, peak(i, last))) <= limit:
                found.append((p, sum(cut_bytes(j) for j in cuts), cuts))
            return
        for j in range(i + 1, last - (k_devices - 2 - k)):
            if (p := peak(i, j)) <= limit:
                walk(k + 1, j, (*cuts, j), max(worst, p))

    if refine > 1:
        walk(0, 0, (), 0)
    return [cut_index, *(c for _, _, c in sorted(found) if c != cut_index)][: max(1, refine)]


def step_seconds(
    model: GraphModel,
    stage: Mapping[str, int],
    link_bandwidth: float = LINK_BANDWIDTH,
    link_latency: float = LINK_LATENCY,
) -> float:
    """Predicted step time of a placement: every op's compute (the stages run one after another,
    without micro-batches) plus each transfer between devices at ``link_bandwidth`` and ``link_latency``."""
    nbytes, transfers = _crossing(model, stage)
    return float(sum(op_seconds(model).values())) + nbytes / link_bandwidth + transfers * link_latency


def with_placement(model: GraphModel, placement: Sequence[Stage]) -> GraphModel:
    """``model`` with each op of a stage on the stage's device (the ``device`` of its node), as the
    rewrite places them (:func:`tflms.rewrite.apply.apply_placement`); ``model`` itself without a
    placement. The ops on variables keep their device (TensorFlow places them beside the variable)."""
    if not placement:
        return model
    device = {op: st.device for st in placement for op in st.ops}
    records = op_records(model)
    for name, rec in records.items():
        if name in device and not _resource_op(model, name):
            rec["device"] = device[name]
    return GraphModel.from_ops(records.values(), model.variable_bytes, model.name, model.variables)


def placement_plan(model: GraphModel, config: LMSConfig, host_ops: Sequence[str] | None = None) -> SwapPlan:
    """The plan of ``config.devices`` for ``model``: its placement (:func:`place`, copy-only ops on
    ``config.host``: ``host_ops``, or with ``None`` those that lower the largest predicted device
    peak), no swaps.

    ``peak_bytes_before`` is the plain step's predicted peak on one device, ``peak_bytes_after``
    the largest predicted device peak of the placement. With a budget (a size), a largest peak above
    it raises :class:`tflms.BudgetError` (``on_budget_miss="raise"``) or warns (``"best"``);
    ``budget="auto"`` reads no device limit here and plans as ``budget=None`` (the plan's
    ``budget_text`` says so). The passes of ``config.policy`` and swaps are not applied with a
    placement (the plan's ``reason`` says so)."""
    if not config.devices:
        raise ValueError(f"placement_plan needs config.devices. Received: devices={config.devices!r}")
    before = Simulator(model, config.host).peak()
    stages = place(model, config.devices, host=config.host, host_ops=host_ops)
    on_devices = device_stages(stages, config.host)
    largest = max(st.peak_bytes for st in on_devices)
    budget = config.budget if isinstance(config.budget, int) else None
    if budget is not None and largest > budget:
        if config.on_budget_miss == "raise":
            raise BudgetError(budget, largest, before)
        warnings.warn(
            f"tflms: the placement's largest predicted device peak ({format_bytes(largest)}) exceeds the budget "
            f"({format_bytes(budget)}); placed anyway (on_budget_miss='best')",
            LMSWarning,
            stacklevel=3,
        )
    on_host = len(stages) - len(on_devices)
    reason = (
        f"placed on {len(on_devices)} devices"
        + (f" and {len(stages[-1].ops)} copy-only ops on the host" if on_host else "")
        + f": largest predicted device peak {format_bytes(largest)} "
        f"({format_bytes(before)} on one device); swaps and the policy's passes are not applied with devices"
    )
    plan = SwapPlan(
        function=model.name,
        options=config.to_dict(),
        swaps=(),
        n_ops=model.dag.number_of_nodes(),
        peak_bytes_before=before,
        peak_bytes_after=largest,
        variable_bytes=model.variable_bytes,
        reason=reason,
        placement=stages,
    ).with_model(model)
    if config.budget == "auto":
        plan.with_budget_text("budget='auto' reads no device limit with devices=: planned without a budget")
    return plan
