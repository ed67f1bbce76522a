// hfq's anticipation: see Anticipation in anticipation.hpp.
#include "core/policies/hfq/hfq.hpp"

namespace pvgpu::hfq {

void Anticipation::hold(Time until) {
    if (!hfq_.feeder_.hold_until(until)) return;
    ++anticipations_;
    held_until_ = until;
}

Time Anticipation::until(Time now) {
    if (hfq_.preemption_.possible()) {
        // A bursty leaf back sooner than a preemption would take: keep
        // the engine for it rather than feed and preempt.
        Time until = now;
        for (EntityId leaf : hfq_.idle_candidates_) {
            Node& n = hfq_.fq_.nodes_[leaf];
            if (!n.bursty || n.shadowed || n.think < 0 || n.think >= hfq_.preemption_.cost()) continue;
            if (!hfq_.fq_.behind(leaf)) continue;
            until = std::max(until, n.idle_since + 2 * n.think);
        }
        if (until > now) return until;
    }
    if (hfq_.p_.anticipate <= 0 || hfq_.idle_candidates_.empty()) return now;
    Duration fed = hfq_.feeder_.feed_estimate();
    Time until = now;
    for (EntityId leaf : hfq_.idle_candidates_) {
        const Node& n = hfq_.fq_.nodes_[leaf];
        if (n.shadowed || n.idle_since < 0) continue;
        // A long think is not worth an idle GPU: holding it would cost
        // more GPU time than the returning leaf gets back.  An unknown
        // think is probed once with the longest hold.
        Duration wait = n.think < 0 ? hfq_.p_.anticipate : 2 * n.think;
        if (wait > hfq_.p_.anticipate || wait >= fed) continue;
        until = std::max(until, n.idle_since + wait);
    }
    return until;
}

}  // namespace pvgpu::hfq
