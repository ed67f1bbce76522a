// The scheduler ties an entity tree, a GPU device and a policy together.  The
// simulator and the daemon both drive this class; only the Clock, the Timers and
// the GpuDevice behind it differ.
#pragma once

#include <memory>
#include <unordered_map>
#include <vector>

#include "accounting.hpp"
#include "entity_tree.hpp"
#include "gpu_device.hpp"
#include "policy.hpp"
#include "shadow_channel.hpp"
#include "time.hpp"

namespace pvgpu {

// What the mechanisms cost (DESIGN.md section 6, "costs").  Defaults follow
// published numbers: a VM exit plus host handling of a trapped doorbell is a
// couple of microseconds (LoGV, thesis table 5.2); an EPT remap with TLB
// shootdown and a QEMU memory transaction is tens of microseconds; an MMIO read
// of a GPU register (the engine status, a channel's IB_GET) is about a
// microsecond (`poll`).
struct MechanismCosts {
    Duration trap = 2 * kMicrosecond;
    Duration remap = 50 * kMicrosecond;
    Duration poll = 1 * kMicrosecond;
};

struct SchedulerStats {
    std::uint64_t traps = 0;
    std::uint64_t remaps = 0;
    std::uint64_t polls = 0;
    std::uint64_t accounting_reads = 0;  // engine status reads of the accounting (not the policy's)
    // Channel register reads (IB_GET, IB_PUT, status, pending) of the
    // policy and the accounting, each costed as one MMIO read.
    std::uint64_t register_reads = 0;
    std::uint64_t fences = 0;
    std::uint64_t channel_errors = 0;
    std::uint64_t released_entries = 0;
    std::uint64_t held_reports = 0;  // shadowed doorbells reporting new held work
    std::uint64_t preemptions = 0;  // host preemptions the policy asked for and the engine did
    // Host CPU the mechanisms cost, from MechanismCosts (deterministic).
    Duration mechanism_cpu = 0;
    // Entries into policy code: callbacks, traps, interrupts and the policy's
    // own timers, each counted once however much it nests (a decision).
    std::uint64_t policy_calls = 0;
    // Host CPU measured inside those entries (real, not deterministic).
    Duration policy_cpu = 0;
};

// What was counted between two snapshots (`later` - `earlier`).
SchedulerStats operator-(const SchedulerStats& later, const SchedulerStats& earlier);

class Scheduler final : public PolicyContext, private GpuInterrupts {
public:
    Scheduler(GpuDevice& gpu, const Clock& clock, Timers& timers, std::unique_ptr<Policy> policy,
              MechanismCosts costs = {});
    ~Scheduler() override;
    Scheduler(const Scheduler&) = delete;
    Scheduler& operator=(const Scheduler&) = delete;

    EntityTree& entities() { return tree_; }
    const MechanismCosts& costs() const { return costs_; }
    const SchedulerStats& stats() const { return stats_; }
    Policy& policy() { return *policy_; }
    // GPU time per leaf, measured the same way under every policy.
    const Accounting& accounting() const { return accounting_; }
    // Accounting::seed_looks: a host seeds them from its own entropy.
    void seed_accounting(std::uint64_t seed) { accounting_.seed_looks(seed); }
    void set_policy(std::unique_ptr<Policy> policy);

    ChannelId open_channel(EntityId leaf, ChannelMemory mem = {});
    // The same for a channel that carries on from `start` (re-created after
    // a drain elsewhere): to the accounting it has completed nothing yet.
    ChannelId open_channel(EntityId leaf, ChannelMemory mem, ChannelStart start);
    void close_channel(ChannelId ch);

    // Drain (the first half of moving a channel to another GPU or host):
    // the channel is shadowed whatever the policy wants, so the guest's new
    // work is held, and the policy hears it closed, so nothing is released
    // and nobody waits for it; the accounting goes on charging what still
    // runs.  drained() once the shadow is mapped and the GPU finished all
    // the work it had.  Then detach() reads where the channel stands and
    // closes it, or undrain() gives it back to the policy as it was.
    void drain(ChannelId ch);
    bool drained(ChannelId ch) const;
    void undrain(ChannelId ch);
    struct Position {
        std::uint32_t get = 0;    // the GPU's IB_GET: every entry before it ran
        std::uint32_t fence = 0;  // the GPU's FENCE
        std::uint32_t put = 0;    // the guest's IB_PUT: held work runs from get to here
    };
    Position detach(ChannelId ch);
    ShadowChannel& channel(ChannelId ch);
    bool has_channel(ChannelId ch) const { return channels_.count(ch) != 0; }

    // Channel error listener (the daemon forwards it to the VM).
    using ErrorListener = std::function<void(ChannelId, EntityId, std::uint32_t)>;
    void set_error_listener(ErrorListener l) { error_listener_ = std::move(l); }
    // Mode listener: called when a channel's mapping actually changes (the
    // remap landed), so the daemon can tell the client to switch its mapping.
    using ModeListener = std::function<void(ChannelId, ChannelMode)>;
    void set_mode_listener(ModeListener l) { mode_listener_ = std::move(l); }
    // Fence listener: a completion interrupt, after the policy saw it (the
    // daemon wakes host clients waiting for that fence).
    using FenceListener = std::function<void(ChannelId, std::uint32_t)>;
    void set_fence_listener(FenceListener l) { fence_listener_ = std::move(l); }

