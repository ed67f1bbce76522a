// The simulated GPU (scheduler/sim/sim_gpu.hpp) as a black box: only ring
// entries, doorbells, the host-visible registers, interrupts and, as ground
// truth, the ExecutionObserver.  All times are virtual and exact.
#include <catch2/catch.hpp>

#include <algorithm>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <ostream>
#include <stdexcept>
#include <tuple>
#include <utility>
#include <vector>

#include "sim/event_loop.hpp"
#include "sim/sim_gpu.hpp"

using namespace pvgpu;
using pvgpu::sim::Arbitration;
using pvgpu::sim::SimGpuConfig;

namespace {

constexpr Duration ms(double v) { return static_cast<Duration>(v * kMillisecond); }

struct Segment {
    ChannelId ch;
    Time start, end;
    bool operator==(const Segment& o) const {
        return ch == o.ch && start == o.start && end == o.end;
    }
};
std::ostream& operator<<(std::ostream& os, const Segment& s) {
    return os << "ch" << s.ch << "[" << s.start << "," << s.end << ")";
}

struct Event {
    ChannelId ch;
    std::uint32_t value;  // fence or error code
    Time at;
    bool operator==(const Event& o) const { return ch == o.ch && value == o.value && at == o.at; }
};
std::ostream& operator<<(std::ostream& os, const Event& e) {
    return os << "ch" << e.ch << ":" << e.value << "@" << e.at;
}

// The host's timers, each firing `lag` late, counted: pvgpud's wakeups.
struct CountingTimers final : Timers {
    explicit CountingTimers(sim::EventLoop& l, Duration late = 0) : loop(l), lag(late) {}
    TimerId arm(Time at, std::function<void()> fn) override {
        return loop.arm(at + lag, [this, fn = std::move(fn)] {
            ++fired;
            fired_at.push_back(loop.now());
            fn();
        });
    }
    void cancel(TimerId id) override { loop.cancel(id); }
    sim::EventLoop& loop;
    Duration lag;
    int fired = 0;
    std::vector<Time> fired_at;
};

// Event loop + GPU + recorders for everything the GPU reports.  The host's
// timers are counted (its wakeups); a channel made with gpu.create_channel()
// has no fence watcher and is heard of by its interrupts only, as in pvgpud.
struct GpuRig final : sim::ExecutionObserver, GpuInterrupts {
    explicit GpuRig(SimGpuConfig cfg = {}) : gpu(loop, timers, cfg) {
        gpu.set_observer(this);
        gpu.set_interrupt_handler(this);
    }

    void executed(ChannelId ch, Time start, Time end) override { segments.push_back({ch, start, end}); }
    void on_fence(ChannelId ch, std::uint32_t fence) override {
        irqs.push_back({ch, fence, loop.now()});
        if (fence_hook) fence_hook(ch, fence);
    }
    void on_channel_error(ChannelId ch, std::uint32_t error) override {
        errors.push_back({ch, error, loop.now()});
        if (error_hook) error_hook(ch, error);
    }

    // A channel whose fence watcher records every completion.
    ChannelId channel() {
        ChannelId ch = gpu.create_channel();
        gpu.set_fence_watcher(ch, [this, ch](std::uint32_t f) { watched.push_back({ch, f, loop.now()}); });
        return ch;
    }

    // Writes kernels of the given run times after the channel's IB_PUT and
    // rings the doorbell once.  Fences count entries: the n-th entry ever
    // submitted on a channel carries fence n.
    void submit(ChannelId ch, const std::vector<Duration>& kernels, std::uint32_t flags = PVGPU_ENTRY_IRQ) {
        std::uint32_t put = gpu.read_ib_put(ch);
        for (Duration d : kernels) {
            pvgpu_ring_entry& e = gpu.ring(ch)->entries[put & PVGPU_RING_MASK];
            e.payload = static_cast<std::uint64_t>(d);
            e.fence = put + 1;
            e.flags = flags;
            ++put;
        }
        gpu.write_ib_put(ch, put);
    }

    Duration executed_by(ChannelId ch, Time until = INT64_MAX) const {
        Duration d = 0;
        for (const Segment& s : segments)
            if (s.ch == ch && s.start < until) d += std::min(s.end, until) - s.start;
        return d;
    }
    // The engine status register, 0 when idle (channel ids start at 1), so a
    // failing check prints a number.
    ChannelId running() const { return gpu.running_channel().value_or(0); }
    std::vector<Time> fence_times(ChannelId ch) const {
        std::vector<Time> out;
        for (const Event& e : watched)
            if (e.ch == ch) out.push_back(e.at);
        return out;
    }

    sim::EventLoop loop;
    CountingTimers timers{loop};
    sim::SimGpu gpu;
    std::vector<Segment> segments;
    std::vector<Event> irqs;
    std::vector<Event> errors;
    std::vector<Event> watched;
    std::function<void(ChannelId, std::uint32_t)> fence_hook;  // host reaction to an interrupt
    std::function<void(ChannelId, std::uint32_t)> error_hook;  // ... to a channel error
};

SimGpuConfig timeslice(Duration slice, Duration ctxsw = 0) {
    SimGpuConfig c;
    c.arbitration = Arbitration::Timeslice;
    c.timeslice = slice;
    c.ctxsw = ctxsw;
    return c;
}

}  // namespace

TEST_CASE("sim gpu: channels start empty and idle", "[sim_gpu]") {
    GpuRig r;
    ChannelId a = r.channel();
    ChannelId b = r.channel();
    CHECK(a != b);
    CHECK(r.gpu.read_ib_put(a) == 0);
    CHECK(r.gpu.read_ib_get(a) == 0);
    CHECK(r.gpu.read_fence(a) == 0);
    CHECK(r.gpu.read_status(a) == PVGPU_CHAN_STATUS_OK);
    CHECK_FALSE(r.gpu.pending(a));
    CHECK_FALSE(r.gpu.running_channel().has_value());
    CHECK(r.gpu.ring(a) != r.gpu.ring(b));
    CHECK_THROWS_AS(r.gpu.read_fence(999), std::out_of_range);
    CHECK_THROWS_AS(r.gpu.write_ib_put(999, 1), std::out_of_range);
    CHECK(sim::to_string(Arbitration::RoundRobin) == "round-robin");
    CHECK(sim::to_string(Arbitration::Timeslice) == "timeslice");
    CHECK_THROWS_AS(sim::SimGpu(r.loop, r.loop, timeslice(0)), std::invalid_argument);
}

