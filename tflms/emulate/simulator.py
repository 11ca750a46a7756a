"""Predicted device memory of a step, before and after a swap plan.

Execution model (documented in the README; every number the simulator reports
follows from it). It follows what TensorFlow 2.21's executor does, as the profiler's
per-op allocation records on the test bed show (``benchmarks/simulator_accuracy.py``):

0. The graph is the step as Grappler leaves it after its constant push-down
   (:func:`tflms.emulate.grappler.with_constant_pushdown`: ``c * (dx * y)`` becomes
   ``dx * (c * y)``, and ``c * y`` of forward tensors then runs in the forward pass),
   in the rewritten step too: a swap-in reaches its consumers through a landing named
   under the swapped tensor's producer (:func:`tflms.rewrite.apply.landing_name`), and
   Grappler pairs the constant as in the plain step (``tests/test_tf_internals.py``).
   A swap-in's consumers are the reads of the traced step; where a push-down moved
   a read to the other op of its pair, the swap-in feeds that op, and a pushed-down
   op that a swap-in feeds runs after the swap-in's trigger. Grappler's other
   rewrites are not modelled.
1. Ops run in :meth:`GraphModel.schedule` order: the executor's ready order, depth
   first (after an op, the ops it made ready run next; ties by graph order). What
   only feeds the optimizer's update (reads of its slots, its learning rate) runs
   first, as the executor starts every op without inputs at once; an ``IdentityN``'s
   consumers wait only for the ops whose outputs they read through it (Grappler
   removes it), so each variable's update runs as soon as its own gradient exists.
2. Each output of an op on the device is allocated when the op runs, with its
   static size (:func:`tflms.ir.graph.estimate_bytes` for unknown dimensions). The
   step's arguments belong to the caller: they are held for the whole step.
   Outputs of op types in :data:`tflms.ir.graph.ALIAS_OP_TYPES` (``Identity``,
   ``Reshape``, ``ReadVariableOp``...) share their input's buffer and allocate nothing.
   An op with a measured temporary buffer (its ``scratch`` bytes, from an op profile:
   :func:`tflms.emulate.costs.with_scratch`) allocates it after its outputs, as an output
   nobody reads (rule 4).
3. In-place outputs: an op of :data:`FORWARDING_OP_TYPES` whose output (or of
   :data:`FORWARDING_OUTPUTS`, whose output it names) has the size
   and dtype of an input it is the last reader of writes into that buffer (the
   input is not counted during the op; one input per op, not a ``Placeholder`` or
   ``Const``), unless another read of that buffer is within ``CONCURRENT_READS``
   steps before it (it may still be running).
4. Any other buffer is freed ``1 + LAG`` steps after the last op that reads it (or
   any alias of it): with two inter-op threads the next op may still hold its
   inputs. A tensor nobody reads is freed right after its producer. ``IdentityN``
   is not a reader (Grappler removes it; its consumers read its inputs directly).
5. Ops placed on the host (their device string names the plan's ``host``) allocate
   no device memory.
6. Variables (model weights and optimizer slots captured by the step) are always
   resident: ``variable_bytes`` is added to every step. An in-place update of a
   variable (:data:`VARIABLE_WRITE_TYPES`) while a tensor read from it before may
   still be held, by a reader the update does not wait for (a weight's
   ``Conv2DBackpropInput`` against its Adam update), copies the variable first, as
   TensorFlow's ``PrepareToUpdateVariable`` does: the new buffer, allocated at the
   update, is the variable from then on; the old one is freed ``1 + LAG`` steps
   after the last of those reads. TensorFlow copies only where the read has not
   finished when the update runs, which depends on timing; this rule copies every
   variable whose read may not have, so it counts the most copies a step can make.
7. With a plan: the far consumers of a swapped tensor no longer read the device
   copy; the swap-out reads it right after its producer (so the device copy is
   freed by rules 3-4 applied to the swap-out and the *near* consumers). Each
   swap-in allocates the tensor's bytes when its trigger runs (when it has none:
   right after the producer) and frees them by rules 3-4 applied to the consumers
   it feeds. Transfer time is not modelled: a swap-in is assumed to arrive at its
   trigger and a swap-out to be sent at once.
8. The buffers of rules 2-7 go through an emulation of TensorFlow's BFC allocator
   (the device's, as on the test bed), and the chunks it hands out are what is
   counted: at each position, first the buffers ending there are freed (merged
   with free neighbours in their region), then the new ones are allocated in
   output order (swap-ins last); an in-place output takes over its input's chunk.
   A request is rounded up to 256 bytes and gets the smallest free chunk that
   holds it (lowest address on ties), split only if that chunk is at least twice
   the request or would waste at least 128 MiB; when none holds it a new region
   is added: 2 MiB first, then doubling (and doubled until the request fits).
   The variables (rule 6) are placed first, one chunk each in the order the step
   first reads them (:attr:`tflms.ir.graph.GraphModel.variables`; as one block when the
   model does not list them), and ``STEPS`` steps run one after the other on that
   allocator: a variable copied by rule 6 moves to its new chunk for the steps after
   it, which is how small variables come to sit inside the large free chunks
   activations need (a 16 MiB activation takes a 30 MiB hole whole: it is not split). The
   prediction is the step with the highest peak. ``requested`` (:attr:`MemoryProfile.requested`,
   :meth:`Simulator.requested_peak`, :meth:`Simulator.prefix_peaks`) is the same
   model without this rule: a lower bound, fast to compute, used by searches.

Example on a hand-built graph (see ``tests/emulate/test_simulator.py`` for more):

    >>> from tflms.ir.graph import GraphModel
    >>> f32 = lambda n: ("float32", (n,), 4 * n, False)
    >>> ops = [
    ...     {"name": "a", "type": "Relu", "inputs": [], "outputs": [f32(100)]},
    ...     {"name": "b", "type": "Relu", "inputs": ["a:0"], "outputs": [f32(10)]},
    ...     {"name": "c", "type": "Add", "inputs": ["a:0", "b:0"], "outputs": [f32(1)]},
    ... ]
    >>> prof = simulate(GraphModel.from_ops(ops))
    >>> int(prof.requested.max()), prof.peak_bytes  # 400 + 40 + 4 bytes; chunks 512 + 256 + 256
    (444, 1024)
"""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Sequence
from typing import TYPE_CHECKING

