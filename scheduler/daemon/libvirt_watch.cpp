#include "libvirt_watch.hpp"

#include <libvirt/libvirt.h>
#include <libvirt/virterror.h>
#include <pvgpu/abi.h>

#include <fstream>
#include <functional>
#include <stdexcept>

#include "virt.hpp"

namespace pvgpu::daemon {

// ---- libvirt's event API on a GLib main context ----------------------------
//
// libvirt needs an event loop for its connection (RPC replies, keepalive,
// domain events).  Implementing its six callbacks on the daemon's context
// keeps everything on the main thread: no lock is shared with libvirt.
namespace {

struct EventHandle {
    int fd;
    int events;  // VIR_EVENT_HANDLE_*
    virEventHandleCallback cb;
    void* opaque;
    virFreeCallback ff;
    FdWatch watch;
};
struct EventTimeout {
    int interval_ms;  // -1 off, 0 every loop iteration
    virEventTimeoutCallback cb;
    void* opaque;
    virFreeCallback ff;
    Source src;
};

GMainContext* g_event_ctx = nullptr;
std::map<int, std::unique_ptr<EventHandle>> g_handles;
std::map<int, std::unique_ptr<EventTimeout>> g_timeouts;
int g_next_event_id = 1;

// libvirt wants free callbacks run after removal returns, never inside it.
void defer_free(virFreeCallback ff, void* opaque) {
    if (!ff) return;
    struct Pending {
        virFreeCallback ff;
        void* opaque;
    };
    GSource* s = g_idle_source_new();
    g_source_set_callback(
        s,
        [](gpointer p) -> gboolean {
            auto* pending = static_cast<Pending*>(p);
            pending->ff(pending->opaque);
            return G_SOURCE_REMOVE;
        },
        new Pending{ff, opaque},  // NOLINT: owned by GLib, freed below
        [](gpointer p) { delete static_cast<Pending*>(p); });  // NOLINT
    g_source_attach(s, g_event_ctx);
    g_source_unref(s);
}

void arm_handle(int id) {
    EventHandle& h = *g_handles.at(id);
    GIOCondition cond{};
    if (h.events & VIR_EVENT_HANDLE_READABLE) cond = static_cast<GIOCondition>(cond | G_IO_IN);
    if (h.events & VIR_EVENT_HANDLE_WRITABLE) cond = static_cast<GIOCondition>(cond | G_IO_OUT);
    if (h.events == 0) {
        h.watch.reset();  // FdWatch always reports HUP/ERR; libvirt asked for nothing
    } else if (h.watch) {
        h.watch.set_condition(cond);
    } else {
        h.watch = FdWatch(g_event_ctx, h.fd, cond, [id](GIOCondition got) {
            auto it = g_handles.find(id);
            if (it == g_handles.end()) return;
            EventHandle& e = *it->second;
            int ev = 0;
            if (got & G_IO_IN) ev |= VIR_EVENT_HANDLE_READABLE;
            if (got & G_IO_OUT) ev |= VIR_EVENT_HANDLE_WRITABLE;
            if (got & G_IO_ERR) ev |= VIR_EVENT_HANDLE_ERROR;
            if (got & G_IO_HUP) ev |= VIR_EVENT_HANDLE_HANGUP;
            ev &= e.events | VIR_EVENT_HANDLE_ERROR | VIR_EVENT_HANDLE_HANGUP;
            if (ev) e.cb(id, e.fd, ev, e.opaque);
        });
    }
}

int add_handle(int fd, int events, virEventHandleCallback cb, void* opaque, virFreeCallback ff) {
    const int id = g_next_event_id++;
    g_handles[id] = std::make_unique<EventHandle>(EventHandle{fd, events, cb, opaque, ff, {}});
    arm_handle(id);
    return id;
}

void update_handle(int id, int events) {
    auto it = g_handles.find(id);
    if (it == g_handles.end()) return;
    it->second->events = events;
    arm_handle(id);
}

int remove_handle(int id) {
    auto it = g_handles.find(id);
    if (it == g_handles.end()) return -1;
    defer_free(it->second->ff, it->second->opaque);
    g_handles.erase(it);  // a running dispatch keeps its GSource alive
    return 0;
}

void arm_timeout(int id) {
    EventTimeout& t = *g_timeouts.at(id);
    t.src.reset();
    if (t.interval_ms < 0) return;
    auto fire = [id] {
        auto it = g_timeouts.find(id);
        if (it == g_timeouts.end()) return false;
        it->second->cb(id, it->second->opaque);
        return true;  // until libvirt updates or removes it
    };
    t.src = t.interval_ms == 0 ? add_idle(g_event_ctx, fire)
                               : add_timeout(g_event_ctx, static_cast<unsigned>(t.interval_ms), fire);
}

int add_timeout_cb(int interval_ms, virEventTimeoutCallback cb, void* opaque, virFreeCallback ff) {
    const int id = g_next_event_id++;
    g_timeouts[id] = std::make_unique<EventTimeout>(EventTimeout{interval_ms, cb, opaque, ff, {}});
    arm_timeout(id);
    return id;
}

void update_timeout(int id, int interval_ms) {
    auto it = g_timeouts.find(id);
    if (it == g_timeouts.end()) return;
    it->second->interval_ms = interval_ms;
    arm_timeout(id);
}

int remove_timeout(int id) {
    auto it = g_timeouts.find(id);
    if (it == g_timeouts.end()) return -1;
    defer_free(it->second->ff, it->second->opaque);
    g_timeouts.erase(it);
    return 0;
}

// libvirt takes one event implementation per process, for good.  A later
// daemon in the same process (tests) may take it over once nothing is
// registered on the old context any more.
void register_event_impl(GMainContext* ctx) {
    static bool registered = false;
    if (g_event_ctx == ctx) return;
    if (!g_handles.empty() || !g_timeouts.empty())
        throw std::logic_error("libvirt's event loop is still in use on another main context");
    g_event_ctx = ctx;
    if (!registered)
        virEventRegisterImpl(add_handle, update_handle, remove_handle, add_timeout_cb, update_timeout, remove_timeout);
    registered = true;
}

pid_t read_pid_file(const std::string& path) {
    std::ifstream f(path);
    long pid = 0;
    if (!(f >> pid) || pid <= 0) return 0;
    return static_cast<pid_t>(pid);
}

constexpr unsigned kBackoffFirstMs = 500;
constexpr unsigned kBackoffMaxMs = 30000;

}  // namespace

// ---- the watcher ---------------------------------------------------------

struct LibvirtWatch::Impl {
    GMainContext* ctx;
    LibvirtConfig cfg;
    Listener& listener;
    virt::Connection conn;
    int lifecycle_cb = -1, metadata_cb = -1;
    std::map<std::string, DomainInfo> running;  // by UUID
    std::set<std::string> dirty;                 // UUIDs to look at again
    Source work;                                 // processes `dirty` outside libvirt's callbacks
    Source retry;
    unsigned backoff_ms = kBackoffFirstMs;
    bool warned = false;
    bool lost = false;

