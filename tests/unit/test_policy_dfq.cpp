// The `dfq` policy on the simulated GPU: greedy submitters, ground truth from
// the engine's ExecutionObserver, the policy seeing only host registers.
#include <catch2/catch.hpp>

#include <map>
#include <memory>
#include <string>
#include <vector>

#include "policy_rig.hpp"

using namespace pvgpu;

using pvgpu::test::ms;
using pvgpu::test::Rig;

TEST_CASE("dfq: catalog entry and parameters", "[policy][dfq]") {
    PolicyInfo info = dfq_info();
    CHECK(info.name == "dfq");
    CHECK(param_or_default({}, info, "sample_ms") == 10.0);
    CHECK(param_or_default({}, info, "freerun_ms") == 50.0);
    CHECK(param_or_default({}, info, "threshold_ms") == 5.0);
    CHECK(make_policy("dfq", {{"freerun_ms", 100}})->name() == "dfq");
    CHECK_THROWS_AS(make_policy("dfq", {{"sample_ms", 0}}), std::invalid_argument);
    CHECK_THROWS_AS(make_policy("dfq", {{"quantum", 1}}), std::invalid_argument);
}

TEST_CASE("dfq: long and short kernels get 50/50 where the GPU gives 89/11", "[policy][dfq]") {
    Rig rig("dfq");
    EntityId a = rig.task("long");
    EntityId b = rig.task("short");
    rig.submit_loop(a, ms(4));
    rig.submit_loop(b, ms(0.5));
    rig.run_until(ms(1000));
    rig.measure_from(ms(1000));
    rig.run_until(ms(11000));
    INFO("long " << rig.share(a) << " short " << rig.share(b) << " busy " << rig.busy_fraction(ms(11000))
                 << " drain_ms " << rig.counter("drain_ms") << " denials " << rig.counter("denials"));
    CHECK(rig.share(a) == Approx(0.5).margin(0.025));
    // The price of draining and exclusive sampling: some idle GPU, but not much.
    CHECK(rig.busy_fraction(ms(11000)) > 0.9);
    CHECK(rig.busy_fraction(ms(11000)) < 0.999);
    CHECK(rig.counter("samples") >= 2 * rig.counter("cycles") - 2);
    CHECK(rig.counter("trapped_doorbells") > 0);
    CHECK(rig.counter("denials") > 0);
    CHECK(rig.counter("drain_ms") > 0);
}

TEST_CASE("dfq: weights 200:100 give 2:1", "[policy][dfq]") {
    Rig rig("dfq");
    EntityId a = rig.task("heavy", 200);
    EntityId b = rig.task("light", 100);
    rig.submit_loop(a, ms(0.5));
    rig.submit_loop(b, ms(3));
    rig.run_until(ms(1000));
    rig.measure_from(ms(1000));
    rig.run_until(ms(11000));
    INFO("heavy " << rig.share(a) << " light " << rig.share(b));
    CHECK(rig.share(a) == Approx(2.0 / 3.0).margin(0.025));
}

TEST_CASE("dfq: nested tree gets the product of shares", "[policy][dfq]") {
    Rig rig("dfq");
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
    CHECK(rig.share(a) == Approx(2.0 / 3.0 * 1.0 / 4.0).margin(0.025));
    CHECK(rig.share(b) == Approx(2.0 / 3.0 * 3.0 / 4.0).margin(0.025));
    CHECK(rig.share(c) == Approx(1.0 / 3.0).margin(0.025));
}

TEST_CASE("dfq: an idle leaf gives its share away", "[policy][dfq]") {
    Rig rig("dfq");
    EntityId a = rig.task("a");
    EntityId b = rig.task("b");
    EntityId c = rig.task("c", 200);
    rig.submit_loop(a, ms(2));
    rig.submit_loop(b, ms(0.5));
    ChannelId cc = rig.submit_loop(c, ms(1));
    rig.run_until(ms(500));
    rig.measure_from(ms(500));
    rig.run_until(ms(6500));
    INFO("with c: a " << rig.share(a) << " b " << rig.share(b) << " c " << rig.share(c));
    CHECK(rig.share(c) == Approx(0.5).margin(0.025));
    CHECK(rig.share(a) == Approx(0.25).margin(0.025));

    rig.subs.at(cc).running = false;  // c goes idle
    rig.run_until(ms(7000));
    rig.measure_from(ms(7000));
    rig.run_until(ms(13000));
    INFO("without c: a " << rig.share(a) << " b " << rig.share(b) << " busy " << rig.busy_fraction(ms(13000)));
    CHECK(rig.gpu_time(c) == 0);
    CHECK(rig.share(a) == Approx(0.5).margin(0.025));
    CHECK(rig.busy_fraction(ms(13000)) > 0.9);
}

