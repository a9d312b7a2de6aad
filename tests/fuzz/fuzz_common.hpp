// fasta2a fuzz targets: what the three targets share. An input decoder that never runs out (past
// the end every read gives 0), an in-memory file for the readers that take a path, the property
// check that aborts (libFuzzer reports the input), and the rule that only fasta2a::error escapes.
#pragma once

#include <fasta2a/common.hpp>
#include <fasta2a/plan.hpp>

#include <sys/mman.h>
#include <unistd.h>

#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <exception>
#include <new>
#include <string>
#include <string_view>

namespace fuzz {

/// Aborts with a message when a property does not hold; libFuzzer saves the input as a crash.
#define FUZZ_CHECK(cond, what)                                                                     \
  do {                                                                                             \
    if (!(cond)) {                                                                                 \
      std::fprintf(stderr, "fuzz: property violated at %s:%d: %s\n  %s\n", __FILE__, __LINE__,   \
                   #cond, std::string(what).c_str());                                              \
      std::abort();                                                                                \
    }                                                                                              \
  } while (0)

/// Runs f; a fasta2a::error (the library's documented failure) is fine and ends the input, any
/// other exception aborts naming it. Returns true when f returned normally.
template <class F>
bool documented_errors_only(const char* what, F&& f) {
  try {
    f();
    return true;
  } catch (const fasta2a::error&) {
    return false;
  } catch (const std::bad_alloc&) {
    std::fprintf(stderr, "fuzz: %s threw std::bad_alloc (an allocation nothing bounded)\n", what);
    std::abort();
  } catch (const std::exception& e) {
    std::fprintf(stderr, "fuzz: %s threw an undocumented exception: %s\n", what, e.what());
    std::abort();
  } catch (...) {
    std::fprintf(stderr, "fuzz: %s threw something that is not a std::exception\n", what);
    std::abort();
  }
}

/// Reads the fuzzer's bytes front to back; past the end every read is 0, so every input decodes.
class bytes {
public:
  bytes(const std::uint8_t* data, std::size_t size) : p_(data), end_(data + size) {}
  std::uint8_t u8() { return p_ != end_ ? *p_++ : 0; }
  std::uint64_t u64() {
    std::uint64_t v = 0;
    for (int i = 0; i < 8; ++i) v |= static_cast<std::uint64_t>(u8()) << (8 * i);
    return v;
  }
  std::size_t left() const { return static_cast<std::size_t>(end_ - p_); }
  std::string_view rest() {
    std::string_view s(reinterpret_cast<const char*>(p_), left());
    p_ = end_;
    return s;
  }

private:
  const std::uint8_t* p_;
  const std::uint8_t* end_;
};

/// One in-memory file per process (memfd), rewritten per input and named by /proc/self/fd/N, for
/// readers that take a path: no disk traffic, and the real open/seek/read path of the reader.
class memory_file {
public:
  memory_file() {
    fd_ = memfd_create("fasta2a-fuzz", 0);
    if (fd_ < 0) {
      std::perror("fuzz: memfd_create");
      std::abort();
    }
    path_ = "/proc/self/fd/" + std::to_string(fd_);
  }
  const std::string& write(std::string_view text) {
    if (ftruncate(fd_, 0) != 0) std::abort();
    std::size_t done = 0;
    while (done < text.size()) {
      const ssize_t k = pwrite(fd_, text.data() + done, text.size() - done, static_cast<off_t>(done));
      if (k <= 0) std::abort();
      done += static_cast<std::size_t>(k);
    }
    return path_;
  }

private:
  int fd_ = -1;
  std::string path_;
};

/// Every field of two plans equal (plan has no operator==); the name of the first that differs.
inline std::string plan_difference(const fasta2a::plan& a, const fasta2a::plan& b) {
  if (a.decomposer != b.decomposer) return "decomposer";
  if (a.choice != b.choice) return "choice";
  if (a.servers != b.servers || a.gpus_per_server != b.gpus_per_server) return "shape";
  if (a.granule != b.granule) return "granule";
  if (a.staged != b.staged) return "staged";
  if (a.view != b.view) return "view";
  if (a.rail_load != b.rail_load) return "rail_load";
  if (a.total_bytes != b.total_bytes) return "total_bytes";
  if (a.scaleup_bytes != b.scaleup_bytes) return "scaleup_bytes";
  if (a.stage_weight != b.stage_weight) return "stage_weight";
  if (a.stage_perm != b.stage_perm) return "stage_perm";
  if (a.rail_weight != b.rail_weight) return "rail_weight";
  if (a.rail_perm != b.rail_perm) return "rail_perm";
  if (a.pieces != b.pieces) return "pieces";
  if (a.message_first != b.message_first || a.message_count != b.message_count) return "message index";
  if (a.staging_bytes != b.staging_bytes) return "staging_bytes";
  if (a.op_offsets != b.op_offsets || a.op_list != b.op_list) return "op index";
  return {};
}

} // namespace fuzz
