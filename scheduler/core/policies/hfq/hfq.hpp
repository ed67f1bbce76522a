// `hfq`: hierarchical fair queuing with continuous, event-based accounting.
// The policy's internal declarations; the pieces are explained where they
// are defined (fair_queue.cpp, feeder.cpp, queue_cap.cpp, anticipation.cpp,
// preemption.cpp, leaves.cpp) and policy.cpp wires the events to them.
#pragma once

#include <algorithm>
#include <array>
#include <cmath>
#include <limits>
#include <set>
#include <unordered_map>
#include <unordered_set>

#include "core/policies/policies.hpp"

namespace pvgpu::hfq {

constexpr double kUnitWeight = 100.0;
// A bursty leaf is protected (preemption, holds) only while its GPU rate
// over about this long is below its fair share.
constexpr Duration kRateWindow = 50 * kMillisecond;
constexpr double kBehind = 0.9;
// Which of two leaves is further below its max-min share is judged over
// this long: over 0.2 s a leaf just fed reads as well served and holds
// starve the others (low-demand 0.0330); from 1 s on within 0.0297, 5 s
// 0.0290, a longer window only following a change of load more slowly.
constexpr Duration kBalanceWindow = 1000 * kMillisecond;
// A bursty leaf stays in the run queue through a think of at most this many
// times `idle_us`: a longer think is not a burst pattern worth holding for.
constexpr int kMaxStay = 4;
// On a non-preemptive engine the engine idles for a thinking leaf that is
// not the worse off at most this many of its bursts before its return, for
// a kernel that would make it wait more than the idle (delays_return).
// Fewer (2) give back part of what the hold buys on low-demand; 4 and more
// idle a long-think leaf's neighbours for nothing.
constexpr Duration kHoldBursts = 3;

struct Key {
    double vtime;
    EntityId id;
    bool operator<(const Key& o) const { return vtime != o.vtime ? vtime < o.vtime : id < o.id; }
};

// Backlogged children of one entity, split by whether they may run.
struct RunQueue {
    std::set<Key> open;
    std::set<Key> blocked;
    double floor = 0;  // monotonic min vtime: returning children start near it

    bool empty() const { return open.empty() && blocked.empty(); }
    double min_vtime() const {
        double m = INFINITY;
        if (!open.empty()) m = open.begin()->vtime;
        if (!blocked.empty()) m = std::min(m, blocked.begin()->vtime);
        return m;
    }
};

// A leaf's GPU time per wall time, averaged exponentially over about
// `window` and brought up to date when read.  Divided by the weight the
// average has gathered since the first read, so a leaf watched for less
// than a window is not read as idle for the rest of it.
struct RateMeter {
    double rate = 0;   // average so far, not yet divided
    double gathered = 0;
    Time at = -1;
    Duration used = 0;

    double read(Duration accounted, Time now, Duration window) {
        if (at < 0) {
            at = now;
            used = accounted;
            return 0;
        }
        if (now > at) {
            const double w = 1 - std::exp(-static_cast<double>(now - at) / static_cast<double>(window));
            rate += w * (static_cast<double>(accounted - used) / static_cast<double>(now - at) - rate);
            gathered += w * (1 - gathered);
            at = now;
            used = accounted;
        }
        return gathered > 0 ? rate / gathered : 0;
    }
};

struct Node {
    double vtime = 0;
    bool active = false;
    bool blocked = false;
    bool shadowed = false;  // leaves: channels are asked to be Shadowed
    bool bursty = false;    // leaves: seen between bursts; trapped while unblocked
    bool metered = false;   // leaves: queue above `queue`: shadowed, fed as the GPU drains it
    bool provisional = false;  // leaves: metered on joining a busy GPU, until a kernel length is learned
    Duration accounted = 0;
    Time idle_since = -1;   // leaves: first moment seen without work, while in the run queue
    Time went_idle = -1;    // leaves: when the current think began, kept after leaving the queue
    Duration think = -1;    // leaves: mean time from going idle to new work, -1 unknown
    Duration burst = -1;    // leaves: mean GPU time charged between a return and going idle
    Duration burst_from = -1;  // leaves: `accounted` at the last return
    Duration turnaround = -1;  // leaves, while blocked: mean time from a completion that left no work to the next store
    // Leaves: GPU rate over kRateWindow (is it behind now?) and over
    // kBalanceWindow (who is further below its share?), read at decisions.
    mutable RateMeter recent, sustained;
    RunQueue rq;
};

struct Params {
    Duration threshold, unblock, lag, idle, grace, anticipate, feed_lead, queue;
    int fair_window;  // siblings above which threshold, unblock and queue shrink (0: never)
};

// How late the return of a leaf held for is seen: the accounting reads an
// idle engine a few times over about a millisecond.
constexpr Duration kReturnSeenWithin = 1 * kMillisecond;

class HfqPolicy final : public Policy {
public:
    explicit HfqPolicy(Params p) : p_(p) {}

