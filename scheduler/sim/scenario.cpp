// Scenario parsing (DESIGN.md section 6).  Everything is validated before a
// Scenario is returned, and every error names the JSON path of the culprit, so
// a typo can never silently fall back to a default and half-run an experiment.
#include "scenario.hpp"

#include <pvgpu/abi.h>

#include <nlohmann/json.hpp>

#include <algorithm>
#include <array>
#include <cerrno>
#include <charconv>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <limits>
#include <map>
#include <memory>
#include <set>
#include <span>
#include <string_view>

#include "core/entity_tree.hpp"

namespace pvgpu::sim {

namespace {

using nlohmann::json;

// Upper bound for every time field: keeps the nanosecond conversions far from
// int64 overflow (1e12 us = 1e15 ns, about 11.6 days).
constexpr double kMaxTimeUs = 1e12;
constexpr double kMaxTimeMs = kMaxTimeUs / 1000;
// Scenario trees are written by hand; this only stops runaway recursion.
constexpr int kMaxTreeDepth = 64;
// Integral doubles are exact up to 2^53.
constexpr double kMaxExactInteger = 9007199254740992.0;

constexpr std::string_view kKernelUsShape =
    R"(must be a positive number or {"uniform": [a, b]} or {"exp": mean})";

// Shortest round-tripping decimal, without exponent ("20000", "0.5").
std::string fmt(double v) {
    std::array<char, 64> buf{};
    auto [end, ec] = std::to_chars(buf.data(), buf.data() + buf.size(), v, std::chars_format::fixed);
    if (ec != std::errc{}) return std::to_string(v);
    return std::string(buf.data(), end);
}

[[noreturn]] void fail(const std::string& path, std::string_view problem) {
    throw ScenarioError((path.empty() ? std::string("(root)") : path) + ": " + std::string(problem));
}

std::string member(const std::string& path, std::string_view key) {
    return path.empty() ? std::string(key) : path + "." + std::string(key);
}

std::string element(const std::string& path, std::size_t index) {
    return path + "[" + std::to_string(index) + "]";
}

std::string join(const std::vector<std::string>& names) {
    std::string out;
    for (const auto& n : names) out += (out.empty() ? "" : ", ") + n;
    return out;
}

// ---- duplicate keys -------------------------------------------------------
// nlohmann::json keeps only one of two equal keys; a second "weight" in a node
// is almost certainly a mistake, so a SAX pass over the text looks for them.

class DuplicateKeyFinder final : public nlohmann::json_sax<json> {
public:
    std::optional<std::string> error;

    bool null() override { return value_done(); }
    bool boolean(bool) override { return value_done(); }
    bool number_integer(number_integer_t) override { return value_done(); }
    bool number_unsigned(number_unsigned_t) override { return value_done(); }
    bool number_float(number_float_t, const string_t&) override { return value_done(); }
    bool string(string_t&) override { return value_done(); }
    bool binary(binary_t&) override { return value_done(); }

    bool start_object(std::size_t) override {
        frames_.push_back(Frame{false, 0, {}, {}});
        return true;
    }
    bool key(string_t& k) override {
        Frame& f = frames_.back();
        if (!f.keys.insert(k).second) {
            f.key = k;
            error = path() + ": duplicate key";
            return false;
        }
        f.key = k;
        return true;
    }
    bool end_object() override {
        frames_.pop_back();
        return value_done();
    }
    bool start_array(std::size_t) override {
        frames_.push_back(Frame{true, 0, {}, {}});
        return true;
    }
    bool end_array() override {
        frames_.pop_back();
        return value_done();
    }
    bool parse_error(std::size_t, const std::string&, const nlohmann::detail::exception& e) override {
        // json::parse already accepted the text; keep a message just in case.
        error = std::string("invalid JSON: ") + e.what();
        return false;
    }

private:
    struct Frame {
        bool array;
        std::size_t index;      // arrays: element in progress
        std::string key;        // objects: member in progress
        std::set<std::string> keys;
    };