// A channel drained on one GPU is re-created on another where it stopped
// (../shared/DESIGN.md section 10): its registers and the control page's
// copies start there, and its work goes on from that ring slot, across the
// 32-bit wrap too.
TEST_CASE("sim gpu: a channel created at starting positions carries on from them", "[sim_gpu][start]") {
    GpuRig r;
    auto page = std::make_unique<pvgpu_ctrl_page>();
    auto ring = std::make_unique<pvgpu_ring>();
    page->ib_put = 12345;  // the submitter's: the GPU leaves it alone
    const std::uint32_t get = GENERATE(0u, 300u, 0xffffffffu);
    const ChannelId a = r.gpu.create_channel(ChannelMemory{page.get(), ring.get()}, ChannelStart{get, 77});
    CHECK(r.gpu.read_ib_put(a) == get);
    CHECK(r.gpu.read_ib_get(a) == get);
    CHECK(r.gpu.read_fence(a) == 77);
    CHECK_FALSE(r.gpu.pending(a));
    CHECK(page->ib_put == 12345);
    CHECK(page->ib_get == get);
    CHECK(page->fence == 77);
    CHECK(page->status == PVGPU_CHAN_STATUS_OK);
    // Two kernels after the starting slot: fences as the entries say.
    r.submit(a, {ms(1), ms(1)});
    CHECK(r.gpu.read_ib_put(a) == get + 2);
    CHECK(r.gpu.pending(a));
    r.loop.run_until(ms(10));
    CHECK(r.irqs == std::vector<Event>{{a, get + 1, ms(1)}, {a, get + 2, ms(2)}});
    CHECK(r.gpu.read_ib_get(a) == get + 2);
    CHECK(r.gpu.read_fence(a) == get + 2);
    CHECK(page->ib_get == get + 2);
    CHECK_FALSE(r.gpu.pending(a));
    // A ring's worth from the start is fine; one more is not work.
    const ChannelId b = r.gpu.create_channel(ChannelMemory{}, ChannelStart{get, 0});
    r.gpu.write_ib_put(b, get + PVGPU_RING_ENTRIES + 1);
    r.loop.run_until(ms(11));
    CHECK(r.errors == std::vector<Event>{{b, PVGPU_CHAN_ERR_BAD_ENTRY, ms(10)}});
}

TEST_CASE("sim gpu: IB_GET, pending and the engine status register", "[sim_gpu]") {
    GpuRig r;
    ChannelId a = r.channel();
    ChannelId b = r.channel();
    r.submit(a, {ms(1), ms(1)});
    r.submit(b, {ms(1)});
    // t=0: A's first entry is fetched and on the engine; B waits, unfetched.
    CHECK(r.running() == a);
    CHECK(r.gpu.read_ib_put(a) == 2);
    CHECK(r.gpu.read_ib_get(a) == 1);
    CHECK(r.gpu.read_ib_get(b) == 0);
    CHECK(r.gpu.pending(a));
    CHECK(r.gpu.pending(b));

    r.loop.run_until(ms(0.5));
    CHECK(r.running() == a);
    CHECK(r.gpu.read_fence(a) == 0);

    // t=1: A#1 done (round-robin) -> B#1 fetched and runs.
    r.loop.run_until(ms(1));
    CHECK(r.gpu.read_fence(a) == 1);
    CHECK(r.running() == b);
    CHECK(r.gpu.read_ib_get(b) == 1);
    CHECK(r.gpu.read_ib_get(a) == 1);  // A#2 not fetched yet
    CHECK(r.gpu.pending(a));

    // t=2: B done, A#2 runs; t=3 all done.
    r.loop.run_until(ms(2));
    CHECK(r.running() == a);
    CHECK(r.gpu.read_ib_get(a) == 2);
    CHECK_FALSE(r.gpu.pending(b));
    r.loop.run_until(ms(3));
    CHECK_FALSE(r.gpu.running_channel().has_value());
    CHECK_FALSE(r.gpu.pending(a));
    CHECK(r.gpu.read_fence(a) == 2);
    CHECK(r.gpu.read_ib_get(a) == 2);
    CHECK(r.gpu.busy_time() == ms(3));
    CHECK(r.fence_times(a) == std::vector<Time>{ms(1), ms(3)});
    CHECK(r.fence_times(b) == std::vector<Time>{ms(2)});

    // Work submitted to an idle engine starts at once.
    r.loop.run_until(ms(10));
    r.submit(b, {ms(2)});
    CHECK(r.running() == b);
    r.loop.run_until(ms(20));
    CHECK(r.fence_times(b) == std::vector<Time>{ms(2), ms(12)});
}

TEST_CASE("sim gpu: round-robin serves channels in turn, one whole kernel each", "[sim_gpu][rr]") {
    GpuRig r;
    ChannelId a = r.channel();
    ChannelId b = r.channel();
    // Both always busy within the window: 200 x 4 ms = 800 ms and 200 x 1 ms.
    r.submit(a, std::vector<Duration>(200, ms(4)));
    r.submit(b, std::vector<Duration>(200, ms(1)));
    r.loop.run_until(ms(500));

    // The pattern is A[0,4) B[4,5) A[5,9) B[9,10) ...: 100 periods of 5 ms,
    // A gets 4 of every 5 ms: 400 ms, B 100 ms, no gap, no split kernels.
    REQUIRE(r.segments.size() >= 4);
    CHECK(r.segments[0] == Segment{a, 0, ms(4)});
    CHECK(r.segments[1] == Segment{b, ms(4), ms(5)});
    CHECK(r.segments[2] == Segment{a, ms(5), ms(9)});
    CHECK(r.segments[3] == Segment{b, ms(9), ms(10)});
    CHECK(r.executed_by(a, ms(500)) == ms(400));
    CHECK(r.executed_by(b, ms(500)) == ms(100));
    CHECK(r.gpu.busy_time() == ms(500));
    CHECK(r.segments.size() == 200);
    for (std::size_t i = 0; i < r.segments.size(); ++i) {
        const Segment& s = r.segments[i];
        CHECK(s.ch == (i % 2 == 0 ? a : b));
        CHECK(s.end - s.start == (s.ch == a ? ms(4) : ms(1)));
        if (i > 0) CHECK(s.start == r.segments[i - 1].end);
    }
    CHECK(r.gpu.read_fence(a) == 100);
    CHECK(r.gpu.read_fence(b) == 100);
}

TEST_CASE("sim gpu: round-robin rotates over three channels", "[sim_gpu][rr]") {
    GpuRig r;
    ChannelId a = r.channel();
    ChannelId b = r.channel();
    ChannelId c = r.channel();
    r.submit(a, {ms(1), ms(1), ms(1)});
    r.submit(b, {ms(2), ms(2), ms(2)});
    r.submit(c, {ms(3), ms(3), ms(3)});
    r.loop.run_until(ms(100));
    // Each round serves each channel once: rounds of 1+2+3 = 6 ms.
    REQUIRE(r.segments.size() == 9);
    CHECK(r.segments[0].ch == a);  // the first doorbell starts the engine
    for (std::size_t round = 0; round < 3; ++round) {
        std::vector<ChannelId> seen;
        for (std::size_t i = 0; i < 3; ++i) seen.push_back(r.segments[round * 3 + i].ch);
        std::sort(seen.begin(), seen.end());
        CHECK(seen == std::vector<ChannelId>{a, b, c});
        CHECK(r.segments[round * 3 + 2].end == ms(6) * static_cast<Duration>(round + 1));
    }
    // A channel that comes back after idling joins the rotation.
    r.submit(a, {ms(1), ms(1)});
    r.submit(b, {ms(1), ms(1)});
    r.loop.run_until(ms(200));
    REQUIRE(r.segments.size() == 13);
    CHECK(r.segments[9].ch != r.segments[10].ch);
    CHECK(r.segments[10].ch != r.segments[11].ch);
    CHECK(r.segments[11].ch != r.segments[12].ch);
}

