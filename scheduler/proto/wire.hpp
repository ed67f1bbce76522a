// The binary wire protocol of include/pvgpu/protocol.h: framing, validation,
// encoding, and sending/receiving with SCM_RIGHTS.  Everything a peer sends
// is untrusted: the decoder checks magic, type, length per type, flags,
// reserved fields, enum ranges and string termination before anything else
// looks at a message, and never reads past what it was given.
#pragma once

#include <pvgpu/protocol.h>

#include <cstddef>
#include <cstdint>
#include <deque>
#include <optional>
#include <ranges>
#include <span>
#include <string>
#include <type_traits>
#include <variant>
#include <vector>

#include "unique_fd.hpp"

namespace pvgpu::wire {

// A decoded, validated message.  `payload` holds exactly the struct for the
// type (copied, aligned); `fds` the descriptors that came with it.
struct Message {
    pvgpu_msg_hdr hdr{};
    std::vector<std::byte> payload;
    std::vector<UniqueFd> fds;

    template <class T> T as() const;  // payload as a protocol struct
};

// Why a byte stream was rejected.  After an error the stream is unusable:
// the daemon answers PVGPU_MSG_ERROR and drops the connection.
struct DecodeError {
    std::string reason;
};

// Reassembles messages from a stream that arrives in arbitrary pieces.
// Memory stays bounded: a header is checked as soon as its 16 bytes are in,
// so a peer can never make the reader hold more than one maximal message
// beyond the chunk just fed.
class Reader {
public:
    // Bytes and any fds received with them.  The fds belong to the LAST
    // message whose header starts in this chunk: the kernel hands fds out
    // with the recvmsg() that reads the first byte of the sendmsg() that
    // carried them, and may glue earlier fd-less bytes in front of it, but
    // never later ones.  A chunk with fds and no message start in it, or
    // more than PVGPU_PROTO_MAX_FDS fds, is an error.  The reader owns the
    // fds from here on (closed on error or with the Message).
    void feed(std::span<const std::byte> bytes, std::vector<UniqueFd> fds = {});
    // The next complete message, nothing yet (monostate), or an error.
    // After an error every later call returns the same error.
    std::variant<std::monostate, Message, DecodeError> next();
    // Bytes buffered and not yet returned by next(); after draining next(),
    // the start of an incomplete message.
    std::size_t buffered() const { return buf_.size() - pos_; }
    // Puts the stream into the error state (e.g. fds truncated by the kernel).
    void fail(std::string reason);
    // What an orderly EOF means now: nullopt when it fell between messages,
    // else the error "connection closed mid-message".
    std::optional<DecodeError> at_eof() const;

private:
    struct FdGroup {
        std::uint64_t at;  // stream offset of the message the fds belong to
        std::vector<UniqueFd> fds;
    };
    void compact();

    std::vector<std::byte> buf_;
    std::size_t pos_ = 0;       // start of the first unconsumed message in buf_
    std::uint64_t base_ = 0;    // stream offset of buf_[0]
    std::size_t scan_ = 0;      // next message start in buf_ not yet header-checked
    std::vector<FdGroup> fds_;  // ascending `at`
    bool failed_ = false;
    std::string error_;
};

// Checks what the 16 header bytes alone decide: magic, known type, flags,
// len <= PVGPU_PROTO_MAX_PAYLOAD and len == the size for the type.
std::optional<std::string> validate_header(const pvgpu_msg_hdr& hdr);
// Expected payload size of a type, or nullopt for an unknown type.
std::optional<std::size_t> payload_size(std::uint16_t type);

// Validation of one message given its header and payload bytes; returns an
// error reason or nullopt.  Exposed for the fuzzer and tests.
std::optional<std::string> validate(const pvgpu_msg_hdr& hdr, std::span<const std::byte> payload,
                                    std::size_t nfds);

// Encoding.  `payload` may be empty for payload-less types.
std::vector<std::byte> encode(std::uint16_t type, std::uint32_t seq,
                              std::span<const std::byte> payload = {});
// A protocol struct.  Constrained so that spans and containers of bytes
// (std::span<const std::byte, 8> included) take the overload above instead
// of recursing into this one.
template <class T>
    requires(std::is_trivially_copyable_v<T> && !std::ranges::range<T>)
std::vector<std::byte> encode(std::uint16_t type, std::uint32_t seq, const T& body) {
    return encode(type, seq, std::as_bytes(std::span<const T, 1>(&body, 1)));
}

// Blocking-free I/O on a non-blocking UNIX stream socket.
// send_some: one sendmsg() of `bytes` with `fds` (SCM_RIGHTS, at most
// PVGPU_PROTO_MAX_FDS) on its first byte.  Returns the number of bytes
// written, 0 on EAGAIN (then nothing, fds included, was sent); throws
// std::system_error on a broken connection.  Once any byte went out the fds
// went with it: the caller's queue completes a partial write WITHOUT fds.
// A call carrying fds must start at the first byte of the message that owns
// them and hold no bytes of later messages (see Reader::feed).
std::size_t send_some(int sock, std::span<const std::byte> bytes, std::span<const int> fds);
// One recvmsg() of what is available into the reader (MSG_DONTWAIT, fds
// with MSG_CMSG_CLOEXEC).  Returns false on orderly EOF (then see
// Reader::at_eof), true otherwise (including EAGAIN); throws
// std::system_error on socket errors.  Truncated fds (MSG_CTRUNC) put the
// reader into the error state.
bool receive(int sock, Reader& reader);

// An outgoing queue that keeps the fd rule of send_some: a message with
// fds goes out in its own sendmsg() calls, its fds with its first byte.
// The queue owns the fds it is given and closes them once sent (push dup()s
// of descriptors you keep).
class Writer {
public:
    void push(std::vector<std::byte> message, std::vector<UniqueFd> fds = {});
    // Sends what the socket takes now.  True when the queue is empty;
    // throws std::system_error on a broken connection.
    bool flush(int sock);
    bool empty() const { return queue_.empty(); }
    std::size_t pending_bytes() const;

private:
    struct Item {
        std::vector<std::byte> bytes;
        std::vector<UniqueFd> fds;
    };
    std::deque<Item> queue_;
    std::size_t sent_ = 0;  // bytes of the front item already written
};

// Copies a NUL-padded fixed-size name field into a std::string (stops at NUL).
std::string name_of(const char* field, std::size_t size);
// Fills a fixed-size field, truncating and NUL-padding; bytes that are not
// printable ASCII become '?' so the field always passes validate().
void set_name(char* field, std::size_t size, const std::string& value);

const char* type_name(std::uint16_t type);

}  // namespace pvgpu::wire

#include <algorithm>
#include <cstring>

namespace pvgpu::wire {

template <class T> T Message::as() const {
    T t{};
    std::memcpy(&t, payload.data(), std::min(sizeof t, payload.size()));
    return t;
}

}  // namespace pvgpu::wire
