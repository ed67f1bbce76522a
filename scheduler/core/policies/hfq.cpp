// `hfq`: hierarchical fair queuing with continuous, event-based accounting.
//
// Accounting: the scheduler's own (scheduler/core/accounting.*, the same under
// every policy) charges GPU time from completion interrupts and engine-status
// reads at those moments; hfq advances its virtual time by those charges.  It
// never polls the engine: no exclusive sampling phase, no traps while busy, no
// wake-ups while the GPU runs.
//
// Fairness (CFS group scheduling): every inner entity has a run queue of its
// backlogged children ordered by per-level virtual time; a child's vtime
// advances by gpu_time * 100 / weight.  A child more than `threshold` ahead of
// the least-served backlogged sibling is blocked: every channel below it is
// shadowed, so its guest keeps writing but the GPU sees nothing.  It is
// unblocked once it falls back within `unblock`.  A leaf's share is therefore
// the product of w / sum(w) over its ancestors, enforced level by level, which
// is why a VM that sends no (or lying) pid hints only hurts itself.
//
// Work conservation: if the engine stays idle for a short grace period while
// shadowed channels hold work, the least-ahead of them gets one entry released
// from its shadow page (a partial release: no remap, it stays blocked).  A
// less-ahead blocked leaf whose kernel just completed first gets its learned
// turnaround to submit again (resubmit_wait): a client with one kernel in
// flight has nothing held at that moment.
// A shadowed leaf's new work is seen from the device's report of its
// doorbell (work_held), a direct leaf's from its completions and the
// accounting's reads.  When nothing has had work for `idle_us`, every
// channel traps its next doorbell, so a returning host is seen at once.
//
// Bursty leaves (BFQ's idling, EEVDF's lag): an unblocked leaf whose absence
// left the engine idle with held work is thinking between bursts.  Its
// doorbells are trapped from then on, so its think time is learned exactly.
// Feeding stops once the least-ahead blocked leaf is `feed_lead` ahead,
// if its learned kernel would delay the thinking leaf's learned return and
// either the thinking leaf is further below its max-min share (demands
// water-filled by weight, GPU rates over the last second) than the fed
// one, or, within a few of its bursts of the return, the delay is longer
// than the engine would idle until then.  The fed leaf cannot run away
// from a leaf that is owed the GPU when it comes back, and the engine
// idles only while the leaf it idles for is the worse off.  A returning leaf
// keeps up to `lag` of credit, more than `threshold`, so its siblings stay
// blocked while it bursts.  On a preemptive engine a returning bursty leaf
// below its fair share takes the engine from a blocked leaf's kernel (host
// preemption, a modeled dead time), unless that kernel is learned to end
// sooner than the preemption would take.  A kernel fed past the feed cap is
// the returning leaf's to take whatever its share (and again when it
// resumes, while its leaf is still past the cap): there, feeding it costs
// the returning leaf a preemption's dead time instead of the rest of the
// kernel, which is what lets hfq feed rather than idle.
//
// Queue cap (the queue depth limits of BFQ and of the kernel's
// blk-wbt): blocking stops what a leaf submits next, not what it has already
// queued on the GPU, which keeps running in turn with everyone else.  A
// client that keeps many long kernels queued would run that far ahead of
// its siblings after every block.  So once a leaf that shares the GPU has
// more than `queue` of learned work waiting on it, its channels stay
// shadowed and hfq hands the GPU its held entries one at a time as it
// drains them (at a completion, when a store is reported, or when its
// channel is seen leaving the engine): never less
// than one entry waiting, never more than `queue` of work.  It is direct
// again once it has the GPU to itself or leaves the run queue.  A channel
// that joins a busy GPU is metered from its first entry, one at a time,
// until a kernel length sizes its queue.
//
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
#include <algorithm>
#include <array>
#include <cmath>
#include <limits>
#include <set>
#include <unordered_map>
#include <unordered_set>

#include "policies.hpp"

namespace pvgpu {

namespace {

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

    void start(PolicyContext& ctx) override {
        ctx_ = &ctx;
        idle_timer_.bind(ctx.timers());
        grace_timer_.bind(ctx.timers());
        preempt_timer_.bind(ctx.timers());
        const EngineArbitration engine = ctx.gpu().arbitration();
        // A preemption as slow as a slice buys nothing over its end.
        can_preempt_ = engine.preemptive && engine.preempt < engine.timeslice;
        preempt_cost_ = engine.preempt;
        arm_idle_check(ctx.now() + p_.idle);
    }

    void stop() override {
        idle_timer_.cancel();
        grace_timer_.cancel();
        preempt_timer_.cancel();
        for (auto& [ch, leaf] : chans_) ctx_->set_mode(ch, ChannelMode::Direct);
        idle_trapped_.clear();
    }

    void channel_added(ChannelId ch, EntityId leaf) override {
        node(leaf);
        chans_[ch] = leaf;
        runs_[ch] = ChannelRuns{0, ctx_->gpu().read_ib_get(ch), ctx_->gpu().read_status(ch) != PVGPU_CHAN_STATUS_OK, std::nullopt};
        // A channel that joins a busy GPU has no kernel length learned, so
        // the cap cannot size its queue: the client's first queue would
        // reach the GPU whole and run that far ahead of everyone.  It is
        // metered from its first entry until a length is learned.  (A leaf
        // already running keeps its mode: metering it would remap its
        // running channels for the sake of one that may not queue deep.)
        Node& n = nodes_[leaf];
        if (p_.queue > 0 && !n.metered && !n.active && active_leaves_ > 0) {
            n.provisional = true;
            set_metered(leaf, true);
        }
        if (idle_armed_) idle_trapped_.insert(ch);
        ctx_->set_mode(ch, idle_armed_ ? ChannelMode::Trapped : mode_of(leaf));
        // The idle check found no channel to trap (none had opened): look
        // again for this one, or its first work on an idle GPU goes unheard.
        if (!idle_armed_ && active_leaves_ == 0) arm_idle_check(ctx_->now() + p_.idle);
    }

    void channel_removed(ChannelId ch, EntityId leaf) override {
        chans_.erase(ch);
        idle_trapped_.erase(ch);
        runs_.erase(ch);
        forget_kernel(ch);
        if (left_engine_ == ch) left_engine_ = 0;
        if (last_left_ == ch) last_left_ = 0;
        // The scheduler drops the channel after this call.
        bool others = false;
        for (ChannelId c : ctx_->channels_of(leaf)) others = others || (c != ch && has_work(c));
        if (!others && leaf < nodes_.size() && nodes_[leaf].active) deactivate(leaf);
    }

    void tree_changed(EntityTree::Change c, EntityId id) override {
        if (c == EntityTree::Change::Added) {
            node(id) = Node{};
        } else if (c == EntityTree::Change::Removed) {
            if (id < nodes_.size() && nodes_[id].active) deactivate(id);
            if (id < nodes_.size()) nodes_[id] = Node{};
            shadowed_leaves_.erase(id);
            metered_.erase(id);
            idle_candidates_.erase(id);
        } else if (c == EntityTree::Change::Weight) {
            // New weights apply to future charges; re-check the sibling level now.
            // A policy set at run time learns entities from their channels: a
            // parent it has no node for has no run queue to re-check.
            EntityId parent = ctx_->tree().get(id).parent;
            if (parent < nodes_.size()) rebalance(parent);
        }
    }

