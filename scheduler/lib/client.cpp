// libpvgpu: see pvgpu.h for the contract.
//
// Structure: Client::Impl owns the socket, the channel states (keyed by a
// handle that stays stable across reconnects) and the request/reply logic.
// Lost connections surface inside the library as ConnectionLost; every public
// operation runs under with_reconnect(), which re-establishes the session
// (connect, HELLO, CHAN_ALLOC per channel, resubmission) and retries.
#include "pvgpu.h"

#include <fcntl.h>
#include <poll.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <unistd.h>

#include <pvgpu/abi.h>
#include <pvgpu/protocol.h>

#include <algorithm>
#include <cerrno>
#include <cmath>
#include <cstring>
#include <deque>
#include <map>
#include <optional>
#include <system_error>
#include <thread>
#include <utility>

#include "proto/unique_fd.hpp"
#include "proto/wire.hpp"

namespace pvgpu {
namespace {

using SteadyClock = std::chrono::steady_clock;
using TimePoint = SteadyClock::time_point;
using std::chrono::nanoseconds;

// The daemon closed the connection or the socket broke; recoverable by
// reconnecting.  Deliberately not a std::exception: it never leaves the library.
struct ConnectionLost {
    std::string reason;
    // The daemon said why with an ERROR first (it found fault with us):
    // reconnecting would only repeat it.
    bool refused = false;
};

std::string errno_text(int err) { return std::error_code(err, std::system_category()).message(); }

// Control page registers are shared with the GPU: acquire/release pairs order
// the ring entry writes before IB_PUT and the GPU's FENCE after its work.
std::uint32_t load_acquire(const volatile std::uint32_t& reg) {
    return __atomic_load_n(&reg, __ATOMIC_ACQUIRE);
}
void store_release(volatile std::uint32_t& reg, std::uint32_t value) {
    __atomic_store_n(&reg, value, __ATOMIC_RELEASE);
}

TimePoint saturating_add(TimePoint t, nanoseconds d) {
    if (d >= TimePoint::max() - t) return TimePoint::max();
    return t + d;
}

const char* status_text(std::uint32_t status) {
    switch (status) {
    case PVGPU_OK: return "ok";
    case PVGPU_E_VERSION: return "no common protocol version";
    case PVGPU_E_INVALID: return "invalid request";
    case PVGPU_E_STATE: return "not allowed in this state";
    case PVGPU_E_LIMIT: return "too many channels for this client";
    case PVGPU_E_NOENT: return "no such channel";
    case PVGPU_E_INTERNAL: return "daemon internal error";
    default: return "unknown status";
    }
}

std::string channel_error_text(std::uint32_t err) {
    switch (err) {
    case PVGPU_CHAN_ERR_WATCHDOG: return "killed by the GPU watchdog (a kernel ran too long)";
    case PVGPU_CHAN_ERR_BAD_ENTRY: return "killed by the GPU: bad ring entry";
    default: return "stopped by the GPU (error " + std::to_string(err) + ")";
    }
}

// RAII shared mapping of a channel's memfd.
class Mapping {
public:
    Mapping() = default;
    Mapping(int fd, std::size_t size) : size_(size) {
        void* p = ::mmap(nullptr, size, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
        if (p == MAP_FAILED) throw ClientError("cannot map channel memory: " + errno_text(errno));
        addr_ = p;
    }
    Mapping(Mapping&& o) noexcept
        : addr_(std::exchange(o.addr_, nullptr)), size_(std::exchange(o.size_, 0)) {}
    Mapping& operator=(Mapping&& o) noexcept {
        if (this != &o) {
            reset();
            addr_ = std::exchange(o.addr_, nullptr);
            size_ = std::exchange(o.size_, 0);
        }
        return *this;
    }
    Mapping(const Mapping&) = delete;
    Mapping& operator=(const Mapping&) = delete;
    ~Mapping() { reset(); }

    void reset() {
        if (addr_) ::munmap(addr_, size_);
        addr_ = nullptr;
        size_ = 0;
    }
    std::byte* data() const { return static_cast<std::byte*>(addr_); }

private:
    void* addr_ = nullptr;
    std::size_t size_ = 0;
};

// One submitted entry the library has not yet seen complete.  The payload is
// kept so the entry can be resubmitted on a fresh channel after a reconnect.
struct Entry {
    std::uint64_t fence;         // the application's fence
    std::uint32_t dev_fence;     // fence written into the ring of the current channel
    std::uint64_t payload;       // kernel run time, ns
    TimePoint earliest_done;     // lower bound on its completion time
};

struct ChannelState {
    // Current daemon-side channel (replaced on reconnect).
    std::uint32_t chan_id = 0;
    Mapping mem;
    UniqueFd doorbell;
    pvgpu_ctrl_page* ctrl = nullptr;
    pvgpu_ring* ring = nullptr;
    std::uint32_t put = 0;             // entries written into this channel's ring
    std::uint32_t next_dev_fence = 1;
    std::uint32_t mode = PVGPU_MODE_DIRECT;
    std::uint32_t mode_seq = 0;

