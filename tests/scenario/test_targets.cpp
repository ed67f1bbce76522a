// The fairness targets of issue 12 for hfq with its defaults, on both GPU
// models.  Kept apart from the `scenario` suite: a target the policy does not
// meet yet is a failing test here (meson test --suite targets), not a
// tolerance widened until it passes.  The simulation is deterministic, so a
// result is either inside its target or not; there is no noise to allow for.
#include <catch2/catch.hpp>

#include <string>

#include "sim/report.hpp"
#include "sim/scenario.hpp"
#include "sim/simulation.hpp"

using namespace pvgpu;
using namespace pvgpu::sim;

namespace {

SimResult run_hfq(const std::string& name, Arbitration arb) {
    Scenario sc = load_scenario(std::string(PVGPU_SCENARIO_DIR) + "/" + name + ".json");
    sc.policy = "hfq";
    sc.params.clear();
    sc.gpu.arbitration = arb;
    return run_simulation(sc);
}

}  // namespace

TEST_CASE("bursty tenants get what they ask for: design-example <= 0.06", "[targets][bursty]") {
    auto arb = GENERATE(Arbitration::RoundRobin, Arbitration::Timeslice);
    SimResult r = run_hfq("design-example", arb);
    INFO(to_table(r));
    CHECK(r.fairness.max_share_error <= 0.06);
}

TEST_CASE("bursty tenants get what they ask for: low-demand <= 0.03", "[targets][bursty]") {
    auto arb = GENERATE(Arbitration::RoundRobin, Arbitration::Timeslice);
    SimResult r = run_hfq("low-demand", arb);
    INFO(to_table(r));
    CHECK(r.fairness.max_share_error <= 0.03);
}

TEST_CASE("every other bundled scenario: error <= 0.01, idle with work <= 1%", "[targets]") {
    auto name = GENERATE(as<std::string>{}, "flat", "weighted", "hierarchical", "uncooperative", "mixed",
                         "demo", "gdev-fig14", "overhead");
    auto arb = GENERATE(Arbitration::RoundRobin, Arbitration::Timeslice);
    SimResult r = run_hfq(name, arb);
    INFO(to_table(r));
    CHECK(r.fairness.max_share_error <= 0.01);
    CHECK(r.idle_with_demand_fraction <= 0.01);
}
