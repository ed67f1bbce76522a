// Guest-side submitters: one loop per channel that writes ring entries, bumps
// IB_PUT through the (possibly trapped or shadowed) mapping, waits for the
// batch's fence, spends gap_us of CPU, and goes again.
#pragma once

#include <cstdint>
#include <functional>
#include <optional>

#include "core/scheduler.hpp"
#include "event_loop.hpp"
#include "scenario.hpp"
#include "sim_gpu.hpp"

namespace pvgpu::sim {

// Deterministic, platform-independent random numbers (splitmix64).
class Rng {
public:
    explicit Rng(std::uint64_t seed) : state_(seed) {}
    std::uint64_t next();
    double uniform01();  // [0, 1)
    Duration sample(const Dist& d);

private:
    std::uint64_t state_;
};

class SubmitLoop {
public:
    // Told whenever the loop's outstanding work goes from none to some or back.
    using DemandListener = std::function<void(bool has_outstanding)>;

    SubmitLoop(EventLoop& loop, SimGpu& gpu, Scheduler& sched, ChannelId ch, const Workload& w,
               std::uint64_t seed, DemandListener on_demand);
    ~SubmitLoop();
    SubmitLoop(const SubmitLoop&) = delete;
    SubmitLoop& operator=(const SubmitLoop&) = delete;

    void start();
    // The channel died (watchdog, bad entry): stop submitting, nothing is
    // outstanding any more.
    void abandon() {
        failed_ = true;
        set_outstanding(false);
    }
    // Told of every entry the loop submits, when its client submits it (a
    // trapped store lands a trap's cost later).
    using SubmitListener = std::function<void(ChannelId)>;
    void set_submit_listener(SubmitListener l) { on_submit_ = std::move(l); }
    ChannelId channel() const { return ch_; }
    std::uint64_t completed() const { return completed_; }
    std::uint64_t submitted() const { return submitted_; }
    std::optional<Time> finished() const { return finished_; }
    bool failed() const { return failed_; }
    Time start_time() const { return start_; }
    // Standalone demand: min(1, busy / (busy + gap)) for this one loop.
    double demand() const;

private:
    void submit_next();     // one entry of the current batch
    void on_fence(std::uint32_t fence);
    void set_outstanding(bool v);
    // Workload::forge_progress: overwrite the control page now / every 10 us.
    void pin_page();
    void forge();

    EventLoop& loop_;
    SimGpu& gpu_;
    Scheduler& sched_;
    ChannelId ch_;
    Workload w_;
    Rng rng_;
    SubmitListener on_submit_;
    DemandListener on_demand_;
    Time start_;
    std::uint32_t put_ = 0;
    std::uint32_t batch_left_ = 0;   // entries of this batch still to write
    std::uint32_t batch_fence_ = 0;  // fence that ends the batch
    std::uint64_t submitted_ = 0;
    std::uint64_t completed_ = 0;
    std::optional<Time> finished_;
    bool failed_ = false;
    bool outstanding_ = false;
    TimerId forge_timer_ = kNoTimer;
};

}  // namespace pvgpu::sim
