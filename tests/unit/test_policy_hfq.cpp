// hfq under conditions a scenario file cannot express: weights changed and
// entities added while running, idle periods, policy switches, held work.
//
// Tolerances.  The simulation is deterministic (simulated clock): no bound
// covers run-to-run spread.  Share margins of 0.02 are the goal (worst share
// error 0.02 on the standard scenarios), 0.01 the goal for scenarios without
// a bursty target; other numbers are derived at the check.  "Measured" is
// the value the run gets today.
#include <catch2/catch.hpp>

#include <limits>
#include <map>
#include <memory>

#include "core/scheduler.hpp"
#include "sim/event_loop.hpp"
#include "sim/sim_gpu.hpp"
#include "sim/workload.hpp"
#include "policy_rig.hpp"

using namespace pvgpu;
using namespace pvgpu::sim;

namespace {

using test::Truth;

struct Rig {
    EventLoop loop;
    SimGpu gpu;
    Scheduler sched;
    Truth truth;
    std::vector<std::unique_ptr<SubmitLoop>> loops;

    explicit Rig(Arbitration arb = Arbitration::RoundRobin, std::string policy = "hfq",
                 const PolicyParams& params = {}, Duration irq_latency = 0)
        : gpu(loop, loop, SimGpuConfig{arb, 2 * kMillisecond, 0, 2 * kSecond, 75 * kMicrosecond, irq_latency}),
          sched(gpu, loop, loop, make_policy(policy, params)) {
        gpu.set_observer(&truth);
    }

    // A greedy (or gapped, or finite) submit loop on a new channel of `leaf`.
    SubmitLoop& add_loop(EntityId leaf, double kernel_us, double gap_us = 0, std::uint64_t kernels = 0,
                         double start_ms = 0, std::uint32_t batch = 1) {
        Workload w;
        w.kernel_us = {Dist::Kind::Fixed, kernel_us, 0};
        w.gap_us = gap_us;
        w.batch = batch;
        w.kernels = kernels;
        w.start_ms = start_ms;
        ChannelId ch = sched.open_channel(leaf);
        loops.push_back(std::make_unique<SubmitLoop>(loop, gpu, sched, ch, w, loops.size() + 1, nullptr));
        loops.back()->start();
        return *loops.back();
    }

    Duration ran(const SubmitLoop& l) { return truth.ran[l.channel()]; }
    void run_ms(double ms) { loop.run_until(loop.now() + from_us(ms * 1000)); }
};

double share(Duration a, Duration b) { return double(a) / double(a + b); }

}  // namespace

TEST_CASE("hfq equalises long and short kernels on a round-robin GPU", "[hfq]") {
    Rig rig;
    EntityId a = rig.sched.entities().add(kRootEntity, "long", EntityKind::Task);
    EntityId b = rig.sched.entities().add(kRootEntity, "short", EntityKind::Task);
    auto& la = rig.add_loop(a, 4000);
    auto& lb = rig.add_loop(b, 500);
    rig.run_ms(5000);
    // Without scheduling round-robin gives 4000/4500 = 0.89 to `long`.
    // The goal for scenarios without a bursty target, 0.01 (measured 0.5004).
    CHECK(share(rig.ran(la), rig.ran(lb)) == Approx(0.5).margin(0.01));
    CHECK(rig.sched.policy().counters().at("blocks") > 0);
    // Accounting agrees with the ground truth: the GPU's context-switch
    // trace dates every stint, so within 0.1% (measured equal to the
    // nanosecond; the bound was 2%, with no source).
    CHECK(double(*rig.sched.policy().accounted(a)) == Approx(double(rig.ran(la))).epsilon(0.001));
    CHECK(double(*rig.sched.policy().accounted(b)) == Approx(double(rig.ran(lb))).epsilon(0.001));
}

TEST_CASE("hfq follows weight changes at run time", "[hfq]") {
    Rig rig;
    EntityId a = rig.sched.entities().add(kRootEntity, "a", EntityKind::Vm);
    EntityId b = rig.sched.entities().add(kRootEntity, "b", EntityKind::Vm);
    auto& la = rig.add_loop(a, 1000);
    auto& lb = rig.add_loop(b, 300);
    rig.run_ms(2000);
    // The goal, 0.02 (measured 0.50003, then 0.75025).
    CHECK(share(rig.ran(la), rig.ran(lb)) == Approx(0.5).margin(0.02));
    rig.sched.entities().set_weight(a, 300);
    Duration a0 = rig.ran(la), b0 = rig.ran(lb);
    rig.run_ms(4000);
    CHECK(share(rig.ran(la) - a0, rig.ran(lb) - b0) == Approx(0.75).margin(0.02));
}

TEST_CASE("hfq gives a newcomer its share and banks no credit for idle time", "[hfq]") {
    Rig rig;
    EntityId a = rig.sched.entities().add(kRootEntity, "old", EntityKind::Task);
    auto& la = rig.add_loop(a, 2000);
    rig.run_ms(3000);  // `old` alone for 3 s
    EntityId b = rig.sched.entities().add(kRootEntity, "new", EntityKind::Task);
    auto& lb = rig.add_loop(b, 200);
    Duration a0 = rig.ran(la);
    rig.run_ms(1000);
    // Fair from the start: `old` is not starved for its 3 s of history ...
    // The goal, 0.02 (measured 0.4990; the bound was 0.03, with no source).
    CHECK(share(rig.ran(la) - a0, rig.ran(lb)) == Approx(0.5).margin(0.02));
}

