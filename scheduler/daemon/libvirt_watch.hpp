// pvgpud follows libvirt: which domains run, their GPU weight and GPU (the
// <pvgpu:gpu weight="N" device="G"/> metadata element) and the pid of their QEMU, so a
// VMM's HELLO can be checked against it.  The connection is driven by the
// daemon's own GLib main context (libvirt's event API implemented on it):
// lifecycle and METADATA_CHANGE events arrive as main-loop callbacks, a
// lost libvirtd is reconnected with backoff and everything resynchronised,
// and an absent libvirtd costs one failed connect per backoff period.
#pragma once

#include <glib.h>
#include <sys/types.h>

#include <cstdint>
#include <map>
#include <memory>
#include <optional>
#include <set>
#include <string>
#include <vector>

#include "config.hpp"
#include "gsource.hpp"
#include "identity.hpp"
#include "log.hpp"

namespace pvgpu::daemon {

// What pvgpud knows of a running domain that has pvgpu.
struct DomainInfo {
    std::string uuid;
    std::string name;
    std::uint32_t weight = 0;      // from the metadata, else the default
    std::optional<std::uint32_t> gpu;  // the metadata's device="N" (0..15); nullopt: pvgpud places it
    std::string metadata_error;    // non-empty: the metadata was invalid
    pid_t pid = 0;                 // its QEMU, from libvirt's pid file; 0 unknown
};

class LibvirtWatch {
public:
    class Listener {
    public:
        virtual ~Listener() = default;
        // A domain with pvgpu runs (started, found at a resync, or its
        // metadata changed).
        virtual void domain_up(const DomainInfo& d) = 0;
        // A domain stopped (or is no longer found at a resync).
        virtual void domain_down(const std::string& uuid, const std::string& name) = 0;
    };

    // Connects at once (and again after any loss, with backoff).
    LibvirtWatch(GMainContext* ctx, LibvirtConfig cfg, Listener& listener);
    ~LibvirtWatch();
    LibvirtWatch(const LibvirtWatch&) = delete;
    LibvirtWatch& operator=(const LibvirtWatch&) = delete;

    bool connected() const;
    // The running domain of that UUID: from the cache, else asked of libvirt
    // now (a QEMU says HELLO before libvirt's STARTED event).  nullopt: not a
    // running libvirt domain, or libvirt is not reachable.
    std::optional<DomainInfo> domain(const std::string& uuid);
    // An admin's weight for `target` (a VM name or UUID): when it is a
    // libvirt domain with pvgpu, written into its metadata (which then is
    // the weight's source) and its UUID returned; nullopt when it is none,
    // or libvirt is not reachable.  Throws std::runtime_error when libvirt
    // refuses the write.
    std::optional<std::string> set_weight(const std::string& target, std::uint32_t weight);

private:
    struct Impl;
    std::unique_ptr<Impl> impl_;
};

// The daemon's VMM identity hook for libvirt domains: a HELLO for the UUID of
// a running domain is refused unless its peer is the pid libvirt recorded
// for that domain's QEMU.  VMs that are not libvirt domains pass.
class LibvirtIdentity final : public VmmIdentityCheck {
public:
    explicit LibvirtIdentity(LibvirtWatch& watch) : watch_(&watch) {}
    std::optional<std::string> refuse(const ucred& peer, const std::string& uuid) const override;

private:
    LibvirtWatch* watch_;
};

}  // namespace pvgpu::daemon