TEST_CASE("sim gpu: timeslice preempts and resumes with the remaining time", "[sim_gpu][timeslice]") {
    GpuRig r(timeslice(ms(2)));
    ChannelId a = r.channel();
    ChannelId b = r.channel();
    r.submit(a, {ms(5)});
    r.submit(b, {ms(1)});
    r.loop.run_until(ms(100));
    // A[0,2) preempted (B waits); B[2,3) done; A resumes with 3 ms left:
    // [3,5) slice ends but nobody waits, so it keeps the engine: [5,6) done.
    CHECK(r.fence_times(b) == std::vector<Time>{ms(3)});
    CHECK(r.fence_times(a) == std::vector<Time>{ms(6)});
    CHECK(r.irqs == std::vector<Event>{{b, 1, ms(3)}, {a, 1, ms(6)}});
    CHECK(r.executed_by(a) == ms(5));
    CHECK(r.executed_by(b) == ms(1));
    REQUIRE(r.segments.size() >= 3);
    CHECK(r.segments[0] == Segment{a, 0, ms(2)});
    CHECK(r.segments[1] == Segment{b, ms(2), ms(3)});
    CHECK(r.segments[2].ch == a);
    CHECK(r.segments[2].start == ms(3));
    CHECK(r.gpu.context_switches() == 3);  // idle->A, A->B, B->A
    CHECK(r.gpu.busy_time() == ms(6));
    CHECK(r.gpu.read_ib_get(a) == 1);  // fetched once, not refetched on resume
}

TEST_CASE("sim gpu: timeslice runs several kernels per slice and splits the last", "[sim_gpu][timeslice]") {
    GpuRig r(timeslice(ms(2)));
    ChannelId a = r.channel();
    ChannelId b = r.channel();
    r.submit(a, {ms(0.75), ms(0.75), ms(0.75), ms(0.75)});
    r.submit(b, {ms(1)});
    r.loop.run_until(ms(100));
    // Slice A [0,2): 0.75, 1.5 done, third runs 0.5 ms and is preempted (0.25 left).
    // Slice B [2,4): done at 3, nothing more.  Slice A from 3: 3.25, 4.0.
    CHECK(r.fence_times(a) == std::vector<Time>{ms(0.75), ms(1.5), ms(3.25), ms(4.0)});
    CHECK(r.fence_times(b) == std::vector<Time>{ms(3)});
    CHECK(r.executed_by(a) == ms(3));
    CHECK(r.gpu.busy_time() == ms(4));
    CHECK(r.gpu.context_switches() == 3);
}

TEST_CASE("sim gpu: timeslice with two long kernels alternates slices", "[sim_gpu][timeslice]") {
    GpuRig r(timeslice(ms(2)));
    ChannelId a = r.channel();
    ChannelId b = r.channel();
    r.submit(a, {ms(3)});
    r.submit(b, {ms(3)});
    r.loop.run_until(ms(100));
    // A[0,2) B[2,4) A[4,5) done, B[5,6) done.
    CHECK(r.segments == std::vector<Segment>{{a, 0, ms(2)}, {b, ms(2), ms(4)}, {a, ms(4), ms(5)},
                                             {b, ms(5), ms(6)}});
    CHECK(r.fence_times(a) == std::vector<Time>{ms(5)});
    CHECK(r.fence_times(b) == std::vector<Time>{ms(6)});
}

TEST_CASE("sim gpu: a lone channel is never preempted", "[sim_gpu][timeslice]") {
    GpuRig r(timeslice(ms(1)));
    ChannelId a = r.channel();
    r.submit(a, {ms(7.5)});
    r.loop.run_until(ms(100));
    CHECK(r.fence_times(a) == std::vector<Time>{ms(7.5)});
    CHECK(r.executed_by(a) == ms(7.5));
    CHECK(r.gpu.context_switches() == 1);
}

TEST_CASE("sim gpu: context switch dead time in timeslice mode", "[sim_gpu][timeslice]") {
    GpuRig r(timeslice(ms(2), ms(0.5)));
    ChannelId a = r.channel();
    ChannelId b = r.channel();
    r.submit(a, {ms(5)});
    r.submit(b, {ms(1)});
    r.loop.run_until(ms(100));
    // Load A 0-0.5, A runs [0.5,2.5) (slice from the end of the switch);
    // load B 2.5-3, B [3,4) done; load A 4-4.5, A [4.5,6.5) slice over, alone,
    // keeps going without a switch: [6.5,7.5) done.
    CHECK(r.fence_times(b) == std::vector<Time>{ms(4)});
    CHECK(r.fence_times(a) == std::vector<Time>{ms(7.5)});
    REQUIRE(r.segments.size() >= 3);
    CHECK(r.segments[0] == Segment{a, ms(0.5), ms(2.5)});
    CHECK(r.segments[1] == Segment{b, ms(3), ms(4)});
    CHECK(r.segments[2].start == ms(4.5));
    // Dead time is not busy time: 5 + 1 ms of kernels.
    CHECK(r.gpu.busy_time() == ms(6));
    CHECK(r.gpu.context_switches() == 3);
}

TEST_CASE("sim gpu: host preemption loads the chosen channel after its dead time", "[sim_gpu][timeslice]") {
    SimGpuConfig cfg = timeslice(ms(2));
    cfg.preempt = ms(0.075);
    GpuRig r(cfg);
    ChannelId a = r.channel();
    ChannelId b = r.channel();
    ChannelId c = r.channel();
    r.submit(a, {ms(5)});
    r.loop.run_until(ms(1));
    CHECK_FALSE(r.gpu.preempt_to(b));  // no work on b
    CHECK_FALSE(r.gpu.preempt_to(a));  // already on the engine
    r.submit(c, {ms(1)});
    r.submit(b, {ms(1)});
    REQUIRE(r.gpu.preempt_to(b));
    CHECK(r.running() == b);
    CHECK(r.gpu.arbitration().preempt == ms(0.075));
    r.loop.run_until(ms(100));
    // A [0,1) taken off; dead 75 us; B [1.075,2.075) with a fresh slice; then
    // the engine's own order: C after B, A resumes with its 4 ms left.
    REQUIRE(r.segments.size() >= 3);
    CHECK(r.segments[0] == Segment{a, 0, ms(1)});
    CHECK(r.segments[1] == Segment{b, ms(1.075), ms(2.075)});
    CHECK(r.segments[2] == Segment{c, ms(2.075), ms(3.075)});
    CHECK(r.fence_times(a) == std::vector<Time>{ms(7.075)});
    CHECK(r.executed_by(a) == ms(5));
    CHECK(r.gpu.busy_time() == ms(7));  // the dead time is not busy
    CHECK(r.gpu.preemptions() == 1);
    CHECK(r.gpu.read_ib_get(a) == 1);  // resumed, not refetched
}

TEST_CASE("sim gpu: a non-preemptive engine refuses host preemption", "[sim_gpu][rr]") {
    GpuRig r;
    ChannelId a = r.channel();
    ChannelId b = r.channel();
    CHECK_FALSE(r.gpu.preempt_to(a));  // idle engine
    r.submit(a, {ms(3)});
    r.submit(b, {ms(1)});
    r.loop.run_until(ms(1));
    CHECK_FALSE(r.gpu.preempt_to(b));
    CHECK_FALSE(r.gpu.arbitration().preemptive);
    r.loop.run_until(ms(100));
    CHECK(r.segments == std::vector<Segment>{{a, 0, ms(3)}, {b, ms(3), ms(4)}});
    CHECK(r.gpu.preemptions() == 0);
}

