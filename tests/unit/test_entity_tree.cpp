// The entity tree (scheduler/core/entity_tree.hpp): structure, ids, weights,
// names, the leaves-only rule for channels, change notifications, traversal.
#include <catch2/catch.hpp>

#include <ostream>
#include <string>
#include <utility>
#include <vector>

#include "core/entity_tree.hpp"

using namespace pvgpu;

namespace {

struct Recorded {
    EntityTree::Change change;
    EntityId id;
    bool operator==(const Recorded& o) const { return change == o.change && id == o.id; }
};

std::ostream& operator<<(std::ostream& os, const Recorded& r) {
    const char* c = r.change == EntityTree::Change::Added     ? "Added"
                    : r.change == EntityTree::Change::Removed ? "Removed"
                                                              : "Weight";
    return os << c << "(" << r.id << ")";
}

// Pre-order list of paths ("" for the root).
std::vector<std::string> walk(const EntityTree& t) {
    std::vector<std::string> out;
    t.for_each([&](const Entity& e) { out.push_back(t.path(e.id)); });
    return out;
}

}  // namespace

TEST_CASE("entity tree: a new tree holds only the root", "[entity_tree]") {
    EntityTree t;
    CHECK(t.size() == 1);
    CHECK(t.id_bound() == 1);
    REQUIRE(t.valid(kRootEntity));
    const Entity& r = t.get(kRootEntity);
    CHECK(r.id == kRootEntity);
    CHECK(r.kind == EntityKind::Root);
    CHECK(r.depth == 0);
    CHECK(r.parent == kNoEntity);
    CHECK(r.children.empty());
    CHECK(t.path(kRootEntity).empty());
    CHECK(t.find_path("") == kRootEntity);
    CHECK(t.is_leaf(kRootEntity));
    CHECK_FALSE(t.valid(1));
    CHECK_FALSE(t.valid(kNoEntity));
    CHECK_THROWS_AS(t.get(1), TreeError);
    CHECK(to_string(EntityKind::Root) == "root");
    CHECK(to_string(EntityKind::Vm) == "vm");
    CHECK(to_string(EntityKind::Task) == "task");
}

TEST_CASE("entity tree: add, find_path, path, remove", "[entity_tree]") {
    EntityTree t;
    EntityId vm1 = t.add(kRootEntity, "vm1", EntityKind::Vm, 200);
    EntityId vm2 = t.add(kRootEntity, "vm2", EntityKind::Vm);
    EntityId bench = t.add(vm1, "bench", EntityKind::Task, 300);
    EntityId host = t.add(kRootEntity, "host-task", EntityKind::Task);

    // Ids are handed out densely from 1 in a fresh tree.
    CHECK(vm1 == 1);
    CHECK(vm2 == 2);
    CHECK(bench == 3);
    CHECK(host == 4);
    CHECK(t.size() == 5);
    CHECK(t.id_bound() == 5);

    const Entity& b = t.get(bench);
    CHECK(b.name == "bench");
    CHECK(b.parent == vm1);
    CHECK(b.kind == EntityKind::Task);
    CHECK(b.weight == 300);
    CHECK(b.depth == 2);
    CHECK(b.alive);
    CHECK(t.get(vm2).weight == PVGPU_WEIGHT_DEFAULT);
    CHECK(t.get(vm1).children == std::vector<EntityId>{bench});
    CHECK(t.get(kRootEntity).children == std::vector<EntityId>{vm1, vm2, host});
    CHECK_FALSE(t.is_leaf(vm1));
    CHECK(t.is_leaf(vm2));

    CHECK(t.path(bench) == "vm1/bench");
    CHECK(t.path(vm1) == "vm1");
    CHECK(t.find_path("vm1/bench") == bench);
    CHECK(t.find_path("vm1") == vm1);
    CHECK(t.find_path("host-task") == host);
    CHECK_FALSE(t.find_path("vm2/bench").has_value());
    CHECK_FALSE(t.find_path("bench").has_value());
    CHECK_FALSE(t.find_path("vm1/bench/x").has_value());
    CHECK_FALSE(t.find_path("/vm1").has_value());
    CHECK_FALSE(t.find_path("vm1//bench").has_value());
    CHECK(t.find_child(vm1, "bench") == bench);
    CHECK_FALSE(t.find_child(vm2, "bench").has_value());

    t.remove(bench);
    CHECK_FALSE(t.valid(bench));
    CHECK(t.size() == 4);
    CHECK(t.id_bound() == 5);  // id space does not shrink
    CHECK(t.get(vm1).children.empty());
    CHECK(t.is_leaf(vm1));
    CHECK_FALSE(t.find_path("vm1/bench").has_value());
    CHECK_THROWS_AS(t.get(bench), TreeError);
    CHECK_THROWS_AS(t.remove(bench), TreeError);       // already gone
    CHECK_THROWS_AS(t.remove(kRootEntity), TreeError);  // never
    CHECK_THROWS_AS(t.remove(99), TreeError);

    // Removing a middle sibling keeps the others in order.
    t.remove(vm2);
    CHECK(t.get(kRootEntity).children == std::vector<EntityId>{vm1, host});
}

