#include "sim_gpu.hpp"

#include <algorithm>
#include <stdexcept>
#include <utility>

namespace pvgpu::sim {

namespace {

// Sets `ref` to `value` when the scope ends, however it ends (a throwing
// interrupt handler must not leave the engine's bookkeeping stale).
template <class T> struct RestoreOnExit {
    T& ref;
    T value;
    ~RestoreOnExit() { ref = value; }
};

}  // namespace

std::string_view to_string(Arbitration a) {
    return a == Arbitration::RoundRobin ? "round-robin" : "timeslice";
}

SimGpu::SimGpu(const Clock& clock, Timers& timers, SimGpuConfig cfg)
    : clock_(clock), timers_(timers), cfg_(cfg) {
    if (cfg_.arbitration == Arbitration::Timeslice && cfg_.timeslice <= 0)
        throw std::invalid_argument("timeslice must be positive");
}

SimGpu::~SimGpu() = default;

SimGpu::Channel& SimGpu::chan(ChannelId ch) {
    if (ch < by_id_.size() && by_id_[ch]) return *by_id_[ch];
    auto it = channels_.find(ch);
    if (it == channels_.end()) throw std::out_of_range("no GPU channel " + std::to_string(ch));
    return it->second;
}

const SimGpu::Channel& SimGpu::chan(ChannelId ch) const {
    if (ch < by_id_.size() && by_id_[ch]) return *by_id_[ch];
    auto it = channels_.find(ch);
    if (it == channels_.end()) throw std::out_of_range("no GPU channel " + std::to_string(ch));
    return it->second;
}

ChannelId SimGpu::create_channel(ChannelMemory mem, ChannelStart start) {
    ChannelId id = next_id_++;
    Channel c;
    if (!mem.ctrl) c.own_ctrl = std::make_unique<pvgpu_ctrl_page>();
    if (!mem.ring) c.own_ring = std::make_unique<pvgpu_ring>();
    c.ctrl = mem.ctrl ? mem.ctrl : c.own_ctrl.get();
    c.ring = mem.ring ? mem.ring : c.own_ring.get();
    // Nothing queued: IB_PUT = IB_GET = completed, all at `start.get`.
    c.put = c.completed = c.get = start.get;
    c.fence = start.fence;
    // The GPU owns these fields from now on.  IB_PUT is the submitter's:
    // a host re-creating a channel puts its position there itself.
    c.ctrl->ib_get = start.get;
    c.ctrl->fence = start.fence;
    c.ctrl->status = PVGPU_CHAN_STATUS_OK;
    c.ctrl->error = PVGPU_CHAN_ERR_NONE;
    Channel& added = channels_.emplace(id, std::move(c)).first->second;
    if (by_id_.size() <= id) by_id_.resize(id + 1);
    by_id_[id] = &added;
    return id;
}

void SimGpu::destroy_channel(ChannelId ch) {
    chan(ch);
    catch_up();
    if (running_ == ch) stop_engine();
    ready_.erase(ch);
    channels_.erase(ch);
    if (ch < by_id_.size()) by_id_[ch] = nullptr;
    kick();
    arm_wake();
}

pvgpu_ring* SimGpu::ring(ChannelId ch) { return chan(ch).ring; }

void SimGpu::set_watchdog(Duration limit) {
    catch_up();
    cfg_.watchdog = limit;
    if (running_) {
        // The running segment was planned against the old limit; a kernel
        // already past the new one is killed now.
        run_segment();
        seg_end_ = std::max(seg_end_, clock_.now());
    }
    arm_wake();
}

void SimGpu::set_fence_watcher(ChannelId ch, FenceWatcher w) {
    catch_up();
    chan(ch).watcher = std::move(w);
    arm_wake();  // its completions now wake the host
}

// The engine runs on its own: a register read shows it as of now, even
// when the host's loop has not yet run the timer that models it.
void SimGpu::run_on() const { const_cast<SimGpu*>(this)->catch_up(); }

std::uint32_t SimGpu::read_ib_put(ChannelId ch) const { return chan(ch).put; }
std::uint32_t SimGpu::read_ib_get(ChannelId ch) const {
    run_on();
    return chan(ch).get;
}
std::uint32_t SimGpu::read_fence(ChannelId ch) const {
    run_on();
    return chan(ch).fence;
}
std::uint32_t SimGpu::read_status(ChannelId ch) const {
    run_on();
    return chan(ch).dead ? PVGPU_CHAN_STATUS_ERROR : PVGPU_CHAN_STATUS_OK;
}

bool SimGpu::runnable(const Channel& c) const {
    return !c.dead && c.completed != c.put;
}

bool SimGpu::pending(ChannelId ch) const {
    run_on();
    return runnable(chan(ch));
}

std::optional<ChannelId> SimGpu::running_channel() const {
    run_on();
    return running_;
}

void SimGpu::update_ready(ChannelId ch) {
    if (runnable(chan(ch)))
        ready_.insert(ch);
    else
        ready_.erase(ch);
}

void SimGpu::write_ib_put(ChannelId ch, std::uint32_t put) {
    catch_up();
    Channel& c = chan(ch);
    if (c.dead) return;  // a dead channel ignores doorbells
    // The entries this doorbell adds (none if IB_PUT went back).
    for (std::uint32_t i = c.put; put - c.put <= PVGPU_RING_ENTRIES && i != put; ++i)
        (*c.fetched)[i & PVGPU_RING_MASK] = c.ring->entries[i & PVGPU_RING_MASK];
    c.put = put;
    // More outstanding entries than the ring holds cannot be real work.
    if (put - c.completed > PVGPU_RING_ENTRIES) {
        fail(ch, PVGPU_CHAN_ERR_BAD_ENTRY);
        arm_wake();
        return;
    }
    update_ready(ch);
    kick();
    arm_wake();
}

std::optional<ChannelId> SimGpu::next_after(ChannelId ch) const {
    if (ready_.empty()) return std::nullopt;
    auto it = ready_.upper_bound(ch);
    if (it == ready_.end()) it = ready_.begin();
    return *it;
}

void SimGpu::kick() {
    if (running_) return;
    if (auto next = next_after(last_served_)) start(*next);
    if (!running_) trace_switch(engine_now(), 0);
}

void SimGpu::trace_switch(Time at, ChannelId to) {
    if (to == traced_ || !cfg_.ctxsw_trace) return;
    traced_ = to;
    if (trace_.size() == kTraceCapacity) {
        trace_.pop_front();
        ++trace_lost_;
    }
    trace_.push_back({at, to});
}

std::uint64_t SimGpu::read_ctxsw_trace(std::vector<CtxswRecord>& out) {
    catch_up();
    // A context still being loaded (a switch's dead time) is written when
    // it is in.
    const Time now = clock_.now();
    while (!trace_.empty() && trace_.front().at <= now) {
        out.push_back(trace_.front());
        trace_.pop_front();
    }
    return std::exchange(trace_lost_, 0);
}

void SimGpu::start(ChannelId ch, Duration dead) {
    Channel& c = chan(ch);
    if (!c.in_flight && entry(c, c.completed).payload > kMaxPayload) {
        fail(ch, PVGPU_CHAN_ERR_BAD_ENTRY);
        kick();
        return;
    }
    Time now = engine_now();
    bool switching = on_engine_ != ch;
    running_ = ch;
    on_engine_ = ch;
    seg_start_ = now;
    if (switching) ++switches_;
    if (dead >= 0) {
        seg_start_ = now + dead;
        slice_end_ = seg_start_ + cfg_.timeslice;
    } else if (cfg_.arbitration == Arbitration::Timeslice && (switching || now >= slice_end_)) {
        if (switching) seg_start_ = now + cfg_.ctxsw;
        slice_end_ = seg_start_ + cfg_.timeslice;
    }
    // The dead time of a switch or a preemption runs nobody's work.
    if (seg_start_ > now) trace_switch(now, 0);
    trace_switch(seg_start_, ch);
    if (!c.in_flight) {
        c.remaining = static_cast<Duration>(entry(c, c.completed).payload);
        c.ran = 0;
        c.in_flight = true;
        c.get = c.completed + 1;
        c.ctrl->ib_get = c.get;
    }
    run_segment();
}

void SimGpu::run_segment() {
    Channel& c = chan(*running_);
    Time end = seg_start_ + c.remaining;
    if (cfg_.watchdog > 0) end = std::min(end, seg_start_ + (cfg_.watchdog - c.ran));
    if (cfg_.arbitration == Arbitration::Timeslice) end = std::min(end, slice_end_);
    seg_end_ = end;
    arm_wake();
}

// Each segment end is processed at its own time (the engine's), whenever
// the host's timer got to run: in real time it fires late, and the next
// kernel must not pay.  What those ends raised reaches the host after the
// engine caught up to now.  A segment ending right now, with nothing
// raised before it, is handled as it happens: its handler reads the engine
// as that completion left it.
void SimGpu::on_wake() {
    wake_at_ = -1;
    try {
        run_overdue();
        if (running_ && seg_end_ == clock_.now() && raised_.empty()) end_at_seg_end();
        deliver();
    } catch (...) {
        arm_wake();  // a throwing handler must not stop the engine's wakeups
        throw;
    }
    arm_wake();
}

void SimGpu::arm_wake() {
    const Time at = next_wake();
    if (at == wake_at_) return;
    wake_at_ = at;
    if (at == kNever)
        wake_timer_.cancel();
    else
        wake_timer_.arm(at, [this] { on_wake(); });
}

bool SimGpu::segment_wakes() const {
    const Channel& c = chan(*running_);
    if (seg_end_ - seg_start_ < c.remaining) return true;  // cut: a watchdog kill, or a slice's end
    return (entry(c, c.completed).flags & PVGPU_ENTRY_IRQ) != 0 || c.watcher;
}

Duration SimGpu::work_to_raise(const Channel& c, std::uint32_t from, Duration remaining, Duration ran,
                               Duration limit) const {
    Duration work = 0;
    for (std::uint32_t i = from; i != c.put && work < limit; ++i) {
        const pvgpu_ring_entry& e = entry(c, i);
        if (i != from || remaining < 0) {
            if (e.payload > kMaxPayload) return work;  // start() fails it
            remaining = static_cast<Duration>(e.payload);
            ran = 0;
        }
        if (cfg_.watchdog > 0 && remaining > cfg_.watchdog - ran) return work + (cfg_.watchdog - ran);
        work += remaining;
        if ((e.flags & PVGPU_ENTRY_IRQ) != 0 || c.watcher) return work;
    }
    return kNever;
}

// A lower bound is enough: a wakeup before anything is due finds nothing
// and plans again.  The running segment, a silent completion, ends at
// seg_end_ for sure (only the host can stop it, and every host call
// catches up and plans anew).  After it, a raise needs its channel's own
// work up to it; a cut comes at a slice's end at the earliest.
Time SimGpu::next_wake() const {
    if (!running_) return kNever;  // idle until the host rings a doorbell
    if (segment_wakes()) return seg_end_;
    Duration least = kNever;
    if (cfg_.arbitration == Arbitration::Timeslice)
        least = slice_end_ > seg_end_ ? slice_end_ - seg_end_ : cfg_.timeslice;
    for (ChannelId id : ready_) {
        const Channel& c = chan(id);
        const Duration w = id == *running_ ? work_to_raise(c, c.completed + 1, -1, 0, least)
                                           : work_to_raise(c, c.completed, c.in_flight ? c.remaining : -1, c.ran, least);
        least = std::min(least, w);
    }
    return least == kNever ? kNever : seg_end_ + least;
}

void SimGpu::run_overdue() {
    RestoreOnExit<bool> restore{catching_up_, catching_up_};
    catching_up_ = true;
    while (running_ && engine_time_ < 0 && seg_end_ < clock_.now()) end_at_seg_end();
}

void SimGpu::end_at_seg_end() {
    // A stale engine time would stop every catch-up.
    RestoreOnExit<Time> guard{engine_time_, -1};
    engine_time_ = seg_end_;
    segment_end();
}

void SimGpu::catch_up() {
    if (catching_up_) return;
    run_overdue();
    // A host call is no place to run the host's interrupt handlers: they
    // are pending, as on hardware, until the host's loop gets to them.
    // From a handler, deliver() is already under way and takes them in
    // turn: another delivery would be a wasted host wakeup per interrupt.
    if (!delivering_) deliver_later();
}

void SimGpu::deliver_later() {
    if (!raised_.empty() && !deliver_timer_.armed()) deliver_timer_.arm(clock_.now(), [this] { deliver(); });
}

void SimGpu::raise(Raised r) {
    if (cfg_.irq_latency > 0) {
        in_transit_.emplace_back(engine_now() + cfg_.irq_latency, r);
        arm_transit();
        return;
    }
    if (catching_up_)
        raised_.push_back(r);
    else
        dispatch(r);
}

void SimGpu::deliver() {
    deliver_timer_.cancel();
    if (delivering_) return;  // a handler's call: the outer delivery goes on
    delivering_ = true;
    std::size_t i = 0;
    try {
        // A handler's host call may catch up and raise more: they go last
        // (a copy, as the push may move the vector under a reference).
        while (i < raised_.size()) {
            const Raised r = raised_[i++];
            dispatch(r);
        }
    } catch (...) {
        // The rest stay pending, neither lost nor repeated, and go out on
        // the next turn of the host's loop.
        raised_.erase(raised_.begin(), raised_.begin() + static_cast<std::ptrdiff_t>(i));
        delivering_ = false;
        deliver_later();
        throw;
    }
    raised_.clear();
    delivering_ = false;
}

void SimGpu::arm_transit() {
    if (!in_transit_.empty() && !transit_timer_.armed())
        transit_timer_.arm(in_transit_.front().first, [this] { deliver_late(); });
}

void SimGpu::deliver_late() {
    try {
        // A handler's host call may raise more (due later): they queue behind.
        while (!in_transit_.empty() && in_transit_.front().first <= clock_.now()) {
            const Raised r = in_transit_.front().second;
            in_transit_.pop_front();
            dispatch(r);
        }
    } catch (...) {
        arm_transit();  // the rest are neither lost nor repeated
        throw;
    }
    arm_transit();
}

void SimGpu::dispatch(const Raised& r) {
    // A channel the host destroyed meanwhile takes its interrupts with it.
    if (!channels_.count(r.ch)) return;
    if (r.error) {
        if (irq_) irq_->on_channel_error(r.ch, r.value);
        return;
    }
    if (r.irq && irq_) irq_->on_fence(r.ch, r.value);
    auto it = channels_.find(r.ch);  // the host may have destroyed it
    if (it != channels_.end() && it->second.watcher) it->second.watcher(r.value);
}

Duration SimGpu::busy_time_now() const {
    run_on();
    const Time now = clock_.now();
    // A segment still in its switch's dead time starts in the future.
    return busy_ + (running_ && now > seg_start_ ? now - seg_start_ : 0);
}

Time SimGpu::engine_now() const { return engine_time_ >= 0 ? engine_time_ : clock_.now(); }

void SimGpu::segment_end() {
    ChannelId ch = *running_;
    Channel& c = chan(ch);
    Time now = engine_now();
    end_segment(ch, now);

    if (c.remaining > 0 && cfg_.watchdog > 0 && c.ran >= cfg_.watchdog) {
        running_.reset();
        last_served_ = ch;
        fail(ch, PVGPU_CHAN_ERR_WATCHDOG);
        kick();
        return;
    }

    if (c.remaining > 0) {
        // Time slice expired mid-kernel: preempt only if someone else waits.
        bool others = ready_.size() > 1 || (ready_.size() == 1 && !ready_.count(ch));
        if (others) {
            running_.reset();
            last_served_ = ch;
            kick();
        } else {
            slice_end_ = now + cfg_.timeslice;
            seg_start_ = now;
            run_segment();
        }
        return;
    }

    // Kernel done.
    const pvgpu_ring_entry e = entry(c, c.completed);
    // Whom it tells, decided now: a handler run below may destroy the channel.
    const bool irq = (e.flags & PVGPU_ENTRY_IRQ) != 0;
    const bool tell = irq || c.watcher;
    c.in_flight = false;
    ++c.completed;
    c.fence = e.fence;
    c.ctrl->fence = c.fence;
    update_ready(ch);
    if (cfg_.arbitration == Arbitration::Timeslice && now < slice_end_ && runnable(c)) {
        start(ch);  // same slice, next kernel
    } else {
        running_.reset();
        last_served_ = ch;
        kick();
    }
    // Interrupts after the engine has moved on, as the host would observe
    // them.  A silent completion has no one to tell.
    if (tell) raise({ch, e.fence, false, irq});
}

bool SimGpu::preempt_to(ChannelId next) {
    catch_up();
    if (cfg_.arbitration != Arbitration::Timeslice || !running_ || *running_ == next) return false;
    auto it = channels_.find(next);
    if (it == channels_.end() || !runnable(it->second)) return false;
    stop_engine();
    ++preemptions_;
    start(next, cfg_.preempt);
    arm_wake();
    return true;
}

// What the running kernel ran since its segment started, up to `now`: off
// its remaining time (a preempted kernel resumes with the rest), onto its
// watchdog time and the engine's busy time.  Nothing if it is still in a
// switch's dead time.
void SimGpu::end_segment(ChannelId ch, Time now) {
    if (now <= seg_start_) return;
    Channel& c = chan(ch);
    const Duration ran = now - seg_start_;
    c.remaining -= ran;
    c.ran += ran;
    busy_ += ran;
    if (observer_) observer_->executed(ch, seg_start_, now);
}

void SimGpu::stop_engine() {
    ChannelId ch = *running_;
    end_segment(ch, clock_.now());
    running_.reset();
    last_served_ = ch;
}

void SimGpu::fail(ChannelId ch, std::uint32_t error) {
    Channel& c = chan(ch);
    c.dead = true;
    c.ctrl->status = PVGPU_CHAN_STATUS_ERROR;
    c.ctrl->error = error;
    c.in_flight = false;
    ready_.erase(ch);
    // The kernel on the engine dies with its channel.
    bool was_running = running_ == ch;
    if (was_running) stop_engine();
    raise({ch, error, true, true});
    if (was_running) kick();
}

}  // namespace pvgpu::sim
