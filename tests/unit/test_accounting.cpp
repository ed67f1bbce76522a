// The scheduler's policy-independent accounting (core/accounting.*) against
// the engine's ground truth, under every policy and both GPU models.
//
// Tolerances.  The simulation is deterministic (simulated clock, seeded
// draws): no bound here covers run-to-run spread, and each is one of
//   - the goal: each tenant charged within 1% of the GPU time it ran (0.01
//     relative, `/ 100`);
//   - 0.001 where the GPU keeps a context-switch trace (the default GPU):
//     every stint is dated by the GPU, so charge and truth differ only by
//     where the run's last stint is cut (the truth counts a kernel once it
//     ends, the books up to the last read); 0.1% is room for that cut;
//   - a bound derived at the check (a read's window, one kernel at a
//     window's edge, the random sweep's per-configuration bound);
//   - where a case runs over seeds of the audit looks, those seeds are its
//     repeated runs: the comment gives the spread measured over them and
//     the factor the bound leaves (about four standard deviations).  Those
//     spreads were measured on a GPU without a trace; a case that runs on
//     the default GPU (Rig(policy) without no_trace) is now charged from
//     the trace, and its runs are exact (every seed alike).
// Approx with its default epsilon, and ==, are exact arithmetic.
#include <catch2/catch.hpp>

#include <algorithm>
#include <cmath>
#include <functional>
#include <map>
#include <memory>
#include <numeric>
#include <random>
#include <string>
#include <tuple>
#include <vector>

#include "policy_rig.hpp"

using namespace pvgpu;

using pvgpu::test::ms;
using pvgpu::test::Rig;
using pvgpu::test::StallingTimers;

namespace {

// A think time (Submitter::gap_after) drawn uniformly from [lo, hi] ms.
std::function<Duration(std::uint64_t)> drawn(double lo, double hi, unsigned seed) {
    auto rng = std::make_shared<std::mt19937>(seed);
    return [=](std::uint64_t) { return ms(std::uniform_real_distribution<double>(lo, hi)(*rng)); };
}

// A lone tenant's 2 s run: its submitters stop, the engine drains, and
// the GPU time it ran is set against what the accounting charged it.
struct Charged {
    double ran;
    double charged;
};
Charged run_and_drain(Rig& rig, EntityId leaf) {
    rig.run_until(ms(2000));
    rig.stop_submitters();
    rig.run_until(ms(2100));
    return {static_cast<double>(rig.gpu_time(leaf)), static_cast<double>(rig.sched.accounting().gpu_time(leaf))};
}

// A lone tenant's relative charging error under 16 seeds of the accounting's
// random looks (their noise is by design: a bound on one seed is luck).
// `setup` opens the tenant's submitters on a fresh rig and returns its leaf.
struct OverSeeds {
    double mean, lo, hi;
};
OverSeeds over_seeds(const char* policy, const std::function<EntityId(Rig&)>& setup) {
    std::vector<double> errs;
    for (std::uint64_t seed = 1; seed <= 16; ++seed) {
        Rig rig(policy);
        rig.sched.seed_accounting(seed);
        const EntityId leaf = setup(rig);
        const auto [ran, charged] = run_and_drain(rig, leaf);
        errs.push_back((charged - ran) / ran);
    }
    const auto [lo, hi] = std::minmax_element(errs.begin(), errs.end());
    return {std::accumulate(errs.begin(), errs.end(), 0.0) / static_cast<double>(errs.size()), *lo, *hi};
}

double rel_error(Duration measured, Duration truth) {
    return std::abs(double(measured - truth)) / double(truth);
}

// The looks, audits and traps below are the accounting of a GPU without a
// context-switch trace (with one, every stint is charged from the trace):
// the tests of those mechanisms run on such a GPU.
sim::SimGpuConfig no_trace(sim::SimGpuConfig cfg = {}) {
    cfg.ctxsw_trace = false;
    return cfg;
}

sim::SimGpuConfig timeslice_gpu(Duration slice = ms(2), Duration ctxsw = 0) {
    sim::SimGpuConfig cfg;
    cfg.arbitration = sim::Arbitration::Timeslice;
    cfg.timeslice = slice;
    cfg.ctxsw = ctxsw;
    return cfg;
}

// One task per load, each a loop of kernels with CPU gaps between them.
struct Load {
    double kernel_ms, gap_ms;
    std::uint32_t depth = 1;      // kernels kept submitted
    std::uint32_t irq_every = 1;  // an interrupt on every n-th kernel
};

// Runs the loads for 2 s, lets the engine drain, and checks that every task
// is charged what it ran within `tolerance`.
// Starts a task t0, t1, ... per load, runs them for 2 s and lets the
// engine drain (the truth counts a kernel when it ends).
std::vector<EntityId> run_loads(Rig& rig, const std::vector<Load>& loads) {
    std::vector<EntityId> leaves;
    for (const Load& l : loads) {
        const EntityId leaf = rig.task("t" + std::to_string(leaves.size()));
        Rig::Submitter& s = rig.subs.at(rig.submit_loop(leaf, ms(l.kernel_ms), ms(l.gap_ms)));
        s.depth = l.depth;
        s.irq_every = l.irq_every;
        leaves.push_back(leaf);
    }
    rig.run_until(ms(2000));
    rig.stop_submitters();
    rig.run_until(ms(2100));
    return leaves;
}

void check_charged(const std::string& policy, const sim::SimGpuConfig& cfg, std::initializer_list<Load> loads,
                   double tolerance = 0.001) {
    Rig rig(policy, {}, cfg);
    const std::vector<EntityId> leaves = run_loads(rig, loads);
    const Accounting& acc = rig.sched.accounting();
    for (const EntityId& leaf : leaves) {
        INFO("t" << (&leaf - leaves.data()) << ": charged " << to_ms(acc.gpu_time(leaf)) << " ms, ran "
                 << to_ms(rig.gpu_time(leaf)) << " ms");
        CHECK(rel_error(acc.gpu_time(leaf), rig.gpu_time(leaf)) < tolerance);
    }
}

}  // namespace

TEST_CASE("accounting: none on the round-robin GPU is exact from fences alone", "[accounting]") {
    Rig rig("none");
    EntityId a = rig.task("long");
    EntityId b = rig.task("short");
    rig.submit_loop(a, ms(4));
    rig.submit_loop(b, ms(0.2));
    rig.run_until(ms(2000));
    const Accounting& acc = rig.sched.accounting();
    INFO("long " << to_ms(acc.gpu_time(a)) << " / " << to_ms(rig.gpu_time(a)) << "; short "
                 << to_ms(acc.gpu_time(b)) << " / " << to_ms(rig.gpu_time(b)));
    // The GPU's round-robin gives 4 / 4.2 = 0.95 to the long kernels.  The
    // share counts kernels that ended by 2 s: the round cut at the end
    // moves it by at most one 4 ms kernel of 1905 ms, 0.2%; 1% (relative)
    // is the accounting goal's bound, applied to the share here.
    CHECK(rig.share(a) == Approx(4.0 / 4.2).epsilon(0.01));
    CHECK(rel_error(acc.gpu_time(a), rig.gpu_time(a)) < 0.001);
    CHECK(rel_error(acc.gpu_time(b), rig.gpu_time(b)) < 0.001);
    for (const auto& [ch, sub] : rig.subs) {
        INFO("channel " << ch << " leaf " << sub.leaf);
        CHECK(acc.kernels(sub.leaf) == sub.completed);
    }
    // One engine-status read per completion (plus the settle reads of the
    // two channels' first doorbells, and the audit looks of the spells
    // while they are new: either may ask for one interrupt per batch), no
    // poll, no policy read.  20 to 22 reads over fences under seeds 1..24 of
    // the looks, and 20 at 2, 4 and 8 s under the default: a cost at the
    // start only.
    CHECK(rig.sched.stats().accounting_reads <= rig.sched.stats().fences + 2 * 6 + 12);
    CHECK(rig.sched.stats().polls == 0);
}

TEST_CASE("accounting: a preemptive GPU is read at slice ends only", "[accounting]") {
    auto ctxsw = GENERATE(Duration{0}, ms(0.05));
    Rig rig("none", {}, timeslice_gpu(ms(2), ctxsw));
    EntityId a = rig.task("long");
    EntityId b = rig.task("short");
    rig.submit_loop(a, ms(5));  // spans slices: preempted mid-kernel
    rig.submit_loop(b, ms(0.3));
    rig.run_until(ms(2000));
    const Accounting& acc = rig.sched.accounting();
    INFO("ctxsw " << ctxsw << ": long " << to_ms(acc.gpu_time(a)) << " / " << to_ms(rig.gpu_time(a))
                  << "; short " << to_ms(acc.gpu_time(b)) << " / " << to_ms(rig.gpu_time(b)));
    CHECK(rel_error(acc.gpu_time(a), rig.gpu_time(a)) < 0.001);
    CHECK(rel_error(acc.gpu_time(b), rig.gpu_time(b)) < 0.001);
    // About one read per 2 ms slice plus one per completion, nothing more.
    CHECK(rig.sched.stats().accounting_reads <= rig.sched.stats().fences + 2000 / 2 + 2);
}

TEST_CASE("accounting: idle GPU costs no reads", "[accounting]") {
    Rig rig("none", {}, timeslice_gpu());
    EntityId a = rig.task("once");
    rig.submit_loop(a, ms(3), 0, 1);
    rig.run_until(ms(10));
    auto reads = rig.sched.stats().accounting_reads;
    // The audit looks at the idle engine until every doorbell is trapped
    // (50 ms) and one look sees it idle after that; none after.  (Before a
    // fresh channel's first unseen start was audited, none at all.)
    rig.run_until(ms(1000));
    INFO("audit looks at the idle engine: " << rig.sched.stats().accounting_reads - reads);
    CHECK(rig.sched.stats().accounting_reads - reads <= 16);
    reads = rig.sched.stats().accounting_reads;
    rig.run_until(ms(10000));
    CHECK(rig.sched.stats().accounting_reads == reads);
    // Its start on the idle engine was caught by a settle read: within
    // half the gap between two of them (the reads after an idle sighting
    // are 1, 10, 40 us apart: a start in the 10 us gap, placed mid-way, is
    // at most 5 us off).
    CHECK(std::abs(rig.sched.accounting().gpu_time(a) - ms(3)) <= ms(0.005));
}

TEST_CASE("accounting: starts from an idle engine are charged the learned kernel length", "[accounting]") {
    // A bursty tenant next to a busy one: most of its kernels start at the
    // other's completion (seen), some from an idle engine (unseen).
    Rig rig("none");
    EntityId busy = rig.task("busy");
    EntityId bursty = rig.task("bursty");
    rig.submit_loop(busy, ms(1), ms(1.5));
    rig.submit_loop(bursty, ms(0.4), ms(2));
    rig.run_until(ms(3000));
    const Accounting& acc = rig.sched.accounting();
    INFO("busy " << to_ms(acc.gpu_time(busy)) << " / " << to_ms(rig.gpu_time(busy)) << "; bursty "
                 << to_ms(acc.gpu_time(bursty)) << " / " << to_ms(rig.gpu_time(bursty)));
    CHECK(rel_error(acc.gpu_time(busy), rig.gpu_time(busy)) < 0.01);
    CHECK(rel_error(acc.gpu_time(bursty), rig.gpu_time(bursty)) < 0.01);
}

TEST_CASE("accounting: the same numbers under every policy", "[accounting]") {
    auto policy = GENERATE(as<std::string>{}, "none", "timeslice", "dfq", "hfq");
    auto preemptive = GENERATE(false, true);
    Rig rig(policy, {}, preemptive ? timeslice_gpu() : sim::SimGpuConfig{});
    EntityId vm = rig.vm("vm1");
    EntityId t1 = rig.task("t1", 100, vm);
    EntityId t2 = rig.task("t2", 100, vm);
    EntityId host = rig.task("host", 200);
    rig.submit_loop(t1, ms(3));
    rig.submit_loop(t2, ms(0.25));
    rig.submit_loop(host, ms(1));
    rig.run_until(ms(3000));
    const Accounting& acc = rig.sched.accounting();
    for (EntityId leaf : {t1, t2, host}) {
        INFO(policy << (preemptive ? " timeslice GPU" : " round-robin GPU") << ": leaf " << leaf << " measured "
                    << to_ms(acc.gpu_time(leaf)) << " true " << to_ms(rig.gpu_time(leaf)));
        CHECK(rel_error(acc.gpu_time(leaf), rig.gpu_time(leaf)) < 0.01);
    }
}

TEST_CASE("accounting: closed channels keep their time, removed entities lose it", "[accounting]") {
    Rig rig("none");
    EntityId a = rig.task("a");
    EntityId b = rig.task("b");
    ChannelId ca = rig.submit_loop(a, ms(1), 0, 10);
    rig.submit_loop(b, ms(1), 0, 10);
    rig.run_until(ms(100));
    const Accounting& acc = rig.sched.accounting();
    CHECK(acc.gpu_time(a) == ms(10));
    CHECK(acc.kernels(a) == 10);
    rig.sched.close_channel(ca);
    CHECK(acc.gpu_time(a) == ms(10));
    rig.sched.entities().remove(a);
    CHECK(acc.gpu_time(a) == 0);
    CHECK(acc.kernels(a) == 0);
    CHECK(acc.gpu_time(b) == ms(10));
}

// A channel believed on the engine when it is closed: its last kernel asked
// for no interrupt and ended unseen.  Charging it up to the close gave it
// the idle engine's time too (0.9 ms here for a 0.3 ms kernel).
TEST_CASE("accounting: a channel closed after its kernel ended unseen is charged that kernel", "[accounting]") {
    auto policy = GENERATE(std::string("none"), std::string("hfq"));
    Rig rig(policy);
    const EntityId a = rig.task("a");
    const ChannelId ca = rig.submit_loop(a, ms(0.3), 0, 1);
    rig.subs.at(ca).irq = false;
    rig.run_until(ms(0.9));  // before the busy engine's first watch read
    rig.sched.close_channel(ca);
    const Duration charged = rig.sched.accounting().gpu_time(a);
    INFO(policy << ": charged " << to_ms(charged) << " ms for 0.3 ms");
    // Its start was caught by the settle reads, 1 us apart.
    CHECK(std::abs(charged - ms(0.3)) <= ms(0.001));
}

