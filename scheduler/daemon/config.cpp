#include "config.hpp"

#include <getopt.h>
#include <glib.h>

#include <cerrno>
#include <charconv>
#include <cstring>
#include <fstream>
#include <functional>
#include <memory>
#include <optional>
#include <set>
#include <sstream>
#include <string_view>
#include <utility>
#include <vector>

namespace pvgpu::daemon {

namespace {

struct KeyFileDeleter {
    void operator()(GKeyFile* k) const { g_key_file_free(k); }
};
using KeyFilePtr = std::unique_ptr<GKeyFile, KeyFileDeleter>;

struct GErrorDeleter {
    void operator()(GError* e) const { g_error_free(e); }
};
using GErrorPtr = std::unique_ptr<GError, GErrorDeleter>;

std::string trim(std::string_view s) {
    auto b = s.find_first_not_of(" \t\r");
    if (b == std::string_view::npos) return {};
    auto e = s.find_last_not_of(" \t\r");
    return std::string(s.substr(b, e - b + 1));
}

// A whole number in [min, max], all of `v` (no sign, blanks or suffix).
template <class T>
std::optional<T> whole_number(std::string_view v, T min, T max, int base = 10) {
    T value{};
    const auto [p, ec] = std::from_chars(v.data(), v.data() + v.size(), value, base);
    if (ec != std::errc() || p != v.data() + v.size() || value < min || value > max) return std::nullopt;
    return value;
}

// Where each key was written, so messages can name the line.  The syntax
// check here is stricter than GKeyFile's message and names the line.
class LineMap {
public:
    LineMap(const std::string& text, const std::string& name) : name_(name) {
        std::istringstream in(text);
        std::string line, group;
        int n = 0;
        while (std::getline(in, line)) {
            ++n;
            std::string t = trim(line);
            if (t.empty() || t[0] == '#') continue;
            if (t[0] == '[') {
                if (t.back() != ']' || t.size() < 3)
                    throw ConfigError(name + ":" + std::to_string(n) + ": malformed group header '" + t +
                                      "'");
                group = t.substr(1, t.size() - 2);
                groups_.emplace(group, n);
                continue;
            }
            auto eq = t.find('=');
            if (eq == std::string::npos || eq == 0)
                throw ConfigError(name + ":" + std::to_string(n) +
                                  ": expected 'key = value', '[group]' or '# comment', got '" + t + "'");
            if (group.empty())
                throw ConfigError(name + ":" + std::to_string(n) + ": key '" + trim(t.substr(0, eq)) +
                                  "' comes before any [group]");
            keys_.emplace(group + "\n" + trim(t.substr(0, eq)), n);
        }
    }

    // "file:12: [gpu] timeslice_us"
    std::string where(const std::string& group, const std::string& key) const {
        auto it = keys_.find(group + "\n" + key);
        std::string at = name_;
        if (it != keys_.end()) at += ":" + std::to_string(it->second);
        return at + ": [" + group + "] " + key;
    }
    std::string where_group(const std::string& group) const {
        auto it = groups_.find(group);
        std::string at = name_;
        if (it != groups_.end()) at += ":" + std::to_string(it->second);
        return at + ": [" + group + "]";
    }

private:
    std::string name_;
    std::map<std::string, int> keys_;
    std::map<std::string, int> groups_;
};

// "gpu.N" with N a GPU index written plainly (no sign, no leading zero).
std::optional<std::uint32_t> gpu_group_index(const std::string& group) {
    if (group.rfind("gpu.", 0) != 0) return std::nullopt;
    const std::string n = group.substr(4);
    if (n.size() > 1 && n[0] == '0') return std::nullopt;
    return whole_number<std::uint32_t>(n, 0, kMaxGpus - 1);
}

class Reader {
public:
    Reader(GKeyFile* kf, const LineMap& lines) : kf_(kf), lines_(lines) {}

    std::optional<std::string> raw(const char* group, const char* key) {
        seen_.insert(std::string(group) + "\n" + key);
        if (!g_key_file_has_key(kf_, group, key, nullptr)) return std::nullopt;
        GError* err = nullptr;
        gchar* v = g_key_file_get_string(kf_, group, key, &err);
        if (!v) {
            GErrorPtr e(err);
            throw ConfigError(lines_.where(group, key) + ": " + (e ? e->message : "unreadable value"));
        }
        std::string s(v);
        g_free(v);
        return trim(s);
    }

    void string(const char* group, const char* key, std::string& out) {
        if (auto v = raw(group, key)) out = *v;
    }

