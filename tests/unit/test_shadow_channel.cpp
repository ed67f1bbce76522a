// Shadow channels (scheduler/core/shadow_channel.hpp) over the simulated GPU,
// and the Scheduler's mapping control (remap delay, traps, errors, policy
// changes) with a trivial policy written here.
#include <catch2/catch.hpp>

#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

#include "core/scheduler.hpp"
#include "core/shadow_channel.hpp"
#include "sim/event_loop.hpp"
#include "sim/sim_gpu.hpp"

using namespace pvgpu;

namespace {

constexpr Duration us(double v) { return static_cast<Duration>(v * kMicrosecond); }
constexpr Duration ms(double v) { return static_cast<Duration>(v * kMillisecond); }

// One GPU channel seen through a ShadowChannel, as a guest would use it:
// write entries into the ring, then store IB_PUT.
struct ShadowRig {
    explicit ShadowRig(sim::SimGpuConfig cfg = {})
        : gpu(loop, loop, cfg),
          ch(gpu.create_channel()),
          sc(gpu, ch, [this](ChannelId c, std::uint32_t put) {
              traps.emplace_back(c, put);
              gpu_put_at_trap.push_back(gpu.read_ib_put(c));
              if (trap_hook) trap_hook(put);
          }) {
        gpu.set_fence_watcher(ch, [this](std::uint32_t f) {
            ++completed;
            last_fence = f;
        });
    }

    // Writes `n` kernels of `kernel` ns after what the guest last wrote and
    // stores the new IB_PUT.  Returns whether the store trapped.
    bool write(std::uint32_t n, Duration kernel = ms(1)) {
        std::uint32_t put = sc.guest_read_put();
        for (std::uint32_t i = 0; i < n; ++i, ++put) {
            pvgpu_ring_entry& e = sc.ring()->entries[put & PVGPU_RING_MASK];
            e.payload = static_cast<std::uint64_t>(kernel);
            e.fence = put + 1;
            e.flags = 0;
        }
        written += n;
        return sc.guest_write_put(put);
    }
    void drain() { loop.run_until(loop.now() + 10 * kSecond); }

    sim::EventLoop loop;
    sim::SimGpu gpu;
    ChannelId ch;
    std::vector<std::pair<ChannelId, std::uint32_t>> traps;
    std::vector<std::uint32_t> gpu_put_at_trap;
    std::function<void(std::uint32_t)> trap_hook;
    ShadowChannel sc;
    std::uint32_t written = 0;
    std::uint32_t completed = 0;
    std::uint32_t last_fence = 0;
};

}  // namespace

TEST_CASE("shadow channel: direct writes reach the GPU", "[shadow]") {
    ShadowRig r;
    CHECK(r.sc.id() == r.ch);
    CHECK(r.sc.mode() == ChannelMode::Direct);
    CHECK(to_string(ChannelMode::Direct) == "direct");
    CHECK(to_string(ChannelMode::Trapped) == "trapped");
    CHECK(to_string(ChannelMode::Shadowed) == "shadowed");

    CHECK_FALSE(r.write(3));  // no exit
    CHECK(r.gpu.read_ib_put(r.ch) == 3);
    CHECK(r.sc.guest_read_put() == 3);
    CHECK(r.sc.held() == 0);
    CHECK(r.gpu.pending(r.ch));
    CHECK(r.sc.guest_read_get() == 1);  // the GPU fetched the first entry
    CHECK(r.traps.empty());
    r.drain();
    CHECK(r.completed == 3);
    CHECK(r.sc.guest_read_fence() == 3);
    CHECK(r.sc.guest_read_get() == 3);
    CHECK(r.sc.take_released() == 0);  // nothing went through a release
}

TEST_CASE("shadow channel: trapped writes are reported once each, then forwarded", "[shadow]") {
    ShadowRig r;
    r.sc.set_trapped();
    CHECK(r.sc.mode() == ChannelMode::Trapped);
    CHECK(r.write(1));
    CHECK(r.write(2));
    CHECK(r.write(1));
    REQUIRE(r.traps.size() == 3);
    CHECK(r.traps[0] == std::make_pair(r.ch, 1u));
    CHECK(r.traps[1] == std::make_pair(r.ch, 3u));
    CHECK(r.traps[2] == std::make_pair(r.ch, 4u));
    // The handler runs before the write is forwarded.
    CHECK(r.gpu_put_at_trap == std::vector<std::uint32_t>{0, 1, 3});
    CHECK(r.gpu.read_ib_put(r.ch) == 4);
    CHECK(r.sc.held() == 0);
    r.drain();
    CHECK(r.completed == 4);
    CHECK(r.last_fence == 4);

    // Back to direct: no more traps.
    r.sc.set_direct();
    CHECK_FALSE(r.write(2));
    CHECK(r.traps.size() == 3);
    CHECK(r.gpu.read_ib_put(r.ch) == 6);
    // A handler-less channel still forwards trapped writes.
    ShadowChannel bare(r.gpu, r.ch, nullptr);
    CHECK(bare.guest_read_put() == 6);  // starts from the GPU's IB_PUT
    bare.set_trapped();
    CHECK(bare.guest_write_put(7));
    CHECK(r.gpu.read_ib_put(r.ch) == 7);
}