    std::string_view name() const override { return "hfq"; }
    void start(PolicyContext& ctx) override;
    void stop() override;
    void channel_added(ChannelId ch, EntityId leaf) override;
    void channel_removed(ChannelId ch, EntityId leaf) override;
    void tree_changed(EntityTree::Change c, EntityId id) override;
    void doorbell_trapped(ChannelId ch, std::uint32_t) override;
    void work_held(ChannelId ch, std::uint32_t) override;
    void fence(ChannelId ch, std::uint32_t) override;
    void channel_error(ChannelId ch, std::uint32_t) override;

    void charged(ChannelId ch, Duration d) override { charge(ch, d); }
    void engine_changed(std::optional<ChannelId> running) override;
    std::optional<Duration> accounted(EntityId leaf) const override;
    std::map<std::string, double> counters() const override;

private:
    Node& node(EntityId id);

    EntityId parent_of(EntityId id) const { return ctx_->tree().get(id).parent; }
    std::uint32_t weight_of(EntityId id) const { return ctx_->tree().get(id).weight; }

    // The shadow page is the host's own memory; pending() is a register read.
    bool has_work(ChannelId ch) const;
    bool leaf_has_work(EntityId leaf) const;
    // At an interrupt the accounting has just read the engine.  The channel
    // on it has work, and an idle engine has nothing pending anywhere (the
    // GPU serves any channel with work): only held entries can be left.
    // Saves a register read per kernel of a leaf that waits on each fence.
    bool has_work_at_fence(ChannelId ch, EntityId leaf) const;

    // ---- accounting ----

    void charge(ChannelId ch, Duration d);

    // ---- run queues ----

    // A channel showed work: its leaf (and ancestors) are backlogged.
    void touch(ChannelId ch);

    // Bursty: an unblocked leaf whose absence let the GPU be fed held work.
    // Its next return must be seen at once to be served at once, so its
    // doorbells trap (a couple of microseconds each) until a think longer
    // than any stay in the run queue shows no burst pattern worth that.
    void set_bursty(EntityId leaf, bool bursty);

    // The leaf's fair share now: w / sum(w) of the backlogged at every level.
    double fair_share(EntityId leaf) const;

    // Is the leaf's recent GPU rate below its fair share?  A leaf that gets
    // its share anyway is not worth an idle or preempted engine.
    bool behind(EntityId leaf);

    // What a leaf asks for: burst / (burst + think) of the GPU once both
    // are learned, else all of it.
    double demand(EntityId id) const;

    // The leaf's max-min fair share: at every level the parent's share is
    // water-filled over the backlogged children by weight, a child that
    // asks for less than its part getting what it asks for and the rest
    // going to the others (an inner entity counts as asking for all).
    // fair_share() is the same without demands.
    double maxmin_share(EntityId leaf) const;

    // How far the leaf is below its max-min share, over a window long
    // against its kernels and thinks (a leaf just fed always looks well
    // served over a short one).  Max-min serves the larger first.
    double shortfall(EntityId leaf) const;

    ChannelMode mode_of(EntityId leaf) const;
    // A channel still trapped since the GPU last idled stays trapped, unless
    // its leaf's mode is stronger, until its own doorbell.
    ChannelMode mode_of(ChannelId ch, EntityId leaf) const;

    // `ch` of an unblocked bursty leaf has new work: if the engine runs
    // work of a blocked leaf (fed from its shadow page, or still running
    // from before the block), take it off.  It resumes later where it was.
    void preempt_for(ChannelId ch);

    // A shadowed leaf seen without work since its last completion has
    // stored its next entry: how long its client takes to submit again
    // (resubmit_wait).  A gap of `idle` or more is a think, not a turnaround.
    void learn_turnaround(EntityId leaf, ChannelId ch);

    // The latest completion timestamp of the leaf's live channels (their
    // own memory), at most now; none if nothing completed.
    std::optional<Time> last_completion(EntityId leaf) const;

    // `exact`: seen by its trapped doorbell, at the moment it happened.
    void mark_busy(EntityId leaf, bool exact = false);

    void activate(EntityId id);

    void deactivate(EntityId id);

    // Among n backlogged siblings each is owed 1/n of any window, so a lead
    // of `threshold` weighs n/fair_window times more than among fair_window:
    // above that many, the bounds shrink with n and keep their weight.  Not
    // below kCrowdFloor (or the configured bound, if smaller): blocks and
    // unblocks churn once the threshold is shorter than a kernel (the
    // simulator's 128-client U rises again below 0.2 ms).
    static constexpr Duration kCrowdFloor = 250 * kMicrosecond;
    double crowd_scale(std::size_t n, Duration bound) const;
    Duration queue_cap() const;

