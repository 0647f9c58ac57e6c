"""Machine code from LLVM IR for this CPU, kept on disk between processes.

What this file is: the loader panels.py (the sparse first layer) and tile_gemm.py (the
small-GEMM register tile) share. `load_or_compile` returns an MCJIT engine holding the
module's object code with its functions bound as external symbols (so cached njit
kernels, and other IR modules, call them by name). The object code is compiled once per
(the kernel module's source, llvmlite, LLVM, CPU, features) and kept in NUMBA_CACHE_DIR
when that is set, else beside numba's own cache in this package's __pycache__; nowhere if
neither is writable. The file starts with the SHA-256 of the object code and is used only
if that matches (LLVM is not handed a damaged object).

Also here, for the kernel modules that write IR (tile_gemm.py, tile_bf16.py, panels.py):
`counted_loop` (the one loop construct), `declare`, `transpose_rows` (a square block of
row vectors turned in registers), vector loads and stores with lane masks, a register
tile's start from zero or from C, and the dispatch of the columns past the last panel.

What it is not: an IR builder (each kernel module writes its own) or a fallback (a
caller that catches the exception binds plain Numba loops or another library instead).
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

import llvmlite
import llvmlite.binding as llb
import llvmlite.ir as ir

_MAGIC = b"cubedqn-llvm-object-1\n"


def _cache_path(stem, source, tm_triple, cpu, features):
    from numba.core.config import CACHE_DIR
    key = hashlib.sha256("\0".join((source, llvmlite.__version__, ".".join(map(str, llb.llvm_version_info)),
                                     tm_triple, cpu, features)).encode()).hexdigest()[:20]
    folder = Path(CACHE_DIR) / "cubedqn" if CACHE_DIR else Path(__file__).parent / "__pycache__"
    return folder / f"{stem}-{key}.o"


def _read_cached(path):
    """The cached object code, or None (absent, unreadable or not matching its digest)."""
    try:
        data = path.read_bytes()
    except OSError:
        return None
    head, digest, obj = data[:len(_MAGIC)], data[len(_MAGIC):len(_MAGIC) + 32], data[len(_MAGIC) + 32:]
    return obj if head == _MAGIC and obj and hashlib.sha256(obj).digest() == digest else None


def _write_cached(path, obj):
    """Atomically (temp file + rename); a cache that cannot be written is not an error."""
    tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp.write_bytes(_MAGIC + hashlib.sha256(obj).digest() + obj)
        os.replace(tmp, path)
    except OSError:
        tmp.unlink(missing_ok=True)


def _engine_for(tm, obj, symbols):
    """An MCJIT engine holding the object code `obj`, each of `symbols` bound to it.
    External symbols the code calls must be bound (llb.add_symbol) before this."""
    engine = llb.create_mcjit_compiler(llb.parse_assembly(""), tm)
    engine.add_object_file(llb.ObjectFileRef.from_data(obj))
    engine.finalize_object()
    for name in symbols:
        address = engine.get_function_address(name)
        if not address:
            raise RuntimeError(f"{name} is not in the object code")
        llb.add_symbol(name, address)
    return engine


def counted_loop(b, start, stop, step, name, carried=()):
    """Opens, at IRBuilder b, `for i = start; i + step <= stop; i += step` (i64; the full
    steps only: a remainder is left for a following loop, which can start at i, the first
    value not done). carried: values kept in registers across iterations (SSA phis).
    Returns (i, phis, close): close(new_values) ends the body and returns the phis, which
    hold the carried values after the loop."""
    i64 = ir.IntType(64)
    pre = b.block
    head, body, done = (b.append_basic_block(f"{name}.{x}") for x in ("head", "body", "done"))
    b.branch(head)
    b.position_at_end(head)
    i = b.phi(i64, name)
    i.add_incoming(start, pre)
    phis = []
    for k, init in enumerate(carried):
        ph = b.phi(init.type, f"{name}.c{k}")
        ph.add_incoming(init, pre)
        phis.append(ph)
    b.cbranch(b.icmp_signed("<=", b.add(i, ir.Constant(i64, step)), stop), body, done)
    b.position_at_end(body)

    def close(values=()):
        end = b.block
        i.add_incoming(b.add(i, ir.Constant(i64, step)), end)
        for ph, v in zip(phis, values):
            ph.add_incoming(v, end)
        b.branch(head)
        b.position_at_end(done)
        return phis

    return i, phis, close


def sgemm_type():
    """void (order, transa, transb, m, n, k, alpha, a, lda, b, ldb, beta, c, ldc): the CBLAS
    ILP64 sgemm, the signature of the engine's GEMM symbol (tile_gemm.TILE, team.TEAM_SGEMM)."""
    i32, i64, f32 = ir.IntType(32), ir.IntType(64), ir.FloatType()
    fp = f32.as_pointer()
    return ir.FunctionType(ir.VoidType(), [i32, i32, i32, i64, i64, i64, f32, fp, i64, fp, i64, f32, fp, i64])


