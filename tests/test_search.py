"""Search plumbing on tiny cases: beam search solves short scrambles optimally, greedy
never revisits a state, beam dedup is exact, and verification rejects wrong solutions."""
import numpy as np
import pytest

from cubedqn.cube import apply_moves, expand_children, get_puzzle, invert_moves, parse_moves
from cubedqn.encoding import Encoder, Policy
from cubedqn.nn import MLP, Layout
from cubedqn.oracle import load_oracle
from cubedqn.search import (astar_search, beam_search, cost_to_go, greedy_solve, hash_table, select_beam,
                            select_distinct, solve_many, verify)

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


def test_astar_with_the_exact_heuristic_is_optimal_and_any_network_solves_short_scrambles(oracle):
    states = oracle.random_states(12, np.random.default_rng(2))
    optimal = oracle.distances(states)
    ok, lengths, _, _ = solve_many(OraclePolicy(oracle), P2, states, 12, "astar", beam_width=1, max_moves=20,
                                   weight=1.0)
    assert ok.all() and np.array_equal(lengths, optimal)  # an exact h: A* expands the optimal path only
    for scramble in ("R", "R U", "F' R U"):
        state = apply_moves(P2, P2.solved, parse_moves(scramble, "qtm"))
        sol = astar_search(untrained(), state, MOVES, 12, batch=256, weight=1.0, max_depth=8)
        assert verify(P2, state, sol) and len(sol) <= 8
    assert astar_search(untrained(), P2.solved, MOVES, 12) == []
    far = states[np.argmax(optimal)]
    assert astar_search(untrained(), far, MOVES, 12, batch=4, max_depth=3) is None  # too deep: gives up


def test_cost_to_go_inverts_the_discounted_value():
    for gamma in (0.99, 0.9, 1.0):
        c = np.arange(1, 15, dtype=np.float64)
        q = -c if gamma == 1.0 else -(1 - gamma ** c) / (1 - gamma)
        np.testing.assert_allclose(cost_to_go(q, gamma), c, rtol=1e-9)


def test_greedy_never_revisits_a_state():
    state = apply_moves(P2, P2.solved, parse_moves("R F"))
    solved, lengths, sols = greedy_solve(PreferencePolicy(), state[None], MOVES, max_moves=30)
    seen = {state.tobytes()}
    s = state
    for a in (sols[0] or []):
        s = apply_moves(P2, s, [a])
        assert s.tobytes() not in seen
        seen.add(s.tobytes())


def test_greedy_never_revisits_a_position_up_to_rotation():
    """With the canonical encoder a position seen turned is the same position: R and L' lead
    to one position, so a greedy cube may not take L' after R' (back where it was)."""
    enc = Encoder(P2, 12)
    net = Policy(MLP(Layout(enc.in_dim, enc.n_active, (16,), 12), seed=3), enc)

    class Recording:  # the states greedy asks about are the cube's path
        def __init__(self):
            self.path = []

        def q_values(self, states):
            self.path.append(np.array(states[0]))
            return net.q_values(states)

        position_keys = staticmethod(net.position_keys)

    rng = np.random.default_rng(5)
    longest = 0
    for _ in range(10):
        start = apply_moves(P2, P2.solved, rng.integers(0, 12, 9))
        rec = Recording()
        greedy_solve(rec, start[None], MOVES, max_moves=30)
        keys = {k.tobytes() for k in enc.position_keys(np.stack(rec.path))}
        assert len(keys) == len(rec.path)  # every position asked about is new, up to rotation
        longest = max(longest, len(rec.path))
    assert longest > 5  # an untrained network wanders: the guard was exercised


def test_select_distinct_skips_equal_keys_and_carries_its_table():
    keys = np.array([[1, 2], [3, 4], [1, 2], [5, 6], [3, 4], [7, 8]], np.uint8)
    out = np.empty(3, np.int64)
    table = hash_table(3)
    n = select_distinct(keys, 3, 0, table, out, 0)
    assert n == 3 and out.tolist() == [0, 1, 3]
    out = np.empty(4, np.int64)
    table = hash_table(4)
    n = select_distinct(keys[:3], 4, 0, table, out, 0)   # first chunk: 2 distinct
    n = select_distinct(keys, 4, 3, table, out, n)        # the rest, against the same table
    assert n == 4 and out.tolist() == [0, 1, 3, 5]


