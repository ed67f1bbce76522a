// Framing, validation, encoding and socket I/O of the binary wire protocol.
// See docs/protocol.md for the protocol as a whole.
#include "wire.hpp"

#include <sys/socket.h>
#include <sys/uio.h>

#include <array>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <stdexcept>
#include <system_error>

namespace pvgpu::wire {

namespace {

constexpr std::size_t kHdrSize = sizeof(pvgpu_msg_hdr);

// Bytes one receive() asks for.  Bounded so that a flooding peer cannot make
// one call buffer an unbounded amount; level-triggered polling calls again.
constexpr std::size_t kRecvChunk = 16384;

// Control buffer for exactly PVGPU_PROTO_MAX_FDS descriptors; the union
// gives it cmsghdr alignment.
union FdControl {
    cmsghdr align;
    char buf[CMSG_SPACE(sizeof(int) * PVGPU_PROTO_MAX_FDS)];
};

pvgpu_msg_hdr read_header(const std::byte* p) {
    pvgpu_msg_hdr h;
    std::memcpy(&h, p, sizeof h);
    return h;
}

template <class T> T read_body(std::span<const std::byte> payload) {
    T t{};
    std::memcpy(&t, payload.data(), sizeof t);
    return t;
}

std::string hex(std::uint32_t v) {
    char b[16];
    std::snprintf(b, sizeof b, "0x%08x", v);
    return b;
}

// What is wrong with a status or mode field; nullopt: nothing.
std::optional<std::string> bad_status(std::uint32_t s) {
    if (s <= PVGPU_E_INTERNAL) return std::nullopt;
    return "status " + std::to_string(s) + " is unknown";
}
std::optional<std::string> bad_mode(std::uint32_t m) {
    if (m <= PVGPU_MODE_SHADOWED) return std::nullopt;
    return "mode " + std::to_string(m) + " is out of range";
}

// A fixed-size text field: NUL-terminated inside the field and printable
// ASCII before the NUL (names end up in logs, paths and JSON).
std::optional<std::string> check_name(const char* field, std::size_t size, const char* what) {
    const std::size_t n = strnlen(field, size);
    if (n == size)
        return std::string(what) + " is not NUL-terminated within its " + std::to_string(size) +
               " bytes";
    for (std::size_t i = 0; i < n; ++i) {
        const auto c = static_cast<unsigned char>(field[i]);
        if (c < 0x20 || c > 0x7e)
            return std::string(what) + " has a non-printable byte " + hex(c) + " at offset " +
                   std::to_string(i);
    }
    return std::nullopt;
}

std::optional<std::string> check_body(std::uint16_t type, std::span<const std::byte> payload,
                                      std::size_t nfds) {
    using R = std::optional<std::string>;
    // Only an OK CHAN_REPLY, QUIESCE and CHAN_RESTORE carry fds; their own
    // cases check the count.
    if (type != PVGPU_MSG_CHAN_REPLY && type != PVGPU_MSG_QUIESCE && type != PVGPU_MSG_CHAN_RESTORE && nfds != 0)
        return "carries " + std::to_string(nfds) +
               " fds; only CHAN_REPLY with status OK, QUIESCE and CHAN_RESTORE may carry fds";
    switch (type) {
    case PVGPU_MSG_HELLO: {
        const auto b = read_body<pvgpu_hello>(payload);
        if (b.version < 1) return R("version 0 is invalid (versions start at 1)");
        if (b.role != PVGPU_ROLE_VMM && b.role != PVGPU_ROLE_HOST)
            return "role " + std::to_string(b.role) + " is neither VMM (1) nor HOST (2)";
        if (b.role == PVGPU_ROLE_HOST) {
            for (auto u : b.uuid)
                if (u != 0) return R("uuid must be zero for role HOST");
        }
        if (b.gpu > PVGPU_GPU_INDEX(PVGPU_MAX_GPUS - 1))
            return "gpu " + std::to_string(b.gpu) + " is out of range (0: any, n + 1: GPU n < " +
                   std::to_string(PVGPU_MAX_GPUS) + ")";
        return check_name(b.name, sizeof b.name, "name");
    }
    case PVGPU_MSG_CHAN_ALLOC: {
        const auto b = read_body<pvgpu_chan_alloc>(payload);
        return check_name(b.task_name, sizeof b.task_name, "task_name");
    }
    case PVGPU_MSG_CHAN_FREE: {
        const auto b = read_body<pvgpu_chan_ref>(payload);
        if (b.reserved != 0) return R("reserved field is not zero");
        return std::nullopt;
    }
    case PVGPU_MSG_MODE_ACK:
        return bad_mode(read_body<pvgpu_mode_ack>(payload).mode);
    case PVGPU_MSG_TASK_WEIGHT: {
        // The weight's range is the daemon's to answer (E_INVALID in the
        // reply), not a reason to drop the connection.
        const auto b = read_body<pvgpu_task_weight>(payload);
        if (b.reserved != 0) return R("reserved field is not zero");
        return std::nullopt;
    }
    case PVGPU_MSG_QUIESCE: {
        const auto b = read_body<pvgpu_quiesce>(payload);
        if (b.reserved != 0) return R("reserved field is not zero");
        if (nfds != 1) return "needs 1 fd (the socket for its end), got " + std::to_string(nfds);
        return std::nullopt;
    }
    case PVGPU_MSG_RESUME: {
        const auto b = read_body<pvgpu_chan_ref>(payload);
        if (b.chan_id != 0 || b.reserved != 0) return R("chan_id and reserved must be zero");
        return std::nullopt;
    }
    case PVGPU_MSG_CHAN_RESTORE: {
        const auto b = read_body<pvgpu_chan_restore>(payload);
        if (auto e = bad_mode(b.mode)) return e;
        if (nfds != 1) return "needs 1 fd (the saved channel memory), got " + std::to_string(nfds);
        return check_name(b.task_name, sizeof b.task_name, "task_name");
    }
    case PVGPU_MSG_QUIESCE_REPLY:
    case PVGPU_MSG_RESUME_REPLY:
        return bad_status(read_body<pvgpu_status_reply>(payload).status);
    case PVGPU_MSG_TRAP_REPORT:
    case PVGPU_MSG_PING:
    case PVGPU_MSG_PONG:
        return std::nullopt;
    case PVGPU_MSG_HELLO_REPLY: {
        const auto b = read_body<pvgpu_hello_reply>(payload);
        if (auto e = bad_status(b.status)) return e;
        if (b.status == PVGPU_OK && b.version < 1)
            return R("version 0 is invalid (versions start at 1)");
        return std::nullopt;
    }
    case PVGPU_MSG_CHAN_REPLY: {
        const auto b = read_body<pvgpu_chan_reply>(payload);
        if (auto e = bad_status(b.status)) return e;
        if (b.status != PVGPU_OK) {
            if (nfds != 0)
                return "carries " + std::to_string(nfds) + " fds but status is not OK";
            return std::nullopt;
        }
        // The third, the completion notifier, only in a version-3 host
        // session: the client checks the count against its session.
        if (nfds != 2 && nfds != 3)
            return "status OK needs 2 fds (memfd, doorbell eventfd) or 3 (and a completion notifier), got " +
                   std::to_string(nfds);
        if (auto e = bad_mode(b.mode)) return e;
        if (b.mem_size != PVGPU_CHAN_MEM_SIZE)
            return "mem_size " + std::to_string(b.mem_size) + " is not PVGPU_CHAN_MEM_SIZE (" +
                   std::to_string(PVGPU_CHAN_MEM_SIZE) + ")";
        return std::nullopt;
    }
    case PVGPU_MSG_FREE_REPLY:
        return bad_status(read_body<pvgpu_status_reply>(payload).status);
    case PVGPU_MSG_TASK_WEIGHT_REPLY: {
        const auto b = read_body<pvgpu_status_reply>(payload);
        if (auto e = bad_status(b.status)) return e;
        if (b.chan_id != 0) return R("chan_id is not zero");
        return std::nullopt;
    }
    case PVGPU_MSG_MODE: {
        const auto b = read_body<pvgpu_mode>(payload);
        if (auto e = bad_mode(b.mode)) return e;
        if (b.reserved != 0) return R("reserved field is not zero");
        return std::nullopt;
    }
    case PVGPU_MSG_NOTICE: {
        const auto b = read_body<pvgpu_notice>(payload);
        if (b.kind < PVGPU_NOTICE_WATCHDOG || b.kind > PVGPU_NOTICE_DEGRADED)
            return "notice kind " + std::to_string(b.kind) + " is unknown";
        return std::nullopt;
    }
    case PVGPU_MSG_ERROR: {
        const auto b = read_body<pvgpu_error>(payload);
        if (auto e = bad_status(b.status)) return e;
        if (b.reserved != 0) return R("reserved field is not zero");
        if (strnlen(b.message, sizeof b.message) == sizeof b.message)
            return R("message is not NUL-terminated within its 120 bytes");
        return std::nullopt;
    }
    default:
        return "unknown message type " + std::to_string(type);
    }
}

}  // namespace

std::optional<std::size_t> payload_size(std::uint16_t type) {
    switch (type) {
    case PVGPU_MSG_HELLO: return sizeof(pvgpu_hello);
    case PVGPU_MSG_CHAN_ALLOC: return sizeof(pvgpu_chan_alloc);
    case PVGPU_MSG_CHAN_FREE: return sizeof(pvgpu_chan_ref);
    case PVGPU_MSG_MODE_ACK: return sizeof(pvgpu_mode_ack);
    case PVGPU_MSG_TRAP_REPORT: return sizeof(pvgpu_trap_report);
    case PVGPU_MSG_PING: return 0;
    case PVGPU_MSG_TASK_WEIGHT: return sizeof(pvgpu_task_weight);
    case PVGPU_MSG_QUIESCE: return sizeof(pvgpu_quiesce);
    case PVGPU_MSG_RESUME: return sizeof(pvgpu_chan_ref);
    case PVGPU_MSG_CHAN_RESTORE: return sizeof(pvgpu_chan_restore);
    case PVGPU_MSG_QUIESCE_REPLY: return sizeof(pvgpu_status_reply);
    case PVGPU_MSG_RESUME_REPLY: return sizeof(pvgpu_status_reply);
    case PVGPU_MSG_HELLO_REPLY: return sizeof(pvgpu_hello_reply);
    case PVGPU_MSG_CHAN_REPLY: return sizeof(pvgpu_chan_reply);
    case PVGPU_MSG_FREE_REPLY: return sizeof(pvgpu_status_reply);
    case PVGPU_MSG_MODE: return sizeof(pvgpu_mode);
    case PVGPU_MSG_NOTICE: return sizeof(pvgpu_notice);
    case PVGPU_MSG_ERROR: return sizeof(pvgpu_error);
    case PVGPU_MSG_PONG: return 0;
    case PVGPU_MSG_TASK_WEIGHT_REPLY: return sizeof(pvgpu_status_reply);
    default: return std::nullopt;
    }
}

const char* type_name(std::uint16_t type) {
    switch (type) {
    case PVGPU_MSG_HELLO: return "HELLO";
    case PVGPU_MSG_CHAN_ALLOC: return "CHAN_ALLOC";
    case PVGPU_MSG_CHAN_FREE: return "CHAN_FREE";
    case PVGPU_MSG_MODE_ACK: return "MODE_ACK";
    case PVGPU_MSG_TRAP_REPORT: return "TRAP_REPORT";
    case PVGPU_MSG_PING: return "PING";
    case PVGPU_MSG_TASK_WEIGHT: return "TASK_WEIGHT";
    case PVGPU_MSG_QUIESCE: return "QUIESCE";
    case PVGPU_MSG_RESUME: return "RESUME";
    case PVGPU_MSG_CHAN_RESTORE: return "CHAN_RESTORE";
    case PVGPU_MSG_QUIESCE_REPLY: return "QUIESCE_REPLY";
    case PVGPU_MSG_RESUME_REPLY: return "RESUME_REPLY";
    case PVGPU_MSG_HELLO_REPLY: return "HELLO_REPLY";
    case PVGPU_MSG_CHAN_REPLY: return "CHAN_REPLY";
    case PVGPU_MSG_FREE_REPLY: return "FREE_REPLY";
    case PVGPU_MSG_MODE: return "MODE";
    case PVGPU_MSG_NOTICE: return "NOTICE";
    case PVGPU_MSG_ERROR: return "ERROR";
    case PVGPU_MSG_PONG: return "PONG";
    case PVGPU_MSG_TASK_WEIGHT_REPLY: return "TASK_WEIGHT_REPLY";
    default: return "UNKNOWN";
    }
}

std::optional<std::string> validate_header(const pvgpu_msg_hdr& hdr) {
    if (hdr.magic != PVGPU_PROTO_MAGIC)
        return "bad magic " + hex(hdr.magic) + " (expected " + hex(PVGPU_PROTO_MAGIC) + ")";
    // Checked before the type so an oversize announcement is named as such.
    if (hdr.len > PVGPU_PROTO_MAX_PAYLOAD)
        return "len " + std::to_string(hdr.len) + " exceeds the maximum payload " +
               std::to_string(PVGPU_PROTO_MAX_PAYLOAD);
    const auto size = payload_size(hdr.type);
    if (!size) return "unknown message type " + std::to_string(hdr.type);
    const std::string what = std::string(type_name(hdr.type)) + " (seq " + std::to_string(hdr.seq) + "): ";
    if (hdr.flags != 0) return what + "flags " + hex(hdr.flags) + " are not zero";
    if (hdr.len != *size)
        return what + "len " + std::to_string(hdr.len) + ", expected " + std::to_string(*size);
    return std::nullopt;
}

std::optional<std::string> validate(const pvgpu_msg_hdr& hdr, std::span<const std::byte> payload,
                                    std::size_t nfds) {
    if (auto e = validate_header(hdr)) return e;
    const std::string what = std::string(type_name(hdr.type)) + " (seq " + std::to_string(hdr.seq) + "): ";
    if (payload.size() != hdr.len)
        return what + "payload is " + std::to_string(payload.size()) + " bytes, header says len " +
               std::to_string(hdr.len);
    if (nfds > PVGPU_PROTO_MAX_FDS)
        return what + std::to_string(nfds) + " fds, more than the maximum " +
               std::to_string(PVGPU_PROTO_MAX_FDS);
    if (auto e = check_body(hdr.type, payload, nfds)) return what + *e;
    return std::nullopt;
}

// ---- Reader ---------------------------------------------------------------

void Reader::compact() {
    if (pos_ == 0) return;
    buf_.erase(buf_.begin(), buf_.begin() + static_cast<std::ptrdiff_t>(pos_));
    base_ += pos_;
    scan_ -= pos_;
    pos_ = 0;
}

void Reader::feed(std::span<const std::byte> bytes, std::vector<UniqueFd> fds) {
    if (failed_) return;  // the stream is dead; `fds` close on return
    if (fds.size() > PVGPU_PROTO_MAX_FDS) {
        fail(std::to_string(fds.size()) + " fds arrived at once, more than the maximum " +
             std::to_string(PVGPU_PROTO_MAX_FDS));
        return;
    }
    compact();
    const std::size_t chunk_start = buf_.size();
    buf_.insert(buf_.end(), bytes.begin(), bytes.end());

    // Walk the message starts this chunk completes headers for, checking
    // each header at once: a bad one (oversize len included) cuts the buffer
    // right after it, so nothing behind it is ever held, and next() reports
    // it once the messages before it are taken.
    std::optional<std::size_t> last_start;
    while (true) {
        if (scan_ >= chunk_start && scan_ < buf_.size()) last_start = scan_;
        if (scan_ + kHdrSize > buf_.size()) break;
        const auto hdr = read_header(buf_.data() + scan_);
        if (validate_header(hdr)) {
            buf_.resize(scan_ + kHdrSize);
            break;
        }
        scan_ += kHdrSize + hdr.len;
    }

    if (fds.empty()) return;
    if (!last_start) {
        fail(std::to_string(fds.size()) + " fds arrived with no message starting in their chunk");
        return;
    }
    const std::uint64_t at = base_ + *last_start;
    if (!fds_.empty() && fds_.back().at >= at) {
        fail("two sets of fds arrived for one message");
        return;
    }
    fds_.push_back(FdGroup{at, std::move(fds)});
}

std::variant<std::monostate, Message, DecodeError> Reader::next() {
    if (failed_) return DecodeError{error_};
    if (buffered() < kHdrSize) return std::monostate{};
    const auto hdr = read_header(buf_.data() + pos_);
    if (auto e = validate_header(hdr)) {
        fail(*e);
        return DecodeError{error_};
    }
    if (buffered() < kHdrSize + hdr.len) return std::monostate{};

    Message m;
    m.hdr = hdr;
    const auto* body = buf_.data() + pos_ + kHdrSize;
    m.payload.assign(body, body + hdr.len);
    const std::uint64_t at = base_ + pos_;
    if (!fds_.empty() && fds_.front().at == at) {
        m.fds = std::move(fds_.front().fds);
        fds_.erase(fds_.begin());
    }
    if (auto e = validate(m.hdr, m.payload, m.fds.size())) {
        fail(*e);
        return DecodeError{error_};
    }
    pos_ += kHdrSize + hdr.len;
    if (pos_ == buf_.size()) {
        // Cheap reset while empty keeps the buffer from creeping forward.
        base_ += pos_;
        scan_ -= pos_;
        pos_ = 0;
        buf_.clear();
    }
    return m;
}

void Reader::fail(std::string reason) {
    if (failed_) return;  // the first error is the one that counts
    failed_ = true;
    error_ = std::move(reason);
    buf_.clear();
    buf_.shrink_to_fit();
    pos_ = 0;
    scan_ = 0;
    fds_.clear();  // closes them
}

std::optional<DecodeError> Reader::at_eof() const {
    if (failed_) return DecodeError{error_};
    if (buffered() == 0) return std::nullopt;
    return DecodeError{"connection closed mid-message (" + std::to_string(buffered()) +
                       " bytes of an incomplete message buffered)"};
}

// ---- encoding -------------------------------------------------------------

std::vector<std::byte> encode(std::uint16_t type, std::uint32_t seq,
                              std::span<const std::byte> payload) {
    if (payload.size() > UINT32_MAX) throw std::length_error("pvgpu wire: payload too large");
    pvgpu_msg_hdr hdr{};
    hdr.magic = PVGPU_PROTO_MAGIC;
    hdr.type = type;
    hdr.flags = 0;
    hdr.len = static_cast<std::uint32_t>(payload.size());
    hdr.seq = seq;
    std::vector<std::byte> out(kHdrSize + payload.size());
    std::memcpy(out.data(), &hdr, kHdrSize);
    if (!payload.empty()) std::memcpy(out.data() + kHdrSize, payload.data(), payload.size());
    return out;
}

// ---- socket I/O -----------------------------------------------------------

std::size_t send_some(int sock, std::span<const std::byte> bytes, std::span<const int> fds) {
    if (fds.size() > PVGPU_PROTO_MAX_FDS)
        throw std::invalid_argument("pvgpu wire: too many fds for one message");
    if (bytes.empty()) {
        // A stream socket cannot carry fds without data.
        if (!fds.empty()) throw std::invalid_argument("pvgpu wire: fds need at least one byte");
        return 0;
    }
    iovec iov{};
    iov.iov_base = const_cast<std::byte*>(bytes.data());  // sendmsg does not write it
    iov.iov_len = bytes.size();
    msghdr msg{};
    msg.msg_iov = &iov;
    msg.msg_iovlen = 1;
    FdControl ctl{};
    if (!fds.empty()) {
        msg.msg_control = ctl.buf;
        msg.msg_controllen = CMSG_SPACE(sizeof(int) * fds.size());
        cmsghdr* c = CMSG_FIRSTHDR(&msg);
        c->cmsg_level = SOL_SOCKET;
        c->cmsg_type = SCM_RIGHTS;
        c->cmsg_len = CMSG_LEN(sizeof(int) * fds.size());
        std::memcpy(CMSG_DATA(c), fds.data(), sizeof(int) * fds.size());
    }
    while (true) {
        const ssize_t n = ::sendmsg(sock, &msg, MSG_NOSIGNAL | MSG_DONTWAIT);
        if (n >= 0) return static_cast<std::size_t>(n);
        if (errno == EINTR) continue;
        if (errno == EAGAIN || errno == EWOULDBLOCK) return 0;
        throw std::system_error(errno, std::system_category(), "pvgpu wire: sendmsg");
    }
}

bool receive(int sock, Reader& reader) {
    std::array<std::byte, kRecvChunk> data;
    iovec iov{};
    iov.iov_base = data.data();
    iov.iov_len = data.size();
    FdControl ctl{};
    msghdr msg{};
    msg.msg_iov = &iov;
    msg.msg_iovlen = 1;
    msg.msg_control = ctl.buf;
    msg.msg_controllen = sizeof ctl.buf;

    ssize_t n;
    while (true) {
        n = ::recvmsg(sock, &msg, MSG_CMSG_CLOEXEC | MSG_DONTWAIT);
        if (n >= 0) break;
        if (errno == EINTR) continue;
        if (errno == EAGAIN || errno == EWOULDBLOCK) return true;
        throw std::system_error(errno, std::system_category(), "pvgpu wire: recvmsg");
    }

    // Own every fd at once so that any early return closes them.
    std::vector<UniqueFd> fds;
    for (cmsghdr* c = CMSG_FIRSTHDR(&msg); c != nullptr; c = CMSG_NXTHDR(&msg, c)) {
        if (c->cmsg_level != SOL_SOCKET || c->cmsg_type != SCM_RIGHTS) continue;
        const std::size_t count = (c->cmsg_len - CMSG_LEN(0)) / sizeof(int);
        for (std::size_t i = 0; i < count; ++i) {
            int fd;
            std::memcpy(&fd, CMSG_DATA(c) + i * sizeof(int), sizeof fd);
            fds.emplace_back(fd);
        }
    }
    if (msg.msg_flags & MSG_CTRUNC) {
        // The kernel dropped fds that did not fit: the peer sent more than
        // one message may carry.
        reader.fail("fds truncated: the peer sent more than " +
                    std::to_string(PVGPU_PROTO_MAX_FDS) + " fds at once");
        return n != 0;
    }
    if (n == 0) return false;
    reader.feed(std::span<const std::byte>(data.data(), static_cast<std::size_t>(n)), std::move(fds));
    return true;
}

// ---- Writer ---------------------------------------------------------------

void Writer::push(std::vector<std::byte> message, std::vector<UniqueFd> fds) {
    if (message.empty()) return;
    queue_.push_back(Item{std::move(message), std::move(fds)});
}

bool Writer::flush(int sock) {
    while (!queue_.empty()) {
        Item& item = queue_.front();
        std::array<int, PVGPU_PROTO_MAX_FDS> raw{};
        std::size_t nfds = 0;
        if (sent_ == 0) {
            if (item.fds.size() > raw.size())
                throw std::invalid_argument("pvgpu wire: too many fds for one message");
            for (const auto& fd : item.fds) raw[nfds++] = fd.get();
        }
        // One message per call: the receiver attributes fds to the last
        // message starting in a chunk, so an fd-carrying send must not
        // contain bytes of later messages.
        const auto rest = std::span<const std::byte>(item.bytes).subspan(sent_);
        const std::size_t n = send_some(sock, rest, std::span<const int>(raw.data(), nfds));
        if (n == 0) return false;
        item.fds.clear();  // the kernel holds its own references now
        sent_ += n;
        if (sent_ == item.bytes.size()) {
            queue_.pop_front();
            sent_ = 0;
        }
    }
    return true;
}

std::size_t Writer::pending_bytes() const {
    std::size_t total = 0;
    for (const auto& item : queue_) total += item.bytes.size();
    return total - sent_;
}

// ---- names ----------------------------------------------------------------

std::string name_of(const char* field, std::size_t size) {
    return std::string(field, strnlen(field, size));
}

void set_name(char* field, std::size_t size, const std::string& value) {
    if (size == 0) return;
    const std::size_t n = std::min(value.size(), size - 1);  // keep one NUL
    for (std::size_t i = 0; i < n; ++i) {
        const auto c = static_cast<unsigned char>(value[i]);
        field[i] = (c >= 0x20 && c <= 0x7e) ? value[i] : '?';
    }
    std::memset(field + n, 0, size - n);
}

}  // namespace pvgpu::wire
