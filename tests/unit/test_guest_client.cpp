// libpvgpu's device transport (the guest side) against an in-process fake of
// the guest driver: the fake's channel "pages" are memfds that the library
// maps exactly as it maps /dev/pvgpu, and a fake GPU runs what the doorbell
// announced when the library waits.  Covers transport selection, the ioctl
// ABI as the driver checks it, fence widening across the 32-bit wrap, wait
// results (OK, DEAD, LOST, timeout, EINTR), waits over several channels
// (PVGPU_IOC_WAIT_ANY, and the fallback for a module without it), and
// re-allocation plus resubmission after the device lost pvgpud.
#include <catch2/catch.hpp>

#include <fcntl.h>
#include <sys/mman.h>
#include <unistd.h>

#include <pvgpu/guest_ioctl.h>

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <stdexcept>
#include <string>
#include <vector>

#include "lib/device_ops.hpp"
#include "pvgpu.h"

using Catch::Matchers::Contains;
using namespace std::chrono_literals;
using pvgpu::detail::Mapping;

namespace {

// What the fake driver and its device hold.  Tests reach in to script the
// device (link loss, dead channels, GPU speed) and to read what it received.
struct FakeDevice {
    struct Slot {
        bool used = false;
        bool lost = false;           // LOST: the page reads STATUS=1, ERROR=0x80
        std::uint32_t chan_id = 0;
        pvgpu::UniqueFd memfd;
        Mapping gpu;                 // the device's view of the three pages
        std::uint32_t last_doorbell = 0;
        bool kicked = false;         // the doorbell changed since the GPU last looked
        bool stalled = false;        // the GPU runs nothing of this channel
        std::vector<std::uint64_t> executed;  // payloads run, in order
        std::vector<std::uint32_t> fences;    // their ring fences

        pvgpu_ctrl_page& ctrl() const { return *reinterpret_cast<pvgpu_ctrl_page*>(gpu.data()); }
        std::uint32_t doorbell() const {
            return *reinterpret_cast<volatile std::uint32_t*>(gpu.data() + PVGPU_MMAP_DOORBELL);
        }
        pvgpu_ring& ring() const { return *reinterpret_cast<pvgpu_ring*>(gpu.data() + PVGPU_MMAP_RING); }
    };

    std::uint32_t device_version = 2;
    std::uint32_t link = PVGPU_LINK_READY;
    std::uint32_t link_gen = 1;
    std::vector<Slot> slots = std::vector<Slot>(4);
    std::uint32_t next_chan_id = 100;
    // IB_PUT/IB_GET/FENCE of a new channel (a real one starts at 0; the
    // library must take whatever the page says).
    std::uint32_t initial_counter = 0;
    // Entries the GPU completes per wait call.
    std::size_t gpu_budget = SIZE_MAX;
    // INFO calls that still report the link down before it comes back
    // (READY, link_gen + 1) after lose_link().
    int down_for_infos = 0;
    // Lost slots are re-allocated in place when the link comes back (the
    // device does this itself, docs/pvgpu-device.md section 8).
    bool realloc_in_place = false;
    // Called before each wait is decided; may script events.
    std::function<void(FakeDevice&, const pvgpu_ioc_wait&)> on_wait;
    std::function<void(FakeDevice&, const pvgpu_ioc_wait_any&)> on_wait_any;
    // The module has PVGPU_IOC_WAIT_ANY (else it answers ENOTTY).
    bool has_wait_any = true;
    int eintr_waits = 0;         // the next N waits end with EINTR

    // Records.
    std::vector<pvgpu_ioc_set_weight> weights;
    std::vector<std::int64_t> wait_timeouts;      // WAIT and WAIT_ANY alike
    int waits = 0;                                // WAIT calls
    int wait_any_calls = 0;                       // WAIT_ANY calls (ENOTTY ones included)
    std::vector<pvgpu_wait_target> wait_any_targets;  // the last WAIT_ANY's
    int allocs = 0;
    int frees = 0;
    std::uint32_t weight = PVGPU_WEIGHT_DEFAULT;

    Slot& slot(std::uint32_t handle) { return slots.at(handle); }

    void fresh_page(Slot& s) {
        std::memset(s.gpu.data(), 0, PVGPU_MMAP_CHANNEL_SIZE);
        s.ctrl().ib_put = initial_counter;
        s.ctrl().ib_get = initial_counter;
        s.ctrl().fence = initial_counter;
        s.last_doorbell = s.doorbell();
        s.kicked = false;
        s.lost = false;
        s.chan_id = next_chan_id++;
    }

