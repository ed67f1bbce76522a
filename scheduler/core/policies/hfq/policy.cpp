// hfq's events, wired to its fair queuing and mechanisms (hfq.hpp), and its
// parameters.
#include "core/policies/hfq/hfq.hpp"

namespace pvgpu::hfq {

void HfqPolicy::start(PolicyContext& ctx) {
    ctx_ = &ctx;
    fq_.start(ctx);
    idle_timer_.bind(ctx.timers());
    feeder_.start(ctx.timers());
    preemption_.start(ctx.timers(), ctx.gpu().arbitration());
    arm_idle_check(ctx.now() + p_.idle);
}

void HfqPolicy::charged(ChannelId ch, Duration d) {
    auto it = chans_.find(ch);
    if (it == chans_.end()) return;
    if (auto r = runs_.find(ch); r != runs_.end()) r->second.charged += d;
    fq_.charge(it->second, d);
    catch_up_.charged(it->second);
}

void HfqPolicy::stop() {
    idle_timer_.cancel();
    feeder_.stop();
    preemption_.stop();
    for (auto& [ch, leaf] : chans_) ctx_->set_mode(ch, ChannelMode::Direct);
    idle_trapped_.clear();
}

void HfqPolicy::channel_added(ChannelId ch, EntityId leaf) {
    fq_.node(leaf);
    chans_[ch] = leaf;
    runs_[ch] = ChannelRuns{0, ctx_->gpu().read_ib_get(ch), ctx_->gpu().read_status(ch) != PVGPU_CHAN_STATUS_OK, std::nullopt};
    if (ch < kIndexedIds) {
        if (runs_by_id_.size() <= ch) runs_by_id_.resize(ch + 1);
        runs_by_id_[ch] = &runs_[ch];
    }
    // A channel that joins a busy GPU has no kernel length learned, so
    // the cap cannot size its queue: the client's first queue would
    // reach the GPU whole and run that far ahead of everyone.  It is
    // metered from its first entry until a length is learned.  (A leaf
    // already running keeps its mode: metering it would remap its
    // running channels for the sake of one that may not queue deep.)
    Node& n = fq_.nodes_[leaf];
    if (p_.queue > 0 && !n.metered && !n.active && fq_.active_leaves_ > 0) {
        n.provisional = true;
        queue_cap_.set_metered(leaf, true);
    }
    if (idle_armed_) idle_trapped_.insert(ch);
    ctx_->set_mode(ch, idle_armed_ ? ChannelMode::Trapped : mode_of(leaf));
    // The idle check found no channel to trap (none had opened): look
    // again for this one, or its first work on an idle GPU goes unheard.
    if (!idle_armed_ && fq_.active_leaves_ == 0) arm_idle_check(ctx_->now() + p_.idle);
}

void HfqPolicy::channel_removed(ChannelId ch, EntityId leaf) {
    chans_.erase(ch);
    idle_trapped_.erase(ch);
    runs_.erase(ch);
    if (ch < runs_by_id_.size()) runs_by_id_[ch] = nullptr;
    forget_kernel(ch);
    if (left_engine_ == ch) left_engine_ = 0;
    if (last_left_ == ch) last_left_ = 0;
    // The scheduler drops the channel after this call.
    bool others = false;
    for (ChannelId c : ctx_->channels_of(leaf)) others = others || (c != ch && has_work(c));
    if (!others && leaf < fq_.nodes_.size() && fq_.nodes_[leaf].active) fq_.deactivate(leaf);
}

void HfqPolicy::tree_changed(EntityTree::Change c, EntityId id) {
    if (c == EntityTree::Change::Added) {
        fq_.node(id) = Node{};
    } else if (c == EntityTree::Change::Removed) {
        if (id < fq_.nodes_.size() && fq_.nodes_[id].active) fq_.deactivate(id);
        if (id < fq_.nodes_.size()) fq_.nodes_[id] = Node{};
        fq_.shadowed_leaves_.erase(id);
        queue_cap_.forget(id);
        catch_up_.ended(id);
        idle_candidates_.erase(id);
    } else if (c == EntityTree::Change::Weight) {
        // New weights apply to future charges; re-check the sibling level now.
        // A policy set at run time learns entities from their channels: a
        // parent it has no node for has no run queue to re-check.
        if (id < fq_.nodes_.size()) fq_.weight_changed(id);
        EntityId parent = ctx_->tree().get(id).parent;
        if (parent < fq_.nodes_.size()) fq_.rebalance(parent);
    }
}

void HfqPolicy::doorbell_trapped(ChannelId ch, std::uint32_t) {
    leave_idle_trap(ch);
    // The write is forwarded after this returns, so the GPU does not show
    // it as pending yet: the doorbell itself is the evidence of work.
    auto it = chans_.find(ch);
    if (it == chans_.end()) return;
    mark_busy(it->second, true);
    // A bursty leaf is back: over-served work on the engine gives way to
    // it once the write has reached the GPU.
    const Node& n = fq_.nodes_[it->second];
    if ((n.bursty || catch_up_.catching_up(it->second)) && !n.shadowed) preemption_.returned(ch, ctx_->now());
}

void HfqPolicy::work_held(ChannelId ch, std::uint32_t) {
    idle_trapped_.erase(ch);  // shadowed now: it rang, and is not trapped
    if (auto it = chans_.find(ch); it != chans_.end()) {
        // A store into a shadow page is reported as it happens, like a trap.
        const EntityId leaf = it->second;
        learn_turnaround(leaf, ch);
        mark_busy(leaf, true);
        queue_cap_.meter(leaf);
        // A metered bursty leaf returns through here, not through a
        // trapped doorbell: it may preempt as doorbell_trapped() lets it.
        const Node& n = fq_.nodes_[leaf];
        if (n.bursty && n.metered && !n.shadowed) preemption_.returned(ch, ctx_->now());
    }
    // New held work while the engine idles: work conservation may feed it.
    after_event();
}

void HfqPolicy::fence(ChannelId ch, std::uint32_t) {
    forget_kernel(ch);
    feeder_.learn_latency(ch);
    touch(ch);
    // A channel that stays on the engine shows no engine change: its
    // leaf is fed (or found past the cap) here.
    if (auto it = chans_.find(ch); it != chans_.end()) queue_cap_.meter(it->second);
    after_event();
}

void HfqPolicy::channel_error(ChannelId ch, std::uint32_t) {
    forget_kernel(ch);
    if (auto r = runs_.find(ch); r != runs_.end()) r->second.dead = true;
    after_event();
}

void HfqPolicy::engine_changed(std::optional<ChannelId> running) {
    // The channel that left the engine may have ended an entry that
    // asked for no interrupt: feed it now if metered, or see whether
    // its queue is past the cap (a leaf without interrupts has no
    // completions to look at it otherwise).
    if (auto it = chans_.find(left_engine_); left_engine_ != 0 && it != chans_.end()) queue_cap_.meter(it->second);
    if (left_engine_ != 0 && left_engine_ != running.value_or(0)) last_left_ = left_engine_;
    left_engine_ = running.value_or(0);
    if (running) preemption_.seen_running(*running, ctx_->now());
    // On the engine, it has work: no register read to ask.
    if (running)
        if (auto it = chans_.find(*running); it != chans_.end()) mark_busy(it->second);
    after_event();
}

std::optional<Duration> HfqPolicy::accounted(EntityId leaf) const {
    if (leaf >= fq_.nodes_.size()) return Duration{0};
    return fq_.nodes_[leaf].accounted;
}

std::map<std::string, double> HfqPolicy::counters() const {
    return {{"blocks", static_cast<double>(fq_.blocks_)},
            {"unblocks", static_cast<double>(fq_.unblocks_)},
            {"work_conserving_releases", static_cast<double>(feeder_.releases())},
            {"covers", static_cast<double>(feeder_.covers())},
            {"idle_arms", static_cast<double>(idle_arms_)},
            {"anticipations", static_cast<double>(anticipation_.holds())},
            {"preemptions", static_cast<double>(preemption_.preemptions())},
            {"catch_ups", static_cast<double>(catch_up_.catch_ups())},
            {"meters", static_cast<double>(queue_cap_.meters())},
            {"metered_releases", static_cast<double>(queue_cap_.releases())}};
}

void HfqPolicy::after_event() {
    queue_cap_.feed_unheard();
    if (const std::optional<ChannelId> running = ctx_->running_seen()) {
        // Unblocked work is running again: work conservation can rest.
        auto it = chans_.find(*running);
        if (it == chans_.end() || !fq_.nodes_[it->second].shadowed) {
            feeder_.rest();
            if (it != chans_.end()) feeder_.cover(*running, it->second);
        }
        return;
    }
    Time now = ctx_->now();
    if (Time hold = anticipation_.until(now); hold > now) {
        // A returning leaf is expected before a fed kernel would end.
        anticipation_.hold(hold);
        return;
    }
    if (feeder_.feeding()) {
        // Already feeding the GPU from shadow pages and the unblocked
        // entities still have nothing: next entry now, no grace.
        feeder_.release_if_idle();
    } else {
        // New work during a longer wait (resubmit_wait's) is looked at
        // within `grace`, not at the wait's end.
        if (!fq_.shadowed_leaves_.empty()) feeder_.release_by(now + p_.grace);
    }
}

void HfqPolicy::forget_kernel(ChannelId ch) {
    feeder_.forget_kernel(ch);
    preemption_.forget_kernel(ch);
}

}  // namespace pvgpu::hfq

namespace pvgpu {

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
                // Accepted so that older configurations still load (`ignored` below).
                {"poll_us", 500.0,
                 "deprecated, ignored with a warning: hfq no longer polls the engine (the scheduler's accounting "
                 "charges it)"},
                {"settle_us", 5.0, "deprecated, ignored with a warning: the scheduler's accounting reads an idle "
                                   "engine itself"},
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
            },
            {"poll_us", "settle_us"}};
}

std::unique_ptr<Policy> make_hfq(const PolicyParams& p) {
    PolicyInfo info = hfq_info();
    const ParamReader get{p, info};
    hfq::Params params{from_us(get("threshold_ms") * 1000), from_us(get("unblock_ms") * 1000),
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
    return std::make_unique<hfq::HfqPolicy>(params);
}

}  // namespace pvgpu