// The watchdog kills a 10 ms kernel 5 ms in while the host is stalled; the
// other channel's next kernel runs meanwhile.  The error interrupt handled
// at the stall's end charged the killed channel up to then (9 ms of 5), and
// the kernel after it nothing.  The GPU timestamps the stop.
TEST_CASE("accounting: a channel killed while the host is late is charged up to the kill", "[accounting]") {
    auto policy = GENERATE(std::string("none"), std::string("hfq"));
    sim::SimGpuConfig cfg;
    cfg.watchdog = ms(5);
    Rig rig(policy, {}, cfg);
    rig.host_timers.stall(ms(5), ms(10));
    const EntityId good = rig.task("good"), bad = rig.task("bad");
    rig.submit_loop(good, ms(1));                      // 0..1, then 6..7 after the kill
    rig.submit_loop(bad, ms(10), 0, 1, ms(0.5));       // 1..6, killed
    rig.run_until(ms(10.5));
    const Accounting& acc = rig.sched.accounting();
    CHECK(rig.sched.stats().channel_errors == 1);
    INFO(policy << ": bad " << to_ms(acc.gpu_time(bad)) << " / " << to_ms(rig.gpu_time(bad)) << " ms; good "
                << to_ms(acc.gpu_time(good)) << " / " << to_ms(rig.gpu_time(good)) << " ms");
    CHECK(rig.gpu_time(bad) == ms(5));
    CHECK(std::abs(acc.gpu_time(bad) - rig.gpu_time(bad)) <= ms(0.001));
    // good's kernel on the engine at 10.5 ms is charged to now, the ground
    // truth counts it at its end: compare what ended.  Bound: one of good's
    // 1 ms kernels, the one on the engine at 30 ms.
    rig.run_until(ms(30));
    CHECK(std::abs(acc.gpu_time(good) - rig.gpu_time(good)) <= ms(1));
}

// A tenant may submit without asking for completion interrupts: hfq must
// still hold it to its weight and the books must stay exact.  (Here the
// interrupting neighbour's learned kernel length already pins every switch;
// the end-to-end case that needs the watch read and the GPU's completion
// timestamps, a qtest guest beside a host throttle, is qemu-modes, which
// charged the guest 3.8 s for 3.5 s of kernels and let it take 0.89 of the
// GPU at weight 20 without them.)
TEST_CASE("accounting: kernels without completion interrupts are charged as they run", "[accounting]") {
    Rig rig("hfq");
    EntityId quiet = rig.task("no-irq", 20);
    EntityId loud = rig.task("irq", 100);
    ChannelId cq = rig.submit_loop(quiet, ms(0.5), ms(0.2));
    rig.subs.at(cq).irq = false;
    rig.submit_loop(loud, ms(2));
    rig.run_until(ms(1000));
    rig.measure_from(ms(1000));
    const Accounting& acc = rig.sched.accounting();
    const Duration q0 = acc.gpu_time(quiet), l0 = acc.gpu_time(loud);
    rig.run_until(ms(6000));
    const Duration dq = acc.gpu_time(quiet) - q0, dl = acc.gpu_time(loud) - l0;
    INFO("no-irq " << to_ms(dq) << " / " << to_ms(rig.gpu_time(quiet)) << " ms; irq " << to_ms(dl) << " / "
                   << to_ms(rig.gpu_time(loud)) << " ms; share " << rig.share(quiet));
    CHECK(rel_error(dq, rig.gpu_time(quiet)) < 0.01);
    CHECK(rel_error(dl, rig.gpu_time(loud)) < 0.01);
    // hfq's split to its weights (20:100); 0.01 is the goal for shares on
    // the simulator's scenarios that have no bursty target, tighter than
    // the 0.02 of the standard ones.
    CHECK(rig.share(quiet) == Approx(20.0 / 120.0).margin(0.01));
    CHECK(acc.kernels(quiet) == 0);  // no interrupt, no kernel counted
}

// pvgpud runs the simulated GPU on its own event loop: when the host stalls
// (a burst of client connections at start-up), the GPU's completion timers
// fire late and in a row.  The first completion handled reads the engine
// (naming the kernel that started when it ended), then the next completion
// arrives with a GPU timestamp earlier than that read.  Bounding it by the
// read charged that kernel the whole stall and the kernels after it
// nothing: here one of three leaves was charged 13.7 ms more than it ran
// (of a 20 ms stall), another 10 ms less.  The timestamp is the truth.
TEST_CASE("accounting: completions handled late after a host stall are charged their own length",
          "[accounting]") {
    auto policy = GENERATE(std::string("none"), std::string("hfq"));
    Rig rig(policy);
    rig.host_timers.stall(ms(100), ms(120));
    const EntityId a = rig.task("a"), b = rig.task("b"), c = rig.task("c");
    const ChannelId ca = rig.submit_loop(a, ms(0.5));
    const ChannelId cb = rig.submit_loop(b, ms(0.3));
    const ChannelId cc = rig.submit_loop(c, ms(1));
    rig.run_until(ms(300));
    const Accounting& acc = rig.sched.accounting();
    for (EntityId leaf : {a, b, c}) {
        INFO(policy << ": leaf " << leaf << " charged " << to_ms(acc.gpu_time(leaf)) << " ms, ran "
                    << to_ms(rig.gpu_time(leaf)) << " ms");
        // The kernel on the engine at the end is charged up to now, the
        // ground truth counts it once it ends: at most one 1 ms kernel apart.
        CHECK(std::abs(acc.gpu_time(leaf) - rig.gpu_time(leaf)) < ms(1));
    }
    CHECK(acc.kernel_estimate(ca) == ms(0.5));
    CHECK(acc.kernel_estimate(cb) == ms(0.3));
    CHECK(acc.kernel_estimate(cc) == ms(1));
}

// hfq asks how long a kernel may run, not only how long it runs on
// average: a mean is outlasted by half of a varying tenant's kernels.  The
// spread is the mean deviation of the lengths seen from the estimate.
TEST_CASE("accounting: a channel's kernel spread is learned with its length", "[accounting]") {
    auto policy = GENERATE(std::string("none"), std::string("hfq"));
    Rig rig(policy);
    const EntityId a = rig.task("a"), b = rig.task("b");
    const ChannelId fixed = rig.submit_loop(a, ms(1));
    const ChannelId varying = rig.submit_loop(b, ms(0.5));
    // 0.2 and 0.8 ms in turn: mean 0.5 ms, every kernel 0.3 ms from it.
    rig.subs.at(varying).pattern = {ms(0.2), ms(0.8)};
    rig.run_until(ms(500));
    const Accounting& acc = rig.sched.accounting();
    INFO(policy << ": fixed " << to_ms(acc.kernel_estimate(fixed)) << " +- " << to_ms(acc.kernel_spread(fixed))
                << " ms; varying " << to_ms(acc.kernel_estimate(varying)) << " +- "
                << to_ms(acc.kernel_spread(varying)) << " ms");
    CHECK(acc.kernel_estimate(fixed) == ms(1));
    CHECK(acc.kernel_spread(fixed) < ms(0.001));
    // The estimate moves an eighth of the way per sample, so it swings
    // between 0.48 and 0.52 ms (a difference of 0.6 / 15); each kernel is
    // then 0.32 ms from the estimate before it, which the spread learns.
    CHECK(acc.kernel_estimate(varying) == Approx(double(ms(0.5))).margin(double(ms(0.021))));
    CHECK(acc.kernel_spread(varying) == Approx(double(ms(0.32))).margin(double(ms(0.002))));
    CHECK(acc.kernel_spread(rig.sched.open_channel(a)) == 0);  // nothing seen yet
}

namespace {

// qemu-modes in unit form: a guest that asks for one interrupt per batch of
// eight 0.5 ms kernels and keeps 64 submitted (VM weight 20), beside a host
// throttle whose two loops resubmit a 2 ms kernel `gap_ms` after each
// completion, on a host that stalls as `stall` sets up.  Checks both leaves'
// books against the engine over 500 ms .. `until`.
void check_guest_beside_throttle(const std::string& policy, double gap_ms,
                                 const std::function<void(StallingTimers&)>& stall, Time until,
                                 const std::string& what, Duration irq_latency = 0, std::uint64_t seed = 0) {
    sim::SimGpuConfig cfg;
    cfg.irq_latency = irq_latency;
    Rig rig(policy, {}, cfg);
    if (seed != 0) rig.sched.seed_accounting(seed);
    stall(rig.host_timers);
    const EntityId vm = rig.vm("vm-modes", 20);
    const EntityId guest = rig.task("task-77", 100, vm);
    const EntityId thr = rig.task("thr");
    const ChannelId cg = rig.submit_loop(guest, ms(0.5));
    rig.subs.at(cg).irq_every = 8;
    rig.subs.at(cg).depth = 64;
    rig.submit_loop(thr, ms(2), ms(gap_ms));
    rig.submit_loop(thr, ms(2), ms(gap_ms));
    rig.run_until(ms(500));
    rig.measure_from(ms(500));
    const Accounting& acc = rig.sched.accounting();
    const Duration g0 = acc.gpu_time(guest), t0 = acc.gpu_time(thr);
    rig.run_until(until);
    const Duration dg = acc.gpu_time(guest) - g0, dt = acc.gpu_time(thr) - t0;
    INFO(policy << ", " << what << ", gap " << gap_ms << " ms: guest " << to_ms(dg) << " / "
                << to_ms(rig.gpu_time(guest)) << " ms; throttle " << to_ms(dt) << " / " << to_ms(rig.gpu_time(thr))
                << " ms");
    CHECK(rel_error(dg, rig.gpu_time(guest)) < 0.01);
    CHECK(rel_error(dt, rig.gpu_time(thr)) < 0.01);
}

// A host stalled `stall_ms` at the start of every 37 ms, read between
// stalls (30 ms into a period): a stalled host's books lag the engine until
// its interrupts are handled.  Every interrupt also `latency_us` late.
void check_periodic_stalls(double stall_ms, double gap_ms, double latency_us = 0, std::uint64_t seed = 0) {
    check_guest_beside_throttle(
        "hfq", gap_ms, [&](StallingTimers& t) { t.stall_every(ms(600), ms(37), ms(stall_ms)); },
        ms(600 + 37 * 105 + 30),
        "stalls of " + std::to_string(static_cast<int>(stall_ms)) + " ms every 37 ms, interrupts " +
            std::to_string(static_cast<int>(latency_us)) + " us late, seed " + std::to_string(seed),
        static_cast<Duration>(latency_us * 1000), seed);
}

}  // namespace

// One 20 ms stall.  After it the completions are handled in a row, and each
// one's engine read shows the engine as that completion left it; the
// guest's next kernel, without an interrupt, then looked like it ran until
// the next sighting after the stall: charged 666.6 ms for 652 ms run
// (qemu-modes, on a busy CI machine: 680 ms for 552 ms).  Its last
// completion timestamp ends its stint.
TEST_CASE("accounting: a guest with an interrupt per batch beside a throttle that resubmits late",
          "[accounting]") {
    const double gap_ms = GENERATE(0.0, 0.3, 2.5);
    const std::string policy = GENERATE(std::string("none"), std::string("hfq"));
    const double stall_ms = GENERATE(0.0, 20.0);
    check_guest_beside_throttle(
        policy, gap_ms, [&](StallingTimers& t) { if (stall_ms > 0) t.stall(ms(1000), ms(1000 + stall_ms)); },
        ms(4500), "one stall of " + std::to_string(static_cast<int>(stall_ms)) + " ms");
}

// Stalls over and over.  A throttle kernel that started unseen after a
// guest kernel without an interrupt was charged from the stale sighting
// on, and the guest the rest: the guest was charged 667 ms for 614.5 ms run
// with 2 ms stalls every 37 ms, 665.6 ms for 383.5 ms with 15 ms stalls.
// The stint of the channel believed on the engine ends at its own last
// completion there too.
TEST_CASE("accounting: interrupts handled in a row after every one of many stalls", "[accounting]") {
    check_periodic_stalls(GENERATE(2.0, 5.0), GENERATE(0.0, 0.3, 2.5));
}

// The same stalls with every interrupt 20 or 50 us late as well.  The
// guest was charged 9.6% more than it ran (15 ms stalls, no resubmit gap),
// 3.5% (5 ms, 0.3 ms) and 1.2% (2 ms, none).  A throttle kernel that
// completed at the very moment the stall ended was left out of the
// replay, and the guest kernel after it charged the throttle's 2 ms.  And
// with 2 ms kernels the accounting's busy read, every 1 ms, came at each
// interrupt's moment, 20 us after the completion, and ran first: it closed
// the throttle's stint, whose interrupt then had nothing to learn a kernel
// length from, and without learned lengths a replay cannot count kernels
// (it split the window in timestamp order).  A stint closed at a
// completion by a look now teaches its length as the interrupt would.
TEST_CASE("accounting: many stalls with late interrupts", "[accounting]") {
    check_periodic_stalls(GENERATE(2.0, 5.0, 15.0), GENERATE(0.0, 0.3, 2.5), GENERATE(20.0, 50.0));
}

// A host stalled 15 ms of every 37.  The GPU runs on through a stall (as
// hardware does) and its interrupts arrive after it, and the host's own
// timer may release held work before it handles them.  Each channel's
// timestamp names only its last completion of the window: ordered by
// timestamps alone, a guest kernel run between two throttle kernels went to
// the throttle (the guest was charged 493 ms for 545.5 with no resubmit
// gap), and the host's release charged the guest the whole stint up to its
// last completion, the throttle's kernels in it included (445 for 434 with
// 0.3 ms).  GET counts the throttle's kernels exactly (one interrupt each);
// the guest gets the rest of the busy window.
// Under seeds 1..12 of the looks: with strata a quarter of the guest's
// pace between interrupts (10 ms), seeds 1, 5, 9 and 10 put it +2.7% or
// +4.8% off; the default seed passed by luck.  Strata per kernel: exact.
TEST_CASE("accounting: 15 ms stalls every 37 ms", "[accounting]") {
    const double gap = GENERATE(0.0, 0.3, 2.5);
    for (std::uint64_t seed = 1; seed <= 12; ++seed) check_periodic_stalls(15.0, gap, 0, seed);
}