    template <class T>
    void number(const char* group, const char* key, T& out, T min, T max, int base = 10) {
        auto v = raw(group, key);
        if (!v) return;
        const std::optional<T> value = whole_number(*v, min, max, base);
        if (!value)
            throw ConfigError(lines_.where(group, key) + ": '" + *v + "' is not " +
                              (base == 8 ? "an octal mode" : "an integer") + " in " + std::to_string(min) +
                              ".." + std::to_string(max));
        out = *value;
    }

    void duration(const char* group, const char* key, Duration& out, Duration unit, std::int64_t min,
                  std::int64_t max) {
        std::int64_t v = out / unit;
        number<std::int64_t>(group, key, v, min, max);
        out = v * unit;
    }

    double real(const std::string& group, const std::string& key) {
        auto v = raw(group.c_str(), key.c_str());
        double value = 0;
        auto [p, ec] = std::from_chars(v->data(), v->data() + v->size(), value);
        if (ec != std::errc() || p != v->data() + v->size() || !(value >= 0))
            throw ConfigError(lines_.where(group, key) + ": '" + *v + "' is not a number >= 0");
        return value;
    }

    // Every key present must have been read: a typo is an error, not a default.
    void check_unknown() const {
        gsize ngroups = 0;
        gchar** groups = g_key_file_get_groups(kf_, &ngroups);
        std::unique_ptr<gchar*, decltype(&g_strfreev)> gfree(groups, g_strfreev);
        for (gsize i = 0; i < ngroups; ++i) {
            std::string g = groups[i];
            if (g.rfind("policy.", 0) == 0) continue;  // checked against the catalog
            static const std::set<std::string> known = {"daemon",  "scheduler", "gpu",
                                                        "limits",  "metrics",   "libvirt",
                                                        "kubernetes"};
            if (!known.count(g) && !gpu_group_index(g))
                throw ConfigError(lines_.where_group(g) +
                                  ": unknown group (known: daemon, scheduler, gpu, gpu.N, limits, metrics, "
                                  "libvirt, kubernetes, policy.NAME)");
            gsize nkeys = 0;
            gchar** keys = g_key_file_get_keys(kf_, groups[i], &nkeys, nullptr);
            std::unique_ptr<gchar*, decltype(&g_strfreev)> kfree(keys, g_strfreev);
            for (gsize k = 0; k < nkeys; ++k)
                if (!seen_.count(g + "\n" + keys[k]))
                    throw ConfigError(lines_.where(g, keys[k]) + ": unknown key");
        }
    }