    // Application view (survives reconnects).
    std::uint64_t next_fence = 1;
    std::uint64_t completed = 0;
    std::deque<Entry> pending;
    std::string dead;                  // non-empty: why the channel is unusable

    // Completion polling (see next_check):
    TimePoint head_floor{};            // the head entry cannot have started before this
    TimePoint last_incomplete{};       // last time a look found the head not done
    double lateness_ns = 0;            // learned: completion time past the lower bound, per kernel
    unsigned misses = 0;               // fine-step checks since the last progress
    // The entry being waited for, to learn the lateness from.
    std::uint64_t probe_fence = 0;     // 0: none
    TimePoint probe_lower{};           // its lower bound, lateness not included
    std::size_t probe_kernels = 0;     // kernels from the head up to it
    unsigned probe_misses = 0;         // fine-step checks for it
};

}  // namespace

struct Client::Impl {
    explicit Impl(ClientOptions o) : options(std::move(o)) {
        if (options.name.size() >= PVGPU_NAME_LEN)
            throw ClientError("client name '" + options.name + "' is longer than " +
                              std::to_string(PVGPU_NAME_LEN - 1) + " bytes");
        if (options.socket_path.empty()) throw ClientError("empty daemon socket path");
        if (options.socket_path.size() >= sizeof(sockaddr_un{}.sun_path))
            throw ClientError("socket path too long: " + options.socket_path);
        if (options.min_poll.count() <= 0 || options.max_poll < options.min_poll)
            throw ClientError("invalid poll interval bounds");
    }

    ClientOptions options;
    UniqueFd sock;
    wire::Reader reader;
    bool connected = false;
    std::string lost_reason;           // why the last connection ended
    std::string daemon_error;          // ERROR pushed on this connection, if any
    std::uint32_t client_id = 0;
    std::uint32_t max_channels = 0;
    std::uint32_t next_seq = 1;
    std::uint32_t awaited_seq = 0;     // request whose reply we are waiting for
    std::optional<wire::Message> reply;
    std::map<std::uint64_t, ChannelState> channels;  // by handle
    std::uint64_t next_handle = 1;
    TimePoint last_pump{};
    ClientStats stats;

    void log(const std::string& line) const {
        if (options.log) options.log(line);
    }

    // ---- connection -------------------------------------------------------

    // Connects and says HELLO.  Connection failures are ConnectionLost (a
    // caller may retry); a refusal by the daemon is a ClientError.
    void connect_and_hello() {
        UniqueFd fd(::socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0));
        if (!fd) throw ClientError("socket: " + errno_text(errno));
        sockaddr_un addr{};
        addr.sun_family = AF_UNIX;
        std::memcpy(addr.sun_path, options.socket_path.data(), options.socket_path.size());
        int rc;
        do {
            rc = ::connect(fd.get(), reinterpret_cast<const sockaddr*>(&addr), sizeof addr);
        } while (rc < 0 && errno == EINTR);
        if (rc < 0)
            throw ConnectionLost{"cannot connect to " + options.socket_path + ": " + errno_text(errno)};
        // Non-blocking from here: wire I/O never blocks, we wait with ppoll.
        const int flags = ::fcntl(fd.get(), F_GETFL);
        if (flags < 0 || ::fcntl(fd.get(), F_SETFL, flags | O_NONBLOCK) < 0)
            throw ClientError("fcntl: " + errno_text(errno));
        sock = std::move(fd);
        reader = wire::Reader{};
        daemon_error.clear();
        reply.reset();
        awaited_seq = 0;

        pvgpu_hello hello{};
        hello.version = PVGPU_PROTO_VERSION;
        hello.role = PVGPU_ROLE_HOST;
        wire::set_name(hello.name, sizeof hello.name, options.name);
        hello.pid = static_cast<std::uint32_t>(::getpid());
        const wire::Message m = request(PVGPU_MSG_HELLO, hello);
        if (m.hdr.type != PVGPU_MSG_HELLO_REPLY)
            throw ClientError("pvgpud answered HELLO with " + std::string(wire::type_name(m.hdr.type)));
        const auto r = m.as<pvgpu_hello_reply>();
        if (r.status != PVGPU_OK)
            throw ClientError("pvgpud refused HELLO: " + std::string(status_text(r.status)));
        client_id = r.client_id;
        max_channels = r.max_channels;
        connected = true;
    }

