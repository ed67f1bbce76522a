// Scenario tests: the bundled scenarios run through the simulator and are
// held to the fairness targets of the design (DESIGN.md sections 7 and 8).
//
// Tolerances.  The simulator is deterministic (simulated clock, seeded
// workloads): no bound here covers run-to-run spread.  Each is a goal (the
// worst share error 0.02 on the standard scenarios, 0.01 on those without a
// bursty target, idle with work waiting 1%, hfq's overhead 1%, the
// accounting's 1% of each tenant's time, issue 12's bursty targets 0.06 and
// 0.03), an analytical bound derived at the check, or, where a case guards
// a fix with no goal of its own, the value the run gets today rounded up
// (a regression guard: said so at the check).  1e-9 margins are exact
// arithmetic.
#include <catch2/catch.hpp>

#include <algorithm>
#include <cstdio>
#include <filesystem>
#include <string>
#include <vector>

#include "sim/report.hpp"
#include "sim/scenario.hpp"
#include "sim/simulation.hpp"

using namespace pvgpu;
using namespace pvgpu::sim;

namespace {

Scenario bundled(const std::string& name) {
    return load_scenario(std::string(PVGPU_SCENARIO_DIR) + "/" + name + ".json");
}

SimResult run(Scenario sc, const std::string& policy, Arbitration arb) {
    sc.policy = policy;
    sc.params.clear();
    sc.gpu.arbitration = arb;
    return run_simulation(sc);
}

const EntityResult& entity(const SimResult& r, const std::string& path) {
    for (const auto& e : r.entities)
        if (e.path == path) return e;
    FAIL("no entity " << path);
    throw std::logic_error("unreachable");
}

std::string describe(const SimResult& r) { return to_table(r); }

// Relative error of the scheduler's accounting against the ground truth:
// the goal, 1% of each tenant's time, on every bundled scenario, policy and
// GPU model (with the context-switch trace every stint is charged exactly;
// the run's last stint is the only error).  Deterministic.
constexpr double kMeasuredAccuracy = 0.01;

// The accounting of every entity with at least `min_truth` of GPU time
// against the engine's ground truth, to kMeasuredAccuracy.
void check_accounting(const SimResult& r, Duration min_truth) {
    for (const auto& e : r.entities) {
        if (e.gpu_time_total < min_truth) continue;
        double err = std::abs(double(e.measured - e.gpu_time_total)) / double(e.gpu_time_total);
        INFO(e.path << ": measured " << to_ms(e.measured) << " ms, true " << to_ms(e.gpu_time_total) << " ms");
        CHECK(err <= kMeasuredAccuracy);
    }
}

}  // namespace

TEST_CASE("hfq meets its share targets on the standard scenarios", "[scenario][hfq]") {
    auto name = GENERATE(as<std::string>{}, "flat", "weighted", "hierarchical", "uncooperative", "mixed");
    auto arb = GENERATE(Arbitration::RoundRobin, Arbitration::Timeslice);
    SimResult r = run(bundled(name), "hfq", arb);
    INFO(describe(r));
    // The goals: worst share error 0.02, idle with work waiting 1%.  Jain's
    // index has no goal of its own: 0.99 is a floor the 0.02 goal keeps
    // (leaves within 0.02 of targets of 0.25 give at least 0.994); measured
    // 0.999996 or more on all ten runs.
    CHECK(r.fairness.max_share_error <= 0.02);
    CHECK(r.idle_with_demand_fraction <= 0.01);
    CHECK(r.fairness.jain_index >= 0.99);
}

TEST_CASE("none shows the GPU's own unfairness", "[scenario][none]") {
    SimResult rr = run(bundled("flat"), "none", Arbitration::RoundRobin);
    INFO(describe(rr));
    // Round-robin per kernel: shares follow kernel length (100us .. 8ms).
    // Not tolerances but the GPU's own split: k8ms gets 8 / (0.1 + 0.5 + 2 +
    // 8) = 0.755 (> 0.7), k100us 0.1 / 10.6 = 0.009 (< 0.02), and k8ms's
    // error 0.755 - 0.25 = 0.5 (> 0.3).
    CHECK(rr.fairness.max_share_error > 0.3);
    CHECK(entity(rr, "k8ms").achieved_share > 0.7);
    CHECK(entity(rr, "k100us").achieved_share < 0.02);
}

