// pvgpu-bench-decision: scheduler decision cost and CPU time versus the number
// of entities.  Each size runs the same simulated load (two-level tree: VMs of
// tasks with kernel lengths spread over 100 us .. 2 ms, all saturating) long
// enough that the least-served leaf completes --min-kernels kernels after a
// warm-up in which it completes two (a steady state: the start-up transient,
// when every leaf joins at once and no kernel length is known, is left out),
// and reports the host CPU spent inside the policy per decision (each entry
// into policy code: interrupt, trap, timer) and per GPU-second, both counted
// after the warm-up.  Numbers are wall-clock CPU time on this machine:
// compare the ratios within one run, not across machines.
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <string>
#include <utility>
#include <vector>

#include "sim/scenario.hpp"
#include "sim/simulation.hpp"

using namespace pvgpu;
using namespace pvgpu::sim;

namespace {

// The load for `entities` leaves.  The warm-up lasts until every leaf, at its
// weighted share, has completed two kernels; the measured time after it is
// `duration_ms`, raised until every leaf completes `min_kernels` in it.
Scenario make_load(std::size_t entities, const std::string& policy, double duration_ms,
                   double min_kernels) {
    Scenario sc;
    sc.name = "decision-" + std::to_string(entities);
    sc.seed = 42;
    sc.duration_ms = duration_ms;
    sc.policy = policy;
    std::size_t vms = static_cast<std::size_t>(std::ceil(std::sqrt(double(entities))));
    std::size_t made = 0;
    double vm_weights = 0;
    std::vector<double> task_weights;  // per VM: sum of its tasks' weights
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
        vm_weights += vm.weight;
        double tw = 0;
        for (const NodeSpec& t : vm.children) tw += t.weight;
        task_weights.push_back(tw);
        sc.tree.push_back(vm);
    }
    // Leaf share = product of weight fractions; kernels in T = T * share / kernel.
    auto need_ms = [&](double kernels) {
        double need = 0;
        for (std::size_t v = 0; v < sc.tree.size(); ++v)
            for (const NodeSpec& t : sc.tree[v].children) {
                double share = sc.tree[v].weight / vm_weights * t.weight / task_weights[v];
                need = std::max(need, kernels * t.workload->kernel_us.mean() / 1000.0 / share);
            }
        return need * 1.1;
    };
    sc.warmup_ms = need_ms(2);
    sc.duration_ms = sc.warmup_ms + std::max(duration_ms, need_ms(min_kernels));
    return sc;
}

}  // namespace

int main(int argc, char** argv) {
    std::string policy = "hfq";
    double duration_ms = 2000;
    double min_kernels = 10;
    std::vector<std::size_t> sizes{16, 64, 256, 1024, 4096};
    for (int i = 1; i < argc; ++i) {
        if (!std::strcmp(argv[i], "--policy") && i + 1 < argc) {
            policy = argv[++i];
        } else if (!std::strcmp(argv[i], "--duration-ms") && i + 1 < argc) {
            duration_ms = std::atof(argv[++i]);
        } else if (!std::strcmp(argv[i], "--min-kernels") && i + 1 < argc) {
            min_kernels = std::atof(argv[++i]);
        } else if (!std::strcmp(argv[i], "--sizes") && i + 1 < argc) {
            sizes.clear();
            for (char* tok = std::strtok(argv[++i], ","); tok; tok = std::strtok(nullptr, ","))
                sizes.push_back(static_cast<std::size_t>(std::strtoull(tok, nullptr, 10)));
        } else if (!std::strcmp(argv[i], "--quick")) {
            sizes = {16, 256};
            duration_ms = 200;
            min_kernels = 3;
        } else {
            std::fprintf(stderr,
                         "usage: pvgpu-bench-decision [--policy NAME] [--duration-ms N]\n"
                         "                            [--min-kernels N] [--sizes N,N,...] [--quick]\n"
                         "Runs each size, after a warm-up in which every leaf completes two kernels,\n"
                         "for at least --duration-ms (default 2000) of simulated time and until the\n"
                         "least-served leaf completes --min-kernels (10) more.\n");
            return !std::strcmp(argv[i], "--help") || !std::strcmp(argv[i], "-h") ? 0 : 2;
        }
    }
    if (!(duration_ms > 0)) {
        std::fprintf(stderr, "pvgpu-bench-decision: --duration-ms must be positive\n");
        return 2;
    }
    if (!(min_kernels >= 0)) {
        std::fprintf(stderr, "pvgpu-bench-decision: --min-kernels must be >= 0\n");
        return 2;
    }
    for (std::size_t n : sizes)
        if (n == 0) {
            std::fprintf(stderr, "pvgpu-bench-decision: --sizes wants positive integers\n");
            return 2;
        }

    std::printf("policy %s, >= %.0f ms of simulated time per size after a warm-up, >= %.0f kernels per leaf\n\n",
                policy.c_str(), duration_ms, min_kernels);
    std::printf("%9s %9s %9s %11s %12s %12s %14s %13s %12s %10s\n", "entities", "warmup_s", "sim_s",
                "min_kernels", "decisions", "ns/decision", "policy_us/gs", "mech_us/gs", "busy", "wall_ms");
    double base = 0;
    std::vector<std::pair<std::size_t, double>> results;  // entities, ns per decision
    for (std::size_t n : sizes) {
        Scenario sc = make_load(n, policy, duration_ms, min_kernels);
        auto t0 = std::chrono::steady_clock::now();
        SimResult r = run_simulation(sc);
        double wall = std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
        // A decision is one entry into policy code (interrupt, trap or the
        // policy's own timer), counted once however it nests.
        // Everything after the warm-up: the steady state.
        const SchedulerStats& st = r.window_stats;
        double decisions = double(st.policy_calls);
        double ns = decisions > 0 ? double(st.policy_cpu) / decisions : 0;
        std::uint64_t least = r.entities.empty() ? 0 : r.entities.front().kernels_in_window;
        for (const auto& e : r.entities) least = std::min(least, e.kernels_in_window);
        const double measured_s = (sc.duration_ms - sc.warmup_ms) / 1000.0;
        double gpu_s = r.busy_fraction * measured_s;
        double per_gs = gpu_s > 0 ? 1.0 / gpu_s : 0;
        if (base == 0) base = ns;
        std::printf("%9zu %9.1f %9.1f %11llu %12.0f %12.1f %14.0f %13.0f %12.4f %10.0f   (x%.2f)\n", n,
                    sc.warmup_ms / 1000.0, measured_s, static_cast<unsigned long long>(least), decisions, ns,
                    to_us(st.policy_cpu) * per_gs, to_us(st.mechanism_cpu) * per_gs, r.busy_fraction, wall,
                    base > 0 ? ns / base : 0);
        results.push_back({n, ns});
    }
    // Machine-readable figures (tests/summary.py counts a benchmark that
    // prints none as failed).
    for (const auto& [n, ns] : results)
        std::printf("RESULT decision.%s.%zu.ns_per_decision=%.1f\n", policy.c_str(), n, ns);
    std::printf("\nwarmup_s: simulated time left out, until every leaf has completed two kernels;\n"
                "sim_s: the measured time after it, which every other column counts.\n"
                "min_kernels: kernels completed by the least-served leaf.\n"
                "ns/decision: host CPU inside the policy per entry (interrupt, trap, timer).\n"
                "policy_us/gs: policy CPU per GPU-busy second; mech_us/gs: modeled trap,\n"
                "remap and register-read cost per GPU-busy second.  (xN): ns/decision relative to\n"
                "the smallest size, measured in this run.\n");
    return 0;
}