    const LineMap& lines() const { return lines_; }
    GKeyFile* kf() const { return kf_; }

private:
    GKeyFile* kf_;
    const LineMap& lines_;
    std::set<std::string> seen_;
};

void read_policy_groups(Reader& r, Config& cfg) {
    gsize ngroups = 0;
    gchar** groups = g_key_file_get_groups(r.kf(), &ngroups);
    std::unique_ptr<gchar*, decltype(&g_strfreev)> gfree(groups, g_strfreev);
    for (gsize i = 0; i < ngroups; ++i) {
        std::string g = groups[i];
        if (g.rfind("policy.", 0) != 0) continue;
        std::string name = g.substr(7);
        const PolicyInfo* info = nullptr;
        std::string known;
        for (const auto& pi : policy_catalog()) {
            if (pi.name == name) info = &pi;
            known += (known.empty() ? "" : ", ") + pi.name;
        }
        if (!info)
            throw ConfigError(r.lines().where_group(g) + ": unknown policy '" + name + "' (known: " + known +
                              ")");
        gsize nkeys = 0;
        gchar** keys = g_key_file_get_keys(r.kf(), groups[i], &nkeys, nullptr);
        std::unique_ptr<gchar*, decltype(&g_strfreev)> kfree(keys, g_strfreev);
        PolicyParams& params = cfg.policy_params[name];
        for (gsize k = 0; k < nkeys; ++k) {
            std::string key = keys[k];
            bool found = false;
            std::string names;
            for (const auto& [n, def, doc] : info->params) {
                found = found || n == key;
                names += (names.empty() ? "" : ", ") + n;
            }
            if (!found)
                throw ConfigError(r.lines().where(g, key) + ": unknown parameter of policy " + name +
                                  " (known: " + (names.empty() ? "none" : names) + ")");
            params[key] = r.real(g, key);
        }
    }
}

GpuConfig read_gpu_group(Reader& r, const std::string& g, std::uint32_t index) {
    const char* group = g.c_str();
    GpuConfig gpu;
    gpu.name = "gpu" + std::to_string(index);
    r.string(group, "name", gpu.name);
    if (gpu.name.empty() || gpu.name.size() > 32 ||
        gpu.name.find_first_not_of("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789-_.") !=
            std::string::npos)
        throw ConfigError(r.lines().where(g, "name") + ": '" + gpu.name +
                          "' is not a name of 1-32 letters, digits, '-', '_' or '.'");
    r.string(group, "backend", gpu.backend);
    if (gpu.backend != "sim" && (gpu.backend.empty() || gpu.backend[0] != '/'))
        throw ConfigError(r.lines().where(g, "backend") + ": '" + gpu.backend +
                          "' is neither sim nor the absolute path of a backend module");
    if (auto v = r.raw(group, "arbitration")) {
        if (*v != "round-robin" && *v != "timeslice")
            throw ConfigError(r.lines().where(g, "arbitration") + ": '" + *v + "' is not round-robin or timeslice");
        gpu.arbitration = *v;
    }
    auto number = [&](const char* key, std::optional<std::int64_t>& out, std::int64_t min, std::int64_t max) {
        if (!r.raw(group, key)) return;
        std::int64_t v = 0;
        r.number<std::int64_t>(group, key, v, min, max);
        out = v;
    };
    number("timeslice_us", gpu.timeslice_us, 1, 10'000'000);
    number("ctxsw_us", gpu.ctxsw_us, 0, 1'000'000);
    number("preempt_us", gpu.preempt_us, 0, 1'000'000);
    number("watchdog_ms", gpu.watchdog_ms, 0, 3'600'000);
    if (auto v = r.raw(group, "ctxsw_trace")) {
        if (*v != "true" && *v != "false")
            throw ConfigError(r.lines().where(g, "ctxsw_trace") + ": '" + *v + "' is not true or false");
        gpu.ctxsw_trace = *v;
    }
    return gpu;
}

// [gpu] is the one GPU gpu0; [gpu.0] .. [gpu.N-1] are N GPUs, numbered
// without gaps.  Both kinds in one file, a gap or a name used twice is an
// error naming the group.
void read_gpu_groups(Reader& r, Config& cfg) {
    gsize ngroups = 0;
    gchar** groups = g_key_file_get_groups(r.kf(), &ngroups);
    std::unique_ptr<gchar*, decltype(&g_strfreev)> gfree(groups, g_strfreev);
    std::map<std::uint32_t, std::string> numbered;
    bool plain = false;
    for (gsize i = 0; i < ngroups; ++i) {
        const std::string g = groups[i];
        if (g == "gpu") plain = true;
        if (auto n = gpu_group_index(g)) numbered[*n] = g;
    }
    if (plain && !numbered.empty())
        throw ConfigError(r.lines().where_group(numbered.begin()->second) +
                          ": [gpu] and [gpu.N] groups in one file (use [gpu.0] for the first GPU)");
    cfg.gpus.clear();
    if (numbered.empty()) {
        cfg.gpus.push_back(read_gpu_group(r, "gpu", 0));
        return;
    }
    for (const auto& [n, g] : numbered) {
        if (n != cfg.gpus.size())
            throw ConfigError(r.lines().where_group(g) + ": there is no [gpu." + std::to_string(cfg.gpus.size()) +
                              "] (number GPUs from 0 without gaps)");
        cfg.gpus.push_back(read_gpu_group(r, g, n));
        for (std::size_t k = 0; k + 1 < cfg.gpus.size(); ++k)
            if (cfg.gpus[k].name == cfg.gpus.back().name)
                throw ConfigError(r.lines().where(g, "name") + ": '" + cfg.gpus.back().name +
                                  "' is already the name of GPU " + std::to_string(k));
    }
}

// The chosen policy must build with its parameters.
void check_policy(const Config& cfg, const std::string& origin) {
    try {
        make_policy(cfg.policy, params_for(cfg, cfg.policy));
    } catch (const std::invalid_argument& e) {
        throw ConfigError(origin + ": " + e.what());
    }
}

}  // namespace

std::vector<std::string> backend_options(const GpuConfig& g) {
    std::vector<std::string> o;
    if (g.arbitration) o.push_back("arbitration=" + *g.arbitration);
    if (g.timeslice_us) o.push_back("timeslice_us=" + std::to_string(*g.timeslice_us));
    if (g.ctxsw_us) o.push_back("ctxsw_us=" + std::to_string(*g.ctxsw_us));
    if (g.preempt_us) o.push_back("preempt_us=" + std::to_string(*g.preempt_us));
    if (g.watchdog_ms) o.push_back("watchdog_ms=" + std::to_string(*g.watchdog_ms));
    if (g.ctxsw_trace) o.push_back("ctxsw_trace=" + *g.ctxsw_trace);
    return o;
}

PolicyParams params_for(const Config& cfg, const std::string& policy) {
    auto it = cfg.policy_params.find(policy);
    return it == cfg.policy_params.end() ? PolicyParams{} : it->second;
}

Config parse_config(const std::string& text, const std::string& name) {
    LineMap lines(text, name);
    KeyFilePtr kf(g_key_file_new());
    GError* err = nullptr;
    if (!g_key_file_load_from_data(kf.get(), text.data(), text.size(), G_KEY_FILE_NONE, &err)) {
        GErrorPtr e(err);
        throw ConfigError(name + ": " + (e ? e->message : "cannot parse"));
    }
    Config cfg;
    Reader r(kf.get(), lines);

    r.string("daemon", "socket", cfg.socket);
    r.string("daemon", "admin_socket", cfg.admin_socket);
    r.number<std::uint32_t>("daemon", "socket_mode", cfg.socket_mode, 0, 0777, 8);
    r.string("daemon", "socket_group", cfg.socket_group);
    if (auto v = r.raw("daemon", "vmm_users")) {
        cfg.vmm_users.clear();
        std::string item;
        for (char ch : *v + ",") {
            if (ch == ',' || ch == ' ' || ch == '\t') {
                if (!item.empty()) cfg.vmm_users.push_back(std::exchange(item, {}));
            } else {
                item += ch;
            }
        }
    }
    r.number<std::uint32_t>("daemon", "admin_socket_mode", cfg.admin_socket_mode, 0, 0777, 8);
    r.string("daemon", "admin_group", cfg.admin_group);
    r.string("daemon", "state_dir", cfg.state_dir);
    r.number<std::uint32_t>("daemon", "realtime_priority", cfg.realtime_priority, 0, 99);
    if (auto v = r.raw("daemon", "log_level")) {
        auto l = parse_log_level(*v);
        if (!l)
            throw ConfigError(lines.where("daemon", "log_level") + ": '" + *v +
                              "' is not one of error, warning, info, debug");
        cfg.log_level = *l;
    }
    if (auto v = r.raw("daemon", "placement")) {
        if (*v == "spread")
            cfg.placement = Placement::Spread;
        else if (*v == "pack")
            cfg.placement = Placement::Pack;
        else
            throw ConfigError(lines.where("daemon", "placement") + ": '" + *v + "' is not spread or pack");
    }
    r.number<std::uint32_t>("daemon", "pack_limit", cfg.pack_limit, 1, 65536);
    for (const auto* key : {"socket", "admin_socket", "state_dir"}) {
        std::string v = key == std::string("socket")         ? cfg.socket
                        : key == std::string("admin_socket") ? cfg.admin_socket
                                                             : cfg.state_dir;
        if (v.empty()) throw ConfigError(lines.where("daemon", key) + ": must not be empty");
    }

    r.string("scheduler", "policy", cfg.policy);
    r.duration("scheduler", "remap_us", cfg.costs.remap, kMicrosecond, 0, 1'000'000);
    r.duration("scheduler", "trap_us", cfg.costs.trap, kMicrosecond, 0, 1'000'000);
    r.duration("scheduler", "poll_us", cfg.costs.poll, kMicrosecond, 0, 1'000'000);
    read_policy_groups(r, cfg);

    read_gpu_groups(r, cfg);

    Limits& l = cfg.limits;
    r.number<std::uint32_t>("limits", "max_clients", l.max_clients, 1, 65536);
    r.number<std::uint32_t>("limits", "max_channels_per_client", l.max_channels_per_client, 1, 4096);
    r.number<std::uint32_t>("limits", "max_channels", l.max_channels, 1, 65536);
    r.number<std::uint32_t>("limits", "vmm_clients_per_uid", l.vmm_clients_per_uid, 1, 65536);
    r.number<std::uint32_t>("limits", "vmm_channels_per_uid", l.vmm_channels_per_uid, 1, 65536);
    r.number<std::uint32_t>("limits", "host_clients", l.host_clients, 0, 65536);
    r.number<std::uint32_t>("limits", "host_channels", l.host_channels, 0, 65536);
    r.number<std::uint32_t>("limits", "host_clients_per_uid", l.host_clients_per_uid, 0, 65536);
    r.number<std::uint32_t>("limits", "host_channels_per_uid", l.host_channels_per_uid, 0, 65536);
    r.number<std::uint32_t>("limits", "max_queue_fds", l.max_queue_fds, 2, 1024);
    std::size_t kib = l.max_queue_bytes / 1024;
    r.number<std::size_t>("limits", "max_queue_kib", kib, 4, 1024 * 1024);
    l.max_queue_bytes = kib * 1024;
    r.duration("limits", "hello_timeout_ms", l.hello_timeout, kMillisecond, 1, 3'600'000);
    r.duration("limits", "mode_ack_timeout_ms", l.mode_ack_timeout, kMillisecond, 1, 3'600'000);
    r.number<std::uint32_t>("limits", "admin_max_clients", l.admin_max_clients, 1, 4096);
    r.number<std::uint32_t>("limits", "admin_max_clients_per_uid", l.admin_max_clients_per_uid, 1, 4096);
    r.number<std::uint32_t>("limits", "admin_reserved_clients", l.admin_reserved_clients, 1, 4096);
    r.number<std::uint32_t>("limits", "admin_requests_per_s", l.admin_requests_per_s, 1, 1'000'000);
    r.duration("limits", "admin_idle_timeout_s", l.admin_idle_timeout, kSecond, 1, 86400);

    r.string("metrics", "textfile", cfg.metrics.textfile);
    if (!cfg.metrics.textfile.empty()) {
        const std::string& f = cfg.metrics.textfile;
        if (f[0] != '/' || f.back() == '/')
            throw ConfigError(lines.where("metrics", "textfile") + ": '" + f + "' is not an absolute file path");
        if (f.size() < 6 || f.compare(f.size() - 5, 5, ".prom") != 0)
            throw ConfigError(lines.where("metrics", "textfile") + ": '" + f +
                              "' must end in .prom (node_exporter's textfile collector reads only those)");
    }
    r.duration("metrics", "interval_s", cfg.metrics.interval, kSecond, 1, 3600);

    r.string("libvirt", "uri", cfg.libvirt.uri);
    if (cfg.libvirt.uri.empty())
        throw ConfigError(lines.where("libvirt", "uri") + ": empty (use 'none' to not follow libvirt)");
    r.string("libvirt", "pid_dir", cfg.libvirt.pid_dir);
    if (cfg.libvirt.pid_dir.empty() || cfg.libvirt.pid_dir[0] != '/')
        throw ConfigError(lines.where("libvirt", "pid_dir") + ": '" + cfg.libvirt.pid_dir +
                          "' is not an absolute directory");

    r.string("kubernetes", "allocation_file", cfg.kubernetes.allocation_file);
    if (const std::string& f = cfg.kubernetes.allocation_file; !f.empty() && (f[0] != '/' || f.back() == '/'))
        throw ConfigError(lines.where("kubernetes", "allocation_file") + ": '" + f +
                          "' is not an absolute file path (empty: off)");

    r.check_unknown();
    check_policy(cfg, lines.where("scheduler", "policy"));
    return cfg;
}

Config load_config(const CliOptions& cli) {
    std::string path = cli.config.value_or(kDefaultConfigPath);
    std::string text;
    errno = 0;
    std::ifstream in(path, std::ios::binary);
    int open_errno = errno;
    if (in) {
        std::ostringstream ss;
        ss << in.rdbuf();
        if (in.bad()) throw ConfigError(path + ": read error");
        text = ss.str();
    } else if (cli.config || open_errno != ENOENT) {
        throw ConfigError(path + ": " + (open_errno ? std::strerror(open_errno) : "cannot open"));
    }
    Config cfg = parse_config(text, path);

    if (cli.socket) cfg.socket = *cli.socket;
    if (cli.admin_socket) cfg.admin_socket = *cli.admin_socket;
    if (cli.state_dir) cfg.state_dir = *cli.state_dir;
    if (cli.admin_group) cfg.admin_group = *cli.admin_group;
    if (cli.verbose > 0) cfg.log_level = LogLevel::Debug;
    if (cli.realtime_priority) {
        // The file's reader's rule (the file's value is trimmed first).
        const std::optional<std::uint32_t> n = whole_number<std::uint32_t>(*cli.realtime_priority, 0, 99);
        if (!n)
            throw ConfigError("--realtime-priority: '" + *cli.realtime_priority +
                              "' is not a whole number from 0 to 99");
        cfg.realtime_priority = *n;
    }
    if (cli.gpus) {
        // N GPUs configured like the first (tests, the demo).
        const std::optional<std::uint32_t> n = whole_number<std::uint32_t>(*cli.gpus, 1, kMaxGpus);
        if (!n)
            throw ConfigError("--gpus: '" + *cli.gpus + "' is not a whole number from 1 to " +
                              std::to_string(kMaxGpus));
        const GpuConfig first = cfg.gpus.front();
        cfg.gpus.clear();
        for (std::uint32_t i = 0; i < *n; ++i) {
            cfg.gpus.push_back(first);
            cfg.gpus.back().name = "gpu" + std::to_string(i);
        }
    }
    if (cli.policy) {
        cfg.policy = *cli.policy;
        cfg.policy_overridden = true;
        check_policy(cfg, "--policy");
    }
    for (const auto& [opt, v] :
         {std::pair{"--socket", &cfg.socket}, std::pair{"--admin-socket", &cfg.admin_socket},
          std::pair{"--state-dir", &cfg.state_dir}})
        if (v->empty()) throw ConfigError(std::string(opt) + ": must not be empty");
    return cfg;
}

std::string usage() {
    return "Usage: pvgpud [OPTION]...\n"
           "pvgpu host scheduler daemon: shares GPUs by weight between VMs and host tasks.\n"
           "\n"
           "  -c, --config FILE        configuration file (default " PVGPU_CONFIG_FILE ")\n"
           "  -s, --socket PATH        client socket (default " PVGPU_SOCKET_PATH ")\n"
           "  -a, --admin-socket PATH  admin socket (default " PVGPU_ADMIN_SOCKET_PATH ")\n"
           "  -d, --state-dir DIR      persistent state (default " PVGPU_STATE_DIR ")\n"
           "  -p, --policy NAME        scheduling policy: none, timeslice, dfq, hfq\n"
           "  -g, --admin-group NAME   group allowed to change weights and policy ('' for none)\n"
           "  -G, --gpus N             run N GPUs (1-16), each configured as the first\n"
           "  -r, --realtime-priority N  run at SCHED_FIFO priority N (1-99; 0 keeps the policy\n"
           "                           pvgpud was started with)\n"
           "  -f, --foreground         run in the foreground (the default; pvgpud never forks)\n"
           "  -v, --verbose            log debug messages\n"
           "  -h, --help               show this help\n"
           "  -V, --version            show the version\n"
           "\n"
           "See pvgpud(8).\n";
}

CliOptions parse_cli(int argc, char** argv) {
    static const option longopts[] = {
        {"config", required_argument, nullptr, 'c'},
        {"socket", required_argument, nullptr, 's'},
        {"admin-socket", required_argument, nullptr, 'a'},
        {"state-dir", required_argument, nullptr, 'd'},
        {"policy", required_argument, nullptr, 'p'},
        {"admin-group", required_argument, nullptr, 'g'},
        {"realtime-priority", required_argument, nullptr, 'r'},
        {"gpus", required_argument, nullptr, 'G'},
        {"foreground", no_argument, nullptr, 'f'},
        {"verbose", no_argument, nullptr, 'v'},
        {"help", no_argument, nullptr, 'h'},
        {"version", no_argument, nullptr, 'V'},
        {nullptr, 0, nullptr, 0},
    };
    CliOptions o;
    optind = 0;  // full re-initialisation: parse_cli may run more than once (tests)
    opterr = 0;  // errors are ours to word
    for (;;) {
        int c = getopt_long(argc, argv, ":c:s:a:d:p:g:r:G:fvhV", longopts, nullptr);
        if (c == -1) break;
        switch (c) {
        case 'c': o.config = optarg; break;
        case 's': o.socket = optarg; break;
        case 'a': o.admin_socket = optarg; break;
        case 'd': o.state_dir = optarg; break;
        case 'p': o.policy = optarg; break;
        case 'g': o.admin_group = optarg; break;
        case 'r': o.realtime_priority = optarg; break;
        case 'G': o.gpus = optarg; break;
        case 'f': break;
        case 'v': ++o.verbose; break;
        case 'h': o.help = true; break;
        case 'V': o.version = true; break;
        case ':': throw ConfigError(std::string("option '") + argv[optind - 1] + "' needs an argument");
        default: throw ConfigError(std::string("unknown option '") + argv[optind - 1] + "'");
        }
    }
    if (optind < argc) throw ConfigError(std::string("unexpected argument '") + argv[optind] + "'");
    return o;
}

}  // namespace pvgpu::daemon
