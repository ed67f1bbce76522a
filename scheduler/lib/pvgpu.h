// libpvgpu: the host client library of pvgpud.
//
// A host process connects to the daemon's client socket, allocates channels
// and submits work by writing ring entries into shared memory and ringing a
// doorbell; nothing on the submission path goes through the socket.  The
// socket carries the rest: HELLO, channel allocation, and the MODE messages
// the daemon pushes (the library answers them while the application waits;
// the daemon enforces every mode itself, so a host client only stops ringing
// the doorbell while SHADOWED and rings once when unshadowed).
//
// If the daemon goes away (crash or restart), the library reconnects with a
// bounded backoff, allocates its channels again and resubmits every entry
// that was submitted but not seen completed, so no queued work is lost.
// Fences returned to the application keep increasing across reconnects; an
// entry that was running when the daemon died may run twice (at-least-once).
//
// Threading: a Client and its Channels are used from one thread at a time.
// Errors are reported as pvgpu::ClientError.
//
//     pvgpu::Client client("/run/pvgpu/pvgpud.sock", "render");
//     pvgpu::Channel ch = client.alloc_channel();
//     std::uint64_t f = ch.submit(500'000);   // a 500 us kernel
//     ch.wait(f);
#pragma once

#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>
#include <span>
#include <stdexcept>
#include <string>

namespace pvgpu {

// Every failure the library reports: daemon unreachable, refused, protocol
// violations by the daemon, dead channels, misuse.
class ClientError : public std::runtime_error {
public:
    using std::runtime_error::runtime_error;
};

// Default client socket of pvgpud (docs/protocol.md).
inline constexpr const char* kDefaultSocketPath = "/run/pvgpu/pvgpud.sock";

struct ClientOptions {
    std::string socket_path = kDefaultSocketPath;
    // Task name: the daemon shows this client as host/<name>.  Empty: the
    // daemon names it pid-<pid>.  At most 63 bytes.
    std::string name;

    // Reconnection after the daemon closed the socket.  Attempts start after
    // `reconnect_initial_backoff` and double up to `reconnect_max_backoff`;
    // after `reconnect_timeout` without success the operation in progress
    // throws ClientError.  `reconnect = false` throws at once.
    bool reconnect = true;
    std::chrono::milliseconds reconnect_initial_backoff{20};
    std::chrono::milliseconds reconnect_max_backoff{500};
    std::chrono::milliseconds reconnect_timeout{30'000};

    // How long to wait for the daemon's reply to HELLO, CHAN_ALLOC, CHAN_FREE.
    std::chrono::milliseconds request_timeout{5'000};

    // Completion polling (see Channel::wait).  There is no completion
    // notification in the protocol, so the library sleeps in ppoll() on the
    // daemon socket until the awaited work could have finished (kernel
    // lengths from the head entry on, counted from when the GPU fetched it
    // (IB_GET), plus a learned per-kernel overhead), then re-checks at a
    // fraction of the head kernel's length, backing off; these re-checks are
    // spaced `min_poll` .. `max_poll` apart.
    std::chrono::microseconds min_poll{20};
    std::chrono::microseconds max_poll{2'000};

    // Diagnostics (lost connection, reconnect, notices).  Empty: silent.
    std::function<void(const std::string&)> log;
};

// Counters for reports and tests.
struct ClientStats {
    std::uint64_t reconnects = 0;        // successful reconnections
    std::uint64_t resubmitted = 0;       // entries resubmitted after reconnects
    std::uint64_t mode_messages = 0;     // MODE pushes answered
    std::uint64_t notices = 0;           // NOTICE pushes received
    std::uint64_t polls = 0;             // wake-ups spent checking fences
};

class Channel;

class Client {
public:
    // Connects and says HELLO; throws ClientError if the daemon is not there
    // (no retry here: a daemon that was never reached is a configuration error).
    explicit Client(ClientOptions options);
    Client(const std::string& socket_path, const std::string& name);
    Client(Client&&) noexcept;
    Client& operator=(Client&&) noexcept;
    ~Client();

    // A new channel.  The channel keeps the connection alive: it may outlive
    // this Client object.
    Channel alloc_channel();

    // Handles whatever the daemon sent (MODE, NOTICE, a closed socket) without
    // blocking.  Channel::wait does this too; call it if the application goes
    // a long time without waiting.
    void process_events();

    // Blocks until one of `goals` is reached (true) or `deadline` passes
    // (false).  Also returns false early when a signal interrupts the wait,
    // so a caller can check its flags.  For applications driving several
    // channels from one thread.  With no goals it only answers the daemon
    // until the deadline (a sleep that keeps the session alive).
    struct WaitGoal {
        Channel* channel;
        std::uint64_t fence;
    };
    bool wait_any(std::span<const WaitGoal> goals, std::chrono::steady_clock::time_point deadline);

    std::uint32_t client_id() const;     // changes on reconnect
    std::uint32_t max_channels() const;  // the daemon's per-client limit
    const ClientStats& stats() const;

    struct Impl;

private:
    std::shared_ptr<Impl> impl_;
};

// A channel: a ring of PVGPU_RING_ENTRIES entries on the GPU.  Move-only;
// destroying it frees it on the daemon (outstanding work is dropped).
class Channel {
public:
    Channel() = default;
    Channel(Channel&&) noexcept;
    Channel& operator=(Channel&&) noexcept;
    Channel(const Channel&) = delete;
    Channel& operator=(const Channel&) = delete;
    ~Channel();

    // Queues one kernel of `kernel_ns` (the simulated GPU's run time) and
    // returns its fence.  Fences start at 1 and increase by 1 per entry, also
    // across reconnects.  Blocks while the ring is full.
    std::uint64_t submit(std::uint64_t kernel_ns);
    // Queues several kernels with one doorbell; returns the last one's fence.
    // More than the ring holds is submitted in ring-sized pieces.
    std::uint64_t submit(std::span<const std::uint64_t> kernels_ns);

    // Waits until `fence` has completed; false on timeout.  Answers daemon
    // messages meanwhile.  Throws ClientError if the channel died (watchdog,
    // bad entry) or the daemon stayed away past the reconnect timeout.
    bool wait(std::uint64_t fence,
              std::chrono::nanoseconds timeout = std::chrono::nanoseconds::max());
    // Waits for everything submitted so far.
    bool drain(std::chrono::nanoseconds timeout = std::chrono::nanoseconds::max());

    // The highest completed fence (0 before any), refreshed from the control page.
    std::uint64_t completed();
    // Fence of the last submitted entry (0 before any).
    std::uint64_t last_submitted() const;
    // Entries submitted and not yet seen completed.
    std::uint32_t outstanding();

    // Frees the channel now (also done by the destructor).  Idempotent.
    void free();

    // The daemon's channel id (changes when the channel is re-allocated after
    // a reconnect).
    std::uint32_t id() const;
    explicit operator bool() const { return client_ != nullptr; }

private:
    friend class Client;
    Channel(std::shared_ptr<Client::Impl> client, std::uint64_t handle)
        : client_(std::move(client)), handle_(handle) {}

    std::shared_ptr<Client::Impl> client_;
    std::uint64_t handle_ = 0;
};

}  // namespace pvgpu
