// `hfq`: hierarchical fair queuing with continuous, event-based accounting.
//
// Accounting (LoGA-style): at every fence interrupt and at every poll of the
// engine status register, the time since the last observation is charged to
// the channel that was on the engine.  No exclusive sampling phase, no traps
// while busy.
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
// from its shadow page (a partial release: no remap, it stays blocked).
// When nothing at all is running the policy stops polling and arms doorbell
// traps instead, so an idle host costs no CPU.
//
// Anticipation (BFQ's idling, Iyer and Druschel's anticipatory scheduler): a
// leaf that runs unblocked and has just gone idle between bursts is likely
// to come back after its usual think time.  If that think time is shorter
// than the kernel the GPU would otherwise be fed from a shadow page, feeding
// it would make the returning leaf wait a whole kernel on a non-preemptive
// engine: hfq holds the engine idle instead, for at most twice the leaf's
// learned think time, and only if that is within `anticipate_us`.  Off by
// default: it buys design-example its share at 9% idle GPU and costs demo
// and mixed theirs (docs/results.md section 7).
#include <algorithm>
#include <cmath>
#include <limits>
#include <set>
#include <unordered_map>

#include "policies.hpp"

namespace pvgpu {

namespace {

constexpr double kUnitWeight = 100.0;

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

struct Node {
    double vtime = 0;
    bool active = false;
    bool blocked = false;
    bool shadowed = false;  // leaves: channels are asked to be Shadowed
    Duration accounted = 0;
    Time idle_since = -1;   // leaves: first moment seen without work
    Duration think = -1;    // leaves: mean time from going idle to new work, -1 unknown
    RunQueue rq;
};

struct Params {
    Duration threshold, unblock, lag, poll, settle, idle, grace, anticipate;
};

class HfqPolicy final : public Policy {
public:
    explicit HfqPolicy(Params p) : p_(p) {}

    std::string_view name() const override { return "hfq"; }

    void start(PolicyContext& ctx) override {
        ctx_ = &ctx;
        poll_timer_.bind(ctx.timers());
        grace_timer_.bind(ctx.timers());
        last_t_ = ctx.now();
        settle_ = p_.settle;
        start_polling();
    }

    void stop() override {
        poll_timer_.cancel();
        grace_timer_.cancel();
        for (auto& [ch, leaf] : chans_) ctx_->set_mode(ch, ChannelMode::Direct);
    }

    void channel_added(ChannelId ch, EntityId leaf) override {
        node(leaf);
        chans_[ch] = leaf;
        ctx_->set_mode(ch, idle_armed_ ? ChannelMode::Trapped
                                       : (nodes_[leaf].shadowed ? ChannelMode::Shadowed
                                                                : ChannelMode::Direct));
    }

    void channel_removed(ChannelId ch, EntityId leaf) override {
        chans_.erase(ch);
        kernel_est_.erase(ch);
        if (last_running_ == ch) last_running_.reset();
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
            idle_candidates_.erase(id);
            dormant_shadowed_.erase(id);
        } else if (c == EntityTree::Change::Weight) {
            // New weights apply to future charges; re-check the sibling level now.
            // A policy set at run time learns entities from their channels: a
            // parent it has no node for has no run queue to re-check.
            EntityId parent = ctx_->tree().get(id).parent;
            if (parent < nodes_.size()) rebalance(parent);
        }
    }

    void doorbell_trapped(ChannelId ch, std::uint32_t) override {
        if (idle_armed_) wake_from_idle();
        // The write is forwarded after this returns, so the GPU does not show
        // it as pending yet: the doorbell itself is the evidence of work.
        if (auto it = chans_.find(ch); it != chans_.end()) mark_busy(it->second);
    }

    void fence(ChannelId ch, std::uint32_t) override {
        observe(ch);
        touch(ch);
        after_event();
    }

    void channel_error(ChannelId ch, std::uint32_t) override {
        observe(std::nullopt);
        if (last_running_ == ch) last_running_.reset();
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
                {"idle_arms", static_cast<double>(idle_arms_)},
                {"anticipations", static_cast<double>(anticipations_)}};
    }

private:
    Node& node(EntityId id) {
        if (nodes_.size() <= id) nodes_.resize(std::max<std::size_t>(id + 1, ctx_->tree().id_bound()));
        return nodes_[id];
    }

    EntityId parent_of(EntityId id) const { return ctx_->tree().get(id).parent; }
    std::uint32_t weight_of(EntityId id) const { return ctx_->tree().get(id).weight; }