    void doorbell_trapped(ChannelId ch, std::uint32_t) override {
        leave_idle_trap(ch);
        // The write is forwarded after this returns, so the GPU does not show
        // it as pending yet: the doorbell itself is the evidence of work.
        auto it = chans_.find(ch);
        if (it == chans_.end()) return;
        mark_busy(it->second, true);
        // A bursty leaf is back: over-served work on the engine gives way to
        // it once the write has reached the GPU.
        if (can_preempt_ && nodes_[it->second].bursty && !nodes_[it->second].shadowed)
            preempt_timer_.arm(ctx_->now(), [this, ch] { preempt_for(ch); });
    }

    void work_held(ChannelId ch, std::uint32_t) override {
        idle_trapped_.erase(ch);  // shadowed now: it rang, and is not trapped
        if (auto it = chans_.find(ch); it != chans_.end()) {
            // A metered leaf's store is reported as it happens, like a trap.
            const EntityId leaf = it->second;
            learn_turnaround(leaf, ch);
            mark_busy(leaf, nodes_[leaf].metered && !nodes_[leaf].shadowed);
            meter(leaf);
            // A metered bursty leaf returns through here, not through a
            // trapped doorbell: it may preempt as doorbell_trapped() lets it.
            const Node& n = nodes_[leaf];
            if (can_preempt_ && n.bursty && n.metered && !n.shadowed)
                preempt_timer_.arm(ctx_->now(), [this, ch] { preempt_for(ch); });
        }
        // New held work while the engine idles: work conservation may feed it.
        after_event();
    }

    void fence(ChannelId ch, std::uint32_t) override {
        forget_kernel(ch);
        learn_latency(ch);
        touch(ch);
        // A channel that stays on the engine shows no engine change: its
        // leaf is fed (or found past the cap) here.
        if (auto it = chans_.find(ch); it != chans_.end()) meter(it->second);
        after_event();
    }

    void channel_error(ChannelId ch, std::uint32_t) override {
        forget_kernel(ch);
        if (auto r = runs_.find(ch); r != runs_.end()) r->second.dead = true;
        after_event();
    }

    void charged(ChannelId ch, Duration d) override { charge(ch, d); }

    void engine_changed(std::optional<ChannelId> running) override {
        // The channel that left the engine may have ended an entry that
        // asked for no interrupt: feed it now if metered, or see whether
        // its queue is past the cap (a leaf without interrupts has no
        // completions to look at it otherwise).
        if (auto it = chans_.find(left_engine_); left_engine_ != 0 && it != chans_.end()) meter(it->second);
        if (left_engine_ != 0 && left_engine_ != running.value_or(0)) last_left_ = left_engine_;
        left_engine_ = running.value_or(0);
        if (running && *running == cut_ch_) cut_back_at_ = ctx_->now();
        // On the engine, it has work: no register read to ask.
        if (running)
            if (auto it = chans_.find(*running); it != chans_.end()) mark_busy(it->second);
        after_event();
    }

    std::optional<Duration> accounted(EntityId leaf) const override {
        if (leaf >= nodes_.size()) return Duration{0};
        return nodes_[leaf].accounted;
    }

    std::map<std::string, double> counters() const override {
        return {{"blocks", static_cast<double>(blocks_)},
                {"unblocks", static_cast<double>(unblocks_)},
                {"work_conserving_releases", static_cast<double>(wc_releases_)},
                {"covers", static_cast<double>(covers_)},
                {"idle_arms", static_cast<double>(idle_arms_)},
                {"anticipations", static_cast<double>(anticipations_)},
                {"preemptions", static_cast<double>(preemptions_)},
                {"meters", static_cast<double>(meters_)},
                {"metered_releases", static_cast<double>(metered_releases_)}};
    }

private:
    Node& node(EntityId id) {
        if (nodes_.size() <= id) nodes_.resize(std::max<std::size_t>(id + 1, ctx_->tree().id_bound()));
        return nodes_[id];
    }

    EntityId parent_of(EntityId id) const { return ctx_->tree().get(id).parent; }
    std::uint32_t weight_of(EntityId id) const { return ctx_->tree().get(id).weight; }

    // The shadow page is the host's own memory; pending() is a register read.
    bool has_work(ChannelId ch) const {
        return ctx_->held(ch) > 0 || ctx_->gpu().pending(ch);
    }
    bool leaf_has_work(EntityId leaf) const {
        for (ChannelId c : ctx_->channels_of(leaf))
            if (has_work(c)) return true;
        return false;
    }
    // At an interrupt the accounting has just read the engine.  The channel
    // on it has work, and an idle engine has nothing pending anywhere (the
    // GPU serves any channel with work): only held entries can be left.
    // Saves a register read per kernel of a leaf that waits on each fence.
    bool has_work_at_fence(ChannelId ch, EntityId leaf) const {
        const std::optional<ChannelId> running = ctx_->running_seen();
        if (running == ch) return true;
        if (running) return leaf_has_work(leaf);
        for (ChannelId c : ctx_->channels_of(leaf))
            if (ctx_->held(c) > 0) return true;
        return false;
    }

    // ---- accounting ----

    void charge(ChannelId ch, Duration d) {
        auto it = chans_.find(ch);
        if (it == chans_.end()) return;
        EntityId leaf = it->second;
        nodes_[leaf].accounted += d;
        if (auto r = runs_.find(ch); r != runs_.end()) r->second.charged += d;
        for (EntityId id = leaf; id != kRootEntity; id = parent_of(id)) {
            Node& n = nodes_[id];
            double inc = static_cast<double>(d) * kUnitWeight / weight_of(id);
            if (n.active) {
                RunQueue& rq = nodes_[parent_of(id)].rq;
                auto& set = n.blocked ? rq.blocked : rq.open;
                set.erase({n.vtime, id});
                n.vtime += inc;
                set.insert({n.vtime, id});
            } else {
                n.vtime += inc;
            }
        }
        for (EntityId id = parent_of(leaf);; id = parent_of(id)) {
            rebalance(id);
            if (id == kRootEntity) break;
        }
    }

    // ---- run queues ----

