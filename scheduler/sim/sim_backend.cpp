// The simulated GPU as a backend (include/pvgpu/backend.h): SimGpu behind
// the C ABI, on the host's clock and timers.  Linked into pvgpud as the
// built-in `sim` backend (pvgpu_sim_backend_entry) and built alone as
// libpvgpu-backend-sim.so (sim_backend_module.cpp exports the entry), so the
// dlopen path is tested against the same code.
#include <pvgpu/backend.h>

#include <algorithm>
#include <charconv>
#include <cstring>
#include <functional>
#include <map>
#include <memory>
#include <stdexcept>
#include <string>
#include <string_view>
#include <unordered_map>
#include <utility>

#include "sim_gpu.hpp"

namespace pvgpu::sim {
namespace {

void put_error(char* err, std::size_t len, const std::string& msg) {
    if (!err || len == 0) return;
    const std::size_t n = std::min(len - 1, msg.size());
    std::memcpy(err, msg.data(), n);
    err[n] = '\0';
}

class HostClock final : public Clock {
public:
    explicit HostClock(const pvgpu_backend_host& h) : h_(h) {}
    Time now() const override { return static_cast<Time>(h_.now_ns(h_.ctx)); }

private:
    const pvgpu_backend_host& h_;
};

// SimGpu's timers on the host's: each expiry comes back through fire().
class HostTimers final : public Timers {
public:
    explicit HostTimers(const pvgpu_backend_host& h) : h_(h) {}
    ~HostTimers() override {
        for (auto& [id, p] : pending_) h_.timer_cancel(h_.ctx, p->host);
    }
    HostTimers(const HostTimers&) = delete;
    HostTimers& operator=(const HostTimers&) = delete;

    TimerId arm(Time at, std::function<void()> fn) override {
        const TimerId id = next_++;
        auto p = std::make_unique<Pending>(Pending{this, id, std::move(fn), 0});
        Pending* raw = p.get();
        pending_.emplace(id, std::move(p));
        raw->host = h_.timer_arm(h_.ctx, static_cast<pvgpu_u64>(std::max<Time>(at, 0)), &fire, raw);
        return id;
    }
    void cancel(TimerId id) override {
        auto it = pending_.find(id);
        if (it == pending_.end()) return;
        h_.timer_cancel(h_.ctx, it->second->host);
        pending_.erase(it);
    }

private:
    struct Pending {
        HostTimers* self;
        TimerId id;
        std::function<void()> fn;
        pvgpu_backend_handle host;
    };
    // The host runs this on its thread; nothing may unwind into it.
    static void fire(void* arg) {
        auto* p = static_cast<Pending*>(arg);
        HostTimers& self = *p->self;
        std::function<void()> fn = std::move(p->fn);
        self.pending_.erase(p->id);  // frees p
        try {
            fn();
        } catch (const std::exception& e) {
            self.h_.log(self.h_.ctx, PVGPU_BACKEND_LOG_ERROR, e.what());
        }
    }