TEST_CASE("shadow channel: shadowed writes are held and IB_GET is frozen", "[shadow]") {
    ShadowRig r;
    r.write(2);  // t=0: entry 1 on the engine, IB_GET 1
    r.sc.set_shadowed();
    CHECK(r.sc.mode() == ChannelMode::Shadowed);
    CHECK_FALSE(r.write(3));  // no exit
    CHECK_FALSE(r.write(1));
    CHECK(r.traps.empty());
    CHECK(r.gpu.read_ib_put(r.ch) == 2);  // the GPU saw nothing
    CHECK(r.sc.guest_read_put() == 6);    // the guest sees its own stores
    CHECK(r.sc.held() == 4);
    CHECK(r.sc.guest_read_get() == 1);

    r.loop.run_until(ms(100));
    // The GPU finished what it had (2 entries); the guest's IB_GET did not move
    // but FENCE (semaphore memory, never remapped) did.
    CHECK(r.completed == 2);
    CHECK(r.gpu.read_ib_get(r.ch) == 2);
    CHECK(r.sc.guest_read_get() == 1);
    CHECK(r.sc.guest_read_fence() == 2);
    CHECK_FALSE(r.gpu.pending(r.ch));
    CHECK(r.sc.held() == 4);

    // Shadowing again does not refreeze at the newer value.
    r.sc.set_shadowed();
    CHECK(r.sc.guest_read_get() == 1);
    CHECK(r.sc.take_released() == 0);
}

TEST_CASE("shadow channel: set_direct from shadowed releases everything once", "[shadow]") {
    ShadowRig r;
    r.write(2);
    r.sc.set_shadowed();
    r.write(5);
    r.loop.run_until(ms(50));
    REQUIRE(r.completed == 2);
    REQUIRE(r.sc.held() == 5);

    r.sc.set_direct();
    CHECK(r.sc.mode() == ChannelMode::Direct);
    CHECK(r.gpu.read_ib_put(r.ch) == 7);
    CHECK(r.sc.held() == 0);
    CHECK(r.sc.take_released() == 5);
    CHECK(r.sc.take_released() == 0);
    CHECK(r.traps.empty());  // the copy is not a guest store
    CHECK(r.sc.guest_read_get() == r.gpu.read_ib_get(r.ch));
    r.drain();
    CHECK(r.completed == r.written);
    CHECK(r.completed == 7);
    CHECK(r.last_fence == 7);
    // Going direct again releases nothing more.
    r.sc.set_direct();
    CHECK(r.sc.take_released() == 0);
    CHECK(r.gpu.read_ib_put(r.ch) == 7);
}

TEST_CASE("shadow channel: set_trapped from shadowed releases everything, then traps", "[shadow]") {
    ShadowRig r;
    r.sc.set_shadowed();
    r.write(4);
    r.write(4);
    REQUIRE(r.sc.held() == 8);
    r.sc.set_trapped();
    CHECK(r.sc.mode() == ChannelMode::Trapped);
    CHECK(r.gpu.read_ib_put(r.ch) == 8);
    CHECK(r.sc.held() == 0);
    CHECK(r.sc.take_released() == 8);
    CHECK(r.traps.empty());
    CHECK(r.write(2));  // now stores exit
    CHECK(r.traps.size() == 1);
    CHECK(r.gpu.read_ib_put(r.ch) == 10);
    r.drain();
    CHECK(r.completed == 10);
    CHECK(r.completed == r.written);
}

TEST_CASE("shadow channel: partial release hands exactly what was asked", "[shadow]") {
    ShadowRig r;
    r.sc.set_shadowed();
    r.write(10);
    REQUIRE(r.sc.held() == 10);
    CHECK(r.sc.release(3) == 3);
    CHECK(r.gpu.read_ib_put(r.ch) == 3);
    CHECK(r.sc.held() == 7);
    CHECK(r.sc.mode() == ChannelMode::Shadowed);  // still shadowed
    CHECK(r.sc.guest_read_put() == 10);
    CHECK(r.sc.release(0) == 0);
    CHECK(r.gpu.read_ib_put(r.ch) == 3);
    r.loop.run_until(ms(100));
    CHECK(r.completed == 3);  // only the released ones ran
    CHECK(r.sc.release(1) == 1);
    CHECK(r.sc.take_released() == 4);
    CHECK(r.sc.release(100) == 6);  // capped by what is held
    CHECK(r.sc.held() == 0);
    CHECK(r.sc.release(5) == 0);
    CHECK(r.sc.take_released() == 6);
    CHECK(r.sc.take_released() == 0);
    r.drain();
    CHECK(r.completed == 10);
    CHECK(r.last_fence == 10);
    // Unshadowing after everything was released hands nothing twice.
    r.sc.set_direct();
    CHECK(r.sc.take_released() == 0);
    CHECK(r.gpu.read_ib_put(r.ch) == 10);
    r.drain();
    CHECK(r.completed == 10);
}

TEST_CASE("shadow channel: a trap handler that shadows the channel holds that write", "[shadow]") {
    ShadowRig r;
    r.sc.set_trapped();
    r.trap_hook = [&](std::uint32_t) { r.sc.set_shadowed(); };
    CHECK(r.write(1));  // trapped: the vCPU exited
    CHECK(r.traps.size() == 1);
    CHECK(r.sc.mode() == ChannelMode::Shadowed);
    CHECK(r.gpu.read_ib_put(r.ch) == 0);  // not forwarded
    CHECK(r.sc.held() == 1);
    CHECK(r.sc.guest_read_put() == 1);
    r.trap_hook = nullptr;
    CHECK_FALSE(r.write(2));  // shadowed now: no exit
    CHECK(r.traps.size() == 1);
    CHECK(r.sc.held() == 3);
    r.loop.run_until(ms(10));
    CHECK(r.completed == 0);
    r.sc.set_direct();
    CHECK(r.sc.take_released() == 3);
    r.drain();
    CHECK(r.completed == 3);
}

