#include "state_store.hpp"

#include <fcntl.h>
#include <glib.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <nlohmann/json.hpp>
#include <sstream>
#include <stdexcept>
#include <system_error>

#include <pvgpu/protocol.h>

#include "proto/atomic_file.hpp"
#include "proto/unique_fd.hpp"

namespace pvgpu::daemon {

using nlohmann::json;

namespace {

constexpr int kStateVersion = 1;

std::uint32_t weight_of(const json& v, const std::string& where) {
    if (!v.is_number_integer()) throw std::runtime_error(where + ": weight is not an integer");
    auto w = v.get<std::int64_t>();
    if (w < PVGPU_WEIGHT_MIN || w > PVGPU_WEIGHT_MAX)
        throw std::runtime_error(where + ": weight " + std::to_string(w) + " out of range");
    return static_cast<std::uint32_t>(w);
}

const json& object_at(const json& j, const char* key) {
    static const json empty = json::object();
    if (!j.contains(key)) return empty;
    const json& v = j.at(key);
    if (!v.is_object()) throw std::runtime_error(std::string(key) + " is not an object");
    return v;
}

std::map<std::string, std::uint32_t> weights_at(const json& j, const char* key) {
    std::map<std::string, std::uint32_t> out;
    for (const auto& [k, v] : object_at(j, key).items()) out[k] = weight_of(v, std::string(key) + "." + k);
    return out;
}

State::GpuPolicy policy_of(const json& p, const std::string& where) {
    if (!p.is_object() || !p.contains("name") || !p["name"].is_string())
        throw std::runtime_error(where + " needs a string name");
    State::GpuPolicy out;
    out.name = p["name"].get<std::string>();
    for (const auto& [k, v] : object_at(p, "params").items()) {
        if (!v.is_number()) throw std::runtime_error(where + ".params." + k + " is not a number");
        out.params[k] = v.get<double>();
    }
    return out;
}

std::uint32_t gpu_index(const std::string& key, const std::string& where) {
    std::uint32_t n = 0;
    for (char c : key) {
        if (c < '0' || c > '9' || n >= PVGPU_MAX_GPUS) throw std::runtime_error(where + ": '" + key + "' is not a GPU index");
        n = n * 10 + static_cast<std::uint32_t>(c - '0');
    }
    if (key.empty() || n >= PVGPU_MAX_GPUS) throw std::runtime_error(where + ": '" + key + "' is not a GPU index");
    return n;
}

[[noreturn]] void fail(const std::string& what) {
    throw std::system_error(errno, std::generic_category(), what);
}

}  // namespace

State state_from_json(const std::string& text) {
    json j;
    try {
        j = json::parse(text);
    } catch (const json::parse_error& e) {
        throw std::runtime_error(e.what());
    }
    if (!j.is_object()) throw std::runtime_error("not a JSON object");
    if (j.contains("version") && j["version"] != kStateVersion)
        throw std::runtime_error("unsupported version " + j["version"].dump());
    State s;
    for (const auto& [uuid, v] : object_at(j, "vms").items()) {
        if (!v.is_object()) throw std::runtime_error("vms." + uuid + " is not an object");
        State::Vm vm;
        if (v.contains("name")) {
            if (!v["name"].is_string()) throw std::runtime_error("vms." + uuid + ".name is not a string");
            vm.name = v["name"].get<std::string>();
        }
        if (v.contains("weight")) vm.weight = weight_of(v["weight"], "vms." + uuid);
        s.vms[uuid] = vm;
    }
    s.vm_names = weights_at(j, "vm_names");
    s.tasks = weights_at(j, "tasks");
    s.host_tasks = weights_at(j, "host_tasks");
    s.host_users = weights_at(j, "host_users");
    if (j.contains("policy")) {
        State::GpuPolicy p = policy_of(j["policy"], "policy");
        s.policy = p.name;
        s.policy_params = p.params;
    }
    for (const auto& [k, v] : object_at(j, "gpu_policies").items())
        s.gpu_policies[gpu_index(k, "gpu_policies")] = policy_of(v, "gpu_policies." + k);
    for (const auto& [k, v] : object_at(j, "placements").items()) {
        if (!v.is_array()) throw std::runtime_error("placements." + k + " is not an array");
        for (const auto& g : v) {
            if (!g.is_number_unsigned() || g.get<std::uint64_t>() >= PVGPU_MAX_GPUS)
                throw std::runtime_error("placements." + k + ": " + g.dump() + " is not a GPU index");
            s.placements[k].push_back(g.get<std::uint32_t>());
        }
    }
    return s;
}

std::string state_to_json(const State& s) {
    json j = json::object();
    j["version"] = kStateVersion;
    if (s.policy) j["policy"] = {{"name", *s.policy}, {"params", s.policy_params}};
    if (!s.gpu_policies.empty()) {
        json g = json::object();
        for (const auto& [n, p] : s.gpu_policies) g[std::to_string(n)] = {{"name", p.name}, {"params", p.params}};
        j["gpu_policies"] = g;
    }
    if (!s.placements.empty()) j["placements"] = s.placements;
    json vms = json::object();
    for (const auto& [uuid, vm] : s.vms) vms[uuid] = {{"name", vm.name}, {"weight", vm.weight}};
    j["vms"] = vms;
    j["vm_names"] = s.vm_names;
    j["tasks"] = s.tasks;
    j["host_tasks"] = s.host_tasks;
    j["host_users"] = s.host_users;
    return j.dump(2) + "\n";
}

StateStore::Loaded StateStore::load() const {
    Loaded out;
    const std::string p = path();
    std::ifstream in(p, std::ios::binary);
    if (!in) return out;  // first start
    std::ostringstream ss;
    ss << in.rdbuf();
    try {
        out.state = state_from_json(ss.str());
    } catch (const std::exception& e) {
        std::string aside = p + ".corrupt";
        std::string msg = p + " is corrupt (" + e.what() + "); starting with default weights";
        if (std::rename(p.c_str(), aside.c_str()) == 0)
            msg += ", the file was moved to " + aside;
        else
            msg += std::string(", and it could not be moved aside: ") + std::strerror(errno);
        out.warnings.push_back(msg);
        out.state = State{};
    }
    return out;
}

void StateStore::save(const State& s) const {
    if (g_mkdir_with_parents(dir_.c_str(), 0755) != 0) fail("cannot create " + dir_);
    write_file_atomically(path(), state_to_json(s));
    // The rename itself must survive a crash too.
    UniqueFd dirfd(::open(dir_.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC));
    if (dirfd) fsync(dirfd.get());
}

}  // namespace pvgpu::daemon
