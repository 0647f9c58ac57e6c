#!/usr/bin/env python
"""Can a Numba loop beat OpenBLAS on the step's small GEMMs? (An experiment, not used by
the engine.)

Times C = A @ B for A (M, 256), B (256, 256) with scipy's OpenBLAS (np.dot inside njit, as
the engine calls it) against a register-blocked Numba kernel (4 rows x 4 k per pass, the
inner loop over all 256 columns, which LLVM vectorises), one BLAS thread, alternating.

With --llvm it also times what a libxsmm-style kernel would do: an 8 x 32 register tile
(16 AVX-512 accumulators, one broadcast of A and two loads of B per k) written as LLVM IR
with llvmlite and compiled for this CPU with 512-bit vectors, called from njit through a
ctypes pointer; B is packed into 32-column panels inside the call ("packed") or beforehand
("prepacked": a forward pass could pack each weight matrix once per optimizer step). Needs
AVX-512 and M, N multiples of 8 and 32. The engine's own tile, which packs one 32-column
panel at a time into L1 inside the call, is cubedqn/tile_gemm.py (scripts/bench_tile_gemm.py
times it); this earlier experiment is kept for its numbers in
docs/performance-log.md.

  python scripts/bench_small_gemm.py          # LLVM's default vector width (256-bit here)
  python scripts/bench_small_gemm.py --zmm    # 512-bit vectors (host features, -prefer-256-bit)
  python scripts/bench_small_gemm.py --llvm   # + the LLVM IR 8 x 32 tile
"""
import os
import sys
import time

if "--zmm" in sys.argv:  # must be set before numba is imported
    import llvmlite.binding as ll
    os.environ["NUMBA_CPU_FEATURES"] = ll.get_host_cpu_features().flatten() + ",-prefer-256-bit"
    os.environ["NUMBA_CPU_NAME"] = ll.get_host_cpu_name()

import numpy as np  # noqa: E402
import scipy.linalg.cython_blas  # noqa: E402,F401  (load the BLAS njit calls before limiting it)
from numba import njit  # noqa: E402
from threadpoolctl import threadpool_limits  # noqa: E402


@njit(fastmath=True, error_model="numpy")
def gemm_blocked(A, B, C):
    """C = A @ B (row-major, M and K multiples of 4): 4 rows x 4 k of A per pass over B's rows."""
    M, K = A.shape
    N = B.shape[1]
    C[:] = 0
    for i0 in range(0, M, 4):
        c0, c1, c2, c3 = C[i0], C[i0 + 1], C[i0 + 2], C[i0 + 3]
        for k0 in range(0, K, 4):
            b0, b1, b2, b3 = B[k0], B[k0 + 1], B[k0 + 2], B[k0 + 3]
            a00, a01, a02, a03 = A[i0, k0], A[i0, k0 + 1], A[i0, k0 + 2], A[i0, k0 + 3]
            a10, a11, a12, a13 = A[i0 + 1, k0], A[i0 + 1, k0 + 1], A[i0 + 1, k0 + 2], A[i0 + 1, k0 + 3]
            a20, a21, a22, a23 = A[i0 + 2, k0], A[i0 + 2, k0 + 1], A[i0 + 2, k0 + 2], A[i0 + 2, k0 + 3]
            a30, a31, a32, a33 = A[i0 + 3, k0], A[i0 + 3, k0 + 1], A[i0 + 3, k0 + 2], A[i0 + 3, k0 + 3]
            for j in range(N):
                x0, x1, x2, x3 = b0[j], b1[j], b2[j], b3[j]
                c0[j] += a00 * x0 + a01 * x1 + a02 * x2 + a03 * x3
                c1[j] += a10 * x0 + a11 * x1 + a12 * x2 + a13 * x3
                c2[j] += a20 * x0 + a21 * x1 + a22 * x2 + a23 * x3
                c3[j] += a30 * x0 + a31 * x1 + a32 * x2 + a33 * x3


@njit
def gemm_blas(A, B, C):
    np.dot(A, B, C)


