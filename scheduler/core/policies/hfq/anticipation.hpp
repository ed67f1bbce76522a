#pragma once

#include "core/policies/hfq/fair_queue.hpp"

namespace pvgpu::hfq {

class HfqPolicy;

// Anticipation (BFQ's idling, Iyer and Druschel's anticipatory scheduler): a
// leaf that runs unblocked and has just gone idle between bursts is likely
// to come back after its usual think time.  If that think time is shorter
// than the kernel the GPU would otherwise be fed from a shadow page, feeding
// it would make the returning leaf wait a whole kernel on a non-preemptive
// engine: hfq holds the engine idle instead, for at most twice the leaf's
// learned think time, and only if that is within `anticipate_us`.  Off by
// default: the feed cap does the same where it matters, without probing,
// and holding for every learned think idles the engine on loads whose
// leaves would not have waited.
//
// State: the end of the last hold (held_until_), which tells a leaf's
// learned think time (mark_busy) whether its return was seen in time.
class Anticipation {
public:
    explicit Anticipation(HfqPolicy& hfq) : hfq_(hfq) {}

    // Until when to keep the engine idle for an unblocked leaf between
    // bursts; `now` or earlier when no leaf is worth waiting for.
    Time until(Time now);
    // Hold the engine idle until `until` (from until()).
    void hold(Time until);
    // The end of the last hold.
    Time held_until() const { return held_until_; }
    std::uint64_t holds() const { return anticipations_; }

private:
    HfqPolicy& hfq_;
    Time held_until_ = -1;  // end of the last anticipation hold
    std::uint64_t anticipations_ = 0;
};

}  // namespace pvgpu::hfq
