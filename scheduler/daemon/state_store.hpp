// Persistent state in STATE_DIR/state.json: weights the admin set (by VM
// UUID, by VM name for VMs not seen yet, per guest task and per host task)
// and the policy chosen at run time.  Written atomically (temp file in the
// same directory, fsync, rename); a corrupt file is moved aside to
// state.json.corrupt and the daemon starts from defaults.
#pragma once

#include <cstdint>
#include <map>
#include <optional>
#include <string>
#include <vector>

#include "core/policy.hpp"

namespace pvgpu::daemon {

struct State {
    struct Vm {
        std::string name;  // for people reading the file
        std::uint32_t weight = PVGPU_WEIGHT_DEFAULT;
        bool operator==(const Vm&) const = default;
    };
    std::map<std::string, Vm> vms;                    // canonical lower-case UUID -> VM
    std::map<std::string, std::uint32_t> vm_names;    // weights set by name before HELLO
    std::map<std::string, std::uint32_t> tasks;       // "<uuid>/task-<hint>" -> weight
    // "host/<user>/<name>" -> weight.  Keys of one slash, "host/<name>", were
    // written before host tasks were grouped per user: such a weight goes
    // to the first user whose task takes that name, and is saved under the
    // new key (a task weight only splits its user's share, so whoever gets
    // it gains nothing over other users).
    std::map<std::string, std::uint32_t> host_tasks;
    std::map<std::string, std::uint32_t> host_users;  // "<user>" -> weight of host/<user>
    std::optional<std::string> policy;                // set at run time (set-policy), every GPU
    PolicyParams policy_params;
    // set-policy --gpu N: GPU N's own choice, over `policy`.
    struct GpuPolicy {
        std::string name;
        PolicyParams params;
        bool operator==(const GpuPolicy&) const = default;
    };
    std::map<std::uint32_t, GpuPolicy> gpu_policies;
    // Where each VM ("vm/<uuid>") and host user ("user/<name>") was placed,
    // by GPU index, one entry per device: a client that comes back without
    // naming a GPU lands where it was.
    std::map<std::string, std::vector<std::uint32_t>> placements;

    bool operator==(const State&) const = default;
};

// Throws std::runtime_error naming what is wrong.
State state_from_json(const std::string& text);
std::string state_to_json(const State& s);

class StateStore {
public:
    explicit StateStore(std::string dir) : dir_(std::move(dir)) {}

    const std::string& dir() const { return dir_; }
    std::string path() const { return dir_ + "/state.json"; }

    struct Loaded {
        State state;
        std::vector<std::string> warnings;  // the caller logs them
    };
    // Never throws: a missing file is an empty state, a corrupt one is moved
    // aside with a warning.
    Loaded load() const;
    // Creates the directory if needed.  Throws std::system_error.
    void save(const State& s) const;

private:
    std::string dir_;
};

}  // namespace pvgpu::daemon
