// Scenario parsing and validation (scheduler/sim/scenario.hpp, DESIGN.md section 6).
#include <catch2/catch.hpp>

#include <nlohmann/json.hpp>

#include <algorithm>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <string>
#include <unistd.h>

#include "sim/scenario.hpp"

using namespace pvgpu;
using namespace pvgpu::sim;
using nlohmann::json;
using Catch::Matchers::Contains;
using Catch::Matchers::StartsWith;

namespace {

// The example of DESIGN.md section 6, verbatim.
const char* const kExample = R"({
  "name": "example", "seed": 1, "duration_ms": 20000, "warmup_ms": 1000,
  "gpu": {"arbitration": "round-robin", "timeslice_us": 2000},
  "policy": {"name": "hfq", "params": {}},
  "costs": {"trap_us": 2, "remap_us": 50},
  "tree": [
    {"vm": "vm1", "weight": 100, "pid_hints": true, "children": [
      {"task": "bench", "weight": 100,
       "workload": {"kernel_us": 4171, "gap_us": 0, "batch": 1, "channels": 1,
                    "kernels": 0, "start_ms": 0}},
      {"task": "throttle", "workload": {"kernel_us": {"uniform": [100, 900]}}}
    ]},
    {"task": "hostbench", "weight": 200, "workload": {"kernel_us": 300, "gap_us": 50}}
  ]
})";

json example() { return json::parse(kExample); }

// The error message must start with "<path>:" and mention `detail`.
void expect_error(const json& j, const std::string& path, const std::string& detail = "") {
    INFO(j.dump());
    CHECK_THROWS_AS(parse_scenario(j.dump()), ScenarioError);
    CHECK_THROWS_WITH(parse_scenario(j.dump()), StartsWith(path + ": ") && Contains(detail));
}

void expect_error_text(const std::string& text, const std::string& prefix, const std::string& detail = "") {
    INFO(text);
    CHECK_THROWS_AS(parse_scenario(text), ScenarioError);
    CHECK_THROWS_WITH(parse_scenario(text), StartsWith(prefix) && Contains(detail));
}

const PolicyInfo& find_hfq() {
    const auto& cat = policy_catalog();
    auto it = std::find_if(cat.begin(), cat.end(), [](const PolicyInfo& p) { return p.name == "hfq"; });
    REQUIRE(it != cat.end());
    return *it;
}

}  // namespace

TEST_CASE("scenario: the DESIGN.md example parses with the right values", "[scenario]") {
    Scenario sc = parse_scenario(kExample);
    CHECK(sc.name == "example");
    CHECK(sc.seed == 1);
    CHECK(sc.duration_ms == 20000);
    CHECK(sc.warmup_ms == 1000);
    CHECK(sc.gpu.arbitration == Arbitration::RoundRobin);
    CHECK(sc.gpu.timeslice == 2 * kMillisecond);
    CHECK(sc.gpu.ctxsw == 0);
    CHECK(sc.gpu.watchdog == 2 * kSecond);
    CHECK(sc.policy == "hfq");
    CHECK(sc.params.empty());
    CHECK(sc.costs.trap == 2 * kMicrosecond);
    CHECK(sc.costs.remap == 50 * kMicrosecond);
    CHECK(sc.costs.poll == MechanismCosts{}.poll);

    REQUIRE(sc.tree.size() == 2);
    const NodeSpec& vm1 = sc.tree[0];
    CHECK(vm1.kind == NodeSpec::Kind::Vm);
    CHECK(vm1.name == "vm1");
    CHECK(vm1.weight == 100);
    CHECK(vm1.pid_hints);
    CHECK_FALSE(vm1.workload.has_value());
    REQUIRE(vm1.children.size() == 2);

    const NodeSpec& bench = vm1.children[0];
    CHECK(bench.kind == NodeSpec::Kind::Task);
    CHECK(bench.name == "bench");
    CHECK(bench.weight == 100);
    CHECK(bench.children.empty());
    REQUIRE(bench.workload.has_value());
    CHECK(bench.workload->kernel_us.kind == Dist::Kind::Fixed);
    CHECK(bench.workload->kernel_us.a == 4171);
    CHECK(bench.workload->kernel_us.mean() == 4171);
    CHECK(bench.workload->gap_us == 0);
    CHECK(bench.workload->batch == 1);
    CHECK(bench.workload->channels == 1);
    CHECK(bench.workload->kernels == 0);
    CHECK(bench.workload->start_ms == 0);

    const NodeSpec& throttle = vm1.children[1];
    CHECK(throttle.name == "throttle");
    CHECK(throttle.weight == PVGPU_WEIGHT_DEFAULT);
    REQUIRE(throttle.workload.has_value());
    CHECK(throttle.workload->kernel_us.kind == Dist::Kind::Uniform);
    CHECK(throttle.workload->kernel_us.a == 100);
    CHECK(throttle.workload->kernel_us.b == 900);
    CHECK(throttle.workload->kernel_us.mean() == 500);

    const NodeSpec& host = sc.tree[1];
    CHECK(host.kind == NodeSpec::Kind::Task);
    CHECK(host.name == "hostbench");
    CHECK(host.weight == 200);
    REQUIRE(host.workload.has_value());
    CHECK(host.workload->kernel_us.a == 300);
    CHECK(host.workload->gap_us == 50);
}