TEST_CASE("a sleeper returns with bounded credit", "[hfq]") {
    Rig rig;
    EntityId a = rig.sched.entities().add(kRootEntity, "steady", EntityKind::Task);
    EntityId b = rig.sched.entities().add(kRootEntity, "sleeper", EntityKind::Task);
    auto& la = rig.add_loop(a, 1000);
    // 200 kernels of 1 ms, then nothing until a second loop starts at 3 s.
    auto& lb1 = rig.add_loop(b, 1000, 0, 200);
    rig.run_ms(3000);
    REQUIRE(lb1.finished());
    auto& lb2 = rig.add_loop(b, 1000, 0, 0, 3000);
    Duration a0 = rig.ran(la), b0 = rig.ran(lb1) + rig.ran(lb2);
    rig.run_ms(100);
    // The sleeper may not take the GPU for its 2.6 s of absence: `steady`
    // keeps about half even in the first 100 ms.  The sleeper's lead is at
    // most its kept credit (lag_ms, 4 ms), the block threshold (2 ms) and
    // one 1 ms kernel at each edge: 8 ms, so steady gets at least
    // (100 - 8) / 200 = 0.46 (measured 0.4747; the bound was 0.4, with no
    // source).
    Duration da = rig.ran(la) - a0, db = rig.ran(lb1) + rig.ran(lb2) - b0;
    CHECK(share(da, db) >= 0.46);
}

TEST_CASE("hfq reads no engine status while idle or serving a lone task, and wakes on a doorbell", "[hfq]") {
    Rig rig;
    EntityId a = rig.sched.entities().add(kRootEntity, "burst", EntityKind::Task);
    auto& l1 = rig.add_loop(a, 500, 0, 100);  // 50 ms of work, then idle
    rig.run_ms(500);
    REQUIRE(l1.finished());
    CHECK(rig.sched.policy().counters().at("idle_arms") == 1);
    auto polls = rig.sched.stats().polls;
    rig.run_ms(10000);
    CHECK(rig.sched.stats().polls == polls);  // no CPU while idle
    // New work: the first doorbell traps, the policy wakes, work completes.
    auto& l2 = rig.add_loop(a, 500, 0, 100, 10600);
    rig.run_ms(120);  // 20 ms into the burst: traps are off again
    CHECK(rig.sched.stats().traps == 1);
    CHECK(rig.sched.channel(l2.channel()).mode() == ChannelMode::Direct);
    rig.run_ms(1000);
    CHECK(l2.completed() == 100);
    CHECK(rig.sched.stats().traps == 1);
    // Nothing is shadowed, so nothing waits on the engine going idle: a
    // lone task costs the policy no register read.
    CHECK(rig.sched.stats().polls == polls);
    CHECK(rig.sched.policy().counters().at("idle_arms") == 2);
}

TEST_CASE("hfq keeps a lone task with short thinks in the run queue: no idle arming, no traps", "[hfq]") {
    // 100 us kernels, 100 us of CPU after each completion, one in flight,
    // and interrupts that reach the host `latency` late: the task never
    // thinks for `idle_us` (2 ms), and its doorbells are direct, so hfq
    // hears only its completions.  Each completion finds it without work;
    // its stay must start over at each one, or the idle check, landing in a
    // gap, takes it out of the run queue and every doorbell traps (plus two
    // remaps) until it is seen again: 4541 idle arms in 20 s at 20 us before.
    const Duration latency = GENERATE(20 * kMicrosecond, 50 * kMicrosecond);
    CAPTURE(latency);
    Rig rig(Arbitration::RoundRobin, "hfq", {}, latency);
    EntityId a = rig.sched.entities().add(kRootEntity, "gapped", EntityKind::Task);
    auto& l = rig.add_loop(a, 100, 100);
    rig.run_ms(1000);
    // One kernel per 200 us plus the latency (the task waits on its fence).
    const auto cycle_us = 200 + static_cast<double>(latency) / kMicrosecond;
    CHECK(l.completed() >= static_cast<std::uint64_t>(1e6 / cycle_us) - 1);
    CHECK(rig.sched.policy().counters().at("idle_arms") == 0);
    CHECK(rig.sched.stats().traps == 0);
    CHECK(rig.sched.stats().remaps == 0);
    CHECK(rig.sched.stats().polls == 0);
}

TEST_CASE("a VM without pid hints is held to its share across all its channels", "[hfq]") {
    auto arb = GENERATE(Arbitration::RoundRobin, Arbitration::Timeslice);
    Rig rig(arb);
    EntityId vm = rig.sched.entities().add(kRootEntity, "vm", EntityKind::Vm);
    EntityId host = rig.sched.entities().add(kRootEntity, "host", EntityKind::Task);
    Duration vm_ran = 0;
    std::vector<SubmitLoop*> vm_loops;
    for (int i = 0; i < 6; ++i) vm_loops.push_back(&rig.add_loop(vm, 3000));
    auto& lh = rig.add_loop(host, 250);
    rig.run_ms(5000);
    for (auto* l : vm_loops) vm_ran += rig.ran(*l);
    // The goal, 0.02 (measured 0.5016 round-robin, 0.5012 timeslice).
    CHECK(share(vm_ran, rig.ran(lh)) == Approx(0.5).margin(0.02));
}

TEST_CASE("held work is neither lost nor doubled", "[hfq]") {
    Rig rig;
    EntityId a = rig.sched.entities().add(kRootEntity, "a", EntityKind::Task);
    EntityId b = rig.sched.entities().add(kRootEntity, "b", EntityKind::Task);
    // Batches of 8: plenty of entries sit in shadow pages when blocked.
    auto& la = rig.add_loop(a, 3000, 0, 400);
    auto& lb = rig.add_loop(b, 100, 0, 20000);
    rig.run_ms(10000);
    CHECK(la.completed() == la.submitted());
    CHECK(lb.completed() == lb.submitted());
    CHECK(la.finished());
    CHECK(rig.sched.stats().released_entries > 0);
}

