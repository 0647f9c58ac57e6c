"""A monotonic clock that njit kernels can read, so a kernel that runs a whole training
step can still say where its time went.

What this file is: `stamp(buf, k)` writes the monotonic clock, in nanoseconds, into
buf[k] from inside njit code. It calls the C library's clock_gettime through the external
symbol `cubedqn_clock_gettime`, bound at import (as blas.py binds its sgemm), so kernels
that call it stay cacheable. A clock read costs a few tens of nanoseconds.

buf is an int64 array whose last two entries are scratch for the C `struct timespec`
(seconds, nanoseconds); stamps go in buf[:-2].

Where the C library has no clock_gettime (Windows), the symbol is bound to a stand-in that
reads 0 and AVAILABLE is False: callers then keep their Python-timed code paths.

What it is not: a timer. Differences of stamps are durations; the clock's zero is
arbitrary (on Linux it is the clock time.perf_counter reads, but nothing relies on that).
"""

from __future__ import annotations

import ctypes
import time

import llvmlite.binding as llb
from numba import cfunc, njit, types

SYMBOL = "cubedqn_clock_gettime"
_SIG = types.int32(types.int32, types.CPointer(types.int64))
_clock_gettime = types.ExternalFunction(SYMBOL, _SIG)
MONOTONIC = getattr(time, "CLOCK_MONOTONIC", 1)


@njit(cache=True, nogil=True)
def stamp(buf, k):
    """buf[k] = the monotonic clock in ns (buf[-2:] is the timespec scratch)."""
    n = buf.shape[0]
    _clock_gettime(MONOTONIC, buf[n - 2:].ctypes)
    buf[k] = buf[n - 2] * 1000000000 + buf[n - 1]


def _bind() -> bool:
    try:
        fn = ctypes.CDLL(None).clock_gettime
    except (AttributeError, OSError, TypeError):
        fn = None
    if fn is not None:
        llb.add_symbol(SYMBOL, ctypes.cast(fn, ctypes.c_void_p).value)
        return True

    @cfunc(_SIG, nopython=True)
    def no_clock(clock_id, ts):  # reads zero: durations come out 0, callers check AVAILABLE
        ts[0] = 0
        ts[1] = 0
        return -1

    llb.add_symbol(SYMBOL, no_clock.address)
    return False


AVAILABLE = _bind()