TEST_CASE("shadow channel: a long mix of modes loses and doubles nothing", "[shadow]") {
    ShadowRig r;
    std::uint32_t trapped_writes = 0, released = 0, written_while_shadowed = 0;
    // 60 rounds of: a mode change, a few writes, some GPU time, sometimes a
    // partial release.  Kernels of 50 us so the GPU keeps up; ring never full.
    for (int i = 0; i < 60; ++i) {
        switch (i % 5) {
        case 0: r.sc.set_shadowed(); break;
        case 1: CHECK(r.sc.release(2) <= 2); break;  // counted by take_released() below
        case 2: r.sc.set_trapped(); break;
        case 3: r.sc.set_shadowed(); break;
        case 4: (i % 2) ? r.sc.set_direct() : r.sc.set_trapped(); break;
        }
        std::uint32_t n = 1 + static_cast<std::uint32_t>(i % 3);
        ChannelMode m = r.sc.mode();
        if (m == ChannelMode::Shadowed) written_while_shadowed += n;
        bool trapped = r.write(n, us(50));
        CHECK(trapped == (m == ChannelMode::Trapped));
        if (trapped) ++trapped_writes;
        r.loop.run_until(r.loop.now() + us(120));
        released += r.sc.take_released();
    }
    r.sc.set_direct();
    released += r.sc.take_released();
    r.drain();
    // 60 rounds of 1,2,3,1,2,3... entries: 20 x 6 = 120.
    CHECK(r.written == 120);
    CHECK(r.completed == 120);
    CHECK(r.last_fence == 120);
    CHECK(r.gpu.read_ib_put(r.ch) == 120);
    CHECK(r.sc.held() == 0);
    CHECK(r.traps.size() == trapped_writes);
    // Rounds 2, 7, 12, ... trap (12 of them) and rounds 4, 14, 24, ... too (6).
    CHECK(trapped_writes == 12 + 6);
    // Everything written while shadowed was handed over exactly once, by
    // partial releases or by unshadowing: rounds i%5 in {0,1,3}, 36 rounds
    // whose i%3 cycles evenly (i%15 covers all pairs): 12 x (1+2+3) = 72.
    CHECK(written_while_shadowed == 72);
    CHECK(released == written_while_shadowed);
}

TEST_CASE("shadow channel: releasing into a dead channel hands nothing twice", "[shadow]") {
    sim::SimGpuConfig cfg;
    cfg.watchdog = ms(10);
    ShadowRig r(cfg);
    r.write(1, ms(50));  // a runaway kernel
    r.sc.set_shadowed();
    r.write(3);
    REQUIRE(r.sc.held() == 3);
    r.loop.run_until(ms(20));  // the watchdog killed the channel at 10 ms
    REQUIRE(r.gpu.read_status(r.ch) == PVGPU_CHAN_STATUS_ERROR);
    // The GPU ignores doorbells now.  Until the error interrupt is handled
    // the host cannot tell: a release loop must still end and never report
    // more than the 3 held entries handed over.
    std::uint32_t total = 0;
    for (int i = 0; i < 10; ++i) total += r.sc.release(2);
    CHECK(total <= 3);
    CHECK(r.sc.take_released() <= 3);
    // Once the interrupt is handled (the scheduler calls set_dead), nothing more.
    r.write(2);
    r.sc.set_dead();
    CHECK(r.sc.release(2) == 0);
    CHECK(r.sc.take_released() == 0);
    CHECK(r.sc.held() == 2);
}

// A shadowed page holds work; a store more than a ring ahead of the GPU's GET
// is not work, and holding it would keep a broken channel alive until some
// later release hands the garbage over.  It goes through: the GPU rejects it.
TEST_CASE("shadow channel: a shadowed store no ring could hold reaches the GPU, which rejects it", "[shadow]") {
    ShadowRig r;
    int held_reports = 0;
    ShadowChannel sc(r.gpu, r.ch, nullptr, [&](ChannelId, std::uint32_t) { ++held_reports; });
    sc.set_shadowed();
    CHECK_FALSE(sc.guest_write_put(PVGPU_RING_ENTRIES));  // a full ring: real work, held
    CHECK(held_reports == 1);
    CHECK(sc.held() == PVGPU_RING_ENTRIES);
    CHECK(r.gpu.read_ib_put(r.ch) == 0);
    CHECK(r.gpu.read_status(r.ch) == PVGPU_CHAN_STATUS_OK);
    sc.guest_write_put(1000);  // 1000 entries past a GET of 0
    CHECK(held_reports == 1);
    CHECK(r.gpu.read_status(r.ch) == PVGPU_CHAN_STATUS_ERROR);
    CHECK(sc.held() == 0);  // nothing left for a release to hand over
    CHECK(sc.release(PVGPU_RING_ENTRIES) == 0);
}

