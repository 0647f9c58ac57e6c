#!/usr/bin/env python
"""Name cubedqn's compiled kernels in Linux `perf` reports.

perf names code that no file on disk holds (JIT code) from /tmp/perf-PID.map, and numba
writes none: without one a profile of a training step is bare addresses. This runs a
Python program (a script, or a module with -m) in this process and, when it exits, writes
that map for every function numba compiled or loaded from its cache (each overload's
entry point and the njit functions it calls that LLVM did not inline, cfuncs included)
and for cubedqn's own LLVM IR modules (the tile GEMM, the panel gather and scatter, the
GEMM team): each function's address and size, from its object code's symbol table
(`nm -S`). numba keeps the object code of what it compiles with cache=True (all of
cubedqn's kernels); what it loads from its cache is kept here as it is loaded.

  perf record -F 2000 -o perf.data -- python scripts/perf_map.py -m cubedqn.cli \\
      profile --profile cube2 --threads 1 --steps 2000
  perf report -i perf.data --no-children --sort sym          # or --sort dso,sym

Names read module.function (`optim.sq_norm`, `nn.sparse_forward`), `cfunc:` before a
cfunc and `native:` before an LLVM IR module's symbol; numba's Python-call wrappers
(`cpython.*`) are named too. Start-up and compilation are in the recording: `perf record
-D MS` starts it MS milliseconds in, and `perf report --time 20%-100%` reads a part.

What it is not: a profiler (perf is; `cubedqn profile` times the step's phases), and
not needed for Python frames (py-spy names those). It sets numba's hooks by hand
(numba.core.codegen.JITCodeLibrary and cubedqn.native._engine_for), so it is a
developer's script, checked against numba 0.68 (tests/test_perf_map.py).
"""

from __future__ import annotations

import atexit
import importlib.util
import os
import runpy
import shutil
import subprocess
import sys
import tempfile
import weakref

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

_LOADED = weakref.WeakKeyDictionary()  # a library loaded from numba's cache -> its object code
_LIBRARIES = weakref.WeakSet()         # every library with object caching on (cache=True)
_NATIVE = []                           # (MCJIT engine, object code) of cubedqn.native's modules


def install():
    """Keep the object code of what numba and cubedqn.native compile or load from now on.
    Call before cubedqn's modules are imported (they compile or load at import and first
    call)."""
    from numba.core.codegen import JITCodeLibrary

    from cubedqn import native

    unserialize = JITCodeLibrary._unserialize.__func__
    enable = JITCodeLibrary.enable_object_caching

    def _unserialize(cls, codegen, state):
        lib = unserialize(cls, codegen, state)
        if state[1] == "object":  # its object code goes to the JIT, which drops numba's copy
            _LOADED[lib] = bytes(state[2][0])
        return lib

    def enable_object_caching(self):
        enable(self)
        _LIBRARIES.add(self)

    engine_for = native._engine_for

    def _engine_for(tm, obj, symbols):
        engine = engine_for(tm, obj, symbols)
        _NATIVE.append((engine, bytes(obj)))
        return engine

    JITCodeLibrary._unserialize = classmethod(_unserialize)
    JITCodeLibrary.enable_object_caching = enable_object_caching
    native._engine_for = _engine_for


def symbols(obj: bytes) -> dict:
    """{name: (offset, size, strong)} of the functions an object file defines (`nm -S`);
    strong: a global, non-weak symbol."""
    with tempfile.NamedTemporaryFile(suffix=".o") as f:
        f.write(obj)
        f.flush()
        out = subprocess.run(["nm", "-S", "--defined-only", f.name], capture_output=True, text=True,
                             check=True).stdout
    found = {}
    for line in out.splitlines():
        parts = line.split()
        if len(parts) == 4 and parts[2] in "tTwW" and int(parts[1], 16):
            found[parts[3]] = (int(parts[0], 16), int(parts[1], 16), parts[2] == "T")
    return found


def readable(name: str) -> str:
    """numba's mangled name as dotted parts: _ZN7cubedqn5optim7sq_normB3v94... ->
    optim.sq_norm; wrappers keep their prefix (cfunc:, cpython.)."""
    prefix = ""
    for tag, shown in (("cfunc.", "cfunc:"), ("cpython.", "cpython.")):
        if name.startswith(tag):
            prefix, name = shown, name[len(tag):]
    if not name.startswith("_ZN"):
        return prefix + name
    s, parts, i = name[3:], [], 0
    while i < len(s) and s[i].isdigit():
        j = i
        while s[j].isdigit():
            j += 1
        n = int(s[i:j])
        parts.append(s[j:j + n])
        i = j + n
    return prefix + ".".join(p for p in parts if p != "cubedqn")


def _library_lines(lib, obj):
    """(address, size, name) of the functions in one numba library's object code."""
    syms = symbols(obj)
    # the text's load address, from a global symbol of this library's own (its entry point,
    # its wrappers): the njit functions it calls are weak copies, and the JIT resolves
    # such a name to the copy of whichever library was loaded first
    for name, (offset, _, strong) in syms.items():
        if not strong:
            continue
        try:
            address = lib.get_pointer_to_function(name)
        except Exception:
            continue
        if address:
            base = address - offset
            return [(base + off, size, readable(n)) for n, (off, size, _) in syms.items()]
    return []


def write_map(path=None) -> int:
    """Write the perf map (default /tmp/perf-PID.map); returns how many functions it names."""
    lines = []
    for lib in list(_LIBRARIES):
        obj = _LOADED.get(lib) or lib._compiled_object
        if obj:
            lines += _library_lines(lib, obj)
    for engine, obj in _NATIVE:
        for name, (_, size, _) in symbols(obj).items():
            address = engine.get_function_address(name)
            if address:
                lines.append((address, size, "native:" + name))
    lines = sorted(set(lines))
    with open(path or f"/tmp/perf-{os.getpid()}.map", "w") as f:
        for address, size, name in lines:
            f.write(f"{address:x} {size:x} {name}\n")
    return len(lines)


def main(argv):
    if not argv or argv[0] in ("-h", "--help"):
        print(__doc__.split("\n\n")[0] + "\n\nusage: python scripts/perf_map.py (-m MODULE | SCRIPT) [ARGS...]")
        return 0 if argv else 2
    if shutil.which("nm") is None:
        print("perf_map: needs binutils' nm (it reads the object code's symbol tables)", file=sys.stderr)
        return 2
    if argv[0] == "-m":
        if len(argv) < 2:
            print("perf_map: -m needs a module name", file=sys.stderr)
            return 2
        try:
            found = importlib.util.find_spec(argv[1]) is not None
        except (ImportError, ValueError):
            found = False
        if not found:
            print(f"perf_map: no module named {argv[1]!r}", file=sys.stderr)
            return 2
    elif not os.path.isfile(argv[0]):
        print(f"perf_map: no such script: {argv[0]}", file=sys.stderr)
        return 2
    install()

    def at_exit():
        n = write_map()
        print(f"perf_map: {n} functions named in /tmp/perf-{os.getpid()}.map", file=sys.stderr)
    atexit.register(at_exit)
    if argv[0] == "-m":
        sys.argv = [argv[1]] + argv[2:]
        runpy.run_module(argv[1], run_name="__main__", alter_sys=True)
    else:
        sys.argv = argv
        runpy.run_path(argv[0], run_name="__main__")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
