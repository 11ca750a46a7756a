"""Predicted device memory of a step, before and after a swap plan.

Execution model (documented in the README; every number the simulator reports
follows from it):

1. Ops run one at a time in :meth:`GraphModel.schedule` order: by topological
   level, ties by name.
2. Each output of an op on the device is allocated when the op runs, with its
   static size (:func:`tflms.graph.estimate_bytes` for unknown dimensions).
   Outputs of op types in :data:`tflms.graph.ALIAS_OP_TYPES` (``Identity``,
   ``Reshape``, ``ReadVariableOp``...) share their input's buffer and allocate nothing.
3. A buffer is freed right after the last op that reads it (or any alias of it);
   a tensor nobody reads is freed right after its producer.
4. Ops placed on the host (their device string names the plan's ``host``) allocate
   no device memory.
5. Variables (model weights and optimizer slots captured by the step) are always
   resident: ``variable_bytes`` is added to every step.
6. With a plan: the far consumers of a swapped tensor no longer read the device
   copy; the swap-out reads it right after its producer (so the device copy is
   freed after its last *near* consumer). Each swap-in allocates the tensor's
   bytes when its trigger runs (when it has none: right after the producer) and
   frees them after the last consumer it feeds. Transfer time is not modelled:
   a swap-in is assumed to finish before its first consumer.

Example on a hand-built graph (see ``tests/test_simulator.py`` for more):

    >>> from tflms.graph import GraphModel
    >>> f32 = lambda n: ("float32", (n,), 4 * n, False)
    >>> ops = [
    ...     {"name": "a", "type": "Relu", "inputs": [], "outputs": [f32(100)]},
    ...     {"name": "b", "type": "Relu", "inputs": ["a:0"], "outputs": [f32(10)]},
    ...     {"name": "c", "type": "Add", "inputs": ["a:0", "b:0"], "outputs": [f32(1)]},
    ... ]
    >>> simulate(GraphModel.from_ops(ops)).peak_bytes
    444
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import numpy as np

from .graph import ALIAS_OP_TYPES, GraphModel
from .plan import Swap

__all__ = ["MemoryProfile", "Simulator", "simulate"]


@dataclasses.dataclass(frozen=True)
class MemoryProfile:
    """Result of :func:`simulate`.

    ``timeline[i]`` is the predicted device memory (bytes, variables excluded)
    while ``schedule[i]`` runs; ``peak_bytes`` includes ``variable_bytes``.
    ``swap_out_steps``/``swap_in_steps`` are schedule positions, for plotting.
    """

    schedule: tuple[str, ...]
    timeline: np.ndarray
    variable_bytes: int
    peak_bytes: int
    peak_op: str | None
    swap_out_steps: tuple[int, ...] = ()
    swap_in_steps: tuple[int, ...] = ()


def _device_key(device: str) -> tuple[str, str] | None:
    """('CPU', '0') for '/job:x/.../device:CPU:0' or '/device:CPU:0'; None if unplaced."""
    if not device:
        return None
    parts = device.upper().split(":")
    return (parts[-2].rsplit("/", 1)[-1], parts[-1]) if len(parts) >= 2 else None


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

    The plain step's allocations are computed once; :meth:`peak` and
    :meth:`profile` then apply a set of swaps as adjustments, so evaluating a plan
    costs O(ops) in numpy plus O(reads of the swapped buffers) in Python.
    """

    def __init__(self, model: GraphModel, host: str | None = None) -> None:
        dag = model.dag
        self.model = model
        self.order = model.schedule()
        self.pos = pos = {op: i for i, op in enumerate(self.order)}
        n = len(self.order)
        host_key = _device_key(host) if host else None

        # Buffer roots: an alias op's output i shares the buffer of its input i.
        root: dict[str, str] = {}
        for op in self.order:
            op_type = dag.nodes[op]["type"]
            ins = model.inputs_of[op]
            alias = op_type in ALIAS_OP_TYPES and ins
            for i, t in enumerate(model.outputs_of[op]):
                src = (ins[i] if op_type == "IdentityN" and i < len(ins) else ins[0]) if alias else None
                root[t] = root[src] if src is not None else t
        self.root = root

        # Every read of a buffer (through any alias): (position, (consumer, input index)).
        self.reads: dict[str, list[tuple[int, tuple[str, int]]]] = {}
        self.alloc: dict[str, tuple[int, int]] = {}
        self.free: dict[str, int] = {}
        for name, t in model.tensors.items():
            r = root[name]
            p = pos[t.op]
            reads = self.reads.setdefault(r, [])
            reads.extend((pos[c], (c, i)) for c, i in t.consumers)
            self.free[r] = max(self.free.get(r, p), p)  # an alias op's own position counts
            on_device = host_key is None or _device_key(dag.nodes[t.op]["device"]) != host_key
            if r == name and t.bytes and on_device:
                self.alloc[r] = (p, t.bytes)
        for r, reads in self.reads.items():
            if reads:
                self.free[r] = max(self.free[r], max(q for q, _ in reads))
        self.base = np.zeros(n + 1, dtype=np.int64)
        for r, (p, nbytes) in self.alloc.items():
            self.base[p] += nbytes
            self.base[self.free[r] + 1] -= nbytes

    def _delta(self, swaps: Sequence[Swap]) -> np.ndarray:
        pos = self.pos
        delta = self.base.copy()
        moved = {(c, i) for s in swaps for si in s.swap_ins for (c, i) in si.consumers}
        earliest: dict[str, int] = {}
        for s in swaps:
            r = self.root[s.tensor]
            earliest[r] = max(earliest.get(r, 0), pos[s.producer])  # the swap-out reads it there
        for r, swap_out_pos in earliest.items():
            if r not in self.alloc:
                continue
            p, nbytes = self.alloc[r]
            new_free = max([p, swap_out_pos] + [q for q, read in self.reads[r] if read not in moved])
            old_free = self.free[r]
            if new_free != old_free:
                delta[old_free + 1] += nbytes
                delta[new_free + 1] -= nbytes
        for s in swaps:
            p = pos[s.producer]
            for si in s.swap_ins:
                start = max(pos[si.trigger], p) if si.trigger is not None else p
                delta[start] += s.bytes
                delta[max(pos[c] for c, _ in si.consumers) + 1] -= s.bytes
        return delta

    def prefix_peaks(self, swaps: Sequence[Swap]) -> np.ndarray:
        """Predicted peaks (variables included) of ``swaps[:n]`` for every n = 0..len(swaps).

        Built incrementally (one swap's effect on the allocation deltas is local),
        so the whole array costs about len(swaps) cumulative sums.
        """
        pos, n_ops = self.pos, len(self.order)
        delta = self.base.copy()
        free = dict(self.free)
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
                start, nbytes = self.alloc[r]
                new_free = max([start, swap_out_pos[r]] + [q for q, read in self.reads[r] if read not in moved])
                if new_free != free[r]:
                    delta[free[r] + 1] += nbytes
                    delta[new_free + 1] -= nbytes
                    free[r] = new_free
            for si in s.swap_ins:
                begin = max(pos[si.trigger], p) if si.trigger is not None else p
                delta[begin] += s.bytes
                delta[max(pos[c] for c, _ in si.consumers) + 1] -= s.bytes
            peaks[k + 1] = np.cumsum(delta[:n_ops]).max(initial=0)
        return peaks + self.model.variable_bytes

    def peak(self, swaps: Sequence[Swap] = ()) -> int:
        """Predicted peak bytes (variables included) with ``swaps`` applied."""
        n = len(self.order)
        return int(np.cumsum(self._delta(swaps)[:n]).max(initial=0)) + self.model.variable_bytes

    def profile(self, swaps: Sequence[Swap] = ()) -> MemoryProfile:
        """The whole predicted timeline with ``swaps`` applied."""
        n = len(self.order)
        timeline = np.cumsum(self._delta(swaps)[:n])
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
            swap_in_steps=tuple(
                max(self.pos[si.trigger], self.pos[s.producer]) if si.trigger is not None else self.pos[s.producer]
                for s in swaps
                for si in s.swap_ins
            ),
        )