TEST_CASE("dfq: a late joiner starts at the minimum vtime, banking no credit", "[policy][dfq]") {
    Rig rig("dfq");
    EntityId a = rig.task("early");
    rig.submit_loop(a, ms(1));
    rig.run_until(ms(3000));  // a alone runs up a large vtime
    EntityId b = rig.task("late");
    rig.submit_loop(b, ms(1), 0, 0, ms(3000));
    rig.run_until(ms(3200));
    rig.measure_from(ms(3200));
    rig.run_until(ms(5200));
    INFO("early " << rig.share(a) << " late " << rig.share(b));
    // Without the catch-up the late leaf would have the GPU alone for ~3 s.
    CHECK(rig.share(a) == Approx(0.5).margin(0.05));
}

TEST_CASE("dfq: a lone task pays only the drain/sample overhead; an idle host arms no timer",
          "[policy][dfq]") {
    Rig rig("dfq");
    EntityId a = rig.task("a");
    rig.task("idle");
    ChannelId ch = rig.submit_loop(a, ms(1), 0, 5000);
    rig.run_until(ms(1000));
    rig.measure_from(ms(1000));
    rig.run_until(ms(4000));
    double busy = rig.busy_fraction(ms(4000));
    INFO("lone task busy " << busy);
    CHECK(busy > 0.95);
    CHECK(busy < 1.0);
    while (rig.loop.step()) {
    }
    CHECK(rig.subs.at(ch).completed == 5000);
    CHECK(rig.loop.pending() == 0);
    CHECK(rig.sched.mode(ch) == ChannelMode::Direct);
    CHECK(rig.sched.channel(ch).mode() == rig.direct_mapping(ch));
    // Sampled + estimated GPU time matches the truth for a fixed kernel size.
    CHECK(to_ms(*rig.sched.policy().accounted(a)) == Approx(5000.0).epsilon(0.01));
}

TEST_CASE("dfq: held work is never lost and everything ends direct", "[policy][dfq]") {
    Rig rig("dfq");
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
    CHECK(rig.loop.pending() == 0);  // idle: no timer left behind
    CHECK(rig.counter("shadow_events") > 0);
    CHECK(rig.counter("released_entries") > 0);
}

TEST_CASE("dfq: accounting estimates track the ground truth", "[policy][dfq]") {
    Rig rig("dfq");
    EntityId a = rig.task("a");
    EntityId b = rig.task("b");
    rig.submit_loop(a, ms(2.5));
    rig.submit_loop(b, ms(0.4));
    rig.run_until(ms(1000));
    Duration a0 = *rig.sched.policy().accounted(a);
    Duration b0 = *rig.sched.policy().accounted(b);
    rig.measure_from(ms(1000));
    rig.run_until(ms(6000));
    double acc_a = to_ms(*rig.sched.policy().accounted(a) - a0);
    double acc_b = to_ms(*rig.sched.policy().accounted(b) - b0);
    INFO("accounted a " << acc_a << " true " << to_ms(rig.gpu_time(a)) << "; b " << acc_b << " true "
                        << to_ms(rig.gpu_time(b)));
    CHECK(acc_a == Approx(to_ms(rig.gpu_time(a))).epsilon(0.03));
    CHECK(acc_b == Approx(to_ms(rig.gpu_time(b))).epsilon(0.03));
}

TEST_CASE("dfq: weight changes, joining and leaving channels", "[policy][dfq]") {
    Rig rig("dfq");
    EntityId a = rig.task("a");
    EntityId b = rig.task("b");
    rig.submit_loop(a, ms(1.5));
    ChannelId bch = rig.submit_loop(b, ms(0.5));
    rig.run_until(ms(2000));
    rig.sched.entities().set_weight(b, 300);
    rig.run_until(ms(2500));
    rig.measure_from(ms(2500));
    rig.run_until(ms(8500));
    INFO("after weight change: b " << rig.share(b));
    CHECK(rig.share(b) == Approx(0.75).margin(0.03));

    EntityId c = rig.task("c", 300);
    rig.submit_loop(c, ms(2), 0, 0, ms(8500));
    rig.run_until(ms(9000));
    rig.measure_from(ms(9000));
    rig.run_until(ms(15000));
    INFO("three: a " << rig.share(a) << " b " << rig.share(b) << " c " << rig.share(c));
    CHECK(rig.share(a) == Approx(1.0 / 7.0).margin(0.03));
    CHECK(rig.share(c) == Approx(3.0 / 7.0).margin(0.03));

    rig.subs.at(bch).running = false;
    rig.sched.close_channel(bch);
    rig.run_until(ms(15500));
    rig.measure_from(ms(15500));
    rig.run_until(ms(21500));
    INFO("after close: a " << rig.share(a) << " c " << rig.share(c));
    CHECK(rig.share(a) == Approx(0.25).margin(0.03));
}

