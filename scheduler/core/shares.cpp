// Target shares by hierarchical water-filling, and the fairness metrics of
// ../shared/DESIGN.md section 7 computed from them.
#include "shares.hpp"

#include <algorithm>
#include <cmath>
#include <limits>
#include <stdexcept>
#include <string>

namespace pvgpu {

namespace {

// Leaves with a target at or below this are left out of the ratio metrics:
// achieved/target is meaningless for an entity that should get nothing.
constexpr double kMinTarget = 1e-9;

class WaterFill {
public:
    explicit WaterFill(const std::vector<ShareNode>& nodes)
        : nodes_(nodes), demand_(nodes.size(), 0.0), share_(nodes.size(), 0.0),
          visited_(nodes.size(), false) {}

    std::vector<double> run(std::size_t root) {
        check_index(root);
        subtree_demand(root);
        allocate(root, 1.0);
        return std::move(share_);
    }

private:
    void check_index(std::size_t i) const {
        if (i >= nodes_.size())
            throw std::out_of_range("water_fill: node index " + std::to_string(i) + " out of range");
    }

    // A subtree can use at most the whole GPU however many leaves it has.
    double subtree_demand(std::size_t i) {
        if (visited_[i]) throw std::invalid_argument("water_fill: node " + std::to_string(i) +
                                                     " reached twice (not a tree)");
        visited_[i] = true;
        const ShareNode& n = nodes_[i];
        double d = 0;
        if (n.children.empty()) {
            d = n.active ? std::clamp(n.demand, 0.0, 1.0) : 0.0;
        } else {
            for (std::size_t c : n.children) {
                check_index(c);
                d += subtree_demand(c);
            }
        }
        demand_[i] = std::min(1.0, d);
        return demand_[i];
    }

    // Gives node i up to `capacity`; its share is what its leaves end up with.
    void allocate(std::size_t i, double capacity) {
        const ShareNode& n = nodes_[i];
        if (n.children.empty()) {
            share_[i] = std::min(capacity, demand_[i]);
            return;
        }

        // Contenders (positions in n.children): children that want something
        // and have a say (weight > 0).
        std::vector<std::size_t> open;
        for (std::size_t k = 0; k < n.children.size(); ++k) {
            const std::size_t c = n.children[k];
            if (demand_[c] > 0 && nodes_[c].weight > 0) open.push_back(k);
        }
        std::vector<double> alloc(n.children.size(), 0.0);

        // Max-min by weight: whoever's weighted share covers its demand is
        // capped at the demand; the rest of the capacity is split again among
        // the others until nobody is capped any more.
        double remaining = capacity;
        while (!open.empty()) {
            double total_weight = 0;
            for (std::size_t k : open) total_weight += nodes_[n.children[k]].weight;
            std::vector<std::size_t> still_open;
            double used = 0;
            for (std::size_t k : open) {
                const std::size_t c = n.children[k];
                if (demand_[c] <= remaining * nodes_[c].weight / total_weight) {
                    alloc[k] = demand_[c];
                    used += demand_[c];
                } else {
                    still_open.push_back(k);
                }
            }
            if (still_open.size() == open.size()) {
                // Stable: everyone left is limited by the capacity, not demand.
                for (std::size_t k : open)
                    alloc[k] = remaining * nodes_[n.children[k]].weight / total_weight;
                break;
            }
            remaining = std::max(0.0, remaining - used);
            open = std::move(still_open);
        }

        double sum = 0;
        for (std::size_t k = 0; k < n.children.size(); ++k) {
            allocate(n.children[k], alloc[k]);
            sum += share_[n.children[k]];
        }
        share_[i] = sum;
    }

    const std::vector<ShareNode>& nodes_;
    std::vector<double> demand_;
    std::vector<double> share_;
    std::vector<bool> visited_;
};

}  // namespace

std::vector<double> water_fill(const std::vector<ShareNode>& nodes, std::size_t root) {
    return WaterFill(nodes).run(root);
}

FairnessMetrics fairness(const std::vector<double>& achieved, const std::vector<double>& target) {
    if (achieved.size() != target.size())
        throw std::invalid_argument("fairness: " + std::to_string(achieved.size()) + " achieved vs " +
                                    std::to_string(target.size()) + " target shares");
    FairnessMetrics m;
    double sum = 0, sum_sq = 0;
    double lo = std::numeric_limits<double>::infinity();
    double hi = 0;
    std::size_t n = 0;
    for (std::size_t i = 0; i < achieved.size(); ++i) {
        m.max_share_error = std::max(m.max_share_error, std::abs(achieved[i] - target[i]));
        if (target[i] <= kMinTarget) continue;
        double x = achieved[i] / target[i];
        sum += x;
        sum_sq += x * x;
        lo = std::min(lo, x);
        hi = std::max(hi, x);
        ++n;
    }
    if (n == 0) return m;  // nothing to compare: perfectly fair by convention
    // If no leaf got anything, report the worst rather than a vacuous 1.
    m.jain_index = sum_sq > 0 ? (sum * sum) / (static_cast<double>(n) * sum_sq) : 0.0;
    m.unfairness = lo > 0 ? hi / lo : std::numeric_limits<double>::infinity();
    return m;
}

}  // namespace pvgpu