    // A channel showed work: its leaf (and ancestors) are backlogged.
    void touch(ChannelId ch) {
        auto it = chans_.find(ch);
        if (it == chans_.end()) return;
        EntityId leaf = it->second;
        if (has_work_at_fence(ch, leaf)) {
            mark_busy(leaf);
        } else if (nodes_[leaf].idle_since < 0) {
            Node& n = nodes_[leaf];
            n.idle_since = ctx_->now();
            n.went_idle = n.idle_since;
            idle_candidates_.insert(leaf);
            arm_idle_check(ctx_->now() + p_.idle);
            if (n.burst_from >= 0) {
                Duration b = n.accounted - n.burst_from;
                n.burst = n.burst < 0 ? b : n.burst + (b - n.burst) / 4;
                n.burst_from = -1;
            }
        } else {
            // Already idle, yet a kernel of it completed: it came back unseen
            // (a direct doorbell) and thinks again.  Its stay in the run queue
            // starts over, or a task whose every think is short would leave
            // it whenever the idle check lands in one.
            Node& n = nodes_[leaf];
            n.idle_since = ctx_->now();
            n.went_idle = n.idle_since;
        }
    }

    // Bursty: an unblocked leaf whose absence let the GPU be fed held work.
    // Its next return must be seen at once to be served at once, so its
    // doorbells trap (a couple of microseconds each) until a think longer
    // than any stay in the run queue shows no burst pattern worth that.
    void set_bursty(EntityId leaf, bool bursty) {
        Node& n = nodes_[leaf];
        if (n.bursty == bursty) return;
        n.bursty = bursty;
        apply_modes(leaf);
    }

    // The leaf's fair share now: w / sum(w) of the backlogged at every level.
    double fair_share(EntityId leaf) const {
        double share = 1;
        for (EntityId id = leaf; id != kRootEntity; id = parent_of(id)) {
            const RunQueue& rq = nodes_[parent_of(id)].rq;
            double sum = nodes_[id].active ? 0 : weight_of(id);
            for (const auto* set : {&rq.open, &rq.blocked})
                for (const Key& k : *set) sum += weight_of(k.id);
            share *= weight_of(id) / sum;
        }
        return share;
    }

    // Is the leaf's recent GPU rate below its fair share?  A leaf that gets
    // its share anyway is not worth an idle or preempted engine.
    bool behind(EntityId leaf) {
        const Node& n = nodes_[leaf];
        const bool first = n.recent.at < 0;
        const double rate = n.recent.read(n.accounted, ctx_->now(), kRateWindow);
        return first || rate < kBehind * fair_share(leaf);
    }

    // What a leaf asks for: burst / (burst + think) of the GPU once both
    // are learned, else all of it.
    double demand(EntityId id) const {
        const Node& n = nodes_[id];
        if (!ctx_->tree().is_leaf(id) || n.think < 0 || n.burst <= 0) return INFINITY;
        return static_cast<double>(n.burst) / static_cast<double>(n.burst + n.think);
    }

    // The leaf's max-min fair share: at every level the parent's share is
    // water-filled over the backlogged children by weight, a child that
    // asks for less than its part getting what it asks for and the rest
    // going to the others (an inner entity counts as asking for all).
    // fair_share() is the same without demands.
    double maxmin_share(EntityId leaf) const {
        ancestors_.clear();
        for (EntityId a = leaf; a != kRootEntity; a = parent_of(a)) ancestors_.push_back(a);
        double share = 1;
        for (auto it = ancestors_.rbegin(); it != ancestors_.rend(); ++it) {
            const EntityId child = *it;
            const RunQueue& rq = nodes_[parent_of(child)].rq;
            fill_.clear();  // (demand per unit weight, weight), relative to `share`
            bool listed = false;
            for (const auto* set : {&rq.open, &rq.blocked})
                for (const Key& k : *set) {
                    fill_.push_back({demand(k.id) / share / weight_of(k.id), double(weight_of(k.id))});
                    listed = listed || k.id == child;
                }
            if (!listed) fill_.push_back({demand(child) / share / weight_of(child), double(weight_of(child))});
            std::sort(fill_.begin(), fill_.end());
            double left = 1, weights = 0;
            for (const auto& f : fill_) weights += f.second;
            double level = 0;  // share per unit weight of those asking for more
            for (const auto& f : fill_) {
                level = left / weights;
                if (f.first >= level) break;
                left -= f.first * f.second;
                weights -= f.second;
            }
            share *= std::min(demand(child) / share, level * weight_of(child));
        }
        return share;
    }

    // How far the leaf is below its max-min share, over a window long
    // against its kernels and thinks (a leaf just fed always looks well
    // served over a short one).  Max-min serves the larger first.
    double shortfall(EntityId leaf) const {
        const Node& n = nodes_[leaf];
        return maxmin_share(leaf) - n.sustained.read(n.accounted, ctx_->now(), kBalanceWindow);
    }

    ChannelMode mode_of(EntityId leaf) const {
        const Node& n = nodes_[leaf];
        if (n.shadowed || n.metered) return ChannelMode::Shadowed;
        return n.bursty ? ChannelMode::Trapped : ChannelMode::Direct;
    }
    // A channel still trapped since the GPU last idled stays trapped, unless
    // its leaf's mode is stronger, until its own doorbell.
    ChannelMode mode_of(ChannelId ch, EntityId leaf) const {
        const ChannelMode m = mode_of(leaf);
        return m == ChannelMode::Direct && idle_trapped_.count(ch) ? ChannelMode::Trapped : m;
    }

    // `ch` of an unblocked bursty leaf has new work: if the engine runs
    // work of a blocked leaf (fed from its shadow page, or still running
    // from before the block), take it off.  It resumes later where it was.
    void preempt_for(ChannelId ch) {
        auto it = chans_.find(ch);
        if (it == chans_.end() || nodes_[it->second].shadowed || !ctx_->gpu().pending(ch)) return;
        // A leaf that thinks for less than a preemption takes would pay one
        // per return: the engine is held for it instead (anticipation_until).
        if (nodes_[it->second].think >= 0 && nodes_[it->second].think < preempt_cost_) return;
        const std::optional<ChannelId> running = ctx_->engine_status();
        if (!running || *running == ch) return;
        auto run = chans_.find(*running);
        if (run == chans_.end() || !nodes_[run->second].shadowed) return;
        // The fed or cut kernel may have ended without an interrupt: its
        // channel's completion timestamp moved since (memory, not a register).
        if (fed_ch_ != 0 && ctx_->gpu().left_engine_at(fed_ch_) != fed_done_) fed_ch_ = 0;
        if (cut_ch_ != 0 && ctx_->gpu().left_engine_at(cut_ch_) != cut_done_) cut_ch_ = 0;
        // Fed past the cap (or resuming after such a kernel was cut, its
        // leaf still past it), the kernel is the returning leaf's to take.
        const bool owed = (fed_beyond_cap_ && fed_ch_ == *running) ||
                          (cut_ch_ == *running && lead_of(run->second) > static_cast<double>(p_.feed_lead));
        if (!owed && !behind(it->second)) return;
        // A fed kernel about to end costs the returning leaf less than a
        // preemption would cost the engine.
        const Time now = ctx_->now();
        // A cut kernel not yet seen back on the engine (the read above is
        // the first look) ran at least what it had run before the cut.
        const Duration ran = fed_ch_ == *running ? now - fed_at_
                             : cut_ch_ == *running
                                 ? cut_ran_ + (cut_back_at_ >= 0 ? now - cut_back_at_ : 0)
                                 : -1;
        if (ran >= 0)
            if (Duration est = ctx_->kernel_estimate(*running); est > 0 && est - ran <= preempt_cost_) return;
        if (!ctx_->preempt(ch)) return;
        ++preemptions_;
        if (owed || cut_ch_ == *running) {
            cut_ch_ = *running;
            cut_ran_ = ran;
            cut_back_at_ = -1;
            cut_done_ = ctx_->gpu().left_engine_at(cut_ch_);
        }
        fed_ch_ = 0;
        feeding_ = false;
    }

