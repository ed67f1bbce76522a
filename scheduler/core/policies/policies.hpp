// Constructors of the built-in policies; policy.cpp lists them in the catalog.
#pragma once

#include <cstdint>
#include <optional>
#include <vector>

#include "core/policy.hpp"

namespace pvgpu {

PolicyInfo none_info();
std::unique_ptr<Policy> make_none(const PolicyParams& p);

PolicyInfo timeslice_info();
std::unique_ptr<Policy> make_timeslice(const PolicyParams& p);

PolicyInfo dfq_info();
std::unique_ptr<Policy> make_dfq(const PolicyParams& p);

PolicyInfo hfq_info();
std::unique_ptr<Policy> make_hfq(const PolicyParams& p);

// Hierarchical share of every leaf in `backlogged` (indexed by entity id):
// the product over the leaf and its ancestors of w / sum(w of backlogged
// siblings) -- the thesis' formula 3.1 generalised to weights.
std::vector<double> hierarchical_shares(const EntityTree& tree, const std::vector<EntityId>& backlogged);

// A parameter's value, or its catalog default.
double param_or_default(const PolicyParams& p, const PolicyInfo& info, const std::string& name);

// A policy factory's view of its parameters: `get("x")` as param_or_default,
// `get.positive("x")` the same or std::invalid_argument ("POLICY: x must be > 0").
struct ParamReader {
    const PolicyParams& given;
    const PolicyInfo& info;
    double operator()(const std::string& name) const { return param_or_default(given, info, name); }
    double positive(const std::string& name) const;
};

// ---- pieces the engine-watching policies (timeslice, dfq) share ----

// A policy's state of `leaf` in `leaves` (indexed by entity id: ids are
// small and reused), grown on first use.
template <class LeafState>
LeafState& leaf_state_in(std::vector<LeafState>& leaves, EntityId leaf) {
    if (leaves.size() <= leaf) leaves.resize(leaf + 1);
    return leaves[leaf];
}

// Policy::accounted from such a vector: a leaf never seen has used nothing.
template <class LeafState>
std::optional<Duration> accounted_in(const std::vector<LeafState>& leaves, EntityId leaf) {
    if (leaf >= leaves.size()) return Duration{0};
    return leaves[leaf].accounted;
}

// Sets a channel's mode unless it has it already, counting the switches to
// Shadowed in `shadow_events` (a policy counter: how often guests lose the
// direct path).
void set_mode_counted(PolicyContext& ctx, ChannelId ch, ChannelMode mode, std::uint64_t& shadow_events);

// Work on the GPU or held in the shadow page.  A channel the GPU killed
// ignores doorbells, so what it holds can never run: that is no work.
bool has_work_unless_killed(const PolicyContext& ctx, ChannelId ch);

}  // namespace pvgpu
