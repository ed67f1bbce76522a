// Water-filling target shares and fairness metrics (scheduler/core/shares.hpp).
// Every expected value here is exact arithmetic on the inputs: the checks use
// Approx's default epsilon (floating-point rounding only), no tolerance.
#include <catch2/catch.hpp>

#include <cmath>
#include <limits>
#include <stdexcept>
#include <vector>

#include "core/shares.hpp"

using pvgpu::fairness;
using pvgpu::ShareNode;
using pvgpu::water_fill;

namespace {

ShareNode leaf(double weight, double demand, bool active = true) {
    ShareNode n;
    n.weight = weight;
    n.demand = demand;
    n.active = active;
    return n;
}

ShareNode inner(double weight, std::vector<std::size_t> children) {
    ShareNode n;
    n.weight = weight;
    n.children = std::move(children);
    return n;
}

// Root 0 with the given leaves as nodes 1..n.
std::vector<ShareNode> flat(const std::vector<ShareNode>& leaves) {
    std::vector<ShareNode> nodes{inner(100, {})};
    for (const auto& l : leaves) {
        nodes[0].children.push_back(nodes.size());
        nodes.push_back(l);
    }
    return nodes;
}

}  // namespace

TEST_CASE("water_fill: equal weights split the GPU evenly", "[shares]") {
    auto nodes = flat({leaf(100, 1), leaf(100, 1), leaf(100, 1)});
    auto s = water_fill(nodes, 0);
    REQUIRE(s.size() == 4);
    CHECK(s[0] == Approx(1.0));
    CHECK(s[1] == Approx(1.0 / 3));
    CHECK(s[2] == Approx(1.0 / 3));
    CHECK(s[3] == Approx(1.0 / 3));
}

TEST_CASE("water_fill: shares follow weights", "[shares]") {
    auto nodes = flat({leaf(100, 1), leaf(200, 1), leaf(100, 1)});
    auto s = water_fill(nodes, 0);
    CHECK(s[1] == Approx(0.25));
    CHECK(s[2] == Approx(0.5));
    CHECK(s[3] == Approx(0.25));
}

TEST_CASE("water_fill: capped demands give their leftover to the others", "[shares]") {
    SECTION("one capped child") {
        auto s = water_fill(flat({leaf(100, 0.1), leaf(100, 1), leaf(100, 1)}), 0);
        CHECK(s[1] == Approx(0.1));
        CHECK(s[2] == Approx(0.45));
        CHECK(s[3] == Approx(0.45));
        CHECK(s[0] == Approx(1.0));
    }
    SECTION("redistribution caps a second child in the next round") {
        // Round 1: fair 0.25 caps 0.1; round 2: fair 0.3 caps 0.3; rest 0.3 each.
        auto s = water_fill(flat({leaf(100, 0.1), leaf(100, 0.3), leaf(100, 1), leaf(100, 1)}), 0);
        CHECK(s[1] == Approx(0.1));
        CHECK(s[2] == Approx(0.3));
        CHECK(s[3] == Approx(0.3));
        CHECK(s[4] == Approx(0.3));
    }
    SECTION("a heavy child that needs less than its weight's share") {
        auto s = water_fill(flat({leaf(100, 1), leaf(300, 0.5), leaf(100, 1)}), 0);
        CHECK(s[1] == Approx(0.25));
        CHECK(s[2] == Approx(0.5));
        CHECK(s[3] == Approx(0.25));
    }
}

