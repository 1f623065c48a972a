"""AVX-512 vector steps for the diff kernel (numba intrinsics), used only where the CPU has them.

At a bf16 step's ~2% density, most of the diff's per-change time went to finding which lanes of a changed word
changed and writing each lane out (branch-free, four lanes per word whether they changed or not). AVX-512 does
that for 32 elements at once: compare, then *compress* the changed lanes to the front of a register
(``vpcompressw``) and store it whole; the next store starts where the changed ones end (``popcount``). Measured on
the codec benchmark's 134M-parameter step (2.5M changes), one thread: the diff kernel 76 -> 59 ms.

``vpcompressw`` is AVX512-VBMI2 (Intel Ice Lake and later, AMD Zen 4 and later) and the 16-bit compares and
masked stores AVX512-BW: :data:`COMPRESS16` says whether this CPU has both; without them the portable kernel
runs (a kernel compiled here is cached for this CPU only: numba keys its cache entries by CPU and features).
"""

from __future__ import annotations

from typing import Any

import llvmlite.binding as llvm
import numba
from llvmlite import ir
from numba import types
from numba.extending import intrinsic


def _usable(*features: str) -> bool:
    """Whether this CPU has every one of ``features`` and numba compiles for them: ``NUMBA_CPU_FEATURES`` (set to
    build kernels for other machines) names the features numba targets instead of the host's."""
    try:
        host = llvm.get_host_cpu_features()
    except RuntimeError:  # a CPU llvm cannot describe
        return False
    if not all(host.get(f, False) for f in features):
        return False
    if numba.config.CPU_FEATURES is None:
        return True
    targeted = {f[1:] for f in str(numba.config.CPU_FEATURES).split(",") if f.startswith("+")}
    return all(f in targeted for f in features)


COMPRESS16 = _usable("avx512f", "avx512bw", "avx512vbmi2")
"""Whether :func:`compress16` can run here (it must never be compiled elsewhere: no CPU without these
instructions can run it, and LLVM cannot compile it for one)."""

LANES = 32
"""Elements of 16 bits that :func:`compress16` compares at once (one 512-bit register)."""

_I16 = ir.IntType(16)
_VEC = ir.VectorType(_I16, LANES)
_MASK = ir.VectorType(ir.IntType(1), LANES)


def _declared(module: ir.Module, name: str, fnty: ir.FunctionType) -> ir.Function:
    found = module.globals.get(name)
    return found if found is not None else ir.Function(module, fnty, name)


def _splat(builder: ir.IRBuilder, scalar: ir.Value) -> ir.Value:
    undef = ir.Constant(_VEC, ir.Undefined)
    one = builder.insert_element(undef, scalar, ir.Constant(ir.IntType(32), 0))
    return builder.shuffle_vector(one, undef, ir.Constant(ir.VectorType(ir.IntType(32), LANES), [0] * LANES))


@intrinsic
def compress16(typingctx: Any, a: Any, b: Any, out_xor: Any, out_index: Any, out_new: Any, at: Any, first: Any,
               index0: Any) -> Any:
    """Compare ``a[first : first + 32]`` (new bits, 16-bit unsigned) with the snapshot ``b`` there; write the
    changed lanes' ``a ^ b``, their indices ``index0 + lane`` (16-bit) and their new bits ``a`` to the front of
    ``out_xor``/``out_index``/``out_new`` from ``at`` on (each store writes 32 elements: the outputs need 32 elements
    of room past the last change); set ``b = a`` in the changed lanes only (the others are not written); return
    how many lanes changed. Bounds are the caller's (no check): both 32-element windows must lie inside.
    Typed for 1-D contiguous uint16 arrays only (it reads and writes their memory as 16-bit lanes)."""
    arrays = (a, b, out_xor, out_index, out_new)
    if not all(isinstance(t, types.Array) and t.dtype == types.uint16 and t.ndim == 1 and t.layout == "C"
               for t in arrays):
        return None  # numba then reports no matching signature: nothing is compiled for other arrays
    sig = types.int64(a, b, out_xor, out_index, out_new, types.int64, types.int64, types.int64)

    def codegen(context: Any, builder: ir.IRBuilder, signature: Any, args: Any) -> ir.Value:
        arr_a, arr_b, arr_x, arr_i, arr_n, at_v, first_v, index0_v = args

        def window(arr: ir.Value, ty: Any, start: ir.Value) -> ir.Value:
            data = context.make_array(ty)(context, builder, arr).data
            return builder.bitcast(builder.gep(data, [start]), _VEC.as_pointer())

        pa = window(arr_a, signature.args[0], first_v)
        pb = window(arr_b, signature.args[1], first_v)
        va = builder.load(pa, align=2)
        vb = builder.load(pb, align=2)
        vx = builder.xor(va, vb)
        changed = builder.icmp_unsigned("!=", vx, ir.Constant(_VEC, [0] * LANES))
        module = builder.module
        compress = _declared(module, "llvm.x86.avx512.mask.compress.v32i16", ir.FunctionType(_VEC, [_VEC, _VEC, _MASK]))
        zero = ir.Constant(_VEC, [0] * LANES)
        index = builder.add(ir.Constant(_VEC, list(range(LANES))), _splat(builder, builder.trunc(index0_v, _I16)))
        for vec, arr, ty in ((vx, arr_x, signature.args[2]), (index, arr_i, signature.args[3]),
                             (va, arr_n, signature.args[4])):
            builder.store(builder.call(compress, [vec, zero, changed]), window(arr, ty, at_v), align=2)
        store = _declared(module, "llvm.masked.store.v32i16.p0",
                          ir.FunctionType(ir.VoidType(), [_VEC, _VEC.as_pointer(), ir.IntType(32), _MASK]))
        builder.call(store, [va, pb, ir.Constant(ir.IntType(32), 2), changed])
        popcount = _declared(module, "llvm.ctpop.i32", ir.FunctionType(ir.IntType(32), [ir.IntType(32)]))
        count = builder.call(popcount, [builder.bitcast(changed, ir.IntType(32))])
        return builder.zext(count, ir.IntType(64))

    return sig, codegen
