// libpvgpu: see pvgpu.h for the contract.
//
// Structure: Client::Impl owns the channel states (keyed by a handle that
// stays stable across reconnects) and everything that is the same on every
// transport: fences, the entries kept for resubmission, ring and control page
// access, waiting, recovery.  A Transport (transport.hpp; socket_transport.cpp,
// device_transport.cpp) owns the session and the channels' memory.  Lost links
// surface inside the library as LinkLost; every public operation runs under
// with_reconnect(), which re-establishes the session (connect, allocate each
// channel, resubmit) and retries.
#include "pvgpu.h"

#include <unistd.h>

#include <pvgpu/abi.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <deque>
#include <map>
#include <optional>
#include <string_view>
#include <thread>
#include <utility>
#include <vector>

#include "device_ops.hpp"
#include "pvgpu_paths.h"
#include "socket_transport.hpp"
#include "transport.hpp"

namespace pvgpu {

// Constant-initialised, so usable from other libraries' static constructors.
extern const char* const kDefaultSocketPath = PVGPU_SOCKET_PATH;

const char* version() noexcept { return PVGPU_VERSION; }

const char* transport_name(Transport t) {
    switch (t) {
    case Transport::Auto: return "auto";
    case Transport::Socket: return "socket";
    case Transport::Device: return "device";
    }
    return "?";
}

std::uint32_t parse_gpu(std::string_view text, std::string_view what) {
    const auto bad = [&] {
        return ClientError(std::string(what) + ": '" + std::string(text) + "' is not a GPU index (an integer in 0.." +
                           std::to_string(kMaxGpus - 1) + ")");
    };
    std::uint32_t gpu = 0;
    for (const char c : text) {
        if (c < '0' || c > '9') throw bad();
        gpu = gpu * 10 + static_cast<std::uint32_t>(c - '0');
        if (gpu >= kMaxGpus) throw bad();
    }
    if (text.empty()) throw bad();
    return gpu;
}

namespace detail {

std::string device_path(const ClientOptions& options) {
    if (!options.device_path.empty()) return options.device_path;
    const char* env = std::getenv(kDeviceEnv);
    return env && *env ? env : kDefaultDevicePath;
}

pvgpu::Transport select_transport(const ClientOptions& options) {
    if (options.transport != pvgpu::Transport::Auto) return options.transport;
    // Only existence decides: a node we may not open is an error to report,
    // not a reason to talk to a socket that is not there inside a VM.
    return ::access(device_path(options).c_str(), F_OK) == 0 ? pvgpu::Transport::Device
                                                             : pvgpu::Transport::Socket;
}

std::string channel_error_text(std::uint32_t err) {
    switch (err) {
    case PVGPU_CHAN_ERR_WATCHDOG: return "killed by the GPU watchdog (a kernel ran too long)";
    case PVGPU_CHAN_ERR_BAD_ENTRY: return "killed by the GPU: bad ring entry";
    case PVGPU_CHAN_ERR_LOST: return "lost with the link to pvgpud (error 0x80)";
    default: return "stopped by the GPU (error " + std::to_string(err) + ")";
    }
}

}  // namespace detail

namespace {

using namespace detail;
using std::chrono::nanoseconds;

TimePoint saturating_add(TimePoint t, nanoseconds d) {
    if (d >= TimePoint::max() - t) return TimePoint::max();
    return t + d;
}

// One submitted entry the library has not yet seen complete.  The payload is
// kept so the entry can be resubmitted on a fresh channel after a reconnect.
struct Entry {
    std::uint64_t fence;         // the application's fence
    std::uint32_t dev_fence;     // fence written into the ring of the current channel
    std::uint64_t payload;       // kernel run time, ns
    TimePoint earliest_done;     // lower bound on its completion time
};

struct ChannelState {
    // Current channel (replaced on reconnect).
    ChannelLink link;
    // The link's channel is no longer ours (lost, replaced): recover.
    bool lost = false;

