"""A memory-aware schedule: ordering edges that keep two branches of the backward pass
from holding their buffers at the same time (``Knobs.serialize``).

TensorFlow's executor runs every op whose inputs are ready. Where the backward pass forks
(a residual block's main and shortcut branches both read the block's output gradient), it
runs the element-wise BatchNorm gradients of both branches side by side, and both sets of
full-size temporaries are live at once. An :class:`~tflms.ir.decisions.Order` makes one branch's
ops wait until the op that frees the other branch's buffers has run.

Greedy, on the simulator (:mod:`tflms.emulate.simulator`) with the plan's swaps applied:

1. take the position of the predicted peak (requested bytes) and the ``TOP`` largest
   buffers live there;
2. for each such buffer ``a`` and its last reader ``R`` (a backward op), and each other
   such buffer ``b`` made up to the peak by a backward op ``B`` that ``R`` does not need:
   one candidate makes ``B``, and the backward ops that read one of ``B``'s inputs and ran
   up to the peak (its siblings: the other products of the same gradient), wait for
   ``R``, leaving out the ops ``R`` needs;
3. the candidate with the lowest predicted peak is kept if it lowers the requested peak by
   at least ``MIN_GAIN`` and does not raise the allocator-chunk peak; then again, at most
   ``MAX_ROUNDS`` times.
4. Look-ahead: a step's peak often sits on a plateau, two positions of about the same
   height (the BatchNorm gradients of both branches, then the block's output gradient),
   and lowering one only moves the peak to the other. So a best candidate that does not
   raise the requested peak is applied tentatively, up to ``LOOKAHEAD`` rounds in a row;
   the tentative rounds are kept only when a later round meets step 3's conditions against
   the last kept state, and dropped otherwise.

Only backward ops are ordered, and never an op whose outputs only become weight gradients
(:func:`_orderable`; README, "Memory-aware schedule").
Deterministic: candidates are tried in sorted order and ties keep the first.

:func:`update_orders` (the pass ``order_updates``) makes another kind of ordering edge: each
in-place variable update waits for the ops still holding a value read from that variable, so
that TensorFlow does not copy the variable before updating it.

:func:`late_triggers` (step 5 of :mod:`tflms.plan.autotune`, only where a budget needs it) moves the
trigger of a swap-in that arrives by the peak but is read after it to the op that runs right
before its consumer, with an ordering edge; :func:`finish` is what ``make_plan`` does with a
plan's swaps (these orders, then late triggers where the budget is still not met, then, while
it is not and the peak goes down, orders that make room for more late triggers: where a
swap-in's first consumer runs right after the peak, it waits for the sibling readers of its
other input that read no swap-in, and the reader that can write into that input's buffer
reads it last; see :func:`_room_orders`).

No order or trigger of these joins a filter gradient and the bias gradient that oneDNN runs
with it as one kernel (:func:`tflms.emulate.fusion.fused_partners`): that would change the numbers.
"""

from __future__ import annotations

import dataclasses
import weakref
from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING, Any

import networkx as nx

from ..._devices import device_key
from ...emulate.fusion import joins_fused
from ...emulate.simulator import Simulator
from ...ir.decisions import RECOMPUTE_SCOPE, Order
from ...ir.graph import SUM_OP_TYPES, GraphModel, reach, with_orders

if TYPE_CHECKING:
    from ...config import LMSConfig
    from ...ir.decisions import Swap, SwapIn

__all__ = [
    "memory_orders",
    "update_orders",
    "late_triggers",
    "finish",
    "TOP",
    "MAX_ROUNDS",
    "MIN_GAIN",
    "LOOKAHEAD",
]

#: Live buffers at the peak that the greedy pairs up (the largest).
TOP = 8
#: At most this many rounds (each adds one candidate's edges).
MAX_ROUNDS = 10
#: A round must lower the requested-bytes peak by at least this fraction.
MIN_GAIN = 0.005
#: At most this many tentative rounds in a row (step 4 of the module doc).
LOOKAHEAD = 3

_UNORDERED_TYPES = frozenset({"Const", "Shape", "ShapeN", "Size", "Rank", "NoOp"})
_PASS_THROUGH = frozenset({"Identity", "IdentityN", "AddN"})


