#include "backend_gpu.hpp"

#include <dlfcn.h>

#include <algorithm>
#include <array>
#include <cstdint>
#include <cstdio>
#include <string>
#include <type_traits>
#include <utility>

// The built-in simulated GPU (scheduler/sim/sim_backend.cpp), reached by its
// entry like any backend: nothing here knows the simulator.
extern "C" const pvgpu_backend_ops* pvgpu_sim_backend_entry(pvgpu_u32 host_abi_version);

namespace pvgpu {

namespace {

const std::string kAbi = std::to_string(PVGPU_BACKEND_ABI_VERSION);

// A table this host can call through, or a BackendError saying why not.
const pvgpu_backend_ops& check_table(const std::string& label, const pvgpu_backend_ops* ops) {
    if (!ops) throw BackendError("backend " + label + " cannot speak ABI " + kAbi + " (its entry returned no table)");
    if (ops->abi_version != PVGPU_BACKEND_ABI_VERSION)
        throw BackendError("backend " + label + " speaks ABI " + std::to_string(ops->abi_version) +
                           ", pvgpud speaks " + kAbi);
    if (ops->size < sizeof(pvgpu_backend_ops))
        throw BackendError("backend " + label + ": its ABI " + kAbi + " table has " + std::to_string(ops->size) +
                           " bytes, pvgpud needs " + std::to_string(sizeof(pvgpu_backend_ops)));
    const std::pair<const char*, bool> required[] = {
        {"open", ops->open != nullptr},
        {"close", ops->close != nullptr},
        {"describe", ops->describe != nullptr},
        {"arbitration", ops->arbitration != nullptr},
        {"channel_create", ops->channel_create != nullptr},
        {"channel_destroy", ops->channel_destroy != nullptr},
        {"write_ib_put", ops->write_ib_put != nullptr},
        {"read_ib_put", ops->read_ib_put != nullptr},
        {"read_ib_get", ops->read_ib_get != nullptr},
        {"read_fence", ops->read_fence != nullptr},
        {"read_status", ops->read_status != nullptr},
        {"pending", ops->pending != nullptr},
        {"engine_status", ops->engine_status != nullptr},
        {"set_watchdog", ops->set_watchdog != nullptr},
        {"busy_ns", ops->busy_ns != nullptr},
        {"context_switches", ops->context_switches != nullptr},
    };
    for (const auto& [member, present] : required)
        if (!present) throw BackendError("backend " + label + ": its table has no " + member);
    return *ops;
}

std::string label_of(const pvgpu_backend_ops& ops) { return ops.name && *ops.name ? ops.name : "(unnamed)"; }

}  // namespace

void BackendGpu::DlClose::operator()(void* handle) const { dlclose(handle); }

// The host services a backend calls (ctx: the BackendGpu).  None may
// unwind into the backend: what a handler throws waits in pending_.
struct BackendGpu::Host {
    static BackendGpu& self(void* ctx) { return *static_cast<BackendGpu*>(ctx); }
    static void stash(BackendGpu& g) noexcept {
        if (!g.pending_) g.pending_ = std::current_exception();
    }

    static pvgpu_u64 now_ns(void* ctx) noexcept { return static_cast<pvgpu_u64>(self(ctx).clock_.now()); }

    static pvgpu_backend_handle timer_arm(void* ctx, pvgpu_u64 at_ns, pvgpu_backend_callback fn,
                                          void* arg) noexcept {
        BackendGpu& g = self(ctx);
        const std::uint64_t handle = g.next_handle_++;
        try {
            const Time at = static_cast<Time>(std::min<pvgpu_u64>(at_ns, INT64_MAX));
            g.timer_ids_[handle] = g.timers_.arm(at, [&g, handle, fn, arg] {
                g.timer_ids_.erase(handle);
                fn(arg);
                g.rethrow_pending();  // to the host's loop, as a GpuDevice's own timer would
            });
        } catch (...) {
            stash(g);
            return 0;
        }
        return handle;
    }
    static void timer_cancel(void* ctx, pvgpu_backend_handle handle) noexcept {
        BackendGpu& g = self(ctx);
        auto it = g.timer_ids_.find(handle);
        if (it == g.timer_ids_.end()) return;
        g.timers_.cancel(it->second);
        g.timer_ids_.erase(it);
    }

