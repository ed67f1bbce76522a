#include "metrics.hpp"

#include <charconv>
#include <cmath>
#include <set>
#include <stdexcept>
#include <utility>
#include <vector>

#include "log.hpp"

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

std::string gpu_label(long long index) { return "gpu=\"" + std::to_string(index) + "\""; }

json get(const json& o, const char* k) { return o.is_object() && o.contains(k) ? o[k] : json(); }

long long index_of(const json& g, long long fallback) {
    const json i = get(g, "index");
    return i.is_number_integer() ? i.get<long long>() : fallback;
}

// One entity of one GPU.
struct EntityRow {
    long long gpu;
    const json* e;
};

// Every entity with its GPU.  Admin protocol 4 lists them per GPU in
// "gpus"; an older daemon drives one GPU, index 0.
std::vector<EntityRow> entities_of(const json& list) {
    std::vector<EntityRow> rows;
    const json* gpus = list.contains("gpus") && list["gpus"].is_array() ? &list["gpus"] : nullptr;
    if (gpus) {
        long long n = 0;
        for (const json& g : *gpus) {
            const long long index = index_of(g, n++);
            if (const auto it = g.find("entities"); it != g.end() && it->is_array())
                for (const json& e : *it)
                    if (e.is_object()) rows.push_back({index, &e});
        }
        return rows;
    }
    if (const auto it = list.find("entities"); it != list.end() && it->is_array())
        for (const json& e : *it) {
            if (!e.is_object()) continue;
            const json g = get(e, "gpu");
            rows.push_back({g.is_number_integer() ? g.get<long long>() : 0, &e});
        }
    return rows;
}

// The per-GPU part of `stats`, one object per GPU in the shape of admin
// protocol 4's "gpus" (policy from `list` where stats has none).  An older
// daemon's top-level fields are its one GPU, index 0.
std::vector<json> gpus_of(const json& list, const json& stats) {
    std::vector<json> out;
    const json* list_gpus = list.contains("gpus") && list["gpus"].is_array() ? &list["gpus"] : nullptr;
    auto list_gpu = [&](long long index) -> json {
        if (!list_gpus) return json();
        long long n = 0;
        for (const json& g : *list_gpus)
            if (index_of(g, n++) == index) return g;
        return json();
    };
    if (stats.contains("gpus") && stats["gpus"].is_array()) {
        long long n = 0;
        for (const json& g : stats["gpus"]) {
            if (!g.is_object()) continue;
            json o = g;
            o["index"] = index_of(g, n++);
            if (!o.contains("policy")) o["policy"] = get(list_gpu(o["index"].get<long long>()), "policy");
            out.push_back(std::move(o));
        }
        return out;
    }
    const json gpu = get(stats, "gpu");
    json o = {{"index", 0},
              {"name", "gpu0"},
              {"policy", list.contains("policy") ? list["policy"] : get(stats, "policy")},
              {"arbitration", get(gpu, "arbitration")},
              {"busy_fraction", get(gpu, "busy_fraction")},
              {"busy_s", get(gpu, "busy_s")},
              {"idle_with_demand_fraction", get(gpu, "idle_with_demand_fraction")},
              {"context_switches", get(gpu, "context_switches")},
              {"channels", get(stats, "channels")},
              {"scheduler_cpu_s", get(stats, "scheduler_cpu_s")},
              {"metrics", get(stats, "metrics")}};
    out.push_back(std::move(o));
    return out;
}

}  // namespace

