// The pvgpu parts of a libvirt domain: the GPU-share metadata element
// (namespace http://pvgpu.org/xmlns/domain/1.0) and the device wiring in
// <qemu:commandline>.  Pure XML work (libxml2), no libvirt connection, so
// pvgpuctl and pvgpud share it and unit tests cover it.
#pragma once

#include <cstdint>
#include <optional>
#include <stdexcept>
#include <string>
#include <string_view>

namespace pvgpu::virt {

inline constexpr const char* kMetadataNamespace = "http://pvgpu.org/xmlns/domain/1.0";
inline constexpr const char* kMetadataPrefix = "pvgpu";  // `virsh metadata --key`
inline constexpr const char* kQemuNamespace = "http://libvirt.org/schemas/domain/qemu/1.0";
inline constexpr const char* kChardevId = "pvgpu0";

// Malformed XML or values out of range; what() is one line for a log.
class XmlError : public std::runtime_error {
public:
    using std::runtime_error::runtime_error;
};

// <pvgpu:gpu weight="200" device="1"/>: the VM's weight (1..10000, default
// 100) and the host GPU it runs on (0..15; absent: pvgpud places it).
struct GpuMetadata {
    std::uint32_t weight;
    std::optional<std::uint32_t> device = std::nullopt;
};

// Parses the element virDomainGetMetadata returns.  Strict: the element is
// `gpu` (in our namespace if it names one), `weight` and `device` are
// decimals in range, nothing else is allowed (a typo must not silently mean
// the default); the error names the attribute.
GpuMetadata parse_gpu_metadata(std::string_view xml);
// The element virDomainSetMetadata is given (prefix and namespace are the
// API's arguments, so the element itself carries neither).
std::string format_gpu_metadata(const GpuMetadata& m);

// How a domain reaches pvgpud.
struct DeviceWiring {
    std::string socket;    // pvgpud's client socket
    std::uint32_t slots = 0;  // 0: the device's default
    std::string emulator;  // non-empty: also set <emulator> to the patched QEMU
    std::optional<std::uint32_t> gpu = std::nullopt;  // the device's `gpu` (0..15); nullopt: pvgpud places it
};

// Adds (or replaces) the pvgpu chardev and device in the domain's
// <qemu:commandline>; other arguments are kept in order.
std::string attach_device(std::string_view domain_xml, const DeviceWiring& w);
// The same wiring plus the <pvgpu:gpu> element in the domain's <metadata>
// (replacing one there; other metadata kept), for a domain defined from this
// XML without a virDomainSetMetadata call (KubeVirt's virt-launcher).
std::string attach_device(std::string_view domain_xml, const DeviceWiring& w, const GpuMetadata& m);
// Removes every pvgpu device argument and the chardevs they use.
std::string detach_device(std::string_view domain_xml);
// Whether the domain's command line has a pvgpu device.
bool has_device(std::string_view domain_xml);
// The domain's UUID and name from its XML.
struct DomainIds {
    std::string uuid, name;
};
DomainIds domain_ids(std::string_view domain_xml);

}  // namespace pvgpu::virt
