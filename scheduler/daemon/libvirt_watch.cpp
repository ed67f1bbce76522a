#include "libvirt_watch.hpp"

#include <libvirt/libvirt.h>
#include <libvirt/virterror.h>
#include <pvgpu/abi.h>
#include <sys/eventfd.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <chrono>
#include <condition_variable>
#include <cstring>
#include <deque>
#include <fstream>
#include <mutex>
#include <stdexcept>
#include <thread>

#include "proto/unique_fd.hpp"
#include "virt.hpp"

namespace pvgpu::daemon {

namespace {

using SteadyClock = std::chrono::steady_clock;

constexpr unsigned kBackoffFirstMs = 500;
constexpr unsigned kBackoffMaxMs = 30000;
// How long the destructor waits for a worker that is inside a libvirt call
// (a metadata write, say) before leaving it to the process' exit.
constexpr auto kWorkerExitWait = std::chrono::seconds(2);

// libvirt's event loop (RPC replies, keepalive, domain events), one per
// process: libvirt takes one event implementation for good.  Its thread
// runs nothing but libvirt's dispatch, which never waits for libvirtd, so it
// always stops when asked.
class EventLoopThread {
public:
    static void ensure() { static EventLoopThread loop; }

private:
    EventLoopThread() {
        if (virEventRegisterDefaultImpl() < 0)
            throw std::runtime_error(std::string("libvirt: no event loop: ") + virGetLastErrorMessage());
        thread_ = std::thread([this] {
            while (!stop_.load())
                if (virEventRunDefaultImpl() < 0) {
                    log_error("libvirt: event loop failed: ", virGetLastErrorMessage(),
                              "; domain events and keepalive stop");
                    return;
                }
        });
    }
    ~EventLoopThread() {
        stop_ = true;
        // A timer due at once wakes the loop, which then sees stop_.
        const int wake = virEventAddTimeout(0, [](int, void*) {}, nullptr, nullptr);
        if (wake >= 0) {
            thread_.join();
            virEventRemoveTimeout(wake);
        } else {
            thread_.detach();
        }
    }
    std::atomic<bool> stop_{false};
    std::thread thread_;
};

pid_t read_pid_file(const std::string& path) {
    std::ifstream f(path);
    long pid = 0;
    if (!(f >> pid) || pid <= 0) return 0;
    return static_cast<pid_t>(pid);
}

std::int64_t steady_ns() {
    return std::chrono::duration_cast<std::chrono::nanoseconds>(SteadyClock::now().time_since_epoch()).count();
}

}  // namespace

class Worker;
using Job = std::function<void(Worker&)>;
using Result = std::function<void(LibvirtWatch::Impl&)>;

// What the loop and the worker share; the worker holds it too, so a worker
// left inside a libvirt call at shutdown never touches freed memory.
struct Shared {
    explicit Shared(LibvirtConfig c) : cfg(std::move(c)) {}
    const LibvirtConfig cfg;
    std::mutex m;
    std::condition_variable cv;        // jobs or stop for the worker; `exited` for the loop
    std::deque<Job> jobs;              // for the worker
    std::deque<Result> results;        // for the loop
    bool stop = false;
    bool exited = false;
    UniqueFd wake{eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC)};  // readable: results wait
    // When the libvirt call under way began (steady ns); 0: none.
    std::atomic<std::int64_t> busy_since{0};

    void push_job(Job j) {
        {
            std::lock_guard lk(m);
            jobs.push_back(std::move(j));
        }
        cv.notify_all();
    }
    void post(Result r) {
        {
            std::lock_guard lk(m);
            results.push_back(std::move(r));
        }
        const std::uint64_t one = 1;
        (void)!::write(wake.get(), &one, sizeof one);
    }
};

// libvirt's callbacks get a reference of their own: freed by libvirt once
// the callback can no longer run.
struct CallbackRef {
    std::shared_ptr<Shared> sh;
    static void* make(const std::shared_ptr<Shared>& s) { return new CallbackRef{s}; }  // NOLINT: libvirt frees
    static void release(void* p) { delete static_cast<CallbackRef*>(p); }                // NOLINT
    static Shared& of(void* p) { return *static_cast<CallbackRef*>(p)->sh; }
};

