#!/usr/bin/env python3
"""Mutation testing of fasta2a's test suite (issue 12): realistic one-line bugs in a copy of the tree,
each run against the test executables that cover its file. A mutant is KILLED when a test fails (or
times out), SURVIVED when every test passes. Results: tools/MUTATION.md.

  tools/mutate.py [--work DIR] [--only ID,ID] [--list] [--check] [--fresh] [--jobs N] [--timeout S]
                  [--one-at-a-time] [--table]

Each mutation is one line of a header (`old`, replaced by `new`), in which expression `a` becomes `b`.
By default the copy holds every mutant at once as a schema, `(fasta2a_mutant(K) ? (b) : (a))`, and
FASTA2A_MUTANT=K in the environment switches mutant K on at run time: each covering test executable
is compiled once, run once unmutated (the baseline, which must pass) and once per mutant (doctest
stops at the first failure; MPI tests run through their ctest names under mpiexec, which passes the
variable on). The copy and its build folder (DIR/src, DIR/build) are kept between runs and only
changed files are rewritten, so a second run rebuilds only what changed; --fresh starts over.
--one-at-a-time applies each mutation's `new` line to the copy instead and rebuilds its targets (the
literal method; slow; a mutant that does not compile is INVALID). --check verifies every mutation
(its line occurs once, `a` occurs once in it, and replacing `a` by `b` gives `new`), --list prints them,
--table prints DIR/results.jsonl as the table of tools/MUTATION.md.

Anchors: a mutation whose line is no longer in its file (a merge edited it) is reported as
"SKIPPED ... ANCHOR NOT FOUND" (or found several times), recorded as anchor-missing, and the others
still run; the exit status is then 1. Re-anchor it (old, new, a, b) and rerun it with --only.
Too slow for CI; run it before resolving a robustness issue and whenever the suite changes much.
Results go to stdout and DIR/results.jsonl.

Known equivalent mutants (they cannot be killed; keep them as a check on this list's reasoning):
- verify-lower-bound-off-by-one: verify's "below the lower bound" check cannot fire once the rail
  loads passed theirs (the busiest server spreads its inter-server bytes over G rails, so one rail
  carries at least ceil(bytes / G) = the bound, and each of its stage loads is within the stage's
  weight), so weakening it changes no verdict.
- engine-reuse-ignores-budget: a call's staging budget depends only on the largest max(sent,
  received) over the ranks and on the engine's fixed options, and a kept plan is reused only for
  the same matrix or its transpose (each rank's sent and received bytes swapped): the same budget.
"""
import argparse, fnmatch, json, os, re, shutil, subprocess, sys, time

