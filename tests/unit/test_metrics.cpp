// The Prometheus textfile: exposition text, atomic writes, the exporter's
// interval, and the [metrics] configuration keys.
#include <catch2/catch.hpp>

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <chrono>
#include <filesystem>
#include <future>
#include <fstream>
#include <map>
#include <set>
#include <sstream>
#include <string>
#include <vector>

#include "daemon/config.hpp"
#include "daemon/metrics.hpp"
#include "proto/unique_fd.hpp"
#include "sim/event_loop.hpp"

using namespace pvgpu;
using namespace pvgpu::daemon;
using nlohmann::json;

namespace {

std::string slurp(const std::string& path) {
    std::ifstream in(path);
    std::ostringstream ss;
    ss << in.rdbuf();
    return ss.str();
}

struct TempDir {
    std::string path;
    TempDir() {
        char tmpl[] = "/tmp/pvgpu-metrics-XXXXXX";
        REQUIRE(::mkdtemp(tmpl) != nullptr);
        path = tmpl;
    }
    ~TempDir() { std::filesystem::remove_all(path); }
};

json sample_list() {
    return json::parse(R"({"ok":true,"policy":"none","accounting":true,"entities":[
      {"path":"vm1","kind":"vm","weight":100,"target_share":0.5,"achieved_share":0.4,
       "gpu_time_ms":2500.0,"kernels":30,"channels":2},
      {"path":"vm1/task-12","kind":"task","weight":300,"target_share":0.375,"achieved_share":0.3,
       "gpu_time_ms":2000.0,"kernels":10,"channels":1},
      {"path":"vm1/task-13","kind":"task","weight":100,"target_share":0.125,"achieved_share":0.1,
       "gpu_time_ms":500.0,"kernels":20,"channels":1},
      {"path":"host/re\"nder","kind":"host","weight":100,"target_share":0.5,"achieved_share":0.6,
       "gpu_time_ms":1500.5,"kernels":7,"channels":1}]})");
}

// One sample of the exposition text: name, labels, value.
struct Sample {
    std::string name;
    std::map<std::string, std::string> labels;
    std::string value;
};

// Parses the sample lines (labels unescaped); fails the test on a line that
// is not name{k="v",...} value.
std::vector<Sample> parse_samples(const std::string& text) {
    std::vector<Sample> out;
    std::istringstream in(text);
    std::string line;
    while (std::getline(in, line)) {
        if (line.empty() || line[0] == '#') continue;
        INFO(line);
        Sample s;
        std::size_t i = line.find_first_of("{ ");
        REQUIRE(i != std::string::npos);
        s.name = line.substr(0, i);
        if (line[i] == '{') {
            ++i;
            while (line.at(i) != '}') {
                const std::size_t eq = line.find("=\"", i);
                REQUIRE(eq != std::string::npos);
                const std::string key = line.substr(i, eq - i);
                std::string value;
                for (i = eq + 2; line.at(i) != '"'; ++i) {
                    if (line[i] == '\\') {
                        ++i;
                        value += line.at(i) == 'n' ? '\n' : line[i];
                    } else {
                        value += line[i];
                    }
                }
                ++i;
                if (line.at(i) == ',') ++i;
                CHECK(s.labels.emplace(key, value).second);  // no label twice
            }
            ++i;
        }
        REQUIRE(line.at(i) == ' ');
        s.value = line.substr(i + 1);
        out.push_back(std::move(s));
    }
    return out;
}

// The samples of `name` whose labels include all of `labels`.
std::vector<Sample> matching(const std::vector<Sample>& samples, const std::string& name,
                         const std::map<std::string, std::string>& labels = {}) {
    std::vector<Sample> out;
    for (const Sample& s : samples) {
        if (s.name != name) continue;
        bool match = true;
        for (const auto& [k, v] : labels) {
            const auto it = s.labels.find(k);
            match = match && it != s.labels.end() && it->second == v;
        }
        if (match) out.push_back(s);
    }
    return out;
}