TEST_CASE("shadow channel: a trap handler that shadows still lets a store no ring could hold through",
          "[shadow]") {
    ShadowRig r;
    r.trap_hook = [&](std::uint32_t) { r.sc.set_shadowed(); };
    r.sc.set_trapped();
    CHECK(r.write(3));
    CHECK(r.sc.mode() == ChannelMode::Shadowed);
    CHECK(r.sc.held() == 3);  // real work: held
    r.sc.set_trapped();              // releases the 3
    CHECK(r.sc.guest_write_put(2));  // behind the GPU's IB_PUT: not held work
    CHECK(r.sc.held() == 0);         // held() would have wrapped to 2^32 - 1
    CHECK(r.gpu.read_ib_put(r.ch) == 2);  // the GPU judged it (within a ring of GET: taken)
    CHECK(r.gpu.read_status(r.ch) == PVGPU_CHAN_STATUS_OK);
    REQUIRE(r.sc.mode() == ChannelMode::Shadowed);  // the hook shadowed it again
    CHECK_FALSE(r.sc.guest_write_put(2 + PVGPU_RING_ENTRIES + 1));
    CHECK(r.gpu.read_status(r.ch) == PVGPU_CHAN_STATUS_ERROR);
    CHECK(r.sc.held() == 0);
}

// ---------------------------------------------------------------------------
// Scheduler-level mapping control with a minimal policy.

namespace {

// Everything the policy saw, kept outside it so it survives set_policy().
struct PolicyLog {
    int starts = 0, stops = 0, engine_changes = 0;
    std::vector<std::pair<ChannelId, EntityId>> added, removed;
    std::vector<std::pair<ChannelId, std::uint32_t>> trapped, fences, errors, released;
    std::vector<std::pair<EntityTree::Change, EntityId>> tree;
};

class TestPolicy final : public Policy {
public:
    TestPolicy(PolicyLog& log, std::string name = "test") : log_(&log), name_(std::move(name)) {}
    std::string_view name() const override { return name_; }
    void start(PolicyContext& ctx) override {
        ctx_ = &ctx;
        ++log_->starts;
    }
    void stop() override { ++log_->stops; }  // deliberately leaves modes alone
    void channel_added(ChannelId ch, EntityId leaf) override {
        log_->added.emplace_back(ch, leaf);
        if (throw_on_add) throw std::runtime_error("policy bug");
    }
    void channel_removed(ChannelId ch, EntityId leaf) override {
        log_->removed.emplace_back(ch, leaf);
        if (throw_on_remove) throw std::runtime_error("policy bug");
    }
    void tree_changed(EntityTree::Change c, EntityId id) override { log_->tree.emplace_back(c, id); }
    void doorbell_trapped(ChannelId ch, std::uint32_t put) override {
        log_->trapped.emplace_back(ch, put);
        if (on_trap) on_trap(*ctx_, ch, put);
    }
    void fence(ChannelId ch, std::uint32_t f) override { log_->fences.emplace_back(ch, f); }
    void engine_changed(std::optional<ChannelId>) override {
        ++log_->engine_changes;
        if (throw_on_engine_change) throw std::runtime_error("policy bug");
    }
    void channel_error(ChannelId ch, std::uint32_t e) override { log_->errors.emplace_back(ch, e); }
    void released(ChannelId ch, std::uint32_t n) override { log_->released.emplace_back(ch, n); }

    PolicyContext* ctx_ = nullptr;
    std::function<void(PolicyContext&, ChannelId, std::uint32_t)> on_trap;
    bool throw_on_remove = false;
    bool throw_on_add = false;
    bool throw_on_engine_change = false;

private:
    PolicyLog* log_;
    std::string name_;
};

struct SchedRig {
    explicit SchedRig(MechanismCosts costs = {}, sim::SimGpuConfig cfg = {})
        : gpu(loop, loop, cfg), sched(gpu, loop, loop, make(), costs) {}

    std::unique_ptr<Policy> make() {
        auto p = std::make_unique<TestPolicy>(log);
        policy = p.get();
        return p;
    }
    // Guest-side submission through the channel's mapping.
    bool write(ChannelId ch, std::uint32_t n, Duration kernel = ms(1),
               std::uint32_t flags = PVGPU_ENTRY_IRQ) {
        ShadowChannel& sc = sched.channel(ch);
        std::uint32_t put = sc.guest_read_put();
        for (std::uint32_t i = 0; i < n; ++i, ++put) {
            pvgpu_ring_entry& e = sc.ring()->entries[put & PVGPU_RING_MASK];
            e.payload = static_cast<std::uint64_t>(kernel);
            e.fence = put + 1;
            e.flags = flags;
        }
        return sc.guest_write_put(put);
    }
    ChannelMode actual(ChannelId ch) { return sched.channel(ch).mode(); }

    sim::EventLoop loop;
    sim::SimGpu gpu;
    PolicyLog log;
    TestPolicy* policy = nullptr;
    Scheduler sched;
};

MechanismCosts costs(Duration trap, Duration remap, Duration poll) {
    MechanismCosts c;
    c.trap = trap;
    c.remap = remap;
    c.poll = poll;
    return c;
}

}  // namespace