    Impl(GMainContext* c, LibvirtConfig conf, Listener& l) : ctx(c), cfg(std::move(conf)), listener(l) {}

    ~Impl() { disconnect(); }

    void disconnect() {
        if (!conn) return;
        if (lifecycle_cb >= 0) virConnectDomainEventDeregisterAny(conn.get(), lifecycle_cb);
        if (metadata_cb >= 0) virConnectDomainEventDeregisterAny(conn.get(), metadata_cb);
        virConnectUnregisterCloseCallback(conn.get(), on_close);
        lifecycle_cb = metadata_cb = -1;
        conn.reset();
    }

    void connect() {
        try {
            conn = virt::open(cfg.uri);
        } catch (const virt::VirtError& e) {
            if (!warned)
                log_warning("libvirt: ", e.what(), "; retrying (backoff up to ", kBackoffMaxMs / 1000,
                            " s), VMs run at their pvgpud weights meanwhile");
            else
                log_debug("libvirt: ", e.what());
            warned = true;
            schedule_retry();
            return;
        }
        if (virConnectSetKeepAlive(conn.get(), 5, 3) < 0) log_debug("libvirt: no keepalive on ", cfg.uri);
        virConnectRegisterCloseCallback(conn.get(), on_close, this, nullptr);
        lifecycle_cb = virConnectDomainEventRegisterAny(conn.get(), nullptr, VIR_DOMAIN_EVENT_ID_LIFECYCLE,
                                                        VIR_DOMAIN_EVENT_CALLBACK(on_lifecycle), this, nullptr);
        metadata_cb = virConnectDomainEventRegisterAny(conn.get(), nullptr, VIR_DOMAIN_EVENT_ID_METADATA_CHANGE,
                                                       VIR_DOMAIN_EVENT_CALLBACK(on_metadata), this, nullptr);
        if (lifecycle_cb < 0 || metadata_cb < 0) {
            log_warning("libvirt: cannot register domain events on ", cfg.uri, "; retrying");
            disconnect();
            schedule_retry();
            return;
        }
        log_info("libvirt: following domains on ", cfg.uri);
        warned = false;
        backoff_ms = kBackoffFirstMs;
        resync();
    }

