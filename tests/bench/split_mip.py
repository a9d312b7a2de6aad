#!/usr/bin/python3
"""How far splitting server pairs into idle slots can take one colouring: an exact answer.

Reads `bench_stages --dump [servers]` (the tiled Megatron rail matrix M, the factorized decomposer's
unsplit stages, then its split ones) on standard input and solves, with HiGHS through SciPy
(Debian: python3-scipy; the library does not use it), the mixed-integer program

  minimise sum_t w_t  over the stage weights w_t >= 0, with the unsplit stages' permutations kept,
  where each stage may also serve, in its idle slots (a sender and a receiver that the stage leaves
  idle), any matching of server pairs (binary z, at most one pair per idle sender and receiver), and
  every pair (i, j) is served: the bytes x_{ij,t} <= w_t it gets in its stages sum to M(i, j).

That is the best any split pass (factorized_decomposer::split_pairs) can do on this colouring, with
`--extra K` more stages that start empty (any matching). It prints the model's ratio to LB_alpha
at alpha 10 us and 50 GB/s (bench_stages --lb-alpha's), beside the LP relaxation (fractional
matchings) and the split decomposer's own result. A model, not a measurement.

Usage: build/tests/bench_stages --dump 40 | tests/bench/split_mip.py [--extra K] [--time-limit S]
"""
import argparse
import sys

import numpy as np
from scipy.optimize import Bounds, LinearConstraint, milp
from scipy.sparse import lil_matrix

ALPHA_BYTES = 10e-6 * 50e9  # one stage's alpha, in bytes at the NIC's rate


def read_dump(lines):
    blocks, cur = [], None
    for line in lines:
        if line.startswith("#"):
            cur = []
            blocks.append(cur)
        elif line.strip():
            cur.append([int(v) for v in line.split()])
    if len(blocks) != 3:
        sys.exit("split_mip.py: expected bench_stages --dump output (a matrix and two stage lists)")
    m = np.array(blocks[0], dtype=np.float64)
    stages = [(b[0], b[1:]) for b in blocks[1]]
    split = [(b[0], b[1:]) for b in blocks[2]]
    return m, stages, split


def solve(m, perms, relax, time_limit):
    """Least sum of weights (in units of L) for these stages, idle slots matched (or fractional)."""
    s = m.shape[0]
    load = max(m.sum(0).max(), m.sum(1).max())
    mn = m / load
    fixed, cand = [], []
    for t, p in enumerate(perms):
        busy_in = {j for i, j in enumerate(p) if j >= 0 and j != i}
        idle_out = [i for i, j in enumerate(p) if j < 0 or j == i]
        idle_in = [j for j in range(s) if j not in busy_in]
        fixed += [((i, j), t) for i, j in enumerate(p) if j >= 0 and j != i]
        cand += [((i, j), t) for i in idle_out for j in idle_in if i != j and m[i, j] > 0]
    n_t, n_f, n_c = len(perms), len(fixed), len(cand)
    x_f, x_c, z = n_t, n_t + n_f, n_t + n_f + n_c  # variable offsets
    nv = z + n_c
    rows, lo, hi = [], [], []

    def row(coeffs, low, high):
        rows.append(coeffs)
        lo.append(low)
        hi.append(high)

    for k, (_, t) in enumerate(fixed):
        row({x_f + k: 1, t: -1}, -np.inf, 0)  # a stage carries at most its weight per pair
    for k, (pr, t) in enumerate(cand):
        row({x_c + k: 1, t: -1}, -np.inf, 0)
        row({x_c + k: 1, z + k: -mn[pr]}, -np.inf, 0)  # only where the pair is matched
    cover = {}
    for k, (pr, _) in enumerate(fixed):
        cover.setdefault(pr, {})[x_f + k] = 1
    for k, (pr, _) in enumerate(cand):
        cover.setdefault(pr, {})[x_c + k] = 1
    for pr, coeffs in cover.items():
        row(coeffs, mn[pr], np.inf)
    if any(mn[i, j] > 0 and (i, j) not in cover for i in range(s) for j in range(s)):
        sys.exit("split_mip.py: a pair with bytes is in no stage")
    ends = {}
    for k, ((i, j), t) in enumerate(cand):  # one pair per idle sender and per idle receiver
        ends.setdefault(("out", t, i), {})[z + k] = 1
        ends.setdefault(("in", t, j), {})[z + k] = 1
    for coeffs in ends.values():
        row(coeffs, -np.inf, 1)
    a = lil_matrix((len(rows), nv))
    for r, coeffs in enumerate(rows):
        for v, c in coeffs.items():
            a[r, v] = c
    c = np.zeros(nv)
    c[:n_t] = 1
    integrality = np.zeros(nv)
    if not relax:
        integrality[z:] = 1
    upper = np.full(nv, np.inf)
    upper[z:] = 1
    res = milp(c, constraints=LinearConstraint(a.tocsr(), lo, hi), integrality=integrality,
               bounds=Bounds(np.zeros(nv), upper), options={"time_limit": time_limit})
    if res.x is None:
        sys.exit("split_mip.py: HiGHS found no solution: " + res.message)
    return res.fun, res.status == 0, load, n_c


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--extra", type=int, default=0, help="empty stages added (any matching)")
    ap.add_argument("--time-limit", type=float, default=120, help="HiGHS time limit, seconds")
    args = ap.parse_args()
    m, stages, split = read_dump(sys.stdin)
    s = m.shape[0]
    perms = [p for _, p in stages] + [[-1] * s] * args.extra
    t = len(perms)
    load = max(m.sum(0).max(), m.sum(1).max())
    lb_alpha = load + (s - 1) * ALPHA_BYTES

    def ratio(weight_sum_l, stages_n):
        return (weight_sum_l * load + stages_n * ALPHA_BYTES) / lb_alpha

    unsplit = sum(w for w, _ in stages) / load
    split_sum = sum(w for w, _ in split) / load
    relaxed, _, _, _ = solve(m, perms, True, args.time_limit)
    best, optimal, _, n_c = solve(m, perms, False, args.time_limit)
    print(f"servers {s}, stages {t} ({len(stages)} of the colouring + {args.extra} empty), "
          f"{n_c} idle-slot (pair, stage) candidates")
    print(f"sum of weights / L, and model time / LB_alpha (alpha 10 us):")
    print(f"  factorized, unsplit            {unsplit:.4f}  {ratio(unsplit, len(stages)):.4f}")
    print(f"  factorized split (heuristic)   {split_sum:.4f}  {ratio(split_sum, len(split)):.4f}")
    print(f"  best split of this colouring   {best:.4f}  {ratio(best, t):.4f}"
          f"  ({'optimal' if optimal else 'time limit: best found'})")
    print(f"  LP relaxation (a bound)        {relaxed:.4f}  {ratio(relaxed, t):.4f}")
    print(f"  1.05 needs a sum of at most    {(1.05 * lb_alpha - t * ALPHA_BYTES) / load:.4f}")


if __name__ == "__main__":
    main()