def memory_orders(
    model: GraphModel, swaps: Sequence[Swap] = (), host: str | None = None
) -> tuple[tuple[Order, ...], GraphModel]:
    """Ordering edges that lower ``model``'s predicted peak with ``swaps`` applied, and the
    model with them (:func:`tflms.ir.graph.with_orders`); ``((), model)`` when none helps.

    >>> from tflms.ir.graph import GraphModel
    >>> f32 = lambda n: ("float32", (n,), 4 * n, False)
    >>> g = "gradient_tape/"
    >>> ops = [  # one gradient, two branches; the executor runs b1 while a1 waits for c
    ...     {"name": g + "dy", "type": "Relu", "inputs": [], "outputs": [f32(100)]},
    ...     {"name": g + "a1", "type": "Mul", "inputs": [g + "dy:0"], "outputs": [f32(1000)]},
    ...     {"name": g + "a3", "type": "Neg", "inputs": [g + "a2:0"], "outputs": [f32(1)]},
    ...     {"name": g + "b1", "type": "Mul", "inputs": [g + "dy:0"], "outputs": [f32(1000)]},
    ...     {"name": g + "c", "type": "Neg", "inputs": [g + "dy:0"], "outputs": [f32(1)]},
    ...     {"name": g + "a2", "type": "Sum", "inputs": [g + "a1:0", g + "c:0"], "outputs": [f32(1)]},
    ...     {"name": g + "b2", "type": "Sum", "inputs": [g + "b1:0"], "outputs": [f32(1)]},
    ...     {"name": g + "out", "type": "AddV2", "inputs": [g + "a3:0", g + "b2:0"], "outputs": [f32(1)]},
    ... ]
    >>> model = GraphModel.from_ops(ops)
    >>> orders, ordered = memory_orders(model)
    >>> orders
    (Order(op='gradient_tape/b1', after='gradient_tape/a2'),)
    >>> Simulator(model).requested_peak(), Simulator(ordered).requested_peak()
    (8408, 4408)
    """
    kept, _ = _memory_orders(Simulator(model, host), swaps)
    return kept, with_orders(model, kept)  # levels recomputed: the planner reads them


def update_orders(model: GraphModel, host: str | None = None) -> tuple[Order, ...]:
    """Ordering edges that make each in-place variable update wait for the ops still holding a
    value read from that variable (the pass ``order_updates``).

    TensorFlow copies a variable before updating it in place while a tensor read from it is
    still held (``PrepareToUpdateVariable``): Adam updates a kernel as soon as its filter
    gradient exists, while the kernel's ``Conv2DBackpropInput`` may still wait to run. The copy
    is the variable from then on, in a new chunk amid the activations' memory (the simulator's
    rule 6). With an order ``Order(op=<update>, after=<reader>)`` the update runs after the
    reader, when the read is no longer held, and nothing is copied. Only readers whose results
    lead to some variable update are ordered (an op whose output nobody uses, such as the input
    gradient of a model's first convolution, is pruned by Grappler; an order would keep it).

    >>> from tflms.ir.graph import GraphModel
    >>> f32 = lambda n: ("float32", (n,), 4 * n, False)
    >>> res = ("resource", (), 0, False)
    >>> ops = [
    ...     {"name": "w", "type": "Placeholder", "inputs": [], "outputs": [res]},
    ...     {"name": "x", "type": "Placeholder", "inputs": [], "outputs": [f32(10)]},
    ...     {"name": "read", "type": "ReadVariableOp", "inputs": ["w:0"], "outputs": [f32(1000)]},
    ...     {"name": "y", "type": "MatMul", "inputs": ["x:0", "read:0"], "outputs": [f32(10)]},
    ...     {"name": "gradient_tape/dw", "type": "Mul", "inputs": ["y:0", "x:0"], "outputs": [f32(1000)]},
    ...     {"name": "gradient_tape/dx", "type": "MatMul", "inputs": ["y:0", "read:0"], "outputs": [f32(10)]},
    ...     {"name": "adam/update", "type": "AssignSubVariableOp", "inputs": ["w:0", "gradient_tape/dw:0"],
    ...      "outputs": []},
    ...     {"name": "x_var", "type": "Placeholder", "inputs": [], "outputs": [res]},
    ...     {"name": "adam/update_x", "type": "AssignAddVariableOp", "inputs": ["x_var:0", "gradient_tape/dx:0"],
    ...      "outputs": []},
    ... ]
    >>> update_orders(GraphModel.from_ops(ops))
    (Order(op='adam/update', after='gradient_tape/dx'),)
    """
    from ..._devices import device_key
    from ...emulate.static import static_of

    static = static_of(model, device_key(host) if host else None)
    dag = model.dag
    useful = _leading_to_updates(model)
    orders = []
    for op, _nbytes, _handle, reads in static.writes:
        after = nx.descendants(dag, op)  # what runs after the update (later reads of the new value)
        for read, readers in reads:
            if read in after:
                continue
            orders.extend(Order(op=op, after=r) for r in readers if r not in after and r in useful)
    return tuple(sorted(set(orders)))


