// hfq's queue cap: see QueueCap in queue_cap.hpp.
#include "core/policies/hfq/hfq.hpp"

namespace pvgpu::hfq {

Duration QueueCap::queue_cap() const {
    const Duration queue = hfq_.p_.queue;
    return static_cast<Duration>(hfq_.fq_.crowd_scale(hfq_.fq_.active_leaves_, queue) * static_cast<double>(queue));
}

Duration QueueCap::queued(EntityId leaf, bool held) const {
    // queues_of()'s walk without its vector: this runs at every fence.
    Duration q = 0;
    for (ChannelId ch : hfq_.ctx_->channels_of(leaf)) {
        if (!hfq_.live(ch)) continue;
        const Queue c = queue_of(ch);
        q += c.work() + (held ? static_cast<Duration>(hfq_.ctx_->held(c.ch)) * c.length : 0);
    }
    return q;
}

QueueCap::Queue QueueCap::queue_of(ChannelId ch) const {
    const std::uint32_t get = hfq_.ctx_->gpu().read_ib_get(ch);
    return Queue{ch, hfq_.ctx_->gpu_put(ch) - get, kernel_length(ch, get)};
}

std::vector<QueueCap::Queue> QueueCap::queues_of(EntityId leaf) const {
    std::vector<Queue> qs;
    for (ChannelId ch : hfq_.ctx_->channels_of(leaf))
        if (hfq_.live(ch)) qs.push_back(queue_of(ch));
    return qs;
}

Duration QueueCap::kernel_length(ChannelId ch, std::optional<std::uint32_t> get) const {
    if (Duration est = hfq_.ctx_->kernel_estimate(ch); est > 0) return est;
    auto r = hfq_.runs_.find(ch);
    if (r == hfq_.runs_.end()) return 0;
    const std::uint32_t started = get.value_or(hfq_.ctx_->gpu().read_ib_get(ch)) - r->second.get_at_open;
    return started >= 2 ? r->second.charged / started : 0;
}

bool QueueCap::learned(EntityId leaf) const {
    for (ChannelId ch : hfq_.ctx_->channels_of(leaf))
        if (hfq_.live(ch) && hfq_.has_work(ch) && kernel_length(ch) == 0) return false;
    return true;
}

void QueueCap::set_metered(EntityId leaf, bool metered) {
    Node& n = hfq_.fq_.nodes_[leaf];
    if (n.metered == metered) return;
    n.metered = metered;
    if (!metered) n.provisional = false;
    if (metered) {
        metered_.insert(leaf);
        ++meters_;
    } else {
        metered_.erase(leaf);
    }
    hfq_.apply_modes(leaf);  // back to direct releases everything held
}

void QueueCap::feed_unheard() {
    if (metered_.empty()) return;
    const Time now = hfq_.ctx_->now();
    if (hfq_.ctx_->running_seen() && now - scanned_at_ < hfq_.p_.queue) return;
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
    unshadowed_metered();
    for (EntityId leaf : scan_) {
        if (hfq_.fq_.nodes_[leaf].shadowed || hfq_.idle_armed_) continue;  // meter() would not feed it
        const auto& chs = hfq_.ctx_->channels_of(leaf);
        const bool held = std::any_of(chs.begin(), chs.end(), [&](ChannelId ch) { return hfq_.ctx_->held(ch) > 0; });
        if (!held || std::any_of(chs.begin(), chs.end(), [&](ChannelId ch) { return known_pending(ch); }))
            continue;
        if (std::none_of(chs.begin(), chs.end(), [&](ChannelId ch) { return read_pending(ch); })) meter(leaf);
    }
}

void QueueCap::unshadowed_metered() {
    // A shadowed leaf is skipped below, and nothing in the walk unshadows
    // one (blocks change only as GPU time is charged or leaves come and
    // go): only the unshadowed are copied, word by word, not every metered
    // leaf (thousands at 4096 leaves, most of them blocked).
    scan_.clear();
    const std::vector<std::uint64_t>& metered = metered_.words();
    const std::vector<std::uint64_t>& shadowed = hfq_.fq_.shadowed_leaves_.words();
    for (std::size_t i = 0; i < metered.size(); ++i) {
        std::uint64_t w = metered[i] & ~(i < shadowed.size() ? shadowed[i] : 0);
        for (; w != 0; w &= w - 1)
            scan_.push_back(static_cast<EntityId>(i * 64 + static_cast<std::size_t>(__builtin_ctzll(w))));
    }
}

bool QueueCap::known_pending(ChannelId ch) const {
    auto r = hfq_.runs_.find(ch);
    if (r == hfq_.runs_.end() || !r->second.pending_as_of) return false;
    return r->second.pending_as_of == hfq_.ctx_->gpu().left_engine_at(ch);
}

bool QueueCap::read_pending(ChannelId ch) {
    const bool pending = hfq_.ctx_->gpu().pending(ch);
    if (auto r = hfq_.runs_.find(ch); r != hfq_.runs_.end())
        r->second.pending_as_of = pending ? hfq_.ctx_->gpu().left_engine_at(ch) : std::nullopt;
    return pending;
}

void QueueCap::meter(EntityId leaf) {
    if (hfq_.p_.queue <= 0 || leaf >= hfq_.fq_.nodes_.size()) return;
    Node& n = hfq_.fq_.nodes_[leaf];
    if (!n.metered) {
        if (!n.active || hfq_.fq_.active_leaves_ < 2 || queued(leaf) <= queue_cap()) return;
        // Its channels may already be shadowed (blocked) with work
        // held: fed below if it is not blocked.
        set_metered(leaf, true);
    } else if (n.active && hfq_.fq_.active_leaves_ < 2) {
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
    if (n.shadowed || hfq_.idle_armed_) return;  // blocked: only work conservation feeds it
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
            if (hfq_.ctx_->held(c.ch) > 0 && (!next || c.waiting < next->waiting)) next = &c;
        if (!next) return;
        // A channel without a learned length gets one entry at a time.
        if (next->length == 0 && next->waiting > 0) return;
        if (q > 0 && q + next->length > queue_cap()) return;
        if (hfq_.ctx_->release(next->ch, 1) == 0) return;
        ++metered_releases_;
        q -= next->work();
        *next = queue_of(next->ch);
        q += next->work();
    }
}

}  // namespace pvgpu::hfq