    bool has_work(ChannelId ch) const {
        return ctx_->gpu().pending(ch) || ctx_->held(ch) > 0;
    }
    bool leaf_has_work(EntityId leaf) const {
        for (ChannelId c : ctx_->channels_of(leaf))
            if (has_work(c)) return true;
        return false;
    }

    // ---- accounting ----

    // An observation at now(): a fence interrupt of `fence_of` (its channel
    // was on the engine just before now), or a poll when nullopt.
    void observe(std::optional<ChannelId> fence_of) {
        Time now = ctx_->now();
        Duration delta = now - last_t_;
        std::optional<ChannelId> running = ctx_->engine_status();
        std::optional<ChannelId> evidence = fence_of ? fence_of : running;
        if (delta > 0) {
            if (last_running_ && evidence && *last_running_ == *evidence) {
                charge(*last_running_, delta);
                // A whole kernel seen from start (our last fence) to end: learn it.
                if (fence_of && last_was_fence_of_ == *fence_of) learn(*fence_of, delta);
            } else if (evidence) {
                // A switch happened somewhere in the interval.  A fence's own
                // kernel ran at most about its usual length; a poll tells less.
                Duration mine = delta / 2;
                if (fence_of) {
                    auto it = kernel_est_.find(*fence_of);
                    if (it != kernel_est_.end()) mine = std::min<Duration>(delta, it->second);
                }
                if (last_running_)
                    charge(*last_running_, delta - mine);
                charge(*evidence, mine);
            } else if (last_running_) {
                charge(*last_running_, delta / 2);
            }
        }
        last_t_ = now;
        last_running_ = running;
        last_was_fence_of_ = fence_of && running == fence_of ? *fence_of : 0;
        if (running) {
            touch(*running);
            settle_ = p_.settle;
        } else if (active_leaves_ > 0) {
            // The engine just went idle while entities are backlogged: a direct
            // channel will likely start without telling us.  Look again soon,
            // backing off to the normal poll period, so its start is seen.
            schedule_poll(now + settle_);
            settle_ = std::min(settle_ * 2, p_.poll);
        }
    }

    // Exponentially weighted mean of whole-kernel times seen on a channel.
    void learn(ChannelId ch, Duration d) {
        auto [it, fresh] = kernel_est_.try_emplace(ch, d);
        if (!fresh) it->second += (d - it->second) / 8;
    }

    void charge(ChannelId ch, Duration d) {
        auto it = chans_.find(ch);
        if (it == chans_.end()) return;
        EntityId leaf = it->second;
        nodes_[leaf].accounted += d;
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
        if (leaf_has_work(leaf)) {
            mark_busy(leaf);
        } else if (nodes_[leaf].idle_since < 0) {
            nodes_[leaf].idle_since = ctx_->now();
            idle_candidates_.insert(leaf);
        }
    }

