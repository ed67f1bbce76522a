// pvgpud: the scheduling core running in real time on a GLib main loop
// against the host's GPUs (backends; the simulated GPU by default), serving
// VMMs and host processes on the client socket and administrators on the
// admin socket.
//
// GPUs: each has its own scheduler, policy, entity tree and share monitor,
// scheduled independently of the others.  A VMM connection (one pvgpu
// device) and a host user live on one GPU each, named in HELLO or placed
// by pvgpud (Placement); a VM with a device on two GPUs has a VM entity on
// each.  Clients see pvgpud's channel ids, which stay when `move` carries a
// VM's channels to another GPU (Daemon::Move).
//
// Entities (docs/protocol.md 1.2): a VMM's VM is a child of the root keyed
// by UUID; its channels go to "task-<pid hint>" children (hint 0: the VM
// itself, as a guest without the driver's hints looks).  Host clients are
// grouped by user: each uid has one entity under the root, shown as
// host/<user>, and each connection is a task under it, host/<user>/<name>,
// so one user's connections share that user's weight.  Only the configured
// VMM users (SO_PEERCRED) may say HELLO as a VMM.
//
// Submission path: the client stores ring entries and IB_PUT in the shared
// memfd and rings the channel's doorbell eventfd; the daemon reads IB_PUT
// from the shared page and stores it through the channel's ShadowChannel,
// so the mode the policy chose is enforced here whatever the client does.
// MODE pushes ask a VMM to switch its guest's mapping too; one that does
// not answer in time gets DEGRADED and keeps being enforced here.  Host
// clients get none: all their submissions reach the daemon anyway, and work
// held here stays visible to the policy's work-conserving releases.  While work is in flight the
// daemon also re-reads every IB_PUT now and then, as a GPU front end polling
// its channels would, so a store whose doorbell never came still runs.
#pragma once

#include <glib.h>

#include <deque>
#include <map>
#include <memory>
#include <set>
#include <string>
#include <unordered_map>

#include "admin.hpp"
#include "channel_memory.hpp"
#include "client_conn.hpp"
#include "config.hpp"
#include "core/scheduler.hpp"
#include "glib_clock.hpp"
#include "gpu_open.hpp"
#include "identity.hpp"
#include "libvirt_watch.hpp"
#include "metrics.hpp"
#include "gsource.hpp"
#include "share_monitor.hpp"
#include "state_store.hpp"
#include "weights.hpp"

namespace pvgpu::daemon {

struct DaemonCounters {
    std::uint64_t clients_total = 0;
    std::uint64_t protocol_errors = 0;
    std::uint64_t mode_switches = 0;  // MODE pushes sent
    std::uint64_t trap_reports = 0;
    std::uint64_t untrapped_reports = 0;  // TRAP_REPORTs the daemon did not trap itself
    std::uint64_t held_reports = 0;       // TRAP_REPORTs of work stored into a shadow page
    std::uint64_t doorbells = 0;
    std::uint64_t watchdog_kills = 0;
    std::uint64_t bad_entry_kills = 0;
    std::uint64_t degraded = 0;
    std::uint64_t moves = 0;
    std::uint64_t quiesces = 0;           // VMs quiesced for a migration (QUIESCE drained)
    std::uint64_t resumes = 0;            // quiesced VMs resumed (RESUME: the migration failed)
    std::uint64_t restored_channels = 0;  // channels re-created by CHAN_RESTORE
};

class Daemon final : private ClientConn::Handler, private AdminBackend, private LibvirtWatch::Listener {
public:
    // Builds everything and binds both sockets.  Throws std::runtime_error.
    explicit Daemon(Config cfg);
    ~Daemon() override;
    Daemon(const Daemon&) = delete;
    Daemon& operator=(const Daemon&) = delete;

    // Runs until quit() (SIGTERM, SIGINT).  Returns the exit status.
    int run();
    void quit();

