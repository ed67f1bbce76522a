// What dfq and timeslice, the policies that watch the engine, must both do:
// one suite run for each, with the margins each is known to hold.  What only
// one of them does stays in test_policy_dfq.cpp or test_policy_timeslice.cpp.
//
// Tolerances.  Simulated time, no run-to-run spread: each policy's margins
// are bounds it is known to hold (regression guards), above the figures
// measured when they were set: dfq 0.0003-0.012 off (0.121-0.128 of 0.125
// among eight leaves, light share 0.175), timeslice within 0.0005 (0.1248-
// 0.1251); GPU busy dfq 0.965-0.998, timeslice above 0.99.
#include <catch2/catch.hpp>

#include <algorithm>
#include <string>
#include <vector>

#include "policy_rig.hpp"

using namespace pvgpu;

using pvgpu::test::ms;
using pvgpu::test::Rig;

namespace {

struct Watcher {
    std::string policy;
    double weights_margin;     // weights 200:100
    double nested_margin;      // a nested tree; an idle leaf
    double preemptive_margin;  // on a preemptive GPU
    double eight_margin;       // eight leaves, kernels 0.1 to 8 ms
    double weight_changes_margin;
    // A measurement window long enough for those margins: dfq's estimates
    // settle over more cycles than timeslice's turns.
    Duration window;
    double idle_busy;  // the GPU busy fraction once a leaf went idle
    // A channel mode that shows the policy at work under contention: dfq
    // traps or shadows, timeslice shadows whoever does not own the turn.
    bool (*at_work)(ChannelMode);
};

const Watcher& watcher(const std::string& policy) {
    static const Watcher dfq{"dfq", 0.025, 0.025, 0.03, 0.03, 0.03, ms(6000), 0.9,
                             [](ChannelMode m) { return m != ChannelMode::Direct; }};
    static const Watcher timeslice{"timeslice", 0.01, 0.015, 0.02, 0.01, 0.015, ms(4000), 0.99,
                                   [](ChannelMode m) { return m == ChannelMode::Shadowed; }};
    return policy == "dfq" ? dfq : timeslice;
}

}  // namespace

TEST_CASE("dfq and timeslice: weights 200:100 give 2:1", "[policy][dfq][timeslice]") {
    const Watcher& p = watcher(GENERATE(as<std::string>{}, "dfq", "timeslice"));
    Rig rig(p.policy);
    EntityId a = rig.task("heavy", 200);
    EntityId b = rig.task("light", 100);
    rig.submit_loop(a, ms(0.5));
    rig.submit_loop(b, ms(3));
    rig.run_until(ms(1000));
    rig.measure_from(ms(1000));
    rig.run_until(ms(11000));
    INFO("heavy " << rig.share(a) << " light " << rig.share(b));
    CHECK(rig.share(a) == Approx(2.0 / 3.0).margin(p.weights_margin));
    if (p.policy == "timeslice") CHECK(rig.counter("slices") > 100);
}

TEST_CASE("dfq and timeslice: nested tree gets the product of shares", "[policy][dfq][timeslice]") {
    const Watcher& p = watcher(GENERATE(as<std::string>{}, "dfq", "timeslice"));
    Rig rig(p.policy);
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
    CHECK(rig.share(a) == Approx(2.0 / 3.0 * 1.0 / 4.0).margin(p.nested_margin));
    CHECK(rig.share(b) == Approx(2.0 / 3.0 * 3.0 / 4.0).margin(p.nested_margin));
    CHECK(rig.share(c) == Approx(1.0 / 3.0).margin(p.nested_margin));
}

TEST_CASE("dfq and timeslice: an idle leaf gives its share away", "[policy][dfq][timeslice]") {
    const Watcher& p = watcher(GENERATE(as<std::string>{}, "dfq", "timeslice"));
    Rig rig(p.policy);
    EntityId a = rig.task("a");
    EntityId b = rig.task("b");
    EntityId c = rig.task("c", 200);
    rig.submit_loop(a, ms(2));
    rig.submit_loop(b, ms(0.5));
    ChannelId cc = rig.submit_loop(c, ms(1));
    rig.run_until(ms(500));
    rig.measure_from(ms(500));
    rig.run_until(ms(500) + p.window);
    INFO("with c: a " << rig.share(a) << " b " << rig.share(b) << " c " << rig.share(c));
    CHECK(rig.share(c) == Approx(0.5).margin(p.nested_margin));
    CHECK(rig.share(a) == Approx(0.25).margin(p.nested_margin));

    rig.subs.at(cc).running = false;  // c goes idle
    const Time without_c = ms(1000) + p.window;
    rig.run_until(without_c);
    rig.measure_from(without_c);
    const Time end = without_c + p.window;
    rig.run_until(end);
    INFO("without c: a " << rig.share(a) << " b " << rig.share(b) << " busy " << rig.busy_fraction(end));
    CHECK(rig.gpu_time(c) == 0);
    CHECK(rig.share(a) == Approx(0.5).margin(p.nested_margin));
    CHECK(rig.busy_fraction(end) > p.idle_busy);
}

