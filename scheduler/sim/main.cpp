// pvgpu-sim: run scheduling scenarios on the simulated GPU in virtual time.
#include <cstdio>
#include <cstring>
#include <fstream>
#include <iostream>
#include <sstream>
#include <string>
#include <vector>

#include "report.hpp"
#include "scenario.hpp"
#include "simulation.hpp"

using namespace pvgpu;
using namespace pvgpu::sim;

namespace {

constexpr int kExitOk = 0;
constexpr int kExitFailure = 1;
constexpr int kExitUsage = 2;

const char* kUsage = R"(Usage: pvgpu-sim COMMAND [OPTIONS]

Simulate GPU sharing between VMs and tasks in virtual time, with the same
scheduling code the pvgpu daemon runs, and report how fair it was.

Commands:
  run SCENARIO.json        run one scenario, print a table (or --json)
  compare SCENARIO.json    run the scenario under several policies side by side
  check SCENARIO.json      validate a scenario file and exit
  policies                 list policies and their parameters

Options for run and compare:
  --json                   print the JSON report (compare: an array of reports)
  --policy NAME            override the scenario's policy (run)
  --policies A,B,...       policies to compare (compare; default none,hfq)
  --param KEY=VALUE        set a policy parameter (repeatable)
  --arbitration MODEL      round-robin or timeslice
  --timeslice-us N         GPU time slice for the timeslice model
  --seed N                 random seed
  --duration-ms N          simulated time
  --warmup-ms N            time before shares are measured
  --series FILE.csv        write per-entity shares over time (run)
  --series-interval-ms N   interval of the series (default 100)
  --trace FILE.csv         write every kernel run and every submission (run)

General:
  -h, --help               show this help
  --version                show the version

Exit status: 0 success, 1 the simulation failed, 2 bad usage or scenario.
)";

struct Args {
    std::string command, scenario, policy, series, trace;
    std::vector<std::string> policies{"none", "hfq"};
    bool policies_given = false;
    PolicyParams params;
    bool json = false;
    std::optional<std::string> arbitration;
    std::optional<double> timeslice_us, duration_ms, warmup_ms, series_interval_ms;
    std::optional<std::uint64_t> seed;
};

class UsageError : public std::runtime_error {
public:
    using std::runtime_error::runtime_error;
};

double number(const std::string& opt, const std::string& v) {
    try {
        std::size_t pos = 0;
        double d = std::stod(v, &pos);
        if (pos != v.size() || !(d >= 0)) throw std::invalid_argument(v);
        return d;
    } catch (const std::exception&) {
        throw UsageError(opt + ": expected a non-negative number, got '" + v + "'");
    }
}