// The loop's side: what pvgpud knows of libvirt, and the callers waiting.
struct LibvirtWatch::Impl {
    enum class Link { Connecting, Up, Down };

    Impl(GMainContext* c, LibvirtConfig cfg, Listener& l);
    ~Impl();

    // What the worker reported (run on the loop).
    void on_link(Link now, const std::string& why);
    void on_resync(std::map<std::string, DomainInfo> all);
    void on_answer(const std::string& uuid, const DomainAnswer& a);
    // Why a caller cannot wait for libvirt now; nullopt: it may.
    std::optional<std::string> unreachable() const;
    void drain_results();

    // Calls the loop waits on: each `done` runs once, with the worker's
    // answer or, after kLibvirtCallTimeout, with the answer given for late.
    template <class Answer>
    struct Pending {
        std::function<void(const Answer&)> done;
        Source timeout;
    };
    template <class Answer>
    using Calls = std::map<std::uint64_t, Pending<Answer>>;
    template <class Answer>
    std::uint64_t open_call(Calls<Answer>& calls, std::function<void(const Answer&)> done,
                            Answer (*late)(const std::string& why));
    template <class Answer>
    static void finish(Calls<Answer>& calls, std::uint64_t id, const Answer& a);
    GMainContext* ctx;
    Listener& listener;
    std::shared_ptr<Shared> sh;
    FdWatch results_watch;
    std::thread worker;
    Link link = Link::Connecting;
    std::string down_why;
    std::map<std::string, DomainInfo> running;  // by UUID
    std::set<std::string> known;                // UUIDs of every domain with pvgpu libvirt named
    Calls<DomainAnswer> lookups;
    Calls<WeightWrite> writes;
    std::uint64_t next_id = 1;
};

// The worker thread's side: the connection and every libvirt call.
class Worker {
public:
    explicit Worker(std::shared_ptr<Shared> sh) : sh_(std::move(sh)) {}

    void run() {
        std::unique_lock lk(sh_->m);
        while (!sh_->stop) {
            if (!conn_ && SteadyClock::now() >= next_connect_) {
                lk.unlock();
                guarded("libvirt connect", [&] { connect(); });
                // Whatever went wrong, the next try waits for the backoff.
                if (!conn_ && SteadyClock::now() >= next_connect_) retry_later("connect failed");
                lk.lock();
                continue;
            }
            if (sh_->jobs.empty()) {
                if (conn_) sh_->cv.wait(lk);
                else sh_->cv.wait_until(lk, next_connect_);  // the backoff's deadline, or a job
                continue;
            }
            Job job = std::move(sh_->jobs.front());
            sh_->jobs.pop_front();
            lk.unlock();
            guarded("libvirt worker", [&] { job(*this); });
            lk.lock();
        }
        lk.unlock();
        disconnect();
        {
            std::lock_guard g(sh_->m);
            sh_->exited = true;
        }
        sh_->cv.notify_all();
    }

    DomainAnswer ask(const std::string& uuid);
    WeightWrite write_weight(const std::string& target, std::uint32_t weight);
    // A domain event named `uuid`: what it is now, for the loop.
    void refresh(const std::string& uuid) {
        if (!conn_) return;
        DomainAnswer a = ask(uuid);
        sh_->post([uuid, a](LibvirtWatch::Impl& l) { l.on_answer(uuid, a); });
    }
    void lost(int reason);
    void post(Result r) { sh_->post(std::move(r)); }

private:
    // Marks a libvirt call under way, for the loop's "not answering" check.
    struct Busy {
        explicit Busy(Shared& s) : sh(s) { sh.busy_since = steady_ns(); }
        ~Busy() { sh.busy_since = 0; }
        Busy(const Busy&) = delete;
        Busy& operator=(const Busy&) = delete;
        Shared& sh;
    };

