// A scheduling policy decides, per channel, direct / trapped / shadowed.  It sees
// the entity tree, the GPU's host-visible registers and interrupts, timers and
// trapped doorbells, all through PolicyContext; it never sees the work itself.
#pragma once

#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "engine_trace.hpp"
#include "entity_tree.hpp"
#include "gpu_device.hpp"
#include "shadow_channel.hpp"
#include "time.hpp"

namespace pvgpu {

// Free-form numeric policy parameters (scenario "params", pvgpuctl).
using PolicyParams = std::map<std::string, double>;

// The GPU's per-channel registers as a policy reads them.  Each read is an
// MMIO read a real host pays for (MechanismCosts::poll): the scheduler counts
// it.  The engine's configuration and the context-switch trace are not.
class GpuRegisters {
public:
    GpuRegisters(const GpuDevice& gpu, const EngineTrace& trace, std::function<void()> on_read)
        : gpu_(gpu), trace_(trace), on_read_(std::move(on_read)) {}
    std::uint32_t read_ib_get(ChannelId ch) const { return on_read_(), gpu_.read_ib_get(ch); }
    std::uint32_t read_ib_put(ChannelId ch) const { return on_read_(), gpu_.read_ib_put(ch); }
    std::uint32_t read_status(ChannelId ch) const { return on_read_(), gpu_.read_status(ch); }
    bool pending(ChannelId ch) const { return on_read_(), gpu_.pending(ch); }
    EngineArbitration arbitration() const { return gpu_.arbitration(); }
    // When `ch` last left the engine (EngineTrace::left_at): the trace is
    // memory the GPU writes for the host, not a register read.
    std::optional<Time> left_engine_at(ChannelId ch) const { return trace_.left_at(ch); }

private:
    const GpuDevice& gpu_;
    const EngineTrace& trace_;
    std::function<void()> on_read_;
};

class PolicyContext {
public:
    virtual ~PolicyContext() = default;
    virtual Time now() const = 0;
    virtual Timers& timers() = 0;
    virtual const EntityTree& tree() const = 0;
    virtual const GpuRegisters& gpu() const = 0;

    // Channels and their owners.
    virtual const std::vector<ChannelId>& channels_of(EntityId leaf) const = 0;
    virtual EntityId owner(ChannelId ch) const = 0;

    // Mapping control.  Switches may take a while to take effect (remap cost);
    // mode() returns the mode last asked for.
    virtual void set_mode(ChannelId ch, ChannelMode mode) = 0;
    virtual ChannelMode mode(ChannelId ch) const = 0;
    // Entries a shadowed channel's guest has written that the GPU has not seen
    // (the host reads its own shadow page).
    virtual std::uint32_t held(ChannelId ch) const = 0;
    // The GPU's IB_PUT for the channel.  Trapped or shadowed, the host made
    // every store to it and knows it; direct, it costs a register read.
    virtual std::uint32_t gpu_put(ChannelId ch) const = 0;
    // Partial release of held work (resubmission with a cap).
    virtual std::uint32_t release(ChannelId ch, std::uint32_t max) = 0;
    // Engine status register read (an MMIO read; counted as a poll).
    virtual std::optional<ChannelId> engine_status() = 0;
    // The scheduler's own accounting (scheduler/core/accounting.hpp), the same
    // under every policy: the channel it last saw on the engine (no read), and
    // the mean length of a channel's kernels seen whole (0: none yet) and
    // their mean deviation from it.
    virtual std::optional<ChannelId> running_seen() const = 0;
    virtual Duration kernel_estimate(ChannelId ch) const = 0;
    virtual Duration kernel_spread(ChannelId ch) const = 0;
    // Host-only preemption of the engine in favour of `next` (see
    // GpuDevice::preempt_to; gpu().arbitration().preempt is its dead time).
    // False where the engine cannot do it.
    virtual bool preempt(ChannelId next) = 0;
};

class Policy {
public:
    virtual ~Policy() = default;
    virtual std::string_view name() const = 0;

    // start() hands over all existing channels (channel_added for each follows).
    virtual void start(PolicyContext& ctx) = 0;
    // Before the policy is replaced: put every channel back to Direct.
    virtual void stop() = 0;

    virtual void channel_added(ChannelId ch, EntityId leaf) = 0;
    virtual void channel_removed(ChannelId ch, EntityId leaf) = 0;
    virtual void tree_changed(EntityTree::Change change, EntityId id) = 0;

    // Interrupts and traps.
    virtual void doorbell_trapped(ChannelId ch, std::uint32_t put) = 0;
    virtual void fence(ChannelId ch, std::uint32_t fence) = 0;
    virtual void channel_error(ChannelId ch, std::uint32_t error) = 0;
    // Held work of a channel reached the GPU on unshadow/release.
    virtual void released(ChannelId, std::uint32_t /*entries*/) {}
    // A shadowed channel's guest stored new work into its shadow page (the
    // device reports it on the doorbell, as a trap): `held` entries wait.
    virtual void work_held(ChannelId, std::uint32_t /*held*/) {}
    // The accounting charged `d` of GPU time to a channel, and the channel it
    // sees on the engine changed.  Policies that keep virtual time charge it
    // from here: no policy needs to poll the engine status to account.
    virtual void charged(ChannelId, Duration) {}
    virtual void engine_changed(std::optional<ChannelId> /*running*/) {}

    // GPU time the policy believes a leaf has used (accounting accuracy);
    // nullopt when the policy does not account.
    virtual std::optional<Duration> accounted(EntityId) const { return std::nullopt; }
    // Policy-specific counters for reports (phases, shadow events, ...).
    virtual std::map<std::string, double> counters() const { return {}; }
};

struct PolicyInfo {
    std::string name;
    std::string summary;
    // Parameters with their defaults and a line of documentation.
    std::vector<std::tuple<std::string, double, std::string>> params;
    // Parameters that no longer do anything, accepted so that older
    // configurations still load (they are among `params`): setting one
    // draws a warning from policy_warnings().
    std::vector<std::string> ignored = {};
};

// Known policies: none, timeslice, dfq, hfq.
const std::vector<PolicyInfo>& policy_catalog();
// Throws std::invalid_argument naming the unknown policy or parameter.
std::unique_ptr<Policy> make_policy(std::string_view name, const PolicyParams& params);
// One line per parameter in `params` that the policy accepts but ignores
// (PolicyInfo::ignored), for the caller to show once as a warning.
std::vector<std::string> policy_warnings(std::string_view name, const PolicyParams& params);

}  // namespace pvgpu