TEST_CASE("sim gpu: fences always, interrupts only for IRQ entries", "[sim_gpu]") {
    GpuRig r;
    ChannelId a = r.channel();
    auto* ring = r.gpu.ring(a);
    ring->entries[0] = {static_cast<std::uint64_t>(ms(1)), 10, PVGPU_ENTRY_IRQ};
    ring->entries[1] = {static_cast<std::uint64_t>(ms(1)), 20, 0};
    ring->entries[2] = {static_cast<std::uint64_t>(ms(1)), 30, PVGPU_ENTRY_IRQ};
    ring->entries[3] = {static_cast<std::uint64_t>(ms(1)), 40, 0};
    r.gpu.write_ib_put(a, 4);

    r.loop.run_until(ms(1));
    CHECK(r.gpu.read_fence(a) == 10);
    r.loop.run_until(ms(2));
    CHECK(r.gpu.read_fence(a) == 20);  // written without an interrupt
    r.loop.run_until(ms(10));
    CHECK(r.gpu.read_fence(a) == 40);
    CHECK(r.irqs == std::vector<Event>{{a, 10, ms(1)}, {a, 30, ms(3)}});
    // The guest's view sees every completion.
    CHECK(r.watched == std::vector<Event>{{a, 10, ms(1)}, {a, 20, ms(2)}, {a, 30, ms(3)}, {a, 40, ms(4)}});
    CHECK(r.errors.empty());

    // No interrupt handler: completions still happen.
    r.gpu.set_interrupt_handler(nullptr);
    r.submit(a, {ms(1)});
    r.loop.run_until(ms(20));
    CHECK(r.irqs.size() == 2);
    CHECK(r.watched.size() == 5);
    CHECK(r.gpu.read_fence(a) == 5);
}

TEST_CASE("sim gpu: the fence watcher sees every entry, in order, across channels", "[sim_gpu]") {
    GpuRig r(timeslice(ms(1)));
    ChannelId a = r.channel();
    ChannelId b = r.channel();
    r.submit(a, std::vector<Duration>(20, ms(0.3)), 0);
    r.submit(b, std::vector<Duration>(10, ms(0.7)), 0);
    r.loop.run_until(ms(100));
    std::vector<std::uint32_t> fa, fb;
    for (const Event& e : r.watched) (e.ch == a ? fa : fb).push_back(e.value);
    std::vector<std::uint32_t> ea, eb;
    for (std::uint32_t i = 1; i <= 20; ++i) ea.push_back(i);
    for (std::uint32_t i = 1; i <= 10; ++i) eb.push_back(i);
    CHECK(fa == ea);
    CHECK(fb == eb);
    CHECK(r.irqs.empty());  // no IRQ flags at all
    // 20 x 0.3 + 10 x 0.7 = 13 ms of work, no dead time.
    CHECK(r.gpu.busy_time() == ms(13));
    CHECK(r.watched.back().at == ms(13));
}

TEST_CASE("sim gpu: the watchdog kills a runaway channel, others keep running", "[sim_gpu][watchdog]") {
    SimGpuConfig cfg;
    cfg.watchdog = ms(10);
    GpuRig r(cfg);
    ChannelId a = r.channel();
    ChannelId b = r.channel();
    r.submit(a, {ms(50), ms(1)});
    r.submit(b, {ms(1), ms(1), ms(1)});
    r.loop.run_until(ms(9.999));
    CHECK(r.errors.empty());
    CHECK(r.running() == a);

    // A runs [0,10) and dies at 10; B then runs [10,13).
    r.loop.run_until(ms(100));
    CHECK(r.errors == std::vector<Event>{{a, PVGPU_CHAN_ERR_WATCHDOG, ms(10)}});
    CHECK(r.gpu.read_status(a) == PVGPU_CHAN_STATUS_ERROR);
    CHECK(r.gpu.read_status(b) == PVGPU_CHAN_STATUS_OK);
    CHECK(r.gpu.read_fence(a) == 0);
    CHECK_FALSE(r.gpu.pending(a));  // its work is dropped
    CHECK(r.fence_times(a).empty());
    CHECK(r.fence_times(b) == std::vector<Time>{ms(11), ms(12), ms(13)});
    CHECK(r.executed_by(a) == ms(10));
    CHECK(r.gpu.busy_time() == ms(13));
    CHECK_FALSE(r.gpu.running_channel().has_value());

    // A dead channel ignores further doorbells.
    r.submit(a, {ms(1)});
    CHECK(r.gpu.read_ib_put(a) == 2);
    CHECK_FALSE(r.gpu.pending(a));
    CHECK_FALSE(r.gpu.running_channel().has_value());
    r.loop.run_until(ms(200));
    CHECK(r.executed_by(a) == ms(10));
    CHECK(r.errors.size() == 1);  // reported once
    // B still works.
    r.submit(b, {ms(1)});
    r.loop.run_until(ms(300));
    CHECK(r.fence_times(b).back() == ms(201));
}

TEST_CASE("sim gpu: the watchdog limit is inclusive, and 0 disables it", "[sim_gpu][watchdog]") {
    SimGpuConfig cfg;
    cfg.watchdog = ms(10);
    GpuRig r(cfg);
    ChannelId exact = r.channel();
    ChannelId over = r.channel();
    r.submit(exact, {ms(10)});
    r.loop.run_until(ms(50));
    CHECK(r.errors.empty());
    CHECK(r.fence_times(exact) == std::vector<Time>{ms(10)});

    r.submit(over, {ms(10) + 1});  // one nanosecond past the limit
    r.loop.run_until(ms(100));
    CHECK(r.errors == std::vector<Event>{{over, PVGPU_CHAN_ERR_WATCHDOG, ms(60)}});

    // set_watchdog() through the GpuDevice interface; 0 means no limit.
    GpuDevice& dev = r.gpu;
    dev.set_watchdog(0);
    ChannelId slow = r.channel();
    r.submit(slow, {10 * kSecond});
    r.loop.run_until(20 * kSecond);
    CHECK(r.fence_times(slow) == std::vector<Time>{ms(100) + 10 * kSecond});
    CHECK(r.errors.size() == 1);
    dev.set_watchdog(ms(3));
    r.submit(slow, {ms(5)});
    r.loop.run_until(30 * kSecond);
    REQUIRE(r.errors.size() == 2);
    CHECK(r.errors[1] == Event{slow, PVGPU_CHAN_ERR_WATCHDOG, 20 * kSecond + ms(3)});
}

TEST_CASE("sim gpu: the watchdog counts a kernel's time across preemptions", "[sim_gpu][watchdog]") {
    SimGpuConfig cfg = timeslice(ms(2));
    cfg.watchdog = ms(5);
    GpuRig r(cfg);
    ChannelId a = r.channel();
    ChannelId b = r.channel();
    r.submit(a, {ms(50)});
    r.submit(b, std::vector<Duration>(10, ms(1)));
    r.loop.run_until(ms(100));
    // A[0,2) B[2,4) A[4,6) B[6,8) A[8,9): 5 ms run -> killed at 9.
    // B's other 6 kernels run [9,15).
    CHECK(r.errors == std::vector<Event>{{a, PVGPU_CHAN_ERR_WATCHDOG, ms(9)}});
    CHECK(r.executed_by(a) == ms(5));
    CHECK(r.fence_times(b) == std::vector<Time>{ms(3), ms(4), ms(7), ms(8), ms(10), ms(11), ms(12),
                                                ms(13), ms(14), ms(15)});
}