    void schedule_retry() {
        const unsigned ms = backoff_ms;
        backoff_ms = std::min(backoff_ms * 2, kBackoffMaxMs);
        retry = add_timeout(ctx, ms, [this] {
            connect();
            return false;
        });
    }

    // Every running domain, again: after a (re)connect nothing is assumed.
    void resync() {
        virDomainPtr* doms = nullptr;
        const int n = virConnectListAllDomains(conn.get(), &doms, VIR_CONNECT_LIST_DOMAINS_ACTIVE);
        if (n < 0) {
            log_warning("libvirt: cannot list domains: ", virGetLastErrorMessage());
            return;
        }
        std::map<std::string, DomainInfo> now;
        for (int i = 0; i < n; ++i) {
            virt::Domain d(doms[i]);
            if (auto info = describe(d.get())) now[info->uuid] = *info;
        }
        free(doms);  // NOLINT: allocated by libvirt
        for (const auto& [uuid, old] : running)
            if (!now.count(uuid)) listener.domain_down(uuid, old.name);
        running = now;
        for (const auto& [uuid, info] : running) listener.domain_up(info);
        log_debug("libvirt: ", running.size(), " running domains with pvgpu");
    }

    // nullopt: not a pvgpu domain (neither the metadata nor the device).
    std::optional<DomainInfo> describe(virDomainPtr dom) {
        DomainInfo d;
        try {
            d.uuid = virt::uuid_of(dom);
            d.name = virt::name_of(dom);
            d.weight = PVGPU_WEIGHT_DEFAULT;
            bool pvgpu = false;
            try {
                if (auto m = virt::read_gpu_metadata(dom, VIR_DOMAIN_AFFECT_LIVE)) {
                    d.weight = m->weight;
                    d.gpu = m->device;
                    pvgpu = true;
                }
            } catch (const virt::XmlError& e) {
                d.metadata_error = e.what();
                pvgpu = true;
            }
            if (!pvgpu) {
                std::unique_ptr<char, decltype(&free)> xml(virDomainGetXMLDesc(dom, 0), free);
                pvgpu = xml && virt::has_device(xml.get());
            }
            if (!pvgpu) return std::nullopt;
        } catch (const std::exception& e) {
            log_debug("libvirt: ", e.what());
            return std::nullopt;
        }
        d.pid = read_pid_file(cfg.pid_dir + "/" + d.name + ".pid");
        return d;
    }

