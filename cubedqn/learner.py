"""The learner: one DQN gradient step over a sampled batch, from targets to update.

What this file is: the online network, the target network, gradients and the optimizer,
all in the flat layout, plus the preallocated workspaces for one batch size. A step is a
handful of Numba calls, each timed into a phase (forward, backward, optimizer); for dqn
and double targets the same kernels run as one call (fused_sampled_step, below), which
reads the clock between parts for the same timings:

  targets "double" (default): online forward on [s; s'] as one 2B-row GEMM chain, target
      forward on s'; y = r + gamma^n (1 - done) Q_target(s', argmax_a Q_online(s', a)).
  targets "dqn": y = r + gamma^n (1 - done) max_a Q_target(s', a).
  For both, only the transitions that bootstrap (gamma^n (1 - done) != 0) have their s'
  scored: the target net's rows are those s', and with double targets a terminal row's
  s' in the online net's rows is its s (bootstrapped_rows, next_state_rows). A terminal
  transition's y is r either way; this saves its share of the target forward.
  targets "all-actions": uses the cube model. For each sampled s, all children c_a are
      formed and the target network scores them; every action is trained at once with
      y_a = -1 if c_a is solved else -1 + gamma * max_a' Q_target(c_a, a'). With the
      canonical 2x2x2 encoder only the 6 (QTM) distinct children are scored, and with
      target_cache a child whose max_a' Q_target was computed since the last target copy
      is not scored again (the table sits below all_action_targets).

Gradient accumulation splits the batch into k micro-batches and applies one update.
LOMO applies each layer's update during backward, as soon as its gradient is known, with
per-layer clipping (see optim.py) and no full gradient buffer.
sparse_update (lazy first-layer updates) keeps the first layer's gradient zero outside the
rows the batch touched and updates only those rows, from a compact block of those rows'
gradients (nn.sparse_backward_compact, Optimizer.step_rows; the gradient buffer then holds
b1 and the layers above only): what makes wide sparse inputs such as slot pairs affordable.

What it is not: acting, replay or the training loop (see dqn.py).
"""

from __future__ import annotations

import os
import time

import numpy as np
from numba import njit, types
from numba.experimental import structref

from . import clock
from .calls import entry_point
from .children import ChildCodes, code_key, key_slot, take_rows
from .clock import stamp
from .cube import expand_children, solved_batch
from .encoding import Encoder, actions_to_canonical, encode_rotated_or_plain, rows_to_canonical
from .nn import (LOSSES, MLP, Layout, aligned_zeros, dense_backward, dueling_backward, dueling_forward,
                 loss_full, loss_taken, mlp_backward_first, mlp_backward_upper, mlp_forward_first, mlp_forward_upper,
                 sparse_backward_compact, sparse_backward_panels, views)
from .optim import Optimizer, add_into, clipped_step, polyak_update

TARGETS = ("dqn", "double", "all-actions")
# CUBEDQN_FUSED=0 turns the fused step off (train_step then always takes the per-part path),
# for A/B timings; another value is reported by the CLI (exit 2).
_FUSED_ENV = os.environ.get("CUBEDQN_FUSED", "1").strip()
FUSED_PROBLEM = None if _FUSED_ENV in ("0", "1") else \
    f"CUBEDQN_FUSED={os.environ['CUBEDQN_FUSED']!r} is not one of: 0, 1"
FUSED = _FUSED_ENV != "0"
# By default the fused step wherever it covers the configuration, at any size. What one
# call saves is the per-part path's Python and calls, tens of microseconds: 3% of the small
# step (docs/performance-log.md, stop 40), 1-2% of the large one with Adam on the Zen 4 host
# (stop 61: the cube3 profile command, Adam, eight alternating pairs 0.99-1.08x,
# median 1.02x; bench_peers' large Adam step 0.95-0.99x the per-part one in stop 61's three
# reports, with momentum 0.98-1.02x).
# Stops 41-60 kept it to small GEMM layers (then 0.94-1.07x at the large shape, and its
# compile made a one-CPU cold start of the cube3 preset 13-15 s longer); on two CPUs
# `train` now begins with the per-part step while the second process compiles it
# (precompile.py): the cube3 preset's training began ~1 s later cold (stop 61).


class PhaseTimer:
    """Accumulates wall time per phase; one perf_counter call per phase boundary.

    The forward and backward phases are also split into parts (`parts[phase][name]`, their
    sum is the phase): "encode" (states to input rows, children for all-actions targets),
    "first layer" (the sparse gather / scatter-add, or the dense first GEMM), "GEMM layers"
    (layers 1 .. L-1, one BLAS call each, with bias and ReLU), "targets and loss", "kernel
    call" (the fused step only: the Python around its one kernel call, i.e. passing its
    arguments in and the result out; the per-part path's Python is inside each part's
    time), and "accumulate" (adding micro-batch gradients when grad_accum > 1). LOMO's
    backward, which updates layer by layer, is not split.

    Sources: a learner on the fused step keeps its parts' sums itself (the kernel adds
    them up) and books them here only when `total` or `parts` is read (attach / flush):
    booking each step's nine parts in Python cost 12-15 us of a small training step.
    """

    PHASES = ("env", "act", "replay add", "sample", "forward", "backward", "optimizer",
              "target update", "eval", "other")
    PARTS = {"forward": ("encode", "first layer", "GEMM layers", "targets and loss", "kernel call"),
             "backward": ("GEMM layers", "first layer", "accumulate")}

    def __init__(self):
        self._sources = []  # drain(total, parts): add what a source holds to these dicts (None: drop it)
        self.reset()

    def reset(self):
        for drain in self._sources:
            drain(None, None)
        self._total = dict.fromkeys(self.PHASES, 0.0)
        self._parts = {phase: dict.fromkeys(names, 0.0) for phase, names in self.PARTS.items()}

    def add(self, phase, seconds):
        self._total[phase] += seconds

    def attach(self, drain):
        """Book what `drain` holds whenever the totals are read (from now on)."""
        if drain not in self._sources:
            self._sources.append(drain)

    def detach(self, drain):
        """Book what `drain` holds now and no more from it."""
        if drain in self._sources:
            drain(self._total, self._parts)
            self._sources.remove(drain)

    def flush(self):
        for drain in self._sources:
            drain(self._total, self._parts)

    @property
    def total(self):
        """Seconds per phase (a dict, PHASES' order)."""
        self.flush()
        return self._total

    @property
    def parts(self):
        """Seconds per part of the forward and backward phases (dicts, PARTS' order)."""
        self.flush()
        return self._parts