TEST_CASE("sim gpu: more outstanding entries than the ring holds is a bad entry", "[sim_gpu]") {
    GpuRig r;
    ChannelId full = r.channel();
    ChannelId bad = r.channel();
    // Exactly PVGPU_RING_ENTRIES outstanding is a full ring, which is fine.
    r.submit(full, std::vector<Duration>(PVGPU_RING_ENTRIES, kMicrosecond));
    CHECK(r.errors.empty());
    CHECK(r.gpu.read_status(full) == PVGPU_CHAN_STATUS_OK);
    // One more than that is garbage, reported at once.
    r.gpu.write_ib_put(bad, PVGPU_RING_ENTRIES + 1);
    CHECK(r.errors == std::vector<Event>{{bad, PVGPU_CHAN_ERR_BAD_ENTRY, 0}});
    CHECK(r.gpu.read_status(bad) == PVGPU_CHAN_STATUS_ERROR);
    CHECK_FALSE(r.gpu.pending(bad));
    // A doorbell that moves IB_PUT backwards is garbage as well.
    ChannelId back = r.channel();
    r.loop.run_until(ms(1));  // `full` finishes its 256 us
    CHECK(r.gpu.read_fence(full) == PVGPU_RING_ENTRIES);
    r.submit(back, {kMicrosecond, kMicrosecond});
    r.loop.run_until(ms(2));
    r.gpu.write_ib_put(back, 1);
    REQUIRE(r.errors.size() == 2);
    CHECK(r.errors[1] == Event{back, PVGPU_CHAN_ERR_BAD_ENTRY, ms(2)});

    // The limit is relative to completed work: after 256 completions,
    // completed + 256 is fine and completed + 257 is not.
    // (The ring memory still holds the first lap's entries, which run again.)
    r.gpu.write_ib_put(full, 2 * PVGPU_RING_ENTRIES);
    CHECK(r.errors.size() == 2);
    CHECK(r.gpu.pending(full));
    r.loop.run_until(ms(5));
    CHECK_FALSE(r.gpu.pending(full));
    CHECK(r.fence_times(full).size() == 2 * PVGPU_RING_ENTRIES);
    ChannelId f2 = r.channel();
    r.submit(f2, {kMicrosecond});
    r.loop.run_until(ms(6));
    r.gpu.write_ib_put(f2, 1 + PVGPU_RING_ENTRIES + 1);
    REQUIRE(r.errors.size() == 3);
    CHECK(r.errors[2] == Event{f2, PVGPU_CHAN_ERR_BAD_ENTRY, ms(6)});
}

TEST_CASE("sim gpu: a bad doorbell on the running channel stops it at once", "[sim_gpu]") {
    GpuRig r;
    ChannelId a = r.channel();
    ChannelId b = r.channel();
    r.submit(a, {ms(10)});
    r.submit(b, {ms(1)});
    r.loop.run_until(ms(1));
    REQUIRE(r.running() == a);
    r.gpu.write_ib_put(a, 1000);  // garbage while A's kernel runs
    CHECK(r.errors == std::vector<Event>{{a, PVGPU_CHAN_ERR_BAD_ENTRY, ms(1)}});
    // "The channel was stopped; its pending work is dropped": the engine must
    // leave A now, B runs [1,2), and A never completes or interrupts.
    CHECK(r.running() == b);
    r.loop.run_until(ms(20));
    CHECK(r.gpu.read_fence(a) == 0);
    CHECK(r.fence_times(a).empty());
    CHECK(r.irqs == std::vector<Event>{{b, 1, ms(2)}});
    CHECK(r.fence_times(b) == std::vector<Time>{ms(2)});
}

TEST_CASE("sim gpu: destroying the running channel frees the engine", "[sim_gpu]") {
    GpuRig r;
    ChannelId a = r.channel();
    ChannelId b = r.channel();
    ChannelId c = r.channel();
    r.submit(a, {ms(10), ms(10)});
    r.submit(b, {ms(1)});
    r.submit(c, {ms(2)});
    r.loop.run_until(ms(3));
    REQUIRE(r.running() == a);
    r.gpu.destroy_channel(a);
    // The engine moves on at once; A's partial run is reported to the observer.
    CHECK(r.running() == b);
    r.loop.run_until(ms(50));
    CHECK(r.segments == std::vector<Segment>{{a, 0, ms(3)}, {b, ms(3), ms(4)}, {c, ms(4), ms(6)}});
    CHECK(r.fence_times(a).empty());
    CHECK(r.irqs == std::vector<Event>{{b, 1, ms(4)}, {c, 1, ms(6)}});
    CHECK(r.gpu.busy_time() == ms(6));
    CHECK_THROWS_AS(r.gpu.read_fence(a), std::out_of_range);
    CHECK_THROWS_AS(r.gpu.destroy_channel(a), std::out_of_range);
    CHECK_FALSE(r.gpu.running_channel().has_value());

    // Destroying a waiting channel drops it from arbitration.
    ChannelId d = r.channel();
    ChannelId e = r.channel();
    r.submit(d, {ms(1)});
    r.submit(e, {ms(1)});
    r.gpu.destroy_channel(e);
    r.loop.run_until(ms(100));
    CHECK(r.segments.size() == 4);
    CHECK(r.segments.back() == Segment{d, ms(50), ms(51)});
}

TEST_CASE("sim gpu: the host may destroy a channel from its completion interrupt", "[sim_gpu]") {
    GpuRig r(timeslice(ms(2)));
    ChannelId a = r.channel();
    ChannelId b = r.channel();
    r.fence_hook = [&](ChannelId ch, std::uint32_t) {
        if (ch == a) r.gpu.destroy_channel(a);
    };
    r.submit(a, {ms(1), ms(1)});
    r.submit(b, {ms(1)});
    r.loop.run_until(ms(10));
    // A's first kernel completes at 1 and A's second starts in the same slice;
    // the interrupt destroys A while it holds the engine, so B runs [1,2).
    CHECK(r.irqs == std::vector<Event>{{a, 1, ms(1)}, {b, 1, ms(2)}});
    CHECK(r.fence_times(a).empty());  // gone before the guest could look
    CHECK(r.fence_times(b) == std::vector<Time>{ms(2)});
    CHECK(r.executed_by(a) == ms(1));
    CHECK(r.gpu.busy_time() == ms(2));
}

TEST_CASE("sim gpu: runs are deterministic", "[sim_gpu]") {
    auto run = [] {
        GpuRig r(timeslice(ms(1.5), ms(0.1)));
        std::vector<ChannelId> chs;
        for (int i = 0; i < 4; ++i) chs.push_back(r.channel());
        // Each completion resubmits a kernel whose length depends on the count.
        std::map<ChannelId, int> n;
        for (ChannelId ch : chs) {
            r.gpu.set_fence_watcher(ch, [&r, &n, ch](std::uint32_t f) {
                r.watched.push_back({ch, f, r.loop.now()});
                if (++n[ch] < 40) r.submit(ch, {kMicrosecond * (300 + 170 * ((n[ch] * 7 + ch) % 11))});
            });
            r.submit(ch, {ms(0.2) * ch});
        }
        r.loop.run_until(ms(1000));
        return std::make_tuple(r.segments, r.watched, r.irqs, r.gpu.busy_time(), r.gpu.context_switches());
    };
    auto first = run();
    auto second = run();
    CHECK(std::get<0>(first).size() > 100);
    CHECK(std::get<1>(first).size() == 160);
    CHECK(std::get<0>(first) == std::get<0>(second));
    CHECK(std::get<1>(first) == std::get<1>(second));
    CHECK(std::get<2>(first) == std::get<2>(second));
    CHECK(std::get<3>(first) == std::get<3>(second));
    CHECK(std::get<4>(first) == std::get<4>(second));
}

