#include "entity_tree.hpp"

#include <algorithm>

namespace pvgpu {

std::string_view to_string(EntityKind k) {
    switch (k) {
    case EntityKind::Root: return "root";
    case EntityKind::Vm: return "vm";
    case EntityKind::Task: return "task";
    }
    return "?";
}

EntityTree::EntityTree() {
    Entity root;
    root.id = kRootEntity;
    root.kind = EntityKind::Root;
    root.alive = true;
    nodes_.push_back(std::move(root));
    live_ = 1;
}

void EntityTree::check_weight(std::uint32_t weight) {
    if (weight < PVGPU_WEIGHT_MIN || weight > PVGPU_WEIGHT_MAX)
        throw TreeError("weight " + std::to_string(weight) + " out of range " +
                        std::to_string(PVGPU_WEIGHT_MIN) + ".." +
                        std::to_string(PVGPU_WEIGHT_MAX));
}

void EntityTree::check_name(std::string_view name) {
    if (name.empty()) throw TreeError("entity name is empty");
    if (name.size() > 64) throw TreeError("entity name longer than 64 bytes");
    for (char c : name) {
        bool ok = (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') ||
                  c == '-' || c == '_' || c == '.' || c == ':';
        if (!ok)
            throw TreeError("entity name '" + std::string(name) +
                            "' may only contain letters, digits and - _ . :");
    }
}

const Entity& EntityTree::get(EntityId id) const {
    if (!valid(id)) throw TreeError("no entity with id " + std::to_string(id));
    return nodes_[id];
}

Entity& EntityTree::mut(EntityId id) {
    if (!valid(id)) throw TreeError("no entity with id " + std::to_string(id));
    return nodes_[id];
}

EntityId EntityTree::add(EntityId parent, std::string name, EntityKind kind,
                         std::uint32_t weight) {
    if (kind == EntityKind::Root) throw TreeError("there is only one root");
    check_name(name);
    check_weight(weight);
    Entity& p = mut(parent);
    if (p.channels != 0)
        throw TreeError("'" + path(parent) + "' has channels and cannot get children");
    if (find_child(parent, name))
        throw TreeError("duplicate name '" + name + "' under '" + path(parent) + "'");

    EntityId id;
    if (!free_.empty()) {
        id = free_.back();
        free_.pop_back();
    } else {
        id = static_cast<EntityId>(nodes_.size());
        nodes_.emplace_back();
    }
    Entity& e = nodes_[id];
    e = Entity{};
    e.id = id;
    e.parent = parent;
    e.kind = kind;
    e.name = std::move(name);
    e.weight = weight;
    e.depth = nodes_[parent].depth + 1;
    e.alive = true;
    nodes_[parent].children.push_back(id);
    ++live_;
    notify(Change::Added, id);
    return id;
}

void EntityTree::remove(EntityId id) {
    if (id == kRootEntity) throw TreeError("the root cannot be removed");
    Entity& e = mut(id);
    if (!e.children.empty()) throw TreeError("'" + path(id) + "' still has children");
    if (e.channels != 0) throw TreeError("'" + path(id) + "' still has channels");
    notify(Change::Removed, id);
    auto& siblings = nodes_[e.parent].children;
    siblings.erase(std::find(siblings.begin(), siblings.end(), id));
    e.alive = false;
    e.children.clear();
    e.name.clear();
    free_.push_back(id);
    --live_;
}

void EntityTree::set_weight(EntityId id, std::uint32_t weight) {
    if (id == kRootEntity) throw TreeError("the root has no weight");
    check_weight(weight);
    mut(id).weight = weight;
    notify(Change::Weight, id);
}

std::optional<EntityId> EntityTree::find_child(EntityId parent, std::string_view name) const {
    for (EntityId c : get(parent).children)
        if (nodes_[c].name == name) return c;
    return std::nullopt;
}

std::optional<EntityId> EntityTree::find_path(std::string_view p) const {
    EntityId cur = kRootEntity;
    while (!p.empty()) {
        auto slash = p.find('/');
        auto part = p.substr(0, slash);
        auto next = find_child(cur, part);
        if (!next) return std::nullopt;
        cur = *next;
        if (slash == std::string_view::npos) break;
        p.remove_prefix(slash + 1);
    }
    return cur;
}

std::string EntityTree::path(EntityId id) const {
    std::vector<const std::string*> parts;
    for (EntityId cur = id; cur != kRootEntity; cur = get(cur).parent) parts.push_back(&nodes_[cur].name);
    std::string out;
    for (auto it = parts.rbegin(); it != parts.rend(); ++it) {
        if (!out.empty()) out += '/';
        out += **it;
    }
    return out;
}

void EntityTree::for_each(const std::function<void(const Entity&)>& fn) const {
    std::vector<EntityId> stack{kRootEntity};
    while (!stack.empty()) {
        EntityId id = stack.back();
        stack.pop_back();
        const Entity& e = nodes_[id];
        fn(e);
        for (auto it = e.children.rbegin(); it != e.children.rend(); ++it) stack.push_back(*it);
    }
}

void EntityTree::attach_channel(EntityId id) {
    Entity& e = mut(id);
    if (id == kRootEntity) throw TreeError("channels cannot attach to the root");
    if (!e.children.empty()) throw TreeError("'" + path(id) + "' has children; channels attach to leaves");
    ++e.channels;
}

void EntityTree::detach_channel(EntityId id) {
    Entity& e = mut(id);
    if (e.channels == 0) throw TreeError("'" + path(id) + "' has no channel to detach");
    --e.channels;
}

}  // namespace pvgpu
