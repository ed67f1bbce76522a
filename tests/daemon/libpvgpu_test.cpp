// libpvgpu API tests against a running pvgpud.  daemon_test.py (case
// "library") starts the daemon and passes its client socket in
// PVGPU_TEST_SOCKET; run by hand the same way.
#include <sys/resource.h>

#include <pvgpu.h>
#include <pvgpu/abi.h>

#include <catch2/catch.hpp>

#include <chrono>
#include <span>
#include <cstdlib>
#include <string>
#include <vector>

using Catch::Matchers::Contains;
using namespace std::chrono_literals;

namespace {

std::string daemon_socket() {
    const char* s = std::getenv("PVGPU_TEST_SOCKET");
    if (!s || !*s) FAIL("PVGPU_TEST_SOCKET is not set (run through tests/daemon/daemon_test.py)");
    return s;
}

pvgpu::ClientOptions options(const std::string& name) {
    pvgpu::ClientOptions o;
    o.socket_path = daemon_socket();
    o.name = name;
    o.reconnect = false;  // the daemon stays up in these tests
    return o;
}

double cpu_ms() {
    rusage ru{};
    getrusage(RUSAGE_SELF, &ru);
    return static_cast<double>(ru.ru_utime.tv_sec + ru.ru_stime.tv_sec) * 1e3 +
           static_cast<double>(ru.ru_utime.tv_usec + ru.ru_stime.tv_usec) / 1e3;
}

constexpr std::uint64_t kMs = 1'000'000;  // ns

}  // namespace

TEST_CASE("connection errors are clear") {
    CHECK_THROWS_WITH(pvgpu::Client("/nonexistent/pvgpud.sock", "x"),
                      Contains("cannot connect to /nonexistent/pvgpud.sock"));
    CHECK_THROWS_WITH(pvgpu::Client(options(std::string(64, 'n'))), Contains("longer than 63"));
}

TEST_CASE("submit, wait and drain") {
    pvgpu::Client client(options("api-basic"));
    CHECK(client.max_channels() > 0);
    pvgpu::Channel ch = client.alloc_channel();
    CHECK(ch.completed() == 0);
    CHECK(ch.last_submitted() == 0);
    CHECK(ch.submit(1 * kMs) == 1);
    const std::vector<std::uint64_t> batch(9, 1 * kMs);
    CHECK(ch.submit(batch) == 10);
    CHECK(ch.last_submitted() == 10);
    // 10 ms of work cannot be done within 100 us.
    CHECK_FALSE(ch.wait(10, 100us));
    CHECK(ch.outstanding() > 0);
    CHECK(ch.wait(1, 5s));
    CHECK(ch.drain(5s));
    CHECK(ch.completed() == 10);
    CHECK(ch.outstanding() == 0);
    CHECK(ch.wait(3));  // already done: at once
    CHECK_THROWS_WITH(ch.wait(11), Contains("never submitted"));
}

TEST_CASE("more entries than the ring holds") {
    pvgpu::Client client(options("api-ring"));
    pvgpu::Channel ch = client.alloc_channel();
    const std::vector<std::uint64_t> many(600, 10'000);  // 600 x 10 us
    CHECK(ch.submit(many) == 600);
    CHECK(ch.outstanding() <= PVGPU_RING_ENTRIES);
    CHECK(ch.drain(10s));
    CHECK(ch.completed() == 600);
}

TEST_CASE("waiting takes about the work's time and little CPU") {
    pvgpu::Client client(options("api-cpu"));
    pvgpu::Channel ch = client.alloc_channel();
    const double cpu0 = cpu_ms();
    const auto t0 = std::chrono::steady_clock::now();
    std::uint64_t fence = 0;
    for (int i = 0; i < 100; ++i) fence = ch.submit(2 * kMs);  // 200 ms of GPU work
    REQUIRE(ch.wait(fence, 10s));
    const double wall = std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
    const double cpu = cpu_ms() - cpu0;
    std::printf("RESULT library.wait_200ms.wall_ms=%.1f\nRESULT library.wait_200ms.cpu_ms=%.2f\n"
                "RESULT library.wait_200ms.polls=%llu\n",
                wall, cpu, static_cast<unsigned long long>(client.stats().polls));
    CHECK(wall >= 200.0);
    CHECK(wall < 400.0);  // the daemon's GPU loses some time per kernel; not twice the work
    CHECK(cpu < 0.05 * wall);  // no busy waiting: well under 5% of a core
}

TEST_CASE("wait_any across channels") {
    pvgpu::Client client(options("api-any"));
    pvgpu::Channel a = client.alloc_channel();
    pvgpu::Channel b = client.alloc_channel();
    const std::uint64_t fa = a.submit(50 * kMs);
    const std::uint64_t fb = b.submit(1 * kMs);
    const pvgpu::Client::WaitGoal goal_array[] = {{&a, fa}, {&b, fb}};
    const std::span<const pvgpu::Client::WaitGoal> goals(goal_array);
    REQUIRE(client.wait_any(goals, std::chrono::steady_clock::now() + 5s));
    CHECK((a.completed() == fa || b.completed() == fb));
    CHECK_FALSE(client.wait_any(goals.subspan(0, 0), std::chrono::steady_clock::now() + 1ms));
    CHECK(a.drain(5s));
    const pvgpu::Client::WaitGoal none[] = {{&a, fa}};
    CHECK(client.wait_any(none, std::chrono::steady_clock::now()));  // already reached
}

TEST_CASE("the per-client channel limit is reported") {
    pvgpu::Client client(options("api-limit"));
    std::vector<pvgpu::Channel> channels;
    for (std::uint32_t i = 0; i < client.max_channels(); ++i) channels.push_back(client.alloc_channel());
    CHECK_THROWS_WITH(client.alloc_channel(), Contains("too many channels"));
    channels.pop_back();  // frees one
    CHECK_NOTHROW(channels.push_back(client.alloc_channel()));
}

TEST_CASE("a bad entry kills the channel with a clear error") {
    pvgpu::Client client(options("api-bad"));
    pvgpu::Channel ch = client.alloc_channel();
    const std::uint64_t f = ch.submit(std::uint64_t{1} << 60);  // no kernel runs for 36 years
    CHECK_THROWS_WITH(ch.wait(f, 5s), Contains("bad ring entry"));
    CHECK_THROWS_WITH(ch.submit(1000), Contains("bad ring entry"));
    CHECK_NOTHROW(ch.free());
    // The client is fine: a new channel works.
    pvgpu::Channel ok = client.alloc_channel();
    CHECK(ok.wait(ok.submit(1000), 5s));
}

TEST_CASE("free, moves and lifetimes") {
    pvgpu::Channel kept;
    {
        pvgpu::Client client(options("api-life"));
        kept = client.alloc_channel();
    }
    // The channel keeps the connection: it outlives the Client object.
    CHECK(kept.wait(kept.submit(1 * kMs), 5s));
    pvgpu::Channel moved = std::move(kept);
    CHECK_FALSE(static_cast<bool>(kept));  // NOLINT(bugprone-use-after-move): testing it
    CHECK(moved.completed() == 1);
    moved.free();
    moved.free();  // idempotent
    CHECK_THROWS_WITH(moved.submit(1), Contains("freed"));
}
