"""Search plumbing on tiny cases: beam search solves short scrambles optimally, greedy
never revisits a state, beam dedup is exact, and verification rejects wrong solutions."""
import numpy as np
import pytest

from cubedqn.cube import apply_moves, expand_children, get_puzzle, invert_moves, parse_moves
from cubedqn.encoding import Encoder, Policy
from cubedqn.nn import MLP, Layout
from cubedqn.oracle import load_oracle
from cubedqn.search import beam_search, greedy_solve, select_beam, solve_many, verify

P2 = get_puzzle("cube2")
MOVES = np.ascontiguousarray(P2.moves[:12])


class OraclePolicy:
    """Q(s, a) = -(1 + exact distance of the child): the ideal network."""

    def __init__(self, oracle):
        self.oracle = oracle

    def q_values(self, states):
        states = np.ascontiguousarray(np.atleast_2d(states))
        kids = np.empty((len(states), 12, 24), np.uint8)
        expand_children(states, MOVES, 12, kids)
        return -(1.0 + self.oracle.distances(kids.reshape(-1, 24)).reshape(len(states), 12))


class PreferencePolicy:
    """The same fixed action preference everywhere (U first): greedy must avoid cycles."""

    def q_values(self, states):
        return np.tile(-np.arange(12, dtype=np.float64), (len(np.atleast_2d(states)), 1))


@pytest.fixture(scope="module")
def oracle(tmp_path_factory):
    import os
    os.environ["CUBEDQN_CACHE_DIR"] = str(tmp_path_factory.mktemp("cache"))
    return load_oracle("qtm")


def untrained():
    return Policy(MLP(Layout(144, 24, (32,), 12), seed=7), Encoder(P2, 12))


@pytest.mark.parametrize("scramble", ["R", "R U", "F' R U", "U2 F"])
def test_beam_search_finds_optimal_short_solutions_with_any_network(scramble, oracle):
    state = apply_moves(P2, P2.solved, parse_moves(scramble, "qtm"))
    optimal = int(oracle.distances(state)[0])
    sol = beam_search(untrained(), state, MOVES, 12, width=2000, max_depth=6)  # width covers depth 3
    assert verify(P2, state, sol) and len(sol) == optimal


def test_oracle_policy_is_optimal_for_greedy_and_narrow_beam(oracle):
    states = oracle.random_states(30, np.random.default_rng(1))
    optimal = oracle.distances(states)
    ok, lengths, _, sols = solve_many(OraclePolicy(oracle), P2, states, 12, "greedy", max_moves=20)
    assert ok.all() and np.array_equal(lengths, optimal)
    ok, lengths, _, _ = solve_many(OraclePolicy(oracle), P2, states[:5], 12, "beam", beam_width=2, max_moves=20)
    assert ok.all() and np.array_equal(lengths, optimal[:5])


def test_greedy_never_revisits_a_state():
    state = apply_moves(P2, P2.solved, parse_moves("R F"))
    solved, lengths, sols = greedy_solve(PreferencePolicy(), state[None], MOVES, max_moves=30)
    seen = {state.tobytes()}
    s = state
    for a in (sols[0] or []):
        s = apply_moves(P2, s, [a])
        assert s.tobytes() not in seen
        seen.add(s.tobytes())


def test_select_beam_deduplicates_exactly():
    a = apply_moves(P2, P2.solved, [6])
    b = apply_moves(P2, P2.solved, [0])
    kids = np.ascontiguousarray(np.stack([a, b, a, a, b, P2.solved]))
    out = np.empty(3, np.int64)
    n = select_beam(kids, np.array([0.0, 1.0, -1.0, 0.5, 2.0, 3.0]), 3, out)
    assert n == 3 and out[:n].tolist() == [2, 1, 5]  # best copy of a, then b, then solved


def test_verification_rejects_wrong_solutions():
    state = apply_moves(P2, P2.solved, parse_moves("R U F"))
    assert verify(P2, state, invert_moves(parse_moves("R U F")))
    assert not verify(P2, state, parse_moves("R U F"))
    assert not verify(P2, state, None)
    assert not verify(P2, state, [])
