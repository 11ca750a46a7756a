"""Predicted step time of a plan: a compute stream and one copy engine per direction.

Pure (no TensorFlow): a :class:`~tflms.ir.graph.GraphModel`, the swaps of a plan, each op's
compute seconds (:func:`tflms.emulate.costs.op_seconds`) and a :class:`Link` give a
:class:`Timeline`: when each op starts and ends, when each transfer starts and lands, and the
step's time. The execution model:

1. One compute stream runs the ops one at a time in ``order`` (default: the executor's
   order, :func:`tflms.emulate.order.ready_order`). An op starts when the stream is free and
   the ops it depends on have ended: its data inputs' producers (an ``IdentityN`` passes its
   inputs on: its consumers wait for the ops that made them, as Grappler removes it) and its
   control inputs. With ``streams=k`` (a CPU's executor runs ops on several inter-op threads),
   each op in ``order`` goes to the stream that is free first.
2. A swap-out is a transfer on the device-to-host engine, requested when its producer ends;
   a swap-in is a transfer on the host-to-device engine, requested when its trigger has ended
   and its swap-out has landed (with no trigger: when the swap-out has landed). Each engine
   moves one transfer at a time, in the order requested, taking
   ``link.latency + bytes / bandwidth`` of its direction.
3. An op fed by a swap-in starts no earlier than the swap-in lands; an op with a fence
   (:class:`tflms.ir.decisions.Fence`) no earlier than the fence's swap-out lands. The compute
   stream waits meanwhile: the difference is the op's stall.
4. The step ends when the last op has ended and the last transfer has landed.

So a swap whose transfers fit in the compute between its producer and the consumer costs
nothing, and one that does not delays the consumer by the difference. Grappler's memory
optimizer chooses swap-in triggers the same way: the time the consumer needs the tensor
minus the transfer time (:func:`timed_trigger_time`).

Example: a swap whose round trip (2 x 1 ms) fits in 4 ms of compute costs nothing; with a
link ten times slower, the consumer waits 16 ms:

    >>> from tflms.ir.graph import GraphModel
    >>> from tflms.ir.decisions import Swap, SwapIn
    >>> f32 = ("float32", (250, 1000), 10**6, False)
    >>> ops = [{"name": n, "type": "Relu", "inputs": i, "outputs": [f32]} for n, i in (
    ...     ("a", []), ("b", ["a:0"]), ("c", ["b:0"]), ("gradient_tape/d", ["c:0", "a:0"]))]
    >>> model = GraphModel.from_ops(ops)
    >>> swap = Swap("a:0", "a", "Relu", "float32", (250, 1000), 10**6, 0, 3,
    ...             (SwapIn((("gradient_tape/d", 1),), None, 3, None),))
    >>> times = {"a": 1e-3, "b": 2e-3, "c": 2e-3, "gradient_tape/d": 1e-3}
    >>> fast, slow = Link(1e9, 1e9, 0.0), Link(1e8, 1e8, 0.0)
    >>> round(timeline(model, times).step_seconds * 1e3, 6)
    6.0
    >>> round(timeline(model, times, [swap], fast).step_seconds * 1e3, 6)
    6.0
    >>> round(timeline(model, times, [swap], slow).stall_seconds * 1e3, 6)
    16.0
"""

from __future__ import annotations

import dataclasses
import heapq
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, NamedTuple

from ..ir.graph import GraphModel
from .costs import check_number

if TYPE_CHECKING:
    from ..ir.decisions import Fence, Swap

__all__ = ["Link", "Transfer", "Timeline", "TimelineModel", "timeline", "timed_trigger_time"]


@dataclasses.dataclass(frozen=True)
class Link:
    """The device-host link: bytes per second each way, and seconds per transfer.

    >>> Link(to_host=25e9, to_device=25e9, latency=10e-6).seconds(25 * 10**6, "to_device")
    0.00101
    >>> Link(0, 1, 0)
    Traceback (most recent call last):
    ...
    ValueError: to_host must be bytes per second > 0. Received: to_host=0
    """

    to_host: float
    to_device: float
    latency: float = 0.0

    def __post_init__(self) -> None:
        for name in ("to_host", "to_device"):
            check_number(name, getattr(self, name), "bytes per second > 0")
        check_number("latency", self.latency, "seconds >= 0", strict=False)

    def seconds(self, nbytes: int, direction: str) -> float:
        """Time of one transfer of ``nbytes`` ``'to_host'`` or ``'to_device'``."""
        if direction not in ("to_host", "to_device"):
            raise ValueError(f"direction must be 'to_host' or 'to_device'. Received: direction={direction!r}")
        return self.latency + nbytes / getattr(self, direction)