# Each: id, file, the exact text (unique in the file), its replacement, the test executables
# (CMake targets) that cover it, and for MPI targets a ctest regex instead of running them directly.
M = [
    # planner.hpp
    dict(id="planner-partial-granule-rounded-up", file="include/fasta2a/planner.hpp",
         old="      cap[best] += i < whole ? granule : part;",
         new="      cap[best] += i < whole ? granule : granule;",
         a="i < whole ? granule : part", b="i < whole ? granule : granule",
         targets=["test_planner_and_decomposers"], args=["--source-file=*/test_planner.cpp"]),
    dict(id="planner-per-rail-bytes-whole-remainder", file="include/fasta2a/planner.hpp",
         old="return base + std::min(rem, granule); // the first rail's share of the remainder",
         new="return base + rem; // the first rail's share of the remainder",
         a="std::min(rem, granule)", b="rem",
         targets=["test_planner_and_decomposers"], args=["--source-file=*/test_planner.cpp"]),
    dict(id="planner-padding-stage-kept", file="include/fasta2a/planner.hpp",
         old="if (pair_weight_[pr] >= m_(s, d)) entry = -1;",
         new="if (pair_weight_[pr] > m_(s, d)) entry = -1;",
         a="pair_weight_[pr] >= m_(s, d)", b="pair_weight_[pr] > m_(s, d)",
         targets=["test_planner_and_decomposers"], args=["--source-file=*/test_planner.cpp"]),
    dict(id="planner-own-rail-ignored", file="include/fasta2a/planner.hpp",
         old="for (int k = 0; k < G; ++k) res[k] = cap_[k] - std::min(B(k, k), cap_[k]);",
         new="for (int k = 0; k < G; ++k) res[k] = cap_[k];",
         a="cap_[k] - std::min(B(k, k), cap_[k])", b="cap_[k]",
         targets=["test_planner_and_decomposers"], args=["--source-file=*/test_planner.cpp"]),
    # decompose.hpp
    dict(id="decompose-units-floor", file="include/fasta2a/decompose.hpp",
         old="return unit == 1 ? v : v / unit + (v % unit != 0);", new="return unit == 1 ? v : v / unit;",
         a="v / unit + (v % unit != 0)", b="v / unit",
         targets=["test_planner_and_decomposers"], args=["--source-file=*/test_fewer_stages.cpp"]),
    dict(id="decompose-diagonal-padding-max", file="include/fasta2a/decompose.hpp",
         old="const bytes_t d = std::min(row[i], col[i]);", new="const bytes_t d = std::max(row[i], col[i]);",
         a="std::min(row[i], col[i])", b="std::max(row[i], col[i])",
         targets=["test_planner_and_decomposers"], args=["--source-file=*/test_planner.cpp"]),
    # detail::heaviest_first (Birkhoff's and slack's order), its insertion sort up to 32 stages
    dict(id="birkhoff-lightest-first", file="include/fasta2a/decompose.hpp",
         old="for (; i > 0 && weight[order_[i - 1]] < weight[x]; --i)",
         new="for (; i > 0 && weight[order_[i - 1]] > weight[x]; --i)",
         a="weight[order_[i - 1]] < weight[x]", b="weight[order_[i - 1]] > weight[x]",
         targets=["test_planner_and_decomposers"], args=["--source-file=*/test_planner.cpp"]),
    # fewer_stages.hpp
    dict(id="quantum-divides-by-n", file="include/fasta2a/fewer_stages.hpp",
         old="net.alpha_s * net.bandwidth * L / (n - 1));", new="net.alpha_s * net.bandwidth * L / n);",
         a="L / (n - 1)", b="L / n",
         targets=["test_planner_and_decomposers"], args=["--source-file=*/test_fewer_stages.cpp"]),
    dict(id="quantum-no-round-down", file="include/fasta2a/fewer_stages.hpp",
         old="return q < 2 ? 1 : floor_pow2(static_cast<bytes_t>(std::min(q, 9.2e18)));",
         new="return q < 2 ? 1 : static_cast<bytes_t>(std::min(q, 9.2e18));",
         a="floor_pow2(static_cast<bytes_t>(std::min(q, 9.2e18)))", b="static_cast<bytes_t>(std::min(q, 9.2e18))",
         targets=["test_planner_and_decomposers"], args=["--source-file=*/test_fewer_stages.cpp"]),
    # verify.hpp
    dict(id="verify-two-granules-of-imbalance", file="include/fasta2a/verify.hpp",
         old="if (*hi - *lo > p.granule)", new="if (*hi - *lo > 2 * p.granule)",
         a="*hi - *lo > p.granule", b="*hi - *lo > 2 * p.granule",
         targets=["test_planner_and_decomposers"], args=["--source-file=*/test_verify.cpp"]),
    dict(id="verify-rail-load-equal-weight-refused", file="include/fasta2a/verify.hpp",
         old="if (sum > p.weight(st, static_cast<int>(k % G)))", new="if (sum > p.weight(st, static_cast<int>(k % G)) + 1)",
         a="sum > p.weight(st, static_cast<int>(k % G))", b="sum > p.weight(st, static_cast<int>(k % G)) + 1",
         targets=["test_planner_and_decomposers"], args=["--source-file=*/test_verify.cpp"]),
    dict(id="verify-gap-unchecked", file="include/fasta2a/verify.hpp",
         old="if (pc.offset != off) return fail(", new="if (pc.offset < off) return fail(",
         a="pc.offset != off", b="pc.offset < off",
         targets=["test_planner_and_decomposers"], args=["--source-file=*/test_verify.cpp"]),
    # EQUIVALENT (cannot be killed; see the module comment and tools/MUTATION.md): once every rail
    # load is within its stage's weight, the weights sum to at least ceil(busiest server's bytes / G).
    dict(id="verify-lower-bound-off-by-one", file="include/fasta2a/verify.hpp",
         old="if (total < bound)", new="if (total + 1 < bound)",
         a="total < bound", b="total + 1 < bound",
         targets=["test_planner_and_decomposers"], args=["--source-file=*/test_verify.cpp"]),
    # cost_model.hpp / topology.hpp (the model)
    dict(id="cost-direct-without-alpha", file="include/fasta2a/cost_model.hpp",
         old="pr.scaleout_s = net.direct_time(nic);", new="pr.scaleout_s = net.transfer_time(nic);",
         a="net.direct_time(nic)", b="net.transfer_time(nic)",
         targets=["test_traffic_cost_program_json_registry"], args=["--source-file=*/test_cost_model.cpp"]),
    dict(id="model-direct-time-without-alpha", file="include/fasta2a/topology.hpp",
         old="return busiest_nic > 0 ? stage_time(busiest_nic) : 0.0;",
         new="return busiest_nic > 0 ? transfer_time(busiest_nic) : 0.0;",
         a="stage_time(busiest_nic)", b="transfer_time(busiest_nic)",
         targets=["test_planner_and_decomposers"], args=["--source-file=*/test_topology.cpp"]),
    dict(id="cost-overall-min", file="include/fasta2a/cost_model.hpp",
         old="double overall_s() const noexcept { return std::max(scaleout_s, scaleup_s); }",
         new="double overall_s() const noexcept { return std::min(scaleout_s, scaleup_s); }",
         a="std::max(scaleout_s, scaleup_s)", b="std::min(scaleout_s, scaleup_s)",
         targets=["test_traffic_cost_program_json_registry"], args=["--source-file=*/test_cost_model.cpp"]),
    dict(id="cost-direct-total-ignores-scaleup", file="include/fasta2a/cost_model.hpp",
         old="pr.total_s = std::max(pr.scaleout_s, pr.scaleup_s);", new="pr.total_s = pr.scaleout_s;",
         a="std::max(pr.scaleout_s, pr.scaleup_s)", b="pr.scaleout_s",
         targets=["test_traffic_cost_program_json_registry"], args=["--source-file=*/test_cost_model.cpp"]),
    # plan files: plan_reader.hpp, json_writer.hpp
    dict(id="json-hop-to-rank-n-accepted", file="include/fasta2a/plan_reader.hpp",
         old='if (x.to >= N) fail(wh, "field \\"to\\" is "', new='if (x.to > N) fail(wh, "field \\"to\\" is "',
         a="x.to >= N", b="x.to > N",
         targets=["test_traffic_cost_program_json_registry"], args=["--source-file=*/test_json.cpp"]),
    dict(id="json-perm-to-server-s-accepted", file="include/fasta2a/plan_reader.hpp",
         old="if (perm[s] >= S || perm[s] == s)", new="if (perm[s] > S || perm[s] == s)",
         a="perm[s] >= S", b="perm[s] > S",
         targets=["test_traffic_cost_program_json_registry"], args=["--source-file=*/test_json.cpp"]),
    dict(id="json-zero-byte-piece-accepted", file="include/fasta2a/plan_reader.hpp",
         old="if (pc.bytes == 0)\n        fail(", new="if (pc.bytes == 0 && false)\n        fail(",
         a="pc.bytes == 0", b="pc.bytes == 0 && false",
         targets=["test_traffic_cost_program_json_registry"], args=["--source-file=*/test_json.cpp"]),
    dict(id="json-writer-hop-to-written-as-from", file="include/fasta2a/json_writer.hpp",
         old="        number(x.to);", new="        number(x.from);",
         a="x.to", b="x.from",
         targets=["test_traffic_cost_program_json_registry"], args=["--source-file=*/test_json.cpp"]),
    # plan.hpp (routes and staging shared by planner and reader)
    dict(id="plan-staging-slot-at-wrong-end", file="include/fasta2a/plan.hpp",
         old="pc.stage_in = rail_target == pc.dst ? no_staging : in_base + pos;",
         new="pc.stage_in = rail_source == pc.dst ? no_staging : in_base + pos;",
         a="rail_target == pc.dst", b="rail_source == pc.dst",
         targets=["test_planner_and_decomposers"], args=["--source-file=*/test_planner.cpp"]),
    # program.hpp
    dict(id="program-rail-source-as-target", file="include/fasta2a/program.hpp",
         old="const rank_t a = pc.rail >= 0 ? p.rail_source(pc) : -1, b = pc.rail >= 0 ? p.rail_target(pc) : -1;",
         new="const rank_t a = pc.rail >= 0 ? p.rail_target(pc) : -1, b = pc.rail >= 0 ? p.rail_target(pc) : -1;",
         a="p.rail_source(pc)", b="p.rail_target(pc)",
         targets=["test_traffic_cost_program_json_registry"], args=["--source-file=*/test_program.cpp"]),
    # transports: host.hpp, mpi.hpp
    # transports: host.hpp (the lead's revocable-region work may move these lines)
    dict(id="host-signal-before-count", file="transports/host/include/fasta2a/host.hpp",
         old="return detail::poll_until([&] { return c.load(std::memory_order_acquire) >= count; }, waiting_, timeout);",
         new="return detail::poll_until([&] { return c.load(std::memory_order_acquire) + 1 >= count; }, waiting_, timeout);",
         a="c.load(std::memory_order_acquire) >= count", b="c.load(std::memory_order_acquire) + 1 >= count",
         targets=["test_host_conformance_and_tcp_bootstrap"], args=["--source-file=*conformance*"]),
    dict(id="host-test-off-by-one", file="transports/host/include/fasta2a/host.hpp",
         old="return counter(rank_, peer, ch).load(std::memory_order_acquire) >= count;",
         new="return counter(rank_, peer, ch).load(std::memory_order_acquire) + 1 >= count;",
         a="counter(rank_, peer, ch).load(std::memory_order_acquire) >= count", b="counter(rank_, peer, ch).load(std::memory_order_acquire) + 1 >= count",
         targets=["test_host_conformance_and_tcp_bootstrap"], args=["--source-file=*conformance*"]),
    dict(id="host-put-source-offset-dropped", file="transports/host/include/fasta2a/host.hpp",
         old="std::memcpy(dst.ptr + dst_off, src.ptr + src_off, n);", new="std::memcpy(dst.ptr + dst_off, src.ptr, n);",
         a="src.ptr + src_off", b="src.ptr",
         targets=["test_host_conformance_and_tcp_bootstrap"], args=["--source-file=*conformance*"]),
    # transports: mpi.hpp
    dict(id="mpi-chunk-count-floor", file="transports/mpi/include/fasta2a/mpi.hpp",
         old="return n == 0 ? 1 : (n - 1) / limit + 1;", new="return n == 0 ? 1 : n / limit + 1;",
         a="(n - 1) / limit + 1", b="n / limit + 1",
         targets=["test_mpi"], run=[], ctest=r"^mpi\.np4$"),
    dict(id="mpi-max-message-int-max-plus-one", file="transports/mpi/include/fasta2a/mpi.hpp",
         old="if (m == 0 || m > mpi_int_max)", new="if (m == 0 || m > mpi_int_max + 1)",
         a="m > mpi_int_max", b="m > mpi_int_max + 1",
         targets=["test_mpi"], run=[], ctest=r"^mpi\.np4$"),
    # the covered-count check of wait(): the first expect a signal covers is not waited for
    dict(id="mpi-wait-skips-first-covered-expect", file="transports/mpi/include/fasta2a/mpi.hpp",
         old="in.covered <= in.expects_base ? in.reqs_base : in.expect_end[in.covered - 1 - in.expects_base];",
         new="in.covered <= in.expects_base + 1 ? in.reqs_base : in.expect_end[in.covered - 1 - in.expects_base];",
         a="in.covered <= in.expects_base", b="in.covered <= in.expects_base + 1",
         targets=["test_mpi"], run=[], ctest=r"^mpi\.np4(\.tcp)?$"),
    # progress(): a probe of any tag matches a signal not yet taken and returns without progress
    dict(id="mpi-progress-probe-any-tag", file="transports/mpi/include/fasta2a/mpi.hpp",
         old="detail::mpi_check(MPI_Iprobe(MPI_ANY_SOURCE, progress_tag(), comm_, &flag, MPI_STATUS_IGNORE),",
         new="detail::mpi_check(MPI_Iprobe(MPI_ANY_SOURCE, MPI_ANY_TAG, comm_, &flag, MPI_STATUS_IGNORE),",
         a="progress_tag()", b="MPI_ANY_TAG",
         targets=["test_mpi"], run=[], ctest=r"^mpi\.np2(\.tcp)?$"),
    # rma.hpp (shared by the libfabric and verbs transports; tested on any machine by test_rma)
    dict(id="rma-chunk-count-floor", file="include/fasta2a/rma.hpp",
         old="return n / max + (n % max != 0);", new="return n / max;",
         a="n / max + (n % max != 0)", b="n / max",
         targets=["test_rma"], args=["--source-file=*/test_rma.cpp"]),
    dict(id="rma-last-chunk-full-length", file="include/fasta2a/rma.hpp",
         old="for (std::size_t off = 0; off < n; off += max) f(off, n - off < max ? n - off : max);",
         new="for (std::size_t off = 0; off < n; off += max) f(off, max);",
         a="n - off < max ? n - off : max", b="max",
         targets=["test_rma"], args=["--source-file=*/test_rma.cpp"]),
    dict(id="rma-imm32-channel-decoded-at-wrong-shift", file="include/fasta2a/rma.hpp",
         old="f.ch = (imm >> seq_bits) & (max_channels - 1);", new="f.ch = (imm >> channel_bits) & (max_channels - 1);",
         a="imm >> seq_bits", b="imm >> channel_bits",
         targets=["test_rma"], args=["--source-file=*/test_rma.cpp"]),
    dict(id="rma-signal-sent-before-its-put-completes", file="include/fasta2a/rma.hpp",
         old="if (posted && need <= done && waiting_.empty()) sent_upto_ = index;",
         new="if (posted && need <= done + 1 && waiting_.empty()) sent_upto_ = index;",
         a="need <= done", b="need <= done + 1",
         targets=["test_rma"], args=["--source-file=*/test_rma.cpp"]),
    # engine.hpp: anchored in run(), take(), await() and run_stages(), not in execute()'s error paths
    # (issue 12's engine work), except engine-finish-wait-skipped, which is in execute().
    dict(id="engine-rail-window-off-by-one", file="include/fasta2a/engine.hpp",
         old="if (bal_i == waits.size() && cr_i == credits.size() && leaving_.size() < W) {",
         new="if (bal_i == waits.size() && cr_i == credits.size() && leaving_.size() <= W) {",
         a="leaving_.size() < W", b="leaving_.size() <= W",
         targets=["test_engine_host", "test_host_conformance_and_tcp_bootstrap"], args=["--source-file=*/test_engine_host.cpp,*conformance*"]),
    # the transport contract (issue 49 item 3): the engine asks for a capability by its concept
    dict(id="engine-ignores-drives-progress", file="include/fasta2a/engine.hpp",
         old="  static constexpr bool drives_progress = DrivesProgress<C>;",
         new="  static constexpr bool drives_progress = false && DrivesProgress<C>;",
         a="= DrivesProgress<C>", b="= false && DrivesProgress<C>",
         targets=["test_engine_host"], args=["--source-file=*/test_transport_contract.cpp"]),
    dict(id="engine-retires-without-abandon", file="include/fasta2a/engine.hpp",
         old="    if constexpr (Abandonable<C>) c->abandon();",
         new="    if constexpr (false && Abandonable<C>) c->abandon();",
         a="(Abandonable<C>)", b="(false && Abandonable<C>)",
         targets=["test_engine_host"], args=["--source-file=*/test_transport_contract.cpp"]),
    # shared staging (issue 13): a slot released for stage t + K before stage t is done with it
    dict(id="engine-balance-slot-released-before-rail-sent", file="include/fasta2a/engine.hpp",
         old="      while (rel_out < released && rel_out < rail &&", new="      while (rel_out < released && rel_out <= rail &&",
         a="rel_out < rail", b="rel_out <= rail",
         targets=["test_engine_host", "test_host_conformance_and_tcp_bootstrap"], args=["--source-file=*/test_engine_host.cpp,*conformance*"]),
    dict(id="engine-arrival-slot-released-before-redistributed", file="include/fasta2a/engine.hpp",
         old="      while (rel_in < released && rel_in < redist) {", new="      while (rel_in < released && rel_in <= redist) {",
         a="rel_in < redist", b="rel_in <= redist",
         targets=["test_engine_host", "test_host_conformance_and_tcp_bootstrap"], args=["--source-file=*/test_engine_host.cpp,*conformance*"]),
    # shared staging over MPI (expects_gate_puts): a slot freed by posting the next stage's rail
    # expects; stage K's posted at the start lets its bytes land before stage 0 is redistributed
    dict(id="engine-lazy-expects-of-stage-K-posted-at-start", file="include/fasta2a/engine.hpp",
         old="           static_cast<std::size_t>(i.stage) >= pg.ring();",
         new="           static_cast<std::size_t>(i.stage) > pg.ring();",
         a="static_cast<std::size_t>(i.stage) >= pg.ring()", b="static_cast<std::size_t>(i.stage) > pg.ring()",
         targets=["test_conformance_mpi"], run=[], ctest=r"^mpi\.conformance\.np4$"),
    dict(id="planner-shared-staging-one-slot-for-all-stages", file="include/fasta2a/planner.hpp",
         old="        const bytes_t at = static_cast<bytes_t>(static_cast<std::uint32_t>(st) % ring_) * slot_ + pos - (cum - c.weight[st]);",
         new="        const bytes_t at = static_cast<bytes_t>(0u) * slot_ + pos - (cum - c.weight[st]);",
         a="static_cast<std::uint32_t>(st) % ring_", b="0u",
         targets=["test_traffic_cost_program_json_registry"], args=["--source-file=*/test_program.cpp"]),
    dict(id="program-credit-for-stage-before-ring", file="include/fasta2a/program.hpp",
         old="        if (K > 0 && t >= K) { // staging credits of stage t (see rank_program)",
         new="        if (K > 0 && t + 1 >= K) { // staging credits of stage t (see rank_program)",
         a="t >= K", b="t + 1 >= K",
         targets=["test_traffic_cost_program_json_registry"], args=["--source-file=*/test_program.cpp"]),
    dict(id="engine-redistribute-before-last-rail-wait", file="include/fasta2a/engine.hpp",
         old="        if (in_i == waits.size()) {", new="        if (in_i + 1 >= waits.size()) {",
         a="in_i == waits.size()", b="in_i + 1 >= waits.size()",
         targets=["test_engine_host", "test_host_conformance_and_tcp_bootstrap"], args=["--source-file=*/test_engine_host.cpp,*conformance*"]),
    dict(id="engine-take-does-not-count", file="include/fasta2a/engine.hpp",
         old="if (ok) ++e;", new="if (ok) e += 0;",
         a="++e", b="e += 0",
         targets=["test_engine_host", "test_host_conformance_and_tcp_bootstrap"], args=["--source-file=*/test_engine_host.cpp,*conformance*"]),
    dict(id="engine-take-tests-current-count", file="include/fasta2a/engine.hpp",
         old="out_conn_->test(w.peer, w.channel, e + 1);", new="out_conn_->test(w.peer, w.channel, e);",
         a="out_conn_->test(w.peer, w.channel, e + 1)", b="out_conn_->test(w.peer, w.channel, e)",
         targets=["test_engine_host", "test_host_conformance_and_tcp_bootstrap"], args=["--source-file=*/test_engine_host.cpp,*conformance*"]),
    dict(id="engine-finish-wait-skipped", file="include/fasta2a/engine.hpp",
         old="for (const instr& w : pg.at(sec::finish)) await(x, w);", new="for (const instr& w : pg.at(sec::finish)) (void)w;",
         a="await(x, w)", b="(void)w",
         targets=["test_engine_host", "test_host_conformance_and_tcp_bootstrap"], args=["--source-file=*/test_engine_host.cpp,*conformance*"]),
    dict(id="engine-copy-source-offset-dropped", file="include/fasta2a/engine.hpp",
         old="case instr_op::copy: mem_.copy(local_ptr(x, i.dst_buf) + i.dst, local_ptr(x, i.src_buf) + i.src, i.bytes); break;",
         new="case instr_op::copy: mem_.copy(local_ptr(x, i.dst_buf) + i.dst, local_ptr(x, i.src_buf), i.bytes); break;",
         a="local_ptr(x, i.src_buf) + i.src", b="local_ptr(x, i.src_buf)",
         targets=["test_engine_host", "test_host_conformance_and_tcp_bootstrap"], args=["--source-file=*/test_engine_host.cpp,*conformance*"]),
    # an expect lands at the offset of its buffer inside a larger registration (a window or a cached
    # buffer); only transports with real expects (MPI) see it: the host transport's expect is a no-op
    dict(id="engine-expect-ignores-buffer-base", file="include/fasta2a/engine.hpp",
         old="      const bytes_t dst = i.dst + local_base(x, i.dst_buf);", new="      const bytes_t dst = i.dst;",
         a="i.dst + local_base(x, i.dst_buf)", b="i.dst",
         targets=["test_mpi", "test_conformance_mpi"], run=[], ctest=r"^mpi\.(np4|conformance\.np4)$"),
    # bouncing happens where the scale-out transport cannot register the memory space's memory: the
    # stand-in GPU engine over MPI (device memory, MPI for scale-out; gpu_ipc registers it directly)
    dict(id="engine-bounce-in-skipped", file="include/fasta2a/engine.hpp",
         old="          bounce_in(x, redist);", new="          (void)redist;",
         a="bounce_in(x, redist)", b="(void)redist",
         targets=["test_gpu_engine_mpi"], run=[], ctest=r"^gpu_standin\.engine_mpi\.np4$"),
    # the engine no longer drives the other tier's progress while it waits on one: over MPI without
    # single-copy shared memory, ranks waiting for scale-up signals leave their rail sends unsent
    # (the deadlock first seen on an H200)
    dict(id="engine-no-cross-tier-progress", file="include/fasta2a/engine.hpp",
         old="      if constexpr (drives_progress<out_conn>) out_conn_->progress();",
         new="      if constexpr (drives_progress<out_conn>) (void)0;",
         a="out_conn_->progress()", b="(void)0",
         targets=["test_gpu_engine_mpi"], run=[], ctest=r"^gpu_standin\.engine_mpi\.progress$"),
    # gpu_memory.hpp: every per-call event made by the runtime (no pool): cuEventCreate waits for the
    # context lock that a caller blocked in a copy into pageable memory holds (a hang on an H200)
    dict(id="gpu-memory-event-pool-bypassed", file="transports/gpu/include/fasta2a/gpu_memory.hpp",
         old="      if (events_->free.empty()) grow_events(events_->all.size()); // all in use: twice as many",
         new="      if (true) grow_events(events_->all.size()); // all in use: twice as many",
         a="events_->free.empty()", b="true",
         targets=["test_gpu_ipc_standin"]),
    # Issue 13's code (added 2026-12-06): the plan of the transposed matrix, the engine's kept
    # plans, the rank view's walk, per-rail choices and plan files, the decomposers' shortcuts and
    # the pipelined cost model.
    dict(id="transpose-per-rail-balance-of-rail-source", file="include/fasta2a/transpose.hpp",
         old="b.stage_out = in_was ? a.stage_in - balance[rd] : no_staging;",
         new="b.stage_out = in_was ? a.stage_in - balance[rs] : no_staging;",
         a="balance[rd]", b="balance[rs]",
         targets=["test_planner_and_decomposers"], args=["--source-file=*/test_transpose.cpp"]),
    dict(id="transpose-second-ring-dropped", file="include/fasta2a/transpose.hpp",
         old="b.stage_in = out_was ? in_ring + at : no_staging;", new="b.stage_in = out_was ? at : no_staging;",
         a="in_ring + at", b="at",
         targets=["test_planner_and_decomposers"], args=["--source-file=*/test_transpose.cpp"]),
    dict(id="transpose-paired-ops-not-swapped", file="include/fasta2a/transpose.hpp",
         old="const rank_op& o = from[i + next - prev];", new="const rank_op& o = from[i];",
         a="i + next - prev", b="i",
         targets=["test_planner_and_decomposers"], args=["--source-file=*/test_transpose.cpp"]),
    dict(id="engine-reuse-reads-own-match-bits", file="include/fasta2a/engine.hpp",
         old="      match &= word(r, h_match);", new="      match &= word(me_, h_match);",
         a="word(r, h_match)", b="word(me_, h_match)",
         targets=["test_engine_host"], args=["--source-file=*/test_engine_host.cpp"]),
    dict(id="engine-reuse-ignores-budget", file="include/fasta2a/engine.hpp",
         old="if (kept_[at].budget != budget) continue;", new="if (false) continue;",
         a="kept_[at].budget != budget", b="false",
         targets=["test_engine_host"], args=["--source-file=*/test_engine_host.cpp"]),
    dict(id="engine-per-rail-balance-not-flipped", file="include/fasta2a/engine.hpp",
         old="k.balance[r] = k.p.staging_bytes[r] - k.balance[r];", new="k.balance[r] = k.balance[r];",
         a="k.p.staging_bytes[r] - k.balance[r]", b="k.balance[r]",
         targets=["test_engine_host"], args=["--source-file=*/test_engine_host.cpp"]),
    dict(id="engine-transposed-row-and-column-kept", file="include/fasta2a/engine.hpp",
         old="        std::swap(k.row, k.col); // this rank's row", new="        (void)0; // this rank's row",
         a="std::swap(k.row, k.col)", b="(void)0",
         targets=["test_engine_host"], args=["--source-file=*/test_engine_host.cpp"]),
    dict(id="planner-view-spill-mark-dropped", file="include/fasta2a/planner.hpp",
         old="            set_bit(over_, static_cast<std::size_t>(w), u);", new="            (void)0;",
         a="set_bit(over_, static_cast<std::size_t>(w), u)", b="(void)0",
         targets=["test_planner_and_decomposers"], args=["--source-file=*/test_planner.cpp"]),
    dict(id="planner-view-rail-position-counts-later-message", file="include/fasta2a/planner.hpp",
         old="ok_end = a + (k < b);", new="ok_end = a + (k <= b);",
         a="a + (k < b)", b="a + (k <= b)",
         targets=["test_planner_and_decomposers"], args=["--source-file=*/test_planner.cpp"]),
    dict(id="planner-balance-bytes-of-m-for-per-rail", file="include/fasta2a/planner.hpp",
         old="rails_ ? caps_[(static_cast<std::size_t>(s) * S + d) * G + k] : m_(s, d);",
         new="m_(s, d);",
         a="rails_ ? caps_[(static_cast<std::size_t>(s) * S + d) * G + k] : m_(s, d)", b="m_(s, d)",
         targets=["test_planner_and_decomposers"], args=["--source-file=*/test_transpose.cpp"]),
    dict(id="planner-automatic-takes-the-slower", file="include/fasta2a/planner.hpp",
         old="    if (mine < theirs) {", new="    if (mine > theirs) {",
         a="mine < theirs", b="mine > theirs",
         targets=["test_planner_and_decomposers"], args=["--source-file=*/test_per_rail.cpp"]),
    dict(id="json-per-rail-stage-weight-below-heaviest-accepted", file="include/fasta2a/plan_reader.hpp",
         old="      if (p_.stage_weight[t] != heaviest)", new="      if (p_.stage_weight[t] > heaviest)",
         a="p_.stage_weight[t] != heaviest", b="p_.stage_weight[t] > heaviest",
         targets=["test_traffic_cost_program_json_registry"], args=["--source-file=*/test_json.cpp"]),
    dict(id="slack-shift-weight-from-larger-slack", file="include/fasta2a/fewer_stages.hpp",
         old="w = std::min(w, R_[idx(s, d)] + std::min(slack_row(s), slack_col(d)));",
         new="w = std::min(w, R_[idx(s, d)] + std::max(slack_row(s), slack_col(d)));",
         a="std::min(slack_row(s), slack_col(d))", b="std::max(slack_row(s), slack_col(d))",
         targets=["test_planner_and_decomposers"], args=["--source-file=*/test_fewer_stages.cpp"]),
    dict(id="factorized-local-search-always-skipped", file="include/fasta2a/factorized.hpp",
         old="if (skip_when_tight_ && weights_sum(w_) == envelope()) return;",
         new="if (skip_when_tight_ && weights_sum(w_) >= envelope()) return;",
         a="weights_sum(w_) == envelope()", b="weights_sum(w_) >= envelope()",
         targets=["test_planner_and_decomposers"], args=["--source-file=*/test_fewer_stages.cpp"]),
    dict(id="cost-pipelined-window-one-more", file="include/fasta2a/cost_model.hpp",
         old="if (sends && leaving[r] >= W) break;", new="if (sends && leaving[r] > W) break;",
         a="leaving[r] >= W", b="leaving[r] > W",
         targets=["test_traffic_cost_program_json_registry"], args=["--source-file=*/test_cost_model.cpp"]),
    # Added 2026-12-06: the staging floor, the GPU IPC connection's kept flag values, the view's
    # skip of empty messages.
    dict(id="planner-staging-floor-ignored", file="include/fasta2a/planner.hpp",
         old="  b = std::max(b, floor);",
         new="  b = std::max(b, bytes_t{0});",
         a="std::max(b, floor)", b="std::max(b, bytes_t{0})",
         targets=["test_engine_host"], args=["--source-file=*/test_engine_host.cpp"]),
    dict(id="gpu-ipc-kept-flags-unused", file="transports/gpu/include/fasta2a/gpu_ipc.hpp",
         old="    if (st.seen[k] >= count) return true;",
         new="    if (false) return true;",
         a="st.seen[k] >= count", b="false",
         targets=["test_gpu_ipc_standin"]),
    dict(id="planner-view-skips-one-byte-messages", file="include/fasta2a/planner.hpp",
         old="          for (int i = 0; i < in_word; ++i) todo |= static_cast<std::uint64_t>(B(a, first + i) != 0) << i;",
         new="          for (int i = 0; i < in_word; ++i) todo |= static_cast<std::uint64_t>(B(a, first + i) > 1) << i;",
         a="B(a, first + i) != 0", b="B(a, first + i) > 1",
         targets=["test_planner_and_decomposers", "test_traffic_cost_program_json_registry"]),
    # program.hpp: two contiguous puts merged though their destinations are apart
    dict(id="program-coalesce-ignores-destination", file="include/fasta2a/program.hpp",
         old="prev.src + prev.bytes == x.src && prev.dst + prev.bytes == x.dst) {",
         new="prev.src + prev.bytes == x.src) {",
         a="prev.src + prev.bytes == x.src && prev.dst + prev.bytes == x.dst", b="prev.src + prev.bytes == x.src",
         targets=["test_traffic_cost_program_json_registry"], args=["--source-file=*/test_program.cpp"]),
]




