#pragma once

#include "core/policies/hfq/fair_queue.hpp"

namespace pvgpu::hfq {

class HfqPolicy;

// Work conservation: if the engine stays idle for a short grace period while
// shadowed channels hold work, the least-ahead of them gets one entry released
// from its shadow page (a partial release: no remap, it stays blocked).  A
// less-ahead blocked leaf whose kernel just completed first gets its learned
// turnaround to submit again (resubmit_wait): a client with one kernel in
// flight has nothing held at that moment.
//
// Feed lead and feed cap: feeding stops once the least-ahead blocked leaf
// is `feed_lead` ahead, if its learned kernel would delay the thinking
// leaf's learned return and either the thinking leaf is further below its
// max-min share (demands water-filled by weight, GPU rates over the last
// second) than the fed one, or, within a few of its bursts of the return,
// the delay is longer than the engine would idle until then.  The fed leaf
// cannot run away from a leaf that is owed the GPU when it comes back, and
// the engine idles only while the leaf it idles for is the worse off.
//
// State: the fed kernel (fed_*: a returning leaf may take it back, see
// Preemption), the grace timer, and the interrupt latency that sizes a cover.
class Feeder {
public:
    explicit Feeder(HfqPolicy& hfq) : hfq_(hfq) {}

    void start(Timers& timers) { grace_timer_.bind(timers); }
    void stop() { grace_timer_.cancel(); }
    // The engine stayed idle although shadowed channels hold work: feed it
    // from the least-ahead blocked leaf that has some.
    void release_if_idle();
    // Look at the idle engine again (release_if_idle) no later than `at`.
    void release_by(Time at);
    // Keep the engine idle until `at` (anticipation), unless a look is due
    // later already: whether the look moved.
    bool hold_until(Time at);
    // Whether held entries are being handed out; unblocked work runs again.
    bool feeding() const { return feeding_; }
    void rest() { feeding_ = false; }
    // A leaf that waits on each fence hears of its kernel's end an
    // interrupt's latency late, and the engine idles until it stores the
    // next one.  When it runs alone (every other leaf with work blocked)
    // and nothing of its own waits behind its kernel, one held entry of the
    // least-ahead blocked leaf, if that is within `feed_lead`, is queued
    // behind it: the engine runs that across the turnaround instead of
    // idling, and the leaf's next kernel follows it.  Virtual time keeps the
    // shares (the covering leaf is charged and stays blocked); an engine
    // that idles only where two of the waiting leaf's kernels must follow
    // one another is the least idle a fair schedule has.  A latency
    // shorter than `grace` is not worth it.
    void cover(ChannelId ch, EntityId runner);
    // How late every interrupt reaches the host: the handler's time against
    // the completion timestamp the GPU wrote with the fence, the least of
    // the last few.  A stalled host makes some late, not all.
    void learn_latency(ChannelId ch);
    // The learned kernel length of what release_if_idle() would feed next;
    // unknown counts as long (the worst case for a returning leaf).
    Duration feed_estimate();

    // The fed kernel, for a returning leaf that may take the engine back:
    // when `running` was fed (nullopt: it is not the fed kernel), whether
    // past the feed cap; preempted(): taken off the engine.
    std::optional<Time> fed_at(ChannelId running) const {
        return fed_ch_ == running ? std::optional<Time>(fed_at_) : std::nullopt;
    }
    bool fed_beyond_cap(ChannelId running) const { return fed_beyond_cap_ && fed_ch_ == running; }
    void preempted() {
        fed_ch_ = 0;
        feeding_ = false;
    }
    // The fed kernel may have ended without an interrupt: its channel's
    // completion timestamp moved since (memory, not a register).
    void forget_ended();
    // `ch`'s kernel ended (or the channel did): it is no longer the fed one.
    void forget_kernel(ChannelId ch) {
        if (fed_ch_ == ch) fed_ch_ = 0;
    }
    std::uint64_t releases() const { return wc_releases_; }
    std::uint64_t covers() const { return covers_; }

private:
    // The last cover entry has not started yet.
    bool cover_pending();
    // `pessimistic`: the learned length plus twice its spread, which few
    // of the leaf's kernels outlast (a mean alone is outlasted by half).
    Duration feed_estimate(EntityId leaf, bool pessimistic = false) const;
    // A client with one kernel in flight submits the next only after the
    // last completed: at that completion its shadow page is empty, while a
    // leaf further ahead has work held.  Fed at once, the further one would
    // win every time: two such clients alternate kernel for kernel, and one
    // with 6 ms kernels got 0.96 of the two's GPU time against one with
    // 250 us kernels, both blocked behind a bursty third (as under `none`).
    // So a blocked leaf less ahead than `best` (the leaf about to be fed),
    // whose work ended just now, is given its learned turnaround twice over
    // (at least `grace`, at most its own burst: an engine idle longer than
    // the work it lets in costs the others more than the leaf gets back) to
    // submit again, unless `best`'s kernel is shorter than the wait left.
    // A leaf whose turnaround is longer than its burst is not turning
    // around but thinking: a bursty leaf, not waited for here.  Until when;
    // or -1.
    Time resubmit_wait(EntityId best) const;
    // The least-ahead shadowed leaf that holds work, or kNoEntity.
    EntityId feed_candidate(bool* beyond_cap = nullptr) const;
    // The thinking leaf below its share expected back first, or null.
    const Node* next_return() const;
    // A leaf below its share is thinking.  On a non-preemptive engine it
    // waits on its return for the kernel it finds running, so of the leaves
    // within `threshold` of the least-ahead `best` (a lead the fair queue
    // tolerates anyway) feed one whose kernel ends before that return; a
    // kernel that cannot end before it goes first in the think, where it
    // overruns the least, not after the others.
    EntityId fit_to_return(EntityId best, double best_lead) const;
    // Would a kernel of length `est` (`longest`: the length few of its
    // kernels outlast) fed now make an unblocked leaf between bursts wait
    // longer on its return than the engine would idle until then (an
    // unknown think: it may return at any moment)?
    bool delays_return(EntityId fed, Duration est, Duration longest) const;

    HfqPolicy& hfq_;
    Timer grace_timer_;
    Time grace_at_ = 0;
    ChannelId fed_ch_ = 0;  // channel of the fed kernel on the engine since fed_at_, if any
    Time fed_at_ = 0;
    std::optional<Time> fed_done_;  // the fed channel's completion timestamp when fed
    bool fed_beyond_cap_ = false;   // fed past the cap: a returning leaf may preempt it
    bool feeding_ = false;  // work conservation is handing out held entries
    std::array<Duration, 16> latencies_{};  // the last interrupts' latencies (0 until seen)
    std::size_t latency_next_ = 0;
    Duration irq_latency_ = 0;   // the least of them
    ChannelId cover_ch_ = 0;     // the channel of the last cover entry
    std::uint32_t cover_put_ = 0;  // ... its IB_PUT after that release
    mutable std::vector<std::pair<double, EntityId>> candidates_;  // feed_candidate's scratch: (lead, leaf)
    std::uint64_t wc_releases_ = 0;
    std::uint64_t covers_ = 0;
};

}  // namespace pvgpu::hfq