TEST_CASE("sim gpu: an absurd payload is a bad entry, not a negative run time", "[sim_gpu]") {
    pvgpu::sim::EventLoop loop;
    pvgpu::sim::SimGpu gpu(loop, loop, {});
    pvgpu::ChannelId a = gpu.create_channel();
    pvgpu::ChannelId b = gpu.create_channel();
    gpu.ring(a)->entries[0] = {std::uint64_t{1} << 63, 1, 0};
    gpu.ring(b)->entries[0] = {1000000, 1, 0};
    gpu.write_ib_put(a, 1);
    gpu.write_ib_put(b, 1);
    loop.run_until(10 * pvgpu::kMillisecond);
    CHECK(gpu.read_status(a) == PVGPU_CHAN_STATUS_ERROR);
    CHECK(gpu.read_fence(a) == 0);
    CHECK(gpu.read_fence(b) == 1);  // the other channel is served
}

TEST_CASE("sim gpu: host-provided channel memory carries the GPU's registers", "[sim_gpu]") {
    pvgpu::sim::EventLoop loop;
    pvgpu::sim::SimGpu gpu(loop, loop, {});
    auto ctrl = std::make_unique<pvgpu_ctrl_page>();
    auto ring = std::make_unique<pvgpu_ring>();
    ctrl->ib_put = 7;  // the submitter's field: the GPU must leave it alone
    ctrl->fence = 99;  // stale: reset when the channel is created
    pvgpu::ChannelId ch = gpu.create_channel({ctrl.get(), ring.get()});
    CHECK(ctrl->fence == 0);
    CHECK(gpu.ring(ch) == ring.get());
    ring->entries[0] = {500000, 42, PVGPU_ENTRY_IRQ};
    gpu.write_ib_put(ch, 1);
    loop.run_until(pvgpu::kMillisecond);
    CHECK(ctrl->ib_get == 1);
    CHECK(ctrl->fence == 42);
    CHECK(ctrl->ib_put == 7);
    CHECK(gpu.read_ib_put(ch) == 1);
    gpu.destroy_channel(ch);
}

TEST_CASE("sim gpu: a submitter cannot revive its dead channel through the page", "[sim_gpu]") {
    pvgpu::sim::EventLoop loop;
    pvgpu::sim::SimGpu gpu(loop, loop, {});
    auto ctrl = std::make_unique<pvgpu_ctrl_page>();
    auto ring = std::make_unique<pvgpu_ring>();
    pvgpu::ChannelId ch = gpu.create_channel({ctrl.get(), ring.get()});
    gpu.write_ib_put(ch, PVGPU_RING_ENTRIES + 1);  // bad doorbell: channel dies
    REQUIRE(gpu.read_status(ch) == PVGPU_CHAN_STATUS_ERROR);
    ctrl->status = PVGPU_CHAN_STATUS_OK;           // the client scribbles on its page
    ctrl->error = PVGPU_CHAN_ERR_NONE;
    ring->entries[0] = {1000, 1, PVGPU_ENTRY_IRQ};
    gpu.write_ib_put(ch, 1);
    loop.run_until(pvgpu::kMillisecond);
    CHECK(gpu.read_status(ch) == PVGPU_CHAN_STATUS_ERROR);
    CHECK_FALSE(gpu.pending(ch));
    CHECK(ctrl->fence == 0);
}

namespace {

// Timers that fire late while the host is stalled over [from, to): pvgpud
// runs the simulated GPU on its own loop, so its segment ends wait with it.
struct LateTimers final : Timers {
    LateTimers(sim::EventLoop& l, Time stall_from, Time stall_to) : loop(l), from(stall_from), to(stall_to) {}
    TimerId arm(Time at, std::function<void()> fn) override {
        return loop.arm(at >= from && at < to ? to : at, std::move(fn));
    }
    void cancel(TimerId id) override { loop.cancel(id); }
    sim::EventLoop& loop;
    Time from, to;
};



// Appends kernels after the channel's IB_PUT, an interrupt on the last
// only (as libpvgpu submits), and rings the doorbell.
void submit_batch(sim::SimGpu& gpu, ChannelId ch, const std::vector<Duration>& kernels) {
    std::uint32_t put = gpu.read_ib_put(ch);
    for (std::size_t i = 0; i < kernels.size(); ++i, ++put)
        gpu.ring(ch)->entries[put & PVGPU_RING_MASK] = {static_cast<std::uint64_t>(kernels[i]), put + 1,
                                                        i + 1 == kernels.size() ? PVGPU_ENTRY_IRQ : 0u};
    gpu.write_ib_put(ch, put);
}

}  // namespace

// As hardware does: the engine runs on while the host is late, its registers
// show the present, and the interrupts raised meanwhile reach the host after
// it caught up, in the order they were raised, each handler reading the
// engine as it is then (not as that completion left it).
TEST_CASE("sim gpu: a host late for its timers finds the engine run on", "[sim_gpu][rr]") {
    sim::EventLoop loop;
    LateTimers timers(loop, ms(0.5), ms(3.5));
    sim::SimGpu gpu(loop, timers, {});
    struct Recorder final : sim::ExecutionObserver, GpuInterrupts {
        sim::SimGpu* gpu = nullptr;
        sim::EventLoop* loop = nullptr;
        std::vector<Segment> segments;
        std::vector<std::tuple<ChannelId, std::uint32_t, Time, ChannelId>> irqs;  // ch, fence, at, running
        void executed(ChannelId ch, Time s, Time e) override { segments.push_back({ch, s, e}); }
        void on_fence(ChannelId ch, std::uint32_t fence) override {
            irqs.emplace_back(ch, fence, loop->now(), gpu->running_channel().value_or(0));
        }
        void on_channel_error(ChannelId, std::uint32_t) override {}
    } rec;
    rec.gpu = &gpu;
    rec.loop = &loop;
    gpu.set_observer(&rec);
    gpu.set_interrupt_handler(&rec);
    const ChannelId a = gpu.create_channel(), b = gpu.create_channel();
    auto submit = [&](ChannelId ch, int n) {
        for (int i = 0; i < n; ++i)
            gpu.ring(ch)->entries[i] = {static_cast<std::uint64_t>(ms(1)), static_cast<std::uint32_t>(i + 1), PVGPU_ENTRY_IRQ};
        gpu.write_ib_put(ch, static_cast<std::uint32_t>(n));
    };
    submit(a, 3);
    submit(b, 2);
    // Someone the stall does not hold (a guest polling its fence) reads
    // the registers in the middle of it.
    std::tuple<ChannelId, std::uint32_t, std::uint32_t> mid{};
    loop.arm(ms(2.5), [&] { mid = {gpu.running_channel().value_or(0), gpu.read_fence(a), gpu.read_fence(b)}; });
    loop.run_until(ms(10));

    // The engine's own schedule is the same as with a punctual host.
    CHECK(rec.segments == std::vector<Segment>{{a, 0, ms(1)}, {b, ms(1), ms(2)}, {a, ms(2), ms(3)},
                                                 {b, ms(3), ms(4)}, {a, ms(4), ms(5)}});
    CHECK(mid == std::tuple<ChannelId, std::uint32_t, std::uint32_t>{a, 1, 1});
    // Handled at 3.5 ms, each one reads b on the engine (since 3 ms).
    using Irq = std::tuple<ChannelId, std::uint32_t, Time, ChannelId>;
    for (const auto& [ch, fence, at, running] : rec.irqs)
        UNSCOPED_INFO("ch" << ch << " fence " << fence << " at " << at << " running " << running);
    CHECK(rec.irqs == std::vector<Irq>{{a, 1, ms(3.5), b}, {b, 1, ms(3.5), b},
                                       {a, 2, ms(3.5), b}, {b, 2, ms(4), a},
                                       {a, 3, ms(5), 0}});
    // The context-switch trace dates every change of channel at the
    // engine's time, however late the host reads it.
    std::vector<CtxswRecord> trace;
    CHECK(gpu.read_ctxsw_trace(trace) == 0);
    CHECK(trace == std::vector<CtxswRecord>{{0, a}, {ms(1), b}, {ms(2), a}, {ms(3), b}, {ms(4), a}, {ms(5), 0}});
}

