// Discrete-event loop in virtual time: the simulator's Clock and Timers.
// Events at the same instant run in the order they were armed, so a run is
// deterministic.
#pragma once

#include <functional>
#include <map>
#include <queue>
#include <unordered_map>
#include <vector>

#include "core/time.hpp"

namespace pvgpu::sim {

class EventLoop final : public Clock, public Timers {
public:
    Time now() const override { return now_; }
    TimerId arm(Time at, std::function<void()> fn) override;
    void cancel(TimerId id) override;

    // Runs events up to and including `until`; the clock ends at `until`.
    void run_until(Time until);
    // Runs the next event; false when none is left.
    bool step();
    std::uint64_t events_run() const { return events_run_; }
    std::size_t pending() const { return live_.size(); }

private:
    struct Entry {
        Time at;
        TimerId id;
        bool operator>(const Entry& o) const { return at != o.at ? at > o.at : id > o.id; }
    };
    std::priority_queue<Entry, std::vector<Entry>, std::greater<Entry>> queue_;
    std::unordered_map<TimerId, std::function<void()>> live_;
    Time now_ = 0;
    TimerId next_id_ = 1;
    std::uint64_t events_run_ = 0;
};

}  // namespace pvgpu::sim
