"""A gradient's squared norm whose order of adds is written down, in LLVM IR.

What this file is: two functions, compiled for this CPU with llvmlite (kept on disk like
numba's cache, native.py) and bound at import as the external symbols
`cubedqn_sq_norm_f32` and `cubedqn_sq_norm_f64`, double (const T *g, i64 n): the sum of
g[0:n]'s squares, which optim.sq_norm calls from njit (the clip's global norm, each
training step).

Why IR: the sum used to be a Numba loop with reassociating fast-math flags, so that LLVM
ran it in vector lanes. A reassociated sum's bits follow how LLVM compiles it, and a
cached Numba caller holds its own copy of its callees, compiled apart from the callee's:
a process that compiled `optim.clipped_step_rows` summed one way, one that loaded it from
Numba's cache another (norms 4.447770045 and 4.447770056 of the same gradient). Where the
norm clipped a step, the same command with the same seed then trained another net on a
cold cache than on a warm one (the cube2-quick preset from its step 408;
docs/performance-log.md, stop 60). Here the vectors and the order are the IR's own, with
no fast-math flags, so every compile of it, on any CPU, adds the same numbers in the same
order: the same bits.

Order (T float32: LANES 16; float64: LANES 8): the blocks of BLOCK values first, each
value times SCALE (2^48, exact unless it overflows) and squared in T; a block's squares
go into ACCS vector accumulators (value j of the block into accumulator (j / LANES) mod
ACCS, lane j mod LANES), added in index order from zero; the accumulators summed
(a0 + a1) + (a2 + a3), then the lanes halved (lane l + lane l + LANES/2, ...) down to one
value, which is added, as a double, to the total, block after block. The scale keeps
float32 squares of |g| from 3.9e-34 to 65536 normal (subnormal arithmetic can be many
times slower); a larger value overflows: where the total is not finite, the whole array
is summed again in double (that also carries a NaN). Else the total times 2^-96, plus the
squares of the last n mod BLOCK values in double. reference.sq_norm is this order in
numpy (the tests compare bits).

What it is not: a compensated or exact sum (relative error about 1e-9 on a gradient, a few
float32 ulps at worst), or used for strided arrays (optim.sq_norm passes contiguous ones).
"""

from __future__ import annotations

import llvmlite.binding as llb
import llvmlite.ir as ir
from numba import types

from .native import counted_loop, load_or_compile

BLOCK = 256          # values a block's partial sums cover
ACCS = 4             # vector accumulators a block
SCALE = 2.0 ** 48    # values are squared times SCALE (float32: subnormal squares become normal)
F32, F64 = "cubedqn_sq_norm_f32", "cubedqn_sq_norm_f64"
LANES = {F32: 16, F64: 8}

SIG = types.float64(types.voidptr, types.int64)
sq_norm_f32 = types.ExternalFunction(F32, SIG)
sq_norm_f64 = types.ExternalFunction(F64, SIG)