SCHEMA_HEADER = """
#ifndef FASTA2A_MUTANT_SWITCH
#define FASTA2A_MUTANT_SWITCH
#include <cstdlib>
// tools/mutate.py: mutant K is on when FASTA2A_MUTANT=K.
inline bool fasta2a_mutant(int k) {
  static const int on = [] {
    const char* e = std::getenv("FASTA2A_MUTANT");
    return e ? std::atoi(e) : 0;
  }();
  return on == k;
}
#endif
"""


def run(cmd, cwd, timeout=None, log=None, env=None):
    t0 = time.time()
    try:
        p = subprocess.run(cmd, cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                           timeout=timeout, env=env, errors="replace")
        rc, out = p.returncode, p.stdout
    except subprocess.TimeoutExpired as e:
        out = e.stdout.decode(errors="replace") if isinstance(e.stdout, bytes) else (e.stdout or "")
        rc = 124
    if log:
        with open(log, "a") as f:
            f.write(f"$ {' '.join(cmd)}  (rc {rc}, {time.time() - t0:.0f} s)\n{out[-3000:]}\n")
    return rc, out


def test_programs(src):
    """tests/CMakeLists.txt's test programs: {target: [its files]} from `fasta2a_add_test(<target>
    <file>...)` (each program lists the test files it is built from)."""
    text = open(os.path.join(src, "tests", "CMakeLists.txt")).read()
    return {t: files.split() for t, files in re.findall(r"^fasta2a_add_test\((\w+)\s+([^)]*)\)", text, re.M)}


