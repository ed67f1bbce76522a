#include "admin.hpp"

#include <pvgpu/protocol.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <memory>
#include <string_view>

#include "log.hpp"
#include "unix_socket.hpp"

#ifndef PVGPU_VERSION
#define PVGPU_VERSION "unknown"
#endif

namespace pvgpu::daemon {

using nlohmann::json;

namespace {

constexpr std::size_t kReadChunk = 16384;
// How long a closing connection's leftover input is discarded.
constexpr Duration kDrainTime = 1 * kSecond;
// The grid rate-limited connections resume on: at most this much later
// than their next token.
constexpr Duration kResumeGrid = 5 * kMillisecond;

std::string dump_line(const json& j) {
    // Strings echoed back (targets, commands) may hold invalid UTF-8: replace, never throw.
    return j.dump(-1, ' ', false, json::error_handler_t::replace) + "\n";
}

PeerCred peer_of(int fd) {
    PeerCred p;
    ucred uc{};
    socklen_t len = sizeof uc;
    if (getsockopt(fd, SOL_SOCKET, SO_PEERCRED, &uc, &len) == 0) {
        p.pid = uc.pid;
        p.uid = uc.uid;
        p.gid = uc.gid;
    }
    std::vector<gid_t> groups(32);
    for (int tries = 0; tries < 4; ++tries) {
        len = static_cast<socklen_t>(groups.size() * sizeof(gid_t));
        if (getsockopt(fd, SOL_SOCKET, SO_PEERGROUPS, groups.data(), &len) == 0) {
            groups.resize(len / sizeof(gid_t));
            p.groups = std::move(groups);
            break;
        }
        if (errno != ERANGE) break;
        groups.resize(len / sizeof(gid_t) + 1);
    }
    return p;
}

}  // namespace

json admin_error(const std::string& message) { return {{"ok", false}, {"error", message}}; }

bool AdminPolicy::may_mutate(const PeerCred& peer) const {
    if (peer.uid == 0 || peer.uid == daemon_uid_) return true;
    if (admin_gid_ == static_cast<gid_t>(-1)) return false;
    return peer.gid == admin_gid_ ||
           std::find(peer.groups.begin(), peer.groups.end(), admin_gid_) != peer.groups.end();
}

std::string AdminPolicy::denied(const std::string& cmd) const {
    std::vector<std::string> who{"root"};
    if (daemon_uid_ != 0) who.push_back("uid " + std::to_string(daemon_uid_));
    if (!admin_group_.empty()) who.push_back("group " + admin_group_);
    std::string list;
    for (std::size_t i = 0; i < who.size(); ++i) {
        if (i > 0) list += i + 1 == who.size() ? " or " : ", ";
        list += who[i];
    }
    return "permission denied: " + cmd + " needs " + list;
}

std::optional<json> parse_admin_request(const std::string& line, json& req) {
    if (line.find_first_not_of(" \t\r\n") == std::string::npos) return json(nullptr);
    try {
        req = json::parse(line);
    } catch (const json::exception& e) {
        return admin_error(std::string("bad request: ") + e.what());
    }
    if (!req.is_object()) return admin_error("bad request: not a JSON object");
    auto it = req.find("cmd");
    if (it == req.end() || !it->is_string()) return admin_error("bad request: missing \"cmd\"");
    return std::nullopt;
}

std::optional<json> handle_admin_request(const std::string& line, const PeerCred& peer,
                                         const AdminPolicy& rights, AdminBackend& backend,
                                         const AdminReply& later) {
    json req;
    if (auto bad = parse_admin_request(line, req)) {
        if (bad->is_null()) return std::nullopt;
        return bad;
    }
    return handle_admin_command(req, peer, rights, backend, later);
}

namespace {

// The admin protocol's commands (docs/protocol.md), one row each, as
// systemd's loginctl keeps its verbs: adding a command is adding a row.
struct AdminCommand {
    std::string_view name;
    // Needs AdminPolicy's rights; after it, answers shared among
    // unprivileged peers are stale.
    bool mutates;
    // Answers through `later` (the reply may come after the handler
    // returned), so it needs a connection that can take one.
    bool deferred;
    json (*run)(const json& req, AdminBackend& backend, const AdminReply& later);
};

constexpr AdminCommand kAdminCommands[] = {
    {"version", false, false,
     [](const json&, AdminBackend&, const AdminReply&) {
         return json{{"ok", true},
                     {"version", PVGPU_VERSION},
                     {"protocol", PVGPU_PROTO_VERSION},
                     {"admin_protocol", kAdminProtocolVersion}};
     }},
    {"list", false, false, [](const json&, AdminBackend& b, const AdminReply&) { return b.admin_list(); }},
    {"get-policy", false, false,
     [](const json&, AdminBackend& b, const AdminReply&) { return b.admin_get_policy(); }},
    {"stats", false, false, [](const json&, AdminBackend& b, const AdminReply&) { return b.admin_stats(); }},
    {"move", true, true,
     [](const json& req, AdminBackend& b, const AdminReply& later) {
         b.admin_move(req, later);
         return json(nullptr);
     }},
    {"set-weight", true, true,
     [](const json& req, AdminBackend& b, const AdminReply& later) {
         b.admin_set_weight(req, later);
         return json(nullptr);
     }},
    {"set-policy", true, false,
     [](const json& req, AdminBackend& b, const AdminReply&) { return b.admin_set_policy(req); }},
};

const AdminCommand* find_admin_command(std::string_view name) {
    for (const AdminCommand& c : kAdminCommands)
        if (c.name == name) return &c;
    return nullptr;
}

}  // namespace

json handle_admin_command(const json& req, const PeerCred& peer, const AdminPolicy& rights,
                          AdminBackend& backend, const AdminReply& later) {
    const std::string cmd = req.at("cmd").get<std::string>();
    try {
        const AdminCommand* c = find_admin_command(cmd);
        if (!c) return admin_error("unknown command: " + cmd);
        if (c->mutates && !rights.may_mutate(peer)) return admin_error(rights.denied(cmd));
        if (c->deferred && !later) return admin_error(cmd + " is not available on this connection");
        return c->run(req, backend, later);
    } catch (const std::exception& e) {
        log_error("admin command ", cmd, " failed: ", e.what());
        return admin_error(std::string("internal error: ") + e.what());
    }
}

struct AdminServer::Conn {
    UniqueFd fd;
    PeerCred peer;
    FdWatch watch;
    Timer idle;
    Timer resume;
    std::string in;
    std::string out;
    Bucket own;                 // peers that may mutate
    Bucket* bucket = nullptr;   // `own`, or the uid's in uid_buckets_
    bool eof = false;
    bool paused = false;    // out of request tokens
    bool closing = false;   // close once `out` is written
    bool draining = false;  // closing: output shut down, input discarded until EOF
    bool dead = false;
    std::uint64_t id = 0;
    bool waiting = false;     // a deferred command's response is due: read nothing
    bool in_handler = false;  // inside handle_admin_request
};

AdminServer::AdminServer(GMainContext* ctx, const Clock& clock, Timers& timers, Options opt,
                         AdminBackend& backend)
    : ctx_(ctx),
      clock_(clock),
      timers_(timers),
      opt_(std::move(opt)),
      backend_(backend),
      rights_(geteuid(), group_id(opt_.admin_group), opt_.admin_group) {
    if (!opt_.admin_group.empty() && group_id(opt_.admin_group) == static_cast<gid_t>(-1))
        log_warning("admin group '", opt_.admin_group, "' does not exist: only root and uid ", geteuid(),
                    " may change weights and policy");
    listen_fd_ = listen_unix(opt_.path, opt_.mode, opt_.socket_group);
    listen_watch_ = FdWatch(ctx_, listen_fd_.get(), G_IO_IN, [this](GIOCondition) { accept_some(); });
}

AdminServer::~AdminServer() {
    listen_watch_.reset();
    conns_.clear();
    if (listen_fd_) ::unlink(opt_.path.c_str());
}

void AdminServer::accept_some() {
    for (int i = 0; i < 16; ++i) {
        UniqueFd fd(accept4(listen_fd_.get(), nullptr, nullptr, SOCK_NONBLOCK | SOCK_CLOEXEC));
        if (!fd) {
            if (errno != EAGAIN && errno != EWOULDBLOCK && errno != ECONNABORTED && errno != EINTR)
                log_warning("admin accept: ", std::strerror(errno));
            return;
        }
        PeerCred peer = peer_of(fd.get());
        const bool privileged = rights_.may_mutate(peer);
        std::size_t live = 0, same_uid = 0;
        for (const auto& other : conns_) {
            if (other->dead) continue;
            ++live;
            same_uid += other->peer.uid == peer.uid ? 1 : 0;
        }
        std::string refused;
        if (live >= opt_.max_clients + (privileged ? opt_.reserved_clients : 0))
            refused = "too many admin connections";
        else if (!privileged && same_uid >= opt_.max_clients_per_uid)
            refused = "too many admin connections from uid " + std::to_string(peer.uid) + " (limit " +
                      std::to_string(opt_.max_clients_per_uid) + ")";
        if (!refused.empty()) {
            std::string msg = dump_line(admin_error(refused));
            (void)!::send(fd.get(), msg.data(), msg.size(), MSG_DONTWAIT | MSG_NOSIGNAL);
            log_debug("admin connection from pid ", peer.pid, " uid ", peer.uid, " refused: ", refused);
            continue;
        }
        auto c = std::make_unique<Conn>();
        c->id = next_conn_++;
        Conn& conn = *c;
        conn.fd = std::move(fd);
        conn.peer = std::move(peer);
        conn.bucket = &bucket_of(conn);
        conn.idle.bind(timers_);
        conn.resume.bind(timers_);
        conn.watch =
            FdWatch(ctx_, conn.fd.get(), G_IO_IN, [this, &conn](GIOCondition cond) { on_io(conn, cond); });
        conn.idle.arm(clock_.now() + opt_.idle_timeout, [this, &conn] { drop(conn); });
        log_debug("admin connection from pid ", conn.peer.pid, " uid ", conn.peer.uid);
        conns_.push_back(std::move(c));
    }
}

void AdminServer::on_io(Conn& c, GIOCondition cond) {
    if (cond & G_IO_OUT) {
        flush(c);
        // The response went out: requests that waited behind it go on.
        if (!c.dead && c.out.empty() && !c.closing && !c.paused) process(c);
    }
    if (c.dead) return;
    if (cond & (G_IO_IN | G_IO_HUP | G_IO_ERR)) {
        if (!(c.watch.condition() & G_IO_IN)) {
            if (cond & (G_IO_HUP | G_IO_ERR)) drop(c);
            return;
        }
        char buf[kReadChunk];
        ssize_t n = ::read(c.fd.get(), buf, sizeof buf);
        if (c.draining) {
            if (n == 0 || (n < 0 && errno != EAGAIN && errno != EINTR)) drop(c);
            return;
        }
        if (n > 0) {
            c.in.append(buf, static_cast<std::size_t>(n));
        } else if (n == 0) {
            c.eof = true;
        } else if (errno != EAGAIN && errno != EINTR) {
            drop(c);
            return;
        }
        process(c);
    }
}

void AdminServer::process(Conn& c) {
    while (!c.dead && !c.closing && !c.waiting) {
        // One response queued at a time: the next request waits until the
        // socket took the last one.
        if (!c.out.empty() && (!write_out(c) || !c.out.empty())) break;
        std::size_t nl = c.in.find('\n');
        bool last = nl == std::string::npos && c.eof && !c.in.empty();  // unterminated final request
        if (nl == std::string::npos && !last) {
            if (c.in.size() >= kAdminMaxLine) {
                c.out += dump_line(admin_error("request too long"));
                c.closing = true;
            }
            break;
        }
        std::size_t len = last ? c.in.size() : nl + 1;
        if (len > kAdminMaxLine) {
            c.out += dump_line(admin_error("request too long"));
            c.closing = true;
            break;
        }
        Time now = clock_.now();
        Bucket& b = *c.bucket;
        double rate = opt_.requests_per_s;
        b.tokens = std::min(rate, b.tokens + rate * double(now - b.refilled) / double(kSecond));
        b.refilled = now;
        if (b.tokens < 1) {
            c.paused = true;
            auto wait = static_cast<Duration>((1 - b.tokens) / rate * double(kSecond)) + 1;
            // Paused connections resume on a shared grid, so a flood of
            // them costs pvgpud one wakeup per tick, not one per token.
            const Time at = (now + wait + kResumeGrid - 1) / kResumeGrid * kResumeGrid;
            c.resume.arm(at, [this, &c] {
                c.paused = false;
                process(c);
            });
            break;
        }
        b.tokens -= 1;
        std::string line = c.in.substr(0, last ? len : nl);
        c.in.erase(0, len);
        json req;
        std::string resp;
        if (auto bad = parse_admin_request(line, req))
            resp = bad->is_null() ? std::string() : dump_line(*bad);
        else
            resp = respond(c, req, now);
        if (!resp.empty()) {
            c.out += resp;
            c.idle.arm(now + opt_.idle_timeout, [this, &c] { drop(c); });
        }
    }
    if (!c.dead && c.eof && !c.paused && !c.waiting && c.in.find('\n') == std::string::npos && c.in.empty())
        c.closing = true;
    flush(c);
}

std::string AdminServer::respond(Conn& c, const json& req, Time now) {
    const std::string& cmd = req.at("cmd").get_ref<const std::string&>();
    const bool privileged = rights_.may_mutate(c.peer);
    if (!privileged && opt_.shared_answer_age > 0 && (cmd == "list" || cmd == "stats"))
        return shared_answer(cmd, now);
    const std::uint64_t id = c.id;
    auto later = std::make_shared<bool>(false);  // set once the reply came
    c.in_handler = true;
    json resp = handle_admin_command(req, c.peer, rights_, backend_, [this, id, later](json r) {
        *later = true;
        answer(id, std::move(r));
    });
    c.in_handler = false;
    // What an unprivileged peer sees next must not predate a change.
    // An unknown command counts as a change: clearing is only ever safe.
    if (const AdminCommand* known = find_admin_command(cmd); privileged && (!known || known->mutates))
        shared_.clear();
    if (!resp.is_null()) return dump_line(resp);
    // Deferred: nothing more is read until the answer (maybe given already).
    c.waiting = !*later;
    if (c.waiting) c.idle.cancel();
    return {};
}

const std::string& AdminServer::shared_answer(const std::string& cmd, Time now) {
    Shared& sh = shared_[cmd];
    if (!sh.line.empty() && now - sh.built < opt_.shared_answer_age) return sh.line;
    json resp = handle_admin_command(json{{"cmd", cmd}}, PeerCred{}, rights_, backend_);
    sh.line = dump_line(resp);
    // An error is not kept: the next request tries again.
    sh.built = resp.value("ok", false) ? now : now - opt_.shared_answer_age;
    return sh.line;
}

AdminServer::Bucket& AdminServer::bucket_of(Conn& c) {
    const Time now = clock_.now();
    // A uid's bucket outlives its connections until it would be full again:
    // reconnecting must not buy a fresh burst.
    std::erase_if(uid_buckets_, [&](const auto& kv) {
        return kv.second.users == 0 && now - kv.second.refilled >= kSecond;
    });
    const Bucket full{double(opt_.requests_per_s), now, 0};
    if (rights_.may_mutate(c.peer)) {
        c.own = full;
        ++c.own.users;
        return c.own;
    }
    Bucket& b = uid_buckets_.try_emplace(c.peer.uid, full).first->second;
    ++b.users;
    return b;
}

void AdminServer::release_bucket(Conn& c) {
    if (c.bucket) --c.bucket->users;
    c.bucket = nullptr;
}

bool AdminServer::write_out(Conn& c) {
    if (c.dead) return false;
    while (!c.out.empty()) {
        ssize_t n = ::send(c.fd.get(), c.out.data(), c.out.size(), MSG_DONTWAIT | MSG_NOSIGNAL);
        if (n < 0) {
            if (errno == EAGAIN || errno == EWOULDBLOCK) break;
            if (errno == EINTR) continue;
            drop(c);
            return false;
        }
        c.out.erase(0, static_cast<std::size_t>(n));
    }
    return true;
}

void AdminServer::flush(Conn& c) {
    if (write_out(c)) update(c);
}

void AdminServer::update(Conn& c) {
    if (c.dead) return;
    if (c.closing && c.out.empty()) {
        // Closing with unread input would make the peer's next read fail
        // with ECONNRESET: send EOF, discard what still comes (for a while).
        if (!c.draining) {
            c.draining = true;
            ::shutdown(c.fd.get(), SHUT_WR);
            c.resume.cancel();
            c.idle.arm(clock_.now() + kDrainTime, [this, &c] { drop(c); });
        }
        c.watch.set_condition(G_IO_IN);
        return;
    }
    int cond = 0;
    bool room = c.in.size() < 2 * kAdminMaxLine && c.out.empty();
    if (!c.closing && !c.eof && !c.paused && room) cond |= G_IO_IN;
    if (!c.out.empty()) cond |= G_IO_OUT;
    c.watch.set_condition(static_cast<GIOCondition>(cond));
}

void AdminServer::answer(std::uint64_t id, json resp) {
    for (auto& p : conns_) {
        if (p->id != id || p->dead) continue;
        Conn& c = *p;
        shared_.clear();  // a deferred answer is a mutation's: what others see must not predate it
        c.out += dump_line(resp);
        c.waiting = false;
        c.idle.arm(clock_.now() + opt_.idle_timeout, [this, &c] { drop(c); });
        if (!c.in_handler) process(c);  // else the loop in process() goes on
        return;
    }
}

void AdminServer::drop(Conn& c) {
    if (c.dead) return;
    c.dead = true;
    release_bucket(c);
    c.watch.reset();
    c.idle.cancel();
    c.resume.cancel();
    dead_.push_back(&c);
    // Freed from the loop, never under a callback of its own.
    if (!reaper_)
        reaper_ = add_idle(ctx_, [this] {
            for (Conn* d : dead_)
                conns_.remove_if([d](const std::unique_ptr<Conn>& p) { return p.get() == d; });
            dead_.clear();
            return false;
        });
}

}  // namespace pvgpu::daemon