    // Application view (survives reconnects).  Application fences are 64-bit
    // and never wrap; the ring carries 32-bit device fences, matched to them
    // through `pending` (compared by difference, so they may wrap).
    std::uint64_t next_fence = 1;
    std::uint64_t completed = 0;
    std::deque<Entry> pending;
    std::string dead;                  // non-empty: why the channel is unusable

    // Completion estimate (see next_check):
    TimePoint head_floor{};            // the head entry cannot have started before this
    TimePoint last_incomplete{};       // last time a look found the head not done
    double lateness_ns = 0;            // learned: completion time past the lower bound, per kernel
    unsigned misses = 0;               // fine-step checks since the last progress
    // The entry being waited for, to learn the lateness from.
    std::uint64_t probe_fence = 0;     // 0: none
    TimePoint probe_lower{};           // its lower bound, lateness not included
    std::size_t probe_kernels = 0;     // kernels from the head up to it
    unsigned probe_misses = 0;         // fine-step checks for it
};

}  // namespace

struct Client::Impl {
    Impl(ClientOptions o, std::unique_ptr<DeviceOps> device) : options(std::move(o)) {
        if (options.name.size() >= 64)
            throw ClientError("client name '" + options.name + "' is longer than 63 bytes");
        if (options.min_poll.count() <= 0 || options.max_poll < options.min_poll)
            throw ClientError("invalid poll interval bounds");
        if (options.weight > PVGPU_WEIGHT_MAX)
            throw ClientError("task weight " + std::to_string(options.weight) + " is out of range " +
                              std::to_string(PVGPU_WEIGHT_MIN) + ".." + std::to_string(PVGPU_WEIGHT_MAX));
        if (device || select_transport(options) == pvgpu::Transport::Device) {
            if (!device) device = open_device(device_path(options));
            backend = make_device_transport(std::move(device), options);
        } else {
            backend = make_socket_transport(options, stats, [this](std::uint32_t chan_id) {
                return by_chan_id(chan_id);
            });
        }
    }

    ClientOptions options;
    ClientStats stats;
    std::map<std::uint64_t, ChannelState> channels;  // by handle
    std::uint64_t next_handle = 1;
    std::unique_ptr<TransportBackend> backend;
    bool connected = false;
    bool had_session = false;          // a session was ever established
    std::string lost_reason;           // why the last session ended (or never began)

    void log(const std::string& line) const {
        if (options.log) options.log(line);
    }

    // The first session.  A socket that is not there is a configuration
    // error; a device whose link is down will come back (a daemon restart).
    void start() {
        try {
            backend->connect();
            connected = had_session = true;
        } catch (const LinkLost& e) {
            if (backend->kind() == pvgpu::Transport::Socket || !options.reconnect) throw ClientError(e.reason);
            lost_reason = e.reason;
            log(e.reason + "; channel allocations wait for it");
        }
    }

    // ---- sessions ---------------------------------------------------------

    void mark_lost(std::string reason) {
        connected = false;
        lost_reason = std::move(reason);
    }

    // Re-establishes the session after a lost link: last look at the old
    // control pages (work that completed needs no resubmission), then
    // reconnect with backoff, re-allocate every channel and resubmit.
    void recover() {
        const bool reconnecting = had_session;
        drop_session();
        const std::string why = (reconnecting ? "lost " + backend->describe() : backend->describe() + " is not up") +
                                " (" + lost_reason + ")";
        if (!options.reconnect) throw ClientError(why);
        log(why + "; reconnecting");

        const TimePoint start = SteadyClock::now();
        auto backoff = options.reconnect_initial_backoff;
        std::string last_error;
        for (unsigned attempt = 1;; ++attempt) {
            try {
                backend->connect();
                connected = had_session = true;
                for (auto& [handle, c] : channels) {
                    if (!c.dead.empty()) continue;  // a dead channel stays dead
                    attach(c, backend->allocate());
                    resubmit(c);
                }
                if (reconnecting) ++stats.reconnects;
                log(std::string(reconnecting ? "reconnected: " : "up: ") + backend->describe() + " after " +
                    std::to_string(attempt) + " attempt(s)");
                return;
            } catch (const LinkLost& e) {
                drop_session();
                if (e.refused) {
                    lost_reason = why;
                    throw ClientError(why + "; reconnecting failed: " + e.reason);
                }
                last_error = e.reason;
            } catch (...) {
                // Refused or unanswered: give up, but leave a consistent
                // disconnected state so a later call can try again.
                drop_session();
                lost_reason = why;
                throw;
            }
            if (SteadyClock::now() - start >= options.reconnect_timeout)
                throw ClientError(why + "; could not reconnect within " +
                                  std::to_string(options.reconnect_timeout.count()) + " ms: " + last_error);
            std::this_thread::sleep_for(backoff);  // retry pacing, not synchronisation
            backoff = std::min(backoff * 2, options.reconnect_max_backoff);
        }
    }

