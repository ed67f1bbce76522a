// Where an entity's weight comes from, decided here and nowhere else.
//
//   VM          its libvirt domain's <pvgpu:gpu weight=...> metadata when it
//               is one (pvgpud writes what an admin sets there, and applies
//               what libvirt says changed); otherwise the admin's weight for
//               its UUID; otherwise one set for its name before it ever
//               connected; otherwise the default.  A VM with devices on
//               several GPUs has this weight on each.
//   VM task     what the guest asked for that pid hint on this connection
//               (TASK_WEIGHT: it only splits the VM's own share); otherwise
//               the admin's; otherwise the default.  The latest word wins: an
//               admin's weight for the task drops the guest's request.
//   host user   the admin's weight for the user; otherwise the default.
//   host task   the admin's weight for host/<user>/<name>; otherwise one
//               saved before host tasks had users (host/<name>, taken over
//               by the first such task); otherwise the default.
//
// Everything an admin or libvirt sets is kept in state.json (State), so it
// survives a restart of pvgpud, of the VM, and of libvirtd.
#pragma once

#include <cstdint>
#include <functional>
#include <map>
#include <optional>
#include <string>

#include "state_store.hpp"

namespace pvgpu::daemon {

class WeightBook {
public:
    // `state` holds the saved weights; `save` writes it out after a change.
    WeightBook(State& state, std::function<void()> save) : state_(state), save_(std::move(save)) {}

    std::uint32_t vm(const std::string& uuid, const std::string& hello_name, const std::string& name) const;
    // The VM's own weight, from the admin or its domain's metadata.  Returns
    // whether it changed.
    bool set_vm(const std::string& uuid, const std::string& name, std::uint32_t weight);
    // For a VM not connected, by the name it will give.
    void set_vm_name(const std::string& name, std::uint32_t weight);

    // `guest`: the guest's request for the task, if it made one.
    std::uint32_t vm_task(const std::string& uuid, const std::string& key, std::optional<std::uint32_t> guest) const;
    void set_vm_task(const std::string& uuid, const std::string& key, std::uint32_t weight);

    std::uint32_t host_user(const std::string& user) const;
    void set_host_user(const std::string& user, std::uint32_t weight);
    // `key` is host/<user>/<name>; a legacy host/<name> weight moves to it.
    std::uint32_t host_task(const std::string& key, const std::string& name);
    void set_host_task(const std::string& key, std::uint32_t weight);

private:
    State& state_;
    std::function<void()> save_;
};

}  // namespace pvgpu::daemon
