// libpvgpu's device transport: an application inside a VM and the pvgpu guest
// driver's /dev/pvgpu (include/pvgpu/guest_ioctl.h).  The driver allocates
// channels on the VM's pvgpu PCI device and maps a channel's control page,
// doorbell page and ring into the process; submission is stores only (ring
// entries, IB_PUT, a 32-bit doorbell store: docs/pvgpu-device.md section 6).
// Waits sleep in PVGPU_IOC_WAIT (one channel) or PVGPU_IOC_WAIT_ANY (several),
// which the device ends with an interrupt.
#include <fcntl.h>
#include <sys/ioctl.h>
#include <time.h>
#include <unistd.h>

#include <algorithm>
#include <vector>

#include "device_ops.hpp"
#include "proto/unique_fd.hpp"

namespace pvgpu::detail {
namespace {

using std::chrono::nanoseconds;

const char* link_name(std::uint32_t link) {
    switch (link) {
    case PVGPU_LINK_DOWN: return "down";
    case PVGPU_LINK_HELLO: return "connecting (HELLO in flight)";
    case PVGPU_LINK_READY: return "ready";
    default: return "in an unknown state";
    }
}

class SystemDevice final : public DeviceOps {
public:
    explicit SystemDevice(std::string path) : path_(std::move(path)) {
        fd_ = UniqueFd(::open(path_.c_str(), O_RDWR | O_CLOEXEC));
        if (!fd_) {
            const int err = errno;
            std::string hint;
            if (err == ENOENT || err == ENXIO || err == ENODEV) hint = " (is the pvgpu module loaded?)";
            if (err == EACCES || err == EPERM) hint = " (check the device node's permissions)";
            throw ClientError("cannot open " + path_ + ": " + errno_text(err) + hint);
        }
    }

    const std::string& path() const override { return path_; }
    int info(pvgpu_ioc_info& arg) override { return call(PVGPU_IOC_INFO, &arg); }
    int alloc(pvgpu_ioc_alloc& arg) override { return call(PVGPU_IOC_ALLOC, &arg); }
    int free(pvgpu_ioc_free& arg) override { return call(PVGPU_IOC_FREE, &arg); }
    int wait(pvgpu_ioc_wait& arg) override { return call(PVGPU_IOC_WAIT, &arg); }
    int wait_any(pvgpu_ioc_wait_any& arg) override { return call(PVGPU_IOC_WAIT_ANY, &arg); }
    int set_weight(pvgpu_ioc_set_weight& arg) override { return call(PVGPU_IOC_SET_WEIGHT, &arg); }
    Mapping map_channel(std::uint64_t offset) override {
        return Mapping(fd_.get(), PVGPU_MMAP_CHANNEL_SIZE, offset);
    }

private:
    int call(unsigned long request, void* arg) { return ::ioctl(fd_.get(), request, arg) < 0 ? errno : 0; }

    std::string path_;
    UniqueFd fd_;
};

class DeviceTransport final : public TransportBackend {
public:
    DeviceTransport(std::unique_ptr<DeviceOps> ops, const ClientOptions& options)
        : ops_(std::move(ops)), options_(options) {
        // The VM's GPU is its device's, chosen by the host admin; $PVGPU_GPU,
        // which a host-wide environment may set, is ignored here.
        if (options_.gpu)
            throw ClientError("a GPU (" + std::to_string(*options_.gpu) +
                              ") can be named only by a host client (socket transport); inside a VM the "
                              "GPU is the pvgpu device's (QEMU property gpu=N, set on the host)");
        info_ = query_info();
        if (info_.abi_version != PVGPU_GUEST_ABI_VERSION)
            throw ClientError(ops_->path() + " speaks guest ABI version " + std::to_string(info_.abi_version) +
                              ", this libpvgpu version " + std::to_string(PVGPU_GUEST_ABI_VERSION));
        if (options_.weight != 0 && info_.device_version < 2)
            throw ClientError("task weights need a pvgpu device of version 2 or later; " + ops_->path() +
                              " is version " + std::to_string(info_.device_version));
    }

    pvgpu::Transport kind() const override { return pvgpu::Transport::Device; }
    std::string describe() const override { return "the link of " + ops_->path() + " to pvgpud"; }

