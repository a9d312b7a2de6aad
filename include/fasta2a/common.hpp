// fasta2a: basic vocabulary shared by every header (sizes, ranks, errors).
#pragma once

#include <cstdint>
#include <limits>
#include <stdexcept>
#include <string>

/// Forces inlining of small hot lambdas on the planner's path (GCC and Clang).
#if defined(__GNUC__) || defined(__clang__)
#define FASTA2A_INLINE __attribute__((always_inline))
#else
#define FASTA2A_INLINE
#endif

namespace fasta2a {

/// Byte counts and offsets. Always 64-bit unsigned: MoE messages reach gigabytes and sums of them
/// are checked against overflow rather than allowed to wrap.
using bytes_t = std::uint64_t;

/// A global rank number, server-major: rank = server * gpus_per_server + local.
using rank_t = std::int32_t;

/// Every error fasta2a reports is a `fasta2a::error`: its message names the problem (which size,
/// which file, which rank) so that a user can fix the input without reading the library.
class error : public std::runtime_error {
public:
  using std::runtime_error::runtime_error;
};

/// Raised when a plan would exceed the configured size limits (stages or memory).
class plan_too_large : public error {
public:
  using error::error;
};

namespace detail {

/// a + b, or an error naming `what` if the sum does not fit in 64 bits.
inline bytes_t checked_add(bytes_t a, bytes_t b, const char* what) {
  bytes_t r;
  if (__builtin_add_overflow(a, b, &r))
    throw error(std::string("byte count overflows 64 bits: ") + what);
  return r;
}

/// a * b, or an error naming `what` if the product does not fit in 64 bits.
inline bytes_t checked_mul(bytes_t a, bytes_t b, const char* what) {
  bytes_t r;
  if (__builtin_mul_overflow(a, b, &r))
    throw error(std::string("byte count overflows 64 bits: ") + what);
  return r;
}

} // namespace detail
} // namespace fasta2a
