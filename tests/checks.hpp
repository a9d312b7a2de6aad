// Checks the planning tests share (test_planning.cpp builds them into one program). Include after
// <doctest/doctest.h>.
#pragma once

#include <cstddef>
#include <string>
#include <utility>
#include <vector>

#include <fasta2a/plan.hpp>
#include <fasta2a/traffic.hpp>
#include <fasta2a/verify.hpp>

namespace fasta2a::testing {

/// True if `part` occurs in `s`.
inline bool contains(const std::string& s, const std::string& part) { return s.find(part) != std::string::npos; }

/// Requires that p passes the verifier for t (`exact`: with the weights summing to the per-rail
/// bound), naming the verifier's error where it does not.
inline void check_plan(const plan& p, const traffic_matrix& t, bool exact) {
  const verify_result r = verify(p, t, {.exact_lower_bound = exact});
  INFO(r.error);
  REQUIRE(r.ok);
}

/// What rank r does in a plan: per stage, its ops with the full content of each piece.
inline std::vector<std::pair<std::size_t, std::pair<op_kind, piece>>> rank_work(const plan& p, rank_t r) {
  std::vector<std::pair<std::size_t, std::pair<op_kind, piece>>> w;
  for (std::size_t t = 0; t < p.op_stages(); ++t)
    for (const rank_op& op : p.ops(r, t)) w.push_back({t, {op.kind, p.pieces[op.piece]}});
  return w;
}

} // namespace fasta2a::testing
