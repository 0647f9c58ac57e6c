"""Calling a compiled njit kernel without going through its dispatcher on every call.

What this file is: `entry_point(kernel, *args)`, the compiled overload of an njit
dispatcher for the numba types of the given arguments, as a plain callable. A dispatcher
call types every argument (a fingerprint per array), looks the overload up, then calls
it; the entry point only unboxes the arguments and runs the machine code. The hot loops
call a few kernels with the same arrays over and over, so they find the entry point once
and keep it while the arguments are the same objects:

  a do-nothing kernel on one struct, hot: 3.7 us through the dispatcher, 1.3 by its entry
  point; right after a training step has been through the caches, 14.8 against 6.6
  (docs/performance-log.md, stop 47)

What it is not: a check. The entry point trusts that its arguments have the types it was
compiled for (an array's dtype, dimensions and layout: it reads them as such), so a
caller holds one only while it knows that: the same array objects (which cannot change
type), numbers that convert (a Python int where a float64 is taken). `Dispatcher.compile`
loads the overload from numba's cache, or compiles it, as the first call would; where
the dispatcher already holds it, it returns that one.
"""

from __future__ import annotations

from functools import partial

from numba import typeof


def entry_point(kernel, *args):
    """kernel's compiled overload for the types of args (compiled or loaded from the cache
    where it is not held yet), to be called with arguments of those types only."""
    return kernel.compile(tuple(typeof(a) for a in args))


class Entry:
    """One call site's kernel: its entry point while the call's array arguments are the
    objects it was found for, else its dispatcher.

    The site passes the arguments that stay the same while its objects do (arrays,
    constants) first and the ones that vary from call to call (counts, a schedule's
    value) last, as the kernel takes them, and compares its objects with `keys` by `is`
    (as fast a check as there is in Python): while they match it calls `call(*varying)`,
    functools.partial(entry point, *fixed), so the fixed arguments cost nothing to
    gather. Otherwise it calls the kernel (the dispatcher) itself, and then, where its
    objects are `missed`'s (the call before had them too), `bind`s them; else it sets
    `missed` to them and `keys` to (). So a caller that passes new arrays every time pays
    a comparison and a tuple more than the dispatcher (finding an entry point took
    123-126 us, runs/perf40/entry_lookup.txt), and one that keeps its arrays gets the
    entry point from its third call on. The sites make these checks inline: written as
    methods they slowed adds of 64 from a new array each call to 0.78x of the dispatcher
    alone, inline to 0.94x (runs/perf40/fresh_arrays_ab2.txt, fresh_arrays_ab3.txt)."""

    __slots__ = ("kernel", "keys", "call", "missed")

    def __init__(self, kernel):
        self.kernel, self.keys, self.call, self.missed = kernel, (), None, ()

    def bind(self, keys, fixed, typed):
        """Hold the entry point for the types of `fixed` and of `typed`, values standing in
        for the varying arguments (0.0 for a float that may come as an int), with `fixed`
        bound, while the site's arguments are the objects in `keys`."""
        self.call = partial(entry_point(self.kernel, *fixed, *typed), *fixed)
        self.keys, self.missed = keys, ()