class Laps:
    """Splits a phase into parts: lap(name) books the time since the previous lap to `name`."""

    __slots__ = ("parts", "last")

    def __init__(self, parts: dict, start: float):
        self.parts, self.last = parts, start

    def lap(self, name):
        t = time.perf_counter()
        self.parts[name] += t - self.last
        self.last = t


@njit(cache=True, nogil=True, error_model="numpy")
def best_action(q, i):
    """The first a with the largest q[i, a]: double DQN's choice of the next action."""
    best = 0
    for a in range(1, q.shape[1]):
        if q[i, a] > q[i, best]:
            best = a
    return best


@njit(cache=True, nogil=True, error_model="numpy")
def bootstrapped_rows(dones, discounts, live):
    """live[:k] = the transitions whose target bootstraps, disc * (1 - done) != 0, in order;
    returns k. The others (terminal ones) need no Q(s', .), and the step scores only these
    rows' s': what a terminal row saves is its share of the target net's forward (and, with
    double targets, a cheaper row in the online net's; next_state_rows)."""
    k = 0
    for i in range(dones.shape[0]):
        if discounts[i] * (1.0 - dones[i]) != 0.0:
            live[k] = i
            k += 1
    return k


@njit(cache=True, nogil=True, error_model="numpy")
def live_targets(q_next_target, live, k, best, rewards, dones, discounts, double, out):
    """y = r + disc * (1 - done) * Q_t(s', a*) where only the rows live[:k]
    (bootstrapped_rows) were scored: row j of q_next_target is transition live[j]'s s',
    valued at best[j] (double: the online net's choice, best_actions) or at its max. The
    others get y = r + disc * (1 - done) * 0, which is r (a finite Q_t there would have
    made it the same)."""
    for i in range(out.shape[0]):
        out[i] = rewards[i] + discounts[i] * (1.0 - dones[i]) * 0.0
    for j in range(k):
        if double:
            v = q_next_target[j, best[j]]
        else:
            v = q_next_target[j, 0]
            for a in range(1, q_next_target.shape[1]):
                if q_next_target[j, a] > v:
                    v = q_next_target[j, a]
        i = live[j]
        out[i] = rewards[i] + discounts[i] * (1.0 - dones[i]) * v


@njit(cache=True, nogil=True)
def next_state_rows(nxt_rows, own_rows, dst, row0, live, k):
    """dst[row0 + i] = nxt_rows[i] where transition i bootstraps (live[:k]), else own_rows[i]:
    the online net's rows of s' with double targets. A terminal row's s' is never used; its
    state in its place makes the pair (s, s) of the sparse GEMMs' lists (halves), which
    lists one row's nonzeros instead of two rows'."""
    j = 0
    for i in range(nxt_rows.shape[0]):
        if j < k and live[j] == i:
            j += 1
            for c in range(nxt_rows.shape[1]):
                dst[row0 + i, c] = nxt_rows[i, c]
        else:
            for c in range(own_rows.shape[1]):
                dst[row0 + i, c] = own_rows[i, c]


@njit(cache=True, nogil=True)
def compact_rows(a, live, k):
    """a[j] = a[live[j]] for j < k (live increasing): the bootstrapped rows first, in order."""
    for j in range(k):
        r = live[j]
        if r != j:
            for c in range(a.shape[1]):
                a[j, c] = a[r, c]


# The fused step: one kernel call for a whole sampled-targets step ("dqn" / "double"), the
# same kernels in the same order as the per-part path of Learner.train_step, so the two give
# the same bits (tested). Why: that path is a dozen Numba calls from Python, and at the
# 2x2x2's 144-256-256-12, batch 64, their calls cost about a tenth of the step.
# It stamps the clock (clock.stamp) at the end of each part, in this order, so the
# PhaseTimer gets the same parts as from the per-part path:
FUSED_PARTS = (("forward", "encode"), ("forward", "first layer"), ("forward", "GEMM layers"),
               ("forward", "first layer"), ("forward", "GEMM layers"), ("forward", "targets and loss"),
               ("backward", "GEMM layers"), ("backward", "first layer"), ("optimizer", None))
# The stamps array: the N_PARTS + 1 stamps of the last step, then each part's nanoseconds
# summed over the steps since the learner last booked them (Learner._drain_parts), then
# the clock's scratch.
N_PARTS = len(FUSED_PARTS)


@njit(cache=True, nogil=True, error_model="numpy")
def best_actions(q, live, out):
    """out[j] = best_action(q, live[j]) for j < len(out): double targets' choice (live_targets),
    and the target net's picks."""
    for j in range(out.shape[0]):
        out[j] = best_action(q, live[j])


@njit(cache=True, nogil=True)
def copy_rows(src, dst, row0):
    """dst[row0 + i] = src[i], element by element (see the note above cube.py's kernels:
    an array assignment would compile its error path, seconds of a cold start)."""
    for i in range(src.shape[0]):
        for j in range(src.shape[1]):
            dst[row0 + i, j] = src[i, j]


@njit(cache=True, nogil=True, error_model="numpy")
def forward_stamped(idx, x, sparse, Ws, bs, acts, q, rows, panel, groups, dueling, stamps, k, halves, picks,
                    head_t):
    """MLP.forward_ws inside the fused step: Q-values of the first `rows` input rows into q
    (rows [0, len(picks)) only at picks[i]); stamps[k] after the first layer, stamps[k + 1]
    after the GEMM layers (and dueling head). No rows: nothing runs (the stamps still)."""
    if rows > 0:
        mlp_forward_first(idx, x, sparse, Ws, bs, acts, rows, panel, groups)
    stamp(stamps, k)
    if rows > 0:
        mlp_forward_upper(Ws, bs, acts, rows, halves, picks, head_t[0])
        if dueling:
            dueling_forward(acts[-1][:rows], q[:rows])
    stamp(stamps, k + 1)