// Admin protocol 4: two GPUs; vm1 has a task on each, vm2 is on gpu1 only.
json two_gpu_list() {
    const char* text = R"({"ok":true,"policy":"hfq","accounting":true,"window_s":2.0,"entities":[],"gpus":[
      {"index":0,"name":"gpu0","policy":"hfq","arbitration":"round-robin","busy_fraction":0.9,"vms":1,"entities":[
        {"path":"vm1","kind":"vm","weight":200,"target_share":1.0,"achieved_share":1.0,
         "gpu_time_ms":1000.0,"kernels":10,"channels":1,"gpu":0},
        {"path":"vm1/task-7","kind":"task","weight":100,"target_share":1.0,"achieved_share":1.0,
         "gpu_time_ms":1000.0,"kernels":10,"channels":1,"gpu":0}]},
      {"index":1,"name":"big","policy":"timeslice","arbitration":"timeslice","busy_fraction":0.5,"vms":2,
       "entities":[
        {"path":"vm1","kind":"vm","weight":200,"target_share":0.667,"achieved_share":0.6,
         "gpu_time_ms":3000.0,"kernels":30,"channels":1,"gpu":1},
        {"path":"vm2","kind":"vm","weight":100,"target_share":0.333,"achieved_share":0.4,
         "gpu_time_ms":2000.0,"kernels":20,"channels":1,"gpu":1}]}]})";
    // The top-level "entities": every GPU's, each with its "gpu".
    json list = json::parse(text);
    for (const json& g : list["gpus"])
        for (const json& e : g["entities"]) list["entities"].push_back(e);
    return list;
}

json two_gpu_stats() {
    return json::parse(R"({"ok":true,"uptime_s":3.0,"policy":"hfq","clients":3,"channels":3,
      "process_cpu_s":0.5,"scheduler_cpu_s":0.04,
      "gpu":{"busy_fraction":0.9,"idle_with_demand_fraction":0.0},
      "metrics":{"max_share_error":0.0,"jain_index":1.0,"unfairness":1.0},
      "counters":{"traps":1,"mode_switches":2,"watchdog_kills":0,"protocol_errors":0,"bad_entry_kills":0},
      "gpus":[
        {"index":0,"name":"gpu0","policy":"hfq","arbitration":"round-robin","busy_fraction":0.9,"busy_s":2.5,
         "idle_with_demand_fraction":0.0,"context_switches":40,"channels":1,"vms":1,"scheduler_cpu_s":0.01,
         "metrics":{"max_share_error":0.0,"jain_index":1.0,"unfairness":1.0,"scheduler_cpu_us_per_s":3.0}},
        {"index":1,"name":"big","policy":"timeslice","arbitration":"timeslice","busy_fraction":0.5,"busy_s":1.5,
         "idle_with_demand_fraction":0.25,"context_switches":70,"channels":2,"vms":2,"scheduler_cpu_s":0.03,
         "metrics":{"max_share_error":0.067,"jain_index":0.97,"unfairness":1.33,"scheduler_cpu_us_per_s":9.0}}]})");
}

json sample_stats() {
    return json::parse(R"({"ok":true,"uptime_s":12.5,"policy":"none","clients":2,"channels":3,
      "process_cpu_s":0.25,"scheduler_cpu_s":0.03,
      "gpu":{"busy_fraction":0.99,"idle_with_demand_fraction":0.0},
      "metrics":{"max_share_error":0.1,"jain_index":0.95,"unfairness":2.0},
      "counters":{"traps":5,"mode_switches":6,"watchdog_kills":1,"protocol_errors":2,"bad_entry_kills":0}})");
}

}  // namespace

