"""On-chip memory as addresses: the SBUF and PSUM of one NeuronCore, byte-addressed per partition.

Each program (logical core) owns two :class:`AddressSpace` objects: SBUF (128 partitions x 192 / 224 / 256 KiB
on trn1 / trn2 / trn3 [ARCH2/3/4]) and PSUM (128 partitions x 8 banks x 2 KiB [ARCH2]). An on-chip tensor
occupies partitions ``[p0, p0 + shape[0])`` and bytes ``[base, base + prod(shape[1:]) * itemsize)`` of every
one of them. In numerics mode the space holds the bytes (``raw``, uint8 [128, bytes per partition]) and a
per-byte written-state (``mask``: 0 never written, 1 written by a non-matmul instruction, 2 by a TensorE
matmul/transpose), so two tensors at overlapping addresses ALIAS: a write through one is read through the
other, and a read of bytes nobody wrote is an error whichever tensor object reads them.

Placement
- ``nl.ndarray(..., address=(partition, byte_offset))`` places a tensor exactly there (direct allocation, as
  production kernels multi-buffer SBUF and PSUM; nki-library ``utils/modular_allocator.py``). The bytes keep
  whatever they held: nothing is reset, so aliases see each other. An address outside the space is an
  address-space error (:class:`NkiLimitError`); a PSUM address must start at a bank boundary.
- A tensor without an address is placed by this module's allocator. Policy (the lifetime rule of
  NKI_SUBSET.md 6.3, which is ours, not the compiler's): a tensor is live from its ``nl.ndarray`` call until
  its last Python reference dies; SBUF tensors get a free byte range spanning every partition, PSUM tensors a
  run of whole free 2 KiB banks, chosen NEXT FIT (ASSUMPTION: the first free range at or after a rotation
  cursor that moves past each placement, wrapping around; 64-byte aligned SBUF offsets, ASSUMPTION). Ranges
  of live explicitly placed tensors count as occupied. A fresh allocation is sentinel-filled and marked
  never-written (the official simulator's fresh-memory rule). A tensor allocated afresh in every iteration
  of a loop therefore rotates through as many buffers as the free space holds (the buffers the allocation
  really has, as a compiler placing the whole unrolled kernel would give it), not just two; a tensor
  allocated once before the loop is single-buffered.
- SBUF whose live bytes would exceed the generation's bytes per partition: a warning
  (:class:`NkiCapacityWarning`), an error under ``strict=True``; the tensor then lives in a private overflow
  buffer at a virtual address past the physical end (so the schedule still sees distinct bytes). The same
  private placement, silently, when the live bytes fit but no single free range does (fragmentation of the
  greedy policy, which a compiler placing the whole kernel at once would avoid). PSUM without free banks is
  always an error.

Peaks recorded on the launch's RunRecord: ``peak_sbuf_bytes_per_partition`` (live allocator bytes plus the
union of live explicit ranges) and ``peak_psum_banks`` (banks touched by live tensors).
"""
from __future__ import annotations

import bisect
import weakref

import numpy as np

from .errors import NkiCapacityWarning, NkiLimitError, NkiValidationError

__all__ = ["AddressSpace", "SBUF_ALIGN", "PMAX", "PSUM_BANK_BYTES"]

PMAX = 128
PSUM_BANK_BYTES = 2048
SBUF_ALIGN = 64  # ASSUMPTION: allocator alignment of SBUF free offsets (sbuf_min_align is unconfirmed, TILE)