TEST_CASE("scheduler: channels, owners and the policy's view", "[scheduler]") {
    SchedRig r;
    CHECK(r.log.starts == 1);
    CHECK(r.sched.policy().name() == "test");
    EntityTree& t = r.sched.entities();
    EntityId vm = t.add(kRootEntity, "vm", EntityKind::Vm);
    EntityId task = t.add(vm, "task", EntityKind::Task);
    using C = EntityTree::Change;
    CHECK(r.log.tree == std::vector<std::pair<C, EntityId>>{{C::Added, vm}, {C::Added, task}});

    CHECK_THROWS_AS(r.sched.open_channel(kRootEntity), TreeError);
    CHECK_THROWS_AS(r.sched.open_channel(vm), TreeError);  // inner node
    ChannelId c1 = r.sched.open_channel(task);
    ChannelId c2 = r.sched.open_channel(task);
    CHECK(r.log.added == std::vector<std::pair<ChannelId, EntityId>>{{c1, task}, {c2, task}});
    CHECK(r.sched.channels_of(task) == std::vector<ChannelId>{c1, c2});
    CHECK(r.sched.channels_of(vm).empty());
    CHECK(r.sched.channels_of(12345).empty());
    CHECK(r.sched.owner(c1) == task);
    CHECK(t.get(task).channels == 2);
    CHECK(r.sched.has_channel(c1));
    CHECK(r.sched.mode(c1) == ChannelMode::Direct);

    r.sched.close_channel(c1);
    CHECK(r.log.removed == std::vector<std::pair<ChannelId, EntityId>>{{c1, task}});
    CHECK_FALSE(r.sched.has_channel(c1));
    CHECK(r.sched.channels_of(task) == std::vector<ChannelId>{c2});
    CHECK(t.get(task).channels == 1);
    CHECK_THROWS_AS(r.gpu.read_fence(c1), std::out_of_range);  // GPU channel gone too

    // Bad ids throw and change nothing.
    CHECK_THROWS_AS(r.sched.close_channel(c1), std::out_of_range);
    CHECK_THROWS_AS(r.sched.close_channel(999), std::out_of_range);
    CHECK_THROWS_AS(r.sched.channel(999), std::out_of_range);
    CHECK_THROWS_AS(r.sched.mode(999), std::out_of_range);
    CHECK_THROWS_AS(r.sched.set_mode(999, ChannelMode::Trapped), std::out_of_range);
    CHECK_THROWS_AS(r.sched.owner(999), std::out_of_range);
    CHECK(r.log.removed.size() == 1);
    CHECK(t.get(task).channels == 1);

    r.sched.close_channel(c2);
    t.remove(task);  // now allowed
    CHECK_FALSE(t.valid(task));

    CHECK_THROWS_AS(Scheduler(r.gpu, r.loop, r.loop, nullptr), std::invalid_argument);
    CHECK_THROWS_AS(r.sched.set_policy(nullptr), std::invalid_argument);
}

// pvgpud closed a channel whose close threw half-way (a policy that looked
// it up after the GPU let go of it) a second time at its client's teardown,
// and freed memory twice.  Whatever a callback throws, the channel leaves
// every table and the GPU, and the error still reaches the caller.
TEST_CASE("scheduler: a close that a callback fails still closes the channel", "[scheduler]") {
    SchedRig r;
    EntityTree& t = r.sched.entities();
    EntityId task = t.add(kRootEntity, "task", EntityKind::Task);
    ChannelId c1 = r.sched.open_channel(task);
    ChannelId c2 = r.sched.open_channel(task);
    r.write(c1, 4);  // work on the engine when it closes
    r.policy->throw_on_remove = true;
    CHECK_THROWS_WITH(r.sched.close_channel(c1), "policy bug");
    r.policy->throw_on_remove = false;
    CHECK_FALSE(r.sched.has_channel(c1));
    CHECK(r.sched.channels_of(task) == std::vector<ChannelId>{c2});
    CHECK(t.get(task).channels == 1);
    CHECK_THROWS_AS(r.gpu.read_fence(c1), std::out_of_range);
    CHECK_THROWS_AS(r.sched.close_channel(c1), std::out_of_range);
    r.loop.run_until(r.loop.now() + ms(10));
    CHECK(r.sched.accounting().running() != std::optional<ChannelId>(c1));
    r.sched.close_channel(c2);
    t.remove(task);
    CHECK_FALSE(t.valid(task));
}

// pvgpud unmaps the memory of a channel whose open failed: the GPU, the
// accounting and the scheduler must not keep it (a review of 2eb5c66).
TEST_CASE("scheduler: an open that the policy fails leaves no channel behind", "[scheduler]") {
    SchedRig r;
    EntityTree& t = r.sched.entities();
    EntityId task = t.add(kRootEntity, "task", EntityKind::Task);
    r.policy->throw_on_add = true;
    CHECK_THROWS_WITH(r.sched.open_channel(task), "policy bug");
    r.policy->throw_on_add = false;
    REQUIRE(r.log.added.size() == 1);
    const ChannelId failed = r.log.added[0].first;
    CHECK_FALSE(r.sched.has_channel(failed));
    CHECK(r.sched.channels_of(task).empty());
    CHECK(t.get(task).channels == 0);
    CHECK_THROWS_AS(r.gpu.read_fence(failed), std::out_of_range);
    ChannelId c = r.sched.open_channel(task);
    r.write(c, 2);
    r.loop.run_until(r.loop.now() + ms(10));
    CHECK(r.sched.accounting().gpu_time(task) == ms(2));
    r.sched.close_channel(c);
    t.remove(task);
}

