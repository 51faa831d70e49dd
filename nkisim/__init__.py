"""nkisim -- a NumPy emulator of the standalone NKI API (``nki``, ``nki.language``, ``nki.isa``;
NKI 0.7 semantics by default, ``simulate(..., nki_version="0.6")`` for older programs; ``dst``-first ISA ops),
plus instruction records for the cost model.

Usage::

    from nkisim import language as nl, isa as nisa, nki_module as nki   # a kernel written against nki, nl, nisa
    from nkisim import simulate, last_record
    from nkisim.schedule import schedule                 # the modeled time of a recorded run

    out = simulate(kernel, target="trn2")(a, b)          # numpy arrays or CPU torch tensors
    out = simulate(kernel[2])(a, b)                      # LNC2: programs 0 and 1, concurrently (cores.py)
    outs = simulate(kernel).ranks([(a0,), (a1,)])        # two ranks (nki.collectives between them)
    rec = last_record()                                  # RunRecord: instrs, peak SBUF/PSUM, warnings
    simulate(kernel, numerics=False)(a, b)               # trace mode: records + limit checks only

What is emulated
  * Tensors are storage plus a strided view (partition dim first on chip); slicing, ``nl.ds``, ``reshape``,
    ``permute``, ``broadcast``, ``view(dtype)``, ``.ap(pattern, offset, scalar_offset=/vector_offset=)``
    return aliasing views. Buffers: ``nl.sbuf``, ``nl.psum``, ``nl.hbm``, ``nl.shared_hbm``.
  * SBUF and PSUM are byte-addressed per partition per core (``memory.py``): ``nl.ndarray(..., address=
    (partition, byte_offset))`` places a tensor and aliases whatever occupies those bytes; tensors without an
    address are placed by a documented allocator (lifetime rule, best fit).
  * Every write rounds to the destination dtype (ml_dtypes bf16 / fp8 e4m3, e4m3fn, e5m2 / fp16 / tf32
    RNE; float -> int rounds to nearest and saturates). Engine arithmetic is fp32; TensorE accumulates fp32.
  * nl: creation, load/store/copy/load_transpose2d, ranges (= ``range``), program_id/num_programs,
    tile_size, element-wise math, reductions, matmul/transpose/broadcast_to/where/softmax.
    nisa: nc_matmul (accumulate True/False/None, transpose mode, tiling mode, fp8 double_row),
    nc_transpose (TensorE/VectorE), activation (+ reduce registers), activation_reduce, tensor_tensor,
    tensor_scalar, scalar_tensor_tensor, tensor_reduce, tensor_copy, memset, iota, affine_select,
    reciprocal, dma_copy (casts, scalar/vector dynamic offsets with oob_mode error/skip), dma_transpose,
    dma_compute; the instructions of isa_extra.py (scans, top-8, gathers, predicated copies, partition
    reductions, nonzero compaction, batch-norm statistics); registers and runtime loop bounds
    (isa_control.py; nl.fori_loop / while_loop bodies traced once and replayed per runtime trip, NkiScalar;
    nl.dynamic_range only under nki_version <= 0.6); core_barrier, sendrecv and nki.collectives;
    on trn3 the MX instructions quantize_mx and nc_matmul_mx with the packed x4 dtypes (isa_mx.py).
    The rest raise NotImplementedError (docs/NKI_SUBSET.md §3.13: rng, dropout, exponential, ...).
  * One ``records.Instr`` per instruction in the launch's ``RunRecord`` (engine, op, partitions, free,
    dtypes, buffers, flops, DMA bytes / contiguous bytes / partitions / direction / dge / transpose,
    inner stride, reduce_res, onezero, dep_prev, program, read/write footprints: space, partitions, bytes);
    peak SBUF bytes/partition and PSUM banks. ``schedule.py`` turns a record into the modeled time.

Checked beyond the official simulator (each raises a subclass of ``NkiValidationError`` naming the op,
operand, value and limit)
  * reads of never-written on-chip (and kernel-allocated HBM) elements (a per-element written mask, not
    just the NaN sentinel, so integer tensors are covered too): a warning, an error under strict=True;
    ``accumulate=True`` onto PSUM no matmul
    wrote (and, on trn1/trn2, onto PSUM last written by a non-matmul instruction);
  * address space: an ``address=`` outside 128 partitions x 192/224/256 KiB (SBUF, trn1/2/3) or 8 x 2 KiB
    (PSUM; bank-aligned) is an error; allocator-placed SBUF beyond the bytes per partition: a warning, an
    error under ``strict=True``; allocator-placed PSUM without free banks (each rounds up to whole 2 KiB
    banks): always an error; a matmul output must sit in one PSUM bank (trn1/2);
  * start-partition alignment of compute operands (0 for >64 partitions, 0/64 for >32, 0/32/64/96 else);
    ScalarE/VectorE/GpSimd free size (64K elements from SBUF, 4K from PSUM);
  * a source lint of the kernel (keyword-only signature, legacy ``nl.arange``/``mgrid``/``mask=``/
    ``neuronxcc``, rejected by design), list arguments, ``kernel[lnc]`` with lnc in {1, 2} (2 rejected on
    trn1), outputs in HBM, ``bool()``/``int()`` on tensors.

Assumed (see docs/NKI_SUBSET.md for the rules and the ASSUMPTION list)
  * LNC2 programs run concurrently but one at a time, switching only at rendezvous (deterministic);
    ``shared_hbm`` allocations are matched between the two programs by allocation order. Default target trn2.
  * ScalarE functions are computed exactly (a warning when an input is outside the table's valid range).
  * ``activation(reduce_op=nl.add)`` needs ``reduce_cmd`` reset_reduce/reduce (idle would leave the
    registers untouched, so it is rejected rather than silently reading stale registers).
  * ``t[...] = <fresh result of the instruction just issued>`` re-targets that instruction (no extra copy
    is recorded), as the compiler writes such results in place; other assignments record a copy.
  * Reinterpreting views (``.view(dtype)`` of another itemsize) track initialisation over their bounding
    storage range. In trace mode (``numerics=False``) dynamic offsets are not resolved (no bounds checks)
    and returned outputs are sentinel-filled.
"""
from __future__ import annotations

from . import isa, language, nki_module, records  # noqa: F401
from .errors import (NkiBufferError, NkiDtypeError, NkiLaunchError, NkiLimitError,  # noqa: F401
                     NkiOutOfBoundsError, NkiShapeError, NkiUninitializedReadError, NkiValidationError)
from .nki_module import jit, last_record, simulate  # noqa: F401

__all__ = ["simulate", "jit", "last_record", "nki_module", "language", "isa", "records", "NkiValidationError",
           "NkiLimitError", "NkiBufferError", "NkiDtypeError", "NkiShapeError", "NkiUninitializedReadError",
           "NkiOutOfBoundsError", "NkiLaunchError"]
