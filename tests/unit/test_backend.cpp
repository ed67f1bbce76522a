// The GPU backend ABI (include/pvgpu/backend.h) from the host's side:
// BackendGpu over the built-in simulated GPU and over the same code loaded
// from libpvgpu-backend-sim.so, against SimGpu used directly, channels at
// starting positions through the ABI, and the errors of open_backend.
#include <catch2/catch.hpp>

#include <cstdint>
#include <memory>
#include <stdexcept>
#include <string>
#include <vector>

#include "backend/backend_gpu.hpp"
#include "backend_test_paths.h"  // the modules' paths, from tests/meson.build
#include "sim/event_loop.hpp"
#include "sim/sim_gpu.hpp"

using namespace pvgpu;

namespace {

constexpr Duration ms(double v) { return static_cast<Duration>(v * kMillisecond); }

struct Event {
    ChannelId ch;
    std::uint32_t value;
    Time at;
    bool error;
    bool operator==(const Event& o) const { return ch == o.ch && value == o.value && at == o.at && error == o.error; }
};
std::ostream& operator<<(std::ostream& os, const Event& e) {
    return os << "ch" << e.ch << (e.error ? " error " : ":") << e.value << "@" << e.at;
}

struct Recorder final : GpuInterrupts {
    explicit Recorder(const Clock& c) : clock(c) {}
    void on_fence(ChannelId ch, std::uint32_t fence) override {
        events.push_back({ch, fence, clock.now(), false});
        if (throw_on_fence) throw std::runtime_error("handler failed");
    }
    void on_channel_error(ChannelId ch, std::uint32_t error) override {
        events.push_back({ch, error, clock.now(), true});
    }
    const Clock& clock;
    std::vector<Event> events;
    bool throw_on_fence = false;
};

// Kernels of the given lengths after the channel's IB_PUT, an interrupt on
// each, fences numbered by position; one doorbell.
void submit(GpuDevice& gpu, ChannelId ch, const std::vector<Duration>& kernels) {
    std::uint32_t put = gpu.read_ib_put(ch);
    for (Duration d : kernels) {
        gpu.ring(ch)->entries[put & PVGPU_RING_MASK] = {static_cast<std::uint64_t>(d), put + 1, PVGPU_ENTRY_IRQ};
        ++put;
    }
    gpu.write_ib_put(ch, put);
}

// What a host sees of a GPU over one fixed workload: two channels, one
// started at given positions, kernels of mixed lengths, registers read
// half-way.
struct Seen {
    std::vector<Event> events;
    std::vector<std::uint32_t> mid;  // IB_GET a, IB_GET b, FENCE a, running
    Duration busy_mid = 0, busy_end = 0;
    std::uint64_t switches = 0;
    bool operator==(const Seen& o) const {
        return events == o.events && mid == o.mid && busy_mid == o.busy_mid && busy_end == o.busy_end &&
               switches == o.switches;
    }
};

Seen run_workload(GpuDevice& gpu, sim::EventLoop& loop) {
    Recorder rec(loop);
    gpu.set_interrupt_handler(&rec);
    const ChannelId a = gpu.create_channel();
    const ChannelId b = gpu.create_channel(ChannelMemory{}, ChannelStart{1000, 40});
    submit(gpu, a, {ms(1), ms(3), ms(0.5)});
    submit(gpu, b, {ms(2), ms(2)});
    Seen s;
    loop.run_until(ms(2.5));
    s.mid = {gpu.read_ib_get(a), gpu.read_ib_get(b), gpu.read_fence(a), gpu.running_channel().value_or(0)};
    s.busy_mid = gpu.busy_time();
    loop.run_until(ms(20));
    s.busy_end = gpu.busy_time();
    s.switches = gpu.context_switches();
    s.events = rec.events;
    gpu.set_interrupt_handler(nullptr);
    return s;
}

std::string error_of(const std::string& backend, const std::vector<std::string>& options = {}) {
    sim::EventLoop loop;
    try {
        open_backend(backend, options, loop, loop);
    } catch (const BackendError& e) {
        return e.what();
    }
    return "(no error)";
}

}  // namespace

