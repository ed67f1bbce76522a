// The `timeslice` policy on the simulated GPU: greedy submitters, ground truth
// from the engine's ExecutionObserver, the policy seeing only host registers.
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

TEST_CASE("timeslice: weights 200:100 give 2:1", "[policy][timeslice]") {
    Rig rig("timeslice");
    EntityId a = rig.task("heavy", 200);
    EntityId b = rig.task("light", 100);
    rig.submit_loop(a, ms(0.5));
    rig.submit_loop(b, ms(3));
    rig.run_until(ms(1000));
    rig.measure_from(ms(1000));
    rig.run_until(ms(11000));
    INFO("heavy " << rig.share(a) << " light " << rig.share(b));
    CHECK(rig.share(a) == Approx(2.0 / 3.0).margin(0.01));
    CHECK(rig.counter("slices") > 100);
}

TEST_CASE("timeslice: nested tree gets the product of shares", "[policy][timeslice]") {
    Rig rig("timeslice");
    EntityId vm = rig.vm("vm1", 200);
    EntityId a = rig.task("a", 100, vm);
    EntityId b = rig.task("b", 300, vm);
    EntityId c = rig.task("host", 100);
    rig.submit_loop(a, ms(2));
    rig.submit_loop(b, ms(0.3));
    rig.submit_loop(b, ms(1));  // two channels on one leaf
    rig.submit_loop(c, ms(1.5));
    rig.run_until(ms(1000));
    rig.measure_from(ms(1000));
    rig.run_until(ms(11000));
    INFO("a " << rig.share(a) << " b " << rig.share(b) << " host " << rig.share(c));
    CHECK(rig.share(a) == Approx(2.0 / 3.0 * 1.0 / 4.0).margin(0.015));
    CHECK(rig.share(b) == Approx(2.0 / 3.0 * 3.0 / 4.0).margin(0.015));
    CHECK(rig.share(c) == Approx(1.0 / 3.0).margin(0.015));
}

