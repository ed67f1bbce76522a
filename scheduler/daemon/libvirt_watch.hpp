// pvgpud follows libvirt: which domains run, their GPU weight and GPU (the
// <pvgpu:gpu weight="N" device="G"/> metadata element) and the pid of their QEMU, so a
// VMM's HELLO can be checked against it.
//
// No libvirt call runs on pvgpud's scheduling thread (issue 51 item 2): a
// libvirtd that is silent, slow or gone must not stall doorbells, mode
// switches or admins.  Every call (connect, resync, lookups, metadata
// writes) runs on a worker thread owned by the watch, one at a time from a
// queue; results come back to the main loop as callbacks.  libvirt's own
// event loop (domain events, keepalive, lost connections) runs on a second,
// process-wide thread.  Callers on the loop get an answer within
// kLibvirtCallTimeout whatever libvirt does: a call that does not return by
// then is answered "unreachable" (its result, should it come later, still
// updates what pvgpud knows).  Lost connections are retried with backoff.
#pragma once

#include <glib.h>
#include <sys/types.h>

#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <set>
#include <string>
#include <vector>

#include "config.hpp"
#include "core/time.hpp"
#include "gsource.hpp"
#include "log.hpp"

namespace pvgpu::daemon {

// How long the loop waits for one libvirt request (a lookup is three local
// RPCs, a metadata write two; an idle libvirtd answers each in well under a
// millisecond): past it the caller is answered "unreachable".
inline constexpr Duration kLibvirtCallTimeout = 1 * kSecond;

// What pvgpud knows of a running domain that has pvgpu.
struct DomainInfo {
    std::string uuid;
    std::string name;
    std::uint32_t weight = 0;      // from the metadata, else the default
    std::optional<std::uint32_t> gpu;  // the metadata's device="N" (0..15); nullopt: pvgpud places it
    std::string metadata_error;    // non-empty: the metadata was invalid
    pid_t pid = 0;                 // its QEMU, from libvirt's pid file; 0 unknown
};

// libvirt's answer about one UUID.
struct DomainAnswer {
    enum class Kind {
        Running,      // a running domain with pvgpu: `info`
        Stopped,      // a defined domain with pvgpu that does not run: `info` (name, uuid)
        None,         // no domain with pvgpu has this UUID
        Unreachable,  // libvirt did not answer (`why`)
    };
    Kind kind = Kind::Unreachable;
    DomainInfo info;
    std::string why;
};

// The result of writing a weight into a domain's metadata.
struct WeightWrite {
    enum class Kind { Written, NotDomain, Failed, Unreachable };
    Kind kind = Kind::Unreachable;
    std::string uuid;  // Written: the domain's
    std::string why;   // Failed, Unreachable
};

class LibvirtWatch {
public:
    class Listener {
    public:
        virtual ~Listener() = default;
        // A domain with pvgpu runs (started, found at a resync or a lookup,
        // or its metadata changed).
        virtual void domain_up(const DomainInfo& d) = 0;
        // A domain stopped (or is no longer found at a resync).
        virtual void domain_down(const std::string& uuid, const std::string& name) = 0;
        // A defined domain with pvgpu does not run (found so at a resync or
        // a lookup): nobody may be its VMM now.
        virtual void domain_not_running(const std::string& uuid, const std::string& name) = 0;
    };

    // Starts the worker, which connects at once (and again after any loss,
    // with backoff).  Returns without waiting for libvirt.
    LibvirtWatch(GMainContext* ctx, LibvirtConfig cfg, Listener& listener);
    // Stops the worker; one stuck inside a libvirt call (which libvirt
    // cannot cancel) is waited for briefly, then left to the process' exit.
    ~LibvirtWatch();
    LibvirtWatch(const LibvirtWatch&) = delete;
    LibvirtWatch& operator=(const LibvirtWatch&) = delete;

    // Connected and answering (as far as the loop knows).
    bool connected() const;
    // libvirt has named `uuid` a domain with pvgpu since pvgpud started.
    bool knows(const std::string& uuid) const;
    // What libvirt says of `uuid`, on the loop: at once from the cache (a
    // running domain whose QEMU pid is known) or when libvirt is known to
    // be unreachable, otherwise once the worker asked (a QEMU says HELLO
    // before libvirt's STARTED event), at most kLibvirtCallTimeout later.
    void lookup(const std::string& uuid, std::function<void(const DomainAnswer&)> done);
    // An admin's weight for `target` (a VM name or UUID) into its domain's
    // metadata (which then is the weight's source), answered on the loop
    // within kLibvirtCallTimeout.
    void set_weight(const std::string& target, std::uint32_t weight, std::function<void(const WeightWrite&)> done);

    struct Impl;

private:
    std::unique_ptr<Impl> impl_;
};

}  // namespace pvgpu::daemon
