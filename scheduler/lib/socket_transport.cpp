// libpvgpu's socket transport: a host process and pvgpud's client socket
// (docs/protocol.md).  Submission goes through shared memory and an eventfd
// doorbell; the socket carries HELLO, allocation and the MODE/NOTICE pushes,
// which are answered whenever the library waits.
#include "socket_transport.hpp"

#include <fcntl.h>
#include <poll.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <unistd.h>

#include <pvgpu/protocol.h>

#include <algorithm>
#include <array>
#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <optional>
#include <vector>

#include "proto/wire.hpp"

namespace pvgpu::detail {
namespace {

using std::chrono::nanoseconds;

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

timespec to_timespec(nanoseconds d) {
    timespec ts{};
    ts.tv_sec = static_cast<time_t>(d.count() / 1'000'000'000);
    ts.tv_nsec = static_cast<long>(d.count() % 1'000'000'000);
    return ts;
}

class SocketTransport final : public TransportBackend {
public:
    SocketTransport(const ClientOptions& options, ClientStats& stats, LinkLookup lookup)
        : options_(options), stats_(stats), lookup_(std::move(lookup)) {
        if (options_.socket_path.empty()) throw ClientError("empty daemon socket path");
        if (options_.socket_path.size() >= sizeof(sockaddr_un{}.sun_path))
            throw ClientError("socket path too long: " + options_.socket_path);
        if (options_.weight != 0)
            throw ClientError("a task weight (" + std::to_string(options_.weight) +
                              ") applies only inside a VM (device transport); a host task's weight "
                              "is set by the admin: pvgpuctl set-weight host/USER/NAME W");
        if (options_.gpu) {
            if (*options_.gpu >= kMaxGpus)
                throw ClientError("GPU " + std::to_string(*options_.gpu) + " is out of range 0.." +
                                  std::to_string(kMaxGpus - 1));
            gpu_ = options_.gpu;
        } else if (const char* env = std::getenv(kGpuEnv); env && *env) {
            gpu_ = parse_gpu(env, kGpuEnv);
        }
    }

    pvgpu::Transport kind() const override { return pvgpu::Transport::Socket; }
    std::string describe() const override { return "pvgpud at " + options_.socket_path; }

    // Connection failures are LinkLost (a caller may retry); a refusal by the
    // daemon is a ClientError.
    void connect() override {
        UniqueFd fd(::socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0));
        if (!fd) throw ClientError("socket: " + errno_text(errno));
        sockaddr_un addr{};
        addr.sun_family = AF_UNIX;
        std::memcpy(addr.sun_path, options_.socket_path.data(), options_.socket_path.size());
        int rc;
        do {
            rc = ::connect(fd.get(), reinterpret_cast<const sockaddr*>(&addr), sizeof addr);
        } while (rc < 0 && errno == EINTR);
        if (rc < 0)
            throw LinkLost{"cannot connect to " + options_.socket_path + ": " + errno_text(errno)};
        // Non-blocking from here: wire I/O never blocks, we wait with ppoll.
        const int flags = ::fcntl(fd.get(), F_GETFL);
        if (flags < 0 || ::fcntl(fd.get(), F_SETFL, flags | O_NONBLOCK) < 0)
            throw ClientError("fcntl: " + errno_text(errno));
        sock_ = std::move(fd);
        reader_ = wire::Reader{};
        daemon_error_.clear();
        daemon_message_.clear();
        reply_.reset();
        awaited_seq_ = 0;

        pvgpu_hello hello{};
        hello.version = PVGPU_PROTO_VERSION;
        hello.role = PVGPU_ROLE_HOST;
        wire::set_name(hello.name, sizeof hello.name, options_.name);
        hello.pid = static_cast<std::uint32_t>(::getpid());
        hello.gpu = gpu_ ? PVGPU_GPU_INDEX(*gpu_) : PVGPU_GPU_ANY;
        wire::Message m;
        try {
            m = request(PVGPU_MSG_HELLO, hello);
        } catch (const LinkLost& e) {
            // An ERROR (with seq 0) and the close: the daemon's reason is the
            // refusal, not a lost link to retry.
            if (!e.refused || daemon_message_.empty()) throw;
            throw ClientError(hello_refused(PVGPU_E_INVALID));
        }
        if (m.hdr.type != PVGPU_MSG_HELLO_REPLY)
            throw ClientError("pvgpud answered HELLO with " + std::string(wire::type_name(m.hdr.type)));
        const auto r = m.as<pvgpu_hello_reply>();
        if (r.status != PVGPU_OK) throw ClientError(hello_refused(r.status));
        if (gpu_ && r.version < PVGPU_PROTO_VERSION_GPU)
            throw ClientError("pvgpud at " + options_.socket_path + " speaks protocol version " +
                              std::to_string(r.version) + ", which cannot place a client on a GPU (version " +
                              std::to_string(PVGPU_PROTO_VERSION_GPU) + " can); name none to let it choose");
        hello_ = r;
        connected_ = true;
    }

    void disconnect() override {
        sock_.reset();
        reader_ = wire::Reader{};
        connected_ = false;
    }

    ChannelLink allocate() override {
        pvgpu_chan_alloc body{};
        wire::Message m = request(PVGPU_MSG_CHAN_ALLOC, body);
        if (m.hdr.type != PVGPU_MSG_CHAN_REPLY)
            throw ClientError("pvgpud answered CHAN_ALLOC with " + std::string(wire::type_name(m.hdr.type)));
        const auto r = m.as<pvgpu_chan_reply>();
        if (r.status != PVGPU_OK) {
            std::string why = status_text(r.status);
            if (r.status == PVGPU_E_LIMIT) why += " (limit " + std::to_string(hello_.max_channels) + ")";
            throw ClientError("pvgpud refused CHAN_ALLOC: " + why);
        }
        // Version 3 adds the completion notifier; an older daemon sends two.
        const std::size_t fds = notifier_session() ? 3 : 2;
        if (m.fds.size() != fds || r.mem_size < PVGPU_CHAN_MEM_SIZE)
            throw ClientError("pvgpud sent a malformed CHAN_REPLY (" + std::to_string(m.fds.size()) +
                              " fds in a version " + std::to_string(hello_.version) + " session, expected " +
                              std::to_string(fds) + ")");
        check_channel_memory(m.fds[0].get());
        ChannelLink link;
        // What libpvgpu uses of it (a newer daemon may send more); the
        // mapping outlives the memfd.
        link.mem = Mapping(m.fds[0].get(), PVGPU_CHAN_MEM_SIZE);
        link.doorbell_fd = std::move(m.fds[1]);
        if (fds == 3) link.completion_fd = std::move(m.fds[2]);
        link.chan_id = r.chan_id;
        link.ctrl = reinterpret_cast<pvgpu_ctrl_page*>(link.mem.data());
        link.ring = reinterpret_cast<pvgpu_ring*>(link.mem.data() + PVGPU_CHAN_RING_OFFSET);
        link.mode = r.mode;
        return link;
    }

    // The channel memory must stay as large as it is while mapped: a file
    // that can shrink lets whoever else holds it truncate it under the
    // client, and a store past its end kills the client with SIGBUS.
    // pvgpud's memfds are sealed against shrinking (F_SEAL_SHRINK) and
    // sized for the channel; anything else is refused, as QEMU refuses it.
    void check_channel_memory(int memfd) const {
        struct stat st {};
        if (::fstat(memfd, &st) != 0)
            throw ClientError("cannot inspect the channel memory pvgpud sent: " + errno_text(errno));
        if (!S_ISREG(st.st_mode))
            throw ClientError("pvgpud at " + options_.socket_path +
                              " sent channel memory that is not a memory file; channel refused");
        const int seals = ::fcntl(memfd, F_GET_SEALS);
        if (seals < 0 || !(seals & F_SEAL_SHRINK))
            throw ClientError("pvgpud at " + options_.socket_path +
                              " sent channel memory that is not sealed against shrinking (F_SEAL_SHRINK); "
                              "channel refused");
        if (st.st_size < static_cast<off_t>(PVGPU_CHAN_MEM_SIZE))
            throw ClientError("pvgpud at " + options_.socket_path + " sent channel memory of " +
                              std::to_string(st.st_size) + " bytes, smaller than a channel's " +
                              std::to_string(PVGPU_CHAN_MEM_SIZE) + "; channel refused");
    }

    void release(ChannelLink& link, bool session_alive) override {
        const std::uint32_t chan_id = link.chan_id;
        const bool was_attached = link.attached();
        link = ChannelLink{};
        if (!session_alive || !connected_ || !was_attached) return;  // dropped with the connection
        try {
            pvgpu_chan_ref ref{};
            ref.chan_id = chan_id;
            const wire::Message m = request(PVGPU_MSG_CHAN_FREE, ref);
            const auto r = m.as<pvgpu_status_reply>();
            if (m.hdr.type != PVGPU_MSG_FREE_REPLY || r.status != PVGPU_OK)
                throw ClientError("pvgpud refused CHAN_FREE of channel " + std::to_string(chan_id) + ": " +
                                  status_text(r.status));
        } catch (const LinkLost&) {
            connected_ = false;
            throw;
        }
    }

    void ring_doorbell(ChannelLink& link) override {
        // Shadowed: the daemon holds this channel's work back whatever we do,
        // so do not ring (no syscall, no daemon wake-up per submit).  IB_PUT
        // is still published: pvgpud reads it to see the held backlog, and
        // hfq needs that to keep the channel in its run queue (keeping IB_PUT
        // private, as docs/protocol.md 2.5 says, measured 0.82/0.18 instead
        // of 0.54/0.46 for 2000 us vs 200 us kernels).
        if (link.mode == PVGPU_MODE_SHADOWED) return;
        kick(link);
    }

    void service() override {
        // Answer anything the daemon pushed, at most once a millisecond: a
        // mode switch may wait for its ack far longer, and a syscall per
        // submission would double the cost of submitting.
        if (const TimePoint t = SteadyClock::now(); t - last_pump_ >= std::chrono::milliseconds(1)) pump(t);
    }

    // With a version-3 daemon every channel has a completion notifier;
    // with an older one we look at FENCE when the work could be done.
    CompletionWake completion_wake() const override {
        return connected_ && notifier_session() ? CompletionWake::Any : CompletionWake::None;
    }

    void arm_wake(ChannelLink& link, std::uint32_t dev_fence) override {
        if (!link.completion_fd || !link.attached()) return;
        // Dekker with pvgpud's on_fence: our request is visible before we
        // look at FENCE, its FENCE store before it looks at our request.
        __atomic_store_n(&link.ctrl->notify_fence, dev_fence, __ATOMIC_SEQ_CST);
        __atomic_thread_fence(__ATOMIC_SEQ_CST);
        // What the notifier holds announced completions the look at FENCE
        // that follows will see: drop it, or the next sleep would not sleep.
        std::array<char, 256> buf;
        ssize_t n;
        do {
            n = ::read(link.completion_fd.get(), buf.data(), buf.size());
        } while (n == static_cast<ssize_t>(buf.size()) || (n < 0 && errno == EINTR));
    }

    SleepResult sleep(std::span<const WaitTarget> targets, TimePoint wake) override {
        return pump(wake, targets) ? SleepResult::Woke : SleepResult::Interrupted;
    }

    TransportInfo info() override {
        TransportInfo i;
        i.transport = pvgpu::Transport::Socket;
        i.path = options_.socket_path;
        i.protocol_version = hello_.version;
        i.client_id = hello_.client_id;
        i.max_channels = hello_.max_channels;
        i.gpu = gpu_;
        return i;
    }
    std::uint32_t client_id() const override { return hello_.client_id; }
    std::uint32_t max_channels() const override { return hello_.max_channels; }

private:
    void log(const std::string& line) const {
        if (options_.log) options_.log(line);
    }

    // Why HELLO was refused: the daemon's ERROR message when it sent one
    // (pvgpud says why before its HELLO_REPLY), else the reply's status.
    std::string hello_refused(std::uint32_t status) const {
        if (daemon_message_.empty()) return "pvgpud refused HELLO: " + std::string(status_text(status));
        std::string why = "pvgpud refused HELLO: " + daemon_message_;
        // A pvgpud before protocol version 4 takes a named GPU for a
        // protocol error (the field was reserved, and zero).
        if (gpu_ && daemon_message_.find("reserved field is not zero") != std::string::npos)
            why += "; this pvgpud predates protocol version " + std::to_string(PVGPU_PROTO_VERSION_GPU) +
                   " and cannot place a client on a GPU (name none to let it choose)";
        return why;
    }

    static void kick(ChannelLink& link) {
        const std::uint64_t one = 1;
        ssize_t n;
        do {
            n = ::write(link.doorbell_fd.get(), &one, sizeof one);
        } while (n < 0 && errno == EINTR);
        if (n != static_cast<ssize_t>(sizeof one)) throw ClientError("doorbell write failed: " + errno_text(errno));
    }

    void send(std::vector<std::byte> bytes) {
        std::size_t off = 0;
        const TimePoint deadline = SteadyClock::now() + options_.request_timeout;
        while (off < bytes.size()) {
            std::size_t n;
            try {
                n = wire::send_some(sock_.get(), std::span(bytes).subspan(off), {});
            } catch (const std::system_error& e) {
                throw LinkLost{e.code().message()};
            }
            off += n;
            if (off == bytes.size()) break;
            // The socket buffer is full.  Keep reading while we wait so a
            // daemon that is itself blocked writing to us can make progress.
            pollfd p{sock_.get(), POLLOUT | POLLIN, 0};
            const auto left = deadline - SteadyClock::now();
            if (left <= nanoseconds::zero()) throw ClientError("pvgpud does not read its socket (send timed out)");
            const timespec ts = to_timespec(left);
            if (::ppoll(&p, 1, &ts, nullptr) < 0 && errno != EINTR) throw ClientError("ppoll: " + errno_text(errno));
            if (p.revents & (POLLIN | POLLHUP | POLLERR)) receive_into_reader();
        }
    }

    void receive_into_reader() {
        bool open;
        try {
            open = wire::receive(sock_.get(), reader_);
        } catch (const std::system_error& e) {
            throw LinkLost{e.code().message()};
        }
        if (!open) {
            if (!daemon_error_.empty()) throw LinkLost{daemon_error_, true};
            throw LinkLost{"daemon closed the connection"};
        }
    }

    // Sends a request and waits for the reply with the same seq, handling
    // pushes meanwhile.  An ERROR reply becomes a ClientError.
    template <class Body> wire::Message request(std::uint16_t type, const Body& body) {
        std::uint32_t seq = next_seq_++;
        if (seq == 0) seq = next_seq_++;  // 0 is for pushes
        awaited_seq_ = seq;
        reply_.reset();
        send(wire::encode(type, seq, body));
        const TimePoint deadline = SteadyClock::now() + options_.request_timeout;
        while (!reply_) {
            if (SteadyClock::now() >= deadline)
                throw ClientError("pvgpud did not answer " + std::string(wire::type_name(type)) + " within " +
                                  std::to_string(options_.request_timeout.count()) + " ms");
            pump(deadline);
        }
        awaited_seq_ = 0;
        wire::Message m = std::move(*reply_);
        reply_.reset();
        if (m.hdr.type == PVGPU_MSG_ERROR) {
            const auto e = m.as<pvgpu_error>();
            if (type == PVGPU_MSG_HELLO) {
                daemon_message_ = wire::name_of(e.message, sizeof e.message);
                throw ClientError(hello_refused(e.status));
            }
            throw ClientError("pvgpud rejected " + std::string(wire::type_name(type)) + ": " +
                              wire::name_of(e.message, sizeof e.message) + " (" + status_text(e.status) + ")");
        }
        return m;
    }

    // Waits for socket input until `deadline` or, when `targets` have
    // completion notifiers, until one of them is written, and handles every
    // complete message.  Returns false if a signal interrupted the wait.
    bool pump(TimePoint deadline, std::span<const WaitTarget> targets = {}) {
        last_pump_ = SteadyClock::now();
        // Messages already buffered may change what the caller waits for.
        if (dispatch_buffered() > 0) return true;
        polls_.clear();
        polls_.push_back(pollfd{sock_.get(), POLLIN, 0});
        for (const WaitTarget& t : targets)
            if (t.link->completion_fd) polls_.push_back(pollfd{t.link->completion_fd.get(), POLLIN, 0});
        timespec ts{};
        const timespec* timeout = nullptr;
        if (deadline != TimePoint::max()) {
            ts = to_timespec(std::max(nanoseconds::zero(), deadline - SteadyClock::now()));
            timeout = &ts;
        }
        const int rc = ::ppoll(polls_.data(), polls_.size(), timeout, nullptr);
        if (rc < 0) {
            if (errno == EINTR) return false;
            throw ClientError("ppoll: " + errno_text(errno));
        }
        // A notifier is read by the next arm_wake(), before FENCE is.
        if (polls_[0].revents != 0) {
            receive_into_reader();
            dispatch_buffered();
        }
        return true;
    }

    bool notifier_session() const { return hello_.version >= PVGPU_PROTO_VERSION_COMPLETION; }

    // Handles complete buffered messages; returns how many.
    std::size_t dispatch_buffered() {
        std::size_t handled = 0;
        // Stop once a reply is in: pushes behind it may name the channel the
        // reply creates, which the caller registers only after it returns.
        while (!reply_) {
            auto next = reader_.next();
            if (std::holds_alternative<std::monostate>(next)) break;
            if (auto* err = std::get_if<wire::DecodeError>(&next))
                throw LinkLost{"protocol error from pvgpud: " + err->reason, true};
            handle(std::move(std::get<wire::Message>(next)));
            ++handled;
        }
        return handled;
    }

    void handle(wire::Message m) {
        switch (m.hdr.type) {
        case PVGPU_MSG_MODE: {
            const auto mode = m.as<pvgpu_mode>();
            ++stats_.mode_messages;
            ChannelLink* link = lookup_(mode.chan_id);
            if (!link) return;  // a channel we freed; the daemon forgets it too
            // Leaving SHADOWED (to TRAPPED, or DIRECT from a buggy daemon):
            // ring for what was held back, then ack with that IB_PUT.  A host
            // client has no mapping to switch; DIRECT and TRAPPED are the same
            // here (every submit rings).
            const bool unshadow = link->mode == PVGPU_MODE_SHADOWED && mode.mode != PVGPU_MODE_SHADOWED;
            link->mode = mode.mode;
            link->mode_seq = mode.mode_seq;
            if (unshadow) kick(*link);
            pvgpu_mode_ack ack{};
            ack.chan_id = mode.chan_id;
            ack.mode = mode.mode;
            ack.mode_seq = mode.mode_seq;
            ack.guest_put = link->put;
            send(wire::encode(PVGPU_MSG_MODE_ACK, 0, ack));
            return;
        }
        case PVGPU_MSG_NOTICE: {
            const auto n = m.as<pvgpu_notice>();
            ++stats_.notices;
            if (n.kind == PVGPU_NOTICE_DEGRADED) {
                log("pvgpud: channel " + std::to_string(n.chan_id) + " ignored a mode switch; enforced host-side");
                return;
            }
            ChannelLink* link = lookup_(n.chan_id);
            if (link && link->error == PVGPU_CHAN_ERR_NONE)
                link->error = n.kind == PVGPU_NOTICE_WATCHDOG ? PVGPU_CHAN_ERR_WATCHDOG : PVGPU_CHAN_ERR_BAD_ENTRY;
            return;
        }
        case PVGPU_MSG_ERROR:
            if (m.hdr.seq != 0 && m.hdr.seq == awaited_seq_) {
                reply_ = std::move(m);
            } else {
                const auto e = m.as<pvgpu_error>();
                // The daemon closes right after this: the reason for the loss.
                daemon_message_ = wire::name_of(e.message, sizeof e.message);
                daemon_error_ = "pvgpud error: " + daemon_message_ + " (" + status_text(e.status) + ")";
            }
            return;
        case PVGPU_MSG_HELLO_REPLY:
        case PVGPU_MSG_CHAN_REPLY:
        case PVGPU_MSG_FREE_REPLY:
        case PVGPU_MSG_PONG:
            if (m.hdr.seq == awaited_seq_ && awaited_seq_ != 0) reply_ = std::move(m);
            return;  // a stale reply to a request we gave up on
        default:
            throw LinkLost{"pvgpud sent an unexpected " + std::string(wire::type_name(m.hdr.type)), true};
        }
    }

    const ClientOptions& options_;
    ClientStats& stats_;
    LinkLookup lookup_;
    UniqueFd sock_;
    wire::Reader reader_;
    bool connected_ = false;
    std::string daemon_error_;          // ERROR pushed on this connection, if any
    std::string daemon_message_;        // its message
    std::optional<std::uint32_t> gpu_;  // the GPU HELLO names (ClientOptions::gpu, $PVGPU_GPU)
    pvgpu_hello_reply hello_{};
    std::uint32_t next_seq_ = 1;
    std::uint32_t awaited_seq_ = 0;     // request whose reply we are waiting for
    std::optional<wire::Message> reply_;
    TimePoint last_pump_{};
    std::vector<pollfd> polls_;         // pump()'s, kept to spare an allocation per wait
};

}  // namespace

std::unique_ptr<TransportBackend> make_socket_transport(const ClientOptions& options, ClientStats& stats,
                                                 LinkLookup lookup) {
    return std::make_unique<SocketTransport>(options, stats, std::move(lookup));
}

}  // namespace pvgpu::detail
