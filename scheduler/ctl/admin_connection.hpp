// A connection to pvgpud's admin socket (docs/protocol.md section 1): one
// JSON object per line each way, strictly in turn.  Shared by pvgpuctl and
// pvgpu-device-plugin.
#pragma once

#include <nlohmann/json.hpp>

#include <chrono>
#include <optional>
#include <string>

#include "proto/unique_fd.hpp"

namespace pvgpu {

// The daemon is unreachable, answered ok:false, or broke the protocol.
struct DaemonError {
    std::string message;
    std::optional<nlohmann::json> reply;  // the ok:false reply, for --json
};

class AdminConnection {
public:
    static constexpr std::chrono::seconds kReplyTimeout{10};

    explicit AdminConnection(std::string path) : path_(std::move(path)) {}

    // One request, one reply, within `timeout`; connects first when not
    // connected (again after a lost connection).  ok:false replies are
    // returned, not thrown; anything else that goes wrong throws DaemonError.
    nlohmann::json request(const nlohmann::json& req, std::chrono::milliseconds timeout = kReplyTimeout);

    bool connected() const { return static_cast<bool>(fd_); }
    const std::string& path() const { return path_; }

private:
    void connect();
    void send_line(const std::string& line);
    std::optional<nlohmann::json> take_reply();

    std::string path_;
    UniqueFd fd_;
    std::string buf_;
};

}  // namespace pvgpu
