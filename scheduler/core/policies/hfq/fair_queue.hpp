// hfq's fair queuing: per-level virtual time, one run queue per inner entity.
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
// Worked example (threshold 2 ms, unblock 0.5 ms; vtimes in ms).  VM A
// (weight 200) and VM B (weight 100) under the root; B runs two tasks b1
// and b2 of weight 100 each.  Every kernel takes 1 ms and each client
// submits its next one when the last completes.  A 1 ms charge advances A by
// 1 * 100/200 = 0.5, and b1 by 1 * 100/100 = 1 in B's run queue *and* B by
// 1 in the root's: a charge walks up the tree, each level with its own
// weight.  After every charge each level is rebalanced against the least
// vtime among its backlogged children:
//
//   kernel  A    B   b1  b2  B - A  blocked
//   A       0.5  0   0   0   -0.5
//   b1      0.5  1   1   0    0.5   (within B: b1 - b2 = 1, fine)
//   b2      0.5  2   1   1    1.5
//   A       1.0  2   1   1    1.0
//   b1      1.0  3   2   1    2.0   not more than 2: still open
//   b2      1.0  4   2   2    3.0   B, so b1 and b2 are shadowed
//   A x4    3.0  4   2   2    1.0   B (still more than 0.5)
//   A       3.5  4   2   2    0.5   none: B is unblocked
//
// A ran 7 ms to B's 4 (b1 2, b2 2), and over a longer run B's lead swings
// between about 0.5 and 3: A gets 2/3 of the GPU, b1 and b2 1/6 each, the
// product of w / sum(w) down their path.  b1 and b2 never block each other: their
// lead over one another stays within 2.  A task of B that was blocked by its
// sibling would be shadowed alone; B blocked at the root shadows both.
// A child that leaves the run queue (idle for `idle`) and returns starts at
// most `lag` behind the queue's floor (no banked credit), which is how a
// returning bursty leaf keeps its siblings blocked while it bursts.
#pragma once

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdint>
#include <iterator>
#include <limits>
#include <set>
#include <unordered_map>
#include <unordered_set>
#include "core/policies/policies.hpp"

namespace pvgpu::hfq {

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

// A set of entity ids kept as a bitmap: insert and erase in O(1) without
// allocating (a std::set allocated a node per insert, several per kernel at
// thousands of leaves), iterated in ascending id order like a std::set.  An
// iterator reads the live bitmap, so ids inserted or erased ahead of it
// during a walk are seen as a std::set's walk would see them.
class IdSet {
public:
    bool insert(EntityId id) {
        if (words_.size() <= id / 64) words_.resize(id / 64 + 1);
        std::uint64_t& w = words_[id / 64];
        const std::uint64_t bit = std::uint64_t{1} << (id % 64);
        if (w & bit) return false;
        w |= bit;
        ++size_;
        return true;
    }
    std::size_t erase(EntityId id) {
        if (!count(id)) return 0;
        words_[id / 64] &= ~(std::uint64_t{1} << (id % 64));
        --size_;
        return 1;
    }
    std::size_t count(EntityId id) const {
        return id / 64 < words_.size() && (words_[id / 64] >> (id % 64) & 1) ? 1 : 0;
    }
    bool empty() const { return size_ == 0; }
    std::size_t size() const { return size_; }
    // The bitmap, 64 ids a word: sets are combined word by word.
    const std::vector<std::uint64_t>& words() const { return words_; }

    class iterator {
    public:
        using iterator_category = std::input_iterator_tag;
        using value_type = EntityId;
        using difference_type = std::ptrdiff_t;
        using pointer = const EntityId*;
        using reference = EntityId;
        EntityId operator*() const { return id_; }
        iterator& operator++() {
            id_ = set_->next(id_ + 1);
            return *this;
        }
        bool operator!=(const iterator& o) const { return id_ != o.id_; }
        bool operator==(const iterator& o) const { return id_ == o.id_; }