Args parse_args(int argc, char** argv) {
    Args a;
    std::vector<std::string> pos;
    for (int i = 1; i < argc; ++i) {
        std::string s = argv[i];
        auto value = [&]() -> std::string {
            if (i + 1 >= argc) throw UsageError(s + " needs a value");
            return argv[++i];
        };
        if (s == "-h" || s == "--help") {
            std::fputs(kUsage, stdout);
            std::exit(kExitOk);
        } else if (s == "--version") {
            std::puts("pvgpu-sim " PVGPU_VERSION);
            std::exit(kExitOk);
        } else if (s == "--json") {
            a.json = true;
        } else if (s == "--policy") {
            a.policy = value();
        } else if (s == "--policies") {
            a.policies_given = true;
            a.policies.clear();
            std::stringstream ss(value());
            for (std::string p; std::getline(ss, p, ',');)
                if (!p.empty()) a.policies.push_back(p);
            if (a.policies.empty()) throw UsageError("--policies: empty list");
        } else if (s == "--param") {
            std::string kv = value();
            auto eq = kv.find('=');
            if (eq == std::string::npos || eq == 0) throw UsageError("--param: expected KEY=VALUE, got '" + kv + "'");
            a.params[kv.substr(0, eq)] = number("--param " + kv.substr(0, eq), kv.substr(eq + 1));
        } else if (s == "--arbitration") {
            a.arbitration = value();
        } else if (s == "--timeslice-us") {
            a.timeslice_us = number(s, value());
        } else if (s == "--seed") {
            std::string v = value();
            std::size_t used = 0;
            try {
                if (v.empty() || v[0] == '-') throw std::invalid_argument(v);
                a.seed = std::stoull(v, &used, 10);
            } catch (const std::exception&) {
                used = 0;
            }
            if (used == 0 || used != v.size()) throw UsageError("--seed: expected a whole number, got '" + v + "'");
        } else if (s == "--duration-ms") {
            a.duration_ms = number(s, value());
        } else if (s == "--warmup-ms") {
            a.warmup_ms = number(s, value());
        } else if (s == "--series") {
            a.series = value();
        } else if (s == "--trace") {
            a.trace = value();
        } else if (s == "--series-interval-ms") {
            a.series_interval_ms = number(s, value());
        } else if (s.size() > 1 && s[0] == '-') {
            throw UsageError("unknown option " + s);
        } else {
            pos.push_back(s);
        }
    }
    if (pos.empty()) throw UsageError("no command given");
    a.command = pos[0];
    // Options that belong to the other command are mistakes, not no-ops.
    if (a.command == "compare" && (!a.policy.empty() || !a.series.empty() || a.series_interval_ms || !a.trace.empty()))
        throw UsageError("compare takes --policies, not --policy, --series, --series-interval-ms or --trace");
    if (a.command != "compare" && a.policies_given)
        throw UsageError("--policies belongs to compare; run takes --policy");
    if (a.command == "policies") {
        if (pos.size() != 1) throw UsageError("policies takes no arguments");
    } else if (a.command == "run" || a.command == "compare" || a.command == "check") {
        if (pos.size() != 2) throw UsageError(a.command + " takes exactly one scenario file");
        a.scenario = pos[1];
    } else {
        throw UsageError("unknown command '" + a.command + "'");
    }
    return a;
}

// Command-line overrides go through the same validation as the file.
Scenario load_with_overrides(const Args& a, const std::string& policy) {
    Scenario sc = load_scenario(a.scenario);
    if (!policy.empty() && policy != sc.policy) {
        sc.policy = policy;
        sc.params.clear();
    }
    for (const auto& [k, v] : a.params) sc.params[k] = v;
    if (a.arbitration) {
        if (*a.arbitration == "round-robin")
            sc.gpu.arbitration = Arbitration::RoundRobin;
        else if (*a.arbitration == "timeslice")
            sc.gpu.arbitration = Arbitration::Timeslice;
        else
            throw UsageError("--arbitration: expected round-robin or timeslice, got '" + *a.arbitration + "'");
    }
    // The same limits as the scenario file: whole nanoseconds, at most 1e9 ms.
    constexpr double kMaxMs = 1e9;
    if (a.timeslice_us) {
        if (!(*a.timeslice_us >= 0.001 && *a.timeslice_us <= kMaxMs * 1000))
            throw UsageError("--timeslice-us must be between 0.001 and 1e12");
        sc.gpu.timeslice = from_us(*a.timeslice_us);
    }
    if (a.seed) sc.seed = *a.seed;
    if (a.duration_ms) sc.duration_ms = *a.duration_ms;
    if (a.warmup_ms) sc.warmup_ms = *a.warmup_ms;
    if (!(sc.duration_ms >= 0.001 && sc.duration_ms <= kMaxMs))
        throw UsageError("duration must be between 0.001 and 1e9 ms");
    if (!(sc.warmup_ms >= 0 && sc.warmup_ms < sc.duration_ms))
        throw UsageError("warmup must be shorter than the duration");
    try {
        make_policy(sc.policy, sc.params);  // validates name and parameters
    } catch (const std::invalid_argument& e) {
        throw UsageError(e.what());
    }
    for (const std::string& w : policy_warnings(sc.policy, sc.params))
        std::fprintf(stderr, "pvgpu-sim: warning: %s\n", w.c_str());
    return sc;
}

