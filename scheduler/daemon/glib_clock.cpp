#include "glib_clock.hpp"

#include <sys/timerfd.h>
#include <time.h>

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

TimerId GlibTimers::arm(Time at, std::function<void()> fn) {
    TimerId id = next_id_++;
    heap_.push({at, id});
    live_.emplace(id, std::move(fn));
    if (!dispatching_ && (fd_at_ == 0 || at < fd_at_)) rearm();
    return id;
}

void GlibTimers::cancel(TimerId id) {
    if (live_.erase(id) == 0) return;
    if (dispatching_) return;  // dispatch() re-arms when it is done
    if (heap_.size() > 64 && heap_.size() > 4 * live_.size()) compact();
    rearm();
}

void GlibTimers::drop_dead_head() {
    while (!heap_.empty() && !live_.count(heap_.top().id)) heap_.pop();
}

void GlibTimers::compact() {
    std::vector<Entry> keep;
    keep.reserve(live_.size());
    while (!heap_.empty()) {
        if (live_.count(heap_.top().id)) keep.push_back(heap_.top());
        heap_.pop();
    }
    heap_ = decltype(heap_)(std::greater<Entry>(), std::move(keep));
}

void GlibTimers::rearm() {
    drop_dead_head();
    Time want = heap_.empty() ? 0 : heap_.top().at;
    // it_value 0 would disarm: a deadline at or before the epoch means "now".
    if (!heap_.empty() && want <= 0) want = 1;
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
            drop_dead_head();
            if (heap_.empty() || heap_.top().at > now || ran == kMaxPerDispatch) break;
            Entry e = heap_.top();
            heap_.pop();
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
