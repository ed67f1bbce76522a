#include "metrics.hpp"

#include <fcntl.h>
#include <unistd.h>

#include <charconv>
#include <cerrno>
#include <cmath>
#include <cstring>
#include <set>
#include <stdexcept>

#include "log.hpp"
#include "proto/unique_fd.hpp"

namespace pvgpu::daemon {

using nlohmann::json;

namespace {

// Label values may hold any UTF-8; the format escapes \, " and newline.
std::string escape(const std::string& s) {
    std::string out;
    for (char c : s) {
        if (c == '\\')
            out += "\\\\";
        else if (c == '"')
            out += "\\\"";
        else if (c == '\n')
            out += "\\n";
        else
            out += c;
    }
    return out;
}

std::string number(const json& v) {
    if (v.is_number_integer()) return v.dump();
    if (!v.is_number()) return "NaN";
    double d = v.get<double>();
    if (std::isnan(d)) return "NaN";
    if (std::isinf(d)) return d > 0 ? "+Inf" : "-Inf";
    char buf[32];
    auto [end, ec] = std::to_chars(buf, buf + sizeof buf, d);
    return ec == std::errc{} ? std::string(buf, end) : "NaN";
}

class Writer {
public:
    // One HELP and TYPE block per metric family, before its samples.
    void family(const char* name, const char* type, const char* help) {
        out_ += "# HELP ";
        out_ += name;
        out_ += ' ';
        out_ += help;
        out_ += "\n# TYPE ";
        out_ += name;
        out_ += ' ';
        out_ += type;
        out_ += '\n';
    }
    void sample(const char* name, const std::string& labels, const json& value) {
        out_ += name;
        if (!labels.empty()) out_ += "{" + labels + "}";
        out_ += ' ' + number(value) + '\n';
    }
    std::string take() { return std::move(out_); }

private:
    std::string out_;
};

// {kind, vm, task} of an entity from its admin path: `vm1` (a VM),
// `vm1/task-1234` (a guest task), `host/alice` (a host user, task="alice"),
// `host/alice/render` (a host task, task="alice/render").
std::string entity_labels(const json& e) {
    const std::string path = e.value("path", std::string{});
    const std::string kind = e.value("kind", std::string{});
    std::string vm, task;
    const auto slash = path.rfind('/');
    if (kind == "host" || kind == "user") {
        task = path.rfind("host/", 0) == 0 ? path.substr(5) : path;
    } else if (kind == "vm" || slash == std::string::npos) {
        vm = path;
    } else {
        vm = path.substr(0, slash);
        task = path.substr(slash + 1);
    }
    return "kind=\"" + escape(kind) + "\",vm=\"" + escape(vm) + "\",task=\"" + escape(task) + "\"";
}

}  // namespace

std::string render_prometheus(const json& list, const json& stats) {
    Writer w;
    const json entities = list.value("entities", json::array());
    // Counters go on leaves only (the entities that own channels), so that
    // sum by (vm) over them is a VM's total and nothing is counted twice.
    std::set<std::string> parents;
    for (const json& e : entities) {
        const std::string path = e.value("path", std::string{});
        for (std::size_t p = path.find('/'); p != std::string::npos; p = path.find('/', p + 1))
            parents.insert(path.substr(0, p));
    }
    auto per_entity = [&](const char* name, const char* type, const char* help, const char* field,
                          bool leaves_only) {
        w.family(name, type, help);
        for (const json& e : entities) {
            const std::string path = e.value("path", std::string{});
            if (leaves_only && parents.count(path)) continue;
            if (!e.contains(field)) continue;
            json v = e[field];
            if (std::string(field) == "gpu_time_ms" && v.is_number()) v = v.get<double>() / 1000.0;
            w.sample(name, entity_labels(e), v);
        }
    };
    per_entity("pvgpu_entity_gpu_seconds_total", "counter",
               "GPU time used by the entity, from completion interrupts and the engine status register.",
               "gpu_time_ms", true);
    per_entity("pvgpu_entity_kernels_total", "counter",
               "Kernels of the entity that completed with a completion interrupt.", "kernels", true);
    per_entity("pvgpu_entity_weight", "gauge", "Admin weight of the entity (1..10000).", "weight", false);
    per_entity("pvgpu_entity_target_share", "gauge",
               "Fraction of the whole GPU the entity should get now (weighted fair share of the backlogged).",
               "target_share", false);
    per_entity("pvgpu_entity_achieved_share", "gauge",
               "Fraction of the whole GPU the entity got over the daemon's recent window.", "achieved_share",
               false);
    per_entity("pvgpu_entity_channels", "gauge", "Open channels in the entity's subtree.", "channels", false);

    w.family("pvgpu_policy_info", "gauge", "The active scheduling policy (value 1).");
    w.sample("pvgpu_policy_info", "policy=\"" + escape(list.value("policy", std::string("unknown"))) + "\"", 1);

    auto scalar = [&](const char* name, const char* type, const char* help, const json& v) {
        if (v.is_null()) return;
        w.family(name, type, help);
        w.sample(name, "", v);
    };
    const json gpu = stats.value("gpu", json::object());
    const json metrics = stats.value("metrics", json::object());
    const json counters = stats.value("counters", json::object());
    auto get = [](const json& o, const char* k) { return o.contains(k) ? o[k] : json(); };
    scalar("pvgpu_uptime_seconds", "gauge", "Seconds since pvgpud started.", get(stats, "uptime_s"));
    scalar("pvgpu_clients", "gauge", "Connected binary-protocol clients.", get(stats, "clients"));
    scalar("pvgpu_channels", "gauge", "Open channels.", get(stats, "channels"));
    scalar("pvgpu_gpu_busy_ratio", "gauge", "Fraction of the recent window the GPU was executing.",
           get(gpu, "busy_fraction"));
    scalar("pvgpu_gpu_idle_with_demand_ratio", "gauge",
           "Fraction of the recent window the GPU idled while some channel had work.",
           get(gpu, "idle_with_demand_fraction"));
    scalar("pvgpu_max_share_error", "gauge", "Largest |achieved - target| share over the leaves with work.",
           get(metrics, "max_share_error"));
    scalar("pvgpu_jain_index", "gauge", "Jain's fairness index over achieved/target of the leaves with work.",
           get(metrics, "jain_index"));
    scalar("pvgpu_unfairness", "gauge", "max(achieved/target) / min(achieved/target) over the leaves with work.",
           get(metrics, "unfairness"));
    scalar("pvgpu_daemon_cpu_seconds_total", "counter", "CPU time used by pvgpud (user + system).",
           get(stats, "process_cpu_s"));
    scalar("pvgpu_scheduler_cpu_seconds_total", "counter",
           "CPU time pvgpud spent in the scheduler's own code (policy and accounting).",
           get(stats, "scheduler_cpu_s"));
    scalar("pvgpu_mode_switches_total", "counter", "Channel mode switches pushed to clients.",
           get(counters, "mode_switches"));
    scalar("pvgpu_traps_total", "counter", "Trapped doorbell writes.", get(counters, "traps"));
    scalar("pvgpu_watchdog_kills_total", "counter", "Channels killed by the GPU watchdog.",
           get(counters, "watchdog_kills"));
    scalar("pvgpu_bad_entry_kills_total", "counter", "Channels stopped for a bad ring entry or IB_PUT.",
           get(counters, "bad_entry_kills"));
    scalar("pvgpu_protocol_errors_total", "counter", "Client connections dropped for protocol errors.",
           get(counters, "protocol_errors"));
    return w.take();
}

void write_file_atomically(const std::string& path, const std::string& text) {
    auto fail = [&](const std::string& what, int err) {
        throw std::runtime_error(what + ": " + std::strerror(err));
    };
    // node_exporter reads only *.prom: a temporary name without that suffix
    // is never collected half-written.
    std::string tmp = path + ".tmp";
    UniqueFd fd(::open(tmp.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC | O_NOFOLLOW, 0644));
    if (!fd) fail(tmp, errno);
    std::size_t done = 0;
    while (done < text.size()) {
        ssize_t n = ::write(fd.get(), text.data() + done, text.size() - done);
        if (n < 0 && errno == EINTR) continue;
        if (n < 0) {
            int err = errno;
            ::unlink(tmp.c_str());
            fail(tmp, err);
        }
        done += static_cast<std::size_t>(n);
    }
    if (::fsync(fd.get()) != 0 || ::close(fd.release()) != 0) {
        int err = errno;
        ::unlink(tmp.c_str());
        fail(tmp, err);
    }
    if (::rename(tmp.c_str(), path.c_str()) != 0) {
        int err = errno;
        ::unlink(tmp.c_str());
        fail(path, err);
    }
}

TextfileExporter::TextfileExporter(std::string path, Duration interval, const Clock& clock, Timers& timers,
                                   Render render)
    : path_(std::move(path)), interval_(interval), clock_(clock), timer_(timers), render_(std::move(render)) {
    write_now();
    timer_.arm(clock_.now() + interval_, [this] { tick(); });
}

TextfileExporter::~TextfileExporter() {
    timer_.cancel();
    ::unlink(path_.c_str());
}

void TextfileExporter::tick() {
    write_now();
    timer_.arm(clock_.now() + interval_, [this] { tick(); });
}

bool TextfileExporter::write_now() {
    try {
        write_file_atomically(path_, render_());
        if (!last_error_.empty()) log_info("metrics textfile ", path_, " written again");
        last_error_.clear();
        return true;
    } catch (const std::exception& e) {
        if (last_error_ != e.what()) log_warning("cannot write metrics textfile: ", e.what());
        last_error_ = e.what();
        return false;
    }
}

}  // namespace pvgpu::daemon