    void connect();
    void disconnect();
    void resync();
    std::optional<DomainInfo> describe(virDomainPtr dom, bool running);
    void retry_later(const std::string& why);
    void link(LibvirtWatch::Impl::Link now, const std::string& why = {}) {
        sh_->post([now, why](LibvirtWatch::Impl& l) { l.on_link(now, why); });
    }

    static int on_lifecycle(virConnectPtr, virDomainPtr dom, int, int, void* opaque) {
        mark(dom, opaque);
        return 0;
    }
    static void on_metadata(virConnectPtr, virDomainPtr dom, int type, const char* nsuri, void* opaque) {
        if (type != VIR_DOMAIN_METADATA_ELEMENT || !nsuri || std::string(nsuri) != virt::kMetadataNamespace) return;
        mark(dom, opaque);
    }
    // On libvirt's event thread: the work goes to the worker.
    static void mark(virDomainPtr dom, void* opaque) {
        char buf[VIR_UUID_STRING_BUFLEN];
        if (virDomainGetUUIDString(dom, buf) < 0) return;
        std::string uuid = buf;
        CallbackRef::of(opaque).push_job([uuid](Worker& w) { w.refresh(uuid); });
    }
    static void on_close(virConnectPtr, int reason, void* opaque) {
        CallbackRef::of(opaque).push_job([reason](Worker& w) { w.lost(reason); });
    }

    std::shared_ptr<Shared> sh_;
    virt::Connection conn_;
    int lifecycle_cb_ = -1, metadata_cb_ = -1;
    bool close_cb_ = false;
    unsigned backoff_ms_ = kBackoffFirstMs;
    bool warned_ = false;
    SteadyClock::time_point next_connect_{};
};

// ---- the worker ------------------------------------------------------------

void Worker::connect() {
    link(LibvirtWatch::Impl::Link::Connecting);
    try {
        Busy busy(*sh_);
        conn_ = virt::open(sh_->cfg.uri);
    } catch (const virt::VirtError& e) {
        retry_later(e.what());
        return;
    }
    Busy busy(*sh_);
    if (virConnectSetKeepAlive(conn_.get(), 5, 3) < 0) log_debug("libvirt: no keepalive on ", sh_->cfg.uri);
    close_cb_ = virConnectRegisterCloseCallback(conn_.get(), on_close, CallbackRef::make(sh_), CallbackRef::release) == 0;
    lifecycle_cb_ = virConnectDomainEventRegisterAny(conn_.get(), nullptr, VIR_DOMAIN_EVENT_ID_LIFECYCLE,
                                                     VIR_DOMAIN_EVENT_CALLBACK(on_lifecycle), CallbackRef::make(sh_),
                                                     CallbackRef::release);
    metadata_cb_ = virConnectDomainEventRegisterAny(conn_.get(), nullptr, VIR_DOMAIN_EVENT_ID_METADATA_CHANGE,
                                                    VIR_DOMAIN_EVENT_CALLBACK(on_metadata), CallbackRef::make(sh_),
                                                    CallbackRef::release);
    if (lifecycle_cb_ < 0 || metadata_cb_ < 0) {
        const std::string why = std::string("cannot register domain events: ") + virGetLastErrorMessage();
        disconnect();
        retry_later(why);
        return;
    }
    log_info("libvirt: following domains on ", sh_->cfg.uri);
    warned_ = false;
    backoff_ms_ = kBackoffFirstMs;
    resync();
    link(LibvirtWatch::Impl::Link::Up);
}

void Worker::retry_later(const std::string& why) {
    if (!warned_)
        log_warning("libvirt: ", why, "; retrying (backoff up to ", kBackoffMaxMs / 1000,
                    " s), VMs run at their pvgpud weights meanwhile");
    else
        log_debug("libvirt: ", why);
    warned_ = true;
    link(LibvirtWatch::Impl::Link::Down, why);
    next_connect_ = SteadyClock::now() + std::chrono::milliseconds(backoff_ms_);
    backoff_ms_ = std::min(backoff_ms_ * 2, kBackoffMaxMs);
}

