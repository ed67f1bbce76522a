// Target and achieved GPU shares for the admin socket, from what the daemon
// may know: the scheduler's own accounting (Scheduler::accounting(), the same
// under every policy) sampled over a sliding window, the GPU's utilisation
// counter, and which channels hold work.  Never the simulator's ground truth.  Sampling runs only while
// something is submitted, so an idle daemon does not wake up for it.
#pragma once

#include <cstdint>
#include <deque>
#include <unordered_map>
#include <vector>

#include "core/scheduler.hpp"
#include "core/shares.hpp"

namespace pvgpu::daemon {

class ShareMonitor {
public:
    ShareMonitor(Scheduler& sched, const GpuDevice& gpu, const Clock& clock, Timers& timers,
                 Duration window = 2 * kSecond, Duration period = 250 * kMillisecond);

    // Work was submitted: make sure sampling runs.
    void activity();
    // The entity is gone (its id may be reused).
    void forget(EntityId id);
    struct Share {
        double target_now = 0;  // water-filling over the leaves backlogged now
        double target_avg = 0;  // the same, averaged over the window
        double achieved = 0;    // accounted GPU time in the window / window
        Duration gpu_time = 0;  // accounted since the entity was created (subtree)
        std::uint64_t kernels = 0;  // completion interrupts since it was created (subtree)
    };
    struct Snapshot {
        std::unordered_map<EntityId, Share> entities;
        Duration window = 0;
        double busy_fraction = 0;
        double idle_with_demand_fraction = 0;
        double scheduler_cpu_us_per_s = 0;  // real CPU in policy callbacks per wall second
        double process_cpu_us_per_s = 0;    // the whole daemon (getrusage)
        Duration process_cpu = 0;           // the whole daemon since it started
        FairnessMetrics metrics;            // over leaves with a target in the window
    };
    Snapshot snapshot();

    bool sampling() const { return timer_.armed(); }

private:
    struct Sample {
        Time end = 0;
        Duration dt = 0;
        std::vector<std::pair<EntityId, Duration>> used;  // every entity, subtree sums
        std::vector<std::pair<EntityId, double>> target;  // target share x dt (ns), every entity
        Duration busy = 0;
        Duration idle_with_demand = 0;
        Duration policy_cpu = 0;
        Duration process_cpu = 0;
    };
    struct Leaf {
        Duration last_accounted = 0;
        std::uint64_t last_kernels = 0;
        Time last_busy = -1;  // last time it had work or used the GPU
    };

    bool sample();  // returns whether anything was busy
    void tick();

    Scheduler& sched_;
    const GpuDevice& gpu_;
    const Clock& clock_;
    Timer timer_;
    Duration window_, period_;

    std::unordered_map<EntityId, Leaf> leaves_;
    std::unordered_map<EntityId, Duration> total_;
    std::unordered_map<EntityId, std::uint64_t> kernels_;
    std::unordered_map<EntityId, double> target_now_;
    std::deque<Sample> samples_;
    Time last_t_ = 0;
    Duration last_busy_ = 0;
    Duration last_policy_cpu_ = 0;
    Duration last_process_cpu_ = 0;
    bool last_backlog_ = false;
};

}  // namespace pvgpu::daemon