    // Forgets a half-established session: every channel released, no session.
    void drop_session() {
        for (auto& [handle, c] : channels) {
            refresh(c);
            try {
                backend->release(c.link, false);
            } catch (const LinkLost&) {  // NOLINT(bugprone-empty-catch): the session is being dropped
            }
            c.lost = false;
        }
        backend->disconnect();
        connected = false;
    }

    void ensure_connected() {
        if (!connected) recover();
    }

    // Runs `op`, reconnecting and retrying whenever the link is lost.
    template <class Op> auto with_reconnect(Op&& op) {
        for (;;) {
            ensure_connected();
            try {
                return op();
            } catch (const LinkLost& e) {
                mark_lost(e.reason);
                if (e.refused) throw ClientError("connection to pvgpud ended: " + e.reason);
            }
        }
    }

    // ---- channels ---------------------------------------------------------

    ChannelLink* by_chan_id(std::uint32_t chan_id) {
        for (auto& [handle, c] : channels)
            if (c.link.attached() && c.link.chan_id == chan_id) return &c.link;
        return nullptr;
    }

    ChannelState& channel(std::uint64_t handle) {
        auto it = channels.find(handle);
        if (it == channels.end()) throw ClientError("channel was freed");
        return it->second;
    }

    static void attach(ChannelState& c, ChannelLink link) {
        c.link = std::move(link);
        c.lost = false;
        // A fresh channel starts at 0; reading the page keeps us right if not.
        c.link.put = load_acquire(c.link.ctrl->ib_put);
        c.link.next_dev_fence = load_acquire(c.link.ctrl->fence) + 1;
        c.misses = 0;
    }

    // Writes the entries of `c.pending` from index `from` into the ring,
    // publishes IB_PUT and rings the doorbell once.
    void write_entries(ChannelState& c, std::size_t from) {
        ChannelLink& l = c.link;
        for (std::size_t i = from; i < c.pending.size(); ++i) {
            const Entry& e = c.pending[i];
            pvgpu_ring_entry& slot = l.ring->entries[l.put & PVGPU_RING_MASK];
            slot.payload = e.payload;
            slot.fence = e.dev_fence;
            slot.flags = PVGPU_ENTRY_IRQ;
            ++l.put;
        }
        store_release(l.ctrl->ib_put, l.put);  // after the entries
        backend->ring_doorbell(l);
    }

    // After a reconnect: the outstanding entries go to the new channel in
    // order, with new ring fences; the application's fences stay the same.
    void resubmit(ChannelState& c) {
        if (c.pending.empty()) return;
        TimePoint prev = SteadyClock::now();
        c.head_floor = prev;
        c.misses = 0;
        for (Entry& e : c.pending) {
            e.dev_fence = c.link.next_dev_fence++;
            prev += nanoseconds(e.payload);
            e.earliest_done = prev;
        }
        write_entries(c, 0);
        stats.resubmitted += c.pending.size();
        log("resubmitted " + std::to_string(c.pending.size()) + " entries on channel " +
            std::to_string(c.link.chan_id));
    }