TEST_CASE("metrics: exposition text with Prometheus names and labels", "[daemon][metrics]") {
    const std::string text = render_prometheus(sample_list(), sample_stats());
    INFO(text);
    CHECK(text.find("# TYPE pvgpu_entity_gpu_seconds_total counter\n") != std::string::npos);
    CHECK(text.find("pvgpu_entity_gpu_seconds_total{kind=\"task\",vm=\"vm1\",task=\"task-12\",gpu=\"0\"} 2\n") !=
          std::string::npos);
    CHECK(text.find("pvgpu_entity_gpu_seconds_total{kind=\"host\",vm=\"\",task=\"re\\\"nder\",gpu=\"0\"} 1.5005\n") !=
          std::string::npos);
    // Counters only on leaves: a VM with tasks would be counted twice by sum().
    CHECK(text.find("pvgpu_entity_gpu_seconds_total{kind=\"vm\"") == std::string::npos);
    CHECK(text.find("pvgpu_entity_kernels_total{kind=\"task\",vm=\"vm1\",task=\"task-13\",gpu=\"0\"} 20\n") !=
          std::string::npos);
    // Gauges on every entity.
    CHECK(text.find("pvgpu_entity_weight{kind=\"vm\",vm=\"vm1\",task=\"\",gpu=\"0\"} 100\n") != std::string::npos);
    CHECK(text.find("pvgpu_entity_target_share{kind=\"task\",vm=\"vm1\",task=\"task-12\",gpu=\"0\"} 0.375\n") !=
          std::string::npos);
    CHECK(text.find("pvgpu_policy_info{policy=\"none\",gpu=\"0\"} 1\n") != std::string::npos);
    CHECK(text.find("pvgpu_jain_index{gpu=\"0\"} 0.95\n") != std::string::npos);
    CHECK(text.find("pvgpu_daemon_cpu_seconds_total 0.25\n") != std::string::npos);
    CHECK(text.find("pvgpu_scheduler_cpu_seconds_total{gpu=\"0\"} 0.03\n") != std::string::npos);
    CHECK(text.find("pvgpu_watchdog_kills_total 1\n") != std::string::npos);
    CHECK(text.find("pvgpu_protocol_errors_total 2\n") != std::string::npos);
    CHECK(text.find("pvgpu_mode_switches_total 6\n") != std::string::npos);
    CHECK(text.find("pvgpu_traps_total 5\n") != std::string::npos);
    // An older reply without "gpus" is one GPU: gpu="0" on every per-GPU series.
    CHECK(text.find("pvgpu_gpu_busy_ratio{gpu=\"0\"} 0.99\n") != std::string::npos);
    CHECK(text.find("pvgpu_channels{gpu=\"0\"} 3\n") != std::string::npos);
    CHECK(text.find("pvgpu_gpu_info{gpu=\"0\",name=\"gpu0\",arbitration=\"unknown\"} 1\n") != std::string::npos);
    CHECK(text.find("pvgpu_clients 2\n") != std::string::npos);  // not per GPU
    // Every sample line belongs to a family declared before it.
    std::istringstream in(text);
    std::string line, family;
    while (std::getline(in, line)) {
        if (line.rfind("# TYPE ", 0) == 0) family = line.substr(7, line.find(' ', 7) - 7);
        if (line.empty() || line[0] == '#') continue;
        INFO(line);
        CHECK(line.rfind(family, 0) == 0);
    }
}

TEST_CASE("metrics: two GPUs, a gpu label on every per-GPU and per-entity series", "[daemon][metrics]") {
    const std::string text = render_prometheus(two_gpu_list(), two_gpu_stats());
    INFO(text);
    const std::vector<Sample> samples = parse_samples(text);
    // Global series have no gpu label; everything else has one.
    const std::set<std::string> global = {"pvgpu_uptime_seconds", "pvgpu_clients", "pvgpu_daemon_cpu_seconds_total",
                                          "pvgpu_mode_switches_total", "pvgpu_traps_total",
                                          "pvgpu_watchdog_kills_total", "pvgpu_bad_entry_kills_total",
                                          "pvgpu_protocol_errors_total"};
    for (const Sample& s : samples) {
        INFO(s.name);
        CHECK(s.labels.count("gpu") == (global.count(s.name) ? 0u : 1u));
    }
    // vm1 is on both GPUs: a leaf on gpu1, a parent (no counters) on gpu0.
    auto one = [&](const std::string& name, const std::map<std::string, std::string>& labels) {
        const auto found = matching(samples, name, labels);
        INFO(name);
        REQUIRE(found.size() == 1);
        return found[0].value;
    };
    CHECK(one("pvgpu_entity_gpu_seconds_total", {{"vm", "vm1"}, {"task", ""}, {"gpu", "1"}}) == "3");
    CHECK(matching(samples, "pvgpu_entity_gpu_seconds_total", {{"vm", "vm1"}, {"task", ""}, {"gpu", "0"}}).empty());
    CHECK(one("pvgpu_entity_gpu_seconds_total", {{"vm", "vm1"}, {"task", "task-7"}, {"gpu", "0"}}) == "1");
    CHECK(one("pvgpu_entity_kernels_total", {{"vm", "vm2"}, {"gpu", "1"}}) == "20");
    CHECK(one("pvgpu_entity_weight", {{"vm", "vm1"}, {"kind", "vm"}, {"gpu", "0"}}) == "200");
    CHECK(one("pvgpu_entity_weight", {{"vm", "vm1"}, {"kind", "vm"}, {"gpu", "1"}}) == "200");
    CHECK(matching(samples, "pvgpu_entity_achieved_share").size() == 4);
    // Per-GPU series, once per GPU.
    CHECK(one("pvgpu_gpu_info", {{"gpu", "1"}, {"name", "big"}, {"arbitration", "timeslice"}}) == "1");
    CHECK(one("pvgpu_gpu_info", {{"gpu", "0"}, {"name", "gpu0"}, {"arbitration", "round-robin"}}) == "1");
    CHECK(one("pvgpu_policy_info", {{"gpu", "0"}, {"policy", "hfq"}}) == "1");
    CHECK(one("pvgpu_policy_info", {{"gpu", "1"}, {"policy", "timeslice"}}) == "1");
    CHECK(matching(samples, "pvgpu_policy_info").size() == 2);
    CHECK(one("pvgpu_gpu_busy_ratio", {{"gpu", "1"}}) == "0.5");
    CHECK(one("pvgpu_gpu_busy_seconds_total", {{"gpu", "0"}}) == "2.5");
    CHECK(one("pvgpu_gpu_idle_with_demand_ratio", {{"gpu", "1"}}) == "0.25");
    CHECK(one("pvgpu_gpu_context_switches_total", {{"gpu", "1"}}) == "70");
    CHECK(one("pvgpu_channels", {{"gpu", "1"}}) == "2");
    CHECK(one("pvgpu_gpu_vms", {{"gpu", "1"}}) == "2");
    CHECK(one("pvgpu_max_share_error", {{"gpu", "1"}}) == "0.067");
    CHECK(one("pvgpu_jain_index", {{"gpu", "1"}}) == "0.97");
    CHECK(one("pvgpu_jain_index", {{"gpu", "0"}}) == "1");
    CHECK(one("pvgpu_unfairness", {{"gpu", "1"}}) == "1.33");
    CHECK(one("pvgpu_scheduler_cpu_seconds_total", {{"gpu", "1"}}) == "0.03");
    CHECK(one("pvgpu_clients", {}) == "3");
    // One HELP and TYPE per family, before all of its samples.
    std::set<std::string> declared;
    std::istringstream in(text);
    std::string line, family;
    while (std::getline(in, line)) {
        if (line.rfind("# TYPE ", 0) == 0) {
            family = line.substr(7, line.find(' ', 7) - 7);
            INFO(family);
            CHECK(declared.insert(family).second);
        }
        if (line.empty() || line[0] == '#') continue;
        INFO(line);
        CHECK(line.rfind(family + (line[family.size()] == '{' ? "{" : " "), 0) == 0);
    }
}

