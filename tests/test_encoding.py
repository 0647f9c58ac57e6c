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
    find_rotations(variants, enc.rotations, enc.fac, enc.colours, rot)
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