    // Block children too far ahead of the least-served; unblock those back in range.
    void rebalance(EntityId parent);

    // A leaf thinking between bursts stays in the run queue, where its vtime
    // banks credit.  One that asks for less than its fair share would bank
    // it without bound and pin every sibling to its own pace (a sibling
    // asking more than it, but less than its share, was held to it: 0.139
    // of 0.25 on the timeslice GPU).  Max-min owes it its demand, not a
    // pace: it is kept at most `lag` behind the least-served sibling with
    // work, as it would be on returning to the queue.
    void lift_thinking(RunQueue& rq);

    void unblock(RunQueue& rq, Key k);

    // Re-derive the channel modes of every leaf below `id`.
    void refresh(EntityId id);

    // ---- queue cap ----

    // Learned work of the leaf's entries the GPU has but has not started
    // (its own IB_PUT - IB_GET): what would still run if it were blocked now.
    // A dead channel's registers stay where the GPU stopped: nothing of it
    // runs, nothing counts.  With `held`, the entries held back in its
    // shadow pages count too.
    Duration queued(EntityId leaf, bool held = false) const;
    // A live channel's entries on the GPU not yet started (its IB_PUT -
    // IB_GET), and its kernel length: one register read, of IB_GET (the
    // host knows a trapped or shadowed channel's IB_PUT).
    struct Queue {
        ChannelId ch;
        std::uint32_t waiting;
        Duration length;
        Duration work() const { return static_cast<Duration>(waiting) * length; }
    };
    Queue queue_of(ChannelId ch) const;
    std::vector<Queue> queues_of(EntityId leaf) const;

    // The accounting learns a kernel's length from its completion
    // interrupt.  A channel whose entries ask for none has it learned here
    // instead, as its charged GPU time over the entries the GPU started
    // (its own IB_GET): otherwise a tenant could keep its queue uncapped
    // by never asking for an interrupt.  0: not known yet.
    Duration kernel_length(ChannelId ch, std::optional<std::uint32_t> get = std::nullopt) const;
    // The GPU reports every channel it stops (channel_error): no register read.
    bool live(ChannelId ch) const;

    // Every live channel of the leaf that has work has a kernel length.
    bool learned(EntityId leaf) const;

    void set_metered(EntityId leaf, bool metered);

    // A metered leaf is fed at its own completions and when its channel is
    // seen leaving the engine.  An entry that asked for no interrupt and ran
    // unseen between two reads ends unheard: such a leaf (held work, nothing
    // left on the GPU) is looked for whenever the engine is seen idle, and
    // otherwise at most once per `queue` of events, so a scan over the
    // metered leaves is not paid per kernel.
    void feed_unheard();

    // Whether the GPU still has work of `ch`, known without a register read.
    // Work stops pending only when its last entry completes, and every
    // completion moves the channel's completion timestamp (written with the
    // fence, interrupt or not): a channel read pending that has completed
    // nothing since still is.
    bool known_pending(ChannelId ch) const;
    bool read_pending(ChannelId ch);

    // Meter a leaf whose queue has grown past `queue` while it shares the
    // GPU; feed a metered, unblocked one up to `queue`.
    void meter(EntityId leaf);

    void apply_modes(EntityId leaf);

    // ---- idleness, work conservation ----

    void arm_idle_check(Time at);

    // How long a leaf without work stays in the run queue: `idle`, or for a
    // bursty leaf a little over its learned think time (CFQ's slice_idle),
    // so that it is still owed its share, and protected, when it returns.
    Duration stay_of(const Node& n) const;

    // Leaves without work for stay_of() leave the run queue; once none is
    // left and the engine is idle, every doorbell traps.
    void idle_check();

    // Nothing runs and nothing waits: trap the next doorbell.  Each channel
    // stays trapped until its own doorbell (or a stronger mode of its
    // leaf): switching every channel back at the first doorbell of any
    // remapped each channel twice per idle spell, 37045 remaps in 10 s for
    // a 55 ms pulse beside 100 channels that never submit.
    void arm_idle();

    // `ch` rang (a trapped doorbell): the first since the idle arming wakes
    // hfq; its own idle trap is done either way.
    void leave_idle_trap(ChannelId ch);

    void wake_from_idle();

    void after_event();

    // How late every interrupt reaches the host: the handler's time against
    // the completion timestamp the GPU wrote with the fence, the least of
    // the last few.  A stalled host makes some late, not all.
    void learn_latency(ChannelId ch);

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
    // The last cover entry has not started yet.
    bool cover_pending();

    // Look at the idle engine again (release_if_idle) no later than `at`.
    void release_by(Time at);

