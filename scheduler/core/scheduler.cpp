#include "scheduler.hpp"

#include <algorithm>
#include <chrono>
#include <exception>
#include <stdexcept>

namespace pvgpu {

SchedulerStats operator-(const SchedulerStats& later, const SchedulerStats& earlier) {
    static_assert(sizeof(SchedulerStats) == 13 * sizeof(std::uint64_t), "a new counter: subtract it here");
    SchedulerStats d;
    d.traps = later.traps - earlier.traps;
    d.remaps = later.remaps - earlier.remaps;
    d.polls = later.polls - earlier.polls;
    d.accounting_reads = later.accounting_reads - earlier.accounting_reads;
    d.register_reads = later.register_reads - earlier.register_reads;
    d.fences = later.fences - earlier.fences;
    d.channel_errors = later.channel_errors - earlier.channel_errors;
    d.released_entries = later.released_entries - earlier.released_entries;
    d.held_reports = later.held_reports - earlier.held_reports;
    d.preemptions = later.preemptions - earlier.preemptions;
    d.mechanism_cpu = later.mechanism_cpu - earlier.mechanism_cpu;
    d.policy_calls = later.policy_calls - earlier.policy_calls;
    d.policy_cpu = later.policy_cpu - earlier.policy_cpu;
    return d;
}

const std::vector<ChannelId> Scheduler::kNoChannels;

Scheduler::Scheduler(GpuDevice& gpu, const Clock& clock, Timers& timers,
                     std::unique_ptr<Policy> policy, MechanismCosts costs)
    : gpu_(gpu),
      registers_(gpu, trace_,
                 [this] {
                     ++stats_.register_reads;
                     stats_.mechanism_cpu += costs_.poll;
                 }),
      clock_(clock), timers_(timers), costs_(costs), policy_(std::move(policy)),
      accounting_(
          clock, timers,
          [this] {
              ++stats_.accounting_reads;
              stats_.mechanism_cpu += costs_.poll;
              return gpu_.running_channel();
          },
          gpu.arbitration()) {
    if (!policy_) throw std::invalid_argument("scheduler needs a policy");
    accounting_.set_remap_delay(costs_.remap);
    accounting_.set_left_engine([this](ChannelId ch) { return trace_.left_at(ch); });
    if (trace_.available()) {
        trace_.set_sink({[this](const CtxswRecord& r) { accounting_.trace_switch(r); },
                         [this](std::uint64_t n) { accounting_.trace_lost(n); }});
        accounting_.set_trace([this] { trace_.sync(); });
    }
    accounting_.set_fetched([this](ChannelId ch) { return fetched_since_open(ch); });
    accounting_.set_pending([this](ChannelId ch) { return registers_.pending(ch); });
    accounting_.set_listener([this](const Accounting::Event& e) { on_accounting_event(e); });
    accounting_.set_trap_listener([this](ChannelId ch, bool trap) {
        auto it = channels_.find(ch);
        if (it == channels_.end() || it->second.accounting_trap == trap) return;
        it->second.accounting_trap = trap;
        update_mode(ch);
    });
    gpu_.set_interrupt_handler(this);
    tree_.set_listener([this](EntityTree::Change c, EntityId id) {
        if (c == EntityTree::Change::Added && by_entity_.size() <= id) by_entity_.resize(id + 1);
        if (c == EntityTree::Change::Removed) accounting_.entity_removed(id);
        call_policy([&] { policy_->tree_changed(c, id); });
    });
    call_policy([&] { policy_->start(*this); });
}

Scheduler::~Scheduler() {
    gpu_.set_interrupt_handler(nullptr);
    tree_.set_listener(nullptr);
}

template <class F> void Scheduler::call_policy(F&& f) {
    // A policy call can nest another (set_mode -> apply_mode -> released):
    // only the outermost one is timed, so nothing is counted twice.
    if (policy_depth_ > 0) {
        f();
        return;
    }
    ++stats_.policy_calls;
    auto t0 = std::chrono::steady_clock::now();
    {
        struct Depth {
            int& d;
            explicit Depth(int& depth) : d(depth) { ++d; }
            ~Depth() { --d; }
        } depth{policy_depth_};
        f();
        deliver_accounting();  // what the accounting saw meanwhile, in the same entry
    }
    stats_.policy_cpu += std::chrono::duration_cast<std::chrono::nanoseconds>(
                             std::chrono::steady_clock::now() - t0)
                             .count();
}

void Scheduler::on_accounting_event(const Accounting::Event& e) {
    accounting_events_.push_back(e);
    // Outside any policy call (the accounting's own reads): one entry now.
    if (policy_depth_ == 0) call_policy([] {});
}

void Scheduler::deliver_accounting() {
    // Events the policy causes meanwhile (an unshadow releases work, which
    // the accounting reads) are appended and delivered in this loop.
    std::size_t i = 0;
    try {
        for (; i < accounting_events_.size(); ++i) {
            const Accounting::Event e = accounting_events_[i];
            if (e.is_charge) {
                if (!hidden(e.ch)) policy_->charged(e.ch, e.d);
            } else {
                policy_->engine_changed(e.running && hidden(*e.running) ? std::nullopt : e.running);
            }
        }
    } catch (...) {
        // Delivered once, the failed one included: the rest come next time.
        accounting_events_.erase(accounting_events_.begin(),
                                 accounting_events_.begin() + static_cast<std::ptrdiff_t>(i + 1));
        throw;
    }
    accounting_events_.clear();
}

TimerId Scheduler::PolicyTimers::arm(Time at, std::function<void()> fn) {
    return s_.timers_.arm(at, [this, f = std::move(fn)] { s_.call_policy(f); });
}

void Scheduler::PolicyTimers::cancel(TimerId id) { s_.timers_.cancel(id); }

void Scheduler::set_policy(std::unique_ptr<Policy> policy) {
    if (!policy) throw std::invalid_argument("scheduler needs a policy");
    call_policy([&] { policy_->stop(); });
    // Whatever the old policy left, the new one starts from direct channels.
    for (auto& [ch, st] : channels_) set_mode(ch, ChannelMode::Direct);
    policy_ = std::move(policy);
    call_policy([&] { policy_->start(*this); });
    std::vector<ChannelId> ids;
    for (auto& [ch, st] : channels_)
        if (!st.draining) ids.push_back(ch);
    std::sort(ids.begin(), ids.end());
    for (ChannelId ch : ids) call_policy([&] { policy_->channel_added(ch, channels_.at(ch).owner); });
}

std::uint32_t Scheduler::fetched_since_open(ChannelId ch) const {
    const std::uint32_t get = registers_.read_ib_get(ch);
    auto it = channels_.find(ch);
    return it == channels_.end() ? get : get - it->second.get_base;
}

ChannelId Scheduler::open_channel(EntityId leaf, ChannelMemory mem) { return open_channel(leaf, mem, {}); }

ChannelId Scheduler::open_channel(EntityId leaf, ChannelMemory mem, ChannelStart start) {
    tree_.attach_channel(leaf);  // validates: live leaf, not the root
    ChannelId ch = 0;
    try {
        ch = gpu_.create_channel(mem, start);
    } catch (...) {
        // A backend may refuse a channel (out of channels, bad memory).
        tree_.detach_channel(leaf);
        throw;
    }
    ChannelState st;
    st.get_base = start.get;
    st.shadow = std::make_unique<ShadowChannel>(
        gpu_, ch, [this](ChannelId c, std::uint32_t put) { on_trap(c, put); },
        [this](ChannelId c, std::uint32_t held) { on_held(c, held); });
    st.owner = leaf;
    st.remap_timer = std::make_unique<Timer>(timers_);
    ChannelState& added = channels_.emplace(ch, std::move(st)).first->second;
    if (ch < kIndexedIds) {
        if (by_id_.size() <= ch) by_id_.resize(ch + 1);
        by_id_[ch] = &added;
    }
    if (by_entity_.size() <= leaf) by_entity_.resize(leaf + 1);
    by_entity_[leaf].push_back(ch);
    accounting_.channel_added(ch, leaf);
    try {
        call_policy([&] { policy_->channel_added(ch, leaf); });
    } catch (...) {
        // The caller unmaps the memory of a channel whose open failed: the
        // GPU must not keep it.
        try {
            close_channel(ch);
        } catch (...) {
        }
        throw;
    }
    state(ch).mapped = true;
    return ch;
}

void Scheduler::drain(ChannelId ch) {
    ChannelState& st = state(ch);
    if (st.draining) return;
    st.draining = true;
    auto& v = by_entity_[st.owner];
    v.erase(std::find(v.begin(), v.end(), ch));
    call_policy([&] { policy_->channel_removed(ch, st.owner); });
    update_mode(ch);
}

bool Scheduler::drained(ChannelId ch) const {
    const ChannelState& st = state(ch);
    return st.draining && st.shadow->mode() == ChannelMode::Shadowed && !st.remap_timer->armed() &&
           !gpu_.pending(ch);
}

void Scheduler::undrain(ChannelId ch) {
    ChannelState& st = state(ch);
    if (!st.draining) return;
    st.draining = false;
    by_entity_[st.owner].push_back(ch);
    // The policy starts from a direct channel, as after set_policy.
    st.wanted = ChannelMode::Direct;
    call_policy([&] { policy_->channel_added(ch, st.owner); });
    update_mode(ch);
}

Scheduler::Position Scheduler::detach(ChannelId ch) {
    const ChannelState& st = state(ch);
    Position p{gpu_.read_ib_get(ch), gpu_.read_fence(ch), st.shadow->guest_read_put()};
    close_channel(ch);
    return p;
}

void Scheduler::close_channel(ChannelId ch) {
    auto it = channels_.find(ch);
    if (it == channels_.end()) throw std::out_of_range("no channel " + std::to_string(ch));
    EntityId leaf = it->second.owner;
    const bool draining = it->second.draining;
    it->second.closing = true;
    // Whatever a callback throws, the channel leaves every table and the
    // GPU before the error goes on: half-closed, it was closed again at its
    // client's teardown and its memory freed twice.
    std::exception_ptr failed;
    auto step = [&failed](auto&& f) {
        try {
            f();
        } catch (...) {
            if (!failed) failed = std::current_exception();
        }
    };
    // Not among its leaf's channels while the policy hears of the close (it
    // would feed it or read its GPU state meanwhile).
    if (!draining) {  // a draining channel left the policy already
        auto& v = by_entity_[leaf];
        v.erase(std::find(v.begin(), v.end(), ch));
        step([&] { call_policy([&] { policy_->channel_removed(ch, leaf); }); });
    }
    step([&] { tree_.detach_channel(leaf); });
    step([&] { accounting_.channel_removed(ch); });
    channels_.erase(ch);
    if (ch < by_id_.size()) by_id_[ch] = nullptr;
    step([&] { gpu_.destroy_channel(ch); });
    step([&] { trace_.forget(ch); });
    if (failed) std::rethrow_exception(failed);
}

bool Scheduler::hidden(ChannelId ch) const {
    auto it = channels_.find(ch);
    return it != channels_.end() && (it->second.closing || it->second.draining);
}

Scheduler::ChannelState& Scheduler::state(ChannelId ch) {
    if (ch < by_id_.size() && by_id_[ch]) return *by_id_[ch];
    auto it = channels_.find(ch);
    if (it == channels_.end()) throw std::out_of_range("no channel " + std::to_string(ch));
    return it->second;
}

const Scheduler::ChannelState& Scheduler::state(ChannelId ch) const {
    if (ch < by_id_.size() && by_id_[ch]) return *by_id_[ch];
    auto it = channels_.find(ch);
    if (it == channels_.end()) throw std::out_of_range("no channel " + std::to_string(ch));
    return it->second;
}

ShadowChannel& Scheduler::channel(ChannelId ch) { return *state(ch).shadow; }

const std::vector<ChannelId>& Scheduler::channels_of(EntityId leaf) const {
    return leaf < by_entity_.size() ? by_entity_[leaf] : kNoChannels;
}

EntityId Scheduler::owner(ChannelId ch) const { return state(ch).owner; }

ChannelMode Scheduler::mode(ChannelId ch) const { return state(ch).wanted; }

void Scheduler::set_mode(ChannelId ch, ChannelMode m) {
    ChannelState& st = state(ch);
    if (st.wanted == m) return;
    st.wanted = m;
    update_mode(ch);
}

ChannelMode Scheduler::effective(const ChannelState& st) {
    if (st.draining) return ChannelMode::Shadowed;
    return st.wanted == ChannelMode::Direct && st.accounting_trap ? ChannelMode::Trapped : st.wanted;
}

void Scheduler::update_mode(ChannelId ch) {
    ChannelState& st = state(ch);
    const ChannelMode m = effective(st);
    if (st.shadow->mode() == m) {
        st.remap_timer->cancel();  // a pending switch was reverted before it landed
        return;
    }
    if (!st.mapped) {
        apply_mode(ch);
        return;
    }
    // One switch in flight lands on whatever mode is wanted then: a change
    // of mind meanwhile costs nothing more.
    if (st.remap_timer->armed()) return;
    ++stats_.remaps;
    stats_.mechanism_cpu += costs_.remap;
    if (costs_.remap <= 0)
        apply_mode(ch);
    else
        st.remap_timer->arm(now() + costs_.remap, [this, ch] { apply_mode(ch); });
}

void Scheduler::apply_mode(ChannelId ch) {
    auto it = channels_.find(ch);
    if (it == channels_.end()) return;
    ShadowChannel& sc = *it->second.shadow;
    ChannelMode before = sc.mode();
    switch (effective(it->second)) {
    case ChannelMode::Direct: sc.set_direct(); break;
    case ChannelMode::Trapped: sc.set_trapped(); break;
    case ChannelMode::Shadowed: sc.set_shadowed(); break;
    }
    if (mode_listener_ && sc.mode() != before) mode_listener_(ch, sc.mode());
    if (std::uint32_t n = sc.take_released()) {
        stats_.released_entries += n;
        accounting_.host_kicked(ch, sc.put_given() - n);
        call_policy([&] { policy_->released(ch, n); });
    }
}

std::uint32_t Scheduler::held(ChannelId ch) const { return state(ch).shadow->held(); }

std::uint32_t Scheduler::gpu_put(ChannelId ch) const {
    if (const auto put = state(ch).shadow->known_gpu_put()) return *put;
    return registers_.read_ib_put(ch);
}

std::uint32_t Scheduler::release(ChannelId ch, std::uint32_t max) {
    ShadowChannel& sc = *state(ch).shadow;
    std::uint32_t n = sc.release(max);
    sc.take_released();
    stats_.released_entries += n;
    if (n > 0) accounting_.host_kicked(ch, sc.put_given() - n);
    return n;
}

std::optional<ChannelId> Scheduler::engine_status() {
    ++stats_.polls;
    stats_.mechanism_cpu += costs_.poll;
    std::optional<ChannelId> running = gpu_.running_channel();
    // The accounting sees the GPU as it is (it still charges a closing
    // channel until it lets go of it, and ignores it after); to the policy,
    // which heard of the close first, the engine drops it next.
    accounting_.observed(running);
    if (running && hidden(*running)) return std::nullopt;
    return running;
}

bool Scheduler::preempt(ChannelId next) {
    if (!channels_.count(next)) return false;
    // The host reads who it takes off (a status read) before it preempts.
    if (!gpu_.arbitration().preemptive || !engine_status()) return false;
    if (!gpu_.preempt_to(next)) return false;
    ++stats_.preemptions;
    accounting_.preempted(next);
    return true;
}

void Scheduler::on_trap(ChannelId ch, std::uint32_t put) {
    ++stats_.traps;
    stats_.mechanism_cpu += costs_.trap;
    // What the GPU had before this doorbell: the host's own last store, or
    // a read after a direct spell.
    accounting_.doorbell_forwarded(ch, gpu_put(ch));
    if (!hidden(ch)) call_policy([&] { policy_->doorbell_trapped(ch, put); });
}

void Scheduler::on_held(ChannelId ch, std::uint32_t held) {
    ++stats_.held_reports;
    stats_.mechanism_cpu += costs_.trap;
    if (!hidden(ch)) call_policy([&] { policy_->work_held(ch, held); });
}

void Scheduler::on_fence(ChannelId ch, std::uint32_t fence) {
    if (!channels_.count(ch)) return;
    ++stats_.fences;
    // One entry: the accounting charges the kernel first, then the policy
    // hears the interrupt.
    call_policy([&] {
        accounting_.fence(ch);
        deliver_accounting();
        if (!hidden(ch)) policy_->fence(ch, fence);
    });
    if (fence_listener_) fence_listener_(ch, fence);
}

void Scheduler::on_channel_error(ChannelId ch, std::uint32_t error) {
    auto it = channels_.find(ch);
    if (it == channels_.end()) return;
    ++stats_.channel_errors;
    it->second.shadow->set_dead();
    accounting_.channel_error(ch);
    if (!hidden(ch)) call_policy([&] { policy_->channel_error(ch, error); });
    if (error_listener_) error_listener_(ch, it->second.owner, error);
}

}  // namespace pvgpu