# The one-call step's arguments, as one numba struct (StepArgs: the batch's arrays, the
# encoder's tables, the workspaces, the layers' views of the online and target weights and
# of the gradients, the optimizer's state and constants, the stamps, and `scalars`, where
# each step's learning rate and Adam's bias corrections are written before the call).
# numba unboxes each array argument from its Python object every call, a struct in one go:
# a do-nothing call on 59 of these as separate arguments (the layers' views left out, the
# kernel then making them) and the 3 scalars took 10.5-15.4 us after a 2 MB sweep (what a
# small step moves through the caches; 9.8-12.3 hot), on a StepArgs and the scalars
# 3.4-5.1 (1.5-2.7), and the small step 6-15 us less in process
# (runs/perf37/struct_call.txt, struct_ab.txt).
STEP_FIELDS = ("b_states", "b_next", "b_actions", "b_rewards", "b_dones", "b_discounts", "weights",
               "framed", "enc_sparse", "home_facelets", "colours", "frame_perm", "frame_cmap", "order", "act_map",
               "states", "nxt", "rot", "rot_next", "actions_c", "head_taken", "best_next", "live",
               "sparse", "Ws", "bs", "idx", "x", "acts", "deltas", "q", "dq", "panel", "groups", "head_t",
               "Wts", "bts", "idx_t", "x_t", "acts_t", "q_t", "panel_t", "groups_t", "head_tt",
               "double", "dueling", "y", "td", "scale", "loss_kind",
               "kind", "clip", "max_norm", "params", "grads", "gWs", "gbs", "m_state", "v_state", "slices",
               "mu", "b1", "b2", "eps", "wd", "opt_ctx", "stamps", "scalars")


@structref.register
class StepArgsType(types.StructRef):
    """The numba type of a StepArgs: its fields' types as given (not literal)."""
    def preprocess_fields(self, fields):
        return tuple((name, types.unliteral(typ)) for name, typ in fields)


class StepArgs(structref.StructRefProxy):
    """fused_sampled_step's arguments (STEP_FIELDS) held by numba; made by
    make_step_args, whose cached compile builds it (StructRefProxy's own constructor
    would compile in every process)."""


structref.define_proxy(StepArgs, StepArgsType, STEP_FIELDS)


@njit(cache=True)
def make_step_args(*fields):
    """A StepArgs of STEP_FIELDS' values, in that order."""
    return StepArgs(*fields)


@njit(cache=True, nogil=True, error_model="numpy")
def fused_sampled_step(s):
    """One gradient step on a batch of B transitions (s: a StepArgs; b_* are the batch's
    fields, (B, S) states, (B,) the rest): encode s and s', target forward on s' and online
    forward on s (double: online on s and s' first, then target), targets and loss,
    backward, clipped update with this
    step's learning rate and Adam's bias corrections (s.scalars: Optimizer.step_scalars in
    the buffer's dtype). The layers' weights and gradients (Ws, bs, Wts, bts, gWs, gbs) are
    views of params, the target's parameters and grads. Returns (loss, gradient norm before
    clipping, the number of transitions that bootstrap, whose s' the target net scored:
    bootstrapped_rows); stamps[0..9] get the clock at the start and after each part, and
    stamps[10..18] add up each part's nanoseconds."""
    b_states, b_next, b_actions, b_rewards, b_dones, b_discounts, weights = (
        s.b_states, s.b_next, s.b_actions, s.b_rewards, s.b_dones, s.b_discounts, s.weights)
    framed, enc_sparse, home_facelets, colours, frame_perm, frame_cmap, order, act_map = (
        s.framed, s.enc_sparse, s.home_facelets, s.colours, s.frame_perm, s.frame_cmap, s.order, s.act_map)
    states, nxt, rot, rot_next, actions_c, head_taken, best_next, live = (
        s.states, s.nxt, s.rot, s.rot_next, s.actions_c, s.head_taken, s.best_next, s.live)
    sparse, Ws, bs, idx, x, acts, deltas, q, dq, panel, groups, head_t = (
        s.sparse, s.Ws, s.bs, s.idx, s.x, s.acts, s.deltas, s.q, s.dq, s.panel, s.groups, s.head_t)
    Wts, bts, idx_t, x_t, acts_t, q_t, panel_t, groups_t, head_tt = (
        s.Wts, s.bts, s.idx_t, s.x_t, s.acts_t, s.q_t, s.panel_t, s.groups_t, s.head_tt)
    double, dueling, y, td, scale, loss_kind = s.double, s.dueling, s.y, s.td, s.scale, s.loss_kind
    kind, clip, max_norm, params, grads, gWs, gbs, m_state, v_state, slices = (
        s.kind, s.clip, s.max_norm, s.params, s.grads, s.gWs, s.gbs, s.m_state, s.v_state, s.slices)
    mu, b1, b2, eps, wd, opt_ctx, stamps = s.mu, s.b1, s.b2, s.eps, s.wd, s.opt_ctx, s.stamps
    lr, bc1, bc2 = s.scalars[0], s.scalars[1], s.scalars[2]
    n = states.shape[0]
    # Constant arguments go in as np.int64 / np.bool_: numba compiles a callee once per
    # literal value it is called with (stamp(stamps, 0) .. stamp(stamps, 9) were ten
    # compiles; 16 of a cold cube3 command's 96 with the other such calls, stop 28 in
    # docs/performance-log.md; tests/test_dqn.py checks that none is left)
    stamp(stamps, np.int64(0))
    copy_rows(b_states, states, np.int64(0))  # contiguous copies: the batch's fields are views of its records
    copy_rows(b_next, nxt, np.int64(0))
    encode_rotated_or_plain(framed, enc_sparse, states, home_facelets, colours, frame_perm, frame_cmap, order, rot,
                            idx[:n], x[:n])
    encode_rotated_or_plain(framed, enc_sparse, nxt, home_facelets, colours, frame_perm, frame_cmap, order,
                            rot_next, idx_t[:n], x_t[:n])
    # only the transitions that bootstrap have their s' scored (n_boot of the n rows)
    n_boot = bootstrapped_rows(b_dones, b_discounts, live)
    if double:  # the online net's rows n..2n are the same inputs (a terminal row's: its s)
        next_state_rows(idx_t[:n], idx[:n], idx, n, live, n_boot)
        next_state_rows(x_t[:n], x[:n], x, n, live, n_boot)
    compact_rows(idx_t, live, n_boot)  # the target's rows: those s', in order
    compact_rows(x_t, live, n_boot)
    actions_to_canonical(b_actions, rot, act_map, actions_c)
    stamp(stamps, np.int64(1))
    # the online head's rows of s: only the taken action's value, where head_taken says so
    # (Learner.head_taken); the target's rows of s': with double targets, only the value at
    # the online net's choice (so the online forward goes first), else all (their max)
    picks = head_taken[:n]
    if double:  # rows s, then s' (a state and its successor share more of their zeros: halves)
        forward_stamped(idx, x, sparse, Ws, bs, acts, q, 2 * n, panel, groups, dueling, stamps, np.int64(2), double,
                        picks, head_t)
        best_actions(q[n:2 * n], live, best_next[:n_boot])
        picks_t = best_next[:n_boot if picks.shape[0] > 0 else 0]
        forward_stamped(idx_t, x_t, sparse, Wts, bts, acts_t, q_t, n_boot, panel_t, groups_t, dueling, stamps,
                        np.int64(4), np.bool_(False), picks_t, head_tt)
    else:
        forward_stamped(idx_t, x_t, sparse, Wts, bts, acts_t, q_t, n_boot, panel_t, groups_t, dueling, stamps,
                        np.int64(2), np.bool_(False), best_next[:0], head_tt)
        forward_stamped(idx, x, sparse, Ws, bs, acts, q, n, panel, groups, dueling, stamps, np.int64(4), double,
                        picks, head_t)
    live_targets(q_t[:n_boot], live, n_boot, best_next, b_rewards, b_dones, b_discounts, double, y)
    loss = loss_taken(q[:n], actions_c, y, weights, scale, loss_kind, dq, td, n)
    if dueling:
        dueling_backward(dq[:n], deltas[-1][:n])
    stamp(stamps, np.int64(6))
    # the head's backward from the taken actions alone where Learner.head_taken says so (not dueling)
    mlp_backward_upper(Ws, acts, deltas, gWs, gbs, n, head_taken[:n], head_t)
    stamp(stamps, np.int64(7))
    mlp_backward_first(idx, x, sparse, Ws, deltas, gWs, gbs, n, panel)
    stamp(stamps, np.int64(8))
    norm = clipped_step(kind, clip, max_norm, params, grads, m_state, v_state, slices, lr, mu, b1, b2, eps, bc1,
                        bc2, wd, opt_ctx)
    stamp(stamps, np.int64(9))
    for k in range(N_PARTS):
        stamps[N_PARTS + 1 + k] += stamps[k + 1] - stamps[k]
    return loss, norm, n_boot