TEST_CASE("switching policy at run time returns channels to direct", "[hfq]") {
    Rig rig;
    EntityId a = rig.sched.entities().add(kRootEntity, "a", EntityKind::Task);
    EntityId b = rig.sched.entities().add(kRootEntity, "b", EntityKind::Task);
    auto& la = rig.add_loop(a, 5000);
    auto& lb = rig.add_loop(b, 100);
    rig.run_ms(1000);
    rig.sched.set_policy(make_policy("none", {}));
    rig.run_ms(100);  // remaps land
    CHECK(rig.sched.channel(la.channel()).mode() == ChannelMode::Direct);
    CHECK(rig.sched.channel(lb.channel()).mode() == ChannelMode::Direct);
    auto polls = rig.sched.stats().polls;
    Duration a0 = rig.ran(la), b0 = rig.ran(lb);
    rig.run_ms(1000);
    CHECK(rig.sched.stats().polls == polls);
    // Back to the GPU's own round-robin: 5000 / 5100 to `a`; over 1 s one
    // 5 ms kernel at an edge moves it 0.005: 0.01.
    CHECK(share(rig.ran(la) - a0, rig.ran(lb) - b0) == Approx(5000.0 / 5100).margin(0.01));
    rig.sched.set_policy(make_policy("hfq", {}));
    a0 = rig.ran(la), b0 = rig.ran(lb);
    rig.run_ms(3000);
    // The goal, 0.02 (measured 0.5008).
    CHECK(share(rig.ran(la) - a0, rig.ran(lb) - b0) == Approx(0.5).margin(0.02));
}

TEST_CASE("channels and entities can leave while hfq runs", "[hfq]") {
    Rig rig;
    EntityTree& tree = rig.sched.entities();
    EntityId vm = tree.add(kRootEntity, "vm", EntityKind::Vm);
    EntityId t1 = tree.add(vm, "t1", EntityKind::Task);
    EntityId t2 = tree.add(vm, "t2", EntityKind::Task);
    EntityId host = tree.add(kRootEntity, "host", EntityKind::Task);
    auto& l1 = rig.add_loop(t1, 2000);
    rig.add_loop(t2, 2000);
    auto& lh = rig.add_loop(host, 400);
    rig.run_ms(1000);
    // t1's guest task exits: its channel closes mid-kernel, the entity goes.
    rig.gpu.set_fence_watcher(l1.channel(), nullptr);
    rig.sched.close_channel(l1.channel());
    tree.remove(t1);
    Duration h0 = rig.ran(lh);
    rig.run_ms(3000);
    // host vs vm (now t2 alone) still 50/50: the goal, 0.02 (measured 0.5007).
    CHECK(double(rig.ran(lh) - h0) / double(3 * kSecond) == Approx(0.5).margin(0.02));
    CHECK_FALSE(tree.valid(t1));
}

// The closed-loop daemon test's teardown (CI, 2026-11-29): a client freed
// its channel while its kernel ran and hfq held the others' work.  The
// accounting's last read took the channel off the engine; hfq, hearing the
// engine idle, read the status again and the GPU, not yet told, still named
// the closing channel, which the accounting then believed running: every
// later interrupt looked it up ("no GPU channel 1") and the daemon tore its
// state down half-way.  Closed at every 0.1 ms through two rounds.
TEST_CASE("a channel closed on the engine while hfq holds others' work is let go of", "[hfq]") {
    int on_engine_with_held = 0;
    for (int i = 0; i < 130; ++i) {
        Rig rig;
        EntityTree& tree = rig.sched.entities();
        EntityId a = tree.add(kRootEntity, "long", EntityKind::Task);
        EntityId b = tree.add(kRootEntity, "short", EntityKind::Task);
        EntityId m = tree.add(kRootEntity, "monitor", EntityKind::Task);
        auto& la = rig.add_loop(a, 6000);
        auto& lb = rig.add_loop(b, 250);
        rig.add_loop(m, 150, 850);
        rig.run_ms(500 + 0.1 * i);
        const ChannelId ch = la.channel();
        if (rig.gpu.running_channel() == ch && rig.sched.held(lb.channel()) > 0) ++on_engine_with_held;
        rig.gpu.set_fence_watcher(ch, nullptr);
        rig.sched.close_channel(ch);
        tree.remove(a);
        CHECK(rig.sched.accounting().running() != std::optional<ChannelId>(ch));
        REQUIRE_NOTHROW(rig.run_ms(200));
    }
    // The case above was met, not just the easy ones.
    CHECK(on_engine_with_held > 0);
}

// Closing a channel is charged what it ran under every policy.  Masking a
// closing channel from the accounting too (a first fix of the test above)
// made the timeslice policy's status read at the close end its stint at a
// guess, and the accounting's own read then found it running on: its last
// stint was charged 1.4 ms short on average (a review of 5604d6f).
TEST_CASE("a channel closed on the engine is charged what it ran under every policy", "[hfq]") {
    const std::string policy = GENERATE(as<std::string>{}, "hfq", "timeslice", "dfq", "none");
    int on_engine = 0;
    Duration worst = 0;
    for (int i = 0; i < 60; ++i) {
        Rig rig(Arbitration::RoundRobin, policy);
        EntityTree& tree = rig.sched.entities();
        EntityId a = tree.add(kRootEntity, "a", EntityKind::Task);
        EntityId b = tree.add(kRootEntity, "b", EntityKind::Task);
        auto& la = rig.add_loop(a, 8000);
        rig.add_loop(b, 1000);
        rig.run_ms(300 + 0.37 * i);
        const ChannelId ch = la.channel();
        if (rig.gpu.running_channel() == ch) ++on_engine;
        rig.gpu.set_fence_watcher(ch, nullptr);
        rig.sched.close_channel(ch);
        const Duration off = rig.sched.accounting().gpu_time(a) - rig.ran(la);
        worst = std::max(worst, off < 0 ? -off : off);
    }
    INFO(policy << ": closed on the engine " << on_engine << " times, worst " << to_us(worst) << " us off");
    CHECK(on_engine > 0);
    CHECK(worst <= 0);
}

