// Test rig shared by the policy tests: event loop + simulated GPU +
// scheduler + one greedy (or gapped, or finite) submitter per channel, with
// ground truth from the engine's ExecutionObserver.
#pragma once

#include <algorithm>
#include <cstdlib>
#include <functional>
#include <map>
#include <memory>
#include <stdexcept>
#include <string>
#include <vector>

#include "core/policies/policies.hpp"
#include "core/scheduler.hpp"
#include "sim/event_loop.hpp"
#include "sim/sim_gpu.hpp"

namespace pvgpu::test {


// The timers of a host that stalls (the GPU model's and the scheduler's,
// which share one event loop in pvgpud): a timer due inside the stall fires
// when it ends, after those due before it, as on a busy event loop.  As
// pvgpud's GlibTimers does, the GPU model's (device()) fire before the
// scheduler's there, whatever their deadlines: hardware runs on while the
// host is stalled.
class StallingTimers final : public Timers {
public:
    explicit StallingTimers(sim::EventLoop& loop) : loop_(loop) {}
    // Set before the timers concerned are armed.
    void stall(Time from, Time to) {
        from_ = from;
        to_ = to;
        period_ = 0;
    }
    // From `from` on, a stall of `length` at the start of every `period`.
    void stall_every(Time from, Duration period, Duration length) {
        if (period <= 0 || length >= period)
            throw std::invalid_argument("stall_every: a stall must be shorter than its period");
        from_ = from;
        period_ = period;
        to_ = length;
    }
    TimerId arm(Time at, std::function<void()> fn) override { return arm_at(at, 1, std::move(fn)); }
    void cancel(TimerId id) override { loop_.cancel(id); }
    Timers& device() { return device_; }

private:
    // A stalled timer fires at the stall's end, the host's one nanosecond
    // after the device's.
    TimerId arm_at(Time at, Duration host_delay, std::function<void()> fn) {
        if (period_ > 0 && at >= from_) {
            const Time phase = (at - from_) % period_;
            return loop_.arm(phase < to_ ? at - phase + to_ + host_delay : at, std::move(fn));
        }
        return loop_.arm(at >= from_ && at < to_ ? to_ + host_delay : at, std::move(fn));
    }
    class DeviceLane final : public Timers {
    public:
        explicit DeviceLane(StallingTimers& t) : t_(t) {}
        TimerId arm(Time at, std::function<void()> fn) override { return t_.arm_at(at, 0, std::move(fn)); }
        void cancel(TimerId id) override { t_.cancel(id); }

    private:
        StallingTimers& t_;
    };

    sim::EventLoop& loop_;
    Time from_ = 0, to_ = 0;  // periodic: to_ is the stall's length
    Duration period_ = 0;
    DeviceLane device_{*this};
};

// Ground-truth GPU time per channel, for a test that builds its own rig
// (Rig below keeps its own, counted from a start time).
struct Truth final : sim::ExecutionObserver {
    std::map<ChannelId, Duration> ran;
    void executed(ChannelId ch, Time start, Time end) override { ran[ch] += end - start; }
};

// Event loop + simulated GPU + scheduler + one submitter loop per channel.
class Rig final : public sim::ExecutionObserver {
public:
    struct Submitter {
        EntityId leaf = kNoEntity;
        Duration kernel = 0;
        Duration gap = 0;          // guest CPU time between a completion and the next submission
        std::uint64_t limit = 0;   // kernels to submit; 0 = endless
        std::uint32_t put = 0;
        std::uint64_t submitted = 0;
        std::uint64_t completed = 0;
        bool running = true;
        bool irq = true;           // ask for completion interrupts
        std::uint32_t irq_every = 1;  // ... on every irq_every-th kernel only (0: none)
        std::uint32_t depth = 1;      // kernels kept submitted ahead of the GPU
        std::vector<Duration> pattern{};  // if set: kernel lengths in turn, instead of `kernel`
        // If set: the gap after its n-th completion (1, 2, ...), instead of `gap`.
        std::function<Duration(std::uint64_t)> gap_after{};
    };

    // `start`: the clock's time when the GPU and the scheduler come up (a
    // host's monotonic clock is far from 0 then).
    explicit Rig(const std::string& policy, const PolicyParams& params = {},
                 sim::SimGpuConfig cfg = {}, Time start = 0, MechanismCosts costs = {})
        : gpu_(started(loop, start), host_timers.device(), traced_or_not(cfg)),
          sched(gpu_, loop, host_timers, make_policy(policy, params), costs) {
        gpu_.set_observer(this);
        measure_from_ = start;
        // PVGPU_LOOKS_SEED=N seeds the accounting's random looks (to measure
        // their noise over seeds: docs/results.md section 6); unset, the
        // fixed default every run reproduces.
        if (const char* e = std::getenv("PVGPU_LOOKS_SEED")) sched.seed_accounting(std::strtoull(e, nullptr, 0));
    }

    // PVGPU_TEST_CTXSW_TRACE=0 runs every rig on a GPU without a
    // context-switch trace (tests/unit/accounting_notrace.py): the
    // accounting's trace-less mechanisms under the cases written for them.
    static sim::SimGpuConfig traced_or_not(sim::SimGpuConfig cfg) {
        if (const char* e = std::getenv("PVGPU_TEST_CTXSW_TRACE"); e && std::string(e) == "0") cfg.ctxsw_trace = false;
        return cfg;
    }

