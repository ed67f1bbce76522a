// The simulated GPU: a black box that behaves like hardware.  Work arrives
// through ring entries and IB_PUT doorbells; the engine runs one kernel at a
// time, arbitrating between channels round-robin (non-preemptive, Kepler) or by
// preemptive time slices (Pascal and later).  The host sees only the GpuDevice
// registers and interrupts.  The simulator's measurement harness may watch the
// ExecutionObserver, the ground truth a scheduler never gets.
#pragma once

#include <array>
#include <cstdint>
#include <deque>
#include <functional>
#include <memory>
#include <set>
#include <string>
#include <string_view>
#include <unordered_map>
#include <vector>

#include "core/gpu_device.hpp"
#include "core/time.hpp"

namespace pvgpu::sim {

enum class Arbitration { RoundRobin, Timeslice };
std::string_view to_string(Arbitration a);

struct SimGpuConfig {
    Arbitration arbitration = Arbitration::RoundRobin;
    Duration timeslice = 2 * kMillisecond;  // Timeslice only
    Duration ctxsw = 0;                     // Timeslice only: engine dead time per switch
    Duration watchdog = 2 * kSecond;        // 0 disables
    Duration preempt = 75 * kMicrosecond;   // Timeslice only: engine dead time per host preemption
    // From a completion or a channel error to the host's handler and the
    // submitter's wake-up (MSI, the host's IRQ path, a thread's wake-up).
    // 0: at once.  For the simulator's cost model; pvgpud's is real.
    Duration irq_latency = 0;
    // Keep a context-switch trace for the host (GpuDevice::read_ctxsw_trace).
    // false models a GPU without one: the host's accounting then guesses
    // from interrupts, registers and looks.
    bool ctxsw_trace = true;
};

// Ground truth for the simulator's reports, never for schedulers.
class ExecutionObserver {
public:
    virtual ~ExecutionObserver() = default;
    // The engine ran `ch` over [start, end).
    virtual void executed(ChannelId ch, Time start, Time end) = 0;
};

class SimGpu final : public GpuDevice {
public:
    SimGpu(const Clock& clock, Timers& timers, SimGpuConfig cfg);
    ~SimGpu() override;

    void set_interrupt_handler(GpuInterrupts* handler) override { irq_ = handler; }
    using GpuDevice::create_channel;
    ChannelId create_channel(ChannelMemory mem, ChannelStart start) override;
    void destroy_channel(ChannelId ch) override;
    pvgpu_ring* ring(ChannelId ch) override;

    void write_ib_put(ChannelId ch, std::uint32_t put) override;
    std::uint32_t read_ib_put(ChannelId ch) const override;
    std::uint32_t read_ib_get(ChannelId ch) const override;
    std::uint32_t read_fence(ChannelId ch) const override;
    std::uint32_t read_status(ChannelId ch) const override;
    bool pending(ChannelId ch) const override;
    std::optional<ChannelId> running_channel() const override;
    std::uint64_t read_ctxsw_trace(std::vector<CtxswRecord>& out) override;
    bool has_ctxsw_trace() const override { return cfg_.ctxsw_trace; }
    void set_watchdog(Duration limit) override;
    EngineArbitration arbitration() const override {
        if (cfg_.arbitration != Arbitration::Timeslice) return {};
        return {true, cfg_.timeslice, cfg_.ctxsw, cfg_.preempt};
    }
    bool preempt_to(ChannelId next) override;

    void set_observer(ExecutionObserver* o) { observer_ = o; }
    // Guest side: the submitter's view of completions (a guest polls fence
    // memory or gets the device's per-channel interrupt).  Not a host path.
    using FenceWatcher = std::function<void(std::uint32_t fence)>;
    void set_fence_watcher(ChannelId ch, FenceWatcher w);
    // Guest side: the control page as mapped to the submitter, which may
    // write anything into it.  Not a host path.
    pvgpu_ctrl_page* control_page(ChannelId ch) { return chan(ch).ctrl; }
    const SimGpuConfig& config() const { return cfg_; }
    // Time the engine executed kernels, up to the last segment's end
    // before now (ground truth for the simulator's tests).
    Duration busy_time_ended() const {
        run_on();
        return busy_;
    }
    // The same with the running segment up to now: what a utilisation
    // counter read at any moment shows (GpuDevice::busy_time).
    Duration busy_time_now() const;
    Duration busy_time() const override { return busy_time_now(); }
    std::uint64_t context_switches() const override { return switches_; }
    std::uint64_t preemptions() const { return preemptions_; }

private:
    static constexpr Time kNever = INT64_MAX;
    // A run time beyond any watchdog (and beyond int64 ns) is not real work.
    static constexpr std::uint64_t kMaxPayload = std::uint64_t{1} << 50;

    struct Channel {
        std::unique_ptr<pvgpu_ctrl_page> own_ctrl;  // when the host gave none
        std::unique_ptr<pvgpu_ring> own_ring;
        pvgpu_ctrl_page* ctrl = nullptr;
        pvgpu_ring* ring = nullptr;
        // The entries as the GPU fetched them at their doorbell: the ring is
        // tenant memory, and what the engine runs, and when it interrupts,
        // must not change under it (nor under the wakeup planned from them).
        std::unique_ptr<std::array<pvgpu_ring_entry, PVGPU_RING_ENTRIES>> fetched =
            std::make_unique<std::array<pvgpu_ring_entry, PVGPU_RING_ENTRIES>>();
        std::uint32_t put = 0;         // the GPU's IB_PUT register
        // The GPU's own status: the page's STATUS is a copy the submitter can
        // scribble on, so it must not bring a dead channel back.
        bool dead = false;
        std::uint32_t completed = 0;   // entries finished
        // The GPU's own GET and FENCE registers.  The control page gets a copy
        // for the submitter, but that page is tenant memory: a host reads
        // progress from these, never from the page.
        std::uint32_t get = 0;
        std::uint32_t fence = 0;
        // The kernel at `completed` when it was preempted or not started yet.
        bool in_flight = false;
        Duration remaining = 0;
        Duration ran = 0;              // this kernel's run time so far (watchdog)
        FenceWatcher watcher;
    };