TEST_CASE("hfq rejects bad parameters", "[hfq]") {
    CHECK_THROWS_WITH(make_policy("hfq", {{"idle_us", 0}}), Catch::Contains("idle_us"));
    CHECK_THROWS_WITH(make_policy("hfq", {{"anticipate_us", -1}}), Catch::Contains("anticipate_us"));
    // Older configurations still load: the poll parameters have no effect
    // now, and setting one draws a warning naming it.
    CHECK_NOTHROW(make_policy("hfq", {{"poll_us", 0}, {"settle_us", 0}}));
    const std::vector<std::string> warnings = policy_warnings("hfq", {{"poll_us", 0}, {"settle_us", 0}});
    REQUIRE(warnings.size() == 2);
    CHECK_THAT(warnings[0], Catch::Contains("'poll_us' is deprecated and ignored"));
    CHECK_THAT(warnings[1], Catch::Contains("'settle_us' is deprecated and ignored"));
    CHECK(policy_warnings("hfq", {{"threshold_ms", 2}}).empty());
    CHECK(policy_warnings("dfq", {{"settle_us", 100}}).empty());
    CHECK_THROWS_WITH(make_policy("hfq", {{"unblock_ms", 5}, {"threshold_ms", 1}}),
                      Catch::Contains("unblock_ms"));
    CHECK_THROWS_WITH(make_policy("hfq", {{"bogus", 1}}), Catch::Contains("bogus"));
    CHECK_THROWS_WITH(make_policy("hfq", {{"fair_window", -1}}), Catch::Contains("fair_window"));
    CHECK_THROWS_WITH(make_policy("hfq", {{"fair_window", 2.5}}), Catch::Contains("fair_window"));
    CHECK_NOTHROW(make_policy("hfq", {{"fair_window", 0}}));
}

// Gapped and batched submitters: the cases where a leaf's demand is bursty.
// Each runs 1 s of warm-up and a 10 s window; the simulation has no noise, and
// the margins below are what the block threshold (2 ms of weighted GPU time)
// and one kernel at the window's edges can move a share: 2 ms / 10 s, 0.0002.
// Measured, the shares below sit within 0.0009 of their targets (b 0.2299
// against 300/1300 = 0.2308); the margin is 0.002, so a change that costs a
// bursty leaf a fifth of a percent of the GPU shows here.
namespace {

struct Split {
    double a, b, busy;
};

Split run_pair(Arbitration arb, double a_kernel_us, double b_kernel_us, double b_gap_us,
               std::uint32_t b_batch, const PolicyParams& params = {}) {
    Rig rig(arb, "hfq", params);
    EntityId a = rig.sched.entities().add(kRootEntity, "a", EntityKind::Task, 100);
    EntityId b = rig.sched.entities().add(kRootEntity, "b", EntityKind::Task, 100);
    SubmitLoop& la = rig.add_loop(a, a_kernel_us);
    SubmitLoop& lb = rig.add_loop(b, b_kernel_us, b_gap_us, 0, 0, b_batch);
    rig.run_ms(1000);
    Duration a0 = rig.ran(la), b0 = rig.ran(lb);
    rig.run_ms(10000);
    double da = double(rig.ran(la) - a0), db = double(rig.ran(lb) - b0);
    return {da / 1e10, db / 1e10, (da + db) / 1e10};
}

}  // namespace

TEST_CASE("hfq: a batched leaf against long kernels gets half", "[hfq][bursty]") {
    auto arb = GENERATE(Arbitration::RoundRobin, Arbitration::Timeslice);
    // b: batches of four 250 us kernels back to back; a: 2 ms kernels.
    Split s = run_pair(arb, 2000, 250, 0, 4);
    INFO(to_string(arb) << ": a " << s.a << " b " << s.b << " busy " << s.busy);
    CHECK(s.b == Approx(0.5).margin(0.002));
    CHECK(s.busy >= 0.99);
}

// Half is out of reach; what is checked is the best equal split each
// engine allows.  On the round-robin GPU each 1 ms kernel of a placed in
// one of b's 200 us thinks delays b by 800 us and unfilled thinks idle:
// filling half of them gives both 1 / 2.2 = 0.4545.  On the timeslice GPU
// a kernel of a cut short by a preemption (75 us dead time) resumes later,
// so an equal split preempts once per kernel of a, every other think: each
// gets 1000 / 2075 = 0.482.  hfq gets 0.4531 / 0.4808.  On the timeslice
// GPU it got 0.4531 too until a kernel fed past the feed cap became the
// returning leaf's to preempt (b, at 0.9 of its share, was not "behind").
// The check allows 0.005 under the bound; hfq is 0.0014 / 0.0011 under.
TEST_CASE("hfq: a gapped leaf whose demand exceeds its share gets the best equal split", "[hfq][bursty]") {
    auto arb = GENERATE(Arbitration::RoundRobin, Arbitration::Timeslice);
    // b: 500 us kernels, 200 us CPU gap (demand 0.71); a: greedy 1 ms kernels.
    Split s = run_pair(arb, 1000, 500, 200, 1);
    const double bound = arb == Arbitration::RoundRobin ? 1 / 2.2 : 1000.0 / 2075;
    INFO(to_string(arb) << ": a " << s.a << " b " << s.b << " busy " << s.busy << ", bound " << bound);
    CHECK(s.b >= bound - 0.005);
    CHECK(s.a >= bound - 0.005);
}

