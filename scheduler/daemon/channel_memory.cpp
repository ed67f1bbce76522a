#include "channel_memory.hpp"

#include <fcntl.h>
#include <sys/eventfd.h>
#include <sys/mman.h>
#include <sys/uio.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <system_error>
#include <utility>

namespace pvgpu::daemon {

namespace {

[[noreturn]] void fail(const char* what) { throw std::system_error(errno, std::generic_category(), what); }

}  // namespace

ChannelMemoryFile ChannelMemoryFile::create(const char* name) {
    ChannelMemoryFile m;
    m.fd_ = UniqueFd(memfd_create(name, MFD_CLOEXEC | MFD_ALLOW_SEALING));
    if (!m.fd_) fail("memfd_create");
    if (ftruncate(m.fd_.get(), static_cast<off_t>(size())) != 0) fail("ftruncate");
    if (fcntl(m.fd_.get(), F_ADD_SEALS, F_SEAL_SHRINK | F_SEAL_GROW | F_SEAL_SEAL) != 0) fail("F_ADD_SEALS");
    void* p = mmap(nullptr, size(), PROT_READ | PROT_WRITE, MAP_SHARED, m.fd_.get(), 0);
    if (p == MAP_FAILED) fail("mmap");
    m.base_ = p;
    return m;
}

ChannelMemoryFile::ChannelMemoryFile(ChannelMemoryFile&& o) noexcept
    : fd_(std::move(o.fd_)), base_(std::exchange(o.base_, nullptr)) {}

ChannelMemoryFile& ChannelMemoryFile::operator=(ChannelMemoryFile&& o) noexcept {
    if (this != &o) {
        unmap();
        fd_ = std::move(o.fd_);
        base_ = std::exchange(o.base_, nullptr);
    }
    return *this;
}

ChannelMemoryFile::~ChannelMemoryFile() { unmap(); }

void ChannelMemoryFile::unmap() {
    if (base_) munmap(base_, size());
    base_ = nullptr;
}

int ChannelMemoryFile::discard() {
    unmap();
    int err = 0;
    if (fd_ && fallocate(fd_.get(), FALLOC_FL_PUNCH_HOLE | FALLOC_FL_KEEP_SIZE, 0, static_cast<off_t>(size())) != 0)
        err = errno;
    fd_.reset();
    return err;
}

pvgpu_ring* ChannelMemoryFile::ring() const {
    if (!base_) return nullptr;
    return reinterpret_cast<pvgpu_ring*>(static_cast<char*>(base_) + PVGPU_CHAN_RING_OFFSET);
}

std::uint32_t ChannelMemoryFile::client_put() const {
    std::uint32_t put = ctrl()->ib_put;
    // Ring entries written before IB_PUT must be seen after it.
    std::atomic_thread_fence(std::memory_order_acquire);
    return put;
}

Doorbell Doorbell::create() {
    Doorbell d;
    d.fd_ = UniqueFd(eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK));
    if (!d.fd_) fail("eventfd");
    return d;
}

bool Doorbell::drain() const {
    // RWF_NOWAIT: non-blocking whatever O_NONBLOCK says.  The client holds
    // the same open file description: it could clear O_NONBLOCK and read
    // the counter to zero between our poll and this read, and a plain
    // read would then block pvgpud.  A kernel whose eventfd does not
    // support it (EOPNOTSUPP) gets the plain read.
    std::uint64_t v = 0;
    iovec iov{&v, sizeof v};
    ssize_t n;
    do {
        n = preadv2(fd_.get(), &iov, 1, -1, RWF_NOWAIT);
    } while (n < 0 && errno == EINTR);
    if (n < 0 && errno == EOPNOTSUPP) n = ::read(fd_.get(), &v, sizeof v);
    return n == static_cast<ssize_t>(sizeof v) && v != 0;
}

CompletionNotifier CompletionNotifier::create() {
    int fds[2];
    if (pipe2(fds, O_CLOEXEC | O_NONBLOCK) != 0) fail("pipe2");
    CompletionNotifier n;
    n.reader_ = UniqueFd(fds[0]);
    n.writer_ = UniqueFd(fds[1]);
    // The smallest pipe: bounds what an unread notifier pins in the kernel
    // (and in the per-user pipe budget).  A failure only leaves it larger.
    (void)fcntl(fds[1], F_SETPIPE_SZ, static_cast<int>(sysconf(_SC_PAGESIZE)));
    return n;
}

void CompletionNotifier::signal() {
    if (!writer_) return;
    const char byte = 1;
    ssize_t n;
    do {
        n = ::write(writer_.get(), &byte, 1);
    } while (n < 0 && errno == EINTR);
    // EAGAIN: full, the client has a wake-up waiting.  EPIPE (SIGPIPE is
    // ignored): the client closed its end; stop paying for the syscall.
    if (n < 0 && errno == EPIPE) writer_.reset();
}

}  // namespace pvgpu::daemon