TEST_CASE("entity tree: ids are reused after removal", "[entity_tree]") {
    EntityTree t;
    EntityId a = t.add(kRootEntity, "a", EntityKind::Vm);
    EntityId b = t.add(kRootEntity, "b", EntityKind::Vm);
    EntityId c = t.add(a, "c", EntityKind::Task, 7);
    REQUIRE(t.id_bound() == 4);
    t.attach_channel(c);
    t.detach_channel(c);
    t.remove(c);
    t.remove(b);

    // Two ids are free; two adds take them back without growing the id space.
    EntityId d = t.add(kRootEntity, "d", EntityKind::Task, 42);
    EntityId e = t.add(kRootEntity, "e", EntityKind::Task);
    CHECK(((d == b && e == c) || (d == c && e == b)));
    CHECK(t.id_bound() == 4);
    CHECK(t.size() == 4);

    // A reused slot carries nothing of its previous life.
    const Entity& de = t.get(d);
    CHECK(de.name == "d");
    CHECK(de.parent == kRootEntity);
    CHECK(de.weight == 42);
    CHECK(de.depth == 1);
    CHECK(de.channels == 0);
    CHECK(de.children.empty());
    CHECK(de.kind == EntityKind::Task);
    CHECK(t.path(d) == "d");
    CHECK(t.find_path("a/c") == std::nullopt);
    // A third add needs a fresh id.
    EntityId f = t.add(kRootEntity, "f", EntityKind::Task);
    CHECK(f == 4);
    CHECK(t.id_bound() == 5);
}

TEST_CASE("entity tree: weights must lie in 1..10000", "[entity_tree]") {
    EntityTree t;
    CHECK_THROWS_AS(t.add(kRootEntity, "zero", EntityKind::Vm, 0), TreeError);
    CHECK_THROWS_AS(t.add(kRootEntity, "big", EntityKind::Vm, 10001), TreeError);
    CHECK_THROWS_AS(t.add(kRootEntity, "huge", EntityKind::Vm, UINT32_MAX), TreeError);
    CHECK(t.size() == 1);  // refused adds leave nothing behind
    EntityId lo = t.add(kRootEntity, "lo", EntityKind::Vm, 1);
    EntityId hi = t.add(kRootEntity, "hi", EntityKind::Vm, 10000);
    CHECK(t.get(lo).weight == 1);
    CHECK(t.get(hi).weight == 10000);

    t.set_weight(lo, 10000);
    CHECK(t.get(lo).weight == 10000);
    t.set_weight(lo, 1);
    CHECK(t.get(lo).weight == 1);
    CHECK_THROWS_AS(t.set_weight(lo, 0), TreeError);
    CHECK_THROWS_AS(t.set_weight(lo, 10001), TreeError);
    CHECK(t.get(lo).weight == 1);  // unchanged by the refused updates
    CHECK_THROWS_AS(t.set_weight(kRootEntity, 100), TreeError);
    CHECK_THROWS_AS(t.set_weight(77, 100), TreeError);

    CHECK_NOTHROW(EntityTree::check_weight(1));
    CHECK_NOTHROW(EntityTree::check_weight(10000));
    CHECK_THROWS_AS(EntityTree::check_weight(0), TreeError);
    CHECK_THROWS_AS(EntityTree::check_weight(10001), TreeError);
}