// pvgpud's timers always fire a little late, so every segment end is a
// catch-up whose interrupts are delivered from the timer itself.  A handler
// that reads a register must not schedule a second delivery for the
// interrupts already being delivered: at 128 clients that was a second
// host wakeup per kernel, doubling pvgpud's timer wakeups.
TEST_CASE("sim gpu: interrupts handled on a late timer cost no second wakeup", "[sim_gpu]") {
    sim::EventLoop loop;
    CountingTimers timers(loop, 10 * kMicrosecond);
    sim::SimGpu gpu(loop, timers, {});
    struct Handler final : GpuInterrupts {
        sim::SimGpu* gpu = nullptr;
        std::vector<std::uint32_t> fences;
        void on_fence(ChannelId ch, std::uint32_t fence) override {
            fences.push_back(fence);
            (void)gpu->running_channel();  // the accounting's engine read
            (void)gpu->read_ib_get(ch);
        }
        void on_channel_error(ChannelId, std::uint32_t) override {}
    } h;
    h.gpu = &gpu;
    gpu.set_interrupt_handler(&h);
    const ChannelId ch = gpu.create_channel();
    for (std::uint32_t i = 0; i < 5; ++i)
        gpu.ring(ch)->entries[i] = {static_cast<std::uint64_t>(ms(1)), i + 1, PVGPU_ENTRY_IRQ};
    gpu.write_ib_put(ch, 5);
    loop.run_until(ms(10));
    CHECK(h.fences == std::vector<std::uint32_t>{1, 2, 3, 4, 5});
    CHECK(timers.fired == 5);  // one per kernel: its segment's end
}

// A handler that throws (pvgpud logs it and goes on) takes neither the
// interrupts after it in the same delivery nor repeats the ones before.
TEST_CASE("sim gpu: a throwing interrupt handler loses and repeats nothing", "[sim_gpu]") {
    sim::EventLoop loop;
    LateTimers timers(loop, ms(0.5), ms(3.5));  // fences 1..3 reach the host together at 3.5 ms
    sim::SimGpu gpu(loop, timers, {});
    struct Handler final : GpuInterrupts {
        std::vector<std::uint32_t> fences;
        bool thrown = false;
        void on_fence(ChannelId, std::uint32_t fence) override {
            fences.push_back(fence);
            if (fence == 2 && !thrown) {
                thrown = true;
                throw std::runtime_error("handler failed");
            }
        }
        void on_channel_error(ChannelId, std::uint32_t) override {}
    } h;
    gpu.set_interrupt_handler(&h);
    const ChannelId ch = gpu.create_channel();
    for (std::uint32_t i = 0; i < 5; ++i)
        gpu.ring(ch)->entries[i] = {static_cast<std::uint64_t>(ms(1)), i + 1, PVGPU_ENTRY_IRQ};
    gpu.write_ib_put(ch, 5);
    CHECK_THROWS_AS(loop.run_until(ms(10)), std::runtime_error);
    loop.run_until(ms(10));
    CHECK(h.fences == std::vector<std::uint32_t>{1, 2, 3, 4, 5});
}

TEST_CASE("sim gpu: busy time now counts the running segment, not a switch's dead time", "[sim_gpu][timeslice]") {
    // pvgpud's `stats` reads busy_time_now() at any moment: an admin's
    // window must not lose the kernel still running at either end.
    GpuRig r(timeslice(ms(2), ms(0.1)));
    ChannelId a = r.channel();
    ChannelId b = r.channel();
    r.submit(a, {ms(1)});
    r.submit(b, {ms(1)});
    // Loaded from idle: A's context costs the switch, [0, 0.1) dead.
    r.loop.run_until(ms(0.05));
    CHECK(r.gpu.busy_time_now() == 0);
    r.loop.run_until(ms(0.6));
    CHECK(r.gpu.busy_time_ended() == 0);  // the segment has not ended
    CHECK(r.gpu.busy_time_now() == ms(0.5));
    // A done at 1.1; B's switch [1.1, 1.2), B runs to 2.2.
    r.loop.run_until(ms(1.15));
    CHECK(r.gpu.busy_time_now() == ms(1));
    r.loop.run_until(ms(1.7));
    CHECK(r.gpu.busy_time_now() == ms(1.5));
    r.loop.run_until(ms(10));
    CHECK(r.gpu.busy_time_now() == ms(2));
    CHECK(r.gpu.busy_time_ended() == ms(2));
    CHECK(r.gpu.busy_time() == r.gpu.busy_time_now());  // GpuDevice's counter
}

// A GPU interrupts its host only where an entry asks for it: a kernel that
// completes silently must not cost pvgpud a wakeup (issue 12 section 2: one
// wakeup per kernel was the floor of its CPU).  The engine still runs the
// same schedule, and a register read between wakeups shows it as of now.
TEST_CASE("sim gpu: a completion that raises nothing costs the host no wakeup", "[sim_gpu][rr]") {
    GpuRig r;
    SECTION("a lone channel: one wakeup per interrupt") {
        const ChannelId a = r.gpu.create_channel();
        submit_batch(r.gpu, a, {ms(1), ms(1), ms(1), ms(1)});
        submit_batch(r.gpu, a, {ms(1), ms(1), ms(1), ms(1)});
        std::uint32_t mid = 0;
        r.loop.arm(ms(2.5), [&] { mid = r.gpu.read_fence(a); });
        r.loop.run_until(ms(20));
        CHECK(r.irqs == std::vector<Event>{{a, 4, ms(4)}, {a, 8, ms(8)}});
        CHECK(mid == 2);
        CHECK(r.timers.fired_at == std::vector<Time>{ms(4), ms(8)});  // the read costs none either
        CHECK(r.gpu.busy_time() == ms(8));
    }
    SECTION("two channels in turn: wakeups bounded by each channel's work to its interrupt") {
        const ChannelId a = r.gpu.create_channel(), b = r.gpu.create_channel();
        submit_batch(r.gpu, a, {ms(1), ms(1), ms(1), ms(1)});
        submit_batch(r.gpu, b, {ms(1), ms(1), ms(1), ms(1)});
        std::tuple<ChannelId, std::uint32_t, std::uint32_t> mid{};
        r.loop.arm(ms(2.5), [&] { mid = {r.gpu.running_channel().value_or(0), r.gpu.read_fence(a), r.gpu.read_fence(b)}; });
        r.loop.run_until(ms(20));
        std::vector<Segment> turns;
        for (int i = 0; i < 8; ++i) turns.push_back({i % 2 ? b : a, ms(i), ms(i + 1)});
        CHECK(r.segments == turns);
        CHECK(mid == std::tuple<ChannelId, std::uint32_t, std::uint32_t>{a, 1, 1});
        CHECK(r.irqs == std::vector<Event>{{a, 4, ms(7)}, {b, 4, ms(8)}});
        // Planned as each segment starts, from each channel's own work to its
        // interrupt: after the read's catch-up (a's second kernel, [2, 3)),
        // a has 2 ms to its interrupt, b 3 ms (5); at 5 ms, b's third runs and
        // each has 1 ms to go (7); then the interrupts at 7 and 8.  One per
        // kernel before, eight.
        CHECK(r.timers.fired_at == std::vector<Time>{ms(5), ms(7), ms(8)});
    }
    SECTION("a doorbell during a silent kernel plans anew") {
        const ChannelId a = r.gpu.create_channel(), b = r.gpu.create_channel();
        submit_batch(r.gpu, a, {ms(1), ms(1), ms(1), ms(1)});
        r.loop.arm(ms(1.5), [&] { submit_batch(r.gpu, b, {ms(1)}); });
        r.loop.run_until(ms(20));
        CHECK(r.segments == std::vector<Segment>{{a, 0, ms(1)}, {a, ms(1), ms(2)}, {b, ms(2), ms(3)},
                                                    {a, ms(3), ms(4)}, {a, ms(4), ms(5)}});
        CHECK(r.irqs == std::vector<Event>{{b, 1, ms(3)}, {a, 4, ms(5)}});
    }
    SECTION("a silent runaway kernel is still killed on time") {
        r.gpu.set_watchdog(ms(5));
        const ChannelId a = r.gpu.create_channel();
        submit_batch(r.gpu, a, {ms(1), ms(1), ms(100)});
        r.loop.run_until(ms(50));
        CHECK(r.errors == std::vector<Event>{{a, PVGPU_CHAN_ERR_WATCHDOG, ms(7)}});
        CHECK(r.irqs.empty());
        CHECK(r.timers.fired_at == std::vector<Time>{ms(7)});
    }
}