def median_us(f, n=300):
    f()
    ts = []
    for _ in range(n):
        t = time.perf_counter()
        f()
        ts.append(time.perf_counter() - t)
    return float(np.median(ts)) * 1e6


# -- the LLVM IR tile (--llvm) -------------------------------------------------------------
MR, NR, LANES = 8, 32, 16  # tile rows, tile columns, floats per AVX-512 register


def build_tile_gemm():
    """IR for gemm(A, lda, Bp, C, ldc, M, N, K): C = A @ B with B packed in NR-column panels
    (panel p holds B[:, p*NR:(p+1)*NR] row by row); accumulators are SSA vectors (phis)."""
    import llvmlite.ir as ir
    f32, i64 = ir.FloatType(), ir.IntType(64)
    vec = ir.VectorType(f32, LANES)
    mod = ir.Module(name="tile_gemm")
    fn = ir.Function(mod, ir.FunctionType(ir.VoidType(), [f32.as_pointer(), i64, f32.as_pointer(),
                                                          f32.as_pointer(), i64, i64, i64, i64]), name="gemm")
    A, lda, Bp, C, ldc, M, N, K = fn.args
    fma = ir.Function(mod, ir.FunctionType(vec, [vec, vec, vec]), name=f"llvm.fma.v{LANES}f32")
    b = ir.IRBuilder(fn.append_basic_block("entry"))
    c = lambda v: ir.Constant(i64, v)  # noqa: E731
    zero = ir.Constant(vec, [0.0] * LANES)

    def open_loop(stop, name, carried=()):
        pre = b.block
        head, body, done = (b.append_basic_block(f"{name}.{x}") for x in ("head", "body", "done"))
        b.branch(head)
        b.position_at_end(head)
        i = b.phi(i64, name)
        i.add_incoming(c(0), pre)
        phis = []
        for init, nm in carried:
            ph = b.phi(vec, nm)
            ph.add_incoming(init, pre)
            phis.append(ph)
        b.cbranch(b.icmp_signed("<", i, stop), body, done)
        b.position_at_end(body)
        return i, head, done, phis

    def close_loop(i, step, head, done, phis=(), values=()):
        nxt = b.add(i, c(step))
        end = b.block
        b.branch(head)
        i.add_incoming(nxt, end)
        for ph, v in zip(phis, values):
            ph.add_incoming(v, end)
        b.position_at_end(done)

    j0, jhead, jdone, _ = open_loop(N, "j")
    panel = b.gep(Bp, [b.mul(j0, K)])
    i0, ihead, idone, _ = open_loop(M, "i")
    names = [(zero, f"acc{r}_{v}") for r in range(MR) for v in range(NR // LANES)]
    k, khead, kdone, accs = open_loop(K, "k", names)
    brow = b.gep(panel, [b.mul(k, c(NR))])
    bv = [b.load(b.bitcast(b.gep(brow, [c(v * LANES)]), vec.as_pointer()), align=4) for v in range(NR // LANES)]
    new = []
    lane0 = ir.Constant(ir.IntType(32), 0)
    splat_mask = ir.Constant(ir.VectorType(ir.IntType(32), LANES), [0] * LANES)
    for r in range(MR):
        a = b.load(b.gep(A, [b.add(b.mul(b.add(i0, c(r)), lda), k)]))
        av = b.shuffle_vector(b.insert_element(ir.Constant(vec, ir.Undefined), a, lane0),
                              ir.Constant(vec, ir.Undefined), splat_mask)
        new += [b.call(fma, [av, bv[v], accs[r * (NR // LANES) + v]]) for v in range(NR // LANES)]
    close_loop(k, 1, khead, kdone, accs, new)
    for r in range(MR):
        crow = b.gep(C, [b.add(b.mul(b.add(i0, c(r)), ldc), j0)])
        for v in range(NR // LANES):
            b.store(accs[r * (NR // LANES) + v], b.bitcast(b.gep(crow, [c(v * LANES)]), vec.as_pointer()), align=4)
    close_loop(i0, MR, ihead, idone)
    close_loop(j0, NR, jhead, jdone)
    b.ret_void()
    return str(mod)


def compile_tile_gemm():
    """(ctypes function, the engine that owns its code): compiled for this CPU, 512-bit vectors."""
    import ctypes
    import llvmlite.binding as llvm
    llvm.initialize_native_target()
    llvm.initialize_native_asmprinter()
    tm = llvm.Target.from_default_triple().create_target_machine(
        cpu=llvm.get_host_cpu_name(), features=llvm.get_host_cpu_features().flatten() + ",-prefer-256-bit", opt=3)
    mod = llvm.parse_assembly(build_tile_gemm())
    mod.triple = tm.triple
    mod.verify()
    pb = llvm.create_pass_builder(tm, llvm.PipelineTuningOptions(speed_level=3))
    pb.getModulePassManager().run(mod, pb)
    engine = llvm.create_mcjit_compiler(mod, tm)
    engine.finalize_object()
    i64, ptr = ctypes.c_int64, ctypes.c_void_p
    proto = ctypes.CFUNCTYPE(None, ptr, i64, ptr, ptr, i64, i64, i64, i64)
    return proto(engine.get_function_address("gemm")), engine


def main():
    threadpool_limits(1, user_api="blas")
    rng = np.random.default_rng(0)
    llvm_tile = "--llvm" in sys.argv
    if llvm_tile:
        import llvmlite.binding as llvm
        if "+avx512f" not in llvm.get_host_cpu_features().flatten():
            sys.exit("--llvm needs AVX-512 (the tile keeps 16 512-bit accumulators)")
        tile, _engine = compile_tile_gemm()

        @njit
        def pack_panels(B, Bp):
            """Bp holds B's NR-column panels one after another, each row by row."""
            K, N = B.shape
            for k in range(K):
                row = B[k]
                for p in range(N // NR):
                    base = (p * K + k) * NR
                    for j in range(NR):
                        Bp[base + j] = row[p * NR + j]

        @njit
        def gemm_tile_prepacked(A, Bp, C):
            tile(A.ctypes.data, A.shape[1], Bp.ctypes.data, C.ctypes.data, C.shape[1], C.shape[0], C.shape[1],
                 A.shape[1])

        @njit
        def gemm_tile(A, B, C, Bp):
            pack_panels(B, Bp)
            gemm_tile_prepacked(A, Bp, C)

    from cubedqn.profiling import peak_gflops
    print(f"vector width: {'512-bit forced' if '--zmm' in sys.argv else 'LLVM default'}; "
          f"sgemm peak (n = 1024, one thread) {peak_gflops():.1f} GFLOP/s")
    for m in (64, 128, 768):
        A = rng.random((m, 256), np.float32)
        B = rng.random((256, 256), np.float32)
        C1, C2, C3 = (np.zeros((m, 256), np.float32) for _ in range(3))
        Bp = np.zeros(B.size, np.float32)
        t = {"OpenBLAS": [], "Numba blocked": [], "LLVM tile, packed": [], "prepacked": []}
        for _ in range(5):
            t["OpenBLAS"].append(median_us(lambda: gemm_blas(A, B, C1)))
            t["Numba blocked"].append(median_us(lambda: gemm_blocked(A, B, C2)))
            if llvm_tile:
                t["LLVM tile, packed"].append(median_us(lambda: gemm_tile(A, B, C3, Bp)))
                t["prepacked"].append(median_us(lambda: gemm_tile_prepacked(A, Bp, C3)))
        assert np.allclose(C1, C2, rtol=1e-4)
        if llvm_tile:
            assert np.allclose(C1, C3, rtol=1e-4)
        flops = 2 * m * 256 * 256
        cols = [f"{name} {np.median(v):7.1f} us ({flops / np.median(v) / 1e3:5.1f} GFLOP/s)"
                for name, v in t.items() if v]
        print(f"{m:4d} x 256 x 256: " + "   ".join(cols))


if __name__ == "__main__":
    main()
