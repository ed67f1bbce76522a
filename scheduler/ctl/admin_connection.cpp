// pvgpud's admin socket, client side (admin_connection.hpp).
#include "admin_connection.hpp"

#include <poll.h>
#include <sys/socket.h>
#include <sys/un.h>

#include <cerrno>
#include <cstring>
#include <string_view>
#include <system_error>
#include <utility>

namespace pvgpu {

namespace {

using SteadyClock = std::chrono::steady_clock;

std::string errno_text(int err) { return std::error_code(err, std::system_category()).message(); }

std::string timeout_text(std::chrono::milliseconds t) {
    if (t.count() % 1000 == 0) return std::to_string(t.count() / 1000) + " s";
    return std::to_string(t.count()) + " ms";
}

}  // namespace

nlohmann::json AdminConnection::request(const nlohmann::json& req, std::chrono::milliseconds timeout) {
    if (!fd_) connect();
    send_line(req.dump() + "\n");
    const auto deadline = SteadyClock::now() + timeout;
    for (;;) {
        if (auto reply = take_reply()) return std::move(*reply);
        const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(deadline - SteadyClock::now());
        if (left.count() <= 0) throw DaemonError{"pvgpud did not answer within " + timeout_text(timeout), {}};
        pollfd p{fd_.get(), POLLIN, 0};
        const int rc = ::poll(&p, 1, static_cast<int>(left.count()));
        if (rc < 0) {
            if (errno == EINTR) continue;
            throw DaemonError{"poll: " + errno_text(errno), {}};
        }
        if (rc == 0) continue;
        char chunk[4096];
        const ssize_t n = ::recv(fd_.get(), chunk, sizeof chunk, 0);
        if (n < 0) {
            if (errno == EINTR) continue;
            const int err = errno;
            fd_.reset();
            throw DaemonError{"lost connection to " + path_ + ": " + errno_text(err), {}};
        }
        if (n == 0) {
            fd_.reset();
            buf_.clear();
            throw DaemonError{"pvgpud closed the admin connection without answering", {}};
        }
        buf_.append(chunk, static_cast<std::size_t>(n));
    }
}

void AdminConnection::send_line(const std::string& line) {
    std::string_view rest = line;
    while (!rest.empty()) {
        const ssize_t n = ::send(fd_.get(), rest.data(), rest.size(), MSG_NOSIGNAL);
        if (n < 0) {
            if (errno == EINTR) continue;
            const int err = errno;
            fd_.reset();
            throw DaemonError{"lost connection to " + path_ + ": " + errno_text(err), {}};
        }
        rest.remove_prefix(static_cast<std::size_t>(n));
    }
}

// The next complete reply line in the buffer, parsed; blank lines skipped.
std::optional<nlohmann::json> AdminConnection::take_reply() {
    while (true) {
        const auto nl = buf_.find('\n');
        if (nl == std::string::npos) return std::nullopt;
        const std::string reply_line = buf_.substr(0, nl);
        buf_.erase(0, nl + 1);
        if (reply_line.find_first_not_of(" \t\r") == std::string::npos) continue;
        nlohmann::json reply = nlohmann::json::parse(reply_line, nullptr, false);
        if (reply.is_discarded() || !reply.is_object() || !reply.contains("ok") || !reply["ok"].is_boolean())
            throw DaemonError{"malformed reply from pvgpud: " + reply_line.substr(0, 200), {}};
        return reply;
    }
}

void AdminConnection::connect() {
    sockaddr_un addr{};
    if (path_.empty() || path_.size() >= sizeof addr.sun_path)
        throw DaemonError{"cannot connect to " + path_ + ": invalid socket path", {}};
    UniqueFd fd(::socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0));
    if (!fd) throw DaemonError{"socket: " + errno_text(errno), {}};
    addr.sun_family = AF_UNIX;
    std::memcpy(addr.sun_path, path_.data(), path_.size());
    int rc;
    do {
        rc = ::connect(fd.get(), reinterpret_cast<const sockaddr*>(&addr), sizeof addr);
    } while (rc < 0 && errno == EINTR);
    if (rc < 0) throw DaemonError{"cannot connect to " + path_ + ": " + errno_text(errno), {}};
    fd_ = std::move(fd);
    buf_.clear();
}

}  // namespace pvgpu