TEST_CASE("water_fill: three levels multiply shares", "[shares]") {
    // root(0) -> A(1, w100), T(2, w100); A -> B(3, w300), a1(4, w100); B -> b1(5), b2(6)
    std::vector<ShareNode> nodes{
        inner(100, {1, 2}), inner(100, {3, 4}), leaf(100, 1),
        inner(300, {5, 6}), leaf(100, 1),       leaf(100, 1), leaf(100, 1),
    };
    auto s = water_fill(nodes, 0);
    CHECK(s[0] == Approx(1.0));
    CHECK(s[1] == Approx(0.5));
    CHECK(s[2] == Approx(0.5));
    CHECK(s[3] == Approx(0.5 * 0.75));
    CHECK(s[4] == Approx(0.5 * 0.25));
    CHECK(s[5] == Approx(0.5 * 0.75 * 0.5));
    CHECK(s[6] == Approx(0.5 * 0.75 * 0.5));
}

TEST_CASE("water_fill: when everybody fits, shares equal demands", "[shares]") {
    auto s = water_fill(flat({leaf(100, 0.1), leaf(5000, 0.2), leaf(1, 0.3)}), 0);
    CHECK(s[1] == Approx(0.1));
    CHECK(s[2] == Approx(0.2));
    CHECK(s[3] == Approx(0.3));
    CHECK(s[0] == Approx(0.6));
}

TEST_CASE("water_fill: subtree demand is the sum of its leaves, at most 1", "[shares]") {
    SECTION("a small VM is capped at its leaves' total") {
        // root -> vm(1) {0.2, 0.1}, task(2) demand 1
        std::vector<ShareNode> nodes{inner(100, {1, 2}), inner(100, {3, 4}), leaf(100, 1),
                                     leaf(100, 0.2), leaf(100, 0.1)};
        auto s = water_fill(nodes, 0);
        CHECK(s[1] == Approx(0.3));
        CHECK(s[2] == Approx(0.7));
        CHECK(s[3] == Approx(0.2));
        CHECK(s[4] == Approx(0.1));
    }
    SECTION("a VM whose leaves want more than the GPU counts as demand 1") {
        std::vector<ShareNode> nodes{inner(100, {1, 2}), inner(100, {3, 4}), leaf(100, 1),
                                     leaf(100, 0.8), leaf(100, 0.8)};
        auto s = water_fill(nodes, 0);
        CHECK(s[1] == Approx(0.5));
        CHECK(s[2] == Approx(0.5));
        CHECK(s[3] == Approx(0.25));
        CHECK(s[4] == Approx(0.25));
    }
    SECTION("a leaf demand above 1 is clamped") {
        auto s = water_fill(flat({leaf(100, 5), leaf(100, 0.25)}), 0);
        CHECK(s[1] == Approx(0.75));
        CHECK(s[2] == Approx(0.25));
    }
}

TEST_CASE("water_fill: inactive leaves get nothing and free their share", "[shares]") {
    SECTION("flat") {
        auto s = water_fill(flat({leaf(100, 1), leaf(100, 1, false), leaf(100, 1)}), 0);
        CHECK(s[1] == Approx(0.5));
        CHECK(s[2] == 0.0);
        CHECK(s[3] == Approx(0.5));
    }
    SECTION("a VM with only inactive leaves") {
        std::vector<ShareNode> nodes{inner(100, {1, 2}), inner(1000, {3, 4}), leaf(100, 1),
                                     leaf(100, 1, false), leaf(100, 0.5, false)};
        auto s = water_fill(nodes, 0);
        CHECK(s[1] == 0.0);
        CHECK(s[3] == 0.0);
        CHECK(s[4] == 0.0);
        CHECK(s[2] == Approx(1.0));
    }
    SECTION("zero demand and zero weight") {
        auto s = water_fill(flat({leaf(100, 0), leaf(0, 1), leaf(100, 0.5)}), 0);
        CHECK(s[1] == 0.0);
        CHECK(s[2] == 0.0);
        CHECK(s[3] == Approx(0.5));
    }
}

TEST_CASE("water_fill: a non-root subtree gets the full capacity", "[shares]") {
    std::vector<ShareNode> nodes{inner(100, {1, 2}), leaf(100, 1), leaf(100, 1)};
    auto s = water_fill(nodes, 0);
    REQUIRE(s.size() == 3);
    // Start at a leaf: it gets min(1, demand).
    auto only = water_fill(nodes, 2);
    CHECK(only[2] == Approx(1.0));
    CHECK(only[1] == 0.0);
}