TEST_CASE("dfq: weights hold on a preemptive time-sliced GPU", "[policy][dfq]") {
    sim::SimGpuConfig cfg;
    cfg.arbitration = sim::Arbitration::Timeslice;
    cfg.timeslice = ms(2);
    Rig rig("dfq", {}, cfg);
    EntityId a = rig.task("a", 300);
    EntityId b = rig.task("b", 100);
    rig.submit_loop(a, ms(3));
    rig.submit_loop(b, ms(5));
    rig.run_until(ms(1000));
    rig.measure_from(ms(1000));
    rig.run_until(ms(11000));
    INFO("a " << rig.share(a));
    CHECK(rig.share(a) == Approx(0.75).margin(0.03));
}

TEST_CASE("dfq: stop() puts every channel back to direct and cancels its timers", "[policy][dfq]") {
    Rig rig("dfq");
    EntityId a = rig.task("a");
    EntityId b = rig.task("b");
    rig.submit_loop(a, ms(4));
    rig.submit_loop(b, ms(0.5));
    rig.run_until(ms(1003));
    bool some_not_direct = false;
    for (const auto& [ch, s] : rig.subs) some_not_direct |= rig.sched.mode(ch) != ChannelMode::Direct;
    CHECK(some_not_direct);

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
    Rig rig2("dfq");
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

TEST_CASE("dfq: eight leaves with kernels from 0.1 to 8 ms share equally", "[policy][dfq]") {
    Rig rig("dfq");
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
    CHECK(lo > 0.125 - 0.03);
    CHECK(hi < 0.125 + 0.03);
    CHECK(rig.busy_fraction(ms(11000)) > 0.97);
}

TEST_CASE("dfq: a light leaf with CPU gaps does not make the GPU idle", "[policy][dfq]") {
    Rig rig("dfq");
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

TEST_CASE("dfq: a channel killed by the watchdog does not stall the others", "[policy][dfq]") {
    sim::SimGpuConfig cfg;
    cfg.watchdog = ms(50);
    Rig rig("dfq", {}, cfg);
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

TEST_CASE("dfq and timeslice: leaves and channels come and go under load", "[policy][dfq][timeslice]") {
    auto policy = GENERATE(as<std::string>{}, "dfq", "timeslice");
    Rig rig(policy);
    EntityId vm = rig.vm("vm");
    EntityId a = rig.task("a", 100, vm);
    EntityId b = rig.task("b");
    rig.submit_loop(a, ms(3));
    rig.submit_loop(b, ms(0.4));
    // Every 37 ms a short-lived task appears, works, closes and is removed;
    // its entity id is reused by the next one.
    for (int i = 0; i < 40; ++i) {
        Time t = ms(100 + 37 * i);
        rig.run_until(t);
        EntityId c = rig.task("tmp" + std::to_string(i), 100, i % 2 ? vm : kRootEntity);
        ChannelId ch = rig.submit_loop(c, ms(0.7), 0, 0, t);
        rig.run_until(t + ms(11 + i % 7));
        rig.subs.at(ch).running = false;
        rig.sched.close_channel(ch);
        rig.subs.erase(ch);
        rig.sched.entities().remove(c);
    }
    rig.run_until(ms(2000));
    rig.measure_from(ms(2000));
    rig.run_until(ms(6000));
    INFO("a " << rig.share(a) << " b " << rig.share(b));
    CHECK(rig.share(a) == Approx(0.5).margin(0.03));
    rig.stop_submitters();
    while (rig.loop.step()) {
    }
    for (const auto& [ch, s] : rig.subs) CHECK(s.completed == s.submitted);
    CHECK(rig.loop.pending() == 0);
}
