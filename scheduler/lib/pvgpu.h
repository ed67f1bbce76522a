// libpvgpu: the client library of pvgpu, for host processes and for
// applications inside a VM.
//
// Two transports carry the same API (ClientOptions::transport):
//  - socket: a host process talks to pvgpud's client socket (below);
//  - device: an application in a guest opens the pvgpu driver's device node
//    (/dev/pvgpu, include/pvgpu/guest_ioctl.h), maps its channels' pages and
//    submits exactly the same way: ring entries, IB_PUT, a doorbell store.
//    Completion waits sleep in PVGPU_IOC_WAIT (interrupt-driven).
// Auto (the default) uses the device if its node exists, else the socket.
//
// Socket transport: a host process connects to the daemon's client socket,
// allocates channels and submits work by writing ring entries into shared
// memory and ringing a doorbell; nothing on the submission path goes through
// the socket.  The
// socket carries the rest: HELLO, channel allocation, and the MODE messages
// the daemon pushes (the library answers them while the application waits;
// the daemon enforces every mode itself, so a host client only stops ringing
// the doorbell while SHADOWED and rings once when unshadowed).
//
// If the daemon goes away (crash or restart), the library reconnects with a
// bounded backoff, allocates its channels again and resubmits every entry
// that was submitted but not seen completed, so no queued work is lost.  On
// the device transport the same happens when a channel dies with
// PVGPU_CHAN_ERR_LOST (the VM's device lost pvgpud): the library frees it,
// allocates a new one once the device's link is back, and resubmits.
// Fences returned to the application keep increasing across reconnects; an
// entry that was running when the daemon died may run twice (at-least-once).
//
// Threading: a Client and its Channels are used from one thread at a time.
// Errors are reported as pvgpu::ClientError; device errors name the node,
// the ioctl and the errno.
//
//     pvgpu::Client client(pvgpu::ClientOptions{});  // /dev/pvgpu in a VM, else the socket
//     pvgpu::Channel ch = client.alloc_channel();
//     std::uint64_t f = ch.submit(500'000);   // a 500 us kernel
//     ch.wait(f);
#pragma once

#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <span>
#include <stdexcept>
#include <string>
#include <string_view>

namespace pvgpu {

// Every failure the library reports: daemon unreachable, refused, protocol
// violations by the daemon, dead channels, misuse.
class ClientError : public std::runtime_error {
public:
    using std::runtime_error::runtime_error;
};

// The library's version ("0.1.0"), the pvgpu release it was built from.
const char* version() noexcept;

// Default client socket of pvgpud (docs/protocol.md): RUNSTATEDIR/pvgpu/pvgpud.sock
// as this libpvgpu was configured (/run/pvgpu/pvgpud.sock on Debian).
extern const char* const kDefaultSocketPath;

// Default device node of the guest driver (guest_ioctl.h PVGPU_DEVICE_NODE).
inline constexpr const char* kDefaultDevicePath = "/dev/pvgpu";
// Environment variable naming the device node when ClientOptions::device_path is empty.
inline constexpr const char* kDeviceEnv = "PVGPU_DEVICE";
// Environment variable naming a host client's GPU when ClientOptions::gpu is unset.
inline constexpr const char* kGpuEnv = "PVGPU_GPU";
// A host has at most this many GPUs, numbered from 0 (protocol.h PVGPU_MAX_GPUS).
inline constexpr std::uint32_t kMaxGpus = 16;

enum class Transport {
    Auto,    // the device if its node exists (a guest), else the socket
    Socket,  // pvgpud's client socket (a host process)
    Device,  // the guest driver's device node (an application in a VM)
};

// "auto", "socket", "device".
const char* transport_name(Transport t);

// A GPU index as $PVGPU_GPU and `pvgpu-load --gpu` take it: a decimal
// integer in 0..kMaxGpus-1, nothing else (no sign, no blanks).  Throws
// ClientError naming `what` (the variable or option) and the text.
std::uint32_t parse_gpu(std::string_view text, std::string_view what = kGpuEnv);

struct ClientOptions {
    Transport transport = Transport::Auto;

    std::string socket_path = kDefaultSocketPath;
    // Task name: the daemon shows this client as host/<name>.  Empty: the
    // daemon names it pid-<pid>.  At most 63 bytes.  Socket transport only:
    // in a guest the driver names the task after the process (comm).
    std::string name;

