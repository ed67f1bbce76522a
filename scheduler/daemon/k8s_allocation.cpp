// The allocation file of a Kubernetes pod (k8s_allocation.hpp).
#include "k8s_allocation.hpp"

#include <fcntl.h>
#include <linux/openat2.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <nlohmann/json.hpp>

#include "proto/unique_fd.hpp"

#ifndef SYS_openat2
#define SYS_openat2 437  // the same number on every architecture (asm-generic/unistd.h)
#endif

namespace pvgpu::daemon {

AllocationParse parse_allocation(std::string_view text, std::size_t gpus) {
    using nlohmann::json;
    if (text.size() > kMaxAllocationFileBytes)
        return {std::nullopt, "larger than " + std::to_string(kMaxAllocationFileBytes) + " bytes"};
    json doc;
    try {
        doc = json::parse(text);
    } catch (const json::parse_error& e) {
        return {std::nullopt, "malformed JSON at byte " + std::to_string(e.byte)};
    }
    if (!doc.is_object()) return {std::nullopt, "not a JSON object"};
    const auto it = doc.find("gpu");
    if (it == doc.end()) return {std::nullopt, "no \"gpu\" field"};
    if (!it->is_number_integer()) return {std::nullopt, "\"gpu\" is not an integer"};
    if (!it->is_number_unsigned()) return {std::nullopt, "\"gpu\" is negative (" + it->dump() + ")"};
    const auto gpu = it->get<std::uint64_t>();
    if (gpu >= gpus)
        return {std::nullopt, "\"gpu\" is " + std::to_string(gpu) + "; this host has " + std::to_string(gpus) +
                                  " GPU" + (gpus == 1 ? "" : "s")};
    return {static_cast<std::uint32_t>(gpu), {}};
}

namespace {

AllocationRead read_error(const std::string& what, int err) {
    return {AllocationRead::Kind::Error, what + ": " + std::strerror(err)};
}

// `path` inside the directory `root` as if it were "/": openat2's
// RESOLVE_IN_ROOT keeps absolute symbolic links inside it.  Kernels before
// 5.6 lack openat2: the path is then opened relative to `root`, whose
// final component still may not be a link (O_NOFOLLOW).
int open_in_root(int root, const std::string& path) {
    const std::uint64_t flags = O_RDONLY | O_NOFOLLOW | O_CLOEXEC | O_NONBLOCK;
    open_how how{};
    how.flags = flags;
    how.resolve = RESOLVE_IN_ROOT | RESOLVE_NO_MAGICLINKS;
    int fd;
    do fd = static_cast<int>(::syscall(SYS_openat2, root, path.c_str(), &how, sizeof how));
    while (fd < 0 && errno == EINTR);
    if (fd >= 0 || errno != ENOSYS) return fd;
    const std::size_t rel = path.find_first_not_of('/');
    return ::openat(root, rel == std::string::npos ? "." : path.c_str() + rel, static_cast<int>(flags));
}

}  // namespace

AllocationRead read_allocation_file(pid_t pid, const std::string& path) {
    const std::string root_path = "/proc/" + std::to_string(pid) + "/root";
    const UniqueFd root(::open(root_path.c_str(), O_PATH | O_DIRECTORY | O_CLOEXEC));
    // ENOENT: the process is gone, there is no view of it to read.
    if (!root) return errno == ENOENT ? AllocationRead{} : read_error("cannot open " + root_path, errno);
    const UniqueFd fd(open_in_root(root.get(), path));
    if (!fd) {
        if (errno == ENOENT || errno == ENOTDIR) return {};  // no pod reserved units for this VMM
        return read_error(errno == ELOOP ? "cannot open (a symbolic link?)" : "cannot open", errno);
    }
    struct stat st {};
    if (::fstat(fd.get(), &st) != 0) return read_error("fstat", errno);
    if (!S_ISREG(st.st_mode)) return {AllocationRead::Kind::Error, "not a regular file"};
    if (st.st_size > static_cast<off_t>(kMaxAllocationFileBytes))
        return {AllocationRead::Kind::Error, "larger than " + std::to_string(kMaxAllocationFileBytes) + " bytes"};
    // One byte more than allowed, to see a file that grew since fstat.
    std::string text(kMaxAllocationFileBytes + 1, '\0');
    std::size_t got = 0;
    while (got < text.size()) {
        const ssize_t n = ::read(fd.get(), text.data() + got, text.size() - got);
        if (n < 0 && errno == EINTR) continue;
        if (n < 0) return read_error("read", errno);
        if (n == 0) break;
        got += static_cast<std::size_t>(n);
    }
    text.resize(got);
    return {AllocationRead::Kind::Text, std::move(text)};
}

}  // namespace pvgpu::daemon