// Every channel may ask for one interrupt per batch (a client that waits for
// batches, not kernels).  On the round-robin engine the channels then take
// turns between interrupts, unseen: none charged the 4 ms leaf 3218 ms of
// the 3846 ms it ran and the 0.2 ms leaf 96 of 192, and hfq gave the 0.2 ms
// leaf 0.378 of the GPU while its books said 0.333.  GET counts each
// channel's kernels between looks and the completion timestamps of a
// round teach their lengths.  The timeslice engine, read at slice ends, was
// exact already and stays so.
TEST_CASE("accounting: channels that interrupt once per batch are charged as they ran", "[accounting]") {
    const std::string policy = GENERATE(std::string("none"), std::string("hfq"));
    const int per_batch = GENERATE(range(1, 8));  // bit i: leaf i interrupts on every fourth kernel only
    sim::SimGpuConfig cfg;
    cfg.arbitration = GENERATE(sim::Arbitration::RoundRobin, sim::Arbitration::Timeslice);
    Rig rig(policy, {}, cfg);
    const Duration lengths[3] = {ms(4), ms(1), ms(0.2)};
    EntityId leaves[3];
    for (int i = 0; i < 3; ++i) {
        leaves[i] = rig.task("t" + std::to_string(i));
        const ChannelId ch = rig.submit_loop(leaves[i], lengths[i]);
        if (per_batch & (1 << i)) rig.subs.at(ch).irq_every = 4;
        rig.subs.at(ch).depth = 8;  // two batches of four
    }
    rig.run_until(ms(1000));
    rig.measure_from(ms(1000));
    const Accounting& acc = rig.sched.accounting();
    Duration before[3];
    for (int i = 0; i < 3; ++i) before[i] = acc.gpu_time(leaves[i]);
    rig.run_until(ms(6000));
    for (int i = 0; i < 3; ++i) {
        const Duration charged = acc.gpu_time(leaves[i]) - before[i];
        INFO(policy << (cfg.arbitration == sim::Arbitration::Timeslice ? ", timeslice" : ", round-robin")
                    << ", per-batch mask " << per_batch << ", " << to_ms(lengths[i]) << " ms leaf: charged "
                    << to_ms(charged) << " ms, ran " << to_ms(rig.gpu_time(leaves[i])) << " ms, share "
                    << rig.share(leaves[i]));
        // The books count the kernel on the engine at the end up to now, the
        // engine once it ends: one 4 ms kernel is 0.24% of a third of 5 s.
        // Measured at most 0.23% apart, shares at most 0.0006 off.
        CHECK(rel_error(charged, rig.gpu_time(leaves[i])) < 0.005);
        if (policy == "hfq") CHECK(rig.share(leaves[i]) == Approx(1.0 / 3).margin(0.002));
    }
}

// The tenant chooses which of its kernels interrupt: this one asks only
// after the short kernel of each batch (three 3.8 ms, one 0.2 ms).  Beside
// neighbours that interrupt once per batch on the round-robin engine, its
// long kernels are seen only by the watch reads.  A watch read that came at
// the very moment the neighbour before it completed (the register still
// named the neighbour) once placed its start halfway to the next read: hfq
// gave it 0.338 of three and charged it 1656 ms of the 1690 it ran.  Now
// every case is charged within 0.19% of what ran (one 3.8 ms kernel at the
// window's end is 0.23%), and hfq's shares are within 0.0016 of a third.
TEST_CASE("accounting: a tenant that asks for interrupts after its short kernels only", "[accounting]") {
    const std::string policy = GENERATE(std::string("none"), std::string("hfq"));
    const bool neighbours_per_batch = GENERATE(false, true);
    sim::SimGpuConfig cfg;
    cfg.arbitration = GENERATE(sim::Arbitration::RoundRobin, sim::Arbitration::Timeslice);
    Rig rig(policy, {}, cfg);
    const EntityId cheat = rig.task("cheat"), b = rig.task("b"), c = rig.task("c");
    const ChannelId cc = rig.submit_loop(cheat, ms(1));
    rig.subs.at(cc).pattern = {ms(3.8), ms(3.8), ms(3.8), ms(0.2)};
    rig.subs.at(cc).irq_every = 4;
    rig.subs.at(cc).depth = 8;
    for (EntityId l : {b, c}) {
        const ChannelId ch = rig.submit_loop(l, ms(1));
        rig.subs.at(ch).depth = 8;
        if (neighbours_per_batch) rig.subs.at(ch).irq_every = 4;
    }
    rig.run_until(ms(1000));
    rig.measure_from(ms(1000));
    const Accounting& acc = rig.sched.accounting();
    const Duration before = acc.gpu_time(cheat);
    rig.run_until(ms(6000));
    const Duration charged = acc.gpu_time(cheat) - before;
    INFO(policy << (cfg.arbitration == sim::Arbitration::Timeslice ? ", timeslice" : ", round-robin")
                << (neighbours_per_batch ? ", neighbours per batch" : ", neighbours per kernel") << ": charged "
                << to_ms(charged) << " ms, ran " << to_ms(rig.gpu_time(cheat)) << " ms, share " << rig.share(cheat));
    CHECK(rel_error(charged, rig.gpu_time(cheat)) < 0.005);
    if (policy == "hfq") CHECK(rig.share(cheat) == Approx(1.0 / 3).margin(0.002));
}

TEST_CASE("accounting: a kernel that ends with its slice, seen first by another look than the slice end's",
          "[accounting]") {
    // A 2 ms kernel in a 2 ms slice ends exactly at the slice end.  When a
    // policy's own engine read sees the switch before the slice end's read
    // does (here: one every 7 us), that look must also tell a channel that
    // ran out of work from one preempted, or its late interrupt charges it
    // again.
    auto ctxsw_us = GENERATE(0, 30);
    auto latency_us = GENERATE(0, 20, 50);
    sim::SimGpuConfig cfg = timeslice_gpu(ms(2), ctxsw_us * kMicrosecond);
    cfg.irq_latency = latency_us * kMicrosecond;
    Rig rig("none", {}, cfg);
    EntityId a = rig.task("slice-long");
    EntityId b = rig.task("short");
    rig.submit_loop(a, ms(2));
    rig.submit_loop(b, ms(0.5));
    std::function<void()> look = [&] {
        rig.sched.engine_status();
        rig.loop.arm(rig.loop.now() + 7 * kMicrosecond, look);
    };
    rig.loop.arm(1, look);
    rig.run_until(ms(1000));
    // Let the engine drain: the truth counts a kernel when it ends.
    rig.stop_submitters();
    rig.run_until(ms(1010));
    const Accounting& acc = rig.sched.accounting();
    INFO("ctxsw " << ctxsw_us << " us, interrupts " << latency_us << " us late: slice-long "
                  << to_ms(acc.gpu_time(a)) << " / " << to_ms(rig.gpu_time(a)) << "; short "
                  << to_ms(acc.gpu_time(b)) << " / " << to_ms(rig.gpu_time(b)));
    CHECK(rel_error(acc.gpu_time(a), rig.gpu_time(a)) < 0.001);
    CHECK(rel_error(acc.gpu_time(b), rig.gpu_time(b)) < 0.001);
}

TEST_CASE("accounting: a channel closed while preempted keeps its time and leaves nothing behind", "[accounting]") {
    // A 5 ms kernel taken off the engine at its 2 ms slice end, then closed
    // before it resumes.  The accounting keeps a list of preempted channels
    // whose late completions it looks for; a closed one must leave it, or a
    // later late interrupt would look up a channel that is gone.
    auto latency_us = GENERATE(0, 50);
    sim::SimGpuConfig cfg = timeslice_gpu(ms(2));
    cfg.irq_latency = latency_us * kMicrosecond;
    Rig rig("none", {}, cfg);
    const EntityId a = rig.task("long");
    const EntityId b = rig.task("short");
    const EntityId c = rig.task("other");
    const ChannelId ca = rig.submit_loop(a, ms(5));
    rig.submit_loop(b, ms(0.3));
    rig.run_until(ms(2.15));  // a preempted at 2 ms, b's 0.3 ms kernel on the engine
    rig.sched.close_channel(ca);
    // A new channel may get the closed one's id.
    rig.submit_loop(c, ms(0.7), 0, 0, ms(3));
    rig.run_until(ms(500));
    rig.stop_submitters();
    rig.run_until(ms(510));
    const Accounting& acc = rig.sched.accounting();
    INFO("interrupts " << latency_us << " us late: long " << to_ms(acc.gpu_time(a)) << " / "
                       << to_ms(rig.gpu_time(a)) << "; short " << to_ms(acc.gpu_time(b)) << " / "
                       << to_ms(rig.gpu_time(b)) << "; other " << to_ms(acc.gpu_time(c)) << " / "
                       << to_ms(rig.gpu_time(c)));
    REQUIRE(rig.gpu_time(a) == ms(2));
    CHECK(acc.gpu_time(a) == ms(2));
    CHECK(rel_error(acc.gpu_time(b), rig.gpu_time(b)) < 0.001);
    CHECK(rel_error(acc.gpu_time(c), rig.gpu_time(c)) < 0.001);
}

TEST_CASE("accounting: a short kernel that ends unseen before the read at another's late interrupt",
          "[accounting]") {
    // 50 us kernels resubmitted at their interrupt, 50 us late, beside 2 ms
    // kernels with 0.5 ms gaps on the round-robin GPU.  A short kernel
    // queued behind a long one starts at the long one's end and ends just
    // as the long one's interrupt reads the engine: idle.  Its own
    // interrupt comes after the settle reads that saw the engine idle, and
    // was charged from the last of them: nothing (16.6% of the short task's
    // time lost, before).  It ran from when the engine was believed idle.
    auto policy = GENERATE(as<std::string>{}, "none", "hfq");
    sim::SimGpuConfig cfg;
    cfg.irq_latency = 50 * kMicrosecond;
    Rig rig(policy, {}, cfg);
    const EntityId a = rig.task("long-gapped");
    const EntityId b = rig.task("short");
    rig.submit_loop(a, ms(2), ms(0.5));
    rig.submit_loop(b, ms(0.05));
    rig.run_until(ms(2000));
    rig.stop_submitters();
    rig.run_until(ms(2100));
    const Accounting& acc = rig.sched.accounting();
    INFO(policy << ": long " << to_ms(acc.gpu_time(a)) << " / " << to_ms(rig.gpu_time(a)) << "; short "
                << to_ms(acc.gpu_time(b)) << " / " << to_ms(rig.gpu_time(b)));
    CHECK(rel_error(acc.gpu_time(a), rig.gpu_time(a)) < 0.001);
    CHECK(rel_error(acc.gpu_time(b), rig.gpu_time(b)) < 0.001);
}

TEST_CASE("accounting: a host whose clock is far from 0 at start charges nothing from before it", "[accounting]") {
    // pvgpud's clock is the host's monotonic clock: hours at start.  A
    // 50 us kernel starts unseen between the settle reads that follow the
    // channel's creation (at +51 us and +201 us), ends before the second,
    // and its interrupt comes 100 us late, after it.  Its start is bounded
    // by when the engine was first seen idle: the accounting's start, not
    // time 0 (which charged it half an hour).
    sim::SimGpuConfig cfg;
    cfg.irq_latency = 100 * kMicrosecond;
    const Time start = 3600 * kSecond;
    Rig rig("none", {}, cfg, start);
    const EntityId a = rig.task("once");
    rig.submit_loop(a, ms(0.05), 0, 1, start + ms(0.06));
    rig.run_until(start + ms(10));
    const Duration charged = rig.sched.accounting().gpu_time(a);
    INFO("charged " << to_ms(charged) << " ms for " << to_ms(rig.gpu_time(a)));
    REQUIRE(rig.gpu_time(a) == ms(0.05));
    // Without a learned length: half the window from the idle engine's
    // last sighting before it (+51 us) to its end.
    CHECK(charged <= ms(0.06));
}

TEST_CASE("accounting: a kernel whose start was seen late is put right at its end after a preemption",
          "[accounting]") {
    // The timeslice policy on the timeslice GPU, 30 us switches: a 1 ms
    // task's direct doorbell starts its kernel just after the policy read
    // the engine idle (at another channel's held doorbell); the next look
    // is 50 us later, so the start is placed in the middle.  The channel
    // keeps its previous slice and is preempted at its end, and the rest
    // runs later: its completion used to charge the rest as seen, 25 us
    // short on half its kernels (1.24%).  Its learned length now puts the
    // whole kernel right, within that start's uncertainty.
    check_charged("timeslice", timeslice_gpu(ms(2), 30 * kMicrosecond), {{1, 0.5}, {2, 0.5}, {0.05, 0, 2}, {2, 2}});
}

TEST_CASE("accounting: a trapped doorbell after a kernel that ended unheard starts its channel then",
          "[accounting]") {
    // hfq on the timeslice GPU (sweep seed 252): a 2 ms task that asks for
    // an interrupt on every 4th kernel only beside a 0.5 ms one that thinks
    // 2 ms between kernels.  The 2 ms task's kernel, preempted, finishes
    // its rest unheard and the engine idles; the 0.5 ms task's trapped
    // doorbell comes 2 ms later.  The look after that doorbell used to date
    // the 0.5 ms kernel from the other's end (a ran-out stint's successor
    // starts at once), charging it the idle 2 ms: 130% too much.  Every
    // entry the GPU had of it had completed when the host forwarded that
    // doorbell, so nothing of it ran before.
    check_charged("hfq", timeslice_gpu(ms(2), 10 * kMicrosecond), {{0.5, 2}, {2, 0, 1, 4}});
}

TEST_CASE("accounting: on a preemptive GPU, another's interrupt after a kernel that ended unheard",
          "[accounting]") {
    // none on the timeslice GPU, 30 us switches (sweep seed 182): a 1 ms
    // task with an interrupt on every 4th kernel runs out of work (its next
    // doorbell comes just after the engine moved on) and a 50 us one runs.
    // Its interrupt found the 1 ms task believed on the engine and charged
    // it up to its own start, the switch's dead time included, and the
    // 50 us task's stint then paid a second switch: 2.08% over and 1.04%
    // under.  GET says the one kernel the 1 ms task fetched is the one
    // its completion timestamp ended: it ran out then.
    check_charged("none", timeslice_gpu(ms(2), 30 * kMicrosecond),
                  {{4, 0, 2}, {1, 0, 1, 4}, {0.05, 0.1, 4}, {0.2, 0.5, 4}});
}

TEST_CASE("accounting: a task that restarts after the settle reads stopped is seen whole by looks that halve "
          "its window",
          "[accounting]") {
    // none on the timeslice GPU, 1 ms slices, 30 us switches, interrupts
    // 20 us late (sweep seed 387): a 1 ms task that thinks 2 ms after each
    // completion beside a 50 us one that thinks 0.5 ms.  The 1 ms task's
    // kernels always start on an idle engine after its six settle reads,
    // and the next look is the 50 us task's interrupt, so none is seen
    // whole and no length is learned: each was charged from the middle of
    // its 800 us window, 39% under in all.  A look in the middle of where
    // its last start was seen, counted from the completion before it,
    // halves that window each time, and two looks at its ends then see a
    // start exactly.  (The kernels before that, ten halvings of 800 us,
    // are charged as before: 0.11% of the task's time, hence 0.2%.)  Its
    // kernel is as long as its slice: with its start known within a
    // microsecond, the slice-end read must take a completion just after the
    // slice end believed as the kernel running out, not as a preemption
    // (taken as one, the length was never learned: 38% under).
    sim::SimGpuConfig cfg = timeslice_gpu(ms(1), 30 * kMicrosecond);
    cfg.irq_latency = 20 * kMicrosecond;
    check_charged("none", cfg, {{1, 2}, {0.05, 0.5}}, 0.002);
}