def _leading_to_updates(model: GraphModel) -> set[str]:
    """The ops whose results lead to a variable update (a reverse search from every update): an
    order's ``after`` among the others would keep an op alive that Grappler prunes."""
    from ...emulate.simulator import VARIABLE_WRITE_TYPES

    dag = model.dag
    updates = {op for op in dag if dag.nodes[op].get("type") in VARIABLE_WRITE_TYPES}
    return updates | reach(dag.predecessors, updates)


def with_update_orders(model: GraphModel, sim: Simulator) -> tuple[GraphModel, tuple[Order, ...], Simulator]:
    """``(model with its update orders, the orders, a simulator of it)``, or ``(model, (), sim)``
    when there are none or the simulator predicts a higher peak with them (``sim``: of ``model``).

    No update waits for a recompute clone (an op under ``tflms_recompute/``): the rewrite gates
    orders on the graph before the clones exist, and such orders change the numbers (the variables of
    the transformer of :mod:`tflms.testing.zoo` with ``recompute`` and ``order_updates``, after three
    Adam steps); the update then copies the variable, as without the pass."""
    orders = tuple(o for o in update_orders(model, sim.host) if not _is_clone(o.after) and not _is_clone(o.op))
    if not orders:
        return model, (), sim
    ordered = with_orders(model, orders)
    ordered_sim = Simulator(ordered, sim.host)
    if ordered_sim.peak() > sim.peak():
        return model, (), sim
    return ordered, orders, ordered_sim


def _is_clone(op: str) -> bool:
    return op.startswith(f"{RECOMPUTE_SCOPE}/") or f"/{RECOMPUTE_SCOPE}/" in op


def _memory_orders(sim: Simulator, swaps: Sequence[Swap] = ()) -> tuple[tuple[Order, ...], Simulator]:
    """:func:`memory_orders` on ``sim``'s model: the orders, and a simulator of the model with
    them (``sim`` when there are none), made by the search (:meth:`Simulator._ordered`). A
    simulator with a given order (``Simulator(..., order=...)``) is replaced by one without."""
    if sim._order is not None:  # noqa: SLF001 (an order given to it cannot take ordering edges)
        sim = Simulator(sim.model, sim.host)
    kept: list[Order] = []  # the orders of the last kept state
    tentative: list[Order] = []  # applied after it, kept only if a later round pays off (step 4)
    pending = 0  # tentative rounds since the last kept state
    kept_sim = sim  # of the last kept state; ``sim``: of the current one (kept and tentative orders)
    best_requested, best_chunks = sim.requested_peak(swaps), sim.peak(swaps)
    for _ in range(MAX_ROUNDS):
        found = None
        for candidate in _candidates(sim, swaps):
            if set(candidate) <= set(kept + tentative):
                continue
            requested = sim._ordered_requested_peak(candidate, swaps)  # noqa: SLF001 (fast path for this search)
            if requested <= best_requested and (found is None or requested < found[0]):
                found = (requested, candidate)
        if found is None:
            break
        requested, candidate = found
        sim = sim._ordered(candidate)  # noqa: SLF001
        tentative.extend(o for o in candidate if o not in tentative and o not in kept)
        chunks = sim.peak(swaps, above=best_chunks) if requested <= best_requested * (1 - MIN_GAIN) else None
        if chunks is not None and chunks <= best_chunks:
            kept.extend(tentative)
            tentative, pending, kept_sim = [], 0, sim
            best_requested, best_chunks = requested, chunks
            continue
        pending += 1
        if pending >= LOOKAHEAD:
            break
    return tuple(kept), kept_sim