    // A shadowed leaf seen without work since its last completion has
    // stored its next entry: how long its client takes to submit again
    // (resubmit_wait).  A gap of `idle` or more is a think, not a turnaround.
    void learn_turnaround(EntityId leaf, ChannelId ch) {
        Node& n = nodes_[leaf];
        if (!n.shadowed || n.idle_since < 0 || ctx_->held(ch) != 1) return;
        const std::optional<Time> done = last_completion(leaf);
        if (!done) return;
        const Duration t = ctx_->now() - *done;
        if (t >= p_.idle) {
            n.turnaround = -1;  // a think: nothing to wait for
            return;
        }
        n.turnaround = n.turnaround < 0 ? t : n.turnaround + (t - n.turnaround) / 4;
    }

    // The latest completion timestamp of the leaf's live channels (their
    // own memory), at most now; none if nothing completed.
    std::optional<Time> last_completion(EntityId leaf) const {
        std::optional<Time> done;
        for (ChannelId ch : ctx_->channels_of(leaf))
            if (const std::optional<Time> t = ctx_->gpu().left_engine_at(ch); live(ch) && t && (!done || *t > *done))
                done = t;
        if (done) done = std::min(*done, ctx_->now());
        return done;
    }

    // `exact`: seen by its trapped doorbell, at the moment it happened.
    void mark_busy(EntityId leaf, bool exact = false) {
        Node& n = nodes_[leaf];
        if (n.went_idle >= 0) {
            // Back from a think (perhaps one longer than `idle`, which took
            // it out of the run queue).  Seen by a trapped doorbell or while
            // the engine was held for it, the time is close (the accounting's
            // settle reads); seen while a fed kernel ran, it is only an upper
            // bound and may only lower the estimate.
            Duration t = ctx_->now() - n.went_idle;
            if (exact || ctx_->now() <= held_until_ + kReturnSeenWithin)
                n.think = n.think < 0 ? t : n.think + (t - n.think) / 4;
            else if (n.think >= 0)
                n.think = std::min(n.think, t);
            if (t > kMaxStay * p_.idle) set_bursty(leaf, false);
        }
        n.idle_since = -1;
        n.went_idle = -1;
        n.burst_from = n.accounted;
        idle_candidates_.erase(leaf);
        activate(leaf);
    }

    void activate(EntityId id) {
        if (id == kRootEntity || nodes_[id].active) return;
        EntityId parent = parent_of(id);
        Node& n = nodes_[id];
        RunQueue& rq = nodes_[parent].rq;
        if (!rq.empty()) rq.floor = std::max(rq.floor, rq.min_vtime());
        // No banked credit: a returning child starts at most `lag` behind.
        n.vtime = std::max(n.vtime, rq.floor - static_cast<double>(p_.lag));
        n.active = true;
        n.blocked = false;
        if (ctx_->tree().is_leaf(id)) ++active_leaves_;
        rq.open.insert({n.vtime, id});
        activate(parent);
        rebalance(parent);
    }

    void deactivate(EntityId id) {
        Node& n = nodes_[id];
        if (!n.active) return;
        EntityId parent = parent_of(id);
        RunQueue& rq = nodes_[parent].rq;
        rq.floor = std::max(rq.floor, rq.min_vtime());
        (n.blocked ? rq.blocked : rq.open).erase({n.vtime, id});
        n.active = false;
        n.idle_since = -1;
        if (ctx_->tree().is_leaf(id)) {
            --active_leaves_;
            idle_candidates_.erase(id);
            set_metered(id, false);
            // Alone on the GPU, a leaf has nobody to run ahead of.  One that
            // has not started keeps its meter until it does.
            if (active_leaves_ == 1)
                for (EntityId m : std::set<EntityId>(metered_))
                    if (nodes_[m].active) set_metered(m, false);
            if (active_leaves_ == 0) arm_idle_check(ctx_->now() + p_.idle);
        }
        if (n.blocked) {
            n.blocked = false;
            refresh(id);
        }
        if (rq.empty()) {
            if (parent != kRootEntity) deactivate(parent);
        } else {
            rebalance(parent);
        }
    }

    // Among n backlogged siblings each is owed 1/n of any window, so a lead
    // of `threshold` weighs n/fair_window times more than among fair_window:
    // above that many, the bounds shrink with n and keep their weight.  Not
    // below kCrowdFloor (or the configured bound, if smaller): blocks and
    // unblocks churn once the threshold is shorter than a kernel (the
    // simulator's 128-client U rises again below 0.2 ms).
    static constexpr Duration kCrowdFloor = 250 * kMicrosecond;
    double crowd_scale(std::size_t n, Duration bound) const {
        if (p_.fair_window <= 0 || n <= static_cast<std::size_t>(p_.fair_window) || bound <= 0) return 1.0;
        const double scale = static_cast<double>(p_.fair_window) / static_cast<double>(n);
        const double floor = std::min(1.0, static_cast<double>(kCrowdFloor) / static_cast<double>(bound));
        return std::max(scale, floor);
    }
    Duration queue_cap() const {
        return static_cast<Duration>(crowd_scale(active_leaves_, p_.queue) * static_cast<double>(p_.queue));
    }

    // Block children too far ahead of the least-served; unblock those back in range.
    void rebalance(EntityId parent) {
        RunQueue& rq = nodes_[parent].rq;
        if (rq.empty()) return;
        lift_thinking(rq);
        double m = rq.min_vtime();
        rq.floor = std::max(rq.floor, m);
        // One factor for both bounds, so unblock stays within threshold.
        const double scale = crowd_scale(rq.open.size() + rq.blocked.size(), p_.threshold);
        while (!rq.open.empty() && rq.open.rbegin()->vtime - m > scale * static_cast<double>(p_.threshold)) {
            Key k = *rq.open.rbegin();
            rq.open.erase(k);
            rq.blocked.insert(k);
            nodes_[k.id].blocked = true;
            ++blocks_;
            refresh(k.id);
        }
        while (!rq.blocked.empty() && rq.blocked.begin()->vtime - m <= scale * static_cast<double>(p_.unblock)) {
            unblock(rq, *rq.blocked.begin());
        }
    }

