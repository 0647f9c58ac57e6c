"""Orientation canonicalisation: the action relabelling is exact, and Q-values of one
position seen in any of its 24 orientations agree move for move."""
import numpy as np
import pytest

from cubedqn.cube import apply_moves, get_puzzle
from cubedqn.encoding import Encoder, Policy, action_map, find_rotations
from cubedqn.nn import MLP, Layout
from cubedqn.oracle import load_oracle

P2 = get_puzzle("cube2")


@pytest.mark.parametrize("n_actions", [12, 18])
def test_action_map_is_a_permutation_that_commutes_with_rotation(n_actions):
    amap = action_map(P2, n_actions)
    assert np.array_equal(amap[0], np.arange(n_actions))
    rng = np.random.default_rng(0)
    for r, R in enumerate(P2.rotations):
        assert sorted(amap[r]) == list(range(n_actions))
        s = apply_moves(P2, P2.solved, rng.integers(0, 18, 15))
        for a in range(n_actions):
            # turning with a, then rotating == rotating, then turning with amap[r, a]
            assert np.array_equal(apply_moves(P2, s, [a])[R], apply_moves(P2, s[R], [amap[r, a]]))


def test_canonical_form_puts_dbl_home_and_is_orientation_free(tmp_path, monkeypatch):
    monkeypatch.setenv("CUBEDQN_CACHE_DIR", str(tmp_path))
    enc = Encoder(P2, 12)
    rng = np.random.default_rng(1)
    s = apply_moves(P2, P2.solved, rng.integers(0, 12, 20))
    variants = np.ascontiguousarray(s[P2.rotations])  # the same position in 24 orientations
    rot = np.empty(24, np.int64)
    find_rotations(variants, enc.home_facelets, enc.colours, rot)
    canon = np.array([variants[i][P2.rotations[rot[i]]] for i in range(24)])
    assert len({c.tobytes() for c in canon}) == 1
    assert np.array_equal(canon[0][P2.corner_facelets[6]], P2.corner_colours[6])
    assert len(set(load_oracle("qtm").distances(variants).tolist())) == 1


def test_policy_q_values_agree_across_orientations():
    layout = Layout(144, 24, (32,), 12)
    pol = Policy(MLP(layout, seed=4), Encoder(P2, 12))
    rng = np.random.default_rng(2)
    s = apply_moves(P2, P2.solved, rng.integers(0, 12, 20))
    q = pol.q_values(s)[0]
    for R in P2.rotations:
        qr = pol.q_values(s[R])[0]
        for a in range(12):
            # move a on s corresponds to the move b on s[R] that gives the same rotated child
            child = apply_moves(P2, s, [a])[R]
            b = [b for b in range(12) if np.array_equal(apply_moves(P2, s[R], [b]), child)][0]
            assert qr[b] == pytest.approx(q[a], abs=1e-6)


def test_cube3_encoder_is_identity():
    enc = Encoder(get_puzzle("cube3"), 12)
    assert not enc.canonical


