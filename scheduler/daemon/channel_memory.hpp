// Shared memory of one channel (control page + ring) in a sealed memfd, and
// the channel's doorbell eventfd.  Both are handed to the client with
// SCM_RIGHTS; the client maps the memfd and submits by writing ring entries
// and IB_PUT, then rings the doorbell.
#pragma once

#include <pvgpu/protocol.h>

#include <cstddef>
#include <cstdint>

#include "core/gpu_device.hpp"
#include "proto/unique_fd.hpp"

namespace pvgpu::daemon {

class ChannelMemoryFile {
public:
    // memfd of PVGPU_CHAN_MEM_SIZE bytes, sealed against shrinking and growing
    // (a client cannot truncate it under the daemon and cause SIGBUS), mapped
    // shared.  Throws std::system_error.
    static ChannelMemoryFile create(const char* name = "pvgpu-channel");

    ChannelMemoryFile() = default;
    ChannelMemoryFile(ChannelMemoryFile&& o) noexcept;
    ChannelMemoryFile& operator=(ChannelMemoryFile&& o) noexcept;
    ChannelMemoryFile(const ChannelMemoryFile&) = delete;
    ChannelMemoryFile& operator=(const ChannelMemoryFile&) = delete;
    ~ChannelMemoryFile();

    int fd() const { return fd_.get(); }
    static constexpr std::size_t size() { return PVGPU_CHAN_MEM_SIZE; }
    pvgpu_ctrl_page* ctrl() const { return static_cast<pvgpu_ctrl_page*>(base_); }
    pvgpu_ring* ring() const;
    // What the GPU backend is given for the channel.
    ChannelMemory memory() const { return {ctrl(), ring()}; }

    // IB_PUT as the client last stored it: untrusted, read once.
    std::uint32_t client_put() const;

private:
    void unmap();

    UniqueFd fd_;
    void* base_ = nullptr;
};

// The doorbell: an eventfd the client writes after storing IB_PUT.
class Doorbell {
public:
    static Doorbell create();  // EFD_CLOEXEC | EFD_NONBLOCK; throws std::system_error
    int fd() const { return fd_.get(); }
    // Reads the counter; true when the client rang since the last drain.
    bool drain() const;

private:
    UniqueFd fd_;
};

}  // namespace pvgpu::daemon
