// pvgpuctl: admin CLI of pvgpud (docs/pvgpuctl.8.md).  Speaks the admin
// protocol of docs/protocol.md: one JSON object per line over a UNIX socket.
#include <poll.h>
#include <signal.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <termios.h>
#include <unistd.h>

#include <nlohmann/json.hpp>

#include <algorithm>
#include <cerrno>
#include <charconv>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <ctime>
#include <map>
#include <optional>
#include <string>
#include <string_view>
#include <system_error>
#include <utility>
#include <vector>

#include <pvgpu/abi.h>  // PVGPU_WEIGHT_*

#include "admin_connection.hpp"
#include "proto/share_text.hpp"
#include "proto/unique_fd.hpp"
#include "pvgpu_paths.h"
#ifdef PVGPU_HAVE_LIBVIRT
#include <libvirt/virterror.h>
#include <pvgpu/protocol.h>  // PVGPU_MAX_GPUS (attach --gpu)

#include "virt.hpp"
#endif

#ifndef PVGPU_VERSION
#define PVGPU_VERSION "unknown"
#endif

namespace {

using json = nlohmann::json;
using SteadyClock = std::chrono::steady_clock;

constexpr int kExitOk = 0;
constexpr int kExitDaemon = 1;
constexpr int kExitUsage = 2;

constexpr const char* kDefaultAdminSocket = PVGPU_ADMIN_SOCKET_PATH;
constexpr const char* kDefaultClientSocket = PVGPU_SOCKET_PATH;
// The admin connection and its errors: admin_connection.hpp.
using pvgpu::AdminConnection;
using pvgpu::DaemonError;

constexpr auto kReplyTimeout = AdminConnection::kReplyTimeout;
// A move answers when it has finished: pvgpud drains the VM's work from the
// GPU first (bounded by the GPU watchdog), which may take seconds.
constexpr auto kMoveTimeout = std::chrono::seconds(60);
// The admin protocol version that reports per GPU ("gpus") and has move.
constexpr int kAdminProtocolGpus = 4;
constexpr unsigned kWeightMin = PVGPU_WEIGHT_MIN;
constexpr unsigned kWeightMax = PVGPU_WEIGHT_MAX;
constexpr unsigned kWeightDefault = PVGPU_WEIGHT_DEFAULT;
// "1..10000", as the help texts write the range.
const std::string kWeightRange = std::to_string(kWeightMin) + ".." + std::to_string(kWeightMax);

// ---- errors -----------------------------------------------------------------

struct UsageError {
    std::string message;
};
// ---- command line -------------------------------------------------------------

struct Args {
    std::string admin_socket;
    bool json_output = false;
    std::string command;
    std::vector<std::string> operands;
    std::optional<double> interval_s;
    std::optional<unsigned long> count;
    std::string libvirt_uri;             // empty: libvirt's default
    std::optional<std::string> weight;   // attach
    std::optional<std::string> gpu_text;  // --gpu as given (attach also takes "any")
    std::string client_socket;           // attach
    std::string emulator;                // attach
    std::optional<unsigned> gpu;         // list, top, stats, policy, set-policy, move
    std::optional<unsigned> from_gpu;    // move
    bool help = false;
};

bool looks_like_option(std::string_view a) {
    // "-5" is an operand (a bad weight), not an option.
    return a.size() > 1 && a[0] == '-' && !(a[1] >= '0' && a[1] <= '9');
}

Args parse_args(int argc, char** argv) {
    Args a;
    bool operands_only = false;
    for (int i = 1; i < argc; ++i) {
        const std::string_view arg = argv[i];
        if (operands_only || !looks_like_option(arg)) {
            if (a.command.empty())
                a.command = arg;
            else
                a.operands.emplace_back(arg);
            continue;
        }
        if (arg == "--") {
            operands_only = true;
            continue;
        }
        std::string_view key = arg;
        std::optional<std::string_view> inline_value;
        if (const auto eq = arg.find('='); eq != std::string_view::npos && arg.starts_with("--")) {
            key = arg.substr(0, eq);
            inline_value = arg.substr(eq + 1);
        }
        auto value = [&]() -> std::string {
            if (inline_value) return std::string(*inline_value);
            if (i + 1 >= argc) throw UsageError{std::string(key) + " needs a value"};
            return argv[++i];
        };
        if (key == "-h" || key == "--help") {
            a.help = true;
        } else if (key == "--json") {
            a.json_output = true;
        } else if (key == "-c" || key == "--connect") {
            a.libvirt_uri = value();
        } else if (key == "--weight") {
            a.weight = value();
        } else if (key == "--socket") {
            a.client_socket = value();
            if (a.client_socket.empty()) throw UsageError{"--socket needs a path"};
        } else if (key == "--emulator") {
            a.emulator = value();
            if (a.emulator.empty()) throw UsageError{"--emulator needs a path"};
        } else if (key == "--admin-socket") {
            a.admin_socket = value();
            if (a.admin_socket.empty()) throw UsageError{"--admin-socket needs a path"};
        } else if (key == "--interval") {
            const std::string v = value();
            char* end = nullptr;
            const double s = std::strtod(v.c_str(), &end);
            if (v.empty() || *end != '\0' || !std::isfinite(s) || s < 0.05 || s > 3600)
                throw UsageError{"--interval must be a number of seconds in 0.05..3600"};
            a.interval_s = s;
        } else if (key == "--gpu" || key == "--from") {
            const std::string v = value();
            if (key == "--gpu") a.gpu_text = v;
            if (key == "--gpu" && v == "any") continue;  // attach's: pvgpud places the device
            unsigned n = 0;
            const auto [end, ec] = std::from_chars(v.data(), v.data() + v.size(), n);
            if (ec != std::errc{} || end != v.data() + v.size())
                throw UsageError{std::string(key) + " must be a GPU index (0, 1, ...), got '" + v + "'"};
            (key == "--gpu" ? a.gpu : a.from_gpu) = n;
        } else if (key == "--count") {
            const std::string v = value();
            unsigned long n = 0;
            const auto [end, ec] = std::from_chars(v.data(), v.data() + v.size(), n);
            if (ec != std::errc{} || end != v.data() + v.size() || n == 0)
                throw UsageError{"--count must be a positive integer"};
            a.count = n;
        } else {
            throw UsageError{"unknown option '" + std::string(key) + "'"};
        }
    }
    if (a.admin_socket.empty()) {
        const char* env = std::getenv("PVGPU_ADMIN_SOCKET");
        a.admin_socket = (env && *env) ? env : kDefaultAdminSocket;
    }
    if (a.client_socket.empty()) {
        const char* env = std::getenv("PVGPU_SOCKET");
        a.client_socket = (env && *env) ? env : kDefaultClientSocket;
    }
    return a;
}

void expect_operands(const Args& a, std::size_t min, std::size_t max) {
    if (a.operands.size() < min) throw UsageError{a.command + ": missing arguments"};
    if (a.operands.size() > max)
        throw UsageError{a.command + ": unexpected argument '" + a.operands[max] + "'"};
}

// ---- formatting -----------------------------------------------------------------

std::string fmt(const char* format, double v) {
    char buf[64];
    std::snprintf(buf, sizeof buf, format, v);
    return buf;
}

std::string percent(const json& v) {
    if (!v.is_number()) return "-";
    return fmt("%.1f%%", v.get<double>() * 100.0);
}

std::string number(const json& v, const char* format = "%.1f") {
    if (!v.is_number()) return "-";
    if (v.is_number_integer()) return std::to_string(v.get<long long>());
    return fmt(format, v.get<double>());
}

std::string scalar(const json& v) {
    if (v.is_string()) return v.get<std::string>();
    if (v.is_number_float()) return fmt("%g", v.get<double>());
    return v.dump();
}

std::vector<std::string> split_path(const std::string& path) {
    std::vector<std::string> parts;
    std::size_t start = 0;
    while (start <= path.size()) {
        const auto slash = path.find('/', start);
        parts.push_back(path.substr(start, slash == std::string::npos ? std::string::npos : slash - start));
        if (slash == std::string::npos) break;
        start = slash + 1;
    }
    return parts;
}

// A row of the tree table; `entity` is null for a grouping line such as
// "host/" (a namespace, not an entity).
struct Row {
    std::string label;
    const json* entity = nullptr;
};

// Orders entities parent-first by path components and indents each by its
// depth, inserting missing ancestors as bare grouping lines.
std::vector<Row> tree_rows(const json& entities) {
    std::vector<std::pair<std::vector<std::string>, const json*>> sorted;
    for (const json& e : entities) {
        if (!e.is_object()) continue;
        const std::string path = e.value("path", std::string{});
        sorted.emplace_back(split_path(path), &e);
    }
    std::sort(sorted.begin(), sorted.end(), [](const auto& x, const auto& y) { return x.first < y.first; });
    std::vector<Row> rows;
    std::vector<std::string> shown;  // path components of the last row printed
    for (const auto& [parts, e] : sorted) {
        // Grouping lines for ancestors not yet shown.
        std::size_t common = 0;
        while (common < shown.size() && common + 1 < parts.size() && shown[common] == parts[common]) ++common;
        for (std::size_t d = common; d + 1 < parts.size(); ++d)
            rows.push_back(Row{std::string(2 * d, ' ') + parts[d] + "/", nullptr});
        std::string label = std::string(2 * (parts.size() - 1), ' ') + parts.back();
        // A guest task's name (its comm) says more than its pid hint.
        if (const auto name = e->value("task_name", std::string{}); !name.empty()) label += " (" + name + ")";
        rows.push_back(Row{std::move(label), e});
        shown = parts;
    }
    return rows;
}

void print_table(const std::vector<std::vector<std::string>>& table, std::FILE* out) {
    std::vector<std::size_t> width;
    for (const auto& row : table)
        for (std::size_t i = 0; i < row.size(); ++i) {
            if (width.size() <= i) width.push_back(0);
            width[i] = std::max(width[i], row[i].size());
        }
    for (const auto& row : table) {
        std::string line;
        for (std::size_t i = 0; i < row.size(); ++i) {
            const bool left = i == 0 || i == 1;  // name and kind left-aligned, numbers right
            const std::size_t pad = width[i] - row[i].size();
            if (i) line += "  ";
            if (left)
                line += row[i] + (i + 1 < row.size() ? std::string(pad, ' ') : "");
            else
                line += std::string(pad, ' ') + row[i];
        }
        line.erase(line.find_last_not_of(' ') + 1);
        std::fprintf(out, "%s\n", line.c_str());
    }
}

// `now_share`: top's per-refresh share column (path -> share), or null.
void print_entities(const json& reply, const std::map<std::string, double>* now_share, std::FILE* out) {
    std::vector<std::vector<std::string>> table;
    const json entities = reply.value("entities", json::array());
    // Admin protocol 2 counts kernels; an older pvgpud does not.
    const bool kernels = std::any_of(entities.begin(), entities.end(),
                                     [](const json& e) { return e.contains("kernels"); });
    std::vector<std::string> header{"ENTITY", "KIND", "WEIGHT", "TARGET", "ACHIEVED"};
    if (now_share) header.emplace_back("NOW");
    header.insert(header.end(), {"GPU_MS", "CHANNELS"});
    if (kernels) header.emplace_back("KERNELS");
    table.push_back(header);
    for (const Row& r : tree_rows(entities)) {
        std::vector<std::string> row{r.label};
        if (!r.entity) {
            row.resize(header.size());
            table.push_back(row);
            continue;
        }
        const json& e = *r.entity;
        row.push_back(e.value("kind", std::string("-")));
        row.push_back(number(e.value("weight", json())));
        row.push_back(percent(e.value("target_share", json())));
        row.push_back(percent(e.value("achieved_share", json())));
        if (now_share) {
            const auto it = now_share->find(e.value("path", std::string{}));
            row.push_back(it == now_share->end() ? "-" : fmt("%.1f%%", it->second * 100.0));
        }
        row.push_back(number(e.value("gpu_time_ms", json())));
        row.push_back(number(e.value("channels", json())));
        if (kernels) row.push_back(number(e.value("kernels", json())));
        table.push_back(row);
    }
    if (entities.empty()) {
        std::fprintf(out, "(no entities: no client is connected)\n");
        return;
    }
    print_table(table, out);
}

// Flattens nested objects into "a.b: value" lines, each after `indent`.
void print_flat(const json& obj, const std::string& prefix, std::FILE* out, const char* indent = "") {
    for (const auto& [key, value] : obj.items()) {
        if (prefix.empty() && key == "ok") continue;
        const std::string name = prefix.empty() ? key : prefix + "." + key;
        if (value.is_object())
            print_flat(value, name, out, indent);
        else
            std::fprintf(out, "%s%s: %s\n", indent, name.c_str(), scalar(value).c_str());
    }
}

// An old pvgpud (admin protocol 1) measures GPU time only when its policy
// accounts; it says so with "accounting": false, and its shares, GPU times
// and fairness metrics are then placeholders, not measurements.
bool measured(const json& list) { return list.value("accounting", true); }

constexpr const char* kNotMeasured =
    "(this pvgpud does not measure GPU time under its policy: ACHIEVED, GPU_MS and the fairness "
    "metrics are unknown; pvgpud with admin protocol 2 measures them under every policy)";

// Blanks what an old daemon reports without measuring it.
json without_unmeasured(json list) {
    if (measured(list)) return list;
    for (json& e : list["entities"]) {
        e["achieved_share"] = nullptr;
        e["gpu_time_ms"] = nullptr;
    }
    return list;
}

// ---- GPUs -------------------------------------------------------------------------
//
// Admin protocol 4 reports per GPU: `list` and `stats` carry "gpus", one
// object per GPU with its "index", "name", "policy", "busy_fraction", "vms"
// (and in `list` its "entities").  An older pvgpud drives one GPU: it is
// shown as GPU 0, gpu0.

bool has_gpus(const json& reply) { return reply.contains("gpus") && reply["gpus"].is_array(); }

long long gpu_index(const json& g) {
    const json i = g.value("index", json());
    return i.is_number_integer() ? i.get<long long>() : -1;
}

// The object of GPU `index` in a reply's "gpus", or null.
json gpu_in(const json& reply, long long index) {
    if (has_gpus(reply))
        for (const json& g : reply["gpus"])
            if (g.is_object() && gpu_index(g) == index) return g;
    return json();
}

// The GPUs of a `list` reply, each with its entities.  What a GPU lacks
// (an older pvgpud's busy fraction) comes from `stats` when given.
json gpus_of(const json& list, const json& stats = json()) {
    json gpus = json::array();
    if (has_gpus(list)) {
        for (const json& g : list["gpus"])
            if (g.is_object() && gpu_index(g) >= 0) gpus.push_back(g);
    } else {
        json entities = list.value("entities", json::array());
        long long vms = 0;
        for (json& e : entities) {
            if (!e.is_object()) continue;
            e["gpu"] = 0;
            vms += e.value("kind", std::string{}) == "vm";
        }
        gpus.push_back({{"index", 0},
                        {"name", "gpu0"},
                        {"policy", list.value("policy", json())},
                        {"vms", vms},
                        {"entities", std::move(entities)}});
    }
    for (json& g : gpus) {
        if (g.value("busy_fraction", json()).is_number()) continue;
        json from = has_gpus(stats) ? gpu_in(stats, gpu_index(g)) : stats.value("gpu", json());
        if (from.is_object()) g["busy_fraction"] = from.value("busy_fraction", json());
    }
    return gpus;
}

// The GPUs a command shows: all, or GPU `only` (a usage error if there is
// no such GPU, naming the ones there are).
json select_gpus(const json& gpus, std::optional<unsigned> only) {
    if (!only) return gpus;
    std::string known;
    for (const json& g : gpus) {
        if (gpu_index(g) == static_cast<long long>(*only)) return json::array({g});
        known += (known.empty() ? "" : ", ") + std::to_string(gpu_index(g)) + " (" +
                 g.value("name", std::string("?")) + ")";
    }
    throw UsageError{"no GPU " + std::to_string(*only) + ": this pvgpud has " +
                     (gpus.size() == 1 ? "one GPU, " : "GPUs ") + known};
}

// GPU N's name, as pvgpud names it ("gpuN" by default).
std::string gpu_name(const json& gpus, long long index) {
    for (const json& g : gpus)
        if (gpu_index(g) == index && g.value("name", json()).is_string()) return g["name"].get<std::string>();
    return "gpu" + std::to_string(index);
}

// GPU 1 gpu1  policy hfq  busy 99.8%  VMs 2
std::string gpu_header(const json& g) {
    const json policy = g.value("policy", json());
    return "GPU " + std::to_string(gpu_index(g)) + " " + g.value("name", std::string("?")) + "  policy " +
           (policy.is_string() ? policy.get<std::string>() : "?") + "  busy " +
           percent(g.value("busy_fraction", json())) + "  VMs " + number(g.value("vms", json()));
}

// The policy above a list: the GPUs' one policy, or "per GPU".
std::string common_policy(const json& gpus) {
    std::string common;
    for (const json& g : gpus) {
        const json p = g.value("policy", json());
        const std::string name = p.is_string() ? p.get<std::string>() : "?";
        if (!common.empty() && name != common) return "per GPU";
        common = name;
    }
    return common.empty() ? "?" : common;
}

// A `list` reply for --json: the daemon's, with "gpus" (synthesized for an
// older pvgpud, whose entities then gain "gpu": 0); with --gpu, that GPU's
// part only.
json list_with_gpus(json list, const json& gpus, std::optional<unsigned> only) {
    if (!has_gpus(list) && list.contains("entities") && list["entities"].is_array())
        for (json& e : list["entities"])
            if (e.is_object()) e["gpu"] = 0;
    list["gpus"] = gpus;
    if (only) {
        json kept = json::array();
        for (const json& e : list.value("entities", json::array()))
            if (e.is_object() && e.value("gpu", json()) == json(*only)) kept.push_back(e);
        list["entities"] = std::move(kept);
    }
    return list;
}

// A `stats` reply with only GPU `only`'s part of "gpus".
json stats_for(json stats, std::optional<unsigned> only) {
    if (only && has_gpus(stats)) stats["gpus"] = json::array({gpu_in(stats, *only)});
    return stats;
}

void print_policy(const json& reply) {
    std::printf("policy: %s\n", reply.value("policy", std::string("?")).c_str());
    const json params = reply.value("params", json::object());
    for (const auto& [key, value] : params.items()) std::printf("  %s = %s\n", key.c_str(), scalar(value).c_str());
}

// ---- commands ---------------------------------------------------------------------

// Sends a request; ok:false becomes a DaemonError carrying the reply.
json call(AdminConnection& conn, const json& req, std::chrono::seconds timeout = kReplyTimeout) {
    json reply = conn.request(req, timeout);
    if (!reply["ok"].get<bool>()) {
        const json err = reply.value("error", json("unspecified error"));
        throw DaemonError{err.is_string() ? err.get<std::string>() : err.dump(), reply};
    }
    return reply;
}

void print_json(const json& reply) { std::printf("%s\n", reply.dump(2).c_str()); }

// One GPU's entity table under its header line.
void print_gpu(const json& g, const json& list, const std::map<std::string, double>* now_share, std::FILE* out) {
    std::fprintf(out, "%s\n", gpu_header(g).c_str());
    const json view = {{"accounting", measured(list)}, {"entities", g.value("entities", json::array())}};
    print_entities(without_unmeasured(view), now_share, out);
}

int cmd_list(const Args& a, AdminConnection& conn) {
    const json reply = call(conn, {{"cmd", "list"}});
    // An older pvgpud reports its one GPU's busy fraction in stats only.
    json stats;
    if (!has_gpus(reply)) {
        try {
            stats = call(conn, {{"cmd", "stats"}});
        } catch (const DaemonError&) {
            // busy shown as '-'
        }
    }
    const json gpus = select_gpus(gpus_of(reply, stats), a.gpu);
    if (a.json_output) {
        print_json(list_with_gpus(reply, gpus, a.gpu));
        return kExitOk;
    }
    std::printf("policy: %s\n", common_policy(gpus).c_str());
    bool first = true;
    for (const json& g : gpus) {
        if (!first) std::printf("\n");
        first = false;
        print_gpu(g, reply, nullptr, stdout);
    }
    if (!measured(reply)) std::printf("%s\n", kNotMeasured);
    return kExitOk;
}

unsigned parse_weight(const std::string& text) {
    const std::optional<std::uint32_t> w = pvgpu::parse_weight(text);
    if (!w) throw UsageError{"weight must be an integer in " + kWeightRange + ", got '" + text + "'"};
    return *w;
}

int cmd_set_weight(const Args& a, AdminConnection& conn) {
    std::string target = a.operands[0];
    if (target.empty()) throw UsageError{"set-weight: empty TARGET"};
    const unsigned weight = parse_weight(a.operands[1]);
    // pvgpud writes a libvirt domain's weight into its metadata itself.
    const json reply = call(conn, {{"cmd", "set-weight"}, {"target", target}, {"weight", weight}});
    if (!a.json_output && reply.value("libvirt", false))
        std::printf("%s: weight %u written to the libvirt domain's metadata\n", target.c_str(), weight);
    if (a.json_output) {
        print_json(reply);
        return kExitOk;
    }
    std::printf("%s: weight %s%s\n", reply.value("path", target).c_str(),
                number(reply.value("weight", json(weight))).c_str(),
                reply.value("pending", false) ? " (pending: applied when it connects)" : "");
    return kExitOk;
}

// "GPU 0 gpu0  policy hfq" and its parameters, for each GPU of a
// get-policy reply that has "gpus" (admin protocol 4).
void print_gpu_policies(const json& gpus) {
    for (const json& g : gpus) {
        const json policy = g.value("policy", json());
        std::printf("GPU %lld %s  policy %s\n", gpu_index(g), g.value("name", std::string("?")).c_str(),
                    policy.is_string() ? policy.get<std::string>().c_str() : "?");
        const json params = g.value("params", json::object());
        for (const auto& [key, value] : params.items())
            std::printf("  %s = %s\n", key.c_str(), scalar(value).c_str());
    }
}

int cmd_set_policy(const Args& a, AdminConnection& conn) {
    json params = json::object();
    for (std::size_t i = 1; i < a.operands.size(); ++i) {
        const std::string& kv = a.operands[i];
        const auto eq = kv.find('=');
        if (eq == std::string::npos || eq == 0 || eq + 1 == kv.size())
            throw UsageError{"set-policy: parameter '" + kv + "' is not KEY=VALUE"};
        const std::string key = kv.substr(0, eq);
        const std::string text = kv.substr(eq + 1);
        double v = 0;
        const auto [end, ec] = std::from_chars(text.data(), text.data() + text.size(), v);
        if (ec != std::errc{} || end != text.data() + text.size() || !std::isfinite(v))
            throw UsageError{"set-policy: value of '" + key + "' must be a number, got '" + text + "'"};
        // Integral values go out as JSON integers so they read naturally in logs.
        if (v == std::floor(v) && std::fabs(v) < 9e15)
            params[key] = static_cast<long long>(v);
        else
            params[key] = v;
    }
    json req = {{"cmd", "set-policy"}, {"policy", a.operands[0]}, {"params", params}};
    if (a.gpu) {
        // Refuse an unknown GPU here, as list does.  An older pvgpud has
        // one GPU and no "gpu" in its requests: GPU 0 is all of it.
        const json current = call(conn, {{"cmd", "get-policy"}});
        json gpus = has_gpus(current) ? current["gpus"] : json::array({{{"index", 0}, {"name", "gpu0"}}});
        select_gpus(gpus, a.gpu);
        if (has_gpus(current)) req["gpu"] = *a.gpu;
    }
    const json reply = call(conn, req);
    if (a.json_output) {
        print_json(reply);
        return kExitOk;
    }
    print_policy(reply);
    // Which GPUs changed, where that is news: --gpu, or several GPUs.
    const json changed = reply.value("gpus", json());
    if (changed.is_array() && (a.gpu || changed.size() > 1)) {
        std::string list;
        for (const json& i : changed) list += (list.empty() ? "" : ", ") + number(i);
        std::printf("on GPU%s %s\n", changed.size() == 1 ? "" : "s", list.c_str());
    }
    return kExitOk;
}

int cmd_policy(const Args& a, AdminConnection& conn) {
    json reply = call(conn, {{"cmd", "get-policy"}});
    const json gpus = select_gpus(has_gpus(reply) ? reply["gpus"]
                                                  : json::array({{{"index", 0},
                                                                  {"name", "gpu0"},
                                                                  {"policy", reply.value("policy", json())},
                                                                  {"params", reply.value("params", json())}}}),
                                  a.gpu);
    if (a.json_output) {
        if (a.gpu && has_gpus(reply)) reply["gpus"] = gpus;
        print_json(reply);
    } else if (has_gpus(reply) && (a.gpu || gpus.size() > 1)) {
        print_gpu_policies(gpus);
    } else {
        print_policy(reply);
    }
    return kExitOk;
}

// The daemon's admin protocol version; 1 when it does not say.
int admin_protocol(AdminConnection& conn) {
    const json v = conn.request({{"cmd", "version"}});
    const json p = v.value("admin_protocol", json());
    return v.value("ok", false) && p.is_number_integer() ? p.get<int>() : 1;
}

int cmd_stats(const Args& a, AdminConnection& conn) {
    json reply = call(conn, {{"cmd", "stats"}});
    if (a.gpu) {
        select_gpus(has_gpus(reply) ? reply["gpus"] : json::array({{{"index", 0}, {"name", "gpu0"}}}), a.gpu);
        reply = stats_for(std::move(reply), a.gpu);
    }
    if (a.json_output) {
        print_json(reply);
        return kExitOk;
    }
    // Before admin protocol 2 the metrics were placeholders under a policy
    // that does not account: ask, and do not print them as measurements.
    bool unmeasured = false;
    if (admin_protocol(conn) < 2 && !measured(call(conn, {{"cmd", "list"}}))) {
        unmeasured = true;
        for (auto& [key, value] : reply["metrics"].items())
            if (key != "scheduler_cpu_us_per_s" && key != "process_cpu_us_per_s") value = "n/a";
    }
    json flat = reply;
    flat.erase("gpus");
    print_flat(flat, "", stdout);
    if (unmeasured) std::printf("%s\n", kNotMeasured);
    // A section per GPU under its header line (admin protocol 4; an older
    // pvgpud's one GPU is the gpu.* lines above).
    if (has_gpus(reply)) {
        for (json g : reply["gpus"]) {
            if (!g.is_object()) continue;
            std::printf("\n%s\n", gpu_header(g).c_str());
            for (const char* key : {"index", "name", "policy", "vms"}) g.erase(key);
            print_flat(g, "", stdout, "  ");
        }
    }
    return kExitOk;
}

int cmd_move(const Args& a, AdminConnection& conn) {
    const std::string& vm = a.operands[0];
    if (vm.empty()) throw UsageError{"move: empty VM"};
    if (!a.gpu) throw UsageError{"move: --gpu N (the GPU to move the VM to) is required"};
    if (a.from_gpu && *a.from_gpu == *a.gpu) throw UsageError{"move: --from and --gpu name the same GPU"};
    json req = {{"cmd", "move"}, {"target", vm}, {"gpu", *a.gpu}};
    if (a.from_gpu) req["from"] = *a.from_gpu;
    json reply;
    try {
        reply = call(conn, req, kMoveTimeout);
    } catch (const DaemonError& e) {
        // An older pvgpud drives one GPU and does not know move: say so.
        int protocol = kAdminProtocolGpus;
        if (e.reply) {
            try {
                protocol = admin_protocol(conn);
            } catch (const DaemonError&) {
            }
        }
        if (protocol >= kAdminProtocolGpus) throw;
        throw DaemonError{"this pvgpud (admin protocol " + std::to_string(protocol) +
                              ") drives one GPU and cannot move VMs: " + e.message,
                          e.reply};
    }
    if (a.json_output) {
        print_json(reply);
        return kExitOk;
    }
    // The GPUs' names, for the summary (the move has happened: a failure
    // here only leaves the default names).
    json gpus = json::array();
    try {
        gpus = gpus_of(call(conn, {{"cmd", "list"}}));
    } catch (const DaemonError&) {
    }
    const json channels = reply.value("channels", json::array());
    double longest = 0;
    for (const json& c : channels) {
        if (!c.is_object()) continue;
        const json pause = c.value("pause_ms", json());
        std::printf("channel %s: paused %s ms\n", number(c.value("chan_id", json())).c_str(),
                    number(pause, "%.1f").c_str());
        if (pause.is_number()) longest = std::max(longest, pause.get<double>());
    }
    auto name_of = [&](const char* key) {
        const json i = reply.value(key, json());
        return i.is_number_integer() ? gpu_name(gpus, i.get<long long>()) : std::string("?");
    };
    std::string summary = std::to_string(channels.size()) + (channels.size() == 1 ? " channel" : " channels");
    if (!channels.empty()) summary += ", longest pause " + fmt("%.1f", longest) + " ms";
    std::printf("%s moved from %s to %s (%s)\n", reply.value("path", vm).c_str(), name_of("from").c_str(),
                name_of("to").c_str(), summary.c_str());
    return kExitOk;
}

int cmd_version(const Args& a, AdminConnection& conn) {
    if (!a.json_output) {
        std::printf("pvgpuctl %s\n", PVGPU_VERSION);
        std::fflush(stdout);
    }
    json reply = call(conn, {{"cmd", "version"}});
    if (a.json_output) {
        reply["pvgpuctl_version"] = PVGPU_VERSION;
        print_json(reply);
        return kExitOk;
    }
    std::printf("pvgpud %s (protocol %s, admin protocol %s)\n", reply.value("version", std::string("?")).c_str(),
                number(reply.value("protocol", json())).c_str(),
                number(reply.value("admin_protocol", json())).c_str());
    return kExitOk;
}

// ---- top ------------------------------------------------------------------------

volatile sig_atomic_t g_interrupted = 0;
extern "C" void on_sigint(int) { g_interrupted = 1; }

// Puts a terminal stdin into non-canonical, no-echo mode so a single 'q'
// arrives at once; restores it on destruction.  Signals (Ctrl-C) stay on.
class RawTerminal {
public:
    RawTerminal() {
        if (!::isatty(STDIN_FILENO) || ::tcgetattr(STDIN_FILENO, &saved_) != 0) return;
        termios raw = saved_;
        raw.c_lflag &= static_cast<tcflag_t>(~(ICANON | ECHO));
        raw.c_cc[VMIN] = 1;
        raw.c_cc[VTIME] = 0;
        active_ = ::tcsetattr(STDIN_FILENO, TCSANOW, &raw) == 0;
    }
    RawTerminal(const RawTerminal&) = delete;
    RawTerminal& operator=(const RawTerminal&) = delete;
    ~RawTerminal() {
        if (active_) ::tcsetattr(STDIN_FILENO, TCSANOW, &saved_);
    }
    bool active() const { return active_; }

private:
    termios saved_{};
    bool active_ = false;
};

int cmd_top(const Args& a, AdminConnection& conn) {
    const double interval = a.interval_s.value_or(1.0);
    const bool tty_out = ::isatty(STDOUT_FILENO);

    struct sigaction sa{};
    sa.sa_handler = on_sigint;
    sigemptyset(&sa.sa_mask);
    ::sigaction(SIGINT, &sa, nullptr);  // no SA_RESTART: poll() returns EINTR
    ::sigaction(SIGTERM, &sa, nullptr);
    RawTerminal terminal;

    using GpuPath = std::pair<long long, std::string>;  // a VM on two GPUs has an entity on each
    std::map<GpuPath, double> last_gpu_ms;
    auto last_time = SteadyClock::now();
    bool have_last = false;
    for (unsigned long frame = 1; !g_interrupted; ++frame) {
        // The daemon drops idle admin connections after 60 s; reconnect once.
        auto fetch = [&](const json& req) {
            try {
                return call(conn, req);
            } catch (const DaemonError& e) {
                if (e.reply) throw;
                return call(conn, req);
            }
        };
        const json list = fetch({{"cmd", "list"}});
        const json stats = fetch({{"cmd", "stats"}});
        const auto now = SteadyClock::now();

        const json all_gpus = gpus_of(list, stats);
        const json gpus = select_gpus(all_gpus, a.gpu);

        // Share of its GPU in the last refresh interval, from GPU time deltas.
        std::map<long long, std::map<std::string, double>> now_share;  // by GPU index
        std::map<GpuPath, double> gpu_ms;
        const double wall_ms = std::chrono::duration<double, std::milli>(now - last_time).count();
        for (const json& g : gpus) {
            for (const json& e : g.value("entities", json::array())) {
                const GpuPath key{gpu_index(g), e.value("path", std::string{})};
                const double ms = e.value("gpu_time_ms", 0.0);
                gpu_ms[key] = ms;
                if (have_last && wall_ms > 0 && measured(list)) {
                    const auto it = last_gpu_ms.find(key);
                    if (it != last_gpu_ms.end())
                        now_share[key.first][key.second] = std::max(0.0, ms - it->second) / wall_ms;
                }
            }
        }
        last_gpu_ms = std::move(gpu_ms);
        last_time = now;

        if (a.json_output) {
            std::printf("%s\n",
                        json{{"list", list_with_gpus(list, gpus, a.gpu)}, {"stats", stats_for(stats, a.gpu)}}
                            .dump()
                            .c_str());
        } else {
            if (tty_out) std::fputs("\033[H\033[2J", stdout);  // home, clear screen
            const std::time_t t = std::time(nullptr);
            char clock[16];
            std::strftime(clock, sizeof clock, "%H:%M:%S", std::localtime(&t));
            auto fairness = [&](const json& metrics) {
                if (measured(list))
                    std::printf("max share error %s  Jain %s  unfairness %s\n",
                                percent(metrics.value("max_share_error", json())).c_str(),
                                number(metrics.value("jain_index", json()), "%.4f").c_str(),
                                number(metrics.value("unfairness", json()), "%.3f").c_str());
                else
                    std::printf("%s\n", kNotMeasured);
            };
            // One GPU: the first two lines as on a host of one GPU, then
            // its table under its GPU line.  Several: the first line is the
            // host's, and each GPU's fairness goes under its GPU line.
            const bool several = all_gpus.size() > 1;
            if (!several) {
                const json gpu = stats.value("gpu", json::object());
                std::printf("pvgpu top  %s  policy %s  clients %s  channels %s  GPU busy %s  (q quits)\n", clock,
                            list.value("policy", std::string("?")).c_str(),
                            number(stats.value("clients", json())).c_str(),
                            number(stats.value("channels", json())).c_str(),
                            percent(gpu.value("busy_fraction", json())).c_str());
                fairness(stats.value("metrics", json::object()));
            } else {
                std::printf("pvgpu top  %s  GPUs %zu  clients %s  channels %s  (q quits)\n", clock, all_gpus.size(),
                            number(stats.value("clients", json())).c_str(),
                            number(stats.value("channels", json())).c_str());
            }
            for (const json& g : gpus) {
                std::printf("\n%s\n", gpu_header(g).c_str());
                if (several) {
                    const json per_gpu = gpu_in(stats, gpu_index(g));
                    fairness(per_gpu.is_object() ? per_gpu.value("metrics", json::object()) : json::object());
                }
                const json view = {{"accounting", measured(list)}, {"entities", g.value("entities", json::array())}};
                // From the second refresh on, every GPU's table has NOW.
                print_entities(without_unmeasured(view), have_last ? &now_share[gpu_index(g)] : nullptr, stdout);
            }
            if (!tty_out) std::fputs("\n", stdout);
        }
        std::fflush(stdout);
        have_last = true;
        if (a.count && frame >= *a.count) break;

        // Sleep for the interval, waking for 'q' on a terminal or a signal.
        const auto until = now + std::chrono::duration<double>(interval);
        while (!g_interrupted) {
            const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(until - SteadyClock::now());
            if (left.count() <= 0) break;
            pollfd p{terminal.active() ? STDIN_FILENO : -1, POLLIN, 0};
            const int rc = ::poll(&p, 1, static_cast<int>(left.count()));
            if (rc > 0 && (p.revents & POLLIN)) {
                char c = 0;
                if (::read(STDIN_FILENO, &c, 1) == 1 && (c == 'q' || c == 'Q')) return kExitOk;
            }
        }
    }
    return kExitOk;
}

#ifdef PVGPU_HAVE_LIBVIRT
// attach --gpu: "any" (nullopt: pvgpud places the domain) or an index 0..15.
std::optional<std::uint32_t> parse_attach_gpu(const std::string& text) {
    const std::optional<pvgpu::GpuChoice> choice = pvgpu::parse_gpu_choice(text);
    if (!choice)
        throw UsageError{"--gpu must be a GPU index in 0.." + std::to_string(PVGPU_MAX_GPUS - 1) +
                         " or 'any', got '" + text + "'"};
    return choice->index;
}

int edit_domain(const Args& a, bool attach) {
    using namespace pvgpu::virt;
    std::optional<unsigned> weight;
    if (a.weight) weight = parse_weight(*a.weight);
    const std::optional<std::uint32_t> gpu = a.gpu_text ? parse_attach_gpu(*a.gpu_text) : std::nullopt;
    Connection conn = open(a.libvirt_uri);
    Domain dom = lookup(conn.get(), a.operands[0]);
    const std::string name = name_of(dom.get());
    std::unique_ptr<char, decltype(&free)> xml(
        virDomainGetXMLDesc(dom.get(), VIR_DOMAIN_XML_INACTIVE | VIR_DOMAIN_XML_SECURE), free);
    if (!xml) fail("domain '" + name + "'");
    // The metadata first: the device's gpu property follows its device attribute.
    std::optional<GpuMetadata> meta;
    if (attach) {
        try {
            meta = read_gpu_metadata(dom.get(), VIR_DOMAIN_AFFECT_CONFIG);
        } catch (const XmlError&) {
            meta.reset();  // malformed: replaced
        }
        if (!meta) meta = GpuMetadata{kWeightDefault};
        if (weight) meta->weight = *weight;
        if (a.gpu_text) meta->device = gpu;
    }
    std::string edited;
    try {
        edited = attach ? attach_device(xml.get(), DeviceWiring{a.client_socket, 0, a.emulator, meta->device})
                        : detach_device(xml.get());
    } catch (const XmlError& e) {
        throw std::runtime_error("domain '" + name + "': " + e.what());
    }
    Domain defined(virDomainDefineXML(conn.get(), edited.c_str()));
    if (!defined) fail("redefining domain '" + name + "'");
    write_gpu_metadata(defined.get(), meta, VIR_DOMAIN_AFFECT_CONFIG);
    const bool running = virDomainIsActive(defined.get()) == 1;
    if (a.json_output) {
        json out = {{"ok", true}, {"domain", name}, {"uuid", uuid_of(defined.get())}, {"attached", attach},
                    {"running", running}};
        if (attach) {
            out["weight"] = meta->weight, out["socket"] = a.client_socket;
            out["gpu"] = meta->device ? json(*meta->device) : json(nullptr);
        }
        print_json(out);
    } else if (attach) {
        const std::string on = meta->device ? "GPU " + std::to_string(*meta->device) : "any GPU (pvgpud places it)";
        std::printf("%s: pvgpu device attached (socket %s), weight %u, %s%s\n", name.c_str(),
                    a.client_socket.c_str(), meta->weight, on.c_str(),
                    running ? "; the running domain gets it at its next start" : "");
    } else {
        std::printf("%s: pvgpu device detached%s\n", name.c_str(),
                    running ? "; the running domain keeps it until it shuts down" : "");
    }
    return kExitOk;
}

int cmd_attach(const Args& a, AdminConnection&) { return edit_domain(a, true); }
int cmd_detach(const Args& a, AdminConnection&) { return edit_domain(a, false); }
// attach and detach take one DOMAIN.
constexpr std::pair<std::size_t, std::size_t> kDomainArgs{1, 1};
#else
[[noreturn]] int no_libvirt(const Args& a, AdminConnection&) {
    throw std::runtime_error(a.command + ": this pvgpuctl was built without libvirt support");
}
constexpr auto cmd_attach = no_libvirt;
constexpr auto cmd_detach = no_libvirt;
// Any arguments: the missing libvirt support is what to report.
constexpr std::pair<std::size_t, std::size_t> kDomainArgs{0, SIZE_MAX};
#endif

// ---- the verbs ------------------------------------------------------------------

// The options that only some verbs take, as bits of Verb::options.
enum : unsigned {
    kOptGpu = 1u << 0,     // --gpu N
    kOptGpuAny = 1u << 1,  // --gpu any
    kOptTop = 1u << 2,     // --interval, --count
    kOptAttach = 1u << 3,  // --weight, --emulator
    kOptFrom = 1u << 4,    // --from
};

// A verb that is not given `option` rejects the command line when `given`
// holds; the rules are checked in this order.  The messages are written out,
// not built from the verbs, because they are pvgpuctl's output and keep
// their wording (the --gpu one lists its verbs in an order of its own).
struct OptionRule {
    unsigned option;
    bool (*given)(const Args&);
    const char* message;
};

constexpr OptionRule kOptionRules[] = {
    {kOptTop, [](const Args& a) { return a.interval_s || a.count; }, "--interval and --count are options of top"},
    {kOptAttach, [](const Args& a) { return a.weight || !a.emulator.empty(); },
     "--weight and --emulator are options of attach"},
    {kOptGpu, [](const Args& a) { return a.gpu_text.has_value(); },
     "--gpu is an option of attach, list, top, stats, policy, set-policy and move"},
    {kOptGpuAny, [](const Args& a) { return a.gpu_text && !a.gpu; }, "--gpu any is an option of attach"},
    {kOptFrom, [](const Args& a) { return a.from_gpu.has_value(); }, "--from is an option of move"},
};

using Handler = int (*)(const Args&, AdminConnection&);

// One row a command, as systemd's loginctl and git's builtins keep theirs:
// adding a command is adding a row.  The connection is lazy: a verb that
// does not use it never connects.
struct Verb {
    std::string_view name;
    std::string_view synopsis;  // its line in pvgpuctl --help
    std::string summary;        // beside the synopsis; '\n' breaks lines
    std::string help;           // pvgpuctl help NAME
    std::pair<std::size_t, std::size_t> args;  // how many operands, at least and at most
    unsigned options;                          // the kOpt* it takes
    Handler run;
    bool own_checks = false;  // help: takes any option, counts its own operands
};

int cmd_help(const Args& a, AdminConnection&);

const std::vector<Verb>& verbs() {
    static const std::vector<Verb> table = {
        {"list", "list [--gpu N]", "entity tree with weights and shares, per GPU",
         R"(usage: pvgpuctl [--json] list [--gpu N]

Shows every scheduling entity as a tree: VMs, their guest tasks, host users
(host/USER) and their tasks (host/USER/NAME), per GPU: a header line per
GPU (GPU 1 gpu1  policy hfq  busy 99.8%  VMs 2), then that GPU's entities.
A VM on two GPUs has an entity on each.  --gpu N shows GPU N only.
Columns: WEIGHT (admin
weight), TARGET (the share of its GPU it should get now), ACHIEVED (what it got over the daemon's recent window),
GPU_MS (GPU time used since it appeared, subtree included), CHANNELS,
KERNELS (kernels completed with a completion interrupt, subtree included).
pvgpud measures GPU time itself, from completion interrupts and the GPU's
engine status register, the same way under every policy.  An older pvgpud
(admin protocol 1) measured nothing under policy none: its ACHIEVED and
GPU_MS are then shown as '-', with a note.  A pvgpud before admin protocol 4
drives one GPU, shown as GPU 0 gpu0.  --json prints the daemon's reply,
with the entities per GPU in "gpus".
)",
         {0, 0}, kOptGpu, cmd_list},
        {"set-weight", "set-weight TARGET WEIGHT", "set an admin weight (" + kWeightRange + ")",
         R"(usage: pvgpuctl set-weight TARGET WEIGHT

Sets the admin weight of an entity; WEIGHT is an integer in )" + kWeightRange +
        R"(
(default weight )" + std::to_string(kWeightDefault) + R"().  TARGET is a VM UUID, a VM name, or an entity path
(vm1/task-1234, host/alice, host/alice/render).  A weight for a VM or a
host user that is not connected yet is remembered by pvgpud and applied when
it connects.  Needs root, the
daemon's uid or its admin group.

A VM that is a libvirt domain with pvgpu (see attach) keeps its weight in
the domain's metadata: pvgpud writes <pvgpu:gpu weight="W"/> there (keeping
its device="N"), live and in the persistent definition, through the libvirt
connection it follows ([libvirt] uri), so `virsh dumpxml` and the scheduler
agree and the weight survives a host reboot.
)",
         {2, 2}, 0, cmd_set_weight},
        {"set-policy", "set-policy NAME [KEY=VALUE]... [--gpu N]", "switch the scheduling policy (of every GPU,\nor of GPU N)",
         R"(usage: pvgpuctl set-policy NAME [KEY=VALUE]... [--gpu N]

Switches the scheduling policy at run time: none, timeslice, dfq or hfq.
KEY=VALUE pairs set numeric policy parameters; omitted ones take their
defaults (pvgpuctl policy shows the effective ones).  Every GPU has its own
policy: --gpu N switches GPU N's only; without it every GPU's.  Example:
  pvgpuctl set-policy hfq threshold_ms=4
  pvgpuctl set-policy timeslice --gpu 1
Needs root, the daemon's uid or its admin group.
)",
         {1, 64}, kOptGpu, cmd_set_policy},
        {"policy", "policy [--gpu N]", "show the active policy and its parameters",
         R"(usage: pvgpuctl [--json] policy [--gpu N]

Shows the active policy and its effective parameters; on a host with several
GPUs, each GPU's (--gpu N: GPU N's).
)",
         {0, 0}, kOptGpu, cmd_policy},
        {"stats", "stats [--gpu N]", "daemon statistics and fairness metrics",
         R"(usage: pvgpuctl [--json] stats [--gpu N]

Shows daemon statistics: uptime, clients, channels, GPU busy fraction,
fairness metrics (max share error, Jain's index, unfairness) and counters,
then a section per GPU (--gpu N: GPU N's only) under its header line: its
policy, arbitration, busy fraction and time, context switches, channels,
VMs, scheduler CPU and fairness metrics.
)",
         {0, 0}, kOptGpu, cmd_stats},
        {"top", "top [--interval S] [--count N] [--gpu N]", "live view, refreshed every S seconds",
         R"(usage: pvgpuctl top [--interval S] [--count N] [--gpu N]

Live view of the entity tree, redrawn every S seconds (default 1), per GPU
as in list (--gpu N: GPU N only).  NOW is the share of its GPU each entity
used since the previous refresh.  Quit with q or Ctrl-C; --count N exits
after N refreshes.
)",
         {0, 0}, kOptGpu | kOptTop, cmd_top},
        {"move", "move VM --gpu N [--from M]", "move a running VM's channels to GPU N, live",
         R"(usage: pvgpuctl [--json] move VM --gpu N [--from M]

Moves a running VM (name or UUID) to GPU N, live and without the guest's
help: pvgpud holds the VM's channels back (the guest keeps writing), waits
for the work already on the GPU to complete, recreates each channel on GPU N
with the same ring and fences, and lets it go.  The guest sees a pause,
printed per channel:
  channel 3: paused 12.5 ms
  vm2 moved from gpu0 to gpu1 (2 channels, longest pause 12.5 ms)
--from M names the GPU to move from when the VM has devices on several.
A move that fails leaves the VM running where it was; pvgpud's message is
printed and the exit status is 1.  Waits up to )" + std::to_string(kMoveTimeout.count()) + R"( s for pvgpud.
Needs root, the daemon's uid or its admin group.
)",
         {1, 1}, kOptGpu | kOptFrom, cmd_move},
        {"version", "version", "versions of pvgpuctl and pvgpud",
         R"(usage: pvgpuctl [--json] version

Prints the versions of pvgpuctl and of the running pvgpud (and the protocol
versions it speaks).
)",
         {0, 0}, 0, cmd_version},
        {"attach", "attach DOMAIN [--weight W] [--gpu N] [--socket PATH] [--emulator PATH]", "give a libvirt domain the pvgpu device",
         R"(usage: pvgpuctl [-c URI] attach DOMAIN [--weight W] [--gpu N] [--socket PATH] [--emulator PATH]

Edits the persistent definition of the libvirt domain DOMAIN (name or UUID)
so that it gets the pvgpu device at its next start: a <qemu:commandline>
with a chardev to pvgpud's client socket (--socket, default
$PVGPU_SOCKET or )" PVGPU_SOCKET_PATH R"(; reconnecting, so a pvgpud restart
is survived) and `-device pvgpu`, plus the GPU share in the domain's
metadata (namespace http://pvgpu.org/xmlns/domain/1.0, --weight, default:
the weight already there, else )" + std::to_string(kWeightDefault) + R"().  --gpu N puts the domain on the
host's GPU N (0..15): device="N" in the metadata and gpu=N on the device;
--gpu any lets pvgpud place it; default: the GPU already in the metadata,
else any.  --emulator PATH also sets the
domain's <emulator> to the pvgpu-patched QEMU; the domain must run it.
Attaching again replaces the wiring (a new socket path, say).  Needs the
right to define domains on that libvirt connection.
)",
         kDomainArgs, kOptGpu | kOptGpuAny | kOptAttach, cmd_attach},
        {"detach", "detach DOMAIN", "take it away again",
         R"(usage: pvgpuctl [-c URI] detach DOMAIN

Removes the pvgpu device wiring and the pvgpu metadata from the persistent
definition of the libvirt domain DOMAIN.  A running domain keeps its device
until it is shut down.
)",
         kDomainArgs, 0, cmd_detach},
        {"help", "help [COMMAND]", "help on a command (also: COMMAND --help)",
         R"(usage: pvgpuctl help [COMMAND]

Prints help on pvgpuctl or on one command.
)",
         {0, 1}, 0, cmd_help, true},
    };
    return table;
}