@dataclasses.dataclass(frozen=True)
class Transfer:
    """One transfer of the timeline: a swap-out (``swap_in`` is ``None``) or swap-in ``swap_in``
    of ``tensor``; requested at ``requested``, on its engine from ``start`` to ``end`` (landed)."""

    tensor: str
    swap_in: int | None
    bytes: int
    requested: float
    start: float
    end: float


@dataclasses.dataclass(frozen=True)
class Timeline:
    """When each op ran and each transfer moved, in seconds from the step's start (module doc).

    ``start``/``end``: per op; ``stall``: per op that waited for a transfer, how long the
    compute stream waited for it; ``transfers``: swap-outs then swap-ins, each in its
    engine's order."""

    start: Mapping[str, float]
    end: Mapping[str, float]
    stall: Mapping[str, float]
    transfers: tuple[Transfer, ...]
    compute_seconds: float

    @property
    def step_seconds(self) -> float:
        """The step's predicted time: until the last op has ended and the last transfer landed."""
        last_op = max(self.end.values(), default=0.0)
        return max(last_op, max((t.end for t in self.transfers), default=0.0))

    @property
    def stall_seconds(self) -> float:
        """Total time the compute stream waited for transfers."""
        return sum(self.stall.values())

    def landed(self, tensor: str, swap_in: int | None = 0) -> float:
        """When swap-in ``swap_in`` of ``tensor`` landed on the device (``None``: its swap-out on the host)."""
        for t in self.transfers:
            if t.tensor == tensor and t.swap_in == swap_in:
                return t.end
        raise KeyError(f"no transfer of {tensor!r} (swap-in {swap_in!r}) in this timeline")


