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
#include "core/policies/hfq/hfq.hpp"

namespace pvgpu::hfq {

Duration HfqPolicy::queue_cap() const {
    return static_cast<Duration>(crowd_scale(active_leaves_, p_.queue) * static_cast<double>(p_.queue));
}

Duration HfqPolicy::queued(EntityId leaf, bool held) const {
    Duration q = 0;
    for (const Queue& c : queues_of(leaf))
        q += c.work() + (held ? static_cast<Duration>(ctx_->held(c.ch)) * c.length : 0);
    return q;
}

HfqPolicy::Queue HfqPolicy::queue_of(ChannelId ch) const {
    const std::uint32_t get = ctx_->gpu().read_ib_get(ch);
    return Queue{ch, ctx_->gpu_put(ch) - get, kernel_length(ch, get)};
}

std::vector<HfqPolicy::Queue> HfqPolicy::queues_of(EntityId leaf) const {
    std::vector<Queue> qs;
    for (ChannelId ch : ctx_->channels_of(leaf))
        if (live(ch)) qs.push_back(queue_of(ch));
    return qs;
}

Duration HfqPolicy::kernel_length(ChannelId ch, std::optional<std::uint32_t> get) const {
    if (Duration est = ctx_->kernel_estimate(ch); est > 0) return est;
    auto r = runs_.find(ch);
    if (r == runs_.end()) return 0;
    const std::uint32_t started = get.value_or(ctx_->gpu().read_ib_get(ch)) - r->second.get_at_open;
    return started >= 2 ? r->second.charged / started : 0;
}

bool HfqPolicy::live(ChannelId ch) const {
    auto r = runs_.find(ch);
    return r != runs_.end() && !r->second.dead;
}

bool HfqPolicy::learned(EntityId leaf) const {
    for (ChannelId ch : ctx_->channels_of(leaf))
        if (live(ch) && has_work(ch) && kernel_length(ch) == 0) return false;
    return true;
}

void HfqPolicy::set_metered(EntityId leaf, bool metered) {
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

void HfqPolicy::feed_unheard() {
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

bool HfqPolicy::known_pending(ChannelId ch) const {
    auto r = runs_.find(ch);
    if (r == runs_.end() || !r->second.pending_as_of) return false;
    return r->second.pending_as_of == ctx_->gpu().left_engine_at(ch);
}

bool HfqPolicy::read_pending(ChannelId ch) {
    const bool pending = ctx_->gpu().pending(ch);
    if (auto r = runs_.find(ch); r != runs_.end())
        r->second.pending_as_of = pending ? ctx_->gpu().left_engine_at(ch) : std::nullopt;
    return pending;
}

void HfqPolicy::meter(EntityId leaf) {
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

}  // namespace pvgpu::hfq