TEST_CASE("hfq: a gapped leaf below its share gets its demand", "[hfq][bursty]") {
    auto arb = GENERATE(Arbitration::RoundRobin, Arbitration::Timeslice);
    // b: 300 us kernels, 1 ms CPU gap: demand 300/1300 = 0.231 < 0.5.
    Split s = run_pair(arb, 500, 300, 1000, 1);
    INFO(to_string(arb) << ": a " << s.a << " b " << s.b << " busy " << s.busy);
    CHECK(s.b == Approx(300.0 / 1300.0).margin(0.002));
}

// b returns from each 4 ms think with lag_ms of credit, above the block
// threshold, so a is held back for the whole burst (0.142 with a credit at
// the threshold: each burst interleaved with a's 2 ms kernels).
TEST_CASE("hfq: a batched, gapped leaf below its share gets its demand", "[hfq][bursty]") {
    auto arb = GENERATE(Arbitration::RoundRobin, Arbitration::Timeslice);
    // b: four 250 us kernels, then 4 ms of CPU: demand 1/5; a: greedy 2 ms kernels.
    Split s = run_pair(arb, 2000, 250, 4000, 4);
    INFO(to_string(arb) << ": a " << s.a << " b " << s.b << " busy " << s.busy);
    CHECK(s.b == Approx(0.2).margin(0.002));
}

TEST_CASE("hfq: on the timeslice GPU a returning bursty leaf preempts a blocked one", "[hfq][bursty]") {
    // b: 150 us kernels, 850 us think (demand 0.15); a: greedy 6 ms kernels.
    // Each return of b finds a's kernel on the engine.  With a host
    // preemption (75 us of dead engine time) per return, b gets at most
    // 150 / (150 + 850 + 75) = 0.1395.  Without one (round-robin GPU) each
    // of a's kernels makes b wait at least 6 - 0.85 = 5.15 ms, so with a
    // share x, b gets at most 0.15 (1 - 5.15 x / 6); the max-min split
    // equalises a's error (0.85 - x) and b's (0.129 x): x = 0.7530, b =
    // 0.0530.  hfq used to feed a whenever b thought (b 0.02); it now holds
    // the engine while b is further below its max-min share than a.
    Split ts = run_pair(Arbitration::Timeslice, 6000, 150, 850, 1);
    Split rr = run_pair(Arbitration::RoundRobin, 6000, 150, 850, 1);
    INFO("timeslice: a " << ts.a << " b " << ts.b << "; round-robin: a " << rr.a << " b " << rr.b);
    CHECK(ts.b == Approx(150.0 / 1075.0).margin(0.002));
    // The rest, less the preemptions' dead time: 1 - 0.1395 - 75 / 1075 =
    // 0.791 at most (measured 0.7905); 0.78 is 0.011 below that bound.
    CHECK(ts.a >= 0.78);
    const double x = 0.85 / (1 + 0.15 * 5.15 / 6);
    CHECK(rr.a == Approx(x).margin(0.002));
    CHECK(rr.b == Approx(0.15 * (1 - 5.15 * x / 6)).margin(0.002));
}

// A bursty leaf far behind keeps its two greedy siblings blocked, and the
// engine is fed from their shadow pages.  Each submits its next kernel only
// once the last completed, so at each completion only the other one has
// work held: fed at once, they alternated kernel for kernel and the 6 ms
// one got 0.96 of their GPU time on the round-robin GPU (0.83 on the
// timeslice GPU).  The one less ahead is now given its turnaround to
// submit (hfq's resubmit_wait).  Measured: 0.4999 / 0.5000; the margin is
// about one 6 ms kernel of the two's 8.5 s in the window.
TEST_CASE("hfq: a client with one kernel in flight is not starved by a blocked neighbour's queue",
          "[hfq][bursty]") {
    auto arb = GENERATE(Arbitration::RoundRobin, Arbitration::Timeslice);
    Rig rig(arb);
    EntityId lng = rig.sched.entities().add(kRootEntity, "long", EntityKind::Task);
    EntityId sht = rig.sched.entities().add(kRootEntity, "short", EntityKind::Task);
    EntityId mon = rig.sched.entities().add(kRootEntity, "monitor", EntityKind::Task);
    SubmitLoop& ll = rig.add_loop(lng, 6000);
    SubmitLoop& ls = rig.add_loop(sht, 250);
    rig.add_loop(mon, 150, 850);
    rig.run_ms(1000);
    const Duration l0 = rig.ran(ll), s0 = rig.ran(ls);
    rig.run_ms(10000);
    const double split = share(rig.ran(ll) - l0, rig.ran(ls) - s0);
    INFO(to_string(arb) << ": long's part of the two " << split);
    CHECK(split == Approx(0.5).margin(0.001));
}

TEST_CASE("hfq: a bursty leaf back from a long absence is direct again", "[hfq][bursty]") {
    // b bursts (four 250 us kernels, 4 ms thinks) beside a's greedy 2 ms
    // kernels, so it is marked bursty: a trap per doorbell while unblocked.
    Rig rig(Arbitration::RoundRobin);
    EntityId a = rig.sched.entities().add(kRootEntity, "a", EntityKind::Task, 100);
    EntityId b = rig.sched.entities().add(kRootEntity, "b", EntityKind::Task, 100);
    rig.add_loop(a, 2000);
    SubmitLoop& bursts = rig.add_loop(b, 250, 4000, 40, 0, 4);
    rig.run_ms(200);
    REQUIRE(rig.sched.channel(bursts.channel()).mode() == ChannelMode::Trapped);
    // After 300 ms away (far beyond any think worth a trap) b comes back
    // greedy: its first doorbell is still trapped, then it runs direct.
    SubmitLoop& back = rig.add_loop(b, 250, 0, 0, 500);
    rig.run_ms(400);
    const auto traps = rig.sched.stats().traps;
    rig.run_ms(200);
    CHECK(rig.sched.stats().traps == traps);
    CHECK(rig.sched.channel(back.channel()).mode() != ChannelMode::Trapped);
    CHECK(rig.sched.channel(bursts.channel()).mode() != ChannelMode::Trapped);
}