def _candidates(sim: Simulator, swaps: Sequence[Swap]) -> list[tuple[Order, ...]]:
    """The edge sets one round tries (step 2 of the module doc), sorted."""
    model = sim.executed
    position, schedule = sim.requested_peak_position(swaps)
    pos = {op: i for i, op in enumerate(schedule)}
    # The swap-ins' readers as the simulator runs them (where a push-down moved a read).
    as_run = sim._as_run(swaps)  # noqa: SLF001 (the simulator's rule 0, within the package)
    groups = {(s.tensor, k): si.consumers for s in as_run for k, si in enumerate(s.swap_ins)}
    live = [name for name, _ in sim.live(position, swaps) if name in model.tensors or " (swap-in " in name][:TOP]

    def last_reader(buffer: str) -> str | None:
        tensor, _, k = buffer.partition(" (swap-in ")
        readers = groups[tensor, int(k[:-1])] if k else model.tensors[tensor].consumers
        later = [c for c, _ in readers if pos[c] > position]
        return max(later, key=pos.__getitem__) if later else None

    triggers = _trigger_edges(swaps)
    found: set[tuple[Order, ...]] = set()
    for a in live:
        reader = last_reader(a)
        if reader is None or model.phase(reader) != "backward":
            continue
        # What the reader waits for, in the step as run and in the step the edges go into (a
        # constant push-down moves data edges; an order against either would close a cycle).
        needed = nx.ancestors(model.dag, reader) | {reader}
        if sim.model.dag is not model.dag:
            needed |= nx.ancestors(sim.model.dag, reader)
        for b in live:
            if b == a or " (swap-in " in b:
                continue
            producer = model.tensors[b].op
            if pos[producer] > position or producer in needed or not _orderable(model, producer):
                continue
            ops = {producer} | {
                c
                for t in model.inputs_of[producer]
                for c, _ in model.tensors[t].consumers
                if c not in needed and pos[c] <= position and _orderable(model, c)
            }
            candidate = tuple(Order(op=c, after=reader) for c in sorted(ops))
            if not joins_fused(sim.model, [(o.after, o.op) for o in candidate], triggers):
                found.add(candidate)
    return sorted(found)


def _trigger_edges(swaps: Sequence[Swap]) -> list[tuple[str, str]]:
    """``(trigger, consumer)`` for each swap-in with a trigger: its consumers wait for it."""
    return [(si.trigger, c) for s in swaps for si in s.swap_ins if si.trigger for c, _ in si.consumers]


def _orderable(model: GraphModel, op: str) -> bool:
    """A backward op that computes data and whose outputs do not only become weight gradients."""
    if model.phase(op) != "backward" or model.dag.nodes[op]["type"] in _UNORDERED_TYPES:
        return False
    seen, stack = set(), [op]
    while stack:
        for t in model.outputs_of[stack.pop()]:
            for c, _ in model.tensors[t].consumers:
                kind = model.dag.nodes[c]["type"]
                if kind in _PASS_THROUGH and c not in seen and model.phase(c) == "backward":
                    seen.add(c)
                    stack.append(c)
                elif kind != "IdentityN" and model.phase(c) == "backward":
                    return True
    return False


