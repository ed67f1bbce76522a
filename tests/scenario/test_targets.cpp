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

// Met targets live in test_scenarios.cpp (design-example on both GPUs,
// low-demand on the timeslice GPU, every other scenario on both).  This one
// is not met: hfq gets 0.0303 against a bound of 0.026 (docs/results.md
// section 7 has the bound and what is left to it).

TEST_CASE("bursty tenants get what they ask for: low-demand <= 0.03 (round-robin GPU)",
          "[targets][bursty]") {
    SimResult r = run_hfq("low-demand", Arbitration::RoundRobin);
    INFO(to_table(r));
    CHECK(r.fairness.max_share_error <= 0.03);
}
