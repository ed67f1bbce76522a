#include "identity.hpp"

#include <pwd.h>

#include <charconv>

namespace pvgpu::daemon {

std::string user_name(uid_t uid) {
    std::vector<char> buf(16384);
    passwd pw{};
    passwd* res = nullptr;
    if (getpwuid_r(uid, &pw, buf.data(), buf.size(), &res) == 0 && res && res->pw_name[0] != '\0')
        return res->pw_name;
    return std::to_string(uid);
}

std::optional<uid_t> user_id(const std::string& name_or_uid) {
    if (name_or_uid.empty()) return std::nullopt;
    uid_t uid = 0;
    const char* end = name_or_uid.data() + name_or_uid.size();
    if (auto [p, ec] = std::from_chars(name_or_uid.data(), end, uid); ec == std::errc() && p == end) return uid;
    std::vector<char> buf(16384);
    passwd pw{};
    passwd* res = nullptr;
    if (getpwnam_r(name_or_uid.c_str(), &pw, buf.data(), buf.size(), &res) == 0 && res) return res->pw_uid;
    return std::nullopt;
}

VmmUsers::VmmUsers(const std::vector<std::string>& users, std::vector<std::string>* unknown) {
    for (const auto& u : users) {
        auto uid = user_id(u);
        if (!uid) {
            if (unknown) unknown->push_back(u);
            continue;
        }
        uids_.insert(*uid);
        shown_ += (shown_.empty() ? "" : ", ") + u;
    }
}

std::optional<std::string> VmmUsers::refuse(const ucred& peer, const std::string& /*uuid*/) const {
    if (allows(peer.uid)) return std::nullopt;
    return "uid " + std::to_string(peer.uid) + " may not act as a VMM (vmm_users: " +
           (shown_.empty() ? "none" : shown_) + ")";
}

}  // namespace pvgpu::daemon