def test_select_beam_deduplicates_exactly():
    a = apply_moves(P2, P2.solved, [6])
    b = apply_moves(P2, P2.solved, [0])
    kids = np.ascontiguousarray(np.stack([a, b, a, a, b, P2.solved]))
    out = np.empty(3, np.int64)
    n = select_beam(None, kids, np.array([0.0, 1.0, -1.0, 0.5, 2.0, 3.0]), 3, out)
    assert n == 3 and out[:n].tolist() == [2, 1, 5]  # best copy of a, then b, then solved


def test_verification_rejects_wrong_solutions():
    state = apply_moves(P2, P2.solved, parse_moves("R U F"))
    assert verify(P2, state, invert_moves(parse_moves("R U F")))
    assert not verify(P2, state, parse_moves("R U F"))
    assert not verify(P2, state, None)
    assert not verify(P2, state, [])


@pytest.mark.parametrize("search", ["greedy", "beam", "astar"])
@pytest.mark.parametrize("inputs,symmetry", [("pairs", 48), ("stickers", 1)])
def test_threads_solve_the_same_as_one_thread(search, inputs, symmetry, oracle):
    """Cubes split over two threads (forked policies, GIL-free kernels) get the very same
    solutions as one thread. The symmetry-reduced pair encoder has the most scratch state;
    sticker inputs run the first layer by panels (each fork has its own scratch)."""
    enc = Encoder(P2, 12, inputs=inputs, symmetry=symmetry)
    policy = Policy(MLP(Layout(enc.in_dim, enc.n_active, (32,), 12), seed=3), enc)
    rng = np.random.default_rng(4)
    states = np.stack([apply_moves(P2, P2.solved, rng.integers(0, 12, d)) for d in (1, 2, 3, 4, 5) * 4])
    width = 64 if inputs == "stickers" else 16  # beams of 64: 64-row policy calls, panel workspaces
    one = solve_many(policy, P2, states, 12, search, beam_width=width, max_moves=8)
    two = solve_many(policy, P2, states, 12, search, beam_width=width, max_moves=8, threads=2)
    assert one[0].any()
    assert np.array_equal(one[0], two[0]) and np.array_equal(one[1], two[1]) and one[3] == two[3]
    assert len(two[2]) == len(states)
    if inputs == "stickers" and search == "beam":
        assert any(ws.panel.size for ws, _ in policy._ws.values())


def test_forked_policies_share_weights_but_not_scratch():
    enc = Encoder(P2, 12, inputs="pairs", symmetry=48)
    policy = Policy(MLP(Layout(enc.in_dim, enc.n_active, (32,), 12), seed=3), enc)
    twin = policy.fork()
    assert twin.net is policy.net and twin._ws is not policy._ws
    assert twin.encoder._codes is not enc._codes and twin.encoder._base is not enc._base
    assert twin.encoder.frame_perm is enc.frame_perm
    with pytest.raises(ValueError, match="fork"):
        solve_many(OraclePolicy(None), P2, np.stack([P2.solved, P2.solved]), 12, "beam", threads=2)


def test_a_failing_threaded_solve_stops_instead_of_solving_every_cube():
    """An exception (or Ctrl-C) in a threaded solve reaches the caller once the cubes
    already running end; the cubes not started are dropped, not solved first."""
    import threading
    import time

    class Failing:
        calls = 0
        lock = threading.Lock()

        def fork(self):
            return self

        def q_values(self, states):
            with Failing.lock:
                Failing.calls += 1
            time.sleep(0.02)  # a cube takes a while: the caller sees the error long before 200 ran
            raise RuntimeError("network failed")

    states = np.stack([apply_moves(P2, P2.solved, [0, 2])] * 200)
    with pytest.raises(RuntimeError, match="network failed"):
        solve_many(Failing(), P2, states, 12, "beam", threads=2)
    assert Failing.calls < 20


class StickerKeys:
    """A policy whose position keys are the stickers: select_beam keys lazily, down the order."""

    def position_keys(self, states):
        return np.array(states, np.uint8)


