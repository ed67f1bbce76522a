// Thin RAII over the libvirt C API for what pvgpu needs: connections,
// domains, and the pvgpu metadata element.  Errors are exceptions carrying
// libvirt's own message; libvirt's default handler (printing to stderr) is
// silenced once per process.
#pragma once

#include <libvirt/libvirt.h>
#include <libvirt/virterror.h>

#include <memory>
#include <optional>
#include <stdexcept>
#include <string>

#include "domain_xml.hpp"

namespace pvgpu::virt {

class VirtError : public std::runtime_error {
public:
    VirtError(const std::string& what, int code) : std::runtime_error(what), code_(code) {}
    int code() const { return code_; }  // virErrorNumber

private:
    int code_;
};

struct ConnectClose {
    void operator()(virConnectPtr c) const { virConnectClose(c); }
};
struct DomainFree {
    void operator()(virDomainPtr d) const { virDomainFree(d); }
};
using Connection = std::unique_ptr<virConnect, ConnectClose>;
using Domain = std::unique_ptr<virDomain, DomainFree>;

// Throws VirtError "CONTEXT: libvirt's last error".
[[noreturn]] void fail(const std::string& context);

// uri empty: libvirt's default (LIBVIRT_DEFAULT_URI, then its own choice).
Connection open(const std::string& uri);
// By UUID, else by name.  Throws VirtError (VIR_ERR_NO_DOMAIN if none).
Domain lookup(virConnectPtr conn, const std::string& name_or_uuid);

std::string uuid_of(virDomainPtr dom);
std::string name_of(virDomainPtr dom);

// The domain's <pvgpu:gpu> (flags: VIR_DOMAIN_AFFECT_LIVE / _CONFIG /
// _CURRENT); nullopt when it has none.  Throws XmlError when it is
// malformed, VirtError when libvirt fails.
std::optional<GpuMetadata> read_gpu_metadata(virDomainPtr dom, unsigned flags);
// Sets (or with nullopt removes) the element.
void write_gpu_metadata(virDomainPtr dom, const std::optional<GpuMetadata>& m, unsigned flags);

// A domain with pvgpu (metadata or device) keeps its weight in its metadata:
// writes `weight` there (its persistent definition, and the running domain
// too), keeping the metadata's device.  Returns the domain's UUID when it
// did; nullopt when `target` (a name or UUID) is no domain or no pvgpu
// domain.  Throws VirtError when libvirt fails.
std::optional<std::string> set_domain_weight(virConnectPtr conn, const std::string& target, std::uint32_t weight);

}  // namespace pvgpu::virt