TEST_CASE("accounting: the looks that halve a think window stop with the work", "[accounting]") {
    // The task of the test above, stopped before its length is learned:
    // the looks are placed after its own completions, so an idle GPU costs
    // no reads once they have passed.
    sim::SimGpuConfig cfg = timeslice_gpu(ms(1), 30 * kMicrosecond);
    cfg.irq_latency = 20 * kMicrosecond;
    Rig rig("none", {}, no_trace(cfg));
    const EntityId a = rig.task("thinks");
    const EntityId b = rig.task("short");
    const ChannelId ch = rig.submit_loop(a, ms(1), ms(2));
    rig.submit_loop(b, ms(0.05), ms(0.5));
    rig.run_until(ms(12));
    REQUIRE(rig.sched.accounting().kernel_estimate(ch) == 0);  // not learned yet
    rig.stop_submitters();
    // (The audit's looks, too, stop once every doorbell is trapped.)
    rig.run_until(ms(500));
    const auto reads = rig.sched.stats().accounting_reads;
    rig.run_until(ms(5000));
    CHECK(rig.sched.stats().accounting_reads == reads);
}

TEST_CASE("accounting: a trapped doorbell of the channel believed on the engine, after it ran out unheard",
          "[accounting]") {
    // hfq on the timeslice GPU, 4 ms slices (batch sweep seed 309): a 1 ms
    // task that thinks 2 ms and asks for an interrupt on every 4th kernel,
    // beside an 8 ms and a 2 ms task that hfq holds back.  Its kernel ends
    // unheard, the engine idles, and its next doorbell (trapped: it is
    // behind its share) finds it still believed on the engine, so the
    // slice-end look charged it the idle 2 ms: 49% too much.  The GPU's
    // pending register at that doorbell says it had nothing left: it ran
    // out at its completion timestamp.  A preempted kernel the engine
    // resumed then is read and dated from that moment.  (Measured after:
    // 0.00%, 0.17% and 0.00%; the 8 ms task's 0.17% is the bound here.)
    check_charged("hfq", timeslice_gpu(ms(4)), {{1, 2, 1, 4}, {8, 0}, {2, 0, 4}}, 0.002);
}

TEST_CASE("accounting: a preempted kernel resumed when the running channel ran out, seen only by a look",
          "[accounting]") {
    // hfq on the timeslice GPU, 1 ms slices, interrupts 50 us late (batch
    // sweep seed 267): hfq preempts a 2 ms task for a 0.2 ms one that
    // thinks 2 ms.  The 0.2 ms kernel ends unheard, the engine resumes
    // the 2 ms kernel and finishes it, and the slice-end look finds the
    // engine idle.  The host then releases the 2 ms task's next kernel, so
    // the late interrupt of the one before finds the channel on the engine
    // again and its rest (0.76 ms) was never charged: 9.4% under.  The
    // look now charges the preempted kernels that completed since the
    // running one ran out, from that moment on, as a late interrupt does.
    sim::SimGpuConfig cfg = timeslice_gpu(ms(1));
    cfg.irq_latency = 50 * kMicrosecond;
    check_charged("hfq", cfg, {{0.2, 2, 1, 4}, {2, 0.1, 2}});
}

TEST_CASE("accounting: another's interrupt after a ran-out kernel whose start was seen in a window",
          "[accounting]") {
    // dfq on the timeslice GPU, 4 ms slices, interrupts 50 us late (batch
    // sweep seed 245): a 2 ms task that thinks 2 ms and interrupts on
    // every 4th kernel starts on an idle engine after the settle reads'
    // 150 us look, and the 800 us one sees it: its start is placed in the
    // middle of those 800 us.  It runs out unheard and a 0.2 ms task runs;
    // that one's interrupt ended the 2 ms task's stint at its completion
    // timestamp but charged it as seen, 0.3 ms short a time: 6.45% under.
    // Its stint is now closed as any that ends at a completion, with its
    // usual length when GET says it held one kernel begun in a window.
    sim::SimGpuConfig cfg = timeslice_gpu(ms(4));
    cfg.irq_latency = 50 * kMicrosecond;
    check_charged("dfq", cfg, {{2, 0.1, 4}, {8, 0, 2}, {0.2, 0.5}, {2, 2, 1, 4}});
}

TEST_CASE("accounting: a new channel's first batches, before its interrupts show it batches", "[accounting]") {
    // Random configuration 360 of the batch sweep: `none` on the round-robin
    // GPU, a 0.5 ms task (two in flight) and a 0.2 ms task that thinks
    // 0.1 ms, both asking for an interrupt on every 4th kernel, beside a
    // 4 ms task that asks for one on each.  The 0.2 ms task runs unheard
    // between the other two; the watch read that finds the 4 ms one on the
    // engine replays the completions made meanwhile only while some channel
    // is known to batch, and a channel is known to after its second and
    // third interrupts (52 ms here).  Until then each of its kernels there
    // went to the 4 ms task: 1.87% of what it ran in 2 s, and in the first
    // 50 ms 0.8 ms charged of 2.4 ms run.  A channel counts as batching until
    // two of its interrupts in a row come after exactly one kernel each.
    Rig rig("none");
    const EntityId batched = rig.task("batched");
    const EntityId gapped = rig.task("gapped-batched");
    const EntityId each = rig.task("each");
    const ChannelId b = rig.submit_loop(batched, ms(0.5));
    rig.subs.at(b).depth = 2;
    rig.subs.at(b).irq_every = 4;
    rig.subs.at(rig.submit_loop(gapped, ms(0.2), ms(0.1))).irq_every = 4;
    rig.submit_loop(each, ms(4));
    rig.run_until(ms(50));
    rig.stop_submitters();
    rig.run_until(ms(100));
    const Accounting& acc = rig.sched.accounting();
    for (const EntityId leaf : {batched, gapped, each}) {
        INFO("leaf " << leaf << ": charged " << to_ms(acc.gpu_time(leaf)) << " ms, ran " << to_ms(rig.gpu_time(leaf))
                     << " ms");
        // Exact in this deterministic run; 10 us leaves room for rounding in
        // unrelated changes, and the bug was 1.6 ms (a regression guard, not
        // a measured spread).
        CHECK(std::abs(acc.gpu_time(leaf) - rig.gpu_time(leaf)) <= 10 * kMicrosecond);
    }
}

TEST_CASE("accounting: a kernel that ran entirely between two looks at an idle engine", "[accounting]") {
    // Random configuration 289 of the batch sweep: the `timeslice` policy
    // on the timeslice GPU (1 ms slices, 10 us switches), interrupts 20 us
    // late; three tasks that ask for an interrupt on every 4th kernel only.
    // The 1 ms task that thinks 2 ms (one in flight) has one kernel in four
    // start after the settle reads stopped and end before the next look,
    // which sees the engine idle again; a later exact start counted every
    // kernel GET had fetched as charged, so that kernel was never charged:
    // 24.8% under.  A look at an engine believed idle now charges the
    // kernels a channel completed since the previous look (its completion
    // timestamp lies between them, GET counts them) and dates what runs
    // next after them.  The first attempt (a2411a6, reverted) left that
    // date alone, and the next replay charged the same kernel again.  Here
    // every policy on both GPUs, so each kernel is charged once, whichever
    // look, replay or late interrupt comes first.
    for (const char* policy : {"none", "hfq", "dfq", "timeslice"})
        for (const bool timeslice : {false, true}) {
            INFO(policy << " on the " << (timeslice ? "timeslice" : "round-robin") << " GPU");
            sim::SimGpuConfig cfg = timeslice ? timeslice_gpu(ms(1), 10 * kMicrosecond) : sim::SimGpuConfig{};
            cfg.irq_latency = 20 * kMicrosecond;
            Rig rig(policy, {}, cfg);
            const EntityId tiny = rig.task("tiny");
            const EntityId busy = rig.task("busy");
            const EntityId thinker = rig.task("thinker");
            rig.subs.at(rig.submit_loop(tiny, ms(0.05), ms(0.1))).irq_every = 4;
            Rig::Submitter& b = rig.subs.at(rig.submit_loop(busy, ms(1), ms(0.1)));
            b.irq_every = 4;
            b.depth = 2;
            rig.subs.at(rig.submit_loop(thinker, ms(1), ms(2))).irq_every = 4;
            rig.run_until(ms(2000));
            rig.stop_submitters();
            rig.run_until(ms(2100));
            const Accounting& acc = rig.sched.accounting();
            auto ran = [&](EntityId leaf) { return static_cast<double>(rig.gpu_time(leaf)); };
            auto off = [&](EntityId leaf) { return static_cast<double>(acc.gpu_time(leaf)) - ran(leaf); };
            INFO("tiny charged " << to_ms(acc.gpu_time(tiny)) << " ms of " << to_ms(rig.gpu_time(tiny))
                                 << ", busy " << to_ms(acc.gpu_time(busy)) << " of " << to_ms(rig.gpu_time(busy))
                                 << ", thinker " << to_ms(acc.gpu_time(thinker)) << " of "
                                 << to_ms(rig.gpu_time(thinker)));
            // The sweep's bound for the 1 ms tasks: 1% plus the latency over
            // their kernel.  Before: the thinker 24.6% under with the
            // `timeslice` policy on either GPU.
            CHECK(std::abs(off(thinker)) < 0.03 * ran(thinker));
            CHECK(std::abs(off(busy)) < 0.03 * ran(busy));
            // The 50 us task thinks twice its kernel inside its batches: its
            // own idle time may be charged to it (the sweep's allowance,
            // 150% here; its kernels that run between looks are charged the
            // length learned from its stints, gaps included: up to +129%
            // under dfq and `timeslice`), and its latency bound is 41%.
            CHECK(off(tiny) > -0.41 * ran(tiny));
            CHECK(off(tiny) < (0.41 + 1.5) * ran(tiny));
        }
}

TEST_CASE("accounting: two sparse tenants, one asking for an interrupt per batch, within their bounds",
          "[accounting]") {
    // Found by a review of ran_between_looks: a 0.1 ms task that thinks
    // 1.5 ms and asks for an interrupt on every 4th kernel, beside a
    // 0.15 ms task that thinks 1.7 ms and asks for one on each; the GPU
    // idles most of the time.  The second restarts after the settle reads
    // stopped and no look ever saw it on the engine, so no think window was
    // opened for the probe looks and its length stayed unknown: each
    // interrupt charged half the time since the last look, and replays the
    // span since the previous completion, idle time included.  `none`
    // charged it 367 ms of 162 (693 at 182402d).  Its interrupt now bounds
    // its think time too (it started after the last look), the probes find
    // its start, and replays charge a channel that interrupts on every
    // kernel what GET counts of its usual length: +0.11% under `none` and
    // dfq, +0.36% under hfq (+0.74% before), +0.52% under `timeslice`
    // (-0.4% to +1.1% over 13 seeds; bound: the goal, 1%).
    // The batching task was charged its own idle time inside its batches
    // (+405% under `none`, +408% under dfq, +33% under hfq, +543% under
    // `timeslice`) until the audit looks corrected its charges too: now
    // right on average, with their noise, large beside its 0.1 ms kernels
    // (the looks are a quarter of the other task's pace apart): -5.0% to
    // +11.7% over 13 audit seeds (spread 16.7 points, worst 11.7%), hence
    // 15%: 1.3 times the worst, not four standard deviations.  The other: 1% either way
    // (-0.4% to +1.1% over those seeds).
    for (const char* policy : {"none", "hfq", "dfq", "timeslice"}) {
        INFO(policy);
        Rig rig(policy);
        const EntityId x = rig.task("x");
        const EntityId y = rig.task("y");
        rig.subs.at(rig.submit_loop(x, ms(0.1), ms(1.5))).irq_every = 4;
        const ChannelId ych = rig.submit_loop(y, ms(0.15), ms(1.7), 0, ms(0.7));
        rig.run_until(ms(2000));
        rig.stop_submitters();
        rig.run_until(ms(2100));
        const Accounting& acc = rig.sched.accounting();
        const double ran_x = static_cast<double>(rig.gpu_time(x)), ran_y = static_cast<double>(rig.gpu_time(y));
        const double off_x = static_cast<double>(acc.gpu_time(x)) - ran_x;
        const double off_y = static_cast<double>(acc.gpu_time(y)) - ran_y;
        INFO("x charged " << to_ms(acc.gpu_time(x)) << " ms of " << to_ms(rig.gpu_time(x)) << ", y "
                          << to_ms(acc.gpu_time(y)) << " of " << to_ms(rig.gpu_time(y)));
        CHECK(std::abs(off_x) < 0.15 * ran_x);
        CHECK(std::abs(off_y) < 0.01 * ran_y);
        // Its length is learned (at its 12th kernel, 0.1496 ms): within the
        // goal's 1% of the true 0.15 ms (measured 0.27% off).
        CHECK(std::abs(acc.kernel_estimate(ych) - ms(0.15)) < ms(0.15) / 100);
    }
}

TEST_CASE("accounting: seed 372's tasks under dfq, where a stint's end is ambiguous",
          "[accounting][accounting-turns-dfq]") {
    // A target until the per-channel doorbell traps: the 2 ms task's unseen start
    // is now read at its trapped doorbell, which settles ambiguity (1)
    // below: +1.38%, +2.24%, 0% and -0.05%.  Sweep seed 372's four tasks (two that
    // ask for an interrupt per 4 kernels, two on each) under dfq: +1.38%,
    // -5.38%, -9.91% and +18.73%.  Two ambiguities: (1) the 0.5 ms task
    // runs its batch and runs out, and the 2 ms task that thinks 2 ms
    // starts unseen; the slice-end read 1.85 ms later sees the 2 ms task on
    // the engine, GET counts several kernels of the 0.5 ms task since it was
    // charged, and its pending register is set (it resubmitted at its
    // interrupt): "ran out at its last completion" and "ran on and was
    // preempted now" both fit, and read as a preemption the 0.5 ms task pays
    // for the 2 ms task's time.  Reading it as running out because the
    // stretch is much longer than its learned length would let a tenant with
    // one long kernel among short ones be preempted uncharged.  (2) the two
    // batching tasks take turns inside what the host believes is one slice;
    // replaying the others' completion timestamps there was tried twice
    // (c15cab3, c77b594) and taken out after reviews found windows with a
    // preemption let through and a tenant charged 69% short by a stale
    // learned length.
    sim::SimGpuConfig cfg = timeslice_gpu(ms(2), 10 * kMicrosecond);
    cfg.irq_latency = 50 * kMicrosecond;
    Rig rig("dfq", {}, cfg);
    const std::vector<EntityId> leaves = run_loads(rig, {{2, 0}, {0.5, 0.1, 1, 4}, {2, 2}, {0.5, 0, 1, 4}});
    const Accounting& acc = rig.sched.accounting();
    auto off = [&](std::size_t i) {
        return (static_cast<double>(acc.gpu_time(leaves[i])) - static_cast<double>(rig.gpu_time(leaves[i]))) /
               static_cast<double>(rig.gpu_time(leaves[i]));
    };
    INFO("t0 " << 100 * off(0) << "%, t1 " << 100 * off(1) << "%, t2 " << 100 * off(2) << "%, t3 " << 100 * off(3)
               << "%");
    // The sweep's bounds: 1% plus the latency over the kernel; a task that
    // asks for an interrupt per 4 kernels and thinks between them may also
    // be charged 3/4 of its gap per kernel.
    CHECK(std::abs(off(0)) < 0.01 + 0.05 / 2);
    CHECK(std::abs(off(2)) < 0.01 + 0.05 / 2);
    CHECK(off(1) > -(0.01 + 0.05 / 0.5));
    CHECK(off(1) < 0.01 + 0.05 / 0.5 + 0.75 * 0.1 / 0.5);
    CHECK(std::abs(off(3)) < 0.01 + 0.05 / 0.5);
}