    void mark_lost(std::string reason) {
        connected = false;
        lost_reason = std::move(reason);
    }

    // Re-establishes the session after a lost connection: last look at the
    // old control pages (work that completed needs no resubmission), then
    // reconnect with backoff, re-allocate every channel and resubmit.
    void recover() {
        drop_session();
        const std::string why = "lost connection to pvgpud at " + options.socket_path + " (" +
                                lost_reason + ")";
        if (!options.reconnect) throw ClientError(why);
        log(why + "; reconnecting");

        const TimePoint start = SteadyClock::now();
        auto backoff = options.reconnect_initial_backoff;
        std::string last_error;
        for (unsigned attempt = 1;; ++attempt) {
            try {
                connect_and_hello();
                for (auto& [handle, c] : channels) {
                    if (!c.dead.empty()) continue;  // a dead channel stays dead
                    allocate(c);
                    resubmit(c);
                }
                ++stats.reconnects;
                log("reconnected to pvgpud after " + std::to_string(attempt) + " attempt(s)");
                return;
            } catch (const ConnectionLost& e) {
                drop_session();
                if (e.refused) {
                    lost_reason = why;
                    throw ClientError(why + "; reconnecting failed: " + e.reason);
                }
                last_error = e.reason;
            } catch (...) {
                // Refused or unanswered: give up, but leave a consistent
                // disconnected state so a later call can try again.
                drop_session();
                lost_reason = why;
                throw;
            }
            if (SteadyClock::now() - start >= options.reconnect_timeout)
                throw ClientError(why + "; could not reconnect within " +
                                  std::to_string(options.reconnect_timeout.count()) +
                                  " ms: " + last_error);
            std::this_thread::sleep_for(backoff);  // retry pacing, not synchronisation
            backoff = std::min(backoff * 2, options.reconnect_max_backoff);
        }
    }

    // Forgets a half-established session: no socket, every channel detached.
    void drop_session() {
        for (auto& [handle, c] : channels) {
            refresh(c);
            detach(c);
        }
        sock.reset();
        reader = wire::Reader{};
        connected = false;
    }

    void ensure_connected() {
        if (!connected) recover();
    }

    // Runs `op`, reconnecting and retrying whenever the connection is lost.
    template <class Op> auto with_reconnect(Op&& op) {
        for (;;) {
            ensure_connected();
            try {
                return op();
            } catch (const ConnectionLost& e) {
                mark_lost(e.reason);
                if (e.refused) throw ClientError("connection to pvgpud ended: " + e.reason);
            }
        }
    }

    // ---- messages ---------------------------------------------------------

    void send(std::vector<std::byte> bytes) {
        std::size_t off = 0;
        const TimePoint deadline = SteadyClock::now() + options.request_timeout;
        while (off < bytes.size()) {
            std::size_t n;
            try {
                n = wire::send_some(sock.get(), std::span(bytes).subspan(off), {});
            } catch (const std::system_error& e) {
                throw ConnectionLost{e.code().message()};
            }
            off += n;
            if (off == bytes.size()) break;
            // The socket buffer is full.  Keep reading while we wait so a
            // daemon that is itself blocked writing to us can make progress.
            pollfd p{sock.get(), POLLOUT | POLLIN, 0};
            const auto left = deadline - SteadyClock::now();
            if (left <= nanoseconds::zero())
                throw ClientError("pvgpud does not read its socket (send timed out)");
            const timespec ts = to_timespec(left);
            if (::ppoll(&p, 1, &ts, nullptr) < 0 && errno != EINTR)
                throw ClientError("ppoll: " + errno_text(errno));
            if (p.revents & (POLLIN | POLLHUP | POLLERR)) receive_into_reader();
        }
    }

    void receive_into_reader() {
        bool open;
        try {
            open = wire::receive(sock.get(), reader);
        } catch (const std::system_error& e) {
            throw ConnectionLost{e.code().message()};
        }
        if (!open) {
            if (!daemon_error.empty()) throw ConnectionLost{daemon_error, true};
            throw ConnectionLost{"daemon closed the connection"};
        }
    }

