"""One emulated run of a step: the executor's order, buffers freed after their last read, swaps,
the allocator (rules of :mod:`tflms.emulate.simulator`)."""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from .._devices import device_key
from ..ir.graph import GraphModel
from .bfc import BFCAllocator, OutOfMemory, _rounded
from .order import ready_order
from .static import _arrays, _forwarding, _Reads, static_of

if TYPE_CHECKING:
    from ..ir.decisions import Swap

__all__ = ["STEPS", "MemoryProfile"]


#: A read this close (in schedule positions) before the last one may still be running
#: when the last starts (the executor runs ready siblings side by side): no reuse then.
CONCURRENT_READS = 1


#: Ops in flight besides the current one: a buffer is freed this many positions
#: after its last read (2 inter-op threads: the next op may still hold its inputs).
LAG = 1


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


#: Steps the allocator emulation (rule 8) runs one after the other. The chunks a step gets
#: depend on where the steps before it left the variables that rule 6 copied. Three steps cost
#: 60 % of five and predict the same peak as five for the zoo's CNN and transformer, 1-3 % less
#: for its ResNet50 96² (batch 16-48).
STEPS = 3


class _Replay:
    """Rules 1-8 on one model as run (:class:`Simulator` picks the model for a set of swaps)."""

    def __init__(self, model: GraphModel, host: str | None, order: Sequence[str] | None) -> None:
        self.model = model
        self.order = list(order) if order is not None else ready_order(model)
        self.pos = pos = {op: i for i, op in enumerate(self.order)}
        n = len(self.order)
        static = static_of(model, device_key(host) if host else None)
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
        last, sole = _last_reads(arrays, at, n_roots)
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
        self._span_parts = (starts, ends_at, sizes, end == last, roots)  # for _plain_spans, made when needed
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

    @functools.cached_property
    def _in_place_outputs(self) -> set[str]:
        """The outputs written in place (their roots): each takes the chunk its op's input hands on."""
        types, outputs_of = self.model.dag.nodes, self.model.outputs_of
        return {outputs_of[op][_forwarding(types[op]["type"])[0]] for op, _ in self.forwarding}

    @functools.cached_property
    def _plain_spans(self) -> list[tuple[int, int, int, bool, str, int]]:
        """The buffers of the step without swaps, as :meth:`_spans` lists them (swaps replace a few)."""
        starts, ends_at, sizes, written, roots = self._span_parts
        return list(zip(starts, ends_at, sizes, written.tolist(), roots, [-1] * len(roots)))

    @functools.cached_property
    def _span_index(self) -> dict[str, int]:
        """Each buffer's index in :attr:`_plain_spans`."""
        return {r: k for k, r in enumerate(self._span_parts[4])}

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
        rounded = [_rounded(span[2]) for span in spans]
        bfc, chunk_of, resident = self._allocator(limit)
        program = self._program(spans)
        nbytes_of = [span[2] for span in spans]
        best = np.zeros(n, dtype=np.int64)
        state = None  # the allocator's state after the previous step
        for _ in range(steps):
            held = bfc.in_use - resident  # before the step's first event
            marks, values = _run_step(program, bfc, chunk_of, self.copies, nbytes_of, rounded, resident, n, stop)
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

    def _allocator(self, limit: int | None) -> tuple[BFCAllocator, dict[Any, int], int]:
        """``(allocator, chunk per variable handle, resident bytes)``: the variables placed first, as
        :meth:`_allocated` starts its steps; ``limit`` in the peak's currency (variables at their bytes)."""
        if limit is not None:  # in the peak's currency: the variables count at their bytes, not their chunks'
            chunks = [_rounded(nbytes) for _, nbytes in self.model.variables] or [_rounded(self.model.variable_bytes)]
            limit = _rounded(limit + sum(chunks) - self.model.variable_bytes)
        if not self.model.variables:
            return BFCAllocator(self.model.variable_bytes, limit), {}, 0
        bfc = BFCAllocator(limit=limit)
        chunk_of = {}
        for handle, nbytes in self.model.variables:
            chunk_of[handle or object()] = bfc.alloc(nbytes)
        return bfc, chunk_of, bfc.in_use

    def _program(
        self, spans: Sequence[tuple[int, int, int, bool, str, int]]
    ) -> list[tuple[int, list[tuple[int, int]]]]:
        """The events of :meth:`_allocated` as one program per position, made once for all steps:
        ``(position, [(code, index), ...])`` with code 0 free, 1 hand on (written in place), 2 free a
        copied variable's old chunk, 3 allocate, 4 allocate taking a chunk handed on there if it
        holds the buffer, 5 copy a variable (``index`` into ``spans`` or :attr:`copies`)."""
        copies = self.copies
        # (position, phase, index): per position, first the buffers that end (0) and the old
        # chunks of copied variables (1) are freed, then the new buffers (2) and copies (3) made.
        events = sorted(
            [(end, 0, k) for k, (_, end, *_) in enumerate(spans)]
            + [(start, 2, k) for k, (start, *_) in enumerate(spans)]
            + [(end, 1, k) for k, (_, end, *_) in enumerate(copies)]
            + [(w, 3, k) for k, (w, *_) in enumerate(copies)]
        )
        in_place_outputs = self._in_place_outputs
        # Per buffer: whether its end hands its chunk on, and whether it is an output written in
        # place (it takes a chunk handed on at its start).
        hands = [span[3] for span in spans]
        takes_chunk = [span[5] < 0 and span[4] in in_place_outputs for span in spans]
        program: list[tuple[int, list[tuple[int, int]]]] = []
        last = None
        for p, phase, k in events:
            if p != last:
                ops: list[tuple[int, int]] = []
                program.append((p, ops))
                last = p
            if phase == 0:
                ops.append((1 if hands[k] else 0, k))
            elif phase == 2:
                ops.append((4 if takes_chunk[k] else 3, k))
            else:
                ops.append((2 if phase == 1 else 5, k))
        return program

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