import numpy as np

from .._devices import device_key
from ..ir.graph import GraphModel, with_order_edges
from .bfc import BFC_FIRST_REGION, BFC_MAX_WASTE, BFC_ROUND, OutOfMemory
from .grappler import with_constant_pushdown
from .order import ready_order, seed_ready_structure
from .replay import STEPS, MemoryProfile, _Replay
from .static import FORWARDING_OP_TYPES, FORWARDING_OUTPUTS, VARIABLE_WRITE_TYPES, _seed_ordered_static, is_scratch

if TYPE_CHECKING:
    from ..ir.decisions import Order, Swap

__all__ = [
    "BFC_FIRST_REGION",
    "BFC_MAX_WASTE",
    "BFC_ROUND",
    "FORWARDING_OP_TYPES",
    "FORWARDING_OUTPUTS",
    "VARIABLE_WRITE_TYPES",
    "MemoryProfile",
    "OutOfMemory",
    "Simulator",
    "simulate",
]


def simulate(model: GraphModel, swaps: Sequence[Swap] = (), host: str | None = None) -> MemoryProfile:
    """Predict device memory over the step's schedule, with ``swaps`` applied.

    Args:
        model: the step's graph model.
        swaps: swaps of a plan (``plan.swaps``); empty for the plain step.
        host: the host device; ops placed there allocate no device memory.

    To evaluate many plans of one model, build a :class:`Simulator` once.
    """
    return Simulator(model, host).profile(swaps)