TEST_CASE("hierarchical targets are products of shares", "[scenario][tree]") {
    SimResult r = run(bundled("hierarchical"), "hfq", Arbitration::RoundRobin);
    // vm1 200 vs vm2 100 vs hostjob 100 -> 1/2, 1/4, 1/4; vm1: render | nested
    // -> 1/4 each; nested: t1 100 | t2 300 -> 1/16, 3/16.
    CHECK(entity(r, "vm1/render").target_share == Approx(0.25).margin(1e-9));
    CHECK(entity(r, "vm1/nested/t1").target_share == Approx(0.0625).margin(1e-9));
    CHECK(entity(r, "vm1/nested/t2").target_share == Approx(0.1875).margin(1e-9));
    CHECK(entity(r, "vm2/fft").target_share == Approx(0.125).margin(1e-9));
    CHECK(entity(r, "hostjob").target_share == Approx(0.25).margin(1e-9));
    // The achieved share: the goal for scenarios without a bursty target
    // (0.01; measured 0.0622).
    CHECK(entity(r, "vm1/nested/t1").achieved_share == Approx(0.0625).margin(0.01));
}

TEST_CASE("a VM without pid hints gets its VM share, not one per channel", "[scenario][uncooperative]") {
    SimResult none = run(bundled("uncooperative"), "none", Arbitration::RoundRobin);
    SimResult hfq = run(bundled("uncooperative"), "hfq", Arbitration::RoundRobin);
    INFO(describe(none) << describe(hfq));
    // Four channels of 3 ms kernels take most of a round-robin GPU ...
    CHECK(entity(none, "nohints").achieved_share > 0.8);
    // ... but the VM as a whole is held to half (the goal: within 0.02).
    CHECK(entity(hfq, "nohints").achieved_share == Approx(0.5).margin(0.02));
    CHECK(entity(hfq, "cooperative/x").achieved_share == Approx(0.25).margin(0.02));
}

TEST_CASE("thesis 5.4.2.1: benchmark runtime stays flat as throttle kernels grow", "[scenario][thesis]") {
    auto arb = GENERATE(Arbitration::RoundRobin, Arbitration::Timeslice);
    Scenario base = bundled("thesis-5.4.2.1");
    std::vector<double> hfq_rt, none_rt;
    for (int us = 100; us <= 1000; us += 100) {
        Scenario sc = base;
        sc.tree[0].children[1].workload->kernel_us = {Dist::Kind::Fixed, double(us), 0};
        auto h = run(sc, "hfq", arb);
        auto n = run(sc, "none", arb);
        REQUIRE(entity(h, "vm1/bench").finished_ms);
        REQUIRE(entity(n, "vm1/bench").finished_ms);
        hfq_rt.push_back(*entity(h, "vm1/bench").finished_ms);
        none_rt.push_back(*entity(n, "vm1/bench").finished_ms);
    }
    auto spread = [](const std::vector<double>& v) {
        return *std::max_element(v.begin(), v.end()) / *std::min_element(v.begin(), v.end());
    };
    INFO("hfq runtimes: " << Catch::Detail::stringify(hfq_rt));
    INFO("none runtimes: " << Catch::Detail::stringify(none_rt));
    // The thesis's target: runtime flat, max / min within 5%.
    CHECK(spread(hfq_rt) <= 1.05);
    if (arb == Arbitration::RoundRobin) {
        // Round-robin gives the bench 4171 / (4171 + t): 2.14 s .. 2.59 s.
        CHECK(spread(none_rt) >= 1.15);
        CHECK(std::is_sorted(none_rt.begin(), none_rt.end()));
    }
}

TEST_CASE("thesis 5.4.2.2: host benchmark flat against 1..8 throttles in a VM", "[scenario][thesis]") {
    auto arb = GENERATE(Arbitration::RoundRobin, Arbitration::Timeslice);
    Scenario base = bundled("thesis-5.4.2.2");
    NodeSpec throttle = base.tree[1].children[0];
    std::vector<double> hfq_rt, none_rt;
    for (int n = 1; n <= 8; ++n) {
        Scenario sc = base;
        sc.tree[1].children.clear();
        for (int i = 1; i <= n; ++i) {
            NodeSpec t = throttle;
            t.name = "throttle" + std::to_string(i);
            sc.tree[1].children.push_back(t);
        }
        auto h = run(sc, "hfq", arb);
        auto nn = run(sc, "none", arb);
        REQUIRE(entity(h, "bench").finished_ms);
        REQUIRE(entity(nn, "bench").finished_ms);
        hfq_rt.push_back(*entity(h, "bench").finished_ms);
        none_rt.push_back(*entity(nn, "bench").finished_ms);
    }
    auto spread = [](const std::vector<double>& v) {
        return *std::max_element(v.begin(), v.end()) / *std::min_element(v.begin(), v.end());
    };
    INFO("hfq runtimes: " << Catch::Detail::stringify(hfq_rt));
    INFO("none runtimes: " << Catch::Detail::stringify(none_rt));
    // The thesis's target: runtime flat, max / min within 5%; none's
    // growth (2.35 and more, measured) is checked only to be far from flat.
    CHECK(spread(hfq_rt) <= 1.05);
    CHECK(spread(none_rt) >= 1.5);
}

