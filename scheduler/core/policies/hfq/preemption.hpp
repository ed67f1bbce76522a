#pragma once

#include "core/policies/hfq/fair_queue.hpp"

namespace pvgpu::hfq {

class HfqPolicy;

// Preemption: on a preemptive engine a returning bursty leaf below its fair
// share takes the engine from a blocked leaf's kernel (host preemption, a
// modeled dead time), unless that kernel is learned to end sooner than the
// preemption would take.  A kernel fed past the feed cap is the returning
// leaf's to take whatever its share (and again when it resumes, while its
// leaf is still past the cap): there, feeding it costs the returning leaf a
// preemption's dead time instead of the rest of the kernel, which is what
// lets hfq feed rather than idle.
//
// State: whether the engine can preempt and at what cost, and the kernel
// cut (cut_*) until it completes.
class Preemption {
public:
    explicit Preemption(HfqPolicy& hfq) : hfq_(hfq) {}

    // Learns whether the engine can preempt, and at what cost.
    void start(Timers& timers, const EngineArbitration& engine);
    void stop() { preempt_timer_.cancel(); }
    bool possible() const { return can_preempt_; }
    Duration cost() const { return preempt_cost_; }
    // `ch` of an unblocked bursty leaf rang: once its write has reached the
    // GPU, over-served work on the engine gives way to it.
    void returned(ChannelId ch, Time now);
    // `ch` is on the engine: a cut kernel is seen back.
    void seen_running(ChannelId ch, Time now) {
        if (ch == cut_ch_) cut_back_at_ = now;
    }
    // `ch`'s kernel ended (or the channel did): it is no longer the cut one.
    void forget_kernel(ChannelId ch) {
        if (cut_ch_ == ch) cut_ch_ = 0;
    }
    std::uint64_t preemptions() const { return preemptions_; }

private:
    // `ch` of an unblocked bursty leaf has new work: if the engine runs
    // work of a blocked leaf (fed from its shadow page, or still running
    // from before the block), take it off.  It resumes later where it was.
    void preempt_for(ChannelId ch);

    HfqPolicy& hfq_;
    Timer preempt_timer_;
    ChannelId cut_ch_ = 0;          // such a kernel, preempted, not yet completed
    Duration cut_ran_ = 0;          // ... had run this long
    Time cut_back_at_ = -1;         // ... was seen back on the engine then (-1: not yet)
    std::optional<Time> cut_done_;  // ... and its channel's completion timestamp when cut
    bool can_preempt_ = false;
    Duration preempt_cost_ = 0;
    std::uint64_t preemptions_ = 0;
};

}  // namespace pvgpu::hfq
