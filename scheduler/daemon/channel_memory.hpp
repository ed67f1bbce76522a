// Shared memory of one channel (control page + ring) in a sealed memfd, the
// channel's doorbell eventfd and, for host clients of protocol version 3,
// its completion notifier.  All are handed to the client with SCM_RIGHTS;
// the client maps the memfd and submits by writing ring entries and IB_PUT,
// then rings the doorbell, and sleeps on the notifier.
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

    // At the channel's free: unmaps it, gives its pages back (a hole
    // punched over the whole file, which stays its size: the seals hold)
    // and closes pvgpud's fd.  A client that keeps its copy of the memfd, or
    // a mapping, after the free then holds no pages pvgpud wrote (and was
    // charged for); what it touches afterwards is its own.  Returns 0 or
    // the errno of the punch (the rest is done either way).
    int discard();

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

// The completion notifier (docs/protocol.md 2.3, CHAN_REPLY): a pipe whose
// read end goes to the client and whose write end only pvgpud holds.  Not an
// eventfd: the client would share the daemon's open file description, and
// by clearing O_NONBLOCK on it and filling the counter it could make the
// daemon's write block.  The pipe holds one page: a client that never reads
// costs that page and, once it is full, one failed write per completion.
class CompletionNotifier {
public:
    // pipe2(O_CLOEXEC | O_NONBLOCK), shrunk to one page; throws std::system_error.
    static CompletionNotifier create();
    bool valid() const { return static_cast<bool>(writer_); }
    // The read end, for the CHAN_REPLY (the daemon keeps no copy).
    UniqueFd take_reader() { return std::move(reader_); }
    // One byte; never blocks.  A full pipe already says the same; a closed
    // one (the client let go of it) is not written again.
    void signal();

private:
    UniqueFd reader_;
    UniqueFd writer_;
};

}  // namespace pvgpu::daemon
