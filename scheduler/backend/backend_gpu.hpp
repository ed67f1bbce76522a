// A GPU behind the backend ABI (include/pvgpu/backend.h), as the scheduling
// core sees every GPU: a GpuDevice.  open_backend() takes the built-in
// simulated GPU ("sim") or loads a backend library with dlopen; BackendGpu
// owns the backend's GPU handle and the library, and turns the C calls and
// callbacks into GpuDevice's.  docs/backend.md is the contract.
#pragma once

#include <pvgpu/backend.h>

#include <cstdint>
#include <exception>
#include <functional>
#include <memory>
#include <optional>
#include <stdexcept>
#include <string>
#include <string_view>
#include <unordered_map>
#include <vector>

#include "core/gpu_device.hpp"
#include "core/time.hpp"

namespace pvgpu {

// A backend that cannot be loaded or opened: the message names the backend
// and says why (for pvgpud's start-up error).
class BackendError : public std::runtime_error {
public:
    using std::runtime_error::runtime_error;
};

// Watches file descriptors on the scheduling thread's loop, for backends
// whose interrupts arrive on an fd (pvgpu_backend_host.fd_watch).
class FdWatcher {
public:
    virtual ~FdWatcher() = default;
    // `ready` runs on the scheduling thread whenever `fd` is readable.
    // Returns a non-zero id, or 0 when the fd cannot be watched.
    virtual std::uint64_t watch(int fd, std::function<void()> ready) = 0;
    virtual void unwatch(std::uint64_t id) = 0;
};

// What a host offers a backend besides its clock and timers.
struct BackendHooks {
    // A backend's log line (level: PVGPU_BACKEND_LOG_*); default: stderr.
    std::function<void(int level, std::string_view msg)> log;
    // Null: the backend gets no fd_watch (the simulated GPU needs none).
    FdWatcher* fds = nullptr;
};

class BackendGpu;

// Opens a GPU: `backend` is "sim" (the simulated GPU built in) or the path
// of a backend library (it must contain a '/'); `options` are its
// "key=value" strings (for sim: arbitration=round-robin|timeslice,
// timeslice_us, ctxsw_us, preempt_us, watchdog_ms).  The clock and timers
// must outlive the GPU; its callbacks run from `timers`' expiries.  Throws
// BackendError: the library does not load (dlerror's text), has no entry
// symbol, speaks another ABI version, or refuses the options.
std::unique_ptr<BackendGpu> open_backend(const std::string& backend, const std::vector<std::string>& options,
                                         const Clock& clock, Timers& timers, BackendHooks hooks = {});

class BackendGpu final : public GpuDevice {
    struct Key {
        explicit Key() = default;
    };
    struct DlClose {
        void operator()(void* handle) const;
    };

public:
    using Library = std::unique_ptr<void, DlClose>;  // null for the built-in backend
    // Through open_backend() only (it alone makes a Key).
    BackendGpu(Key, Library lib, const pvgpu_backend_ops& ops, std::string path, const Clock& clock,
               Timers& timers, BackendHooks hooks);
    ~BackendGpu() override;
    BackendGpu(const BackendGpu&) = delete;
    BackendGpu& operator=(const BackendGpu&) = delete;

    // The backend's line for the log ("simulated GPU, round-robin, ...").
    std::string description() const;
    // "round-robin", "timeslice", or the backend's own word.
    const std::string& arbitration_name() const { return arbitration_name_; }
    // The table's name ("sim") and what was opened ("sim" or the path).
    const std::string& backend_name() const { return name_; }
    const std::string& backend_path() const { return path_; }

    void set_interrupt_handler(GpuInterrupts* handler) override { irq_ = handler; }
    using GpuDevice::create_channel;
    // Memory left null is allocated here (the ABI always gets host memory).
    ChannelId create_channel(ChannelMemory mem, ChannelStart start) override;
    void destroy_channel(ChannelId ch) override;
    pvgpu_ring* ring(ChannelId ch) override { return channel(ch).ring; }

    void write_ib_put(ChannelId ch, std::uint32_t put) override;
    std::uint32_t read_ib_put(ChannelId ch) const override;
    std::uint32_t read_ib_get(ChannelId ch) const override;
    std::uint32_t read_fence(ChannelId ch) const override;
    std::uint32_t read_status(ChannelId ch) const override;
    bool pending(ChannelId ch) const override;
    std::optional<ChannelId> running_channel() const override;
    std::uint64_t read_ctxsw_trace(std::vector<CtxswRecord>& out) override;
    bool has_ctxsw_trace() const override { return has_trace_; }
    EngineArbitration arbitration() const override { return arbitration_; }
    bool preempt_to(ChannelId next) override;
    void set_watchdog(Duration limit) override;
    Duration busy_time() const override;
    std::uint64_t context_switches() const override;

private:
    friend std::unique_ptr<BackendGpu> open_backend(const std::string&, const std::vector<std::string>&,
                                                    const Clock&, Timers&, BackendHooks);
    struct Host;  // the pvgpu_backend_host callbacks
    struct Channel {
        std::unique_ptr<pvgpu_ctrl_page> own_ctrl;  // when the caller gave none
        std::unique_ptr<pvgpu_ring> own_ring;
        pvgpu_ring* ring = nullptr;
    };
    struct CloseGpu {
        const pvgpu_backend_ops* ops;
        void operator()(pvgpu_backend_gpu* g) const { ops->close(g); }
    };

    void open(const std::vector<std::string>& options);
    const Channel& channel(ChannelId ch) const;
    // Calls into the backend, then rethrows what a host callback threw
    // meanwhile (callbacks never unwind through the backend's C frames).
    template <class F> auto call(F&& f) const;
    void rethrow_pending() const;
    void log(int level, std::string_view msg) const;

    Library lib_;  // first in, last out: the backend's code lives in it
    const pvgpu_backend_ops& ops_;
    std::string name_, path_;
    const Clock& clock_;
    Timers& timers_;
    BackendHooks hooks_;
    std::unique_ptr<pvgpu_backend_host> host_;  // stable address for the backend
    // The backend's timers and fd watches, by the handle it was given.
    std::unordered_map<std::uint64_t, TimerId> timer_ids_;
    std::unordered_map<std::uint64_t, std::uint64_t> watch_ids_;
    std::uint64_t next_handle_ = 1;
    GpuInterrupts* irq_ = nullptr;
    mutable std::exception_ptr pending_;
    std::unordered_map<ChannelId, Channel> channels_;
    EngineArbitration arbitration_;
    std::string arbitration_name_;
    Time trace_last_ = 0;  // the latest context-switch record's time
    bool has_trace_ = false;
    std::unique_ptr<pvgpu_backend_gpu, CloseGpu> gpu_;  // closed before anything above goes
};

}  // namespace pvgpu