TEST_CASE("accounting: a tenant seen only at its interrupts whose kernels or think time change", "[accounting]") {
    // A tenant that asks for an interrupt on every kernel and starts on an
    // idle GPU after the settle reads have stopped: no look sees its starts
    // once its length is learned, and each unseen start is charged that
    // length.
    // (grow) 0.15 ms kernels that become 0.6 ms after 60: the old length was
    //   kept for good, -73% under every policy.  The check looks (at random
    //   moments of each idle spell, up to three) see a kernel running longer
    //   than learned, the length is forgotten and learned again.
    // (double) the same, 0.3 ms: -47.7% before.
    // (shrink) 0.6 ms kernels that become 0.15 ms: +242% before; a check
    //   look that sees the engine idle bounds the next kernel from above.
    // (think) 1 ms kernels, think 0.99..1 ms for 200 kernels (no think
    //   window closes, the probes are spent), then 205 us, just after the
    //   fourth settle read: each start was dated in the middle of the 800 us
    //   to the next read, -30% under none, dfq and `timeslice`.  Its length
    //   is now learned from the bounds its windows prove (learn_bounds).
    // Each unseen start is corrected by the audit looks, right on average
    // and noisy by how far off the guess was: each case runs under 16 seeds
    // of the looks.  Bound: the sweep's for an interrupt per kernel, 1%, on
    // the mean over the seeds; each run within about four sds of the looks'
    // noise over those seeds (grow 0.4%, double 0.8%, shrink's 0.15 ms
    // kernels 1.8%, think under 0.1%, measured over those seeds), which none of
    // the failures above would have met.
    for (const char* policy : {"none", "hfq", "dfq", "timeslice"}) {
        for (const char* change : {"grow", "double", "shrink", "think"}) {
            const std::string what = change;
            const OverSeeds e = over_seeds(policy, [&](Rig& rig) {
                const EntityId y = rig.task("y");
                if (what == "think") {
                    auto first = drawn(0.99, 1.0, 7);
                    rig.subs.at(rig.submit_loop(y, ms(1), 0, 0, ms(3))).gap_after = [=](std::uint64_t n) {
                        return n < 200 ? first(n) : ms(0.205);
                    };
                } else {
                    Rig::Submitter& s = rig.subs.at(rig.submit_loop(y, ms(0.15), ms(1.7), 0, ms(5)));
                    const double before = what == "shrink" ? 0.6 : 0.15;
                    const double after = what == "grow" ? 0.6 : what == "double" ? 0.3 : 0.15;
                    s.pattern.assign(60, ms(before));
                    s.pattern.resize(2000, ms(after));
                }
                return y;
            });
            INFO(policy << ", " << change << ": mean " << 100 * e.mean << "%, runs " << 100 * e.lo << ".."
                        << 100 * e.hi << "%");
            CHECK(std::abs(e.mean) < 0.01);
            const double per_run = what == "shrink" ? 0.072 : what == "double" ? 0.032 : 0.02;
            CHECK(std::max(-e.lo, e.hi) < per_run);
        }
    }
}

// The jittering tenants of the accounting-jitter cases (a)..(f) (c: 0..5);
// returns the tenant's leaf.
EntityId jitter_case(Rig& rig, int c) {
    const EntityId y = rig.task("y");
    if (c == 0) {
        rig.subs.at(rig.submit_loop(y, ms(1), 0, 0, ms(5))).gap_after = drawn(0.3, 2.5, 1);
    } else if (c == 1) {
        const EntityId x = rig.task("x");
        rig.subs.at(rig.submit_loop(x, ms(0.1), ms(1.5))).irq_every = 4;
        rig.subs.at(rig.submit_loop(y, ms(0.15), 0, 0, ms(0.7))).gap_after = drawn(1.5, 1.9, 1);
    } else if (c == 2) {
        Rig::Submitter& s = rig.subs.at(rig.submit_loop(y, ms(0.15), ms(1.7), 0, ms(5)));
        s.pattern.assign(60, ms(0.15));
        s.pattern.resize(2000, ms(0.18));
    } else {
        // Kernel lengths in turn, and the thinks after them in turn.
        const std::vector<std::vector<double>> kernels{{2.0, 0.1}, {1.0, 0.1}, {0.1, 2.0}};
        const std::vector<std::vector<double>> thinks{{1.2, 0.0}, {1.3, 1.1}, {1.2}};
        Rig::Submitter& s = rig.subs.at(rig.submit_loop(y, 0, 0, 0, ms(5)));
        for (double k : kernels[c - 3]) s.pattern.push_back(ms(k));
        s.gap_after = [t = thinks[c - 3]](std::uint64_t n) { return ms(t[n % t.size()]); };
    }
    return y;
}

TEST_CASE("accounting: tenants whose think time jitters, seen only at their interrupts",
          "[accounting][accounting-jitter]") {
    // A target until the per-channel doorbell traps (results.md section 6,
    // "Sparse tenants" and "Doorbell traps").  Tenants that ask for an interrupt on
    // every kernel and start on an idle GPU where no look sees a start
    // exactly, so the probe looks cannot close a think window on them.
    // (a) 1 ms kernels, think time drawn from 0.3..2.5 ms: the bounds its
    // windows prove narrow too slowly to learn its length (-2.9% under
    // none, dfq and `timeslice`, -7.3% before them; hfq exact).  (b) the
    // sparse pair of the test above, with the 0.15 ms task's think drawn
    // from 1.5..1.9 ms: a start dated at the previous kernel's end after the
    // engine idled teaches a length too long (+22% under none, +28% dfq,
    // +8.6% `timeslice`, +1.4% hfq; +67/+73/+21% before the bounds).  (c) a
    // tenant whose kernels become a fifth longer than the length learned:
    // a check look's proof must exceed it by a quarter, so it stays hidden
    // (-14.5% under none, dfq and `timeslice`, -15.5% hfq).  Found by a
    // review of da3ce1c, tenants that alternate short and long kernels, the
    // short ones seen whole or caught by the probes, so the learned length
    // is theirs, the long ones started unseen and charged it: (d) 2 ms
    // kernels after 1.2 ms thinks, each followed at once by a 0.1 ms one
    // (-57% under every policy); (e) 0.1 ms kernels after 1.1 ms thinks and
    // 1 ms ones after 1.3 ms (-16%; -78% before a check that sees the
    // engine idle looks again, -33% before checks served channels of
    // unknown length); (f) 0.1 and 2 ms kernels in turn, 1.2 ms thinks
    // (-19%, -40% before the latter).  The audit looks correct them all on
    // average; what is left is their noise, which grows with how far off the
    // guess is: 39 of these 192 runs were beyond 1%.  Now a channel that
    // started unseen after the settle reads has its doorbells trapped, and
    // its next starts are read right after them: every run within 0.22%.
    // The bound is the sweep's for an interrupt per kernel: 1%, on every
    // run under seeds 1..8 of the looks.
    for (const char* policy : {"none", "hfq", "dfq", "timeslice"}) {
        for (int c = 0; c < 6; ++c) {
            for (std::uint64_t seed = 1; seed <= 8; ++seed) {
                INFO(policy << " case " << "abcdef"[c] << ", seed " << seed);
                Rig rig(policy);
                rig.sched.seed_accounting(seed);
                const EntityId y = jitter_case(rig, c);
                const auto [ran, charged] = run_and_drain(rig, y);
                INFO("charged " << to_ms(rig.sched.accounting().gpu_time(y)) << " ms of "
                                << to_ms(rig.gpu_time(y)));
                CHECK(std::abs(charged - ran) < 0.01 * ran);
            }
        }
    }
}

TEST_CASE("accounting: the jittering tenants are charged right on average over seeds of the looks", "[accounting]") {
    // The target above asks each run to be within 1%; what keeps (b) beyond
    // it is the looks' noise (results.md section 6).  What they must not
    // be is biased, which is what every failure the target was written for
    // was (-57% to +22%): over 16 seeds of the looks the mean of each case
    // is within 1%, each run within about four sds of the noise measured
    // over those seeds (b75141c: (a) 0.27%, (b) up to 1.75%, (c) 1.27%, (d)
    // 0.19%, (e) 0.88%, (f) 0.61%; (b) under `timeslice` has one run at
    // -5.5%).
    const double per_run[] = {0.011, 0.07, 0.051, 0.008, 0.035, 0.025};
    for (const char* policy : {"none", "hfq", "dfq", "timeslice"}) {
        for (int c = 0; c < 6; ++c) {
            const OverSeeds e = over_seeds(policy, [c](Rig& rig) { return jitter_case(rig, c); });
            INFO(policy << " case " << "abcdef"[c] << ": mean " << 100 * e.mean << "%, runs " << 100 * e.lo << ".."
                        << 100 * e.hi << "%");
            CHECK(std::abs(e.mean) < 0.01);
            CHECK(std::max(-e.lo, e.hi) < per_run[c]);
        }
    }
}

TEST_CASE("accounting: the looks' moments follow their seed", "[accounting]") {
    // pvgpud seeds them from the host's entropy (Accounting::seed_looks):
    // a fixed sequence is one a tenant could replay.  A lone sparse tenant
    // whose starts are unseen, so the audit looks decide its charges: the
    // same seed gives the same charges to the nanosecond, another seed other
    // ones (each within 1%: this tenant's noise is 0.3% since b75141c).
    auto charged = [](std::uint64_t seed) {
        Rig rig("none", {}, no_trace());
        rig.sched.seed_accounting(seed);
        const EntityId y = rig.task("y");
        Rig::Submitter& s = rig.subs.at(rig.submit_loop(y, 0, 0, 0, ms(5)));
        s.pattern = {ms(2.0), ms(0.1)};
        s.gap_after = [](std::uint64_t n) { return ms(n % 2 ? 0.0 : 0.6); };
        return run_and_drain(rig, y);
    };
    const Charged a = charged(7), again = charged(7), b = charged(8), c = charged(7 + (std::uint64_t{1} << 40));
    INFO("seed 7: " << a.charged << " ns, seed 8: " << b.charged << ", seed 7 + 2^40: " << c.charged << " of " << a.ran);
    CHECK(a.ran == b.ran);
    CHECK(a.charged == again.charged);
    CHECK(a.charged != b.charged);
    CHECK(a.charged != c.charged);  // its high half counts too
    for (const Charged& x : {a, b, c}) CHECK(std::abs(x.charged - x.ran) < 0.01 * x.ran);
}

TEST_CASE("accounting: tenants that hide where their long kernels start from the audit", "[accounting]") {
    // Ways a
    // tenant could keep its unseen starts from being corrected.  (a) a
    // kernel of 20 us that asks for no interrupt right before each 2 ms one
    // that does: two kernels at each interrupt, which the correction once
    // skipped (charged as two of the learned length).  (b) the same tenant
    // with a second channel whose 50 us kernels never ask for an interrupt:
    // every completion then went through the replay, which the correction
    // once skipped too.  Think times vary (1..2 ms), so no look pattern
    // settles on them.  At a684771: (a) -31.2% under `none`, dfq and
    // `timeslice`, +24.3% under hfq; (b) -7.7%, -4.9%, -2.1%, -7.7%.  Now
    // (a) +0.73%, +0.11% under hfq; (b) -0.03%, +0.15%, +0.49%, -0.03%.
    // Bound: 1% on the mean over 16 seeds of the looks (b75141c: -0.12% to
    // +0.13%), and about four sds of their noise on each run (3.2%; runs
    // -1.2% to +2.1%).
    for (const char* policy : {"none", "hfq", "dfq", "timeslice"}) {
        for (int c = 0; c < 2; ++c) {
            const OverSeeds e = over_seeds(policy, [&](Rig& rig) {
                const EntityId y = rig.task("y");
                Rig::Submitter& s = rig.subs.at(rig.submit_loop(y, 0, 0, 0, ms(5)));
                s.pattern = {ms(0.02), ms(2)};
                s.irq_every = 2;
                s.gap_after = [](std::uint64_t n) {
                    return n % 2 == 1 ? 0 : ms(1 + 0.1 * static_cast<double>(n % 11));
                };
                if (c == 1) rig.subs.at(rig.submit_loop(y, ms(0.05), ms(3.3), 0, ms(6))).irq_every = 0;
                return y;
            });
            INFO(policy << " case " << "ab"[c] << ": mean " << 100 * e.mean << "%, runs " << 100 * e.lo << ".."
                        << 100 * e.hi << "%");
            CHECK(std::abs(e.mean) < 0.01);
            CHECK(std::max(-e.lo, e.hi) < 0.032);
        }
    }
}