    // Device node.  Empty: $PVGPU_DEVICE if set, else /dev/pvgpu.
    std::string device_path;
    // Device transport: this process's weight among the tasks of its VM
    // (1..10000, like nice; the VM's own share is the host admin's).  Applied
    // with PVGPU_IOC_SET_WEIGHT when the client opens the device (or, if its
    // link is down then, at the first session; the driver re-sends it after a
    // reconnect).  0: leave it as it is
    // (default 100).  On the socket transport a non-zero weight is an error:
    // the protocol gives host tasks no say in their own weight (the admin sets
    // it with `pvgpuctl set-weight host/NAME W`).
    std::uint32_t weight = 0;

    // Socket transport: the host's GPU this client runs on, 0..kMaxGpus-1.
    // Unset: $PVGPU_GPU if it is set and not empty (parsed by parse_gpu), else
    // none, and pvgpud places the client (its `placement` setting).  Read
    // once, when the Client is constructed; an index of 16 or more, or a
    // $PVGPU_GPU that is not one, is a ClientError there.  pvgpud refuses a
    // GPU the host lacks at HELLO, and the ClientError carries its reason
    // ("pvgpud refused HELLO: no GPU 5 on this host (2 GPUs)"); a pvgpud
    // older than protocol version 4 cannot place clients and refuses them
    // too.  Device transport: the GPU is the VM's pvgpu device's
    // (the host admin's QEMU property gpu=N), so setting this is a
    // ClientError there, and $PVGPU_GPU is ignored.
    std::optional<std::uint32_t> gpu;

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

    // Completion waits (see Channel::wait), socket transport.  With a
    // pvgpud of protocol version 3 every channel has a completion notifier
    // that pvgpud writes when the fence being waited for completes: the
    // library sleeps in ppoll() on it and the daemon socket, waking once per
    // awaited fence, and the bounds below are not used.  With an older
    // pvgpud the library sleeps in ppoll() on the
    // daemon socket until the awaited work could have finished (kernel
    // lengths from the head entry on, counted from when the GPU fetched it
    // (IB_GET), plus a learned per-kernel overhead), then re-checks at a
    // fraction of the head kernel's length, backing off; these re-checks are
    // spaced `min_poll` .. `max_poll` apart.  The device transport sleeps
    // in PVGPU_IOC_WAIT instead, or PVGPU_IOC_WAIT_ANY for several channels
    // at once (with a guest driver that lacks it: on the one expected to
    // finish first, until the next one is expected).
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
    std::uint64_t polls = 0;             // wake-ups spent checking fences (sleeps while waiting)
};

// What Client::info() reports about the transport in use.
struct TransportInfo {
    Transport transport = Transport::Socket;  // never Auto
    std::string path;                          // socket path or device node

    // Socket: what pvgpud said in HELLO_REPLY.
    std::uint32_t protocol_version = 0;
    std::uint32_t client_id = 0;
    std::uint32_t max_channels = 0;
    // The GPU this client asked for in HELLO (ClientOptions::gpu or
    // $PVGPU_GPU); nullopt: none, pvgpud placed it.
    std::optional<std::uint32_t> gpu;

    // Device: PVGPU_IOC_INFO, read when info() is called.
    std::uint32_t abi_version = 0;
    std::uint32_t device_version = 0;
    std::uint32_t num_slots = 0;
    std::uint32_t slots_used = 0;   // by every process of the VM
    std::uint32_t link = 0;         // PVGPU_LINK_*
    std::uint32_t link_gen = 0;
    std::uint32_t irq_mode = 0;     // PVGPU_IRQ_*
    bool pid_hints = false;
    std::uint32_t channels = 0;     // held by this client
    std::uint64_t pid_hint = 0;     // this process's hint (0: none)
    std::uint32_t weight = 0;       // this process's weight inside its VM
};

class Channel;

namespace detail {
struct ClientAccess;
}

class Client {
public:
    // Socket: connects and says HELLO; throws ClientError if the daemon is
    // not there (no retry here: a daemon that was never reached is a
    // configuration error).  Device: opens the node, checks its ABI version
    // and applies `weight`; a device whose link to pvgpud is down is not an
    // error here (allocations wait for it up to reconnect_timeout).
    explicit Client(ClientOptions options);
    // The socket transport on `socket_path`.
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

    std::uint32_t client_id() const;     // changes on reconnect; device: 0
    std::uint32_t max_channels() const;  // the daemon's per-client limit; device: its slots
    const ClientStats& stats() const;

    Transport transport() const;         // Socket or Device, never Auto
    // The transport's state; on the device a fresh PVGPU_IOC_INFO.
    TransportInfo info();

    struct Impl;

private:
    friend struct detail::ClientAccess;  // tests: a client on a fake device
    explicit Client(std::shared_ptr<Impl> impl) : impl_(std::move(impl)) {}
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
    // a reconnect; on the device, as the driver reported it).
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