    // --- PolicyContext ---
    Time now() const override { return clock_.now(); }
    Timers& timers() override { return policy_timers_; }
    const EntityTree& tree() const override { return tree_; }
    const GpuRegisters& gpu() const override { return registers_; }
    const std::vector<ChannelId>& channels_of(EntityId leaf) const override;
    EntityId owner(ChannelId ch) const override;
    void set_mode(ChannelId ch, ChannelMode mode) override;
    ChannelMode mode(ChannelId ch) const override;
    std::uint32_t held(ChannelId ch) const override;
    std::uint32_t gpu_put(ChannelId ch) const override;
    std::uint32_t release(ChannelId ch, std::uint32_t max) override;
    std::optional<ChannelId> engine_status() override;
    std::optional<ChannelId> running_seen() const override { return accounting_.running(); }
    Duration kernel_estimate(ChannelId ch) const override { return accounting_.kernel_estimate(ch); }
    Duration kernel_spread(ChannelId ch) const override { return accounting_.kernel_spread(ch); }
    bool preempt(ChannelId next) override;

private:
    struct ChannelState {
        std::unique_ptr<ShadowChannel> shadow;
        EntityId owner = kNoEntity;
        ChannelMode wanted = ChannelMode::Direct;  // the policy's
        bool accounting_trap = false;               // the accounting's wish (Accounting::wants_trap)
        std::unique_ptr<Timer> remap_timer;
        // False while the policy hears of the new channel: its memory is
        // first mapped in the mode the policy asks for then, so that mode
        // applies at once, with no remap (the client gets it with the channel).
        bool mapped = false;
        // Set while close_channel tells the policy and the accounting: the
        // GPU still has it, but to the policy it is gone (engine_status).
        bool closing = false;
        // drain(): shadowed whatever the policy wants, and gone to the policy.
        bool draining = false;
        // GET it started at: the accounting counts its kernels from here.
        std::uint32_t get_base = 0;
    };

    void on_fence(ChannelId ch, std::uint32_t fence) override;
    void on_channel_error(ChannelId ch, std::uint32_t error) override;
    void on_trap(ChannelId ch, std::uint32_t put);
    void on_held(ChannelId ch, std::uint32_t held);
    // Accounting events (charges, engine changes) reach the policy at the end
    // of the outermost policy call, so a policy is never entered again from
    // inside itself.
    void on_accounting_event(const Accounting::Event& e);
    void deliver_accounting();
    void apply_mode(ChannelId ch);
    // The mode a channel gets: the policy's, or trapped where the
    // accounting asks for it and the policy would map it direct.
    static ChannelMode effective(const ChannelState& st);
    // Remaps `ch` towards its effective mode (a remap's cost and delay).
    void update_mode(ChannelId ch);
    ChannelState& state(ChannelId ch);
    const ChannelState& state(ChannelId ch) const;
    // Closing or draining: gone to the policy, still on the GPU.
    bool hidden(ChannelId ch) const;
    // IB_GET as the accounting counts it: entries fetched since the channel opened.
    std::uint32_t fetched_since_open(ChannelId ch) const;

    // Runs a policy callback and charges its CPU time.
    template <class F> void call_policy(F&& f);

    // The timers a policy sees: each expiry is an entry into policy code,
    // timed and counted like a callback.
    class PolicyTimers final : public Timers {
    public:
        explicit PolicyTimers(Scheduler& s) : s_(s) {}
        TimerId arm(Time at, std::function<void()> fn) override;
        void cancel(TimerId id) override;

    private:
        Scheduler& s_;
    };

    GpuDevice& gpu_;
    EngineTrace trace_{gpu_};
    GpuRegisters registers_;
    const Clock& clock_;
    Timers& timers_;
    PolicyTimers policy_timers_{*this};
    MechanismCosts costs_;
    EntityTree tree_;
    std::unique_ptr<Policy> policy_;
    Accounting accounting_;
    std::unordered_map<ChannelId, ChannelState> channels_;
    // state()'s index into channels_ (whose elements never move) by id:
    // backends number channels in sequence, and at thousands of channels a
    // hash lookup, several per decision, missed the cache twice.  Ids from
    // kIndexedIds up are found in channels_ alone.
    static constexpr ChannelId kIndexedIds = 1u << 20;
    std::vector<ChannelState*> by_id_;
    std::vector<std::vector<ChannelId>> by_entity_;
    SchedulerStats stats_;
    ErrorListener error_listener_;
    ModeListener mode_listener_;
    FenceListener fence_listener_;
    int policy_depth_ = 0;
    std::vector<Accounting::Event> accounting_events_;
    static const std::vector<ChannelId> kNoChannels;
};

}  // namespace pvgpu