TEST_CASE("sim gpu: silent kernels across time slices keep the schedule", "[sim_gpu][timeslice]") {
    GpuRig r(timeslice(ms(2)));
    const ChannelId a = r.gpu.create_channel(), b = r.gpu.create_channel();
    submit_batch(r.gpu, a, {ms(3), ms(1)});
    submit_batch(r.gpu, b, {ms(0.5), ms(0.5)});
    r.loop.run_until(ms(20));
    CHECK(r.segments == std::vector<Segment>{{a, 0, ms(2)}, {b, ms(2), ms(2.5)}, {b, ms(2.5), ms(3)},
                                                {a, ms(3), ms(4)}, {a, ms(4), ms(5)}});
    CHECK(r.irqs == std::vector<Event>{{b, 2, ms(3)}, {a, 2, ms(5)}});
}

// Found by a review of the wakeup plan: each of these lost or delayed an
// interrupt, or worse, once kernels could complete without a wakeup.
TEST_CASE("sim gpu: what the engine runs and raises was fixed at the doorbell", "[sim_gpu]") {
    GpuRig r;
    const ChannelId a = r.gpu.create_channel();
    r.gpu.ring(a)->entries[0] = {static_cast<std::uint64_t>(ms(1)), 1, 0};
    r.gpu.ring(a)->entries[1] = {static_cast<std::uint64_t>(ms(1)), 2, 0};
    r.gpu.write_ib_put(a, 2);
    // The tenant rewrites entries it rang in, without a doorbell: an
    // interrupt asked for late, a longer kernel.  The GPU fetched them at
    // the doorbell (and planned its host's wakeups from that).
    r.loop.arm(ms(0.5), [&] {
        r.gpu.ring(a)->entries[1] = {static_cast<std::uint64_t>(ms(50)), 2, PVGPU_ENTRY_IRQ};
        r.gpu.ring(a)->entries[0].flags = PVGPU_ENTRY_IRQ;
    });
    // Written before its own doorbell, an entry counts as written.
    r.loop.arm(ms(3), [&] {
        r.gpu.ring(a)->entries[2] = {static_cast<std::uint64_t>(ms(1)), 3, PVGPU_ENTRY_IRQ};
        r.gpu.write_ib_put(a, 3);
    });
    r.loop.run_until(ms(100));
    CHECK(r.segments == std::vector<Segment>{{a, 0, ms(1)}, {a, ms(1), ms(2)}, {a, ms(3), ms(4)}});
    CHECK(r.irqs == std::vector<Event>{{a, 3, ms(4)}});
}

TEST_CASE("sim gpu: a watchdog lowered while a kernel runs kills it at the new limit", "[sim_gpu][watchdog]") {
    GpuRig r;  // watchdog 2 s
    const ChannelId a = r.gpu.create_channel();
    submit_batch(r.gpu, a, {ms(1), ms(100)});
    SECTION("before the kernel reached it") {
        r.loop.arm(ms(0.5), [&] { r.gpu.set_watchdog(ms(5)); });
        r.loop.run_until(ms(200));
        CHECK(r.errors == std::vector<Event>{{a, PVGPU_CHAN_ERR_WATCHDOG, ms(6)}});
    }
    SECTION("after: at once") {
        r.loop.arm(ms(20), [&] { r.gpu.set_watchdog(ms(2)); });
        r.loop.run_until(ms(200));
        CHECK(r.errors == std::vector<Event>{{a, PVGPU_CHAN_ERR_WATCHDOG, ms(20)}});
    }
    CHECK(r.irqs.empty());
}

TEST_CASE("sim gpu: a handler that throws on time leaves the engine running on", "[sim_gpu]") {
    GpuRig r;
    bool thrown = false;
    r.fence_hook = [&](ChannelId, std::uint32_t) {
        if (!std::exchange(thrown, true)) throw std::runtime_error("handler failed");
    };
    const ChannelId a = r.gpu.create_channel();
    r.gpu.ring(a)->entries[0] = {static_cast<std::uint64_t>(ms(1)), 1, PVGPU_ENTRY_IRQ};
    r.gpu.ring(a)->entries[1] = {static_cast<std::uint64_t>(ms(1)), 2, 0};
    r.gpu.ring(a)->entries[2] = {static_cast<std::uint64_t>(ms(1)), 3, PVGPU_ENTRY_IRQ};
    r.gpu.write_ib_put(a, 3);
    CHECK_THROWS_AS(r.loop.run_until(ms(10)), std::runtime_error);
    // Bounded: a stale engine time once re-armed the wakeup at `now` forever.
    int steps = 0;
    while (steps < 1000 && r.loop.step()) ++steps;
    CHECK(steps < 1000);
    CHECK(r.irqs == std::vector<Event>{{a, 1, ms(1)}, {a, 3, ms(3)}});
}

TEST_CASE("sim gpu: a handler may destroy the channel whose next entry failed", "[sim_gpu]") {
    GpuRig r;
    r.error_hook = [&](ChannelId ch, std::uint32_t) { r.gpu.destroy_channel(ch); };
    const ChannelId a = r.gpu.create_channel();
    r.gpu.ring(a)->entries[0] = {static_cast<std::uint64_t>(ms(1)), 1, 0};
    r.gpu.ring(a)->entries[1] = {std::uint64_t{1} << 52, 2, 0};  // fails at its start, as a completes its first
    r.gpu.write_ib_put(a, 2);
    r.loop.run_until(ms(10));
    CHECK(r.errors == std::vector<Event>{{a, PVGPU_CHAN_ERR_BAD_ENTRY, ms(1)}});
}