int list_policies() {
    for (const auto& p : policy_catalog()) {
        std::printf("%s\n    %s\n", p.name.c_str(), p.summary.c_str());
        for (const auto& [name, def, doc] : p.params) std::printf("    %-16s %-10g %s\n", name.c_str(), def, doc.c_str());
        std::printf("\n");
    }
    return kExitOk;
}

int run(const Args& a) {
    Scenario sc = load_with_overrides(a, a.policy);
    SimOptions opt;
    if (a.series_interval_ms) {
        if (!(*a.series_interval_ms >= 0.001 && *a.series_interval_ms <= sc.duration_ms))
            throw UsageError("--series-interval-ms must be between 0.001 and the duration");
        opt.series_interval_ms = *a.series_interval_ms;
    }
    std::ofstream series;  // opened only once everything is known to be valid
    if (!a.series.empty()) {
        series.open(a.series);
        if (!series) throw std::runtime_error("cannot write " + a.series + ": " + std::strerror(errno));
        opt.series = &series;
    }
    std::ofstream trace;
    if (!a.trace.empty()) {
        trace.open(a.trace);
        if (!trace) throw std::runtime_error("cannot write " + a.trace + ": " + std::strerror(errno));
        opt.trace = &trace;
    }
    SimResult r = run_simulation(sc, opt);
    if (a.json)
        std::cout << to_json(r).dump(2) << '\n';
    else
        std::cout << to_table(r);
    if (series.is_open() && !series.good()) throw std::runtime_error("writing " + a.series + " failed");
    if (trace.is_open() && !trace.good()) throw std::runtime_error("writing " + a.trace + " failed");
    return kExitOk;
}

int compare(const Args& a) {
    std::vector<SimResult> runs;
    for (const auto& p : a.policies) {
        // --param applies to the policies that have that parameter.
        Args one = a;
        one.params.clear();
        for (const auto& [k, v] : a.params) {
            bool known = false;
            for (const auto& info : policy_catalog())
                for (const auto& q : a.policies)
                    if (info.name == q)
                        for (const auto& [name, def, doc] : info.params) known = known || name == k;
            if (!known) throw UsageError("--param " + k + ": none of the compared policies has it");
        }
        for (const auto& info : policy_catalog())
            if (info.name == p)
                for (const auto& [k, v] : a.params)
                    for (const auto& [name, def, doc] : info.params)
                        if (name == k) one.params[k] = v;
        runs.push_back(run_simulation(load_with_overrides(one, p)));
    }
    if (a.json) {
        nlohmann::json arr = nlohmann::json::array();
        for (const auto& r : runs) arr.push_back(to_json(r));
        std::cout << arr.dump(2) << '\n';
    } else {
        std::cout << compare_table(runs);
    }
    return kExitOk;
}

}  // namespace

int main(int argc, char** argv) {
    try {
        Args a = parse_args(argc, argv);
        if (a.command == "policies") return list_policies();
        if (a.command == "check") {
            load_with_overrides(a, a.policy);
            std::printf("%s: ok\n", a.scenario.c_str());
            return kExitOk;
        }
        if (a.command == "compare") return compare(a);
        return run(a);
    } catch (const UsageError& e) {
        std::fprintf(stderr, "pvgpu-sim: %s\nTry 'pvgpu-sim --help'.\n", e.what());
        return kExitUsage;
    } catch (const ScenarioError& e) {
        std::fprintf(stderr, "pvgpu-sim: %s\n", e.what());
        return kExitUsage;
    } catch (const std::exception& e) {
        std::fprintf(stderr, "pvgpu-sim: %s\n", e.what());
        return kExitFailure;
    }
}
