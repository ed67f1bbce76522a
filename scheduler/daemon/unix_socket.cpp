#include "unix_socket.hpp"

#include <glib.h>
#include <grp.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <stdexcept>
#include <vector>

namespace pvgpu::daemon {

namespace {

[[noreturn]] void fail(const std::string& what) {
    throw std::runtime_error(what + ": " + std::strerror(errno));
}

sockaddr_un address(const std::string& path) {
    sockaddr_un a{};
    a.sun_family = AF_UNIX;
    if (path.size() >= sizeof a.sun_path)
        throw std::runtime_error(path + ": socket path longer than " + std::to_string(sizeof a.sun_path - 1) +
                                 " bytes");
    std::memcpy(a.sun_path, path.c_str(), path.size() + 1);
    return a;
}

}  // namespace

gid_t group_id(const std::string& name) {
    if (name.empty()) return static_cast<gid_t>(-1);
    std::vector<char> buf(16384);
    group gr{};
    group* res = nullptr;
    if (getgrnam_r(name.c_str(), &gr, buf.data(), buf.size(), &res) != 0 || !res)
        return static_cast<gid_t>(-1);
    return res->gr_gid;
}

UniqueFd listen_unix(const std::string& path, mode_t mode, const std::string& group) {
    sockaddr_un addr = address(path);
    if (auto slash = path.rfind('/'); slash != std::string::npos && slash > 0) {
        std::string dir = path.substr(0, slash);
        if (g_mkdir_with_parents(dir.c_str(), 0755) != 0) fail("cannot create " + dir);
    }

    struct stat st {};
    if (lstat(path.c_str(), &st) == 0) {
        if (!S_ISSOCK(st.st_mode)) throw std::runtime_error(path + ": exists and is not a socket");
        UniqueFd probe(socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0));
        if (!probe) fail("socket");
        if (connect(probe.get(), reinterpret_cast<const sockaddr*>(&addr), sizeof addr) == 0)
            throw std::runtime_error(path + ": another daemon is listening there");
        if (unlink(path.c_str()) != 0) fail("cannot remove stale socket " + path);
    }

    UniqueFd fd(socket(AF_UNIX, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0));
    if (!fd) fail("socket");
    if (bind(fd.get(), reinterpret_cast<const sockaddr*>(&addr), sizeof addr) != 0) fail("bind " + path);
    // Permissions before listen(): nobody can connect through a wider mode.
    if (chmod(path.c_str(), mode) != 0) fail("chmod " + path);
    if (!group.empty()) {
        gid_t gid = group_id(group);
        if (gid == static_cast<gid_t>(-1)) throw std::runtime_error(path + ": unknown group '" + group + "'");
        if (chown(path.c_str(), static_cast<uid_t>(-1), gid) != 0) fail("chown " + path);
    }
    if (listen(fd.get(), 128) != 0) fail("listen " + path);
    return fd;
}

}  // namespace pvgpu::daemon