def late_triggers(
    sim: Simulator, swaps: Sequence[Swap], budget: int | None = None
) -> tuple[list[Swap], tuple[Order, ...], Simulator]:
    """Swap-ins that arrive by the predicted peak but are read only after it, triggered later.

    A swap-in's trigger is an op on a path into its consumers, ``swapin_ahead`` levels before
    them: at the latest, the op that produces one of the consumer's other inputs. Where the
    consumer's other inputs are all ready well before it runs (the stem of DenseNet121:
    ``batchnorm/mul_1/Mul_1`` reads the stem convolution's output, swapped in when
    ``ReluGrad`` runs, and ``ReluGrad``'s output, while ``MaxPoolGrad``'s output is still
    held), the swap-in is on the device at the peak without being read there. Per round, at the
    position of the predicted peak (requested bytes), each such swap-in gets as trigger the
    last backward op (on the device, not a constant, a shape op or a sum) that the schedule runs
    before its first consumer, and each of its consumers an :class:`~tflms.ir.decisions.Order` after
    that op, so that the simulator's schedule waits for it as the executor will (through the
    swap-in); a swap-in that feeds a sum keeps its trigger (a control edge on a sum can change
    how Grappler associates it, see :data:`tflms.ir.graph.SUM_OP_TYPES`). A round is kept if
    it lowers the allocator-chunk peak; rounds stop at ``budget`` (when given), when no swap-in
    moves, or after ``MAX_ROUNDS``.

    Returns ``(swaps, orders, simulator of the model with the orders)``: ``(list(swaps), (),
    sim)`` when no round pays off. The plan's other triggers are kept.
    """
    host_key = device_key(sim.host) if sim.host else None
    best_swaps, orders, best_sim = list(swaps), [], sim
    best = sim.peak(best_swaps)
    for _ in range(MAX_ROUNDS):
        if budget is not None and best <= budget:
            break
        model = best_sim.model
        position, schedule = best_sim.requested_peak_position(best_swaps)
        pos = {op: i for i, op in enumerate(schedule)}

        moved, more = [], []
        fused = (_trigger_edges(best_swaps), [])  # the triggers before the round, the round's new edges
        for s in best_swaps:
            ins = []
            for si in s.swap_ins:
                start = max(pos.get(si.trigger, -1), pos.get(s.producer, -1)) if si.trigger else pos.get(s.producer, -1)
                trigger = _later_trigger(model, schedule, pos, si, position, host_key, fused) if start >= 0 else None
                if trigger is None or start > position:
                    ins.append(si)
                    continue
                ins.append(dataclasses.replace(si, trigger=trigger, trigger_level=model.level(trigger)))
                more += [Order(op=c, after=trigger) for c, _ in si.consumers if not model.dag.has_edge(trigger, c)]
                fused[1].extend((trigger, c) for c, _ in si.consumers)
            moved.append(dataclasses.replace(s, swap_ins=tuple(ins)) if ins != list(s.swap_ins) else s)
        if moved == best_swaps:
            break
        more = sorted(set(more) - set(orders))
        candidate = best_sim._ordered(more) if more else best_sim  # noqa: SLF001 (within the package)
        peak = candidate.peak(moved, above=best)
        if peak >= best:
            break
        best_swaps, orders, best_sim, best = moved, orders + more, candidate, peak
    return best_swaps, tuple(orders), best_sim


def _acyclic(sim: Simulator, swaps: Sequence[Swap], orders: Sequence[Order]) -> bool:
    """Whether ``orders`` close no cycle in ``sim``'s step, with each swap-in's consumers waiting
    for its trigger (edges the step's graph model does not have) and both graph models (as
    written, and as run after Grappler's push-down)."""
    edges = [(o.after, o.op) for o in orders] + _trigger_edges(swaps)
    dags = (sim.model.dag,) if sim.executed.dag is sim.model.dag else (sim.model.dag, sim.executed.dag)
    return not any(_closes_cycle(dag, edges) for dag in dags)


#: Per DAG: (node count when made, each op's index in a topological order of it; None if it has a
#: cycle). A model's DAG is not edited once made (an order makes a new one, :func:`with_orders`); the
#: node count is a cheap guard (as for the fused pairs of :mod:`tflms.emulate.fusion`).
_TOPO: weakref.WeakKeyDictionary[nx.DiGraph, tuple[int, dict[str, int] | None]] = weakref.WeakKeyDictionary()


def _topo_index(dag: nx.DiGraph) -> dict[str, int] | None:
    """Each op's index in a topological order of ``dag`` (kept per DAG); None if ``dag`` has a cycle."""
    known = _TOPO.get(dag)
    if known is not None and known[0] == dag.number_of_nodes():
        return known[1]
    try:
        index: dict[str, int] | None = {op: i for i, op in enumerate(nx.topological_sort(dag))}
    except nx.NetworkXUnfeasible:
        index = None
    _TOPO[dag] = (dag.number_of_nodes(), index)
    return index


