// Time, clocks and timers: injected so the same scheduling code runs in
// virtual time in the simulator and in real time in the daemon.
#pragma once

#include <cstdint>
#include <functional>

namespace pvgpu {

// Nanoseconds, signed so differences are natural.
using Time = std::int64_t;
using Duration = std::int64_t;

constexpr Duration kMicrosecond = 1000;
constexpr Duration kMillisecond = 1000 * kMicrosecond;
constexpr Duration kSecond = 1000 * kMillisecond;

constexpr Duration from_us(double us) { return static_cast<Duration>(us * 1000.0); }
constexpr double to_us(Duration d) { return static_cast<double>(d) / 1000.0; }
constexpr double to_ms(Duration d) { return static_cast<double>(d) / 1e6; }

class Clock {
public:
    virtual ~Clock() = default;
    virtual Time now() const = 0;
};

using TimerId = std::uint64_t;
constexpr TimerId kNoTimer = 0;

// One-shot timers.  Callbacks run on the scheduler's thread, never re-entrantly
// from arm()/cancel().
class Timers {
public:
    virtual ~Timers() = default;
    virtual TimerId arm(Time at, std::function<void()> fn) = 0;
    // Cancelling an expired or unknown timer is a no-op.
    virtual void cancel(TimerId id) = 0;
};

// RAII holder for a timer so a policy cannot leak one past its lifetime.
class Timer {
public:
    Timer() = default;
    explicit Timer(Timers& t) : timers_(&t) {}
    Timer(const Timer&) = delete;
    Timer& operator=(const Timer&) = delete;
    ~Timer() { cancel(); }
    void bind(Timers& t) { timers_ = &t; }
    void arm(Time at, std::function<void()> fn) {
        cancel();
        id_ = timers_->arm(at, [this, f = std::move(fn)] {
            id_ = kNoTimer;
            f();
        });
    }
    void cancel() {
        if (id_ != kNoTimer && timers_) timers_->cancel(id_);
        id_ = kNoTimer;
    }
    bool armed() const { return id_ != kNoTimer; }

private:
    Timers* timers_ = nullptr;
    TimerId id_ = kNoTimer;
};

}  // namespace pvgpu