TEST_CASE("entity tree: names are validated", "[entity_tree]") {
    EntityTree t;
    CHECK_THROWS_AS(t.add(kRootEntity, "", EntityKind::Vm), TreeError);
    CHECK_THROWS_AS(t.add(kRootEntity, "a/b", EntityKind::Vm), TreeError);
    CHECK_THROWS_AS(t.add(kRootEntity, "has space", EntityKind::Vm), TreeError);
    CHECK_THROWS_AS(t.add(kRootEntity, "tab\t", EntityKind::Vm), TreeError);
    CHECK_THROWS_AS(t.add(kRootEntity, "caf\xc3\xa9", EntityKind::Vm), TreeError);
    CHECK_THROWS_AS(t.add(kRootEntity, std::string("nul\0x", 5), EntityKind::Vm), TreeError);
    CHECK_THROWS_AS(t.add(kRootEntity, std::string(65, 'x'), EntityKind::Vm), TreeError);
    CHECK_THROWS_AS(t.add(kRootEntity, "root", EntityKind::Root), TreeError);  // one root only
    CHECK(t.size() == 1);

    // Every allowed character class, and exactly 64 bytes.
    EntityId ok = t.add(kRootEntity, "Vm-1_a.b:c9", EntityKind::Vm);
    CHECK(t.find_path("Vm-1_a.b:c9") == ok);
    EntityId long64 = t.add(kRootEntity, std::string(64, 'y'), EntityKind::Task);
    CHECK(t.get(long64).name.size() == 64);
    // A pid hint as a name.
    CHECK_NOTHROW(t.add(ok, "4242", EntityKind::Task));

    CHECK_NOTHROW(EntityTree::check_name("a"));
    CHECK_THROWS_AS(EntityTree::check_name(""), TreeError);
    CHECK_THROWS_AS(EntityTree::check_name("x y"), TreeError);
}

TEST_CASE("entity tree: duplicate sibling names are refused", "[entity_tree]") {
    EntityTree t;
    EntityId vm1 = t.add(kRootEntity, "vm1", EntityKind::Vm);
    EntityId vm2 = t.add(kRootEntity, "vm2", EntityKind::Vm);
    EntityId a1 = t.add(vm1, "app", EntityKind::Task);
    CHECK_THROWS_AS(t.add(kRootEntity, "vm1", EntityKind::Vm), TreeError);
    CHECK_THROWS_AS(t.add(vm1, "app", EntityKind::Task), TreeError);
    CHECK_THROWS_AS(t.add(vm1, "app", EntityKind::Vm), TreeError);  // kind does not matter
    CHECK(t.size() == 4);
    // The same name under another parent is fine, and names are case sensitive.
    EntityId a2 = t.add(vm2, "app", EntityKind::Task);
    EntityId a3 = t.add(vm1, "App", EntityKind::Task);
    CHECK(a2 != a1);
    CHECK(t.find_path("vm1/app") == a1);
    CHECK(t.find_path("vm2/app") == a2);
    CHECK(t.find_path("vm1/App") == a3);
    // After removal the name is free again.
    t.remove(a1);
    EntityId a4 = t.add(vm1, "app", EntityKind::Task);
    CHECK(t.find_path("vm1/app") == a4);
}

TEST_CASE("entity tree: channels attach only to leaves", "[entity_tree]") {
    EntityTree t;
    EntityId vm = t.add(kRootEntity, "vm", EntityKind::Vm);
    EntityId task = t.add(vm, "task", EntityKind::Task);

    // Root and inner nodes refuse channels.
    CHECK_THROWS_AS(t.attach_channel(kRootEntity), TreeError);
    CHECK_THROWS_AS(t.attach_channel(vm), TreeError);
    CHECK_THROWS_AS(t.attach_channel(42), TreeError);
    CHECK(t.get(kRootEntity).channels == 0);
    CHECK(t.get(vm).channels == 0);

    t.attach_channel(task);
    t.attach_channel(task);
    CHECK(t.get(task).channels == 2);

    // A leaf with channels cannot become an inner node, nor be removed.
    CHECK_THROWS_AS(t.add(task, "child", EntityKind::Task), TreeError);
    CHECK(t.get(task).children.empty());
    CHECK(t.size() == 3);
    CHECK_THROWS_AS(t.remove(task), TreeError);
    CHECK(t.valid(task));
    // An entity with children cannot be removed either.
    CHECK_THROWS_AS(t.remove(vm), TreeError);
    CHECK(t.valid(vm));

    t.detach_channel(task);
    CHECK(t.get(task).channels == 1);
    CHECK_THROWS_AS(t.remove(task), TreeError);
    t.detach_channel(task);
    CHECK(t.get(task).channels == 0);
    CHECK_THROWS_AS(t.detach_channel(task), TreeError);  // nothing left to detach
    CHECK(t.get(task).channels == 0);

    // Without channels it may get children, after which it refuses channels.
    EntityId sub = t.add(task, "sub", EntityKind::Task);
    CHECK_THROWS_AS(t.attach_channel(task), TreeError);
    t.remove(sub);
    t.remove(task);
    t.remove(vm);
    CHECK(t.size() == 1);
}

