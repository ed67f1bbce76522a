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
#include "core/policies/hfq/hfq.hpp"

namespace pvgpu::hfq {

Time HfqPolicy::anticipation_until(Time now) {
    if (can_preempt_) {
        // A bursty leaf back sooner than a preemption would take: keep
        // the engine for it rather than feed and preempt.
        Time until = now;
        for (EntityId leaf : idle_candidates_) {
            Node& n = nodes_[leaf];
            if (!n.bursty || n.shadowed || n.think < 0 || n.think >= preempt_cost_) continue;
            if (!behind(leaf)) continue;
            until = std::max(until, n.idle_since + 2 * n.think);
        }
        if (until > now) return until;
    }
    if (p_.anticipate <= 0 || idle_candidates_.empty()) return now;
    Duration fed = feed_estimate();
    Time until = now;
    for (EntityId leaf : idle_candidates_) {
        const Node& n = nodes_[leaf];
        if (n.shadowed || n.idle_since < 0) continue;
        // A long think is not worth an idle GPU: holding it would cost
        // more GPU time than the returning leaf gets back.  An unknown
        // think is probed once with the longest hold.
        Duration wait = n.think < 0 ? p_.anticipate : 2 * n.think;
        if (wait > p_.anticipate || wait >= fed) continue;
        until = std::max(until, n.idle_since + wait);
    }
    return until;
}

}  // namespace pvgpu::hfq
