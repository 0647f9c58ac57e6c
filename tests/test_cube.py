"""Cube model: group identities, notation, facelets (round trips, hand-computed states,
each validation failure), batched kernels vs the pure-Python model, the exact oracle."""
import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from cubedqn.cube import (CubeError, apply_actions, apply_moves, encode_index,
                          encode_onehot, expand_children, format_moves, from_facelets, get_puzzle,
                          invert_moves, is_solved, parse_moves, scramble_into, solved_batch,
                          sticker_order, to_facelets)
from cubedqn.oracle import PUBLISHED_COUNTS, decode_states, load_oracle
from cubedqn.rng import make_rng

PUZZLES = ["cube2", "cube3"]
SOLVED3 = "UUUUUUUUURRRRRRRRRFFFFFFFFFDDDDDDDDDLLLLLLLLLBBBBBBBBB"


@pytest.mark.parametrize("name", PUZZLES)
def test_quarter_turns_have_order_4_and_inverses(name):
    p = get_puzzle(name)
    rng = np.random.default_rng(0)
    start = apply_moves(p, p.solved, rng.integers(0, 18, 30))
    for a in range(12):
        s = start
        for k in range(4):
            s = apply_moves(p, s, [a])
            assert (k == 3) == bool(np.array_equal(s, start))
        assert np.array_equal(apply_moves(p, start, [a, a ^ 1]), start)
    for a in range(12, 18):
        q = 2 * (a - 12)
        assert np.array_equal(apply_moves(p, start, [a]), apply_moves(p, start, [q, q]))


@pytest.mark.parametrize("name", PUZZLES)
def test_sexy_move_six_times_is_identity(name):
    p = get_puzzle(name)
    seq = parse_moves("R U R' U'")
    s = p.solved
    for k in range(1, 7):
        s = apply_moves(p, s, seq)
        assert np.array_equal(s, p.solved) == (k == 6)


def test_known_facelet_strings():
    p = get_puzzle("cube3")
    assert to_facelets(p.solved) == SOLVED3
    # R turns the F column up onto U: the standard example from Kociemba's format.
    assert to_facelets(apply_moves(p, p.solved, parse_moves("R"))) == \
        "UUFUUFUUFRRRRRRRRRFFDFFDFFDDDBDDBDDBLLLLLLLLLUBBUBBUBB"
    # The superflip, every edge flipped in place; the string follows by hand from the net.
    superflip = "U R2 F B R B2 R U2 L B2 R U' D' R2 F R' L B2 U2 F2"
    assert to_facelets(apply_moves(p, p.solved, parse_moves(superflip))) == \
        "UBULURUFURURFRBRDRFUFLFRFDFDFDLDRDBDLULBLFLDLBUBRBLBDB"
    p2 = get_puzzle("cube2")
    assert to_facelets(apply_moves(p2, p2.solved, parse_moves("R"))) == "UFUFRRRRFDFDDBDBLLLLUBUB"


def test_move_parsing_and_errors():
    assert parse_moves("R  U2\tF'\n") == [6, 12, 9]
    assert parse_moves("R2", metric="qtm") == [6, 6]
    assert format_moves([6, 12, 9]) == "R U2 F'"
    with pytest.raises(CubeError, match=r"unknown move 'X' at position 2"):
        parse_moves("R X U")
    with pytest.raises(CubeError, match="unknown metric"):
        parse_moves("R", metric="foo")


@settings(max_examples=60, deadline=None)
@given(st.sampled_from(PUZZLES), st.lists(st.integers(0, 17), max_size=40))
def test_scramble_then_inverse_is_solved_and_facelets_round_trip(name, seq):
    p = get_puzzle(name)
    s = apply_moves(p, p.solved, seq)
    assert np.array_equal(from_facelets(p, to_facelets(s)), s)
    assert is_solved(apply_moves(p, s, invert_moves(seq)))
    assert parse_moves(format_moves(seq)) == seq