TEST_CASE("scenario: defaults for every optional field", "[scenario]") {
    Scenario sc = parse_scenario(R"({"name": "min", "duration_ms": 10,
        "tree": [{"task": "t", "workload": {"kernel_us": 5}}]})");
    CHECK(sc.name == "min");
    CHECK(sc.seed == 1);
    CHECK(sc.duration_ms == 10);
    CHECK(sc.warmup_ms == 0);
    CHECK(sc.gpu.arbitration == Arbitration::RoundRobin);
    CHECK(sc.gpu.timeslice == 2000 * kMicrosecond);
    CHECK(sc.gpu.ctxsw == 0);
    CHECK(sc.gpu.watchdog == 2000 * kMillisecond);
    CHECK(sc.gpu.preempt == 75 * kMicrosecond);
    CHECK(sc.policy == "hfq");
    CHECK(sc.params.empty());
    CHECK(sc.costs.trap == MechanismCosts{}.trap);
    CHECK(sc.costs.remap == MechanismCosts{}.remap);
    CHECK(sc.costs.poll == MechanismCosts{}.poll);
    REQUIRE(sc.tree.size() == 1);
    CHECK(sc.tree[0].weight == 100);
    REQUIRE(sc.tree[0].workload.has_value());
    const Workload& w = *sc.tree[0].workload;
    CHECK(w.gap_us == 0);
    CHECK(w.batch == 1);
    CHECK(w.channels == 1);
    CHECK(w.kernels == 0);
    CHECK(w.start_ms == 0);
}

TEST_CASE("scenario: every field set explicitly", "[scenario]") {
    json j = example();
    j["seed"] = 42;
    j["gpu"] = {{"arbitration", "timeslice"}, {"timeslice_us", 500}, {"ctxsw_us", 25}, {"watchdog_ms", 0}};
    j["costs"] = {{"trap_us", 3.5}, {"remap_us", 0}, {"poll_us", 0.25}, {"preempt_us", 60}};
    j["tree"][0]["pid_hints"] = false;
    j["tree"][0]["weight"] = PVGPU_WEIGHT_MAX;
    j["tree"][0]["children"].push_back(
        {{"vm", "nested"}, {"weight", PVGPU_WEIGHT_MIN},
         {"children", {{{"task", "t"}, {"workload", {{"kernel_us", {{"exp", 250}}}}}}}}});
    j["tree"][1]["workload"] = {{"kernel_us", 300}, {"gap_us", 12.5}, {"batch", PVGPU_RING_ENTRIES - 1},
                                {"channels", 64}, {"kernels", 1000}, {"start_ms", 5}};
    const PolicyInfo& hfq = find_hfq();
    if (!hfq.params.empty()) j["policy"]["params"][std::get<0>(hfq.params[0])] = 7;

    Scenario sc = parse_scenario(j.dump());
    CHECK(sc.seed == 42);
    CHECK(sc.gpu.arbitration == Arbitration::Timeslice);
    CHECK(sc.gpu.timeslice == 500 * kMicrosecond);
    CHECK(sc.gpu.ctxsw == 25 * kMicrosecond);
    CHECK(sc.gpu.watchdog == 0);
    CHECK(sc.costs.trap == 3500);
    CHECK(sc.gpu.preempt == 60 * kMicrosecond);
    CHECK(sc.costs.remap == 0);
    CHECK(sc.costs.poll == 250);
    if (!hfq.params.empty()) {
        REQUIRE(sc.params.size() == 1);
        CHECK(sc.params.at(std::get<0>(hfq.params[0])) == 7);
    }
    CHECK_FALSE(sc.tree[0].pid_hints);
    CHECK(sc.tree[0].weight == PVGPU_WEIGHT_MAX);
    REQUIRE(sc.tree[0].children.size() == 3);
    const NodeSpec& nested = sc.tree[0].children[2];
    CHECK(nested.kind == NodeSpec::Kind::Vm);
    CHECK(nested.weight == PVGPU_WEIGHT_MIN);
    REQUIRE(nested.children.size() == 1);
    CHECK(nested.children[0].workload->kernel_us.kind == Dist::Kind::Exp);
    CHECK(nested.children[0].workload->kernel_us.mean() == 250);
    const Workload& w = *sc.tree[1].workload;
    CHECK(w.gap_us == 12.5);
    CHECK(w.batch == PVGPU_RING_ENTRIES - 1);
    CHECK(w.channels == 64);
    CHECK(w.kernels == 1000);
    CHECK(w.start_ms == 5);
}