class TimelineModel:
    """:func:`timeline` precomputed for one step and one set of op times: the structure
    (order, dependencies) is built once, and :meth:`run` times any plan on it in O(ops +
    edges). For searches that time many plans of one step (:mod:`tflms.plan.autotune`)."""

    def __init__(
        self, model: GraphModel, seconds: Mapping[str, float], order: Sequence[str] | None = None, streams: int = 1
    ) -> None:
        if isinstance(streams, bool) or not isinstance(streams, int) or streams < 1:
            raise ValueError(f"streams must be an integer >= 1. Received: streams={streams!r}")
        self.streams = streams
        if order is None:
            from .order import ready_order

            order = ready_order(model)
        missing = [op for op in model.dag if op not in seconds]
        if missing:
            raise ValueError(
                f"seconds must give every op's compute time; {len(missing)} ops have none, e.g. {missing[:3]}. "
                f"Use tflms.emulate.costs.op_seconds(model, profile). Received: {len(seconds)} op times"
            )
        if sorted(order) != sorted(model.dag):
            raise ValueError(f"order must list every op of the model once. Received: order of {len(order)} ops")
        self.model = model
        self.order = list(order)
        index = {op: i for i, op in enumerate(self.order)}
        self._index = index
        dag = model.dag
        deps: list[tuple[int, ...]] = []
        for op in self.order:
            found = set()
            for name in model.inputs_of[op]:
                found.add(self._source(name))
            found.update(p for p in dag.predecessors(op) if dag.edges[p, op]["control"])
            found.discard(op)
            deps.append(tuple(sorted(index[p] for p in found)))
        self._deps = deps
        self._seconds = [float(seconds[op]) for op in self.order]
        self._plain_start: Mapping[str, float] | None = None
        self.compute_seconds = sum(self._seconds)

    def _source(self, tensor: str) -> str:
        """The op whose output ``tensor`` is as run: an ``IdentityN`` passes on its input."""
        model = self.model
        op, index = tensor.rsplit(":", 1)
        while model.dag.nodes[op]["type"] == "IdentityN" and int(index) < len(model.inputs_of[op]):
            op, index = model.inputs_of[op][int(index)].rsplit(":", 1)
        return op

    def run(
        self,
        swaps: Sequence[Swap] = (),
        link: Link | None = None,
        fences: Sequence[Fence] = (),
        *,
        in_time: bool = False,
    ) -> Timeline:
        """The :class:`Timeline` of ``swaps`` (and ``fences``) over ``link`` on this step.

        ``in_time``: ignore the swap-ins' triggers and request each swap-in as its swap-out
        has landed but no earlier than its first consumer's start in the plain step minus its
        transfer time (:func:`timed_trigger_time`): the step time the plan's swaps cost with
        triggers chosen on the timeline, for searches that choose the triggers afterwards."""
        if swaps and link is None:
            raise ValueError("a timeline with swaps needs a link. Received: link=None")
        if in_time and self._plain_start is None:
            self._plain_start = self.run().start
        order = self.order
        n = len(order)
        start = [0.0] * n
        end = [0.0] * n
        stall = {}
        outs_at, ins_at, untriggered, needs, waits_out, not_before = self._events(swaps, fences, link, in_time)
        engines = _Engines(swaps, link)
        in_done, out_done = engines.in_done, engines.out_done
        free = [0.0] * self.streams  # when each compute stream is free
        for i in range(n):
            lane = min(range(len(free)), key=free.__getitem__)
            ready = free[lane]
            for d in self._deps[i]:
                if end[d] > ready:
                    ready = end[d]
            waited = ready
            for key in needs.get(i, ()):
                if key not in in_done:
                    engines.land_until(key)
                if in_done[key] > waited:
                    waited = in_done[key]
            for k in waits_out.get(i, ()):
                waited = max(waited, out_done.get(k, 0.0))
            if waited > ready:
                stall[order[i]] = waited - ready
            start[i] = waited
            end[i] = free[lane] = waited + self._seconds[i]
            for k in outs_at.get(i, ()):
                landed = engines.swap_out(k, end[i])
                for kj in untriggered.get(k, ()):
                    engines.request_in(*kj, max(landed, not_before.get(kj, 0.0)))
            for k, j in ins_at.get(i, ()):
                if k not in out_done:
                    raise ValueError(
                        f"the swap-in of {swaps[k].tensor!r} is triggered by {order[i]!r}, which runs before the "
                        f"tensor's producer {swaps[k].producer!r}: check the plan's triggers"
                    )
                engines.request_in(k, j, max(end[i], out_done[k]))
        engines.land_until(None)
        return Timeline(
            start=dict(zip(order, start)),
            end=dict(zip(order, end)),
            stall=stall,
            transfers=tuple(engines.transfers_out + engines.transfers_in),
            compute_seconds=self.compute_seconds,
        )

    def _events(self, swaps: Sequence[Swap], fences: Sequence[Fence], link: Link | None, in_time: bool) -> _Events:
        """What each op position of :meth:`run` does besides computing (see :class:`_Events`)."""
        index = self._index
        events = _Events({}, {}, {}, {}, {}, {})
        outs_at, ins_at, untriggered, needs = events.outs_at, events.ins_at, events.untriggered, events.needs
        for k, s in enumerate(swaps):
            outs_at.setdefault(index[s.producer], []).append(k)
            for j, si in enumerate(s.swap_ins):
                if in_time:
                    first = min(self._plain_start[c] for c, _ in si.consumers)  # type: ignore[index]
                    events.not_before[(k, j)] = first - link.seconds(s.bytes, "to_device")  # type: ignore[union-attr]
                    untriggered.setdefault(k, []).append((k, j))
                elif si.trigger is None:
                    untriggered.setdefault(k, []).append((k, j))
                else:
                    ins_at.setdefault(index[si.trigger], []).append((k, j))
                for c, _ in si.consumers:
                    needs.setdefault(index[c], []).append((k, j))
        by_tensor = {s.tensor: k for k, s in enumerate(swaps)}
        for f in fences:
            events.waits_out.setdefault(index[f.op], []).append(by_tensor[f.tensor])
        return events


