"""Q-guided search: batched greedy rollouts, beam search and weighted A*, every solution verified.

Greedy: all cubes advance together, one forward pass per move over the unsolved ones;
each takes its best-Q action whose result it has not visited before (a cube with no such
action is stuck and counts as unsolved).

"Same state" means the same position as the policy sees it: `policy.position_keys`
(encoding.Encoder.position_keys) identifies states that differ only by a whole-cube
rotation, or by any of the 48 symmetries when the network's input does; such states have
the same distance and the same Q-values (relabelled), so revisiting one would repeat a
choice already made, and keeping two in a beam would waste a slot. Policies without
position_keys compare raw stickers.

Beam search (Q*-style): a parent's single forward pass scores all of its children, since
Q(s, a) estimates -(1 + cost-to-go of child a). A beam of width W therefore costs W
forward rows per depth, not W x actions. Children are deduplicated exactly (hash of the
position key, then a byte comparison) and the W best distinct ones form the next beam.
Where every child's key is at hand (the policy's table of positions gives them,
encoding.Policy.q_values_and_child_keys, or the keys are the stickers themselves) one
kernel selects them (select_in_order); else keys are computed only for the best-scored
children, until W distinct ones are found.

Weighted A* (DeepCubeA's batched BWAS): f = weight * g + h, h read off the parent's
Q-values the same way, a batch of lowest-f nodes expanded per forward pass; the open set
is a binary heap in arrays and the best g of each position a hash table of its key.

All return action lists, and `verify` replays each on its start state.
"""

from __future__ import annotations

import time

import numpy as np
from numba import njit

from .cube import apply_moves, expand_children, is_solved, solved_batch


@njit(cache=True, nogil=True)
def _state_hash(state):
    h = np.uint64(14695981039346656037)
    for j in range(state.shape[0]):
        h = (h ^ np.uint64(state[j])) * np.uint64(1099511628211)
    return h


def position_keys(policy, states):
    """(n, K) uint8 keys, equal for equivalent positions (raw stickers if the policy has none)."""
    f = getattr(policy, "position_keys", None)
    return np.ascontiguousarray(states if f is None else f(states), dtype=np.uint8)


def q_and_child_keys(policy, states):
    """(Q-values of states (n, A), position_keys of their children (n*A, K), row i*A + a for
    action a, or None): the policy gives the keys where it can without framing every child
    (encoding.Policy.q_values_and_child_keys); None leaves them to the caller."""
    f = getattr(policy, "q_values_and_child_keys", None)
    return f(states) if f is not None else (policy.q_values(states), None)


@njit(cache=True, nogil=True)
def _visited(hist, n_hist, key):
    k_n = key.shape[0]
    for k in range(n_hist):
        same = True
        for j in range(k_n):
            if hist[k, j] != key[j]:
                same = False
                break
        if same:
            return True
    return False


@njit(cache=True, nogil=True)
def _ranks_before(x, y):
    """Whether Q-value x comes before y: higher first, NaN last."""
    return x > y or (y != y and x == x)


@njit(cache=True, nogil=True)
def greedy_step(q, rows, kids, kid_keys, states, hist, hist_len, actions_out, stuck):
    """Cube rows[k] (q row k, children kids[k], their keys kid_keys[k]) takes its best action
    to a position not visited before; states and the key history are updated in place.
    Actions are tried in the order of a stable argsort of -q (ties: the lower action; NaN
    last), found by selection: no array per cube, and no sort to compile (numba's argsort
    cost ~2 s of a cold start)."""
    n_a = q.shape[1]
    for k in range(rows.shape[0]):
        i = rows[k]
        chosen = -1
        tried = 0  # bit a: action a was tried (n_a <= 18)
        for _ in range(n_a):
            a = -1
            for b in range(n_a):
                if not (tried >> b) & 1 and (a < 0 or _ranks_before(q[k, b], q[k, a])):
                    a = b
            tried |= 1 << a
            if not _visited(hist[i], hist_len[i], kid_keys[k, a]):
                chosen = a
                break
        if chosen < 0:
            stuck[i] = True
            continue
        for j in range(states.shape[1]):
            states[i, j] = kids[k, chosen, j]
        for j in range(hist.shape[2]):
            hist[i, hist_len[i], j] = kid_keys[k, chosen, j]
        hist_len[i] += 1
        actions_out[i] = chosen