    GMainContext* context() const { return ctx_.get(); }
    // Adds a check every VMM HELLO must also pass, after the configured VMM
    // users (the libvirt integration's pid check, issue 9).
    void add_vmm_identity_check(std::unique_ptr<VmmIdentityCheck> check);
    const DaemonCounters& counters() const { return counters_; }

private:
    enum class Kind { Vm, VmTask, HostUser, Host };
    // What the daemon knows about an entity it created.
    struct Meta {
        Kind kind = Kind::Host;
        std::string uuid;  // Vm, VmTask: the VM's
        std::string key;   // HostUser: "host/<user>"; Host: "host/<user>/<name>"; VmTask: "task-<hint>"
        std::uint64_t pid_hint = 0;
        std::string task_name;  // VmTask: display name from CHAN_ALLOC
    };
    // One VMM connection's VM on its GPU (a VM with two devices has two).
    struct Vm {
        std::string uuid;
        std::uint32_t gpu = 0;
        std::string hello_name;
        EntityId entity = kNoEntity;
        std::uint32_t client = 0;
        std::map<std::uint64_t, EntityId> tasks;  // pid hint -> task entity
        // Weights the guest asked for its tasks (TASK_WEIGHT), by pid hint,
        // whether or not the task has an entity now; bounded (the oldest set
        // of a task without channels makes room), dropped with the
        // connection or when the guest sends weight 0 (its driver does when
        // the process exits).
        struct GuestWeight {
            std::uint32_t weight = 0;
            std::uint64_t set = 0;  // Vm::weights_set when it was set
        };
        std::map<std::uint64_t, GuestWeight> guest_weights;
        std::uint64_t weights_set = 0;
    };
    struct Channel {
        ChannelId id = 0;        // pvgpud's, what the client sees
        std::uint32_t gpu = 0;   // where it runs now
        ChannelId local = 0;     // the GPU's channel
        std::uint32_t client = 0;
        bool vmm = false;
        std::uint64_t pid_hint = 0;
        EntityId leaf = kNoEntity;
        ChannelMemoryFile mem;
        Doorbell bell;
        CompletionNotifier notifier;  // host clients of protocol version 3 only
        MuxWatch watch;               // after `bell`: removed while its fd is open
        // What a VMM was last told; for a host client (told nothing after
        // its CHAN_REPLY), the mode in force.
        ChannelMode pushed = ChannelMode::Direct;
        std::uint32_t mode_seq = 0;
        // Pushes not acknowledged yet, oldest first: each must be acked
        // (by its own or a later mode_seq) within the timeout.
        std::deque<std::pair<std::uint32_t, Time>> unacked;
        Timer ack_timer;
        bool degraded = false;
    };
    // One GPU of the host: the device (a backend), its scheduler and policy,
    // its share monitor, and what pvgpud knows of the entities in its tree.
    struct Gpu {
        std::uint32_t index = 0;
        std::string name;
        std::unique_ptr<GpuDevice> dev;
        std::unique_ptr<Scheduler> sched;
        std::unique_ptr<ShareMonitor> monitor;
        std::string policy_name;
        PolicyParams policy_params;  // as given (defaults filled in on output)
        std::unordered_map<EntityId, Meta> meta;
        std::unordered_map<ChannelId, ChannelId> chan_of;  // the GPU's channel -> pvgpud's
        std::string arbitration;                            // as the backend reports it
    };
    // A VM device's channels on their way to another GPU (admin `move`):
    // every channel drains on `from` (new ones too), then all are re-created
    // on `to` with their positions and the VM's entities follow.  Until the
    // switch nothing has changed on `to`, so a move that fails (the drain
    // outlasts the watchdog, the VM disconnects) leaves the VM where it was.
    struct Move {
        std::uint32_t client = 0;
        std::string uuid;
        std::uint32_t from = 0, to = 0;
        std::map<ChannelId, Time> draining;  // pvgpud's id -> when it was shadowed
        Time deadline = 0;
        Timer poll;
        AdminReply reply;
    };
    using VmKey = std::pair<std::string, std::uint32_t>;  // UUID, GPU
    using UserKey = std::pair<std::string, std::uint32_t>;  // user name, GPU
    // A uid with host clients on a GPU: its entity lives while it has any.
    struct HostUser {
        EntityId entity = kNoEntity;
        std::uint32_t clients = 0;
    };
    // A VMM's channels held for a live migration (QUIESCE, protocol v5):
    // drained like a move's, until RESUME (a failed migration) or the
    // connection's end (a completed one: the source QEMU exits).
    struct Quiesce {
        std::uint32_t seq = 0;   // the QUIESCE's, echoed in its answers
        UniqueFd done;           // the client's socket for quiesce_done; closed once sent
        std::set<ChannelId> held;
        Time since = 0, deadline = 0;
        bool drained = false;
        Timer poll;
    };
    struct Client {
        std::unique_ptr<ClientConn> conn;
        uid_t uid = 0;
        bool vmm_user = false;  // the uid may be a VMM: counted in the VMM budget
        bool hello = false;
        std::uint32_t role = 0;
        std::uint32_t version = 0;         // protocol version agreed at HELLO
        std::string uuid;                  // VMM
        EntityId host_entity = kNoEntity;  // HOST
        std::string host_user;             // HOST: key of host_users_
        std::uint32_t gpu = 0;             // after HELLO: the GPU it is on
        std::set<ChannelId> channels;
        UniqueFd pidfd;                 // a VMM user's process (identity checks)
        bool hello_pending = false;     // its HELLO waits for libvirt
        bool libvirt_verified = false;  // VMM: libvirt named it its domain's QEMU
        bool closing = false;
        bool linger = false;  // refused at HELLO: its socket outlives it (linger())
        std::unique_ptr<Quiesce> quiesce;  // VMM: its channels held for a migration
    };

