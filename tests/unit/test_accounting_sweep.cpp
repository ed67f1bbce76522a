// The accounting against the engine's truth on random configurations.  With
// an interrupt on every kernel it is met (a test in suite 'unit'); where
// some channels interrupt on every 4th kernel only, a target not met yet
// (tests/meson.build: suite 'targets', pinned in tests/unmet-targets.txt).
// Each configuration is drawn from a seed: 2-4 channels, each with kernels
// of 0.05-8 ms, CPU gaps of 0-2 ms, 1-4 kernels in flight, interrupts on
// every kernel or on every 4th; the round-robin or the timeslice GPU
// (1-4 ms slices, 0-30 us switches); interrupts 0-50 us late; one of the
// four policies.  Every leaf that ran 50 ms or more must be charged within
// 1% of what it ran, plus the interrupt latency over its kernel length (a
// start after an idle engine that the host only learns of at the next
// interrupt lies anywhere in that latency); a tenant that asks for one
// interrupt per batch and thinks inside it may also be charged its own
// gaps there (run_seed says why), never less.  Failing seeds are printed
// with their configuration and each leaf beyond its bound;
// docs/results.md section 6 says what fails.
#include <catch2/catch.hpp>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <optional>
#include <random>
#include <string>

#include "policy_rig.hpp"

using namespace pvgpu;
using pvgpu::test::ms;
using pvgpu::test::Rig;

