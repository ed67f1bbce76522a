// The `timeslice` policy on the simulated GPU: greedy submitters, ground truth
// from the engine's ExecutionObserver, the policy seeing only host registers.
//
// Tolerances.  Simulated time, no run-to-run spread: each margin is a bound
// the policy is known to hold (a regression guard), set above the figure
// measured when it was written; where the goal is tighter the goal is
// named.  Measured: shares within 0.0005 of their targets against margins of
// 0.01-0.02 (the goal for shares: 0.01-0.02); the accounting exact against
// epsilons of 0.005 and 0.001.
#include <catch2/catch.hpp>

#include <map>
#include <memory>
#include <string>
#include <vector>

#include "policy_rig.hpp"

using namespace pvgpu;

using pvgpu::test::ms;
using pvgpu::test::Rig;

TEST_CASE("timeslice: catalog entry and parameters", "[policy][timeslice]") {
    PolicyInfo info = timeslice_info();
    CHECK(info.name == "timeslice");
    CHECK(param_or_default({}, info, "period_ms") == 20.0);
    CHECK(param_or_default({}, info, "min_slice_ms") == 1.0);
    CHECK(make_policy("timeslice", {{"period_ms", 10}})->name() == "timeslice");
    CHECK_THROWS_AS(make_policy("timeslice", {{"period_ms", 0}}), std::invalid_argument);
    CHECK_THROWS_AS(make_policy("timeslice", {{"slice", 1}}), std::invalid_argument);
}

TEST_CASE("timeslice: long and short kernels get 50/50 where the GPU gives 89/11", "[policy][timeslice]") {
    auto run = [](const std::string& policy) {
        Rig rig(policy);
        EntityId a = rig.task("long");
        EntityId b = rig.task("short");
        rig.submit_loop(a, ms(4));
        rig.submit_loop(b, ms(0.5));
        rig.run_until(ms(1000));
        rig.measure_from(ms(1000));
        rig.run_until(ms(11000));
        INFO(policy << ": long " << rig.share(a) << " short " << rig.share(b) << " busy "
                    << rig.busy_fraction(ms(11000)));
        CHECK(rig.busy_fraction(ms(11000)) > 0.99);
        return rig.share(a);
    };
    double none = run("none");
    CHECK(none == Approx(4.0 / 4.5).margin(0.01));
    double ts = run("timeslice");
    CHECK(ts == Approx(0.5).margin(0.01));
}

TEST_CASE("timeslice: a lone task runs disengaged and an idle host arms no timer", "[policy][timeslice]") {
    // Without a context-switch trace, so that the accounting's idle trap is
    // there to be seen.
    sim::SimGpuConfig cfg;
    cfg.ctxsw_trace = false;
    Rig rig("timeslice", {}, cfg);
    EntityId a = rig.task("a");
    rig.task("idle");
    ChannelId ch = rig.submit_loop(a, ms(1), 0, 2000);
    rig.run_until(ms(1000));
    CHECK(rig.sched.mode(ch) == ChannelMode::Direct);
    CHECK(rig.counter("engagements") == 0);
    while (rig.loop.step()) {
    }
    CHECK(rig.subs.at(ch).completed == 2000);
    CHECK(rig.loop.pending() == 0);
    // None but the accounting's idle trap, once the work ended.
    CHECK(rig.sched.accounting().wants_trap(ch));
    CHECK(rig.sched.stats().remaps == 1);
    // Its GPU time is accounted from fences and the engine status register.
    CHECK(to_ms(*rig.sched.policy().accounted(a)) == Approx(2000.0).epsilon(0.001));
}

TEST_CASE("timeslice: overrun is measured and charged", "[policy][timeslice]") {
    // 7 ms kernels against a 5 ms turn: every turn overruns.
    Rig rig("timeslice", {{"period_ms", 10}});
    EntityId a = rig.task("long");
    EntityId b = rig.task("short");
    rig.submit_loop(a, ms(7));
    rig.submit_loop(b, ms(0.25));
    rig.run_until(ms(1000));
    rig.measure_from(ms(1000));
    Duration acc_a0 = *rig.sched.policy().accounted(a);
    Duration acc_b0 = *rig.sched.policy().accounted(b);
    rig.run_until(ms(11000));
    INFO("long " << rig.share(a) << " overrun_ms " << rig.counter("overrun_ms") << " skipped "
                 << rig.counter("skipped_turns"));
    CHECK(rig.share(a) == Approx(0.5).margin(0.02));
    CHECK(rig.counter("overrun_ms") > 1000);
    CHECK(rig.counter("skipped_turns") > 0);
    // Accounting from the engine status register matches the ground truth.
    double acc_a = to_ms(*rig.sched.policy().accounted(a) - acc_a0);
    double acc_b = to_ms(*rig.sched.policy().accounted(b) - acc_b0);
    INFO("accounted long " << acc_a << " true " << to_ms(rig.gpu_time(a)) << "; short " << acc_b << " true "
                           << to_ms(rig.gpu_time(b)));
    CHECK(acc_a == Approx(to_ms(rig.gpu_time(a))).epsilon(0.005));
    CHECK(acc_b == Approx(to_ms(rig.gpu_time(b))).epsilon(0.005));
}

