#include "event_loop.hpp"

namespace pvgpu::sim {

TimerId EventLoop::arm(Time at, std::function<void()> fn) {
    if (at < now_) at = now_;  // the past is now
    TimerId id = next_id_++;
    queue_.push({at, id});
    live_.emplace(id, std::move(fn));
    return id;
}

void EventLoop::cancel(TimerId id) { live_.erase(id); }

bool EventLoop::step() {
    while (!queue_.empty()) {
        Entry e = queue_.top();
        queue_.pop();
        auto it = live_.find(e.id);
        if (it == live_.end()) continue;  // cancelled
        auto fn = std::move(it->second);
        live_.erase(it);
        now_ = e.at;
        ++events_run_;
        fn();
        return true;
    }
    return false;
}

void EventLoop::run_until(Time until) {
    while (!queue_.empty()) {
        // Skip cancelled heads so top() is a live event.
        while (!queue_.empty() && !live_.count(queue_.top().id)) queue_.pop();
        if (queue_.empty() || queue_.top().at > until) break;
        step();
    }
    if (now_ < until) now_ = until;
}

}  // namespace pvgpu::sim