void Worker::disconnect() {
    if (!conn_) return;
    if (lifecycle_cb_ >= 0) virConnectDomainEventDeregisterAny(conn_.get(), lifecycle_cb_);
    if (metadata_cb_ >= 0) virConnectDomainEventDeregisterAny(conn_.get(), metadata_cb_);
    if (close_cb_) virConnectUnregisterCloseCallback(conn_.get(), on_close);
    lifecycle_cb_ = metadata_cb_ = -1;
    close_cb_ = false;
    conn_.reset();
}

void Worker::lost(int reason) {
    if (!conn_) return;
    disconnect();
    backoff_ms_ = kBackoffFirstMs;
    warned_ = false;
    retry_later("connection to " + sh_->cfg.uri + " lost (reason " + std::to_string(reason) + ")");
}

// Every domain with pvgpu, again: after a (re)connect nothing is assumed.
void Worker::resync() {
    virDomainPtr* doms = nullptr;
    const int n = virConnectListAllDomains(conn_.get(), &doms, 0);
    if (n < 0) {
        log_warning("libvirt: cannot list domains: ", virGetLastErrorMessage());
        return;
    }
    std::map<std::string, DomainInfo> all;
    std::set<std::string> active;
    for (int i = 0; i < n; ++i) {
        virt::Domain d(doms[i]);
        const bool running = virDomainIsActive(d.get()) == 1;
        try {
            if (auto info = describe(d.get(), running)) {
                all[info->uuid] = *info;
                if (running) active.insert(info->uuid);
            }
        } catch (const std::exception& e) {
            log_debug("libvirt: ", e.what());
        }
    }
    free(doms);  // NOLINT: allocated by libvirt
    // Stopped domains go with pid -1: known, not running.
    for (auto& [uuid, info] : all)
        if (!active.count(uuid)) info.pid = -1;
    sh_->post([all = std::move(all)](LibvirtWatch::Impl& l) mutable { l.on_resync(std::move(all)); });
}

// nullopt: not a pvgpu domain (neither the metadata nor the device).
// Throws when libvirt fails: "cannot tell" is not "no".
std::optional<DomainInfo> Worker::describe(virDomainPtr dom, bool running) {
    DomainInfo d;
    d.uuid = virt::uuid_of(dom);
    d.name = virt::name_of(dom);
    d.weight = PVGPU_WEIGHT_DEFAULT;
    bool pvgpu = false;
    const unsigned flags = running ? VIR_DOMAIN_AFFECT_LIVE : VIR_DOMAIN_AFFECT_CONFIG;
    try {
        if (auto m = virt::read_gpu_metadata(dom, flags)) {
            d.weight = m->weight;
            d.gpu = m->device;
            pvgpu = true;
        }
    } catch (const virt::XmlError& e) {
        d.metadata_error = e.what();
        pvgpu = true;
    }
    if (!pvgpu) {
        std::unique_ptr<char, decltype(&free)> xml(virDomainGetXMLDesc(dom, running ? 0 : VIR_DOMAIN_XML_INACTIVE),
                                                   free);
        if (!xml) virt::fail("domain " + d.name);
        pvgpu = virt::has_device(xml.get());
    }
    if (!pvgpu) return std::nullopt;
    if (running) d.pid = read_pid_file(sh_->cfg.pid_dir + "/" + d.name + ".pid");
    return d;
}

DomainAnswer Worker::ask(const std::string& uuid) {
    DomainAnswer a;
    if (!conn_) {
        a.why = "not connected to " + sh_->cfg.uri;
        return a;
    }
    Busy busy(*sh_);
    try {
        virt::Domain dom(virDomainLookupByUUIDString(conn_.get(), uuid.c_str()));
        if (!dom) {
            virErrorPtr e = virGetLastError();
            if (e && e->code == VIR_ERR_NO_DOMAIN) {
                a.kind = DomainAnswer::Kind::None;
                return a;
            }
            virt::fail("lookup of " + uuid);
        }
        const int active = virDomainIsActive(dom.get());
        if (active < 0) virt::fail("domain " + uuid);
        if (auto info = describe(dom.get(), active == 1)) {
            a.kind = active == 1 ? DomainAnswer::Kind::Running : DomainAnswer::Kind::Stopped;
            a.info = *info;
        } else {
            a.kind = DomainAnswer::Kind::None;
        }
    } catch (const std::exception& e) {
        a.kind = DomainAnswer::Kind::Unreachable;
        a.why = e.what();
    }
    return a;
}