    // A leaf thinking between bursts stays in the run queue, where its vtime
    // banks credit.  One that asks for less than its fair share would bank
    // it without bound and pin every sibling to its own pace (a sibling
    // asking more than it, but less than its share, was held to it: 0.139
    // of 0.25 on the timeslice GPU).  Max-min owes it its demand, not a
    // pace: it is kept at most `lag` behind the least-served sibling with
    // work, as it would be on returning to the queue.
    void lift_thinking(RunQueue& rq) {
        double busy_min = INFINITY;
        for (const auto* set : {&rq.open, &rq.blocked})
            for (const Key& k : *set)
                if (nodes_[k.id].idle_since < 0 || !ctx_->tree().is_leaf(k.id)) {
                    busy_min = std::min(busy_min, k.vtime);
                    break;
                }
        if (!std::isfinite(busy_min)) return;
        const double low = busy_min - static_cast<double>(p_.lag);
        lifted_.clear();
        for (const auto* set : {&rq.open, &rq.blocked})
            for (const Key& k : *set) {
                if (k.vtime >= low) break;
                if (nodes_[k.id].idle_since >= 0 && ctx_->tree().is_leaf(k.id) && demand(k.id) < fair_share(k.id))
                    lifted_.push_back(k);
            }
        for (const Key& k : lifted_) {
            auto& set = nodes_[k.id].blocked ? rq.blocked : rq.open;
            set.erase(k);
            nodes_[k.id].vtime = low;
            set.insert({low, k.id});
        }
    }

    void unblock(RunQueue& rq, Key k) {
        rq.blocked.erase(k);
        rq.open.insert(k);
        nodes_[k.id].blocked = false;
        ++unblocks_;
        refresh(k.id);
    }

    // Re-derive the channel modes of every leaf below `id`.
    void refresh(EntityId id) {
        const Entity& e = ctx_->tree().get(id);
        if (!e.children.empty()) {
            for (EntityId c : e.children) refresh(c);
            return;
        }
        bool shadow = false;
        for (EntityId a = id; a != kRootEntity; a = parent_of(a)) shadow = shadow || nodes_[a].blocked;
        Node& n = nodes_[id];
        if (n.shadowed == shadow) return;
        n.shadowed = shadow;
        if (shadow)
            shadowed_leaves_.insert(id);
        else
            shadowed_leaves_.erase(id);
        apply_modes(id);
        // Unblocked but metered: its held work goes out as the GPU drains it.
        if (!shadow) meter(id);
    }

    // ---- queue cap ----

    // Learned work of the leaf's entries the GPU has but has not started
    // (its own IB_PUT - IB_GET): what would still run if it were blocked now.
    // A dead channel's registers stay where the GPU stopped: nothing of it
    // runs, nothing counts.  With `held`, the entries held back in its
    // shadow pages count too.
    Duration queued(EntityId leaf, bool held = false) const {
        Duration q = 0;
        for (const Queue& c : queues_of(leaf))
            q += c.work() + (held ? static_cast<Duration>(ctx_->held(c.ch)) * c.length : 0);
        return q;
    }
    // A live channel's entries on the GPU not yet started (its IB_PUT -
    // IB_GET), and its kernel length: one register read, of IB_GET (the
    // host knows a trapped or shadowed channel's IB_PUT).
    struct Queue {
        ChannelId ch;
        std::uint32_t waiting;
        Duration length;
        Duration work() const { return static_cast<Duration>(waiting) * length; }
    };
    Queue queue_of(ChannelId ch) const {
        const std::uint32_t get = ctx_->gpu().read_ib_get(ch);
        return Queue{ch, ctx_->gpu_put(ch) - get, kernel_length(ch, get)};
    }
    std::vector<Queue> queues_of(EntityId leaf) const {
        std::vector<Queue> qs;
        for (ChannelId ch : ctx_->channels_of(leaf))
            if (live(ch)) qs.push_back(queue_of(ch));
        return qs;
    }

    // The accounting learns a kernel's length from its completion
    // interrupt.  A channel whose entries ask for none has it learned here
    // instead, as its charged GPU time over the entries the GPU started
    // (its own IB_GET): otherwise a tenant could keep its queue uncapped
    // by never asking for an interrupt.  0: not known yet.
    Duration kernel_length(ChannelId ch, std::optional<std::uint32_t> get = std::nullopt) const {
        if (Duration est = ctx_->kernel_estimate(ch); est > 0) return est;
        auto r = runs_.find(ch);
        if (r == runs_.end()) return 0;
        const std::uint32_t started = get.value_or(ctx_->gpu().read_ib_get(ch)) - r->second.get_at_open;
        return started >= 2 ? r->second.charged / started : 0;
    }
    // The GPU reports every channel it stops (channel_error): no register read.
    bool live(ChannelId ch) const {
        auto r = runs_.find(ch);
        return r != runs_.end() && !r->second.dead;
    }

    // Every live channel of the leaf that has work has a kernel length.
    bool learned(EntityId leaf) const {
        for (ChannelId ch : ctx_->channels_of(leaf))
            if (live(ch) && has_work(ch) && kernel_length(ch) == 0) return false;
        return true;
    }

    void set_metered(EntityId leaf, bool metered) {
        Node& n = nodes_[leaf];
        if (n.metered == metered) return;
        n.metered = metered;
        if (!metered) n.provisional = false;
        if (metered) {
            metered_.insert(leaf);
            ++meters_;
        } else {
            metered_.erase(leaf);
        }
        apply_modes(leaf);  // back to direct releases everything held
    }

    // A metered leaf is fed at its own completions and when its channel is
    // seen leaving the engine.  An entry that asked for no interrupt and ran
    // unseen between two reads ends unheard: such a leaf (held work, nothing
    // left on the GPU) is looked for whenever the engine is seen idle, and
    // otherwise at most once per `queue` of events, so a scan over the
    // metered leaves is not paid per kernel.
    void feed_unheard() {
        if (metered_.empty()) return;
        const Time now = ctx_->now();
        if (ctx_->running_seen() && now - scanned_at_ < p_.queue) return;
        scanned_at_ = now;
        // meter() may unmeter a leaf: walk a copy.  Each pending() is a
        // register read: blocked leaves (meter() feeds none) are skipped,
        // held work is in the host's own shadow pages, and a channel is read
        // only where known_pending() cannot tell.  At 128 clients this scan
        // read 83000 registers a second before; 1900 now.
        // The copy is a member vector (a set copied per scan was 128
        // allocations each 2 ms at 128 clients); a scan from inside one
        // (a release's synchronous channel error) leaves it to the outer.
        if (scanning_) return;
        scanning_ = true;
        struct Done {
            bool& flag;
            ~Done() { flag = false; }
        } done{scanning_};
        scan_.assign(metered_.begin(), metered_.end());
        for (EntityId leaf : scan_) {
            if (nodes_[leaf].shadowed || idle_armed_) continue;  // meter() would not feed it
            const auto& chs = ctx_->channels_of(leaf);
            const bool held = std::any_of(chs.begin(), chs.end(), [&](ChannelId ch) { return ctx_->held(ch) > 0; });
            if (!held || std::any_of(chs.begin(), chs.end(), [&](ChannelId ch) { return known_pending(ch); }))
                continue;
            if (std::none_of(chs.begin(), chs.end(), [&](ChannelId ch) { return read_pending(ch); })) meter(leaf);
        }
    }