// Queue cap: eight leaves that each keep two batches of four kernels queued
// (kernels 250 us .. 2 ms, as issue 12's 128 throttles).  Blocking stops
// what a leaf submits next; what it already queued still runs in turn with
// the others, so without the cap the leaves drift apart by the threshold
// plus up to eight queued kernels.  The cap keeps them within the threshold,
// `queue_ms` and a kernel or two.
namespace {

Duration queue_spread(const PolicyParams& params, std::uint64_t* metered_releases = nullptr) {
    Rig rig(Arbitration::RoundRobin, "hfq", params);
    std::vector<std::vector<SubmitLoop*>> leaves;
    for (int i = 0; i < 8; ++i) {
        EntityId leaf = rig.sched.entities().add(kRootEntity, "t" + std::to_string(i), EntityKind::Task, 100);
        const double kernel_us = 250 + 250 * i;
        leaves.push_back({&rig.add_loop(leaf, kernel_us, 0, 0, 0, 4), &rig.add_loop(leaf, kernel_us, 0, 0, 0, 4)});
    }
    auto ran = [&](int i) { return rig.ran(*leaves[i][0]) + rig.ran(*leaves[i][1]); };
    rig.run_ms(1000);  // past the first queues, dumped before any kernel length was learned
    std::vector<Duration> from;
    for (int i = 0; i < 8; ++i) from.push_back(ran(i));
    Duration spread = 0;
    for (int step = 0; step < 400; ++step) {
        rig.run_ms(10);
        Duration lo = std::numeric_limits<Duration>::max(), hi = 0;
        for (int i = 0; i < 8; ++i) {
            lo = std::min(lo, ran(i) - from[i]);
            hi = std::max(hi, ran(i) - from[i]);
        }
        spread = std::max(spread, hi - lo);
    }
    if (metered_releases) *metered_releases = static_cast<std::uint64_t>(rig.sched.policy().counters().at("metered_releases"));
    return spread;
}

}  // namespace

TEST_CASE("hfq: a leaf keeps at most queue_ms queued while it shares the GPU", "[hfq][queue]") {
    std::uint64_t releases = 0;
    const Duration capped = queue_spread({}, &releases);
    const Duration uncapped = queue_spread({{"queue_ms", 0}});
    INFO("spread with the cap " << to_ms(capped) << " ms, without " << to_ms(uncapped) << " ms");
    CHECK(releases > 0);
    // The threshold (2 ms), queue_ms (2 ms) and the longest kernel (2 ms).
    CHECK(capped <= 6 * kMillisecond);
    CHECK(uncapped > 6 * kMillisecond);
}

namespace {

// Issue 12's 128 host throttles: equal leaves with kernels spread over
// 250 us .. 2 ms, batches of four on two channels each.  U (most GPU time
// over least) over `seconds` after 2 s of warm-up, from the GPU's own record.
// U over `seconds` after 2 s; `reads_per_s`: the channel register reads of
// the policy and the accounting per simulated second over that window.
double crowd_unfairness(const PolicyParams& params, double seconds, double* reads_per_s = nullptr) {
    Rig rig(Arbitration::RoundRobin, "hfq", params);
    std::vector<std::vector<SubmitLoop*>> leaves;
    for (int i = 0; i < 128; ++i) {
        EntityId leaf = rig.sched.entities().add(kRootEntity, "t" + std::to_string(i), EntityKind::Task);
        const double kernel_us = 250 + (1750 * i) / 127;
        leaves.push_back({&rig.add_loop(leaf, kernel_us, 0, 0, 0, 4), &rig.add_loop(leaf, kernel_us, 0, 0, 0, 4)});
    }
    auto ran = [&](const std::vector<SubmitLoop*>& ls) {
        Duration d = 0;
        for (SubmitLoop* l : ls) d += rig.ran(*l);
        return d;
    };
    rig.run_ms(2000);
    std::vector<Duration> before;
    for (auto& ls : leaves) before.push_back(ran(ls));
    const std::uint64_t reads = rig.sched.stats().register_reads;
    rig.run_ms(seconds * 1000);
    if (reads_per_s) *reads_per_s = double(rig.sched.stats().register_reads - reads) / seconds;
    Duration least = std::numeric_limits<Duration>::max(), most = 0;
    for (std::size_t i = 0; i < leaves.size(); ++i) {
        const Duration got = ran(leaves[i]) - before[i];
        least = std::min(least, got);
        most = std::max(most, got);
    }
    return double(most) / double(least);
}

}  // namespace