def test_cubie_encoding_solved_identity_and_orientation_free():
    from cubedqn.nn import Workspace
    enc = Encoder(P2, 12, inputs="cubies")
    assert (enc.in_dim, enc.n_active) == (192, 8)
    layout = Layout(enc.in_dim, enc.n_active, (8,), 12)
    ws = Workspace(layout, 24)
    rot = np.zeros(24, np.int64)
    enc.encode(np.ascontiguousarray(P2.solved[P2.rotations]), ws, 0, rot)
    assert np.array_equal(ws.idx, np.tile(24 * np.arange(8) + 3 * np.arange(8), (24, 1)))
    s = apply_moves(P2, P2.solved, np.random.default_rng(3).integers(0, 12, 20))
    enc.encode(np.ascontiguousarray(s[P2.rotations]), ws, 0, rot)
    assert (ws.idx == ws.idx[0]).all() and len(set(ws.idx[0] // 24)) == 8
    with pytest.raises(ValueError, match="cube2"):
        Encoder(get_puzzle("cube3"), 12, inputs="cubies")


def test_training_runs_with_cubie_inputs(tmp_path):
    from cubedqn.config import Config
    from cubedqn.dqn import Trainer, load_policy
    tr = Trainer(Config(hidden=(16,), n_envs=8, batch_size=8, learning_starts=16, buffer_size=500, steps=5,
                        input_encoding="cubies", targets="all-actions"))
    tr.run()
    tr.save(tmp_path / "run")
    cfg, pol = load_policy(tmp_path / "run")
    assert pol.q_values(P2.solved).shape == (1, 12)


def test_pair_encoding_matches_cubie_pairs_and_is_orientation_free():
    from cubedqn.nn import Workspace
    cub, pairs = Encoder(P2, 12, inputs="cubies"), Encoder(P2, 12, inputs="pairs")
    assert (pairs.in_dim, pairs.n_active) == (21 * 441, 21)
    rng = np.random.default_rng(5)
    # random positions, each seen in a random whole-cube orientation
    states = np.stack([apply_moves(P2, P2.solved, rng.integers(0, 18, 25))[P2.rotations[rng.integers(24)]]
                       for _ in range(20)])
    ws_c = Workspace(Layout(192, 8, (4,), 12), 20)
    ws_p = Workspace(Layout(pairs.in_dim, 21, (4,), 12), 20)
    rot = np.zeros(20, np.int64)
    cub.encode(states, ws_c, 0, rot)
    pairs.encode(states, ws_p, 0, rot)
    free = [0, 1, 2, 3, 4, 5, 7]  # slot 6 (DBL) always holds cubie 6, untwisted
    for i in range(20):
        v = ws_c.idx[i] - 24 * np.arange(8)          # 3*cubie + twist per slot
        assert v[6] == 3 * 6
        v = np.where(v >= 21, v - 3, v)[free]        # cubie 7 -> 6: seven free cubies
        expect = [441 * p + 21 * v[k] + v[l] for p, (k, l) in
                  enumerate((k, l) for k in range(7) for l in range(k + 1, 7))]
        assert ws_p.idx[i].tolist() == expect
    with pytest.raises(ValueError, match="canonical"):
        Encoder(P2, 12, canonical=False, inputs="pairs")


@pytest.mark.parametrize("views", [6, 48])
def test_symmetry_views_make_q_values_exactly_symmetric(views):
    from cubedqn.cube import symmetries
    perm, cmap, mmap = symmetries("cube2")
    net = MLP(Layout(192, 8, (32,), 12), seed=1)
    plain, sym = Policy(net, Encoder(P2, 12, inputs="cubies")), \
        Policy(net, Encoder(P2, 12, inputs="cubies"), views=views)
    s = apply_moves(P2, P2.solved, np.random.default_rng(6).integers(0, 12, 20))
    q = sym.q_values(s)[0]
    manual = np.mean([plain.q_values(cmap[k][s[perm[k]]])[0][mmap[k, :12]] for k in range(views)], axis=0)
    np.testing.assert_allclose(q, manual, rtol=1e-5, atol=1e-6)
    for k in range(views):  # the views form a group (S3 keeping DBL, or all 48): invariance is exact
        qk = sym.q_values(cmap[k][s[perm[k]]])[0]
        np.testing.assert_allclose(qk[mmap[k, :12]], q, rtol=1e-5, atol=1e-6)
    assert not np.allclose(plain.q_values(s)[0], q)
    with pytest.raises(ValueError, match="between 1 and 48"):
        Policy(net, Encoder(P2, 12), views=49)


@pytest.mark.parametrize("inputs,symmetry", [("stickers", 6), ("cubies", 48), ("pairs", 6), ("pairs", 48)])
def test_symmetric_input_sends_symmetric_images_to_one_input(inputs, symmetry):
    """With input symmetry 6 (48) the images of a position under the symmetries that keep
    DBL home (under all of them), each in a random orientation, encode identically, and
    their Q-values are the same numbers on corresponding moves."""
    from cubedqn.cube import symmetries
    from cubedqn.nn import Workspace
    perm, cmap, _ = symmetries("cube2")
    enc = Encoder(P2, 12, inputs=inputs, symmetry=symmetry)
    assert enc.act_map.shape == (24 * (1152 if symmetry == 48 else 6), 12)  # rotation x view
    pol = Policy(MLP(Layout(enc.in_dim, enc.n_active, (16,), 12), seed=2), enc)
    ws = Workspace(Layout(enc.in_dim, enc.n_active, (4,), 12), symmetry)
    rot = np.zeros(symmetry, np.int64)
    rng = np.random.default_rng(7)
    for _ in range(3):
        s = apply_moves(P2, P2.solved, rng.integers(0, 12, 20))
        R = P2.rotations[rng.integers(0, 24, symmetry)]
        images = np.ascontiguousarray([cmap[k][s[perm[k]]][R[k]] for k in range(symmetry)])
        enc.encode(images, ws, 0, rot)
        assert (ws.idx == ws.idx[0]).all()
        q, qi = pol.q_values(s)[0], pol.q_values(images)
        for k in range(symmetry):
            for a in range(12):
                # the move on image k whose child is the image of s's child under a
                child = cmap[k][apply_moves(P2, s, [a])[perm[k]]][R[k]]
                b = [b for b in range(12) if np.array_equal(apply_moves(P2, images[k], [b]), child)]
                assert len(b) == 1 and qi[k, b[0]] == pytest.approx(q[a], abs=1e-6)
    plain = Encoder(P2, 12, inputs=inputs)  # without symmetry the images are different inputs
    plain.encode(images, ws, 0, rot)
    assert len({r.tobytes() for r in ws.idx}) > 1
    with pytest.raises(ValueError, match="canonical"):
        Encoder(P2, 12, canonical=False, symmetry=6)
    with pytest.raises(ValueError, match="1, 6 or 48"):
        Encoder(P2, 12, symmetry=8)


@pytest.mark.parametrize("inputs,symmetry", [("stickers", 1), ("pairs", 48)])
def test_position_keys_identify_exactly_the_positions_the_encoder_identifies(inputs, symmetry):
    """Keys are equal for the same position turned (and, with 48 symmetries, mirrored or
    recoloured by a symmetry), different for different positions, and equal keys always
    mean equal network inputs."""
    from cubedqn.cube import symmetries
    from cubedqn.nn import Workspace
    perm, cmap, _ = symmetries("cube2")
    enc = Encoder(P2, 12, inputs=inputs, symmetry=symmetry)
    rng = np.random.default_rng(3)
    states = np.stack([apply_moves(P2, P2.solved, rng.integers(0, 12, 14)) for _ in range(40)])
    keys = enc.position_keys(states)
    assert keys.dtype == np.uint8 and len({k.tobytes() for k in keys}) == len({s.tobytes() for s in states})
    for s, key in zip(states[:5], keys[:5]):
        turned = np.ascontiguousarray(s[P2.rotations])
        assert (enc.position_keys(turned) == key).all()
        images = np.ascontiguousarray([cmap[k][s[perm[k]]] for k in range(48)])
        same = (enc.position_keys(images) == key).all(axis=1)
        assert same.all() if symmetry == 48 else (same.sum() < 48 and same[0])
    # a position's mirror image is a different key without symmetry: count distinct keys
    ws = Workspace(Layout(enc.in_dim, enc.n_active, (4,), 12), len(states))
    enc.encode(states, ws, 0, np.zeros(len(states), np.int64))
    by_key = {}
    for k, row in zip(keys, ws.idx):
        assert by_key.setdefault(k.tobytes(), row.tobytes()) == row.tobytes()
    cube3 = get_puzzle("cube3")
    s3 = np.stack([cube3.solved, apply_moves(cube3, cube3.solved, [0])])
    assert np.array_equal(Encoder(cube3, 12).position_keys(s3), s3)  # no symmetry: the stickers


@pytest.mark.parametrize("inputs,symmetry,sparse", [("stickers", 1, True), ("stickers", 1, False),
                                                    ("stickers", 48, True), ("pairs", 1, True)])
def test_encode_without_codes_writes_the_same_inputs_and_frames(inputs, symmetry, sparse):
    """want_codes=False (the training and acting path) skips the corner codes only where
    the input does not need them; inputs and frames are those of the full encode, and
    find_rotations agrees with reading each rotation's permutation."""
    from cubedqn.nn import Workspace
    enc = Encoder(P2, 12, inputs=inputs, symmetry=symmetry, sparse=sparse)
    rng = np.random.default_rng(4)
    states = np.ascontiguousarray(np.stack([apply_moves(P2, P2.solved, rng.integers(0, 12, 25))[P2.rotations[r]]
                                            for r in rng.integers(0, 24, 40)]))
    layout = Layout(enc.in_dim, enc.n_active, (4,), 12)
    full, lean = (Workspace(layout, 40, dense_input=not sparse) for _ in range(2))
    rot_full, rot_lean = np.zeros(40, np.int64), np.zeros(40, np.int64)
    codes = enc.encode(states, full, 0, rot_full)
    got = enc.encode(states, lean, 0, rot_lean, want_codes=False)
    np.testing.assert_array_equal(rot_full, rot_lean)
    np.testing.assert_array_equal(full.idx, lean.idx)
    np.testing.assert_array_equal(full.x, lean.x)
    assert codes is not None and (got is None) == (inputs == "stickers" and symmetry == 1)
    by_permutation = [next(r for r in range(24) if np.array_equal(s[P2.rotations[r]][enc.fac], enc.colours))
                      for s in states]
    find_rotations(states, enc.home_facelets, enc.colours, rot_lean)
    np.testing.assert_array_equal(rot_lean, by_permutation)


@pytest.mark.parametrize("symmetry", [1, 48])
def test_framed_stickers_list_the_dbl_slot_first_and_the_first_layer_folds_it(symmetry):
    """In a frame the DBL cubie is home and untwisted, so framed sticker inputs list its
    three stickers first (framed_order): those columns are then the same in every row, the
    first layer adds their W1 rows once (nn._constant_prefix reads 3), and each row holds
    the W1 rows encode_onehot_framed sets, so Q-values match the dense one-hot input's."""
    from cubedqn.encoding import framed_order
    from cubedqn.nn import Workspace, _constant_prefix
    order = framed_order(P2)
    assert list(order[:3]) == list(P2.corner_facelets[6])
    assert sorted(order.tolist()) == list(range(P2.n_stickers))
    enc = Encoder(P2, 12, symmetry=symmetry)
    dense = Encoder(P2, 12, symmetry=symmetry, sparse=False)
    assert np.array_equal(enc.sticker_order, order)
    rng = np.random.default_rng(7)
    states = np.ascontiguousarray(np.stack([apply_moves(P2, P2.solved, rng.integers(0, 12, 15))[P2.rotations[r]]
                                            for r in rng.integers(0, 24, 64)]))
    layout = Layout(enc.in_dim, enc.n_active, (64, 32), 12)
    sparse_ws, lean_ws = Workspace(layout, 64), Workspace(layout, 64)
    dense_ws = Workspace(layout, 64, dense_input=True)
    rot, rot_lean, rot_dense = (np.zeros(64, np.int64) for _ in range(3))
    enc.encode(states, sparse_ws, 0, rot)
    enc.encode(states, lean_ws, 0, rot_lean, want_codes=False)  # the training path's kernel (symmetry 1)
    dense.encode(states, dense_ws, 0, rot_dense)
    np.testing.assert_array_equal(rot, rot_dense)
    np.testing.assert_array_equal(sparse_ws.idx, lean_ws.idx)
    assert _constant_prefix(sparse_ws.idx) == 3
    assert (sparse_ws.idx[:, :3] == 6 * order[:3] + P2.corner_colours[6]).all()
    for i in range(64):
        assert np.array_equal(np.sort(sparse_ws.idx[i]), np.flatnonzero(dense_ws.x[i]))
    net = MLP(layout, seed=3)
    q_dense = MLP(layout, net.params.copy(), sparse=False).forward_ws(dense_ws, 64)
    np.testing.assert_allclose(net.forward_ws(sparse_ws, 64), q_dense, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("symmetry", [6, 48])
def test_frame_is_the_smallest_image_with_dbl_home_first_view_on_ties(symmetry):
    """choose_frame against a plain search: every view of the canonical state x (all n_view
    of them, through the encoder's own frame tables) whose image has the DBL cubie home
    untwisted is a candidate; the frame is the one whose corner codes are smallest
    lexicographically, the lowest view among equal ones; codes are that image's."""
    from cubedqn.encoding import corner_code
    enc = Encoder(P2, 12, inputs="pairs", symmetry=symmetry)
    rng = np.random.default_rng(11)
    states = [apply_moves(P2, P2.solved, rng.integers(0, 12, d))[P2.rotations[r]]
              for d, r in zip(rng.integers(0, 14, 60), rng.integers(0, 24, 60))]
    states.append(P2.solved)  # every view of the solved cube ties
    states = np.ascontiguousarray(states)
    n = len(states)
    frame, codes = np.zeros(n, np.int64), np.zeros((n, 8), np.int64)
    enc.frames(states, frame, codes)
    identity = np.arange(P2.n_stickers)
    r0 = np.zeros(n, np.int64)
    find_rotations(states, enc.home_facelets, enc.colours, r0)
    for i, s in enumerate(states):
        best = None
        for v in range(enc.n_view):
            f = r0[i] * enc.n_view + v
            image = enc.frame_cmap[f][s[enc.frame_perm[f]]]
            key = tuple(corner_code(image, identity, enc._identity_cmap, enc.corner_facelets[j], enc.corner_lookup)
                        for j in range(8))
            if key[6] == 18 and (best is None or key < best[0]):
                best = (key, f)
        assert frame[i] == best[1] and tuple(codes[i]) == best[0]


def test_corner_tables_match_a_corner_at_a_time(monkeypatch):
    """encoding.corner_tables (numpy, all views at once) against the plain loop: each
    (slot, cubie, twist) placed on a blank cube, read through each view by corner_code."""
    from cubedqn import encoding
    calls = []

    def recording(*args):
        encoding_tables(*args)
        calls.append(args)

    encoding_tables = encoding.corner_tables
    monkeypatch.setattr(encoding, "corner_tables", recording)
    Encoder(P2, 12, inputs="pairs", symmetry=48)
    assert len(calls) == 2  # the views, and the symmetries that keep DBL home
    code = encoding.corner_code.py_func
    for perm, cmap, facelets, colours, lookup, slot_of, slot_map, code_map in calls:
        for v in range(0, len(perm), 7):
            inv = np.argsort(perm[v])
            x = np.zeros(perm.shape[1], np.uint8)
            for j, fj in enumerate(facelets):
                j2 = slot_of[inv[fj[0]]]
                assert slot_map[v, j] == j2
                for cubie in range(len(colours)):
                    for t in range(3):
                        x[fj[t]], x[fj[(t + 1) % 3]], x[fj[(t + 2) % 3]] = colours[cubie]
                        assert code_map[v, j, 3 * cubie + t] == code(x, perm[v], cmap[v], facelets[j2], lookup)


def _scrambles(p, n, seed):
    rng = np.random.default_rng(seed)
    return np.stack([apply_moves(p, p.solved, list(rng.integers(0, 18, int(rng.integers(0, 25)))))
                     for _ in range(n)])


@pytest.mark.parametrize("name,canonical,symmetry", [("cube3", False, 1), ("cube2", True, 1), ("cube2", False, 1),
                                                     ("cube2", True, 48)])
def test_cubie_tables_list_every_state_the_encoder_writes(name, canonical, symmetry):
    """The first layer's tables (InputGroups) hold every value a cubie's stickers take in
    encoded states (in frames and symmetric views too); stickers that are no state of the
    puzzle are not listed (those calls sum W1 rows)."""
    from cubedqn.nn import Workspace, _table_codes
    p = get_puzzle(name)
    enc = Encoder(p, 12, canonical=canonical, symmetry=symmetry)
    groups = enc.input_groups
    assert groups.n_groups == {"cube3": 26, "cube2": 8}[name]
    assert groups.n_tables == {"cube3": 6 * 6 + 8 * 24 + 12 * 24, "cube2": 8 * 24}[name]
    layout = Layout(enc.in_dim, enc.n_active, (32,), 12)
    ws = Workspace(layout, 300)
    states = _scrambles(p, 300, 1)
    enc.encode(states, ws, 0, np.zeros(300, np.int64))
    codes = np.zeros((300, groups.n_groups), np.int32)
    assert _table_codes(ws.idx, groups.tables, codes)
    t_order, t_starts = groups.tables[4], groups.tables[5]
    for i in (0, 7, 299):  # a row's table rows hold exactly its W1 rows
        rows = sorted(int(r) for t in codes[i] for r in t_order[t_starts[t]:t_starts[t + 1]])
        assert rows == sorted(ws.idx[i].tolist())
    ws.idx[5, :] = np.arange(enc.n_active) * 6  # every sticker colour 0: no state
    assert not _table_codes(ws.idx, groups.tables, codes)


def test_network_with_cubie_tables_sums_the_tables_and_agrees_with_stickers():
    """A workspace whose rows pay for the tables: its first layer is the sequential sums
    of table rows (each the sum of its W1 rows) bit for bit, the Q-values agree with the
    sticker sums to float32 rounding; a batch with stickers of no state sums W1 rows."""
    from cubedqn.nn import Workspace, _table_codes
    p = get_puzzle("cube3")
    enc = Encoder(p, 12, canonical=False)
    layout = Layout(enc.in_dim, enc.n_active, (64, 32), 12)
    net = MLP(layout, seed=4)
    rows = 320
    tabled, plain = Workspace(layout, rows, groups=enc.input_groups), Workspace(layout, rows)
    assert tabled.groups[5].size - 1 == enc.input_groups.n_tables and plain.groups[5].size == 1
    assert Workspace(layout, 182, groups=enc.input_groups).groups[5].size == 1  # too few rows to pay
    states = _scrambles(p, rows, 2)
    for ws in (tabled, plain):
        enc.encode(states, ws, 0, np.zeros(rows, np.int64))
    q_t, q_p = net.forward_ws(tabled, rows).copy(), net.forward_ws(plain, rows).copy()
    np.testing.assert_allclose(q_t, q_p, rtol=1e-4, atol=1e-4)
    codes = np.zeros((rows, 26), np.int32)
    assert _table_codes(tabled.idx, enc.input_groups.tables, codes)
    t_order, t_starts = enc.input_groups.tables[4], enc.input_groups.tables[5]
    W, b = net.Ws[0], net.bs[0]
    table = np.zeros((len(t_starts) - 1, W.shape[1]), np.float32)
    for t in range(len(table)):
        for r in t_order[t_starts[t]:t_starts[t + 1]]:
            table[t] += W[r]
    want = np.repeat(b[None], rows, 0)
    for k in range(codes.shape[1]):
        want += table[codes[:, k]]
    np.testing.assert_array_equal(tabled.acts[0][:rows], np.maximum(want, 0))
    assert not np.array_equal(tabled.acts[0][:rows], plain.acts[0][:rows])  # another order of adds
    tabled.idx[3] = np.arange(54) * 6  # no state: the whole call sums W1 rows, as the plain one
    plain.idx[3] = tabled.idx[3]
    np.testing.assert_array_equal(net.forward_ws(tabled, rows), net.forward_ws(plain, rows))