TEST_CASE("scenario: other policies and integral floats are accepted", "[scenario]") {
    json j = example();
    j["policy"] = {{"name", "none"}};
    j["tree"][1]["weight"] = 300.0;
    Scenario sc = parse_scenario(j.dump());
    CHECK(sc.policy == "none");
    CHECK(sc.tree[1].weight == 300);
    // The same name under different parents is fine.
    j["tree"][1]["task"] = "bench";
    CHECK(parse_scenario(j.dump()).tree[1].name == "bench");
}

TEST_CASE("scenario: bad JSON", "[scenario]") {
    expect_error_text("{", "invalid JSON: ");
    expect_error_text("", "invalid JSON: ");
    expect_error_text(R"({"name": "x",})", "invalid JSON: ");
    expect_error_text(std::string(kExample) + " trailing", "invalid JSON: ");
}

TEST_CASE("scenario: unknown fields", "[scenario]") {
    json j = example();
    j["bogus"] = 1;
    expect_error(j, "bogus", "unknown field");

    j = example();
    j["gpu"]["preempt"] = true;
    expect_error(j, "gpu.preempt", "unknown field");

    j = example();
    j["costs"]["irq_us"] = 1;
    expect_error(j, "costs.irq_us", "unknown field");

    j = example();
    j["policy"]["nmae"] = "hfq";
    expect_error(j, "policy.nmae", "unknown field");

    j = example();
    j["tree"][0]["children"][1]["workload"]["kernel_ms"] = 3;
    expect_error(j, "tree[0].children[1].workload.kernel_ms", "unknown field");

    j = example();
    j["tree"][1]["wieght"] = 3;
    expect_error(j, "tree[1].wieght", "unknown field");

    j = example();
    j["tree"][0]["children"][0]["pid_hints"] = true;
    expect_error(j, "tree[0].children[0].pid_hints", "vm");
}

TEST_CASE("scenario: wrong types", "[scenario]") {
    json j = example();
    j["duration_ms"] = "20000";
    expect_error(j, "duration_ms", "must be a number");

    j = example();
    j["name"] = 5;
    expect_error(j, "name", "must be a string");

    j = example();
    j["seed"] = -1;
    expect_error(j, "seed", "integer");

    j = example();
    j["seed"] = 1.5;
    expect_error(j, "seed", "integer");

    j = example();
    j["gpu"] = "round-robin";
    expect_error(j, "gpu", "must be an object");

    j = example();
    j["tree"][0]["pid_hints"] = "yes";
    expect_error(j, "tree[0].pid_hints", "true or false");

    j = example();
    j["tree"][1]["weight"] = true;
    expect_error(j, "tree[1].weight", "integer");

    j = example();
    j["tree"][1]["weight"] = 150.5;
    expect_error(j, "tree[1].weight", "integer");

    j = example();
    j["tree"] = json::object();
    expect_error(j, "tree", "non-empty array");

    j = example();
    j["tree"][1] = "hostbench";
    expect_error(j, "tree[1]", "must be an object");

    j = example();
    j["tree"][1]["workload"] = 300;
    expect_error(j, "tree[1].workload", "must be an object");

    j = example();
    j["policy"]["params"] = json::array();
    expect_error(j, "policy.params", "must be an object");

    expect_error_text("[]", "(root): ", "must be an object");
}

TEST_CASE("scenario: required fields", "[scenario]") {
    json j = example();
    j.erase("name");
    expect_error(j, "name", "required");

    j = example();
    j.erase("duration_ms");
    expect_error(j, "duration_ms", "required");

    j = example();
    j.erase("tree");
    expect_error(j, "tree", "required");

    j = example();
    j["name"] = "";
    expect_error(j, "name", "empty");
}