    // The GPU: runs entries from IB_GET up to IB_PUT once the doorbell rang.
    void run_gpu(Slot& s) {
        if (s.doorbell() != s.last_doorbell) {
            s.last_doorbell = s.doorbell();
            s.kicked = true;
        }
        if (!s.kicked || s.stalled || s.lost || s.ctrl().status != PVGPU_CHAN_STATUS_OK) return;
        for (std::size_t n = 0; n < gpu_budget && s.ctrl().ib_get != s.ctrl().ib_put; ++n) {
            const pvgpu_ring_entry& e = s.ring().entries[s.ctrl().ib_get & PVGPU_RING_MASK];
            if (e.flags != PVGPU_ENTRY_IRQ) throw std::logic_error("ring entry without the IRQ flag");
            s.executed.push_back(e.payload);
            s.fences.push_back(e.fence);
            s.ctrl().ib_get = s.ctrl().ib_get + 1;
            s.ctrl().fence = e.fence;
        }
        if (s.ctrl().ib_get == s.ctrl().ib_put) s.kicked = false;
    }

    // pvgpud went away: every channel LOST, the link down for a while.
    void lose_link(int infos_down) {
        link = PVGPU_LINK_DOWN;
        down_for_infos = infos_down;
        for (Slot& s : slots) {
            if (!s.used) continue;
            s.lost = true;
            s.ctrl().status = PVGPU_CHAN_STATUS_ERROR;
            s.ctrl().error = PVGPU_CHAN_ERR_LOST;
        }
    }

    void link_back() {
        link = PVGPU_LINK_READY;
        ++link_gen;
        if (!realloc_in_place) return;
        for (Slot& s : slots)
            if (s.used && s.lost) fresh_page(s);
    }

    void kill(std::uint32_t handle, std::uint32_t error) {
        slot(handle).ctrl().status = PVGPU_CHAN_STATUS_ERROR;
        slot(handle).ctrl().error = error;
    }

    std::uint32_t used_slots() const {
        std::uint32_t n = 0;
        for (const Slot& s : slots) n += s.used ? 1 : 0;
        return n;
    }

    std::uint32_t only_used_handle() const {
        for (std::uint32_t h = 0; h < slots.size(); ++h)
            if (slots[h].used) return h;
        throw std::logic_error("no slot in use");
    }
};

// The driver's side of the ABI, checked as strictly as the module does.
class FakeOps final : public pvgpu::detail::DeviceOps {
public:
    explicit FakeOps(std::shared_ptr<FakeDevice> dev) : dev_(std::move(dev)) {}

    const std::string& path() const override { return path_; }

    int info(pvgpu_ioc_info& a) override {
        if (a.size != sizeof a || a.flags != 0) return EINVAL;
        if (dev_->link != PVGPU_LINK_READY && dev_->down_for_infos-- <= 0) dev_->link_back();
        a.abi_version = PVGPU_GUEST_ABI_VERSION;
        a.device_version = dev_->device_version;
        a.num_slots = static_cast<std::uint32_t>(dev_->slots.size());
        a.slots_used = dev_->used_slots();
        a.link = dev_->link;
        a.link_gen = dev_->link_gen;
        a.pid_hints = 1;
        a.channels = dev_->used_slots();
        a.pid_hint = 4242;
        a.weight = dev_->weight;
        a.irq_mode = PVGPU_IRQ_MSIX;
        return 0;
    }

    int alloc(pvgpu_ioc_alloc& a) override {
        if (a.size != sizeof a || a.flags != 0 || a.reserved[0] || a.reserved[1]) return EINVAL;
        ++dev_->allocs;
        if (dev_->link != PVGPU_LINK_READY) return ENOLINK;
        for (std::uint32_t h = 0; h < dev_->slots.size(); ++h) {
            FakeDevice::Slot& s = dev_->slots[h];
            if (s.used) continue;
            s = FakeDevice::Slot{};
            s.memfd = pvgpu::UniqueFd(::memfd_create("fake-pvgpu-channel", MFD_CLOEXEC));
            if (!s.memfd || ::ftruncate(s.memfd.get(), PVGPU_MMAP_CHANNEL_SIZE) != 0)
                throw std::runtime_error("memfd");
            s.gpu = Mapping(s.memfd.get(), PVGPU_MMAP_CHANNEL_SIZE);
            s.used = true;
            dev_->fresh_page(s);
            a.handle = h;
            a.chan_id = s.chan_id;
            a.mmap_offset = PVGPU_MMAP_OFFSET(h);
            a.pid_hint = 4242;
            return 0;
        }
        return ENOSPC;
    }

    int free(pvgpu_ioc_free& a) override {
        if (a.size != sizeof a || a.flags != 0 || a.reserved != 0) return EINVAL;
        if (a.handle >= dev_->slots.size() || !dev_->slots[a.handle].used) return EBADF;
        ++dev_->frees;
        dev_->slots[a.handle] = FakeDevice::Slot{};
        return 0;
    }