TEST_CASE("hfq costs a lone saturating task at most 1% of throughput", "[scenario][overhead]") {
    auto arb = GENERATE(Arbitration::RoundRobin, Arbitration::Timeslice);
    SimResult none = run(bundled("overhead"), "none", arb);
    SimResult hfq = run(bundled("overhead"), "hfq", arb);
    double ratio = double(entity(hfq, "vm1/saturate").kernels_completed) /
                   double(entity(none, "vm1/saturate").kernels_completed);
    INFO("hfq/none throughput " << ratio);
    // The goal: hfq costs a lone saturating task at most 1%.
    CHECK(ratio >= 0.99);
}

TEST_CASE("hfq accounting tracks true GPU time (LoGA fig 9/10)", "[scenario][accounting]") {
    auto arb = GENERATE(Arbitration::RoundRobin, Arbitration::Timeslice);
    SimResult r = run(bundled("loga-accuracy"), "hfq", arb);
    for (const auto& e : r.entities) {
        INFO(e.path);
        REQUIRE(e.accounted);
        double err = std::abs(double(*e.accounted - e.gpu_time_total)) / double(e.gpu_time_total);
        CHECK(err <= kMeasuredAccuracy);
    }
}

TEST_CASE("a late joiner gets its share (Gdev fig 14)", "[scenario][gdev]") {
    auto arb = GENERATE(Arbitration::RoundRobin, Arbitration::Timeslice);
    SimResult r = run(bundled("gdev-fig14"), "hfq", arb);
    INFO(describe(r));
    CHECK(r.fairness.max_share_error <= 0.02);
    CHECK(r.idle_with_demand_fraction <= 0.01);
}

TEST_CASE("dfq is fair but pays for draining; timeslice is fair", "[scenario][dfq][timeslice]") {
    SimResult none = run(bundled("flat"), "none", Arbitration::RoundRobin);
    SimResult dfq = run(bundled("flat"), "dfq", Arbitration::RoundRobin);
    SimResult ts = run(bundled("flat"), "timeslice", Arbitration::RoundRobin);
    INFO(describe(dfq) << describe(ts));
    // A quarter of none's error: "fair" as a factor against the GPU's own
    // split, no goal of its own (neither policy is held to hfq's 0.02).
    CHECK(dfq.fairness.max_share_error < none.fairness.max_share_error / 4);
    CHECK(ts.fairness.max_share_error < none.fairness.max_share_error / 4);
    // Draining leaves the GPU idle with work waiting; hfq does not.
    SimResult hfq = run(bundled("flat"), "hfq", Arbitration::RoundRobin);
    CHECK(dfq.idle_with_demand_fraction > hfq.idle_with_demand_fraction);
}

TEST_CASE("simulations are deterministic for a seed", "[scenario][determinism]") {
    Scenario sc = bundled("mixed");
    auto strip = [](SimResult r) {
        auto j = to_json(r);
        j["metrics"].erase("policy_cpu_us_per_s");  // measured host CPU time
        return j.dump();
    };
    CHECK(strip(run_simulation(sc)) == strip(run_simulation(sc)));
    Scenario other = sc;
    other.seed = sc.seed + 1;
    CHECK(strip(run_simulation(sc)) != strip(run_simulation(other)));
}

// The scheduler's own accounting (what pvgpuctl shows) is the same under
// every policy: completion interrupts plus one engine-status read each, and
// on the preemptive GPU one read per slice end.  Held against the engine's
// ground truth for every policy, both GPU models and every bundled scenario
// with more than one tenant; the bound is results.md section 6's.
TEST_CASE("the scheduler's accounting tracks true GPU time under every policy", "[scenario][accounting]") {
    auto arb = GENERATE(Arbitration::RoundRobin, Arbitration::Timeslice);
    auto policy = GENERATE(as<std::string>{}, "none", "timeslice", "dfq", "hfq");
    auto name = GENERATE(as<std::string>{}, "flat", "weighted", "hierarchical", "uncooperative", "mixed",
                         "loga-accuracy", "low-demand", "design-example", "gdev-fig14", "demo",
                         "thesis-5.4.2.1", "thesis-5.4.2.2");
    SimResult r = run(bundled(name), policy, arb);
    INFO(name << " under " << policy << " on " << r.arbitration);
    check_accounting(r, 100 * kMillisecond);  // below that, too little to weigh
    // No periodic poll on the non-preemptive GPU: one read per completion,
    // plus at most six settle reads each time the engine goes idle (a
    // completion that leaves it idle: 1 + 6 per fence at most; 100 for the
    // start-up's audit looks).
    INFO("accounting reads " << r.stats.accounting_reads << ", fences " << r.stats.fences);
    if (arb == Arbitration::RoundRobin) CHECK(r.stats.accounting_reads <= 7 * r.stats.fences + 100);
}