    // Reads FENCE, IB_PUT and STATUS; retires completed entries.  Returns
    // whether any did.  Notices a channel that is no longer ours (`lost`) or
    // that the GPU killed (`dead`).
    bool refresh(ChannelState& c) {
        if (!c.link.attached() || c.lost) return false;
        const pvgpu_ctrl_page& page = *c.link.ctrl;
        std::uint32_t fence = load_acquire(page.fence);
        if (c.link.reached_valid && static_cast<std::int32_t>(c.link.reached - fence) > 0) fence = c.link.reached;
        // Only we store IB_PUT, in every mode (a shadow page holds our
        // stores).  Another value means the page is no longer our channel:
        // the device re-allocated the slot after a reconnect (a fresh page),
        // or freed it (all ones).  Its FENCE is then not ours either.
        if (load_acquire(page.ib_put) != c.link.put) {
            c.lost = true;
            return false;
        }
        const TimePoint now = SteadyClock::now();
        std::size_t retired = 0;
        std::uint64_t later_work = 0;  // retired entries after the first: ran after last_incomplete
        // Entries complete in order; compare by difference so 32-bit ring
        // fences may wrap.
        while (!c.pending.empty() && static_cast<std::int32_t>(fence - c.pending.front().dev_fence) >= 0) {
            if (retired++ > 0) later_work += c.pending.front().payload;
            if (c.pending.front().fence == c.probe_fence) learn_lateness(c, now);
            c.completed = c.pending.front().fence;
            c.pending.pop_front();
        }
        if (retired > 0) {
            // The new head started after its predecessor completed, which was
            // after the last look that found the predecessor running.
            c.head_floor = c.last_incomplete + nanoseconds(later_work);
            c.misses = 0;
        }
        if (!c.pending.empty()) c.last_incomplete = now;
        std::uint32_t error = c.link.error;
        if (error == PVGPU_CHAN_ERR_NONE && load_acquire(page.status) == PVGPU_CHAN_STATUS_ERROR)
            error = load_acquire(page.error);
        if (error == PVGPU_CHAN_ERR_LOST)
            c.lost = true;
        else if (error != PVGPU_CHAN_ERR_NONE && c.dead.empty())
            c.dead = channel_error_text(error);
        return retired > 0;
    }

    // Throws what keeps `c` from making progress.
    void check_usable(const ChannelState& c) const {
        if (!c.dead.empty()) throw ClientError("channel " + std::to_string(c.link.chan_id) + ": " + c.dead);
        if (c.lost)
            throw LinkLost{"channel " + std::to_string(c.link.chan_id) + " " +
                           channel_error_text(PVGPU_CHAN_ERR_LOST)};
    }

    // How late the awaited entry completed past its lower bound, per kernel
    // (the GPU's per-kernel overhead as seen from here).  When the first look
    // already found it done, it was at most that late: probe lower.
    void learn_lateness(ChannelState& c, TimePoint now) {
        const double payload = static_cast<double>(c.pending.front().payload);
        double sample = 0.75 * c.lateness_ns;
        if (c.probe_misses > 0)
            sample = static_cast<double>(nanoseconds(now - c.probe_lower).count()) /
                     static_cast<double>(c.probe_kernels);
        c.lateness_ns += (std::clamp(sample, 0.0, payload) - c.lateness_ns) / 8;
        c.probe_fence = 0;
    }

