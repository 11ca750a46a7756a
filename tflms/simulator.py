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

__all__ = ["MemoryProfile", "simulate"]


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
    """
    dag = model.dag
    order = model.schedule()
    pos = {op: i for i, op in enumerate(order)}
    n = len(order)
    host_key = _device_key(host) if host else None

    # Buffer roots: an alias op's output i shares the buffer of its input i.
    root: dict[str, str] = {}
    for op in order:
        node = dag.nodes[op]
        is_alias = node["type"] in ALIAS_OP_TYPES
        ins = model.inputs_of[op]
        for i, t in enumerate(model.outputs_of[op]):
            src = None
            if is_alias and ins:
                src = ins[i] if node["type"] == "IdentityN" and i < len(ins) else ins[0]
            root[t] = root[src] if src is not None else t

    moved = {(c, i) for s in swaps for si in s.swap_ins for (c, i) in si.consumers}
    free_at: dict[str, int] = {}
    alloc: dict[str, tuple[int, int]] = {}
    for name, t in model.tensors.items():
        r = root[name]
        p = pos[t.op]
        last = max((pos[c] for c, i in t.consumers if (c, i) not in moved), default=p)
        free_at[r] = max(free_at.get(r, p), last, p)
        on_device = host_key is None or _device_key(dag.nodes[t.op]["device"]) != host_key
        if r == name and t.bytes and on_device:
            alloc[r] = (p, t.bytes)

    delta = np.zeros(n + 1, dtype=np.int64)
    for r, (p, nbytes) in alloc.items():
        delta[p] += nbytes
        delta[free_at[r] + 1] -= nbytes

    out_steps, in_steps = [], []
    for s in swaps:
        p = pos[s.producer]
        out_steps.append(p)
        for si in s.swap_ins:
            start = max(pos[si.trigger], p) if si.trigger is not None else p
            end = max(pos[c] for c, _ in si.consumers)
            delta[start] += s.bytes
            delta[end + 1] -= s.bytes
            in_steps.append(start)

    timeline = np.cumsum(delta[:n])
    if n:
        k = int(np.argmax(timeline))
        peak, peak_op = int(timeline[k]), order[k]
    else:
        peak, peak_op = 0, None
    return MemoryProfile(
        schedule=tuple(order),
        timeline=timeline,
        variable_bytes=model.variable_bytes,
        peak_bytes=peak + model.variable_bytes,
        peak_op=peak_op,
        swap_out_steps=tuple(out_steps),
        swap_in_steps=tuple(in_steps),
    )