    int wait(pvgpu_ioc_wait& a) override {
        if (a.size != sizeof a || a.flags != 0 || a.reserved != 0) return EINVAL;
        if (a.handle >= dev_->slots.size() || !dev_->slots[a.handle].used) return EBADF;
        dev_->wait_timeouts.push_back(a.timeout_ns);
        ++dev_->waits;
        // Each round is a stretch of sleep in which the GPU runs up to
        // gpu_budget entries; a wait without timeout sleeps until it ends.
        FakeDevice::Slot& s = dev_->slots[a.handle];
        for (;;) {
            if (dev_->on_wait) dev_->on_wait(*dev_, a);
            if (dev_->eintr_waits > 0) {
                --dev_->eintr_waits;
                return EINTR;
            }
            const std::size_t ran = s.executed.size();
            dev_->run_gpu(s);
            if (static_cast<std::int32_t>(s.ctrl().fence - a.fence) >= 0) {
                a.status = PVGPU_WAIT_OK;
                a.error = 0;
                return 0;
            }
            if (s.ctrl().status == PVGPU_CHAN_STATUS_ERROR) {
                a.status = PVGPU_WAIT_DEAD;
                a.error = s.ctrl().error;
                return 0;
            }
            if (a.timeout_ns >= 0) return ETIME;
            if (s.executed.size() == ran)
                throw std::logic_error("wait for fence " + std::to_string(a.fence) + " would sleep forever");
        }
    }

    int wait_any(pvgpu_ioc_wait_any& a) override {
        ++dev_->wait_any_calls;
        if (!dev_->has_wait_any) return ENOTTY;
        if (a.size != sizeof a || a.flags != 0 || a.reserved0 != 0 || a.reserved1 != 0 || a.reserved[0] != 0 ||
            a.reserved[1] != 0)
            return EINVAL;
        if (a.count == 0 || a.count > PVGPU_WAIT_ANY_MAX) return EINVAL;
        if (a.targets == 0) return EFAULT;
        const auto* t = reinterpret_cast<const pvgpu_wait_target*>(a.targets);
        dev_->wait_any_targets.assign(t, t + a.count);
        for (const pvgpu_wait_target& w : dev_->wait_any_targets)
            if (w.handle >= dev_->slots.size() || !dev_->slots[w.handle].used) return EBADF;
        dev_->wait_timeouts.push_back(a.timeout_ns);
        // As wait(), over every target: the lowest index that ended it.
        for (;;) {
            if (dev_->on_wait_any) dev_->on_wait_any(*dev_, a);
            if (dev_->eintr_waits > 0) {
                --dev_->eintr_waits;
                return EINTR;
            }
            std::size_t ran = 0;
            for (FakeDevice::Slot& s : dev_->slots) ran += s.executed.size();
            for (const pvgpu_wait_target& w : dev_->wait_any_targets) dev_->run_gpu(dev_->slots[w.handle]);
            for (std::uint32_t i = 0; i < a.count; ++i) {
                const FakeDevice::Slot& s = dev_->slots[t[i].handle];
                if (static_cast<std::int32_t>(s.ctrl().fence - t[i].fence) >= 0) {
                    a.index = i;
                    a.status = PVGPU_WAIT_OK;
                    a.error = 0;
                    return 0;
                }
                if (s.ctrl().status == PVGPU_CHAN_STATUS_ERROR) {
                    a.index = i;
                    a.status = PVGPU_WAIT_DEAD;
                    a.error = s.ctrl().error;
                    return 0;
                }
            }
            if (a.timeout_ns >= 0) return ETIME;
            std::size_t now_ran = 0;
            for (FakeDevice::Slot& s : dev_->slots) now_ran += s.executed.size();
            if (now_ran == ran) throw std::logic_error("wait_any would sleep forever");
        }
    }

    int set_weight(pvgpu_ioc_set_weight& a) override {
        if (a.size != sizeof a || a.flags != 0 || a.reserved != 0) return EINVAL;
        if (dev_->device_version < 2) return EOPNOTSUPP;
        if (a.weight < PVGPU_WEIGHT_MIN || a.weight > PVGPU_WEIGHT_MAX) return EINVAL;
        if (dev_->link != PVGPU_LINK_READY) return ENOLINK;
        dev_->weights.push_back(a);
        dev_->weight = a.weight;
        return 0;
    }

