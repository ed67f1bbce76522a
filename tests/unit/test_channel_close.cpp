// Channels closed at random moments under every policy and GPU model: a
// close must leave nothing that later looks the channel up.  Found the hard
// way (CI on 4315767): hfq's status read during a close made the accounting
// believe the closing channel ran on, and every later interrupt asked the
// GPU for it.  A read-only review's fuzz of this shape hit that in 44 of
// 1600 runs.  Also: channels opened at starting positions (drain and
// re-create) are accounted as fresh ones.
#include <catch2/catch.hpp>

#include <cstdint>
#include <random>
#include <string>
#include <vector>

#include "policy_rig.hpp"

using namespace pvgpu;
using namespace pvgpu::sim;
using pvgpu::test::Rig;

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
        const Duration irq_latency = rng() % 3 == 0 ? 30 * kMicrosecond : 0;
        Rig rig(policy, {}, SimGpuConfig{arb, 2 * kMillisecond, 0, 2 * kSecond, 75 * kMicrosecond, irq_latency}, 0,
                costs);
        std::vector<ChannelId> open;
        const int leaves = 2 + static_cast<int>(rng() % 3);
        for (int l = 0; l < leaves; ++l) {
            const EntityId leaf = rig.task("t" + std::to_string(l), 50 + rng() % 200);
            for (int n = 1 + static_cast<int>(rng() % 2); n > 0; --n) {
                const Duration kernel = static_cast<Duration>(100 + rng() % 6000) * kMicrosecond;
                const Duration gap = rng() % 2 ? 0 : static_cast<Duration>(rng() % 2000) * kMicrosecond;
                const std::uint32_t depth = 1 + rng() % 4;
                const bool irq = rng() % 4 != 0;
                const ChannelId ch = rig.submit_loop(leaf, kernel, gap);
                rig.subs[ch].depth = depth;
                rig.subs[ch].irq = irq;
                open.push_back(ch);
            }
        }
        auto run_for = [&rig](Duration d) { rig.run_until(rig.loop.now() + d); };
        try {
            run_for(static_cast<Duration>(200 + rng() % 400) * kMillisecond + rng() % kMillisecond);
            for (int n = 1 + static_cast<int>(rng() % 3); n > 0 && !open.empty(); --n) {
                const std::size_t i = rng() % open.size();
                const ChannelId ch = open[i];
                open.erase(open.begin() + static_cast<std::ptrdiff_t>(i));
                rig.close(ch);
                ++closes;
                if (rig.sched.accounting().running() == std::optional<ChannelId>(ch)) ++believed_running;
                run_for(static_cast<Duration>(rng() % 50) * kMillisecond + rng() % kMillisecond);
            }
            run_for(300 * kMillisecond);
        } catch (const std::exception& e) {
            if (failed++ == 0) first = "run " + std::to_string(run) + ": " + e.what();
        }
    }
    INFO(policy << " on the " << to_string(arb) << " GPU, remap " << to_us(remap) << " us: " << closes
                << " closes; first failure: " << first);
    CHECK(failed == 0);
    CHECK(believed_running == 0);
}

// A channel re-created at positions it reached elsewhere has completed
// nothing yet as far as the accounting knows: the same run from any start
// is charged exactly the same.
TEST_CASE("scheduler: channels opened at starting positions are accounted as fresh ones", "[scheduler][start]") {
    const std::string policy = GENERATE(as<std::string>{}, "hfq", "dfq", "timeslice");
    auto charged = [&policy](ChannelStart from) {
        Rig rig(policy);
        const EntityId x = rig.task("x", 100), y = rig.task("y", 300);
        rig.submit_loop(x, kMillisecond, 0, 0, 0, from);
        rig.submit_loop(y, 300 * kMicrosecond, 100 * kMicrosecond, 0, 0, from);
        rig.run_until(300 * kMillisecond);
        const Accounting& acc = rig.sched.accounting();
        return std::vector<std::int64_t>{acc.gpu_time(x), acc.gpu_time(y), static_cast<std::int64_t>(acc.kernels(x)),
                                         static_cast<std::int64_t>(acc.kernels(y))};
    };
    const std::vector<std::int64_t> fresh = charged({});
    INFO(policy);
    CHECK(fresh[0] + fresh[1] > 200 * kMillisecond);  // both ran
    CHECK(charged({1000, 1000}) == fresh);
    CHECK(charged({0xffffff80u, 7}) == fresh);
}