    // Whether the GPU still has work of `ch`, known without a register read.
    // Work stops pending only when its last entry completes, and every
    // completion moves the channel's completion timestamp (written with the
    // fence, interrupt or not): a channel read pending that has completed
    // nothing since still is.
    bool known_pending(ChannelId ch) const {
        auto r = runs_.find(ch);
        if (r == runs_.end() || !r->second.pending_as_of) return false;
        return r->second.pending_as_of == ctx_->gpu().left_engine_at(ch);
    }
    bool read_pending(ChannelId ch) {
        const bool pending = ctx_->gpu().pending(ch);
        if (auto r = runs_.find(ch); r != runs_.end())
            r->second.pending_as_of = pending ? ctx_->gpu().left_engine_at(ch) : std::nullopt;
        return pending;
    }

    // Meter a leaf whose queue has grown past `queue` while it shares the
    // GPU; feed a metered, unblocked one up to `queue`.
    void meter(EntityId leaf) {
        if (p_.queue <= 0 || leaf >= nodes_.size()) return;
        Node& n = nodes_[leaf];
        if (!n.metered) {
            if (!n.active || active_leaves_ < 2 || queued(leaf) <= queue_cap()) return;
            // Its channels may already be shadowed (blocked) with work
            // held: fed below if it is not blocked.
            set_metered(leaf, true);
        } else if (n.active && active_leaves_ < 2) {
            set_metered(leaf, false);  // alone on the GPU: nobody to run ahead of
            return;
        } else if (n.provisional && learned(leaf)) {
            // Metered on joining: it stays so only if its queue is past the cap.
            n.provisional = false;
            if (queued(leaf, true) <= queue_cap()) {
                set_metered(leaf, false);
                return;
            }
        }
        if (n.shadowed || idle_armed_) return;  // blocked: only work conservation feeds it
        // Each live channel's GET is read once here and again only after a
        // release into it (which may start its entry on an idle engine):
        // other channels' GETs only move forward meanwhile, so the queue is
        // over-, never under-estimated.
        std::vector<Queue> qs = queues_of(leaf);
        Duration q = 0;
        for (const Queue& c : qs) q += c.work();
        for (;;) {
            // The live channel with the fewest entries waiting on the GPU
            // goes first, so a leaf's channels drain in turn.
            Queue* next = nullptr;
            for (Queue& c : qs)
                if (ctx_->held(c.ch) > 0 && (!next || c.waiting < next->waiting)) next = &c;
            if (!next) return;
            // A channel without a learned length gets one entry at a time.
            if (next->length == 0 && next->waiting > 0) return;
            if (q > 0 && q + next->length > queue_cap()) return;
            if (ctx_->release(next->ch, 1) == 0) return;
            ++metered_releases_;
            q -= next->work();
            *next = queue_of(next->ch);
            q += next->work();
        }
    }

    void apply_modes(EntityId leaf) {
        if (idle_armed_) return;  // modes are restored on wake-up
        for (ChannelId ch : ctx_->channels_of(leaf)) ctx_->set_mode(ch, mode_of(ch, leaf));
    }

    // ---- idleness, work conservation ----

    void arm_idle_check(Time at) {
        if (idle_timer_.armed() && idle_check_at_ <= at) return;
        idle_check_at_ = at;
        idle_timer_.arm(at, [this] { idle_check(); });
    }

    // How long a leaf without work stays in the run queue: `idle`, or for a
    // bursty leaf a little over its learned think time (CFQ's slice_idle),
    // so that it is still owed its share, and protected, when it returns.
    Duration stay_of(const Node& n) const {
        if (!n.bursty || n.think < 0) return p_.idle;
        return std::clamp(n.think + n.think / 2, p_.idle, kMaxStay * p_.idle);
    }

    // Leaves without work for stay_of() leave the run queue; once none is
    // left and the engine is idle, every doorbell traps.
    void idle_check() {
        const Time now = ctx_->now();
        std::vector<EntityId> quiet;
        Time next = -1;
        for (EntityId leaf : idle_candidates_) {
            const Time due = nodes_[leaf].idle_since + stay_of(nodes_[leaf]);
            if (now >= due)
                quiet.push_back(leaf);
            else if (next < 0 || due < next)
                next = due;
        }
        for (EntityId leaf : quiet) {
            if (leaf_has_work(leaf))
                mark_busy(leaf);
            else
                deactivate(leaf);
        }
        if (next >= 0) arm_idle_check(next);
        if (active_leaves_ == 0 && !idle_armed_ && !ctx_->running_seen() && !chans_.empty()) arm_idle();
        after_event();
    }

    // Nothing runs and nothing waits: trap the next doorbell.  Each channel
    // stays trapped until its own doorbell (or a stronger mode of its
    // leaf): switching every channel back at the first doorbell of any
    // remapped each channel twice per idle spell, 37045 remaps in 10 s for
    // a 55 ms pulse beside 100 channels that never submit.
    void arm_idle() {
        idle_armed_ = true;
        ++idle_arms_;
        for (auto& [ch, leaf] : chans_) {
            idle_trapped_.insert(ch);
            ctx_->set_mode(ch, ChannelMode::Trapped);
        }
    }

    // `ch` rang (a trapped doorbell): the first since the idle arming wakes
    // hfq; its own idle trap is done either way.
    void leave_idle_trap(ChannelId ch) {
        const bool was = idle_trapped_.erase(ch) > 0;
        if (idle_armed_) {
            wake_from_idle();
        } else if (was) {
            if (auto it = chans_.find(ch); it != chans_.end()) ctx_->set_mode(ch, mode_of(ch, it->second));
        }
    }

    void wake_from_idle() {
        idle_armed_ = false;
        for (auto& [ch, leaf] : chans_) ctx_->set_mode(ch, mode_of(ch, leaf));
        // Held while every channel trapped: metered leaves are fed now.
        for (EntityId leaf : std::set<EntityId>(metered_)) meter(leaf);
    }

    void after_event() {
        feed_unheard();
        if (const std::optional<ChannelId> running = ctx_->running_seen()) {
            // Unblocked work is running again: work conservation can rest.
            auto it = chans_.find(*running);
            if (it == chans_.end() || !nodes_[it->second].shadowed) {
                feeding_ = false;
                if (it != chans_.end()) cover(*running, it->second);
            }
            return;
        }
        Time now = ctx_->now();
        if (Time hold = anticipation_until(now); hold > now) {
            // A returning leaf is expected before a fed kernel would end.
            if (!grace_timer_.armed() || grace_at_ < hold) {
                ++anticipations_;
                grace_at_ = hold;
                held_until_ = hold;
                grace_timer_.arm(hold, [this] { release_if_idle(); });
            }
            return;
        }
        if (feeding_) {
            // Already feeding the GPU from shadow pages and the unblocked
            // entities still have nothing: next entry now, no grace.
            release_if_idle();
        } else {
            // New work during a longer wait (resubmit_wait's) is looked at
            // within `grace`, not at the wait's end.
            if (!shadowed_leaves_.empty()) release_by(now + p_.grace);
        }
    }