    const pvgpu_backend_host& h_;
    TimerId next_ = 1;
    std::unordered_map<TimerId, std::unique_ptr<Pending>> pending_;
};

class HostInterrupts final : public GpuInterrupts {
public:
    explicit HostInterrupts(const pvgpu_backend_host& h) : h_(h) {}
    void on_fence(ChannelId ch, std::uint32_t fence) override { h_.fence_irq(h_.ctx, ch, fence); }
    void on_channel_error(ChannelId ch, std::uint32_t error) override { h_.channel_error(h_.ctx, ch, error); }

private:
    const pvgpu_backend_host& h_;
};

// Options are [gpu.N]'s keys, with the ranges pvgpud's configuration
// always checked for them.
struct DurationOption {
    const char* key;
    Duration SimGpuConfig::*field;
    Duration unit;
    std::int64_t min, max;
};
constexpr DurationOption kDurations[] = {
    {"timeslice_us", &SimGpuConfig::timeslice, kMicrosecond, 1, 10'000'000},
    {"ctxsw_us", &SimGpuConfig::ctxsw, kMicrosecond, 0, 1'000'000},
    {"preempt_us", &SimGpuConfig::preempt, kMicrosecond, 0, 1'000'000},
    {"watchdog_ms", &SimGpuConfig::watchdog, kMillisecond, 0, 3'600'000},
};
constexpr const char* kKnown = "arbitration, timeslice_us, ctxsw_us, preempt_us, watchdog_ms, ctxsw_trace";

void apply_option(SimGpuConfig& cfg, std::string_view key, std::string_view value) {
    if (key == "arbitration") {
        if (value == "round-robin")
            cfg.arbitration = Arbitration::RoundRobin;
        else if (value == "timeslice")
            cfg.arbitration = Arbitration::Timeslice;
        else
            throw std::invalid_argument("arbitration: '" + std::string(value) + "' is not round-robin or timeslice");
        return;
    }
    if (key == "ctxsw_trace") {
        if (value != "true" && value != "false")
            throw std::invalid_argument("ctxsw_trace: '" + std::string(value) + "' is not true or false");
        cfg.ctxsw_trace = value == "true";
        return;
    }
    for (const DurationOption& d : kDurations) {
        if (key != d.key) continue;
        std::int64_t v = 0;
        const auto [p, ec] = std::from_chars(value.data(), value.data() + value.size(), v);
        if (ec != std::errc() || p != value.data() + value.size() || v < d.min || v > d.max)
            throw std::invalid_argument(std::string(key) + ": '" + std::string(value) + "' is not an integer in " +
                                        std::to_string(d.min) + ".." + std::to_string(d.max));
        cfg.*d.field = v * d.unit;
        return;
    }
    throw std::invalid_argument("unknown option '" + std::string(key) + "' (known: " + kKnown + ")");
}

SimGpuConfig parse_options(const char* const* options, pvgpu_u32 n) {
    SimGpuConfig cfg;
    std::map<std::string, int> seen;
    for (pvgpu_u32 i = 0; i < n; ++i) {
        const std::string_view opt = options[i] ? options[i] : "";
        const auto eq = opt.find('=');
        if (eq == std::string_view::npos || eq == 0)
            throw std::invalid_argument("option '" + std::string(opt) + "' is not key=value");
        const std::string_view key = opt.substr(0, eq);
        if (seen[std::string(key)]++) throw std::invalid_argument("option '" + std::string(key) + "' given twice");
        apply_option(cfg, key, opt.substr(eq + 1));
    }
    return cfg;
}

std::string describe(const SimGpuConfig& cfg) {
    std::string d = "simulated GPU, " + std::string(to_string(cfg.arbitration));
    if (cfg.arbitration == Arbitration::Timeslice)
        d += " " + std::to_string(cfg.timeslice / kMicrosecond) + " us, ctxsw " +
             std::to_string(cfg.ctxsw / kMicrosecond) + " us, preempt " + std::to_string(cfg.preempt / kMicrosecond) +
             " us";
    return d + ", watchdog " + std::to_string(cfg.watchdog / kMillisecond) + " ms" +
           (cfg.ctxsw_trace ? "" : ", no context-switch trace");
}

}  // namespace
}  // namespace pvgpu::sim

// The opaque handle of the ABI.  Member order matters: the GPU goes first
// (its Timer members cancel through `timers`), then the timers.
struct pvgpu_backend_gpu {
    pvgpu_backend_gpu(const pvgpu_backend_host& h, const pvgpu::sim::SimGpuConfig& cfg)
        : host(h), clock(h), timers(h), irq(h), gpu(clock, timers, cfg), description(pvgpu::sim::describe(cfg)) {
        gpu.set_interrupt_handler(&irq);
    }
    const pvgpu_backend_host& host;
    pvgpu::sim::HostClock clock;
    pvgpu::sim::HostTimers timers;
    pvgpu::sim::HostInterrupts irq;
    pvgpu::sim::SimGpu gpu;
    std::string description;
    // Trace records read from the model and not yet handed to the host.
    std::vector<pvgpu::CtxswRecord> trace_pending;
};

