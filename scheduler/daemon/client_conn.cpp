#include "client_conn.hpp"

#include <fcntl.h>

#include <algorithm>
#include <cerrno>
#include <system_error>

namespace pvgpu::daemon {

namespace {

// Reading pauses while this much is queued for the client, so a client
// that sends requests but does not read replies only slows itself down.
constexpr std::size_t kPauseBytes = 64 * 1024;
// The kernel doubles it; a message costs ~1 KiB of it however small, so
// about 30 messages (at most 60 descriptors) are in flight at a time.
constexpr std::size_t kSendBufferBytes = 16 * 1024;

}  // namespace

ClientConn::ClientConn(GMainContext* ctx, FdMux& mux, const Clock& clock, Timers& timers, UniqueFd sock,
                       std::uint32_t id, Options opt, Handler& handler)
    : ctx_(ctx), id_(id), opt_(opt), handler_(handler), sock_(std::move(sock)), hello_timer_(timers) {
    socklen_t len = sizeof peer_;
    if (getsockopt(sock_.get(), SOL_SOCKET, SO_PEERCRED, &peer_, &len) != 0) peer_ = ucred{0, ~0u, ~0u};
    // Descriptors written to the socket but not yet read by the client stay
    // open (charged to pvgpud's RLIMIT_NOFILE as in-flight): a small send
    // buffer bounds them per connection, the rest waits in out_ (counted).
    int sndbuf = static_cast<int>(kSendBufferBytes);
    (void)setsockopt(sock_.get(), SOL_SOCKET, SO_SNDBUF, &sndbuf, sizeof sndbuf);
    watch_ = MuxWatch(mux, sock_.get(), G_IO_IN, [this](GIOCondition c) { on_io(c); });
    hello_timer_.arm(clock.now() + opt_.hello_timeout, [this] {
        fail(PVGPU_E_STATE, "no HELLO within " + std::to_string(opt_.hello_timeout / kMillisecond) + " ms");
    });
}

void ClientConn::send(std::uint16_t type, std::uint32_t seq, std::span<const std::byte> payload,
                      std::span<const int> fds, std::size_t pinned_bytes) {
    if (!open_) return;
    Out m;
    m.bytes = wire::encode(type, seq, payload);
    for (int fd : fds) {
        UniqueFd dup(fcntl(fd, F_DUPFD_CLOEXEC, 0));
        if (!dup) {
            close("cannot duplicate a descriptor to send: " + std::system_category().message(errno));
            return;
        }
        m.fds.push_back(std::move(dup));
    }
    m.pinned = pinned_bytes;
    queued_ += m.bytes.size() + m.pinned;
    queued_fds_ += m.fds.size();
    out_.push_back(std::move(m));
    // Requests stop being read at half the limit (and at max_queue_fds), so
    // only pushes the client does not read can get here.
    if (queued_ > opt_.max_queue_bytes || queued_fds_ > 2 * opt_.max_queue_fds) {
        close("client does not read (" + std::to_string(queued_) + " bytes and " + std::to_string(queued_fds_) +
              " descriptors queued)");
        return;
    }
    flush();
}

void ClientConn::fail(std::uint32_t status, const std::string& message, bool protocol_error) {
    if (!open_) return;
    pvgpu_error e{};
    e.status = status;
    wire::set_name(e.message, sizeof e.message, message);
    send_struct(PVGPU_MSG_ERROR, 0, e);
    close(message, protocol_error);
}

void ClientConn::close_after_reply(const std::string& reason) {
    if (!open_) return;
    flush();
    lingering_ = true;
    close(reason, false);
}

void ClientConn::close(const std::string& reason, bool protocol_error) {
    if (!open_) return;
    open_ = false;
    watch_.reset();
    hello_timer_.cancel();
    out_.clear();
    queued_ = 0;
    queued_fds_ = 0;
    resume_.reset();
    // Whatever was written is in the peer's receive queue; it stays readable.
    // (After close_after_reply the reading side stays open: no hang-up yet.)
    ::shutdown(sock_.get(), lingering_ ? SHUT_WR : SHUT_RDWR);
    handler_.on_closed(*this, reason, protocol_error);
}

void ClientConn::on_io(GIOCondition cond) {
    if (cond & G_IO_OUT) flush();
    if (!open_) return;
    if (cond & (G_IO_IN | G_IO_HUP | G_IO_ERR)) {
        if (watch_.condition() & G_IO_IN) {
            read_some();
        } else if (cond & (G_IO_HUP | G_IO_ERR)) {
            close("disconnected");  // paused for back-pressure and the peer went away
        }
    }
}

void ClientConn::read_some() {
    bool alive = true;
    try {
        alive = wire::receive(sock_.get(), reader_);
    } catch (const std::system_error& e) {
        // A peer that closes with our pushes unread resets the connection.
        close(e.code().value() == ECONNRESET ? "disconnected (reset)"
                                             : std::string("receive failed: ") + e.what());
        return;
    }
    peer_eof_ = peer_eof_ || !alive;
    dispatch();
}

bool ClientConn::backlogged() const {
    return queued_ >= std::min(kPauseBytes, opt_.max_queue_bytes / 2) || queued_fds_ >= opt_.max_queue_fds;
}

void ClientConn::dispatch() {
    // One read can hold hundreds of requests: each is handled only while
    // the replies so far fit, the rest wait in the reader (bounded by what
    // one receive takes) until the client reads.
    while (open_ && !backlogged()) {
        auto r = reader_.next();
        if (std::holds_alternative<std::monostate>(r)) break;
        if (auto* err = std::get_if<wire::DecodeError>(&r)) {
            fail(PVGPU_E_INVALID, "protocol error: " + err->reason);
            return;
        }
        handler_.on_message(*this, std::get<wire::Message>(r));
    }
    if (!open_) return;
    if (peer_eof_ && !backlogged()) {
        close(reader_.buffered() ? "disconnected mid-message" : "disconnected");
        return;
    }
    update_watch();
}

void ClientConn::flush() {
    while (open_ && !out_.empty()) {
        Out& m = out_.front();
        std::vector<int> fds;
        if (m.offset == 0)
            for (const auto& fd : m.fds) fds.push_back(fd.get());
        std::size_t n = 0;
        try {
            n = wire::send_some(sock_.get(), std::span(m.bytes).subspan(m.offset), fds);
        } catch (const std::system_error& e) {
            close(std::string("send failed: ") + e.what());
            return;
        }
        if (n == 0) break;  // the socket is full: wait for G_IO_OUT
        if (m.offset == 0) {
            // Delivered with the first byte: the client holds them now.
            queued_fds_ -= m.fds.size();
            queued_ -= m.pinned;
            m.fds.clear();
            m.pinned = 0;
        }
        m.offset += n;
        queued_ -= n;
        if (m.offset == m.bytes.size()) out_.pop_front();
    }
    // Requests that waited for room: handled from the loop, never from
    // inside a send() the daemon is making.
    if (open_ && !backlogged() && (reader_.buffered() > 0 || peer_eof_) && !resume_)
        resume_ = add_idle(ctx_, [this] {
            dispatch();
            return false;
        });
    update_watch();
}

void ClientConn::update_watch() {
    if (!open_) return;
    int cond = 0;
    if (!backlogged() && !peer_eof_) cond |= G_IO_IN;
    if (!out_.empty()) cond |= G_IO_OUT;
    watch_.set_condition(static_cast<GIOCondition>(cond));
}

}  // namespace pvgpu::daemon
