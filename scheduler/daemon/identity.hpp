// Who may act as whom on the client socket.  Credentials come from the
// kernel (SO_PEERCRED at connect), never from what a client says: a VMM
// role needs a configured uid, a host client's entity lives under its own
// user (host/USER/NAME), so it can neither pose as a VM nor take another
// user's saved weight.
#pragma once

#include <sys/socket.h>
#include <sys/types.h>

#include <optional>
#include <set>
#include <string>
#include <vector>

namespace pvgpu::daemon {

// Decides whether a peer may be the VMM of a VM.  The daemon always checks
// the configured VMM users first (VmmUsers); further checks plug in here,
// such as the libvirt integration's (issue 9), which will verify that
// `peer.pid` is the QEMU process of the domain with this UUID.
class VmmIdentityCheck {
public:
    virtual ~VmmIdentityCheck() = default;
    // nullopt when `peer` may act for VM `uuid`; otherwise why it may not
    // (sent to the client and logged).
    virtual std::optional<std::string> refuse(const ucred& peer, const std::string& uuid) const = 0;
};

// [daemon] vmm_users: user names or numeric uids.
class VmmUsers final : public VmmIdentityCheck {
public:
    // Names that have no passwd entry are left out and listed in `unknown`
    // (libvirt-qemu on a host without libvirt is normal, not an error).
    VmmUsers() = default;
    VmmUsers(const std::vector<std::string>& users, std::vector<std::string>* unknown);
    bool allows(uid_t uid) const { return uids_.count(uid) != 0; }
    std::optional<std::string> refuse(const ucred& peer, const std::string& uuid) const override;

private:
    std::set<uid_t> uids_;
    std::string shown_;  // "root, libvirt-qemu" for messages
};

// The user's name, or its number when it has no passwd entry.
std::string user_name(uid_t uid);
// The uid of a user name or a decimal uid; nullopt when neither.
std::optional<uid_t> user_id(const std::string& name_or_uid);

}  // namespace pvgpu::daemon