def bias_gemm_type():
    """i64 (m, n, k, a, lda, b, ldb, c, ldc, bias, relu): C = A @ B + bias (ReLU if relu & 1;
    relu & 2 a hint, tile_gemm.TILE_BIAS), 1 when done, 0 where left to the caller
    (tile_gemm.TILE_BIAS, team.TEAM_BIAS)."""
    i64, fp = ir.IntType(64), ir.FloatType().as_pointer()
    return ir.FunctionType(i64, [i64, i64, i64, fp, i64, fp, i64, fp, i64, fp, i64])


def declare(mod, name, ftype):
    """The function `name` of mod (an intrinsic or an external symbol), declared if new."""
    return mod.globals.get(name) or ir.Function(mod, ftype, name=name)


def prefetch(b, at, for_write=False):
    """A hint to bring the line at pointer `at` into the cache: for reading towards L2
    (locality 2), for writing into this core's L1, owned (locality 3). Never faults,
    whatever the address."""
    i32, i8p = ir.IntType(32), ir.IntType(8).as_pointer()
    fn = declare(b.module, "llvm.prefetch.p0i8", ir.FunctionType(ir.VoidType(), [i8p, i32, i32, i32]))
    b.call(fn, [b.bitcast(at, i8p), ir.Constant(i32, int(for_write)), ir.Constant(i32, 3 if for_write else 2),
                ir.Constant(i32, 1)])


def transpose_rows(b, rows):
    """The 16 x 16 block given as 16 row vectors, transposed: four rounds of swapping the
    off-diagonal t x t blocks of each 2t x 2t block (t = 8, 4, 2, 1), two-source shuffles."""
    n = len(rows)
    rows = list(rows)
    t = n // 2
    while t:
        lo = ir.Constant(ir.VectorType(ir.IntType(32), n), [c if not c & t else n + c - t for c in range(n)])
        hi = ir.Constant(ir.VectorType(ir.IntType(32), n), [c + t if not c & t else n + c for c in range(n)])
        for r in range(n):
            if not r & t:
                a, c = rows[r], rows[r + t]
                rows[r], rows[r + t] = b.shuffle_vector(a, c, lo), b.shuffle_vector(a, c, hi)
        t //= 2
    return rows


def flag_with_setter(mod, name, setter_name, start, align=None):
    """An internal i32 global `name` of mod (starting at `start`) and its setter, void
    setter_name(i32); returns the global, which the emitted code loads where it branches."""
    i32 = ir.IntType(32)
    flag = ir.GlobalVariable(mod, i32, name)
    flag.linkage, flag.initializer = "internal", ir.Constant(i32, start)
    if align:
        flag.align = align
    setter = ir.Function(mod, ir.FunctionType(ir.VoidType(), [i32]), name=setter_name)
    b = ir.IRBuilder(setter.append_basic_block("entry"))
    b.store(setter.args[0], flag)
    b.ret_void()
    return flag


def splat(b, x, width):
    """<width x type of x>: x in every lane (an insert and a shuffle: one broadcast)."""
    vt = ir.VectorType(x.type, width)
    v = b.insert_element(ir.Constant(vt, ir.Undefined), x, ir.Constant(ir.IntType(32), 0))
    return b.shuffle_vector(v, ir.Constant(vt, ir.Undefined), ir.Constant(ir.VectorType(ir.IntType(32), width),
                                                                         [0] * width))


def lane_mask(b, width, limit):
    """<width x i1>: lane < limit (an i64 value)."""
    return b.icmp_signed("<", ir.Constant(ir.VectorType(ir.IntType(64), width), list(range(width))),
                         splat(b, limit, width))


def load_floats(b, base, off, width, mask=None, align=4):
    """width floats at base + off (a float pointer and an i64); with a mask, the lanes it
    leaves out read as zero and their memory is not touched (llvm.masked.load)."""
    f32, i32 = ir.FloatType(), ir.IntType(32)
    t = ir.VectorType(f32, width)
    at = b.bitcast(b.gep(base, [off]), t.as_pointer())
    if mask is None:
        return b.load(at, align=align)
    load = declare(b.module, f"llvm.masked.load.v{width}f32.p0v{width}f32",
                   ir.FunctionType(t, [t.as_pointer(), i32, ir.VectorType(ir.IntType(1), width), t]))
    return b.call(load, [at, ir.Constant(i32, align), mask, ir.Constant(t, [0.0] * width)])


