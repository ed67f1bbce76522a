// hfq's work conservation: see Feeder in feeder.hpp.
#include "core/policies/hfq/hfq.hpp"

namespace pvgpu::hfq {

void Feeder::learn_latency(ChannelId ch) {
    const std::optional<Time> done = hfq_.ctx_->gpu().left_engine_at(ch);
    if (!done) return;
    latencies_[latency_next_++ % latencies_.size()] = std::max<Duration>(0, hfq_.ctx_->now() - *done);
    irq_latency_ = *std::min_element(latencies_.begin(), latencies_.end());
}

void Feeder::cover(ChannelId ch, EntityId runner) {
    if (irq_latency_ < hfq_.p_.grace || hfq_.fq_.shadowed_leaves_.empty()) return;
    if (hfq_.catch_up_.any()) return;  // nothing goes behind a leaf catching up
    const std::vector<Node>& nodes = hfq_.fq_.nodes_;
    for (const auto& [c, leaf] : hfq_.chans_)
        if (leaf != runner && nodes[leaf].active && !nodes[leaf].shadowed && nodes[leaf].idle_since < 0)
            return;  // its work may follow: the engine will not idle
    if (cover_pending()) return;
    const EntityId best = feed_candidate();
    if (best == kNoEntity || hfq_.fq_.lead_of(best) > static_cast<double>(hfq_.p_.feed_lead)) return;
    if (hfq_.ctx_->gpu_put(ch) != hfq_.ctx_->gpu().read_ib_get(ch)) return;  // its own work follows
    for (ChannelId c : hfq_.ctx_->channels_of(best)) {
        if (hfq_.ctx_->release(c, 1) != 0) {
            ++covers_;
            cover_ch_ = c;
            cover_put_ = hfq_.ctx_->gpu_put(c);
            return;
        }
    }
}

bool Feeder::cover_pending() {
    if (cover_ch_ == 0 || !hfq_.live(cover_ch_)) return false;
    if (static_cast<std::int32_t>(hfq_.ctx_->gpu().read_ib_get(cover_ch_) - cover_put_) >= 0) {
        cover_ch_ = 0;
        return false;
    }
    return true;
}

bool Feeder::hold_until(Time at) {
    if (grace_timer_.armed() && grace_at_ >= at) return false;
    grace_at_ = at;
    grace_timer_.arm(at, [this] { release_if_idle(); });
    return true;
}

void Feeder::forget_ended() {
    if (fed_ch_ != 0 && hfq_.ctx_->gpu().left_engine_at(fed_ch_) != fed_done_) fed_ch_ = 0;
}

void Feeder::release_by(Time at) {
    if (grace_timer_.armed() && grace_at_ <= at) return;
    grace_at_ = at;
    grace_timer_.arm(at, [this] { release_if_idle(); });
}

Duration Feeder::feed_estimate() {
    EntityId leaf = feed_candidate();
    if (leaf == kNoEntity) return 0;
    return feed_estimate(leaf);
}

Duration Feeder::feed_estimate(EntityId leaf, bool pessimistic) const {
    Duration est = std::numeric_limits<Duration>::max();
    for (ChannelId ch : hfq_.ctx_->channels_of(leaf))
        if (Duration k = hfq_.ctx_->kernel_estimate(ch); k > 0 && hfq_.ctx_->held(ch) > 0)
            est = std::min(est, pessimistic ? k + 2 * hfq_.ctx_->kernel_spread(ch) : k);
    return est;
}

void Feeder::release_if_idle() {
    // A probe of an unknown think time that ran out: the leaf thinks
    // longer than anticipation could pay for.
    if (hfq_.p_.anticipate > 0)
        for (EntityId leaf : hfq_.idle_candidates_) {
            Node& n = hfq_.fq_.nodes_[leaf];
            if (n.think < 0 && n.idle_since >= 0 && hfq_.ctx_->now() - n.idle_since >= hfq_.p_.anticipate)
                n.think = hfq_.p_.anticipate;
        }
    if (hfq_.fq_.shadowed_leaves_.empty()) return;
    if (hfq_.ctx_->engine_status()) return;
    // The engine idles with work held back because these unblocked
    // leaves are between bursts: watch for their returns from now on.
    for (EntityId leaf : hfq_.idle_candidates_)
        if (!hfq_.fq_.nodes_[leaf].shadowed) hfq_.set_bursty(leaf, true);
    bool beyond_cap = false;
    EntityId best = feed_candidate(&beyond_cap);
    if (best == kNoEntity) return;
    if (const Time until = resubmit_wait(best); until > hfq_.ctx_->now()) {
        release_by(until);
        return;
    }
    // Hand the GPU one held entry straight from the shadow page: no remap,
    // the leaf stays blocked, and the engine is busy again at once.
    for (ChannelId ch : hfq_.ctx_->channels_of(best)) {
        if (hfq_.ctx_->release(ch, 1) != 0) {
            ++wc_releases_;
            feeding_ = true;
            fed_ch_ = ch;
            fed_at_ = hfq_.ctx_->now();
            fed_done_ = hfq_.ctx_->gpu().left_engine_at(ch);
            fed_beyond_cap_ = beyond_cap;
            break;
        }
    }
}

Time Feeder::resubmit_wait(EntityId best) const {
    const Time now = hfq_.ctx_->now();
    const double best_lead = hfq_.fq_.lead_of(best);
    Time until = -1;
    auto consider = [&](EntityId leaf) {
        const Node& n = hfq_.fq_.nodes_[leaf];
        if (!n.shadowed || !n.active) return;
        const Duration burst = std::max<Duration>(0, n.burst);
        if (n.turnaround > burst || hfq_.fq_.lead_of(leaf) >= best_lead) return;
        const Duration window = std::max(hfq_.p_.grace, std::min(2 * n.turnaround, burst));
        if (const std::optional<Time> done = hfq_.last_completion(leaf); done && now - *done < window)
            until = std::max(until, *done + window);
    };
    // Leaves seen without work, and the one whose channel has just left
    // the engine (its completion may not have been handled yet).
    for (EntityId leaf : hfq_.idle_candidates_) consider(leaf);
    const ChannelId left = hfq_.last_left_;
    if (auto it = hfq_.chans_.find(left); left != 0 && it != hfq_.chans_.end()) consider(it->second);
    if (until > now && feed_estimate(best) <= until - now) return -1;
    return until;
}

const Node* Feeder::next_return() const {
    const Node* first = nullptr;
    for (EntityId leaf : hfq_.idle_candidates_) {
        const Node& n = hfq_.fq_.nodes_[leaf];
        if (!n.below_share || n.shadowed || n.idle_since < 0 || n.think < 0) continue;
        if (!first || n.idle_since + n.think < first->idle_since + first->think) first = &n;
    }
    return first;
}

EntityId Feeder::fit_to_return(EntityId best, double best_lead) const {
    const Node* back = next_return();
    if (!back) return best;
    const Time now = hfq_.ctx_->now();
    const Duration left = back->idle_since + back->think - now;
    // Nothing fed since the leaf went idle: its whole think is ahead.
    const bool think_starts = fed_at_ < back->idle_since;
    EntityId fits = kNoEntity, overruns = kNoEntity;
    double fits_lead = INFINITY, overruns_lead = INFINITY;
    for (const auto& [lead, leaf] : candidates_) {
        if (lead > best_lead + static_cast<double>(hfq_.p_.threshold)) continue;
        const Duration est = feed_estimate(leaf);
        if (est <= left && lead < fits_lead) {
            fits = leaf;
            fits_lead = lead;
        } else if (est > left && lead < overruns_lead) {
            overruns = leaf;
            overruns_lead = lead;
        }
    }
    if (overruns != kNoEntity && (think_starts || fits == kNoEntity)) return overruns;
    return fits != kNoEntity ? fits : best;
}

EntityId Feeder::feed_candidate(bool* beyond_cap) const {
    EntityId best = kNoEntity;
    double best_lead = INFINITY;
    candidates_.clear();
    for (EntityId leaf : hfq_.fq_.shadowed_leaves_) {
        bool held = false;
        for (ChannelId ch : hfq_.ctx_->channels_of(leaf)) held = held || hfq_.ctx_->held(ch) > 0;
        if (!held) continue;
        const double lead = hfq_.fq_.lead_of(leaf);
        candidates_.push_back({lead, leaf});
        if (lead < best_lead) {
            best_lead = lead;
            best = leaf;
        }
    }
    if (candidates_.size() > 1) best = fit_to_return(best, best_lead);
    // Fed further, it would run away from a sibling that is only between
    // bursts: that one is owed the GPU when it returns, unless the fed
    // kernel is likely over by then.  Feeding another leaf instead
    // would starve the least-ahead one: hold the engine.
    // Fed past the cap, the kernel is the returning leaf's to take back
    // on a preemptive engine (preempt_for).
    if (best != kNoEntity && best_lead > static_cast<double>(hfq_.p_.feed_lead)) {
        if (delays_return(best, feed_estimate(best), feed_estimate(best, true))) return kNoEntity;
        if (beyond_cap) *beyond_cap = true;
    }
    return best;
}

bool Feeder::delays_return(EntityId fed, Duration est, Duration longest) const {
    Time now = hfq_.ctx_->now();
    std::optional<double> fed_shortfall;  // the same for every thinking leaf: once
    for (EntityId leaf : hfq_.idle_candidates_) {
        const Node& n = hfq_.fq_.nodes_[leaf];
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
        if (!hfq_.preemption_.possible()) {
            const Duration added = std::max<Duration>(0, longest - until_back) -
                                   std::max<Duration>(0, longest - n.think);
            if (added > 0) {
                if (!fed_shortfall) fed_shortfall = hfq_.fq_.shortfall(fed);
                if (hfq_.fq_.shortfall(leaf) > *fed_shortfall) return true;
            }
            if (!n.shadowed && until_back <= kHoldBursts * n.burst && added > until_back) return true;
        }
        if (n.shadowed) continue;
        // Demand (burst / (burst + think)) below its fair share: max-min
        // fairness owes it its demand, not a GPU held at everyone's cost.
        if (hfq_.fq_.demand(leaf) < hfq_.fq_.fair_share(leaf)) continue;
        // Idling longer than the burst it would protect costs the others
        // more GPU time than the returning leaf gets back.
        if (until_back > n.burst) continue;
        // On a preemptive engine a leaf that thinks longer than a
        // preemption takes the engine back when it returns: it waits
        // the preemption's dead time, not the rest of the kernel.
        Duration wait = est - until_back;
        const Preemption& preemption = hfq_.preemption_;
        if (preemption.possible() && n.think >= preemption.cost()) wait = std::min(wait, preemption.cost());
        if (wait > until_back) return true;
    }
    return false;
}

}  // namespace pvgpu::hfq