def _run_step(
    program: list[tuple[int, list[tuple[int, int]]]],
    bfc: BFCAllocator,
    chunk_of: dict[Any, int],
    copies: Sequence[tuple[int, int, int, str, str]],
    nbytes_of: Sequence[int],
    rounded: Sequence[int],
    resident: int,
    n: int,
    stop: int | None,
) -> tuple[list[int], list[int]]:
    """One step of :meth:`_Replay._allocated`: ``program`` (:meth:`_Replay._program`) run on ``bfc``.

    Returns ``(marks, values)``: the positions (< ``n``) with events, and the bytes in use after
    them (``resident`` left out); up to the first position above ``stop``, if one is."""
    alloc, release, size = bfc.alloc, bfc.release, bfc.size
    addr = [0] * len(nbytes_of)
    released = [0] * len(copies)  # per copy: the chunk freed at its end
    marks: list[int] = []  # positions (< n) with events, and the bytes in use after them
    values: list[int] = []
    handed: list[int] = []
    for p, ops in program:
        for code, k in ops:
            if code == 3:
                addr[k] = alloc(nbytes_of[k], rounded[k])
            elif code == 0:
                release(addr[k])
            elif code == 1:
                handed.append(addr[k])
            elif code == 4:
                chunk = handed.pop(0) if handed else None
                if chunk is not None and size[chunk] < rounded[k]:
                    release(chunk)
                    chunk = None
                addr[k] = alloc(nbytes_of[k], rounded[k]) if chunk is None else chunk
            elif code == 2:
                release(released[k])
            else:
                _, _, nbytes, _, handle = copies[k]
                new = alloc(nbytes)
                released[k] = chunk_of.get(handle, new)
                if handle in chunk_of:
                    chunk_of[handle] = new
        if handed:  # the position is done: chunks handed on that no output took are freed
            for chunk in handed:
                release(chunk)
            handed = []
        if p < n:
            in_use = bfc.in_use - resident
            marks.append(p)
            values.append(in_use)
            if stop is not None and in_use > stop:
                break
    return marks, values


def _last_reads(arrays: Any, at: np.ndarray, n_roots: int) -> tuple[np.ndarray, np.ndarray]:
    """Per buffer (root) its last read's position (-1 if none), and the index of the one read there
    if no other read is within :data:`CONCURRENT_READS` positions of it, else -1 (see
    :meth:`_Replay._last_read`); ``at`` maps op indices to schedule positions."""
    # Sorted by buffer, then position.
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
    return last, sole