TEST_CASE("entity tree: the listener sees Added, Removed and Weight", "[entity_tree]") {
    EntityTree t;
    std::vector<Recorded> log;
    std::vector<bool> valid_when_notified;
    t.set_listener([&](EntityTree::Change c, EntityId id) {
        log.push_back({c, id});
        valid_when_notified.push_back(t.valid(id));
    });
    using C = EntityTree::Change;

    EntityId vm = t.add(kRootEntity, "vm", EntityKind::Vm);
    EntityId task = t.add(vm, "task", EntityKind::Task, 5);
    t.set_weight(task, 6);
    t.set_weight(vm, 700);
    t.remove(task);
    // Refused requests notify nothing.
    CHECK_THROWS(t.add(vm, "bad name", EntityKind::Task));
    CHECK_THROWS(t.set_weight(vm, 0));
    CHECK_THROWS(t.remove(kRootEntity));
    CHECK_THROWS(t.remove(task));
    t.remove(vm);

    std::vector<Recorded> expected{{C::Added, vm},    {C::Added, task},  {C::Weight, task},
                                   {C::Weight, vm},   {C::Removed, task}, {C::Removed, vm}};
    CHECK(log == expected);
    // Added arrives once the entity exists, so a policy can read it.
    REQUIRE(valid_when_notified.size() == 6);
    CHECK(valid_when_notified[0]);
    CHECK(valid_when_notified[1]);

    // With the listener cleared nothing is reported.
    t.set_listener(nullptr);
    t.add(kRootEntity, "quiet", EntityKind::Vm);
    CHECK(log.size() == 6);
}

TEST_CASE("entity tree: for_each is a depth-first pre-order", "[entity_tree]") {
    EntityTree t;
    EntityId vm1 = t.add(kRootEntity, "vm1", EntityKind::Vm);
    EntityId vm2 = t.add(kRootEntity, "vm2", EntityKind::Vm);
    t.add(vm1, "a", EntityKind::Task);
    EntityId nested = t.add(vm1, "nested", EntityKind::Vm);
    t.add(nested, "x", EntityKind::Task);
    t.add(vm1, "b", EntityKind::Task);
    t.add(vm2, "c", EntityKind::Task);
    t.add(kRootEntity, "host", EntityKind::Task);

    std::vector<std::string> expected{"",  "vm1",  "vm1/a", "vm1/nested", "vm1/nested/x",
                                      "vm1/b", "vm2", "vm2/c", "host"};
    CHECK(walk(t) == expected);

    // Removed entities are skipped; a reused id appears where it now lives.
    EntityId x = *t.find_path("vm1/nested/x");
    t.remove(x);
    EntityId y = t.add(vm2, "y", EntityKind::Task);
    CHECK(y == x);
    std::vector<std::string> expected2{"", "vm1", "vm1/a", "vm1/nested", "vm1/b",
                                       "vm2", "vm2/c", "vm2/y", "host"};
    CHECK(walk(t) == expected2);

    std::size_t n = 0;
    t.for_each([&](const Entity& e) {
        CHECK(e.alive);
        ++n;
    });
    CHECK(n == t.size());
}

TEST_CASE("entity tree: depth and nested VMs at depth 3 and more", "[entity_tree]") {
    EntityTree t;
    EntityId l1 = t.add(kRootEntity, "l1", EntityKind::Vm);
    EntityId l2 = t.add(l1, "l2", EntityKind::Vm);
    EntityId l3 = t.add(l2, "l3", EntityKind::Vm);
    EntityId l4 = t.add(l3, "l4", EntityKind::Vm);
    EntityId leaf = t.add(l4, "1234", EntityKind::Task, 9);
    EntityId side = t.add(l2, "side", EntityKind::Task);

    CHECK(t.get(l1).depth == 1);
    CHECK(t.get(l2).depth == 2);
    CHECK(t.get(l3).depth == 3);
    CHECK(t.get(l4).depth == 4);
    CHECK(t.get(leaf).depth == 5);
    CHECK(t.get(side).depth == 3);
    CHECK(t.path(leaf) == "l1/l2/l3/l4/1234");
    CHECK(t.find_path("l1/l2/l3/l4/1234") == leaf);
    CHECK(t.find_path("l1/l2/side") == side);
    CHECK_FALSE(t.find_path("l1/l2/l3/l4/1234/more").has_value());

    // Channels work at any depth, as long as it is a leaf.
    t.attach_channel(leaf);
    CHECK_THROWS_AS(t.attach_channel(l4), TreeError);
    CHECK_THROWS_AS(t.attach_channel(l3), TreeError);
    t.detach_channel(leaf);

    // Depth follows the parent when a slot is reused elsewhere.
    t.remove(leaf);
    EntityId shallow = t.add(kRootEntity, "shallow", EntityKind::Task);
    CHECK(shallow == leaf);
    CHECK(t.get(shallow).depth == 1);
    // And an emptied inner VM becomes a leaf again.
    CHECK(t.is_leaf(l4));
    t.attach_channel(l4);
    CHECK(t.get(l4).channels == 1);
}
