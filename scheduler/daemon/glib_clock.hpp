// Real time for the scheduling core: a Clock on CLOCK_MONOTONIC and Timers
// driven by one timerfd on a GLib main context.
#pragma once

#include <glib.h>

#include <cstdint>
#include <functional>
#include <queue>
#include <unordered_map>
#include <vector>

#include "core/time.hpp"
#include "gsource.hpp"
#include "proto/unique_fd.hpp"

namespace pvgpu::daemon {

// Nanoseconds of CLOCK_MONOTONIC (the timerfd's clock, so deadlines match).
class MonotonicClock final : public Clock {
public:
    Time now() const override;
};

// One-shot timers as min-heaps of deadlines behind a single timerfd
// (TFD_TIMER_ABSTIME), always armed to the earliest live deadline and
// disarmed when none is left: an idle daemon gets no timer wakeups at all.
// Callbacks run from the main loop, in deadline order (arm order on ties),
// never from inside arm() or cancel().
//
// Two lanes share the fd: the host's timers (this object) and the simulated
// GPU's (device()).  When the loop runs late, every overdue device timer
// fires before any overdue host timer: hardware finishes its kernels while
// the host is stalled, so a host timer that fires late must see the engine
// as it is now, not as it was at the timer's deadline (a busy-engine read
// would charge the kernel that ended meanwhile the whole stall).
class GlibTimers final : public Timers {
public:
    explicit GlibTimers(GMainContext* ctx);
    GlibTimers(const GlibTimers&) = delete;
    GlibTimers& operator=(const GlibTimers&) = delete;

    TimerId arm(Time at, std::function<void()> fn) override;
    void cancel(TimerId id) override;
    // The device lane (ids are shared with the host lane: either cancels).
    Timers& device() { return device_; }

    // Introspection for tests and stats.
    std::size_t armed() const { return live_.size(); }
    // The deadline the timerfd is set to, or 0 when it is disarmed.
    Time fd_deadline() const { return fd_at_; }
    int fd() const { return fd_.get(); }
    std::uint64_t wakeups() const { return wakeups_; }
    std::uint64_t fired() const { return fired_; }

private:
    struct Entry {
        Time at;
        TimerId id;
        bool operator>(const Entry& o) const { return at != o.at ? at > o.at : id > o.id; }
    };
    using Heap = std::priority_queue<Entry, std::vector<Entry>, std::greater<Entry>>;
    enum Lane { kDevice = 0, kHost = 1 };

    class DeviceLane final : public Timers {
    public:
        explicit DeviceLane(GlibTimers& t) : t_(t) {}
        TimerId arm(Time at, std::function<void()> fn) override { return t_.arm_in(kDevice, at, std::move(fn)); }
        void cancel(TimerId id) override { t_.cancel(id); }

    private:
        GlibTimers& t_;
    };

    TimerId arm_in(Lane lane, Time at, std::function<void()> fn);
    void dispatch();
    void rearm();
    void drop_dead_heads();
    // The lane whose head is due first at or before `now`, device first; -1 if none.
    int due(Time now);
    void compact();

    UniqueFd fd_;
    FdWatch watch_;
    Heap heaps_[2];
    DeviceLane device_{*this};
    std::unordered_map<TimerId, std::function<void()>> live_;
    TimerId next_id_ = 1;
    Time fd_at_ = 0;
    bool dispatching_ = false;
    std::uint64_t wakeups_ = 0;
    std::uint64_t fired_ = 0;
};

}  // namespace pvgpu::daemon
