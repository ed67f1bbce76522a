// `hfq`: hierarchical fair queuing with continuous, event-based accounting.
//
// Accounting: the scheduler's own (scheduler/core/accounting.*, the same under
// every policy) charges GPU time from completion interrupts and engine-status
// reads at those moments; hfq advances its virtual time by those charges.  It
// never polls the engine: no exclusive sampling phase, no traps while busy, no
// wake-ups while the GPU runs.
//
// The pieces, each with its own state and its explanation:
//   fair_queue.hpp    FairQueue: per-level virtual time, block and unblock
//                     (a worked example);
//   feeder.hpp        Feeder: work conservation, feeding held work to an idle
//                     engine;
//   queue_cap.hpp     QueueCap: metering a leaf with too much queued;
//   anticipation.hpp  Anticipation: holding the engine for a thinking leaf;
//   preemption.hpp    Preemption: taking the engine back for a returning
//                     bursty leaf;
//   catch_up.hpp      CatchUp: serving a leaf back below its share at once,
//                     up to the credit it earned while thinking.
// HfqPolicy (below; leaves.cpp, policy.cpp) holds the channels, learns each
// leaf's think and burst times, sets channel modes, and wires the
// scheduler's events to the fair queue and the mechanisms.
#pragma once
#include "core/policies/hfq/fair_queue.hpp"
#include "core/policies/hfq/queue_cap.hpp"
#include "core/policies/hfq/feeder.hpp"
#include "core/policies/hfq/anticipation.hpp"
#include "core/policies/hfq/preemption.hpp"
#include "core/policies/hfq/catch_up.hpp"

namespace pvgpu::hfq {

class HfqPolicy final : public Policy, private FairQueue::Listener {
public:
    explicit HfqPolicy(Params p) : p_(p) {}

    std::string_view name() const override { return "hfq"; }
    void start(PolicyContext& ctx) override;
    void stop() override;
    void channel_added(ChannelId ch, EntityId leaf) override;
    void channel_removed(ChannelId ch, EntityId leaf) override;
    void tree_changed(EntityTree::Change c, EntityId id) override;
    void doorbell_trapped(ChannelId ch, std::uint32_t) override;
    void work_held(ChannelId ch, std::uint32_t) override;
    void fence(ChannelId ch, std::uint32_t) override;
    void channel_error(ChannelId ch, std::uint32_t) override;

    void charged(ChannelId ch, Duration d) override;
    void engine_changed(std::optional<ChannelId> running) override;
    std::optional<Duration> accounted(EntityId leaf) const override;
    std::map<std::string, double> counters() const override;

private:
    // ---- a leaf's work, thinks and channel modes; idleness (leaves.cpp) ----

    // The shadow page is the host's own memory; pending() is a register read.
    bool has_work(ChannelId ch) const;

    bool leaf_has_work(EntityId leaf) const;
    // At an interrupt the accounting has just read the engine.  The channel
    // on it has work, and an idle engine has nothing pending anywhere (the
    // GPU serves any channel with work): only held entries can be left.
    // Saves a register read per kernel of a leaf that waits on each fence.
    bool has_work_at_fence(ChannelId ch, EntityId leaf) const;

    // The GPU reports every channel it stops (channel_error): no register read.
    bool live(ChannelId ch) const;

    // The latest completion timestamp of the leaf's live channels (their
    // own memory), at most now; none if nothing completed.
    std::optional<Time> last_completion(EntityId leaf) const;

    // A channel showed work: its leaf (and ancestors) are backlogged.
    void touch(ChannelId ch);

    // `exact`: seen by its trapped doorbell, at the moment it happened.
    void mark_busy(EntityId leaf, bool exact = false);
    // The leaf has left its run queue (deactivate): it is no longer metered
    // or a candidate for idleness; a leaf left alone is unmetered too.
    void leaf_left(EntityId leaf) override;
    // Re-derive the leaf's channel modes; an unshadowed metered leaf is fed.
    void shadow_changed(EntityId leaf, bool shadowed) override;
    bool shadowed(EntityId leaf, bool blocked_above) const override {
        return catch_up_.shadowed(leaf, blocked_above);
    }