// The same with every interrupt late (costs.irq_latency_us): the host reads
// the engine as it is when the interrupt arrives.  A doorbell the host
// forwarded or released while the believed kernel had ended unheard was
// dated back to that end: hfq's bursty monitor was charged 1.4% (low-demand,
// round-robin, 50 us) and 1.7% (mixed, timeslice) more than it ran.  The
// `timeslice` policy's owner was off by up to 2.1%:
// a stint that ended at a timestamped completion was charged from the
// middle of the window its start was seen in (not its usual length); a
// preempted kernel that resumed and completed before a late interrupt's
// read went to nobody; and a preemptive engine seen on another channel
// switched at the slice end, not at the completion that ran the old
// channel out of work.
TEST_CASE("the scheduler's accounting tracks true GPU time when interrupts arrive late", "[scenario][accounting]") {
    auto latency_us = GENERATE(20, 50);
    auto arb = GENERATE(Arbitration::RoundRobin, Arbitration::Timeslice);
    auto policy = GENERATE(as<std::string>{}, "none", "timeslice", "dfq", "hfq");
    auto name = GENERATE(as<std::string>{}, "flat", "weighted", "hierarchical", "uncooperative", "mixed",
                         "loga-accuracy", "low-demand", "design-example", "gdev-fig14", "demo");
    Scenario sc = bundled(name);
    sc.gpu.irq_latency = latency_us * kMicrosecond;
    SimResult r = run(sc, policy, arb);
    INFO(name << " under " << policy << " on " << r.arbitration << ", interrupts " << latency_us << " us late");
    check_accounting(r, 100 * kMillisecond);
}

TEST_CASE("the accounting charges nobody a context switch's dead time when interrupts arrive late",
          "[scenario][accounting]") {
    // The timeslice GPU with 30 us of dead time per switch.  A kernel that
    // ended with its slice was taken for preempted at the slice end's read
    // and charged again by its late interrupt, and the next channel was
    // dated from that interrupt, dead time included: flat under none 2.50%
    // off at 20 us, hfq on mixed 1.32% at 50 us, before the fix.
    auto latency_us = GENERATE(20, 50);
    auto policy = GENERATE(as<std::string>{}, "none", "timeslice", "dfq", "hfq");
    auto name = GENERATE(as<std::string>{}, "flat", "weighted", "hierarchical", "uncooperative", "mixed",
                         "loga-accuracy", "low-demand", "design-example", "gdev-fig14", "demo");
    Scenario sc = bundled(name);
    sc.gpu.irq_latency = latency_us * kMicrosecond;
    sc.gpu.ctxsw = 30 * kMicrosecond;
    SimResult r = run(sc, policy, Arbitration::Timeslice);
    INFO(name << " under " << policy << ", ctxsw 30 us, interrupts " << latency_us << " us late");
    check_accounting(r, 100 * kMillisecond);
}

TEST_CASE("the accounting charges a task with CPU gaps its kernels' length on a late timeslice GPU",
          "[scenario][accounting]") {
    // 0.5 ms kernels with 0.2 ms gaps beside two loops: when a look at the
    // engine (not the interrupt) saw it run out of work, its stint was
    // charged from the middle of the window its start was seen in.  Under
    // the timeslice policy, which gives it the engine alone, 1.56-1.97% over
    // at 50 us whatever the switch cost, before the fix.
    auto latency_us = GENERATE(20, 50);
    auto ctxsw_us = GENERATE(0, 10, 30);
    auto policy = GENERATE(as<std::string>{}, "none", "timeslice", "dfq", "hfq");
    Scenario sc = parse_scenario(R"({"name": "gaps-beside-loops", "seed": 1, "duration_ms": 10000,
        "warmup_ms": 1000,
        "tree": [{"task": "gaps", "workload": {"kernel_us": 500, "gap_us": 200}},
                 {"task": "loop2", "workload": {"kernel_us": 2000}},
                 {"task": "loop8", "workload": {"kernel_us": 8000}}]})");
    sc.gpu.irq_latency = latency_us * kMicrosecond;
    sc.gpu.ctxsw = ctxsw_us * kMicrosecond;
    SimResult r = run(sc, policy, Arbitration::Timeslice);
    INFO(policy << ", ctxsw " << ctxsw_us << " us, interrupts " << latency_us << " us late");
    check_accounting(r, 0);
}