TEST_CASE("water_fill: malformed trees are refused", "[shares]") {
    std::vector<ShareNode> bad_index{inner(100, {1, 7}), leaf(100, 1)};
    CHECK_THROWS_AS(water_fill(bad_index, 0), std::out_of_range);
    CHECK_THROWS_AS(water_fill(bad_index, 9), std::out_of_range);
    std::vector<ShareNode> shared_child{inner(100, {1, 1}), leaf(100, 1)};
    CHECK_THROWS_AS(water_fill(shared_child, 0), std::invalid_argument);
}

TEST_CASE("fairness: perfect match", "[shares]") {
    auto m = fairness({0.25, 0.5, 0.25}, {0.25, 0.5, 0.25});
    CHECK(m.max_share_error == 0.0);
    CHECK(m.jain_index == Approx(1.0));
    CHECK(m.unfairness == Approx(1.0));
}

TEST_CASE("fairness: known vectors", "[shares]") {
    SECTION("two leaves, 20% over and under") {
        auto m = fairness({0.3, 0.2}, {0.25, 0.25});
        CHECK(m.max_share_error == Approx(0.05));
        // x = 1.2, 0.8: (2)^2 / (2 * (1.44 + 0.64)) = 4 / 4.16
        CHECK(m.jain_index == Approx(4.0 / 4.16));
        CHECK(m.unfairness == Approx(1.5));
    }
    SECTION("ratios 1, 2, 3") {
        auto m = fairness({0.1, 0.2, 0.3}, {0.1, 0.1, 0.1});
        CHECK(m.max_share_error == Approx(0.2));
        CHECK(m.jain_index == Approx(36.0 / 42.0));
        CHECK(m.unfairness == Approx(3.0));
    }
    SECTION("zero-target leaves count for the error only") {
        auto m = fairness({0.45, 0.45, 0.1}, {0.45, 0.45, 0.0});
        CHECK(m.max_share_error == Approx(0.1));
        CHECK(m.jain_index == Approx(1.0));
        CHECK(m.unfairness == Approx(1.0));
    }
    SECTION("a starved leaf makes unfairness infinite") {
        auto m = fairness({0.5, 0.0}, {0.5, 0.5});
        CHECK(m.max_share_error == Approx(0.5));
        CHECK(m.jain_index == Approx(0.5));
        CHECK(std::isinf(m.unfairness));
        CHECK(m.unfairness > 0);
    }
    SECTION("nobody got anything") {
        auto m = fairness({0.0, 0.0}, {0.5, 0.5});
        CHECK(m.jain_index == 0.0);
        CHECK(m.unfairness == std::numeric_limits<double>::infinity());
    }
    SECTION("nothing to compare") {
        auto m = fairness({}, {});
        CHECK(m.max_share_error == 0.0);
        CHECK(m.jain_index == 1.0);
        CHECK(m.unfairness == 1.0);
    }
}

TEST_CASE("fairness: mismatched sizes are refused", "[shares]") {
    CHECK_THROWS_AS(fairness({0.5}, {0.5, 0.5}), std::invalid_argument);
}

TEST_CASE("fairness of water_fill targets against themselves", "[shares]") {
    auto nodes = flat({leaf(100, 0.1), leaf(200, 1), leaf(100, 1)});
    auto s = water_fill(nodes, 0);
    std::vector<double> leaves(s.begin() + 1, s.end());
    CHECK(leaves[0] + leaves[1] + leaves[2] == Approx(1.0));
    CHECK(leaves[1] == Approx(0.6));
    CHECK(leaves[2] == Approx(0.3));
    auto m = fairness(leaves, leaves);
    CHECK(m.jain_index == Approx(1.0));
}