TEST_CASE("accounting: lone tenants whose kernel lengths and think times vary", "[.targets][accounting-sweep-varied]") {
    // A target not met yet (tests/meson.build, suite 'targets'; results.md
    // section 6, "Varied tenants").  60 configurations of one tenant alone
    // on the GPU, asking for an interrupt on every kernel: kernels of a mean
    // drawn from 0.05..2 ms, each up to +-0..50% off it, think times of a
    // mean drawn from 0.1..4 ms, likewise; `none` and dfq in turn.  Its
    // starts after the settle reads are seen by no look, the probe looks
    // cannot close a window on a think time that varies, and bounds of
    // varied lengths never agree: each unseen kernel is charged half the
    // time since the last look.  The audit looks correct that on average;
    // what is left is their noise, predicted per configuration by
    // docs/looks_noise.py: 39 of the 60 keep a standard deviation over 0.5%
    // even with every stratum at the 200 us floor.  Bound: 1%, for each of
    // 12 seeds of the looks (with the default seed alone it was met by
    // luck: 2 of 12 seeds leave one configuration beyond).
    int beyond_all = 0;
    double worst_all = 0;
    for (std::uint64_t looks = 1; looks <= 12; ++looks) {
    int beyond = 0;
    double sum = 0;
    std::uint64_t reads = 0, kernels = 0, traps = 0;
    for (unsigned seed = 0; seed < 60; ++seed) {
        std::mt19937 g(seed);
        auto between = [&](double a, double b) { return std::uniform_real_distribution<double>(a, b)(g); };
        const double len = between(0.05, 2), len_spread = between(0, 1);
        const double think = between(0.1, 4), think_spread = between(0, 1);
        const char* policy = seed % 2 ? "dfq" : "none";
        // The accounting of a GPU without a context-switch trace: with one,
        // every stint is charged exactly ([accounting][trace]).
        sim::SimGpuConfig cfg;
        cfg.ctxsw_trace = false;
        Rig rig(policy, {}, cfg);
        rig.sched.seed_accounting(looks);
        const EntityId y = rig.task("y");
        Rig::Submitter& s = rig.subs.at(rig.submit_loop(y, ms(len), ms(think), 0, ms(5)));
        auto rng = std::make_shared<std::mt19937>(seed + 1000);
        auto off = [rng](double spread) {
            return 1 + spread * std::uniform_real_distribution<double>(-0.5, 0.5)(*rng);
        };
        for (int i = 0; i < 4000; ++i) s.pattern.push_back(ms(len * off(len_spread)));
        s.gap_after = [=](std::uint64_t) { return ms(think * off(think_spread)); };
        rig.run_until(ms(2000));
        rig.stop_submitters();
        rig.run_until(ms(2100));
        const double ran = static_cast<double>(rig.gpu_time(y));
        const double err = (static_cast<double>(rig.sched.accounting().gpu_time(y)) - ran) / ran;
        sum += std::abs(err);
        worst_all = std::max(worst_all, std::abs(err));
        if (std::abs(err) >= 0.01) ++beyond;
        reads += rig.sched.accounting().reads();
        kernels += rig.sched.accounting().kernels(y);
        traps += rig.sched.stats().traps;
        if (looks == 1 || std::abs(err) >= 0.01)
        std::printf("looks %llu, seed %u: %s, kernels %.2f ms +-%.0f%%, think %.2f ms +-%.0f%%: %+.2f%% (%.2f traps per kernel)\n",
                    static_cast<unsigned long long>(looks), seed, policy, len, 50 * len_spread, think, 50 * think_spread, 100 * err,
                    static_cast<double>(rig.sched.stats().traps) /
                        static_cast<double>(rig.sched.accounting().kernels(y)));
    }
    std::printf("looks %llu: %d of 60 configurations beyond 1%% (mean error %.2f%%; %.2f engine reads, %.2f traps per kernel)\n",
                static_cast<unsigned long long>(looks), beyond, 100 * sum / 60,
                static_cast<double>(reads) / static_cast<double>(kernels),
                static_cast<double>(traps) / static_cast<double>(kernels));
    beyond_all += beyond;
    }
    // The figures of this pinned target (tests/unmet-targets.txt): runs
    // beyond 1% of 720, and the worst run's error.
    if (beyond_all > 0)
        std::printf("UNMET accounting-sweep-varied measured=%d target=0 worst_pct=%.2f\n", beyond_all,
                    100 * worst_all);
    CHECK(beyond_all == 0);
}

TEST_CASE("accounting: kernels that start unseen after a silent channel", "[accounting]") {
    // Found by a read-only review of 257238c.  Channel a0 learns 5 ms
    // kernels, then runs 50 us ones asking for no interrupt; a1 learns
    // 20 us, then runs 4 ms ones (after `think`).  Each a1 interrupt reads a0
    // on the engine, whose completion timestamp says it ran out long before:
    // a1 started unseen in between, and without a spell open while a0 was
    // believed on the engine its kernel was charged the learned 20 us,
    // uncorrected: -98.3% when both are y's, under every policy, and y
    // -99.5% when a0 is x's.  a0 is marked as ending unheard (its interrupt
    // overdue), and a spell stays open while it is believed on the engine.
    // Over 16 seeds of the looks, on each tenant that ran 100 ms or more (as
    // the audit's figures count): the mean within 1% (measured -0.45..
    // +0.08%), each run within 3% (4 times the largest standard deviation
    // measured, 0.68%: hfq and `timeslice` with a0 x's).  Under `none` (no
    // policy reads of its own) at most 1.5 reads per ms (measured 0.92..1.13,
    // 0.19..0.23 before: a look per quarter of a1's pace).
    for (const char* policy : {"none", "hfq", "dfq", "timeslice"}) {
        for (const bool two : {false, true}) {
          for (const double len : {4.0, 0.9, 0.5}) {
            for (const double think : {0.0, 1.0}) {
                INFO(policy << (two ? ", a0 x's" : ", both y's") << ", a1 " << len << " ms, think " << think << " ms");
                std::map<EntityId, std::vector<double>> errs;
                double reads_per_ms = 0;
                for (std::uint64_t seed = 1; seed <= 16; ++seed) {
                    Rig rig(policy);
                    rig.sched.seed_accounting(seed);
                    const EntityId y = rig.task("y");
                    const EntityId x = two ? rig.task("x") : y;
                    const ChannelId a0 = rig.submit_loop(x, ms(5), 0, 0, ms(1));
                    const ChannelId a1 = rig.submit_loop(y, ms(0.02), 0, 0, ms(1));
                    rig.loop.arm(ms(300), [&] {
                        rig.subs.at(a0).kernel = ms(0.05);
                        rig.subs.at(a0).irq_every = 0;
                        rig.subs.at(a1).kernel = ms(len);
                        rig.subs.at(a1).gap = ms(think);
                    });
                    rig.run_until(ms(400));
                    const Accounting& acc = rig.sched.accounting();
                    std::map<EntityId, Duration> before{{y, acc.gpu_time(y)}, {x, acc.gpu_time(x)}};
                    const std::uint64_t reads0 = acc.reads();
                    rig.measure_from(ms(400));
                    rig.run_until(ms(2400));
                    rig.stop_submitters();
                    rig.run_until(ms(2600));
                    reads_per_ms = std::max(reads_per_ms, static_cast<double>(acc.reads() - reads0) / 2200);
                    for (const auto& [e, charged0] : before) {
                        const double ran = static_cast<double>(rig.gpu_time(e));
                        if (ran >= 100e6) errs[e].push_back((static_cast<double>(acc.gpu_time(e) - charged0) - ran) / ran);
                    }
                }
                for (const auto& [e, v] : errs) {
                    const auto [lo, hi] = std::minmax_element(v.begin(), v.end());
                    const double mean = std::accumulate(v.begin(), v.end(), 0.0) / static_cast<double>(v.size());
                    INFO("entity " << e << ": mean " << 100 * mean << "%, runs " << 100 * *lo
                                             << ".." << 100 * *hi << "%");
                    CHECK(std::abs(mean) < 0.01);
                    CHECK(std::max(-*lo, *hi) < 0.03);
                }
                INFO(reads_per_ms << " reads per ms at most");
                // Short kernels: the looks' budget (about 5 reads per ms) plus a
                // read at each interrupt of a 0.5 ms kernel (2 per ms).
                if (std::string(policy) == "none") CHECK(reads_per_ms < (len > 1 ? 1.5 : 7.0));
            }
          }
        }
    }
}

TEST_CASE("accounting: an open channel never used or one host stall costs honest tenants no looks",
          "[accounting]") {
    // Found by a review of 42ee89b.  Three tenants that interrupt on every
    // kernel (0.3, 1 and 1.7 ms) read the engine once per fence.  Spells while some channel
    // batches (or is new) counted a channel opened and never used as new
    // for good: 3.00 reads per fence under `none`.  And a replay after one
    // 5 ms host stall let every replayed channel set the strata's pace for
    // good: 1.96 reads per fence under hfq against 1.40.  Over 2..6 s, both
    // within 1.05 times the same run without them (the idle task is in
    // every run: hfq's own reads depend on its tree).
    for (const char* policy : {"none", "hfq"}) {
        double per_fence[3] = {};
        for (int what = 0; what < 3; ++what) {  // 0: plain, 1: an idle channel, 2: a stall at 1 s
            INFO(policy << ", case " << what);
            Rig rig(policy, {}, no_trace());
            if (what == 2) rig.host_timers.stall(ms(1000), ms(1005));
            for (int i = 0; i < 3; ++i) rig.submit_loop(rig.task("t" + std::to_string(i)), ms(0.3 + 0.7 * i));
            const EntityId idle = rig.task("idle");  // in every case: hfq's tree is the same
            if (what == 1) rig.sched.open_channel(idle);
            rig.run_until(ms(2000));
            const std::uint64_t r0 = rig.sched.stats().accounting_reads, f0 = rig.sched.stats().fences;
            rig.run_until(ms(6000));
            per_fence[what] = static_cast<double>(rig.sched.stats().accounting_reads - r0) /
                              static_cast<double>(rig.sched.stats().fences - f0);
            INFO(per_fence[what] << " reads per fence");
        }
        INFO(policy << ": " << per_fence[0] << " reads per fence, " << per_fence[1] << " beside an idle channel, "
                    << per_fence[2] << " after a stall");
        // Under hfq the idle channel costs 1.64 reads per fence against
        // 1.40 with or without these spells: not the looks (left open).
        if (std::string(policy) == "none") CHECK(per_fence[1] < 1.05 * per_fence[0]);
        // Without completion timestamps (a GPU without a trace) hfq reads
        // 1.71 per fence after the stall against 1.40: the replay that
        // kept it flat dated the stall's kernels by them.  Not met; shown
        // in docs/results.md.  A GPU with a trace reads nothing at all.
        if (std::string(policy) == "none") CHECK(per_fence[2] < 1.05 * per_fence[0]);
        else WARN("target not met: " << policy << " reads " << per_fence[2] << " per fence after a stall, "
                                     << per_fence[0] << " without (target 1.05x)");
    }
}

namespace {

// The review's silent channel: y's a1 learns 20 us kernels (an interrupt
// per two), then from 300 ms runs 0.6 ms ones asking for none, beside b's
// 0.3 ms kernels, an interrupt per 4; with `counted`, y also has a channel
// that interrupts on each 50 us kernel.  Runs to 2.6 s; the charges and the
// truth are taken over 0.4..2.4 s (after the change settles).
struct SilentBeside {
    double y_ran, y_charged, b_ran, b_charged;
    double y_share;  // over 0.4..2.4 s
};
SilentBeside run_silent_beside_batcher(Rig& rig, bool counted) {
    const EntityId y = rig.task("y");
    const EntityId b = rig.task("b");
    if (counted) rig.submit_loop(y, ms(0.05), 0, 0, ms(1));
    const ChannelId a1 = rig.submit_loop(y, ms(0.02), 0, 0, ms(1));
    rig.subs.at(a1).irq_every = 2;
    Rig::Submitter& bs = rig.subs.at(rig.submit_loop(b, ms(0.3), 0, 0, ms(1)));
    bs.irq_every = 4;
    bs.depth = 4;
    rig.loop.arm(ms(300), [&rig, a1] {
        rig.subs.at(a1).kernel = ms(0.6);
        rig.subs.at(a1).irq_every = 0;
    });
    rig.run_until(ms(400));
    const Accounting& acc = rig.sched.accounting();
    const Duration y0 = acc.gpu_time(y), b0 = acc.gpu_time(b);
    rig.measure_from(ms(400));
    rig.run_until(ms(2400));
    const double share = rig.share(y);
    rig.stop_submitters();
    rig.run_until(ms(2600));
    return {static_cast<double>(rig.gpu_time(y)), static_cast<double>(acc.gpu_time(y) - y0),
            static_cast<double>(rig.gpu_time(b)), static_cast<double>(acc.gpu_time(b) - b0), share};
}

}  // namespace

TEST_CASE("accounting: a silent channel whose kernels grew beside a batching neighbour", "[accounting]") {
    // Found by a read-only review of 257238c.  y's channel a1 learns 20 us
    // kernels (an interrupt per two), then runs 0.6 ms ones asking for
    // none; its a0 interrupts on each 50 us kernel; b batches 0.3 ms
    // kernels, an interrupt per 4.  At a0's interrupts the replay splits the
    // time of the channels that do not interrupt on each kernel by learned
    // lengths: unaudited, and with no spell open while the engine was busy,
    // y was charged -62.8% and b +128% under `none`, and hfq gave y 0.784
    // (target 0.5).  Spells now stay open while some channel batches (or
    // may), and each part of such a replay is audited.  Over 16 seeds of the
    // looks: each mean within 1% (measured -0.10..+0.04%), each run within
    // 3% (4 times the largest standard deviation measured, 0.65%: b under
    // `none`); hfq's share for y within 0.01 of 0.5.
    for (const char* policy : {"none", "hfq", "dfq", "timeslice"}) {
        std::map<char, std::vector<double>> errs;
        for (std::uint64_t seed = 1; seed <= 16; ++seed) {
            INFO(policy << ", seed " << seed);
            Rig rig(policy);
            rig.sched.seed_accounting(seed);
            const SilentBeside r = run_silent_beside_batcher(rig, true);
            errs['y'].push_back((r.y_charged - r.y_ran) / r.y_ran);
            errs['b'].push_back((r.b_charged - r.b_ran) / r.b_ran);
            if (std::string(policy) == "hfq") CHECK(r.y_share == Approx(0.5).margin(0.01));
        }
        for (const auto& [name, v] : errs) {
            const auto [lo, hi] = std::minmax_element(v.begin(), v.end());
            const double mean = std::accumulate(v.begin(), v.end(), 0.0) / static_cast<double>(v.size());
            INFO(policy << ", " << name << ": mean " << 100 * mean << "%, runs " << 100 * *lo << ".." << 100 * *hi
                        << "%");
            CHECK(std::abs(mean) < 0.01);
            CHECK(std::max(-*lo, *hi) < 0.03);
        }
    }
}