namespace pvgpu::sim {
namespace {

// Runs `f` on the GPU; an exception (a host bug: an unknown channel) is
// logged and `fallback` returned, since nothing may unwind into C.
template <class R, class F> R guarded(pvgpu_backend_gpu* g, R fallback, F&& f) noexcept {
    try {
        return f(g->gpu);
    } catch (const std::exception& e) {
        try {
            g->host.log(g->host.ctx, PVGPU_BACKEND_LOG_ERROR, e.what());
        } catch (...) {
        }
        return fallback;
    }
}

pvgpu_backend_gpu* sim_open(const pvgpu_backend_host* host, const char* const* options, pvgpu_u32 n_options,
                            char* err, size_t err_len) noexcept {
    try {
        if (!host || host->abi_version != PVGPU_BACKEND_ABI_VERSION || host->size < sizeof(pvgpu_backend_host))
            throw std::invalid_argument("host services of another ABI version");
        // Owned by the host from here: returned raw through the C ABI, freed by sim_close.
        return std::make_unique<pvgpu_backend_gpu>(*host, parse_options(options, n_options)).release();
    } catch (const std::exception& e) {
        put_error(err, err_len, e.what());
        return nullptr;
    }
}

void sim_close(pvgpu_backend_gpu* g) noexcept { std::unique_ptr<pvgpu_backend_gpu> owned(g); }

const char* sim_describe(pvgpu_backend_gpu* g) noexcept { return g->description.c_str(); }

void sim_arbitration(pvgpu_backend_gpu* g, pvgpu_backend_arbitration* out) noexcept {
    const EngineArbitration a = g->gpu.arbitration();
    out->preemptive = a.preemptive ? 1 : 0;
    out->flags = g->gpu.has_ctxsw_trace() ? PVGPU_BACKEND_HAS_CTXSW_TRACE : 0;
    out->timeslice_ns = static_cast<pvgpu_u64>(a.timeslice);
    out->ctxsw_ns = static_cast<pvgpu_u64>(a.ctxsw);
    out->preempt_ns = static_cast<pvgpu_u64>(a.preempt);
    const std::string_view name = to_string(g->gpu.config().arbitration);
    const std::size_t n = std::min(name.size(), sizeof out->name - 1);
    std::memcpy(out->name, name.data(), n);
    out->name[n] = '\0';
}

int sim_channel_create(pvgpu_backend_gpu* g, pvgpu_ctrl_page* ctrl, pvgpu_ring* ring,
                       const pvgpu_backend_channel_start* start, pvgpu_u32* channel, char* err,
                       size_t err_len) noexcept {
    if (!ctrl || !ring) {
        put_error(err, err_len, "a channel needs its control page and ring");
        return -1;
    }
    const ChannelStart s = start ? ChannelStart{start->get, start->fence} : ChannelStart{};
    try {
        *channel = g->gpu.create_channel(ChannelMemory{ctrl, ring}, s);
        return 0;
    } catch (const std::exception& e) {
        put_error(err, err_len, e.what());
        return -1;
    }
}

void sim_channel_destroy(pvgpu_backend_gpu* g, pvgpu_u32 ch) noexcept {
    guarded(g, 0, [ch](SimGpu& gpu) { return gpu.destroy_channel(ch), 0; });
}

void sim_write_ib_put(pvgpu_backend_gpu* g, pvgpu_u32 ch, pvgpu_u32 put) noexcept {
    guarded(g, 0, [ch, put](SimGpu& gpu) { return gpu.write_ib_put(ch, put), 0; });
}
pvgpu_u32 sim_read_ib_put(pvgpu_backend_gpu* g, pvgpu_u32 ch) noexcept {
    return guarded(g, 0u, [ch](SimGpu& gpu) { return gpu.read_ib_put(ch); });
}
pvgpu_u32 sim_read_ib_get(pvgpu_backend_gpu* g, pvgpu_u32 ch) noexcept {
    return guarded(g, 0u, [ch](SimGpu& gpu) { return gpu.read_ib_get(ch); });
}
pvgpu_u32 sim_read_fence(pvgpu_backend_gpu* g, pvgpu_u32 ch) noexcept {
    return guarded(g, 0u, [ch](SimGpu& gpu) { return gpu.read_fence(ch); });
}
pvgpu_u32 sim_read_status(pvgpu_backend_gpu* g, pvgpu_u32 ch) noexcept {
    return guarded(g, PVGPU_CHAN_STATUS_ERROR, [ch](SimGpu& gpu) { return gpu.read_status(ch); });
}
int sim_pending(pvgpu_backend_gpu* g, pvgpu_u32 ch) noexcept {
    return guarded(g, 0, [ch](SimGpu& gpu) { return gpu.pending(ch) ? 1 : 0; });
}

int sim_engine_status(pvgpu_backend_gpu* g, pvgpu_u32* channel) noexcept {
    return guarded(g, 0, [channel](SimGpu& gpu) {
        const std::optional<ChannelId> r = gpu.running_channel();
        if (!r) return 0;
        *channel = *r;
        return 1;
    });
}

pvgpu_u32 sim_ctxsw_trace(pvgpu_backend_gpu* g, pvgpu_backend_ctxsw* out, pvgpu_u32 max, pvgpu_u64* lost) noexcept {
    *lost = 0;
    return guarded(g, pvgpu_u32{0}, [g, out, max, lost](SimGpu& gpu) {
        // Records beyond `max` wait for the next call.
        std::vector<CtxswRecord>& pending = g->trace_pending;
        *lost = gpu.read_ctxsw_trace(pending);
        const std::size_t n = std::min<std::size_t>(max, pending.size());
        for (std::size_t i = 0; i < n; ++i)
            out[i] = {static_cast<pvgpu_u64>(pending[i].at), pending[i].to, 0};
        pending.erase(pending.begin(), pending.begin() + static_cast<std::ptrdiff_t>(n));
        return static_cast<pvgpu_u32>(n);
    });
}

int sim_preempt_to(pvgpu_backend_gpu* g, pvgpu_u32 next) noexcept {
    return guarded(g, 0, [next](SimGpu& gpu) { return gpu.preempt_to(next) ? 1 : 0; });
}

void sim_set_watchdog(pvgpu_backend_gpu* g, pvgpu_u64 limit_ns) noexcept {
    const Duration limit = static_cast<Duration>(std::min<pvgpu_u64>(limit_ns, INT64_MAX));
    guarded(g, 0, [limit](SimGpu& gpu) { return gpu.set_watchdog(limit), 0; });
}

pvgpu_u64 sim_busy_ns(pvgpu_backend_gpu* g) noexcept {
    return guarded(g, pvgpu_u64{0}, [](SimGpu& gpu) { return static_cast<pvgpu_u64>(gpu.busy_time()); });
}
pvgpu_u64 sim_context_switches(pvgpu_backend_gpu* g) noexcept {
    return guarded(g, pvgpu_u64{0}, [](SimGpu& gpu) { return pvgpu_u64{gpu.context_switches()}; });
}

constexpr pvgpu_backend_ops kOps = {
    PVGPU_BACKEND_ABI_VERSION,
    sizeof(pvgpu_backend_ops),
    "sim",
    sim_open,
    sim_close,
    sim_describe,
    sim_arbitration,
    sim_channel_create,
    sim_channel_destroy,
    sim_write_ib_put,
    sim_read_ib_put,
    sim_read_ib_get,
    sim_read_fence,
    sim_read_status,
    sim_pending,
    sim_engine_status,
    sim_ctxsw_trace,
    sim_preempt_to,
    sim_set_watchdog,
    sim_busy_ns,
    sim_context_switches,
};

}  // namespace
}  // namespace pvgpu::sim

// pvgpud's built-in backend; libpvgpu-backend-sim.so exports it as
// pvgpu_backend_entry (sim_backend_module.cpp).
extern "C" const pvgpu_backend_ops* pvgpu_sim_backend_entry(pvgpu_u32 host_abi_version) {
    return host_abi_version == PVGPU_BACKEND_ABI_VERSION ? &pvgpu::sim::kOps : nullptr;
}