TEST_CASE("timeslice: an idle leaf gives its share away", "[policy][timeslice]") {
    Rig rig("timeslice");
    EntityId a = rig.task("a");
    EntityId b = rig.task("b");
    EntityId c = rig.task("c", 200);
    rig.submit_loop(a, ms(2));
    rig.submit_loop(b, ms(0.5));
    ChannelId cc = rig.submit_loop(c, ms(1));
    rig.run_until(ms(500));
    rig.measure_from(ms(500));
    rig.run_until(ms(4500));
    INFO("with c: a " << rig.share(a) << " b " << rig.share(b) << " c " << rig.share(c));
    CHECK(rig.share(c) == Approx(0.5).margin(0.015));
    CHECK(rig.share(a) == Approx(0.25).margin(0.015));

    rig.subs.at(cc).running = false;  // c goes idle
    rig.run_until(ms(5000));
    rig.measure_from(ms(5000));
    rig.run_until(ms(9000));
    INFO("without c: a " << rig.share(a) << " b " << rig.share(b) << " busy " << rig.busy_fraction(ms(9000)));
    CHECK(rig.gpu_time(c) == 0);
    CHECK(rig.share(a) == Approx(0.5).margin(0.015));
    CHECK(rig.busy_fraction(ms(9000)) > 0.99);
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

TEST_CASE("timeslice: held work is never lost and everything ends direct", "[policy][timeslice]") {
    Rig rig("timeslice");
    EntityId a = rig.task("a");
    EntityId b = rig.task("b", 300);
    EntityId c = rig.task("c");
    rig.submit_loop(a, ms(4), 0, 400);
    rig.submit_loop(b, ms(0.5), 0, 3000);
    rig.submit_loop(b, ms(0.2), ms(0.3), 3000);
    rig.submit_loop(c, ms(1), ms(2), 500, ms(300));
    while (rig.loop.step()) {
    }
    for (const auto& [ch, s] : rig.subs) {
        INFO("channel " << ch);
        CHECK(s.completed == s.submitted);
        CHECK(s.completed == s.limit);
        CHECK(rig.sched.held(ch) == 0);
        CHECK(rig.sched.mode(ch) == ChannelMode::Direct);
        CHECK(rig.sched.channel(ch).mode() == rig.direct_mapping(ch));
    }
    CHECK(rig.loop.pending() == 0);  // disengaged: no timer left behind
    CHECK(rig.counter("engagements") >= 1);
    CHECK(rig.counter("shadow_events") > 0);
    CHECK(rig.sched.stats().released_entries > 0);
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

TEST_CASE("timeslice: weight changes, joining and leaving channels", "[policy][timeslice]") {
    Rig rig("timeslice");
    EntityId a = rig.task("a");
    EntityId b = rig.task("b");
    rig.submit_loop(a, ms(1.5));
    ChannelId bch = rig.submit_loop(b, ms(0.5));
    rig.run_until(ms(2000));
    rig.sched.entities().set_weight(b, 300);
    rig.run_until(ms(2500));
    rig.measure_from(ms(2500));
    rig.run_until(ms(6500));
    INFO("after weight change: b " << rig.share(b));
    CHECK(rig.share(b) == Approx(0.75).margin(0.015));

    // A third leaf joins late, then b's channel closes under load.
    EntityId c = rig.task("c", 300);
    rig.submit_loop(c, ms(2), 0, 0, ms(6500));
    rig.run_until(ms(7000));
    rig.measure_from(ms(7000));
    rig.run_until(ms(11000));
    INFO("three: a " << rig.share(a) << " b " << rig.share(b) << " c " << rig.share(c));
    CHECK(rig.share(a) == Approx(1.0 / 7.0).margin(0.015));
    CHECK(rig.share(c) == Approx(3.0 / 7.0).margin(0.015));

    rig.subs.at(bch).running = false;
    rig.sched.close_channel(bch);
    rig.run_until(ms(11500));
    rig.measure_from(ms(11500));
    rig.run_until(ms(15500));
    INFO("after close: a " << rig.share(a) << " c " << rig.share(c));
    CHECK(rig.share(a) == Approx(0.25).margin(0.015));
}

TEST_CASE("timeslice: weights hold on a preemptive time-sliced GPU", "[policy][timeslice]") {
    sim::SimGpuConfig cfg;
    cfg.arbitration = sim::Arbitration::Timeslice;
    cfg.timeslice = ms(2);
    Rig rig("timeslice", {}, cfg);
    EntityId a = rig.task("a", 300);
    EntityId b = rig.task("b", 100);
    rig.submit_loop(a, ms(3));
    rig.submit_loop(b, ms(5));
    rig.run_until(ms(1000));
    rig.measure_from(ms(1000));
    rig.run_until(ms(11000));
    INFO("a " << rig.share(a));
    CHECK(rig.share(a) == Approx(0.75).margin(0.02));
}

TEST_CASE("timeslice: stop() puts every channel back to direct and cancels its timers", "[policy][timeslice]") {
    Rig rig("timeslice");
    EntityId a = rig.task("a");
    EntityId b = rig.task("b");
    rig.submit_loop(a, ms(4));
    rig.submit_loop(b, ms(0.5));
    rig.run_until(ms(1003));
    bool some_shadowed = false;
    for (const auto& [ch, s] : rig.subs) some_shadowed |= rig.sched.mode(ch) == ChannelMode::Shadowed;
    CHECK(some_shadowed);

    rig.sched.policy().stop();
    for (const auto& [ch, s] : rig.subs) CHECK(rig.sched.mode(ch) == ChannelMode::Direct);
    rig.stop_submitters();
    while (rig.loop.step()) {
    }
    CHECK(rig.loop.pending() == 0);
    for (const auto& [ch, s] : rig.subs) {
        CHECK(rig.sched.mode(ch) == ChannelMode::Direct);
        CHECK(rig.sched.channel(ch).mode() == rig.direct_mapping(ch));
        CHECK(rig.sched.held(ch) == 0);
        CHECK(s.completed == s.submitted);
    }

    // Swapping policies through the scheduler works the same way.
    Rig rig2("timeslice");
    rig2.submit_loop(rig2.task("a"), ms(4));
    rig2.submit_loop(rig2.task("b"), ms(0.5));
    rig2.run_until(ms(1003));
    rig2.sched.set_policy(make_policy("none", {}));
    rig2.run_until(ms(1010));
    for (const auto& [ch, s] : rig2.subs) {
        CHECK(rig2.sched.mode(ch) == ChannelMode::Direct);
        CHECK(rig2.sched.channel(ch).mode() == rig2.direct_mapping(ch));
    }
}

TEST_CASE("timeslice: eight leaves with kernels from 0.1 to 8 ms share equally", "[policy][timeslice]") {
    Rig rig("timeslice");
    const double kernels_ms[] = {0.1, 0.25, 0.5, 1, 2, 3, 5, 8};
    std::vector<EntityId> leaves;
    for (int i = 0; i < 8; ++i) {
        leaves.push_back(rig.task("t" + std::to_string(i)));
        rig.submit_loop(leaves.back(), ms(kernels_ms[i]));
    }
    rig.run_until(ms(1000));
    rig.measure_from(ms(1000));
    rig.run_until(ms(11000));
    double lo = 1, hi = 0;
    for (EntityId l : leaves) {
        lo = std::min(lo, rig.share(l));
        hi = std::max(hi, rig.share(l));
    }
    INFO("min share " << lo << " max share " << hi << " unfairness " << hi / lo << " busy "
                      << rig.busy_fraction(ms(11000)));
    CHECK(lo > 0.125 - 0.01);
    CHECK(hi < 0.125 + 0.01);
    CHECK(rig.busy_fraction(ms(11000)) > 0.97);
}

TEST_CASE("timeslice: a light leaf with CPU gaps does not make the GPU idle", "[policy][timeslice]") {
    Rig rig("timeslice");
    EntityId light = rig.task("light");
    EntityId greedy = rig.task("greedy");
    rig.submit_loop(light, ms(1), ms(4));  // alone it would use 20% of the GPU
    rig.submit_loop(greedy, ms(2));
    rig.run_until(ms(1000));
    rig.measure_from(ms(1000));
    rig.run_until(ms(11000));
    INFO("light " << rig.share(light) << " greedy " << rig.share(greedy) << " busy "
                  << rig.busy_fraction(ms(11000)));
    CHECK(rig.busy_fraction(ms(11000)) > 0.95);
    CHECK(rig.share(light) > 0.05);
    CHECK(rig.share(light) < 0.25);
}

TEST_CASE("timeslice: a channel killed by the watchdog does not stall the others", "[policy][timeslice]") {
    sim::SimGpuConfig cfg;
    cfg.watchdog = ms(50);
    Rig rig("timeslice", {}, cfg);
    EntityId bad = rig.task("bad");
    EntityId good = rig.task("good");
    ChannelId bad_ch = rig.submit_loop(bad, ms(500));
    ChannelId good_ch = rig.submit_loop(good, ms(1));
    rig.run_until(ms(500));
    // The dead channel's guest keeps writing: held or ignored, never run.
    rig.submit(bad_ch);
    rig.submit(bad_ch);
    rig.run_until(ms(1000));
    rig.measure_from(ms(1000));
    rig.run_until(ms(3000));
    INFO("good busy " << rig.busy_fraction(ms(3000)));
    CHECK(rig.sched.channel(bad_ch).guest_read_fence() == 0);
    CHECK(rig.busy_fraction(ms(3000)) > 0.97);
    CHECK(rig.gpu_time(good) == rig.total_gpu_time());
    rig.subs.at(good_ch).running = false;
    while (rig.loop.step()) {
    }
    CHECK(rig.loop.pending() == 0);
}

