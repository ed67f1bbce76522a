// Entity names and UUIDs as the daemon shows them (docs/protocol.md 1.2).
#pragma once

#include <array>
#include <cstdint>
#include <optional>
#include <string>
#include <string_view>

namespace pvgpu::daemon {

using Uuid = std::array<std::uint8_t, 16>;

// "5f0c1a2e-8d1b-4c55-9a10-6e0d2f5b9c01" (lower case).
std::string format_uuid(const Uuid& u);
// Canonical form, either case; nullopt otherwise.
std::optional<Uuid> parse_uuid(std::string_view s);
bool is_nil(const Uuid& u);

// A name the entity tree accepts (EntityTree::check_name): characters other
// than letters, digits, '-', '_' and '.' become '_' (':' too: the daemon
// keeps it for its own namespaces), at most `max` bytes.
std::string sanitize_name(std::string_view raw, std::size_t max = 64);
// base + suffix within `max` bytes, cutting the base if needed.
std::string with_suffix(const std::string& base, const std::string& suffix, std::size_t max = 64);

// Longest host user name the daemon keeps whole (LOGIN_NAME_MAX - 1).
constexpr std::size_t kMaxUserName = 255;
// The root entity of a host user: "host:<user>" when that fits the tree's
// 64 bytes; a longer user name is cut and given 8 hex digits of a hash of
// the whole name, so two long names with a common beginning stay apart.
// Only the tree sees this name: admins name the user host/<user>, whole.
std::string host_user_entity_name(const std::string& user);

}  // namespace pvgpu::daemon
