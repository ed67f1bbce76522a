// libpvgpu internals: what the shared client logic (client.cpp) needs from a
// transport, and what a transport hands back for one channel.
//
// The shared logic owns everything that is the same on every transport: the
// application's 64-bit fences, the entries not yet seen complete (kept for
// resubmission), writing ring entries and IB_PUT, reading FENCE/STATUS,
// recovering a lost link (re-allocate with backoff, resubmit).  A transport
// only establishes the session, allocates/frees channel memory, rings
// doorbells and sleeps until something may have changed.
#pragma once

#include <sys/mman.h>

#include <pvgpu/abi.h>

#include <cerrno>
#include <chrono>
#include <cstdint>
#include <functional>
#include <span>
#include <string>
#include <system_error>
#include <utility>

#include "proto/unique_fd.hpp"
#include "pvgpu.h"

namespace pvgpu::detail {

using SteadyClock = std::chrono::steady_clock;
using TimePoint = SteadyClock::time_point;

inline std::string errno_text(int err) { return std::error_code(err, std::system_category()).message(); }

// The link to the scheduler is gone (daemon closed the socket, the device
// lost pvgpud, a channel reported PVGPU_CHAN_ERR_LOST); recoverable by
// re-establishing the session.  Deliberately not a std::exception: it never
// leaves the library.
struct LinkLost {
    std::string reason;
    // The other side said why it ended the session (it found fault with us):
    // retrying would only repeat it.
    bool refused = false;
};

// Control page registers are shared with the GPU: acquire/release pairs order
// the ring entry writes before IB_PUT and the GPU's FENCE after its work.
inline std::uint32_t load_acquire(const volatile std::uint32_t& reg) {
    return __atomic_load_n(&reg, __ATOMIC_ACQUIRE);
}
inline void store_release(volatile std::uint32_t& reg, std::uint32_t value) {
    __atomic_store_n(&reg, value, __ATOMIC_RELEASE);
}

// RAII shared mapping of `size` bytes of `fd` at `offset`.
class Mapping {
public:
    Mapping() = default;
    Mapping(int fd, std::size_t size, std::uint64_t offset = 0) : size_(size) {
        void* p = ::mmap(nullptr, size, PROT_READ | PROT_WRITE, MAP_SHARED, fd, static_cast<off_t>(offset));
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
    std::size_t size() const { return size_; }

private:
    void* addr_ = nullptr;
    std::size_t size_ = 0;
};

// One allocated channel as the transport made it: its memory and doorbell,
// and the counters of this particular channel (a re-allocated channel starts
// afresh).  A few fields belong to one transport only; they are marked.
struct ChannelLink {
    std::uint32_t chan_id = 0;          // the daemon's channel id (logs)
    pvgpu_ctrl_page* ctrl = nullptr;    // null: not attached
    pvgpu_ring* ring = nullptr;
    Mapping mem;
    std::uint32_t put = 0;              // entries written into this ring
    std::uint32_t next_dev_fence = 1;   // device-side fence of the next entry
    // The GPU killed the channel (socket: NOTICE; device: a DEAD wait), as
    // PVGPU_CHAN_ERR_*; the control page says the same, this only saves a look.
    std::uint32_t error = PVGPU_CHAN_ERR_NONE;

    // Socket transport: doorbell eventfd and the mode pvgpud put us in, and
    // (protocol version 3) the completion notifier pvgpud writes.
    UniqueFd doorbell_fd;
    UniqueFd completion_fd;
    std::uint32_t mode = 0;             // PVGPU_MODE_*
    std::uint32_t mode_seq = 0;
    // Device transport: the driver's handle and the doorbell register.
    std::uint32_t handle = 0;
    volatile std::uint32_t* doorbell_reg = nullptr;
    // The highest fence a WAIT reported reached.  The driver reads it from
    // the device's wait registers (the real channel), while a shadowed
    // control page shows a copy refreshed only every millisecond: without
    // this, a wait that ended would find FENCE behind and wait again at once.
    std::uint32_t reached = 0;
    bool reached_valid = false;

    bool attached() const { return ctrl != nullptr; }
};

// A channel's fence to wait for (device-side value).
struct WaitTarget {
    ChannelLink* link;
    std::uint32_t dev_fence;
};

enum class SleepResult {
    Woke,         // the deadline passed or something arrived: look again
    Interrupted,  // a signal
};

class TransportBackend {
public:
    virtual ~TransportBackend() = default;

    virtual pvgpu::Transport kind() const = 0;
    // For messages: "pvgpud at /run/pvgpu/pvgpud.sock", "device /dev/pvgpu".
    virtual std::string describe() const = 0;

    // Establishes a session (socket: connect + HELLO; device: link READY,
    // weight applied).  LinkLost: try again later; ClientError: give up.
    virtual void connect() = 0;
    // Ends the session; channels were released before.
    virtual void disconnect() = 0;

    // A new channel, attached.  LinkLost or ClientError as connect().
    virtual ChannelLink allocate() = 0;
    // Gives the channel back and detaches it.  `session_alive`: the other
    // side still knows it (else only the local resources go).  LinkLost: the
    // channel is gone all the same, the session too.
    virtual void release(ChannelLink& link, bool session_alive) = 0;

    // IB_PUT was stored: tell the GPU (unless the mode says it is pointless).
    virtual void ring_doorbell(ChannelLink& link) = 0;

    // Handles control traffic without blocking; cheap enough to call per submit.
    virtual void service() = 0;
    // How sleep() learns of completions now (it may change with a
    // reconnect to another daemon, or once after a sleep that found the
    // device's driver older than it thought; ask again after every sleep):
    enum class CompletionWake {
        None,   // it does not: sleep until the work could be done, look again
        First,  // when the first target's fence is reached (device without PVGPU_IOC_WAIT_ANY)
        Any,    // when any target's fence is reached (socket, version 3; device)
    };
    virtual CompletionWake completion_wake() const = 0;
    // Before a look at the channel's FENCE for `dev_fence`: asks to be woken
    // when it is reached and consumes wake-ups already delivered, so the look
    // that follows sees everything they announced (CompletionWake::Any).
    virtual void arm_wake(ChannelLink& /*link*/, std::uint32_t /*dev_fence*/) {}
    // Sleeps until `wake`, a signal, or (as completion_wake says) until a
    // target's fence is reached or its channel dies (then `link->error` may
    // be set; a lost link throws LinkLost).  Handles control traffic
    // meanwhile.  `targets` are ordered by expected completion.
    virtual SleepResult sleep(std::span<const WaitTarget> targets, TimePoint wake) = 0;

    virtual TransportInfo info() = 0;
    virtual std::uint32_t client_id() const = 0;
    virtual std::uint32_t max_channels() const = 0;
};

}  // namespace pvgpu::detail