@settings(max_examples=30, deadline=None)
@given(st.sampled_from(PUZZLES), st.lists(st.integers(0, 17), min_size=1, max_size=20), st.integers(1, 8))
def test_batched_kernels_match_python_model(name, seq, n):
    p = get_puzzle(name)
    states = np.repeat(apply_moves(p, p.solved, seq)[None], n, axis=0)
    actions = np.arange(n) % 18
    out = np.empty_like(states)
    apply_actions(states, actions, p.moves, out)
    for i in range(n):
        assert np.array_equal(out[i], apply_moves(p, states[i], [actions[i]]))
    kids = np.empty((n, 18, p.n_stickers), np.uint8)
    expand_children(states, p.moves, 18, kids)
    assert np.array_equal(kids[0, 5], apply_moves(p, states[0], [5]))
    solved = np.empty(n, np.bool_)
    solved_batch(out, solved)
    assert [bool(v) for v in solved] == [is_solved(o) for o in out]
    idx = np.empty((n, p.n_stickers), np.int32)
    encode_index(out, sticker_order(p), idx)
    x = np.empty((n, p.n_stickers * 6), np.float32)
    encode_onehot(out, x)
    assert np.array_equal(np.flatnonzero(x[0]), np.sort(idx[0]))
    assert x.sum() == n * p.n_stickers


@pytest.mark.parametrize("name", PUZZLES)
def test_sticker_order_lists_the_stickers_no_move_moves_first(name):
    """The 3x3x3's six centres (no face turn moves them), then every other sticker in
    order; the 2x2x2 has none, so its order is the identity. The centres' index columns
    are then the same for every state."""
    p = get_puzzle(name)
    order = sticker_order(p)
    fixed = sorted(int(c) for c in p.centre_facelets)
    assert list(order[:len(fixed)]) == fixed
    assert list(order[len(fixed):]) == [j for j in range(p.n_stickers) if j not in fixed]
    states = np.stack([apply_moves(p, p.solved, [a, (5 * a + 3) % 18]) for a in range(18)])
    idx = np.empty((len(states), p.n_stickers), np.int32)
    encode_index(states, order, idx)
    assert (idx[:, :len(fixed)] == idx[0, :len(fixed)]).all()
    assert len(fixed) == p.n_stickers or not (idx[:, len(fixed)] == idx[0, len(fixed)]).all()


def test_scramble_kernel_is_seeded_and_never_undoes():
    p = get_puzzle("cube3")
    runs = []
    for _ in range(2):
        st_ = np.repeat(p.solved[None], 50, axis=0)
        rec = np.empty((50, 25), np.int8)
        scramble_into(st_, np.full(50, 25), p.moves, 12, make_rng(4), True, rec)
        runs.append((st_, rec))
    assert np.array_equal(runs[0][0], runs[1][0])
    rec = runs[0][1]
    assert np.all(rec[:, 1:] != (rec[:, :-1] ^ 1))
    for i in range(50):
        assert np.array_equal(runs[0][0][i], apply_moves(p, p.solved, rec[i]))


def test_2x2_all_orientations_are_solved():
    p = get_puzzle("cube2")
    out = np.empty(24, np.bool_)
    solved_batch(np.ascontiguousarray(p.solved[p.rotations]), out)
    assert out.all()
    assert len({r.tobytes() for r in p.rotations}) == 24
    assert is_solved(apply_moves(p, p.solved, parse_moves("R L'")))  # a whole-cube rotation


@pytest.mark.parametrize("text, message", [
    (SOLVED3[:-1], "must have 54 letters, got 53"),
    (SOLVED3[:-1] + "X", "invalid letter 'X' at position 54"),
    ("R" + SOLVED3[1:], "colour U appears 8 times, expected 9"),
    (SOLVED3[:4] + "R" + SOLVED3[5:13] + "U" + SOLVED3[14:], "centre of face U is R"),
])
def test_invalid_facelets_basic(text, message):
    with pytest.raises(CubeError, match=message):
        from_facelets(get_puzzle("cube3"), text)


def _swap(text, i, j):
    t = list(text)
    t[i], t[j] = t[j], t[i]
    return "".join(t)


def test_invalid_facelets_cubies_and_solvability():
    p = get_puzzle("cube3")
    c = p.corner_facelets
    e = p.edge_facelets
    # Twist one corner in place: rotate its three stickers.
    t = list(SOLVED3)
    a, b, d = c[0]
    t[a], t[b], t[d] = SOLVED3[d], SOLVED3[a], SOLVED3[b]
    with pytest.raises(CubeError, match="corner twist"):
        from_facelets(p, "".join(t))
    with pytest.raises(CubeError, match="edge flip"):
        from_facelets(p, _swap(SOLVED3, *e[0]))
    # Swap two edges (both stickers): permutation parity.
    t = list(SOLVED3)
    for k in range(2):
        t[e[0][k]], t[e[1][k]] = SOLVED3[e[1][k]], SOLVED3[e[0][k]]
    with pytest.raises(CubeError, match="parities differ"):
        from_facelets(p, "".join(t))
    # A corner with two U stickers cannot exist (counts still fine).
    with pytest.raises(CubeError, match="no corner has colours"):
        from_facelets(p, _swap(SOLVED3, c[0][1], c[1][0] + 1))
    with pytest.raises(CubeError, match="no edge has colours"):
        from_facelets(p, _swap(SOLVED3, e[0][1], e[5][0]))  # UR gets U+D
    p2 = get_puzzle("cube2")
    s2 = to_facelets(p2.solved)
    a, b, d = p2.corner_facelets[0]
    t = list(s2)
    t[a], t[b], t[d] = s2[d], s2[a], s2[b]
    with pytest.raises(CubeError, match="corner twist"):
        from_facelets(p2, "".join(t))
    with pytest.raises(CubeError, match="must have 24 letters"):
        from_facelets(p2, SOLVED3)


