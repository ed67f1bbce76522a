#include "daemon.hpp"

#include <poll.h>
#include <sys/random.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <chrono>
#include <cmath>
#include <csignal>
#include <cstdio>
#include <cstring>
#include <functional>
#include <vector>

#include "k8s_allocation.hpp"
#include "log.hpp"
#include "names.hpp"
#include "unix_socket.hpp"

namespace pvgpu::daemon {

using nlohmann::json;

namespace {

// 64 bits from the kernel's entropy pool.  getrandom(2) without flags
// blocks only until the pool is first initialised (early boot); a clock is
// no secret from a tenant, so it is only the last resort, mixed with what a
// tenant cannot see (the pid, the address of this stack), and logged.
std::uint64_t host_entropy() {
    std::uint64_t v = 0;
    ssize_t n;
    do n = getrandom(&v, sizeof v, 0);
    while (n < 0 && errno == EINTR);
    if (n == static_cast<ssize_t>(sizeof v)) return v;
    log_warning("getrandom: ", n < 0 ? std::strerror(errno) : "short read",
                "; seeding the accounting's looks from the clock, which a tenant may guess");
    const auto now = static_cast<std::uint64_t>(std::chrono::system_clock::now().time_since_epoch().count());
    return now ^ (static_cast<std::uint64_t>(getpid()) << 32) ^ reinterpret_cast<std::uintptr_t>(&v);
}

std::uint32_t wire_mode(ChannelMode m) {
    switch (m) {
    case ChannelMode::Direct: return PVGPU_MODE_DIRECT;
    case ChannelMode::Trapped: return PVGPU_MODE_TRAPPED;
    case ChannelMode::Shadowed: return PVGPU_MODE_SHADOWED;
    }
    return PVGPU_MODE_DIRECT;
}

// While work is in flight every channel's IB_PUT is re-read this often: the
// backstop for a store whose doorbell never came (the doorbell is the fast
// path).
constexpr Duration kPutScanPeriod = 20 * kMillisecond;

// Connections beyond max_clients are still accepted, to be refused at HELLO
// with PVGPU_E_LIMIT; beyond this many more they are dropped at once.
constexpr std::size_t kConnectionSlack = 64;

// How long a refused client's socket stays open for the peer to read its
// refusal, and how many may wait so at once (a flood of bad HELLOs costs
// that many descriptors at most).
constexpr Duration kLinger = 1 * kSecond;
constexpr std::size_t kMaxLingering = 64;

// A ratio that no leaf can be compared on (one got nothing) is reported as
// this rather than as a JSON-less infinity.
constexpr double kMaxUnfairness = 1e6;

double finite_or(double v, double cap) { return std::isfinite(v) ? std::min(v, cap) : cap; }

// A name free under the root: base, then base-<suffix>, then numbered.
std::string unique_root_name(const EntityTree& tree, const std::string& prefix, const std::string& base,
                             const std::string& suffix) {
    std::string name = base;
    for (int k = 1; tree.find_child(kRootEntity, prefix + name); ++k) {
        std::string s = "-" + suffix + (k > 1 ? "-" + std::to_string(k) : "");
        name = with_suffix(base, s, 64 - prefix.size());
    }
    return name;
}

// The peer's process, held so that its pid cannot name another one later:
// the kernel's own pidfd of the peer where it has one (SO_PEERPIDFD, Linux
// 6.5), else one opened now from the pid SO_PEERCRED recorded at connect.
UniqueFd peer_pidfd(int sock, pid_t pid) {
#ifndef SO_PEERPIDFD
    constexpr int SO_PEERPIDFD = 77;  // linux/socket.h, not yet in every libc
#endif
    int fd = -1;
    socklen_t len = sizeof fd;
    if (getsockopt(sock, SOL_SOCKET, SO_PEERPIDFD, &fd, &len) == 0 && fd >= 0) return UniqueFd(fd);
    if (pid <= 0) return {};
    return UniqueFd(static_cast<int>(syscall(SYS_pidfd_open, pid, 0)));
}

// A pidfd turns readable when its process exits.
bool pidfd_alive(int pidfd) {
    pollfd p{pidfd, POLLIN, 0};
    return ::poll(&p, 1, 0) == 0;
}

const PolicyInfo* find_policy(const std::string& name) {
    for (const auto& p : policy_catalog())
        if (p.name == name) return &p;
    return nullptr;
}

}  // namespace

Daemon::Daemon(Config cfg)
    : cfg_(std::move(cfg)),
      ctx_(g_main_context_new()),
      loop_(g_main_loop_new(ctx_.get(), FALSE)),
      timers_(ctx_.get()),
      mux_(ctx_.get()),
      store_(cfg_.state_dir),
      weights_(state_, [this] { save_state(); }) {
    started_ = clock_.now();
    // Completion notifiers are pipes: a write to one whose client closed
    // its end must be an EPIPE, not the end of pvgpud (main() does the same;
    // this covers every process that embeds the daemon, the fuzzer's too).
    std::signal(SIGPIPE, SIG_IGN);
    // Found out now rather than at the first set-weight.
    if (g_mkdir_with_parents(cfg_.state_dir.c_str(), 0755) != 0 || ::access(cfg_.state_dir.c_str(), W_OK) != 0)
        log_warning("state directory ", cfg_.state_dir, " is not writable (", std::strerror(errno),
                    "): weights set now will not survive a restart");
    auto loaded = store_.load();
    for (const auto& w : loaded.warnings) log_warning(w);
    state_ = std::move(loaded.state);

    std::vector<std::string> unknown_users;
    vmm_users_ = VmmUsers(cfg_.vmm_users, &unknown_users);
    for (const auto& u : unknown_users) log_warning("vmm_users: no such user '", u, "' (ignored)");

    open_gpus();
    accept_pause_.bind(timers_);
    linger_timer_.bind(timers_);
    scan_timer_.bind(timers_);

    listen_fd_ = listen_unix(cfg_.socket, cfg_.socket_mode, cfg_.socket_group);
    listen_watch_ =
        FdWatch(ctx_.get(), listen_fd_.get(), G_IO_IN, [this](GIOCondition) { accept_clients(); });
    try {
        AdminServer::Options ao;
        ao.path = cfg_.admin_socket;
        ao.mode = cfg_.admin_socket_mode;
        ao.socket_group = cfg_.socket_group;
        ao.admin_group = cfg_.admin_group;
        ao.max_clients = cfg_.limits.admin_max_clients;
        ao.max_clients_per_uid = cfg_.limits.admin_max_clients_per_uid;
        ao.reserved_clients = cfg_.limits.admin_reserved_clients;
        ao.requests_per_s = cfg_.limits.admin_requests_per_s;
        ao.idle_timeout = cfg_.limits.admin_idle_timeout;
        admin_ =
            std::make_unique<AdminServer>(ctx_.get(), clock_, timers_, ao, static_cast<AdminBackend&>(*this));
    } catch (...) {
        ::unlink(cfg_.socket.c_str());
        throw;
    }

    sigterm_ = add_signal(ctx_.get(), SIGTERM, [this] {
        log_info("SIGTERM: shutting down");
        quit();
    });
    sigint_ = add_signal(ctx_.get(), SIGINT, [this] {
        log_info("SIGINT: shutting down");
        quit();
    });
    if (!cfg_.metrics.textfile.empty()) {
        metrics_file_ = std::make_unique<TextfileExporter>(
            cfg_.metrics.textfile, cfg_.metrics.interval, clock_, timers_,
            [this] { return render_prometheus(admin_list(), admin_stats()); });
        log_info("metrics textfile ", cfg_.metrics.textfile, ", every ", cfg_.metrics.interval / kSecond, " s");
    }

    sighup_ = add_signal(ctx_.get(), SIGHUP, [] {
        log_info("SIGHUP: the configuration is read at start only; restart pvgpud to apply changes");
    });

    log_info("pvgpud ", PVGPU_VERSION, ": ", gpus_.size(), gpus_.size() == 1 ? " GPU" : " GPUs", ", placement ",
             cfg_.placement == Placement::Spread ? "spread" : "pack");
    log_info("client socket ", cfg_.socket, ", admin socket ", cfg_.admin_socket, ", state ", store_.path());
    if (cfg_.libvirt.uri != "none") {
#ifdef PVGPU_HAVE_LIBVIRT
        LibvirtWatch::Listener& self = *this;  // a private base: converted here
        libvirt_ = std::make_unique<LibvirtWatch>(ctx_.get(), cfg_.libvirt, self);
#else
        log_info("built without libvirt: not following libvirt domains ([libvirt] uri = none to say so)");
#endif
    }
}

Daemon::~Daemon() {
    libvirt_.reset();
    admin_.reset();
    listen_watch_.reset();
    std::vector<std::uint32_t> ids;
    for (const auto& [id, cl] : clients_) ids.push_back(id);
    for (auto id : ids) teardown(id);
    if (listen_fd_) ::unlink(cfg_.socket.c_str());
    // The scheduler holds timers on the GPU and both on timers_: drop in order.
    metrics_file_.reset();
    move_.reset();
    for (auto& g : gpus_) {
        g->monitor.reset();
        g->sched.reset();
        g->dev.reset();
    }
}

// Each GPU: its backend, then its policy: --policy, else what an admin chose
// at run time for this GPU or for all, else the configuration.
void Daemon::open_gpus() {
    for (std::uint32_t i = 0; i < cfg_.gpus.size(); ++i) {
        const GpuConfig& gc = cfg_.gpus[i];
        auto g = std::make_unique<Gpu>();
        g->index = i;
        g->name = gc.name;
        std::unique_ptr<BackendGpu> dev = open_gpu_device(i, gc, clock_, timers_.device());
        g->arbitration = dev->arbitration_name();
        const std::string description = dev->description();
        g->dev = std::move(dev);
        std::string name = cfg_.policy, origin = cfg_.policy_overridden ? "--policy" : "configuration";
        PolicyParams params = params_for(cfg_, name);
        std::unique_ptr<Policy> policy;
        std::optional<State::GpuPolicy> saved;
        if (auto sp = state_.gpu_policies.find(i); sp != state_.gpu_policies.end())
            saved = sp->second;
        else if (state_.policy)
            saved = State::GpuPolicy{*state_.policy, state_.policy_params};
        if (!cfg_.policy_overridden && saved) {
            try {
                policy = make_policy(saved->name, saved->params);
                name = saved->name;
                params = saved->params;
                origin = store_.path() + ", set at run time";
            } catch (const std::exception& e) {
                log_warning("GPU ", i, ": ignoring the policy saved in ", store_.path(), ": ", e.what());
            }
        }
        if (!policy) policy = make_policy(name, params);
        for (const std::string& w : policy_warnings(name, params)) log_warning("GPU ", i, ": ", w);
        g->policy_name = name;
        g->policy_params = params;
        g->sched = std::make_unique<Scheduler>(*g->dev, clock_, timers_, std::move(policy), cfg_.costs);
        g->sched->seed_accounting(host_entropy());
        Gpu* gp = g.get();
        g->sched->set_mode_listener([this, gp](ChannelId local, ChannelMode m) {
            if (ChannelId id = chan_id(*gp, local)) on_mode_change(id, m);
        });
        g->sched->set_error_listener([this, gp](ChannelId local, EntityId, std::uint32_t err) {
            if (ChannelId id = chan_id(*gp, local)) on_channel_error(id, err);
        });
        g->sched->set_fence_listener([this, gp](ChannelId local, std::uint32_t fence) {
            if (ChannelId id = chan_id(*gp, local)) on_fence(id, fence);
        });
        g->monitor = std::make_unique<ShareMonitor>(*g->sched, *g->dev, clock_, timers_);
        log_info("GPU ", i, " ", g->name, ": ", description, " (backend ", gc.backend, "), policy ", name, " (",
                 origin, ")");
        gpus_.push_back(std::move(g));
    }
}

ChannelId Daemon::chan_id(const Gpu& g, ChannelId local) const {
    auto it = g.chan_of.find(local);
    return it == g.chan_of.end() ? 0 : it->second;
}

int Daemon::run() {
    // Tests and service wrappers wait for this line, whatever the log level.
    log_line(LogLevel::Info, "ready");
    g_main_loop_run(loop_.get());
    log_info("stopped");
    return 0;
}

void Daemon::quit() { g_main_loop_quit(loop_.get()); }

#ifndef PVGPU_HAVE_LIBVIRT
// Built without libvirt (the fuzzer's build): no watcher is ever made, but
// the owner's destructor still needs the watcher's.
struct LibvirtWatch::Impl {};
LibvirtWatch::~LibvirtWatch() = default;
bool LibvirtWatch::connected() const { return false; }
bool LibvirtWatch::knows(const std::string&) const { return false; }
void LibvirtWatch::lookup(const std::string&, std::function<void(const DomainAnswer&)> done) { done({}); }
void LibvirtWatch::set_weight(const std::string&, std::uint32_t, std::function<void(const WeightWrite&)> done) {
    done({});
}
#endif

void Daemon::add_vmm_identity_check(std::unique_ptr<VmmIdentityCheck> check) {
    vmm_checks_.push_back(std::move(check));
}

bool Daemon::in_vmm_budget(const Client& cl) {
    return cl.hello ? cl.role == PVGPU_ROLE_VMM : cl.vmm_user;
}

Daemon::Usage Daemon::usage(bool vmm_budget, std::optional<uid_t> uid, std::uint32_t except) const {
    Usage u;
    for (const auto& [id, cl] : clients_) {
        if (cl.closing || id == except || in_vmm_budget(cl) != vmm_budget || (uid && cl.uid != *uid)) continue;
        ++u.clients;
        u.channels += cl.channels.size();
    }
    return u;
}

// ---------------------------------------------------------------- clients

void Daemon::accept_clients() {
    for (int i = 0; i < 32; ++i) {
        UniqueFd fd(accept4(listen_fd_.get(), nullptr, nullptr, SOCK_NONBLOCK | SOCK_CLOEXEC));
        if (!fd) {
            int err = errno;
            if (err == EMFILE || err == ENFILE || err == ENOBUFS || err == ENOMEM) {
                // The pending connection keeps the socket readable: back off
                // instead of spinning until descriptors are free again.
                log_warning("accept: ", std::strerror(err), "; not accepting clients for 100 ms");
                listen_watch_.set_condition(static_cast<GIOCondition>(0));
                accept_pause_.arm(clock_.now() + 100 * kMillisecond,
                                  [this] { listen_watch_.set_condition(G_IO_IN); });
            } else if (err != EAGAIN && err != EWOULDBLOCK && err != ECONNABORTED && err != EINTR) {
                log_warning("accept: ", std::strerror(err));
            }
            return;
        }
        ucred peer{0, ~0u, ~0u};
        socklen_t len = sizeof peer;
        if (getsockopt(fd.get(), SOL_SOCKET, SO_PEERCRED, &peer, &len) != 0) peer = ucred{0, ~0u, ~0u};
        const bool vmm_user = vmm_users_.allows(peer.uid);
        auto drop = [&](const std::string& why) {
            pvgpu_error e{};
            e.status = PVGPU_E_LIMIT;
            wire::set_name(e.message, sizeof e.message, why);
            auto bytes = wire::encode(PVGPU_MSG_ERROR, 0, e);
            (void)!::send(fd.get(), bytes.data(), bytes.size(), MSG_DONTWAIT | MSG_NOSIGNAL);
            log_warning("dropped a connection from pid ", peer.pid, " uid ", peer.uid, ": ", why);
        };
        std::size_t live = 0;
        for (const auto& [id, cl] : clients_) live += cl.closing ? 0 : 1;
        if (live >= cfg_.limits.max_clients + kConnectionSlack) {
            drop("too many clients (" + std::to_string(live) + " connections open)");
            continue;
        }
        // Per-uid budgets hold before HELLO too: connections that never say
        // HELLO must not lock anyone else out either.
        const Usage mine = usage(vmm_user, peer.uid);
        const std::uint32_t per_uid =
            vmm_user ? cfg_.limits.vmm_clients_per_uid : cfg_.limits.host_clients_per_uid;
        if (mine.clients >= per_uid) {
            drop("too many connections from uid " + std::to_string(peer.uid) + " (limit " +
                 std::to_string(per_uid) + ")");
            continue;
        }
        if (!vmm_user && usage(false, std::nullopt).clients >= cfg_.limits.host_clients) {
            drop("too many host clients (limit " + std::to_string(cfg_.limits.host_clients) + ")");
            continue;
        }
        std::uint32_t id = next_client_++;
        if (next_client_ == 0) next_client_ = 1;
        ++counters_.clients_total;
        ClientConn::Options opt;
        opt.max_queue_bytes = cfg_.limits.max_queue_bytes;
        opt.max_queue_fds = cfg_.limits.max_queue_fds;
        opt.hello_timeout = cfg_.limits.hello_timeout;
        Client cl;
        cl.uid = peer.uid;
        cl.vmm_user = vmm_user;
        // Only a possible VMM's identity is ever checked against libvirt's.
        if (vmm_user) cl.pidfd = peer_pidfd(fd.get(), peer.pid);
        cl.conn = std::make_unique<ClientConn>(ctx_.get(), mux_, clock_, timers_, std::move(fd), id, opt,
                                               static_cast<ClientConn::Handler&>(*this));
        log_debug("client ", id, " connected (pid ", cl.conn->peer().pid, ", uid ", cl.conn->peer().uid, ")");
        clients_.emplace(id, std::move(cl));
    }
}

void Daemon::on_closed(ClientConn& c, const std::string& reason, bool protocol_error) {
    if (protocol_error) {
        ++counters_.protocol_errors;
        log_warning("client ", c.id(), " (pid ", c.peer().pid, ") dropped: ", reason);
    } else {
        log_info("client ", c.id(), " closed: ", reason);
    }
    auto it = clients_.find(c.id());
    if (it == clients_.end()) return;
    it->second.closing = true;
    // Tear down from the loop: this may run inside a scheduler callback.
    to_reap_.insert(c.id());
    if (!reaper_)
        reaper_ = add_idle(ctx_.get(), [this] {
            reap();
            return false;
        });
}

void Daemon::reap() {
    auto ids = std::move(to_reap_);
    to_reap_.clear();
    for (auto id : ids) teardown(id);
}

void Daemon::teardown(std::uint32_t client_id) {
    auto it = clients_.find(client_id);
    if (it == clients_.end()) return;
    Client& cl = it->second;
    if (move_ && move_->client == client_id) move_abort("the VM disconnected");
    std::vector<ChannelId> chans(cl.channels.begin(), cl.channels.end());
    for (ChannelId ch : chans) close_channel(ch);
    if (!cl.hello) {
        // nothing placed
    } else if (cl.role == PVGPU_ROLE_VMM) {
        if (Vm* v = vm_of(cl)) {
            Gpu& g = *gpus_[v->gpu];
            for (auto [hint, task] : v->tasks) remove_entity(g, task);
            remove_entity(g, v->entity);
            vms_.erase({v->uuid, v->gpu});
        }
    } else if (cl.host_entity != kNoEntity) {
        Gpu& g = *gpus_[cl.gpu];
        remove_entity(g, cl.host_entity);
        if (auto u = host_users_.find({cl.host_user, cl.gpu}); u != host_users_.end() && --u->second.clients == 0) {
            remove_entity(g, u->second.entity);
            host_users_.erase(u);
        }
    }
    if (cl.linger) linger(cl.conn->take_socket());
    clients_.erase(it);
}

// A refused client's socket, its sending side shut: closed once the peer
// has read what it was sent and closed its end, or after a while.
void Daemon::linger(UniqueFd fd) {
    const Time now = clock_.now();
    while (!lingering_.empty() && (lingering_.front().first <= now || lingering_.size() >= kMaxLingering))
        lingering_.pop_front();
    if (!fd) return;
    lingering_.emplace_back(now + kLinger, std::move(fd));
    if (!linger_timer_.armed()) linger_timer_.arm(now + kLinger, [this] { linger({}); });
}

void Daemon::on_message(ClientConn& c, wire::Message& m) {
    auto it = clients_.find(c.id());
    if (it == clients_.end() || it->second.closing) return;
    Client& cl = it->second;
    const std::uint16_t type = m.hdr.type;
    if (!cl.hello && type != PVGPU_MSG_HELLO) {
        c.fail(PVGPU_E_STATE, std::string(wire::type_name(type)) + " before HELLO");
        return;
    }
    try {
        switch (type) {
        case PVGPU_MSG_HELLO: on_hello(cl, m); break;
        case PVGPU_MSG_CHAN_ALLOC: on_alloc(cl, m); break;
        case PVGPU_MSG_CHAN_FREE: on_free(cl, m); break;
        case PVGPU_MSG_MODE_ACK: on_mode_ack(cl, m); break;
        case PVGPU_MSG_TRAP_REPORT: on_trap_report(cl, m); break;
        case PVGPU_MSG_PING: c.send(PVGPU_MSG_PONG, m.hdr.seq); break;
        case PVGPU_MSG_TASK_WEIGHT: on_task_weight(cl, m); break;
        case PVGPU_MSG_QUIESCE: on_quiesce(cl, m); break;
        case PVGPU_MSG_RESUME: on_resume(cl, m); break;
        case PVGPU_MSG_CHAN_RESTORE: on_restore(cl, m); break;
        default: c.fail(PVGPU_E_INVALID, std::string("unexpected message ") + wire::type_name(type)); break;
        }
    } catch (const std::exception& e) {
        log_error("client ", c.id(), ": ", wire::type_name(type), " failed: ", e.what());
        c.fail(PVGPU_E_INTERNAL, "internal error", false);
    }
}

void Daemon::refuse_hello(Client& cl, const HelloRequest& req, std::uint32_t status, const std::string& why) {
    ClientConn& conn = *cl.conn;
    // The reply has no room for words: an ERROR before it says why, and
    // the peer can read both before it sees the connection end.
    pvgpu_error e{};
    e.status = status;
    wire::set_name(e.message, sizeof e.message, why);
    conn.send_struct(PVGPU_MSG_ERROR, 0, e);
    conn.send_struct(PVGPU_MSG_HELLO_REPLY, req.seq, hello_reply(cl, req, status));
    cl.linger = true;
    conn.close_after_reply("HELLO refused: " + why);
}

pvgpu_hello_reply Daemon::hello_reply(const Client& cl, const HelloRequest& req, std::uint32_t status) const {
    pvgpu_hello_reply r{};
    r.client_id = cl.conn->id();
    r.max_channels = cfg_.limits.max_channels_per_client;
    r.version = std::min<std::uint32_t>(req.h.version, PVGPU_PROTO_VERSION);
    r.status = status;
    return r;
}

bool Daemon::hello_full() const {
    std::size_t ready = 0;
    for (const auto& [id, other] : clients_) ready += other.hello && !other.closing ? 1 : 0;
    return ready >= cfg_.limits.max_clients;
}

void Daemon::on_hello(Client& cl, const wire::Message& m) {
    ClientConn& conn = *cl.conn;
    if (cl.hello || cl.hello_pending) {
        conn.fail(PVGPU_E_STATE, "second HELLO");
        return;
    }
    HelloRequest req;
    req.h = m.as<pvgpu_hello>();
    req.seq = m.hdr.seq;
    const auto& h = req.h;
    if (h.version < 1) return refuse_hello(cl, req, PVGPU_E_VERSION, "protocol version 0");
    if (hello_full()) {
        log_warning("refused a client: ", cfg_.limits.max_clients, " clients connected");
        return refuse_hello(cl, req, PVGPU_E_LIMIT, "too many clients");
    }

    req.raw = wire::name_of(h.name, sizeof h.name);
    const std::string& raw = req.raw;
    // The GPU the client named, if any; pvgpud's placement otherwise.
    if (h.gpu != PVGPU_GPU_ANY) {
        req.asked = h.gpu - 1;
        if (*req.asked >= gpus_.size()) {
            const std::string why = "no GPU " + std::to_string(*req.asked) + " on this host (" +
                                    std::to_string(gpus_.size()) + (gpus_.size() == 1 ? " GPU)" : " GPUs)");
            log_warning("client ", conn.id(), " (pid ", conn.peer().pid, ", ",
                        h.role == PVGPU_ROLE_VMM ? "VM " + (raw.empty() ? std::string("?") : raw) : "host", "): ",
                        why);
            return refuse_hello(cl, req, PVGPU_E_INVALID, why);
        }
    }

    if (h.role == PVGPU_ROLE_VMM) return hello_vmm(cl, req);
    if (h.role == PVGPU_ROLE_HOST) {
        const Usage mine = usage(false, cl.uid, conn.id());
        if (mine.clients >= cfg_.limits.host_clients_per_uid)
            return refuse_hello(cl, req, PVGPU_E_LIMIT,
                                "uid " + std::to_string(cl.uid) + " has " + std::to_string(mine.clients) +
                                    " host clients (limit " + std::to_string(cfg_.limits.host_clients_per_uid) + ")");
        if (usage(false, std::nullopt, conn.id()).clients >= cfg_.limits.host_clients)
            return refuse_hello(cl, req, PVGPU_E_LIMIT, "too many host clients");
        std::uint32_t pid = h.pid ? h.pid : static_cast<std::uint32_t>(conn.peer().pid);
        std::string error;
        if (!hello_host(cl, raw, pid, req.asked, error)) return refuse_hello(cl, req, PVGPU_E_INTERNAL, error);
        return finish_hello(cl, req);
    }
    return refuse_hello(cl, req, PVGPU_E_INVALID, "unknown role " + std::to_string(h.role));
}

void Daemon::finish_hello(Client& cl, const HelloRequest& req) {
    cl.role = req.h.role;
    cl.version = std::min<std::uint32_t>(req.h.version, PVGPU_PROTO_VERSION);
    cl.hello = true;
    cl.conn->hello_done();
    cl.conn->send_struct(PVGPU_MSG_HELLO_REPLY, req.seq, hello_reply(cl, req, PVGPU_OK));
}

// A VMM's HELLO: who it is (the configured users, then libvirt's word on a
// domain's QEMU), then its VM's entity.  libvirt is asked off the loop: the
// HELLO is answered when it answers or gives up, nothing else waits.
void Daemon::hello_vmm(Client& cl, const HelloRequest& req) {
    ClientConn& conn = *cl.conn;
    Uuid u{};
    std::memcpy(u.data(), req.h.uuid, u.size());
    if (is_nil(u)) return refuse_hello(cl, req, PVGPU_E_INVALID, "a VMM must give its VM's UUID");
    if (req.raw == "host") return refuse_hello(cl, req, PVGPU_E_INVALID, "the VM name 'host' is reserved");
    if (req.raw.find('/') != std::string::npos)
        return refuse_hello(cl, req, PVGPU_E_INVALID, "a VM name may not contain '/'");
    const std::string uuid = format_uuid(u);
    // The kernel's word on who connected, never the client's.
    std::optional<std::string> denied = vmm_users_.refuse(conn.peer(), uuid);
    for (const auto& check : vmm_checks_)
        if (!denied) denied = check->refuse(conn.peer(), uuid);
    if (denied) {
        log_warning("client ", conn.id(), " (pid ", conn.peer().pid, ") refused as VMM of ", uuid, ": ", *denied);
        // E_STATE, not a new status: clients of every version know it.
        return refuse_hello(cl, req, PVGPU_E_STATE, *denied);
    }
    if (!libvirt_) return admit_vmm(cl, req, uuid, nullptr);
    cl.hello_pending = true;
    const std::uint32_t id = conn.id();
    libvirt_->lookup(uuid, [this, id, req, uuid](const DomainAnswer& a) {
        auto it = clients_.find(id);
        if (it == clients_.end() || it->second.closing) return;  // gone while libvirt was asked
        Client& c = it->second;
        c.hello_pending = false;
        try {
            admit_vmm(c, req, uuid, &a);
        } catch (const std::exception& e) {
            log_error("client ", id, ": HELLO failed: ", e.what());
            c.conn->fail(PVGPU_E_INTERNAL, "internal error", false);
        }
    });
}

void Daemon::admit_vmm(Client& cl, const HelloRequest& req, const std::string& uuid, const DomainAnswer* libvirt) {
    ClientConn& conn = *cl.conn;
    if (hello_full()) return refuse_hello(cl, req, PVGPU_E_LIMIT, "too many clients");
    std::optional<DomainInfo> domain;
    bool verified = false;
    if (libvirt) {
        if (auto why = libvirt_refusal(cl, uuid, *libvirt, verified)) {
            log_warning("client ", conn.id(), " (pid ", conn.peer().pid, ") refused as VMM of ", uuid, ": ", *why);
            return refuse_hello(cl, req, PVGPU_E_STATE, *why);
        }
        if (libvirt->kind == DomainAnswer::Kind::Running) {
            domain = libvirt->info;
            // A libvirt domain's weight is its metadata's: saved before it is read.
            domain_up(*domain);
            // Its QEMU comes first: a peer admitted while libvirt could not
            // tell goes (issue 51 item 9).
            evict_unverified(uuid, domain->name, domain->pid);
        }
    }
    const std::set<std::uint32_t> taken = gpus_of_vm(uuid);
    const AskedGpu ask = asked_gpu(cl, req, uuid, domain ? &*domain : nullptr, taken);
    if (ask.refused) return;
    const std::optional<std::uint32_t>& asked = ask.gpu;
    if (asked && taken.count(*asked))
        return refuse_hello(cl, req, PVGPU_E_STATE,
                            "VM " + uuid + " is already connected on GPU " + std::to_string(*asked));
    std::string error;
    const auto gpu = place("vm/" + uuid, asked, taken, error);
    if (!gpu) return refuse_hello(cl, req, PVGPU_E_STATE, "VM " + uuid + " " + error);
    Gpu& g = *gpus_[*gpu];
    EntityTree& tree = g.sched->entities();
    const std::string& raw = req.raw;
    std::string name = unique_root_name(tree, "", raw.empty() ? uuid : sanitize_name(raw), uuid.substr(0, 8));
    std::uint32_t weight = weights_.vm(uuid, raw, name);
    EntityId e = tree.add(kRootEntity, name, EntityKind::Vm, weight);
    g.meta[e] = Meta{Kind::Vm, uuid, uuid, 0, {}};
    vms_[{uuid, *gpu}] = Vm{uuid, *gpu, raw, e, conn.id(), {}, {}, 0};
    cl.uuid = uuid;
    cl.gpu = *gpu;
    cl.libvirt_verified = verified;
    remember_placement("vm/" + uuid, *gpu);
    log_info("client ", conn.id(), ": VM ", name, " (", uuid, "), pid ", conn.peer().pid, ", weight ", weight,
             ", on GPU ", *gpu, " ", g.name,
             ask.reserved ? " (reserved by its pod: " + cfg_.kubernetes.allocation_file + ")"
             : asked      ? " (asked for)"
                          : " (placed)",
             verified ? ", the QEMU of libvirt domain " + domain->name : "");
    finish_hello(cl, req);
}

// The device's gpu= wins, then the domain's metadata (device="N"), then
// the GPU the VMM's pod reserved (its allocation file); none of them: the
// placement.  One device per GPU: a domain's or pod's GPU the VM already
// has a device on is left to the placement (a second device goes
// elsewhere).
Daemon::AskedGpu Daemon::asked_gpu(Client& cl, const HelloRequest& req, const std::string& uuid,
                                   const DomainInfo* domain, const std::set<std::uint32_t>& taken) {
    if (req.asked) return {req.asked, false, false};
    if (domain && domain->gpu && !taken.count(*domain->gpu)) {
        if (*domain->gpu < gpus_.size()) return {domain->gpu, false, false};
        refuse_hello(cl, req, PVGPU_E_INVALID,
                     "libvirt domain " + domain->name + " asks for GPU " + std::to_string(*domain->gpu) +
                         "; this host has " + std::to_string(gpus_.size()));
        return {std::nullopt, false, true};
    }
    if (cfg_.kubernetes.allocation_file.empty()) return {};
    std::string why;
    const std::optional<std::uint32_t> pod_gpu = pod_reservation(cl, why);
    if (!why.empty()) {
        log_warning("client ", cl.conn->id(), " (pid ", cl.conn->peer().pid, ") refused as VMM of ", uuid, ": ",
                    why);
        refuse_hello(cl, req, PVGPU_E_INVALID, why);
        return {std::nullopt, false, true};
    }
    if (pod_gpu && !taken.count(*pod_gpu)) return {pod_gpu, true, false};
    return {};
}

// The file is read as the VMM sees it, through /proc/PID/root; what was
// read counts only if the pid still names the peer when the read is done
// (its pidfd, held since it connected, is not readable): else it may be
// another process's file.
std::optional<std::uint32_t> Daemon::pod_reservation(const Client& cl, std::string& why) const {
    const std::string& file = cfg_.kubernetes.allocation_file;
    const pid_t pid = cl.conn->peer().pid;
    if (pid <= 0) return std::nullopt;  // a peer in no pid namespace of ours: nothing to read
    const AllocationRead r = read_allocation_file(pid, file);
    if (r.kind != AllocationRead::Kind::Absent && !is_process(cl, pid)) {
        // The process that connected is gone (a client may hand its socket
        // on): what its pid names now is not this VMM's view.
        log_info("client ", cl.conn->id(), ": pid ", pid, " is not the process that connected any more; ", file,
                 " not read, placed as if absent");
        return std::nullopt;
    }
    switch (r.kind) {
    case AllocationRead::Kind::Absent: return std::nullopt;
    case AllocationRead::Kind::Error: why = file + ": " + r.text; return std::nullopt;
    case AllocationRead::Kind::Text: break;
    }
    AllocationParse p = parse_allocation(r.text, gpus_.size());
    if (!p.gpu) why = file + ": " + p.error;
    return p.gpu;
}

bool Daemon::hello_host(Client& cl, const std::string& raw, std::uint32_t pid, std::optional<std::uint32_t> asked,
                        std::string& error) {
    const std::string user = sanitize_name(user_name(cl.uid), kMaxUserName);
    const std::string user_key = "host/" + user;
    // A user's clients share one GPU unless one names another: an unnamed
    // client joins the user where it already runs.
    std::optional<std::uint32_t> gpu = asked;
    if (!gpu)
        for (const auto& [key, hu] : host_users_)
            if (key.first == user) {
                gpu = key.second;
                break;
            }
    if (!gpu) gpu = place("user/" + user, std::nullopt, {}, error);
    if (!gpu) return false;
    Gpu& g = *gpus_[*gpu];
    EntityTree& tree = g.sched->entities();
    // Nothing is recorded until both entities exist: a refused or failed
    // HELLO leaves no trace a later one would trip over.
    const auto known = host_users_.find({user, *gpu});
    EntityId group = known == host_users_.end() ? kNoEntity : known->second.entity;
    const bool fresh = group == kNoEntity;
    std::uint32_t user_weight = 0;
    if (fresh) {
        const std::string entity = host_user_entity_name(user);
        if (tree.find_child(kRootEntity, entity)) {
            error = "entity " + entity + " (host user " + user + ") exists";
            return false;
        }
        user_weight = weights_.host_user(user);
        group = tree.add(kRootEntity, entity, EntityKind::Vm, user_weight);
    }

    // A name free under the user: base, then base-<client id>, then numbered.
    const std::string base = raw.empty() ? "pid-" + std::to_string(pid) : sanitize_name(raw, 48);
    std::string name = base;
    for (int k = 1; tree.find_child(group, name); ++k)
        name = with_suffix(base, "-" + std::to_string(cl.conn->id()) + (k > 1 ? "-" + std::to_string(k) : ""));
    const std::string key = user_key + "/" + name;
    const std::uint32_t weight = weights_.host_task(key, name);
    EntityId e;
    try {
        e = tree.add(group, name, EntityKind::Task, weight);
    } catch (...) {
        if (fresh) tree.remove(group);
        throw;
    }
    if (fresh) {
        host_users_[{user, *gpu}].entity = group;
        g.meta[group] = Meta{Kind::HostUser, {}, user_key, 0, {}};
        remember_placement("user/" + user, *gpu);
        log_info("host user ", user_key, " (uid ", cl.uid, "), weight ", user_weight, ", on GPU ", *gpu, " ", g.name);
    }
    ++host_users_[{user, *gpu}].clients;
    cl.host_user = user;
    cl.gpu = *gpu;
    g.meta[e] = Meta{Kind::Host, {}, key, 0, {}};
    cl.host_entity = e;
    log_info("client ", cl.conn->id(), ": host task ", key, ", pid ", cl.conn->peer().pid, ", weight ", weight,
             ", GPU ", *gpu);
    return true;
}

// ---------------------------------------------------------------- placement

std::set<std::uint32_t> Daemon::gpus_of_vm(const std::string& uuid) const {
    std::set<std::uint32_t> out;
    for (auto it = vms_.lower_bound({uuid, 0}); it != vms_.end() && it->first.first == uuid; ++it)
        out.insert(it->first.second);
    return out;
}

Daemon::Vm* Daemon::vm_of(const Client& cl) {
    auto it = vms_.find({cl.uuid, cl.gpu});
    return it == vms_.end() || it->second.client != cl.conn->id() ? nullptr : &it->second;
}

std::optional<std::uint32_t> Daemon::place(const std::string& key, std::optional<std::uint32_t> asked,
                                           const std::set<std::uint32_t>& taken, std::string& error) {
    if (asked) return asked;
    // Where it was, if that GPU is still there and free for it.
    if (auto p = state_.placements.find(key); p != state_.placements.end())
        for (std::uint32_t g : p->second)
            if (g < gpus_.size() && !taken.count(g)) return g;
    // Load per GPU: the VMs and host users placed there, and their weights.
    std::vector<std::uint64_t> count(gpus_.size()), weight(gpus_.size());
    for (const auto& [k, vm] : vms_) {
        ++count[vm.gpu];
        weight[vm.gpu] += gpus_[vm.gpu]->sched->entities().get(vm.entity).weight;
    }
    for (const auto& [k, hu] : host_users_) {
        ++count[k.second];
        weight[k.second] += gpus_[k.second]->sched->entities().get(hu.entity).weight;
    }
    std::optional<std::uint32_t> best;
    for (std::uint32_t g = 0; g < gpus_.size(); ++g) {
        if (taken.count(g)) continue;
        if (cfg_.placement == Placement::Pack && count[g] < cfg_.pack_limit) return g;
        // spread, and pack once every GPU holds pack_limit: the least loaded.
        const auto& load = cfg_.placement == Placement::Spread ? weight : count;
        if (!best || load[g] < load[*best]) best = g;
    }
    if (!best) error = "has a device on every GPU of this host";
    return best;
}

void Daemon::remember_placement(const std::string& key, std::uint32_t gpu, std::optional<std::uint32_t> from) {
    auto& list = state_.placements[key];
    if (from) std::erase(list, *from);
    if (std::find(list.begin(), list.end(), gpu) != list.end() && !from) return;
    std::erase(list, gpu);
    list.push_back(gpu);
    // Bounded: a VM has at most one device per GPU.
    if (list.size() > gpus_.size()) list.resize(gpus_.size());
    save_state();
}

// ---------------------------------------------------------------- channels

Daemon::Channel* Daemon::owned(const Client& cl, std::uint32_t chan_id) {
    if (!cl.channels.count(chan_id)) return nullptr;
    auto it = channels_.find(chan_id);
    return it == channels_.end() ? nullptr : it->second.get();
}

std::string Daemon::channel_limit(const Client& cl) const {
    const Limits& l = cfg_.limits;
    if (cl.channels.size() >= l.max_channels_per_client) return "per-client channel limit";
    if (channels_.size() >= l.max_channels) {
        log_warning("channel limit (", l.max_channels, ") reached");
        return "channel limit";
    }
    const bool vmm = cl.role == PVGPU_ROLE_VMM;
    const std::uint32_t per_uid = vmm ? l.vmm_channels_per_uid : l.host_channels_per_uid;
    if (usage(vmm, cl.uid).channels >= per_uid)
        return "uid " + std::to_string(cl.uid) + " holds " + std::to_string(per_uid) + " channels";
    if (!vmm && usage(false, std::nullopt).channels >= l.host_channels) return "host channel limit";
    return {};
}

EntityId Daemon::leaf_for(Client& cl, std::uint64_t pid_hint, const std::string& task_name,
                          std::string& error) {
    if (cl.role == PVGPU_ROLE_HOST) return cl.host_entity;
    Gpu& g = *gpus_[cl.gpu];
    EntityTree& tree = g.sched->entities();
    Vm& vm = *vm_of(cl);
    const Entity& ve = tree.get(vm.entity);
    // No hint: the VM itself, as a guest without the driver's hints looks.
    if (pid_hint == 0 && ve.children.empty()) return vm.entity;
    if (ve.channels > 0) {
        error = "the VM has channels without a pid hint; hinted channels cannot join them";
        return kNoEntity;
    }
    if (auto t = vm.tasks.find(pid_hint); t != vm.tasks.end()) return t->second;
    std::string name = "task-" + std::to_string(pid_hint);
    // What the guest asked for this task wins: it is newer than any admin
    // weight saved for a hint (a guest pid) from an earlier session.
    auto gw = vm.guest_weights.find(pid_hint);
    const std::uint32_t weight = weights_.vm_task(
        vm.uuid, name, gw == vm.guest_weights.end() ? std::nullopt : std::optional(gw->second.weight));
    EntityId e = tree.add(vm.entity, name, EntityKind::Task, weight);
    g.meta[e] = Meta{Kind::VmTask, vm.uuid, name, pid_hint, sanitize_name(task_name, 32)};
    vm.tasks[pid_hint] = e;
    return e;
}

void Daemon::on_alloc(Client& cl, const wire::Message& m) {
    const auto a = m.as<pvgpu_chan_alloc>();
    const std::uint64_t hint = cl.role == PVGPU_ROLE_VMM ? a.pid_hint : 0;
    open_channel_for(cl, m.hdr.seq, hint, wire::name_of(a.task_name, sizeof a.task_name), nullptr);
}

// A new channel for `cl` (CHAN_ALLOC), or one carrying on from where
// another pvgpud left it (CHAN_RESTORE: `restore` has its memory and
// positions).  Answers CHAN_REPLY either way.
void Daemon::open_channel_for(Client& cl, std::uint32_t seq, std::uint64_t hint, const std::string& task_name,
                              const Restore* restore) {
    ClientConn& conn = *cl.conn;
    pvgpu_chan_reply r{};
    r.mem_size = PVGPU_CHAN_MEM_SIZE;
    auto refuse = [&](std::uint32_t status, const std::string& why) {
        log_debug("client ", conn.id(), ": channel refused: ", why);
        r.status = status;
        conn.send_struct(PVGPU_MSG_CHAN_REPLY, seq, r);
    };
    if (std::string why = channel_limit(cl); !why.empty()) return refuse(PVGPU_E_LIMIT, why);
    std::string error;
    EntityId leaf = leaf_for(cl, hint, task_name, error);
    if (leaf == kNoEntity) return refuse(PVGPU_E_STATE, error);

    auto ch = std::make_unique<Channel>();
    try {
        ch->mem = ChannelMemoryFile::create();
        ch->bell = Doorbell::create();
        if (cl.role == PVGPU_ROLE_HOST && cl.version >= PVGPU_PROTO_VERSION_COMPLETION)
            ch->notifier = CompletionNotifier::create();
    } catch (const std::system_error& e) {
        log_warning("client ", conn.id(), ": cannot create channel memory: ", e.what());
        remove_if_empty_task(*gpus_[cl.gpu], leaf);
        return refuse(PVGPU_E_INTERNAL, e.what());
    }
    ChannelStart start{};
    if (restore) {
        // The saved control page and ring, with the positions the restore
        // names (the GPU's own registers start from them too).
        std::memcpy(ch->mem.ctrl(), restore->mem.data(), PVGPU_CHAN_MEM_SIZE);
        ch->mem.ctrl()->ib_get = restore->get;
        ch->mem.ctrl()->fence = restore->fence;
        ch->mem.ctrl()->ib_put = restore->put;
        start = ChannelStart{restore->get, restore->fence};
    }
    Gpu& g = *gpus_[cl.gpu];
    const ChannelId local = g.sched->open_channel(leaf, ch->mem.memory(), start);
    while (next_chan_ == 0 || channels_.count(next_chan_)) ++next_chan_;
    const ChannelId id = next_chan_++;
    // Recorded at once: the GPU now uses this memory, only close_channel()
    // may let go of it.
    Channel& rec = *channels_.emplace(id, std::move(ch)).first->second;
    g.chan_of[local] = id;
    cl.channels.insert(id);
    rec.id = id;
    rec.gpu = g.index;
    rec.local = local;
    rec.client = conn.id();
    rec.vmm = cl.role == PVGPU_ROLE_VMM;
    rec.pid_hint = hint;
    rec.leaf = leaf;
    rec.ack_timer.bind(timers_);
    rec.watch = MuxWatch(mux_, rec.bell.fd(), G_IO_IN, [this, id](GIOCondition) { on_doorbell(id); });
    // The work the guest had queued on the other host runs here: the
    // policy releases it as it would a store of the guest's, and the put
    // scan runs while it is in flight (it also brings the control page's
    // IB_GET and FENCE up to date when no entry raises an interrupt).
    if (restore && restore->put != restore->get) deliver_put(rec, restore->put);
    // Switches that landed while opening are in this mode; pushes follow.
    rec.pushed = g.sched->channel(local).mode();
    // A channel opened while its VM moves moves too; one opened while its
    // VM is quiesced for a migration is held too.
    if (move_ && move_->client == conn.id()) move_drain(id);
    if (cl.quiesce) {
        g.sched->drain(local);
        cl.quiesce->held.insert(id);
    }
    r.status = PVGPU_OK;
    r.chan_id = id;
    // A host client is never pushed a switch (daemon.hpp) and does not ring
    // while it believes its channel shadowed: it is told only modes in
    // which it rings, and its doorbells are held here as the mode says.
    r.mode = wire_mode(!rec.vmm && rec.pushed == ChannelMode::Shadowed ? ChannelMode::Direct : rec.pushed);
    // The notifier's read end goes with the reply only; pvgpud keeps the
    // write end (send() duplicates, so this copy closes on return).
    const UniqueFd reader = rec.notifier.take_reader();
    const int fds[3] = {rec.mem.fd(), rec.bell.fd(), reader.get()};
    log_debug("client ", conn.id(), ": channel ", id, restore ? " restored" : "", " on ", admin_path(rec), ", GPU ",
              g.index);
    if (restore) ++counters_.restored_channels;
    // The memfd stays alive while the reply waits: it counts as queued.
    conn.send_struct(PVGPU_MSG_CHAN_REPLY, seq, r, std::span<const int>(fds, reader ? 3 : 2), PVGPU_CHAN_MEM_SIZE);
}

void Daemon::on_free(Client& cl, const wire::Message& m) {
    const auto ref = m.as<pvgpu_chan_ref>();
    pvgpu_status_reply r{};
    r.chan_id = ref.chan_id;
    if (owned(cl, ref.chan_id)) {
        close_channel(ref.chan_id);
        r.status = PVGPU_OK;
    } else {
        r.status = PVGPU_E_NOENT;
    }
    cl.conn->send_struct(PVGPU_MSG_FREE_REPLY, m.hdr.seq, r);
}

void Daemon::on_mode_ack(Client& cl, const wire::Message& m) {
    const auto a = m.as<pvgpu_mode_ack>();
    Channel* ch = owned(cl, a.chan_id);
    if (!ch) return;  // freed meanwhile: nothing to do
    if (a.mode_seq > ch->mode_seq) {
        log_debug("client ", cl.conn->id(), ": MODE_ACK for mode ", a.mode_seq, " never sent on channel ",
                  ch->id);
        return;
    }
    // An ack covers its own push and every older one (clients may skip
    // straight to the newest).
    while (!ch->unacked.empty() && static_cast<std::int32_t>(ch->unacked.front().first - a.mode_seq) <= 0)
        ch->unacked.pop_front();
    if (ch->unacked.empty()) ch->ack_timer.cancel();
    // Leaving SHADOWED, the guest's writes to its shadow page arrive here.
    deliver_put(*ch, a.guest_put);
}

void Daemon::on_trap_report(Client& cl, const wire::Message& m) {
    const auto t = m.as<pvgpu_trap_report>();
    Channel* ch = owned(cl, t.chan_id);
    if (!ch) return;
    // A shadowed channel's report is work the guest stored into its shadow
    // page: held here, and the scheduler sees the channel is backlogged.
    Scheduler& sched = sched_of(*ch);
    if (sched.channel(ch->local).mode() == ChannelMode::Shadowed) {
        if (deliver_put(*ch, t.put)) ++counters_.held_reports;
        return;
    }
    ++counters_.trap_reports;
    const auto before = sched.stats().traps;
    // In any mode: a store racing a switch must not be lost.  The channel's
    // ShadowChannel counts it when trapped here too.
    if (deliver_put(*ch, t.put) && sched_of(*ch).stats().traps == before) ++counters_.untrapped_reports;
}

// The guest's weight for one of its tasks.  A child of the VM entity, so it
// only divides the VM's share among the VM's tasks: a guest redistributes
// its share, it can never enlarge it.
void Daemon::on_task_weight(Client& cl, const wire::Message& m) {
    ClientConn& conn = *cl.conn;
    if (cl.version < PVGPU_PROTO_VERSION_TASK_WEIGHT) {
        conn.fail(PVGPU_E_STATE, "TASK_WEIGHT needs protocol version " +
                                     std::to_string(PVGPU_PROTO_VERSION_TASK_WEIGHT) + "; this session speaks " +
                                     std::to_string(cl.version));
        return;
    }
    if (cl.role != PVGPU_ROLE_VMM) {
        conn.fail(PVGPU_E_STATE, "TASK_WEIGHT is for VMM clients only");
        return;
    }
    const auto t = m.as<pvgpu_task_weight>();
    pvgpu_status_reply r{};
    auto answer = [&](std::uint32_t status) {
        r.status = status;
        conn.send_struct(PVGPU_MSG_TASK_WEIGHT_REPLY, m.hdr.seq, r);
    };
    if (t.pid_hint == 0 || t.weight > PVGPU_WEIGHT_MAX) return answer(PVGPU_E_INVALID);
    Vm& vm = *vm_of(cl);
    const std::string key = "task-" + std::to_string(t.pid_hint);
    auto task = vm.tasks.find(t.pid_hint);
    std::uint32_t applied;
    if (t.weight == 0) {
        vm.guest_weights.erase(t.pid_hint);
        applied = weights_.vm_task(vm.uuid, key, std::nullopt);
    } else {
        // Remembered hints are bounded (the guest could name any number of
        // tasks that never allocate a channel); changing a known one is fine.
        // A guest whose driver never says a process ended (weight 0) would
        // fill the table with dead pids: the weight set longest ago of a
        // task without channels makes room.  There always is one: tasks
        // with channels are at most max_channels_per_client, a quarter of
        // the bound; the refusal below only guards that arithmetic.
        const std::size_t limit = std::size_t{cfg_.limits.max_channels_per_client} * 4;
        if (!vm.guest_weights.count(t.pid_hint) && vm.guest_weights.size() >= limit) {
            auto oldest = vm.guest_weights.end();
            for (auto w = vm.guest_weights.begin(); w != vm.guest_weights.end(); ++w)
                if (!vm.tasks.count(w->first) &&
                    (oldest == vm.guest_weights.end() || w->second.set < oldest->second.set))
                    oldest = w;
            if (oldest == vm.guest_weights.end()) {
                log_debug("client ", conn.id(), ": task weight for hint ", t.pid_hint, " refused: ", limit,
                          " task weights remembered, all of tasks with channels");
                return answer(PVGPU_E_LIMIT);
            }
            log_debug("client ", conn.id(), ": forgot the guest weight of hint ", oldest->first,
                      " (no channels) to remember one for hint ", t.pid_hint);
            vm.guest_weights.erase(oldest);
        }
        vm.guest_weights[t.pid_hint] = Vm::GuestWeight{t.weight, ++vm.weights_set};
        applied = weights_.vm_task(vm.uuid, key, t.weight);
    }
    if (task != vm.tasks.end()) {
        Gpu& g = *gpus_[vm.gpu];
        g.sched->entities().set_weight(task->second, applied);
        log_debug("client ", conn.id(), ": guest set the weight of ", admin_path(g, task->second), " to ", applied);
    } else {
        log_debug("client ", conn.id(), ": guest weight ", t.weight, " remembered for ", key);
    }
    answer(PVGPU_OK);
}

void Daemon::on_doorbell(ChannelId id) {
    auto it = channels_.find(id);
    if (it == channels_.end()) return;
    Channel& ch = *it->second;
    ch.bell.drain();
    ++counters_.doorbells;
    deliver_put(ch, ch.mem.client_put());
}

bool Daemon::deliver_put(Channel& ch, std::uint32_t put) {
    ShadowChannel& sc = sched_of(ch).channel(ch.local);
    // Only forward puts ahead of the last one: doorbells, trap reports and
    // acks race each other, and a stale value must not move IB_PUT back.  A
    // put too far ahead is the GPU's to reject (BAD_ENTRY kills the channel).
    if (static_cast<std::int32_t>(put - sc.guest_read_put()) <= 0) return false;
    sc.guest_write_put(put);
    gpu_of(ch).monitor->activity();
    if (!scan_timer_.armed()) scan_timer_.arm(clock_.now() + kPutScanPeriod, [this] { scan_puts(); });
    return true;
}

void Daemon::scan_puts() {
    bool busy = false;
    for (auto& [id, ch] : channels_) {
        deliver_put(*ch, ch->mem.client_put());
        Gpu& g = gpu_of(*ch);
        busy = busy || g.dev->pending(ch->local) || g.sched->held(ch->local) > 0;
    }
    // Only while work is in flight: an idle daemon does not poll.
    if (busy && !scan_timer_.armed()) scan_timer_.arm(clock_.now() + kPutScanPeriod, [this] { scan_puts(); });
}

void Daemon::close_channel(ChannelId id) {
    auto it = channels_.find(id);
    if (it == channels_.end()) return;
    // The GPU lets go of the channel before its memory is unmapped.  A
    // callback that fails the close still leaves it closed (see
    // Scheduler::close_channel): the rest of the teardown goes on.
    Channel& ch = *it->second;
    Gpu& g = gpu_of(ch);
    if (move_) move_forget(id);
    if (auto c = clients_.find(ch.client); c != clients_.end() && c->second.quiesce)
        c->second.quiesce->held.erase(id);
    try {
        g.sched->close_channel(ch.local);
    } catch (const std::exception& e) {
        log_error("internal error closing channel ", id, ": ", e.what());
    }
    g.chan_of.erase(ch.local);
    // The GPU no longer reads it: its pages go back now, not when the
    // client lets go of its copy of the memfd (issue 51 item 6).
    if (int err = ch.mem.discard())
        log_warning("channel ", id, ": cannot release its memory: ", std::strerror(err));
    EntityId leaf = ch.leaf;
    if (auto c = clients_.find(ch.client); c != clients_.end()) c->second.channels.erase(id);
    channels_.erase(it);
    remove_if_empty_task(g, leaf);
}

void Daemon::remove_if_empty_task(Gpu& g, EntityId leaf) {
    auto m = g.meta.find(leaf);
    if (m == g.meta.end() || m->second.kind != Kind::VmTask) return;
    if (g.sched->entities().get(leaf).channels != 0) return;
    if (auto v = vms_.find({m->second.uuid, g.index}); v != vms_.end()) v->second.tasks.erase(m->second.pid_hint);
    remove_entity(g, leaf);
}

void Daemon::remove_entity(Gpu& g, EntityId id) {
    if (!g.sched->entities().valid(id)) return;
    g.sched->entities().remove(id);
    g.meta.erase(id);
    g.monitor->forget(id);
}

void Daemon::on_mode_change(ChannelId id, ChannelMode mode) {
    auto it = channels_.find(id);
    if (it == channels_.end()) return;  // still opening: the CHAN_REPLY carries the mode
    Channel& ch = *it->second;
    if (!ch.vmm) {
        ch.pushed = mode;  // enforced here only; see daemon.hpp
        return;
    }
    // The client unshadows through TRAPPED (thesis 4.3.2), as the daemon did.
    if (ch.pushed == ChannelMode::Shadowed && mode == ChannelMode::Direct)
        push_mode(ch, ChannelMode::Trapped);
    push_mode(ch, mode);
}

void Daemon::push_mode(Channel& ch, ChannelMode mode) {
    auto c = clients_.find(ch.client);
    if (c == clients_.end() || c->second.closing) return;
    pvgpu_mode msg{};
    msg.chan_id = ch.id;
    msg.mode = wire_mode(mode);
    msg.mode_seq = ++ch.mode_seq;
    ch.pushed = mode;
    ++counters_.mode_switches;
    if (!ch.degraded) {
        Time now = clock_.now();
        ch.unacked.push_back({ch.mode_seq, now});
        ChannelId id = ch.id;
        if (!ch.ack_timer.armed())
            ch.ack_timer.arm(now + cfg_.limits.mode_ack_timeout, [this, id] { check_ack(id); });
    }
    c->second.conn->send_struct(PVGPU_MSG_MODE, 0, msg);
}

void Daemon::check_ack(ChannelId id) {
    auto it = channels_.find(id);
    if (it == channels_.end()) return;
    Channel& ch = *it->second;
    if (ch.degraded || ch.unacked.empty()) return;
    Time due = ch.unacked.front().second + cfg_.limits.mode_ack_timeout;
    if (clock_.now() < due) {
        ch.ack_timer.arm(due, [this, id] { check_ack(id); });
        return;
    }
    // The switch is already enforced here; the client only loses the
    // benefit of doing it in its own mapping.  Said once per channel.
    const std::uint32_t late = ch.unacked.front().first;
    ch.degraded = true;
    ch.unacked.clear();
    ++counters_.degraded;
    log_warning("client ", ch.client, " did not acknowledge mode switch ", late, " of channel ", id,
                " within ", cfg_.limits.mode_ack_timeout / kMillisecond, " ms; enforcing its mode host-side");
    pvgpu_notice n{};
    n.kind = PVGPU_NOTICE_DEGRADED;
    n.chan_id = id;
    n.pid_hint = ch.pid_hint;
    if (auto c = clients_.find(ch.client); c != clients_.end())
        c->second.conn->send_struct(PVGPU_MSG_NOTICE, 0, n);
}

// A completion interrupt: wake a host client sleeping on its notifier if
// FENCE reached what it asked for.  NOTIFY_FENCE is the client's to write
// and decides only whether that client is woken; read once.  The fence
// between the GPU's FENCE store (before this interrupt) and this read pairs
// with the client's between its NOTIFY_FENCE store and its FENCE read, so
// either it sees the fence or we see its request: no lost wake-up.
void Daemon::on_fence(ChannelId id, std::uint32_t fence) {
    auto it = channels_.find(id);
    if (it == channels_.end() || !it->second->notifier.valid()) return;
    Channel& ch = *it->second;
    std::atomic_thread_fence(std::memory_order_seq_cst);
    const std::uint32_t wanted = ch.mem.ctrl()->notify_fence;
    if (static_cast<std::int32_t>(fence - wanted) >= 0) ch.notifier.signal();
}

void Daemon::on_channel_error(ChannelId id, std::uint32_t error) {
    auto it = channels_.find(id);
    if (it == channels_.end()) return;
    Channel& ch = *it->second;
    ch.notifier.signal();  // its waits end: the NOTICE says why
    const bool watchdog = error == PVGPU_CHAN_ERR_WATCHDOG;
    ++(watchdog ? counters_.watchdog_kills : counters_.bad_entry_kills);
    log_info("channel ", id, " of client ", ch.client, " (", admin_path(ch), ", GPU ", ch.gpu, ", pid hint ", ch.pid_hint,
             ") stopped: ", watchdog ? "a kernel ran past the watchdog" : "bad ring entry or IB_PUT");
    pvgpu_notice n{};
    n.kind = watchdog ? PVGPU_NOTICE_WATCHDOG : PVGPU_NOTICE_BAD_ENTRY;
    n.chan_id = id;
    n.pid_hint = ch.pid_hint;
    if (auto c = clients_.find(ch.client); c != clients_.end() && !c->second.closing)
        c->second.conn->send_struct(PVGPU_MSG_NOTICE, 0, n);
}

// ---------------------------------------------------------------- move

namespace {
// How often a move looks whether its channels have drained: the drain ends
// with the kernel on the engine, so this is the pause it may add.
constexpr Duration kMovePoll = 1 * kMillisecond;
}  // namespace

void Daemon::admin_move(const json& req, AdminReply reply) {
    auto fail = [&](const std::string& why) { reply(admin_error(why)); };
    auto t = req.find("target");
    if (t == req.end() || !t->is_string() || t->get<std::string>().empty())
        return fail("bad request: missing \"target\" (a VM name or UUID)");
    const std::string target = t->get<std::string>();
    auto index = [&](const char* key) -> std::optional<std::uint32_t> {
        auto v = req.find(key);
        if (v == req.end() || v->is_null()) return std::nullopt;
        if (!v->is_number_unsigned() || v->get<std::uint64_t>() >= gpus_.size()) return kMaxGpus;
        return v->get<std::uint32_t>();
    };
    const auto to = index("gpu"), from = index("from");
    if (!to) return fail("bad request: missing \"gpu\" (the GPU to move to)");
    for (auto g : {to, from})
        if (g && *g == kMaxGpus)
            return fail("no such GPU (this host has " + std::to_string(gpus_.size()) + ": 0.." +
                        std::to_string(gpus_.size() - 1) + ")");
    if (move_) return fail("a move is under way (VM " + move_->uuid + "); try again when it is done");
    // The VM's devices by UUID, name or the name it said at HELLO.
    std::vector<const Vm*> found;
    const auto u = parse_uuid(target);
    for (const auto& [key, vm] : vms_)
        if (u ? vm.uuid == format_uuid(*u)
              : gpus_[vm.gpu]->sched->entities().get(vm.entity).name == target || vm.hello_name == target)
            found.push_back(&vm);
    if (found.empty()) return fail("no such VM connected: " + target);
    const std::string uuid = found[0]->uuid;
    std::erase_if(found, [&](const Vm* v) { return v->uuid != uuid || (from && v->gpu != *from); });
    if (found.empty()) return fail("VM " + target + " has no device on GPU " + std::to_string(*from));
    if (found.size() > 1) return fail("VM " + target + " has devices on several GPUs: name the one to move (from)");
    const Vm& vm = *found[0];
    if (clients_.at(vm.client).quiesce)
        return fail("VM " + target + " is being migrated to another host (its channels are quiesced)");
    if (vm.gpu == *to) return fail("VM " + target + " is on GPU " + std::to_string(*to) + " already");
    if (gpus_of_vm(uuid).count(*to))
        return fail("VM " + target + " has another device on GPU " + std::to_string(*to));

    move_ = std::make_unique<Move>();
    Move& mv = *move_;
    mv.client = vm.client;
    mv.uuid = uuid;
    mv.from = vm.gpu;
    mv.to = *to;
    mv.reply = std::move(reply);
    // Work on the engine completes within the watchdog; without one, a
    // kernel may run for ever: then the move gives up after a minute.
    const std::int64_t wd = cfg_.gpus[mv.from].watchdog_ms.value_or(2000);
    mv.deadline = clock_.now() + (wd > 0 ? wd * kMillisecond + kSecond : 60 * kSecond);
    mv.poll.bind(timers_);
    log_info("moving VM ", uuid, " from GPU ", mv.from, " to GPU ", mv.to);
    for (ChannelId id : clients_.at(vm.client).channels) move_drain(id);
    move_poll();
}

void Daemon::move_drain(ChannelId id) {
    Channel& ch = *channels_.at(id);
    sched_of(ch).drain(ch.local);
    move_->draining.emplace(id, clock_.now());
}

void Daemon::move_forget(ChannelId id) { move_->draining.erase(id); }

void Daemon::move_poll() {
    Move& mv = *move_;
    bool all = true;
    for (const auto& [id, since] : mv.draining) {
        const Channel& ch = *channels_.at(id);
        all = all && sched_of(ch).drained(ch.local);
    }
    if (all) return move_switch();
    if (clock_.now() >= mv.deadline) return move_abort("the work on GPU " + std::to_string(mv.from) +
                                                       " did not complete in time");
    mv.poll.arm(clock_.now() + kMovePoll, [this] { move_poll(); });
}

EntityId Daemon::moved_leaf(Gpu& g, Vm& vm, const Channel& ch, std::uint32_t weight, const std::string& task_name) {
    EntityTree& tree = g.sched->entities();
    if (ch.pid_hint == 0 && tree.get(vm.entity).children.empty()) return vm.entity;
    if (auto t = vm.tasks.find(ch.pid_hint); t != vm.tasks.end()) return t->second;
    const std::string name = "task-" + std::to_string(ch.pid_hint);
    EntityId e = tree.add(vm.entity, name, EntityKind::Task, weight);
    g.meta[e] = Meta{Kind::VmTask, vm.uuid, name, ch.pid_hint, task_name};
    vm.tasks[ch.pid_hint] = e;
    return e;
}

// Every channel drained: each is re-created on the target where it stopped,
// with the guest's held work, and the VM's entities follow.
void Daemon::move_switch() {
    std::unique_ptr<Move> mv = std::move(move_);
    Gpu& a = *gpus_[mv->from];
    Gpu& b = *gpus_[mv->to];
    Client& cl = clients_.at(mv->client);
    Vm old = vms_.at({mv->uuid, mv->from});
    vms_.erase({mv->uuid, mv->from});
    EntityTree& ta = a.sched->entities();
    const std::string name = unique_root_name(b.sched->entities(), "", ta.get(old.entity).name, mv->uuid.substr(0, 8));
    EntityId ve = b.sched->entities().add(kRootEntity, name, EntityKind::Vm, ta.get(old.entity).weight);
    b.meta[ve] = Meta{Kind::Vm, mv->uuid, mv->uuid, 0, {}};
    Vm& vm = vms_[{mv->uuid, mv->to}] =
        Vm{mv->uuid, mv->to, old.hello_name, ve, mv->client, {}, old.guest_weights, old.weights_set};
    cl.gpu = mv->to;
    json channels = json::array();
    double longest = 0;
    for (const auto& [id, since] : mv->draining) {
        Channel& ch = *channels_.at(id);
        const std::uint32_t weight = ta.get(ch.leaf).weight;
        auto m = a.meta.find(ch.leaf);
        const std::string task_name = m == a.meta.end() ? std::string() : m->second.task_name;
        const Scheduler::Position pos = a.sched->detach(ch.local);
        a.chan_of.erase(ch.local);
        ch.leaf = moved_leaf(b, vm, ch, weight, task_name);
        ch.local = b.sched->open_channel(ch.leaf, ch.mem.memory(), ChannelStart{pos.get, pos.fence});
        ch.gpu = mv->to;
        b.chan_of[ch.local] = id;
        // What the guest stored while shadowed is B's policy's to release.
        if (pos.put != pos.get) b.sched->channel(ch.local).guest_write_put(pos.put);
        on_mode_change(id, b.sched->channel(ch.local).mode());
        const double pause = to_ms(clock_.now() - since);
        longest = std::max(longest, pause);
        channels.push_back({{"chan_id", id}, {"pause_ms", pause}, {"get", pos.get}, {"fence", pos.fence}});
    }
    for (auto [hint, task] : old.tasks) remove_entity(a, task);
    remove_entity(a, old.entity);
    remember_placement("vm/" + mv->uuid, mv->to, mv->from);
    ++counters_.moves;
    b.monitor->activity();
    char pause[32];
    std::snprintf(pause, sizeof pause, "%.1f", longest);
    log_info("VM ", name, " (", mv->uuid, ") moved from GPU ", mv->from, " to GPU ", mv->to, ": ",
             mv->draining.size(), mv->draining.size() == 1 ? " channel" : " channels", ", longest pause ", pause,
             " ms");
    mv->reply({{"ok", true},
               {"path", name},
               {"uuid", mv->uuid},
               {"from", mv->from},
               {"to", mv->to},
               {"channels", std::move(channels)}});
}

void Daemon::move_abort(const std::string& why) {
    std::unique_ptr<Move> mv = std::move(move_);
    for (const auto& [id, since] : mv->draining) {
        Channel& ch = *channels_.at(id);
        sched_of(ch).undrain(ch.local);
    }
    log_warning("move of VM ", mv->uuid, " to GPU ", mv->to, " failed: ", why, "; it stays on GPU ", mv->from);
    mv->reply(admin_error("move failed: " + why + "; the VM stays on GPU " + std::to_string(mv->from)));
}

// ---------------------------------------------------------------- migration

namespace {
// How often a quiesce looks whether its channels have drained, as a move does.
constexpr Duration kQuiescePoll = 1 * kMillisecond;

bool is_socket(int fd) {
    struct stat st {};
    return fstat(fd, &st) == 0 && S_ISSOCK(st.st_mode);
}
}  // namespace

// The migration requests come from a VMM that spoke protocol version 5.
bool Daemon::migration_session(Client& cl, const char* request) {
    if (cl.role == PVGPU_ROLE_VMM && cl.version >= PVGPU_PROTO_VERSION_MIGRATE) return true;
    cl.conn->fail(PVGPU_E_STATE, std::string(request) + " needs a VMM session of protocol version " +
                                     std::to_string(PVGPU_PROTO_VERSION_MIGRATE));
    return false;
}

// QUIESCE: the drain `move` uses, for the whole VM, answered on the
// client's socket (quiesce_done) and with QUIESCE_REPLY.
void Daemon::on_quiesce(Client& cl, wire::Message& m) {
    ClientConn& conn = *cl.conn;
    if (!migration_session(cl, "QUIESCE")) return;
    const auto q = m.as<pvgpu_quiesce>();
    UniqueFd done = std::move(m.fds.at(0));
    auto answer_now = [&](std::uint32_t status, const char* why) {
        log_warning("client ", conn.id(), ": QUIESCE refused: ", why);
        pvgpu_quiesce_done d{status, 0, m.hdr.seq, 0};
        if (is_socket(done.get())) (void)::send(done.get(), &d, sizeof d, MSG_DONTWAIT | MSG_NOSIGNAL);
        conn.send_struct(PVGPU_MSG_QUIESCE_REPLY, m.hdr.seq, pvgpu_status_reply{status, 0});
    };
    if (!is_socket(done.get())) return answer_now(PVGPU_E_INVALID, "its fd is not a socket");
    if (cl.quiesce) return answer_now(PVGPU_E_STATE, "already quiesced");
    if (move_ && move_->client == cl.conn->id()) return answer_now(PVGPU_E_STATE, "a move to another GPU is under way");
    auto qs = std::make_unique<Quiesce>();
    qs->seq = m.hdr.seq;
    qs->done = std::move(done);
    qs->since = clock_.now();
    const std::int64_t wd = cfg_.gpus[cl.gpu].watchdog_ms.value_or(2000);
    const Duration bound = q.timeout_ms ? static_cast<Duration>(q.timeout_ms) * kMillisecond
                                        : (wd > 0 ? wd * kMillisecond + kSecond : 60 * kSecond);
    qs->deadline = qs->since + bound;
    qs->poll.bind(timers_);
    for (ChannelId id : cl.channels) {
        Channel& ch = *channels_.at(id);
        sched_of(ch).drain(ch.local);
        qs->held.insert(id);
    }
    cl.quiesce = std::move(qs);
    log_info("VM ", cl.uuid, ": quiescing ", cl.quiesce->held.size(), " channels for a migration");
    quiesce_poll(cl.conn->id());
}

void Daemon::quiesce_poll(std::uint32_t client_id) {
    auto it = clients_.find(client_id);
    if (it == clients_.end() || !it->second.quiesce) return;
    Client& cl = it->second;
    Quiesce& qs = *cl.quiesce;
    bool all = true;
    for (ChannelId id : qs.held) {
        const Channel& ch = *channels_.at(id);
        all = all && sched_of(ch).drained(ch.local);
    }
    if (all) return quiesce_end(cl, PVGPU_OK);
    if (clock_.now() >= qs.deadline) return quiesce_end(cl, PVGPU_E_INTERNAL);
    qs.poll.arm(clock_.now() + kQuiescePoll, [this, client_id] { quiesce_poll(client_id); });
}

// The drain ended: tell the client on its socket and on the connection.
// Failed, the channels go back to the policy at once.
void Daemon::quiesce_end(Client& cl, std::uint32_t status) {
    Quiesce& qs = *cl.quiesce;
    const auto n = static_cast<std::uint32_t>(qs.held.size());
    pvgpu_quiesce_done d{status, n, qs.seq, 0};
    if (::send(qs.done.get(), &d, sizeof d, MSG_DONTWAIT | MSG_NOSIGNAL) != static_cast<ssize_t>(sizeof d))
        log_warning("VM ", cl.uuid, ": cannot send the end of the quiesce: ", std::strerror(errno));
    qs.done.reset();
    char pause[32];
    std::snprintf(pause, sizeof pause, "%.1f", to_ms(clock_.now() - qs.since));
    cl.conn->send_struct(PVGPU_MSG_QUIESCE_REPLY, qs.seq, pvgpu_status_reply{status, n});
    if (status == PVGPU_OK) {
        qs.drained = true;
        ++counters_.quiesces;
        log_info("VM ", cl.uuid, ": ", n, n == 1 ? " channel" : " channels", " quiesced in ", pause,
                 " ms; held until the migration ends");
        return;
    }
    log_warning("VM ", cl.uuid, ": quiesce failed after ", pause, " ms (the work on the GPU did not complete); "
                "its channels run on");
    for (ChannelId id : qs.held) {
        Channel& ch = *channels_.at(id);
        sched_of(ch).undrain(ch.local);
    }
    cl.quiesce.reset();
}

// RESUME: the migration failed or was cancelled; the channels run on here.
void Daemon::on_resume(Client& cl, const wire::Message& m) {
    ClientConn& conn = *cl.conn;
    if (!migration_session(cl, "RESUME")) return;
    std::uint32_t n = 0;
    if (cl.quiesce) {
        if (!cl.quiesce->drained) {
            // Resumed before the drain ended: its answer is still owed.
            pvgpu_quiesce_done d{PVGPU_E_STATE, 0, cl.quiesce->seq, 0};
            (void)::send(cl.quiesce->done.get(), &d, sizeof d, MSG_DONTWAIT | MSG_NOSIGNAL);
            conn.send_struct(PVGPU_MSG_QUIESCE_REPLY, cl.quiesce->seq, pvgpu_status_reply{PVGPU_E_STATE, 0});
        }
        for (ChannelId id : cl.quiesce->held) {
            Channel& ch = *channels_.at(id);
            sched_of(ch).undrain(ch.local);
            ++n;
        }
        cl.quiesce.reset();
        ++counters_.resumes;
        log_info("VM ", cl.uuid, ": migration did not complete; ", n, n == 1 ? " channel" : " channels",
                 " resumed");
    }
    conn.send_struct(PVGPU_MSG_RESUME_REPLY, m.hdr.seq, pvgpu_status_reply{PVGPU_OK, n});
}

// CHAN_RESTORE: a channel the VM had on the migration's source host.
void Daemon::on_restore(Client& cl, wire::Message& m) {
    ClientConn& conn = *cl.conn;
    if (!migration_session(cl, "CHAN_RESTORE")) return;
    const auto a = m.as<pvgpu_chan_restore>();
    const UniqueFd fd = std::move(m.fds.at(0));
    auto refuse = [&](std::uint32_t status, const std::string& why) {
        log_warning("client ", conn.id(), ": CHAN_RESTORE refused: ", why);
        pvgpu_chan_reply r{};
        r.status = status;
        r.mem_size = PVGPU_CHAN_MEM_SIZE;
        conn.send_struct(PVGPU_MSG_CHAN_REPLY, m.hdr.seq, r);
    };
    // The GPU would run every entry from IB_GET to IB_PUT: never more than
    // the ring holds.
    if (a.ib_put - a.ib_get > PVGPU_RING_ENTRIES)
        return refuse(PVGPU_E_INVALID, "IB_PUT " + std::to_string(a.ib_put) + " is more than a ring ahead of IB_GET " +
                                           std::to_string(a.ib_get));
    // A regular file only (a memfd): a pipe or socket could block the read.
    struct stat st {};
    if (fstat(fd.get(), &st) != 0 || !S_ISREG(st.st_mode) ||
        st.st_size < static_cast<off_t>(PVGPU_CHAN_MEM_SIZE))
        return refuse(PVGPU_E_INVALID, "its memory is not a regular file of " +
                                           std::to_string(PVGPU_CHAN_MEM_SIZE) + " bytes");
    Restore rs{a.ib_put, a.ib_get, a.fence, std::vector<std::byte>(PVGPU_CHAN_MEM_SIZE)};
    std::size_t have = 0;
    while (have < rs.mem.size()) {
        const ssize_t n = ::pread(fd.get(), rs.mem.data() + have, rs.mem.size() - have, static_cast<off_t>(have));
        if (n < 0 && errno == EINTR) continue;
        if (n <= 0) return refuse(PVGPU_E_INVALID, "its memory cannot be read");
        have += static_cast<std::size_t>(n);
    }
    const std::uint64_t hint = a.pid_hint;
    open_channel_for(cl, m.hdr.seq, hint, wire::name_of(a.task_name, sizeof a.task_name), &rs);
}

// ---------------------------------------------------------------- admin

std::string Daemon::admin_path(const Gpu& g, EntityId id) const {
    if (auto m = g.meta.find(id);
        m != g.meta.end() && (m->second.kind == Kind::Host || m->second.kind == Kind::HostUser))
        return m->second.key;
    return g.sched->entities().path(id);
}

void Daemon::save_state() {
    try {
        store_.save(state_);
    } catch (const std::exception& e) {
        log_warning("cannot save ", store_.path(), ": ", e.what());
    }
}

// One GPU's entities, in path order, each as the admin protocol shows it.
json Daemon::list_gpu(Gpu& g) {
    const auto snap = g.monitor->snapshot();
    const EntityTree& tree = g.sched->entities();
    json entities = json::array();
    std::function<std::uint32_t(EntityId)> channels = [&](EntityId id) {
        const Entity& e = tree.get(id);
        std::uint32_t n = e.channels;
        for (EntityId c : e.children) n += channels(c);
        return n;
    };
    std::function<void(EntityId)> visit = [&](EntityId parent) {
        std::vector<std::pair<std::string, EntityId>> kids;
        for (EntityId c : tree.get(parent).children) kids.push_back({admin_path(g, c), c});
        std::sort(kids.begin(), kids.end());
        for (const auto& [path, id] : kids) {
            const Entity& e = tree.get(id);
            const auto& sh = snap.entities.at(id);
            auto m = g.meta.find(id);
            Kind kind = m == g.meta.end() ? Kind::VmTask : m->second.kind;
            json o = {{"path", path},
                      {"kind", kind == Kind::Vm         ? "vm"
                               : kind == Kind::Host     ? "host"
                               : kind == Kind::HostUser ? "user"
                                                        : "task"},
                      {"weight", e.weight},
                      {"target_share", sh.target_now},
                      {"achieved_share", sh.achieved},
                      {"gpu_time_ms", to_ms(sh.gpu_time)},
                      {"kernels", sh.kernels},
                      {"channels", channels(id)},
                      {"gpu", g.index}};
            if (kind == Kind::Vm && m != g.meta.end()) o["uuid"] = m->second.uuid;
            if (kind == Kind::VmTask && m != g.meta.end()) {
                o["pid_hint"] = m->second.pid_hint;
                if (!m->second.task_name.empty()) o["task_name"] = m->second.task_name;
                if (auto v = vms_.find({m->second.uuid, g.index}); v != vms_.end()) {
                    const auto& gw = v->second.guest_weights;
                    if (auto w = gw.find(m->second.pid_hint); w != gw.end()) o["guest_weight"] = w->second.weight;
                }
            }
            entities.push_back(std::move(o));
            visit(id);
        }
    };
    visit(kRootEntity);
    std::size_t vms = 0;
    for (const auto& [key, vm] : vms_) vms += vm.gpu == g.index ? 1 : 0;
    return {{"index", g.index},           {"name", g.name},
            {"policy", g.policy_name},    {"arbitration", g.arbitration},
            {"busy_fraction", snap.busy_fraction}, {"vms", vms},
            {"window_s", to_ms(snap.window) / 1000.0}, {"entities", std::move(entities)}};
}

json Daemon::admin_list() {
    json gpus = json::array();
    json all = json::array();
    for (auto& g : gpus_) {
        json one = list_gpu(*g);
        for (const auto& e : one["entities"]) all.push_back(e);
        gpus.push_back(std::move(one));
    }
    return {{"ok", true},
            {"policy", gpus_[0]->policy_name},
            {"accounting", true},
            {"window_s", gpus[0]["window_s"]},
            {"entities", std::move(all)},
            {"gpus", std::move(gpus)}};
}

// ---------------------------------------------------------------- libvirt

void Daemon::domain_up(const DomainInfo& d) {
    std::uint32_t weight = d.weight;
    if (!d.metadata_error.empty()) {
        weight = PVGPU_WEIGHT_DEFAULT;
        if (metadata_errors_[d.uuid] != d.metadata_error)
            log_warning("libvirt domain ", d.name, ": invalid pvgpu metadata (", d.metadata_error,
                        "); it runs at the default weight ", weight);
        metadata_errors_[d.uuid] = d.metadata_error;
    } else {
        metadata_errors_.erase(d.uuid);
    }
    apply_vm_weight(d.uuid, d.name, weight);
    // A VM that connected before libvirt told us its QEMU's pid is checked now.
    if (d.pid > 0)
        for (std::uint32_t gpu : gpus_of_vm(d.uuid)) {
            const Vm& v = vms_.at({d.uuid, gpu});
            auto c = clients_.find(v.client);
            if (c == clients_.end() || c->second.closing) continue;
            if (is_process(c->second, d.pid)) {
                c->second.libvirt_verified = true;
                continue;
            }
            log_warning("client ", c->first, ": VM ", d.uuid, " is libvirt domain ", d.name, " whose QEMU is pid ",
                        d.pid, ", not this peer (pid ", c->second.conn->peer().pid, "): disconnected");
            c->second.conn->close("not the QEMU of libvirt domain " + d.name);
        }
}

bool Daemon::is_process(const Client& cl, pid_t pid) const {
    return pid > 0 && cl.conn->peer().pid == pid && cl.pidfd && pidfd_alive(cl.pidfd.get());
}

// Whether libvirt's answer lets `cl` be the VMM of `uuid` (issue 51 item
// 9): the reason when it does not.  A domain libvirt knows is closed to
// anyone but its running QEMU, compared by pidfd (the peer's pid cannot have
// been reused while pvgpud holds it); only a UUID libvirt has never named
// passes while libvirt cannot answer.
std::optional<std::string> Daemon::libvirt_refusal(const Client& cl, const std::string& uuid,
                                                   const DomainAnswer& a, bool& verified) const {
    verified = false;
    const pid_t peer = cl.conn->peer().pid;
    switch (a.kind) {
    case DomainAnswer::Kind::None: return std::nullopt;  // not libvirt's: vmm_users decided
    case DomainAnswer::Kind::Stopped:
        return "VM " + uuid + " is libvirt domain " + a.info.name + ", which is not running";
    case DomainAnswer::Kind::Unreachable:
        if (libvirt_->knows(uuid))
            return "VM " + uuid + " is a libvirt domain and libvirt cannot confirm its QEMU (" + a.why + ")";
        log_warning("client ", cl.conn->id(), " (pid ", peer, "): VM ", uuid,
                    " taken without libvirt's word (", a.why, "); should libvirt name it a domain of another QEMU, "
                    "that QEMU replaces this client");
        return std::nullopt;
    case DomainAnswer::Kind::Running:
        if (a.info.pid <= 0)
            return "VM " + uuid + " is libvirt domain " + a.info.name + ", whose QEMU pid cannot be read from " +
                   cfg_.libvirt.pid_dir + "/" + a.info.name + ".pid";
        if (!is_process(cl, a.info.pid))
            return "VM " + uuid + " is libvirt domain " + a.info.name + ": peer pid " + std::to_string(peer) +
                   " is not its QEMU (pid " + std::to_string(a.info.pid) + ")";
        verified = true;
        return std::nullopt;
    }
    return "VM " + uuid + ": unknown answer from libvirt";
}

// The QEMU of libvirt domain `name` (pid `qemu`) said HELLO: connections
// under its UUID that were taken without libvirt's word and are not that
// QEMU go now, before its HELLO looks for a free GPU.
void Daemon::evict_unverified(const std::string& uuid, const std::string& name, pid_t qemu) {
    std::vector<std::uint32_t> gone;
    for (std::uint32_t gpu : gpus_of_vm(uuid)) {
        const std::uint32_t id = vms_.at({uuid, gpu}).client;
        auto c = clients_.find(id);
        if (c == clients_.end()) continue;
        Client& other = c->second;
        if (!other.closing) {
            if (other.libvirt_verified) continue;
            if (is_process(other, qemu)) {
                other.libvirt_verified = true;  // the same QEMU's other device
                continue;
            }
            log_warning("client ", id, " (pid ", other.conn->peer().pid, "): VM ", uuid, " is libvirt domain ", name,
                        " and its QEMU (pid ", qemu, ") connected: this client, never verified, is disconnected");
            other.conn->close("replaced by the QEMU of libvirt domain " + name);
        }
        gone.push_back(id);  // closing ones too (domain_up may just have closed it)
    }
    // Now, not from the reaper: the QEMU's HELLO needs the GPU back.
    for (std::uint32_t id : gone) teardown(id);
}

void Daemon::domain_down(const std::string& uuid, const std::string& name) {
    metadata_errors_.erase(uuid);
    log_info("libvirt domain ", name, " (", uuid, ") stopped");
    // Its QEMU is gone; a connection still open under its UUID is stale.
    for (std::uint32_t gpu : gpus_of_vm(uuid))
        if (auto c = clients_.find(vms_.at({uuid, gpu}).client); c != clients_.end())
            c->second.conn->close("libvirt domain " + name + " stopped");
}

// Whoever holds the UUID of a domain that does not run is not its QEMU: a
// client taken while libvirt could not tell goes once it can.
void Daemon::domain_not_running(const std::string& uuid, const std::string& name) {
    for (std::uint32_t gpu : gpus_of_vm(uuid)) {
        auto c = clients_.find(vms_.at({uuid, gpu}).client);
        if (c == clients_.end() || c->second.closing) continue;
        log_warning("client ", c->first, " (pid ", c->second.conn->peer().pid, "): VM ", uuid, " is libvirt domain ",
                    name, ", which is not running: disconnected");
        c->second.conn->close("libvirt domain " + name + " is not running");
    }
}

void Daemon::apply_vm_weight(const std::string& uuid, const std::string& name, std::uint32_t weight) {
    const bool changed = weights_.set_vm(uuid, name, weight);
    const std::set<std::uint32_t> on = gpus_of_vm(uuid);
    for (std::uint32_t gpu : on) {
        EntityTree& tree = gpus_[gpu]->sched->entities();
        const EntityId e = vms_.at({uuid, gpu}).entity;
        if (tree.get(e).weight != weight) {
            tree.set_weight(e, weight);
            log_info("weight of VM ", tree.get(e).name, " on GPU ", gpu, " set to ", weight, " (libvirt domain ",
                     name, ")");
        }
    }
    if (on.empty() && changed) {
        log_info("weight ", weight, " remembered for libvirt domain ", name, " (", uuid, ")");
    }
}

void Daemon::admin_set_weight(const json& req, AdminReply reply) {
    auto w = req.find("weight");
    const std::string bad_weight = "weight must be an integer in " + std::to_string(PVGPU_WEIGHT_MIN) + ".." +
                                   std::to_string(PVGPU_WEIGHT_MAX);
    if (w == req.end() || !w->is_number_integer()) return reply(admin_error(bad_weight));
    const bool in_range = w->is_number_unsigned() ? w->get<std::uint64_t>() <= PVGPU_WEIGHT_MAX
                                                  : w->get<std::int64_t>() <= PVGPU_WEIGHT_MAX;
    if (!in_range || w->get<std::int64_t>() < static_cast<std::int64_t>(PVGPU_WEIGHT_MIN))
        return reply(admin_error(bad_weight));
    const auto weight = w->get<std::uint32_t>();
    auto t = req.find("target");
    if (t == req.end() || !t->is_string()) return reply(admin_error("bad request: missing \"target\""));
    const std::string target = t->get<std::string>();

    // A libvirt domain's weight lives in its metadata: written there first
    // (pvgpud then hears the change too), and applied here by its UUID.
    // The write runs on the libvirt worker; the admin waits, nothing else.
    if (!libvirt_ || target.find('/') != std::string::npos) return reply(set_weight_here(target, weight, {}));
    libvirt_->set_weight(target, weight, [this, target, weight, reply](const WeightWrite& ww) {
        std::optional<std::string> domain;
        switch (ww.kind) {
        case WeightWrite::Kind::Failed: return reply(admin_error("libvirt domain " + target + ": " + ww.why));
        case WeightWrite::Kind::Written:
            domain = ww.uuid;
            log_info("weight ", weight, " written to the metadata of libvirt domain ", target);
            break;
        case WeightWrite::Kind::Unreachable:
            log_warning("set-weight ", target, ": ", ww.why, "; set in pvgpud only");
            break;
        case WeightWrite::Kind::NotDomain: break;
        }
        reply(set_weight_here(target, weight, domain));
    });
}

// set-weight once libvirt had its say: `domain` is the UUID of the libvirt
// domain whose metadata took the weight.
json Daemon::set_weight_here(const std::string& target, std::uint32_t weight,
                             const std::optional<std::string>& domain) {
    // Every entity the target names: a VM or host user on several GPUs has
    // one on each, all given the weight.
    using Found = std::vector<std::pair<Gpu*, EntityId>>;
    auto apply = [&](const Found& found) -> json {
        std::string path;
        for (auto [g, id] : found) {
            EntityTree& tree = g->sched->entities();
            tree.set_weight(id, weight);
            path = admin_path(*g, id);
            if (auto m = g->meta.find(id); m != g->meta.end()) {
                const Meta& meta = m->second;
                if (meta.kind == Kind::Vm) weights_.set_vm(meta.uuid, tree.get(id).name, weight);
                if (meta.kind == Kind::VmTask) {
                    weights_.set_vm_task(meta.uuid, meta.key, weight);
                    // The latest word wins: a guest request made before this
                    // would otherwise come back when the task re-appears.
                    if (auto v = vms_.find({meta.uuid, g->index}); v != vms_.end())
                        v->second.guest_weights.erase(meta.pid_hint);
                }
                if (meta.kind == Kind::Host) weights_.set_host_task(meta.key, weight);
                if (meta.kind == Kind::HostUser) weights_.set_host_user(meta.key.substr(5), weight);
            }
            log_info("weight of ", path, " on GPU ", g->index, " set to ", weight);
        }
        return {{"ok", true}, {"path", path}, {"weight", weight}};
    };
    auto pending = [&]() -> json {
        log_info("weight ", weight, " remembered for VM ", target, " (not connected)");
        return {{"ok", true}, {"path", target}, {"weight", weight}, {"pending", true}};
    };

    const auto with_domain = [&](json reply) {
        if (domain) reply["libvirt"] = true;
        return reply;
    };

    Found found;
    if (auto u = parse_uuid(domain ? *domain : target)) {
        const std::string uuid = format_uuid(*u);
        if (domain) weights_.set_vm(uuid, target == uuid ? std::string() : target, weight);
        for (std::uint32_t gpu : gpus_of_vm(uuid)) found.push_back({gpus_[gpu].get(), vms_.at({uuid, gpu}).entity});
        if (!found.empty()) return with_domain(apply(found));
        weights_.set_vm(uuid, "", weight);
        return with_domain(pending());
    }
    if (target.find('/') == std::string::npos) {
        if (target == "host")
            return admin_error("no such entity: host (host users are host/<user>, their tasks host/<user>/<name>)");
        if (target.empty()) return admin_error("no such entity: \"\"");
        for (const auto& [key, vm] : vms_) {
            Gpu* g = gpus_[vm.gpu].get();
            if (g->sched->entities().get(vm.entity).name == target || vm.hello_name == target)
                found.push_back({g, vm.entity});
        }
        if (!found.empty()) return apply(found);
        weights_.set_vm_name(target, weight);
        return pending();
    }
    if (target.rfind("host/", 0) == 0) {
        // host/<user> or host/<user>/<name>; a user not connected is
        // remembered like a VM that is not.
        const std::string rest = target.substr(5);
        const auto slash = rest.find('/');
        const std::string user = rest.substr(0, slash);
        for (const auto& [key, hu] : host_users_) {
            if (key.first != user) continue;
            Gpu* g = gpus_[key.second].get();
            const auto id = slash == std::string::npos
                                ? std::optional(hu.entity)
                                : g->sched->entities().find_child(hu.entity, rest.substr(slash + 1));
            if (id) found.push_back({g, *id});
        }
        const bool connected = std::any_of(host_users_.begin(), host_users_.end(),
                                           [&](const auto& kv) { return kv.first.first == user; });
        if (!connected && slash == std::string::npos && sanitize_name(user, kMaxUserName) == user &&
            user_id(user)) {
            weights_.set_host_user(user, weight);
            log_info("weight ", weight, " remembered for host user ", target, " (not connected)");
            return {{"ok", true}, {"path", target}, {"weight", weight}, {"pending", true}};
        }
    } else {
        for (auto& g : gpus_)
            if (auto id = g->sched->entities().find_path(target); id && *id != kRootEntity)
                found.push_back({g.get(), *id});
    }
    if (found.empty()) return admin_error("no such entity: " + target);
    return apply(found);
}

json Daemon::effective_params(const Gpu& g) const {
    json p = json::object();
    if (const PolicyInfo* info = find_policy(g.policy_name))
        for (const auto& [name, def, doc] : info->params) p[name] = def;
    for (const auto& [k, v] : g.policy_params) p[k] = v;
    return p;
}

void Daemon::set_gpu_policy(Gpu& g, const std::string& name, const PolicyParams& params) {
    g.sched->set_policy(make_policy(name, params));
    for (const std::string& w : policy_warnings(name, params)) log_warning("GPU ", g.index, ": ", w);
    g.policy_name = name;
    g.policy_params = params;
    log_info("policy of GPU ", g.index, " ", g.name, " set to ", name);
}

json Daemon::admin_set_policy(const json& req) {
    auto p = req.find("policy");
    if (p == req.end() || !p->is_string()) return admin_error("bad request: missing \"policy\"");
    const std::string name = p->get<std::string>();
    const PolicyInfo* info = find_policy(name);
    if (!info) return admin_error("unknown policy: " + name);
    PolicyParams params;
    if (auto ps = req.find("params"); ps != req.end() && !ps->is_null()) {
        if (!ps->is_object()) return admin_error("bad request: \"params\" must be an object");
        for (const auto& [k, v] : ps->items()) {
            std::string known;
            bool found = false;
            for (const auto& [n, def, doc] : info->params) {
                found = found || n == k;
                known += (known.empty() ? "" : ", ") + n;
            }
            if (!found)
                return admin_error("bad parameter \"" + k + "\": policy " + name +
                                   " has no such parameter (known: " + (known.empty() ? "none" : known) +
                                   ")");
            if (!v.is_number()) return admin_error("bad parameter \"" + k + "\": not a number");
            double d = v.get<double>();
            if (!std::isfinite(d) || d < 0)
                return admin_error("bad parameter \"" + k + "\": must be a number >= 0");
            params[k] = d;
        }
    }
    std::optional<std::uint32_t> only;
    if (auto gi = req.find("gpu"); gi != req.end() && !gi->is_null()) {
        if (!gi->is_number_unsigned() || gi->get<std::uint64_t>() >= gpus_.size())
            return admin_error("no GPU " + gi->dump() + " on this host (" + std::to_string(gpus_.size()) +
                               (gpus_.size() == 1 ? " GPU)" : " GPUs)"));
        only = gi->get<std::uint32_t>();
    }
    try {
        make_policy(name, params);  // checked before any GPU changes
    } catch (const std::invalid_argument& e) {
        return admin_error(std::string("bad parameter: ") + e.what());
    }
    json changed = json::array();
    for (auto& g : gpus_) {
        if (only && g->index != *only) continue;
        set_gpu_policy(*g, name, params);
        changed.push_back(g->index);
    }
    if (only) {
        state_.gpu_policies[*only] = State::GpuPolicy{name, params};
    } else {
        state_.policy = name;
        state_.policy_params = params;
        state_.gpu_policies.clear();
    }
    save_state();
    const Gpu& first = *gpus_[only.value_or(0)];
    return {{"ok", true}, {"policy", name}, {"params", effective_params(first)}, {"gpus", std::move(changed)}};
}

json Daemon::admin_get_policy() {
    json gpus = json::array();
    for (const auto& g : gpus_)
        gpus.push_back(
            {{"index", g->index}, {"name", g->name}, {"policy", g->policy_name}, {"params", effective_params(*g)}});
    return {{"ok", true},
            {"policy", gpus_[0]->policy_name},
            {"params", effective_params(*gpus_[0])},
            {"gpus", std::move(gpus)}};
}

// One GPU's utilisation, fairness and scheduler figures.
json Daemon::stats_gpu(Gpu& g) {
    const auto snap = g.monitor->snapshot();
    const SchedulerStats& st = g.sched->stats();
    std::size_t channels = 0, vms = 0;
    for (const auto& [id, ch] : channels_) channels += ch->gpu == g.index ? 1 : 0;
    for (const auto& [key, vm] : vms_) vms += vm.gpu == g.index ? 1 : 0;
    return {{"index", g.index},
            {"name", g.name},
            {"policy", g.policy_name},
            {"arbitration", g.arbitration},
            {"busy_fraction", snap.busy_fraction},
            {"busy_s", to_ms(g.dev->busy_time()) / 1000.0},
            {"idle_with_demand_fraction", snap.idle_with_demand_fraction},
            {"context_switches", g.dev->context_switches()},
            {"channels", channels},
            {"vms", vms},
            {"scheduler_cpu_s", to_ms(st.policy_cpu) / 1000.0},
            {"metrics",
             {{"max_share_error", snap.metrics.max_share_error},
              {"jain_index", snap.metrics.jain_index},
              {"unfairness", finite_or(snap.metrics.unfairness, kMaxUnfairness)},
              {"scheduler_cpu_us_per_s", snap.scheduler_cpu_us_per_s}}},
            {"policy_counters", g.sched->policy().counters()}};
}

json Daemon::admin_stats() {
    // The whole daemon's figures; per-GPU ones under "gpus", GPU 0's also
    // where one GPU's were reported before there were several.
    json gpus = json::array();
    SchedulerStats st;
    for (auto& g : gpus_) {
        gpus.push_back(stats_gpu(*g));
        const SchedulerStats& s = g->sched->stats();
        st.traps += s.traps;
        st.remaps += s.remaps;
        st.polls += s.polls;
        st.accounting_reads += s.accounting_reads;
        st.register_reads += s.register_reads;
        st.fences += s.fences;
        st.released_entries += s.released_entries;
        st.policy_cpu += s.policy_cpu;
    }
    const auto snap = gpus_[0]->monitor->snapshot();
    const json& first = gpus[0];
    std::size_t clients = 0;
    for (const auto& [id, cl] : clients_) clients += cl.closing ? 0 : 1;
    json metrics = first["metrics"];
    metrics["process_cpu_us_per_s"] = snap.process_cpu_us_per_s;
    return {
        {"ok", true},
        {"uptime_s", to_ms(clock_.now() - started_) / 1000.0},
        {"policy", first["policy"]},
        {"clients", clients},
        {"channels", channels_.size()},
        {"window_s", to_ms(snap.window) / 1000.0},
        {"gpu",
         {{"busy_fraction", first["busy_fraction"]},
          {"busy_s", first["busy_s"]},
          {"idle_with_demand_fraction", first["idle_with_demand_fraction"]},
          {"arbitration", first["arbitration"]},
          {"context_switches", first["context_switches"]}}},
        {"metrics", std::move(metrics)},
        {"process_cpu_s", to_ms(snap.process_cpu) / 1000.0},
        {"scheduler_cpu_s", to_ms(st.policy_cpu) / 1000.0},
        {"counters",
         {{"traps", st.traps + counters_.untrapped_reports},
          {"mode_switches", counters_.mode_switches},
          {"watchdog_kills", counters_.watchdog_kills},
          {"protocol_errors", counters_.protocol_errors},
          {"bad_entry_kills", counters_.bad_entry_kills},
          {"trap_reports", counters_.trap_reports},
          {"held_reports", counters_.held_reports},
          {"doorbells", counters_.doorbells},
          {"degraded_channels", counters_.degraded},
          {"moves", counters_.moves},
          {"quiesces", counters_.quiesces},
          {"resumes", counters_.resumes},
          {"restored_channels", counters_.restored_channels},
          {"remaps", st.remaps},
          {"polls", st.polls},
          {"accounting_reads", st.accounting_reads},
          {"register_reads", st.register_reads},
          {"fences", st.fences},
          {"released_entries", st.released_entries},
          {"clients_total", counters_.clients_total},
          {"timer_wakeups", timers_.wakeups()}}},
        // GPU 0's policy's own counters since it started (hfq: blocks,
        // covers, ...; docs/scenarios.md lists them per policy); each
        // GPU's under "gpus".
        {"policy_counters", first["policy_counters"]},
        {"gpus", std::move(gpus)},
    };
}

}  // namespace pvgpu::daemon