    // Until when to keep the engine idle for an unblocked leaf between
    // bursts; `now` or earlier when no leaf is worth waiting for.
    Time anticipation_until(Time now);

    // The learned kernel length of what release_if_idle() would feed next;
    // unknown counts as long (the worst case for a returning leaf).
    Duration feed_estimate();
    // `pessimistic`: the learned length plus twice its spread, which few
    // of the leaf's kernels outlast (a mean alone is outlasted by half).
    Duration feed_estimate(EntityId leaf, bool pessimistic = false) const;

    // The engine stayed idle although shadowed channels hold work: feed it
    // from the least-ahead blocked leaf that has some.
    void release_if_idle();

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

    // `ch`'s kernel ended (or the channel did): it is no longer the fed or
    // the cut one.
    void forget_kernel(ChannelId ch);

    // How far a leaf is ahead of its least-ahead siblings, summed over the
    // levels where it is blocked.
    double lead_of(EntityId leaf) const;

    // The least-ahead shadowed leaf that holds work, or kNoEntity.
    EntityId feed_candidate(bool* beyond_cap = nullptr) const;

    // Would a kernel of length `est` (`longest`: the length few of its
    // kernels outlast) fed now make an unblocked leaf between bursts wait
    // longer on its return than the engine would idle until then (an
    // unknown think: it may return at any moment)?
    bool delays_return(EntityId fed, Duration est, Duration longest) const;

    Params p_;
    PolicyContext* ctx_ = nullptr;
    std::vector<Node> nodes_;
    std::unordered_map<ChannelId, EntityId> chans_;
    // Per channel: GPU time charged and IB_GET when it was added.
    struct ChannelRuns {
        Duration charged;
        std::uint32_t get_at_open;
        bool dead;                            // the GPU stopped it (channel_error)
        std::optional<Time> pending_as_of;    // read pending at this completion timestamp
    };
    std::unordered_map<ChannelId, ChannelRuns> runs_;
    std::set<EntityId> shadowed_leaves_;
    std::set<EntityId> idle_candidates_;  // active leaves seen without work
    std::set<EntityId> metered_;
    std::vector<EntityId> scan_;  // feed_unheard's copy of metered_
    mutable std::vector<EntityId> ancestors_;               // maxmin_share's scratch
    mutable std::vector<std::pair<double, double>> fill_;   // ... and its water-filling
    std::vector<Key> lifted_;                                // lift_thinking's scratch
    bool scanning_ = false;       // feed_unheard is walking scan_
    Time scanned_at_ = -1;      // last look for metered leaves left without work on the GPU
    ChannelId left_engine_ = 0; // the channel last seen on the engine (0: idle)
    ChannelId last_left_ = 0;   // the channel last seen leaving it
    std::size_t active_leaves_ = 0;
    Timer idle_timer_;
    Time idle_check_at_ = 0;
    Timer grace_timer_;
    Time grace_at_ = 0;
    Timer preempt_timer_;
    ChannelId fed_ch_ = 0;  // channel of the fed kernel on the engine since fed_at_, if any
    Time fed_at_ = 0;
    std::optional<Time> fed_done_;  // the fed channel's completion timestamp when fed
    bool fed_beyond_cap_ = false;   // fed past the cap: a returning leaf may preempt it
    ChannelId cut_ch_ = 0;          // such a kernel, preempted, not yet completed
    Duration cut_ran_ = 0;          // ... had run this long
    Time cut_back_at_ = -1;         // ... was seen back on the engine then (-1: not yet)
    std::optional<Time> cut_done_;  // ... and its channel's completion timestamp when cut
    bool can_preempt_ = false;
    Duration preempt_cost_ = 0;
    Time held_until_ = -1;  // end of the last anticipation hold
    bool idle_armed_ = false;
    std::unordered_set<ChannelId> idle_trapped_;  // trapped at the idle arming, not rung since
    bool feeding_ = false;  // work conservation is handing out held entries
    std::array<Duration, 16> latencies_{};  // the last interrupts' latencies (0 until seen)
    std::size_t latency_next_ = 0;
    Duration irq_latency_ = 0;   // the least of them
    ChannelId cover_ch_ = 0;     // the channel of the last cover entry
    std::uint32_t cover_put_ = 0;  // ... its IB_PUT after that release
    std::uint64_t blocks_ = 0;
    std::uint64_t unblocks_ = 0;
    std::uint64_t wc_releases_ = 0;
    std::uint64_t idle_arms_ = 0;
    std::uint64_t anticipations_ = 0;
    std::uint64_t preemptions_ = 0;
    std::uint64_t meters_ = 0;
    std::uint64_t metered_releases_ = 0;
    std::uint64_t covers_ = 0;
};

}  // namespace pvgpu::hfq
