// The GPU as a host sees it: channels with a control page and a ring, fences,
// interrupts, an engine status register and a watchdog.  Nothing here tells
// how long a piece of work takes; a scheduler learns that only by watching.
#pragma once

#include <pvgpu/abi.h>

#include <cstdint>
#include <optional>
#include <vector>

#include "time.hpp"

namespace pvgpu {

using ChannelId = std::uint32_t;

// Memory the host hands the GPU for a channel (like USERD and the GPFIFO on
// real hardware): the control page the submitter sees and the ring.  Null
// members ask the device to allocate its own.  The GPU writes IB_GET, FENCE,
// STATUS and ERROR into `ctrl`; `ctrl->ib_put` belongs to the submitter, the
// GPU keeps its own IB_PUT register and learns new values from doorbells.
// `ctrl` is tenant-writable memory: what the GPU writes there is a copy for
// the submitter; the host reads the GPU's own registers below, never the page.
struct ChannelMemory {
    pvgpu_ctrl_page* ctrl = nullptr;
    pvgpu_ring* ring = nullptr;
};

// Where a new channel's positions start: IB_GET = IB_PUT = `get` (nothing
// queued) and FENCE = `fence`.  Zero for a fresh channel; a channel drained
// on one GPU and re-created on another (../shared/DESIGN.md section 10)
// carries on from where it stopped, so its submitter sees no jump.
struct ChannelStart {
    std::uint32_t get = 0;
    std::uint32_t fence = 0;
};

// How the engine shares itself between channels, as the host programmed it:
// a non-preemptive engine runs each kernel to completion; a preemptive one
// switches channels at the end of every `timeslice` while others wait,
// losing `ctxsw` per switch.  A preemptive engine also lets the host preempt
// it (GpuDevice::preempt_to), losing `preempt` per preemption: a figure of
// the hardware, like the slice the host programmed.
struct EngineArbitration {
    bool preemptive = false;
    Duration timeslice = 0;
    Duration ctxsw = 0;
    Duration preempt = 0;
};

// One record of the context-switch trace: at `at` the engine loaded `to`
// (0: it went idle).
struct CtxswRecord {
    Time at = 0;
    ChannelId to = 0;
    friend bool operator==(const CtxswRecord&, const CtxswRecord&) = default;
};

// Interrupts delivered by the device.  Called on the scheduler's thread.
class GpuInterrupts {
public:
    virtual ~GpuInterrupts() = default;
    // An entry flagged PVGPU_ENTRY_IRQ completed; FENCE now holds `fence`.
    virtual void on_fence(ChannelId ch, std::uint32_t fence) = 0;
    // The channel was stopped (watchdog, bad entry); its pending work is dropped.
    virtual void on_channel_error(ChannelId ch, std::uint32_t error) = 0;
};

class GpuDevice {
public:
    virtual ~GpuDevice() = default;

    virtual void set_interrupt_handler(GpuInterrupts* handler) = 0;

    // Channels.  The control page and ring stay valid until destroy_channel();
    // host-provided memory must outlive the channel.  The GPU's registers
    // and the control page's copies start at `start`.
    virtual ChannelId create_channel(ChannelMemory mem, ChannelStart start) = 0;
    ChannelId create_channel(ChannelMemory mem) { return create_channel(mem, ChannelStart{}); }
    ChannelId create_channel() { return create_channel(ChannelMemory{}); }
    virtual void destroy_channel(ChannelId ch) = 0;
    virtual pvgpu_ring* ring(ChannelId ch) = 0;

    // The GPU's own channel registers (what a direct mapping exposes; the
    // control page holds a copy a tenant can overwrite).  Writing IB_PUT is
    // the doorbell.  IB_GET and FENCE are the GPU's progress and cannot be
    // faked by whatever the tenant writes into its control page.
    virtual void write_ib_put(ChannelId ch, std::uint32_t put) = 0;
    virtual std::uint32_t read_ib_put(ChannelId ch) const = 0;
    virtual std::uint32_t read_ib_get(ChannelId ch) const = 0;
    virtual std::uint32_t read_fence(ChannelId ch) const = 0;
    virtual std::uint32_t read_status(ChannelId ch) const = 0;
    // Work fetched or queued but not yet completed (IB_PUT != completed).
    virtual bool pending(ChannelId ch) const = 0;

    // Engine status register (LoGA): the channel whose context is on the engine.
    virtual std::optional<ChannelId> running_channel() const = 0;
    // The context-switch trace (NVIDIA's FECS context-switch trace): a
    // record each time the engine changed the channel it runs, written for
    // the host whatever the work asks for.  Appends the records not read
    // before to `out`, oldest first; returns how many were lost since the
    // previous call to a full buffer.  A GPU without a trace appends none.
    virtual std::uint64_t read_ctxsw_trace(std::vector<CtxswRecord>& out) {
        (void)out;
        return 0;
    }
    virtual bool has_ctxsw_trace() const { return false; }

    // The arbitration the host configured (non-preemptive unless overridden).
    virtual EngineArbitration arbitration() const { return {}; }

    // Host-only preemption (the host owns the runlist: NVIDIA since Pascal,
    // AMD's MES): the kernel on the engine is taken off, to resume later
    // where it stopped, and `next` is loaded after `arbitration().preempt` of
    // engine dead time (context save and load), with a fresh slice.  Returns
    // false and changes nothing on an engine that cannot preempt, when the
    // engine is idle, or when `next` is already on it or has no pending work.
    virtual bool preempt_to(ChannelId next) {
        (void)next;
        return false;
    }

    // Watchdog: a kernel running longer than this is killed with its channel.
    virtual void set_watchdog(Duration limit) = 0;

    // The GPU's utilisation counter (NVML's per-GPU utilisation): time the
    // engine executed work since the device was opened, read at any moment
    // (a kernel on the engine counts up to now).  Never decreases.
    virtual Duration busy_time() const = 0;
    // Times the engine changed channel (a context switch trace's length).
    virtual std::uint64_t context_switches() const = 0;
};

}  // namespace pvgpu
