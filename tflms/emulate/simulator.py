"""Predicted device memory of a step, before and after a swap plan.

Execution model (documented in the README; every number the simulator reports
follows from it). It follows what TensorFlow 2.21's executor was seen doing on
the test bed (per-op allocation records of the profiler, ``benchmarks/simulator_accuracy.py``):

0. The graph is the step as Grappler leaves it after its constant push-down
   (:func:`tflms.ir.graph.with_constant_pushdown`: ``c * (dx * y)`` becomes
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
   after the last of those reads (measured on the test bed, ResNet50 96² batch 16:
   51-61 MiB of its 90 MiB of weights copied per step; this rule copies all of them).
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
   activations need (a 16 MiB activation in a 30 MiB hole, unsplit, measured). The
   prediction is the step with the highest peak. ``requested`` (:attr:`MemoryProfile.requested`,
   :meth:`Simulator.requested_peak`, :meth:`Simulator.prefix_peaks`) is the same
   model without this rule: a lower bound, fast to compute, used by searches.

Example on a hand-built graph (see ``tests/test_simulator.py`` for more):

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

import bisect
import copy
import dataclasses
import weakref
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import networkx as nx
import numpy as np

from ..ir.devices import device_key
from ..ir.graph import ALIAS_OP_TYPES, GraphModel, reach, with_order_edges
from .grappler import with_constant_pushdown
from .order import _ready_structure, ready_order

if TYPE_CHECKING:
    from ..plan.records import Order, Swap

__all__ = ["MemoryProfile", "Simulator", "simulate"]


@dataclasses.dataclass(frozen=True)
class MemoryProfile:
    """Result of :func:`simulate`.

    ``timeline[i]`` is the predicted device memory (bytes of the allocator's chunks,
    variables excluded) while ``schedule[i]`` runs; ``peak_bytes`` includes
    ``variable_bytes``. ``requested`` is the same without the allocator (rules 1-7
    of the module doc): the bytes the ops asked for.
    ``swap_out_steps``/``swap_in_steps`` are schedule positions, for plotting.
    """

    schedule: tuple[str, ...]
    timeline: np.ndarray
    variable_bytes: int
    peak_bytes: int
    peak_op: str | None
    swap_out_steps: tuple[int, ...] = ()
    swap_in_steps: tuple[int, ...] = ()
    requested: np.ndarray | None = None


def simulate(model: GraphModel, swaps: Sequence[Swap] = (), host: str | None = None) -> MemoryProfile:
    """Predict device memory over the step's schedule, with ``swaps`` applied.

    Args:
        model: the step's graph model.
        swaps: swaps of a plan (``plan.swaps``); empty for the plain step.
        host: the host device; ops placed there allocate no device memory.

    To evaluate many plans of one model, build a :class:`Simulator` once.
    """
    return Simulator(model, host).profile(swaps)


#: Op types whose kernel may write its output into the buffer of an input it reads
#: last (TensorFlow's ``forward_input_or_allocate_output``): input indices it may
#: reuse (None: any). Checked on the CPU kernels of TF 2.21: element-wise ops,
#: ``AddN`` and ``BiasAdd`` (which Grappler fuses into the convolution before it).
FORWARDING_OP_TYPES: dict[str, tuple[int, ...] | None] = {
    **dict.fromkeys(
        (
            "Abs", "Acos", "Asin", "Atan", "BiasAdd", "Ceil", "Cos", "Cosh", "Elu", "Erf", "Erfc", "Exp",
            "Expm1", "Floor", "Gelu", "Inv", "LeakyRelu", "Log", "Log1p", "Neg", "Reciprocal", "Relu",
            "Relu6", "Rint", "Round", "Rsqrt", "Selu", "Sigmoid", "Sign", "Sin", "Sinh", "Softplus",
            "Softsign", "Sqrt", "Square", "Tan", "Tanh", "ClipByValue",
        ),
        (0,),
    ),
    **dict.fromkeys(
        (
            "Add", "AddV2", "Sub", "Mul", "MulNoNan", "Div", "DivNoNan", "RealDiv", "FloorDiv", "FloorMod",
            "Maximum", "Minimum", "Pow", "SquaredDifference", "ReluGrad", "Relu6Grad", "EluGrad", "SeluGrad",
            "LeakyReluGrad", "SigmoidGrad", "TanhGrad", "RsqrtGrad", "SqrtGrad", "SoftplusGrad",
            "ReciprocalGrad", "AddN", "Xdivy", "Xlogy",
        ),
        None,
    ),
    **dict.fromkeys(("Select", "SelectV2"), (1, 2)),
}  # fmt: skip

#: Ops that are not element-wise and still write an output into an input they read last, as
#: :data:`FORWARDING_OP_TYPES` (rule 3; kept apart from it: :mod:`tflms.plan.passes.schedule` orders element-wise
#: ops): op type -> (the output, the input indices). Softmax and LogSoftmax write into their logits
#: (``softmax_op.cc``); the cross-entropy ops write their backprop, output 1, into them
#: (``xent_op.cc``, ``sparse_xent_op.cc``). Measured on the test bed (the GPT of
#: :mod:`tflms.testing.measure`, batch 8): none of them allocated a buffer.
FORWARDING_OUTPUTS: dict[str, tuple[int, tuple[int, ...]]] = {
    "Softmax": (0, (0,)),
    "LogSoftmax": (0, (0,)),
    "SoftmaxCrossEntropyWithLogits": (1, (0,)),
    "SparseSoftmaxCrossEntropyWithLogits": (1, (0,)),
}


def _forwarding(op_type: str) -> tuple[int, tuple[int, ...] | None]:
    """``(output, input indices or None for any)`` that an op of ``op_type`` may write in place
    (rule 3); ``(0, ())`` for none."""
    if op_type in FORWARDING_OUTPUTS:
        return FORWARDING_OUTPUTS[op_type]
    return 0, FORWARDING_OP_TYPES.get(op_type, ())


#: A read this close (in schedule positions) before the last one may still be running
#: when the last starts (the executor runs ready siblings side by side): no reuse then.
CONCURRENT_READS = 1

#: Ops in flight besides the current one: a buffer is freed this many positions
#: after its last read (2 inter-op threads: the next op may still hold its inputs).
LAG = 1

#: Steps the allocator emulation (rule 8) runs one after the other. The chunks a step gets
#: depend on where the steps before it left the variables that rule 6 copied: three steps
#: predicted 1-3 % less than five for ResNet50 96² (batch 16-48), the same for the CNN and
#: the transformer, in 60 % of the time.
STEPS = 3

#: The step's arguments: their buffers belong to the caller, who holds them for the whole step.
_ARGUMENT_OP_TYPES = frozenset({"Placeholder", "_Arg"})

#: Producers whose buffers an op never reuses: the caller or the kernel keeps a reference.
_NOT_FORWARDABLE = frozenset({"Placeholder", "Const", "_Arg", "HostConst"})


#: TensorFlow's BFC allocator (``bfc_allocator.cc``), as the device allocator of the
#: test bed runs it (``TF_CPU_ALLOCATOR_USE_BFC=true``, growth on): requests are rounded
#: up to ``BFC_ROUND`` bytes, the first region is ``BFC_FIRST_REGION`` bytes and each
#: new region doubles; a free chunk is split only when it is at least twice the request
#: or the rest is at least ``BFC_MAX_WASTE`` bytes.
BFC_ROUND = 256
BFC_FIRST_REGION = 2 << 20
BFC_MAX_WASTE = 128 << 20


class OutOfMemory(Exception):
    """The emulated allocator cannot hold a request under its limit; ``nbytes``: the request's bytes."""

    def __init__(self, message: str, nbytes: int = 0) -> None:
        super().__init__(message)
        self.nbytes = nbytes