@pytest.mark.parametrize("policy", [None, StickerKeys()])
@pytest.mark.parametrize("crowded", [False, True])
def test_select_beam_equals_taking_the_first_distinct_in_sorted_order(crowded, policy):
    """Every key at hand (no policy: the stickers), one kernel; keys computed lazily
    (StickerKeys): the partition path, and (crowded: the 3W best are all one position) the
    full-sort path."""
    rng = np.random.default_rng(7)
    pool = np.stack([apply_moves(P2, P2.solved, rng.integers(0, 12, 6)) for _ in range(40)])
    kids = np.ascontiguousarray(pool[rng.integers(0, 40, 200)])
    scores = rng.random(200)
    if crowded:
        kids[:20] = pool[0]
        scores[:20] -= 2.0
    width = 5
    want, seen = [], set()
    for i in np.argsort(scores, kind="stable"):
        if kids[i].tobytes() not in seen and len(want) < width:
            seen.add(kids[i].tobytes())
            want.append(int(i))
    out = np.empty(width, np.int64)
    n = select_beam(policy, kids, scores, width, out)
    assert out[:n].tolist() == want and n == width


@pytest.mark.parametrize("seed", range(8))
def test_select_in_order_is_a_stable_argsort_with_duplicates_skipped(seed):
    """Many tied scores, NaNs (last, by index), duplicate keys, and widths beyond the
    number of distinct keys: the first `width` distinct rows of np.argsort(kind="stable")."""
    from cubedqn.search import select_in_order
    rng = np.random.default_rng(seed)
    m = int(rng.integers(1, 300))
    scores = rng.integers(-3, 4, m).astype(np.float64) * 0.5
    scores[rng.random(m) < 0.1] = np.nan
    scores[rng.random(m) < 0.05] = -0.0
    keys = rng.integers(0, 4, (m, 3)).astype(np.uint8)  # at most 64 distinct keys
    width = int(rng.integers(1, 80))
    want, seen = [], set()
    for i in np.argsort(scores, kind="stable"):
        if keys[i].tobytes() not in seen and len(want) < width:
            seen.add(keys[i].tobytes())
            want.append(int(i))
    out = np.full(width, -1, np.int64)
    n = select_in_order(scores, keys, width, np.empty(m), np.empty(m, np.int64), hash_table(width), out)
    assert out[:n].tolist() == want


def test_select_in_order_takes_nan_scores_last_by_index():
    from cubedqn.search import select_in_order
    scores = np.array([np.nan, 1.0, np.nan, 0.0, 1.0])
    keys = np.arange(5, dtype=np.uint8)[:, None]
    out = np.empty(5, np.int64)
    n = select_in_order(scores, keys, 5, np.empty(5), np.empty(5, np.int64), hash_table(5), out)
    assert out[:n].tolist() == [3, 1, 4, 0, 2]


