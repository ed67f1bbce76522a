// pvgpu-bench-decision: scheduler decision cost and CPU time versus the number
// of entities.  Each size runs the same simulated load (two-level tree: VMs of
// tasks with kernel lengths spread over 100 us .. 2 ms, all saturating) for a
// fixed stretch of virtual time, and reports the host CPU spent inside the
// policy per event and per simulated second.  Numbers are wall-clock CPU time
// on this machine: compare the ratios within one run, not across machines.
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <string>
#include <vector>

#include "sim/scenario.hpp"
#include "sim/simulation.hpp"

using namespace pvgpu;
using namespace pvgpu::sim;

namespace {

Scenario make_load(std::size_t entities, const std::string& policy, double duration_ms) {
    Scenario sc;
    sc.name = "decision-" + std::to_string(entities);
    sc.seed = 42;
    sc.duration_ms = duration_ms;
    sc.warmup_ms = 0;
    sc.policy = policy;
    std::size_t vms = static_cast<std::size_t>(std::ceil(std::sqrt(double(entities))));
    std::size_t made = 0;
    for (std::size_t v = 0; made < entities; ++v) {
        NodeSpec vm;
        vm.kind = NodeSpec::Kind::Vm;
        vm.name = "vm" + std::to_string(v);
        vm.weight = static_cast<std::uint32_t>(50 + (v * 37) % 200);
        for (std::size_t t = 0; t < vms && made < entities; ++t, ++made) {
            NodeSpec task;
            task.kind = NodeSpec::Kind::Task;
            task.name = "t" + std::to_string(t);
            task.weight = static_cast<std::uint32_t>(50 + (made * 53) % 200);
            Workload w;
            w.kernel_us = {Dist::Kind::Fixed, 100.0 + double((made * 7919) % 1901), 0};
            task.workload = w;
            vm.children.push_back(task);
        }
        sc.tree.push_back(vm);
    }
    return sc;
}

}  // namespace

int main(int argc, char** argv) {
    std::string policy = "hfq";
    double duration_ms = 2000;
    std::vector<std::size_t> sizes{16, 64, 256, 1024, 4096};
    for (int i = 1; i < argc; ++i) {
        if (!std::strcmp(argv[i], "--policy") && i + 1 < argc) {
            policy = argv[++i];
        } else if (!std::strcmp(argv[i], "--duration-ms") && i + 1 < argc) {
            duration_ms = std::atof(argv[++i]);
        } else if (!std::strcmp(argv[i], "--quick")) {
            sizes = {16, 256};
            duration_ms = 200;
        } else {
            std::fprintf(stderr,
                         "usage: pvgpu-bench-decision [--policy NAME] [--duration-ms N] [--quick]\n");
            return !std::strcmp(argv[i], "--help") || !std::strcmp(argv[i], "-h") ? 0 : 2;
        }
    }
    if (!(duration_ms > 0)) {
        std::fprintf(stderr, "pvgpu-bench-decision: --duration-ms must be positive\n");
        return 2;
    }

    std::printf("policy %s, %.0f ms of simulated time per size\n\n", policy.c_str(), duration_ms);
    std::printf("%9s %10s %12s %14s %16s %14s %10s\n", "entities", "events", "decisions",
                "ns/decision", "policy_us/s", "mech_us/s", "wall_ms");
    double base = 0;
    for (std::size_t n : sizes) {
        Scenario sc = make_load(n, policy, duration_ms);
        auto t0 = std::chrono::steady_clock::now();
        SimResult r = run_simulation(sc);
        double wall = std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
        // A decision is one policy callback: a fence, a trap or a poll.
        double decisions = double(r.stats.fences + r.stats.traps + r.stats.polls);
        double ns = decisions > 0 ? double(r.stats.policy_cpu) / decisions : 0;
        if (base == 0) base = ns;
        std::printf("%9zu %10llu %12.0f %14.1f %16.0f %14.0f %10.0f   (x%.2f)\n", n,
                    static_cast<unsigned long long>(r.events), decisions, ns, r.policy_cpu_us_per_s,
                    r.scheduler_cpu_us_per_s, wall, base > 0 ? ns / base : 0);
    }
    std::printf("\nns/decision: host CPU inside the policy per fence, trap or poll.\n"
                "policy_us/s: policy CPU per simulated second; mech_us/s: modeled trap,\n"
                "remap and poll cost per simulated second.  (xN): ns/decision relative to\n"
                "the smallest size, measured in this run.\n");
    return 0;
}