@njit(cache=True, error_model="numpy")
def row_max(q, out):
    """out[t] = max_a q[t, a] for the first len(out) rows of q."""
    for t in range(out.shape[0]):
        v = q[t, 0]
        for a in range(1, q.shape[1]):
            if q[t, a] > v:
                v = q[t, a]
        out[t] = v


@njit(cache=True, error_model="numpy")
def all_action_targets(child_max, child_solved, gamma, rep_of, out):
    """out (B,A): y[b,a] = -1 + gamma * max_a' Q_t(child, a') unless the child is solved (then -1).

    child_max / child_solved hold the R representative children of each state (child_max
    their max_a' Q_t, see row_max), entry b*R + rep_of[a] for action a (R = A when every
    child is scored).
    """
    b_n, a_n = out.shape
    n_rep = child_max.shape[0] // b_n
    for b in range(b_n):
        for a in range(a_n):
            r = b * n_rep + rep_of[a]
            out[b, a] = -1.0 if child_solved[r] else -1.0 + gamma * child_max[r]


# The target cache: max_a Q_target of each child position met since the last target update.
# Corner codes (8 x 5 bits) identify a 2x2x2 network input exactly, so they are the key;
# the target's generation goes into the bits above them, so that one comparison checks
# both and a target update invalidates every entry at once (Learner.bump_generation
# clears the table when the generation's bits wrap). The table is 4-way set associative
# (the set from the key alone): a new key takes a stale entry of its set, else the ways
# in turn (first in, first out), so a lookup only reads. In a one-minute `cube2` preset
# run (runs/perf24/value_recur2.txt) a child's value could be found 66.0% of the time at
# most (its first meeting in a generation must miss); with 131,072 entries direct-mapped
# 60.4%, 2-way 64.0%, 4-way 65.7% (65.8% with least-recently-used replacement, which
# makes every hit a write).

GEN_SHIFT = np.uint64(40)
GEN_BITS = 23  # generations 1 .. 2**23 - 1 in a tag; 0 is an empty entry


@njit(cache=True, error_model="numpy")
def target_cache_lookup(codes, child_solved, table_tag, table_val, gen_tag, values, missing):
    """values[i] = cached max Q_t of child i; lists the unsolved children not cached in
    missing[:n]. table_tag / table_val are (sets, ways); gen_tag the current generation's
    tag bits. Returns (n, the number of unsolved children): solved ones need no value."""
    mask = table_tag.shape[0] - 1
    n_miss = n_unsolved = 0
    for i in range(codes.shape[0]):
        if child_solved[i]:
            values[i] = 0.0
            continue
        n_unsolved += 1
        key = code_key(codes, i)
        s = key_slot(key, mask)
        tag = key | (np.uint64(gen_tag) << GEN_SHIFT)
        found = -1
        for w in range(table_tag.shape[1]):
            if table_tag[s, w] == tag:
                found = w
                break
        if found >= 0:
            values[i] = table_val[s, found]
        else:
            missing[n_miss] = i
            n_miss += 1
    return n_miss, n_unsolved


@njit(cache=True, error_model="numpy")
def target_cache_store(row_maxes, codes, missing, n_miss, table_tag, table_val, next_way, gen_tag, values):
    """row_maxes[t] is child missing[t]'s max Q_t (row_max of its scored row): it goes to
    values and to the table, into its set's entry that holds it already (a child met twice
    in one batch), else a stale one, else the way next_way[s] points at (then the next)."""
    mask = table_tag.shape[0] - 1
    ways = table_tag.shape[1]
    g = np.uint64(gen_tag)
    for t in range(n_miss):
        v = row_maxes[t]
        i = missing[t]
        values[i] = v
        key = code_key(codes, i)
        s = key_slot(key, mask)
        tag = key | (g << GEN_SHIFT)
        victim = -1
        for w in range(ways):
            if table_tag[s, w] == tag:
                victim = w
                break
        if victim < 0:
            for w in range(ways):
                if table_tag[s, w] >> GEN_SHIFT != g:
                    victim = w
                    break
        if victim < 0:
            victim = next_way[s]
            next_way[s] = (victim + 1) % ways
        table_tag[s, victim] = tag
        table_val[s, victim] = v