def _has_path(dag: nx.DiGraph, source: str, target: str) -> bool:
    """``nx.has_path(dag, source, target)``, answered from a topological order of ``dag``
    (:func:`_topo_index`): no path where ``source`` comes after ``target`` in it, else a search
    that leaves out the ops after ``target``. The schedule's passes ask it many times of one DAG."""
    index = _topo_index(dag)
    if index is None or source not in index or target not in index:
        return nx.has_path(dag, source, target)
    limit = index[target]
    if index[source] >= limit:
        return source == target
    succ = dag.succ
    seen, stack = {source}, [source]
    while stack:
        for m in succ[stack.pop()]:
            if m == target:
                return True
            if m not in seen and index[m] < limit:
                seen.add(m)
                stack.append(m)
    return False


def _closes_cycle(dag: nx.DiGraph, edges: Iterable[tuple[str, str]]) -> bool:
    """Whether ``dag`` with ``edges`` added (``(before, after)`` pairs, ops outside ``dag``
    included) has a cycle: none where each edge runs forward in a topological order of ``dag``
    (:func:`_topo_index`); else a cycle of an acyclic ``dag`` passes through one of ``edges``, so
    it lies among the ops the edges' ends reach: a topological sort of those (Kahn's) finds it."""
    edges = list(edges)
    index = _topo_index(dag)
    if index is None:
        return True
    if all(u in index and v in index and index[u] < index[v] for u, v in edges):
        return False
    extra: dict[str, list[str]] = {}
    for u, v in edges:
        extra.setdefault(u, []).append(v)

    def successors(n: str) -> list[str]:
        return [*dag.succ[n], *extra.get(n, ())] if n in dag else extra.get(n, [])

    indegree: dict[str, int] = {}
    frontier = list({v for _, v in edges})
    reached = set(frontier)
    while frontier:  # the reached ops, and their in-degrees among them (repeated edges counted)
        for m in successors(frontier.pop()):
            indegree[m] = indegree.get(m, 0) + 1
            if m not in reached:
                reached.add(m)
                frontier.append(m)
    ready = [n for n in reached if n not in indegree]
    done = 0
    while ready:
        n = ready.pop()
        done += 1
        for m in successors(n):
            indegree[m] -= 1
            if indegree[m] == 0:
                ready.append(m)
    return done < len(reached)


def _room_orders(sim: Simulator, swaps: Sequence[Swap]) -> tuple[Order, ...]:
    """Orders that make room for a later trigger where :func:`late_triggers` finds none.

    At the predicted peak (requested bytes), a swap-in that is on the device there and whose
    first consumer ``C`` runs right after it (nothing to trigger it on in between) comes back
    too early. For each other input buffer of ``C`` at least as large as the swapped tensor (in
    a BatchNorm gradient, ``dy`` of ``dy * x``, with ``x`` the swap-in): ``C`` waits for the
    buffer's readers that read no swap-in (the sum of ``dy``), so that one of them can trigger
    the swap-in; and a reader that could write its output into the buffer (the simulator's
    rule 3: ``dy * scale``) waits for all the others, so that it reads the buffer last and
    takes it over (:func:`_room_for`). Only where :func:`late_triggers` has no op to trigger
    the swap-in on."""
    model = sim.model
    host_key = device_key(sim.host) if sim.host else None
    position, schedule = sim.requested_peak_position(swaps)
    pos = {op: i for i, op in enumerate(schedule)}
    fed = {c for s in swaps for si in s.swap_ins for c, _ in si.consumers}
    triggers = _trigger_edges(swaps)
    orders: set[Order] = set()
    useful: set[str] | None = None
    for s in swaps:
        for si in s.swap_ins:
            start = max(pos.get(si.trigger, -1), pos.get(s.producer, -1)) if si.trigger else pos.get(s.producer, -1)
            firsts = [pos.get(c) for c, _ in si.consumers]
            if not 0 <= start <= position or None in firsts or min(firsts) <= position:
                continue
            first = schedule[min(firsts)]
            if first not in model.dag:
                continue
            if _later_trigger(model, schedule, pos, si, position, host_key, (triggers, [])) is not None:
                continue  # late_triggers has an op to trigger it on
            useful = _leading_to_updates(model) if useful is None else useful
            orders.update(_room_for(model, first, s.tensor, s.bytes, pos, fed, useful))
    kept: list[Order] = []
    for o in sorted(orders):  # each with those kept before it: together they may join a pair
        if not joins_fused(model, [(o.after, o.op), *((k.after, k.op) for k in kept)], triggers):
            kept.append(o)
    return tuple(kept)