    void mark_busy(EntityId leaf) {
        Node& n = nodes_[leaf];
        if (n.idle_since >= 0) {
            // Back from a think.  Seen while the engine was held for it, the
            // time is close (settle polls); seen while a fed kernel ran, it
            // is only an upper bound and may only lower the estimate.
            Duration t = ctx_->now() - n.idle_since;
            if (ctx_->now() <= held_until_ + p_.poll)
                n.think = n.think < 0 ? t : n.think + (t - n.think) / 4;
            else if (n.think >= 0)
                n.think = std::min(n.think, t);
        }
        n.idle_since = -1;
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
        if (ctx_->tree().is_leaf(id)) {
            ++active_leaves_;
            watch(id);
        }
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
            watch(id);
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

    // Block children too far ahead of the least-served; unblock those back in range.
    void rebalance(EntityId parent) {
        RunQueue& rq = nodes_[parent].rq;
        if (rq.empty()) return;
        double m = rq.min_vtime();
        rq.floor = std::max(rq.floor, m);
        while (!rq.open.empty() && rq.open.rbegin()->vtime - m > static_cast<double>(p_.threshold)) {
            Key k = *rq.open.rbegin();
            rq.open.erase(k);
            rq.blocked.insert(k);
            nodes_[k.id].blocked = true;
            ++blocks_;
            refresh(k.id);
        }
        while (!rq.blocked.empty() && rq.blocked.begin()->vtime - m <= static_cast<double>(p_.unblock)) {
            unblock(rq, *rq.blocked.begin());
        }
    }

    void unblock(RunQueue& rq, Key k) {
        rq.blocked.erase(k);
        rq.open.insert(k);
        nodes_[k.id].blocked = false;
        ++unblocks_;
        refresh(k.id);
    }

    // Shadowed leaves out of the run queue are the only ones whose new work we
    // cannot see by fence or engine status: poll() reads their shadow pages.
    void watch(EntityId leaf) {
        const Node& n = nodes_[leaf];
        if (n.shadowed && !n.active)
            dormant_shadowed_.insert(leaf);
        else
            dormant_shadowed_.erase(leaf);
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
        watch(id);
        if (idle_armed_) return;  // modes are restored on wake-up
        for (ChannelId ch : ctx_->channels_of(id))
            ctx_->set_mode(ch, shadow ? ChannelMode::Shadowed : ChannelMode::Direct);
    }

    // ---- polling, idleness, work conservation ----

    void start_polling() { schedule_poll(ctx_->now() + next_poll_period()); }

    // Poll periods are dithered over [poll/2, 3*poll/2): a fixed period can
    // lock onto the GPU's own time slice and bias the split of every interval
    // that holds a channel switch.  Dithering makes the switch land uniformly.
    Duration next_poll_period() {
        dither_ ^= dither_ << 13;
        dither_ ^= dither_ >> 7;
        dither_ ^= dither_ << 17;
        return p_.poll / 2 + static_cast<Duration>(dither_ % static_cast<std::uint64_t>(p_.poll));
    }

    // Poll at `at`, or earlier if a poll is already due before then.
    void schedule_poll(Time at) {
        if (poll_timer_.armed() && poll_at_ <= at) return;
        poll_at_ = at;
        poll_timer_.arm(at, [this] { poll(); });
    }

    void poll() {
        observe(std::nullopt);
        Time now = ctx_->now();
        // Guests of shadowed channels write into our own pages: look there.
        std::vector<EntityId> woke;
        for (EntityId leaf : dormant_shadowed_)
            if (leaf_has_work(leaf)) woke.push_back(leaf);
        for (EntityId leaf : woke) mark_busy(leaf);
        std::vector<EntityId> quiet;
        for (EntityId leaf : idle_candidates_)
            if (now - nodes_[leaf].idle_since >= p_.idle) quiet.push_back(leaf);
        for (EntityId leaf : quiet) {
            if (leaf_has_work(leaf))
                mark_busy(leaf);
            else
                deactivate(leaf);
        }
        bool any_active = active_leaves_ > 0;
        after_event();
        if (any_active || last_running_) {
            quiet_since_ = -1;
            schedule_poll(now + next_poll_period());
        } else if (quiet_since_ < 0) {
            quiet_since_ = now;
            schedule_poll(now + next_poll_period());
        } else if (now - quiet_since_ < p_.idle) {
            schedule_poll(now + next_poll_period());
        } else {
            arm_idle();
        }
    }

    // Nothing runs and nothing waits: trap the next doorbell instead of polling.
    void arm_idle() {
        idle_armed_ = true;
        ++idle_arms_;
        for (auto& [ch, leaf] : chans_) ctx_->set_mode(ch, ChannelMode::Trapped);
    }

    void wake_from_idle() {
        idle_armed_ = false;
        quiet_since_ = -1;
        last_t_ = ctx_->now();
        last_running_.reset();
        for (auto& [ch, leaf] : chans_)
            ctx_->set_mode(ch, nodes_[leaf].shadowed ? ChannelMode::Shadowed : ChannelMode::Direct);
        start_polling();
    }

    void after_event() {
        if (last_running_) {
            // Unblocked work is running again: work conservation can rest.
            if (!nodes_[chans_.count(*last_running_) ? chans_[*last_running_] : kRootEntity].shadowed)
                feeding_ = false;
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
        } else if (!grace_timer_.armed()) {
            grace_at_ = now + p_.grace;
            grace_timer_.arm(grace_at_, [this] { release_if_idle(); });
        }
    }

    // Until when to keep the engine idle for an unblocked leaf between
    // bursts; `now` or earlier when no leaf is worth waiting for.
    Time anticipation_until(Time now) {
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
        Duration est = std::numeric_limits<Duration>::max();
        for (ChannelId ch : ctx_->channels_of(leaf))
            if (auto it = kernel_est_.find(ch); it != kernel_est_.end() && ctx_->held(ch) > 0)
                est = std::min(est, it->second);
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
        if (ctx_->engine_status()) return;
        EntityId best = feed_candidate();
        if (best == kNoEntity) return;
        // Hand the GPU one held entry straight from the shadow page: no remap,
        // the leaf stays blocked, and the engine is busy again at once.
        for (ChannelId ch : ctx_->channels_of(best)) {
            if (ctx_->release(ch, 1) != 0) {
                ++wc_releases_;
                feeding_ = true;
                break;
            }
        }
    }

    // The least-ahead shadowed leaf that holds work, or kNoEntity.
    EntityId feed_candidate() const {
        EntityId best = kNoEntity;
        double best_lead = INFINITY;
        for (EntityId leaf : shadowed_leaves_) {
            bool held = false;
            for (ChannelId ch : ctx_->channels_of(leaf)) held = held || ctx_->held(ch) > 0;
            if (!held) continue;
            double lead = 0;
            for (EntityId a = leaf; a != kRootEntity; a = parent_of(a))
                if (nodes_[a].blocked) lead += nodes_[a].vtime - nodes_[parent_of(a)].rq.min_vtime();
            if (lead < best_lead) {
                best_lead = lead;
                best = leaf;
            }
        }
        return best;
    }

    Params p_;
    PolicyContext* ctx_ = nullptr;
    std::vector<Node> nodes_;
    std::unordered_map<ChannelId, EntityId> chans_;
    std::set<EntityId> shadowed_leaves_;
    std::set<EntityId> idle_candidates_;   // active leaves seen without work
    std::set<EntityId> dormant_shadowed_;  // shadowed leaves not in a run queue
    std::size_t active_leaves_ = 0;
    Timer poll_timer_;
    Time poll_at_ = 0;
    Duration settle_ = 0;
    std::uint64_t dither_ = 0x9e3779b97f4a7c15ULL;  // xorshift state, fixed for determinism
    Timer grace_timer_;
    Time grace_at_ = 0;
    Time held_until_ = -1;  // end of the last anticipation hold
    Time last_t_ = 0;
    std::optional<ChannelId> last_running_;
    ChannelId last_was_fence_of_ = 0;  // channel whose fence the last observation was, if it kept running
    std::unordered_map<ChannelId, Duration> kernel_est_;
    Time quiet_since_ = -1;
    bool idle_armed_ = false;
    bool feeding_ = false;  // work conservation is handing out held entries
    std::uint64_t blocks_ = 0, unblocks_ = 0, wc_releases_ = 0, idle_arms_ = 0, anticipations_ = 0;
};

}  // namespace

