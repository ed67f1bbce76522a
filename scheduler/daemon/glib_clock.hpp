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

// One-shot timers as a min-heap of deadlines behind a single timerfd
// (TFD_TIMER_ABSTIME), always armed to the earliest live deadline and
// disarmed when none is left: an idle daemon gets no timer wakeups at all.
// Callbacks run from the main loop, in deadline order (arm order on ties),
// never from inside arm() or cancel().
class GlibTimers final : public Timers {
public:
    explicit GlibTimers(GMainContext* ctx);
    GlibTimers(const GlibTimers&) = delete;
    GlibTimers& operator=(const GlibTimers&) = delete;

    TimerId arm(Time at, std::function<void()> fn) override;
    void cancel(TimerId id) override;

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

    void dispatch();
    void rearm();
    void drop_dead_head();
    void compact();

    UniqueFd fd_;
    FdWatch watch_;
    std::priority_queue<Entry, std::vector<Entry>, std::greater<Entry>> heap_;
    std::unordered_map<TimerId, std::function<void()>> live_;
    TimerId next_id_ = 1;
    Time fd_at_ = 0;
    bool dispatching_ = false;
    std::uint64_t wakeups_ = 0;
    std::uint64_t fired_ = 0;
};

}  // namespace pvgpu::daemon
