"""cubedqn: a fast CPU deep-Q-network engine for Rubik's-cube puzzles."""

__version__ = "0.1.0"

# before any kernel is loaded from Numba's cache: drop the cache where the package's sources
# changed since it was filled (Numba would keep a caller's copy of a changed callee)
from .numba_cache import drop_if_stale as _drop_if_stale  # noqa: E402

_drop_if_stale()