    // When to look at `c` again while waiting for its entry `target`.  Not
    // before the work could be done: the GPU cannot run a kernel faster than
    // its length, a head it has not fetched yet (IB_GET) has not started,
    // and a kernel takes about the learned per-kernel lateness longer.  Past
    // that the GPU is busy with other channels, so look at a fraction of the
    // head kernel's length, backing off while nothing moves.
    TimePoint next_check(ChannelState& c, std::size_t target, TimePoint now) {
        std::uint64_t work = 0;  // head .. target
        for (std::size_t i = 0; i <= target; ++i) work += c.pending[i].payload;
        const std::uint32_t head_pos = c.link.put - static_cast<std::uint32_t>(c.pending.size());
        const bool head_fetched = static_cast<std::int32_t>(load_acquire(c.link.ctrl->ib_get) - head_pos) > 0;
        if (!head_fetched) {
            c.head_floor = std::max(c.head_floor, now);
            c.misses = 0;
        }
        const Entry& head = c.pending.front();
        const TimePoint lower = std::max(c.pending[target].earliest_done, c.head_floor + nanoseconds(work));
        if (c.probe_fence != c.pending[target].fence) {
            c.probe_fence = c.pending[target].fence;
            c.probe_misses = 0;
        }
        c.probe_lower = lower;
        c.probe_kernels = target + 1;
        const TimePoint expected =
            lower + nanoseconds(static_cast<std::int64_t>(c.lateness_ns * static_cast<double>(target + 1)));
        if (expected > now) return expected;
        ++c.probe_misses;
        const double head_ns = static_cast<double>(head.payload);
        const double lo = static_cast<double>(nanoseconds(options.min_poll).count());
        const double hi = std::min(static_cast<double>(nanoseconds(options.max_poll).count()),
                                   std::max(head_ns, lo));
        const double step = std::clamp(head_ns / 4 * std::pow(1.5, std::min(c.misses, 30u)), lo, hi);
        ++c.misses;
        const std::uint64_t rest = work - head.payload;
        return now + nanoseconds(std::max<std::uint64_t>(rest, static_cast<std::uint64_t>(step)));
    }

    struct Goal {
        std::uint64_t handle;
        std::uint64_t fence;
    };

    // Waits until one of the goals is reached (true), the deadline passes or
    // (if `return_on_signal`) a signal arrives (false).
    bool wait_goals(std::span<const Goal> goals, TimePoint deadline, bool return_on_signal) {
        using Wake = TransportBackend::CompletionWake;
        std::vector<std::pair<TimePoint, WaitTarget>> targets;  // by expected completion
        targets.reserve(goals.size());
        std::vector<WaitTarget> sleep_on;
        for (;;) {
            const Wake how = backend->completion_wake();
            if (how == Wake::Any) arm_wakes(goals);
            const TimePoint now = SteadyClock::now();
            targets.clear();
            for (const Goal& g : goals) {
                ChannelState& c = channel(g.handle);
                refresh(c);
                if (c.completed >= g.fence) return true;
                check_usable(c);
                const auto it = std::find_if(c.pending.begin(), c.pending.end(),
                                             [&](const Entry& e) { return e.fence >= g.fence; });
                if (it == c.pending.end()) throw ClientError("internal: fence not outstanding");
                const TimePoint check = next_check(c, static_cast<std::size_t>(it - c.pending.begin()), now);
                targets.emplace_back(check, WaitTarget{&c.link, it->dev_fence});
            }
            if (now >= deadline) return false;
            std::sort(targets.begin(), targets.end(),
                      [](const auto& a, const auto& b) { return a.first < b.first; });
            sleep_on.clear();
            TimePoint wake = deadline;
            switch (how) {
            case Wake::None:
                // Look again when the first could be done.
                if (!targets.empty()) wake = std::min(deadline, targets.front().first);
                break;
            case Wake::First:
                // Woken by the first, look again when the second could be done.
                if (!targets.empty()) sleep_on.push_back(targets.front().second);
                if (targets.size() > 1) wake = std::min(deadline, targets[1].first);
                break;
            case Wake::Any:
                // Woken by whichever completes: no timed look at all.
                for (const auto& t : targets) sleep_on.push_back(t.second);
                break;
            }
            if (!goals.empty()) ++stats.polls;  // with none it is only a sleep
            if (backend->sleep(sleep_on, wake) == SleepResult::Interrupted && return_on_signal) return false;
        }
    }

    // Asks the transport to wake us when each goal's channel reaches the
    // goal's fence (the earliest goal per channel), before the looks at
    // FENCE that decide whether to sleep.
    void arm_wakes(std::span<const Goal> goals) {
        std::vector<std::pair<ChannelLink*, std::uint32_t>> wanted;
        for (const Goal& g : goals) {
            ChannelState& c = channel(g.handle);
            if (c.completed >= g.fence || !c.link.attached() || c.lost) continue;
            const auto it = std::find_if(c.pending.begin(), c.pending.end(),
                                         [&](const Entry& e) { return e.fence >= g.fence; });
            if (it == c.pending.end()) continue;
            auto w = std::find_if(wanted.begin(), wanted.end(), [&](const auto& p) { return p.first == &c.link; });
            if (w == wanted.end())
                wanted.emplace_back(&c.link, it->dev_fence);
            else if (static_cast<std::int32_t>(it->dev_fence - w->second) < 0)
                w->second = it->dev_fence;
        }
        for (auto& [link, fence] : wanted) backend->arm_wake(*link, fence);
    }