    // Bursty: an unblocked leaf whose absence let the GPU be fed held work.
    // Its next return must be seen at once to be served at once, so its
    // doorbells trap (a couple of microseconds each) until a think longer
    // than any stay in the run queue shows no burst pattern worth that.
    void set_bursty(EntityId leaf, bool bursty);
    void set_below_share(EntityId leaf, bool below);

    // A shadowed leaf seen without work since its last completion has
    // stored its next entry: how long its client takes to submit again
    // (resubmit_wait).  A gap of `idle` or more is a think, not a turnaround.
    void learn_turnaround(EntityId leaf, ChannelId ch);

    ChannelMode mode_of(EntityId leaf) const;
    // A channel still trapped since the GPU last idled stays trapped, unless
    // its leaf's mode is stronger, until its own doorbell.
    ChannelMode mode_of(ChannelId ch, EntityId leaf) const;

    void apply_modes(EntityId leaf);
    void arm_idle_check(Time at);
    // How long a leaf without work stays in the run queue: `idle`, or for a
    // bursty leaf a little over its learned think time (CFQ's slice_idle),
    // so that it is still owed its share, and protected, when it returns.
    Duration stay_of(const Node& n) const;

    // Leaves without work for stay_of() leave the run queue; once none is
    // left and the engine is idle, every doorbell traps.
    void idle_check();

    // Nothing runs and nothing waits: trap the next doorbell.  Each channel
    // stays trapped until its own doorbell (or a stronger mode of its
    // leaf): switching every channel back at the first doorbell of any
    // remapped each channel twice per idle spell, 37045 remaps in 10 s for
    // a 55 ms pulse beside 100 channels that never submit.
    void arm_idle();

    // `ch` rang (a trapped doorbell): the first since the idle arming wakes
    // hfq; its own idle trap is done either way.
    void leave_idle_trap(ChannelId ch);

    void wake_from_idle();

    // ---- events, wired to the mechanisms (policy.cpp) ----

    void after_event();
    // `ch`'s kernel ended (or the channel did): it is no longer the fed or
    // the cut one.
    void forget_kernel(ChannelId ch);

    // ---- state ----

    Params p_;
    PolicyContext* ctx_ = nullptr;
    std::unordered_map<ChannelId, EntityId> chans_;
    // Per channel: GPU time charged and IB_GET when it was added.
    struct ChannelRuns {
        Duration charged;
        std::uint32_t get_at_open;
        bool dead;                            // the GPU stopped it (channel_error)
        std::optional<Time> pending_as_of;    // read pending at this completion timestamp
    };
    std::unordered_map<ChannelId, ChannelRuns> runs_;
    // live()'s index into runs_ (whose elements never move) by channel id:
    // live() runs several times a decision, and a hash lookup missed the
    // cache at thousands of channels.  Ids from kIndexedIds up: runs_ alone.
    static constexpr ChannelId kIndexedIds = 1u << 20;
    std::vector<const ChannelRuns*> runs_by_id_;
    IdSet idle_candidates_;  // active leaves seen without work
    ChannelId left_engine_ = 0; // the channel last seen on the engine (0: idle)
    ChannelId last_left_ = 0;   // the channel last seen leaving it
    Timer idle_timer_;
    Time idle_check_at_ = 0;
    bool idle_armed_ = false;
    std::unordered_set<ChannelId> idle_trapped_;  // trapped at the idle arming, not rung since
    std::uint64_t idle_arms_ = 0;

    // The run queues: per-level virtual time, blocks and unblocks.
    FairQueue fq_{p_, *this};

    // The mechanisms, each with its own state (see their headers).  They
    // read the tree, the nodes and the channels above through their
    // back-reference; the policy calls them through their public members.
    friend class Preemption;
    Preemption preemption_{*this};
    friend class Anticipation;
    Anticipation anticipation_{*this};
    friend class Feeder;
    Feeder feeder_{*this};
    friend class QueueCap;
    QueueCap queue_cap_{*this};
    friend class CatchUp;
    CatchUp catch_up_{*this};
};

}  // namespace pvgpu::hfq
