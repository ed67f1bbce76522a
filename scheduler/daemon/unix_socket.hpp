// Listening UNIX stream sockets.
#pragma once

#include <sys/types.h>

#include <string>

#include "proto/unique_fd.hpp"

namespace pvgpu::daemon {

// Binds and listens on `path` (non-blocking, close-on-exec), creating the
// parent directory if needed.  A stale socket file (nobody listening) is
// replaced; a live one or a non-socket is an error.  The file gets `mode`
// and, if `group` is not empty, that group.  Throws std::runtime_error.
UniqueFd listen_unix(const std::string& path, mode_t mode, const std::string& group);

// Group id by name; nullopt-like -1 when unknown.
gid_t group_id(const std::string& name);

}  // namespace pvgpu::daemon