    // Queues `kernels` (at most a ring's worth) with one doorbell.
    std::uint64_t submit(std::uint64_t handle, std::span<const std::uint64_t> kernels) {
        ChannelState& c = channel(handle);
        backend->service();
        refresh(c);
        check_usable(c);
        // Respect the ring: at most PVGPU_RING_ENTRIES entries not completed.
        while (c.pending.size() + kernels.size() > PVGPU_RING_ENTRIES) {
            const Goal g{handle, c.pending[c.pending.size() + kernels.size() - PVGPU_RING_ENTRIES - 1].fence};
            wait_goals(std::span(&g, 1), TimePoint::max(), false);
        }
        const TimePoint now = SteadyClock::now();
        if (c.pending.empty()) {
            c.head_floor = now;  // an idle channel starts this entry no sooner than now
            c.misses = 0;
        }
        TimePoint done = c.pending.empty() ? now : std::max(now, c.pending.back().earliest_done);
        const std::size_t first = c.pending.size();
        for (const std::uint64_t kernel_ns : kernels) {
            done += nanoseconds(kernel_ns);
            c.pending.push_back(Entry{c.next_fence++, c.link.next_dev_fence++, kernel_ns, done});
        }
        // Pending first, ring second: if the link is gone by now the
        // entries are resubmitted after the reconnect.
        write_entries(c, first);
        return c.pending.back().fence;
    }

    std::uint64_t alloc() {
        ChannelState c;
        attach(c, backend->allocate());
        const std::uint64_t handle = next_handle++;
        channels.emplace(handle, std::move(c));
        return handle;
    }