    // A completion or a channel error, as the host (an interrupt) and the
    // submitter (its fence watcher) hear of it.
    struct Raised {
        ChannelId ch;
        std::uint32_t value;   // the fence, or the error code
        bool error;
        bool irq;              // a completion that asked for an interrupt
    };

    static const pvgpu_ring_entry& entry(const Channel& c, std::uint32_t i) {
        return (*c.fetched)[i & PVGPU_RING_MASK];
    }
    Channel& chan(ChannelId ch);
    const Channel& chan(ChannelId ch) const;
    bool runnable(const Channel& c) const;
    void update_ready(ChannelId ch);
    void kick();                       // start the engine if idle and work is ready
    void start(ChannelId ch, Duration dead = -1);  // put ch on the engine after `dead` (-1: ctxsw rule)
    void run_segment();                // run current kernel until done/slice/watchdog
    void segment_end();
    // The host's wakeups.  A kernel's completion that raises nothing needs
    // none: a register read catches the engine up, as a GPU interrupts its
    // host only where an entry asks for it (and a submitter watching its
    // fences is woken by completions only).  Every other segment end (a
    // completion that raises, a watchdog kill, a slice's end) is a wakeup,
    // armed when its segment starts.  While the running segment is a silent
    // completion, the wakeup is the earliest moment the engine, left alone,
    // could raise something or cut a kernel.
    void on_wake();
    void arm_wake();
    Time next_wake() const;
    bool segment_wakes() const;        // the running segment's end is a wakeup
    // Engine time channel `c` needs, from the kernel at `from` on (with
    // `remaining` and `ran` for that kernel if it was started, else -1),
    // to its first completion or kill that raises: kNever if none.  Stops
    // counting at `limit`.
    Duration work_to_raise(const Channel& c, std::uint32_t from, Duration remaining, Duration ran,
                           Duration limit) const;
    void end_at_seg_end();             // segment_end() at the engine's time seg_end_
    void stop_engine();                // take the running channel off mid-kernel
    void end_segment(ChannelId ch, Time now);
    Time engine_now() const;           // the engine's time: a segment's planned end while it ends
    // The engine runs on while the host is late: every segment end before
    // now is processed at its own time, and the interrupts they raised are
    // delivered only after that, so a host handling them reads the engine
    // as it is now (as with hardware), not as each completion left it.
    void catch_up();
    void run_on() const;               // catch_up() from a register read
    // Runs the segment ends due before now; what they raise waits in raised_.
    void run_overdue();
    void raise(Raised r);
    void dispatch(const Raised& r);
    void deliver();
    void deliver_later();              // what raised_ holds, on the host loop's next turn
    void deliver_late();               // what in_transit_ holds that is due by now
    void arm_transit();                // deliver_late() when in_transit_'s first is due
    void fail(ChannelId ch, std::uint32_t error);
    std::optional<ChannelId> next_after(ChannelId ch) const;
    // A context-switch record when the engine's channel changed to `to`
    // (0: idle, or loading a context) at the engine's time `at`.
    void trace_switch(Time at, ChannelId to);

    const Clock& clock_;
    Timers& timers_;
    SimGpuConfig cfg_;
    GpuInterrupts* irq_ = nullptr;
    ExecutionObserver* observer_ = nullptr;

    std::unordered_map<ChannelId, Channel> channels_;
    // chan()'s index into channels_ (whose elements never move) by id, ids
    // being handed out in sequence: a register read is a load, as on the
    // device, not a hash lookup that misses the cache at thousands of
    // channels and is charged to the policy that reads.
    std::vector<Channel*> by_id_;
    std::set<ChannelId> ready_;        // channels with work the engine could run
    ChannelId next_id_ = 1;

    // Engine state.
    std::optional<ChannelId> running_;
    ChannelId last_served_ = 0;
    ChannelId on_engine_ = 0;          // last channel whose context was loaded
    Time seg_start_ = 0;
    Time slice_end_ = 0;
    Time seg_end_ = 0;                 // when the running segment ends (while running_)
    Timer wake_timer_{timers_};        // the host's next wakeup for the engine (next_wake())
    Time wake_at_ = -1;                // what wake_timer_ is armed for
    Time engine_time_ = -1;            // set while a segment's end is processed
    // Raised, not yet delivered, in the order the engine raised them.
    std::vector<Raised> raised_;
    bool catching_up_ = false;         // raise() queues instead of delivering
    bool delivering_ = false;          // deliver() is handing raised_ to the host
    Timer deliver_timer_{timers_};     // delivers what a host call's catch-up raised
    // Raised and still on their way to the host (irq_latency), due in order:
    // the engine's time only moves forward and the latency is one constant.
    std::deque<std::pair<Time, Raised>> in_transit_;
    Timer transit_timer_{timers_};
    Duration busy_ = 0;
    std::uint64_t switches_ = 0;
    std::uint64_t preemptions_ = 0;
    // The context-switch trace's buffer, as a GPU's FECS buffer in memory:
    // bounded, the oldest records dropped (and counted) when the host
    // reads too rarely.
    static constexpr std::size_t kTraceCapacity = 4096;
    std::deque<CtxswRecord> trace_;
    ChannelId traced_ = 0;             // the channel the last record loaded
    std::uint64_t trace_lost_ = 0;
};

}  // namespace pvgpu::sim
