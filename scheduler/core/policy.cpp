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

// Hierarchical share of every leaf in `backlogged` (indexed by entity id):
// the product over the leaf and its ancestors of w / sum(w of backlogged siblings),
// where an inner node is backlogged when a backlogged leaf sits below it.
std::vector<double> hierarchical_shares(const EntityTree& tree, const std::vector<EntityId>& backlogged) {
    std::vector<char> active(tree.id_bound(), 0);
    for (EntityId leaf : backlogged)
        for (EntityId n = leaf; n != kRootEntity && !active[n]; n = tree.get(n).parent) active[n] = 1;
    std::vector<double> share(tree.id_bound(), 0.0);
    for (EntityId leaf : backlogged) {
        double s = 1.0;
        for (EntityId n = leaf; n != kRootEntity; n = tree.get(n).parent) {
            double sum = 0;
            for (EntityId sib : tree.get(tree.get(n).parent).children)
                if (active[sib]) sum += tree.get(sib).weight;
            s *= tree.get(n).weight / sum;
        }
        share[leaf] = s;
    }
    return share;
}

void set_mode_counted(PolicyContext& ctx, ChannelId ch, ChannelMode mode, std::uint64_t& shadow_events) {
    if (ctx.mode(ch) == mode) return;
    if (mode == ChannelMode::Shadowed) ++shadow_events;
    ctx.set_mode(ch, mode);
}

bool has_work_unless_killed(const PolicyContext& ctx, ChannelId ch) {
    if (ctx.gpu().read_status(ch) != PVGPU_CHAN_STATUS_OK) return false;
    return ctx.gpu().pending(ch) || ctx.held(ch) > 0;
}

double param_or_default(const PolicyParams& p, const PolicyInfo& info, const std::string& name) {
    if (auto it = p.find(name); it != p.end()) return it->second;
    for (const auto& [n, def, doc] : info.params)
        if (n == name) return def;
    throw std::logic_error("policy " + info.name + " has no parameter " + name);
}

double ParamReader::positive(const std::string& name) const {
    const double v = (*this)(name);
    if (v <= 0) throw std::invalid_argument(info.name + ": " + name + " must be > 0");
    return v;
}

std::vector<std::string> policy_warnings(std::string_view name, const PolicyParams& params) {
    std::vector<std::string> w;
    for (const auto& e : entries())
        if (e.info.name == name)
            for (const std::string& p : e.info.ignored)
                if (params.count(p))
                    w.push_back("policy " + e.info.name + ": parameter '" + p + "' is deprecated and ignored");
    return w;
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
