// One binary-protocol connection: a non-blocking socket, a wire::Reader for
// what comes in and a queue for what goes out (partial writes resumed when
// the socket drains; descriptors ride on their message's first byte).
// Nothing here ever blocks.  A client that stops reading is paused and, past
// the queue limit, dropped; one that says nothing is dropped after the HELLO
// timeout; one that sends garbage gets ERROR and is dropped.  Descriptors and
// the channel memory behind them count against the client too: each queued
// CHAN_REPLY pins a memfd and an eventfd until the client reads it, so
// requests are not even parsed while too many are queued.
#pragma once

#include <sys/socket.h>

#include <cstddef>
#include <cstdint>
#include <deque>
#include <span>
#include <string>
#include <vector>

#include "core/time.hpp"
#include "gsource.hpp"
#include "proto/unique_fd.hpp"
#include "proto/wire.hpp"

namespace pvgpu::daemon {

class ClientConn {
public:
    class Handler {
    public:
        virtual ~Handler() = default;
        virtual void on_message(ClientConn& c, wire::Message& m) = 0;
        // The connection is finished.  Called once, possibly from inside
        // send() or another callback: the handler destroys the connection
        // later, from the main loop, never from here.
        virtual void on_closed(ClientConn& c, const std::string& reason, bool protocol_error) = 0;
    };

    struct Options {
        std::size_t max_queue_bytes = 1024 * 1024;
        // Requests wait unread while this many descriptors are queued.
        std::size_t max_queue_fds = 8;
        Duration hello_timeout = 5 * kSecond;
    };

    // The socket is watched through `mux` (one fd in the loop for all clients).
    ClientConn(GMainContext* ctx, FdMux& mux, const Clock& clock, Timers& timers, UniqueFd sock,
               std::uint32_t id, Options opt, Handler& handler);
    ClientConn(const ClientConn&) = delete;
    ClientConn& operator=(const ClientConn&) = delete;

    std::uint32_t id() const { return id_; }
    const ucred& peer() const { return peer_; }
    bool is_open() const { return open_; }
    std::size_t queued_bytes() const { return queued_; }
    std::size_t queued_fds() const { return queued_fds_; }

    // Queues a message and writes what the socket takes now.  `fds` are
    // duplicated: the queue owns its copies, so a descriptor closed in the
    // meantime can never be replaced by an unrelated one.  `pinned_bytes`
    // is memory those descriptors keep alive (a channel's memfd): it counts
    // as queued until the message is written.
    void send(std::uint16_t type, std::uint32_t seq, std::span<const std::byte> payload = {},
              std::span<const int> fds = {}, std::size_t pinned_bytes = 0);
    template <class T>
    void send_struct(std::uint16_t type, std::uint32_t seq, const T& body, std::span<const int> fds = {},
                     std::size_t pinned_bytes = 0) {
        send(type, seq, std::as_bytes(std::span<const T, 1>(&body, 1)), fds, pinned_bytes);
    }
    // Sends ERROR, writes what it can and closes.
    void fail(std::uint32_t status, const std::string& message, bool protocol_error = true);
    // Closes (the reason is logged by the handler).
    void close(const std::string& reason, bool protocol_error = false);
    // Closes with only the sending side shut down: the peer reads what was
    // queued (a refusal's ERROR and reply) before it sees the end.  Some
    // clients (QEMU's chardev) drop a socket that reports a hang-up without
    // reading it, so the socket itself must outlive this object a while:
    // take it with take_socket() and close it later.
    void close_after_reply(const std::string& reason);
    UniqueFd take_socket() { return std::move(sock_); }
    // The client said HELLO in time.
    void hello_done() { hello_timer_.cancel(); }

private:
    struct Out {
        std::vector<std::byte> bytes;
        std::vector<UniqueFd> fds;
        std::size_t pinned = 0;  // counted in queued_ until the first byte is sent
        std::size_t offset = 0;
    };

    void on_io(GIOCondition cond);
    void read_some();
    // Handles buffered requests while the output queue has room.
    void dispatch();
    bool backlogged() const;
    void flush();
    void update_watch();

    GMainContext* ctx_;
    std::uint32_t id_;
    Options opt_;
    Handler& handler_;
    UniqueFd sock_;
    ucred peer_{};
    MuxWatch watch_;  // after sock_: removed while the socket is open
    Timer hello_timer_;
    Source resume_;  // dispatches buffered requests once the queue drained
    wire::Reader reader_;
    std::deque<Out> out_;
    std::size_t queued_ = 0;      // bytes, pinned channel memory included
    std::size_t queued_fds_ = 0;  // descriptors not sent yet
    bool peer_eof_ = false;       // the peer finished sending; close once dispatched
    bool open_ = true;
    bool lingering_ = false;  // close_after_reply: the peer may still read
};

}  // namespace pvgpu::daemon