class AddressSpace:
    """One on-chip memory of one core. ``kind`` is "sbuf" or "psum"; ``pitch`` the bytes per partition."""

    def __init__(self, kind, pitch, numerics, program, usable_banks=8):
        self.kind = kind
        self.pitch = int(pitch)
        self.program = program
        self.usable_bytes = usable_banks * PSUM_BANK_BYTES if kind == "psum" else self.pitch
        # The bytes and written-state exist in trace mode too (numerics=False): integer values (loop bounds,
        # offsets) are still computed there (isa_common "Trace mode"); float data is never filled in.
        self.numerics = numerics
        self.raw = np.zeros((PMAX, self.pitch), np.uint8)
        self.mask = np.zeros((PMAX, self.pitch), np.uint8)
        self._auto = []            # sorted [lo, hi) of live allocator-placed tensors
        self._auto_bytes = 0       # exact (unaligned) bytes per partition of live allocator tensors
        self._explicit = {}        # (lo, hi) -> live tensor count, explicitly placed
        self._explicit_union = 0   # bytes per partition covered by live explicit ranges
        self._overflow_top = self.pitch
        self._cursor = 0           # rotation cursor of the allocator (next fit, see _pick)
        self._psum_live = []       # weakrefs to allocator-placed PSUM storages (reclaimed by last use)

    # -- queries ----------------------------------------------------------------------------------
    def _occupied(self):
        """Sorted, merged list of occupied [lo, hi) ranges (allocator + explicit)."""
        ivs = sorted(list(self._auto) + list(self._explicit))
        out = []
        for lo, hi in ivs:
            if out and lo <= out[-1][1]:
                if hi > out[-1][1]:
                    out[-1][1] = hi
            else:
                out.append([lo, hi])
        return out

    def live_bytes(self):
        return self._auto_bytes + self._explicit_union

    def banks_live(self):
        used = set()
        for lo, hi in self._occupied():
            used.update(range(lo // PSUM_BANK_BYTES, (hi - 1) // PSUM_BANK_BYTES + 1))
        return len(used)

    def _pick(self, size, align):
        """Allocator placement (ASSUMPTION, the compiler's allocator is not documented): NEXT FIT, the first free
        range at or after a cursor that moves past each placement (wrapping to the lowest fitting range). A
        tensor allocated afresh in every loop iteration so rotates through as many buffers as the free space
        holds (the buffers its allocation really has), instead of reusing the range just freed (which
        double-buffered every loop allocation). Returns the offset or None when no free range holds ``size``."""
        cur = -(-self._cursor // align) * align
        first = None
        lo = 0
        for olo, ohi in self._occupied() + [[self.usable_bytes, self.usable_bytes]]:
            if olo - lo >= size:
                if first is None:
                    first = lo
                st = max(lo, cur)
                if st + size <= olo:
                    return st
            lo = max(lo, -(-ohi // align) * align)
        return first

    def _best_fit(self, size, align):
        """Lowest-addressed among the smallest free ranges that hold ``size`` bytes (best fit)."""
        best = None
        lo = 0
        for olo, ohi in self._occupied() + [[self.usable_bytes, self.usable_bytes]]:
            gap = olo - lo
            if gap >= size and (best is None or gap < best[0]):
                best = (gap, lo)
            lo = max(lo, -(-ohi // align) * align)
        return None if best is None else best[1]

    def _bump_peaks(self):
        rec = self.program.record
        if self.kind == "psum":
            b = self.banks_live()
            if b > rec.peak_psum_banks:
                rec.peak_psum_banks = b
        else:
            v = self.live_bytes()
            if v > rec.peak_sbuf_bytes_per_partition:
                rec.peak_sbuf_bytes_per_partition = v

    # -- placement ----------------------------------------------------------------------------------
    def place(self, st, what):
        """Allocator placement of storage ``st`` (no address): sets st.p0/base/vbase and its byte arrays."""
        nbytes = st.row_bytes
        prog = self.program
        if self.kind == "psum":
            nb = self.usable_bytes // PSUM_BANK_BYTES
            banks = -(-nbytes // PSUM_BANK_BYTES)
            if banks > nb:
                raise NkiLimitError(
                    f"nl.ndarray: PSUM tensor {what} needs {nbytes} bytes per partition = {banks} banks; the limit "
                    f"is {nb} banks x {PSUM_BANK_BYTES} bytes per partition")
            size = banks * PSUM_BANK_BYTES
            lo = self._pick(size, PSUM_BANK_BYTES)
            while lo is None and self._reclaim_psum():
                lo = self._pick(size, PSUM_BANK_BYTES)
            if lo is None:
                live = self.banks_live()
                if live + banks > nb:
                    raise NkiLimitError(
                        f"nl.ndarray: allocating PSUM tensor {what} ({banks} bank(s)) would make {live + banks} "
                        f"PSUM banks live; the limit is {nb} banks (each PSUM tensor without an address rounds up "
                        "to whole 2 KiB banks; drop references to PSUM tiles you no longer need)")
                raise NkiLimitError(
                    f"nl.ndarray: PSUM tensor {what} needs {banks} contiguous free bank(s); {live} of {nb} banks "
                    "are live but no free run is long enough (place it with address=)")
        else:
            size = -(-max(nbytes, 1) // SBUF_ALIGN) * SBUF_ALIGN
            lo = self._pick(size, SBUF_ALIGN)
            if lo is None:
                live = self._auto_bytes + self._explicit_union + nbytes
                if live <= self.pitch:
                    # fits by bytes, not in one free range: a compiler with whole-kernel liveness would have
                    # placed it; the emulator's greedy policy gives it a private range past the end instead
                    self._place_overflow(st, size)
                    return
                msg = (f"nl.ndarray: allocating SBUF tensor {what} ({nbytes} bytes per partition) makes {live} live "
                       f"SBUF bytes per partition; the {prog.launch.target} limit is {self.pitch} bytes per partition")
                if prog.strict:
                    raise NkiLimitError(msg)
                prog.launch.warn_once("sbuf_capacity", msg + " (warning; an error under strict=True)",
                                      NkiCapacityWarning)
                self._place_overflow(st, size)
                return
        st.p0 = 0
        st.base = st.vbase = lo
        self._cursor = lo + size if lo + size < self.usable_bytes else 0
        self._attach(st)
        bisect.insort(self._auto, (lo, lo + size))
        self._auto_bytes += nbytes
        st.interval = (lo, lo + size)
        weakref.finalize(st, self._release_auto, (lo, lo + size), nbytes)
        if self.kind == "psum":
            self._psum_live.append(weakref.ref(st))
        if self.raw is not None:  # fresh memory: sentinel-filled and never written
            p1 = st.shape[0]
            if self.numerics and nbytes % st.dtype.itemsize == 0 and nbytes:
                self.raw[0:p1, lo:lo + nbytes].view(st.dtype.np)[...] = st.sentinel
            self.mask[0:p1, lo:lo + nbytes] = 0
        self._bump_peaks()

    def _place_overflow(self, st, size):
        lo = self._overflow_top
        self._overflow_top += size
        st.p0 = 0
        st.base = 0
        st.vbase = lo
        st.pitch = max(st.row_bytes, 1)
        st.overflow = True
        st.raw2d = np.zeros((st.shape[0], st.pitch), np.uint8)
        st.mask2d = np.zeros((st.shape[0], st.pitch), np.uint8)
        if self.numerics and st.row_bytes % st.dtype.itemsize == 0 and st.row_bytes:
            st.raw2d.view(st.dtype.np)[...] = st.sentinel
        self._auto_bytes += st.row_bytes
        weakref.finalize(st, self._release_overflow, st.row_bytes)
        self._bump_peaks()

    def place_at(self, st, address, what):
        """Explicit placement at ``address=(partition, byte_offset)``."""
        try:
            pa, fa = address
            pa, fa = int(pa), int(fa)
        except (TypeError, ValueError):
            raise NkiValidationError(f"nl.ndarray: address={address!r} must be (partition_offset, free_offset_bytes)")
        P, nbytes = st.shape[0], st.row_bytes
        name = "SBUF" if self.kind == "sbuf" else "PSUM"
        if pa < 0 or fa < 0:
            raise NkiLimitError(f"nl.ndarray: {name} tensor {what} at address={address!r}: offsets must be >= 0")
        if self.kind == "psum" and fa % PSUM_BANK_BYTES:
            raise NkiValidationError(f"nl.ndarray: a PSUM address must start at a bank boundary (multiple of "
                                     f"{PSUM_BANK_BYTES} bytes), got {fa}")
        if pa + P > PMAX:
            raise NkiLimitError(f"nl.ndarray: {name} tensor {what} at partition {pa} with {P} partitions ends at "
                                f"partition {pa + P}; the {name} has {PMAX} partitions")
        if fa + nbytes > self.usable_bytes:
            raise NkiLimitError(
                f"nl.ndarray: {name} tensor {what} at address={address!r} covers bytes [{fa}, {fa + nbytes}) of each "
                f"partition; the {self.program.launch.target} {name} has {self.usable_bytes} bytes per partition"
                + (f" ({self.usable_bytes // PSUM_BANK_BYTES} banks x {PSUM_BANK_BYTES} B)" if self.kind == "psum"
                   else ""))
        st.p0 = pa
        st.base = st.vbase = fa
        self._attach(st)
        key = (fa, fa + max(nbytes, 1))
        for lo, hi in self._auto:
            if lo < key[1] and key[0] < hi:
                self.program.launch.warn_once(
                    ("explicit_over_auto", self.kind),
                    f"nl.ndarray: {name} tensor {what} at address={address!r} overlaps a live tensor the allocator "
                    "placed there (the two alias; place every tensor of that range with address= to avoid this)")
                break
        n = self._explicit.get(key, 0)
        self._explicit[key] = n + 1
        if n == 0:
            self._recount_explicit()
        weakref.finalize(st, self._release_explicit, key)
        self._bump_peaks()

    def _attach(self, st):
        st.pitch = self.pitch
        st.raw2d = self.raw
        st.mask2d = self.mask
        st.overflow = False

    def _recount_explicit(self):
        tot, cur_lo, cur_hi = 0, None, None
        for lo, hi in sorted(self._explicit):
            if cur_hi is None or lo > cur_hi:
                if cur_hi is not None:
                    tot += cur_hi - cur_lo
                cur_lo, cur_hi = lo, hi
            elif hi > cur_hi:
                cur_hi = hi
        if cur_hi is not None:
            tot += cur_hi - cur_lo
        self._explicit_union = tot

    # -- release (weakref finalizers) -----------------------------------------------------------------
    def _release_auto(self, iv, nbytes, st=None):
        i = bisect.bisect_left(self._auto, iv)
        if i < len(self._auto) and self._auto[i] == iv:
            del self._auto[i]
            self._auto_bytes -= nbytes

    def _reclaim_psum(self):
        """PSUM liveness by LAST USE, as the compiler allocates: when no bank is free, the allocator-placed PSUM
        tensor used least recently gives its bank(s) back although the kernel still holds a reference. Using it
        again afterwards is an error (its real lifetime then overlaps the new tile: more banks live than exist)."""
        best = None
        for ref in list(self._psum_live):
            st = ref()
            if st is None or st.reclaimed:
                self._psum_live.remove(ref)
                continue
            if best is None or st.last_use < best.last_use:
                best = st
        if best is None:
            return False
        best.reclaimed = True
        self._psum_live = [r for r in self._psum_live if r() is not None and r() is not best]
        self._release_auto(best.interval, best.row_bytes)
        return True

    def _release_overflow(self, nbytes):
        self._auto_bytes -= nbytes

    def _release_explicit(self, key):
        n = self._explicit.get(key, 0) - 1
        if n <= 0:
            self._explicit.pop(key, None)
            self._recount_explicit()
        else:
            self._explicit[key] = n