    // How late every interrupt reaches the host: the handler's time against
    // the completion timestamp the GPU wrote with the fence, the least of
    // the last few.  A stalled host makes some late, not all.
    void learn_latency(ChannelId ch) {
        const std::optional<Time> done = ctx_->gpu().left_engine_at(ch);
        if (!done) return;
        latencies_[latency_next_++ % latencies_.size()] = std::max<Duration>(0, ctx_->now() - *done);
        irq_latency_ = *std::min_element(latencies_.begin(), latencies_.end());
    }

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
    void cover(ChannelId ch, EntityId runner) {
        if (irq_latency_ < p_.grace || shadowed_leaves_.empty()) return;
        for (const auto& [c, leaf] : chans_)
            if (leaf != runner && nodes_[leaf].active && !nodes_[leaf].shadowed && nodes_[leaf].idle_since < 0)
                return;  // its work may follow: the engine will not idle
        if (cover_pending()) return;
        const EntityId best = feed_candidate();
        if (best == kNoEntity || lead_of(best) > static_cast<double>(p_.feed_lead)) return;
        if (ctx_->gpu_put(ch) != ctx_->gpu().read_ib_get(ch)) return;  // its own work follows
        for (ChannelId c : ctx_->channels_of(best)) {
            if (ctx_->release(c, 1) != 0) {
                ++covers_;
                cover_ch_ = c;
                cover_put_ = ctx_->gpu_put(c);
                return;
            }
        }
    }
    // The last cover entry has not started yet.
    bool cover_pending() {
        if (cover_ch_ == 0 || !live(cover_ch_)) return false;
        if (static_cast<std::int32_t>(ctx_->gpu().read_ib_get(cover_ch_) - cover_put_) >= 0) {
            cover_ch_ = 0;
            return false;
        }
        return true;
    }

    // Look at the idle engine again (release_if_idle) no later than `at`.
    void release_by(Time at) {
        if (grace_timer_.armed() && grace_at_ <= at) return;
        grace_at_ = at;
        grace_timer_.arm(at, [this] { release_if_idle(); });
    }