const Verb* find_verb(std::string_view name) {
    for (const Verb& v : verbs())
        if (v.name == name) return &v;
    return nullptr;
}

// pvgpuctl --help: the command list comes from the verbs, synopsis in a
// column of 32, the summary beside it or, after a long synopsis, below.
std::string usage() {
    constexpr std::size_t kColumn = 32;
    std::string text = "usage: pvgpuctl [--admin-socket PATH] [--json] COMMAND [ARGS]\n\n"
                       "Administers pvgpud, the pvgpu GPU scheduling daemon.\n\n"
                       "Commands:\n";
    for (const Verb& v : verbs()) {
        std::string line = "  " + std::string(v.synopsis);
        if (line.size() + 2 > kColumn) line += "\n" + std::string(kColumn, ' ');
        else line.resize(kColumn, ' ');
        std::string_view summary = v.summary;
        for (std::size_t nl; (nl = summary.find('\n')) != std::string_view::npos; summary.remove_prefix(nl + 1))
            line += std::string(summary.substr(0, nl)) + "\n" + std::string(kColumn, ' ');
        text += line + std::string(summary) + "\n";
    }
    return text + R"(
Options:
  --admin-socket PATH   admin socket (default $PVGPU_ADMIN_SOCKET or
                        )" PVGPU_ADMIN_SOCKET_PATH R"()
  -c, --connect URI     libvirt URI for attach, detach and the weights of
                        libvirt domains (default: libvirt's, e.g.
                        $LIBVIRT_DEFAULT_URI, else qemu:///system as root)
  --gpu N               the GPU a command is about (its index, as in the
                        GPU header lines); default: every GPU
  --json                print the daemon's JSON reply instead of a table
  -h, --help            this help

Exit status: 0 success, 1 daemon error or daemon unreachable, 2 bad usage.
)";
}