    private:
        friend class IdSet;
        iterator(const IdSet* s, EntityId id) : set_(s), id_(id) {}
        const IdSet* set_;
        EntityId id_;
    };
    iterator begin() const { return {this, next(0)}; }
    iterator end() const { return {this, kEnd}; }

private:
    static constexpr EntityId kEnd = std::numeric_limits<EntityId>::max();
    // The least id in the set at or above `from`, or kEnd.
    EntityId next(EntityId from) const {
        for (std::size_t i = from / 64; i < words_.size(); ++i) {
            std::uint64_t w = words_[i];
            if (i == from / 64) w &= ~std::uint64_t{0} << (from % 64);
            if (w) return static_cast<EntityId>(i * 64 + static_cast<std::size_t>(__builtin_ctzll(w)));
        }
        return kEnd;
    }
    std::vector<std::uint64_t> words_;
    std::size_t size_ = 0;
};

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
    // The weights of open and blocked, kept as they enter and leave so that
    // fair_share() need not walk them; whole numbers, so the sum is exact.
    std::uint64_t weights = 0;

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
    bool below_share = false;  // leaves: asked for less than the fair share at the last return; trapped
    bool metered = false;   // leaves: queue above `queue`: shadowed, fed as the GPU drains it
    bool provisional = false;  // leaves: metered on joining a busy GPU, until a kernel length is learned
    std::uint32_t counted_weight = 0;  // while active: its weight in the parent's RunQueue::weights
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


// The run queues of the tree and their per-level virtual time (the worked
// example above).  HfqPolicy charges it GPU time and tells it when leaves
// have work (activate) and none (deactivate); it blocks and unblocks, and
// tells the Listener which leaves are shadowed and which left.
class FairQueue {
public:
    struct Listener {
        // The leaf is shadowed now (a level above it was blocked), or not.
        virtual void shadow_changed(EntityId leaf, bool shadowed) = 0;
        // The leaf left its run queue (active_leaves_ counts it no more).
        virtual void leaf_left(EntityId leaf) = 0;
        // Whether the leaf is to be shadowed, given whether a level above
        // it is blocked: a mechanism may hold it, or let it through.
        virtual bool shadowed(EntityId leaf, bool blocked_above) const = 0;

    protected:
        ~Listener() = default;
    };

    FairQueue(const Params& p, Listener& listener) : p_(p), listener_(listener) {}
    void start(PolicyContext& ctx) { ctx_ = &ctx; }

    EntityId parent_of(EntityId id) const { return ctx_->tree().get(id).parent; }
    std::uint32_t weight_of(EntityId id) const { return ctx_->tree().get(id).weight; }

    // Among n backlogged siblings each is owed 1/n of any window, so a lead
    // of `threshold` weighs n/fair_window times more than among fair_window:
    // above that many, the bounds shrink with n and keep their weight.  Not
    // below kCrowdFloor (or the configured bound, if smaller): blocks and
    // unblocks churn once the threshold is shorter than a kernel (the
    // simulator's 128-client U rises again below 0.2 ms).
    static constexpr Duration kCrowdFloor = 250 * kMicrosecond;
    Node& node(EntityId id);
    void charge(EntityId leaf, Duration d);
    void activate(EntityId id);
    void deactivate(EntityId id);
    // The entity's weight changed: its parent's run queue counts the new one.
    void weight_changed(EntityId id);
    double crowd_scale(std::size_t n, Duration bound) const;
    // Block children too far ahead of the least-served; unblock those back in range.
    void rebalance(EntityId parent);
    // A leaf thinking between bursts stays in the run queue, where its vtime
    // banks credit.  One that asks for less than its fair share would bank
    // it without bound and pin every sibling to its own pace (a sibling
    // asking more than it, but less than its share, was held to it: 0.139
    // of 0.25 on the timeslice GPU).  Max-min owes it its demand, not a
    // pace: it is kept at most `lag` behind the least-served sibling with
    // work, as it would be on returning to the queue.
    void lift_thinking(RunQueue& rq);
    void unblock(RunQueue& rq, Key k);
    // Re-derive the channel modes of every leaf below `id`.
    void refresh(EntityId id);
    void refresh(EntityId id, bool above);
    // How far a leaf is ahead of its least-ahead siblings, summed over the
    // levels where it is blocked.
    double lead_of(EntityId leaf) const;
    // The leaf's fair share now: w / sum(w) of the backlogged at every level.
    double fair_share(EntityId leaf) const;
    // Is the leaf's recent GPU rate below `factor` of its fair share?  A
    // leaf that gets its share anyway is not worth an idle or preempted
    // engine.
    bool behind(EntityId leaf, double factor = kBehind);
    // What a leaf asks for: burst / (burst + think) of the GPU once both
    // are learned, else all of it.
    double demand(EntityId id) const;
    // The leaf's max-min fair share: at every level the parent's share is
    // water-filled over the backlogged children by weight, a child that
    // asks for less than its part getting what it asks for and the rest
    // going to the others (an inner entity counts as asking for all).
    // fair_share() is the same without demands.
    double maxmin_share(EntityId leaf) const;
    // How far the leaf is below its max-min share, over a window long
    // against its kernels and thinks (a leaf just fed always looks well
    // served over a short one).  Max-min serves the larger first.
    double shortfall(EntityId leaf) const;

private:
    friend class HfqPolicy;
    friend class Feeder;
    friend class QueueCap;
    friend class Anticipation;
    friend class Preemption;
    friend class CatchUp;

    const Params& p_;
    Listener& listener_;
    PolicyContext* ctx_ = nullptr;
    std::vector<Node> nodes_;
    IdSet shadowed_leaves_;
    mutable std::vector<EntityId> ancestors_;               // maxmin_share's scratch
    mutable std::vector<std::pair<double, double>> fill_;   // ... and its water-filling
    std::vector<Key> lifted_;                                // lift_thinking's scratch
    std::size_t active_leaves_ = 0;
    std::uint64_t blocks_ = 0;
    std::uint64_t unblocks_ = 0;
};

}  // namespace pvgpu::hfq
