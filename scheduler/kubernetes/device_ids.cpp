// Device IDs, preferred allocations and Allocate's one-GPU check (device_ids.hpp).
#include "device_ids.hpp"

#include <algorithm>
#include <charconv>
#include <cstdio>
#include <map>
#include <set>

namespace pvgpu::k8s {

namespace {

std::optional<unsigned> parse_number(std::string_view text) {
    unsigned v = 0;
    if (text.empty() || text.size() > 6) return std::nullopt;
    const auto [end, ec] = std::from_chars(text.data(), text.data() + text.size(), v);
    if (ec != std::errc{} || end != text.data() + text.size()) return std::nullopt;
    return v;
}

Unit parse_or_throw(const std::string& id) {
    const auto u = parse_device_id(id);
    if (!u) throw AllocationError{"unknown device ID '" + id + "' (pvgpu's are gpuG-uNNN)"};
    return *u;
}

// The free units per GPU, must_include's among them.
std::map<unsigned, std::set<unsigned>> free_by_gpu(const std::vector<std::string>& available,
                                                   const std::vector<Unit>& must) {
    std::map<unsigned, std::set<unsigned>> by_gpu;
    for (const auto& id : available) {
        const Unit u = parse_or_throw(id);
        by_gpu[u.gpu].insert(u.unit);
    }
    for (const Unit& u : must) by_gpu[u.gpu].insert(u.unit);
    return by_gpu;
}

// The GPU to take `size` units from: must_include's, else the one with the
// most free units that fits.
unsigned pick_gpu(const std::map<unsigned, std::set<unsigned>>& by_gpu, const std::vector<Unit>& must,
                  std::size_t size) {
    if (!must.empty()) {
        const unsigned gpu = must.front().gpu;
        for (const Unit& u : must)
            if (u.gpu != gpu)
                throw AllocationError{"must-include devices span GPUs " + std::to_string(gpu) + " and " +
                                      std::to_string(u.gpu) + "; units of one container come from one GPU"};
        const std::size_t free = by_gpu.at(gpu).size();
        if (free < size)
            throw AllocationError{"GPU " + std::to_string(gpu) + " of the must-include devices has " +
                                      std::to_string(free) + " free units, " + std::to_string(size) + " asked",
                                  true};
        return gpu;
    }
    std::optional<unsigned> best;
    std::size_t most = 0;
    for (const auto& [gpu, units] : by_gpu)
        if (units.size() >= size && units.size() > most) best = gpu, most = units.size();
    if (!best) {
        std::size_t top = 0;
        for (const auto& [gpu, units] : by_gpu) top = std::max(top, units.size());
        throw AllocationError{"no GPU has " + std::to_string(size) + " free units (the most free on one GPU: " +
                                  std::to_string(top) + "); units of one container come from one GPU",
                              true};
    }
    return *best;
}

}  // namespace

std::string device_id(Unit u) {
    char buf[32];
    std::snprintf(buf, sizeof buf, "gpu%u-u%03u", u.gpu, u.unit);
    return buf;
}

std::optional<Unit> parse_device_id(std::string_view id) {
    if (!id.starts_with("gpu")) return std::nullopt;
    id.remove_prefix(3);
    const auto dash = id.find("-u");
    if (dash == std::string_view::npos) return std::nullopt;
    const auto gpu = parse_number(id.substr(0, dash));
    const std::string_view unit_text = id.substr(dash + 2);
    const auto unit = parse_number(unit_text);
    if (!gpu || !unit || unit_text.size() != 3 || *unit >= kUnitsPerGpu) return std::nullopt;
    // One spelling per unit: "gpu01-u000" is not gpu1's.
    if (id.substr(0, dash).size() > 1 && id[0] == '0') return std::nullopt;
    return Unit{*gpu, *unit};
}

std::vector<std::string> all_device_ids(unsigned gpus) {
    std::vector<std::string> ids;
    ids.reserve(std::size_t{gpus} * kUnitsPerGpu);
    for (unsigned g = 0; g < gpus; ++g)
        for (unsigned u = 0; u < kUnitsPerGpu; ++u) ids.push_back(device_id({g, u}));
    return ids;
}

std::vector<std::string> preferred_allocation(const std::vector<std::string>& available,
                                              const std::vector<std::string>& must_include, int size) {
    if (size <= 0) throw AllocationError{"allocation size must be positive, got " + std::to_string(size)};
    std::vector<Unit> must;
    for (const auto& id : must_include) must.push_back(parse_or_throw(id));
    const auto by_gpu = free_by_gpu(available, must);
    const auto want = static_cast<std::size_t>(size);
    const unsigned gpu = pick_gpu(by_gpu, must, want);
    std::set<unsigned> chosen;
    std::vector<std::string> ids;
    for (const Unit& u : must)
        if (chosen.insert(u.unit).second) ids.push_back(device_id(u));
    for (unsigned unit : by_gpu.at(gpu)) {
        if (chosen.size() >= want) break;
        if (chosen.insert(unit).second) ids.push_back(device_id({gpu, unit}));
    }
    return ids;
}

Grant grant_for(const std::vector<std::string>& ids, unsigned gpus) {
    if (ids.empty()) throw AllocationError{"no devices in the container request"};
    std::set<Unit> seen;
    const Unit first = parse_or_throw(ids.front());
    for (const auto& id : ids) {
        const Unit u = parse_or_throw(id);
        if (u.gpu >= gpus)
            throw AllocationError{"device " + id + " is on GPU " + std::to_string(u.gpu) + ", but pvgpud has " +
                                  std::to_string(gpus) + " GPU(s)"};
        if (u.gpu != first.gpu)
            throw AllocationError{"units of one container must come from one GPU: " + ids.front() +
                                  " is on GPU " + std::to_string(first.gpu) + ", " + id + " on GPU " +
                                  std::to_string(u.gpu)};
        if (!seen.insert(u).second) throw AllocationError{"device " + id + " is requested twice"};
    }
    return {first.gpu, static_cast<unsigned>(seen.size())};
}

}  // namespace pvgpu::k8s
