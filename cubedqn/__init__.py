"""cubedqn: a fast CPU deep-Q-network engine for Rubik's-cube puzzles."""

__version__ = "0.1.0"