@pytest.mark.parametrize("n_a", [12, 18])
def test_greedy_step_takes_the_first_unvisited_action_of_a_stable_argsort(n_a):
    """greedy_step's selection against numpy: actions by descending Q (ties: the lower
    action first, NaN last), the first whose child's key is not in the cube's history."""
    from cubedqn.search import greedy_step
    rng = np.random.default_rng(3)
    n, key_len, s = 200, 3, 5
    q = rng.integers(0, 4, (n, n_a)).astype(np.float32)  # few values: many ties
    q[rng.random((n, n_a)) < 0.1] = np.nan
    q[0] = np.nan  # a row of NaNs only
    kid_keys = rng.integers(0, 255, (n, n_a, key_len)).astype(np.uint8)
    kids = rng.integers(0, 6, (n, n_a, s)).astype(np.uint8)
    hist = np.zeros((n, n_a + 2, key_len), np.uint8)
    hist_len = rng.integers(1, n_a + 1, n)
    hist_len[1] = n_a + 1  # every child visited: stuck
    for i in range(n):  # history: the children of random actions, then noise
        for h, a in enumerate(rng.permutation(n_a)[:hist_len[i]] if i != 1 else range(n_a)):
            hist[i, h] = kid_keys[i, a]
        if i == 1:
            hist[i, n_a] = 255
    states = np.zeros((n, s), np.uint8)
    want_states, want_hist, want_len = states.copy(), hist.copy(), hist_len.copy()
    want_actions, want_stuck = np.full(n, -1, np.int64), np.zeros(n, np.bool_)
    for i in range(n):
        seen = {bytes(k) for k in hist[i, :hist_len[i]]}
        order = [a for a in np.argsort(-q[i], kind="stable") if bytes(kid_keys[i, a]) not in seen]
        if not order:
            want_stuck[i] = True
            continue
        a = order[0]
        want_states[i] = kids[i, a]
        want_hist[i, want_len[i]] = kid_keys[i, a]
        want_len[i] += 1
        want_actions[i] = a
    actions, stuck = np.full(n, -1, np.int64), np.zeros(n, np.bool_)
    greedy_step(q, np.arange(n), kids, kid_keys, states, hist, hist_len, actions, stuck)
    assert want_stuck[1] and not want_stuck[0] and want_actions[0] >= 0
    np.testing.assert_array_equal(actions, want_actions)
    np.testing.assert_array_equal(stuck, want_stuck)
    np.testing.assert_array_equal(states, want_states)
    np.testing.assert_array_equal(hist, want_hist)
    np.testing.assert_array_equal(hist_len, want_len)


class WithoutChildKeys:
    """The same policy, but search keys the children itself (position_keys of each child)."""

    def __init__(self, policy):
        self.policy = policy

    def q_values(self, states):
        return self.policy.q_values(states)

    def position_keys(self, states):
        return self.policy.position_keys(states)


def scrambles(n, max_depth, n_actions, seed):
    rng = np.random.default_rng(seed)
    return np.stack([apply_moves(P2, P2.solved, rng.integers(0, n_actions, rng.integers(0, max_depth + 1)))
                     for _ in range(n)])


@pytest.mark.parametrize("inputs,symmetry,n_actions", [("pairs", 48, 12), ("pairs", 48, 18), ("pairs", 6, 12),
                                                       ("pairs", 1, 18), ("cubies", 48, 12), ("cubies", 1, 12)])
def test_child_keys_from_the_table_equal_the_childrens_position_keys(inputs, symmetry, n_actions):
    """Policy.q_values_and_child_keys: its Q-values are q_values' bit for bit, and row i*A + a
    of its keys is position_keys of state i's child under action a. A 4-set table (entries
    evicted and refilled), 16-row chunks under 40-state calls, scrambles of 0-5 moves
    (positions repeat, within a call too)."""
    enc = Encoder(P2, n_actions, inputs=inputs, symmetry=symmetry)
    policy = Policy(MLP(Layout(enc.in_dim, enc.n_active, (32,), n_actions), seed=5), enc, chunk=16,
                    child_table_sets=4)
    moves = np.ascontiguousarray(P2.moves[:n_actions])
    for seed in range(6):
        states = scrambles(40, 5, n_actions, seed)
        q, keys = policy.q_values_and_child_keys(states)
        kids = np.empty((40, n_actions, 24), np.uint8)
        expand_children(states, moves, n_actions, kids)
        assert np.array_equal(q, policy.q_values(states))
        assert np.array_equal(keys, policy.position_keys(kids.reshape(-1, 24)))
    table = policy._child_codes
    assert 0 < table.hits < table.lookups == 6 * 40


@pytest.mark.parametrize("encoder,views", [(dict(inputs="stickers", symmetry=48), 1),
                                           (dict(inputs="cubies", canonical=False), 1),
                                           (dict(inputs="pairs", symmetry=48), 2)])
def test_child_keys_are_left_to_the_caller_where_the_table_does_not_apply(encoder, views):
    enc = Encoder(P2, 12, **encoder)
    policy = Policy(MLP(Layout(enc.in_dim, enc.n_active, (32,), 12), seed=5), enc, views=views)
    states = scrambles(10, 5, 12, 0)
    q, keys = policy.q_values_and_child_keys(states)
    assert keys is None and np.array_equal(q, policy.q_values(states))


