// libpvgpu internals: the guest driver's ioctl/mmap interface
// (include/pvgpu/guest_ioctl.h) behind a narrow seam, so the device
// transport's logic can be tested on a host against an in-process fake.
#pragma once

#include <pvgpu/guest_ioctl.h>

#include <memory>
#include <string>

#include "pvgpu.h"
#include "transport.hpp"

namespace pvgpu::detail {

// One open file of the driver.  The ioctl calls return 0 or an errno value
// (EINTR included: the caller decides whether to retry).
class DeviceOps {
public:
    virtual ~DeviceOps() = default;
    virtual const std::string& path() const = 0;
    virtual int info(pvgpu_ioc_info& arg) = 0;
    virtual int alloc(pvgpu_ioc_alloc& arg) = 0;
    virtual int free(pvgpu_ioc_free& arg) = 0;
    virtual int wait(pvgpu_ioc_wait& arg) = 0;
    // PVGPU_IOC_WAIT_ANY; ENOTTY from a module that predates it.
    virtual int wait_any(pvgpu_ioc_wait_any& arg) = 0;
    virtual int set_weight(pvgpu_ioc_set_weight& arg) = 0;
    // Maps a channel's three pages (PVGPU_MMAP_CHANNEL_SIZE at `offset`);
    // throws ClientError.
    virtual Mapping map_channel(std::uint64_t offset) = 0;
};

// The real driver: opens `path` (ClientError if that fails).
std::unique_ptr<DeviceOps> open_device(const std::string& path);

// The device transport over `ops`.
std::unique_ptr<TransportBackend> make_device_transport(std::unique_ptr<DeviceOps> ops, const ClientOptions& options);

// Internals shared with the tests.
std::string device_path(const ClientOptions& options);     // option, $PVGPU_DEVICE, default
pvgpu::Transport select_transport(const ClientOptions& options);  // never Auto
std::string channel_error_text(std::uint32_t err);          // PVGPU_CHAN_ERR_* for messages

struct ClientAccess {
    // A client whose device transport runs on `ops` (tests).
    static Client with_device(ClientOptions options, std::unique_ptr<DeviceOps> ops);
};

}  // namespace pvgpu::detail
