// FairQueue, hfq's fair queuing (fair_queue.hpp has the worked example).
// First the per-level virtual time: charge() advances a leaf and its
// ancestors, activate()/deactivate() enter and leave run queues,
// rebalance() blocks and unblocks siblings, refresh() tells the policy
// which leaves are shadowed.  Then what is read off it: leads, fair and
// max-min shares.
#include "core/policies/hfq/hfq.hpp"

namespace pvgpu::hfq {

Node& FairQueue::node(EntityId id) {
    if (nodes_.size() <= id) nodes_.resize(std::max<std::size_t>(id + 1, ctx_->tree().id_bound()));
    return nodes_[id];
}

void FairQueue::charge(EntityId leaf, Duration d) {
    nodes_[leaf].accounted += d;
    for (EntityId id = leaf; id != kRootEntity; id = parent_of(id)) {
        Node& n = nodes_[id];
        double inc = static_cast<double>(d) * kUnitWeight / weight_of(id);
        if (n.active) {
            RunQueue& rq = nodes_[parent_of(id)].rq;
            auto& set = n.blocked ? rq.blocked : rq.open;
            // Re-keyed in its own tree node: no free and malloc per level per charge.
            auto key = set.extract({n.vtime, id});
            n.vtime += inc;
            key.value().vtime = n.vtime;
            set.insert(std::move(key));
        } else {
            n.vtime += inc;
        }
    }
    for (EntityId id = parent_of(leaf);; id = parent_of(id)) {
        rebalance(id);
        if (id == kRootEntity) break;
    }
}

void FairQueue::activate(EntityId id) {
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
    n.counted_weight = weight_of(id);
    rq.weights += n.counted_weight;
    activate(parent);
    rebalance(parent);
    if (ctx_->tree().is_leaf(id)) refresh(id);  // a catch-up may hold it
}

void FairQueue::deactivate(EntityId id) {
    Node& n = nodes_[id];
    if (!n.active) return;
    EntityId parent = parent_of(id);
    RunQueue& rq = nodes_[parent].rq;
    rq.floor = std::max(rq.floor, rq.min_vtime());
    (n.blocked ? rq.blocked : rq.open).erase({n.vtime, id});
    rq.weights -= n.counted_weight;
    n.active = false;
    n.idle_since = -1;
    if (ctx_->tree().is_leaf(id)) {
        --active_leaves_;
        listener_.leaf_left(id);
    }
    if (n.blocked) {
        n.blocked = false;
        refresh(id);
    } else if (n.shadowed) {
        refresh(id);  // held while in the run queue (CatchUp)
    }
    if (rq.empty()) {
        if (parent != kRootEntity) deactivate(parent);
    } else {
        rebalance(parent);
    }
}

void FairQueue::weight_changed(EntityId id) {
    Node& n = nodes_[id];
    if (!n.active) return;
    RunQueue& rq = nodes_[parent_of(id)].rq;
    rq.weights = rq.weights - n.counted_weight + weight_of(id);
    n.counted_weight = weight_of(id);
}

void FairQueue::rebalance(EntityId parent) {
    RunQueue& rq = nodes_[parent].rq;
    if (rq.empty()) return;
    lift_thinking(rq);
    double m = rq.min_vtime();
    rq.floor = std::max(rq.floor, m);
    // One factor for both bounds, so unblock stays within threshold.
    const double scale = crowd_scale(rq.open.size() + rq.blocked.size(), p_.threshold);
    while (!rq.open.empty() && rq.open.rbegin()->vtime - m > scale * static_cast<double>(p_.threshold)) {
        auto key = rq.open.extract(std::prev(rq.open.end()));
        const Key k = key.value();
        rq.blocked.insert(std::move(key));
        nodes_[k.id].blocked = true;
        ++blocks_;
        refresh(k.id);
    }
    while (!rq.blocked.empty() && rq.blocked.begin()->vtime - m <= scale * static_cast<double>(p_.unblock)) {
        unblock(rq, *rq.blocked.begin());
    }
}

void FairQueue::unblock(RunQueue& rq, Key k) {
    rq.open.insert(rq.blocked.extract(k));
    nodes_[k.id].blocked = false;
    ++unblocks_;
    refresh(k.id);
}

void FairQueue::refresh(EntityId id) {
    bool above = false;  // some strict ancestor of `id` is blocked
    for (EntityId a = parent_of(id); a != kRootEntity; a = parent_of(a)) above = above || nodes_[a].blocked;
    refresh(id, above);
}

void FairQueue::refresh(EntityId id, bool above) {
    // `above` is passed down, not walked up again from each leaf of a
    // blocked VM: shadowing a VM of n tasks is O(n), not O(n * depth).
    const bool blocked = above || nodes_[id].blocked;
    const Entity& e = ctx_->tree().get(id);
    if (!e.children.empty()) {
        for (EntityId c : e.children) refresh(c, blocked);
        return;
    }
    const bool shadow = listener_.shadowed(id, blocked);
    Node& n = nodes_[id];
    if (n.shadowed == shadow) return;
    n.shadowed = shadow;
    if (shadow)
        shadowed_leaves_.insert(id);
    else
        shadowed_leaves_.erase(id);
    listener_.shadow_changed(id, shadow);
}

double FairQueue::crowd_scale(std::size_t n, Duration bound) const {
    if (p_.fair_window <= 0 || n <= static_cast<std::size_t>(p_.fair_window) || bound <= 0) return 1.0;
    const double scale = static_cast<double>(p_.fair_window) / static_cast<double>(n);
    const double floor = std::min(1.0, static_cast<double>(kCrowdFloor) / static_cast<double>(bound));
    return std::max(scale, floor);
}

void FairQueue::lift_thinking(RunQueue& rq) {
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
        auto key = set.extract(k);
        nodes_[k.id].vtime = low;
        key.value().vtime = low;
        set.insert(std::move(key));
    }
}

double FairQueue::lead_of(EntityId leaf) const {
    double lead = 0;
    for (EntityId a = leaf; a != kRootEntity; a = parent_of(a))
        if (nodes_[a].blocked) lead += nodes_[a].vtime - nodes_[parent_of(a)].rq.min_vtime();
    return lead;
}

double FairQueue::fair_share(EntityId leaf) const {
    double share = 1;
    for (EntityId id = leaf; id != kRootEntity; id = parent_of(id)) {
        const RunQueue& rq = nodes_[parent_of(id)].rq;
        const double sum = static_cast<double>(rq.weights + (nodes_[id].active ? 0 : weight_of(id)));
        share *= weight_of(id) / sum;
    }
    return share;
}

bool FairQueue::behind(EntityId leaf, double factor) {
    const Node& n = nodes_[leaf];
    const bool first = n.recent.at < 0;
    const double rate = n.recent.read(n.accounted, ctx_->now(), kRateWindow);
    return first || rate < factor * fair_share(leaf);
}

double FairQueue::demand(EntityId id) const {
    const Node& n = nodes_[id];
    if (!ctx_->tree().is_leaf(id) || n.think < 0 || n.burst <= 0) return INFINITY;
    return static_cast<double>(n.burst) / static_cast<double>(n.burst + n.think);
}

double FairQueue::maxmin_share(EntityId leaf) const {
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

double FairQueue::shortfall(EntityId leaf) const {
    const Node& n = nodes_[leaf];
    return maxmin_share(leaf) - n.sustained.read(n.accounted, ctx_->now(), kBalanceWindow);
}

}  // namespace pvgpu::hfq
