// The Prometheus textfile: exposition text, atomic writes, the exporter's
// interval, and the [metrics] configuration keys.
#include <catch2/catch.hpp>

#include <sys/stat.h>
#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <sstream>
#include <string>

#include "daemon/config.hpp"
#include "daemon/metrics.hpp"
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
    CHECK(text.find("pvgpu_entity_gpu_seconds_total{kind=\"task\",vm=\"vm1\",task=\"task-12\"} 2\n") !=
          std::string::npos);
    CHECK(text.find("pvgpu_entity_gpu_seconds_total{kind=\"host\",vm=\"\",task=\"re\\\"nder\"} 1.5005\n") !=
          std::string::npos);
    // Counters only on leaves: a VM with tasks would be counted twice by sum().
    CHECK(text.find("pvgpu_entity_gpu_seconds_total{kind=\"vm\"") == std::string::npos);
    CHECK(text.find("pvgpu_entity_kernels_total{kind=\"task\",vm=\"vm1\",task=\"task-13\"} 20\n") !=
          std::string::npos);
    // Gauges on every entity.
    CHECK(text.find("pvgpu_entity_weight{kind=\"vm\",vm=\"vm1\",task=\"\"} 100\n") != std::string::npos);
    CHECK(text.find("pvgpu_entity_target_share{kind=\"task\",vm=\"vm1\",task=\"task-12\"} 0.375\n") !=
          std::string::npos);
    CHECK(text.find("pvgpu_policy_info{policy=\"none\"} 1\n") != std::string::npos);
    CHECK(text.find("pvgpu_jain_index 0.95\n") != std::string::npos);
    CHECK(text.find("pvgpu_daemon_cpu_seconds_total 0.25\n") != std::string::npos);
    CHECK(text.find("pvgpu_scheduler_cpu_seconds_total 0.03\n") != std::string::npos);
    CHECK(text.find("pvgpu_watchdog_kills_total 1\n") != std::string::npos);
    CHECK(text.find("pvgpu_protocol_errors_total 2\n") != std::string::npos);
    CHECK(text.find("pvgpu_mode_switches_total 6\n") != std::string::npos);
    CHECK(text.find("pvgpu_traps_total 5\n") != std::string::npos);
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
                      Catch::Contains("missing/x.prom.tmp") && Catch::Contains("No such file"));

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