def test_unknown_puzzle():
    with pytest.raises(CubeError, match="unknown puzzle 'cube4'"):
        get_puzzle("cube4")


@pytest.mark.parametrize("metric", ["qtm", "htm"])
def test_oracle_matches_published_counts(metric, tmp_path, monkeypatch):
    monkeypatch.setenv("CUBEDQN_CACHE_DIR", str(tmp_path))
    oracle = load_oracle(metric)
    assert oracle.counts() == PUBLISHED_COUNTS[metric]
    assert sum(oracle.counts()) == 3674160
    assert (tmp_path / f"oracle-cube2-{metric}-v1.npy").exists()
    assert load_oracle(metric).counts() == PUBLISHED_COUNTS[metric]  # from the cache


def test_oracle_distances_agree_with_scrambles_in_any_orientation(tmp_path, monkeypatch):
    monkeypatch.setenv("CUBEDQN_CACHE_DIR", str(tmp_path))
    oracle = load_oracle("qtm")
    p = get_puzzle("cube2")
    rng = np.random.default_rng(0)
    for depth in range(0, 6):
        for _ in range(5):
            seq = rng.integers(0, 12, depth)
            s = apply_moves(p, p.solved, seq)
            d = oracle.distances(s)[0]
            assert d <= depth and d % 2 == depth % 2  # QTM: parity of distance is fixed
            for r in p.rotations[::5]:
                assert oracle.distances(s[r])[0] == d
    assert oracle.distances(apply_moves(p, p.solved, parse_moves("R U")))[0] == 2
    # Decode/encode round trip over random indices.
    idx = rng.integers(0, 3674160, 1000)
    assert np.array_equal(oracle.indices(decode_states(idx)), idx)


@pytest.mark.parametrize("name", ["cube2", "cube3"])
def test_symmetries_are_a_group_that_conjugates_moves(name):
    from cubedqn.cube import conjugate_states, symmetries
    p = get_puzzle(name)
    perm, cmap, mmap = symmetries(name)
    assert len({x.tobytes() for x in perm}) == 48
    assert np.array_equal(perm[0], np.arange(p.n_stickers)) and np.array_equal(mmap[0], np.arange(18))
    keys = {(perm[k].tobytes(), cmap[k].tobytes()) for k in range(48)}
    rng = np.random.default_rng(0)
    s = np.stack([apply_moves(p, p.solved, rng.integers(0, 18, 25)) for _ in range(3)])
    dbl = set(p.corner_facelets[6].tolist())
    for k in range(48):
        def conj(x, k=k):
            return cmap[k][x[..., perm[k]]]
        assert np.array_equal(conj(p.solved), p.solved)
        out = np.empty_like(s)
        conjugate_states(s, perm[k], cmap[k], out)
        assert np.array_equal(out, conj(s))
        # conj(s . a) == conj(s) . move_map[a]; quarter turns stay quarter turns
        assert sorted(mmap[k].tolist()) == list(range(18)) and (mmap[k, :12] < 12).all()
        for a in range(18):
            assert np.array_equal(conj(s[:, p.moves[a]]), conj(s)[:, p.moves[mmap[k, a]]])
        # closed under composition: conj_j(conj_k(x)) is again one of the 48
        j = (k * 7 + 3) % 48
        assert (perm[k][perm[j]].tobytes(), cmap[j][cmap[k]].tobytes()) in keys
        # the first six keep the DBL corner's stickers on that corner
        assert (set(perm[k][list(dbl)].tolist()) == dbl) == (k < 6)
    # a mirror turns a clockwise quarter turn into an anticlockwise one
    assert any(mmap[k, 0] % 2 == 1 for k in range(48))