class Simulator:
    """The execution model of this module, precomputed for one graph model.

    Rule 0 of the module doc first: the ops run as Grappler leaves them after its constant
    push-down (:func:`tflms.emulate.grappler.with_constant_pushdown`; :attr:`pushdowns` lists the
    rewritten pairs), with or without swaps. A pushed-down op that a swap-in feeds waits for
    it: where the swap-in has a trigger, the op runs after it (the push-down had made it
    ready in the forward pass); such steps are simulated on a schedule built for them, kept
    for the next call (with a given ``order``, that order).

    The plain step's allocations are computed once; a set of swaps is applied as
    adjustments. :meth:`requested_peak` and :meth:`prefix_peaks` (rules 1-7) then cost
    O(ops) in numpy plus O(reads of the swapped buffers) in Python; :meth:`peak` and
    :meth:`profile` add the allocator emulation (rule 8), O(buffers x free chunks) in
    Python (about 0.2 s for a ResNet50 step).
    ``order`` replaces the schedule (e.g. an order recorded from a real run).
    ``executed`` is the model as run, with or without swaps; ``order`` and ``pos`` are its
    schedule without swaps (or with swaps whose triggered swap-ins feed no pushed-down op);
    positions of :meth:`live` refer to ``profile(swaps).schedule``.
    """

    def __init__(self, model: GraphModel, host: str | None = None, *, order: Sequence[str] | None = None) -> None:
        self.model = model
        self.host = host
        self._order = list(order) if order is not None else None
        executed, self.pushdowns = with_constant_pushdown(model)
        self._moved_reads = _moved_reads(model, executed, self.pushdowns)
        self._pushed_ops = frozenset(op for pair in self.pushdowns for op in pair)
        self._runs = {frozenset(): _Replay(executed, host, self._order)}
        self.executed, self.order, self.pos = executed, self._runs[frozenset()].order, self._runs[frozenset()].pos
        self._caches = _Caches()  # of this simulator only: nothing in it refers back to it

    def _ordered(self, orders: Sequence[Order]) -> Simulator:
        """A simulator of ``with_orders(self.model, orders)`` without re-deriving what orders
        cannot change: the constant push-downs (they follow data edges, devices and shapes;
        an order is a control edge) and the levels (which the simulator does not read; the
        model's levels are left stale, see :func:`tflms.ir.graph.with_order_edges`). For the
        schedule's search, which tries many orders on one step (:mod:`tflms.plan.passes.schedule`)."""
        if self._order is not None:
            raise ValueError("a simulator with a given order cannot take ordering edges")
        # The searches of make_plan's finish try the same orders on the same simulators again
        # (one search per plan of the autotuner's step 5): the simulator made before is returned.
        key = tuple(orders)
        known = self._caches.ordered.get(key)
        if known is not None:
            return known
        new = copy.copy(self)  # the host, the push-downs and the ops they rewrite carry over
        new._caches = _Caches()  # noqa: SLF001 (its own)
        new.model = with_order_edges(self.model, orders)
        # The step as run is the model itself where no constant was pushed down.
        executed = new.model if self.executed is self.model else with_order_edges(self.executed, orders)
        seed_ready_structure(self.executed.dag, executed.dag, [(o.after, o.op) for o in orders])
        _seed_ordered_static(self.executed, executed, orders, device_key(self.host) if self.host else None)
        base = _Replay(executed, self.host, None)
        new._runs = {frozenset(): base}  # noqa: SLF001 (a simulator's own state; the other runs are made lazily)
        new.executed, new.order, new.pos = base.model, base.order, base.pos
        self._caches.keep(self._caches.ordered, key, new)
        return new

    def _of(self, model: GraphModel) -> Simulator:
        """This simulator as one of ``model``: :attr:`model` with the same ops, edges and
        tensors, e.g. :func:`tflms.ir.graph.with_orders` of the orders that :meth:`_ordered` added
        (it recomputes the levels, which the simulator does not read)."""
        new = copy.copy(self)
        new.model = model
        new._caches = _Caches()  # noqa: SLF001 (its ordered simulators are of its own model)
        return new

    def _ordered_requested_peak(self, orders: Sequence[Order], swaps: Sequence[Swap] = ()) -> int:
        """``self._ordered(orders).requested_peak(swaps)``, without building that model: an
        order changes only the schedule. For the schedule's search, which tries many orders."""
        if self._order is not None:
            raise ValueError("a simulator with a given order cannot take ordering edges")
        swaps = self._as_run(swaps)
        edges, gates = [(o.after, o.op) for o in orders], self._gates(swaps)
        # The schedule's search asks about the same orders for the plans of several thresholds.
        key = (tuple(edges), gates)
        run = self._caches.replays.get(key)
        if run is None:
            run = _Replay(self.executed, self.host, self._gated_order(edges, gates))
            self._caches.keep(self._caches.replays, key, run)
        return run.requested_peak(swaps)

    def _as_run(self, swaps: Sequence[Swap]) -> Sequence[Swap]:
        """``swaps`` with each swap-in's consumers as reads of :attr:`executed` (rule 0)."""
        moved = self._moved_reads
        if not moved or not any(c in moved for s in swaps for si in s.swap_ins for c in si.consumers):
            return swaps
        return [
            dataclasses.replace(
                s,
                swap_ins=tuple(
                    dataclasses.replace(si, consumers=tuple(moved.get(c, c) for c in si.consumers)) for si in s.swap_ins
                ),
            )
            if any(c in moved for si in s.swap_ins for c in si.consumers)
            else s
            for s in swaps
        ]

    def _gates(self, swaps: Sequence[Swap]) -> frozenset[tuple[str, str]]:
        """``(trigger, op)`` for the pushed-down ops that the swap-ins of ``swaps`` (as run) feed."""
        if not self._pushed_ops:
            return frozenset()
        return frozenset(
            (si.trigger, c)
            for s in swaps
            for si in s.swap_ins
            if si.trigger is not None
            for c, _ in si.consumers
            if c in self._pushed_ops
        )

    def _gated_order(self, edges: list[tuple[str, str]], gates: frozenset[tuple[str, str]]) -> list[str]:
        """The executor's order of :attr:`executed` with the extra ``edges`` and ``gates``."""
        order = ready_order(self.executed, edges + sorted(gates))
        if len(order) != self.executed.dag.number_of_nodes():
            raise ValueError(
                f"the swap-ins' triggers {sorted(gates)} and the edges {edges} close a cycle in the step as run "
                "(a pushed-down op would wait for its own output): check the plan's triggers and orders"
            )
        return order

    def _run(self, swaps: Sequence[Swap]) -> _Replay:
        """The replay for ``swaps`` (as run): the step's, or one whose schedule has their gates."""
        gates = self._gates(swaps) if self._order is None else frozenset()  # a given order is kept
        run = self._runs.get(gates)
        if run is None:
            run = self._runs[gates] = _Replay(self.executed, self.host, self._gated_order([], gates))
        return run

    def live(self, position: int, swaps: Sequence[Swap] = ()) -> list[tuple[str, int]]:
        """The device buffers counted while ``profile(swaps).schedule[position]`` runs, ``swaps`` applied:
        ``(tensor, bytes)``, largest first (requested bytes, rules 1-7; variables not included).

        A swap-in's buffer is named ``'<tensor> (swap-in k)'``, a variable's copy (rule 6)
        ``'<handle> (copied by <op>)'``. For comparing with what a
        measured peak holds (``benchmarks/peak_anatomy.py``).
        """
        swaps = self._as_run(swaps)
        return self._run(swaps).live(position, swaps)

    def prefix_peaks(self, swaps: Sequence[Swap]) -> np.ndarray:
        """Requested-bytes peaks (variables included) of ``swaps[:n]`` for every n = 0..len(swaps).

        The fast model for searches: rules 1-7 without the allocator (rule 8), so each
        is :meth:`requested_peak`, a lower bound of :meth:`peak`. Built incrementally
        (one swap's effect on the allocation deltas is local), so the whole array costs
        about len(swaps) cumulative sums, once more per swap that gates a pushed-down op.
        """
        swaps = self._as_run(swaps)
        keys, gates = [frozenset()], frozenset()
        for s in swaps:
            gates = gates | self._gates([s])
            keys.append(gates)
        peaks = np.empty(len(swaps) + 1, dtype=np.int64)
        for key in dict.fromkeys(keys):
            ns = [n for n, k in enumerate(keys) if k == key]
            peaks[ns] = self._run(swaps[: ns[-1]]).prefix_peaks(swaps[: ns[-1]])[ns]
        return peaks

    def requested_peak(self, swaps: Sequence[Swap] = ()) -> int:
        """Peak of the requested bytes (variables included): rules 1-7 only, a lower bound of :meth:`peak`."""
        swaps = self._as_run(swaps)
        return self._run(swaps).requested_peak(swaps)

    def requested_peak_position(self, swaps: Sequence[Swap] = ()) -> tuple[int, tuple[str, ...]]:
        """``(position, schedule)``: where the requested-bytes peak (rules 1-7) is reached with
        ``swaps`` applied, in the schedule that :meth:`live`'s positions refer to."""
        swaps = self._as_run(swaps)
        run = self._run(swaps)
        position = int(np.argmax(run.requested(swaps))) if run.order else 0
        return position, tuple(run.order)

    def peak(self, swaps: Sequence[Swap] = (), steps: int | None = None, above: int | None = None) -> int:
        """Predicted peak bytes (variables included) with ``swaps`` applied: BFC chunks (rule 8).

        ``steps``: how many steps the allocator emulation runs (default :data:`STEPS`). The
        peak of more steps is never lower (it is the highest of them): ``steps=1`` is a
        cheaper lower bound, which searches check first. ``above``: the emulation stops as
        soon as the peak exceeds it, and returns what it had then (more than ``above``, at
        most the peak): for searches that only need to know whether a plan fits.
        """
        swaps = self._as_run(swaps)
        return self._run(swaps).peak(swaps, STEPS if steps is None else steps, above)

    def floor(self) -> tuple[int, str | None]:
        """``(bytes, op)``: a lower bound of the peak of any plan, and the op that sets it.

        While an op runs, its inputs and outputs are on the device together, whatever is
        swapped, recomputed or reordered around it. The bound is the variables plus the
        largest such working set of one op of the step as run (rule 0): its distinct device
        buffers (requested bytes, aliases counted once; not the output of an op that rule 3
        lets write into an input of its size, as some plan may make it that input's last
        reader; ``IdentityN`` skipped, as Grappler removes it). No plan of swaps,
        recomputes and orders gets a lower :meth:`peak`; ``(variables, None)`` for a step
        without device buffers.

        >>> from tflms.ir.graph import GraphModel
        >>> f32 = lambda n: ("float32", (n,), 4 * n, False)
        >>> model = GraphModel.from_ops([
        ...     {"name": "x", "type": "Placeholder", "inputs": [], "outputs": [f32(100)]},
        ...     {"name": "a", "type": "Exp", "inputs": ["x:0"], "outputs": [f32(100)]},
        ...     {"name": "b", "type": "MatMul", "inputs": ["a:0", "x:0"], "outputs": [f32(300)]},
        ...     {"name": "c", "type": "Relu", "inputs": ["b:0"], "outputs": [f32(300)]},
        ... ], variable_bytes=1000)
        >>> Simulator(model).floor()  # b: x, a and its output; c writes into b's buffer
        (3000, 'b')
        """
        return self._runs[frozenset()].floor()

    def unplaced(self, swaps: Sequence[Swap] = (), limit: int = 0) -> int | None:
        """Bytes of the first request that finds no free chunk under a device of ``limit`` bytes
        with ``swaps`` applied, or None when every request is placed.

        Rule 8 with a real cap, as TensorFlow's BFC allocator runs under one (the test bed's
        ``TF_CPU_BFC_MEM_LIMIT_IN_MB``; a GPU whose memory grows as needed): its regions
        together never exceed ``limit`` (the variables' included), a new region is the next
        doubling size or what the limit leaves, and a request must fit in one chunk of one
        region. So a step whose :meth:`peak` is within ``limit`` may still find no room for a
        large tensor: with 32 MiB in use, regions of 2+4+...+64 MiB leave 130 MiB of a 256 MiB
        cap, and a 187.5 MiB request fails though most of the pool is free. A diagnostic, not
        what budgets are checked by: the chunks it places are not the ones TensorFlow places, so
        it errs both ways (a plan it places may run out of memory, one for whose tensor it finds
        no chunk may train), and under a cap near the peak it misses chunks for tensors far
        smaller than the room left. :func:`tflms.plan.planner.check_placement` warns by the room
        left instead.

        >>> from tflms.ir.graph import GraphModel
        >>> mib = lambda n: ("float32", (n << 18,), n << 20, False)
        >>> model = GraphModel.from_ops([  # each freed right after its op: at most 64 MiB in use
        ...     {"name": f"op{n}", "type": "Relu", "inputs": [], "outputs": [mib(n)]} for n in (1, 3, 6, 12, 24, 48)
        ... ])
        >>> sim = Simulator(model)  # regions of 2+4+...+32 MiB leave 38 MiB of 100 MiB: no room for 48 MiB
        >>> sim.peak() >> 20, sim.unplaced(limit=100 << 20) >> 20, sim.unplaced(limit=128 << 20)
        (64, 48, None)
        """
        check_limit = int(limit)
        if check_limit <= 0:
            raise ValueError(f"limit must be a positive number of bytes. Received: limit={limit!r}")
        swaps = self._as_run(swaps)
        return self._run(swaps).unplaced(swaps, check_limit)

    def buffer_spans(self) -> list[tuple[str, int, int, int]]:
        """The device buffers of the plain step (rules 1-7, no swaps): ``(tensor, allocated at,
        end, bytes)``, positions in :attr:`order`, ``end`` the first position where the buffer is
        no longer counted; the variables (``model.variable_bytes``), their copies by rule 6 and
        the ops' temporary buffers (rule 2) are not listed. A search that moves ops between
        devices re-counts these per device (:mod:`tflms.plan.passes.place`) instead of simulating
        each candidate.

        >>> from tflms.ir.graph import GraphModel
        >>> f32 = lambda n: ("float32", (n,), 4 * n, False)
        >>> model = GraphModel.from_ops([
        ...     {"name": "a", "type": "Relu", "inputs": [], "outputs": [f32(100)]},
        ...     {"name": "b", "type": "Relu", "inputs": ["a:0"], "outputs": [f32(10)]},
        ... ])
        >>> Simulator(model).buffer_spans()  # a: freed 1 + LAG after its read by b; b: unread
        [('a:0', 0, 3, 400), ('b:0', 1, 2, 40)]
        """
        run = self._runs[frozenset()]
        return [
            (root, start, run.end[root], nbytes) for root, (start, nbytes) in run.alloc.items() if not is_scratch(root)
        ]

    def in_place_reads(self) -> frozenset[tuple[str, int]]:
        """The reads ``(op, input index)`` of the plain step whose op writes its output into that
        input's buffer (rule 3), for :meth:`buffer_spans`' users."""
        return frozenset(self._runs[frozenset()].forwarding)

    def largest_buffer(self) -> int:
        """Bytes of the largest device buffer of the step as run (0 for none): what
        :meth:`unplaced` needs as one contiguous chunk, whatever is swapped."""
        return int(max((nbytes for _, nbytes in self._runs[frozenset()].alloc.values()), default=0))

    def profile(self, swaps: Sequence[Swap] = ()) -> MemoryProfile:
        """The whole predicted timeline (BFC chunk bytes, rule 8) with ``swaps`` applied."""
        swaps = self._as_run(swaps)
        return self._run(swaps).profile(swaps)