// The accounting hands its events to the policy on the way out of its own
// calls; a policy that failed there ended the process (std::terminate from
// a destructor) where every other policy failure reaches the caller.
TEST_CASE("scheduler: a policy that fails on an accounting event fails the call and not the process",
          "[scheduler]") {
    SchedRig r;
    EntityId task = r.sched.entities().add(kRootEntity, "task", EntityKind::Task);
    ChannelId c = r.sched.open_channel(task);
    r.policy->throw_on_engine_change = true;
    r.write(c, 1);
    CHECK_THROWS_WITH(r.loop.run_until(r.loop.now() + ms(5)), "policy bug");
    const int heard = r.log.engine_changes;
    CHECK(heard >= 1);
    r.policy->throw_on_engine_change = false;
    // The rest of the events still come, each once, and the charges stand.
    r.loop.run_until(r.loop.now() + ms(5));
    r.write(c, 2);
    r.loop.run_until(r.loop.now() + ms(10));
    CHECK(r.log.engine_changes > heard);
    CHECK(r.sched.accounting().gpu_time(task) == ms(3));
    r.sched.close_channel(c);
}

// The accounting's own engine reads are counted among the scheduler's
// costs: a GPU without a context-switch trace makes them.
sim::SimGpuConfig without_trace() {
    sim::SimGpuConfig cfg;
    cfg.ctxsw_trace = false;
    return cfg;
}

TEST_CASE("scheduler: a mode switch lands only after the remap delay", "[scheduler]") {
    SchedRig r(costs(us(2), us(50), us(1)), without_trace());
    EntityId task = r.sched.entities().add(kRootEntity, "t", EntityKind::Task);
    ChannelId ch = r.sched.open_channel(task);

    r.sched.set_mode(ch, ChannelMode::Trapped);
    CHECK(r.sched.mode(ch) == ChannelMode::Trapped);  // what was asked for
    CHECK(r.actual(ch) == ChannelMode::Direct);       // what the guest has
    CHECK(r.sched.stats().remaps == 1);
    // A store during the remap still goes straight through.
    CHECK_FALSE(r.write(ch, 1, us(10)));
    CHECK(r.gpu.read_ib_put(ch) == 1);
    r.loop.run_until(us(49));
    CHECK(r.actual(ch) == ChannelMode::Direct);
    r.loop.run_until(us(50));
    CHECK(r.actual(ch) == ChannelMode::Trapped);

    CHECK(r.write(ch, 2, us(10)));
    CHECK(r.write(ch, 1, us(10)));
    CHECK(r.sched.stats().traps == 2);
    CHECK(r.log.trapped == std::vector<std::pair<ChannelId, std::uint32_t>>{{ch, 3}, {ch, 4}});
    CHECK(r.gpu.read_ib_put(ch) == 4);

    // Asking for the mode already asked for is free.
    r.sched.set_mode(ch, ChannelMode::Trapped);
    CHECK(r.sched.stats().remaps == 1);
    // 1 remap x 50 us + 2 traps x 2 us, plus 1 us per register read of the
    // accounting: the engine status (it watches the idle engine after the
    // channel opened), the channel's GET at each start it saw exactly, and
    // its pending register at the trapped doorbell that found every entry
    // it had charged done.
    CHECK(r.sched.stats().register_reads == 3);
    CHECK(r.sched.stats().mechanism_cpu ==
          us(54) + static_cast<Duration>(r.sched.stats().accounting_reads + r.sched.stats().register_reads) * us(1));

    // Shadowing waits for the remap too: a store in between is forwarded.
    r.sched.set_mode(ch, ChannelMode::Shadowed);
    CHECK(r.write(ch, 1, us(10)));  // still trapped
    CHECK(r.gpu.read_ib_put(ch) == 5);
    r.loop.run_until(us(100));
    CHECK(r.actual(ch) == ChannelMode::Shadowed);
    CHECK_FALSE(r.write(ch, 2, us(10)));
    CHECK(r.sched.held(ch) == 2);
    CHECK(r.gpu.read_ib_put(ch) == 5);
    CHECK(r.sched.stats().remaps == 2);
    CHECK(r.sched.stats().traps == 3);
}

TEST_CASE("scheduler: a switch reverted before it lands does not happen", "[scheduler]") {
    SchedRig r(costs(us(2), us(50), us(1)));
    EntityId task = r.sched.entities().add(kRootEntity, "t", EntityKind::Task);
    ChannelId ch = r.sched.open_channel(task);

    r.sched.set_mode(ch, ChannelMode::Shadowed);
    r.loop.run_until(us(20));
    r.sched.set_mode(ch, ChannelMode::Direct);  // changed its mind
    CHECK(r.sched.mode(ch) == ChannelMode::Direct);
    // No remap left armed; at most the accounting's next settle read, its
    // next audit look (the new channel's first start is audited) and its
    // idle trap.
    CHECK(r.loop.pending() <= 3);
    r.loop.run_until(us(200));
    CHECK(r.actual(ch) == ChannelMode::Direct);
    CHECK_FALSE(r.write(ch, 2, us(10)));
    CHECK(r.gpu.read_ib_put(ch) == 2);
    CHECK(r.sched.held(ch) == 0);

    // Asked again after a revert, the switch takes the full delay from the new
    // request: at 200 ask, 220 revert, 240 ask again -> lands at 290, not 250.
    r.sched.set_mode(ch, ChannelMode::Shadowed);
    r.loop.run_until(us(220));
    r.sched.set_mode(ch, ChannelMode::Direct);
    r.loop.run_until(us(240));
    r.sched.set_mode(ch, ChannelMode::Shadowed);
    r.loop.run_until(us(289));
    CHECK(r.actual(ch) == ChannelMode::Direct);
    r.loop.run_until(us(290));
    CHECK(r.actual(ch) == ChannelMode::Shadowed);

    // A switch to a third mode while one is pending lands at the pending time
    // with the newest wish.
    r.sched.set_mode(ch, ChannelMode::Direct);  // at 290, due at 340
    r.loop.run_until(us(320));
    r.sched.set_mode(ch, ChannelMode::Trapped);
    r.loop.run_until(us(339));
    CHECK(r.actual(ch) == ChannelMode::Shadowed);
    r.loop.run_until(us(340));
    CHECK(r.actual(ch) == ChannelMode::Trapped);
    CHECK(r.write(ch, 1, us(10)));
    CHECK(r.sched.stats().traps == 1);
}