    // --- client protocol ---
    void on_message(ClientConn& c, wire::Message& m) override;
    void on_closed(ClientConn& c, const std::string& reason, bool protocol_error) override;
    void accept_clients();
    // A HELLO being answered (maybe later: libvirt is asked off the loop).
    struct HelloRequest {
        pvgpu_hello h{};
        std::uint32_t seq = 0;
        std::string raw;                     // the name given
        std::optional<std::uint32_t> asked;  // the GPU named, if any
    };
    void on_hello(Client& cl, const wire::Message& m);
    void hello_vmm(Client& cl, const HelloRequest& req);
    void admit_vmm(Client& cl, const HelloRequest& req, const std::string& uuid, const DomainAnswer* libvirt);
    // The GPU a VMM's HELLO asks for (the order is in daemon.cpp); `refused`:
    // the HELLO was refused for it.  `reserved`: its pod's allocation file
    // named it.
    struct AskedGpu {
        std::optional<std::uint32_t> gpu;
        bool reserved = false;
        bool refused = false;
    };
    AskedGpu asked_gpu(Client& cl, const HelloRequest& req, const std::string& uuid, const DomainInfo* domain,
                       const std::set<std::uint32_t>& taken);
    // The GPU the VMM's pod reserved ([kubernetes] allocation_file, issue
    // 55); nullopt with `why` empty when none, with `why` set when the file
    // is there and wrong (the HELLO is refused).
    std::optional<std::uint32_t> pod_reservation(const Client& cl, std::string& why) const;
    void finish_hello(Client& cl, const HelloRequest& req);
    void refuse_hello(Client& cl, const HelloRequest& req, std::uint32_t status, const std::string& why);
    pvgpu_hello_reply hello_reply(const Client& cl, const HelloRequest& req, std::uint32_t status) const;
    bool hello_full() const;
    // --- VMM identity against libvirt (issue 51 item 9) ---
    bool is_process(const Client& cl, pid_t pid) const;
    std::optional<std::string> libvirt_refusal(const Client& cl, const std::string& uuid, const DomainAnswer& a,
                                               bool& verified) const;
    void evict_unverified(const std::string& uuid, const std::string& name, pid_t qemu);
    void on_alloc(Client& cl, const wire::Message& m);
    void on_free(Client& cl, const wire::Message& m);
    void on_mode_ack(Client& cl, const wire::Message& m);
    void on_trap_report(Client& cl, const wire::Message& m);
    void on_task_weight(Client& cl, const wire::Message& m);
    // --- live migration (protocol version 5) ---
    bool migration_session(Client& cl, const char* request);
    void on_quiesce(Client& cl, wire::Message& m);
    void quiesce_poll(std::uint32_t client_id);
    void quiesce_end(Client& cl, std::uint32_t status);
    void on_resume(Client& cl, const wire::Message& m);
    void on_restore(Client& cl, wire::Message& m);
    // A channel saved elsewhere, for CHAN_RESTORE: positions and the bytes
    // of its control page and ring.
    struct Restore {
        std::uint32_t put = 0, get = 0, fence = 0;
        std::vector<std::byte> mem;
    };
    void open_channel_for(Client& cl, std::uint32_t seq, std::uint64_t pid_hint, const std::string& task_name,
                          const Restore* restore);
    void reap();
    void teardown(std::uint32_t client_id);
    void linger(UniqueFd fd);
    // Connections (HELLO or not) and channels in one budget: a client is in
    // the VMM budget once it is a VMM, or before HELLO when its uid may be
    // one; otherwise in the host budget.  `uid` nullopt: every uid.
    struct Usage {
        std::size_t clients = 0, channels = 0;
    };
    static bool in_vmm_budget(const Client& cl);
    Usage usage(bool vmm_budget, std::optional<uid_t> uid, std::uint32_t except = 0) const;
    // Why a new channel for `cl` would break a limit, or empty.
    std::string channel_limit(const Client& cl) const;
    bool hello_host(Client& cl, const std::string& raw, std::uint32_t pid, std::optional<std::uint32_t> asked,
                    std::string& error);
    // --- GPUs and placement ---
    Gpu& gpu_of(const Channel& ch) { return *gpus_.at(ch.gpu); }
    Scheduler& sched_of(const Channel& ch) { return *gpus_.at(ch.gpu)->sched; }
    void open_gpus();
    void set_gpu_policy(Gpu& g, const std::string& name, const PolicyParams& params);
    // The GPU for a new VM device or host user named `key` ("vm/<uuid>",
    // "user/<name>"): the one asked for, else where it was, else by the
    // configured placement; never one in `taken`.  nullopt with `error`.
    std::optional<std::uint32_t> place(const std::string& key, std::optional<std::uint32_t> asked,
                                       const std::set<std::uint32_t>& taken, std::string& error);
    void remember_placement(const std::string& key, std::uint32_t gpu, std::optional<std::uint32_t> from = {});
    Vm* vm_of(const Client& cl);
    // --- moving a VM between GPUs ---
    void move_drain(ChannelId id);
    void move_poll();
    void move_switch();
    void move_abort(const std::string& why);
    void move_forget(ChannelId id);
    // The entity a moved channel of `vm` joins on its GPU `g`.
    EntityId moved_leaf(Gpu& g, Vm& vm, const Channel& ch, std::uint32_t weight, const std::string& task_name);
    std::set<std::uint32_t> gpus_of_vm(const std::string& uuid) const;
    // --- channels ---
    Channel* owned(const Client& cl, std::uint32_t chan_id);
    EntityId leaf_for(Client& cl, std::uint64_t pid_hint, const std::string& task_name, std::string& error);
    void on_doorbell(ChannelId ch);
    // A scheduler callback's channel (the GPU's id) as pvgpud's, or 0.
    ChannelId chan_id(const Gpu& g, ChannelId local) const;
    // Stores a put the client reported (doorbell, trap report, mode ack).
    bool deliver_put(Channel& ch, std::uint32_t put);
    void close_channel(ChannelId ch);
    void remove_if_empty_task(Gpu& g, EntityId leaf);
    void on_mode_change(ChannelId ch, ChannelMode mode);
    void push_mode(Channel& ch, ChannelMode mode);
    void check_ack(ChannelId ch);
    void on_channel_error(ChannelId ch, std::uint32_t error);
    void on_fence(ChannelId ch, std::uint32_t fence);
    void scan_puts();