class _Events(NamedTuple):
    """What each op position of :meth:`TimelineModel.run` does besides computing (positions and
    swaps are indices into the order and the swaps; a swap-in is ``(swap, swap-in)``)."""

    outs_at: dict[int, list[int]]  # producer -> swaps whose swap-out it requests
    ins_at: dict[int, list[tuple[int, int]]]  # trigger -> swap-ins it requests
    untriggered: dict[int, list[tuple[int, int]]]  # swap index -> swap-ins requested at its landing
    needs: dict[int, list[tuple[int, int]]]  # consumer -> swap-ins it reads
    waits_out: dict[int, list[int]]  # fenced op -> swap-outs it waits for
    not_before: dict[tuple[int, int], float]  # with in_time: per swap-in, no request before this


class _Engines:
    """The copy engines of one :meth:`TimelineModel.run`: swap-outs over the device-to-host engine
    as their producers end, swap-ins over the host-to-device engine in the order requested."""

    def __init__(self, swaps: Sequence[Swap], link: Link | None) -> None:
        self.swaps, self.link = swaps, link
        self.out_done: dict[int, float] = {}
        self.in_done: dict[tuple[int, int], float] = {}
        self.pending: list[tuple[float, int, int, int]] = []  # (requested, sequence, swap, swap-in): the h2d queue
        self.seq = 0
        self.d2h_free = self.h2d_free = 0.0
        self.transfers_out: list[Transfer] = []
        self.transfers_in: list[Transfer] = []

    def swap_out(self, k: int, at: float) -> float:
        """Move swap ``k``'s swap-out, requested at ``at``, over the device-to-host engine; when it landed."""
        s = self.swaps[k]
        begin = max(at, self.d2h_free)
        self.d2h_free = self.out_done[k] = begin + self.link.seconds(s.bytes, "to_host")  # type: ignore[union-attr]
        self.transfers_out.append(Transfer(s.tensor, None, s.bytes, at, begin, self.d2h_free))
        return self.d2h_free

    def request_in(self, k: int, j: int, at: float) -> None:
        """Queue swap-in ``j`` of swap ``k``, requested at ``at``."""
        heapq.heappush(self.pending, (at, self.seq, k, j))
        self.seq += 1

    def land_until(self, key: tuple[int, int] | None) -> None:
        """Move queued swap-ins over the host-to-device engine, in the order requested,
        until ``key`` has landed (``None``: all of them)."""
        pending, in_done = self.pending, self.in_done
        while pending and (key is None or key not in in_done):
            at, _, k, j = heapq.heappop(pending)
            s = self.swaps[k]
            begin = max(at, self.h2d_free)
            self.h2d_free = begin + self.link.seconds(s.bytes, "to_device")  # type: ignore[union-attr]
            in_done[(k, j)] = self.h2d_free
            self.transfers_in.append(Transfer(s.tensor, j, s.bytes, at, begin, self.h2d_free))


def timeline(
    model: GraphModel,
    seconds: Mapping[str, float],
    swaps: Sequence[Swap] = (),
    link: Link | None = None,
    *,
    order: Sequence[str] | None = None,
    fences: Sequence[Fence] = (),
    streams: int = 1,
) -> Timeline:
    """The :class:`Timeline` of ``swaps`` on ``model`` (module doc): ``seconds`` gives each op's
    compute time (:func:`tflms.emulate.costs.op_seconds`), ``link`` the transfers' (needed when
    there are swaps), ``order`` the compute stream's order (default: the executor's), ``streams``
    how many compute streams run it (1: a GPU's)."""
    return TimelineModel(model, seconds, order, streams).run(swaps, link, fences)


def timed_trigger_time(plain: Timeline, consumer: str, nbytes: int, link: Link) -> float:
    """When a swap-in of ``nbytes`` for ``consumer`` must be requested so that it lands as the
    consumer starts in the ``plain`` timeline: the consumer's start minus the transfer time
    (Grappler's memory optimizer's rule). The trigger is then the op that ends last by then."""
    return plain.start[consumer] - link.seconds(nbytes, "to_device")