WeightWrite Worker::write_weight(const std::string& target, std::uint32_t weight) {
    WeightWrite w;
    if (!conn_) {
        w.why = "not connected to " + sh_->cfg.uri;
        return w;
    }
    Busy busy(*sh_);
    try {
        auto uuid = virt::set_domain_weight(conn_.get(), target, weight);
        w.kind = uuid ? WeightWrite::Kind::Written : WeightWrite::Kind::NotDomain;
        if (uuid) w.uuid = *uuid;
    } catch (const std::exception& e) {
        w.kind = WeightWrite::Kind::Failed;
        w.why = e.what();
    }
    return w;
}

// ---- the loop's side -------------------------------------------------------

LibvirtWatch::Impl::Impl(GMainContext* c, LibvirtConfig cfg, Listener& l)
    : ctx(c), listener(l), sh(std::make_shared<Shared>(std::move(cfg))) {
    if (!sh->wake) throw std::runtime_error(std::string("libvirt: eventfd: ") + std::strerror(errno));
    EventLoopThread::ensure();
    results_watch = FdWatch(ctx, sh->wake.get(), G_IO_IN, [this](GIOCondition) { drain_results(); });
    worker = std::thread([s = sh] { Worker(s).run(); });
}

LibvirtWatch::Impl::~Impl() {
    results_watch.reset();  // nothing the worker still posts runs
    std::unique_lock lk(sh->m);
    sh->stop = true;
    sh->cv.notify_all();
    if (sh->cv.wait_for(lk, kWorkerExitWait, [this] { return sh->exited; })) {
        lk.unlock();
        worker.join();
        return;
    }
    lk.unlock();
    // libvirt cannot cancel a call: the worker holds the shared state, and
    // ends with the process.
    log_warning("libvirt: a call to ", sh->cfg.uri, " has not returned; leaving it behind");
    worker.detach();
}

void LibvirtWatch::Impl::drain_results() {
    std::uint64_t n = 0;
    (void)!::read(sh->wake.get(), &n, sizeof n);
    std::deque<Result> todo;
    {
        std::lock_guard lk(sh->m);
        todo.swap(sh->results);
    }
    for (auto& r : todo) guarded("libvirt result", [&] { r(*this); });
}