    // --- entities and weights ---
    std::string admin_path(const Gpu& g, EntityId id) const;
    std::string admin_path(const Channel& ch) const { return admin_path(*gpus_.at(ch.gpu), ch.leaf); }
    void remove_entity(Gpu& g, EntityId id);
    void save_state();

    // --- admin ---
    nlohmann::json admin_list() override;
    void admin_set_weight(const nlohmann::json& req, AdminReply reply) override;
    nlohmann::json set_weight_here(const std::string& target, std::uint32_t weight,
                                   const std::optional<std::string>& domain);
    nlohmann::json admin_set_policy(const nlohmann::json& req) override;
    nlohmann::json admin_get_policy() override;
    nlohmann::json admin_stats() override;
    void admin_move(const nlohmann::json& req, AdminReply reply) override;
    nlohmann::json effective_params(const Gpu& g) const;
    nlohmann::json list_gpu(Gpu& g);
    nlohmann::json stats_gpu(Gpu& g);

    // --- libvirt (the domains' metadata is the truth for their weights) ---
    void domain_up(const DomainInfo& d) override;
    void domain_down(const std::string& uuid, const std::string& name) override;
    void domain_not_running(const std::string& uuid, const std::string& name) override;
    // A VM's weight from wherever it is kept, applied and saved.
    void apply_vm_weight(const std::string& uuid, const std::string& name, std::uint32_t weight);

