#include "policy.hpp"

#include <stdexcept>

#include "policies/policies.hpp"

namespace pvgpu {

namespace {

struct Entry {
    PolicyInfo info;
    std::unique_ptr<Policy> (*make)(const PolicyParams&);
};

const std::vector<Entry>& entries() {
    static const std::vector<Entry> list = {
        {none_info(), make_none},
        {timeslice_info(), make_timeslice},
        {dfq_info(), make_dfq},
        {hfq_info(), make_hfq},
    };
    return list;
}

}  // namespace

const std::vector<PolicyInfo>& policy_catalog() {
    static const std::vector<PolicyInfo> infos = [] {
        std::vector<PolicyInfo> v;
        for (const auto& e : entries()) v.push_back(e.info);
        return v;
    }();
    return infos;
}

double param_or_default(const PolicyParams& p, const PolicyInfo& info, const std::string& name) {
    if (auto it = p.find(name); it != p.end()) return it->second;
    for (const auto& [n, def, doc] : info.params)
        if (n == name) return def;
    throw std::logic_error("policy " + info.name + " has no parameter " + name);
}

std::unique_ptr<Policy> make_policy(std::string_view name, const PolicyParams& params) {
    std::string known;
    for (const auto& e : entries()) {
        if (e.info.name == name) {
            for (const auto& [key, value] : params) {
                bool found = false;
                std::string names;
                for (const auto& [n, def, doc] : e.info.params) {
                    found = found || n == key;
                    names += (names.empty() ? "" : ", ") + n;
                }
                if (!found)
                    throw std::invalid_argument("policy " + e.info.name + " has no parameter '" + key +
                                                "' (known: " + (names.empty() ? "none" : names) + ")");
                if (!(value >= 0))
                    throw std::invalid_argument("policy parameter '" + key + "' must be >= 0");
            }
            return e.make(params);
        }
        known += (known.empty() ? "" : ", ") + e.info.name;
    }
    throw std::invalid_argument("unknown policy '" + std::string(name) + "' (known: " + known + ")");
}

}  // namespace pvgpu
