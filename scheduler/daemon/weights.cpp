#include "weights.hpp"

#include "log.hpp"

namespace pvgpu::daemon {

std::uint32_t WeightBook::vm(const std::string& uuid, const std::string& hello_name, const std::string& name) const {
    // By UUID (the admin's or the domain's) wins over a weight set by name
    // before the VM ever connected.
    if (auto v = state_.vms.find(uuid); v != state_.vms.end()) return v->second.weight;
    for (const auto& n : {hello_name, name})
        if (auto w = state_.vm_names.find(n); !n.empty() && w != state_.vm_names.end()) return w->second;
    return PVGPU_WEIGHT_DEFAULT;
}

bool WeightBook::set_vm(const std::string& uuid, const std::string& name, std::uint32_t weight) {
    auto it = state_.vms.find(uuid);
    const bool fresh = it == state_.vms.end();
    const std::string keep = fresh || !name.empty() ? name : it->second.name;  // for people reading the file
    if (!fresh && it->second.weight == weight && it->second.name == keep) return false;
    const bool changed = fresh || it->second.weight != weight;
    state_.vms[uuid] = State::Vm{keep, weight};
    save_();
    return changed;
}

void WeightBook::set_vm_name(const std::string& name, std::uint32_t weight) {
    state_.vm_names[name] = weight;
    // Remembered VMs of that name follow, or their UUID entry would win.
    for (auto& [uuid, vm] : state_.vms)
        if (vm.name == name) vm.weight = weight;
    save_();
}

std::uint32_t WeightBook::vm_task(const std::string& uuid, const std::string& key,
                                  std::optional<std::uint32_t> guest) const {
    if (guest) return *guest;
    auto w = state_.tasks.find(uuid + "/" + key);
    return w == state_.tasks.end() ? PVGPU_WEIGHT_DEFAULT : w->second;
}

void WeightBook::set_vm_task(const std::string& uuid, const std::string& key, std::uint32_t weight) {
    state_.tasks[uuid + "/" + key] = weight;
    save_();
}

std::uint32_t WeightBook::host_user(const std::string& user) const {
    auto w = state_.host_users.find(user);
    return w == state_.host_users.end() ? PVGPU_WEIGHT_DEFAULT : w->second;
}

void WeightBook::set_host_user(const std::string& user, std::uint32_t weight) {
    state_.host_users[user] = weight;
    save_();
}

std::uint32_t WeightBook::host_task(const std::string& key, const std::string& name) {
    auto w = state_.host_tasks.find(key);
    if (w == state_.host_tasks.end()) {
        // A weight saved before host paths had a user: its name's first
        // taker gets it (see State::host_tasks), under the new key from now.
        if (auto legacy = state_.host_tasks.find("host/" + name); legacy != state_.host_tasks.end()) {
            w = state_.host_tasks.emplace(key, legacy->second).first;
            state_.host_tasks.erase(legacy);
            log_info("saved weight of host/", name, " now belongs to ", key);
            save_();
        }
    }
    return w == state_.host_tasks.end() ? PVGPU_WEIGHT_DEFAULT : w->second;
}

void WeightBook::set_host_task(const std::string& key, std::uint32_t weight) {
    state_.host_tasks[key] = weight;
    save_();
}

}  // namespace pvgpu::daemon
