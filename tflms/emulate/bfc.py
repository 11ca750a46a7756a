"""TensorFlow's BFC allocator, emulated: chunks, regions, splitting, a limit."""

from __future__ import annotations

import bisect

__all__ = ["BFC_FIRST_REGION", "BFC_MAX_WASTE", "BFC_ROUND", "BFCAllocator", "OutOfMemory"]

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


class BFCAllocator:
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

    def alloc(self, nbytes: int, rounded: int | None = None) -> int:
        """Address of the chunk given to a request of ``nbytes``; ``rounded``: ``nbytes`` rounded
        as the allocator rounds it, where the caller has it already."""
        if rounded is None:
            rounded = _rounded(nbytes)
        free = self.free
        i = bisect.bisect_left(free, (rounded, -1))
        if i == len(free):
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
            i = bisect.bisect_left(free, (rounded, -1))
        # _take(i, rounded), inlined: the emulation calls this about 10^4 times a step.
        size, addr = free.pop(i)
        if (size >= 2 * rounded or size - rounded >= BFC_MAX_WASTE) and size > rounded:
            rest, left_over = addr + rounded, size - rounded
            end = self.region_end[addr]
            self.size[rest], self.used[rest], self.prev[rest] = left_over, False, addr
            self.region_end[rest] = end
            if rest + left_over < end:
                self.prev[rest + left_over] = rest
            self.size[addr] = size = rounded
            bisect.insort(free, (left_over, rest))
        self.used[addr] = True
        self.in_use += size
        return addr

    def release(self, addr: int) -> None:
        """Free a chunk, merged with the free chunks next to it in its region."""
        sizes, used, free = self.size, self.used, self.free
        size = sizes[addr]
        self.in_use -= size
        used[addr] = False
        end = self.region_end[addr]
        nxt = addr + size
        if nxt < end and not used[nxt]:
            nxt_size = sizes[nxt]
            del free[bisect.bisect_left(free, (nxt_size, nxt))]
            size += nxt_size
            del sizes[nxt], used[nxt], self.prev[nxt], self.region_end[nxt]
        prev = self.prev[addr]
        if prev is not None and not used[prev]:
            del free[bisect.bisect_left(free, (sizes[prev], prev))]
            size += sizes[prev]
            del sizes[addr], used[addr], self.prev[addr], self.region_end[addr]
            addr = prev
        sizes[addr] = size
        if addr + size < end:
            self.prev[addr + size] = addr
        bisect.insort(free, (size, addr))


def _rounded(nbytes: int) -> int:
    return max(BFC_ROUND, -(-nbytes // BFC_ROUND) * BFC_ROUND)