    // The running pvgpu domain of that UUID, asked of libvirt now.
    std::optional<DomainInfo> lookup(const std::string& uuid) {
        if (!conn) return std::nullopt;
        virt::Domain dom(virDomainLookupByUUIDString(conn.get(), uuid.c_str()));
        if (!dom || virDomainIsActive(dom.get()) != 1) return std::nullopt;
        return describe(dom.get());
    }

    void refresh(const std::string& uuid) {
        if (!conn) return;
        std::optional<DomainInfo> info = lookup(uuid);
        auto old = running.find(uuid);
        if (info) {
            running[uuid] = *info;
            listener.domain_up(*info);
        } else if (old != running.end()) {
            const std::string name = old->second.name;
            running.erase(old);
            listener.domain_down(uuid, name);
        }
    }

    void mark(virDomainPtr dom) {
        char buf[VIR_UUID_STRING_BUFLEN];
        if (virDomainGetUUIDString(dom, buf) < 0) return;
        dirty.insert(buf);
        if (!work) work = add_idle(ctx, [this] {
            auto todo = std::move(dirty);
            dirty.clear();
            for (const auto& uuid : todo) refresh(uuid);
            return false;
        });
    }

    static int on_lifecycle(virConnectPtr, virDomainPtr dom, int, int, void* opaque) {
        guarded("libvirt lifecycle event", [&] { static_cast<Impl*>(opaque)->mark(dom); });
        return 0;
    }

    static void on_metadata(virConnectPtr, virDomainPtr dom, int type, const char* nsuri, void* opaque) {
        if (type != VIR_DOMAIN_METADATA_ELEMENT || !nsuri || std::string(nsuri) != virt::kMetadataNamespace) return;
        guarded("libvirt metadata event", [&] { static_cast<Impl*>(opaque)->mark(dom); });
    }

    static void on_close(virConnectPtr, int reason, void* opaque) {
        auto* self = static_cast<Impl*>(opaque);
        if (self->lost) return;
        self->lost = true;
        log_warning("libvirt: connection to ", self->cfg.uri, " lost (reason ", reason, "); reconnecting");
        // Not from inside libvirt's callback: it still holds the connection.
        self->retry = add_idle(self->ctx, [self] {
            self->disconnect();
            self->lost = false;
            self->backoff_ms = kBackoffFirstMs;
            self->schedule_retry();
            return false;
        });
    }
};

LibvirtWatch::LibvirtWatch(GMainContext* ctx, LibvirtConfig cfg, Listener& listener)
    : impl_(std::make_unique<Impl>(ctx, std::move(cfg), listener)) {
    register_event_impl(ctx);
    impl_->connect();
}

LibvirtWatch::~LibvirtWatch() = default;

bool LibvirtWatch::connected() const { return impl_->conn != nullptr; }

std::optional<DomainInfo> LibvirtWatch::domain(const std::string& uuid) {
    if (auto it = impl_->running.find(uuid); it != impl_->running.end() && it->second.pid > 0) return it->second;
    auto info = impl_->lookup(uuid);
    if (info) impl_->running[uuid] = *info;
    return info;
}

std::optional<std::string> LibvirtWatch::set_weight(const std::string& target, std::uint32_t weight) {
    if (!impl_->conn) return std::nullopt;
    return virt::set_domain_weight(impl_->conn.get(), target, weight);
}

std::optional<std::string> LibvirtIdentity::refuse(const ucred& peer, const std::string& uuid) const {
    auto d = watch_->domain(uuid);
    if (!d || d->pid <= 0 || d->pid == peer.pid) return std::nullopt;
    return "VM " + uuid + " is libvirt domain " + d->name + ": peer pid " + std::to_string(peer.pid) +
           " is not its QEMU (pid " + std::to_string(d->pid) + ")";
}

}  // namespace pvgpu::daemon
