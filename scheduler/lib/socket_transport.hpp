// libpvgpu internals: the socket transport (pvgpud's client socket).
#pragma once

#include <memory>

#include "transport.hpp"

namespace pvgpu::detail {

// Finds the attached channel the daemon calls `chan_id` (MODE, NOTICE); null if none.
using LinkLookup = std::function<ChannelLink*(std::uint32_t chan_id)>;

std::unique_ptr<TransportBackend> make_socket_transport(const ClientOptions& options, ClientStats& stats,
                                                 LinkLookup lookup);

}  // namespace pvgpu::detail