    Mapping map_channel(std::uint64_t offset) override {
        const std::uint64_t handle = offset / (PVGPU_MMAP_PAGES_PER_CHANNEL * PVGPU_PAGE_SIZE);
        if (offset != PVGPU_MMAP_OFFSET(handle) || handle >= dev_->slots.size() || !dev_->slots[handle].used)
            throw pvgpu::ClientError("fake: bad mmap offset");
        return Mapping(dev_->slots[handle].memfd.get(), PVGPU_MMAP_CHANNEL_SIZE);
    }

private:
    std::shared_ptr<FakeDevice> dev_;
    std::string path_ = "/dev/fake-pvgpu";
};

pvgpu::ClientOptions fast_options() {
    pvgpu::ClientOptions o;
    o.reconnect_initial_backoff = 1ms;
    o.reconnect_max_backoff = 2ms;
    o.reconnect_timeout = 2000ms;
    return o;
}

pvgpu::Client fake_client(const std::shared_ptr<FakeDevice>& dev, pvgpu::ClientOptions o = fast_options()) {
    return pvgpu::detail::ClientAccess::with_device(std::move(o), std::make_unique<FakeOps>(dev));
}

// Sets an environment variable for one scope.
class ScopedEnv {
public:
    ScopedEnv(const char* name, const char* value) : name_(name) {
        if (const char* old = std::getenv(name)) old_ = old;
        if (value)
            ::setenv(name, value, 1);
        else
            ::unsetenv(name);
    }
    ~ScopedEnv() {
        if (old_)
            ::setenv(name_, old_->c_str(), 1);
        else
            ::unsetenv(name_);
    }
    ScopedEnv(const ScopedEnv&) = delete;
    ScopedEnv& operator=(const ScopedEnv&) = delete;

private:
    const char* name_;
    std::optional<std::string> old_;
};

}  // namespace

TEST_CASE("transport selection: device if its node exists, else the socket") {
    using pvgpu::Transport;
    using pvgpu::detail::device_path;
    using pvgpu::detail::select_transport;
    char node[] = "/tmp/pvgpu-test-nodeXXXXXX";
    const pvgpu::UniqueFd fd(::mkstemp(node));
    REQUIRE(fd);

    ScopedEnv env("PVGPU_DEVICE", nullptr);
    pvgpu::ClientOptions o;
    CHECK(device_path(o) == "/dev/pvgpu");
    o.device_path = "/nonexistent/pvgpu";
    CHECK(select_transport(o) == Transport::Socket);
    o.device_path = node;
    CHECK(select_transport(o) == Transport::Device);
    o.transport = Transport::Socket;
    CHECK(select_transport(o) == Transport::Socket);
    o.device_path = "/nonexistent/pvgpu";
    o.transport = Transport::Device;
    CHECK(select_transport(o) == Transport::Device);

    SECTION("PVGPU_DEVICE names the node when the option does not") {
        ScopedEnv set("PVGPU_DEVICE", node);
        pvgpu::ClientOptions d;
        CHECK(device_path(d) == node);
        CHECK(select_transport(d) == Transport::Device);
        d.device_path = "/nonexistent/pvgpu";
        CHECK(select_transport(d) == Transport::Socket);
    }
    SECTION("a forced device that cannot be opened is a clear error") {
        pvgpu::ClientOptions d;
        d.transport = Transport::Device;
        d.device_path = "/nonexistent/pvgpu";
        CHECK_THROWS_WITH(pvgpu::Client(d), Contains("cannot open /nonexistent/pvgpu") && Contains("module loaded"));
        d.device_path = node;  // a regular file: open works, the ioctl does not
        CHECK_THROWS_WITH(pvgpu::Client(d), Contains("PVGPU_IOC_INFO on ") && Contains("not a pvgpu device"));
    }
    ::unlink(node);
}

TEST_CASE("task weights: device only, range-checked, applied on open") {
    auto dev = std::make_shared<FakeDevice>();
    pvgpu::ClientOptions o = fast_options();
    o.weight = 250;
    pvgpu::Client client = fake_client(dev, o);
    REQUIRE(dev->weights.size() == 1);
    CHECK(dev->weights[0].pid == 0);
    CHECK(dev->weights[0].weight == 250);
    const pvgpu::TransportInfo info = client.info();
    CHECK(info.transport == pvgpu::Transport::Device);
    CHECK(info.weight == 250);
    CHECK(info.link == PVGPU_LINK_READY);
    CHECK(info.num_slots == 4);
    CHECK(client.transport() == pvgpu::Transport::Device);

    SECTION("weight 0 leaves it alone") {
        auto d2 = std::make_shared<FakeDevice>();
        pvgpu::Client c2 = fake_client(d2);
        CHECK(d2->weights.empty());
    }
    SECTION("out of range") {
        o.weight = 10001;
        CHECK_THROWS_WITH(fake_client(std::make_shared<FakeDevice>(), o), Contains("out of range 1..10000"));
    }
    SECTION("a version-1 device has no task weights") {
        auto old = std::make_shared<FakeDevice>();
        old->device_version = 1;
        CHECK_THROWS_WITH(fake_client(old, o), Contains("version 2") && Contains("is version 1"));
    }
    SECTION("the socket transport refuses a weight instead of ignoring it") {
        pvgpu::ClientOptions s;
        s.transport = pvgpu::Transport::Socket;
        s.socket_path = "/nonexistent/pvgpud.sock";
        s.weight = 50;
        CHECK_THROWS_WITH(pvgpu::Client(s), Contains("only inside a VM") && Contains("pvgpuctl set-weight"));
    }
}