def _build(mod, name, t):
    """double name(t *g, i64 n) into mod (see the docstring for the order)."""
    lanes, i64, f64 = LANES[name], ir.IntType(64), ir.DoubleType()
    vec = ir.VectorType(t, lanes)
    fn = ir.Function(mod, ir.FunctionType(f64, [t.as_pointer(), i64]), name=name)
    g, n = fn.args
    b = ir.IRBuilder(fn.append_basic_block("entry"))

    def c64(v):
        return ir.Constant(i64, v)

    def exact(lo, hi, total):
        """total + the squares of g[lo:hi] in double, in index order."""
        i, (s,), close = counted_loop(b, lo, hi, 1, "exact", [total])
        x = b.load(b.gep(g, [i]))
        x = b.fpext(x, f64) if t != f64 else x
        return close([b.fadd(s, b.fmul(x, x))])[0]

    m = b.mul(b.sdiv(n, c64(BLOCK)), c64(BLOCK))
    scale = ir.Constant(vec, [SCALE] * lanes)
    zero = ir.Constant(vec, [0.0] * lanes)
    i, (total,), close_i = counted_loop(b, c64(0), m, BLOCK, "block", [ir.Constant(f64, 0.0)])
    accs = [zero] * ACCS
    for j in range(0, BLOCK, lanes):
        x = b.load(b.bitcast(b.gep(g, [b.add(i, c64(j))]), vec.as_pointer()), align=4)
        x = b.fmul(x, scale)
        q = j // lanes % ACCS
        accs[q] = b.fadd(accs[q], b.fmul(x, x))
    s = b.fadd(b.fadd(accs[0], accs[1]), b.fadd(accs[2], accs[3]))
    width = lanes
    while width > 1:
        half = width // 2
        lo = b.shuffle_vector(s, s, ir.Constant(ir.VectorType(ir.IntType(32), half), list(range(half))))
        hi = b.shuffle_vector(s, s, ir.Constant(ir.VectorType(ir.IntType(32), half), list(range(half, width))))
        s, width = b.fadd(lo, hi), half
    block_sum = b.extract_element(s, ir.Constant(ir.IntType(32), 0))
    (total,) = close_i([b.fadd(total, b.fpext(block_sum, f64) if t != f64 else block_sum)])
    finite = b.fcmp_ordered("<=", total, ir.Constant(f64, 1.7976931348623157e308))
    with b.if_else(finite) as (then, otherwise):
        with then:
            scaled = b.fmul(total, ir.Constant(f64, 1.0 / (SCALE * SCALE)))
            tail = exact(m, n, ir.Constant(f64, 0.0))
            done_then, res_then = b.block, b.fadd(scaled, tail)
        with otherwise:
            res_else = exact(c64(0), n, ir.Constant(f64, 0.0))
            done_else = b.block
    out = b.phi(f64)
    out.add_incoming(res_then, done_then)
    out.add_incoming(res_else, done_else)
    b.ret(out)


def module_ir() -> str:
    mod = ir.Module(name="cubedqn_sums")
    _build(mod, F32, ir.FloatType())
    _build(mod, F64, ir.DoubleType())
    return str(mod)


def _make_fallbacks():
    """Plain Numba versions with the same order (no fast-math flags: lane by lane, in
    scalar registers), bound where the IR cannot be compiled here. Compiled only then."""
    import numpy as np
    from numba import carray, cfunc

    def make(dtype, lanes):
        n_vec = BLOCK // lanes

        @cfunc(SIG, cache=True, nopython=True)
        def sq_norm_loops(p, n):
            g = carray(p, n, dtype)
            m = n // BLOCK * BLOCK
            total = 0.0
            sc = dtype(SCALE)
            accs = np.zeros((ACCS, lanes), dtype)
            for i in range(0, m, BLOCK):
                accs[:] = 0
                for v in range(n_vec):
                    for lane in range(lanes):
                        x = g[i + v * lanes + lane] * sc
                        accs[v % ACCS, lane] += x * x
                s = (accs[0] + accs[1]) + (accs[2] + accs[3])
                width = lanes
                while width > 1:
                    s = s[:width // 2] + s[width // 2:width]
                    width //= 2
                total += np.float64(s[0])
            if total <= 1.7976931348623157e308:
                total *= 1.0 / (SCALE * SCALE)
                lo = m
            else:
                total, lo = 0.0, 0
            tail = 0.0
            for i in range(lo, n):
                x = np.float64(g[i])
                tail += x * x
            return total + tail

        return sq_norm_loops

    return make(np.float32, LANES[F32]), make(np.float64, LANES[F64])


def _bind():
    """(engine or None, where the code came from, problem): the IR where it compiles, else
    the loops above."""
    try:
        engine, source = load_or_compile("sums", __file__, module_ir, (F32, F64))
        return engine, source, None
    except Exception as e:  # an LLVM that cannot target this CPU: stay correct, be slow
        global _FALLBACKS
        _FALLBACKS = _make_fallbacks()
        for name, fn in zip((F32, F64), _FALLBACKS):
            llb.add_symbol(name, fn.address)
        return None, "fallback", f"{type(e).__name__}: {e}"


_FALLBACKS = ()
_ENGINE, SOURCE, PROBLEM = _bind()
