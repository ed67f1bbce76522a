// Runs a scenario: builds the entity tree and the simulated GPU, starts the
// submit loops under the chosen policy, and measures the outcome from ground
// truth the scheduler never sees.
#pragma once

#include <map>
#include <optional>
#include <ostream>
#include <string>
#include <vector>

#include "core/shares.hpp"
#include "scenario.hpp"

namespace pvgpu::sim {

struct EntityResult {
    std::string path;
    std::uint32_t weight = 0;
    double demand = 0;             // standalone demand while active
    double target_share = 0;
    double achieved_share = 0;
    double share_error = 0;
    Duration gpu_time = 0;         // measured window only
    Duration gpu_time_total = 0;   // whole run (for accounting accuracy)
    std::optional<Duration> accounted;  // what the policy believes (whole run)
    Duration measured = 0;              // the scheduler's own accounting, any policy (whole run)
    std::uint64_t kernels_completed = 0;  // whole run
    std::uint64_t kernels_in_window = 0;  // completed after the warm-up
    std::optional<double> finished_ms;
    std::uint32_t channel_errors = 0;
};

struct SimResult {
    std::string scenario;
    std::string policy;
    std::string arbitration;
    double sim_time_ms = 0;
    double warmup_ms = 0;
    double busy_fraction = 0;
    double idle_with_demand_fraction = 0;
    std::vector<EntityResult> entities;
    FairnessMetrics fairness;
    double scheduler_cpu_us_per_s = 0;  // modeled mechanism cost (traps, remaps, polls)
    double policy_cpu_us_per_s = 0;     // measured, not deterministic
    SchedulerStats stats;         // whole run
    SchedulerStats window_stats;  // after the warm-up: a steady state's counts and costs
    std::map<std::string, double> policy_counters;
    std::uint64_t context_switches = 0;
    std::uint64_t events = 0;
};

struct SimOptions {
    // Per-entity shares over time, one row per interval, written as CSV.
    std::ostream* series = nullptr;
    double series_interval_ms = 100;
    // Every kernel run and every submission, as CSV: event,start_us,end_us,entity,channel
    // (a run is one stint of a channel on the engine; a submission has no end).
    std::ostream* trace = nullptr;
};

SimResult run_simulation(const Scenario& sc, const SimOptions& opt = {});

}  // namespace pvgpu::sim