@pytest.mark.parametrize("search", ["greedy", "beam", "astar"])
@pytest.mark.parametrize("inputs,symmetry", [("pairs", 48), ("cubies", 6)])
def test_searches_find_the_same_solutions_with_child_keys_from_the_table(search, inputs, symmetry):
    """Exact keys give exactly the same search: the same solutions (and failures) with the
    table (4 sets: evictions all along) as with every child keyed by position_keys."""
    enc = Encoder(P2, 12, inputs=inputs, symmetry=symmetry)
    net = MLP(Layout(enc.in_dim, enc.n_active, (32,), 12), seed=11)
    states = scrambles(24, 7, 12, 3)
    fast = Policy(net, enc, child_table_sets=4)
    slow = WithoutChildKeys(Policy(net, enc.fork()))
    a = solve_many(fast, P2, states, 12, search, beam_width=16, max_moves=9)
    b = solve_many(slow, P2, states, 12, search, beam_width=16, max_moves=9)
    assert a[0].any()
    assert np.array_equal(a[0], b[0]) and np.array_equal(a[1], b[1]) and a[3] == b[3]
    assert fast._child_codes.lookups > 0


def test_heap_pops_in_heapqs_order():
    """The kernels' binary heap against heapq on (f, node) pairs with many equal f."""
    import heapq

    from cubedqn.search import heap_pop, heap_push
    rng = np.random.default_rng(2)
    hf, hn = np.empty(500, np.float64), np.empty(500, np.int64)
    size, ref, node = 0, [], 0
    for _ in range(40):
        for _ in range(int(rng.integers(0, 15))):
            f = float(rng.integers(0, 6)) * 0.5
            size = heap_push(hf, hn, size, f, node)
            heapq.heappush(ref, (f, node))
            node += 1
        for _ in range(int(rng.integers(0, 12))):
            if size:
                got, size = heap_pop(hf, hn, size)
                assert got == heapq.heappop(ref)[1]
    assert size == len(ref)


@pytest.mark.parametrize("weight", [0.6, 1.0])
@pytest.mark.parametrize("inputs,symmetry", [("pairs", 48), ("stickers", 1)])
def test_astar_equals_the_heapq_reference(weight, inputs, symmetry):
    """The same solutions (or failures) as reference.astar_search, whose open set is heapq
    and whose best g per position is a dict: with the table's keys (pairs) and with each
    child keyed (stickers); a small node budget and depth limit make some searches give up."""
    from cubedqn.reference import astar_search as astar_reference
    enc = Encoder(P2, 12, inputs=inputs, symmetry=symmetry)
    policy = Policy(MLP(Layout(enc.in_dim, enc.n_active, (32,), 12), seed=13), enc)
    results = []
    for i, state in enumerate(scrambles(30, 8, 12, 9)):
        kw = dict(batch=8 if i % 2 else 32, weight=weight, max_depth=9, max_nodes=3000)
        got = astar_search(policy, state, MOVES, 12, **kw)
        assert got == astar_reference(policy, state, MOVES, 12, **kw)
        results.append(got)
    assert any(r is None for r in results) and sum(r is not None for r in results) > 10


@pytest.mark.parametrize("puzzle,encoder,same", [("cube3", {}, True),
                                                 ("cube2", dict(inputs="stickers", canonical=False), True),
                                                 ("cube2", dict(inputs="stickers", symmetry=48), False),
                                                 ("cube2", dict(inputs="pairs"), False)])
def test_keys_are_states_exactly_when_position_keys_are_the_stickers(puzzle, encoder, same):
    """select_beam takes the stickers as the keys (its one-kernel path) where the policy
    says so: it must say so only where position_keys returns them unchanged."""
    pz = get_puzzle(puzzle)
    enc = Encoder(pz, 12, **encoder)
    policy = Policy(MLP(Layout(enc.in_dim, enc.n_active, (16,), 12), seed=1), enc)
    rng = np.random.default_rng(0)
    states = np.stack([apply_moves(pz, pz.solved, rng.integers(0, 12, 7)) for _ in range(20)])
    assert policy.keys_are_states == same
    if same:
        assert np.array_equal(policy.position_keys(states), states)
    else:
        assert not np.array_equal(policy.position_keys(states), states)