    void connect() override {
        info_ = query_info();
        require_link();
        // Once set, the driver keeps the weight and sends it again after a
        // reconnect of the device (docs/guest.md section 7).
        if (options_.weight == 0 || weight_applied_) return;
        pvgpu_ioc_set_weight w{};
        w.size = sizeof w;
        w.pid = 0;
        w.weight = options_.weight;
        if (const int err = retry_eintr([&] { return ops_->set_weight(w); })) {
            info_ = query_info();
            require_link();
            std::string why;
            if (err == EPERM && options_.weight > PVGPU_WEIGHT_DEFAULT)
                why = " (a weight above the default " + std::to_string(PVGPU_WEIGHT_DEFAULT) +
                      " needs CAP_SYS_NICE, as nice does)";
            if (err == EDQUOT) why = " (this user's processes hold the driver's weights_per_uid task weights)";
            throw ClientError("PVGPU_IOC_SET_WEIGHT(" + std::to_string(options_.weight) + ") on " + ops_->path() +
                              " failed: " + errno_text(err) + why);
        }
        weight_applied_ = true;
        if (info_.pid_hints == 0)
            log(ops_->path() + ": pid hints are off in this VM (module parameter pid_hints=0), so the task "
                               "weight " + std::to_string(options_.weight) + " has no effect");
    }

    void disconnect() override {}

    ChannelLink allocate() override {
        pvgpu_ioc_alloc a{};
        a.size = sizeof a;
        if (const int err = retry_eintr([&] { return ops_->alloc(a); })) {
            info_ = query_info();
            require_link();
            std::string why;
            if (err == ENOSPC)
                throw ClientError("no free channel on " + ops_->path() + ": " + std::to_string(info_.slots_used) +
                                  " of " + std::to_string(info_.num_slots) + " slots in use in this VM");
            if (err == EDQUOT) why = " (pvgpud refused: the VM's channel limit)";
            if (err == EBUSY) why = " (pvgpud refused: channels with and without pid hints in one VM)";
            if (err == ETIMEDOUT) why = " (pvgpud did not answer in time; see the driver's cmd_timeout_ms)";
            throw ClientError("PVGPU_IOC_ALLOC on " + ops_->path() + " failed: " + errno_text(err) + why);
        }
        ChannelLink link;
        link.handle = a.handle;
        link.chan_id = a.chan_id;
        try {
            link.mem = ops_->map_channel(a.mmap_offset);
        } catch (const ClientError& e) {
            give_back(a.handle);
            throw ClientError(std::string(e.what()) + " (" + ops_->path() + ", handle " +
                              std::to_string(a.handle) + ")");
        }
        link.ctrl = reinterpret_cast<pvgpu_ctrl_page*>(link.mem.data() + PVGPU_MMAP_CTRL);
        link.doorbell_reg = reinterpret_cast<volatile std::uint32_t*>(link.mem.data() + PVGPU_MMAP_DOORBELL);
        link.ring = reinterpret_cast<pvgpu_ring*>(link.mem.data() + PVGPU_MMAP_RING);
        return link;
    }

    // The driver holds the slot whatever happened to the link (a lost slot
    // is freed at once), so it is always given back.
    void release(ChannelLink& link, bool /*session_alive*/) override {
        const bool was_attached = link.attached();
        const std::uint32_t handle = link.handle;
        link = ChannelLink{};  // unmaps first: the driver frees mapped slots too, but need not
        if (was_attached) give_back(handle);
    }

    void ring_doorbell(ChannelLink& link) override {
        // Any value will do; IB_PUT's helps when reading a trace.
        __atomic_store_n(link.doorbell_reg, link.put, __ATOMIC_RELEASE);
    }

    void service() override {}
    // Any, unless the module turned out to lack PVGPU_IOC_WAIT_ANY (an older
    // one answers ENOTTY): then one channel at a time, as before it.
    CompletionWake completion_wake() const override {
        return wait_any_missing_ ? CompletionWake::First : CompletionWake::Any;
    }