    // Until when to keep the engine idle for an unblocked leaf between
    // bursts; `now` or earlier when no leaf is worth waiting for.
    Time anticipation_until(Time now) {
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

    // The learned kernel length of what release_if_idle() would feed next;
    // unknown counts as long (the worst case for a returning leaf).
    Duration feed_estimate() {
        EntityId leaf = feed_candidate();
        if (leaf == kNoEntity) return 0;
        return feed_estimate(leaf);
    }
    // `pessimistic`: the learned length plus twice its spread, which few
    // of the leaf's kernels outlast (a mean alone is outlasted by half).
    Duration feed_estimate(EntityId leaf, bool pessimistic = false) const {
        Duration est = std::numeric_limits<Duration>::max();
        for (ChannelId ch : ctx_->channels_of(leaf))
            if (Duration k = ctx_->kernel_estimate(ch); k > 0 && ctx_->held(ch) > 0)
                est = std::min(est, pessimistic ? k + 2 * ctx_->kernel_spread(ch) : k);
        return est;
    }

    // The engine stayed idle although shadowed channels hold work: feed it
    // from the least-ahead blocked leaf that has some.
    void release_if_idle() {
        // A probe of an unknown think time that ran out: the leaf thinks
        // longer than anticipation could pay for.
        if (p_.anticipate > 0)
            for (EntityId leaf : idle_candidates_) {
                Node& n = nodes_[leaf];
                if (n.think < 0 && n.idle_since >= 0 && ctx_->now() - n.idle_since >= p_.anticipate)
                    n.think = p_.anticipate;
            }
        if (shadowed_leaves_.empty()) return;
        if (ctx_->engine_status()) return;
        // The engine idles with work held back because these unblocked
        // leaves are between bursts: watch for their returns from now on.
        for (EntityId leaf : idle_candidates_)
            if (!nodes_[leaf].shadowed) set_bursty(leaf, true);
        bool beyond_cap = false;
        EntityId best = feed_candidate(&beyond_cap);
        if (best == kNoEntity) return;
        if (const Time until = resubmit_wait(best); until > ctx_->now()) {
            release_by(until);
            return;
        }
        // Hand the GPU one held entry straight from the shadow page: no remap,
        // the leaf stays blocked, and the engine is busy again at once.
        for (ChannelId ch : ctx_->channels_of(best)) {
            if (ctx_->release(ch, 1) != 0) {
                ++wc_releases_;
                feeding_ = true;
                fed_ch_ = ch;
                fed_at_ = ctx_->now();
                fed_done_ = ctx_->gpu().left_engine_at(ch);
                fed_beyond_cap_ = beyond_cap;
                break;
            }
        }
    }

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
    Time resubmit_wait(EntityId best) const {
        const Time now = ctx_->now();
        const double best_lead = lead_of(best);
        Time until = -1;
        auto consider = [&](EntityId leaf) {
            const Node& n = nodes_[leaf];
            if (!n.shadowed || !n.active) return;
            const Duration burst = std::max<Duration>(0, n.burst);
            if (n.turnaround > burst || lead_of(leaf) >= best_lead) return;
            const Duration window = std::max(p_.grace, std::min(2 * n.turnaround, burst));
            if (const std::optional<Time> done = last_completion(leaf); done && now - *done < window)
                until = std::max(until, *done + window);
        };
        // Leaves seen without work, and the one whose channel has just left
        // the engine (its completion may not have been handled yet).
        for (EntityId leaf : idle_candidates_) consider(leaf);
        if (auto it = chans_.find(last_left_); last_left_ != 0 && it != chans_.end()) consider(it->second);
        if (until > now && feed_estimate(best) <= until - now) return -1;
        return until;
    }

    // `ch`'s kernel ended (or the channel did): it is no longer the fed or
    // the cut one.
    void forget_kernel(ChannelId ch) {
        if (fed_ch_ == ch) fed_ch_ = 0;
        if (cut_ch_ == ch) cut_ch_ = 0;
    }

    // How far a leaf is ahead of its least-ahead siblings, summed over the
    // levels where it is blocked.
    double lead_of(EntityId leaf) const {
        double lead = 0;
        for (EntityId a = leaf; a != kRootEntity; a = parent_of(a))
            if (nodes_[a].blocked) lead += nodes_[a].vtime - nodes_[parent_of(a)].rq.min_vtime();
        return lead;
    }

    // The least-ahead shadowed leaf that holds work, or kNoEntity.
    EntityId feed_candidate(bool* beyond_cap = nullptr) const {
        EntityId best = kNoEntity;
        double best_lead = INFINITY;
        for (EntityId leaf : shadowed_leaves_) {
            bool held = false;
            for (ChannelId ch : ctx_->channels_of(leaf)) held = held || ctx_->held(ch) > 0;
            if (!held) continue;
            const double lead = lead_of(leaf);
            if (lead < best_lead) {
                best_lead = lead;
                best = leaf;
            }
        }
        // Fed further, it would run away from a sibling that is only between
        // bursts: that one is owed the GPU when it returns, unless the fed
        // kernel is likely over by then.  Feeding another leaf instead
        // would starve the least-ahead one: hold the engine.
        // Fed past the cap, the kernel is the returning leaf's to take back
        // on a preemptive engine (preempt_for).
        if (best != kNoEntity && best_lead > static_cast<double>(p_.feed_lead)) {
            if (delays_return(best, feed_estimate(best), feed_estimate(best, true))) return kNoEntity;
            if (beyond_cap) *beyond_cap = true;
        }
        return best;
    }

    // Would a kernel of length `est` (`longest`: the length few of its
    // kernels outlast) fed now make an unblocked leaf between bursts wait
    // longer on its return than the engine would idle until then (an
    // unknown think: it may return at any moment)?
    bool delays_return(EntityId fed, Duration est, Duration longest) const {
        Time now = ctx_->now();
        std::optional<double> fed_shortfall;  // the same for every thinking leaf: once
        for (EntityId leaf : idle_candidates_) {
            const Node& n = nodes_[leaf];
            if (n.idle_since < 0 || (n.shadowed && n.think < 0)) continue;
            if (n.think < 0) return true;
            Duration until_back = std::max<Duration>(0, n.idle_since + n.think - now);
            // On a non-preemptive engine a kernel that may outlast the
            // leaf's return makes it wait.  Fed at the start of the leaf's
            // next think instead, it would make it wait only what it is
            // longer than that think.  Max-min between the two: while the
            // returning leaf is further below its max-min share than the
            // fed one, any wait added is its loss and the idle the fed
            // leaf's, so hold, however long the think.  Otherwise, in the
            // last kHoldBursts of the leaf's bursts before its return, feed
            // it now only if the wait it adds is less than the engine would
            // idle until the return (in a longer think the idle costs the
            // others more than the leaf gains).  A leaf blocked behind a
            // sibling (one returning with credit) is held for only on the
            // first count: it may still be further below its max-min share
            // than the fed leaf, but it is not owed the engine's idle.
            if (!can_preempt_) {
                const Duration added = std::max<Duration>(0, longest - until_back) -
                                       std::max<Duration>(0, longest - n.think);
                if (added > 0) {
                    if (!fed_shortfall) fed_shortfall = shortfall(fed);
                    if (shortfall(leaf) > *fed_shortfall) return true;
                }
                if (!n.shadowed && until_back <= kHoldBursts * n.burst && added > until_back) return true;
            }
            if (n.shadowed) continue;
            // Demand (burst / (burst + think)) below its fair share: max-min
            // fairness owes it its demand, not a GPU held at everyone's cost.
            if (demand(leaf) < fair_share(leaf)) continue;
            // Idling longer than the burst it would protect costs the others
            // more GPU time than the returning leaf gets back.
            if (until_back > n.burst) continue;
            // On a preemptive engine a leaf that thinks longer than a
            // preemption takes the engine back when it returns: it waits
            // the preemption's dead time, not the rest of the kernel.
            Duration wait = est - until_back;
            if (can_preempt_ && n.think >= preempt_cost_) wait = std::min(wait, preempt_cost_);
            if (wait > until_back) return true;
        }
        return false;
    }

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
    std::uint64_t blocks_ = 0, unblocks_ = 0, wc_releases_ = 0, idle_arms_ = 0, anticipations_ = 0,
                  preemptions_ = 0, meters_ = 0, metered_releases_ = 0, covers_ = 0;
};

}  // namespace

PolicyInfo hfq_info() {
    return {"hfq",
            "hierarchical weighted fair queuing: event-based accounting, per-level virtual time, "
            "shadowing of over-users, work-conserving",
            {
                {"threshold_ms", 2.0, "block a sibling once it is this far ahead in weighted GPU time"},
                {"unblock_ms", 0.5, "unblock it once it is back within this"},
                {"lag_ms", 4.0,
                 "credit an entity keeps across idle periods; above threshold_ms, so a returning "
                 "leaf holds its siblings back while it bursts"},
                {"idle_us", 2000.0, "an entity without work this long leaves the run queue"},
                // Accepted so that older configurations still load.
                {"poll_us", 500.0, "no effect: hfq no longer polls the engine (the scheduler's accounting charges it)"},
                {"settle_us", 5.0, "no effect: the scheduler's accounting reads an idle engine itself"},
                {"grace_us", 5.0, "GPU idle this long with held work releases one entry of it"},
                {"anticipate_us", 0.0,
                 "hold the GPU idle for an unblocked leaf between bursts for twice its learned think "
                 "time, if that is within this and shorter than the kernel that would be fed (0: never)"},
                {"feed_lead_ms", 4.0,
                 "feed held work to the least-ahead blocked leaf only while it is at most this far ahead "
                 "in weighted GPU time, or when its kernel would delay a thinking unblocked leaf less than "
                 "the GPU would idle until that leaf returns"},
                {"queue_ms", 2.0,
                 "a leaf sharing the GPU with more than this much learned work queued on it is shadowed and "
                 "fed one entry at a time as the GPU drains it, so a block takes effect within this (0: no cap)"},
                {"fair_window", 32.0,
                 "with more backlogged siblings than this, threshold_ms and unblock_ms shrink by this over their "
                 "number, and queue_ms by this over the number of active leaves, down to 0.25 ms (0: never)"},
            }};
}

std::unique_ptr<Policy> make_hfq(const PolicyParams& p) {
    PolicyInfo info = hfq_info();
    auto get = [&](const char* n) { return param_or_default(p, info, n); };
    Params params{from_us(get("threshold_ms") * 1000), from_us(get("unblock_ms") * 1000),
                  from_us(get("lag_ms") * 1000),       from_us(get("idle_us")),
                  from_us(get("grace_us")),            from_us(get("anticipate_us")),
                  from_us(get("feed_lead_ms") * 1000), from_us(get("queue_ms") * 1000),
                  0};
    // A sibling count: a whole number, and 0 turns the scaling off.
    const double fair_window = get("fair_window");
    if (!(fair_window >= 0 && fair_window <= 1e6) || fair_window != std::floor(fair_window))
        throw std::invalid_argument("hfq: fair_window must be a whole number from 0 to 1000000");
    params.fair_window = static_cast<int>(fair_window);
    if (params.idle <= 0) throw std::invalid_argument("hfq: idle_us must be positive");
    if (params.queue < 0) throw std::invalid_argument("hfq: queue_ms must not be negative");
    if (params.feed_lead < 0) throw std::invalid_argument("hfq: feed_lead_ms must not be negative");
    if (params.anticipate < 0) throw std::invalid_argument("hfq: anticipate_us must not be negative");
    if (params.unblock > params.threshold)
        throw std::invalid_argument("hfq: unblock_ms must not exceed threshold_ms");
    return std::make_unique<HfqPolicy>(params);
}

}  // namespace pvgpu