    bool value_done() {
        if (!frames_.empty() && frames_.back().array) ++frames_.back().index;
        return true;
    }
    std::string path() const {
        std::string p;
        for (const Frame& f : frames_) p = f.array ? element(p, f.index) : member(p, f.key);
        return p;
    }

    std::vector<Frame> frames_;
};

void check_duplicate_keys(const std::string& text) {
    DuplicateKeyFinder finder;
    json::sax_parse(text, &finder);
    if (finder.error) throw ScenarioError(*finder.error);
}

// ---- typed field access ---------------------------------------------------

void expect_object(const json& v, const std::string& path) {
    if (!v.is_object()) fail(path, "must be an object");
}

// Rejects members not in `allowed`, naming the first one (keys are sorted).
void reject_unknown(const json& obj, const std::string& path, std::span<const std::string_view> allowed) {
    for (const auto& [key, value] : obj.items()) {
        if (std::find(allowed.begin(), allowed.end(), key) != allowed.end()) continue;
        std::string known;
        for (auto a : allowed) known += (known.empty() ? "" : ", ") + std::string(a);
        fail(member(path, key), "unknown field (expected one of: " + known + ")");
    }
}

const json* find(const json& obj, std::string_view key) {
    auto it = obj.find(std::string(key));
    return it == obj.end() ? nullptr : &*it;
}

const json& require(const json& obj, const std::string& path, std::string_view key) {
    const json* v = find(obj, key);
    if (!v) fail(member(path, key), "required field is missing");
    return *v;
}

double number(const json& v, const std::string& path) {
    // nlohmann never treats booleans as numbers, so true/false are rejected here.
    if (!v.is_number()) fail(path, "must be a number");
    return v.get<double>();
}

double positive(const json& v, const std::string& path, double max) {
    double d = number(v, path);
    if (!(d > 0)) fail(path, "must be a positive number");
    if (d > max) fail(path, "must be at most " + fmt(max));
    return d;
}

double non_negative(const json& v, const std::string& path, double max) {
    double d = number(v, path);
    if (!(d >= 0)) fail(path, "must be a number >= 0");
    if (d > max) fail(path, "must be at most " + fmt(max));
    return d;
}

// An integer in lo..hi; integral floats ("batch": 4.0) are accepted.
std::uint64_t integer(const json& v, const std::string& path, std::uint64_t lo, std::uint64_t hi) {
    auto bad = [&]() -> std::string {
        if (hi == std::numeric_limits<std::uint64_t>::max())
            return "must be an integer >= " + std::to_string(lo);
        return "must be an integer in " + std::to_string(lo) + ".." + std::to_string(hi);
    };
    std::uint64_t u = 0;
    if (v.is_number_unsigned()) {
        u = v.get<std::uint64_t>();
    } else if (v.is_number_integer()) {
        fail(path, bad());  // only negative values are stored as signed
    } else if (v.is_number_float()) {
        double d = v.get<double>();
        if (d != std::floor(d) || d < 0 || d > kMaxExactInteger) fail(path, bad());
        u = static_cast<std::uint64_t>(d);
    } else {
        fail(path, bad());
    }
    if (u < lo || u > hi) fail(path, bad());
    return u;
}

bool boolean(const json& v, const std::string& path) {
    if (!v.is_boolean()) fail(path, "must be true or false");
    return v.get<bool>();
}

std::string string(const json& v, const std::string& path) {
    if (!v.is_string()) fail(path, "must be a string");
    return v.get<std::string>();
}

// A time that must survive conversion to nanoseconds as a non-zero value.
Duration positive_us(const json& v, const std::string& path) {
    Duration d = from_us(positive(v, path, kMaxTimeUs));
    if (d <= 0) fail(path, "must be at least 0.001 (one nanosecond)");
    return d;
}

// ---- sections ---------------------------------------------------------------

SimGpuConfig parse_gpu(const json& v, const std::string& path) {
    static constexpr std::array<std::string_view, 4> kFields = {"arbitration", "timeslice_us",
                                                                "ctxsw_us", "watchdog_ms"};
    expect_object(v, path);
    reject_unknown(v, path, kFields);
    SimGpuConfig cfg;
    if (const json* a = find(v, "arbitration")) {
        std::string p = member(path, "arbitration");
        std::string s = string(*a, p);
        if (s == "round-robin")
            cfg.arbitration = Arbitration::RoundRobin;
        else if (s == "timeslice")
            cfg.arbitration = Arbitration::Timeslice;
        else
            fail(p, "must be \"round-robin\" or \"timeslice\", not \"" + s + "\"");
    }
    if (const json* t = find(v, "timeslice_us")) cfg.timeslice = positive_us(*t, member(path, "timeslice_us"));
    if (const json* c = find(v, "ctxsw_us"))
        cfg.ctxsw = from_us(non_negative(*c, member(path, "ctxsw_us"), kMaxTimeUs));
    if (const json* w = find(v, "watchdog_ms"))
        cfg.watchdog = from_us(non_negative(*w, member(path, "watchdog_ms"), kMaxTimeMs) * 1000);
    return cfg;
}

// Host-side costs go to the scheduler; `preempt_us` is engine dead time and
// `irq_latency_us` the GPU's interrupts' way to the host.
MechanismCosts parse_costs(const json& v, const std::string& path, SimGpuConfig& gpu) {
    static constexpr std::array<std::string_view, 5> kFields = {"trap_us", "remap_us", "poll_us",
                                                                "preempt_us", "irq_latency_us"};
    expect_object(v, path);
    reject_unknown(v, path, kFields);
    MechanismCosts costs;
    auto read = [&](std::string_view key, Duration& out) {
        if (const json* c = find(v, key)) out = from_us(non_negative(*c, member(path, key), kMaxTimeUs));
    };
    read("trap_us", costs.trap);
    read("remap_us", costs.remap);
    read("poll_us", costs.poll);
    read("preempt_us", gpu.preempt);
    read("irq_latency_us", gpu.irq_latency);
    return costs;
}

void parse_policy(const json& v, const std::string& path, Scenario& sc) {
    static constexpr std::array<std::string_view, 2> kFields = {"name", "params"};
    expect_object(v, path);
    reject_unknown(v, path, kFields);
    if (const json* n = find(v, "name")) sc.policy = string(*n, member(path, "name"));

    const auto& catalog = policy_catalog();
    auto info = std::find_if(catalog.begin(), catalog.end(),
                             [&](const PolicyInfo& p) { return p.name == sc.policy; });
    if (info == catalog.end()) {
        std::vector<std::string> known;
        for (const auto& p : catalog) known.push_back(p.name);
        fail(member(path, "name"), "unknown policy \"" + sc.policy + "\" (known: " + join(known) + ")");
    }

    const json* params = find(v, "params");
    if (!params) return;
    std::string ppath = member(path, "params");
    expect_object(*params, ppath);
    for (const auto& item : params->items()) {
        // Plain variables, not a structured binding: older clang cannot capture those.
        const std::string& key = item.key();
        const json& value = item.value();
        std::string kpath = member(ppath, key);
        bool known_param = std::any_of(info->params.begin(), info->params.end(),
                                       [&](const auto& p) { return std::get<0>(p) == key; });
        if (!known_param) {
            std::vector<std::string> names;
            for (const auto& p : info->params) names.push_back(std::get<0>(p));
            fail(kpath, "unknown parameter for policy \"" + info->name + "\" (" +
                            (names.empty() ? std::string("it has none") : "known: " + join(names)) + ")");
        }
        // make_policy() refuses negative parameters; say so here, with the path.
        sc.params[key] = non_negative(value, kpath, std::numeric_limits<double>::max());
    }
}

Dist parse_kernel_us(const json& v, const std::string& path) {
    Dist d;
    if (v.is_number()) {
        double x = v.get<double>();
        if (!(x > 0)) fail(path, kKernelUsShape);
        if (x > kMaxTimeUs) fail(path, "must be at most " + fmt(kMaxTimeUs));
        d.kind = Dist::Kind::Fixed;
        d.a = x;
        return d;
    }
    if (!v.is_object() || v.size() != 1) fail(path, kKernelUsShape);
    if (const json* u = find(v, "uniform")) {
        std::string upath = member(path, "uniform");
        constexpr std::string_view kShape = "must be [a, b] with 0 < a <= b";
        if (!u->is_array() || u->size() != 2 || !(*u)[0].is_number() || !(*u)[1].is_number())
            fail(upath, kShape);
        double lo = (*u)[0].get<double>();
        double hi = (*u)[1].get<double>();
        if (!(lo > 0) || !(lo <= hi)) fail(upath, kShape);
        if (hi > kMaxTimeUs) fail(upath, "must be at most " + fmt(kMaxTimeUs));
        d.kind = Dist::Kind::Uniform;
        d.a = lo;
        d.b = hi;
        return d;
    }
    if (const json* e = find(v, "exp")) {
        d.kind = Dist::Kind::Exp;
        d.a = positive(*e, member(path, "exp"), kMaxTimeUs);
        return d;
    }
    fail(path, kKernelUsShape);
}

Workload parse_workload(const json& v, const std::string& path) {
    static constexpr std::array<std::string_view, 7> kFields = {
        "kernel_us", "gap_us", "batch", "channels", "kernels", "start_ms", "forge_progress"};
    expect_object(v, path);
    reject_unknown(v, path, kFields);
    Workload w;
    w.kernel_us = parse_kernel_us(require(v, path, "kernel_us"), member(path, "kernel_us"));
    if (const json* g = find(v, "gap_us")) w.gap_us = non_negative(*g, member(path, "gap_us"), kMaxTimeUs);
    // A batch must fit in the ring, which holds one entry less than its size.
    if (const json* b = find(v, "batch"))
        w.batch = static_cast<std::uint32_t>(integer(*b, member(path, "batch"), 1, PVGPU_RING_ENTRIES - 1));
    if (const json* c = find(v, "channels"))
        w.channels = static_cast<std::uint32_t>(integer(*c, member(path, "channels"), 1, 64));
    if (const json* k = find(v, "kernels"))
        w.kernels = integer(*k, member(path, "kernels"), 0, std::numeric_limits<std::uint64_t>::max());
    if (const json* s = find(v, "start_ms")) w.start_ms = non_negative(*s, member(path, "start_ms"), kMaxTimeMs);
    if (const json* f = find(v, "forge_progress"))
        w.forge_progress = boolean(*f, member(path, "forge_progress"));
    return w;
}

// Parses one node; `siblings` maps names already used at this level to their path.
NodeSpec parse_node(const json& v, const std::string& path, int depth,
                    std::map<std::string, std::string>& siblings) {
    static constexpr std::array<std::string_view, 4> kVmFields = {"vm", "weight", "pid_hints", "children"};
    static constexpr std::array<std::string_view, 3> kTaskFields = {"task", "weight", "workload"};

    expect_object(v, path);
    if (depth > kMaxTreeDepth) fail(path, "tree nested deeper than " + std::to_string(kMaxTreeDepth) + " levels");
    bool is_vm = v.contains("vm");
    bool is_task = v.contains("task");
    if (is_vm == is_task) fail(path, "a node needs exactly one of \"vm\" or \"task\"");

    NodeSpec node;
    node.kind = is_vm ? NodeSpec::Kind::Vm : NodeSpec::Kind::Task;
    // Misplaced fields get a specific message before the generic unknown-field one.
    if (is_vm && v.contains("workload")) fail(member(path, "workload"), "a vm cannot have a workload");
    if (is_task && v.contains("children")) fail(member(path, "children"), "a task cannot have children");
    if (is_task && v.contains("pid_hints")) fail(member(path, "pid_hints"), "only a vm has pid_hints");
    if (is_vm)
        reject_unknown(v, path, kVmFields);
    else
        reject_unknown(v, path, kTaskFields);

    std::string name_path = member(path, is_vm ? "vm" : "task");
    node.name = string(v.at(is_vm ? "vm" : "task"), name_path);
    try {
        EntityTree::check_name(node.name);
    } catch (const TreeError& e) {
        fail(name_path, e.what());
    }
    if (auto [it, inserted] = siblings.emplace(node.name, name_path); !inserted)
        fail(name_path, "duplicate name \"" + node.name + "\" (already used by " + it->second + ")");

    if (const json* w = find(v, "weight"))
        node.weight = static_cast<std::uint32_t>(
            integer(*w, member(path, "weight"), PVGPU_WEIGHT_MIN, PVGPU_WEIGHT_MAX));

    if (is_vm) {
        if (const json* h = find(v, "pid_hints")) node.pid_hints = boolean(*h, member(path, "pid_hints"));
        std::string cpath = member(path, "children");
        const json& children = require(v, path, "children");
        if (!children.is_array() || children.empty()) fail(cpath, "a vm needs a non-empty array of children");
        std::map<std::string, std::string> names;
        for (std::size_t i = 0; i < children.size(); ++i)
            node.children.push_back(parse_node(children[i], element(cpath, i), depth + 1, names));
    } else {
        node.workload = parse_workload(require(v, path, "workload"), member(path, "workload"));
    }
    return node;
}

Scenario parse_document(const json& doc) {
    static constexpr std::array<std::string_view, 8> kFields = {
        "name", "seed", "duration_ms", "warmup_ms", "gpu", "policy", "costs", "tree"};
    expect_object(doc, "");
    reject_unknown(doc, "", kFields);

    Scenario sc;
    sc.name = string(require(doc, "", "name"), "name");
    if (sc.name.empty()) fail("name", "must not be empty");
    if (const json* s = find(doc, "seed"))
        sc.seed = integer(*s, "seed", 0, std::numeric_limits<std::uint64_t>::max());
    sc.duration_ms = positive(require(doc, "", "duration_ms"), "duration_ms", kMaxTimeMs);
    if (const json* w = find(doc, "warmup_ms")) {
        sc.warmup_ms = non_negative(*w, "warmup_ms", kMaxTimeMs);
        if (sc.warmup_ms >= sc.duration_ms)
            fail("warmup_ms", "must be less than duration_ms (" + fmt(sc.duration_ms) + ")");
    }
    if (const json* g = find(doc, "gpu")) sc.gpu = parse_gpu(*g, "gpu");
    if (const json* p = find(doc, "policy"))
        parse_policy(*p, "policy", sc);
    else
        parse_policy(json::object(), "policy", sc);  // still checks the default exists
    if (const json* c = find(doc, "costs")) sc.costs = parse_costs(*c, "costs", sc.gpu);

    const json& tree = require(doc, "", "tree");
    if (!tree.is_array() || tree.empty()) fail("tree", "must be a non-empty array of vm and task nodes");
    std::map<std::string, std::string> names;
    for (std::size_t i = 0; i < tree.size(); ++i) sc.tree.push_back(parse_node(tree[i], element("tree", i), 1, names));
    return sc;
}

}  // namespace

Scenario parse_scenario(const std::string& json_text) {
    json doc;
    try {
        doc = json::parse(json_text);
    } catch (const json::parse_error& e) {
        throw ScenarioError(std::string("invalid JSON: ") + e.what());
    }
    check_duplicate_keys(json_text);
    return parse_document(doc);
}

Scenario load_scenario(const std::string& path) {
    struct Closer {
        void operator()(std::FILE* f) const { std::fclose(f); }
    };
    std::unique_ptr<std::FILE, Closer> file(std::fopen(path.c_str(), "rb"));
    if (!file) throw ScenarioError(path + ": " + std::strerror(errno));
    std::string text;
    std::array<char, 1 << 16> buf{};
    for (;;) {
        std::size_t n = std::fread(buf.data(), 1, buf.size(), file.get());
        text.append(buf.data(), n);
        if (n < buf.size()) break;
    }
    // Reading a directory opens fine and fails here with EISDIR.
    if (std::ferror(file.get())) throw ScenarioError(path + ": " + std::strerror(errno));
    return parse_scenario(text);
}

}  // namespace pvgpu::sim