TEST_CASE("scheduler: with no remap cost a switch is immediate", "[scheduler]") {
    SchedRig r(costs(us(3), 0, us(1)), without_trace());
    EntityId task = r.sched.entities().add(kRootEntity, "t", EntityKind::Task);
    ChannelId ch = r.sched.open_channel(task);
    r.sched.set_mode(ch, ChannelMode::Shadowed);
    CHECK(r.actual(ch) == ChannelMode::Shadowed);
    r.write(ch, 5);
    CHECK(r.sched.held(ch) == 5);

    // Partial release through the context: counted, but no released() callback
    // (the policy asked for it itself).
    CHECK(r.sched.release(ch, 2) == 2);
    CHECK(r.gpu.read_ib_put(ch) == 2);
    CHECK(r.sched.held(ch) == 3);
    CHECK(r.sched.stats().released_entries == 2);
    CHECK(r.log.released.empty());

    // Unshadowing releases the rest and tells the policy.
    r.sched.set_mode(ch, ChannelMode::Direct);
    CHECK(r.actual(ch) == ChannelMode::Direct);
    CHECK(r.gpu.read_ib_put(ch) == 5);
    CHECK(r.log.released == std::vector<std::pair<ChannelId, std::uint32_t>>{{ch, 3}});
    CHECK(r.sched.stats().released_entries == 5);
    CHECK(r.sched.stats().remaps == 2);
    // No remap cost.  What was spent: the shadowed doorbell store that
    // reported the held work (an exit, like a trap), and the accounting's
    // engine read after the release that started the idle engine, and its
    // read of the channel's GET at that start.
    CHECK(r.sched.stats().held_reports == 1);
    CHECK(r.sched.stats().accounting_reads == 1);
    CHECK(r.sched.stats().register_reads == 1);
    CHECK(r.sched.stats().mechanism_cpu == us(3) + us(1) + us(1));

    // Completions with the IRQ flag reach the policy as fences.
    r.loop.run_until(ms(100));
    CHECK(r.sched.stats().fences == 5);
    CHECK(r.log.fences.size() == 5);
    CHECK(r.log.fences.back() == std::make_pair(ch, 5u));
}

TEST_CASE("scheduler: a policy may shadow a channel from its trap", "[scheduler]") {
    SchedRig r(costs(us(2), 0, us(1)));
    EntityId task = r.sched.entities().add(kRootEntity, "t", EntityKind::Task);
    ChannelId ch = r.sched.open_channel(task);
    r.sched.set_mode(ch, ChannelMode::Trapped);
    r.policy->on_trap = [](PolicyContext& ctx, ChannelId c, std::uint32_t put) {
        if (put >= 3) ctx.set_mode(c, ChannelMode::Shadowed);
    };
    CHECK(r.write(ch, 2));
    CHECK(r.gpu.read_ib_put(ch) == 2);
    CHECK(r.write(ch, 1));  // put 3: the policy shadows, the store is held
    CHECK(r.gpu.read_ib_put(ch) == 2);
    CHECK(r.sched.held(ch) == 1);
    CHECK(r.actual(ch) == ChannelMode::Shadowed);
    CHECK_FALSE(r.write(ch, 1));
    CHECK(r.sched.stats().traps == 2);
    CHECK(r.sched.held(ch) == 2);
}