// Among 128 siblings a 2 ms lead is 7% of a leaf's share of 7 s.  A
// perfectly fair non-preemptive schedule of this load shows U of at most
// 1.061 by GPU time in 95% of 7 s windows (docs/experiments.py
// --only fair_floor); the fixed bounds gave 1.086.
//
// Every channel register read is an MMIO read on real hardware (1 us, the
// model's cost).  hfq's scan for metered leaves left without work read the
// pending state of every channel of every metered leaf every 2 ms: the
// policy and the accounting read 128000 registers a second here (13% of a
// core); 24500 after that; 8200 since the queue cap takes a trapped or
// shadowed channel's IB_PUT from the host's own stores and reads each
// channel's IB_GET once per feed.  Budget: 0.9% of a core.
TEST_CASE("hfq: among many siblings the block threshold and queue cap shrink with their number", "[hfq][queue]") {
    double reads_per_s = 0;
    const double scaled = crowd_unfairness({}, 7, &reads_per_s);
    const double fixed = crowd_unfairness({{"fair_window", 0}}, 7);
    INFO("U over 7 s: fair_window 32 " << scaled << ", fixed bounds " << fixed << "; register reads " << reads_per_s
                                       << " a second");
    CHECK(scaled <= 1.061);
    CHECK(fixed > 1.061);
    CHECK(reads_per_s <= 9000);
}

namespace {

// The queue-cap cases: a leaf `m` beside a sibling that submits 2 ms kernels
// back to back, so that m shares the GPU.
struct SharedRig {
    test::Rig rig{"hfq"};
    EntityId m;
    SharedRig() {
        EntityId a = rig.task("a");
        m = rig.task("m");
        rig.submit_loop(a, test::ms(2));
    }
    // A channel of m with `queued` kernels submitted at once (it resubmits
    // one per completion), `limit` of them in all (0: endless).
    ChannelId channel(Duration kernel, int queued, std::uint64_t limit = 0) {
        const ChannelId ch = rig.submit_loop(m, kernel, 0, limit);
        for (int i = 1; i < queued; ++i) rig.submit(ch);
        return ch;
    }
};

}  // namespace

// A metered leaf whose entries stop asking for completion interrupts: its
// held work must still reach the GPU (fed at anyone's events), not wait
// for a completion it will never hear.
TEST_CASE("hfq: a metered leaf without completion interrupts still runs all its work", "[hfq][queue]") {
    SharedRig s;
    test::Rig& rig = s.rig;
    const ChannelId cb = s.channel(test::ms(1), 8, 400);
    rig.run_until(test::ms(200));
    REQUIRE(rig.sched.channel(cb).mode() == ChannelMode::Shadowed);
    REQUIRE(rig.counter("metered_releases") > 0);
    rig.subs.at(cb).irq = false;
    rig.run_until(test::ms(2000));
    CHECK(rig.subs.at(cb).completed == 400);
}

// A leaf with two channels, one of which the GPU kills (a bad entry) with
// eight entries frozen on it: the dead channel's frozen registers
// must not count as queued work, or the leaf is metered for good and its
// live channel's held work is never released.
TEST_CASE("hfq: a leaf's live channel runs on after its other channel dies with work queued", "[hfq][queue]") {
    SharedRig s;
    test::Rig& rig = s.rig;
    const ChannelId c1 = s.channel(test::ms(1), 1);
    rig.submit(c1);  // one good 1 ms kernel teaches c1's kernel length
    rig.subs.at(c1).kernel = Duration{1} << 52;  // then entries the GPU cannot decode
    for (int i = 0; i < 6; ++i) rig.submit(c1);
    const ChannelId c2 = s.channel(test::ms(1), 8);
    rig.run_until(test::ms(100));
    REQUIRE(rig.sched.gpu().read_status(c1) == PVGPU_CHAN_STATUS_ERROR);
    // Frozen at the first bad entry: it, the loop's own first submission,
    // the six above and the one after the good kernel's completion.
    REQUIRE(rig.sched.gpu().read_ib_put(c1) - rig.sched.gpu().read_ib_get(c1) == 8);
    const std::uint64_t before = rig.subs.at(c2).completed;
    rig.run_until(test::ms(600));
    // m keeps half the GPU through c2 alone: 250 of its 1 ms kernels in
    // 500 ms, less the block threshold's worth at the edges.
    CHECK(rig.subs.at(c2).completed - before >= 245);
}

// A tenant whose entries never ask for a completion interrupt has no kernel
// length learned by the accounting; hfq learns it from the GPU time charged
// per entry started, so its queue is capped like anyone's.
TEST_CASE("hfq: a leaf that asks for no completion interrupts is capped too", "[hfq][queue]") {
    SharedRig s;
    test::Rig& rig = s.rig;
    const ChannelId cb = s.channel(test::ms(1), 1);
    rig.subs.at(cb).irq = false;
    for (int i = 0; i < 7; ++i) rig.submit(cb);  // eight queued, none asking for an interrupt
    rig.run_until(test::ms(300));
    CHECK(rig.sched.channel(cb).mode() == ChannelMode::Shadowed);
    CHECK(rig.counter("metered_releases") > 0);
    const std::uint64_t before = rig.subs.at(cb).completed;
    rig.run_until(test::ms(800));
    // Still half the GPU: 250 of its 1 ms kernels in 500 ms, less the
    // block threshold's worth at the edges.
    CHECK(rig.subs.at(cb).completed - before >= 245);
}

// A client that joins a busy GPU opens its channel and queues deep at once
// (pvgpu-load's throttle: two batches of four).  Its kernel length is not
// known yet, so the cap cannot size its queue: without a meter from the
// start the whole first queue reaches the GPU, and on a round-robin engine
// its long kernels alternate with a short-kernel sibling's, far past its
// share, while it is blocked.
TEST_CASE("hfq: a leaf that joins a busy GPU is metered before its kernel length is known", "[hfq][queue]") {
    test::Rig rig("hfq");
    const EntityId a = rig.task("a");
    const EntityId b = rig.task("b");
    rig.submit_loop(a, test::ms(0.25));
    rig.run_until(test::ms(100));
    rig.measure_from(test::ms(100));
    const ChannelId cb = rig.submit_loop(b, test::ms(2), 0, 0, test::ms(100));
    for (int i = 1; i < 16; ++i) rig.submit(cb);  // sixteen 2 ms kernels queued on joining
    Duration lead = 0;
    for (Time t = test::ms(100); t <= test::ms(300); t += test::ms(0.25)) {
        rig.run_until(t);
        lead = std::max(lead, rig.gpu_time(b) - rig.gpu_time(a));
    }
    INFO("b's largest lead over a since it joined: " << to_ms(lead) << " ms");
    // lag_ms (4: credit a joining leaf starts with) + threshold_ms (2) +
    // queue_ms (2) + one 2 ms kernel.
    CHECK(lead <= test::ms(10));
}