class Learner:
    def __init__(self, layout: Layout, moves: np.ndarray, batch_size: int, encoder: Encoder, targets="double",
                 gamma=0.99, loss="huber", optimizer="adam", seed=0, dtype=np.float32,
                 sparse=True, grad_accum=1, lomo=False, target_update_interval=1000, tau=1.0,
                 sparse_update=False, target_cache=True, child_cache=True, fused=None, **opt_kwargs):
        if targets not in TARGETS:
            raise ValueError(f"unknown targets '{targets}' (expected one of: {', '.join(TARGETS)})")
        if batch_size % grad_accum:
            raise ValueError(f"batch_size {batch_size} is not divisible by grad_accum {grad_accum}")
        if lomo and grad_accum > 1:
            raise ValueError("lomo cannot be combined with grad_accum > 1 (there is no gradient to accumulate)")
        if sparse_update and (not sparse or lomo or grad_accum > 1):
            raise ValueError("sparse_update needs the sparse first layer, without lomo or grad_accum > 1")
        if lomo and opt_kwargs.get("clip", "global") == "global":
            opt_kwargs["clip"] = "layer"  # the documented LOMO clipping rule
        self.layout, self.moves, self.targets, self.encoder = layout, moves, targets, encoder
        self.batch_size, self.gamma, self.loss_kind = batch_size, gamma, LOSSES[loss]
        self.dtype = np.dtype(dtype)
        self.grad_accum, self.lomo, self.sparse_update = grad_accum, lomo, sparse_update
        self.target_update_interval, self.tau = target_update_interval, tau
        self.n_actions = layout.n_actions
        self.online = MLP(layout, seed=seed, dtype=dtype, sparse=sparse)
        self.target = MLP(layout, params=self.online.params.copy(), dtype=dtype, sparse=sparse)
        # lazy updates keep W1's gradient as compact rows (grad_rows): the flat gradient
        # then starts at b1 (grad_from), and gWs[0] is an empty view
        self.grad_from = layout.tensors[0][3] if sparse_update else 0
        self.grads = aligned_zeros(layout.size - self.grad_from if not lomo else 0, self.dtype)
        self.gWs, self.gbs = views(self.grads, layout, self.grad_from) if not lomo else ((), ())
        self.grads_tmp = aligned_zeros(layout.size if grad_accum > 1 else 0, self.dtype)
        self.tWs, self.tbs = views(self.grads_tmp, layout) if grad_accum > 1 else ((), ())
        self.layer_slices = [(off, boff + fo) for off, fi, fo, boff in layout.tensors]
        if lomo:
            self.lomo_scratch = aligned_zeros(max(hi - lo for lo, hi in self.layer_slices), self.dtype)
        self.opt = Optimizer(optimizer, layout.size, dtype, self.layer_slices, **opt_kwargs)
        micro = batch_size // grad_accum
        self.micro = micro
        online_rows = micro if targets != "double" else 2 * micro
        self.ws = self.online.workspace(online_rows, encoder.input_groups)
        self.n_rep = len(encoder.child_reps)
        self.rep_moves = np.ascontiguousarray(moves[encoder.child_reps])
        # read-only like the puzzle's moves that search passes to expand_children: a writeable
        # array is another numba type, and the kernel was compiled twice in a cold start
        self.rep_moves.setflags(write=False)
        target_rows = micro * self.n_rep if targets == "all-actions" else micro
        self.ws_t = self.target.workspace(target_rows, encoder.input_groups)
        self.y = np.zeros(micro, self.dtype)
        self.Y = np.zeros((micro, self.n_actions), self.dtype)
        self.td = np.zeros(batch_size, self.dtype)
        self.states_c = np.zeros((micro, moves.shape[1]), np.uint8)  # contiguous copies of s, s'
        # all-actions with hard target updates and corner codes: cache max Q_t per child
        self.target_cache = bool(target_cache and targets == "all-actions" and encoder.framed and tau >= 1.0)
        # 131,072 entries in sets of 4 (1.6 MB): more than the 77,802 positions left by 48 symmetries
        sets = 1 << 15 if self.target_cache else 1
        self.cache_tag = np.zeros((sets, 4), np.uint64)
        self.cache_val = np.zeros((sets, 4), self.dtype)
        self.cache_next = np.zeros(sets, np.uint8)
        self.generation = 0  # of the target network; bumped whenever its weights change
        self.child_values = np.zeros(target_rows if targets == "all-actions" else 0, self.dtype)  # max_a' Q_t
        self.child_missing = np.zeros(target_rows if self.target_cache else 0, np.int64)
        # all-actions on code inputs: the children's codes from a table keyed by the parent's
        # position (children.py) instead of framing every child every step
        self.child_codes = ChildCodes(encoder, moves, micro) \
            if child_cache and targets == "all-actions" and ChildCodes.applies(encoder) else None
        self.missing_codes = np.zeros((target_rows if self.child_codes is not None else 0, 8), np.int64)
        # all-actions without the table: every representative child expanded and checked here
        kid_rows = micro if targets == "all-actions" and self.child_codes is None else 0
        self.children = np.zeros((kid_rows, self.n_rep, moves.shape[1]), np.uint8)
        self.child_solved = np.zeros(kid_rows * self.n_rep, np.bool_)
        self.missing_max = np.zeros(target_rows if self.target_cache else 0, self.dtype)
        self.cache_lookups = self.cache_hits = 0
        self.children_scored = 0  # rows the target network scored for all-actions targets, in all
        self.next_c = np.zeros((micro, moves.shape[1]), np.uint8)
        self.ones = np.ones(batch_size, self.dtype)
        self.rot = np.zeros(micro, np.int64)            # rotation of each sampled state
        self.rot_scratch = np.zeros(target_rows, np.int64)
        self.actions_c = np.zeros(micro, np.int64)      # taken actions in the canonical frame
        # where the loss's dq rows are zero but at the taken action (sampled targets, no
        # dueling head), the backward takes the head's gradient from them (mlp_backward_upper)
        self.head_taken = self.actions_c if targets != "all-actions" and not layout.dueling else self.actions_c[:0]
        # ... and the forward gives those rows only their taken action's value (picks), and
        # with double targets the target net's rows only the online net's choice, best_next
        # (nn.head_forward_picked; not where the head is the first layer)
        if layout.n_layers < 2:
            self.head_taken = self.actions_c[:0]
        self.best_next = np.zeros(micro, np.int64)
        # sampled targets: the transitions that bootstrap (bootstrapped_rows), whose s' alone
        # the target net scores; how many it scored in the last (micro-)batch and in all
        self.live = np.zeros(micro, np.int64)
        self.last_target_rows = 0
        self.target_rows_scored = 0
        self.Yc = np.zeros((micro, self.n_actions), self.dtype)
        # lazy first-layer update: the rows of W1 the batch touched and their gradients
        # (see nn.sparse_backward_compact)
        max_rows = micro * layout.n_active if sparse_update else 0
        self.row_mark = np.zeros(layout.in_dim if sparse_update else 0, np.uint8)
        self.row_slot = np.zeros(layout.in_dim if sparse_update else 0, np.int32)
        self.touched = np.zeros(max_rows, np.int64)
        self.row_starts, self.row_terms = np.zeros(max_rows + 2, np.int32), np.zeros(max_rows, np.int32)
        self.grad_rows = aligned_zeros((max_rows, layout.widths[1]), self.dtype)
        self.n_touched = 0
        self._parts = PhaseTimer().parts  # where the parts go when no timer is given
        # the fused step (fused_sampled_step) where it covers the configuration; fused=None:
        # unless CUBEDQN_FUSED=0. Timed steps need the kernel's clock.
        if fused is None:
            fused = FUSED
        self.fused = bool(fused) and targets != "all-actions" and grad_accum == 1 \
            and not lomo and not sparse_update and encoder.rotation_only
        self.stamps = np.zeros(2 * N_PARTS + 1 + 2, np.int64)  # stamps, sums, the clock's scratch
        self.scalars = np.zeros(3, self.dtype)  # the one-call step's learning rate and bias corrections
        self._call_s = 0.0      # the fused calls' wall time since their parts were last booked
        self._booked_to = None  # the PhaseTimer those sums go to (attached to it)
        self._fused_args = (None, None, None, None)  # (batch, use_weights, its StepArgs, the kernel's entry)
        self.updates = 0
        self.last_loss = 0.0

    # -- one gradient step ----------------------------------------------------------------
    def train_step(self, batch, timer: PhaseTimer | None = None, use_weights=False):
        """One optimizer update from batch (replay.Batch). Returns the loss; td errors in self.td."""
        if self.fused and (timer is None or clock.AVAILABLE):
            return self._train_step_fused(batch, timer, use_weights)
        clock_ = time.perf_counter
        parts = timer.parts if timer else self._parts
        t = clock_()
        loss = 0.0
        m = self.micro
        weights = batch.weights if use_weights else self.ones
        scale = 1.0 / self.batch_size
        for k in range(self.grad_accum):
            sl = slice(k * m, (k + 1) * m)
            laps = Laps(parts["forward"], t)
            loss += self._forward_loss(batch, sl, weights[sl], scale, laps)
            t1 = laps.last
            if timer:
                timer.add("forward", t1 - t)
            if self.lomo:
                self._lomo_backward_update(m)
                t2 = clock_()
                if timer:
                    timer.add("backward", t2 - t1)
                t = t2
                break
            laps = Laps(parts["backward"], t1)
            first = k == 0 or self.sparse_update
            self._backward(m, first, laps)
            if not first:
                add_into(self.grads, self.grads_tmp)
                laps.lap("accumulate")
            t = laps.last
            if timer:
                timer.add("backward", t - t1)
        if not self.lomo:
            self._update()
        self.updates += 1
        t2 = clock_()
        if timer:
            timer.add("optimizer", t2 - t)
        self.maybe_update_target(timer, t2)
        self.last_loss = loss
        return loss

    def _backward(self, m, first, laps):
        """Gradients of the first m rows' loss (the deltas the forward left in the workspace)
        into the gradient buffers (first: the step's own; else the accumulation's)."""
        on, ws = self.online, self.ws
        gW, gb = (self.gWs, self.gbs) if first else (self.tWs, self.tbs)
        mlp_backward_upper(on.Ws, ws.acts, ws.deltas, gW, gb, m, self.head_taken, ws.head_t)
        laps.lap("GEMM layers")
        if self.sparse_update:
            self.n_touched = sparse_backward_compact(ws.idx[:m], ws.deltas[0][:m], self.grad_rows, gb[0],
                                                     self.row_mark, self.row_slot, self.touched, self.row_starts,
                                                     self.row_terms)
        else:
            mlp_backward_first(ws.idx, ws.x, on.sparse, on.Ws, ws.deltas, gW, gb, m, ws.panel)
        laps.lap("first layer")

    def _update(self):
        """The optimizer's update of the online net from the gradient buffers."""
        if self.sparse_update:
            self.opt.step_rows(self.online.params, self.grad_rows.reshape(-1), self.touched, self.n_touched,
                               self.layout.widths[1], self.grads)
        else:
            self.opt.step(self.online.params, self.grads)

    def compile_update(self):
        """Run the backward and the update once on the workspace as it stands, without a
        forward, so that their kernels compile (or load from Numba's cache) on their own:
        a cold start's warm-up does this while a second process compiles the forward
        (precompile.py). The parameters and optimizer state change by an update from
        whatever the workspace holds: for a throwaway learner (the warm-up's twin)."""
        laps = Laps(dict.fromkeys(PhaseTimer.PARTS["backward"], 0.0), time.perf_counter())
        if self.lomo:
            self._lomo_backward_update(self.micro)
            return
        self._backward(self.micro, True, laps)
        self._update()

    def _train_step_fused(self, batch, timer, use_weights):
        """train_step as one kernel call (fused_sampled_step). The kernel sums its parts'
        times into self.stamps; they, and the Python around the call as the forward's
        "kernel call", reach the timer when it is read (_drain_parts)."""
        t0 = time.perf_counter()
        if timer is not self._booked_to:
            self._book_to(timer)
        opt = self.opt
        opt.begin_step()
        sc = self.scalars  # this step's numbers, in the buffer's dtype as step_args makes them
        sc[0], sc[1], sc[2] = opt.step_scalars()
        args, kernel = self._step_args(batch, use_weights)
        loss, norm, k = kernel(args)
        opt.last_norm = float(norm)
        self.last_target_rows = k
        self.target_rows_scored += k
        self.updates += 1
        t2 = time.perf_counter()
        self._call_s += t2 - t0
        self.maybe_update_target(timer, t2)
        self.last_loss = loss
        return loss

    def _step_args(self, batch, use_weights):
        """fused_sampled_step's StepArgs for this batch object (its arrays are reused from
        step to step, as are the learner's and the optimizer's), made once per batch, and the
        compiled kernel for their type: its entry point (calls.py), called without the
        dispatcher's typing of the argument and its lookup of the overload: 3-9 us less a
        small step outside the kernel (runs/perf40/entry_ab_outside.txt)."""
        last_batch, last_weights, args, kernel = self._fused_args
        if batch is last_batch and use_weights == last_weights:
            return args, kernel
        on, tg, ws, wt, enc, opt = self.online, self.target, self.ws, self.ws_t, self.encoder, self.opt
        kind, clip, max_norm, mu, b1, b2, eps, wd = opt.constants
        args = make_step_args(
            batch.states, batch.next_states, batch.actions, batch.rewards, batch.dones, batch.discounts,
            batch.weights if use_weights else self.ones,
            enc.framed, enc.sparse, enc.home_facelets, enc.colours, enc.frame_perm, enc.frame_cmap,
            enc.sticker_order, enc.act_map,
            self.states_c, self.next_c, self.rot, self.rot_scratch, self.actions_c, self.head_taken, self.best_next,
            self.live, on.sparse, on.Ws, on.bs, ws.idx, ws.x, ws.acts, ws.deltas, ws.q, ws.dq, ws.panel, ws.groups,
            ws.head_t, tg.Ws, tg.bs, wt.idx, wt.x, wt.acts, wt.q, wt.panel, wt.groups, wt.head_t,
            self.targets == "double", self.layout.dueling, self.y, self.td, 1.0 / self.batch_size,
            self.loss_kind,
            kind, clip, max_norm, on.params, self.grads, self.gWs, self.gbs, opt.m, opt.v, opt.slices, mu, b1,
            b2, eps, wd, opt.ctx,
            self.stamps, self.scalars)
        kernel = entry_point(fused_sampled_step, args)  # (calls.py)
        self._fused_args = (batch, use_weights, args, kernel)
        return args, kernel

    def _book_to(self, timer):
        """The fused step's part sums go to `timer` from now on (None: nowhere): what the
        previous timer is owed is booked to it, what steps without a timer summed is dropped."""
        if self._booked_to is not None:
            self._booked_to.detach(self._drain_parts)
        self._drain_parts(None, None)
        self._booked_to = timer
        if timer is not None:
            timer.attach(self._drain_parts)

    def _drain_parts(self, total, parts):
        """Add the fused steps' part sums (and their calls' Python, as "kernel call") to a
        PhaseTimer's total and parts dicts (None: drop them), and start the sums again."""
        sums = self.stamps[N_PARTS + 1:2 * N_PARTS + 1]
        if total is not None:
            ns = sums.tolist()
            # the call's way in and out (14 of a 481 us small step, where the encoding inside
            # took 1.5: docs/performance-log.md, stop 29) is a part of its own
            call = max(0.0, self._call_s - sum(ns) * 1e-9)
            total["forward"] += call
            parts["forward"]["kernel call"] += call
            for k, (phase, part) in enumerate(FUSED_PARTS):
                dt = ns[k] * 1e-9
                total[phase] += dt
                if part is not None:
                    parts[phase][part] += dt
        sums[:] = 0
        self._call_s = 0.0

    def _forward_loss(self, batch, sl, weights, scale, laps=None):
        """Targets and loss for rows sl of the batch; leaves dLoss/dhead in ws.deltas[-1].

        The online net sees canonical states (see encoding.py); world-frame actions and
        per-action targets are relabelled into that frame, values need no relabelling.
        laps (Laps) is told as each part of the forward phase ends.
        """
        m = self.micro
        laps = laps or Laps(self._parts["forward"], time.perf_counter())
        on, tg, ws, wt, enc = self.online, self.target, self.ws, self.ws_t, self.encoder
        # the batch's states are column views of its records: contiguous copies let every
        # kernel below run the one compiled C-layout version that acting also uses
        states = self.states_c
        np.copyto(states, batch.states[sl])
        codes = enc.encode(states, ws, 0, self.rot, want_codes=self.child_codes is not None)
        if self.targets == "all-actions":
            n_kids = m * self.n_rep
            codes, solved, encoded = self.children_of(states, codes, wt)
            laps.lap("encode")
            if self.target_cache:
                self._cached_child_targets(codes, solved, encoded, wt, laps)
            else:
                if not encoded:
                    enc.encode_codes(codes, wt.idx[:n_kids])
                row_max(tg.forward_ws(wt, n_kids, laps), self.child_values)
                all_action_targets(self.child_values, solved, self.gamma, enc.child_rep_of, self.Y)
                self.children_scored += n_kids
            rows_to_canonical(self.Y, self.rot, enc.act_map, self.Yc)
            laps.lap("targets and loss")
            q = on.forward_ws(ws, m, laps)
            loss = loss_full(q, self.Yc, weights, scale, self.loss_kind, ws.dq, self.td[sl], m)
        else:
            nxt = self.next_c
            np.copyto(nxt, batch.next_states[sl])
            enc.encode(nxt, wt, 0, self.rot_scratch[:m], want_codes=False)
            # as fused_sampled_step: only the k transitions that bootstrap have their s' scored
            live = self.live
            k = bootstrapped_rows(batch.dones[sl], batch.discounts[sl], live)
            if self.targets == "double":  # the online net's rows m..2m are the same inputs (or s)
                next_state_rows(wt.idx[:m], ws.idx[:m], ws.idx, m, live, k)
                next_state_rows(wt.x[:m], ws.x[:m], ws.x, m, live, k)
            compact_rows(wt.idx, live, k)
            compact_rows(wt.x, live, k)
            actions_to_canonical(batch.actions[sl], self.rot, enc.act_map, self.actions_c)
            laps.lap("encode")
            # the head's rows of s at the taken actions alone (picks), with double targets the
            # online net first and the target's rows at its choice
            picks = self.head_taken[:m]
            if self.targets == "double":
                q_all = on.forward_ws(ws, 2 * m, laps, halves=True, picks=picks)
                best_actions(q_all[m:], live, self.best_next[:k])
                q = q_all[:m]
                q_next_t = self._target_forward(k, laps, self.best_next[:k if len(picks) else 0])
            else:
                q_next_t = self._target_forward(k, laps, None)
                q = on.forward_ws(ws, m, laps, picks=picks)
            self.last_target_rows = k
            self.target_rows_scored += k
            # argmax/max over actions is frame independent: no relabelling of q_next_*
            live_targets(q_next_t, live, k, self.best_next, batch.rewards[sl], batch.dones[sl], batch.discounts[sl],
                         self.targets == "double", self.y)
            loss = loss_taken(q, self.actions_c, self.y, weights, scale, self.loss_kind, ws.dq,
                              self.td[sl], m)
        if self.layout.dueling:
            dueling_backward(ws.dq[:m], ws.deltas[-1][:m])
        laps.lap("targets and loss")
        return loss

    def _target_forward(self, rows, laps, picks):
        """The target net's Q-values of its workspace's first `rows` rows (none: nothing runs,
        the laps are still told)."""
        if rows:
            return self.target.forward_ws(self.ws_t, rows, laps, picks=picks)
        laps.lap("first layer")
        laps.lap("GEMM layers")
        return self.ws_t.q[:0]

    @property
    def last_mean_q(self):
        """Mean Q(s, .) of the last (micro-)batch's states, computed when asked (for the log)
        rather than every step: numpy's mean cost ~12 us a call here (timed on an 8 x 12
        block: it is mostly numpy's per-call overhead). Where the step's head gave those
        rows only their taken action's value (head_taken), the head is run here on the hidden
        rows the step left, with the weights its forward used (nn.head_forward_picked keeps
        them in the workspace's head_t[0]: W transposed, then the bias)."""
        m = self.micro
        if not m:
            return 0.0
        if len(self.head_taken):
            a_n, h = self.n_actions, self.layout.widths[-2]
            wt = self.ws.head_t[0].astype(np.float64)
            x = self.ws.acts[-2][:m].astype(np.float64)
            return float((x @ wt[:a_n, :h].mean(axis=0)).mean() + wt[a_n, :a_n].mean())
        return float(self.ws.q[:m].mean())

    @property
    def target_cache_hit_rate(self):
        """Share of the unsolved children's values the cache supplied so far (0 before any)."""
        return self.cache_hits / max(self.cache_lookups, 1)

    def children_of(self, states, codes, ws_t):
        """All-actions targets' children of states (n, S), whose own corner codes (from
        Encoder.encode; None where not computed) and frames (self.rot) are given: returns
        (the children's codes or None, their solved flags, encoded). With the child cache
        the codes come from it and nothing is encoded (encoded False: the target rows are
        made from the codes where needed); else the children are expanded, checked and
        encoded into the rows of ws_t (encoded True; codes only where the target cache
        needs them)."""
        if self.child_codes is not None:
            kid_codes, solved = self.child_codes.compute(states, codes, self.rot)
            return kid_codes, solved, False
        expand_children(states, self.rep_moves, self.n_rep, self.children)
        kids = self.children.reshape(len(states) * self.n_rep, -1)
        solved_batch(kids, self.child_solved)
        kid_codes = self.encoder.encode(kids, ws_t, 0, self.rot_scratch, want_codes=self.target_cache)
        return kid_codes, self.child_solved, True

    def _cached_child_targets(self, codes, solved, encoded, wt, laps):
        """All-actions targets with the target cache: only children whose max Q_t is not
        cached since the last target update go through the target network. Network rows do
        not depend on the other rows of their batch here (checked bitwise), so the targets
        equal the uncached ones. encoded: wt's rows hold every child's input (else only
        the codes are given, and the missing children's rows are made from them)."""
        values, missing = self.child_values, self.child_missing
        gen_tag = self.generation % ((1 << GEN_BITS) - 1) + 1
        n_miss, unsolved = target_cache_lookup(codes, solved, self.cache_tag, self.cache_val, gen_tag, values,
                                               missing)
        self.cache_lookups += unsolved
        self.cache_hits += unsolved - n_miss
        self.children_scored += n_miss
        if n_miss:
            if encoded:  # in place: missing is ascending
                rows = wt.idx if self.target.sparse else wt.x
                take_rows(rows, missing, n_miss, rows)
            else:
                take_rows(codes, missing, n_miss, self.missing_codes)
                self.encoder.encode_codes(self.missing_codes[:n_miss], wt.idx[:n_miss])
            row_max(self.target.forward_ws(wt, n_miss, laps), self.missing_max[:n_miss])
            target_cache_store(self.missing_max, codes, missing, n_miss, self.cache_tag, self.cache_val,
                               self.cache_next, gen_tag, values)
        all_action_targets(values, solved, self.gamma, self.encoder.child_rep_of, self.Y)

    def _lomo_backward_update(self, rows):
        """Backward layer by layer (top first), updating each layer right after its gradient."""
        on, ws, opt = self.online, self.ws, self.opt
        opt.begin_step()
        total = 0.0
        for l in range(self.layout.n_layers - 1, -1, -1):
            lo, hi = self.layer_slices[l]
            off, fi, fo, boff = self.layout.tensors[l]
            g = self.lomo_scratch[:hi - lo]
            dW = g[:fi * fo].reshape(fi, fo)
            db = g[fi * fo:]
            if l > 0:
                # dx uses this layer's weights before they are updated.
                dense_backward(ws.acts[l - 1][:rows], ws.deltas[l][:rows], on.Ws[l], dW, db,
                               ws.deltas[l - 1][:rows], True)
            elif on.sparse:  # by panels with the workspace's scratch, else by rows
                sparse_backward_panels(ws.idx[:rows], ws.deltas[0][:rows], dW, db, ws.panel)
            else:
                dense_backward(ws.x[:rows], ws.deltas[0][:rows], on.Ws[0], dW, db,
                               ws.deltas[0][:0], False)
            total += opt.apply(on.params, g, lo, hi)
        opt.last_norm = float(np.sqrt(total))

    def maybe_update_target(self, timer=None, t0=None):
        if self.tau < 1.0:
            polyak_update(self.target.params, self.online.params, self.dtype.type(self.tau))
        elif self.updates % self.target_update_interval == 0:
            np.copyto(self.target.params, self.online.params)
            self.bump_generation()
        if timer:
            timer.add("target update", time.perf_counter() - t0)

    # -- persistence ----------------------------------------------------------------------
    def arrays(self):
        out = {"params": self.online.params, "target_params": self.target.params}
        out.update(self.opt.state_arrays())
        return out

    def load_arrays(self, data, opt_t):
        for name, dst in (("params", self.online.params), ("target_params", self.target.params)):
            src = data[name]
            if src.shape != dst.shape:
                raise ValueError(f"checkpoint '{name}' has {src.size} values, the network needs {dst.size}")
            dst[:] = src
        self.bump_generation()
        self.opt.load_state(data, opt_t)

    def bump_generation(self):
        """The target's weights changed: every cached child value is stale (each entry's tag
        names the generation it was stored in). Where the tags' generation bits wrap, the
        table is cleared, so that an entry from 2**23 - 1 generations ago cannot match."""
        self.generation += 1
        if self.generation % ((1 << GEN_BITS) - 1) == 0:
            self.cache_tag[:] = 0

    @property
    def nbytes(self):
        return self.online.params.nbytes + self.target.params.nbytes + self.gradient_nbytes + self.opt.nbytes

    @property
    def gradient_nbytes(self):
        return self.grads.nbytes + self.grads_tmp.nbytes + self.grad_rows.nbytes
