// libFuzzer target for the binary wire protocol (scheduler/proto/wire.cpp).
//
// Input: byte 0 steers the run, the rest is the stream a peer would send.
//   bits 0-5: chunk size - 1 (the stream is fed to the Reader in pieces of
//             that size, as recvmsg() might return them);
//   bit 6:    two fds arrive with the first chunk;
//   bit 7:    two fds arrive with every fourth chunk.
// Checks: nothing crashes or leaks (ASan/UBSan); every decoded message
// passes validate(), lies where the stream says and re-encodes to the same
// bytes, which decode again to the same message; errors are sticky; every fd
// handed to the Reader is closed once the Reader and its messages are gone.
#include "proto/wire.hpp"

#include <fcntl.h>
#include <unistd.h>

#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <vector>

using namespace pvgpu;
using namespace pvgpu::wire;

namespace {

void require(bool ok, const char* what) {
    if (!ok) {
        std::fprintf(stderr, "fuzz_protocol: check failed: %s\n", what);
        std::abort();
    }
}

int dev_null() {
    static const int fd = ::open("/dev/null", O_RDONLY | O_CLOEXEC);
    return fd;
}

// Fresh descriptors, their numbers remembered to check they get closed.
std::vector<UniqueFd> make_fds(std::size_t n, std::vector<int>& handed_out) {
    std::vector<UniqueFd> v;
    for (std::size_t i = 0; i < n; ++i) {
        UniqueFd fd(::fcntl(dev_null(), F_DUPFD_CLOEXEC, 0));
        require(bool(fd), "dup");
        handed_out.push_back(fd.get());
        v.push_back(std::move(fd));
    }
    return v;
}

void round_trip(const Message& m, std::span<const std::byte> original, std::vector<int>& handed_out) {
    require(!validate(m.hdr, m.payload, m.fds.size()), "decoded message fails validate()");
    const auto encoded = encode(m.hdr.type, m.hdr.seq, m.payload);
    require(encoded.size() == original.size() &&
                std::memcmp(encoded.data(), original.data(), encoded.size()) == 0,
            "re-encoding differs from the bytes decoded");
    Reader again;
    again.feed(encoded, make_fds(m.fds.size(), handed_out));
    auto v = again.next();
    const auto* m2 = std::get_if<Message>(&v);
    require(m2 != nullptr, "re-encoded message does not decode");
    require(std::memcmp(&m2->hdr, &m.hdr, sizeof m.hdr) == 0, "header changed in the round trip");
    require(m2->payload == m.payload, "payload changed in the round trip");
    require(m2->fds.size() == m.fds.size(), "fd count changed in the round trip");
    require(std::holds_alternative<std::monostate>(again.next()), "extra message after round trip");
}

void run(const std::uint8_t* data, std::size_t size, std::vector<int>& handed_out) {
    const std::size_t chunk = (data[0] & 0x3fu) + 1;
    const bool fds_first = data[0] & 0x40u;
    const bool fds_often = data[0] & 0x80u;
    const auto stream = std::as_bytes(std::span<const std::uint8_t>(data + 1, size - 1));

    // validate() straight on the input, as a header and whatever follows.
    if (stream.size() >= sizeof(pvgpu_msg_hdr)) {
        pvgpu_msg_hdr hdr;
        std::memcpy(&hdr, stream.data(), sizeof hdr);
        (void)validate_header(hdr);
        (void)validate(hdr, stream.subspan(sizeof hdr), data[0] % 4);
    }

    Reader r;
    std::vector<Message> kept;  // held to the end: their fds must stay open until then
    std::size_t decoded_to = 0;  // messages tile the stream from its start
    std::optional<std::string> error;
    std::size_t index = 0;
    for (std::size_t off = 0; off < stream.size() && !error; off += chunk, ++index) {
        const auto piece = stream.subspan(off, std::min(chunk, stream.size() - off));
        std::vector<UniqueFd> fds;
        if ((fds_first && index == 0) || (fds_often && index % 4 == 0)) fds = make_fds(2, handed_out);
        r.feed(piece, std::move(fds));
        require(r.buffered() <= chunk + sizeof(pvgpu_msg_hdr) + PVGPU_PROTO_MAX_PAYLOAD,
                "reader buffers more than one message beyond the chunk");
        while (true) {
            auto v = r.next();
            if (std::holds_alternative<std::monostate>(v)) break;
            if (auto* e = std::get_if<DecodeError>(&v)) {
                require(!e->reason.empty(), "empty error reason");
                error = e->reason;
                break;
            }
            auto& m = std::get<Message>(v);
            const std::size_t n = sizeof(pvgpu_msg_hdr) + m.hdr.len;
            require(decoded_to + n <= stream.size(), "message beyond the input");
            round_trip(m, stream.subspan(decoded_to, n), handed_out);
            for (const auto& fd : m.fds) require(::fcntl(fd.get(), F_GETFD) != -1, "message fd not open");
            decoded_to += n;
            kept.push_back(std::move(m));
        }
    }
    if (error) {
        auto v = r.next();
        const auto* e = std::get_if<DecodeError>(&v);
        require(e != nullptr && e->reason == *error, "error is not sticky");
        require(r.buffered() == 0, "a failed reader keeps bytes");
    } else if (r.buffered() == 0) {
        require(decoded_to == stream.size(), "bytes lost between messages");
        require(!r.at_eof(), "EOF between messages reported as error");
    } else {
        require(r.at_eof().has_value(), "EOF mid-message not reported");
    }
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
    if (size == 0) return 0;
    std::vector<int> handed_out;
    run(data, size, handed_out);
    // Everything above is destroyed: every fd the Reader was given is closed.
    for (int fd : handed_out) require(::fcntl(fd, F_GETFD) == -1, "fd leaked");
    return 0;
}