TEST_CASE("hfq's feed cap buys design-example's bursty leaf its share", "[scenario][bursty]") {
    // hostbench (300 us kernels, 50 us think) against 0.1..4.2 ms kernels of
    // a blocked VM: fed kernels fill its gaps unless hfq holds the GPU once
    // the fed VM is feed_lead_ms ahead (issue 12 target: error <= 0.06).
    Scenario sc = bundled("design-example");
    sc.gpu.arbitration = GENERATE(Arbitration::RoundRobin, Arbitration::Timeslice);
    sc.policy = "hfq";
    sc.params.clear();
    SimResult capped = run_simulation(sc);
    sc.params = {{"feed_lead_ms", 1e6}};
    SimResult uncapped = run_simulation(sc);
    INFO(describe(capped) << describe(uncapped));
    CHECK(capped.fairness.max_share_error <= 0.06);
    CHECK(uncapped.fairness.max_share_error > 0.07);  // 0.416 (rr), 0.075 (ts)
    // The price: the GPU idles in hostbench's thinks (8.9% round-robin,
    // 8.6% timeslice, measured): a regression guard rounded up to 10%.
    CHECK(capped.idle_with_demand_fraction <= 0.10);
}

TEST_CASE("hfq preempts for a bursty leaf on the timeslice GPU: low-demand", "[scenario][bursty]") {
    // host-monitor (150 us kernels, 850 us think, weight 50) against 6 ms
    // training kernels and others (issue 12 target: error <= 0.03).
    SimResult r = run(bundled("low-demand"), "hfq", Arbitration::Timeslice);
    INFO(describe(r));
    CHECK(r.fairness.max_share_error <= 0.03);
    CHECK(r.stats.preemptions > 0);
    CHECK(r.policy_counters.at("preemptions") == double(r.stats.preemptions));
}

TEST_CASE("hfq holds the round-robin GPU for low-demand's monitor: error <= 0.03", "[scenario][bursty]") {
    // Issue 12's target on a non-preemptive GPU (the bound is 0.026,
    // results.md section 7).  A kernel that would make the thinking monitor
    // wait is held while the monitor is further below its max-min share
    // than the fed leaf (over a second).  0.0408 at 3.3% idle before any
    // hold; 0.0303 at 8.8% when the wait was traded one for one against the
    // idle in the last three bursts before the return; 0.0297 at 11.8% now,
    // the monitor (0.0288) and the others (0.0297) equalised (deterministic).
    // An unguarded hold for the monitor's whole think cost 19.5% idle and
    // error 0.056: the guard stops holding once the others are worse off.
    SimResult r = run(bundled("low-demand"), "hfq", Arbitration::RoundRobin);
    INFO(describe(r));
    // 0.03: issue 12's target.  0.118: the idle measured today (11.8%), a
    // regression guard with no margin (deterministic).
    CHECK(r.fairness.max_share_error <= 0.03);
    CHECK(r.idle_with_demand_fraction <= 0.118);
}

TEST_CASE("hfq holds for a returning monitor only while it is further behind than the fed leaf",
          "[scenario][bursty]") {
    // low-demand with a 200 us / 800 us monitor: its last three bursts
    // before a return cover 600 us of its think.  Holding for every added
    // wait in them, without asking who is worse off, starved the others
    // below the monitor (0.0164 at 5.6% idle); judged by who is further
    // below its max-min share, 0.0117 at 4.1% (0.0120 at 4.1% with the one
    // for one trade before).
    Scenario sc = bundled("low-demand");
    for (auto& e : sc.tree)
        if (e.name == "host-monitor") {
            e.workload->kernel_us.a = 200;
            e.workload->gap_us = 800;
        }
    SimResult r = run(sc, "hfq", Arbitration::RoundRobin);
    INFO(describe(r));
    // Regression guards: today's 0.0117 and 4.1% rounded up.
    CHECK(r.fairness.max_share_error <= 0.012);
    CHECK(r.idle_with_demand_fraction <= 0.042);
}

