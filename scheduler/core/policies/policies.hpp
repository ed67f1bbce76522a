// Constructors of the built-in policies; policy.cpp lists them in the catalog.
#pragma once

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

}  // namespace pvgpu