TEST_CASE("accounting: a silent channel whose kernels grew beside a batching neighbour, no channel counted",
          "[accounting][accounting-review]") {
    // From a review of 42ee89b: the case above without y's per-kernel
    // channel, so no channel interrupts on every kernel and the replay
    // splits the whole window by learned lengths (replay_shares),
    // unaudited: under hfq y -46..-55%, b +18.7%, y's share 0.69..0.72
    // (target 0.5), a target until the per-channel doorbell traps.  Each of
    // y's kernels starts where its previous one ended unheard: its doorbell
    // is trapped now, and the read after it dates the start (results.md
    // section 6, "Doorbell traps"): y +0.04%, b -0.07% under `none`; under
    // hfq -0.01%, +0.01% and a share of 0.50035.  Bounds: 5% on each
    // tenant (a review's regression guard against the -46..-55% above, far
    // wider than the goal's 1% that the measured 0.07% meets; with the
    // default GPU's trace now exact, share 0.5001), hfq's share
    // for y within 0.01 of 0.5 (the goal for shares on scenarios without a
    // bursty target).
    for (const char* policy : {"none", "hfq"}) {
        INFO(policy);
        Rig rig(policy);
        const SilentBeside r = run_silent_beside_batcher(rig, false);
        for (const auto& [name, ran, charged] : {std::tuple{"y", r.y_ran, r.y_charged}, std::tuple{"b", r.b_ran, r.b_charged}}) {
            INFO(name << " charged " << charged / 1e6 << " ms of " << ran / 1e6 << "; y's share " << r.y_share);
            CHECK(std::abs(charged - ran) < 0.05 * ran);
        }
        if (std::string(policy) == "hfq") CHECK(r.y_share == Approx(0.5).margin(0.01));
    }
}

TEST_CASE("accounting: kernels that start after a long idle are dated by a trapped doorbell",
          "[accounting][accounting-review]") {
    // Found by a read-only review of 257238c: kernels no audit look can
    // correct.  (horizon) A spell ends after 24 strata, 26 s at the 200 us
    // floor a tenant sets with two quick completions: twenty 0.1 ms
    // kernels, a 27 s think, then one 1.5 s kernel started unseen was
    // charged its learned 0.1 ms, uncorrected: -99.8% over 120 s.  (first) A
    // channel opened 10 s before its first kernel (1 ms): half the gap
    // guessed, corrected by strata seconds wide, a correction below zero
    // clamped: 5000, 904 or 0 ms, 2327 on average over 16 seeds of the
    // looks.  Now an engine idle for 50 ms has its doorbells trapped, and
    // either start is read right after its forwarded doorbell: exact (the
    // simulation has no noise), under every policy and on both engines.
    // The cost: two remaps per channel and idle spell over 50 ms, and one
    // trap; a tenant whose thinks are shorter pays none.
    for (const char* policy : {"none", "hfq", "dfq", "timeslice"})
        for (const auto arbitration : {sim::Arbitration::RoundRobin, sim::Arbitration::Timeslice}) {
          for (const bool trace : {true, false}) {
            sim::SimGpuConfig cfg;
            cfg.ctxsw_trace = trace;
            cfg.arbitration = arbitration;
            // With the trace every stint is dated by the GPU: exact (the
            // simulation has no noise).  Without it, the goal: 1% of the
            // tenant's time (measured 0.17% on the timeslice GPU).
            const double tol = trace ? 0.001 : 0.01;
            INFO((trace ? "with" : "without") << " a context-switch trace");
            INFO(policy << (arbitration == sim::Arbitration::Timeslice ? ", timeslice GPU" : ", round-robin GPU"));
            {
                Rig rig(policy, {}, cfg);
                const EntityId y = rig.task("y");
                Rig::Submitter& s = rig.subs.at(rig.submit_loop(y, 0, 0, 0, ms(1)));
                s.pattern.assign(20, ms(0.1));
                s.pattern.push_back(ms(1500));
                s.gap_after = [](std::uint64_t n) { return n % 21 == 20 ? ms(27000) : ms(0.5); };
                rig.run_until(ms(120000));
                rig.stop_submitters();
                rig.run_until(ms(125000));
                const double ran = static_cast<double>(rig.gpu_time(y));
                const double charged = static_cast<double>(rig.sched.accounting().gpu_time(y));
                INFO("horizon: charged " << charged / 1e6 << " ms of " << ran / 1e6 << "; " << rig.sched.stats().traps
                                         << " traps, " << rig.sched.stats().remaps << " remaps");
                CHECK(std::abs(charged - ran) < tol * ran);
                // Four 27 s thinks end with a trapped doorbell; the fifth
                // has not yet.  (Policies trap and remap more of their own.)
                if (std::string(policy) == "none" && !trace) {
                    CHECK(rig.sched.stats().traps == 4);
                    CHECK(rig.sched.stats().remaps == 9);
                }
            }
            for (std::uint64_t seed = 1; seed <= 16; ++seed) {
                INFO("first, seed " << seed);
                Rig rig(policy, {}, cfg);
                rig.sched.seed_accounting(seed);
                const EntityId z = rig.task("z");
                rig.submit_loop(z, ms(1), 0, 1, ms(10000));
                rig.run_until(ms(12000));
                const double ran = static_cast<double>(rig.gpu_time(z));
                const double charged = static_cast<double>(rig.sched.accounting().gpu_time(z));
                INFO("charged " << charged / 1e6 << " ms of " << ran / 1e6);
                CHECK(std::abs(charged - ran) < tol * ran);
            }
            {
                // Thinks within the settle reads (0.5 ms): no trap; one
                // remap, the idle trap's once the work ended.
                Rig rig(policy, {}, cfg);
                const EntityId w = rig.task("w");
                rig.submit_loop(w, ms(1), ms(0.5), 2000, ms(1));
                rig.run_until(ms(9000));
                INFO("0.5 ms thinks: " << rig.sched.stats().traps << " traps, " << rig.sched.stats().remaps
                                       << " remaps");
                if (std::string(policy) == "none" && !trace) {
                    CHECK(rig.sched.stats().traps == 0);
                    CHECK(rig.sched.stats().remaps == 1);
                }
            }
            {
                // Found by a review of dd54309: the idle trap switched every
                // channel back at the first doorbell, so a tenant pulsing
                // every 55 ms beside 100 channels that never submit cost
                // 36663 remaps in 10 s.  Each channel now leaves it at its
                // own doorbell: the pulser's two per pulse, and the idle
                // channels' one, once.
                Rig rig(policy, {}, cfg);
                const EntityId p = rig.task("pulse");
                const EntityId idle = rig.task("idle");
                for (int i = 0; i < 100; ++i) rig.sched.open_channel(idle);
                rig.submit_loop(p, ms(0.01), ms(55), 0, ms(1));
                rig.run_until(ms(10000));
                const auto pulses = static_cast<std::uint64_t>(rig.subs.begin()->second.completed);
                INFO("pulse beside 100 idle channels: " << pulses << " pulses, " << rig.sched.stats().remaps
                                                        << " remaps, " << rig.sched.stats().traps << " traps");
                if (std::string(policy) == "none" && !trace) CHECK(rig.sched.stats().remaps <= 2 * pulses + 100);
                // Charged within one 10 us kernel on the round-robin GPU (the
                // first, started before any trap; 11 us: the kernel plus
                // 1 us, the closest two settle reads); on the timeslice GPU
                // each start also pays about 2.2 us of the context switch,
                // 22% of a 10 us kernel: bound 25%.
                const double off = std::abs(static_cast<double>(rig.sched.accounting().gpu_time(p)) -
                                            static_cast<double>(rig.gpu_time(p)));
                CHECK(off < (arbitration == sim::Arbitration::Timeslice ? 0.25 * static_cast<double>(rig.gpu_time(p))
                                                                         : static_cast<double>(ms(0.011))));
            }
          }
        }
}

namespace {

// A review of dd54309's burst: one 20 ms kernel and nineteen 0.1 ms ones,
// each submitted 50 us before the one before it ends, then `think`; to 2 s.
struct BurstRun {
    double ran, charged;
    std::uint64_t traps, remaps;
};
BurstRun run_bursts(const char* policy, double think, std::uint64_t seed) {
    Rig rig(policy);
    rig.sched.seed_accounting(seed);
    const EntityId y = rig.task("y");
    const ChannelId ch = rig.submit_loop(y, 0, ms(1e9), 0, ms(1e9));  // driven below
    std::vector<Duration> lengths(20, ms(0.1));
    lengths[0] = ms(20);
    rig.subs.at(ch).pattern = lengths;
    Duration burst = 0;
    for (Duration l : lengths) burst += l;
    for (Time t = ms(1); t + burst < ms(2000); t += burst + ms(think)) {
        Time end = t;
        for (std::size_t i = 0; i < lengths.size(); ++i) {
            rig.loop.arm(i == 0 ? t : end - ms(0.05), [&rig, ch] { rig.submit(ch); });
            end += lengths[i];
        }
    }
    rig.run_until(ms(2100));
    return {static_cast<double>(rig.gpu_time(y)), static_cast<double>(rig.sched.accounting().gpu_time(y)),
            rig.sched.stats().traps, rig.sched.stats().remaps};
}

}  // namespace

TEST_CASE("accounting: bursts whose doorbells stream behind their own work keep their trap", "[accounting]") {
    // Found by a review of dd54309: the burst's first start comes after the
    // settle reads and traps the channel; its 17th doorbell, behind its own
    // work, lifted the trap again, so the next burst's first start (the one
    // the trap is for) was guessed again, at two remaps a burst (147 over
    // 2 s with 30 ms thinks).  Doorbells behind the channel's own pending
    // work no longer count towards lifting it: one remap, and a trap per
    // doorbell.
    for (const double think : {5.0, 30.0}) {
        const BurstRun r = run_bursts("none", think, 1);
        INFO("think " << think << " ms: " << r.traps << " traps, " << r.remaps << " remaps");
        CHECK(r.remaps <= 2);
    }
}

TEST_CASE("accounting: bursts whose doorbells stream behind their own work, charged", "[accounting][accounting-bursts]") {
    // The bursts above, 4 policies, thinks of 5 and 30 ms, 32 seeds of the
    // looks.  They were charged one 20 ms kernel short in every run under
    // `none`: the second burst's first, which started unseen with no audit
    // spell open (its channel had shown every start to the settle reads).
    // Audited, one look in the 25.6 ms stratum across the 30 ms think
    // moved its charge by 25.6 ms or nothing (+0.76%, or -2.18% at seed 2);
    // an idle engine's strata are at most 6.25 ms wide until its doorbells
    // are trapped: over 64 seeds the worst run is 0.77% off, the mean
    // -0.05..+0.02%.  Bound: 1%.
    for (const char* policy : {"none", "hfq", "dfq", "timeslice"})
        for (const double think : {5.0, 30.0})
            for (std::uint64_t seed = 1; seed <= 32; ++seed) {
                const BurstRun r = run_bursts(policy, think, seed);
                INFO(policy << ", think " << think << " ms, seed " << seed << ": charged " << r.charged / 1e6
                            << " ms of " << r.ran / 1e6);
                CHECK(std::abs(r.charged - r.ran) < 0.01 * r.ran);
            }
}

namespace {

// The fresh-channel tenant: every 100 ms a new channel of y runs 0.1 ms,
// 0.1 ms, thinks 2 ms, then runs a 40 ms kernel (asking for no interrupt
// if `quiet_long`); the channel is closed `close_after` after it opened.
// Returns what y was charged and what it ran, over 900 ms.
struct FreshRun {
    double charged, truth;                      // y's
    double neighbour_charged, neighbour_truth;  // z's (0 without one)
    double helper_charged, helper_truth;        // w's (with a helper of its own)
};
FreshRun run_fresh_channels(const char* policy, sim::Arbitration arbitration, std::uint64_t seed, Duration close_after,
                            bool quiet_long, Duration helper_at = 0, Duration neighbour_gap = 0,
                            bool helper_own_tenant = false) {
    sim::SimGpuConfig cfg;
    cfg.arbitration = arbitration;
    Rig rig(policy, {}, cfg);
    rig.sched.seed_accounting(seed);
    const EntityId y = rig.task("y");
    const EntityId z = rig.task("z");
    const EntityId w = helper_own_tenant ? rig.task("w") : y;
    if (neighbour_gap > 0) rig.submit_loop(z, ms(0.5), neighbour_gap);
    for (int r = 0; r < 8; ++r)
        rig.loop.arm(ms(1) + r * ms(100), [&rig, y, w, close_after, quiet_long, helper_at] {
            const ChannelId ch = rig.submit_loop(y, 0, 0, 3, rig.loop.now());
            Rig::Submitter& s = rig.subs.at(ch);
            s.pattern = {ms(0.1), ms(0.1), ms(40)};
            s.gap_after = [&rig, ch, quiet_long](std::uint64_t n) {
                if (n == 2 && quiet_long) rig.subs.at(ch).irq = false;
                return n == 2 ? ms(2) : 0;
            };
            rig.loop.arm(rig.loop.now() + close_after, [&rig, ch] { rig.sched.close_channel(ch); });
            if (helper_at > 0)
                rig.loop.arm(rig.loop.now() + helper_at, [&rig, w] {
                    const ChannelId h = rig.submit_loop(w, ms(0.1), 0, 1, rig.loop.now());
                    rig.loop.arm(rig.loop.now() + ms(40), [&rig, h] { rig.sched.close_channel(h); });
                });
        });
    rig.run_until(ms(900));
    return {static_cast<double>(rig.sched.accounting().gpu_time(y)), static_cast<double>(rig.gpu_time(y)),
            static_cast<double>(rig.sched.accounting().gpu_time(z)), static_cast<double>(rig.gpu_time(z)),
            static_cast<double>(rig.sched.accounting().gpu_time(w)), static_cast<double>(rig.gpu_time(w))};
}

}  // namespace