// Found by a review of the holds and waits above, in scenarios no bundled
// one covers (round-robin GPU, deterministic).
TEST_CASE("hfq holds for a long-think monitor and for clients that think between kernels only what it pays",
          "[scenario][bursty]") {
    // A monitor with a 2.5 ms think beside varying and 6 ms kernels: an
    // unbounded hold for kernels that may outlast its return idled 7.6%
    // and raised the error from 0.0082 to 0.0241; held for at most three
    // of its bursts (kHoldBursts), 0.0080 at 2.95% idle (0.5% before the
    // hold existed: on this load it buys little); 0.0083 at 3.06% since the
    // max-min hold, which is not bounded by bursts but stops once the fed
    // leaf is the worse off.
    SimResult th = run(parse_scenario(R"({"name": "long-think", "seed": 3, "duration_ms": 10000, "warmup_ms": 1000,
        "tree": [{"task": "mon", "weight": 15, "workload": {"kernel_us": 150, "gap_us": 2500}},
                 {"task": "pre", "workload": {"kernel_us": {"uniform": [100, 900]}}},
                 {"task": "p2", "workload": {"kernel_us": {"uniform": [100, 1900]}}},
                 {"task": "train", "workload": {"kernel_us": 6000}}]})"),
                       "hfq", Arbitration::RoundRobin);
    INFO(describe(th));
    // Regression guards: today's 0.0083 and 3.06% rounded up.
    CHECK(th.fairness.max_share_error <= 0.0085);
    CHECK(th.idle_with_demand_fraction <= 0.031);
    // A client with 500 us kernels and 1.5 ms of CPU between them is not
    // turning around: waited for like one, it held a greedy 6 ms neighbour
    // to its own share and the GPU busy 0.38 of the time (error 0.468).
    // Not waited for, busy 0.9991 but error 0.301: the two thinking clients
    // got 0.023 and 0.075 of their demands 0.15 and 0.25, as B's kernels ran
    // into every think.  Held for while they are further below their
    // max-min shares than B: 0.1147 at busy 0.749; 0.1065 at busy 0.724
    // once A counts while blocked behind the returning monitor.  The least on a
    // non-preemptive engine is 0.095 (each 6 ms kernel of B costs A at least
    // 4.5 ms and the monitor 5.15 ms: B's error 0.6 - x against A's 0.1875 x).
    const Scenario think = parse_scenario(R"({"name": "think-not-turnaround", "seed": 3, "duration_ms": 10000,
        "warmup_ms": 1000,
        "tree": [{"task": "monitor", "workload": {"kernel_us": 150, "gap_us": 850}},
                 {"task": "A", "workload": {"kernel_us": 500, "gap_us": 1500}},
                 {"task": "B", "workload": {"kernel_us": 6000}}]})");
    SimResult lt = run(think, "hfq", Arbitration::RoundRobin);
    INFO(describe(lt));
    // Regression guards: today's 0.1065 and busy 0.724 (the least error
    // possible here is 0.095, above).
    CHECK(lt.fairness.max_share_error <= 0.107);
    CHECK(lt.busy_fraction >= 0.724);
    // On the timeslice GPU both return by preempting B, but the monitor,
    // thinking in the run queue below its share, banked vtime without
    // bound and A was blocked at its pace: 0.139 each, error 0.111.  Kept
    // within `lag` of B while it thinks, A gets 0.232 and the error is
    // 0.0415, B's, most of it the preemptions' dead time (idle 7.0%).
    SimResult lts = run(think, "hfq", Arbitration::Timeslice);
    INFO(describe(lts));
    // A regression guard: 0.04147 before catching up (CatchUp), 0.04151
    // since: both clients catch up from their first learned returns, ten
    // more preemptions in the first 10 ms, which move the phase of the
    // measured window (the same figure on seeds 1-8: fixed kernel lengths).
    CHECK(lts.fairness.max_share_error <= 0.04152);
}

TEST_CASE("hfq on every other bundled scenario: error <= 0.01, idle with work <= 1%", "[scenario][hfq]") {
    // Issue 12's bound for the scenarios without a bursty target.
    auto name = GENERATE(as<std::string>{}, "flat", "weighted", "hierarchical", "uncooperative", "mixed",
                         "demo", "gdev-fig14", "overhead", "loga-accuracy", "thesis-5.4.2.1",
                         "thesis-5.4.2.2");
    auto arb = GENERATE(Arbitration::RoundRobin, Arbitration::Timeslice);
    SimResult r = run(bundled(name), "hfq", arb);
    INFO(describe(r));
    CHECK(r.fairness.max_share_error <= 0.01);
    CHECK(r.idle_with_demand_fraction <= 0.01);
}