    static pvgpu_backend_handle fd_watch(void* ctx, int fd, pvgpu_backend_callback fn, void* arg) noexcept {
        BackendGpu& g = self(ctx);
        try {
            const std::uint64_t id = g.hooks_.fds->watch(fd, [&g, fn, arg] {
                fn(arg);
                g.rethrow_pending();
            });
            if (id == 0) return 0;
            const std::uint64_t handle = g.next_handle_++;
            g.watch_ids_[handle] = id;
            return handle;
        } catch (...) {
            stash(g);
            return 0;
        }
    }
    static void fd_unwatch(void* ctx, pvgpu_backend_handle handle) noexcept {
        BackendGpu& g = self(ctx);
        auto it = g.watch_ids_.find(handle);
        if (it == g.watch_ids_.end()) return;
        g.hooks_.fds->unwatch(it->second);
        g.watch_ids_.erase(it);
    }

    // Interrupts for a channel the host no longer has are dropped: it
    // destroyed the channel, and with it any interest in its events.
    static void fence_irq(void* ctx, pvgpu_u32 ch, pvgpu_u32 fence) noexcept {
        BackendGpu& g = self(ctx);
        if (!g.irq_ || !g.channels_.count(ch)) return;
        try {
            g.irq_->on_fence(ch, fence);
        } catch (...) {
            stash(g);
        }
    }
    static void channel_error(void* ctx, pvgpu_u32 ch, pvgpu_u32 error) noexcept {
        BackendGpu& g = self(ctx);
        if (!g.irq_ || !g.channels_.count(ch)) return;
        try {
            g.irq_->on_channel_error(ch, error);
        } catch (...) {
            stash(g);
        }
    }