    SleepResult sleep(std::span<const WaitTarget> targets, TimePoint wake) override {
        if (targets.empty()) return sleep_until(wake);
        // Per channel only its lowest fence matters: it is reached first.
        unique_.clear();
        for (const WaitTarget& t : targets) {
            auto it = std::find_if(unique_.begin(), unique_.end(),
                                   [&](const WaitTarget& u) { return u.link == t.link; });
            if (it == unique_.end())
                unique_.push_back(t);
            else if (static_cast<std::int32_t>(t.dev_fence - it->dev_fence) < 0)
                it->dev_fence = t.dev_fence;
        }
        if (unique_.size() == 1 || wait_any_missing_) return sleep_one(unique_.front(), wake);
        return sleep_any(wake);
    }

    TransportInfo info() override {
        info_ = query_info();
        TransportInfo i;
        i.transport = pvgpu::Transport::Device;
        i.path = ops_->path();
        i.abi_version = info_.abi_version;
        i.device_version = info_.device_version;
        i.num_slots = info_.num_slots;
        i.slots_used = info_.slots_used;
        i.link = info_.link;
        i.link_gen = info_.link_gen;
        i.irq_mode = info_.irq_mode;
        i.pid_hints = info_.pid_hints != 0;
        i.channels = info_.channels;
        i.pid_hint = info_.pid_hint;
        i.weight = info_.weight;
        return i;
    }
    std::uint32_t client_id() const override { return 0; }
    std::uint32_t max_channels() const override { return info_.num_slots; }

private:
    void log(const std::string& line) const {
        if (options_.log) options_.log(line);
    }

    template <class Call> static int retry_eintr(Call&& call) {
        int err;
        do {
            err = call();
        } while (err == EINTR);
        return err;
    }

    pvgpu_ioc_info query_info() {
        pvgpu_ioc_info i{};
        i.size = sizeof i;
        if (const int err = retry_eintr([&] { return ops_->info(i); }))
            throw ClientError("PVGPU_IOC_INFO on " + ops_->path() + " failed: " + errno_text(err) +
                              (err == ENOTTY ? " (not a pvgpu device?)" : ""));
        return i;
    }

    // LinkLost unless the device is connected to pvgpud (per info_).
    void require_link() const {
        if (info_.link != PVGPU_LINK_READY)
            throw LinkLost{"the device's link to pvgpud is " + std::string(link_name(info_.link)) + " (link gen " +
                           std::to_string(info_.link_gen) + ")"};
    }

    void give_back(std::uint32_t handle) {
        pvgpu_ioc_free f{};
        f.size = sizeof f;
        f.handle = handle;
        if (const int err = retry_eintr([&] { return ops_->free(f); }))
            log("PVGPU_IOC_FREE of handle " + std::to_string(handle) + " on " + ops_->path() +
                " failed: " + errno_text(err));
    }

    static std::int64_t timeout_ns(TimePoint wake) {
        if (wake == TimePoint::max()) return -1;
        return std::max<std::int64_t>(0, nanoseconds(wake - SteadyClock::now()).count());
    }

    // PVGPU_IOC_WAIT on one channel.
    SleepResult sleep_one(const WaitTarget& target, TimePoint wake) {
        pvgpu_ioc_wait w{};
        w.size = sizeof w;
        w.handle = target.link->handle;
        w.fence = target.dev_fence;
        w.timeout_ns = timeout_ns(wake);
        const int err = ops_->wait(w);
        if (err == EINTR) return SleepResult::Interrupted;
        if (err == ETIME || err == ETIMEDOUT) return SleepResult::Woke;
        if (err != 0)
            throw ClientError("PVGPU_IOC_WAIT on " + ops_->path() + " (channel " +
                              std::to_string(target.link->chan_id) + ", handle " + std::to_string(w.handle) +
                              ", fence " + std::to_string(w.fence) + ") failed: " + errno_text(err));
        wait_ended("PVGPU_IOC_WAIT", target, w.status, w.error);
        return SleepResult::Woke;
    }

