#include "names.hpp"

#include <cstdio>

namespace pvgpu::daemon {

std::string format_uuid(const Uuid& u) {
    static const char* hex = "0123456789abcdef";
    std::string s;
    for (std::size_t i = 0; i < u.size(); ++i) {
        if (i == 4 || i == 6 || i == 8 || i == 10) s += '-';
        s += hex[u[i] >> 4];
        s += hex[u[i] & 15];
    }
    return s;
}

std::optional<Uuid> parse_uuid(std::string_view s) {
    if (s.size() != 36) return std::nullopt;
    Uuid u{};
    std::size_t n = 0;
    auto nibble = [](char c) -> int {
        if (c >= '0' && c <= '9') return c - '0';
        if (c >= 'a' && c <= 'f') return c - 'a' + 10;
        if (c >= 'A' && c <= 'F') return c - 'A' + 10;
        return -1;
    };
    for (std::size_t i = 0; i < s.size();) {
        if (i == 8 || i == 13 || i == 18 || i == 23) {
            if (s[i] != '-') return std::nullopt;
            ++i;
            continue;
        }
        int hi = nibble(s[i]), lo = nibble(s[i + 1]);
        if (hi < 0 || lo < 0) return std::nullopt;
        u[n++] = static_cast<std::uint8_t>(hi << 4 | lo);
        i += 2;
    }
    return u;
}

bool is_nil(const Uuid& u) {
    for (auto b : u)
        if (b) return false;
    return true;
}

std::string sanitize_name(std::string_view raw, std::size_t max) {
    std::string out;
    for (char c : raw) {
        if (out.size() == max) break;
        bool ok = (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') || c == '-' ||
                  c == '_' || c == '.';
        out += ok ? c : '_';
    }
    return out;
}

std::string with_suffix(const std::string& base, const std::string& suffix, std::size_t max) {
    if (suffix.size() >= max) return suffix.substr(0, max);
    return base.substr(0, max - suffix.size()) + suffix;
}

std::string host_user_entity_name(const std::string& user) {
    const std::string prefix = "host:";
    if (prefix.size() + user.size() <= 64) return prefix + user;
    // FNV-1a, 32 bits: stable across runs and builds (std::hash is not).
    std::uint32_t h = 2166136261u;
    for (unsigned char c : user) h = (h ^ c) * 16777619u;
    char hex[10];
    std::snprintf(hex, sizeof hex, "-%08x", h);
    return prefix + with_suffix(user, hex, 64 - prefix.size());
}

}  // namespace pvgpu::daemon