    // Sends a request and waits for the reply with the same seq, handling
    // pushes meanwhile.  An ERROR reply becomes a ClientError.
    template <class Body> wire::Message request(std::uint16_t type, const Body& body) {
        std::uint32_t seq = next_seq++;
        if (seq == 0) seq = next_seq++;  // 0 is for pushes
        awaited_seq = seq;
        reply.reset();
        send(wire::encode(type, seq, body));
        const TimePoint deadline = SteadyClock::now() + options.request_timeout;
        while (!reply) {
            if (SteadyClock::now() >= deadline)
                throw ClientError("pvgpud did not answer " + std::string(wire::type_name(type)) +
                                  " within " + std::to_string(options.request_timeout.count()) + " ms");
            pump(deadline);
        }
        awaited_seq = 0;
        wire::Message m = std::move(*reply);
        reply.reset();
        if (m.hdr.type == PVGPU_MSG_ERROR) {
            const auto e = m.as<pvgpu_error>();
            throw ClientError("pvgpud rejected " + std::string(wire::type_name(type)) + ": " +
                              wire::name_of(e.message, sizeof e.message) + " (" +
                              status_text(e.status) + ")");
        }
        return m;
    }

    // Waits for socket input until `deadline` and handles every complete
    // message.  Returns false if a signal interrupted the wait.
    bool pump(TimePoint deadline) {
        last_pump = SteadyClock::now();
        // Messages already buffered may change what the caller waits for.
        if (dispatch_buffered() > 0) return true;
        pollfd p{sock.get(), POLLIN, 0};
        timespec ts{};
        const timespec* timeout = nullptr;
        if (deadline != TimePoint::max()) {
            ts = to_timespec(std::max(nanoseconds::zero(), deadline - SteadyClock::now()));
            timeout = &ts;
        }
        const int rc = ::ppoll(&p, 1, timeout, nullptr);
        if (rc < 0) {
            if (errno == EINTR) return false;
            throw ClientError("ppoll: " + errno_text(errno));
        }
        if (rc > 0) {
            receive_into_reader();
            dispatch_buffered();
        }
        return true;
    }

    // Handles complete buffered messages; returns how many.
    std::size_t dispatch_buffered() {
        std::size_t handled = 0;
        // Stop once a reply is in: pushes behind it may name the channel the
        // reply creates, which the caller registers only after it returns.
        while (!reply) {
            auto next = reader.next();
            if (std::holds_alternative<std::monostate>(next)) break;
            if (auto* err = std::get_if<wire::DecodeError>(&next))
                throw ConnectionLost{"protocol error from pvgpud: " + err->reason, true};
            handle(std::move(std::get<wire::Message>(next)));
            ++handled;
        }
        return handled;
    }

    void handle(wire::Message m) {
        switch (m.hdr.type) {
        case PVGPU_MSG_MODE: {
            const auto mode = m.as<pvgpu_mode>();
            ++stats.mode_messages;
            ChannelState* c = by_chan_id(mode.chan_id);
            if (!c) return;  // a channel we freed; the daemon forgets it too
            // Leaving SHADOWED (to TRAPPED, or DIRECT from a buggy daemon):
            // ring for what was held back, then ack with that IB_PUT.  A host
            // client has no mapping to switch; DIRECT and TRAPPED are the same
            // here (every submit rings).
            const bool unshadow = c->mode == PVGPU_MODE_SHADOWED && mode.mode != PVGPU_MODE_SHADOWED;
            c->mode = mode.mode;
            c->mode_seq = mode.mode_seq;
            if (unshadow && c->ctrl) publish(*c);
            pvgpu_mode_ack ack{};
            ack.chan_id = mode.chan_id;
            ack.mode = mode.mode;
            ack.mode_seq = mode.mode_seq;
            ack.guest_put = c->put;
            send(wire::encode(PVGPU_MSG_MODE_ACK, 0, ack));
            return;
        }
        case PVGPU_MSG_NOTICE: {
            const auto n = m.as<pvgpu_notice>();
            ++stats.notices;
            ChannelState* c = by_chan_id(n.chan_id);
            if (n.kind == PVGPU_NOTICE_DEGRADED) {
                log("pvgpud: channel " + std::to_string(n.chan_id) +
                    " ignored a mode switch; enforced host-side");
                return;
            }
            if (c && c->dead.empty())
                c->dead = channel_error_text(n.kind == PVGPU_NOTICE_WATCHDOG ? PVGPU_CHAN_ERR_WATCHDOG
                                                                              : PVGPU_CHAN_ERR_BAD_ENTRY);
            return;
        }
        case PVGPU_MSG_ERROR:
            if (m.hdr.seq != 0 && m.hdr.seq == awaited_seq) {
                reply = std::move(m);
            } else {
                const auto e = m.as<pvgpu_error>();
                // The daemon closes right after this: the reason for the loss.
                daemon_error = "pvgpud error: " + wire::name_of(e.message, sizeof e.message) + " (" +
                               status_text(e.status) + ")";
            }
            return;
        case PVGPU_MSG_HELLO_REPLY:
        case PVGPU_MSG_CHAN_REPLY:
        case PVGPU_MSG_FREE_REPLY:
        case PVGPU_MSG_PONG:
            if (m.hdr.seq == awaited_seq && awaited_seq != 0) reply = std::move(m);
            return;  // a stale reply to a request we gave up on
        default:
            throw ConnectionLost{"pvgpud sent an unexpected " + std::string(wire::type_name(m.hdr.type)), true};
        }
    }