def check(src, muts):
    """The mutations whose anchors are missing or ambiguous, each with why: after a merge moves a
    line, re-anchor that mutation (its `old`, `new`, `a`, `b`); the others still run. Also those
    whose `--source-file` patterns name a test file that none of their targets is built from
    (tests/CMakeLists.txt): such a mutant would run no test."""
    bad = {}
    programs = test_programs(src)
    for m in muts:
        files = [f for t in m["targets"] for f in programs.get(t, [])]
        for arg in m.get("args", []):
            if not arg.startswith("--source-file="):
                continue
            unknown = [t for t in m["targets"] if t not in programs]
            if unknown:
                bad[m["id"]] = f"{', '.join(unknown)}: not a test program of tests/CMakeLists.txt (fix its targets)"
                continue
            for pattern in arg.split("=", 1)[1].split(","):
                if not any(fnmatch.fnmatch("tests/" + f, pattern) for f in files):
                    bad[m["id"]] = (f"no target of {', '.join(m['targets'])} is built from a file matching "
                                    f"{pattern} (tests/CMakeLists.txt): fix its targets")
        path = os.path.join(src, m["file"])
        text = open(path).read() if os.path.exists(path) else ""
        n = text.count(m["old"])
        if n != 1:
            bad[m["id"]] = (f"ANCHOR {'NOT FOUND' if n == 0 else f'FOUND {n} TIMES'} in {m['file']}: "
                            f"{m['old'][:90]!r}")
        elif m["old"].count(m["a"]) != 1 or m["old"].replace(m["a"], m["b"], 1) != m["new"]:
            bad[m["id"]] = "replacing a by b in its line does not give new (fix the mutation's fields)"
    return bad