TEST_CASE("metrics: the old-style reply parses with the same parser", "[daemon][metrics]") {
    const std::vector<Sample> samples = parse_samples(render_prometheus(sample_list(), sample_stats()));
    const auto host = matching(samples, "pvgpu_entity_gpu_seconds_total", {{"kind", "host"}});
    REQUIRE(host.size() == 1);
    CHECK(host[0].labels.at("task") == "re\"nder");
    CHECK(host[0].labels.at("gpu") == "0");
    CHECK(matching(samples, "pvgpu_gpu_busy_ratio", {{"gpu", "0"}}).size() == 1);
    CHECK(matching(samples, "pvgpu_policy_info", {{"gpu", "0"}, {"policy", "none"}}).size() == 1);
}

TEST_CASE("metrics: missing fields of an older reply are left out, not invented", "[daemon][metrics]") {
    json list = sample_list();
    for (json& e : list["entities"]) e.erase("kernels");
    json stats = sample_stats();
    stats.erase("process_cpu_s");
    stats.erase("scheduler_cpu_s");
    const std::string text = render_prometheus(list, stats);
    CHECK(text.find("pvgpu_entity_kernels_total{") == std::string::npos);
    CHECK(text.find("pvgpu_daemon_cpu_seconds_total") == std::string::npos);
    CHECK(text.find("pvgpu_scheduler_cpu_seconds_total") == std::string::npos);
}

TEST_CASE("metrics: the textfile is replaced atomically and removed at exit", "[daemon][metrics]") {
    TempDir dir;
    const std::string path = dir.path + "/pvgpu.prom";
    write_file_atomically(path, "a 1\n");
    CHECK(slurp(path) == "a 1\n");
    struct stat st{};
    REQUIRE(::stat(path.c_str(), &st) == 0);
    CHECK((st.st_mode & 0777) == 0644);
    CHECK_FALSE(std::filesystem::exists(path + ".tmp"));
    CHECK_THROWS_WITH(write_file_atomically(dir.path + "/missing/x.prom", "b"),
                      Catch::Contains("missing/") && Catch::Contains("No such file"));

    sim::EventLoop loop;
    int renders = 0;
    {
        TextfileExporter exporter(path, 15 * kSecond, loop, loop, [&] {
            ++renders;
            return "pvgpu_test " + std::to_string(renders) + "\n";
        });
        CHECK(slurp(path) == "pvgpu_test 1\n");  // written at once, not after the first interval
        loop.run_until(14 * kSecond);
        CHECK(renders == 1);
        loop.run_until(31 * kSecond);
        CHECK(renders == 3);
        CHECK(slurp(path) == "pvgpu_test 3\n");
    }
    CHECK_FALSE(std::filesystem::exists(path));
}