class _BFC:
    """Chunks of a best-fit-with-coalescing allocator; ``in_use`` counts chunk bytes.

    ``reserved`` bytes (the variables) are placed first, as TensorFlow's allocator
    would have after allocating them one by one in doubling regions: one region of
    the sum of those regions, the rest of it free, the next region twice the last.
    They are not counted in ``in_use``. With a ``limit`` the regions together never
    exceed it (``BFCAllocator::Extend``: a new region is the smaller of the next
    doubling size and what the limit leaves), and a request that no free chunk and
    no new region can hold raises :class:`OutOfMemory`.
    """

    def __init__(self, reserved: int = 0, limit: int | None = None) -> None:
        self.limit = limit
        self.pool = 0  # bytes of all regions
        self.free: list[tuple[int, int]] = []  # (size, address), sorted: best fit, lowest address
        self.size: dict[int, int] = {}
        self.used: dict[int, bool] = {}
        self.prev: dict[int, int | None] = {}
        self.region_end: dict[int, int] = {}
        self.in_use = 0
        self.top = 0
        self.next_region = BFC_FIRST_REGION
        if reserved > 0:
            total = region = BFC_FIRST_REGION
            while total < reserved:
                region *= 2
                total += region
            if limit is not None:
                if _rounded(reserved) > limit:
                    raise OutOfMemory(f"{reserved} reserved bytes exceed the limit of {limit}", reserved)
                total = min(total, limit // BFC_ROUND * BFC_ROUND)
            self._region(total)
            self._take(0, _rounded(reserved), force_split=True)
            self.next_region = 2 * region

    def _region(self, nbytes: int) -> None:
        addr = self.top
        self.pool += nbytes
        self.top += nbytes + BFC_ROUND  # regions are never neighbours
        self.size[addr], self.used[addr], self.prev[addr] = nbytes, False, None
        self.region_end[addr] = addr + nbytes
        bisect.insort(self.free, (nbytes, addr))

    def _take(self, i: int, rounded: int, force_split: bool = False) -> int:
        size, addr = self.free.pop(i)
        if force_split or size >= 2 * rounded or size - rounded >= BFC_MAX_WASTE:
            if size > rounded:
                rest = addr + rounded
                end = self.region_end[addr]
                self.size[rest], self.used[rest], self.prev[rest] = size - rounded, False, addr
                self.region_end[rest] = end
                if rest + size - rounded < end:
                    self.prev[rest + size - rounded] = rest
                self.size[addr] = rounded
                bisect.insort(self.free, (size - rounded, rest))
        self.used[addr] = True
        return addr

    def alloc(self, nbytes: int) -> int:
        """Address of the chunk given to a request of ``nbytes``."""
        rounded = _rounded(nbytes)
        i = bisect.bisect_left(self.free, (rounded, -1))
        if i == len(self.free):
            left = rounded if self.limit is None else (self.limit - self.pool) // BFC_ROUND * BFC_ROUND
            if rounded > left:
                raise OutOfMemory(f"no free chunk holds {rounded} bytes and the limit leaves {left}", nbytes)
            grown = False
            while rounded > self.next_region:
                self.next_region *= 2
                grown = True
            self._region(self.next_region if self.limit is None else min(self.next_region, left))
            if not grown:
                self.next_region *= 2
            i = bisect.bisect_left(self.free, (rounded, -1))
        addr = self._take(i, rounded)
        self.in_use += self.size[addr]
        return addr

    def release(self, addr: int) -> None:
        """Free a chunk, merged with the free chunks next to it in its region."""
        size = self.size[addr]
        self.in_use -= size
        self.used[addr] = False
        end = self.region_end[addr]
        nxt = addr + size
        if nxt < end and not self.used[nxt]:
            self._unlink(nxt)
            size += self.size[nxt]
            self._forget(nxt)
        prev = self.prev[addr]
        if prev is not None and not self.used[prev]:
            self._unlink(prev)
            size += self.size[prev]
            self._forget(addr)
            addr = prev
        self.size[addr] = size
        if addr + size < end:
            self.prev[addr + size] = addr
        bisect.insort(self.free, (size, addr))

    def _unlink(self, addr: int) -> None:
        del self.free[bisect.bisect_left(self.free, (self.size[addr], addr))]

    def _forget(self, addr: int) -> None:
        del self.size[addr], self.used[addr], self.prev[addr], self.region_end[addr]


def _rounded(nbytes: int) -> int:
    return max(BFC_ROUND, -(-nbytes // BFC_ROUND) * BFC_ROUND)


class Simulator:
    """The execution model of this module, precomputed for one graph model.

    Rule 0 of the module doc first: the ops run as Grappler leaves them after its constant
    push-down (:func:`tflms.ir.graph.with_constant_pushdown`; :attr:`pushdowns` lists the
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

    def _ordered(self, orders: Sequence[Order]) -> Simulator:
        """A simulator of ``with_orders(self.model, orders)`` without re-deriving what orders
        cannot change: the constant push-downs (they follow data edges, devices and shapes;
        an order is a control edge) and the levels (which the simulator does not read; the
        model's levels are left stale, see :func:`tflms.ir.graph.with_order_edges`). For the
        schedule's search, which tries many orders on one step (:mod:`tflms.plan.passes.schedule`)."""
        if self._order is not None:
            raise ValueError("a simulator with a given order cannot take ordering edges")
        new = copy.copy(self)  # the host, the push-downs and the ops they rewrite carry over
        new.model = with_order_edges(self.model, orders)
        # The step as run is the model itself where no constant was pushed down.
        executed = new.model if self.executed is self.model else with_order_edges(self.executed, orders)
        _seed_ordered_static(self.executed, executed, orders, device_key(self.host) if self.host else None)
        base = _Replay(executed, self.host, None)
        new._runs = {frozenset(): base}  # noqa: SLF001 (a simulator's own state; the other runs are made lazily)
        new.executed, new.order, new.pos = base.model, base.order, base.pos
        return new

    def _of(self, model: GraphModel) -> Simulator:
        """This simulator as one of ``model``: :attr:`model` with the same ops, edges and
        tensors, e.g. :func:`tflms.ir.graph.with_orders` of the orders that :meth:`_ordered` added
        (it recomputes the levels, which the simulator does not read)."""
        new = copy.copy(self)
        new.model = model
        return new

    def _ordered_requested_peak(self, orders: Sequence[Order], swaps: Sequence[Swap] = ()) -> int:
        """``self._ordered(orders).requested_peak(swaps)``, without building that model: an
        order changes only the schedule. For the schedule's search, which tries many orders."""
        if self._order is not None:
            raise ValueError("a simulator with a given order cannot take ordering edges")
        swaps = self._as_run(swaps)
        schedule = self._gated_order([(o.after, o.op) for o in orders], self._gates(swaps))
        return _Replay(self.executed, self.host, schedule).requested_peak(swaps)

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
        what budgets are checked by: on the test bed it erred both ways (the GPT of
        :mod:`tflms.testing.measure` at batch 16: a plan it placed under 320 MiB ran out of memory there
        asking for its logits, and the default plan, for whose logits it found no chunk, trained),
        and under caps near the peak it misses chunks for tensors far smaller than the room left
        (ResNet50). :func:`tflms.plan.planner.check_placement` warns by the room left instead.

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

    def largest_buffer(self) -> int:
        """Bytes of the largest device buffer of the step as run (0 for none): what
        :meth:`unplaced` needs as one contiguous chunk, whatever is swapped."""
        return int(max((nbytes for _, nbytes in self._runs[frozenset()].alloc.values()), default=0))

    def profile(self, swaps: Sequence[Swap] = ()) -> MemoryProfile:
        """The whole predicted timeline (BFC chunk bytes, rule 8) with ``swaps`` applied."""
        swaps = self._as_run(swaps)
        return self._run(swaps).profile(swaps)


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


@dataclasses.dataclass
class _Static:
    """What :class:`_Replay` needs of a model that does not depend on the schedule."""

    root: dict[str, str]  # tensor -> the tensor whose buffer it shares (itself if none)
    #: Per tensor, in model order: (its buffer's root, its op, its reads (consumer, input
    #: index) but IdentityN's, whether its op keeps the buffer live (not an IdentityN), the
    #: bytes it allocates on the device (0: none, an alias, or on the host)).
    tensors: list[tuple[str, str, list[tuple[str, int]], bool, int]]
    #: Ops that may write their output into an input: (op, [(input index, its root)]).
    forwarding: list[tuple[str, list[tuple[int, str]]]]
    #: In-place variable writes (rule 6): (writer, bytes, the variable's handle (root tensor),
    #: [(a ReadVariableOp of that variable, the ops that read its value and that the writer
    #: does not wait for)]).
    writes: list[tuple[str, int, str, list[tuple[str, list[str]]]]]
    #: ``tensors`` and ``forwarding`` as arrays (:func:`_arrays`), made on the first replay; an
    #: ordered step's static (:func:`_seed_ordered_static`) shares its parent's.
    arrays: _Arrays | None = None


@dataclasses.dataclass
class _Arrays:
    """:class:`_Static`'s buffers and reads as numpy arrays, for :class:`_Replay` to place them on
    a schedule in numpy: ``op``-arrays index :attr:`ops`, ``root``-arrays :attr:`roots`."""

    ops: dict[str, int]  # op -> its index
    roots: list[str]  # the buffers allocated on the device, in the order of their tensors
    alloc_op: np.ndarray  # per root: the op that allocates it
    alloc_bytes: np.ndarray  # per root: its bytes
    is_argument: np.ndarray  # per root: a step argument (the caller holds it for the whole step)
    keep_root: np.ndarray  # per (tensor, op) that keeps a root live (not an IdentityN): the root
    keep_op: np.ndarray  # ... and the op
    read_root: np.ndarray  # per read of a root (through any alias): the root
    read_op: np.ndarray  # ... the reading op
    read_index: np.ndarray  # ... and its input index
    read_via: np.ndarray  # ... and the op whose output it reads (an alias op's, for a read through it)
    reads_of: dict[str, list[tuple[str, int]]]  # every root (allocated or not) -> its reads (consumer, index)
    #: In-place candidates: (op, [(input index, root index)]), for roots that are allocated.
    forwarding: list[tuple[str, list[tuple[int, int]]]]


def _arrays(static: _Static, model: GraphModel) -> _Arrays:
    """``static``'s :class:`_Arrays` (made once, kept on it)."""
    if static.arrays is not None:
        return static.arrays
    ops = {op: k for k, op in enumerate(model.dag)}
    roots: dict[str, int] = {}
    alloc_op, alloc_bytes, is_argument = [], [], []
    types = model.dag.nodes
    for r, op, _, _, nbytes in static.tensors:
        if nbytes and r not in roots:
            roots[r] = len(roots)
            alloc_op.append(ops[op])
            alloc_bytes.append(nbytes)
            is_argument.append(types[op]["type"] in _ARGUMENT_OP_TYPES)
    keep_root, keep_op, read_root, read_op, read_index, read_via = [], [], [], [], [], []
    reads_of: dict[str, list[tuple[str, int]]] = {}
    for r, op, readers, counts, _ in static.tensors:
        reads_of.setdefault(r, []).extend(readers)
        k = roots.get(r)
        if k is None:
            continue
        if counts:
            keep_root.append(k)
            keep_op.append(ops[op])
        for c, i in readers:
            read_root.append(k)
            read_op.append(ops[c])
            read_index.append(i)
            read_via.append(ops[op])
    forwarding = [(op, [(i, roots[r]) for i, r in cands]) for op, cands in static.forwarding]

    def ints(values: list[int]) -> np.ndarray:
        return np.array(values, dtype=np.int64)

    static.arrays = _Arrays(
        ops,
        list(roots),
        ints(alloc_op),
        ints(alloc_bytes),
        np.array(is_argument, dtype=bool),
        ints(keep_root),
        ints(keep_op),
        ints(read_root),
        ints(read_op),
        ints(read_index),
        ints(read_via),
        reads_of,
        forwarding,
    )
    return static.arrays


class _Reads(dict):
    """Root -> its reads ``[(position, (consumer, input index))]`` in a schedule, made when asked."""

    def __init__(self, pos: dict[str, int], reads_of: dict[str, list[tuple[str, int]]]) -> None:
        super().__init__()
        self._pos, self._reads_of = pos, reads_of

    def __missing__(self, r: str) -> list[tuple[int, tuple[str, int]]]:
        pos = self._pos
        found = self[r] = [(pos[read[0]], read) for read in self._reads_of[r]]
        return found


#: Per model DAG and host: its :class:`_Static`, with the tensors dict it was made from. The
#: schedule's search replays one model under many orders.
_STATICS: weakref.WeakKeyDictionary[Any, dict[Any, tuple[dict, _Static]]] = weakref.WeakKeyDictionary()


def _static(model: GraphModel, host_key: Any) -> _Static:
    per_host = _STATICS.setdefault(model.dag, {})
    hit = per_host.get(host_key)
    if hit is not None and hit[0] is model.tensors:
        return hit[1]
    dag = model.dag
    types = {op: data["type"] for op, data in dag.nodes(data=True)}
    # Buffer roots: an alias op's output i shares the buffer of its input i (in a topological order).
    root: dict[str, str] = {}
    for op in nx.topological_sort(dag):
        op_type = types[op]
        ins = model.inputs_of[op]
        alias = op_type in ALIAS_OP_TYPES and ins
        for i, t in enumerate(model.outputs_of[op]):
            src = (ins[i] if op_type == "IdentityN" and i < len(ins) else ins[0]) if alias else None
            root[t] = root[src] if src is not None else t
    tensors = []
    allocated = set()
    for name, t in model.tensors.items():
        r = root[name]
        on_device = host_key is None or device_key(dag.nodes[t.op]["device"]) != host_key
        nbytes = t.bytes if r == name and t.bytes and on_device else 0
        if nbytes:
            allocated.add(r)
        readers = [(c, i) for c, i in t.consumers if types[c] != "IdentityN"]
        tensors.append((r, t.op, readers, types[t.op] != "IdentityN", nbytes))
    forwarding = []
    for op in dag.nodes:
        k, allowed = _forwarding(types[op])
        outs = model.outputs_of[op]
        if allowed == () or len(outs) <= k:
            continue
        out = model.tensors[outs[k]]
        cands = []
        for i, tname in enumerate(model.inputs_of[op]):
            t = model.tensors[tname]
            r = root[tname]
            if (allowed is None or i in allowed) and t.bytes == out.bytes and t.dtype == out.dtype:
                if r in allocated and types[model.tensors[r].op] not in _NOT_FORWARDABLE:
                    cands.append((i, r))
        if cands:
            forwarding.append((op, cands))
    static = _Static(root, tensors, forwarding, _variable_writes(model, root, types))
    per_host[host_key] = (model.tensors, static)
    return static


def _seed_ordered_static(parent: GraphModel, child: GraphModel, orders: Sequence[Any], host_key: Any) -> None:
    """Cache the :class:`_Static` of ``child`` (``parent`` with the control edges of ``orders``,
    :func:`tflms.ir.graph.with_order_edges`) from ``parent``'s, where that is cached. An order is no
    data: buffers, reads and in-place outputs stay; only a variable write (rule 6) may now wait for
    a read that it did not wait for, through a path over one of the new edges ``after -> op``, i.e.
    from an ancestor of ``after`` to a descendant of ``op``. (For the schedule's search, which
    orders one step many times: deriving a ResNet50 step's writes afresh took 0.2-0.3 s here.)"""
    hit = _STATICS.get(parent.dag, {}).get(host_key)
    if hit is None or hit[0] is not parent.tensors or child.tensors is not parent.tensors:
        return
    static = hit[1]
    _, succ, _, _ = _ready_structure(child.dag)  # the executor's waits, the new edges included
    preds: dict[str, list[str]] = {op: [] for op in succ}
    for op, successors in succ.items():
        for c in successors:
            preds[c].append(op)
    # Per new edge: (what ``after`` waits for, what waits for ``op``), each with the op itself.
    paths = [
        (reach(preds.__getitem__, {o.after}) | {o.after}, reach(succ.__getitem__, {o.op}) | {o.op}) for o in orders
    ]
    writes = []
    for op, nbytes, handle, rvos in static.writes:
        waits = [before for before, after in paths if op in after]
        rvos = [(r, [c for c in free if not any(c in before for before in waits)]) for r, free in rvos]
        if any(free for _, free in rvos):
            writes.append((op, nbytes, handle, rvos))
    _STATICS.setdefault(child.dag, {})[host_key] = (child.tensors, dataclasses.replace(static, writes=writes))


#: Ops that update a variable in place. When a tensor read from the variable earlier is
#: still held, TensorFlow first copies the variable into a new buffer
#: (``PrepareToUpdateVariable`` in ``resource_variable_ops.cc``), which then is the variable.
VARIABLE_WRITE_TYPES = frozenset({"AssignSubVariableOp", "AssignAddVariableOp"})


def _variable_writes(
    model: GraphModel, root: dict[str, str], types: dict[str, str]
) -> list[tuple[str, int, str, list[tuple[str, list[str]]]]]:
    """The in-place variable writes of ``model``, with the reads of the same variable (see :class:`_Static`)."""
    view: dict[str, str] = {}  # tensor -> the ReadVariableOp whose value it is (through aliases)
    for op in nx.topological_sort(model.dag):
        op_type = types[op]
        ins = model.inputs_of[op]
        for i, t in enumerate(model.outputs_of[op]):
            if op_type == "ReadVariableOp":
                view[t] = op
            elif op_type in ALIAS_OP_TYPES and ins:
                src = ins[i] if op_type == "IdentityN" and i < len(ins) else ins[0]
                if src in view:
                    view[t] = view[src]
    readers: dict[str, list[str]] = {}
    for t, rvo in view.items():
        readers.setdefault(rvo, []).extend(c for c, _ in model.tensors[t].consumers if types[c] not in ALIAS_OP_TYPES)
    reads_of: dict[str, list[str]] = {}  # a variable's handle -> its ReadVariableOps
    for rvo in readers:
        reads_of.setdefault(root[model.inputs_of[rvo][0]], []).append(rvo)
    writes = [op for op in model.dag if types[op] in VARIABLE_WRITE_TYPES and len(model.inputs_of[op]) == 2]
    # Which of the reads' consumers each write waits for as the executor runs it (through IdentityN
    # ops, as ready_order): one bit per consumer, ORed along those edges in an order of them.
    bit = {c: 1 << i for i, c in enumerate(dict.fromkeys(c for cs in readers.values() for c in cs))}
    _, succ, _, _ = _ready_structure(model.dag)
    before: dict[str, int] = {}  # op -> the bits of the consumers it waits for
    for op in ready_order(model):
        before.setdefault(op, 0)
        mine = before[op] | bit.get(op, 0)
        for c in succ[op]:
            before[c] = before.get(c, 0) | mine
    out = []
    for op in writes:
        handle, value = model.inputs_of[op]
        nbytes = model.tensors[value].bytes
        waits = before[op]
        rvos = [(r, [c for c in readers[r] if c != op and not waits & bit[c]]) for r in reads_of.get(root[handle], [])]
        if nbytes and any(free for _, free in rvos):
            out.append((op, nbytes, root[handle], rvos))
    return out


class _Replay:
    """Rules 1-8 on one model as run (:class:`Simulator` picks the model for a set of swaps)."""

    def __init__(self, model: GraphModel, host: str | None, order: Sequence[str] | None) -> None:
        self.model = model
        self.order = list(order) if order is not None else ready_order(model)
        self.pos = pos = {op: i for i, op in enumerate(self.order)}
        n = len(self.order)
        static = _static(model, device_key(host) if host else None)
        self.root = static.root

        # Every buffer's allocation, reads (through any alias) and end, placed on the schedule in
        # numpy (the schedule's search replays one step under many orders).
        arrays = _arrays(static, model)
        at = np.full(len(arrays.ops), -1, dtype=np.int64)  # op index -> position
        at[[arrays.ops[op] for op in self.order]] = np.arange(n)
        n_roots = len(arrays.roots)
        start = at[arrays.alloc_op]
        start[arrays.is_argument] = 0
        first = np.full(n_roots, -1, dtype=np.int64)  # the buffer is live at least until here
        np.maximum.at(first, arrays.keep_root, at[arrays.keep_op])
        first[arrays.is_argument] = n + LAG
        # Per buffer its last read, and the one read there if no other read is within
        # CONCURRENT_READS positions of it (see _last_read): sorted by buffer, then position.
        read_at = at[arrays.read_op]
        by = np.lexsort((read_at, arrays.read_root))
        ends = np.flatnonzero(np.append(np.diff(arrays.read_root[by]) != 0, True)) if by.size else by
        last = np.full(n_roots, -1, dtype=np.int64)
        sole = np.full(n_roots, -1, dtype=np.int64)  # index of that read, -1 if none
        if ends.size:
            top = by[ends]
            groups = arrays.read_root[top]
            last[groups] = read_at[top]
            second = np.full(ends.size, -1, dtype=np.int64)
            shared = ends > 0
            shared[shared] = arrays.read_root[by[ends[shared] - 1]] == groups[shared]
            second[shared] = read_at[by[ends[shared] - 1]]
            # An alias op whose output the last read reads (a Reshape before a Softmax) has
            # finished before it: its read is not concurrent with it.
            via = np.zeros(ends.size, dtype=bool)
            via[shared] = arrays.read_op[by[ends[shared] - 1]] == arrays.read_via[top[shared]]
            second[via] = -1
            sole[groups] = np.where(second < read_at[top] - CONCURRENT_READS, top, -1)

        # In-place outputs: the read (op, input) whose buffer the op may reuse for its output.
        self.forwarding: set[tuple[str, int]] = set()
        forwarded = np.full(len(arrays.ops), -1, dtype=np.int64)  # op index -> the input it reuses
        read_op, read_index = arrays.read_op, arrays.read_index
        for op, cands in arrays.forwarding:
            if op not in pos:
                continue
            k = arrays.ops[op]
            mine = [i for i, r in cands if sole[r] >= 0 and read_op[sole[r]] == k and read_index[sole[r]] == i]
            i = (mine or [cands[0][0]])[0]
            self.forwarding.add((op, i))
            forwarded[k] = i
        # The outputs written in place (their roots): each takes the chunk its op's input hands on.
        types = model.dag.nodes
        self._in_place_outputs = {model.outputs_of[op][_forwarding(types[op]["type"])[0]] for op, _ in self.forwarding}
        # Freed right after the last read; *at* it when that read writes its output in place (_end).
        in_place = sole >= 0
        if in_place.any():
            read = sole[in_place]
            in_place[in_place] = forwarded[read_op[read]] == read_index[read]
        end = np.where(last <= first, first + 1, np.where(in_place, last, last + 1 + LAG))

        roots, starts, ends_at, sizes = arrays.roots, start.tolist(), end.tolist(), arrays.alloc_bytes.tolist()
        self.reads: dict[str, list[tuple[int, tuple[str, int]]]] = _Reads(pos, arrays.reads_of)
        self.alloc: dict[str, tuple[int, int]] = dict(zip(roots, zip(starts, sizes)))
        self.first: dict[str, int] = dict(zip(roots, first.tolist()))
        # end[r]: first schedule position where buffer r is no longer counted.
        self.end: dict[str, int] = dict(zip(roots, ends_at))
        # The buffers of the step without swaps, as :meth:`_spans` lists them (swaps replace a few).
        self._plain_spans = list(zip(starts, ends_at, sizes, (end == last).tolist(), roots, [-1] * n_roots))
        self._span_index = {r: k for k, r in enumerate(roots)}
        self.base = np.zeros(n + LAG + 2, dtype=np.int64)
        np.add.at(self.base, start, arrays.alloc_bytes)
        np.add.at(self.base, end, -arrays.alloc_bytes)
        self.peaks: dict[tuple[tuple[Swap, ...], int], int] = {}  # peak(): (swaps, steps) -> exact peak
        # Rule 6: a variable written while a value read from it before may still be held is
        # copied; the old buffer lives until its last read (counted here as the copy's bytes).
        self.copies: list[tuple[int, int, int, str, str]] = []  # (write, end, bytes, writer, handle)
        for op, nbytes, handle, rvos in static.writes:
            if op not in pos:
                continue
            w = pos[op]
            held = [pos[c] for rvo, readers in rvos if pos.get(rvo, n) < w for c in readers if c in pos]
            if held:
                end = max(w, *held) + 1 + LAG
                self.copies.append((w, end, nbytes, op, handle))
                self.base[w] += nbytes
                self.base[end] -= nbytes

    def _last_read(self, reads: Sequence[tuple[int, tuple[str, int]]]) -> tuple[str, int] | None:
        """The one read at the latest position, or None when there is none or several. A read by
        the alias op whose output the latest read reads (a Reshape before a Softmax) has finished
        before it: it is not concurrent with it."""
        best, second, who, before = -1, -1, None, None
        for q, read in reads:
            if q > best:
                best, second, who, before = q, best, read, who
            elif q > second:
                second, before = q, read
        if who is not None and before is not None and who[0] in self.pos and second < best:
            if self.model.inputs_of[who[0]][who[1]].rpartition(":")[0] == before[0]:
                return who
        return who if second < best - CONCURRENT_READS else None

    def _end(self, reads: Sequence[tuple[int, tuple[str, int]]], first: int) -> int:
        """End (exclusive) of a buffer live from at least ``first`` and read by ``reads``.

        Freed right after its last read; *at* it when that read writes its output in place.
        """
        last = max((q for q, _ in reads), default=-1)
        if last <= first:
            return first + 1
        return last if self._last_read(reads) in self.forwarding else last + 1 + LAG

    def _swapped_end(self, r: str, moved: set[tuple[str, int]], swap_out_pos: int) -> int:
        kept = [(q, read) for q, read in self.reads[r] if read not in moved]
        kept.append((swap_out_pos, ("", -1)))  # the swap-out (a send) reads it too
        return self._end(kept, max(self.first[r], swap_out_pos))

    def _swap_in_span(self, s: Swap, si: Any) -> tuple[int, int]:
        """(allocation position, end) of one swap-in's device buffer."""
        pos = self.pos
        p = pos[s.producer]
        start = max(pos[si.trigger], p) if si.trigger is not None else p
        return start, self._end([(pos[c], (c, i)) for c, i in si.consumers], start)

    def _swap_out_positions(self, swaps: Sequence[Swap]) -> dict[str, int]:
        """Per swapped buffer (its root): the position of its last swap-out, which reads it there."""
        positions: dict[str, int] = {}
        for s in swaps:
            r = self.root[s.tensor]
            positions[r] = max(positions.get(r, 0), self.pos[s.producer])
        return positions

    def _delta(self, swaps: Sequence[Swap]) -> np.ndarray:
        delta = self.base.copy()
        moved = {(c, i) for s in swaps for si in s.swap_ins for (c, i) in si.consumers}
        for r, swap_out_pos in self._swap_out_positions(swaps).items():
            if r not in self.alloc:
                continue
            nbytes = self.alloc[r][1]
            new_end, old_end = self._swapped_end(r, moved, swap_out_pos), self.end[r]
            if new_end != old_end:
                delta[old_end] += nbytes
                delta[new_end] -= nbytes
        for s in swaps:
            for si in s.swap_ins:
                start, end = self._swap_in_span(s, si)
                delta[start] += s.bytes
                delta[end] -= s.bytes
        return delta

    def _spans(self, swaps: Sequence[Swap]) -> list[tuple[int, int, int, bool, str, int]]:
        """Every device buffer as ``(allocated at, freed at, bytes, written in place at its end, tensor, k)``.

        ``swaps`` applied; in allocation order (a position's outputs in order, then its swap-ins).
        ``tensor`` owns the buffer; ``k`` is the swap-in's index, -1 for the tensor's own buffer.
        """
        pos = self.pos
        moved = {(c, i) for s in swaps for si in s.swap_ins for (c, i) in si.consumers}
        spans = list(self._plain_spans)
        for r, swap_out_pos in self._swap_out_positions(swaps).items():
            k = self._span_index.get(r)
            if k is None:
                continue
            p, nbytes = self.alloc[r]
            end = self._swapped_end(r, moved, swap_out_pos)
            last = max([q for q, read in self.reads[r] if read not in moved] + [swap_out_pos])
            spans[k] = (p, end, nbytes, end == last, r, -1)
        for s in swaps:
            for k, si in enumerate(s.swap_ins):
                start, end = self._swap_in_span(s, si)
                last = max(pos[c] for c, _ in si.consumers)
                spans.append((start, end, s.bytes, end == last, s.tensor, k))
        spans.sort(key=lambda span: span[0])  # stable
        return spans

    def _allocated(
        self, swaps: Sequence[Swap], steps: int = STEPS, stop: int | None = None, limit: int | None = None
    ) -> np.ndarray:
        """Device bytes in use (BFC chunk sizes, variables excluded) while each op runs.

        Rule 8 of the module doc: at each position the buffers that end there are
        freed, then the buffers that start there are allocated; a buffer that ends
        *at* a position by being written in place hands its chunk to the output
        allocated there; a variable copied by rule 6 gets a new chunk at its write, and
        its old chunk is freed at the copy's end. ``steps`` steps run one after the
        other on the same allocator: the timeline of the one with the highest peak (up to
        where it first exceeds ``stop``, if it does). ``limit``: the allocator's regions together
        stay within it (variables included), and a request it cannot place raises
        :class:`OutOfMemory` (see :meth:`Simulator.unplaced`).
        """
        n = len(self.order)
        spans = self._spans(swaps)
        copies = self.copies
        # (position, phase, index): per position, first the buffers that end (0) and the old
        # chunks of copied variables (1) are freed, then the new buffers (2) and copies (3) made.
        events = sorted(
            [(end, 0, k) for k, (_, end, *_) in enumerate(spans)]
            + [(start, 2, k) for k, (start, *_) in enumerate(spans)]
            + [(end, 1, k) for k, (_, end, *_) in enumerate(copies)]
            + [(w, 3, k) for k, (w, *_) in enumerate(copies)]
        )
        events.append((n + LAG + 2, 0, -1))  # a last position, past every event
        rounded = [_rounded(span[2]) for span in spans]
        if limit is not None:  # in the peak's currency: the variables count at their bytes, not their chunks'
            chunks = [_rounded(nbytes) for _, nbytes in self.model.variables] or [_rounded(self.model.variable_bytes)]
            limit = _rounded(limit + sum(chunks) - self.model.variable_bytes)
        if self.model.variables:
            bfc = _BFC(limit=limit)
            chunk_of = {}
            for handle, nbytes in self.model.variables:
                chunk_of[handle or object()] = bfc.alloc(nbytes)
            resident = bfc.in_use
        else:
            bfc, chunk_of, resident = _BFC(self.model.variable_bytes, limit), {}, 0
        alloc, release, size = bfc.alloc, bfc.release, bfc.size
        in_place_outputs = self._in_place_outputs
        best = np.zeros(n, dtype=np.int64)
        state = None  # the allocator's state after the previous step
        for _ in range(steps):
            addr = [0] * len(spans)
            released = [0] * len(copies)  # per copy: the chunk freed at its end
            marks: list[int] = []  # positions (< n) with events, and the bytes in use after them
            values: list[int] = []
            held = bfc.in_use - resident  # before the step's first event
            handed: list[int] = []
            current = events[0][0]
            for p, phase, k in events:
                if p != current:  # the position before is done
                    for chunk in handed:
                        release(chunk)
                    handed = []
                    if current < n:
                        marks.append(current)
                        values.append(bfc.in_use - resident)
                        if stop is not None and values[-1] > stop:
                            break
                    current = p
                if k < 0:
                    break
                if phase == 0:
                    if spans[k][3]:
                        handed.append(addr[k])
                    else:
                        release(addr[k])
                elif phase == 1:
                    release(released[k])
                elif phase == 2:
                    takes = spans[k][5] < 0 and spans[k][4] in in_place_outputs
                    chunk = handed.pop(0) if handed and takes else None
                    if chunk is not None and size[chunk] < rounded[k]:
                        release(chunk)
                        chunk = None
                    addr[k] = alloc(spans[k][2]) if chunk is None else chunk
                else:
                    _, _, nbytes, _, handle = copies[k]
                    new = alloc(nbytes)
                    released[k] = chunk_of.get(handle, new)
                    if handle in chunk_of:
                        chunk_of[handle] = new
            # Each position holds what the last position with events left.
            filled = np.zeros(n, dtype=np.int64)
            filled[marks] = np.arange(1, len(marks) + 1)
            timeline = np.array([held, *values], dtype=np.int64)[np.maximum.accumulate(filled)]
            if stop is not None and marks and values[-1] > stop:
                return timeline
            if timeline.max(initial=0) > best.max(initial=0):
                best = timeline
            # A step that left the allocator as it found it is repeated exactly by the next ones.
            after = (
                tuple(bfc.free),
                tuple(sorted(bfc.size.items())),
                tuple(sorted(bfc.used.items())),
                tuple(chunk_of.values()),
                bfc.next_region,
            )
            if after == state:
                break
            state = after
        return best

    def live(self, position: int, swaps: Sequence[Swap] = ()) -> list[tuple[str, int]]:
        """See :meth:`Simulator.live`; ``position`` in ``self.order``."""
        if not 0 <= position < len(self.order):
            raise ValueError(f"position must be in [0, {len(self.order)}). Received: position={position!r}")
        found = [
            (name if k < 0 else f"{name} (swap-in {k})", nbytes)
            for start, end, nbytes, _, name, k in self._spans(swaps)
            if start <= position < end
        ]
        found += [
            (f"{handle} (copied by {op})", nbytes) for w, end, nbytes, op, handle in self.copies if w <= position < end
        ]
        return sorted(found, key=lambda item: (-item[1], item[0]))

    def prefix_peaks(self, swaps: Sequence[Swap]) -> np.ndarray:
        """See :meth:`Simulator.prefix_peaks`: one swap's effect on the allocation deltas is local."""
        pos, n_ops = self.pos, len(self.order)
        delta = self.base.copy()
        end = dict(self.end)
        moved: set[tuple[str, int]] = set()
        swap_out_pos: dict[str, int] = {}
        peaks = np.empty(len(swaps) + 1, dtype=np.int64)
        peaks[0] = np.cumsum(delta[:n_ops]).max(initial=0)
        for k, s in enumerate(swaps):
            p = pos[s.producer]
            moved.update(c for si in s.swap_ins for c in si.consumers)
            r = self.root[s.tensor]
            swap_out_pos[r] = max(swap_out_pos.get(r, 0), p)
            if r in self.alloc:
                nbytes = self.alloc[r][1]
                new_end = self._swapped_end(r, moved, swap_out_pos[r])
                if new_end != end[r]:
                    delta[end[r]] += nbytes
                    delta[new_end] -= nbytes
                    end[r] = new_end
            for si in s.swap_ins:
                start, stop = self._swap_in_span(s, si)
                delta[start] += s.bytes
                delta[stop] -= s.bytes
            peaks[k + 1] = np.cumsum(delta[:n_ops]).max(initial=0)
        return peaks + self.model.variable_bytes

    def requested(self, swaps: Sequence[Swap] = ()) -> np.ndarray:
        """Requested bytes (rules 1-7, variables excluded) while each op of ``self.order`` runs."""
        return np.cumsum(self._delta(swaps)[: len(self.order)])

    def requested_peak(self, swaps: Sequence[Swap] = ()) -> int:
        return int(self.requested(swaps).max(initial=0)) + self.model.variable_bytes

    def peak(self, swaps: Sequence[Swap], steps: int, above: int | None = None) -> int:
        key = (tuple(swaps), steps)
        known = self.peaks.get(key)
        if known is not None:
            return known
        stop = None if above is None else above - self.model.variable_bytes
        peak = int(self._allocated(swaps, steps, stop).max(initial=0)) + self.model.variable_bytes
        if above is None or peak <= above:  # exact (a stopped emulation returns less than the peak)
            self.peaks[key] = peak
        return peak

    def unplaced(self, swaps: Sequence[Swap], limit: int) -> int | None:
        """See :meth:`Simulator.unplaced`."""
        key = (tuple(swaps), -limit)  # the limited runs share the peaks' cache: (swaps, -limit) -> result
        if key not in self.peaks:
            try:
                self._allocated(swaps, STEPS, limit=limit)
                self.peaks[key] = -1
            except OutOfMemory as err:
                self.peaks[key] = err.nbytes
        found = self.peaks[key]
        return None if found < 0 else found

    def floor(self) -> tuple[int, str | None]:
        """See :meth:`Simulator.floor`."""
        types = self.model.dag.nodes
        in_place = {op for op, _ in self.forwarding}
        best, who = 0, None
        for op in self.order:
            if types[op]["type"] == "IdentityN":
                continue
            outs = self.model.outputs_of[op]
            roots = {self.root[t] for t in (*self.model.inputs_of[op], *outs)} & self.alloc.keys()
            written = outs[_forwarding(types[op]["type"])[0]] if op in in_place else None
            if written in self.alloc:
                roots.discard(written)
            nbytes = sum(self.alloc[r][1] for r in roots)
            if nbytes > best:
                best, who = nbytes, op
        return best + self.model.variable_bytes, who

    def profile(self, swaps: Sequence[Swap] = ()) -> MemoryProfile:
        n = len(self.order)
        timeline = self._allocated(swaps)
        if n:
            k = int(np.argmax(timeline))
            peak, peak_op = int(timeline[k]), self.order[k]
        else:
            peak, peak_op = 0, None
        return MemoryProfile(
            schedule=tuple(self.order),
            timeline=timeline,
            variable_bytes=self.model.variable_bytes,
            peak_bytes=peak + self.model.variable_bytes,
            peak_op=peak_op,
            swap_out_steps=tuple(self.pos[s.producer] for s in swaps),
            swap_in_steps=tuple(self._swap_in_span(s, si)[0] for s in swaps for si in s.swap_ins),
            requested=np.cumsum(self._delta(swaps)[:n]),
        )