// The meter on joining lasts only until a kernel length is learned: a leaf
// whose queue is within queue_ms is then direct, and pays no shadowing.
TEST_CASE("hfq: a joining leaf with a short queue goes direct once its kernel length is learned",
          "[hfq][queue]") {
    test::Rig rig("hfq");
    const EntityId a = rig.task("a");
    const EntityId b = rig.task("b");
    rig.submit_loop(a, test::ms(2));
    rig.run_until(test::ms(100));
    const ChannelId cb = rig.submit_loop(b, test::ms(0.5), 0, 0, test::ms(100));  // one kernel in flight
    REQUIRE(rig.sched.channel(cb).mode() == ChannelMode::Shadowed);
    rig.run_until(test::ms(150));
    CHECK(rig.sched.channel(cb).mode() == ChannelMode::Direct);
    rig.measure_from(test::ms(150));
    rig.run_until(test::ms(1150));
    // Measured 0.4995: at most the block threshold (2 ms) and one of b's
    // kernels apart at the window's edges, over 1 s.
    CHECK(rig.share(b) == Approx(0.5).margin(0.0025));
}

// A client that opens its channel while another tenant runs, and submits
// only after the GPU has gone idle: its leaf, metered on joining, is
// unmetered from inside hfq's walk over the metered leaves at the wake-up
// (which once erased from the set it walked).  Its work runs, alone.
TEST_CASE("hfq: a leaf metered on joining that submits after the GPU went idle runs its work",
          "[hfq][queue]") {
    test::Rig rig("hfq");
    const EntityId a = rig.task("a");
    const EntityId b = rig.task("b");
    const EntityId c = rig.task("c");
    rig.submit_loop(a, test::ms(1), 0, 10);
    rig.run_until(test::ms(5));
    // Opened while a runs; they submit at 100 ms, long after a is done.
    const ChannelId cb = rig.submit_loop(b, test::ms(1), 0, 50, test::ms(100));
    const ChannelId cc = rig.submit_loop(c, test::ms(1), 0, 50, test::ms(100));
    rig.run_until(test::ms(50));
    REQUIRE(rig.counter("idle_arms") >= 1);
    rig.run_until(test::ms(400));
    CHECK(rig.subs.at(cb).completed == 50);
    CHECK(rig.subs.at(cc).completed == 50);
    CHECK(rig.sched.channel(cb).mode() != ChannelMode::Shadowed);
}

// hfq's first idle check comes `idle_us` after it starts.  A host where no
// client has opened a channel by then must still trap the first doorbell of
// one that opens later on the idle GPU, or hfq hears of its work only from
// completions, after the work has run unprotected.
TEST_CASE("hfq: a channel that joins an idle GPU late is trapped like the others", "[hfq]") {
    test::Rig rig("hfq");
    const EntityId a = rig.task("a");
    rig.run_until(test::ms(10));  // no channel yet: nothing to trap
    const ChannelId ca = rig.submit_loop(a, test::ms(1), 0, 20, test::ms(30));
    rig.run_until(test::ms(20));
    CHECK(rig.counter("idle_arms") == 1);
    CHECK(rig.sched.channel(ca).mode() == ChannelMode::Trapped);
    rig.run_until(test::ms(100));
    CHECK(rig.sched.stats().traps == 1);  // its first doorbell woke hfq
    CHECK(rig.subs.at(ca).completed == 20);
}

// Each channel leaves hfq's idle trap at its own doorbell.  Switching every
// channel back at the first doorbell of any remapped each one twice per
// idle spell: a 10 us kernel every 10 ms beside 100 channels that never
// submit cost 201697 remaps in 10 s (some 20000 a second, a core's worth at
// the modelled 50 us a remap).  Now the idle channels are remapped once,
// the pulser twice per pulse, and each of its pulses is still seen at its
// trapped doorbell.
TEST_CASE("hfq: a pulse beside idle channels remaps only the pulser", "[hfq]") {
    test::Rig rig("hfq");
    const EntityId p = rig.task("pulse");
    const EntityId idle = rig.task("idle");
    std::vector<ChannelId> idle_chs;
    for (int i = 0; i < 100; ++i) idle_chs.push_back(rig.sched.open_channel(idle));
    const ChannelId pc = rig.submit_loop(p, test::ms(0.01), test::ms(10), 0, test::ms(1));
    rig.run_until(test::ms(10000));
    const auto pulses = rig.subs.at(pc).completed;
    INFO(pulses << " pulses, " << rig.sched.stats().remaps << " remaps, " << rig.sched.stats().traps << " traps, "
                << rig.counter("idle_arms") << " idle arms");
    REQUIRE(pulses > 900);
    CHECK(rig.counter("idle_arms") >= pulses - 1);  // every pulse came to an idle-armed GPU
    CHECK(rig.sched.stats().traps >= pulses - 1);   // and was seen at its doorbell
    CHECK(rig.sched.stats().remaps <= 2 * pulses + 100);
    for (ChannelId ch : idle_chs) CHECK(rig.sched.channel(ch).mode() == ChannelMode::Trapped);
}
