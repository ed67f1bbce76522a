// Target shares and fairness metrics (docs/design.md, "The simulator"): what
// the simulator reports against and what pvgpud's share monitor shows, so
// beside the core rather than in sim/.
#pragma once

#include <cstddef>
#include <vector>

namespace pvgpu {

// A node of the tree handed to water-filling.  Leaves carry their standalone
// demand (fraction of the GPU they would use alone, 0..1); inner nodes carry
// children.  Indices refer to the same vector.
struct ShareNode {
    double weight = 100;
    double demand = 0;              // leaves only
    bool active = true;             // inactive leaves demand nothing
    std::vector<std::size_t> children;
};

// Hierarchical weighted max-min fair shares: the root's capacity 1 is split
// among children by weight, no child getting more than its subtree's demand
// (capped at 1), leftovers re-split among the rest; then recursively.
// Returns a share for every node (a node's share = sum of its leaves').
std::vector<double> water_fill(const std::vector<ShareNode>& nodes, std::size_t root);

struct FairnessMetrics {
    double max_share_error = 0;  // max |achieved - target|
    double jain_index = 1;       // over achieved/target, leaves with target > 0
    double unfairness = 1;       // max(achieved/target) / min(achieved/target)
};

FairnessMetrics fairness(const std::vector<double>& achieved, const std::vector<double>& target);

}  // namespace pvgpu