TEST_CASE("scenario: weights outside 1..10000", "[scenario]") {
    json j = example();
    j["tree"][1]["weight"] = 0;
    expect_error(j, "tree[1].weight", "1..10000");

    j["tree"][1]["weight"] = 10001;
    expect_error(j, "tree[1].weight", "1..10000");

    j["tree"][1]["weight"] = -5;
    expect_error(j, "tree[1].weight", "1..10000");

    j = example();
    j["tree"][0]["children"][0]["weight"] = 0;
    expect_error(j, "tree[0].children[0].weight", "1..10000");
}

TEST_CASE("scenario: tree shape", "[scenario]") {
    json j = example();
    j["tree"] = json::array();
    expect_error(j, "tree", "non-empty");

    j = example();
    j["tree"][0]["children"][1]["task"] = "bench";
    expect_error(j, "tree[0].children[1].task", "duplicate name \"bench\"");

    j = example();
    j["tree"][1] = {{"vm", "vm1"}, {"children", example()["tree"][0]["children"]}};
    expect_error(j, "tree[1].vm", "duplicate name \"vm1\"");

    j = example();
    j["tree"][0].erase("children");
    expect_error(j, "tree[0].children", "required");

    j = example();
    j["tree"][0]["children"] = json::array();
    expect_error(j, "tree[0].children", "non-empty array");

    j = example();
    j["tree"][0]["workload"] = {{"kernel_us", 5}};
    expect_error(j, "tree[0].workload", "vm cannot have a workload");

    j = example();
    j["tree"][1].erase("workload");
    expect_error(j, "tree[1].workload", "required");

    j = example();
    j["tree"][1]["children"] = json::array();
    expect_error(j, "tree[1].children", "task cannot have children");

    j = example();
    j["tree"][1]["vm"] = "both";
    expect_error(j, "tree[1]", "exactly one of");

    j = example();
    j["tree"][1] = {{"weight", 100}};
    expect_error(j, "tree[1]", "exactly one of");

    j = example();
    j["tree"][1]["task"] = "host/bench";
    expect_error(j, "tree[1].task", "may only contain");

    j = example();
    j["tree"][0]["children"][0]["task"] = "";
    expect_error(j, "tree[0].children[0].task", "empty");
}

TEST_CASE("scenario: kernel_us shapes", "[scenario]") {
    const std::string path = "tree[0].children[1].workload.kernel_us";
    const std::string shape = R"(must be a positive number or {"uniform": [a, b]} or {"exp": mean})";
    auto with = [](json kernel_us) {
        json j = example();
        j["tree"][0]["children"][1]["workload"]["kernel_us"] = std::move(kernel_us);
        return j;
    };
    expect_error(with(0), path, shape);
    expect_error(with(-3), path, shape);
    expect_error(with("100"), path, shape);
    expect_error(with({{"normal", 5}}), path, shape);
    expect_error(with({{"uniform", {1, 2}}, {"exp", 3}}), path, shape);
    expect_error(with({{"uniform", {900, 100}}}), path + ".uniform", "0 < a <= b");
    expect_error(with({{"uniform", {0, 100}}}), path + ".uniform", "0 < a <= b");
    expect_error(with({{"uniform", {100}}}), path + ".uniform", "0 < a <= b");
    expect_error(with({{"uniform", {100, 200, 300}}}), path + ".uniform", "0 < a <= b");
    expect_error(with({{"uniform", {"1", "2"}}}), path + ".uniform", "0 < a <= b");
    expect_error(with({{"exp", 0}}), path + ".exp", "positive");
    expect_error(with({{"exp", "x"}}), path + ".exp", "number");

    // A degenerate uniform (a == b) is allowed.
    Scenario sc = parse_scenario(with({{"uniform", {300, 300}}}).dump());
    CHECK(sc.tree[0].children[1].workload->kernel_us.mean() == 300);
}

TEST_CASE("scenario: workload ranges", "[scenario]") {
    const std::string base = "tree[1].workload.";
    auto with = [](const char* key, json value) {
        json j = example();
        j["tree"][1]["workload"][key] = std::move(value);
        return j;
    };
    expect_error(with("batch", 0), base + "batch", "1..255");
    expect_error(with("batch", PVGPU_RING_ENTRIES), base + "batch", "1..255");
    expect_error(with("channels", 0), base + "channels", "1..64");
    expect_error(with("channels", 65), base + "channels", "1..64");
    expect_error(with("kernels", -1), base + "kernels", "integer");
    expect_error(with("kernels", 2.5), base + "kernels", "integer");
    expect_error(with("gap_us", -1), base + "gap_us", ">= 0");
    expect_error(with("start_ms", -0.5), base + "start_ms", ">= 0");
    expect_error(with("gap_us", 1e300), base + "gap_us", "at most");
}

