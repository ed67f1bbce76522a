#include "report.hpp"

#include <cmath>
#include <cstdio>
#include <sstream>

namespace pvgpu::sim {

namespace {

// JSON has no infinity; an unbounded unfairness is reported as null.
nlohmann::json finite_or_null(double v) {
    return std::isfinite(v) ? nlohmann::json(v) : nlohmann::json(nullptr);
}

std::string fmt(const char* f, double v) {
    char buf[64];
    std::snprintf(buf, sizeof buf, f, v);
    return buf;
}

}  // namespace

nlohmann::json to_json(const SimResult& r) {
    nlohmann::json j;
    j["scenario"] = r.scenario;
    j["policy"] = r.policy;
    j["sim_time_ms"] = r.sim_time_ms;
    j["warmup_ms"] = r.warmup_ms;
    j["gpu"] = {{"arbitration", r.arbitration},
                {"busy_fraction", r.busy_fraction},
                {"idle_with_demand_fraction", r.idle_with_demand_fraction},
                {"context_switches", r.context_switches}};
    nlohmann::json ents = nlohmann::json::array();
    for (const auto& e : r.entities) {
        nlohmann::json je = {{"path", e.path},
                             {"weight", e.weight},
                             {"demand", e.demand},
                             {"target_share", e.target_share},
                             {"achieved_share", e.achieved_share},
                             {"share_error", e.share_error},
                             {"gpu_time_ms", to_ms(e.gpu_time)},
                             {"gpu_time_total_ms", to_ms(e.gpu_time_total)},
                             {"kernels_completed", e.kernels_completed},
                             {"finished_ms", e.finished_ms ? nlohmann::json(*e.finished_ms)
                                                           : nlohmann::json(nullptr)},
                             {"channel_errors", e.channel_errors}};
        je["accounted_ms"] = e.accounted ? nlohmann::json(to_ms(*e.accounted)) : nlohmann::json(nullptr);
        je["measured_ms"] = to_ms(e.measured);
        ents.push_back(std::move(je));
    }
    j["entities"] = std::move(ents);
    j["metrics"] = {{"max_share_error", r.fairness.max_share_error},
                    {"jain_index", r.fairness.jain_index},
                    {"unfairness", finite_or_null(r.fairness.unfairness)},
                    {"scheduler_cpu_us_per_s", r.scheduler_cpu_us_per_s},
                    {"policy_cpu_us_per_s", r.policy_cpu_us_per_s}};
    j["mechanisms"] = {{"traps", r.stats.traps},
                       {"remaps", r.stats.remaps},
                       {"polls", r.stats.polls},
                       {"accounting_reads", r.stats.accounting_reads},
                       {"register_reads", r.stats.register_reads},
                       {"fences", r.stats.fences},
                       {"channel_errors", r.stats.channel_errors},
                       {"released_entries", r.stats.released_entries},
                       {"held_reports", r.stats.held_reports},
                       {"preemptions", r.stats.preemptions},
                       {"policy_calls", r.stats.policy_calls}};
    j["policy_counters"] = r.policy_counters;
    j["events"] = r.events;
    return j;
}

std::string to_table(const SimResult& r) {
    std::ostringstream os;
    os << "scenario " << r.scenario << "  policy " << r.policy << "  gpu " << r.arbitration << "  "
       << r.sim_time_ms << " ms (warmup " << r.warmup_ms << " ms)\n\n";
    char line[256];
    std::snprintf(line, sizeof line, "%-28s %6s %8s %8s %8s %10s %9s %10s\n", "entity", "weight",
                  "target", "achieved", "error", "gpu_ms", "kernels", "finished");
    os << line;
    for (const auto& e : r.entities) {
        std::string fin = e.finished_ms ? fmt("%.1f", *e.finished_ms) : "-";
        std::snprintf(line, sizeof line, "%-28s %6u %8.4f %8.4f %8.4f %10.1f %9llu %10s\n",
                      e.path.c_str(), e.weight, e.target_share, e.achieved_share, e.share_error,
                      to_ms(e.gpu_time), static_cast<unsigned long long>(e.kernels_completed),
                      fin.c_str());
        os << line;
    }
    os << "\nmax share error " << fmt("%.4f", r.fairness.max_share_error) << "   jain "
       << fmt("%.4f", r.fairness.jain_index) << "   unfairness "
       << (std::isfinite(r.fairness.unfairness) ? fmt("%.3f", r.fairness.unfairness) : "inf") << '\n';
    os << "gpu busy " << fmt("%.4f", r.busy_fraction) << "   idle with work waiting "
       << fmt("%.4f", r.idle_with_demand_fraction) << "   scheduler cpu "
       << fmt("%.0f", r.scheduler_cpu_us_per_s) << " us/s\n";
    os << "traps " << r.stats.traps << "   remaps " << r.stats.remaps << "   polls " << r.stats.polls
       << "   preemptions " << r.stats.preemptions << '\n';
    return os.str();
}

std::string compare_table(const std::vector<SimResult>& runs) {
    std::ostringstream os;
    if (runs.empty()) return {};
    os << "scenario " << runs[0].scenario << "  gpu " << runs[0].arbitration << "  "
       << runs[0].sim_time_ms << " ms\n\n";
    char line[256];
    // Targets depend on when finite jobs finished, so they can differ per
    // policy; then each policy gets its own target column.
    bool same_targets = true;
    for (const auto& r : runs)
        for (std::size_t i = 0; i < r.entities.size(); ++i)
            same_targets = same_targets &&
                           std::abs(r.entities[i].target_share - runs[0].entities[i].target_share) < 1e-9;
    std::snprintf(line, sizeof line, "%-28s", "entity");
    os << line;
    if (same_targets) os << "   target";
    for (const auto& r : runs) {
        std::snprintf(line, sizeof line, same_targets ? " %10s" : " %10s %8s", r.policy.c_str(), "target");
        os << line;
    }
    os << '\n';
    for (std::size_t i = 0; i < runs[0].entities.size(); ++i) {
        std::snprintf(line, sizeof line, "%-28s", runs[0].entities[i].path.c_str());
        os << line;
        if (same_targets) os << fmt(" %8.4f", runs[0].entities[i].target_share);
        for (const auto& r : runs) {
            if (same_targets)
                std::snprintf(line, sizeof line, " %10.4f", r.entities[i].achieved_share);
            else
                std::snprintf(line, sizeof line, " %10.4f %8.4f", r.entities[i].achieved_share,
                              r.entities[i].target_share);
            os << line;
        }
        os << '\n';
    }
    auto row = [&](const char* name, auto get, const char* f) {
        std::snprintf(line, sizeof line, "%-*s", same_targets ? 37 : 28, name);
        os << line;
        for (const auto& r : runs) {
            double v = get(r);
            std::snprintf(line, sizeof line, " %10s%s", std::isfinite(v) ? fmt(f, v).c_str() : "inf",
                          same_targets ? "" : "         ");
            os << line;
        }
        os << '\n';
    };
    os << '\n';
    row("max share error", [](const SimResult& r) { return r.fairness.max_share_error; }, "%.4f");
    row("jain index", [](const SimResult& r) { return r.fairness.jain_index; }, "%.4f");
    row("unfairness", [](const SimResult& r) { return r.fairness.unfairness; }, "%.3f");
    row("gpu busy", [](const SimResult& r) { return r.busy_fraction; }, "%.4f");
    row("idle with work waiting", [](const SimResult& r) { return r.idle_with_demand_fraction; }, "%.4f");
    return os.str();
}

}  // namespace pvgpu::sim