    // PVGPU_IOC_WAIT_ANY on unique_ (one target per channel).
    SleepResult sleep_any(TimePoint wake) {
        if (unique_.size() > PVGPU_WAIT_ANY_MAX)
            throw ClientError("internal: a wait on " + std::to_string(unique_.size()) +
                              " channels, PVGPU_IOC_WAIT_ANY takes at most " + std::to_string(PVGPU_WAIT_ANY_MAX));
        wait_targets_.clear();
        for (const WaitTarget& t : unique_) wait_targets_.push_back(pvgpu_wait_target{t.link->handle, t.dev_fence});
        pvgpu_ioc_wait_any w{};
        w.size = sizeof w;
        w.count = static_cast<std::uint32_t>(wait_targets_.size());
        w.targets = reinterpret_cast<std::uintptr_t>(wait_targets_.data());
        w.timeout_ns = timeout_ns(wake);
        const int err = ops_->wait_any(w);
        if (err == ENOTTY) {
            // Decided once: an older module.  The caller looks again and,
            // told First now, sleeps on one channel with timed looks.
            wait_any_missing_ = true;
            log(ops_->path() + ": the pvgpu module has no PVGPU_IOC_WAIT_ANY (an older version); waits on "
                               "several channels sleep on one and look at the others");
            return SleepResult::Woke;
        }
        if (err == EINTR) return SleepResult::Interrupted;
        if (err == ETIME || err == ETIMEDOUT) return SleepResult::Woke;
        if (err != 0) {
            std::string chans;
            for (const WaitTarget& t : unique_)
                chans += (chans.empty() ? "" : ", ") + std::to_string(t.link->chan_id);
            throw ClientError("PVGPU_IOC_WAIT_ANY on " + ops_->path() + " (channels " + chans +
                              ") failed: " + errno_text(err));
        }
        if (w.index >= unique_.size())
            throw ClientError("PVGPU_IOC_WAIT_ANY on " + ops_->path() + " returned index " + std::to_string(w.index) +
                              " of " + std::to_string(unique_.size()) + " targets");
        wait_ended("PVGPU_IOC_WAIT_ANY", unique_[w.index], w.status, w.error);
        return SleepResult::Woke;
    }

    // What a wait reported for `target`: reached, or its channel died.
    void wait_ended(const char* call, const WaitTarget& target, std::uint32_t status, std::uint32_t error) {
        ChannelLink& l = *target.link;
        if (status == PVGPU_WAIT_DEAD) {
            if (error == PVGPU_CHAN_ERR_LOST)
                throw LinkLost{"channel " + std::to_string(l.chan_id) +
                               ": the device lost its link to pvgpud (error 0x80)"};
            if (error == PVGPU_CHAN_ERR_NONE)
                throw ClientError(ops_->path() + " reported channel " + std::to_string(l.chan_id) +
                                  " dead without an error code");
            // The control page says the same; this saves relying on it.
            l.error = error;
        } else if (status == PVGPU_WAIT_OK) {
            if (!l.reached_valid || static_cast<std::int32_t>(target.dev_fence - l.reached) > 0)
                l.reached = target.dev_fence;
            l.reached_valid = true;
        } else {
            throw ClientError(std::string(call) + " on " + ops_->path() + " returned unknown status " +
                              std::to_string(status));
        }
    }

    // Sleeps without a channel to wait for (an application's own pacing).
    static SleepResult sleep_until(TimePoint wake) {
        if (wake == TimePoint::max()) {
            ::pause();  // only a signal ends it
            return SleepResult::Interrupted;
        }
        const auto since_epoch = nanoseconds(wake.time_since_epoch()).count();
        timespec ts{};
        ts.tv_sec = static_cast<time_t>(since_epoch / 1'000'000'000);
        ts.tv_nsec = static_cast<long>(since_epoch % 1'000'000'000);
        // steady_clock is CLOCK_MONOTONIC.
        const int rc = ::clock_nanosleep(CLOCK_MONOTONIC, TIMER_ABSTIME, &ts, nullptr);
        return rc == EINTR ? SleepResult::Interrupted : SleepResult::Woke;
    }

    std::unique_ptr<DeviceOps> ops_;
    const ClientOptions& options_;
    pvgpu_ioc_info info_{};
    bool weight_applied_ = false;
    bool wait_any_missing_ = false;  // PVGPU_IOC_WAIT_ANY answered ENOTTY
    // sleep()'s, kept to spare allocations per wait.
    std::vector<WaitTarget> unique_;
    std::vector<pvgpu_wait_target> wait_targets_;
};

}  // namespace

std::unique_ptr<DeviceOps> open_device(const std::string& path) { return std::make_unique<SystemDevice>(path); }

std::unique_ptr<TransportBackend> make_device_transport(std::unique_ptr<DeviceOps> ops, const ClientOptions& options) {
    return std::make_unique<DeviceTransport>(std::move(ops), options);
}

}  // namespace pvgpu::detail