TEST_CASE("scheduler: engine status and channel register reads are counted", "[scheduler]") {
    SchedRig r(costs(us(2), us(50), us(1)));
    EntityId task = r.sched.entities().add(kRootEntity, "t", EntityKind::Task);
    ChannelId ch = r.sched.open_channel(task);
    CHECK_FALSE(r.sched.engine_status().has_value());
    r.write(ch, 1);
    CHECK(r.sched.engine_status() == ch);
    CHECK(r.sched.stats().polls == 2);
    // And the accounting's read of the channel's GET at the start it saw.
    CHECK(r.sched.stats().register_reads == 1);
    CHECK(r.sched.stats().mechanism_cpu == us(2) + us(1));
    // A policy's reads of a channel's registers are MMIO reads too.
    const GpuRegisters& regs = r.sched.gpu();
    CHECK(regs.read_ib_put(ch) == 1);
    CHECK(regs.read_ib_get(ch) == 1);
    CHECK(regs.pending(ch));
    CHECK(regs.read_status(ch) == PVGPU_CHAN_STATUS_OK);
    (void)regs.arbitration();  // configuration, not a read
    CHECK(r.sched.stats().register_reads == 5);
    CHECK(r.sched.stats().mechanism_cpu == us(2) + us(5));
    // IB_PUT through the context: a direct guest stores it unseen (a read);
    // trapped or shadowed, the host made every store itself (no read).
    CHECK(r.sched.gpu_put(ch) == 1);
    CHECK(r.sched.stats().register_reads == 6);
    r.sched.set_mode(ch, ChannelMode::Shadowed);
    r.loop.run_until(r.loop.now() + us(100));  // the remap lands
    REQUIRE(r.sched.channel(ch).mode() == ChannelMode::Shadowed);
    r.write(ch, 3);
    CHECK(r.sched.held(ch) == 3);
    CHECK(r.sched.gpu_put(ch) == 1);
    CHECK(r.sched.release(ch, 2) == 2);
    CHECK(r.sched.gpu_put(ch) == 3);
    CHECK(r.sched.held(ch) == 1);
    CHECK(r.sched.stats().register_reads == 6);
}

TEST_CASE("scheduler: channel errors reach the policy and the error listener", "[scheduler]") {
    sim::SimGpuConfig cfg;
    cfg.watchdog = ms(5);
    SchedRig r({}, cfg);
    EntityId vm = r.sched.entities().add(kRootEntity, "vm", EntityKind::Vm);
    EntityId task = r.sched.entities().add(vm, "42", EntityKind::Task);
    ChannelId ok = r.sched.open_channel(task);
    ChannelId bad = r.sched.open_channel(task);
    struct Err {
        ChannelId ch;
        EntityId owner;
        std::uint32_t error;
        Time at;
    };
    std::vector<Err> errs;
    r.sched.set_error_listener([&](ChannelId c, EntityId o, std::uint32_t e) {
        errs.push_back({c, o, e, r.loop.now()});
    });
    r.write(bad, 1, ms(20));
    r.write(ok, 2, ms(1));
    r.loop.run_until(ms(50));
    REQUIRE(errs.size() == 1);
    CHECK(errs[0].ch == bad);
    CHECK(errs[0].owner == task);
    CHECK(errs[0].error == PVGPU_CHAN_ERR_WATCHDOG);
    CHECK(errs[0].at == ms(5));
    CHECK(r.log.errors == std::vector<std::pair<ChannelId, std::uint32_t>>{{bad, PVGPU_CHAN_ERR_WATCHDOG}});
    CHECK(r.sched.stats().channel_errors == 1);
    CHECK(r.gpu.read_fence(ok) == 2);  // the other channel carried on

    // A garbage doorbell is reported the same way, at once.
    r.sched.channel(ok).guest_write_put(1000);
    REQUIRE(errs.size() == 2);
    CHECK(errs[1].ch == ok);
    CHECK(errs[1].error == PVGPU_CHAN_ERR_BAD_ENTRY);
    CHECK(r.sched.stats().channel_errors == 2);
}

TEST_CASE("scheduler: set_policy hands channels back as Direct", "[scheduler]") {
    SchedRig r(costs(us(2), us(50), us(1)));
    EntityId task = r.sched.entities().add(kRootEntity, "t", EntityKind::Task);
    ChannelId a = r.sched.open_channel(task);
    ChannelId b = r.sched.open_channel(task);
    ChannelId c = r.sched.open_channel(task);
    r.sched.set_mode(a, ChannelMode::Shadowed);
    r.sched.set_mode(b, ChannelMode::Trapped);
    r.loop.run_until(us(50));
    REQUIRE(r.actual(a) == ChannelMode::Shadowed);
    REQUIRE(r.actual(b) == ChannelMode::Trapped);
    r.write(a, 3);
    REQUIRE(r.sched.held(a) == 3);

    PolicyLog log2;
    r.sched.set_policy(std::make_unique<TestPolicy>(log2, "second"));
    CHECK(r.log.stops == 1);
    CHECK(r.sched.policy().name() == "second");
    CHECK(log2.starts == 1);
    // The new policy is told about every channel, in id order.
    CHECK(log2.added == std::vector<std::pair<ChannelId, EntityId>>{{a, task}, {b, task}, {c, task}});
    CHECK(r.sched.mode(a) == ChannelMode::Direct);
    CHECK(r.sched.mode(b) == ChannelMode::Direct);
    CHECK(r.sched.mode(c) == ChannelMode::Direct);
    // The mappings change after the remap delay; the held work is released
    // then and reported to the new policy.
    r.loop.run_until(us(100));
    CHECK(r.actual(a) == ChannelMode::Direct);
    CHECK(r.actual(b) == ChannelMode::Direct);
    CHECK(r.actual(c) == ChannelMode::Direct);
    CHECK(r.sched.held(a) == 0);
    CHECK(r.gpu.read_ib_put(a) == 3);
    CHECK(log2.released == std::vector<std::pair<ChannelId, std::uint32_t>>{{a, 3}});
    CHECK(r.log.released.empty());
    // 2 switches away from Direct + 2 back.
    CHECK(r.sched.stats().remaps == 4);
    CHECK_FALSE(r.write(b, 1));
    CHECK(r.sched.stats().traps == 0);
}
