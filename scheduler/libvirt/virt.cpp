#include "virt.hpp"

#include <libvirt/virterror.h>

#include <mutex>

namespace pvgpu::virt {

namespace {

void quiet(void*, virErrorPtr) {}

void silence_default_handler() {
    static std::once_flag once;
    std::call_once(once, [] { virSetErrorFunc(nullptr, quiet); });
}

struct Freer {
    void operator()(char* p) const { free(p); }  // NOLINT: libvirt allocates with malloc
};

}  // namespace

void fail(const std::string& context) {
    virErrorPtr e = virGetLastError();
    std::string msg = e && e->message ? e->message : "unknown libvirt error";
    throw VirtError(context + ": " + msg, e ? e->code : VIR_ERR_INTERNAL_ERROR);
}

Connection open(const std::string& uri) {
    silence_default_handler();
    Connection c(virConnectOpen(uri.empty() ? nullptr : uri.c_str()));
    if (!c) fail("cannot connect to libvirt" + (uri.empty() ? std::string() : " at " + uri));
    return c;
}

Domain lookup(virConnectPtr conn, const std::string& name_or_uuid) {
    silence_default_handler();
    Domain d(virDomainLookupByUUIDString(conn, name_or_uuid.c_str()));
    if (!d) d.reset(virDomainLookupByName(conn, name_or_uuid.c_str()));
    if (!d) fail("domain '" + name_or_uuid + "'");
    return d;
}

std::string uuid_of(virDomainPtr dom) {
    char buf[VIR_UUID_STRING_BUFLEN];
    if (virDomainGetUUIDString(dom, buf) < 0) fail("domain UUID");
    return buf;
}

std::string name_of(virDomainPtr dom) {
    const char* n = virDomainGetName(dom);
    return n ? n : "";
}

std::optional<GpuMetadata> read_gpu_metadata(virDomainPtr dom, unsigned flags) {
    std::unique_ptr<char, Freer> xml(virDomainGetMetadata(dom, VIR_DOMAIN_METADATA_ELEMENT, kMetadataNamespace, flags));
    if (!xml) {
        virErrorPtr e = virGetLastError();
        if (e && e->code == VIR_ERR_NO_DOMAIN_METADATA) return std::nullopt;
        fail("pvgpu metadata of domain '" + name_of(dom) + "'");
    }
    return parse_gpu_metadata(xml.get());
}

void write_gpu_metadata(virDomainPtr dom, const std::optional<GpuMetadata>& m, unsigned flags) {
    const std::string xml = m ? format_gpu_metadata(*m) : std::string();
    if (virDomainSetMetadata(dom, VIR_DOMAIN_METADATA_ELEMENT, m ? xml.c_str() : nullptr, m ? kMetadataPrefix : nullptr,
                             kMetadataNamespace, flags) < 0)
        fail("setting the pvgpu metadata of domain '" + name_of(dom) + "'");
}

std::optional<std::string> set_domain_weight(virConnectPtr conn, const std::string& target, std::uint32_t weight) {
    if (target.find('/') != std::string::npos) return std::nullopt;
    Domain dom;
    try {
        dom = lookup(conn, target);
    } catch (const VirtError& e) {
        if (e.code() == VIR_ERR_NO_DOMAIN) return std::nullopt;
        throw;
    }
    std::unique_ptr<char, decltype(&free)> xml(virDomainGetXMLDesc(dom.get(), VIR_DOMAIN_XML_INACTIVE), free);
    if (!xml) fail("domain '" + target + "'");
    std::optional<GpuMetadata> old;
    try {
        old = read_gpu_metadata(dom.get(), VIR_DOMAIN_AFFECT_CONFIG);
    } catch (const XmlError&) {
        old = GpuMetadata{0};  // malformed: overwritten below
    }
    if (!old && !has_device(xml.get())) return std::nullopt;  // not a pvgpu domain
    unsigned flags = VIR_DOMAIN_AFFECT_CONFIG;
    if (virDomainIsActive(dom.get()) == 1) flags |= VIR_DOMAIN_AFFECT_LIVE;
    write_gpu_metadata(dom.get(), GpuMetadata{weight, old ? old->device : std::nullopt}, flags);
    return uuid_of(dom.get());
}

}  // namespace pvgpu::virt
