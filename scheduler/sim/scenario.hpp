// Scenario files (DESIGN.md section 6): what to simulate.  Parsing validates
// everything up front and names the offending field; nothing is half-run.
#pragma once

#include <cstdint>
#include <optional>
#include <stdexcept>
#include <string>
#include <vector>

#include "core/policy.hpp"
#include "core/scheduler.hpp"
#include "sim_gpu.hpp"

namespace pvgpu::sim {

class ScenarioError : public std::runtime_error {
public:
    using std::runtime_error::runtime_error;
};

// A kernel-length distribution, microseconds.
struct Dist {
    enum class Kind { Fixed, Uniform, Exp };
    Kind kind = Kind::Fixed;
    double a = 0;  // Fixed: value; Uniform: low; Exp: mean
    double b = 0;  // Uniform: high
    double mean() const { return kind == Kind::Uniform ? (a + b) / 2 : a; }
};

struct Workload {
    Dist kernel_us;
    double gap_us = 0;          // CPU time between a completed batch and the next
    std::uint32_t batch = 1;    // kernels submitted back-to-back, then waited for
    std::uint32_t channels = 1; // independent loops, one channel each
    std::uint64_t kernels = 0;  // per channel; 0 = endless
    double start_ms = 0;
    // A cheating tenant: keeps IB_GET pinned at 0 and FENCE at its last
    // submission in its control page, as if nothing it queued had run and
    // everything had completed.  The host must not believe either.
    bool forge_progress = false;
};

struct NodeSpec {
    enum class Kind { Vm, Task };
    Kind kind = Kind::Task;
    std::string name;
    std::uint32_t weight = PVGPU_WEIGHT_DEFAULT;
    bool pid_hints = true;                // VMs only
    std::optional<Workload> workload;     // tasks only
    std::vector<NodeSpec> children;       // VMs only
};

struct Scenario {
    std::string name;
    std::uint64_t seed = 1;
    double duration_ms = 0;
    double warmup_ms = 0;
    SimGpuConfig gpu;
    std::string policy = "hfq";
    PolicyParams params;
    MechanismCosts costs;
    std::vector<NodeSpec> tree;
};

// Throws ScenarioError("field.path: problem") for anything malformed:
// bad JSON, unknown fields, wrong types, weights out of range, empty tree,
// duplicate sibling names, unknown policy or policy parameter.
Scenario parse_scenario(const std::string& json_text);
Scenario load_scenario(const std::string& path);

}  // namespace pvgpu::sim
