// Channels closed at random moments under every policy and GPU model: a
// close must leave nothing that later looks the channel up.  Found the hard
// way (CI on 4315767): hfq's status read during a close made the accounting
// believe the closing channel ran on, and every later interrupt asked the
// GPU for it.  A read-only review's fuzz of this shape hit that in 44 of
// 1600 runs.
#include <catch2/catch.hpp>

#include <map>
#include <random>
#include <string>
#include <vector>

#include "core/scheduler.hpp"
#include "sim/event_loop.hpp"
#include "sim/sim_gpu.hpp"

using namespace pvgpu;
using namespace pvgpu::sim;

namespace {

// A client of one channel: `depth` kernels in flight, each resubmitted
// after `gap`; one that asks for no interrupts polls its fence.
struct Client {
    Duration kernel = 0, gap = 0;
    std::uint32_t depth = 1;
    bool irq = true;
    std::uint32_t put = 0, completed = 0;
};

struct CloseRig {
    EventLoop loop;
    SimGpu gpu;
    Scheduler sched;
    std::map<ChannelId, Client> clients;

    CloseRig(const std::string& policy, Arbitration arb, MechanismCosts costs, Duration irq_latency)
        : gpu(loop, loop, SimGpuConfig{arb, 2 * kMillisecond, 0, 2 * kSecond, 75 * kMicrosecond, irq_latency}),
          sched(gpu, loop, loop, make_policy(policy, {}), costs) {}

    ChannelId open(EntityId leaf, Client c) {
        const ChannelId ch = sched.open_channel(leaf);
        clients[ch] = c;
        gpu.set_fence_watcher(ch, [this, ch](std::uint32_t fence) {
            auto it = clients.find(ch);
            if (it == clients.end()) return;
            it->second.completed = fence;
            loop.arm(loop.now() + it->second.gap, [this, ch] { fill(ch); });
        });
        loop.arm(loop.now(), [this, ch] { fill(ch); });
        return ch;
    }

    void fill(ChannelId ch) {
        auto it = clients.find(ch);
        if (it == clients.end()) return;
        Client& c = it->second;
        ShadowChannel& sc = sched.channel(ch);
        while (c.put - c.completed < c.depth) {
            pvgpu_ring_entry& e = sc.ring()->entries[c.put & PVGPU_RING_MASK];
            e.payload = static_cast<std::uint64_t>(c.kernel);
            e.fence = c.put + 1;
            e.flags = c.irq ? PVGPU_ENTRY_IRQ : 0;
            ++c.put;
            sc.guest_write_put(c.put);
        }
        if (!c.irq)
            loop.arm(loop.now() + c.kernel, [this, ch] {
                auto it2 = clients.find(ch);
                if (it2 == clients.end()) return;
                it2->second.completed = gpu.read_fence(ch);
                fill(ch);
            });
    }

    void close(ChannelId ch) {
        clients.erase(ch);
        sched.close_channel(ch);
    }

    void run_for(Duration d) { loop.run_until(loop.now() + d); }
};

}  // namespace

TEST_CASE("scheduler: channels closed at random moments under every policy leave nothing behind", "[scheduler]") {
    const std::string policy = GENERATE(as<std::string>{}, "hfq", "timeslice", "dfq", "none");
    const Arbitration arb = GENERATE(Arbitration::RoundRobin, Arbitration::Timeslice);
    const Duration remap = GENERATE(Duration{0}, 50 * kMicrosecond);
    int failed = 0, believed_running = 0, closes = 0;
    std::string first;
    for (std::uint32_t run = 0; run < 25; ++run) {
        std::mt19937 rng(run * 7919 + static_cast<std::uint32_t>(remap) + static_cast<std::uint32_t>(arb));
        MechanismCosts costs;
        costs.remap = remap;
        CloseRig rig(policy, arb, costs, rng() % 3 == 0 ? 30 * kMicrosecond : 0);
        EntityTree& tree = rig.sched.entities();
        std::vector<ChannelId> open;
        const int leaves = 2 + static_cast<int>(rng() % 3);
        for (int l = 0; l < leaves; ++l) {
            const EntityId leaf = tree.add(kRootEntity, "t" + std::to_string(l), EntityKind::Task, 50 + rng() % 200);
            for (int n = 1 + static_cast<int>(rng() % 2); n > 0; --n) {
                Client c;
                c.kernel = static_cast<Duration>(100 + rng() % 6000) * kMicrosecond;
                c.gap = rng() % 2 ? 0 : static_cast<Duration>(rng() % 2000) * kMicrosecond;
                c.depth = 1 + rng() % 4;
                c.irq = rng() % 4 != 0;
                open.push_back(rig.open(leaf, c));
            }
        }
        try {
            rig.run_for(static_cast<Duration>(200 + rng() % 400) * kMillisecond + rng() % kMillisecond);
            for (int n = 1 + static_cast<int>(rng() % 3); n > 0 && !open.empty(); --n) {
                const std::size_t i = rng() % open.size();
                const ChannelId ch = open[i];
                open.erase(open.begin() + static_cast<std::ptrdiff_t>(i));
                rig.close(ch);
                ++closes;
                if (rig.sched.accounting().running() == std::optional<ChannelId>(ch)) ++believed_running;
                rig.run_for(static_cast<Duration>(rng() % 50) * kMillisecond + rng() % kMillisecond);
            }
            rig.run_for(300 * kMillisecond);
        } catch (const std::exception& e) {
            if (failed++ == 0) first = "run " + std::to_string(run) + ": " + e.what();
        }
    }
    INFO(policy << " on the " << to_string(arb) << " GPU, remap " << to_us(remap) << " us: " << closes
                << " closes; first failure: " << first);
    CHECK(failed == 0);
    CHECK(believed_running == 0);
}