// The targets for bursty and interactive tenants as a class (issue "hfq:
// protect bursty and interactive tenants"), over every bundled scenario and
// the pattern scenarios in tests/scenario/bursty/, on both GPU models, hfq
// defaults.  A leaf that asks for less than its fair share must get its
// demand (its target) within 0.03 on the round-robin GPU, where a returning
// batch can still wait for one kernel of each channel the GPU already
// queued, and within 0.01 on the time-sliced one, which hfq may preempt;
// every other leaf within 0.01 of its max-min share; on the bundled
// scenarios the GPU idles with work waiting at most 2% of the time.
// Deterministic: the figures are the same in every run.  Not met yet: a
// pinned target (tests/unmet-targets.txt) that prints its figures.
namespace {

struct ClassFigures {
    int cells = 0, missed = 0;
    double below_rr = 0, below_ts = 0, others = 0, idle = 0;
};

void judge_cell(const SimResult& r, bool bundled_scenario, ClassFigures& f) {
    const bool rr = r.arbitration == "round-robin";
    double below = 0, others = 0;
    for (const auto& e : r.entities) {
        const double err = std::abs(e.achieved_share - e.target_share);
        // Asks for less than its share: max-min gives it its demand.
        if (e.demand < e.target_share + 1e-9 && e.demand < 1.0)
            below = std::max(below, err);
        else
            others = std::max(others, err);
    }
    const double idle = bundled_scenario ? r.idle_with_demand_fraction : 0.0;
    const bool met = below <= (rr ? 0.03 : 0.01) && others <= 0.01 && idle <= 0.02;
    ++f.cells;
    f.missed += met ? 0 : 1;
    (rr ? f.below_rr : f.below_ts) = std::max(rr ? f.below_rr : f.below_ts, below);
    f.others = std::max(f.others, others);
    f.idle = std::max(f.idle, idle);
    std::printf("%-30s %-11s below-share %.4f  others %.4f  idle with work %.4f  %s\n", r.scenario.c_str(),
                r.arbitration.c_str(), below, others, r.idle_with_demand_fraction, met ? "met" : "MISSED");
}

}  // namespace

TEST_CASE("hfq serves bursty and interactive tenants as a class", "[.targets][hfq-bursty-classes]") {
    namespace fs = std::filesystem;
    std::vector<std::pair<fs::path, bool>> files;
    for (const char* dir : {PVGPU_SCENARIO_DIR, PVGPU_BURSTY_DIR})
        for (const auto& f : fs::directory_iterator(dir))
            if (f.path().extension() == ".json") files.emplace_back(f.path(), std::string(dir) == PVGPU_SCENARIO_DIR);
    std::sort(files.begin(), files.end());
    REQUIRE(files.size() >= 20);
    ClassFigures f;
    for (const auto& [file, is_bundled] : files)
        for (Arbitration arb : {Arbitration::RoundRobin, Arbitration::Timeslice})
            judge_cell(run(load_scenario(file.string()), "hfq", arb), is_bundled, f);
    std::printf("%d of %d cells met\n", f.cells - f.missed, f.cells);
    if (f.missed > 0)
        std::printf("UNMET hfq-bursty-classes measured=%d target=0 worst_below_rr=%.4f worst_below_ts=%.4f "
                    "worst_others=%.4f worst_idle=%.4f\n",
                    f.missed, f.below_rr, f.below_ts, f.others, f.idle);
    CHECK(f.missed == 0);
}

// Catching up (hfq/catch_up.hpp) on the preemptive GPU: a light tenant
// back from a think below its share takes the engine at its trapped doorbell
// and the others are held while its batch drains, so it gets its demand
// within the issue's 0.01, nested two levels down, in a VM beside a greedy
// sibling, and beside four greedy tenants.  Before catching up these were
// 0.0261, 0.0191, 0.0205 and 0.0579 off: its returns were not seen (no
// trap once a think outlasted the run queue) and nothing preempted for it.
TEST_CASE("hfq: a tenant back below its share catches up on the timeslice GPU", "[scenario][bursty]") {
    auto [name, leaf] = GENERATE(table<std::string, std::string>({
        {"batch-vm-3x300-nested", "vmA/inner/light"},
        {"batch-vm-6x200", "vmA/light"},
        {"interactive-2x150-long-think", "ui"},
        {"batch-vm-4x100-deep", "vmA/svc/light"},
    }));
    SimResult r = run(load_scenario(std::string(PVGPU_BURSTY_DIR) + "/" + name + ".json"), "hfq",
                      Arbitration::Timeslice);
    INFO(describe(r));
    const EntityResult& e = entity(r, leaf);
    REQUIRE(e.target_share == Approx(e.demand));  // max-min owes it its demand: below its share
    CHECK(std::abs(e.achieved_share - e.target_share) <= 0.01);
    CHECK(r.policy_counters.at("catch_ups") > 0);
    CHECK(r.stats.preemptions > 0);
}

