// Checks the planning tests share (the programs test_planner_and_decomposers and
// test_traffic_cost_program_json_registry build them). Include after <doctest/doctest.h>.
#pragma once

#include <chrono>
#include <cstddef>
#include <exception>
#include <future>
#include <string>
#include <utility>
#include <vector>

#include <fasta2a/plan.hpp>
#include <fasta2a/traffic.hpp>
#include <fasta2a/verify.hpp>

#include <fcntl.h>
#include <unistd.h>

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

/// Requires that a and b are the same executable plan: stages, pieces, staging, op and message
/// indexes.
inline void check_same_plan(const plan& a, const plan& b) {
  CHECK(a.view == b.view);
  CHECK(a.stage_weight == b.stage_weight);
  CHECK(a.stage_perm == b.stage_perm);
  CHECK(a.pieces == b.pieces);
  CHECK(a.staging_bytes == b.staging_bytes);
  CHECK(a.staging_ring == b.staging_ring);
  CHECK(a.staging_slot == b.staging_slot);
  CHECK(a.op_offsets == b.op_offsets);
  CHECK(a.op_list == b.op_list);
  CHECK(a.message_first == b.message_first);
  CHECK(a.message_count == b.message_count);
}

/// What rank r does in a plan: per stage, its ops with the full content of each piece.
inline std::vector<std::pair<std::size_t, std::pair<op_kind, piece>>> rank_work(const plan& p, rank_t r) {
  std::vector<std::pair<std::size_t, std::pair<op_kind, piece>>> w;
  for (std::size_t t = 0; t < p.op_stages(); ++t)
    for (const rank_op& op : p.ops(r, t)) w.push_back({t, {op.kind, p.pieces[op.piece]}});
  return w;
}

/// The message of the fasta2a::error that read() throws on `path`, a file that is not to be waited
/// on (a FIFO nobody writes, a device): "no error" if it returns, "not a fasta2a::error: ..." for
/// another exception. A reader must refuse such a file before opening it: one that opens a FIFO
/// blocks in open() until a writer comes. So that such a reader fails the test instead of hanging
/// it, a reader still busy after `deadline` fails the check and is released: `path` is opened for
/// writing and closed, which lets the open() of a FIFO return and its reads find the end.
template <class Read>
std::string error_reading_promptly(const std::string& path, Read read,
                                   std::chrono::seconds deadline = std::chrono::seconds(10)) {
  auto pending = std::async(std::launch::async, [read]() -> std::string {
    try {
      read();
    } catch (const error& e) {
      return e.what();
    } catch (const std::exception& e) {
      return std::string("not a fasta2a::error: ") + e.what();
    }
    return "no error";
  });
  if (pending.wait_for(deadline) == std::future_status::timeout) {
    FAIL_CHECK("still reading " << path << " after " << deadline.count() << " s: it blocks in open()?");
    // A non-blocking open for writing fails (ENXIO) while no reader has the FIFO open: retry.
    for (int tries = 0; tries < 100 && pending.wait_for(std::chrono::milliseconds(100)) != std::future_status::ready;
         ++tries) {
      const int fd = ::open(path.c_str(), O_WRONLY | O_NONBLOCK);
      if (fd >= 0) ::close(fd);
    }
  }
  return pending.get();
}

} // namespace fasta2a::testing