PolicyInfo hfq_info() {
    return {"hfq",
            "hierarchical weighted fair queuing: event-based accounting, per-level virtual time, "
            "shadowing of over-users, work-conserving",
            {
                {"threshold_ms", 2.0, "block a sibling once it is this far ahead in weighted GPU time"},
                {"unblock_ms", 0.5, "unblock it once it is back within this"},
                {"lag_ms", 2.0, "credit an entity keeps across idle periods"},
                {"poll_us", 500.0, "engine status poll period while the GPU is busy"},
                {"settle_us", 5.0, "first re-poll after the engine is seen idle with work pending"},
                {"idle_us", 2000.0, "an entity without work this long leaves the run queue"},
                {"grace_us", 20.0, "GPU idle this long with held work releases one entry of it"},
                {"anticipate_us", 0.0,
                 "hold the GPU idle for an unblocked leaf between bursts for twice its learned think "
                 "time, if that is within this and shorter than the kernel that would be fed (0: never)"},
            }};
}

std::unique_ptr<Policy> make_hfq(const PolicyParams& p) {
    PolicyInfo info = hfq_info();
    auto get = [&](const char* n) { return param_or_default(p, info, n); };
    Params params{from_us(get("threshold_ms") * 1000), from_us(get("unblock_ms") * 1000),
                  from_us(get("lag_ms") * 1000),       from_us(get("poll_us")),
                  from_us(get("settle_us")),           from_us(get("idle_us")),
                  from_us(get("grace_us")),          from_us(get("anticipate_us"))};
    if (params.poll <= 0) throw std::invalid_argument("hfq: poll_us must be positive");
    if (params.settle <= 0) throw std::invalid_argument("hfq: settle_us must be positive");
    if (params.anticipate < 0) throw std::invalid_argument("hfq: anticipate_us must not be negative");
    if (params.unblock > params.threshold)
        throw std::invalid_argument("hfq: unblock_ms must not exceed threshold_ms");
    return std::make_unique<HfqPolicy>(params);
}

}  // namespace pvgpu