TEST_CASE("backend: the built-in sim behaves as SimGpu does", "[backend]") {
    const std::string arbitration = GENERATE(as<std::string>{}, "round-robin", "timeslice");
    sim::EventLoop direct_loop;
    sim::SimGpuConfig cfg;
    cfg.arbitration = arbitration == "timeslice" ? sim::Arbitration::Timeslice : sim::Arbitration::RoundRobin;
    cfg.timeslice = ms(1);
    cfg.ctxsw = ms(0.1);
    sim::SimGpu direct(direct_loop, direct_loop, cfg);
    const Seen want = run_workload(direct, direct_loop);

    sim::EventLoop loop;
    auto gpu = open_backend("sim", {"arbitration=" + arbitration, "timeslice_us=1000", "ctxsw_us=100"}, loop, loop);
    const Seen got = run_workload(*gpu, loop);
    CHECK(got.events == want.events);
    CHECK(got.mid == want.mid);
    CHECK(got.busy_mid == want.busy_mid);
    CHECK(got.busy_end == want.busy_end);
    CHECK(got.switches == want.switches);
    // The workload's facts, so the comparison is not of two empty runs.
    CHECK(got.events.size() == 5);
    CHECK(got.busy_end == ms(8.5));
    CHECK(got.busy_mid > 0);
    CHECK(got.busy_mid < got.busy_end);
    CHECK(gpu->arbitration_name() == arbitration);
    CHECK(gpu->arbitration().preemptive == (arbitration == "timeslice"));
    CHECK(gpu->description().rfind("simulated GPU, " + arbitration, 0) == 0);
    CHECK(gpu->backend_name() == "sim");
}

TEST_CASE("backend: registers, starting positions and host memory through the ABI", "[backend][start]") {
    sim::EventLoop loop;
    auto gpu = open_backend("sim", {}, loop, loop);
    Recorder rec(loop);
    gpu->set_interrupt_handler(&rec);
    auto page = std::make_unique<pvgpu_ctrl_page>();
    auto ring = std::make_unique<pvgpu_ring>();
    const ChannelId a = gpu->create_channel(ChannelMemory{page.get(), ring.get()}, ChannelStart{0xfffffffeu, 9});
    CHECK(gpu->ring(a) == ring.get());
    CHECK(gpu->read_ib_put(a) == 0xfffffffeu);
    CHECK(gpu->read_ib_get(a) == 0xfffffffeu);
    CHECK(gpu->read_fence(a) == 9);
    CHECK(page->ib_get == 0xfffffffeu);
    CHECK(page->fence == 9);
    CHECK_FALSE(gpu->pending(a));
    CHECK_FALSE(gpu->running_channel());
    std::vector<CtxswRecord> trace;
    CHECK(gpu->read_ctxsw_trace(trace) == 0);
    CHECK(trace.empty());
    // Across the wrap: fences 0xffffffff, 0, 1.
    submit(*gpu, a, {ms(1), ms(1), ms(1)});
    CHECK(gpu->pending(a));
    loop.run_until(ms(0.5));
    CHECK(gpu->running_channel() == a);
    CHECK(gpu->busy_time() == ms(0.5));
    loop.run_until(ms(10));
    CHECK(rec.events == std::vector<Event>{{a, 0xffffffffu, ms(1), false}, {a, 0, ms(2), false}, {a, 1, ms(3), false}});
    CHECK(gpu->read_ib_get(a) == 1);
    CHECK(page->fence == 1);
    // The context-switch trace: a loaded at 0, the engine idle at 3 ms.
    CHECK(gpu->read_ctxsw_trace(trace) == 0);
    CHECK(trace == std::vector<CtxswRecord>{{0, a}, {ms(3), 0}});
    trace.clear();
    CHECK(gpu->read_ctxsw_trace(trace) == 0);
    CHECK(trace.empty());  // read once
    CHECK(gpu->busy_time() == ms(3));
    CHECK(gpu->context_switches() == 1);
    CHECK_THROWS_AS(gpu->read_fence(a + 100), std::out_of_range);
    // The watchdog kills a kernel that runs too long, through the error callback.
    gpu->set_watchdog(ms(2));
    submit(*gpu, a, {ms(5)});
    loop.run_until(ms(20));
    CHECK(rec.events.back() == Event{a, PVGPU_CHAN_ERR_WATCHDOG, ms(12), true});
    CHECK(gpu->read_status(a) == PVGPU_CHAN_STATUS_ERROR);
    gpu->destroy_channel(a);
    CHECK_THROWS_AS(gpu->read_fence(a), std::out_of_range);
    gpu->set_interrupt_handler(nullptr);
}

