#!/usr/bin/env python
"""Where a cold start goes: runs one `cubedqn` command in this process with Numba's
compile events recorded, and prints the kernels by compile time.

Each compile is timed from numba's "numba:compile" start to end event; a kernel's compile
includes the compiles of what it calls that were not compiled yet ("incl"), "self" is
that minus those nested compiles. The cache is a fresh temporary NUMBA_CACHE_DIR (so the
run is cold; the LLVM-IR modules of panels.py / tile_gemm.py are kept there too and are
compiled again as well), removed at the end, unless --cache-dir names one.

  env -u OPENBLAS_CORETYPE -u OPENBLAS_L2_SIZE python scripts/compile_times.py \\
      [--top 25] [--cache-dir DIR] -- train --profile cube2-quick --steps 10 --out /tmp/q
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
import time


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--top", type=int, default=25, help="kernels to list (by self time)")
    ap.add_argument("--cache-dir", default=None, help="NUMBA_CACHE_DIR to use (default: a fresh temporary one)")
    ap.add_argument("command", nargs=argparse.REMAINDER, help="the cubedqn command and its options, after --")
    args = ap.parse_args()
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        ap.error("give the cubedqn command after --, e.g. -- train --profile cube2-quick --steps 10 --out /tmp/q")
    # numba reads NUMBA_CACHE_DIR at import: set it before anything imports numba
    fresh = None if args.cache_dir else tempfile.mkdtemp(prefix="cubedqn-cold-")
    os.environ["NUMBA_CACHE_DIR"] = args.cache_dir or fresh
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

    from numba.core import event

    stack = []        # [name, start, time in nested compiles] per compile in progress
    records = {}      # name -> [count, inclusive seconds, self seconds]
    top_level = []

    class Recorder(event.Listener):
        def on_start(self, ev):
            fn = getattr(ev.data.get("dispatcher"), "py_func", None)
            name = f"{fn.__module__}.{fn.__qualname__}" if fn is not None else str(ev.data.get("dispatcher"))
            stack.append([name, time.perf_counter(), 0.0])

        def on_end(self, ev):
            name, start, nested = stack.pop()
            took = time.perf_counter() - start
            r = records.setdefault(name, [0, 0.0, 0.0])
            r[0] += 1
            r[1] += took
            r[2] += took - nested
            if stack:
                stack[-1][2] += took
            else:
                top_level.append(took)

    event.register("numba:compile", Recorder())
    t0 = time.perf_counter()
    from cubedqn.cli import main as cli
    status = 0
    try:
        cli(command, standalone_mode=False)
    except SystemExit as e:  # the CLI always exits; its one-line error is printed already
        status = e.code if isinstance(e.code, int) else int(e.code is not None)
    total = time.perf_counter() - t0
    where = "a fresh cache, removed now" if fresh else f"NUMBA_CACHE_DIR={args.cache_dir}"
    if fresh:
        shutil.rmtree(fresh, ignore_errors=True)
    if status:  # a command that failed compiled what it got to: no table, its exit status
        sys.exit(status)
    print(f"`cubedqn {' '.join(command)}`: {total:.1f} s in all ({where})")
    print(f"numba compiling: {sum(top_level):.1f} s in {len(top_level)} top-level compiles, "
          f"{sum(r[0] for r in records.values())} compiles in all")
    print(f"{'self s':>7} {'incl s':>7} {'n':>3}  kernel")
    for name, (n, incl, own) in sorted(records.items(), key=lambda kv: -kv[1][2])[:args.top]:
        print(f"{own:7.2f} {incl:7.2f} {n:3d}  {name}")


if __name__ == "__main__":
    main()