std::optional<std::string> LibvirtWatch::Impl::unreachable() const {
    if (link == Link::Down) return "libvirt at " + sh->cfg.uri + " is not reachable (" + down_why + ")";
    const std::int64_t since = sh->busy_since.load();
    const auto limit = std::chrono::duration_cast<std::chrono::nanoseconds>(
        std::chrono::milliseconds(kLibvirtCallTimeout / kMillisecond));
    if (since != 0 && steady_ns() - since > limit.count())
        return "libvirt at " + sh->cfg.uri + " has not answered for " +
               std::to_string((steady_ns() - since) / 1'000'000'000) + " s";
    return std::nullopt;
}

void LibvirtWatch::Impl::on_link(Link now, const std::string& why) {
    link = now;
    down_why = why;
}

void LibvirtWatch::Impl::on_resync(std::map<std::string, DomainInfo> all) {
    std::map<std::string, DomainInfo> up;
    std::vector<const DomainInfo*> stopped;
    for (auto& [uuid, info] : all) {
        known.insert(uuid);
        if (info.pid >= 0) up[uuid] = info;
        else stopped.push_back(&info);
    }
    for (const auto& [uuid, old] : running)
        if (!up.count(uuid)) listener.domain_down(uuid, old.name);
    running = up;
    for (const auto& [uuid, info] : running) listener.domain_up(info);
    for (const DomainInfo* d : stopped) listener.domain_not_running(d->uuid, d->name);
    log_debug("libvirt: ", all.size(), " domains with pvgpu, ", running.size(), " running");
}

void LibvirtWatch::Impl::on_answer(const std::string& uuid, const DomainAnswer& a) {
    using K = DomainAnswer::Kind;
    if (a.kind == K::Unreachable) return;  // nothing learnt
    if (a.kind == K::None) known.erase(uuid);
    else known.insert(uuid);
    if (a.kind == K::Running) {
        running[uuid] = a.info;
        listener.domain_up(a.info);
    } else if (auto old = running.find(uuid); old != running.end()) {
        const std::string name = old->second.name;
        running.erase(old);
        listener.domain_down(uuid, name);
    }
    if (a.kind == K::Stopped) listener.domain_not_running(uuid, a.info.name);
}

template <class Answer>
std::uint64_t LibvirtWatch::Impl::open_call(Calls<Answer>& calls, std::function<void(const Answer&)> done,
                                            Answer (*late)(const std::string& why)) {
    const std::uint64_t id = next_id++;
    auto& p = calls[id];
    p.done = std::move(done);
    const unsigned ms = static_cast<unsigned>(kLibvirtCallTimeout / kMillisecond);
    p.timeout = add_timeout(ctx, ms, [this, &calls, id, late, ms] {
        finish(calls, id, late("libvirt at " + sh->cfg.uri + " did not answer within " + std::to_string(ms) + " ms"));
        return false;
    });
    return id;
}

template <class Answer>
void LibvirtWatch::Impl::finish(Calls<Answer>& calls, std::uint64_t id, const Answer& a) {
    auto it = calls.find(id);
    if (it == calls.end()) return;  // answered already (timed out)
    auto done = std::move(it->second.done);
    calls.erase(it);
    done(a);
}

LibvirtWatch::LibvirtWatch(GMainContext* ctx, LibvirtConfig cfg, Listener& listener)
    : impl_(std::make_unique<Impl>(ctx, std::move(cfg), listener)) {}

LibvirtWatch::~LibvirtWatch() = default;

bool LibvirtWatch::connected() const { return impl_->link == Impl::Link::Up; }

bool LibvirtWatch::knows(const std::string& uuid) const { return impl_->known.count(uuid) != 0; }

void LibvirtWatch::lookup(const std::string& uuid, std::function<void(const DomainAnswer&)> done) {
    Impl& l = *impl_;
    if (auto it = l.running.find(uuid); it != l.running.end() && it->second.pid > 0) {
        done(DomainAnswer{DomainAnswer::Kind::Running, it->second, {}});
        return;
    }
    if (auto why = l.unreachable()) {
        done(DomainAnswer{DomainAnswer::Kind::Unreachable, {}, *why});
        return;
    }
    const std::uint64_t id = l.open_call<DomainAnswer>(l.lookups, std::move(done), [](const std::string& why) {
        return DomainAnswer{DomainAnswer::Kind::Unreachable, {}, why};
    });
    l.sh->push_job([uuid, id](Worker& w) {
        DomainAnswer a = w.ask(uuid);
        w.post([uuid, id, a](Impl& impl) {
            impl.on_answer(uuid, a);
            Impl::finish(impl.lookups, id, a);
        });
    });
}

void LibvirtWatch::set_weight(const std::string& target, std::uint32_t weight,
                              std::function<void(const WeightWrite&)> done) {
    Impl& l = *impl_;
    if (auto why = l.unreachable()) {
        done(WeightWrite{WeightWrite::Kind::Unreachable, {}, *why});
        return;
    }
    const std::uint64_t id = l.open_call<WeightWrite>(l.writes, std::move(done), [](const std::string& why) {
        return WeightWrite{WeightWrite::Kind::Unreachable, {}, why};
    });
    l.sh->push_job([target, weight, id](Worker& w) {
        WeightWrite r = w.write_weight(target, weight);
        w.post([id, r](Impl& impl) { Impl::finish(impl.writes, id, r); });
    });
}

}  // namespace pvgpu::daemon
