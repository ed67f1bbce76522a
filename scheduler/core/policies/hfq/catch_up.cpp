// hfq's catching up for a leaf back below its share: see CatchUp in catch_up.hpp.
#include "core/policies/hfq/hfq.hpp"

namespace pvgpu::hfq {

void CatchUp::returned(EntityId leaf, Duration think) {
    FairQueue& fq = hfq_.fq_;
    const double share = fq.fair_share(leaf);
    if (share >= 1 || think <= 0 || !fq.behind(leaf, 1.0)) return;  // alone, or not behind: nobody to hold
    const Duration cap = hfq_.p_.lag * fq.weight_of(leaf) / static_cast<Duration>(kUnitWeight);
    const auto owed = static_cast<Duration>(static_cast<double>(think) * share / (1 - share));
    const Duration credit = std::min(cap, owed);
    if (credit <= 0) return;
    const bool first = catching_.empty();
    catching_[leaf] = Credit{fq.nodes_[leaf].accounted, credit};
    ++catch_ups_;
    if (first)
        refresh_all();
    else
        fq.refresh(leaf);
}

void CatchUp::charged(EntityId leaf) {
    auto it = catching_.find(leaf);
    if (it == catching_.end()) return;
    FairQueue& fq = hfq_.fq_;
    if (fq.nodes_[leaf].accounted - it->second.charged_at_return >= it->second.credit || !fq.behind(leaf, 1.0))
        ended(leaf);
}

void CatchUp::ended(EntityId leaf) {
    if (catching_.erase(leaf) == 0) return;
    if (catching_.empty())
        refresh_all();
    else if (leaf < hfq_.fq_.nodes_.size())
        hfq_.fq_.refresh(leaf);
}

Duration CatchUp::credit(EntityId leaf) const {
    auto it = catching_.find(leaf);
    if (it == catching_.end()) return 0;
    return it->second.credit - (hfq_.fq_.nodes_[leaf].accounted - it->second.charged_at_return);
}

bool CatchUp::shadowed(EntityId leaf, bool blocked_above) const {
    if (catching_.empty()) return blocked_above;
    if (catching_.count(leaf)) return false;
    // Held: the leaves that ask for their share or more, only while in the
    // run queue (shadowing the channels of leaves that have not submitted
    // for a while would remap them all per return).  A leaf below its share
    // is owed its returns as much: it catches up itself when it returns.
    const Node& n = hfq_.fq_.nodes_[leaf];
    return blocked_above || (n.active && !n.below_share);
}

void CatchUp::refresh_all() {
    hfq_.fq_.refresh(kRootEntity, false);  // every leaf once, blocked ancestors passed down
}

}  // namespace pvgpu::hfq
