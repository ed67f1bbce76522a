// The admin socket (docs/protocol.md section 1): newline-delimited JSON
// requests and responses, read-only commands for anyone who can connect,
// mutating ones only for root, the daemon's uid or the admin group
// (SO_PEERCRED / SO_PEERGROUPS).  Lines are bounded (64 KiB), requests are
// rate-limited (per uid for peers that may not mutate, per connection for
// those that may), idle connections are closed; nothing blocks.  `list` and
// `stats` for peers that may not mutate are built at most once per
// shared_answer_age and the same bytes sent to all of them: a flood of
// read-only requests from every uid costs pvgpud's one thread a few builds
// a second, not one per request (issue 51 item 1).
// Each unprivileged uid may hold a few connections, and privileged peers
// have reserved slots beyond the cap, so nobody can lock out root.  A
// connection's next request is read only once the last response is
// written: a client that does not read holds one response, not thousands.
#pragma once

#include <sys/types.h>

#include <cstdint>
#include <functional>
#include <list>
#include <map>
#include <memory>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "core/time.hpp"
#include "gsource.hpp"
#include "proto/unique_fd.hpp"

namespace pvgpu::daemon {

// 2: accounting by the scheduler under every policy (`accounting` always
// true), `kernels` per entity, `process_cpu_s` and `counters.accounting_reads`
// in stats.  3: host tasks grouped per user, host/<user>/<name> under an
// entity of kind "user", host/<user>.
// 4: several GPUs ("gpus" in list, stats and get-policy, "gpu" per
// entity, set-policy's "gpu"), move.
inline constexpr int kAdminProtocolVersion = 4;
inline constexpr std::size_t kAdminMaxLine = 65536;  // bytes, newline included

struct PeerCred {
    pid_t pid = 0;
    uid_t uid = static_cast<uid_t>(-1);
    gid_t gid = static_cast<gid_t>(-1);
    std::vector<gid_t> groups;  // supplementary (SO_PEERGROUPS)
};

// The answer to a command that finishes later (move): called once, on the
// loop; it does nothing when the connection has gone meanwhile.
using AdminReply = std::function<void(nlohmann::json)>;

// What the commands do; the server only frames, parses and checks rights.
// Every method returns a whole response object ({"ok":...}), or hands one
// to its AdminReply later.
class AdminBackend {
public:
    virtual ~AdminBackend() = default;
    // Mutating, answered when done (maybe at once); the connection reads
    // nothing meanwhile.  set-weight waits for libvirt's metadata write.
    virtual void admin_move(const nlohmann::json& req, AdminReply reply) = 0;
    virtual void admin_set_weight(const nlohmann::json& req, AdminReply reply) = 0;
    virtual nlohmann::json admin_list() = 0;
    virtual nlohmann::json admin_set_policy(const nlohmann::json& req) = 0;
    virtual nlohmann::json admin_get_policy() = 0;
    virtual nlohmann::json admin_stats() = 0;
};

nlohmann::json admin_error(const std::string& message);

// Who may mutate: root, `daemon_uid`, or members of `admin_gid` (-1: none).
class AdminPolicy {
public:
    AdminPolicy(uid_t daemon_uid, gid_t admin_gid, std::string admin_group)
        : daemon_uid_(daemon_uid), admin_gid_(admin_gid), admin_group_(std::move(admin_group)) {}
    bool may_mutate(const PeerCred& peer) const;
    std::string denied(const std::string& cmd) const;

private:
    uid_t daemon_uid_;
    gid_t admin_gid_;
    std::string admin_group_;
};

// One request line -> one response object; nullopt for a blank line; a
// JSON null for a command answered through `later` (the caller waits).
std::optional<nlohmann::json> handle_admin_request(const std::string& line, const PeerCred& peer,
                                                   const AdminPolicy& rights, AdminBackend& backend,
                                                   const AdminReply& later = {});
// The parsing half: nullopt when `line` is a request object with a string
// "cmd" (left in `req`); else a JSON null for a blank line, or the error
// response.
std::optional<nlohmann::json> parse_admin_request(const std::string& line, nlohmann::json& req);
// The executing half, for a request parse_admin_request accepted.
nlohmann::json handle_admin_command(const nlohmann::json& req, const PeerCred& peer, const AdminPolicy& rights,
                                    AdminBackend& backend, const AdminReply& later = {});

class AdminServer {
public:
    struct Options {
        std::string path;
        mode_t mode = 0666;
        std::string socket_group;
        std::string admin_group;
        std::size_t max_clients = 32;
        std::size_t max_clients_per_uid = 4;  // peers that may not mutate
        std::size_t reserved_clients = 4;     // beyond max_clients, for peers that may
        // Per uid for peers that may not mutate (all their connections
        // together), per connection for those that may.
        std::uint32_t requests_per_s = 200;
        Duration idle_timeout = 60 * kSecond;
        // How old a `list` or `stats` answer shared by peers that may not
        // mutate may be (0: built for every request).
        Duration shared_answer_age = 250 * kMillisecond;
    };

    // Binds the socket; throws std::runtime_error.
    AdminServer(GMainContext* ctx, const Clock& clock, Timers& timers, Options opt, AdminBackend& backend);
    ~AdminServer();
    AdminServer(const AdminServer&) = delete;
    AdminServer& operator=(const AdminServer&) = delete;

    std::size_t connections() const { return conns_.size(); }

private:
    struct Conn;
    // A token bucket: requests_per_s per second, bursts of as many.
    struct Bucket {
        double tokens = 0;
        Time refilled = 0;
        std::size_t users = 0;  // connections drawing on it
    };
    // A read-only answer built once and sent to every unprivileged peer
    // that asks within shared_answer_age.
    struct Shared {
        std::string line;
        Time built = 0;
    };
    Bucket& bucket_of(Conn& c);
    void release_bucket(Conn& c);
    // The response line to `req` for `c`; empty when it comes later.
    std::string respond(Conn& c, const nlohmann::json& req, Time now);
    const std::string& shared_answer(const std::string& cmd, Time now);
    void accept_some();
    void on_io(Conn& c, GIOCondition cond);
    void process(Conn& c);
    void flush(Conn& c);
    // Writes what the socket takes; false when the connection was dropped.
    bool write_out(Conn& c);
    void update(Conn& c);
    void drop(Conn& c);
    // A deferred command's response for connection `id`, if it is still there.
    void answer(std::uint64_t id, nlohmann::json resp);

    GMainContext* ctx_;
    const Clock& clock_;
    Timers& timers_;
    Options opt_;
    AdminBackend& backend_;
    AdminPolicy rights_;
    UniqueFd listen_fd_;
    FdWatch listen_watch_;
    std::list<std::unique_ptr<Conn>> conns_;
    std::uint64_t next_conn_ = 1;
    Source reaper_;
    std::vector<Conn*> dead_;
    std::map<uid_t, Bucket> uid_buckets_;      // peers that may not mutate
    std::map<std::string, Shared> shared_;     // by command
};

}  // namespace pvgpu::daemon