def greedy_solve(policy, states, moves, max_moves=30):
    """Batched greedy rollouts. Returns (solved (N,), lengths (N,), solutions list)."""
    states = np.array(np.atleast_2d(states), dtype=np.uint8, copy=True)
    n, s = states.shape
    keys0 = position_keys(policy, states)
    hist = np.zeros((n, max_moves + 1, keys0.shape[1]), np.uint8)
    hist[:, 0] = keys0
    hist_len = np.ones(n, np.int64)
    solved = np.zeros(n, np.bool_)
    stuck = np.zeros(n, np.bool_)
    path = np.full((n, max_moves), -1, np.int64)
    step_actions = np.full(n, -1, np.int64)
    solved_batch(states, solved)
    for t in range(max_moves):
        rows = np.flatnonzero(~solved & ~stuck)
        if rows.size == 0:
            break
        q, kid_keys = q_and_child_keys(policy, states[rows])
        n_a = q.shape[1]
        kids = np.empty((rows.size, n_a, s), np.uint8)
        expand_children(states[rows], moves, n_a, kids)
        if kid_keys is None:
            kid_keys = position_keys(policy, kids.reshape(-1, s))
        kid_keys = kid_keys.reshape(rows.size, n_a, -1)
        step_actions[:] = -1
        greedy_step(q, rows, kids, kid_keys, states, hist, hist_len, step_actions, stuck)
        path[rows, t] = step_actions[rows]
        solved_batch(states, solved)
    lengths = np.where(solved, hist_len - 1, -1)
    sols = [path[i, :lengths[i]].tolist() if solved[i] else None for i in range(n)]
    return solved, lengths, sols


@njit(cache=True, nogil=True)
def select_distinct(keys, width, start, table, out_idx, count):
    """Scan keys[start:] (rows in priority order) and append the indices of rows whose key is
    new to out_idx, until `count` reaches width. table (a power of two >= 2 * width, -1 =
    empty) holds the rows already taken and carries over between calls. Returns count."""
    for c in range(start, keys.shape[0]):
        if count >= width:
            break
        count = _take_if_new(keys, c, table, out_idx, count)
    return count


@njit(cache=True, nogil=True)
def _take_if_new(keys, c, table, out_idx, count):
    """Append row c to out_idx[:count] and its index to table unless a row with the same key
    is in table already; returns the new count."""
    k_n = keys.shape[1]
    size = table.shape[0]
    slot = np.int64(_state_hash(keys[c]) & np.uint64(size - 1))
    while table[slot] >= 0:
        o = table[slot]
        same = True
        for j in range(k_n):
            if keys[o, j] != keys[c, j]:
                same = False
                break
        if same:
            return count
        slot = (slot + 1) & (size - 1)
    table[slot] = c
    out_idx[count] = c
    return count + 1