// A textfile directory is often writable by others (a shared collector
// directory): what they plant there must not block pvgpud's one thread nor be
// written through.
TEST_CASE("metrics: a FIFO or symlink planted in the directory neither blocks nor is followed",
          "[daemon][metrics]") {
    TempDir dir;
    const std::string path = dir.path + "/pvgpu.prom";
    // At the temporary names a writer would pick: the fixed one earlier
    // versions used, and the same with a dot in front.
    for (const std::string& name : {path + ".tmp", dir.path + "/.pvgpu.prom.tmp"})
        REQUIRE(::mkfifo(name.c_str(), 0666) == 0);
    const std::string victim = dir.path + "/victim";
    {
        std::ofstream(victim) << "keep\n";
    }
    REQUIRE(::symlink(victim.c_str(), (dir.path + "/pvgpu.prom.tmp2").c_str()) == 0);
    // Opening a FIFO for writing blocks until a reader comes: run the write
    // on another thread and give it the time a local file write takes many
    // times over; on failure, a reader set it free so the test ends.
    auto done = std::async(std::launch::async, [&] { write_file_atomically(path, "a 1\n"); });
    const bool finished = done.wait_for(std::chrono::seconds(5)) == std::future_status::ready;
    if (!finished) {
        // Readers stay open until the writer is done (no SIGPIPE).
        std::vector<UniqueFd> readers;
        for (const std::string& name : {path + ".tmp", dir.path + "/.pvgpu.prom.tmp"})
            readers.emplace_back(::open(name.c_str(), O_RDONLY | O_NONBLOCK | O_CLOEXEC));
        done.wait();
    }
    REQUIRE(finished);
    done.get();
    CHECK(slurp(path) == "a 1\n");
    CHECK(slurp(victim) == "keep\n");
    // Nothing but the planted names and the file itself is left behind.
    std::set<std::string> names;
    for (const auto& e : std::filesystem::directory_iterator(dir.path)) names.insert(e.path().filename());
    CHECK(names == std::set<std::string>{"pvgpu.prom", "pvgpu.prom.tmp", ".pvgpu.prom.tmp", "pvgpu.prom.tmp2",
                                         "victim"});
}

// The shipped unit runs pvgpud with UMask=0077; node_exporter runs as
// another user and must still read the file.
TEST_CASE("metrics: the textfile is world-readable whatever the umask", "[daemon][metrics]") {
    TempDir dir;
    const std::string path = dir.path + "/pvgpu.prom";
    const mode_t old = ::umask(077);
    try {
        write_file_atomically(path, "a 1\n");
    } catch (...) {
        ::umask(old);
        throw;
    }
    ::umask(old);
    struct stat st{};
    REQUIRE(::stat(path.c_str(), &st) == 0);
    CHECK((st.st_mode & 0777) == 0644);
}

TEST_CASE("config: [metrics] textfile and interval", "[daemon][config][metrics]") {
    Config def = parse_config("", "t.conf");
    CHECK(def.metrics.textfile.empty());
    CHECK(def.metrics.interval == 15 * kSecond);
    Config c = parse_config("[metrics]\ntextfile = /var/lib/node_exporter/pvgpu.prom\ninterval_s = 5\n", "t.conf");
    CHECK(c.metrics.textfile == "/var/lib/node_exporter/pvgpu.prom");
    CHECK(c.metrics.interval == 5 * kSecond);
    CHECK_THROWS_WITH(parse_config("[metrics]\ntextfile = pvgpu.prom\n", "t.conf"),
                      Catch::Contains("t.conf:2: [metrics] textfile") && Catch::Contains("absolute"));
    CHECK_THROWS_WITH(parse_config("[metrics]\ntextfile = /tmp/pvgpu.txt\n", "t.conf"),
                      Catch::Contains(".prom"));
    CHECK_THROWS_WITH(parse_config("[metrics]\ninterval_s = 0\n", "t.conf"), Catch::Contains("interval_s"));
    CHECK_THROWS_WITH(parse_config("[metrics]\nlisten = 1\n", "t.conf"), Catch::Contains("unknown key"));
}