TEST_CASE("the counts after the warm-up leave the warm-up out", "[scenario][warmup]") {
    // A lone task of 500 us kernels, each with its interrupt: 20000 in 10 s,
    // and 18001 from the end of the 1 s warm-up on (one at 1000 ms, the
    // window's first instant, one at 10000 ms, its last).
    // pvgpu-bench-decision's steady state is these counts.
    Scenario sc = bundled("overhead");
    SimResult r = run(sc, "hfq", Arbitration::RoundRobin);
    const EntityResult& e = entity(r, "vm1/saturate");
    CHECK(e.kernels_completed == 20000);
    CHECK(e.kernels_in_window == 18001);
    CHECK(r.stats.fences == 20000);
    CHECK(r.window_stats.fences == 18001);
    // Charged from the GPU's context-switch trace: no engine reads at all.
    CHECK(r.stats.accounting_reads == 0);
    CHECK(r.window_stats.policy_calls < r.stats.policy_calls);
    // Without a warm-up the window is the whole run.
    sc.warmup_ms = 0;
    SimResult whole = run(sc, "hfq", Arbitration::RoundRobin);
    CHECK(entity(whole, "vm1/saturate").kernels_in_window == 20000);
    CHECK(whole.window_stats.fences == whole.stats.fences);
    CHECK(whole.window_stats.policy_calls == whole.stats.policy_calls);
}

namespace {

// The least idle of a fair schedule on a non-preemptive GPU when every
// interrupt is `latency_us` late (docs/experiments.py's latency_bound):
// equal shares x; a leaf that waits on each fence is ready a latency after
// each of its kernels, and only another leaf's kernel between two of its
// own keeps the engine busy.  Returns {x, busy}.
std::pair<double, double> latency_bound(const std::vector<std::pair<double, bool>>& kernels_us, double latency_us) {
    double sum = 0;
    for (const auto& [k, waits] : kernels_us) sum += 1.0 / k;
    double uncovered = 0;
    for (const auto& [k, waits] : kernels_us)
        if (waits) uncovered = std::max(uncovered, 1.0 / k - (sum - 1.0 / k));
    const double x = 1.0 / (static_cast<double>(kernels_us.size()) + latency_us * uncovered);
    return {x, static_cast<double>(kernels_us.size()) * x};
}

}  // namespace

// flat: four leaves that each wait on every fence.  queued-sync: two
// metered leaves that keep work queued beside one that waits on every
// fence; without covering its turnarounds with the blocked leaves' held
// entries hfq idled 1.2% (20 us) to 5.2% (90 us) more than the bound, as
// the waiting leaf ran alone between blocks.  Measured within 0.0008 of
// the bound's busy fraction and 0.0005 of its share.
TEST_CASE("hfq idles for late interrupts no more than a fair schedule must", "[scenario][latency]") {
    const double latency_us = GENERATE(20.0, 50.0, 90.0);
    const bool sync = GENERATE(false, true);
    Scenario sc = bundled("flat");
    std::vector<std::pair<double, bool>> model{{100, true}, {500, true}, {2000, true}, {8000, true}};
    if (sync) {
        sc = parse_scenario(R"({"name": "queued-sync", "seed": 1, "duration_ms": 10000, "warmup_ms": 1000,
            "tree": [{"task": "deep", "workload": {"kernel_us": 500, "batch": 16, "channels": 2}},
                     {"task": "deep2", "workload": {"kernel_us": 1000, "batch": 8}},
                     {"task": "sync", "workload": {"kernel_us": 300}}]})");
        model = {{500, false}, {1000, false}, {300, true}};
    }
    sc.gpu.irq_latency = from_us(latency_us);
    SimResult r = run(sc, "hfq", Arbitration::RoundRobin);
    const auto [share, busy] = latency_bound(model, latency_us);
    INFO(describe(r) << "bound: share " << share << ", busy " << busy);
    // 0.001: a regression guard, the measured 0.0008 (busy) and 0.0005
    // (share) rounded up (one 8 ms kernel at each edge of the 9 s window
    // alone could move a share 0.0018: the bound holds by measurement).
    CHECK(r.busy_fraction >= busy - 0.001);
    for (const auto& e : r.entities) CHECK(std::abs(e.achieved_share - share) <= 0.001);
}
