#include "glib_clock.hpp"

#include <sys/timerfd.h>
#include <time.h>

#include <algorithm>
#include <cerrno>
#include <system_error>

namespace pvgpu::daemon {

Time MonotonicClock::now() const {
    timespec ts{};
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return static_cast<Time>(ts.tv_sec) * kSecond + ts.tv_nsec;
}

namespace {

// Timers due within one dispatch are bounded so a callback that keeps
// arming "now" cannot starve the rest of the loop; the fd fires again at once.
constexpr int kMaxPerDispatch = 1024;

}  // namespace

GlibTimers::GlibTimers(GMainContext* ctx) : fd_(timerfd_create(CLOCK_MONOTONIC, TFD_NONBLOCK | TFD_CLOEXEC)) {
    if (!fd_) throw std::system_error(errno, std::generic_category(), "timerfd_create");
    watch_ = FdWatch(ctx, fd_.get(), G_IO_IN, [this](GIOCondition) { dispatch(); });
}

TimerId GlibTimers::arm(Time at, std::function<void()> fn) { return arm_in(kHost, at, std::move(fn)); }

TimerId GlibTimers::arm_in(Lane lane, Time at, std::function<void()> fn) {
    TimerId id = next_id_++;
    heaps_[lane].push({at, id});
    live_.emplace(id, std::move(fn));
    if (!dispatching_ && (fd_at_ == 0 || at < fd_at_)) rearm();
    return id;
}

void GlibTimers::cancel(TimerId id) {
    if (live_.erase(id) == 0) return;
    if (dispatching_) return;  // dispatch() re-arms when it is done
    const std::size_t entries = heaps_[kDevice].size() + heaps_[kHost].size();
    if (entries > 64 && entries > 4 * live_.size()) compact();
    rearm();
}

void GlibTimers::drop_dead_heads() {
    for (Heap& h : heaps_)
        while (!h.empty() && !live_.count(h.top().id)) h.pop();
}

void GlibTimers::compact() {
    for (Heap& h : heaps_) {
        std::vector<Entry> keep;
        keep.reserve(h.size());
        while (!h.empty()) {
            if (live_.count(h.top().id)) keep.push_back(h.top());
            h.pop();
        }
        h = Heap(std::greater<Entry>(), std::move(keep));
    }
}

int GlibTimers::due(Time now) {
    drop_dead_heads();
    for (int lane : {kDevice, kHost})
        if (!heaps_[lane].empty() && heaps_[lane].top().at <= now) return lane;
    return -1;
}

void GlibTimers::rearm() {
    drop_dead_heads();
    const Heap& dev = heaps_[kDevice];
    const Heap& host = heaps_[kHost];
    Time want = 0;
    if (!dev.empty() || !host.empty()) {
        want = dev.empty() ? host.top().at : host.empty() ? dev.top().at : std::min(dev.top().at, host.top().at);
        // it_value 0 would disarm: a deadline at or before the epoch means "now".
        want = std::max<Time>(want, 1);
    }
    if (want == fd_at_) return;
    itimerspec its{};
    its.it_value.tv_sec = want / kSecond;
    its.it_value.tv_nsec = want % kSecond;
    if (timerfd_settime(fd_.get(), TFD_TIMER_ABSTIME, &its, nullptr) != 0)
        throw std::system_error(errno, std::generic_category(), "timerfd_settime");
    fd_at_ = want;
}

void GlibTimers::dispatch() {
    // No read() of the expiration count: the rearm() below always calls
    // timerfd_settime(), which resets the count and so the fd's readability
    // (timerfd_create(2)).  One syscall less per wakeup, and a busy pvgpud
    // wakes once per kernel completion (issue 12 section 2).
    ++wakeups_;
    fd_at_ = -1;  // the fd is spent (or stale): force rearm() to set it again
    dispatching_ = true;
    Time now = MonotonicClock().now();
    int ran = 0;
    try {
        for (;;) {
            const int lane = ran == kMaxPerDispatch ? -1 : due(now);
            if (lane < 0) break;
            Entry e = heaps_[lane].top();
            heaps_[lane].pop();
            auto it = live_.find(e.id);
            auto fn = std::move(it->second);
            live_.erase(it);
            ++ran;
            ++fired_;
            fn();
        }
    } catch (...) {
        dispatching_ = false;
        rearm();
        throw;
    }
    dispatching_ = false;
    rearm();
}

}  // namespace pvgpu::daemon
