// The entity tree: root = host; children = VMs and host tasks; a VM's children
// are its guest tasks (keyed by pid hint) and nested VMs.  Depth is unlimited.
// Channels hang off leaves.  Ids are stable for an entity's lifetime and reused
// afterwards, so per-entity policy state can live in plain vectors.
#pragma once

#include <pvgpu/abi.h>

#include <cstdint>
#include <functional>
#include <optional>
#include <stdexcept>
#include <string>
#include <string_view>
#include <vector>

namespace pvgpu {

using EntityId = std::uint32_t;
constexpr EntityId kRootEntity = 0;
constexpr EntityId kNoEntity = UINT32_MAX;

enum class EntityKind { Root, Vm, Task };

std::string_view to_string(EntityKind k);

struct Entity {
    EntityId id = kNoEntity;
    EntityId parent = kNoEntity;
    EntityKind kind = EntityKind::Task;
    std::string name;
    std::uint32_t weight = PVGPU_WEIGHT_DEFAULT;
    std::vector<EntityId> children;
    std::uint32_t channels = 0;  // channels attached (leaves only)
    std::uint32_t depth = 0;     // root = 0
    bool alive = false;
};

// Thrown for requests the tree refuses (bad weight, duplicate name, ...).
class TreeError : public std::runtime_error {
public:
    using std::runtime_error::runtime_error;
};

class EntityTree {
public:
    EntityTree();

    // Tree changes are reported so policies can update their state.
    enum class Change { Added, Removed, Weight };
    using Listener = std::function<void(Change, EntityId)>;
    void set_listener(Listener l) { listener_ = std::move(l); }

    EntityId add(EntityId parent, std::string name, EntityKind kind,
                 std::uint32_t weight = PVGPU_WEIGHT_DEFAULT);
    // Removes a leaf with no channels.
    void remove(EntityId id);
    void set_weight(EntityId id, std::uint32_t weight);

    bool valid(EntityId id) const { return id < nodes_.size() && nodes_[id].alive; }
    const Entity& get(EntityId id) const;
    std::optional<EntityId> find_child(EntityId parent, std::string_view name) const;
    // "vm1/bench" from the root down; "" is the root.
    std::optional<EntityId> find_path(std::string_view path) const;
    std::string path(EntityId id) const;
    bool is_leaf(EntityId id) const { return get(id).children.empty(); }

    // Capacity of id space: every live id is < id_bound().
    std::size_t id_bound() const { return nodes_.size(); }
    std::size_t size() const { return live_; }

    // Depth-first pre-order over live entities.
    void for_each(const std::function<void(const Entity&)>& fn) const;

    // Used by the scheduler to keep channel counts; refuses non-leaves.
    void attach_channel(EntityId id);
    void detach_channel(EntityId id);

    static void check_weight(std::uint32_t weight);
    static void check_name(std::string_view name);

private:
    Entity& mut(EntityId id);
    void notify(Change c, EntityId id) {
        if (listener_) listener_(c, id);
    }

    std::vector<Entity> nodes_;
    std::vector<EntityId> free_;
    std::size_t live_ = 0;
    Listener listener_;
};

}  // namespace pvgpu