    struct ContextUnref {
        void operator()(GMainContext* c) const { g_main_context_unref(c); }
    };
    struct LoopUnref {
        void operator()(GMainLoop* l) const { g_main_loop_unref(l); }
    };

    Config cfg_;
    std::unique_ptr<GMainContext, ContextUnref> ctx_;
    std::unique_ptr<GMainLoop, LoopUnref> loop_;
    MonotonicClock clock_;
    GlibTimers timers_;
    // Client sockets and doorbells: one fd in the GLib loop for all of them.
    FdMux mux_;
    StateStore store_;
    State state_;
    WeightBook weights_;  // every weight's source (weights.hpp)
    std::vector<std::unique_ptr<Gpu>> gpus_;
    std::unique_ptr<TextfileExporter> metrics_file_;
    Time started_ = 0;

    std::map<VmKey, Vm> vms_;              // connected VMs
    std::map<UserKey, HostUser> host_users_;
    ChannelId next_chan_ = 1;
    std::unique_ptr<Move> move_;  // the one move under way
    VmmUsers vmm_users_;
    std::vector<std::unique_ptr<VmmIdentityCheck>> vmm_checks_;
    std::map<ChannelId, std::unique_ptr<Channel>> channels_;  // by pvgpud's id
    std::map<std::uint32_t, Client> clients_;
    std::uint32_t next_client_ = 1;
    std::set<std::uint32_t> to_reap_;
    Source reaper_;
    DaemonCounters counters_;

    UniqueFd listen_fd_;
    FdWatch listen_watch_;
    Timer accept_pause_;
    Timer scan_timer_;
    Timer linger_timer_;
    std::deque<std::pair<Time, UniqueFd>> lingering_;  // refused clients' sockets, oldest first
    std::unique_ptr<AdminServer> admin_;
    Source sigterm_, sigint_, sighup_;
    std::unique_ptr<LibvirtWatch> libvirt_;                // null: not following libvirt
    std::map<std::string, std::string> metadata_errors_;  // by UUID: logged once
};

}  // namespace pvgpu::daemon
