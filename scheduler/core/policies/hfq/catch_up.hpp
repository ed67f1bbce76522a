#pragma once

#include <map>
#include "core/policies/hfq/fair_queue.hpp"

namespace pvgpu::hfq {

class HfqPolicy;

// Catching up (EEVDF's lag, BFQ's weight raising of sync queues): a leaf
// that comes back from a think below its fair share is served at once, up
// to the credit it earned while thinking.  While it catches up every other
// active leaf is held (shadowed), whatever the levels above say, so from
// the next kernel boundary the GPU gets no new work but the returning
// leaf's; on a preemptive engine its trapped doorbell also takes the engine
// (Preemption).  Its charges walk up the tree as any other, so the levels
// above pay it back after: the holds move GPU time in time, not between
// tenants.
//
// The credit: a leaf of fair share s that thought for T is owed a burst of
// T * s / (1 - s), the burst that keeps its whole cycle at s (a leaf at
// share 1/3 back from 3 ms may run 1.5 ms at once), and never more than
// `lag` of its virtual time.  It ends as soon as the leaf has spent it, has
// no work left, or its GPU rate reaches its share (`behind`): a tenant that
// thinks briefly and returns with a flood gets what a steady one would.
//
// State: the leaves catching up, each with what it had been charged at its
// return and its credit.
class CatchUp {
public:
    explicit CatchUp(HfqPolicy& hfq) : hfq_(hfq) {}

    // `leaf`, active again, is back from a think of `think`.
    void returned(EntityId leaf, Duration think);
    // `leaf` was charged: its catch-up ends once its credit is spent or it
    // is no longer behind its share.
    void charged(EntityId leaf);
    // `leaf` has no work left, left the run queue or is gone.
    void ended(EntityId leaf);
    bool catching_up(EntityId leaf) const { return catching_.count(leaf) > 0; }
    bool any() const { return !catching_.empty(); }
    // What is left of the leaf's credit (0: not catching up).
    Duration credit(EntityId leaf) const;
    // Whether the leaf's channels are shadowed, given whether a level above
    // it is blocked.
    bool shadowed(EntityId leaf, bool blocked_above) const;
    std::uint64_t catch_ups() const { return catch_ups_; }

private:
    struct Credit {
        Duration charged_at_return;
        Duration credit;
    };
    // Re-derive the shadows of every leaf that has channels (the holds
    // began or ended).
    void refresh_all();

    HfqPolicy& hfq_;
    std::map<EntityId, Credit> catching_;
    std::uint64_t catch_ups_ = 0;
};

}  // namespace pvgpu::hfq