TEST_CASE("scenario: times and gpu settings", "[scenario]") {
    json j = example();
    j["warmup_ms"] = 20000;
    expect_error(j, "warmup_ms", "less than duration_ms");

    j["warmup_ms"] = 25000;
    expect_error(j, "warmup_ms", "less than duration_ms");

    j["warmup_ms"] = -1;
    expect_error(j, "warmup_ms", ">= 0");

    j = example();
    j["duration_ms"] = 0;
    expect_error(j, "duration_ms", "positive");

    j = example();
    j["duration_ms"] = 1e30;
    expect_error(j, "duration_ms", "at most");

    j = example();
    j["gpu"]["arbitration"] = "fifo";
    expect_error(j, "gpu.arbitration", "round-robin");

    j = example();
    j["gpu"]["timeslice_us"] = 0;
    expect_error(j, "gpu.timeslice_us", "positive");

    j = example();
    j["gpu"]["timeslice_us"] = 1e-6;  // rounds to 0 ns
    expect_error(j, "gpu.timeslice_us", "nanosecond");

    j = example();
    j["gpu"]["ctxsw_us"] = -1;
    expect_error(j, "gpu.ctxsw_us", ">= 0");

    j = example();
    j["gpu"]["watchdog_ms"] = -1;
    expect_error(j, "gpu.watchdog_ms", ">= 0");

    j = example();
    j["costs"]["remap_us"] = -50;
    expect_error(j, "costs.remap_us", ">= 0");

    j = example();
    j["costs"]["preempt_us"] = -75;
    expect_error(j, "costs.preempt_us", ">= 0");
}

TEST_CASE("scenario: policy name and parameters", "[scenario]") {
    json j = example();
    j["policy"]["name"] = "fifo";
    expect_error(j, "policy.name", "unknown policy \"fifo\"");
    // The message lists every known policy.
    for (const PolicyInfo& p : policy_catalog()) expect_error(j, "policy.name", p.name);

    j = example();
    j["policy"]["params"]["no_such_param"] = 1;
    expect_error(j, "policy.params.no_such_param", "unknown parameter for policy \"hfq\"");
    for (const auto& param : find_hfq().params)
        expect_error(j, "policy.params.no_such_param", std::get<0>(param));

    // Parameters are checked against the policy named, which defaults to hfq.
    j = example();
    j["policy"].erase("name");
    j["policy"]["params"]["no_such_param"] = 1;
    expect_error(j, "policy.params.no_such_param", "\"hfq\"");

    const PolicyInfo& hfq = find_hfq();
    if (!hfq.params.empty()) {
        const std::string name = std::get<0>(hfq.params[0]);
        j = example();
        j["policy"]["params"][name] = "5";
        expect_error(j, "policy.params." + name, "number");
        j["policy"]["params"][name] = -1;
        expect_error(j, "policy.params." + name, ">= 0");
    }
}

TEST_CASE("scenario: duplicate JSON keys are refused", "[scenario]") {
    expect_error_text(R"({"name": "a", "duration_ms": 10, "name": "b",
        "tree": [{"task": "t", "workload": {"kernel_us": 5}}]})",
                      "name: ", "duplicate key");
    expect_error_text(R"({"name": "a", "duration_ms": 10,
        "tree": [{"task": "t", "workload": {"kernel_us": 5}},
                 {"task": "u", "weight": 1, "weight": 2, "workload": {"kernel_us": 5}}]})",
                      "tree[1].weight: ", "duplicate key");
    expect_error_text(R"({"name": "a", "duration_ms": 10,
        "tree": [{"vm": "v", "children": [{"task": "t", "workload": {"kernel_us": 5, "gap_us": 1, "gap_us": 2}}]}]})",
                      "tree[0].children[0].workload.gap_us: ", "duplicate key");
}

TEST_CASE("scenario: load_scenario reads files and reports errors", "[scenario]") {
    SECTION("missing file") {
        const std::string path = "/nonexistent-dir-pvgpu/scenario.json";
        CHECK_THROWS_WITH(load_scenario(path), StartsWith(path) && Contains(std::strerror(ENOENT)));
    }
    SECTION("a directory") {
        CHECK_THROWS_AS(load_scenario("/"), ScenarioError);
    }
    SECTION("a real file") {
        char tmpl[] = "/tmp/pvgpu-scenario-XXXXXX";
        int fd = ::mkstemp(tmpl);
        REQUIRE(fd >= 0);
        ::close(fd);
        {
            std::ofstream out(tmpl);
            out << kExample;
        }
        Scenario sc = load_scenario(tmpl);
        std::remove(tmpl);
        CHECK(sc.name == "example");
        CHECK(sc.tree.size() == 2);
    }
}