def _room_for(
    model: GraphModel, first: str, swapped: str, nbytes: int, pos: dict[str, int], fed: set[str], useful: set[str]
) -> list[Order]:
    """The orders of :func:`_room_orders` for a swap-in of ``swapped`` (``nbytes``) whose first
    consumer is ``first``: on each other input buffer of ``first`` of at least ``nbytes``,
    ``first`` waits for the readers that read no swap-in (``fed``: the ops that do), and a
    reader that could write into the buffer waits for all the others; none unless ``first`` is
    element-wise (:func:`_element_wise`).

    ``pos``: the schedule's positions. Left out: readers not in it or not in ``useful``
    (:func:`_leading_to_updates`: Grappler prunes the others), sums (an order can change how
    Grappler associates one, :data:`tflms.ir.graph.SUM_OP_TYPES`), reductions with a twin (below),
    and buffers with an alias among their readers. Of several readers that could write into the
    buffer, the last. Orders of several calls together can still close a cycle: :func:`finish`
    checks (:func:`_acyclic`)."""
    from ...emulate.simulator import FORWARDING_OP_TYPES
    from ...ir.graph import ALIAS_OP_TYPES

    if not _element_wise(model, first):
        return []
    orders = []
    after_first, before_first = nx.descendants(model.dag, first), nx.ancestors(model.dag, first)
    for name in model.inputs_of[first]:
        if name == swapped:
            continue
        tensor = model.tensors[name]
        readers = sorted({c for c, _ in tensor.consumers if c in pos and c in useful})
        types = {c: model.dag.nodes[c]["type"] for c in readers}
        # Two reductions of the buffer by constant axes (the beta gradients of two BatchNorms that
        # read one gradient) are one op after Grappler's deduplication: an order on either is lost.
        twins = [c for c in readers if all(model.dag.nodes[t.rpartition(":")[0]]["type"] == "Const"
                                            for t in model.inputs_of[c] if t != name)]  # fmt: skip
        readers = [c for c in readers if c not in twins or sum(types[t] == types[c] for t in twins) == 1]
        readers = [c for c in readers if types[c] not in SUM_OP_TYPES]
        if tensor.bytes < nbytes or any(kind in ALIAS_OP_TYPES for kind in types.values()):
            continue
        last = [
            f
            for f in readers
            if f != first
            and f not in fed
            and _element_wise(model, f)
            and _writes_into(model, f, tensor, FORWARDING_OP_TYPES.get(types[f], ()))
            and _orderable(model, f)
            and not nx.descendants(model.dag, f).intersection(readers)
        ]
        f = max(last, key=pos.__getitem__) if last else None
        orders += [
            Order(op=first, after=r)
            for r in readers
            if r not in (f, first) and r not in fed and r not in after_first and r not in before_first
        ]
        if f is not None:
            before_f = nx.ancestors(model.dag, f)
            orders += [Order(op=f, after=r) for r in readers if r != f and r not in before_f]
    return orders


def _element_wise(model: GraphModel, op: str) -> bool:
    """An element-wise op that is not a sum: :func:`_room_orders` orders no other. A control
    input on an op that oneDNN's graph pass fuses with another changes the kernel that runs, and the
    numbers (a ``Conv2DBackpropFilter`` ordered after its ``BiasAddGrad`` changes ResNet50's loss
    from the second step on)."""
    from ...emulate.simulator import FORWARDING_OP_TYPES

    kind = model.dag.nodes[op]["type"]
    return kind in FORWARDING_OP_TYPES and kind not in SUM_OP_TYPES


def _writes_into(model: GraphModel, op: str, tensor: Any, allowed: tuple[int, ...] | None) -> bool:
    """Whether ``op`` reads ``tensor`` at an input it may write its output into (rule 3)."""
    outs = model.outputs_of[op]
    if allowed == () or not outs:
        return False
    out = model.tensors[outs[0]]
    if out.bytes != tensor.bytes or out.dtype != tensor.dtype:
        return False
    return any(c == op and (allowed is None or i in allowed) for c, i in tensor.consumers)