TEST_CASE("dfq and timeslice: held work is never lost and everything ends direct", "[policy][dfq][timeslice]") {
    const Watcher& p = watcher(GENERATE(as<std::string>{}, "dfq", "timeslice"));
    Rig rig(p.policy);
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
    CHECK(rig.loop.pending() == 0);  // idle (dfq), disengaged (timeslice): no timer left behind
    CHECK(rig.counter("shadow_events") > 0);
    if (p.policy == "dfq") {
        CHECK(rig.counter("released_entries") > 0);
    } else {
        CHECK(rig.counter("engagements") >= 1);
        CHECK(rig.sched.stats().released_entries > 0);
    }
}

TEST_CASE("dfq and timeslice: weight changes, joining and leaving channels", "[policy][dfq][timeslice]") {
    const Watcher& p = watcher(GENERATE(as<std::string>{}, "dfq", "timeslice"));
    Rig rig(p.policy);
    EntityId a = rig.task("a");
    EntityId b = rig.task("b");
    rig.submit_loop(a, ms(1.5));
    ChannelId bch = rig.submit_loop(b, ms(0.5));
    rig.run_until(ms(2000));
    rig.sched.entities().set_weight(b, 300);
    rig.run_until(ms(2500));
    rig.measure_from(ms(2500));
    const Time joins = ms(2500) + p.window;
    rig.run_until(joins);
    INFO("after weight change: b " << rig.share(b));
    CHECK(rig.share(b) == Approx(0.75).margin(p.weight_changes_margin));

    // A third leaf joins late, then b's channel closes under load.
    EntityId c = rig.task("c", 300);
    rig.submit_loop(c, ms(2), 0, 0, joins);
    rig.run_until(joins + ms(500));
    rig.measure_from(joins + ms(500));
    const Time closes = joins + ms(500) + p.window;
    rig.run_until(closes);
    INFO("three: a " << rig.share(a) << " b " << rig.share(b) << " c " << rig.share(c));
    CHECK(rig.share(a) == Approx(1.0 / 7.0).margin(p.weight_changes_margin));
    CHECK(rig.share(c) == Approx(3.0 / 7.0).margin(p.weight_changes_margin));

    rig.subs.at(bch).running = false;
    rig.sched.close_channel(bch);
    rig.run_until(closes + ms(500));
    rig.measure_from(closes + ms(500));
    rig.run_until(closes + ms(500) + p.window);
    INFO("after close: a " << rig.share(a) << " c " << rig.share(c));
    CHECK(rig.share(a) == Approx(0.25).margin(p.weight_changes_margin));
}

TEST_CASE("dfq and timeslice: weights hold on a preemptive time-sliced GPU", "[policy][dfq][timeslice]") {
    const Watcher& p = watcher(GENERATE(as<std::string>{}, "dfq", "timeslice"));
    sim::SimGpuConfig cfg;
    cfg.arbitration = sim::Arbitration::Timeslice;
    cfg.timeslice = ms(2);
    Rig rig(p.policy, {}, cfg);
    EntityId a = rig.task("a", 300);
    EntityId b = rig.task("b", 100);
    rig.submit_loop(a, ms(3));
    rig.submit_loop(b, ms(5));
    rig.run_until(ms(1000));
    rig.measure_from(ms(1000));
    rig.run_until(ms(11000));
    INFO("a " << rig.share(a));
    CHECK(rig.share(a) == Approx(0.75).margin(p.preemptive_margin));
}

TEST_CASE("dfq and timeslice: stop() puts every channel back to direct and cancels its timers", "[policy][dfq][timeslice]") {
    const Watcher& p = watcher(GENERATE(as<std::string>{}, "dfq", "timeslice"));
    Rig rig(p.policy);
    EntityId a = rig.task("a");
    EntityId b = rig.task("b");
    rig.submit_loop(a, ms(4));
    rig.submit_loop(b, ms(0.5));
    rig.run_until(ms(1003));
    bool some_at_work = false;
    for (const auto& [ch, s] : rig.subs) some_at_work |= p.at_work(rig.sched.mode(ch));
    CHECK(some_at_work);

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
    Rig rig2(p.policy);
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

TEST_CASE("dfq and timeslice: eight leaves with kernels from 0.1 to 8 ms share equally", "[policy][dfq][timeslice]") {
    const Watcher& p = watcher(GENERATE(as<std::string>{}, "dfq", "timeslice"));
    Rig rig(p.policy);
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
    CHECK(lo > 0.125 - p.eight_margin);
    CHECK(hi < 0.125 + p.eight_margin);
    CHECK(rig.busy_fraction(ms(11000)) > 0.97);
}

TEST_CASE("dfq and timeslice: a light leaf with CPU gaps does not make the GPU idle", "[policy][dfq][timeslice]") {
    const Watcher& p = watcher(GENERATE(as<std::string>{}, "dfq", "timeslice"));
    Rig rig(p.policy);
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

TEST_CASE("dfq and timeslice: a channel killed by the watchdog does not stall the others", "[policy][dfq][timeslice]") {
    const Watcher& p = watcher(GENERATE(as<std::string>{}, "dfq", "timeslice"));
    sim::SimGpuConfig cfg;
    cfg.watchdog = ms(50);
    Rig rig(p.policy, {}, cfg);
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
