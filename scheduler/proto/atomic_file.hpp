// Replacing a file whole or not at all: pvgpud's metrics textfile and state
// file, pvgpu-device-plugin's allocation files.  A reader (node_exporter, a
// container's VMM through kubelet's mount, pvgpud after a crash) never sees
// half of one.
#pragma once

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <stdexcept>
#include <string>

#include "proto/unique_fd.hpp"

namespace pvgpu {

// Writes `text` to `path` (mode 0644) through a temporary file in the same
// directory, synced and renamed over it; throws std::runtime_error naming
// the path and the system error.
inline void write_file_atomically(const std::string& path, const std::string& text) {
    auto fail = [&](const std::string& what, int err) {
        throw std::runtime_error(what + ": " + std::strerror(err));
    };
    // A fresh name in the same directory, created O_EXCL (mkostemp): the
    // directory may be writable by others (a shared textfile directory), and
    // a FIFO, symlink or file planted at a fixed name must neither block the
    // writer nor be written through.  A dot file without the final name's
    // suffix: node_exporter reads only *.prom, never a half-written file.
    const auto slash = path.rfind('/');
    const std::string dir = slash == std::string::npos ? std::string() : path.substr(0, slash + 1);
    const std::string base = slash == std::string::npos ? path : path.substr(slash + 1);
    std::string tmp = dir + "." + base + ".XXXXXX";
    UniqueFd fd(::mkostemp(tmp.data(), O_CLOEXEC));
    if (!fd) fail(dir.empty() ? std::string("./") : dir, errno);
    auto discard = [&](const std::string& what, int err) {
        ::unlink(tmp.c_str());
        fail(what, err);
    };
    // mkostemp creates 0600: under pvgpud's unit's UMask=0077 a mode at open
    // would be cut too, and the readers run as other users.
    if (::fchmod(fd.get(), 0644) != 0) discard("fchmod " + tmp, errno);
    std::size_t done = 0;
    while (done < text.size()) {
        ssize_t n = ::write(fd.get(), text.data() + done, text.size() - done);
        if (n < 0 && errno == EINTR) continue;
        if (n < 0) discard(tmp, errno);
        done += static_cast<std::size_t>(n);
    }
    if (::fsync(fd.get()) != 0 || ::close(fd.release()) != 0) discard(tmp, errno);
    if (::rename(tmp.c_str(), path.c_str()) != 0) discard(path, errno);
}

}  // namespace pvgpu