def _later_trigger(
    model: GraphModel,
    schedule: Sequence[str],
    pos: dict[str, int],
    si: SwapIn,
    after: int,
    host_key: object,
    fused: tuple[list[tuple[str, str]], list[tuple[str, str]]] | None = None,
) -> str | None:
    """The op :func:`late_triggers` would trigger ``si`` on: the last backward op on the device
    that computes data (not a constant, a shape op or a sum) that ``schedule`` runs after
    position ``after`` and before ``si``'s first consumer, and that no consumer leads to; None if
    there is none, or if a consumer is a sum or not in ``schedule``. An op whose edges to the
    consumers would join a fused pair (:func:`tflms.emulate.fusion.joins_fused`; a filter gradient's bias
    gradient) is passed over: ``fused`` holds the edges already there (the swap-ins' triggers) and
    those added before (the late triggers of the same round)."""
    firsts = [pos.get(c) for c, _ in si.consumers]
    # Sums: a late trigger or an order on one could change how it associates (SUM_OP_TYPES).
    if None in firsts or any(model.dag.nodes[c]["type"] in SUM_OP_TYPES for c, _ in si.consumers):
        return None
    for op in reversed(schedule[after + 1 : min(firsts)]):
        node = model.dag.nodes.get(op)
        if (
            node is not None
            and model.phase(op) == "backward"
            and node["type"] not in _UNORDERED_TYPES | SUM_OP_TYPES
            and (host_key is None or device_key(node.get("device", "")) != host_key)
            and not joins_fused(
                model, [*((op, c) for c, _ in si.consumers), *(fused[1] if fused else ())], fused[0] if fused else ()
            )
        ):
            return None if any(_has_path(model.dag, c, op) for c, _ in si.consumers) else op
    return None


def finish(sim: Simulator, swaps: list[Swap], config: LMSConfig) -> tuple[list[Swap], tuple[Order, ...], Simulator]:
    """What :func:`tflms.make_plan` does with a plan's swaps, with ``config.knobs.serialize``: ordering
    edges for them (:func:`memory_orders`), then, where ``config.budget`` is still not met,
    later triggers (:func:`late_triggers`), and orders that make room for more of them
    (:func:`_room_orders`) while the peak goes down. Returns ``(swaps, the orders added,
    simulator of the step with them)``; without ``serialize``, ``(swaps, (), sim)``. The
    autotuner predicts a plan's peak with it (step 5 of :mod:`tflms.plan.autotune`); ``make_plan``
    then finishes the same plan, and a call with the last call's simulator (the same object),
    swaps and config returns that call's result (once: the simulators are not kept longer)."""
    if not config.knobs.serialize:
        return swaps, (), sim
    key = (sim, tuple(swaps), config)
    last = _last_finish[0]
    # make_plan finishes the plan the autotuner's step 5 has just finished (the same simulator,
    # swaps and knobs): the second call reuses the first one's result.
    if last is not None and last[0][0] is sim and last[0][1:] == key[1:]:
        _last_finish[0] = None
        done, orders, finished = last[1]
        return list(done), orders, finished
    orders, sim = _memory_orders(sim, swaps)
    if config.budget is not None and sim.peak(swaps) > config.budget:
        swaps, late, sim = late_triggers(sim, swaps, config.budget)
        orders += late
        peak = sim.peak(swaps)
        for _ in range(MAX_ROUNDS):  # room for later triggers, kept while the peak goes down
            if peak <= config.budget:
                break
            room = tuple(o for o in _room_orders(sim, swaps) if o not in orders)
            if not room or not _acyclic(sim, swaps, room):
                break
            roomy = sim._ordered(room)  # noqa: SLF001 (within the package)
            moved, late, moved_sim = late_triggers(roomy, swaps, config.budget)
            moved_peak = moved_sim.peak(moved, above=peak)
            if moved_peak >= peak:
                break
            swaps, orders, sim, peak = moved, orders + room + late, moved_sim, moved_peak
    _last_finish[0] = (key, (tuple(swaps), orders, sim))
    return list(swaps), orders, sim


#: The last :func:`finish` call's ``((simulator, swaps, config), result)``.
_last_finish: list[tuple | None] = [None]