def sync_tree(src, tree):
    """Copies the working tree (tracked and untracked files, not ignored ones) into `tree`, writing
    only files whose content changed, so that an existing build folder rebuilds only what changed."""
    files = subprocess.run(["git", "ls-files", "-co", "--exclude-standard"], cwd=src, stdout=subprocess.PIPE,
                           text=True, check=True).stdout.split("\n")
    for f in files:
        if f and os.path.isfile(os.path.join(src, f)):
            write_if_changed(os.path.join(tree, f), open(os.path.join(src, f), "rb").read())


def write_if_changed(path, data):
    if isinstance(data, str):
        data = data.encode()
    if os.path.exists(path) and open(path, "rb").read() == data:
        return
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "wb") as f:
        f.write(data)


def table(work):
    latest = {}
    for line in open(os.path.join(work, "results.jsonl")):
        r = json.loads(line)
        latest[r["id"]] = r
    order = {m["id"]: k for k, m in enumerate(M)}
    rows = sorted(latest.values(), key=lambda r: order.get(r["id"], 1 << 30))
    print("| # | mutant | file | result | killing test (first failure) |")
    print("|---|---|---|---|---|")
    for r in rows:
        d = re.sub(r"\x1b\[[0-9;]*m", "", r["detail"])
        if r["verdict"] == "killed" and d.startswith("ctest "):
            tests = re.findall(r"Test +#\d+: (\S+) \.+\*+Failed", d)
            case = re.search(r"TEST CASE: +(.*?) \| ", d + " | ")
            d = (", ".join(tests) or d[:80]) + (f" ({case.group(1)})" if case else "")
        elif r["verdict"] == "killed":
            exe, _, rest = d.partition(" (")
            why, _, rest = rest.partition("): ")
            d = f"{exe}: {rest.split(': /')[0]}" + (" (timed out)" if why == "timed out" else "")
        d = d.replace("|", "/")
        print(f"| {order.get(r['id'], -1) + 1} | `{r['id']}` | {r['file']} | {r['verdict']} | {d[:160]} |")
    valid = [r for r in rows if r["verdict"] in ("killed", "survived")]
    killed = sum(r["verdict"] == "killed" for r in valid)
    print(f"\nScore: {killed}/{len(valid)} killed ({100 * killed / max(1, len(valid)):.0f}%).")
    return 0


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--work", default="/tmp/fasta2a-mutate")
    ap.add_argument("--only", default="", help="mutation ids, comma-separated")
    ap.add_argument("--list", action="store_true")
    ap.add_argument("--check", action="store_true")
    ap.add_argument("--fresh", action="store_true", help="delete DIR first (default: reuse its build folder)")
    ap.add_argument("--one-at-a-time", action="store_true")
    ap.add_argument("--jobs", type=int, default=2)
    ap.add_argument("--timeout", type=int, default=600, help="seconds per test executable or ctest run")
    ap.add_argument("--table", action="store_true",
                    help="print DIR/results.jsonl (each mutation's latest verdict) as a Markdown table")
    a = ap.parse_args()
    if a.table:
        return table(a.work)
    src = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    muts = list(M)
    for k, m in enumerate(muts, 1):
        m["k"] = k
    if a.only:
        want = set(a.only.split(","))
        unknown = want - {m["id"] for m in muts}
        if unknown:
            print("unknown mutation ids: " + ", ".join(sorted(unknown)))
            return 2
        muts = [m for m in muts if m["id"] in want]
    bad = check(src, muts)
    for m in muts:
        if m["id"] in bad:
            print(f"SKIPPED  {m['id']:40s} {bad[m['id']]}", flush=True)
    if a.list:
        for m in muts:
            print(f"{m['k']:2d} {m['id']:42s} {m['file']}: {m['a']!r} -> {m['b']!r}  [{', '.join(m['targets'])}"
                  + (f"; ctest {m['ctest']}" if m.get("ctest") else "") + "]")
    if a.check or a.list:
        return 1 if bad else 0
    skipped = [m for m in muts if m["id"] in bad]
    muts = [m for m in muts if m["id"] not in bad]

    # A copy of the working tree and a build folder, kept between runs (only changed files are
    # rewritten, so ninja rebuilds only what a change touches).
    tree, build = os.path.join(a.work, "src"), os.path.join(a.work, "build")
    if a.fresh and os.path.exists(a.work):
        shutil.rmtree(a.work)
    os.makedirs(tree, exist_ok=True)
    sync_tree(src, tree)
    workloads = os.path.join(os.path.dirname(src), "shared", "workloads")
    log = os.path.join(a.work, "log.txt")
    rc, out = run(["cmake", "-S", tree, "-B", build, "-G", "Ninja", "-DCMAKE_BUILD_TYPE=Release",
                   "-DCMAKE_CXX_FLAGS_RELEASE=-O1 -DNDEBUG", f"-DFASTA2A_WORKLOADS_DIR={workloads}",
                   "-DCMAKE_CUDA_COMPILER=NOTFOUND", "-DFASTA2A_WITH_LIBFABRIC=OFF",
                   "-DFASTA2A_BUILD_BENCHMARKS=OFF", "-DFASTA2A_BUILD_EXAMPLES=OFF", "-DFASTA2A_BUILD_CLI=OFF", "-DFASTA2A_INSTALL=OFF"],
                  tree, log=log)
    if rc != 0:
        print("configure failed:\n" + out[-3000:])
        return 2

    def exe(target):
        for root, _, names in os.walk(build):
            if target in names and os.access(os.path.join(root, target), os.X_OK):
                return os.path.join(root, target)
        return None

    def build_targets(targets):
        return run(["nice", "-n", "10", "cmake", "--build", build, "-j", str(a.jobs), "--target", *targets], tree,
                   log=log)

    def test(m, mutant=0):
        """Runs the mutation's test executables (doctest; stopped at the first failure) and then its
        ctest regex; the first that fails kills the mutant."""
        env = dict(os.environ)
        env.pop("FASTA2A_MUTANT", None)
        if mutant:
            env["FASTA2A_MUTANT"] = str(mutant)
        for t in m.get("run", m["targets"]):
            cmd = ["nice", "-n", "10", exe(t), *m.get("args", [])] + (["--abort-after=1"] if mutant else [])
            rc, out = run(cmd, os.path.dirname(exe(t)), timeout=a.timeout, log=log, env=env)
            if rc != 0:
                case, errs = "?", []
                for l in out.splitlines(): # the failing case: the last one named before the first error
                    if "TEST CASE:" in l and not errs:
                        case = l.split("TEST CASE:", 1)[1].strip()
                    if "ERROR" in l or "FATAL" in l:
                        errs.append(l.strip())
                why = "timed out" if rc == 124 else f"rc {rc}"
                return "killed", f"{t} ({why}): {case}: " + " | ".join(errs[:2])[:400]
        if m.get("ctest"):
            rc, out = run(["nice", "-n", "10", "ctest", "--test-dir", build, "-R", m["ctest"], "--timeout",
                           str(a.timeout), "--output-on-failure"], tree, log=log, env=env)
            if rc != 0:
                failed = [l.strip() for l in out.splitlines() if "***" in l or l.startswith("FAIL")]
                errs = [l.strip() for l in out.splitlines() if "ERROR" in l or "error:" in l or "TEST CASE:" in l]
                return "killed", "ctest " + m["ctest"] + ": " + " | ".join(failed[:2] + errs[:3])[:500]
        return "survived", ""

    def record(m, verdict, why, t0):
        r = dict(id=m["id"], file=m["file"], verdict=verdict, seconds=round(time.time() - t0), detail=why)
        with open(os.path.join(a.work, "results.jsonl"), "a") as f:
            f.write(json.dumps(r) + "\n")
        print(f"{verdict.upper():8s} {m['id']:42s} ({r['seconds']} s) {why[:300]}", flush=True)
        return r

    results = []
    for m in skipped:
        results.append(record(m, "anchor-missing", bad[m["id"]], time.time()))
    originals = {}
    for m in M:
        p = os.path.join(tree, m["file"])
        if m["file"] not in originals and os.path.exists(p):
            originals[m["file"]] = open(os.path.join(src, m["file"])).read()
    if a.one_at_a_time:
        for m in muts:
            path = os.path.join(tree, m["file"])
            original = originals[m["file"]]
            write_if_changed(path, original.replace(m["old"], m["new"], 1))
            t0 = time.time()
            try:
                rc, out = build_targets(m["targets"])
                verdict, why = ("invalid", out[-800:]) if rc != 0 else test(m)
            finally:
                write_if_changed(path, original)
            results.append(record(m, verdict, why, t0))
    else:
        # Every mutation into the copy at once, as schemata (all of M, whatever --only says, so that
        # the copy, and so the build, is the same for every selection).
        by_file = {}
        for m in M:
            if m["id"] not in bad:
                by_file.setdefault(m["file"], []).append(m)
        for f, ms in by_file.items():
            text = originals[f]
            for m in ms:
                line = m["old"].replace(m["a"], f"(fasta2a_mutant({m['k']}) ? ({m['b']}) : ({m['a']}))", 1)
                text = text.replace(m["old"], line, 1)
            text = text.replace("#pragma once\n", "#pragma once\n" + SCHEMA_HEADER, 1)
            write_if_changed(os.path.join(tree, f), text)
        groups = {}
        for m in muts:
            groups.setdefault((tuple(m["targets"]), tuple(m.get("run", m["targets"])), tuple(m.get("args", [])),
                               m.get("ctest")), []).append(m)
        for key, ms in groups.items():
            targets = list(key[0])
            t0 = time.time()
            rc, out = build_targets(targets)
            if rc != 0:
                print(f"BUILD FAILED {', '.join(targets)}:\n{out[-2000:]}", flush=True)
                for m in ms:
                    results.append(record(m, "invalid", "the schema does not compile", t0))
                continue
            verdict, why = test(ms[0])
            print(f"baseline {', '.join(targets)}{' + ctest ' + key[3] if key[3] else ''}: "
                  f"{'passes' if verdict == 'survived' else 'FAILS ' + why} ({time.time() - t0:.0f} s with the build)",
                  flush=True)
            if verdict != "survived":
                for m in ms:
                    results.append(record(m, "no-baseline", "the unmutated tests fail: " + why, t0))
                continue
            for m in ms:
                t0 = time.time()
                verdict, why = test(m, m["k"])
                results.append(record(m, verdict, why, t0))
    valid = [r for r in results if r["verdict"] in ("killed", "survived")]
    killed = sum(r["verdict"] == "killed" for r in valid)
    print(f"mutation score: {killed}/{len(valid)} killed"
          + (f" ({100 * killed / len(valid):.0f}%)" if valid else "")
          + f"; {len(results) - len(valid)} not run"
          + (f" ({', '.join(r['id'] + ': ' + r['verdict'] for r in results if r not in valid)})"
             if len(results) > len(valid) else "")
          + "; survivors: " + (", ".join(r["id"] for r in valid if r["verdict"] == "survived") or "none"))
    return 1 if skipped else 0


if __name__ == "__main__":
    sys.exit(main())