    static void log(void* ctx, int level, const char* msg) noexcept {
        try {
            self(ctx).log(level, msg ? msg : "");
        } catch (...) {
        }
    }
};

BackendGpu::BackendGpu(Key, Library lib, const pvgpu_backend_ops& ops, std::string path, const Clock& clock,
                       Timers& timers, BackendHooks hooks)
    : lib_(std::move(lib)), ops_(ops), name_(label_of(ops)), path_(std::move(path)), clock_(clock), timers_(timers),
      hooks_(std::move(hooks)), host_(std::make_unique<pvgpu_backend_host>()) {
    pvgpu_backend_host& h = *host_;
    h.abi_version = PVGPU_BACKEND_ABI_VERSION;
    h.size = sizeof(pvgpu_backend_host);
    h.ctx = this;
    h.now_ns = &Host::now_ns;
    h.timer_arm = &Host::timer_arm;
    h.timer_cancel = &Host::timer_cancel;
    h.fd_watch = hooks_.fds ? &Host::fd_watch : nullptr;
    h.fd_unwatch = hooks_.fds ? &Host::fd_unwatch : nullptr;
    h.fence_irq = &Host::fence_irq;
    h.channel_error = &Host::channel_error;
    h.log = &Host::log;
}

BackendGpu::~BackendGpu() {
    irq_ = nullptr;
    gpu_.reset();  // the backend stops, drops its channels, cancels its timers
    if (!timer_ids_.empty() || !watch_ids_.empty())
        log(PVGPU_BACKEND_LOG_WARNING, "left timers or fd watches at close; cancelled");
    for (const auto& [handle, id] : timer_ids_) timers_.cancel(id);
    for (const auto& [handle, id] : watch_ids_) hooks_.fds->unwatch(id);
}

void BackendGpu::open(const std::vector<std::string>& options) {
    std::vector<const char*> argv;
    argv.reserve(options.size());
    for (const std::string& o : options) argv.push_back(o.c_str());
    char err[PVGPU_BACKEND_ERROR_LEN] = {};
    pvgpu_backend_gpu* g = ops_.open(host_.get(), argv.data(), static_cast<pvgpu_u32>(argv.size()), err, sizeof err);
    err[sizeof err - 1] = '\0';
    if (!g) throw BackendError("backend " + path_ + ": " + (err[0] ? err : "cannot open the GPU (no reason given)"));
    gpu_ = std::unique_ptr<pvgpu_backend_gpu, CloseGpu>(g, CloseGpu{&ops_});
    // Fixed while the GPU is open: the scheduler's accounting reads it once.
    pvgpu_backend_arbitration a{};
    ops_.arbitration(g, &a);
    a.name[sizeof a.name - 1] = '\0';
    arbitration_ = {a.preemptive != 0, static_cast<Duration>(a.timeslice_ns), static_cast<Duration>(a.ctxsw_ns),
                    static_cast<Duration>(a.preempt_ns)};
    arbitration_name_ = a.name[0] ? a.name : (a.preemptive ? "preemptive" : "non-preemptive");
    has_trace_ = ops_.ctxsw_trace != nullptr && (a.flags & PVGPU_BACKEND_HAS_CTXSW_TRACE) != 0;
    rethrow_pending();
}

void BackendGpu::log(int level, std::string_view msg) const {
    if (hooks_.log) {
        hooks_.log(level, msg);
        return;
    }
    std::fprintf(stderr, "pvgpu backend %s: %.*s\n", name_.c_str(), static_cast<int>(msg.size()), msg.data());
}

void BackendGpu::rethrow_pending() const {
    if (!pending_) return;
    std::rethrow_exception(std::exchange(pending_, nullptr));
}

template <class F> auto BackendGpu::call(F&& f) const {
    if constexpr (std::is_void_v<decltype(f())>) {
        f();
        rethrow_pending();
    } else {
        auto r = f();
        rethrow_pending();
        return r;
    }
}

const BackendGpu::Channel& BackendGpu::channel(ChannelId ch) const {
    auto it = channels_.find(ch);
    if (it == channels_.end()) throw std::out_of_range("no GPU channel " + std::to_string(ch));
    return it->second;
}

std::string BackendGpu::description() const {
    const char* d = ops_.describe(gpu_.get());
    return d ? d : name_;
}

ChannelId BackendGpu::create_channel(ChannelMemory mem, ChannelStart start) {
    Channel c;
    if (!mem.ctrl) mem.ctrl = (c.own_ctrl = std::make_unique<pvgpu_ctrl_page>()).get();
    if (!mem.ring) mem.ring = (c.own_ring = std::make_unique<pvgpu_ring>()).get();
    c.ring = mem.ring;
    const pvgpu_backend_channel_start s{start.get, start.fence};
    char err[PVGPU_BACKEND_ERROR_LEN] = {};
    pvgpu_u32 id = 0;
    if (ops_.channel_create(gpu_.get(), mem.ctrl, mem.ring, &s, &id, err, sizeof err) != 0) {
        err[sizeof err - 1] = '\0';
        throw BackendError("backend " + name_ + ": cannot create a channel: " + (err[0] ? err : "no reason given"));
    }
    if (id == 0 || channels_.count(id))
        throw BackendError("backend " + name_ + " gave a new channel id " + std::to_string(id) + ", 0 or in use");
    channels_.emplace(id, std::move(c));
    rethrow_pending();
    return id;
}

void BackendGpu::destroy_channel(ChannelId ch) {
    channel(ch);
    ops_.channel_destroy(gpu_.get(), ch);
    channels_.erase(ch);  // the backend no longer touches its memory
    rethrow_pending();
}

void BackendGpu::write_ib_put(ChannelId ch, std::uint32_t put) {
    channel(ch);
    call([&] { ops_.write_ib_put(gpu_.get(), ch, put); });
}

std::uint32_t BackendGpu::read_ib_put(ChannelId ch) const {
    channel(ch);
    return call([&] { return ops_.read_ib_put(gpu_.get(), ch); });
}

std::uint32_t BackendGpu::read_ib_get(ChannelId ch) const {
    channel(ch);
    return call([&] { return ops_.read_ib_get(gpu_.get(), ch); });
}

std::uint32_t BackendGpu::read_fence(ChannelId ch) const {
    channel(ch);
    return call([&] { return ops_.read_fence(gpu_.get(), ch); });
}

std::uint32_t BackendGpu::read_status(ChannelId ch) const {
    channel(ch);
    return call([&] { return ops_.read_status(gpu_.get(), ch); });
}

bool BackendGpu::pending(ChannelId ch) const {
    channel(ch);
    return call([&] { return ops_.pending(gpu_.get(), ch) != 0; });
}

std::optional<ChannelId> BackendGpu::running_channel() const {
    pvgpu_u32 ch = 0;
    const bool busy = call([&] { return ops_.engine_status(gpu_.get(), &ch) != 0; });
    return busy ? std::optional<ChannelId>(ch) : std::nullopt;
}

std::uint64_t BackendGpu::read_ctxsw_trace(std::vector<CtxswRecord>& out) {
    if (!has_trace_) return 0;
    std::uint64_t lost = 0;
    std::array<pvgpu_backend_ctxsw, 64> buf{};
    for (;;) {
        pvgpu_u64 dropped = 0;
        const pvgpu_u32 n = call([&] {
            return ops_.ctxsw_trace(gpu_.get(), buf.data(), static_cast<pvgpu_u32>(buf.size()), &dropped);
        });
        lost += dropped;
        // A backend's times are kept in order and never ahead of the host's
        // clock: the accounting must not charge the future.
        const Time now = clock_.now();
        for (pvgpu_u32 i = 0; i < std::min<pvgpu_u32>(n, buf.size()); ++i) {
            const Time at = std::clamp(static_cast<Time>(std::min<pvgpu_u64>(buf[i].at_ns, INT64_MAX)),
                                       std::min(trace_last_, now), now);
            trace_last_ = at;
            out.push_back({at, buf[i].channel});
        }
        if (n < buf.size()) return lost;
    }
}

bool BackendGpu::preempt_to(ChannelId next) {
    channel(next);
    if (!ops_.preempt_to) return false;
    return call([&] { return ops_.preempt_to(gpu_.get(), next) != 0; });
}

void BackendGpu::set_watchdog(Duration limit) {
    call([&] { ops_.set_watchdog(gpu_.get(), static_cast<pvgpu_u64>(std::max<Duration>(limit, 0))); });
}

Duration BackendGpu::busy_time() const {
    return call([&] { return static_cast<Duration>(ops_.busy_ns(gpu_.get())); });
}

std::uint64_t BackendGpu::context_switches() const {
    return call([&] { return std::uint64_t{ops_.context_switches(gpu_.get())}; });
}

namespace {

// The library at `path` and its table.
std::pair<BackendGpu::Library, const pvgpu_backend_ops*> load_library(const std::string& path) {
    if (path.find('/') == std::string::npos)
        throw BackendError("unknown backend '" + path +
                           "': 'sim' or the path of a backend library (/path/to/libpvgpu-backend-NAME.so)");
    BackendGpu::Library lib(dlopen(path.c_str(), RTLD_NOW | RTLD_LOCAL));
    if (!lib) {
        const char* why = dlerror();
        throw BackendError("cannot load backend " + path + ": " + (why ? why : "dlopen failed"));
    }
    dlerror();
    void* sym = dlsym(lib.get(), PVGPU_BACKEND_ENTRY_SYMBOL);
    if (!sym)
        throw BackendError("backend " + path + " is not a pvgpu backend: it has no symbol " +
                           PVGPU_BACKEND_ENTRY_SYMBOL);
    const auto entry = reinterpret_cast<pvgpu_backend_entry_fn>(sym);
    const pvgpu_backend_ops* ops = entry(PVGPU_BACKEND_ABI_VERSION);
    return {std::move(lib), ops};
}

}  // namespace

std::unique_ptr<BackendGpu> open_backend(const std::string& backend, const std::vector<std::string>& options,
                                         const Clock& clock, Timers& timers, BackendHooks hooks) {
    BackendGpu::Library lib;
    const pvgpu_backend_ops* ops = nullptr;
    if (backend == "sim")
        ops = pvgpu_sim_backend_entry(PVGPU_BACKEND_ABI_VERSION);
    else
        std::tie(lib, ops) = load_library(backend);
    const pvgpu_backend_ops& checked = check_table(backend, ops);
    auto gpu = std::make_unique<BackendGpu>(BackendGpu::Key{}, std::move(lib), checked, backend, clock, timers,
                                            std::move(hooks));
    gpu->open(options);
    return gpu;
}

}  // namespace pvgpu