int print_help(const std::string& topic) {
    if (topic.empty()) {
        std::fputs(usage().c_str(), stdout);
        return kExitOk;
    }
    const Verb* v = find_verb(topic);
    if (!v) throw UsageError{"no such command '" + topic + "'"};
    std::fputs(v->help.c_str(), stdout);
    return kExitOk;
}

int cmd_help(const Args& a, AdminConnection&) {
    if (a.operands.size() > 1) throw UsageError{"help takes at most one command"};
    return print_help(a.operands.empty() ? "" : a.operands[0]);
}

int dispatch(const Args& a) {
    if (a.command.empty()) {
        if (a.help) return print_help("");
        throw UsageError{"missing command"};
    }
    const Verb* v = find_verb(a.command);
    if (!v) throw UsageError{"unknown command '" + a.command + "'"};
    AdminConnection conn(a.admin_socket);
    if (v->own_checks) return v->run(a, conn);
    if (a.help) return print_help(a.command);
    for (const OptionRule& rule : kOptionRules)
        if (!(v->options & rule.option) && rule.given(a)) throw UsageError{rule.message};
    expect_operands(a, v->args.first, v->args.second);
    return v->run(a, conn);
}

}  // namespace

int main(int argc, char** argv) {
    Args args;
    try {
        args = parse_args(argc, argv);
        return dispatch(args);
    } catch (const UsageError& e) {
        std::fprintf(stderr, "pvgpuctl: %s\n(see pvgpuctl --help)\n", e.message.c_str());
        return kExitUsage;
    } catch (const DaemonError& e) {
        if (args.json_output && e.reply) print_json(*e.reply);
        std::fprintf(stderr, "pvgpuctl: %s\n", e.message.c_str());
        return kExitDaemon;
    } catch (const std::exception& e) {
        std::fprintf(stderr, "pvgpuctl: %s\n", e.what());
        return kExitDaemon;
    }
}