std::string render_prometheus(const json& list, const json& stats) {
    Writer w;
    const std::vector<EntityRow> entities = entities_of(list);
    // Counters go on leaves only (the entities that own channels), so that
    // sum by (vm) over them is a VM's total and nothing is counted twice.
    // A VM on two GPUs has a tree on each: parents are per GPU.
    std::set<std::pair<long long, std::string>> parents;
    for (const EntityRow& r : entities) {
        const std::string path = r.e->value("path", std::string{});
        for (std::size_t p = path.find('/'); p != std::string::npos; p = path.find('/', p + 1))
            parents.insert({r.gpu, path.substr(0, p)});
    }
    auto per_entity = [&](const char* name, const char* type, const char* help, const char* field,
                          bool leaves_only) {
        w.family(name, type, help);
        for (const EntityRow& r : entities) {
            const json& e = *r.e;
            const std::string path = e.value("path", std::string{});
            if (leaves_only && parents.count({r.gpu, path})) continue;
            if (!e.contains(field)) continue;
            json v = e[field];
            if (std::string(field) == "gpu_time_ms" && v.is_number()) v = v.get<double>() / 1000.0;
            w.sample(name, entity_labels(e) + "," + gpu_label(r.gpu), v);
        }
    };
    per_entity("pvgpu_entity_gpu_seconds_total", "counter",
               "GPU time used by the entity, from completion interrupts and the engine status register.",
               "gpu_time_ms", true);
    per_entity("pvgpu_entity_kernels_total", "counter",
               "Kernels of the entity that completed with a completion interrupt.", "kernels", true);
    per_entity("pvgpu_entity_weight", "gauge", "Admin weight of the entity (1..10000).", "weight", false);
    per_entity("pvgpu_entity_target_share", "gauge",
               "Fraction of its GPU the entity should get now (weighted fair share of the backlogged).",
               "target_share", false);
    per_entity("pvgpu_entity_achieved_share", "gauge",
               "Fraction of its GPU the entity got over the daemon's recent window.", "achieved_share", false);
    per_entity("pvgpu_entity_channels", "gauge", "Open channels in the entity's subtree.", "channels", false);

    const std::vector<json> gpus = gpus_of(list, stats);
    // One sample per GPU that has the field; the family only if one has.
    auto per_gpu = [&](const char* name, const char* type, const char* help, auto value_of) {
        bool declared = false;
        for (const json& g : gpus) {
            const json v = value_of(g);
            if (v.is_null()) continue;
            if (!declared) w.family(name, type, help);
            declared = true;
            w.sample(name, gpu_label(g["index"].get<long long>()), v);
        }
    };
    auto field = [](const char* k) { return [k](const json& g) { return get(g, k); }; };
    auto metric = [](const char* k) { return [k](const json& g) { return get(get(g, "metrics"), k); }; };

    w.family("pvgpu_gpu_info", "gauge", "A GPU of pvgpud: its name and arbitration (value 1).");
    for (const json& g : gpus) {
        const json name = get(g, "name");
        const json arb = get(g, "arbitration");
        const long long index = g["index"].get<long long>();
        w.sample("pvgpu_gpu_info",
                 gpu_label(index) + ",name=\"" +
                     escape(name.is_string() ? name.get<std::string>() : "gpu" + std::to_string(index)) +
                     "\",arbitration=\"" + escape(arb.is_string() ? arb.get<std::string>() : "unknown") + "\"",
                 1);
    }
    w.family("pvgpu_policy_info", "gauge", "The active scheduling policy of the GPU (value 1).");
    for (const json& g : gpus) {
        const json p = get(g, "policy");
        w.sample("pvgpu_policy_info",
                 "policy=\"" + escape(p.is_string() ? p.get<std::string>() : "unknown") + "\"," +
                     gpu_label(g["index"].get<long long>()),
                 1);
    }

    auto scalar = [&](const char* name, const char* type, const char* help, const json& v) {
        if (v.is_null()) return;
        w.family(name, type, help);
        w.sample(name, "", v);
    };
    const json counters = get(stats, "counters");
    scalar("pvgpu_uptime_seconds", "gauge", "Seconds since pvgpud started.", get(stats, "uptime_s"));
    scalar("pvgpu_clients", "gauge", "Connected binary-protocol clients.", get(stats, "clients"));
    per_gpu("pvgpu_channels", "gauge", "Open channels on the GPU.", field("channels"));
    per_gpu("pvgpu_gpu_vms", "gauge", "VMs with channels on the GPU.", field("vms"));
    per_gpu("pvgpu_gpu_busy_ratio", "gauge", "Fraction of the recent window the GPU was executing.",
            field("busy_fraction"));
    per_gpu("pvgpu_gpu_busy_seconds_total", "counter", "Time the GPU was executing.", field("busy_s"));
    per_gpu("pvgpu_gpu_idle_with_demand_ratio", "gauge",
            "Fraction of the recent window the GPU idled while some channel had work.",
            field("idle_with_demand_fraction"));
    per_gpu("pvgpu_gpu_context_switches_total", "counter", "Context switches of the GPU's engine.",
            field("context_switches"));
    per_gpu("pvgpu_max_share_error", "gauge", "Largest |achieved - target| share over the GPU's leaves with work.",
            metric("max_share_error"));
    per_gpu("pvgpu_jain_index", "gauge",
            "Jain's fairness index over achieved/target of the GPU's leaves with work.", metric("jain_index"));
    per_gpu("pvgpu_unfairness", "gauge",
            "max(achieved/target) / min(achieved/target) over the GPU's leaves with work.", metric("unfairness"));
    scalar("pvgpu_daemon_cpu_seconds_total", "counter", "CPU time used by pvgpud (user + system).",
           get(stats, "process_cpu_s"));
    per_gpu("pvgpu_scheduler_cpu_seconds_total", "counter",
            "CPU time pvgpud spent in the GPU's scheduler's own code (policy and accounting).",
            field("scheduler_cpu_s"));
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