TEST_CASE("device submission: ring entries, IB_PUT, doorbell; 64-bit fences over 32-bit wrap") {
    auto dev = std::make_shared<FakeDevice>();
    dev->initial_counter = 0xffff'fff0u;  // the ring fences wrap after 15 entries
    pvgpu::Client client = fake_client(dev);
    pvgpu::Channel ch = client.alloc_channel();
    const std::uint32_t h = dev->only_used_handle();
    CHECK(ch.id() == dev->slot(h).chan_id);

    std::uint64_t fence = 0;
    std::vector<std::uint64_t> sent;
    for (std::uint64_t i = 1; i <= 40; ++i) {
        std::vector<std::uint64_t> batch{1000 + i, 2000 + i};
        fence = ch.submit(batch);
        sent.insert(sent.end(), batch.begin(), batch.end());
        CHECK(fence == 2 * i);
        // IB_PUT is published before the doorbell names it.
        CHECK(dev->slot(h).ctrl().ib_put == static_cast<std::uint32_t>(0xffff'fff0u + 2 * i));
        REQUIRE(ch.wait(fence));
        CHECK(ch.completed() == fence);
    }
    CHECK(ch.outstanding() == 0);
    CHECK(dev->slot(h).executed == sent);
    // The ring fences went through the wrap; the application's did not notice.
    CHECK(dev->slot(h).fences.front() == 0xffff'fff1u);
    CHECK(dev->slot(h).fences.back() == static_cast<std::uint32_t>(0xffff'fff0u + 80));
    // Nothing waited forever or polled: one wait per batch (ring full never hit).
    CHECK(dev->wait_timeouts.size() == 40);
    for (const std::int64_t t : dev->wait_timeouts) CHECK(t == -1);

    SECTION("more than the ring holds waits for space") {
        std::vector<std::uint64_t> many(PVGPU_RING_ENTRIES + 10, 7);
        dev->gpu_budget = 64;
        const std::uint64_t last = ch.submit(many);
        CHECK(last == fence + many.size());
        REQUIRE(ch.drain());
        CHECK(dev->slot(h).executed.size() == sent.size() + many.size());
    }
}

TEST_CASE("device waits: timeout, EINTR, wait_any") {
    auto dev = std::make_shared<FakeDevice>();
    pvgpu::Client client = fake_client(dev);
    pvgpu::Channel a = client.alloc_channel();
    pvgpu::Channel b = client.alloc_channel();

    dev->gpu_budget = 0;  // the GPU is busy elsewhere
    const std::uint64_t fa = a.submit(5'000'000);
    CHECK_FALSE(a.wait(fa, 5ms));
    REQUIRE_FALSE(dev->wait_timeouts.empty());
    for (const std::int64_t t : dev->wait_timeouts) CHECK((t >= 0 && t <= 5'000'000));

    dev->gpu_budget = SIZE_MAX;
    dev->eintr_waits = 1;  // Channel::wait sleeps on through a signal
    CHECK(a.wait(fa));

    const std::uint64_t fb = b.submit(1000);
    dev->eintr_waits = 1;  // wait_any returns early on one
    const pvgpu::Client::WaitGoal goals[] = {{&b, fb}};
    CHECK_FALSE(client.wait_any(goals, std::chrono::steady_clock::now() + 1s));
    CHECK(client.wait_any(goals, std::chrono::steady_clock::now() + 1s));
    CHECK(b.completed() == fb);

    SECTION("with several goals, one PVGPU_IOC_WAIT_ANY over all, no timed look") {
        // a is expected first but its work never starts; b's ends the wait.
        dev->wait_timeouts.clear();
        dev->slot(0).stalled = true;
        const std::uint64_t fa2 = a.submit(1'000);       // 1 us
        const std::uint64_t fb2 = b.submit(50'000'000);  // 50 ms
        const std::uint64_t polls = client.stats().polls;
        const int waits = dev->waits;
        const pvgpu::Client::WaitGoal both[] = {{&a, fa2}, {&b, fb2}};
        CHECK(client.wait_any(both, std::chrono::steady_clock::time_point::max()));
        CHECK(b.completed() == fb2);
        CHECK(a.completed() < fa2);
        // One sleep, over both channels, without a deadline; no single WAIT.
        CHECK(client.stats().polls == polls + 1);
        CHECK(dev->wait_any_calls == 1);
        CHECK(dev->waits == waits);
        REQUIRE(dev->wait_timeouts.size() == 1);
        CHECK(dev->wait_timeouts[0] == -1);
        REQUIRE(dev->wait_any_targets.size() == 2);
        CHECK(dev->wait_any_targets[0].handle == 0);  // ordered by expected completion
        CHECK(dev->wait_any_targets[1].handle == 1);
        CHECK(dev->wait_any_targets[1].fence == dev->slot(1).fences.back());
    }
    SECTION("a module without PVGPU_IOC_WAIT_ANY: sleeps on one, decided once") {
        dev->has_wait_any = false;
        dev->wait_timeouts.clear();
        const std::uint64_t fa2 = a.submit(50'000'000);  // 50 ms
        const std::uint64_t fb2 = b.submit(1'000);       // 1 us
        const pvgpu::Client::WaitGoal both[] = {{&a, fa2}, {&b, fb2}};
        CHECK(client.wait_any(both, std::chrono::steady_clock::time_point::max()));
        CHECK(b.completed() == fb2);
        CHECK(dev->wait_any_calls == 1);
        // It slept on b, the one expected first, bounded by when a is expected.
        REQUIRE(dev->wait_timeouts.size() == 1);
        CHECK(dev->wait_timeouts[0] > 0);
        CHECK(dev->wait_timeouts[0] <= 50'000'000);
        // Not asked again.
        const std::uint64_t fb3 = b.submit(1'000);
        const pvgpu::Client::WaitGoal again[] = {{&a, fa2}, {&b, fb3}};
        CHECK(client.wait_any(again, std::chrono::steady_clock::time_point::max()));
        CHECK(dev->wait_any_calls == 1);
        CHECK(dev->waits >= 2);
    }
    SECTION("several goals on one channel are one WAIT on its lowest fence") {
        const std::uint64_t f1 = a.submit(1'000);
        const std::uint64_t f2 = a.submit(1'000);
        const int waits = dev->waits;
        const pvgpu::Client::WaitGoal same[] = {{&a, f2}, {&a, f1}};
        CHECK(client.wait_any(same, std::chrono::steady_clock::time_point::max()));
        CHECK(dev->wait_any_calls == 0);
        CHECK(dev->waits == waits + 1);
    }
}

TEST_CASE("device wait_any: a dead or lost channel that is not the first target") {
    auto dev = std::make_shared<FakeDevice>();
    pvgpu::ClientOptions o = fast_options();
    o.reconnect = false;
    pvgpu::Client client = fake_client(dev, o);
    pvgpu::Channel a = client.alloc_channel();
    pvgpu::Channel b = client.alloc_channel();
    dev->slot(0).stalled = true;
    const std::uint64_t fa = a.submit(1'000);       // expected first: target 0
    const std::uint64_t fb = b.submit(50'000'000);  // target 1
    const pvgpu::Client::WaitGoal both[] = {{&a, fa}, {&b, fb}};
    dev->slot(1).stalled = true;
    const std::string b_name = "channel " + std::to_string(b.id());  // before the session goes

    SECTION("dead: an error of that channel, not a reconnect") {
        dev->on_wait_any = [](FakeDevice& d, const pvgpu_ioc_wait_any&) { d.kill(1, PVGPU_CHAN_ERR_WATCHDOG); };
        CHECK_THROWS_WITH(client.wait_any(both, std::chrono::steady_clock::time_point::max()),
                          Contains(b_name) && Contains("watchdog"));
        CHECK(dev->wait_any_calls == 1);
        CHECK(client.stats().reconnects == 0);
        // a is fine.
        dev->slot(0).stalled = false;
        CHECK(a.wait(fa));
    }
    SECTION("lost: the link") {
        dev->on_wait_any = [](FakeDevice& d, const pvgpu_ioc_wait_any&) {
            d.slot(1).lost = true;
            d.kill(1, PVGPU_CHAN_ERR_LOST);
        };
        CHECK_THROWS_WITH(client.wait_any(both, std::chrono::steady_clock::time_point::max()),
                          Contains("lost the link of /dev/fake-pvgpu") &&
                              Contains(b_name + ": the device lost its link"));
        CHECK(dev->wait_any_calls == 1);
    }
}

TEST_CASE("dead channels: watchdog and bad entry are errors, not reconnects") {
    auto dev = std::make_shared<FakeDevice>();
    pvgpu::Client client = fake_client(dev);
    pvgpu::Channel ch = client.alloc_channel();
    const std::uint32_t h = dev->only_used_handle();
    dev->gpu_budget = 1;
    const std::uint64_t f = ch.submit(std::vector<std::uint64_t>{1, 2, 3});
    const std::uint32_t error = GENERATE(PVGPU_CHAN_ERR_WATCHDOG, PVGPU_CHAN_ERR_BAD_ENTRY);
    dev->on_wait = [&](FakeDevice& d, const pvgpu_ioc_wait&) {
        if (d.slot(h).executed.size() == 1) d.kill(h, error);
    };
    const char* text = error == PVGPU_CHAN_ERR_WATCHDOG ? "watchdog" : "bad ring entry";
    CHECK_THROWS_WITH(ch.wait(f), Contains("channel " + std::to_string(ch.id())) && Contains(text));
    CHECK_THROWS_WITH(ch.submit(1), Contains(text));
    CHECK(client.stats().reconnects == 0);
    CHECK(dev->allocs == 1);
}

TEST_CASE("link lost: the channel is re-allocated and unfinished work resubmitted") {
    auto dev = std::make_shared<FakeDevice>();
    std::vector<std::string> log;
    pvgpu::ClientOptions o = fast_options();
    o.log = [&](const std::string& line) { log.push_back(line); };
    pvgpu::Client client = fake_client(dev, o);
    pvgpu::Channel ch = client.alloc_channel();
    const std::uint32_t old_chan = ch.id();

    std::vector<std::uint64_t> payloads;
    for (std::uint64_t i = 1; i <= 10; ++i) payloads.push_back(i * 1000);
    const std::uint64_t last = ch.submit(payloads);
    CHECK(last == 10);
    dev->gpu_budget = 3;
    REQUIRE(ch.wait(3));
    CHECK(ch.completed() == 3);

    // pvgpud goes away; the device reports the link down for 3 looks.
    dev->realloc_in_place = GENERATE(false, true);
    dev->on_wait = [](FakeDevice& d, const pvgpu_ioc_wait&) {
        d.on_wait = nullptr;
        d.lose_link(3);
    };
    dev->gpu_budget = SIZE_MAX;
    REQUIRE(ch.wait(last));
    CHECK(ch.completed() == 10);
    CHECK(client.stats().reconnects == 1);
    CHECK(client.stats().resubmitted == 7);
    CHECK(dev->frees == 1);   // the lost channel was given back
    CHECK(ch.id() != old_chan);
    const std::uint32_t h = dev->only_used_handle();
    CHECK(dev->slot(h).executed == std::vector<std::uint64_t>(payloads.begin() + 3, payloads.end()));
    CHECK(std::any_of(log.begin(), log.end(), [](const std::string& l) {
        return l.find("lost the link of /dev/fake-pvgpu to pvgpud") != std::string::npos &&
               l.find("error 0x80") != std::string::npos;
    }));
    CHECK(std::any_of(log.begin(), log.end(),
                      [](const std::string& l) { return l.find("resubmitted 7 entries") != std::string::npos; }));

    // Fences go on from where they were.
    CHECK(ch.submit(42) == 11);
    REQUIRE(ch.drain());
    CHECK(dev->slot(h).executed.back() == 42);
}

TEST_CASE("a channel the device replaced without telling us is recovered before submitting") {
    auto dev = std::make_shared<FakeDevice>();
    pvgpu::Client client = fake_client(dev);
    pvgpu::Channel ch = client.alloc_channel();
    dev->gpu_budget = 2;
    ch.submit(std::vector<std::uint64_t>{11, 12, 13, 14, 15});
    REQUIRE(ch.wait(2));

    // Loss and re-allocation in place both happen between two looks: the
    // page is a fresh channel (FENCE 0, IB_PUT 0), no wait reported it.
    dev->realloc_in_place = true;
    dev->lose_link(0);
    dev->link_back();
    dev->gpu_budget = SIZE_MAX;
    CHECK(ch.submit(16) == 6);
    CHECK(ch.completed() == 2);  // the fresh page's FENCE was not taken for ours
    REQUIRE(ch.drain());
    const std::uint32_t h = dev->only_used_handle();
    CHECK(dev->slot(h).executed == std::vector<std::uint64_t>{13, 14, 15, 16});
    CHECK(client.stats().resubmitted == 3);
}

TEST_CASE("link down: allocation waits for it, up to the reconnect timeout") {
    SECTION("comes back") {
        auto dev = std::make_shared<FakeDevice>();
        dev->link = PVGPU_LINK_DOWN;
        dev->down_for_infos = 4;
        pvgpu::Client client = fake_client(dev);  // not an error at open
        pvgpu::Channel ch = client.alloc_channel();
        CHECK(ch);
        CHECK(dev->link_gen == 2);
        CHECK(client.stats().reconnects == 0);  // it was never connected
    }
    SECTION("stays down") {
        auto dev = std::make_shared<FakeDevice>();
        pvgpu::ClientOptions o = fast_options();
        o.reconnect_timeout = 30ms;
        pvgpu::Client client = fake_client(dev, o);
        pvgpu::Channel ch = client.alloc_channel();
        const std::uint64_t f = ch.submit(1);
        dev->lose_link(1'000'000);
        CHECK_THROWS_WITH(ch.wait(f), Contains("could not reconnect within 30 ms") &&
                                          Contains("link to pvgpud is down"));
    }
    SECTION("reconnect = false gives up at once") {
        auto dev = std::make_shared<FakeDevice>();
        pvgpu::ClientOptions o = fast_options();
        o.reconnect = false;
        pvgpu::Client client = fake_client(dev, o);
        pvgpu::Channel ch = client.alloc_channel();
        const std::uint64_t f = ch.submit(1);
        dev->lose_link(1'000'000);
        CHECK_THROWS_WITH(ch.wait(f), Contains("lost the link of /dev/fake-pvgpu") && Contains("error 0x80"));
    }
    SECTION("the weight is applied once, also when the link was down at first") {
        auto dev = std::make_shared<FakeDevice>();
        pvgpu::ClientOptions o = fast_options();
        o.weight = 300;
        pvgpu::Client client = fake_client(dev, o);
        pvgpu::Channel ch = client.alloc_channel();
        const std::uint64_t f = ch.submit(1);
        dev->lose_link(2);
        REQUIRE(ch.wait(f));
        CHECK(dev->weights.size() == 1);  // the driver sends it again itself

        auto down = std::make_shared<FakeDevice>();
        down->link = PVGPU_LINK_DOWN;
        down->down_for_infos = 2;
        pvgpu::Client late = fake_client(down, o);
        CHECK(down->weights.empty());
        pvgpu::Channel c2 = late.alloc_channel();
        REQUIRE(down->weights.size() == 1);
        CHECK(down->weights[0].weight == 300);
    }
}

TEST_CASE("every slot in use is a clear error") {
    auto dev = std::make_shared<FakeDevice>();
    pvgpu::Client client = fake_client(dev);
    std::vector<pvgpu::Channel> channels;
    for (int i = 0; i < 4; ++i) channels.push_back(client.alloc_channel());
    CHECK_THROWS_WITH(client.alloc_channel(), Contains("no free channel on /dev/fake-pvgpu") &&
                                                  Contains("4 of 4 slots"));
    channels.pop_back();  // freeing gives the slot back
    CHECK(dev->frees == 1);
    CHECK(client.alloc_channel());
}

TEST_CASE("GPU index: PVGPU_GPU and ClientOptions::gpu on the socket, the device's own GPU in a VM") {
    CHECK(pvgpu::parse_gpu("0") == 0);
    CHECK(pvgpu::parse_gpu("15") == 15);
    CHECK(pvgpu::parse_gpu("007") == 7);
    for (const char* bad : {"16", "-1", "+1", "", " 1", "1 ", "x", "1x", "0x1", "99999999999999999999"}) {
        INFO(bad);
        CHECK_THROWS_WITH(pvgpu::parse_gpu(bad),
                          "PVGPU_GPU: '" + std::string(bad) + "' is not a GPU index (an integer in 0..15)");
    }
    CHECK_THROWS_WITH(pvgpu::parse_gpu("16", "--gpu"), Contains("--gpu: '16'"));

    pvgpu::ClientOptions s;
    s.transport = pvgpu::Transport::Socket;
    s.socket_path = "/nonexistent/pvgpud.sock";
    SECTION("a bad PVGPU_GPU is an error before connecting") {
        ScopedEnv env("PVGPU_GPU", "two");
        CHECK_THROWS_WITH(pvgpu::Client(s), "PVGPU_GPU: 'two' is not a GPU index (an integer in 0..15)");
    }
    SECTION("a good or empty PVGPU_GPU gets as far as the socket") {
        ScopedEnv env("PVGPU_GPU", "3");
        CHECK_THROWS_WITH(pvgpu::Client(s), Contains("cannot connect to /nonexistent/pvgpud.sock"));
        ScopedEnv empty("PVGPU_GPU", "");
        CHECK_THROWS_WITH(pvgpu::Client(s), Contains("cannot connect to /nonexistent/pvgpud.sock"));
    }
    SECTION("the option wins over PVGPU_GPU, and is range-checked") {
        ScopedEnv env("PVGPU_GPU", "two");
        s.gpu = 1;
        CHECK_THROWS_WITH(pvgpu::Client(s), Contains("cannot connect to /nonexistent/pvgpud.sock"));
        s.gpu = 16;
        CHECK_THROWS_WITH(pvgpu::Client(s), "GPU 16 is out of range 0..15");
    }
    SECTION("the device ignores PVGPU_GPU and refuses the option") {
        ScopedEnv env("PVGPU_GPU", "two");
        pvgpu::Client c = fake_client(std::make_shared<FakeDevice>());
        CHECK(c.transport() == pvgpu::Transport::Device);
        CHECK_FALSE(c.info().gpu);
        pvgpu::ClientOptions o = fast_options();
        o.gpu = 1;
        CHECK_THROWS_WITH(fake_client(std::make_shared<FakeDevice>(), o),
                          Contains("a GPU (1) can be named only by a host client") && Contains("gpu=N"));
    }
}
