// The report of a run: JSON for scripts (DESIGN.md section 6), a table for people.
#pragma once

#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "simulation.hpp"

namespace pvgpu::sim {

nlohmann::json to_json(const SimResult& r);
std::string to_table(const SimResult& r);
// Several runs of one scenario side by side (e.g. none vs hfq).
std::string compare_table(const std::vector<SimResult>& runs);

}  // namespace pvgpu::sim