namespace {

struct SweepResult {
    std::string config;
    std::string leaves;  // each leaf beyond its bound: which, and its signed error
    double worst = 0;  // worst relative error of a leaf
    double worst_beyond = 0;  // worst relative error of a leaf beyond its bound
    bool over = false;  // some leaf beyond what it is allowed
};

SweepResult run_seed(std::uint32_t seed, bool every_kernel, bool trace) {
    std::mt19937 rng(seed);
    auto pick = [&](std::initializer_list<double> v) { return *(v.begin() + rng() % v.size()); };
    sim::SimGpuConfig cfg;
    cfg.ctxsw_trace = trace;
    const bool timeslice = rng() % 2;
    if (timeslice) {
        cfg.arbitration = sim::Arbitration::Timeslice;
        cfg.timeslice = ms(pick({1, 2, 2, 4}));
        cfg.ctxsw = static_cast<Duration>(pick({0, 0, 10, 30}) * kMicrosecond);
    }
    cfg.irq_latency = static_cast<Duration>(pick({0, 0, 20, 50}) * kMicrosecond);
    static const char* const policies[] = {"none", "hfq", "dfq", "timeslice"};
    const std::string policy = policies[rng() % 4];
    Rig rig(policy, {}, cfg);
    char buf[160];
    std::snprintf(buf, sizeof buf, "seed %u: %s on the %s GPU (slice %.0f ms, switch %.0f us), interrupts %.0f us late:",
                  seed, policy.c_str(), timeslice ? "timeslice" : "round-robin", to_ms(cfg.timeslice),
                  double(cfg.ctxsw) / kMicrosecond, double(cfg.irq_latency) / kMicrosecond);
    SweepResult r{buf, {}};
    struct Leaf {
        EntityId id;
        double allowed;       // either way
        double allowed_over;  // charged more than it ran
    };
    std::vector<Leaf> leaves;
    const int channels = 2 + static_cast<int>(rng() % 3);
    for (int i = 0; i < channels; ++i) {
        const EntityId leaf = rig.task("t" + std::to_string(i));
        const double kernel = pick({0.05, 0.2, 0.5, 1, 2, 4, 8});
        const double gap = pick({0, 0, 0, 0.1, 0.5, 2});
        Rig::Submitter& s = rig.subs.at(rig.submit_loop(leaf, ms(kernel), ms(gap)));
        s.depth = static_cast<std::uint32_t>(pick({1, 1, 2, 4}));
        const auto irq_every = static_cast<std::uint32_t>(pick({1, 1, 1, 4}));
        s.irq_every = every_kernel ? 1 : irq_every;
        // Without a trace: a start the host sees only at the next interrupt
        // after an idle engine (a direct doorbell) lies anywhere in an
        // interrupt's latency: no host can place it closer from what the
        // GPU tells.  With one, the GPU dates every stint: 0.1%, the run's
        // last stint cut at the drain (measured 0.00% on all 1000).
        const double allowed =
            trace ? 0.001 : 0.01 + static_cast<double>(cfg.irq_latency) / static_cast<double>(ms(kernel));
        // A tenant that asks for one interrupt per batch and thinks between
        // the batch's kernels leaves the engine idle where no interrupt and
        // no look marks it: without polling, the host sees one stint from the
        // batch's first start to its last completion.  Alone, with `depth`
        // kernels refilled each a gap after a completion, the engine idles
        // (kernel + gap) / depth - kernel per kernel, unmarked for
        // irq_every - 1 of every irq_every.  That idle time may be charged to
        // it (never less than it ran), and only as idle time: run_seed checks
        // that what the tenants using this allowance got beyond their bound
        // is covered by the net over-charge of all, so none of it came from
        // a neighbour.
        const double idle = std::max(0.0, (kernel + gap) / s.depth - kernel);
        const double own_gaps = s.irq_every > 1 ? (s.irq_every - 1) * idle / (s.irq_every * kernel) : 0;
        // (The trace marks every idle spell: no allowance for them.)
        leaves.push_back({leaf, allowed, allowed + (trace ? 0 : own_gaps)});
        std::snprintf(buf, sizeof buf, " [%.2f ms, gap %.1f, depth %u, irq every %u]", kernel, gap, s.depth,
                      s.irq_every);
        r.config += buf;
    }
    rig.run_until(ms(2000));
    // Let the engine drain: the truth counts a kernel when it ends.
    rig.stop_submitters();
    rig.run_until(ms(2100));
    const Accounting& acc = rig.sched.accounting();
    // PVGPU_SWEEP_EVERY_LEAF=1 prints every leaf of 50 ms or more with its
    // signed error: two builds' outputs, diffed, show what a change moved.
    const bool every_leaf = std::getenv("PVGPU_SWEEP_EVERY_LEAF") != nullptr;
    if (every_leaf) std::printf("%s\n", r.config.c_str());
    double net_over = 0;      // charged less ran, all leaves
    double beyond_base = 0;   // what the own-gap allowance covered
    for (std::size_t i = 0; i < leaves.size(); ++i) {
        const Leaf& l = leaves[i];
        const double truth = static_cast<double>(rig.gpu_time(l.id));
        const double charged = static_cast<double>(acc.gpu_time(l.id));
        net_over += charged - truth;
        if (truth < static_cast<double>(ms(50))) continue;
        const double signed_error = (charged - truth) / truth;
        const double allowed = signed_error > 0 ? l.allowed_over : l.allowed;
        r.worst = std::max(r.worst, std::abs(signed_error));
        if (l.allowed_over > l.allowed && signed_error > l.allowed && signed_error <= l.allowed_over)
            beyond_base += charged - truth - l.allowed * truth;
        if (every_leaf)
            std::printf("leaf seed %u t%zu %+.4f%% %+.3f ms of %.3f ms\n", seed, i, signed_error * 100,
                        (charged - truth) / 1e6, truth / 1e6);
        if (std::abs(signed_error) > allowed) {
            r.over = true;
            r.worst_beyond = std::max(r.worst_beyond, std::abs(signed_error));
            std::snprintf(buf, sizeof buf, " t%zu %+.2f%% (allowed %.2f%%)", i, signed_error * 100, allowed * 100);
            r.leaves += buf;
        }
    }
    if (beyond_base > std::max(0.0, net_over)) {
        r.over = true;
        std::snprintf(buf, sizeof buf, " own-gap allowance used %.2f ms, net over-charge %.2f ms", beyond_base / 1e6,
                      net_over / 1e6);
        r.leaves += buf;
    }
    return r;
}

// `unmet`: the name of the pinned target this sweep is (tests/unmet-targets.txt),
// or null for one that is met: a pinned sweep prints its figures on an UNMET
// line (tests/summary.py judges it against the recorded ones).
// `trace`: the GPU keeps a context-switch trace (the accounting charges
// from it); without one the accounting guesses from interrupts and looks.
void sweep(std::uint32_t seeds, bool every_kernel, bool trace, const char* unmet = nullptr) {
    // PVGPU_SWEEP_SEED=N runs that seed alone (to trace one failure).
    std::optional<std::uint32_t> only;
    if (const char* e = std::getenv("PVGPU_SWEEP_SEED")) {
        char* end = nullptr;
        const unsigned long v = std::strtoul(e, &end, 10);
        if (*e == '\0' || *end != '\0' || v >= seeds)
            FAIL("PVGPU_SWEEP_SEED must be a seed below " << seeds << ", not '" << e << "'");
        only = static_cast<std::uint32_t>(v);
    }
    std::uint32_t over = 0;
    double worst = 0, worst_beyond = 0;
    for (std::uint32_t seed = 0; seed < seeds; ++seed) {
        if (only && seed != *only) continue;
        const SweepResult r = run_seed(seed, every_kernel, trace);
        worst = std::max(worst, r.worst);
        worst_beyond = std::max(worst_beyond, r.worst_beyond);
        if (r.over) {
            ++over;
            std::printf("%s worst leaf %.2f%% off; beyond:%s\n", r.config.c_str(), r.worst * 100, r.leaves.c_str());
        }
    }
    std::printf("%u of %u configurations beyond their bound (worst leaf %.2f%% off)\n", over, only ? 1 : seeds,
                worst * 100);
    if (unmet && over > 0 && !only)
        std::printf("UNMET %s measured=%u target=0 worst_beyond_pct=%.2f\n", unmet, over, worst_beyond * 100);
    CHECK(over == 0);
}

}  // namespace

TEST_CASE("accounting sweep: interrupts on every kernel, 600 random configurations within their bound",
          "[.targets][accounting-sweep-every]") {
    sweep(600, true, false, "accounting-sweep-every");
}

TEST_CASE("accounting sweep with a context-switch trace: 1000 random configurations within their bound",
          "[.sweep][accounting-sweep-trace]") {
    sweep(600, true, true);
    sweep(400, false, true);
}

TEST_CASE("accounting sweep: some channels interrupt every 4th kernel, 400 random configurations within their bound",
          "[.targets][accounting-sweep-batches]") {
    sweep(400, false, false, "accounting-sweep-batches");
}