    EntityId vm(const std::string& name, std::uint32_t weight = 100) {
        return sched.entities().add(kRootEntity, name, EntityKind::Vm, weight);
    }
    EntityId task(const std::string& name, std::uint32_t weight = 100, EntityId parent = kRootEntity) {
        return sched.entities().add(parent, name, EntityKind::Task, weight);
    }

    // Opens a channel on `leaf` and starts a submitter on it at `start_at`.
    // `from`: the channel's starting positions (a channel re-created after a drain).
    ChannelId submit_loop(EntityId leaf, Duration kernel, Duration gap = 0, std::uint64_t limit = 0,
                          Time start_at = 0, ChannelStart from = {}) {
        ChannelId ch = sched.open_channel(leaf, {}, from);
        subs[ch] = Submitter{leaf, kernel, gap, limit};
        subs[ch].put = from.get;
        gpu_.set_fence_watcher(ch, [this, ch](std::uint32_t) {
            auto it = subs.find(ch);
            if (it == subs.end()) return;  // closed
            Submitter& s = it->second;
            ++s.completed;
            const Duration next_gap = s.gap_after ? s.gap_after(s.completed) : s.gap;
            if (next_gap > 0)
                loop.arm(loop.now() + next_gap, [this, ch] { fill(ch); });
            else
                fill(ch);
        });
        loop.arm(start_at, [this, ch] { fill(ch); });
        return ch;
    }

    // Submits until `depth` kernels are outstanding (the loop's step).
    void fill(ChannelId ch) {
        auto it = subs.find(ch);
        if (it == subs.end()) return;  // closed while its next submission waited
        Submitter& s = it->second;
        do submit(ch);
        while (s.running && (!s.limit || s.submitted < s.limit) && s.submitted - s.completed < s.depth);
    }

    // Submits one kernel.
    void submit(ChannelId ch) {
        Submitter& s = subs.at(ch);
        if (!s.running || (s.limit && s.submitted >= s.limit)) return;
        ShadowChannel& sc = sched.channel(ch);
        pvgpu_ring_entry& e = sc.ring()->entries[s.put & PVGPU_RING_MASK];
        e.payload = static_cast<std::uint64_t>(s.pattern.empty() ? s.kernel : s.pattern[s.put % s.pattern.size()]);
        e.fence = s.put + 1;
        e.flags = s.irq && s.irq_every > 0 && (s.put + 1) % s.irq_every == 0 ? PVGPU_ENTRY_IRQ : 0;
        ++s.put;
        ++s.submitted;
        sc.guest_write_put(s.put);
    }

    // Ground truth, counted from `measure_from_` on.
    void executed(ChannelId ch, Time start, Time end) override {
        start = std::max(start, measure_from_);
        if (end > start) busy_[ch] += end - start;
    }
    void measure_from(Time t) {
        busy_.clear();
        measure_from_ = t;
    }
    void run_until(Time t) { loop.run_until(t); }
    // Its client goes away: the submitter with it (its ground truth too).
    void close(ChannelId ch) {
        subs.erase(ch);
        sched.close_channel(ch);
    }
    // Every submitter stops submitting; what it queued still runs (let the
    // engine drain before comparing with the truth, which counts a kernel
    // when it ends).
    void stop_submitters() {
        for (auto& [ch, sub] : subs) sub.running = false;
    }

    Duration gpu_time(EntityId leaf) const {
        Duration d = 0;
        for (const auto& [ch, t] : busy_)
            if (subs.count(ch) && subs.at(ch).leaf == leaf) d += t;
        return d;
    }
    Duration total_gpu_time() const {
        Duration d = 0;
        for (const auto& [ch, t] : busy_) d += t;
        return d;
    }
    double share(EntityId leaf) const {
        return static_cast<double>(gpu_time(leaf)) / static_cast<double>(total_gpu_time());
    }
    double busy_fraction(Time until) const {
        return static_cast<double>(total_gpu_time()) / static_cast<double>(until - measure_from_);
    }
    // The mapping of a channel its policy left direct: direct, or trapped
    // while the accounting traps an idle engine's doorbells.
    ChannelMode direct_mapping(ChannelId ch) const {
        return sched.accounting().wants_trap(ch) ? ChannelMode::Trapped : ChannelMode::Direct;
    }
    double counter(const std::string& name) const {
        auto c = const_cast<Scheduler&>(sched).policy().counters();
        return c.count(name) ? c.at(name) : -1;
    }

    sim::EventLoop loop;
    StallingTimers host_timers{loop};

private:
    sim::SimGpu gpu_;

public:
    Scheduler sched;
    std::map<ChannelId, Submitter> subs;

private:
    static sim::EventLoop& started(sim::EventLoop& l, Time start) {
        l.run_until(start);
        return l;
    }
    std::map<ChannelId, Duration> busy_;
    Time measure_from_ = 0;
};

constexpr Duration ms(double v) { return static_cast<Duration>(v * kMillisecond); }

}  // namespace pvgpu::test
