// libFuzzer target: the TCP bootstrap's handshake parser on the root's side
// (fasta2a::detail::tcp_root_handshake, include/fasta2a/tcp_bootstrap.hpp), the bytes a stranger
// on the network controls.
//
// Input: a mode byte, then the stream. Mode bit 0: the job has a secret (else none). Bit 1: the
// stream is a member's handshake built here from the input (rank, size, name), so the parts after
// the proof are reached; bit 2 then flips one byte of its claim (the next input byte picks which).
// Bits 3-7: the size of the pieces the stream arrives in (1 to 32 bytes, as TCP may cut it).
// Properties: nothing but a finished claim or a drop ends the handshake; raw bytes never make a
// claim (they cannot carry a proof under the secret); a member's handshake is claimed with exactly
// its rank, size and name, and with any byte of its claim flipped it is not; the root never wants
// more than a claim's largest size; what it sends is the 72-byte challenge or a refusal; a
// dropped connection wants nothing more and says why.
#include "fuzz_common.hpp"

#include <fasta2a/tcp_bootstrap.hpp>

#include <algorithm>
#include <cstring>
#include <vector>

namespace fa = fasta2a;
namespace fd = fasta2a::detail;

namespace {

const std::string secret = "the fuzzed job's secret, 32 bytes";
const std::string no_secret;
const std::string job_id = "fuzz-job";

struct outcome {
  fd::tcp_root_handshake::state state;
  std::vector<std::byte> challenge;
};

// Feeds `stream` in pieces of `piece` bytes; the challenge is taken (sent) as soon as it appears.
outcome feed(fd::tcp_root_handshake& hs, const std::vector<std::byte>& stream, std::size_t piece) {
  std::size_t at = 0;
  outcome o{hs.status(), {}};
  while (at < stream.size() && hs.status() == fd::tcp_root_handshake::state::reading) {
    const std::span<std::byte> want = hs.want();
    FUZZ_CHECK(!want.empty(), "a handshake that is reading wants bytes");
    FUZZ_CHECK(want.size() <= fd::tcp_claim_prefix + fd::tcp_max_name + fd::tcp_mac_bytes, "wants more than a claim");
    const std::size_t k = std::min({piece, want.size(), stream.size() - at});
    std::memcpy(want.data(), stream.data() + at, k);
    at += k;
    o.state = hs.received(k);
    if (hs.sent() < hs.out().size() && o.state == fd::tcp_root_handshake::state::reading) {
      FUZZ_CHECK(hs.out().size() == fd::tcp_challenge_bytes, "the root sends only its challenge while reading");
      FUZZ_CHECK(fd::tcp_get(hs.out().data(), 4) == fd::tcp_magic_challenge, "the challenge's magic word");
      o.challenge = hs.out();
      hs.sent() = hs.out().size();
    }
  }
  o.state = hs.status();
  if (o.state == fd::tcp_root_handshake::state::dropped) {
    FUZZ_CHECK(hs.want().empty(), "a dropped connection wants nothing more");
    FUZZ_CHECK(!hs.why().empty(), "a drop says why");
  }
  return o;
}

} // namespace

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  if (size < 1) return 0;
  const std::uint8_t mode = data[0];
  const std::string& key = (mode & 1) ? secret : no_secret;
  const std::size_t piece = 1 + ((mode >> 3) & 31);
  fd::tcp_nonce root_nonce{};
  for (std::size_t i = 0; i < root_nonce.size(); ++i) root_nonce[i] = static_cast<std::byte>(i * 37 + 11);
  std::vector<std::byte> rest(reinterpret_cast<const std::byte*>(data) + 1, reinterpret_cast<const std::byte*>(data) + size);

  fuzz::documented_errors_only("tcp_root_handshake", [&] {
    fd::tcp_root_handshake hs(key, job_id, &root_nonce);
    if (!(mode & 2)) { // raw bytes from a stranger
      const outcome o = feed(hs, rest, piece);
      FUZZ_CHECK(o.state != fd::tcp_root_handshake::state::claimed, "raw bytes made a claim without a proof");
      return;
    }
    // A member's handshake: rank, size, flip position, then the name, from the input.
    fuzz::bytes in(data + 1, size - 1);
    const std::uint64_t head = in.u64();
    const auto rank = static_cast<std::int32_t>(head & 0xffffffffu);
    const auto world = static_cast<std::int32_t>(head >> 32);
    const std::size_t flip = in.u8() | (std::size_t{in.u8()} << 8);
    const std::string name(in.rest().substr(0, fd::tcp_max_name));
    fd::tcp_nonce peer_nonce{};
    for (std::size_t i = 0; i < peer_nonce.size(); ++i) peer_nonce[i] = static_cast<std::byte>(i * 91 + 5);
    std::vector<std::byte> hello;
    fd::tcp_put(hello, fd::tcp_magic_hello, 4);
    fd::tcp_put(hello, fd::tcp_version, 4);
    hello.insert(hello.end(), peer_nonce.begin(), peer_nonce.end());
    const outcome h = feed(hs, hello, piece);
    FUZZ_CHECK(h.state == fd::tcp_root_handshake::state::reading, "a member's hello is taken");
    FUZZ_CHECK(h.challenge.size() == fd::tcp_challenge_bytes, "a member's hello is answered with the challenge");
    fd::tcp_nonce theirs{};
    std::memcpy(theirs.data(), h.challenge.data() + 8, theirs.size());
    const fd::tcp_mac root_proof = fd::tcp_prove(key, "root", peer_nonce, theirs, job_id, {});
    FUZZ_CHECK(fd::tcp_mac_equal(h.challenge.data() + 8 + fd::tcp_nonce_bytes, root_proof), "the root's proof checks");
    const std::vector<std::byte> fields = fd::tcp_root_handshake::claim_fields(rank, world, name);
    std::vector<std::byte> claim;
    fd::tcp_put(claim, fd::tcp_magic_claim, 4);
    claim.insert(claim.end(), fields.begin(), fields.end());
    const fd::tcp_mac m = fd::tcp_prove(key, "rank", theirs, peer_nonce, job_id, fields);
    claim.insert(claim.end(), m.begin(), m.end());
    const bool flipped = (mode & 4) != 0;
    if (flipped) claim[flip % claim.size()] ^= std::byte{0x5a};
    const outcome c = feed(hs, claim, piece);
    if (!flipped) {
      FUZZ_CHECK(c.state == fd::tcp_root_handshake::state::claimed, "a member's claim is taken");
      FUZZ_CHECK(hs.rank() == rank && hs.size() == world && hs.name() == name, "the claim as the member sent it");
    } else {
      FUZZ_CHECK(c.state != fd::tcp_root_handshake::state::claimed, "a claim with a flipped byte was taken");
    }
  });
  return 0;
}