@njit(cache=True, nogil=True)
def select_in_order(scores, keys, width, hf, hn, table, out_idx):
    """The first `width` rows with distinct keys (M, K) in the order of a stable argsort of
    scores (M,) (by score, then row; NaN last) into out_idx; returns their count. hf, hn
    (M,) hold a heap of (score, row) that is popped only as far as needed; table (a power
    of two >= 2 * width) is cleared here."""
    size = 0
    for i in range(scores.shape[0]):
        if scores[i] == scores[i]:
            hf[size], hn[size] = scores[i], i
            size += 1
    for i in range(size // 2 - 1, -1, -1):  # heapify bottom-up: O(M), where M pushes cost O(M log M)
        _sift_down(hf, hn, i, size)
    table[:] = -1
    count = 0
    while size > 0 and count < width:
        i, size = heap_pop(hf, hn, size)
        count = _take_if_new(keys, i, table, out_idx, count)
    for i in range(scores.shape[0]):
        if count >= width:
            break
        if scores[i] != scores[i]:
            count = _take_if_new(keys, i, table, out_idx, count)
    return count


def hash_table(width):
    size = 1
    while size < 4 * width:
        size *= 2
    return np.full(size, -1, np.int64)


def select_beam(policy, kids, scores, width, out_idx, keys=None):
    """Indices of the `width` best (lowest score) distinct positions among kids (M, S), compared
    by the policy's position keys (raw stickers for a policy without them). Returns the count.

    Where every child's key is at hand (keys (M, K) given, or the raw stickers) one kernel
    pops a heap of (score, index) until W distinct keys are found: the order of a stable
    sort, without sorting all W x A children (that took 1.2 ms a depth at W = 1024, a tenth
    of the depth) and without numpy's per-call overheads at small W. Else keys are computed
    down the score order only as far as W distinct ones need: only the best 3W scores are
    ordered at first (a partition, then a sort of those by score and index), and only if
    those hold fewer than W distinct positions is everything sorted and the selection
    redone (the result can differ from sorting everything only among children tied in
    score with the 3W-th)."""
    if keys is None and (getattr(policy, "position_keys", None) is None or getattr(policy, "keys_are_states", False)):
        keys = kids  # the states themselves are the keys
    m = scores.shape[0]
    if keys is not None:  # every key at hand: one kernel, the exact stable order
        return select_in_order(scores, np.ascontiguousarray(keys, dtype=np.uint8), width, np.empty(m, np.float64),
                               np.empty(m, np.int64), hash_table(width), out_idx)
    head = min(m, 3 * width)
    if head < m:
        top = np.argpartition(scores, head - 1)[:head]
        count = _select_down(policy, kids, top[np.lexsort((top, scores[top]))], width, out_idx)
        if count == width:
            return count
    return _select_down(policy, kids, np.argsort(scores, kind="stable"), width, out_idx)


def _select_down(policy, kids, order, width, out_idx):
    """select_beam's scan: the first `width` distinct positions of kids[order], keys computed
    for the first 3W, then in doubling chunks while more are needed."""
    m = order.shape[0]
    table = hash_table(width)
    sel = np.empty(width, np.int64)
    keys = position_keys(policy, kids[order[:min(m, 3 * width)]])
    count = select_distinct(keys, width, 0, table, sel, 0)
    while count < width and keys.shape[0] < m:  # many equivalent children: look further down
        done = keys.shape[0]
        more = position_keys(policy, kids[order[done:min(m, 2 * done)]])
        keys = np.concatenate([keys, more])
        count = select_distinct(keys, width, done, table, sel, count)
    out_idx[:count] = order[sel[:count]]
    return count


def beam_search(policy, state, moves, n_actions, width=64, max_depth=30):
    """Beam search from one state; returns the action list or None if not found."""
    state = np.asarray(state, dtype=np.uint8)
    if is_solved(state):
        return []
    s = state.shape[0]
    beam = state[None].copy()
    parents, acts = [], []
    kids = np.empty((width, n_actions, s), np.uint8)
    solved = np.empty(width * n_actions, np.bool_)
    sel = np.empty(width, np.int64)
    for _ in range(max_depth):
        w = beam.shape[0]
        q, kid_keys = q_and_child_keys(policy, beam)
        k = kids[:w]
        expand_children(beam, moves, n_actions, k)
        flat = k.reshape(w * n_actions, s)
        solved_batch(flat, solved[:w * n_actions])
        hit = np.flatnonzero(solved[:w * n_actions])
        if hit.size:
            c = int(hit[np.argmax(q.reshape(-1)[hit])])
            path = [c % n_actions]
            parent = c // n_actions
            for par, act in zip(reversed(parents), reversed(acts)):
                path.append(int(act[parent]))
                parent = int(par[parent])
            return path[::-1]
        cnt = select_beam(policy, flat, -q.reshape(-1).astype(np.float64), width, sel, kid_keys)
        chosen = sel[:cnt]
        parents.append(chosen // n_actions)
        acts.append(chosen % n_actions)
        beam = flat[chosen].copy()
    return None


def cost_to_go(q, gamma):
    """Moves to solve implied by Q-values: Q(s, a) = -(1 - gamma^c) / (1 - gamma) for a cost
    of c moves (taking a included), so c = log(1 + (1 - gamma) Q) / log(gamma); -Q if gamma = 1."""
    c = -np.asarray(q, np.float64)
    if gamma >= 1.0:
        return c
    return np.log(np.maximum(1.0 - (1.0 - gamma) * c, 1e-12)) / np.log(gamma)


# The heap's entries are (f, node) in two arrays, ordered by f, then node (heapq's order for
# such tuples). The comparisons are written out in each kernel: with small njit helpers
# taking the arrays, heapifying 768 entries took 17-20 us instead of 2.3 (one-off timing).

@njit(cache=True, nogil=True)
def heap_push(hf, hn, size, f, node):
    """Push (f, node) on the binary min-heap hf[:size], hn[:size]; returns the new size."""
    i = size
    while i > 0:
        up = (i - 1) // 2
        if not (f < hf[up] or (f == hf[up] and node < hn[up])):
            break
        hf[i], hn[i] = hf[up], hn[up]
        i = up
    hf[i], hn[i] = f, node
    return size + 1


@njit(cache=True, nogil=True)
def _sift_down(hf, hn, i, size):
    """Move entry i down the heap hf[:size], hn[:size] until its children order after it."""
    f, node = hf[i], hn[i]
    while True:
        c = 2 * i + 1
        if c >= size:
            break
        if c + 1 < size and (hf[c + 1] < hf[c] or (hf[c + 1] == hf[c] and hn[c + 1] < hn[c])):
            c += 1
        if not (hf[c] < f or (hf[c] == f and hn[c] < node)):
            break
        hf[i], hn[i] = hf[c], hn[c]
        i = c
    hf[i], hn[i] = f, node


@njit(cache=True, nogil=True)
def heap_pop(hf, hn, size):
    """Remove the least entry of the heap hf[:size], hn[:size]; returns (its node, the new size)."""
    node = hn[0]
    size -= 1
    hf[0], hn[0] = hf[size], hn[size]
    _sift_down(hf, hn, np.int64(0), size)  # not a literal 0: numba would compile it for that too
    return node, size


@njit(cache=True, nogil=True)
def astar_pop(hf, hn, size, g, max_depth, batch, out):
    """Pop nodes in (f, node) order until `batch` of them are shallower than max_depth (the
    deeper ones are dropped) or the heap is empty: out[:count] gets them. Returns (count, size)."""
    count = 0
    while size > 0 and count < batch:
        node, size = heap_pop(hf, hn, size)
        if g[node] < max_depth:
            out[count] = node
            count += 1
    return count, size


@njit(cache=True, nogil=True)
def _find_key(table_keys, used, key):
    """The slot holding key in the open-addressing table (linear probing), or the empty slot
    where it would go."""
    mask = used.shape[0] - 1
    k_n = key.shape[0]
    slot = np.int64(_state_hash(key) & np.uint64(mask))
    while used[slot]:
        same = True
        for j in range(k_n):
            if table_keys[slot, j] != key[j]:
                same = False
                break
        if same:
            return slot
        slot = (slot + 1) & mask
    return slot


@njit(cache=True, nogil=True)
def astar_push_children(keys, h, idx, n_actions, flat, weight, states, parent, action, g, n_nodes,
                        table_keys, table_g, used, hf, hn, size):
    """Child c (row c of flat, keys and h; parent idx[c // n_actions], action c % n_actions)
    becomes node n_nodes and is pushed with f = weight * g + h unless its position was
    reached before with a lower or equal g. Returns (n_nodes, size)."""
    for c in range(keys.shape[0]):
        p = idx[c // n_actions]
        gc = g[p] + 1
        slot = _find_key(table_keys, used, keys[c])
        if used[slot] and table_g[slot] <= gc:
            continue
        if not used[slot]:
            used[slot] = True
            for j in range(keys.shape[1]):  # element loops: a row assignment compiles numba's
                table_keys[slot, j] = keys[c, j]  # shape-error formatting, ~2 s of a cold start
        table_g[slot] = gc
        for j in range(flat.shape[1]):
            states[n_nodes, j] = flat[c, j]
        parent[n_nodes], action[n_nodes], g[n_nodes] = p, c % n_actions, gc
        size = heap_push(hf, hn, size, weight * gc + h[c], n_nodes)
        n_nodes += 1
    return n_nodes, size


def astar_search(policy, state, moves, n_actions, batch=64, weight=0.6, max_depth=30, gamma=1.0,
                 max_nodes=200_000):
    """Batched weighted A* (DeepCubeA's BWAS, f = weight * g + h) with h from the Q-network.

    Each iteration pops the `batch` open nodes of lowest f (ties: the node made first); one
    forward pass over them scores all their children (h(child a) = cost_to_go(Q(node, a))
    - 1, as in Q* search), and each child whose position (see position_keys) was not
    reached before with a lower or equal g is pushed. Returns the first solution found
    (shortest among the popped batch), or None when the open set empties, max_nodes are
    generated, or only nodes at max_depth remain. weight < 1 trades optimality for speed;
    weight = 1 is plain A* with a learned h. The open set (a binary heap) and the best g
    of each position (a hash table of the keys) live in arrays the kernels above work on.
    """
    state = np.asarray(state, dtype=np.uint8)
    if is_solved(state):
        return []
    s = state.shape[0]
    states = np.empty((max_nodes, s), np.uint8)
    parent = np.empty(max_nodes, np.int64)
    action = np.empty(max_nodes, np.int64)
    g = np.empty(max_nodes, np.int64)
    states[0], parent[0], action[0], g[0] = state, -1, -1, 0
    key0 = position_keys(policy, state[None])
    size = 1
    while size < 2 * max_nodes:  # at most half full
        size *= 2
    table_keys = np.empty((size, key0.shape[1]), np.uint8)
    table_g = np.empty(size, np.int64)
    used = np.zeros(size, np.bool_)
    slot = _find_key(table_keys, used, key0[0])
    used[slot], table_keys[slot], table_g[slot] = True, key0[0], 0
    hf = np.empty(max_nodes, np.float64)  # the heap: f and node number
    hn = np.empty(max_nodes, np.int64)
    hf[0], hn[0] = 0.0, 0
    open_size = 1
    n_nodes = 1
    kids = np.empty((batch, n_actions, s), np.uint8)
    solved = np.empty(batch * n_actions, np.bool_)
    popped = np.empty(batch, np.int64)

    def path_to(node, last):
        out = [last]
        while parent[node] >= 0:
            out.append(int(action[node]))
            node = int(parent[node])
        return out[::-1]

    while open_size:
        b, open_size = astar_pop(hf, hn, open_size, g, max_depth, batch, popped)
        if b == 0:
            break
        idx = popped[:b]
        q, keys = q_and_child_keys(policy, states[idx])
        k = kids[:b]
        expand_children(states[idx], moves, n_actions, k)
        flat = k.reshape(b * n_actions, s)
        solved_batch(flat, solved[:b * n_actions])
        hit = np.flatnonzero(solved[:b * n_actions])
        if hit.size:
            c = int(hit[np.argmin(g[idx[hit // n_actions]])])
            return path_to(int(idx[c // n_actions]), c % n_actions)
        if n_nodes + b * n_actions > max_nodes:
            break
        h = np.ascontiguousarray(np.maximum(cost_to_go(q, gamma) - 1.0, 0.0).reshape(-1))
        if keys is None:
            keys = position_keys(policy, flat)
        n_nodes, open_size = astar_push_children(keys, h, idx, n_actions, flat, float(weight), states, parent,
                                                 action, g, n_nodes, table_keys, table_g, used, hf, hn, open_size)
    return None


def verify(puzzle, state, solution) -> bool:
    return solution is not None and is_solved(apply_moves(puzzle, state, solution))


SEARCHES = ("greedy", "beam", "astar")


def solve_many(policy, puzzle, states, n_actions, search="greedy", beam_width=64, max_moves=30,
               weight=0.6, gamma=1.0, threads=1):
    """Solve each state; returns (solved, lengths, seconds per cube, solutions), all verified.

    beam_width is the beam's width, or the nodes A* expands per forward pass; weight and
    gamma (the discount the network was trained with) are for A* only.

    threads > 1 solves several cubes at once, one per thread, each with its own copy of the
    policy's workspaces (Policy.fork); the kernels release the GIL and each thread's GEMMs
    run on that thread alone meanwhile (threads.one_gemm_thread), so T threads use T cores
    (on the cube3 net too: beam 64 and 512 ran 1.07-1.15x faster this way than one search
    with its GEMMs on a two-thread team, docs/performance-log.md, stop 33). Beam and A*
    hand out cubes one at a time; greedy gives each thread a contiguous share. Results
    equal the one-thread results.
    """
    states = np.atleast_2d(states)
    n = len(states)
    if search not in SEARCHES:
        raise ValueError(f"unknown search '{search}' (expected one of: {', '.join(SEARCHES)})")
    moves = np.ascontiguousarray(puzzle.moves)
    threads = max(1, min(int(threads), n))
    if threads > 1:
        sols, per = _solve_threaded(policy, states, moves, n_actions, search, beam_width, max_moves, weight,
                                    gamma, threads)
    elif search == "greedy":
        sols, per = _solve_greedy(policy, states, moves, max_moves)
    else:
        done = [_solve_one(policy, states[i], moves, n_actions, search, beam_width, max_moves, weight, gamma)
                for i in range(n)]
        sols, per = [s for s, _ in done], np.array([secs for _, secs in done])
    ok = np.array([verify(puzzle, states[i], sols[i]) for i in range(n)], dtype=bool)
    lengths = np.array([len(sols[i]) if ok[i] else -1 for i in range(n)])
    sols = [sols[i] if ok[i] else None for i in range(n)]
    return ok, lengths, per, sols


def _solve_one(policy, state, moves, n_actions, search, beam_width, max_moves, weight, gamma):
    """(solution, seconds) of one cube by beam search or A*."""
    t = time.perf_counter()
    if search == "beam":
        sol = beam_search(policy, state, moves, n_actions, beam_width, max_moves)
    else:
        sol = astar_search(policy, state, moves, n_actions, beam_width, weight, max_moves, gamma)
    return sol, time.perf_counter() - t


def _solve_greedy(policy, states, moves, max_moves):
    """(solutions, seconds per cube): the batch's wall time shared equally among its cubes."""
    t = time.perf_counter()
    _, _, sols = greedy_solve(policy, states, moves, max_moves)
    return list(sols), np.full(len(states), (time.perf_counter() - t) / max(len(states), 1))


def _solve_threaded(policy, states, moves, n_actions, search, beam_width, max_moves, weight, gamma, threads):
    import threading
    from concurrent.futures import ThreadPoolExecutor

    from .threads import one_gemm_thread
    n = len(states)
    fork = getattr(policy, "fork", None)
    if fork is None:
        raise ValueError("this policy cannot be shared between threads (it has no fork())")
    local = threading.local()

    def own_policy():
        if not hasattr(local, "policy"):
            local.policy = fork()
        return local.policy

    def one(i):
        return _solve_one(own_policy(), states[i], moves, n_actions, search, beam_width, max_moves, weight, gamma)

    def share(part):
        return _solve_greedy(own_policy(), states[part], moves, max_moves)

    with one_gemm_thread(), ThreadPoolExecutor(threads) as pool:
        if search == "greedy":
            parts = np.array_split(np.arange(n), threads)
            done = list(pool.map(share, parts))
            sols = [s for part_sols, _ in done for s in part_sols]
            per = np.concatenate([secs for _, secs in done])
        else:
            done = list(pool.map(one, range(n)))
            sols = [s for s, _ in done]
            per = np.array([secs for _, secs in done])
    return sols, per