class _Caches:
    """What :meth:`Simulator._ordered` and :meth:`Simulator._ordered_requested_peak` of one
    simulator made, for the same calls again: the simulators with orders, keyed by the orders, and
    the replays, keyed by their extra edges and gates. At most :attr:`SIZE` of each, the oldest
    dropped first. A simulator's caches hold only what it made (nothing refers back to it), so a
    chain of simulators with orders is freed with the first of them, without the cyclic collector."""

    SIZE = 16

    def __init__(self) -> None:
        self.ordered: dict = {}
        self.replays: dict = {}

    def keep(self, cache: dict, key: object, value: object) -> None:
        cache[key] = value
        while len(cache) > self.SIZE:
            del cache[next(iter(cache))]


def _moved_reads(
    traced: GraphModel, executed: GraphModel, pairs: Sequence[tuple[str, str]]
) -> dict[tuple[str, int], tuple[str, int]]:
    """Reads ``(op, input index)`` of ``traced`` that the push-downs ``pairs`` moved, to where
    ``executed`` has them (rule 0). Together, the ops of the pairs read the same tensors in both."""
    ops = list(dict.fromkeys(op for pair in pairs for op in pair))
    now = [(op, i, t) for op in ops for i, t in enumerate(executed.inputs_of[op])]
    moved: dict[tuple[str, int], tuple[str, int]] = {}
    for op in ops:
        for i, t in enumerate(traced.inputs_of[op]):
            to = now.pop(next(k for k, (_, _, held) in enumerate(now) if held == t))[:2]
            if to != (op, i):
                moved[op, i] = to
    return moved