def store_floats(b, v, base, off, mask=None, align=4):
    """The float vector v to base + off; with a mask, only the lanes it sets."""
    i32 = ir.IntType(32)
    t = v.type
    at = b.bitcast(b.gep(base, [off]), t.as_pointer())
    if mask is None:
        b.store(v, at, align=align)
        return
    store = declare(b.module, f"llvm.masked.store.v{t.count}f32.p0v{t.count}f32",
                    ir.FunctionType(ir.VoidType(), [t, t.as_pointer(), i32, ir.VectorType(ir.IntType(1), t.count)]))
    b.call(store, [v, at, ir.Constant(i32, align), mask])


def zero_or_loaded(b, first, load, zero, name):
    """Accumulators that start at `zero` where `first` (an i1) holds and at load()'s values
    (emitted on their own branch) otherwise: a branch, not a select, so the first K block's
    arithmetic does not wait on loads of C. Returns the phis, one per loaded value."""
    fn = b.function
    entry = b.block
    from_c, start = fn.append_basic_block(f"{name}.fromc"), fn.append_basic_block(f"{name}.start")
    b.cbranch(first, start, from_c)
    b.position_at_end(from_c)
    loaded = load()
    b.branch(start)
    b.position_at_end(start)
    phis = []
    for x in loaded:
        ph = b.phi(x.type)
        ph.add_incoming(zero, entry)
        ph.add_incoming(x, from_c)
        phis.append(ph)
    return phis


def tail_columns(b, rem, lanes, one, two):
    """The last rem (< 2 lanes) columns of C after its full panels, if any: one(masks) where
    they fit in one vector, else two(masks); masks[v] sets the lanes of vector v that are
    columns of C."""
    i64 = ir.IntType(64)
    masks = [lane_mask(b, lanes, b.sub(rem, ir.Constant(i64, v * lanes))) for v in range(2)]
    fn = b.function
    tail_bb, one_bb, two_bb, done_bb = (fn.append_basic_block(x) for x in ("tail", "tail.one", "tail.two", "done"))
    b.cbranch(b.icmp_signed(">", rem, ir.Constant(i64, 0)), tail_bb, done_bb)
    b.position_at_end(tail_bb)
    b.cbranch(b.icmp_signed("<=", rem, ir.Constant(i64, lanes)), one_bb, two_bb)
    b.position_at_end(one_bb)
    one(masks[:1])
    b.branch(done_bb)
    b.position_at_end(two_bb)
    two(masks)
    b.branch(done_bb)
    b.position_at_end(done_bb)


def host_features() -> str:
    llb.initialize_native_target()
    return llb.get_host_cpu_features().flatten()


def host_has_avx512() -> bool:
    return "+avx512f" in host_features().split(",")


def host_has_avx2_fma() -> bool:
    features = host_features().split(",")
    return "+avx2" in features and "+fma" in features


def tile_gemm_setting() -> str:
    """CUBEDQN_TILE_GEMM as the code reads it ("1" unset): 0, 1 or avx2, else an error that
    blas.py reports."""
    return os.environ.get("CUBEDQN_TILE_GEMM", "1").strip().lower()


def tile_avx512() -> bool:
    """Whether the tile GEMM's IR (tile_gemm.py, tile_sparse.py) is built for AVX-512: the
    CPU has it and CUBEDQN_TILE_GEMM is not "avx2", which builds the AVX2 code on an
    AVX-512 CPU too (so that its tests and timings run there)."""
    return host_has_avx512() and tile_gemm_setting() != "avx2"


def load_or_compile(stem, source_files, build_ir, symbols, extra_features=""):
    """(engine, "cache" or "compiled"): the object code of build_ir() for this CPU, from
    the cache file when one matches, else compiled now (and written to the cache). The
    key is the text of source_files (a path, or a tuple of the paths whose code writes the
    IR), so an edit there compiles afresh. Raises where LLVM cannot
    compile the IR here. extra_features are appended to the host's (e.g. "-prefer-256-bit")."""
    llb.initialize_native_target()
    llb.initialize_native_asmprinter()
    cpu, features = llb.get_host_cpu_name(), host_features() + extra_features
    tm = llb.Target.from_default_triple().create_target_machine(cpu=cpu, features=features, opt=3)
    files = (source_files,) if isinstance(source_files, (str, Path)) else source_files
    path = _cache_path(stem, "\0".join(Path(f).read_text() for f in files), tm.triple, cpu, features)
    obj = _read_cached(path)
    if obj is not None:
        try:
            return _engine_for(tm, obj, symbols), "cache"
        except Exception:  # intact but unusable here after all: compile it again
            pass
    mod = llb.parse_assembly(build_ir())
    mod.triple = tm.triple
    mod.verify()
    # no IR pass pipeline: the loops are already written as wanted, and it took ~50 of ~70 ms
    obj = tm.emit_object(mod)
    engine = _engine_for(tm, obj, symbols)
    _write_cached(path, obj)
    return engine, "compiled"
