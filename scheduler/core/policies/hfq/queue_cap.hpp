#pragma once

#include "core/policies/hfq/fair_queue.hpp"

namespace pvgpu::hfq {

class HfqPolicy;

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
// State: the metered leaves and the scan that finds those whose last entry
// ended unheard.
class QueueCap {
public:
    explicit QueueCap(HfqPolicy& hfq) : hfq_(hfq) {}

    // Meter a leaf whose queue has grown past `queue` while it shares the
    // GPU; feed a metered, unblocked one up to `queue`.
    void meter(EntityId leaf);
    void set_metered(EntityId leaf, bool metered);
    // A metered leaf is fed at its own completions and when its channel is
    // seen leaving the engine.  An entry that asked for no interrupt and ran
    // unseen between two reads ends unheard: such a leaf (held work, nothing
    // left on the GPU) is looked for whenever the engine is seen idle, and
    // otherwise at most once per `queue` of events, so a scan over the
    // metered leaves is not paid per kernel.
    void feed_unheard();
    const IdSet& metered() const { return metered_; }
    // The leaf is gone.
    void forget(EntityId leaf) { metered_.erase(leaf); }
    std::uint64_t meters() const { return meters_; }
    std::uint64_t releases() const { return metered_releases_; }

private:
    Duration queue_cap() const;
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
    // Every live channel of the leaf that has work has a kernel length.
    bool learned(EntityId leaf) const;
    // Whether the GPU still has work of `ch`, known without a register read.
    // Work stops pending only when its last entry completes, and every
    // completion moves the channel's completion timestamp (written with the
    // fence, interrupt or not): a channel read pending that has completed
    // nothing since still is.
    bool known_pending(ChannelId ch) const;
    bool read_pending(ChannelId ch);
    // scan_ := the metered leaves that are not shadowed, in id order.
    void unshadowed_metered();

    HfqPolicy& hfq_;
    IdSet metered_;
    std::vector<EntityId> scan_;  // feed_unheard's copy of the unshadowed metered_
    bool scanning_ = false;       // feed_unheard is walking scan_
    Time scanned_at_ = -1;      // last look for metered leaves left without work on the GPU
    std::uint64_t meters_ = 0;
    std::uint64_t metered_releases_ = 0;
};

}  // namespace pvgpu::hfq