    static timespec to_timespec(nanoseconds d) {
        timespec ts{};
        ts.tv_sec = static_cast<time_t>(d.count() / 1'000'000'000);
        ts.tv_nsec = static_cast<long>(d.count() % 1'000'000'000);
        return ts;
    }

    // ---- channels ---------------------------------------------------------

    ChannelState* by_chan_id(std::uint32_t chan_id) {
        for (auto& [handle, c] : channels)
            if (c.ctrl && c.chan_id == chan_id) return &c;
        return nullptr;
    }

    ChannelState& channel(std::uint64_t handle) {
        auto it = channels.find(handle);
        if (it == channels.end()) throw ClientError("channel was freed");
        return it->second;
    }

    // Allocates a daemon-side channel for `c` and maps its memory.
    void allocate(ChannelState& c) {
        pvgpu_chan_alloc body{};
        wire::Message m = request(PVGPU_MSG_CHAN_ALLOC, body);
        if (m.hdr.type != PVGPU_MSG_CHAN_REPLY)
            throw ClientError("pvgpud answered CHAN_ALLOC with " +
                              std::string(wire::type_name(m.hdr.type)));
        const auto r = m.as<pvgpu_chan_reply>();
        if (r.status != PVGPU_OK) {
            std::string why = status_text(r.status);
            if (r.status == PVGPU_E_LIMIT) why += " (limit " + std::to_string(max_channels) + ")";
            throw ClientError("pvgpud refused CHAN_ALLOC: " + why);
        }
        if (m.fds.size() != 2 || r.mem_size < PVGPU_CHAN_MEM_SIZE)
            throw ClientError("pvgpud sent a malformed CHAN_REPLY");
        c.mem = Mapping(m.fds[0].get(), r.mem_size);  // the mapping outlives the memfd
        c.doorbell = std::move(m.fds[1]);
        c.chan_id = r.chan_id;
        c.ctrl = reinterpret_cast<pvgpu_ctrl_page*>(c.mem.data());
        c.ring = reinterpret_cast<pvgpu_ring*>(c.mem.data() + PVGPU_CHAN_RING_OFFSET);
        // A fresh channel starts at 0; reading the page keeps us right if not.
        c.put = c.ctrl->ib_put;
        c.next_dev_fence = load_acquire(c.ctrl->fence) + 1;
        c.mode = r.mode;
        c.mode_seq = 0;
        c.misses = 0;
    }

    static void detach(ChannelState& c) {
        c.ctrl = nullptr;
        c.ring = nullptr;
        c.mem.reset();
        c.doorbell.reset();
    }

    // Writes the entries of `c.pending` from index `from` into the ring and
    // rings the doorbell once.
    void write_entries(ChannelState& c, std::size_t from) {
        for (std::size_t i = from; i < c.pending.size(); ++i) {
            Entry& e = c.pending[i];
            pvgpu_ring_entry& slot = c.ring->entries[c.put & PVGPU_RING_MASK];
            slot.payload = e.payload;
            slot.fence = e.dev_fence;
            slot.flags = PVGPU_ENTRY_IRQ;
            ++c.put;
        }
        // Shadowed: the daemon holds this channel's work back whatever we do,
        // so do not ring (no syscall, no daemon wake-up per submit).  IB_PUT
        // is still published: pvgpud reads it to see the held backlog, and
        // hfq needs that to keep the channel in its run queue (keeping IB_PUT
        // private, as docs/protocol.md 2.5 says, measured 0.82/0.18 instead
        // of 0.54/0.46 for 2000 us vs 200 us kernels).
        if (c.mode == PVGPU_MODE_SHADOWED)
            store_release(c.ctrl->ib_put, c.put);
        else
            publish(c);
    }

    // Stores IB_PUT (after the entries: release order) and rings the doorbell.
    static void publish(ChannelState& c) {
        store_release(c.ctrl->ib_put, c.put);
        const std::uint64_t one = 1;
        ssize_t n;
        do {
            n = ::write(c.doorbell.get(), &one, sizeof one);
        } while (n < 0 && errno == EINTR);
        if (n != static_cast<ssize_t>(sizeof one))
            throw ClientError("doorbell write failed: " + errno_text(errno));
    }

    // After a reconnect: the outstanding entries go to the new channel in
    // order, with new ring fences; the application's fences stay the same.
    void resubmit(ChannelState& c) {
        if (c.pending.empty()) return;
        TimePoint prev = SteadyClock::now();
        c.head_floor = prev;
        c.misses = 0;
        for (Entry& e : c.pending) {
            e.dev_fence = c.next_dev_fence++;
            prev += nanoseconds(e.payload);
            e.earliest_done = prev;
        }
        write_entries(c, 0);
        stats.resubmitted += c.pending.size();
        log("resubmitted " + std::to_string(c.pending.size()) + " entries on channel " +
            std::to_string(c.chan_id));
    }

    // Reads FENCE and STATUS; retires completed entries.  Returns whether any did.
    bool refresh(ChannelState& c) {
        if (!c.ctrl) return false;
        const std::uint32_t fence = load_acquire(c.ctrl->fence);
        const TimePoint now = SteadyClock::now();
        std::size_t retired = 0;
        std::uint64_t later_work = 0;  // retired entries after the first: ran after last_incomplete
        // Entries complete in order; compare by difference so 32-bit ring
        // fences may wrap.
        while (!c.pending.empty() &&
               static_cast<std::int32_t>(fence - c.pending.front().dev_fence) >= 0) {
            if (retired++ > 0) later_work += c.pending.front().payload;
            if (c.pending.front().fence == c.probe_fence) learn_lateness(c, now);
            c.completed = c.pending.front().fence;
            c.pending.pop_front();
        }
        if (retired > 0) {
            // The new head started after its predecessor completed, which was
            // after the last look that found the predecessor running.
            c.head_floor = c.last_incomplete + nanoseconds(later_work);
            c.misses = 0;
        }
        if (!c.pending.empty()) c.last_incomplete = now;
        if (c.dead.empty() && load_acquire(c.ctrl->status) == PVGPU_CHAN_STATUS_ERROR)
            c.dead = channel_error_text(load_acquire(c.ctrl->error));
        return retired > 0;
    }

    // How late the awaited entry completed past its lower bound, per kernel
    // (the GPU's per-kernel overhead as seen from here).  When the first look
    // already found it done, it was at most that late: probe lower.
    void learn_lateness(ChannelState& c, TimePoint now) {
        const double payload = static_cast<double>(c.pending.front().payload);
        double sample = 0.75 * c.lateness_ns;
        if (c.probe_misses > 0)
            sample = static_cast<double>(nanoseconds(now - c.probe_lower).count()) /
                     static_cast<double>(c.probe_kernels);
        c.lateness_ns += (std::clamp(sample, 0.0, payload) - c.lateness_ns) / 8;
        c.probe_fence = 0;
    }

    // When to look at `c` again while waiting for its entry `target`.  Not
    // before the work could be done: the GPU cannot run a kernel faster than
    // its length, a head it has not fetched yet (IB_GET) has not started,
    // and a kernel takes about the learned per-kernel lateness longer.  Past
    // that the GPU is busy with other channels, so look at a fraction of the
    // head kernel's length, backing off while nothing moves.
    TimePoint next_check(ChannelState& c, std::size_t target, TimePoint now) {
        std::uint64_t work = 0;  // head .. target
        for (std::size_t i = 0; i <= target; ++i) work += c.pending[i].payload;
        const std::uint32_t head_pos = c.put - static_cast<std::uint32_t>(c.pending.size());
        const bool head_fetched = static_cast<std::int32_t>(load_acquire(c.ctrl->ib_get) - head_pos) > 0;
        if (!head_fetched) {
            c.head_floor = std::max(c.head_floor, now);
            c.misses = 0;
        }
        const Entry& head = c.pending.front();
        const TimePoint lower = std::max(c.pending[target].earliest_done, c.head_floor + nanoseconds(work));
        if (c.probe_fence != c.pending[target].fence) {
            c.probe_fence = c.pending[target].fence;
            c.probe_misses = 0;
        }
        c.probe_lower = lower;
        c.probe_kernels = target + 1;
        const TimePoint expected =
            lower + nanoseconds(static_cast<std::int64_t>(c.lateness_ns * static_cast<double>(target + 1)));
        if (expected > now) return expected;
        ++c.probe_misses;
        const double head_ns = static_cast<double>(head.payload);
        const double lo = static_cast<double>(nanoseconds(options.min_poll).count());
        const double hi = std::min(static_cast<double>(nanoseconds(options.max_poll).count()),
                                   std::max(head_ns, lo));
        const double step = std::clamp(head_ns / 4 * std::pow(1.5, std::min(c.misses, 30u)), lo, hi);
        ++c.misses;
        const std::uint64_t rest = work - head.payload;
        return now + nanoseconds(std::max<std::uint64_t>(rest, static_cast<std::uint64_t>(step)));
    }

    struct Goal {
        std::uint64_t handle;
        std::uint64_t fence;
    };

    // Waits until one of the goals is reached (true), the deadline passes or
    // (if `return_on_signal`) a signal arrives (false).
    bool wait_goals(std::span<const Goal> goals, TimePoint deadline, bool return_on_signal) {
        if (goals.empty()) {
            // Nothing to wait for: just answer the daemon until the deadline.
            while (SteadyClock::now() < deadline)
                if (!pump(deadline) && return_on_signal) break;
            return false;
        }
        for (;;) {
            TimePoint wake = deadline;
            const TimePoint now = SteadyClock::now();
            for (const Goal& g : goals) {
                ChannelState& c = channel(g.handle);
                refresh(c);
                if (c.completed >= g.fence) return true;
                if (!c.dead.empty())
                    throw ClientError("channel " + std::to_string(c.chan_id) + ": " + c.dead);
                const auto it = std::find_if(c.pending.begin(), c.pending.end(),
                                             [&](const Entry& e) { return e.fence >= g.fence; });
                if (it == c.pending.end()) throw ClientError("internal: fence not outstanding");
                wake = std::min(wake, next_check(c, static_cast<std::size_t>(it - c.pending.begin()), now));
            }
            if (now >= deadline) return false;
            ++stats.polls;
            if (!pump(wake) && return_on_signal) return false;
        }
    }

    // Queues `kernels` (at most a ring's worth) with one doorbell.
    std::uint64_t submit(std::uint64_t handle, std::span<const std::uint64_t> kernels) {
        ChannelState& c = channel(handle);
        if (!c.dead.empty()) throw ClientError("channel " + std::to_string(c.chan_id) + ": " + c.dead);
        // Answer anything the daemon pushed, at most once a millisecond: a
        // mode switch may wait for its ack far longer, and a syscall per
        // submission would double the cost of submitting.
        if (const TimePoint t = SteadyClock::now(); t - last_pump >= std::chrono::milliseconds(1)) pump(t);
        refresh(c);
        // Respect the ring: at most PVGPU_RING_ENTRIES entries not completed.
        while (c.pending.size() + kernels.size() > PVGPU_RING_ENTRIES) {
            const Goal g{handle, c.pending[c.pending.size() + kernels.size() - PVGPU_RING_ENTRIES - 1].fence};
            wait_goals(std::span(&g, 1), TimePoint::max(), false);
        }
        const TimePoint now = SteadyClock::now();
        if (c.pending.empty()) {
            c.head_floor = now;  // an idle channel starts this entry no sooner than now
            c.misses = 0;
        }
        TimePoint done = c.pending.empty() ? now : std::max(now, c.pending.back().earliest_done);
        const std::size_t first = c.pending.size();
        for (const std::uint64_t kernel_ns : kernels) {
            done += nanoseconds(kernel_ns);
            c.pending.push_back(Entry{c.next_fence++, c.next_dev_fence++, kernel_ns, done});
        }
        // Pending first, ring second: if the daemon is gone by now the
        // entries are resubmitted after the reconnect.
        write_entries(c, first);
        return c.pending.back().fence;
    }

    std::uint64_t alloc() {
        ChannelState c;
        allocate(c);
        const std::uint64_t handle = next_handle++;
        channels.emplace(handle, std::move(c));
        return handle;
    }

    void free(std::uint64_t handle) {
        auto it = channels.find(handle);
        if (it == channels.end()) return;
        const std::uint32_t chan_id = it->second.chan_id;
        const bool was_attached = it->second.ctrl != nullptr;
        channels.erase(it);  // a reconnect from here on does not bring it back
        if (!connected || !was_attached) return;  // the daemon dropped it with the connection
        try {
            pvgpu_chan_ref ref{};
            ref.chan_id = chan_id;
            const wire::Message m = request(PVGPU_MSG_CHAN_FREE, ref);
            const auto r = m.as<pvgpu_status_reply>();
            if (m.hdr.type != PVGPU_MSG_FREE_REPLY || r.status != PVGPU_OK)
                throw ClientError("pvgpud refused CHAN_FREE of channel " + std::to_string(chan_id) +
                                  ": " + status_text(r.status));
        } catch (const ConnectionLost& e) {
            mark_lost(e.reason);  // recovered lazily by the next operation
        }
    }
};

// ---- Client -----------------------------------------------------------------

Client::Client(ClientOptions options) : impl_(std::make_shared<Impl>(std::move(options))) {
    try {
        impl_->connect_and_hello();
    } catch (const ConnectionLost& e) {
        throw ClientError(e.reason);
    }
}

Client::Client(const std::string& socket_path, const std::string& name)
    : Client([&] {
          ClientOptions o;
          o.socket_path = socket_path;
          o.name = name;
          return o;
      }()) {}

Client::Client(Client&&) noexcept = default;
Client& Client::operator=(Client&&) noexcept = default;
Client::~Client() = default;

Channel Client::alloc_channel() {
    if (!impl_) throw ClientError("use of a moved-from Client");
    const std::uint64_t handle = impl_->with_reconnect([&] { return impl_->alloc(); });
    return Channel(impl_, handle);
}

void Client::process_events() {
    if (!impl_) throw ClientError("use of a moved-from Client");
    impl_->with_reconnect([&] { impl_->pump(SteadyClock::now()); });
}

bool Client::wait_any(std::span<const WaitGoal> goals, std::chrono::steady_clock::time_point deadline) {
    if (!impl_) throw ClientError("use of a moved-from Client");
    std::vector<Impl::Goal> internal;
    for (const WaitGoal& g : goals) {
        if (!g.channel || g.channel->client_ != impl_)
            throw ClientError("wait_any: channel does not belong to this client");
        if (g.fence > g.channel->last_submitted())
            throw ClientError("wait_any: fence " + std::to_string(g.fence) + " was never submitted");
        internal.push_back(Impl::Goal{g.channel->handle_, g.fence});
    }
    return impl_->with_reconnect([&] { return impl_->wait_goals(internal, deadline, true); });
}

std::uint32_t Client::client_id() const { return impl_ ? impl_->client_id : 0; }
std::uint32_t Client::max_channels() const { return impl_ ? impl_->max_channels : 0; }

const ClientStats& Client::stats() const {
    static const ClientStats empty;
    return impl_ ? impl_->stats : empty;
}

// ---- Channel ----------------------------------------------------------------

Channel::Channel(Channel&& o) noexcept
    : client_(std::move(o.client_)), handle_(std::exchange(o.handle_, 0)) {}

Channel& Channel::operator=(Channel&& o) noexcept {
    if (this != &o) {
        try {
            free();
        } catch (...) {  // NOLINT(bugprone-empty-catch): nothing to report to in a move
        }
        client_ = std::move(o.client_);
        handle_ = std::exchange(o.handle_, 0);
    }
    return *this;
}

Channel::~Channel() {
    try {
        free();
    } catch (...) {  // NOLINT(bugprone-empty-catch): destructors must not throw
    }
}

static void require(const std::shared_ptr<Client::Impl>& client) {
    if (!client) throw ClientError("use of a freed or empty Channel");
}

std::uint64_t Channel::submit(std::uint64_t kernel_ns) {
    return submit(std::span<const std::uint64_t>(&kernel_ns, 1));
}

std::uint64_t Channel::submit(std::span<const std::uint64_t> kernels_ns) {
    require(client_);
    if (kernels_ns.empty()) throw ClientError("submit: no kernels");
    std::uint64_t fence = 0;
    while (!kernels_ns.empty()) {
        const auto piece = kernels_ns.first(std::min<std::size_t>(kernels_ns.size(), PVGPU_RING_ENTRIES));
        fence = client_->with_reconnect([&] { return client_->submit(handle_, piece); });
        kernels_ns = kernels_ns.subspan(piece.size());
    }
    return fence;
}

bool Channel::wait(std::uint64_t fence, std::chrono::nanoseconds timeout) {
    require(client_);
    if (fence > last_submitted())
        throw ClientError("wait: fence " + std::to_string(fence) + " was never submitted");
    const TimePoint deadline = saturating_add(SteadyClock::now(), timeout);
    const Client::Impl::Goal goal{handle_, fence};
    return client_->with_reconnect(
        [&] { return client_->wait_goals(std::span(&goal, 1), deadline, false); });
}

bool Channel::drain(std::chrono::nanoseconds timeout) {
    const std::uint64_t last = last_submitted();
    return last == 0 || wait(last, timeout);
}

std::uint64_t Channel::completed() {
    require(client_);
    ChannelState& c = client_->channel(handle_);
    client_->refresh(c);
    return c.completed;
}

std::uint64_t Channel::last_submitted() const {
    require(client_);
    return client_->channel(handle_).next_fence - 1;
}

std::uint32_t Channel::outstanding() {
    require(client_);
    ChannelState& c = client_->channel(handle_);
    client_->refresh(c);
    return static_cast<std::uint32_t>(c.pending.size());
}

void Channel::free() {
    if (!client_) return;
    auto client = std::move(client_);
    client->free(std::exchange(handle_, 0));
}

std::uint32_t Channel::id() const {
    require(client_);
    return client_->channel(handle_).chan_id;
}

}  // namespace pvgpu
