// libFuzzer target: the plan reader (read_plan_json, load_plan_json) on arbitrary bytes.
// The input is the document itself, so seeds are plain plan files.
// Properties: only fasta2a::error escapes; reading from a file (load_plan_json) agrees with
// reading the text; an accepted plan writes back to a document that reads back to the same plan
// and writes back to the same text (a fixed point); verify and the cost model accept any plan the
// reader accepts as input (they may reject it, never crash) against the matrix its pieces add to.
#include "fuzz_common.hpp"

#include <fasta2a/cost_model.hpp>
#include <fasta2a/json.hpp>
#include <fasta2a/topology.hpp>
#include <fasta2a/verify.hpp>

#include <limits>

namespace fa = fasta2a;

namespace {

// A document may declare up to 2^24 ranks; the reader must refuse what passes this limit before
// allocating it, so the fuzzer's memory limit (run.sh: -rss_limit_mb) finds any allocation the
// limit does not bound.
constexpr fa::plan_read_options read_options{.granule = 1, .max_plan_bytes = std::size_t{64} << 20};

// The traffic matrix the plan's pieces carry, or false where a sum overflows 64 bits.
bool matrix_of(const fa::plan& p, fa::traffic_matrix& t) {
  const fa::rank_t n = p.ranks();
  t = fa::traffic_matrix::Zero(n, n);
  for (const fa::piece& pc : p.pieces) {
    fa::bytes_t& e = t(pc.src, pc.dst);
    if (e > std::numeric_limits<fa::bytes_t>::max() - pc.bytes) return false;
    e += pc.bytes;
  }
  return true;
}

} // namespace

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  static fuzz::memory_file file;
  const std::string_view text(reinterpret_cast<const char*>(data), size);

  fa::plan p;
  const bool read = fuzz::documented_errors_only("read_plan_json", [&] { p = fa::read_plan_json(text, read_options); });
  fa::plan from_file;
  const std::string& path = file.write(text);
  const bool loaded =
      fuzz::documented_errors_only("load_plan_json", [&] { from_file = fa::load_plan_json(path, read_options); });
  FUZZ_CHECK(read == loaded, "read_plan_json and load_plan_json disagree on whether the document is a plan");
  if (!read) return 0;
  FUZZ_CHECK(fuzz::plan_difference(p, from_file).empty(),
             "load_plan_json gives another plan than read_plan_json: " + fuzz::plan_difference(p, from_file));

  // Round trip: what the reader accepts, the writer writes back, and that reads back the same.
  const std::string doc = fa::plan_to_json(p);
  fa::plan q;
  const bool again = fuzz::documented_errors_only("read_plan_json of a written plan",
                                                  [&] { q = fa::read_plan_json(doc, read_options); });
  FUZZ_CHECK(again, "the writer's document of an accepted plan is refused");
  FUZZ_CHECK(fuzz::plan_difference(p, q).empty(), "read -> write -> read changes " + fuzz::plan_difference(p, q));
  FUZZ_CHECK(fa::plan_to_json(q) == doc, "write -> read -> write is not a fixed point");

  // Consumers of read-back plans take any plan the reader accepts without crashing.
  fa::traffic_matrix t;
  if (p.ranks() <= 256 && matrix_of(p, t)) {
    fuzz::documented_errors_only("verify", [&] {
      (void)fa::verify(p, t);
      (void)fa::verify(p, t, {.exact_lower_bound = true});
    });
    fuzz::documented_errors_only("predict", [&] {
      (void)fa::predict(fa::two_tier_topology(p.servers, p.gpus_per_server), p);
    });
  }
  return 0;
}