TEST_CASE("backend: host preemption and a throwing interrupt handler", "[backend]") {
    sim::EventLoop loop;
    auto gpu = open_backend("sim", {"arbitration=timeslice", "timeslice_us=10000", "preempt_us=50"}, loop, loop);
    CHECK(gpu->arbitration().preempt == ms(0.05));
    Recorder rec(loop);
    gpu->set_interrupt_handler(&rec);
    const ChannelId a = gpu->create_channel(), b = gpu->create_channel();
    submit(*gpu, a, {ms(5)});
    submit(*gpu, b, {ms(1)});
    loop.run_until(ms(1));
    CHECK(gpu->running_channel() == a);
    CHECK(gpu->preempt_to(b));
    CHECK_FALSE(gpu->preempt_to(b));  // already on it
    loop.run_until(ms(3));
    CHECK(rec.events.front() == Event{b, 1, ms(2) + 50 * kMicrosecond, false});
    // What a handler throws reaches the host's loop, as with SimGpu itself,
    // without unwinding through the backend.
    rec.throw_on_fence = true;
    CHECK_THROWS_WITH(loop.run_until(ms(20)), "handler failed");
    loop.run_until(ms(20));
    CHECK(rec.events.back() == Event{a, 1, ms(6) + 50 * kMicrosecond, false});
    gpu->set_interrupt_handler(nullptr);
}

TEST_CASE("backend: libpvgpu-backend-sim.so loads with dlopen and works", "[backend]") {
    sim::EventLoop loop;
    auto gpu = open_backend(PVGPU_TEST_SIM_BACKEND, {"watchdog_ms=500"}, loop, loop);
    CHECK(gpu->backend_name() == "sim");
    CHECK(gpu->backend_path() == PVGPU_TEST_SIM_BACKEND);
    CHECK(gpu->description() == "simulated GPU, round-robin, watchdog 500 ms");
    sim::EventLoop direct_loop;
    sim::SimGpu direct(direct_loop, direct_loop, {});
    const Seen want = run_workload(direct, direct_loop);
    CHECK(run_workload(*gpu, loop) == want);
}

TEST_CASE("backend: what cannot be loaded or opened says why", "[backend]") {
    CHECK_THAT(error_of("/nonexistent/libpvgpu-backend-none.so"),
               Catch::StartsWith("cannot load backend /nonexistent/libpvgpu-backend-none.so: ") &&
                   Catch::Contains("No such file"));
    CHECK(error_of(PVGPU_TEST_NO_ENTRY_BACKEND) == std::string("backend ") + PVGPU_TEST_NO_ENTRY_BACKEND +
                                                      " is not a pvgpu backend: it has no symbol pvgpu_backend_entry");
    CHECK(error_of(PVGPU_TEST_ABI99_BACKEND) ==
          std::string("backend ") + PVGPU_TEST_ABI99_BACKEND + " speaks ABI 99, pvgpud speaks " + std::to_string(PVGPU_BACKEND_ABI_VERSION));
    CHECK_THAT(error_of("nvidia"), Catch::StartsWith("unknown backend 'nvidia': 'sim' or the path"));
    CHECK(error_of("sim", {"arbitration=fifo"}) == "backend sim: arbitration: 'fifo' is not round-robin or timeslice");
    CHECK(error_of("sim", {"timeslice_us=0"}) == "backend sim: timeslice_us: '0' is not an integer in 1..10000000");
    CHECK(error_of("sim", {"watchdog_ms=1h"}) == "backend sim: watchdog_ms: '1h' is not an integer in 0..3600000");
    CHECK(error_of("sim", {"ctxsw_us=1000001"}) == "backend sim: ctxsw_us: '1000001' is not an integer in 0..1000000");
    CHECK(error_of("sim", {"colour=blue"}) ==
          "backend sim: unknown option 'colour' (known: arbitration, timeslice_us, ctxsw_us, preempt_us, watchdog_ms, "
          "ctxsw_trace)");
    CHECK(error_of("sim", {"ctxsw_trace=1"}) == "backend sim: ctxsw_trace: '1' is not true or false");
    CHECK(error_of("sim", {"watchdog_ms"}) == "backend sim: option 'watchdog_ms' is not key=value");
    CHECK(error_of("sim", {"preempt_us=1", "preempt_us=2"}) == "backend sim: option 'preempt_us' given twice");
    CHECK(error_of(PVGPU_TEST_SIM_BACKEND, {"arbitration=x"}) ==
          std::string("backend ") + PVGPU_TEST_SIM_BACKEND + ": arbitration: 'x' is not round-robin or timeslice");
}

TEST_CASE("backend sim: ctxsw_trace=false is a GPU without a context-switch trace", "[backend]") {
    sim::EventLoop loop;
    auto with = open_backend("sim", {}, loop, loop);
    auto without = open_backend("sim", {"ctxsw_trace=false"}, loop, loop);
    CHECK(with->has_ctxsw_trace());
    CHECK_FALSE(without->has_ctxsw_trace());
    CHECK_THAT(without->description(), Catch::EndsWith(", no context-switch trace"));
}