TEST_CASE("accounting: a fresh channel's long kernel after its short ones is audited", "[accounting]") {
    // Found while tracing `accounting-bursts`: a channel whose starts the
    // settle reads all saw set no pace for the audit, so its first start
    // after them was guessed at its learned length and nothing corrected
    // it.  A tenant that shows two 0.1 ms kernels to the settle reads,
    // thinks 2 ms and starts a 40 ms one, on a fresh channel each time
    // (it is trapped after), was charged 2.4 ms of 321.6 (0.7%), under
    // every policy and on either GPU; with 500 ms kernels 0.06%.  Once the
    // settle reads are spent on an idle engine, every untrapped channel
    // sets the pace, on the timeslice GPU too.  The audit is right on
    // average: over 64 seeds of the looks the mean is within 5% (measured:
    // -0.6..+0.2%; runs 305..349 ms of 321.6, a spread of 10.5% a run
    // before an idle engine's strata were capped at 6.25 ms), and no run
    // is charged under half.  Both bounds are regression guards against the
    // failure (a 40 ms kernel of each 100 ms round missed, 2.4 ms charged
    // of 321.6 ms): half catches it in any single run; the mean's 5% is
    // about eight times the worst mean measured (0.6%).  On the default GPU,
    // with its trace, every run is now charged exactly 321.6 ms.
    for (const char* policy : {"none", "hfq", "dfq", "timeslice"})
        for (const auto arbitration : {sim::Arbitration::RoundRobin, sim::Arbitration::Timeslice}) {
            double sum = 0, truth = 0;
            constexpr int kSeeds = 64;
            for (std::uint64_t seed = 1; seed <= kSeeds; ++seed) {
                const FreshRun run = run_fresh_channels(policy, arbitration, seed, ms(90), false);
                const double charged = run.charged;
                truth = run.truth;
                INFO(policy << (arbitration == sim::Arbitration::Timeslice ? ", timeslice GPU" : ", round-robin GPU")
                            << ", seed " << seed << ": charged " << charged / 1e6 << " ms of " << truth / 1e6);
                CHECK(charged > 0.5 * truth);
                sum += charged;
            }
            INFO(policy << (arbitration == sim::Arbitration::Timeslice ? ", timeslice GPU" : ", round-robin GPU")
                        << ": mean " << sum / kSeeds / 1e6 << " ms of " << truth / 1e6);
            CHECK(std::abs(sum / kSeeds - truth) < 0.05 * truth);
        }
}

TEST_CASE("accounting: a kernel begun unseen and cut by a second channel is audited whole", "[accounting]") {
    // Found by a review of c8e78f6.  The fresh-channel tenant above rings
    // one 0.1 ms kernel on a second fresh channel of its own some 30 ms
    // into its 40 ms one (variant 0, at several phases against the GPU's
    // 2 ms slices), or that plus an honest neighbour whose 0.5 ms kernels
    // come every 7 ms (variant 1).  On the timeslice GPU the long kernel's
    // start, dated in a 31 ms window, was charged unaudited at the slice
    // end that let the second channel in, and its end was pulled towards
    // the 0.1 ms length learned: 142.4 of 322.4 ms (44%).  With the
    // neighbour, whose kernels cut in unseen, 93.5..96.2%, and under dfq
    // the neighbour was charged 93.5% of what it ran.  A review of the
    // first fix (5de260e) found the cut credited only to the channel that
    // cut in: 82.5..89.8% at phases off the slice grid.  Now a stint begun
    // at a guessed start is audited where a slice end, a host preemption or
    // another channel's completion cuts it, with the looks up to where the
    // next one's guess ends; what the looks saw of a channel found on the
    // engine at another's completion is charged; a slice end is known as
    // well as the start its slice began at.  The looks' noise: over 64
    // seeds runs of y lie in 302..350 ms of 322.4 (measured), their means
    // in 321.8..325.6 (bound 3%); the neighbour is charged exactly in every
    // run (bound 0.1%).
    for (const int variant : {0, 1})
        for (const double at : {20.5, 31.1, 32.2, 32.9, 35.5}) {
            if (variant == 1 && at != 32.2) continue;
            for (const char* policy : {"none", "hfq", "dfq", "timeslice"})
                for (const auto arbitration : {sim::Arbitration::RoundRobin, sim::Arbitration::Timeslice}) {
                    double sum = 0, truth = 0, lo = 1e18, hi = 0, worst_neighbour = 0;
                    constexpr int kSeeds = 64;
                    for (std::uint64_t seed = 1; seed <= kSeeds; ++seed) {
                        const FreshRun run = run_fresh_channels(policy, arbitration, seed, ms(90), false, ms(at),
                                                                variant == 1 ? ms(7) : 0);
                        truth = run.truth;
                        sum += run.charged;
                        lo = std::min(lo, run.charged);
                        hi = std::max(hi, run.charged);
                        if (variant == 1)
                            worst_neighbour =
                                std::max(worst_neighbour, std::abs(run.neighbour_charged / run.neighbour_truth - 1));
                    }
                    INFO("variant " << variant << ", second channel at " << at << " ms, " << policy
                                    << (arbitration == sim::Arbitration::Timeslice ? ", timeslice GPU" : ", round-robin GPU")
                                    << ": mean " << sum / kSeeds / 1e6 << " ms of " << truth / 1e6 << ", runs " << lo / 1e6
                                    << ".." << hi / 1e6 << "; neighbour off by " << 100 * worst_neighbour << "% at most");
                    CHECK(std::abs(sum / kSeeds - truth) < 0.03 * truth);
                    CHECK(worst_neighbour < 0.001);
                }
        }
}

TEST_CASE("accounting: an honest tenant's kernel cut into another's unseen one is charged what it ran",
          "[accounting]") {
    // A review of 5de260e: the second channel of the case above belongs to
    // an honest tenant w (one 0.1 ms kernel a round).  On the timeslice GPU
    // its kernel was guessed at half the time since the long one's guessed
    // start, or (seen starting at a slice end) from the middle of the
    // read's window, and the looks (strata up to 6.25 ms) corrected that
    // guess; each correction that took back more than w was charged became
    // a debt its few 0.1 ms kernels never paid: charged 6.4 to 10.0 times
    // what it ran.  Now a kernel of unknown length whose guess the looks
    // correct on both sides is guessed at nothing, or from its window's
    // end.  Measured over 256 seeds, policy `none` (the others measured the
    // same): 0.73 to 1.16 times on the timeslice GPU, exact on the
    // round-robin GPU; the long tenant y 99.8..100.2%.  The looks' noise:
    // one sighting in some 60 of w's kernels, each standing for up to
    // 6.25 ms, a standard error of some 17%: bound 50%, and y's mean 3%.
    for (const double at : {20.5, 31.1, 32.2, 32.9, 35.5})
        for (const auto arbitration : {sim::Arbitration::RoundRobin, sim::Arbitration::Timeslice}) {
            double sum = 0, truth = 0, y_sum = 0, y_truth = 0;
            constexpr int kSeeds = 256;
            for (std::uint64_t seed = 1; seed <= kSeeds; ++seed) {
                const FreshRun run = run_fresh_channels("none", arbitration, seed, ms(90), false, ms(at), 0, true);
                sum += run.helper_charged;
                truth += run.helper_truth;
                y_sum += run.charged;
                y_truth += run.truth;
            }
            INFO("second channel at " << at << " ms, "
                                      << (arbitration == sim::Arbitration::Timeslice ? "timeslice GPU" : "round-robin GPU")
                                      << ": w charged " << sum / truth << " times what it ran, y " << y_sum / y_truth);
            CHECK(std::abs(sum - truth) < 0.5 * truth);
            CHECK(std::abs(y_sum - y_truth) < 0.03 * y_truth);
        }
}

TEST_CASE("accounting: a channel closed before its unseen kernel's interrupt is charged that kernel", "[accounting]") {
    // Found by a review of c8e78f6.  The fresh-channel tenant above, its
    // channel closed 30 ms into the 40 ms kernel (variant 0), or its long
    // kernel asking for no interrupt and the channel closed after it ran
    // (variant 1).  Closing forgot a channel not believed on the engine:
    // charged 1.6 of 241.6 ms and of 321.6 ms (0.7%, 0.5%), under every
    // policy but timeslice (which reads the engine itself).  A completion
    // no interrupt reported is now charged as its interrupt would be, and a
    // kernel still running is seen by one read.  Mean over 16 seeds of the
    // looks within 5%: a guard against the failure (each long kernel
    // charged 1.6 ms of 40), not a measured spread; on the default GPU,
    // with its trace, every run is now charged exactly.
    for (const int variant : {0, 1})
        for (const char* policy : {"none", "hfq", "dfq", "timeslice"})
            for (const auto arbitration : {sim::Arbitration::RoundRobin, sim::Arbitration::Timeslice}) {
                double sum = 0, truth = 0;
                constexpr int kSeeds = 16;
                for (std::uint64_t seed = 1; seed <= kSeeds; ++seed) {
                    // Variant 0: closed 30 ms into the long kernel; 1: the
                    // long kernel asks for no interrupt, closed after it.
                    const FreshRun run =
                        run_fresh_channels(policy, arbitration, seed, variant == 0 ? ms(32.2) : ms(90), variant == 1);
                    truth = run.truth;
                    sum += run.charged;
                }
                INFO("variant " << variant << ", " << policy
                                << (arbitration == sim::Arbitration::Timeslice ? ", timeslice GPU" : ", round-robin GPU")
                                << ": mean " << sum / kSeeds / 1e6 << " ms of " << truth / 1e6);
                CHECK(std::abs(sum / kSeeds - truth) < 0.05 * truth);
            }
}

TEST_CASE("accounting: a batching tenant that runs out within its slice is charged no switch", "[accounting]") {
    // A tenant that asks for an interrupt on every 4th kernel and resubmits
    // on each completion (depth 1) beside a 2 ms one on the timeslice GPU,
    // 10 us switches: the engine moves on after each of its kernels (its
    // next one comes just after).  The long tenant's interrupt charged it
    // up to that kernel's start, the switch's dead time included: +15.0%
    // with 0.05 ms kernels under `none` (4 ms slices), +1.5% with 0.5 ms
    // ones.  And a slice end that found it gone with several kernels
    // fetched since its last charge took it as preempted there, though the
    // GPU's pending register said it had no work left (sweep seeds 116 and
    // 372).  Measured now: exact, except +0.26% for the batching tenant
    // under the timeslice policy with 4 ms slices (+0.26% before as well,
    // not traced); bound 0.3%.
    for (const char* policy : {"none", "hfq", "dfq", "timeslice"})
        for (const Duration slice : {ms(2), ms(4)})
            for (const double kernel : {0.05, 0.5}) {
                INFO(policy << ", " << to_ms(slice) << " ms slices, " << kernel << " ms kernels");
                check_charged(policy, timeslice_gpu(slice, 10 * kMicrosecond), {{2, 0}, {kernel, 0, 1, 4}}, 0.003);
            }
}


// An interrupt handled after the engine moved on twice (a 0.2 ms kernel of
// another channel, then this channel's next one): the engine read names this
// channel, believed to start at its own completion; the short kernel's
// interrupt right after showed that belief wrong.  That once marked the
// honest channel as one whose kernels end unheard, and audited the engine
// for good while it ran: in pvgpud on the demo load, in 6 of 8 runs, about
// 1.5 engine reads and timer wakeups per interrupt instead of 1.02.
TEST_CASE("accounting: a late handler's belief does not mark an honest channel as ending unheard", "[accounting]") {
    for (const char* policy : {"none", "hfq"}) {
        INFO(policy);
        Rig rig(policy);
        const EntityId a = rig.task("a"), b = rig.task("b");
        rig.subs.at(rig.submit_loop(a, ms(1))).depth = 2;
        rig.subs.at(rig.submit_loop(b, ms(0.2))).depth = 2;
        // A host late by 0.7 ms now and then (above the 0.2 ms kernel, below
        // kLateInterrupt), at phases that drift against the kernels.
        rig.host_timers.stall_every(ms(100), ms(23.3), ms(0.7));
        rig.run_until(ms(300));
        rig.host_timers.stall(0, 0);
        rig.run_until(ms(400));
        const Accounting& acc = rig.sched.accounting();
        const std::uint64_t reads0 = acc.reads(), fences0 = rig.sched.stats().fences;
        const Duration a0 = acc.gpu_time(a), b0 = acc.gpu_time(b);
        rig.measure_from(ms(400));
        rig.run_until(ms(1400));
        const double per_fence = static_cast<double>(acc.reads() - reads0) /
                                 static_cast<double>(rig.sched.stats().fences - fences0);
        rig.stop_submitters();
        rig.run_until(ms(1500));
        INFO("engine reads per interrupt " << per_fence << "; charged a " << to_ms(acc.gpu_time(a) - a0) << " of "
                                           << to_ms(rig.gpu_time(a)) << " ms, b " << to_ms(acc.gpu_time(b) - b0)
                                           << " of " << to_ms(rig.gpu_time(b)) << " ms");
        // Reads per interrupt: 1.02 in pvgpud without the bug, 1.5 with it;
        // the bound is the 5% over one per fence of the completion
        // notification goal.  The charges: the goal, 1%.
        CHECK(per_fence < 1.05);
        CHECK(std::abs(acc.gpu_time(a) - a0 - rig.gpu_time(a)) <= rig.gpu_time(a) / 100);
        CHECK(std::abs(acc.gpu_time(b) - b0 - rig.gpu_time(b)) <= rig.gpu_time(b) / 100);
    }
}

TEST_CASE("accounting: tenants that ask for no interrupt are charged from the context-switch trace",
          "[accounting][trace]") {
    // A tenant in direct mode writes its own entries: it may ask for no
    // interrupt (and so for no completion the host would hear of).  The
    // context-switch trace is written for the host whatever the work asks:
    // every stint is charged from it, exactly (the simulation has no noise;
    // 0.001 leaves room for the 2 s run's last stint, cut at the drain).
    // Mixes of silent (irq_every 0), batching (4) and per-kernel tenants,
    // long and short kernels, with and without thinks, on both engines,
    // with switch dead time on the timeslice one.
    const std::vector<std::vector<Load>> mixes = {
        {{1, 0, 2, 0}, {0.2, 0, 2, 0}},
        {{2, 0.5, 1, 0}, {0.05, 0.1, 1, 1}, {0.5, 0, 4, 4}},
        {{0.1, 2, 1, 0}, {4, 0, 2, 0}, {1, 0.3, 1, 0}},
        {{0.02, 0, 8, 0}, {3, 1, 1, 1}},
    };
    for (const char* policy : {"none", "hfq", "dfq", "timeslice"})
        for (const sim::SimGpuConfig& cfg : {sim::SimGpuConfig{}, timeslice_gpu(ms(2), 30 * kMicrosecond)})
            for (std::size_t m = 0; m < mixes.size(); ++m) {
                INFO(policy << (cfg.arbitration == sim::Arbitration::Timeslice ? ", timeslice GPU" : ", round-robin GPU")
                            << ", mix " << m);
                Rig rig(policy, {}, cfg);
                const std::vector<EntityId> leaves = run_loads(rig, mixes[m]);
                const Accounting& acc = rig.sched.accounting();
                CHECK(acc.traced());
                CHECK(acc.trace_records_lost() == 0);
                for (const EntityId leaf : leaves) {
                    INFO("leaf " << leaf << ": charged " << to_ms(acc.gpu_time(leaf)) << " ms, ran "
                                 << to_ms(rig.gpu_time(leaf)) << " ms");
                    REQUIRE(rig.gpu_time(leaf) > 0);
                    CHECK(rel_error(acc.gpu_time(leaf), rig.gpu_time(leaf)) < 0.001);
                }
                // Nothing was read or trapped for the accounting's sake.
                CHECK(rig.sched.stats().accounting_reads == 0);
            }
}