    void free(std::uint64_t handle) {
        auto it = channels.find(handle);
        if (it == channels.end()) return;
        ChannelLink link = std::move(it->second.link);
        channels.erase(it);  // a reconnect from here on does not bring it back
        try {
            backend->release(link, connected);
        } catch (const LinkLost& e) {
            mark_lost(e.reason);  // recovered lazily by the next operation
        }
    }
};

// ---- Client -----------------------------------------------------------------

Client::Client(ClientOptions options) : impl_(std::make_shared<Impl>(std::move(options), nullptr)) {
    impl_->start();
}

Client::Client(const std::string& socket_path, const std::string& name)
    : Client([&] {
          ClientOptions o;
          o.transport = Transport::Socket;
          o.socket_path = socket_path;
          o.name = name;
          return o;
      }()) {}

Client::Client(Client&&) noexcept = default;
Client& Client::operator=(Client&&) noexcept = default;
Client::~Client() = default;

Channel Client::alloc_channel() {
    if (!impl_) throw ClientError("use of a moved-from Client");
    const std::uint64_t handle = impl_->with_reconnect([&] { return impl_->alloc(); });
    return Channel(impl_, handle);
}

void Client::process_events() {
    if (!impl_) throw ClientError("use of a moved-from Client");
    impl_->with_reconnect([&] { impl_->backend->sleep({}, SteadyClock::now()); });
}

bool Client::wait_any(std::span<const WaitGoal> goals, std::chrono::steady_clock::time_point deadline) {
    if (!impl_) throw ClientError("use of a moved-from Client");
    std::vector<Impl::Goal> internal;
    for (const WaitGoal& g : goals) {
        if (!g.channel || g.channel->client_ != impl_)
            throw ClientError("wait_any: channel does not belong to this client");
        if (g.fence > g.channel->last_submitted())
            throw ClientError("wait_any: fence " + std::to_string(g.fence) + " was never submitted");
        internal.push_back(Impl::Goal{g.channel->handle_, g.fence});
    }
    return impl_->with_reconnect([&] { return impl_->wait_goals(internal, deadline, true); });
}

std::uint32_t Client::client_id() const { return impl_ ? impl_->backend->client_id() : 0; }
std::uint32_t Client::max_channels() const { return impl_ ? impl_->backend->max_channels() : 0; }

Transport Client::transport() const {
    if (!impl_) throw ClientError("use of a moved-from Client");
    return impl_->backend->kind();
}

TransportInfo Client::info() {
    if (!impl_) throw ClientError("use of a moved-from Client");
    return impl_->backend->info();
}

Client detail::ClientAccess::with_device(ClientOptions options, std::unique_ptr<DeviceOps> ops) {
    if (!ops) throw ClientError("with_device: no device");
    options.transport = Transport::Device;
    Client client(std::make_shared<Client::Impl>(std::move(options), std::move(ops)));
    client.impl_->start();
    return client;
}

const ClientStats& Client::stats() const {
    static const ClientStats empty;
    return impl_ ? impl_->stats : empty;
}

// ---- Channel ----------------------------------------------------------------

Channel::Channel(Channel&& o) noexcept
    : client_(std::move(o.client_)), handle_(std::exchange(o.handle_, 0)) {}

Channel& Channel::operator=(Channel&& o) noexcept {
    if (this != &o) {
        try {
            free();
        } catch (...) {  // NOLINT(bugprone-empty-catch): nothing to report to in a move
        }
        client_ = std::move(o.client_);
        handle_ = std::exchange(o.handle_, 0);
    }
    return *this;
}

Channel::~Channel() {
    try {
        free();
    } catch (...) {  // NOLINT(bugprone-empty-catch): destructors must not throw
    }
}

static void require(const std::shared_ptr<Client::Impl>& client) {
    if (!client) throw ClientError("use of a freed or empty Channel");
}

std::uint64_t Channel::submit(std::uint64_t kernel_ns) {
    return submit(std::span<const std::uint64_t>(&kernel_ns, 1));
}

std::uint64_t Channel::submit(std::span<const std::uint64_t> kernels_ns) {
    require(client_);
    if (kernels_ns.empty()) throw ClientError("submit: no kernels");
    std::uint64_t fence = 0;
    while (!kernels_ns.empty()) {
        const auto piece = kernels_ns.first(std::min<std::size_t>(kernels_ns.size(), PVGPU_RING_ENTRIES));
        fence = client_->with_reconnect([&] { return client_->submit(handle_, piece); });
        kernels_ns = kernels_ns.subspan(piece.size());
    }
    return fence;
}

bool Channel::wait(std::uint64_t fence, std::chrono::nanoseconds timeout) {
    require(client_);
    if (fence > last_submitted())
        throw ClientError("wait: fence " + std::to_string(fence) + " was never submitted");
    const TimePoint deadline = saturating_add(SteadyClock::now(), timeout);
    const Client::Impl::Goal goal{handle_, fence};
    return client_->with_reconnect(
        [&] { return client_->wait_goals(std::span(&goal, 1), deadline, false); });
}

bool Channel::drain(std::chrono::nanoseconds timeout) {
    const std::uint64_t last = last_submitted();
    return last == 0 || wait(last, timeout);
}

std::uint64_t Channel::completed() {
    require(client_);
    ChannelState& c = client_->channel(handle_);
    client_->refresh(c);
    return c.completed;
}

std::uint64_t Channel::last_submitted() const {
    require(client_);
    return client_->channel(handle_).next_fence - 1;
}

std::uint32_t Channel::outstanding() {
    require(client_);
    ChannelState& c = client_->channel(handle_);
    client_->refresh(c);
    return static_cast<std::uint32_t>(c.pending.size());
}

void Channel::free() {
    if (!client_) return;
    auto client = std::move(client_);
    client->free(std::exchange(handle_, 0));
}

std::uint32_t Channel::id() const {
    require(client_);
    return client_->channel(handle_).link.chan_id;
}

}  // namespace pvgpu
