// hfq's view of each leaf: when it has work, when it thinks, and the
// channel modes that follow (see HfqPolicy in hfq.hpp).
//
// A shadowed leaf's new work is seen from the device's report of its
// doorbell (work_held), a direct leaf's from its completions and the
// accounting's reads.  When nothing has had work for `idle_us`, every
// channel traps its next doorbell, so a returning host is seen at once.
//
// Bursty leaves (BFQ's idling, EEVDF's lag): an unblocked leaf whose
// absence left the engine idle with held work is thinking between bursts.
// Its doorbells are trapped from then on, so its think time is learned
// exactly.  A returning leaf keeps up to `lag` of credit, more than
// `threshold`, so its siblings stay blocked while it bursts.
#include "core/policies/hfq/hfq.hpp"

namespace pvgpu::hfq {

void HfqPolicy::touch(ChannelId ch) {
    auto it = chans_.find(ch);
    if (it == chans_.end()) return;
    EntityId leaf = it->second;
    if (has_work_at_fence(ch, leaf)) {
        mark_busy(leaf);
    } else if (fq_.nodes_[leaf].idle_since < 0) {
        Node& n = fq_.nodes_[leaf];
        n.idle_since = ctx_->now();
        n.went_idle = n.idle_since;
        idle_candidates_.insert(leaf);
        catch_up_.ended(leaf);
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
        Node& n = fq_.nodes_[leaf];
        n.idle_since = ctx_->now();
        n.went_idle = n.idle_since;
    }
}

void HfqPolicy::set_bursty(EntityId leaf, bool bursty) {
    Node& n = fq_.nodes_[leaf];
    if (n.bursty == bursty) return;
    n.bursty = bursty;
    apply_modes(leaf);
}

ChannelMode HfqPolicy::mode_of(EntityId leaf) const {
    const Node& n = fq_.nodes_[leaf];
    if (n.shadowed || n.metered) return ChannelMode::Shadowed;
    return n.bursty || n.below_share ? ChannelMode::Trapped : ChannelMode::Direct;
}

ChannelMode HfqPolicy::mode_of(ChannelId ch, EntityId leaf) const {
    const ChannelMode m = mode_of(leaf);
    return m == ChannelMode::Direct && idle_trapped_.count(ch) ? ChannelMode::Trapped : m;
}

void HfqPolicy::learn_turnaround(EntityId leaf, ChannelId ch) {
    Node& n = fq_.nodes_[leaf];
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

void HfqPolicy::mark_busy(EntityId leaf, bool exact) {
    Node& n = fq_.nodes_[leaf];
    Duration think = -1;
    if (n.went_idle >= 0) {
        // Back from a think (perhaps one longer than `idle`, which took
        // it out of the run queue).  Seen by a trapped doorbell or while
        // the engine was held for it, the time is close (the accounting's
        // settle reads); seen while a fed kernel ran, it is only an upper
        // bound and may only lower the estimate.
        // The first think is learned even as a bound: it may show a leaf
        // below its share, whose doorbells then trap.
        think = ctx_->now() - n.went_idle;
        exact = exact || ctx_->now() <= anticipation_.held_until() + kReturnSeenWithin;
        if (exact || n.think < 0)
            n.think = n.think < 0 ? think : n.think + (think - n.think) / 4;
        else
            n.think = std::min(n.think, think);
    }
    n.idle_since = -1;
    n.went_idle = -1;
    n.burst_from = n.accounted;
    idle_candidates_.erase(leaf);
    fq_.activate(leaf);
    if (think < 0) return;
    if (think > kMaxStay * p_.idle) set_bursty(leaf, false);
    // A leaf that asks for less than its share (not alone) is owed its
    // returns at once: its doorbells trap, so that they are seen.
    const double share = fq_.fair_share(leaf);
    set_below_share(leaf, share < 1 && fq_.demand(leaf) < share);
    // It catches up on a return seen as it happened: a think learned late
    // is longer than it was, and the credit with it.
    if (n.below_share && exact) catch_up_.returned(leaf, think);
}

void HfqPolicy::set_below_share(EntityId leaf, bool below) {
    Node& n = fq_.nodes_[leaf];
    if (n.below_share == below) return;
    n.below_share = below;
    const bool was_shadowed = n.shadowed;
    if (catch_up_.any()) fq_.refresh(leaf);  // held or not (CatchUp::shadowed)
    if (n.shadowed == was_shadowed) apply_modes(leaf);  // else shadow_changed applied them
}

void HfqPolicy::apply_modes(EntityId leaf) {
    if (idle_armed_) return;  // modes are restored on wake-up
    for (ChannelId ch : ctx_->channels_of(leaf)) ctx_->set_mode(ch, mode_of(ch, leaf));
}

void HfqPolicy::arm_idle_check(Time at) {
    if (idle_timer_.armed() && idle_check_at_ <= at) return;
    idle_check_at_ = at;
    idle_timer_.arm(at, [this] { idle_check(); });
}

Duration HfqPolicy::stay_of(const Node& n) const {
    if (!n.bursty || n.think < 0) return p_.idle;
    return std::clamp(n.think + n.think / 2, p_.idle, kMaxStay * p_.idle);
}

void HfqPolicy::idle_check() {
    const Time now = ctx_->now();
    std::vector<EntityId> quiet;
    Time next = -1;
    for (EntityId leaf : idle_candidates_) {
        const Time due = fq_.nodes_[leaf].idle_since + stay_of(fq_.nodes_[leaf]);
        if (now >= due)
            quiet.push_back(leaf);
        else if (next < 0 || due < next)
            next = due;
    }
    for (EntityId leaf : quiet) {
        if (leaf_has_work(leaf))
            mark_busy(leaf);
        else
            fq_.deactivate(leaf);
    }
    if (next >= 0) arm_idle_check(next);
    if (fq_.active_leaves_ == 0 && !idle_armed_ && !ctx_->running_seen() && !chans_.empty()) arm_idle();
    after_event();
}

void HfqPolicy::arm_idle() {
    idle_armed_ = true;
    ++idle_arms_;
    for (auto& [ch, leaf] : chans_) {
        idle_trapped_.insert(ch);
        ctx_->set_mode(ch, ChannelMode::Trapped);
    }
}

void HfqPolicy::leave_idle_trap(ChannelId ch) {
    const bool was = idle_trapped_.erase(ch) > 0;
    if (idle_armed_) {
        wake_from_idle();
    } else if (was) {
        if (auto it = chans_.find(ch); it != chans_.end()) ctx_->set_mode(ch, mode_of(ch, it->second));
    }
}

void HfqPolicy::wake_from_idle() {
    idle_armed_ = false;
    for (auto& [ch, leaf] : chans_) ctx_->set_mode(ch, mode_of(ch, leaf));
    // Held while every channel trapped: metered leaves are fed now.
    for (EntityId leaf : std::vector<EntityId>(queue_cap_.metered().begin(), queue_cap_.metered().end()))
        queue_cap_.meter(leaf);
}

bool HfqPolicy::has_work(ChannelId ch) const {
    return ctx_->held(ch) > 0 || ctx_->gpu().pending(ch);
}

bool HfqPolicy::leaf_has_work(EntityId leaf) const {
    for (ChannelId c : ctx_->channels_of(leaf))
        if (has_work(c)) return true;
    return false;
}

bool HfqPolicy::has_work_at_fence(ChannelId ch, EntityId leaf) const {
    const std::optional<ChannelId> running = ctx_->running_seen();
    if (running == ch) return true;
    if (running) return leaf_has_work(leaf);
    for (ChannelId c : ctx_->channels_of(leaf))
        if (ctx_->held(c) > 0) return true;
    return false;
}

std::optional<Time> HfqPolicy::last_completion(EntityId leaf) const {
    std::optional<Time> done;
    for (ChannelId ch : ctx_->channels_of(leaf))
        if (const std::optional<Time> t = ctx_->gpu().left_engine_at(ch); live(ch) && t && (!done || *t > *done))
            done = t;
    if (done) done = std::min(*done, ctx_->now());
    return done;
}

bool HfqPolicy::live(ChannelId ch) const {
    if (ch < runs_by_id_.size()) return runs_by_id_[ch] && !runs_by_id_[ch]->dead;
    auto r = runs_.find(ch);
    return r != runs_.end() && !r->second.dead;
}

void HfqPolicy::shadow_changed(EntityId leaf, bool shadowed) {
    apply_modes(leaf);
    // Unblocked but metered: its held work goes out as the GPU drains it.
    if (!shadowed) queue_cap_.meter(leaf);
}

void HfqPolicy::leaf_left(EntityId leaf) {
    idle_candidates_.erase(leaf);
    catch_up_.ended(leaf);
    queue_cap_.set_metered(leaf, false);
    // Alone on the GPU, a leaf has nobody to run ahead of.  One that
    // has not started keeps its meter until it does.
    if (fq_.active_leaves_ == 1)
        for (EntityId m : std::vector<EntityId>(queue_cap_.metered().begin(), queue_cap_.metered().end()))
            if (fq_.nodes_[m].active) queue_cap_.set_metered(m, false);
    if (fq_.active_leaves_ == 0) arm_idle_check(ctx_->now() + p_.idle);
}

}  // namespace pvgpu::hfq
