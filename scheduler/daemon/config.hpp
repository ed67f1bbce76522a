// pvgpud's configuration: PVGPU_CONFIG_FILE (GKeyFile format) with
// command-line overrides.  A missing default file means defaults; anything
// malformed is a ConfigError naming the file, line and key.
#pragma once

#include <cstdint>
#include <map>
#include <optional>
#include <stdexcept>
#include <string>
#include <vector>

#include "core/policy.hpp"
#include "core/scheduler.hpp"
#include <pvgpu/protocol.h>
#include "log.hpp"
#include "pvgpu_paths.h"  // generated: the configured default paths

namespace pvgpu::daemon {

inline constexpr const char* kDefaultConfigPath = PVGPU_CONFIG_FILE;

class ConfigError : public std::runtime_error {
public:
    using std::runtime_error::runtime_error;
};

// Resource limits that keep one client, or one user, from hurting the
// daemon or others.  VMMs and host users have separate budgets: host
// clients together never hold more than host_clients / host_channels, so
// the rest of max_clients / max_channels stays for VMs.
struct Limits {
    std::uint32_t max_clients = 256;
    std::uint32_t max_channels_per_client = 64;
    std::uint32_t max_channels = 1024;
    std::uint32_t vmm_clients_per_uid = 256;
    std::uint32_t vmm_channels_per_uid = 1024;
    std::uint32_t host_clients = 128;
    std::uint32_t host_channels = 512;
    std::uint32_t host_clients_per_uid = 16;
    std::uint32_t host_channels_per_uid = 128;
    std::size_t max_queue_bytes = 1024 * 1024;  // a client that stops reading is dropped
    std::uint32_t max_queue_fds = 8;            // requests wait while this many fds are queued
    Duration hello_timeout = 5 * kSecond;
    Duration mode_ack_timeout = 1 * kSecond;
    std::uint32_t admin_max_clients = 32;
    std::uint32_t admin_max_clients_per_uid = 4;     // unprivileged peers
    std::uint32_t admin_reserved_clients = 4;        // beyond admin_max_clients, privileged peers only
    std::uint32_t admin_requests_per_s = 200;
    Duration admin_idle_timeout = 60 * kSecond;
};

// [metrics]: a Prometheus textfile for node_exporter (off when empty).
struct MetricsConfig {
    std::string textfile;
    Duration interval = 15 * kSecond;
};

// [libvirt]: follow libvirt's domains (weights from domain metadata, the
// QEMU pid of each domain for HELLO checks).
struct LibvirtConfig {
    std::string uri = "qemu:///system";         // "none": do not follow libvirt
    std::string pid_dir = "/run/libvirt/qemu";  // where libvirt writes NAME.pid
};

// [kubernetes]: the file pvgpu-device-plugin mounts into a pod's compute
// container, read through the VMM's /proc/PID/root (docs/kubernetes.md).
struct KubernetesConfig {
    std::string allocation_file = "/run/pvgpu/allocation.json";  // empty: off
};

// [gpu] or [gpu.N]: one GPU of the host as its backend opens it.  The
// engine keys are handed to the backend as "key=value" options, only those
// the file sets: a backend keeps its own defaults (the simulated GPU's are
// in pvgpud.conf) and refuses what it cannot do.
struct GpuConfig {
    std::string name = "gpu0";    // shown in every view; default gpuN
    std::string backend = "sim";  // "sim" (built in) or a backend module's path
    std::optional<std::string> arbitration;  // round-robin | timeslice
    std::optional<std::int64_t> timeslice_us, ctxsw_us, preempt_us, watchdog_ms;
    // The simulated GPU's context-switch trace (true | false); false models
    // a GPU without one, whose accounting guesses.
    std::optional<std::string> ctxsw_trace;
};
// The backend options of `g`, e.g. {"arbitration=timeslice", "timeslice_us=2000"}.
std::vector<std::string> backend_options(const GpuConfig& g);

// [daemon] placement: where a VM or host user that names no GPU goes.
// spread: the GPU with the least total weight placed on it (ties: the lowest
// index); pack: the lowest-index GPU with fewer than pack_limit placed.
enum class Placement { Spread, Pack };

inline constexpr std::uint32_t kMaxGpus = PVGPU_MAX_GPUS;

struct Config {
    // [daemon]
    std::string socket = PVGPU_SOCKET_PATH;
    std::string admin_socket = PVGPU_ADMIN_SOCKET_PATH;
    std::uint32_t socket_mode = 0660;
    std::string socket_group;  // empty: the daemon's group
    // Users (names or numeric uids) whose processes may say HELLO as a VMM.
    std::vector<std::string> vmm_users{"root", "libvirt-qemu"};
    std::uint32_t admin_socket_mode = 0666;
    std::string admin_group = "pvgpu";  // may use mutating admin commands; empty: none
    std::string state_dir = PVGPU_STATE_DIR;
    LogLevel log_level = LogLevel::Info;
    // SCHED_FIFO priority (1..99) pvgpud gives itself; 0: keep what it was
    // started with.  Its latency is the GPU's idle time (pvgpud(8)).
    std::uint32_t realtime_priority = 0;
    // [scheduler] and [policy.NAME]
    std::string policy = "hfq";
    bool policy_overridden = false;  // --policy given: wins over the state file
    std::map<std::string, PolicyParams> policy_params;
    MechanismCosts costs;
    // [daemon] placement, pack_limit
    Placement placement = Placement::Spread;
    std::uint32_t pack_limit = 8;
    // [gpu] or [gpu.0] .. [gpu.15], in index order; never empty.
    std::vector<GpuConfig> gpus{GpuConfig{}};
    // [limits]
    Limits limits;
    // [metrics]
    MetricsConfig metrics;
    // [libvirt]
    LibvirtConfig libvirt;
    // [kubernetes]
    KubernetesConfig kubernetes;
};

// Command line.  parse_cli throws ConfigError with a usage hint.
struct CliOptions {
    std::optional<std::string> config, socket, admin_socket, state_dir, policy, admin_group;
    std::optional<std::string> realtime_priority;
    std::optional<std::string> gpus;  // --gpus N
    int verbose = 0;
    bool help = false;
    bool version = false;
};
CliOptions parse_cli(int argc, char** argv);
std::string usage();

// Parses config text; `name` is used in messages ("pvgpud.conf:12: ...").
Config parse_config(const std::string& text, const std::string& name);
// Reads the file (the default path may be missing; an explicit one may not),
// parses it and applies the command-line overrides.
Config load_config(const CliOptions& cli);

// The parameters of `policy` from the config, empty when none were given.
PolicyParams params_for(const Config& cfg, const std::string& policy);

}  // namespace pvgpu::daemon
