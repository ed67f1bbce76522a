#include "accounting.hpp"

#include <algorithm>
#include <random>
#include <tuple>
#include <utility>

namespace pvgpu {

namespace {

// A slice-end read is placed just after the slice ends, so the engine has
// switched (or renewed the slice) by the time the register is read.
constexpr Duration kSliceReadDelay = 1 * kMicrosecond;
// Gaps between the reads after the engine is seen idle: a client that
// resubmits on its completion starts within microseconds to a millisecond;
// the first read comes right after the completion has been handled, the
// second one a microsecond later (after whatever else happened at once).
constexpr Duration kSettleGaps[] = {0, 1 * kMicrosecond, 10 * kMicrosecond, 40 * kMicrosecond,
                                    150 * kMicrosecond, 800 * kMicrosecond};
// A start seen between two reads this close is taken as exactly known.
constexpr Duration kExactStart = KernelModel::kExactStart;
// A busy non-preemptive engine is read once if nothing was seen for this
// long (and twice its channel's usual kernel): a tenant may submit without
// asking for completion interrupts, and its time must still be charged as
// it runs, not all at once when something else finally interrupts.
constexpr Duration kBusyWatch = 1 * kMillisecond;
// The probe looks (arm_probe) bisect think-time windows up to this wide,
// and give up on a channel after this many looks: a tenant whose think
// time jitters by more than kProbeNarrow never lets a window close.
constexpr Duration kProbeWindow = 10 * kMillisecond;
constexpr int kMaxProbes = 24;
// A channel whose window never closes (its think time jitters, or it
// changed) gets one look back per this many of its interrupts: a window
// the tenant moved after the probes were spent is found again.
constexpr int kProbeRefill = 8;
// Check looks (Accounting::checked) per idle spell and channel.
constexpr int kChecks = 3;
// A think window this narrow is closed by two looks just outside it, at most
// kExactStart apart; wider ones are bisected.
constexpr Duration kProbeNarrow = kExactStart / 2;
// The settle reads end this long after the engine is seen idle.
constexpr Duration kSettleSpan = [] {
    Duration sum = 0;
    for (Duration g : kSettleGaps) sum += g;
    return sum;
}();
// Audit looks (Accounting::audited; their strata are AuditSampler's): the
// mean of the audited charges is a channel's guess once this many kernels
// were audited, and averages over this many at most.
constexpr int kAuditTrusted = 16;
constexpr int kAuditMean = 256;
// ... and beats a learned length more than a kAuditMeanOff'th off it.
constexpr Duration kAuditMeanOff = 4;
// The pace assumed for a channel yet to complete two kernels.
constexpr Duration kAuditNewPace = 2 * kMillisecond;
// A completion interrupt handled this long after the GPU's timestamp: the
// host stalled, other channels may have run since (replayed, while every
// channel interrupts on every kernel; with one that batches, always), and
// the kernels GET counted since the previous interrupt do not say whether
// the channel asks for one per kernel.  In qemu-modes with two busy loops
// beside it, replaying from 100 us on measured +2.6% on average against
// +1.0% without; at 2 ms, 2 ms stalls went unreplayed.
constexpr Duration kLateInterrupt = 1 * kMillisecond;
// Interrupts raised this far apart are handled in the order they were raised.
constexpr Duration kReorder = 50 * kMicrosecond;
// An engine seen idle this long gets its doorbells trapped (set_trap_listener):
// by then the audit's strata are some 25 ms wide, and a kernel that starts
// later (a new channel's first, one after a long think) would be corrected
// by looks seconds apart, or past the spell's last stratum by none.  Two
// remaps per channel and idle spell this long at most.
constexpr Duration kIdleTrap = 50 * kMillisecond;
// A channel trapped for its own sake goes back to direct after this many of
// its bursts in a row began while the engine was busy.
constexpr int kTrapUnneeded = 16;
// A trap asked for has landed by this long after, beyond the host's remap
// delay (set_remap_delay: twice it, a switch may be in flight before).
constexpr Duration kTrapLanded = 1 * kMillisecond;
// The widest audit stratum on an idle engine before its doorbells are all
// trapped (AuditSampler::plan_look): eight or so looks over those 50 ms.
constexpr Duration kAuditIdleWidth = kIdleTrap / 8;

// A kernel already charged `before`, whose current stint of `d` began at a
// moment known only within `slack`: its learned length puts the whole
// right, as far as that uncertainty allows.
Duration whole_kernel(Duration learned, Duration before, Duration d, Duration slack) {
    return std::max<Duration>(0, std::clamp(learned - before, d - slack, d + slack));
}

// Kernels `ch` has completed, from its GET: the GPU has fetched the entry
// of the kernel on the engine too.
std::uint32_t completed_kernels(std::uint32_t get, ChannelId ch, std::optional<ChannelId> running) {
    return get - (running == ch ? 1 : 0);
}

}  // namespace

Accounting::Accounting(const Clock& clock, Timers& timers, StatusRead read, EngineArbitration engine)
    : clock_(clock), read_(std::move(read)), engine_(engine), read_timer_(timers), kick_timer_(timers),
      probe_timer_(timers), audit_(timers, [this](Duration w) { audit_read(w); }), idle_trap_timer_(timers),
      trace_timer_(timers) {
    set_remap_delay(0);
    since_ = last_seen_ = idle_seen_ = clock_.now();
    arm_idle_trap(idle_seen_);
}

void Accounting::arm_idle_trap(Time idle_since) {
    idle_trap_timer_.arm(idle_since + kIdleTrap, [this] { idle_trap_fired(); });
}

void Accounting::idle_trap_fired() {
    Entry entry(*this);
    if (current_) return;  // a sighting of a busy engine came first
    idle_trap_ = true;
    // Each channel leaves the idle trap at its own doorbell: one that never
    // rings stays trapped at no cost, and a neighbour's pulse remaps only
    // the channels that rang since (remapping every channel twice per idle
    // spell made 36663 remaps in 10 s beside 100 idle channels).
    for (auto& [id, c] : channels_) set_traps(id, c, true, c.trapped);
}

void Accounting::set_traps(ChannelId id, Channel& c, bool idle, bool own) {
    const bool before = c.idle_trapped || c.trapped;
    if ((idle || own) && !before) traps_set_at_ = clock_.now();
    c.idle_trapped = idle;
    c.trapped = own;
    if ((idle || own) != before) trap_changes_.emplace_back(id, idle || own);
}

void Accounting::trap_channel(ChannelId id, Channel& c, bool on) {
    c.unneeded_traps = 0;
    set_traps(id, c, c.idle_trapped, on);
}

void Accounting::set_remap_delay(Duration d) {
    trap_lands_ = kTrapLanded + 2 * std::max<Duration>(0, d);
    audit_.set_idle_cap(kAuditIdleWidth, kIdleTrap + trap_lands_);
}

bool Accounting::wants_trap(ChannelId ch) const {
    auto it = channels_.find(ch);
    return it != channels_.end() && (it->second.idle_trapped || it->second.trapped);
}

Accounting::Entry::~Entry() noexcept(false) {
    if (--a_.depth_ > 0 || a_.delivering_) return;
    a_.delivering_ = true;
    // A listener may enter again (its events are appended and delivered here).
    // Events first, then trap wishes, then whatever those made.
    std::size_t e = 0, t = 0;
    try {
        for (;;) {
            if (e < a_.events_.size()) {
                const Event ev = a_.events_[e++];
                if (a_.listener_) a_.listener_(ev);
            } else if (t < a_.trap_changes_.size()) {
                const auto [ch, on] = a_.trap_changes_[t++];
                if (a_.trap_listener_) a_.trap_listener_(ch, on);
            } else {
                break;
            }
        }
    } catch (...) {
        // The rest wait for the next entry; the one that failed is not
        // delivered again.
        a_.events_.erase(a_.events_.begin(), a_.events_.begin() + static_cast<std::ptrdiff_t>(e));
        a_.trap_changes_.erase(a_.trap_changes_.begin(), a_.trap_changes_.begin() + static_cast<std::ptrdiff_t>(t));
        a_.delivering_ = false;
        if (std::uncaught_exceptions() > unwinding_) return;
        throw;
    }
    a_.events_.clear();
    a_.trap_changes_.clear();
    a_.delivering_ = false;
}

std::optional<ChannelId> Accounting::read() {
    ++reads_;
    return known(read_());
}

std::optional<ChannelId> Accounting::known(std::optional<ChannelId> running) const {
    // A channel let go of (channel_removed) that the GPU still runs, its
    // close under way: the engine drops it next, and a stint believed on it
    // would outlive it.  (Work of a context pvgpud did not open would read
    // as idle too: pvgpud owns the GPU's channels.)
    return running && channels_.count(*running) ? running : std::nullopt;
}

void Accounting::channel_added(ChannelId ch, EntityId leaf) {
    Entry entry(*this);
    if (traced()) traced_sync();
    // An id the GPU reuses: the old channel's counts go with it.
    if (auto it = channels_.find(ch); it != channels_.end()) uncount(ch, it->second);
    channels_[ch] = Channel{leaf};
    if (traced()) {
        channels_[ch].learned_get = fetched_ ? fetched_(ch) : 0;
        totals_.try_emplace(leaf);
        return;
    }
    count_batching(channels_[ch]);
    if (idle_trap_) set_traps(ch, channels_[ch], true, false);
    totals_.try_emplace(leaf);
    // Its first doorbell is likely close: watch an idle engine again, and
    // audit its first kernel's unseen start.
    if (!current_) {
        settle_step_ = 0;
        arm_read();
        if (!audit_.is_open()) open_audit(clock_.now(), std::nullopt);
    }
}

void Accounting::channel_removed(ChannelId ch) {
    Entry entry(*this);
    if (traced()) {
        // Its time up to now is charged; what the engine runs of it until
        // it drops it is nobody's.
        traced_sync();
        if (auto it = channels_.find(ch); it != channels_.end()) channels_.erase(it);
        return;
    }
    try {
        settle_removed(ch);
    } catch (...) {
        // Forgotten whatever failed: a channel kept after the GPU let go of
        // it is looked up there at every later look.
        forget(ch);
        throw;
    }
    forget(ch);
    arm_probe();  // not for it any more
}

void Accounting::forget(ChannelId ch) {
    if (auto it = channels_.find(ch); it != channels_.end()) {
        uncount(ch, it->second);
        channels_.erase(it);
    }
    if (current_ == ch) current_.reset();
}

void Accounting::settle_removed(ChannelId ch) {
    // Not believed on the engine, it may have run unseen (a fresh channel
    // closed 30 ms into a 40 ms kernel, or after one that asked for no
    // interrupt, was charged 0.7% of what ran without this): a
    // completion no interrupt reported is charged as its interrupt would
    // be, and a kernel still running is seen by one read.
    if (auto it = channels_.find(ch); it != channels_.end() && current_ != ch && left_engine_)
        if (const std::optional<Time> done = left_engine_(ch); done && *done > it->second.charged_through)
            fence(ch);
    if (current_ != ch && channels_.count(ch)) {
        const std::optional<ChannelId> running = read();
        if (running == ch) observed(running);
    }
    if (current_ == ch) {
        // Believed on the engine, but its kernel may have ended unseen (no
        // interrupt asked for): one read before the GPU forgets it.  Still
        // there: the engine drops it now, and whatever starts next is an
        // unseen start.  Gone: its stint ended at its last completion.
        const Time t = clock_.now();
        const std::optional<ChannelId> running = read();
        if (running == ch) {
            charge_guess(ch, t);
            now_running(std::nullopt, t, t);
        } else {
            observed(running);
        }
    }
}

void Accounting::entity_removed(EntityId id) { totals_.erase(id); }

void Accounting::charge(ChannelId ch, Duration d) {
    if (d <= 0) return;
    auto it = channels_.find(ch);
    if (it == channels_.end()) return;
    totals_[it->second.leaf].gpu_time += d;
    if (ch == current_) stint_charged_ += d;
    events_.push_back({true, ch, d, std::nullopt});
}

void Accounting::fence(ChannelId ch) {
    Entry entry(*this);
    if (traced()) {
        traced_sync();
        if (auto it = channels_.find(ch); it != channels_.end()) ++totals_[it->second.leaf].kernels;
        return;
    }
    const Time now = clock_.now();
    const FenceTime when = fence_time(ch, now);
    const Time t = when.t;
    const bool clamped = when.clamped;  // the GPU's timestamp lay before what was believed: learn nothing from it
    // The interrupt arrives after the engine moved on: the register names
    // the channel that started when this kernel ended.
    const std::optional<ChannelId> running = read();
    auto it = channels_.find(ch);
    if (it == channels_.end()) {
        observed(running);
        return;
    }
    Channel& c = it->second;
    ++totals_[c.leaf].kernels;
    const std::uint32_t get = fetched_ ? fetched_(ch) : 0;
    // Kernels completed by now (GET counts the one on the engine too).
    const std::uint32_t completed = completed_kernels(get, ch, running);
    const bool late = t + kLateInterrupt < now;
    // On a preemptive engine a channel on it now that was not believed there
    // may have run before this kernel too, taken off at a slice end no read
    // saw (a long kernel begun unseen on an engine believed idle, cut by a
    // neighbour's): what the looks saw of it is charged.
    if (engine_.preemptive && running && running != ch && running != current_) charge_sighted(*running, t);
    std::optional<Time> replayed;
    // A replay scans every channel: only when something may have run unseen
    // (the host was late, or some channel interrupts once per batch).
    if (left_engine_ && !engine_.preemptive && (late || batching_ > 0)) replayed = replay(ch, running, now, now);
    if (replayed) {
        now_running(running, *replayed, *replayed);
        last_seen_ = now;
    } else {
        charge_fence(ch, c, t, clamped, running, completed);
    }
    // A channel whose interrupts, handled in time, come one per kernel has
    // its kernels counted exactly by GET after a stall.
    if (!late && !clamped) learn_interrupts(c, completed);
    note_fence(ch, c, t, clamped, late, get, completed, now);
}

Accounting::FenceTime Accounting::fence_time(ChannelId ch, Time now) const {
    // The kernel ended at the GPU's timestamp if it writes one (the interrupt
    // may run late on a busy host), never before what was already seen.  A
    // kernel seen on the engine ends no earlier than it started, but may end
    // before that sighting: a host that ran late reads the engine, then
    // handles completions the GPU timestamped earlier.  Bounding those by
    // the sighting would charge the first of them the whole delay.
    //
    // A kernel of another channel started after the one seen ran from
    // since_; an idle engine seen at last_seen_ started nothing before it.
    FenceTime when{now, false};
    if (left_engine_)
        if (const std::optional<Time> done = left_engine_(ch)) {
            const Time earliest = std::min(unseen_start(*done), now);
            when.t = std::clamp(*done, earliest, now);
            when.clamped = *done < earliest;
        }
    return when;
}

void Accounting::learn_interrupts(Channel& c, std::uint32_t completed) {
    if (c.kernel.estimate == 0 && c.probes > 0 && ++c.refill >= kProbeRefill) {
        --c.probes;
        c.refill = 0;
    }
    const bool every_before = c.every_kernel;
    c.every_kernel = c.fence_get_known && completed - c.fence_done == 1;
    // Two in a row, as for `batches` below: a channel that batches may
    // see one kernel at an interrupt now and then.
    if (c.every_kernel && every_before && !c.one_per_kernel_seen) {
        c.one_per_kernel_seen = true;
        count_batching(c);
    }
    // Several kernels at two interrupts in a row: one a little late
    // sees the next kernel done too, but the next interrupt then sees
    // none.  Once seen, for good: under hfq's metering the same channel
    // may also complete one kernel per interrupt at times.
    const bool several = c.fence_get_known && static_cast<std::int32_t>(completed - c.fence_done) > 1;
    if (several && c.several_before && !c.batches) {
        c.batches = true;
        count_batching(c);
    }
    c.several_before = several;
}

void Accounting::note_fence(ChannelId ch, Channel& c, Time t, bool clamped, bool late, std::uint32_t get,
                            std::uint32_t completed, Time now) {
    // Kernels since its previous interrupt (1 when GET does not say): its
    // pace per kernel sets the audit's strata.
    c.fence_kernels = c.fence_get_known && fetched_
                          ? std::max<std::int32_t>(1, static_cast<std::int32_t>(completed - c.fence_done))
                          : 1;
    c.fence_get = get;
    c.fence_get_known = static_cast<bool>(fetched_);
    c.prev_fence_ts = c.fence_ts;
    c.fence_ts = left_engine_ && !clamped ? t : -1;
    c.check_at = -1;
    if (!current_ && !late && checked(c)) arm_check(c, t);
    c.fence_done = completed;
    c.fenced = c.ran = true;
    c.charged_through = std::max(c.charged_through, t);
    if (fetched_) c.charged_to(completed);
    // The looks so far were for this completion; the engine seen idle now
    // starts a new spell.
    audit_.close();
    if (!current_ || busy_spell()) open_audit(now, ch);
    // Idle from here (a kernel no look saw on the engine ended).
    if (!current_) arm_idle_trap(now);
    idle_after_fence_ = current_ ? std::nullopt : std::optional<ChannelId>(ch);
}

void Accounting::charge_fence(ChannelId ch, Channel& c, Time t, bool clamped, std::optional<ChannelId> running,
                              std::uint32_t completed) {
    const Time now = clock_.now();
    if (current_ == ch) {
        charge_seen_fence(ch, c, t, clamped, completed);
    } else if (fetched_ && c.uncharged(completed, 0)) {
        // Every kernel GET counts was charged already: a look at the engine
        // (a slice end's read) closed its stint at this completion before
        // the interrupt came.  The engine is as that look left it; charging
        // the kernel again, and dating what runs now from this late
        // moment, would charge the switch's dead time twice over.
        c.kernel_start = -1;
        set_preempted(ch, c, false);
        observed(running);
        return;
    } else {
        charge_unseen_fence(ch, c, t, clamped, running, completed, now);
    }
    c.kernel_start = -1;
    set_preempted(ch, c, false);
    current_ = ch;  // it was on the engine until now, whatever was believed
    loaded_ = ch;   // its context, too: running on after it is no switch
    // A late interrupt on a preemptive engine: a channel preempted earlier
    // may have resumed at `t` and finished its kernel before the read.
    const Time next = engine_.preemptive && running != ch && t < now ? resumed_unseen(ch, t, now, running) : t;
    now_running(running, next, next);
    last_seen_ = now;  // the read above
}

void Accounting::charge_seen_fence(ChannelId ch, Channel& c, Time t, bool clamped, std::uint32_t completed) {
    const Duration d = t - since_;
    // One kernel, begun fresh in a window: a look saw it on the engine
    // at seen_hi_ at the latest (a watch read since changes nothing), so
    // it ran at least from there to now, and at most from seen_lo_.  Longer
    // than its learned length allows (four spreads, at most a quarter,
    // beyond it): that length is stale (check_at's looks), and this
    // kernel is charged by its window.  Its length unknown: the bounds
    // teach it (learn_bounds).
    const bool windowed = c.kernel_start < 0 && seen_hi_ > seen_lo_ && c.fresh && !c.preempted && fetched_ &&
                          c.uncharged(completed, 1);
    if (windowed && c.kernel.estimate > 0 &&
        t - seen_hi_ > c.kernel.estimate + std::min(4 * c.kernel.spread, c.kernel.estimate / 4) + kExactStart)
        relearn(c);
    c.started_unseen = false;
    const bool bounded = windowed && c.fence_get_known && completed - c.fence_done == 1;
    if (bounded) c.kernel.learn_bounds(t - seen_hi_, t - seen_lo_);
    Duration mine = one_kernel_guess(c, d);
    const bool corrected = c.fresh && audit_slack_ > 0 && fetched_ && !clamped;
    if (start_slack_ > 0 && audit_mean_guessed(c, t, corrected))
        mine = whole_kernel(c.audit_mean, 0, d, start_slack_);
    // Its length unknown and its start in a slice end's window (up to a
    // slice wide) the looks will correct: from the window's end.  The
    // looks put it right on average either way, but a guess they take
    // back from a channel with little else charged is a debt it never
    // pays (an honest 0.1 ms kernel seen starting at a slice end was
    // charged 6 times that).  Not in the narrow windows of the settle
    // reads: their middle is closer, and the looks' noise grows with
    // the guess's error (lone tenants of varied lengths: 3 of 720
    // beyond 1% instead of 2).
    if (corrected && engine_.preemptive && c.kernel.estimate == 0 &&
        (c.uncharged(completed, 1) || (!c.charged_known && completed == 1)) && seen_hi_ > since_ &&
        audit_applies(c, t))
        mine = std::clamp<Duration>(t - seen_hi_, 0, mine);
    const Duration slack = c.kernel_slack + start_slack_;
    if (c.preempted && slack > 0 && c.kernel.estimate > 0 && fetched_ && c.uncharged(completed, 1)) {
        // The end of one kernel preempted before, whose stints began at
        // moments known only within `slack`: as one_kernel_guess does
        // for a kernel run whole.
        mine = whole_kernel(c.kernel.estimate, c.kernel_charged, d, slack);
    }
    if (corrected) mine = audited(ch, c, t, mine, c.uncharged(completed, 1));
    charge(ch, mine);
    c.kernel_charged = c.kernel_slack = 0;
    if (!clamped) learn_stint(c, t, fetched_ ? completed : 0);
}

void Accounting::charge_unseen_fence(ChannelId ch, Channel& c, Time t, bool clamped,
                                     std::optional<ChannelId> running, std::uint32_t completed, Time now) {
    // It started unseen after the last observation: from an idle engine
    // (a direct doorbell), or after a kernel whose completion raised no
    // interrupt.  It ran about its usual length, at most the whole gap.
    // A sighting later than its completion was the host reading late
    // (the GPU's timestamp is the truth): the gap is then the stint.
    const std::optional<Time> ended = current_ran_out(t);
    // On a preemptive engine, preempted kernels resumed where it ran
    // out; those that completed ran before this one.
    Time after = std::min(unseen_start(t), now);
    if (ended) after = engine_.preemptive ? resumed_unseen(ch, *ended, t, running) : *ended;
    const Time from = std::max(after, std::min(c.no_work_before, t));
    UnseenKernel k{t, from, 0, 0, completed, clamped, false, ended};
    // GET counts its kernels since last charged: with another channel
    // between its interrupts, the two took turns on the engine.
    k.gap = std::max<Duration>(0, t - from);
    k.n = c.kernels_since_charged(completed);
    // One kernel since its previous interrupt, whose GET that read saw.
    k.one_since_fence = fetched_ && c.fence_get_known && completed - c.fence_done == 1;
    learn_unseen(ch, c, k);
    charge_unseen(ch, c, k, running);
}

std::optional<Time> Accounting::current_ran_out(Time t) const {
    // The channel believed on the engine may be known to have ended
    // earlier (stint_end; on a preemptive engine, when GET says its
    // one kernel was all it had): what completed at t started after that.
    std::optional<Time> ended = stint_end(t);
    if (engine_.preemptive && current_ && left_engine_)
        if (const std::optional<Time> done = left_engine_(*current_);
            done && *done > since_ && *done <= t && ran_out_at(*current_, *done))
            ended = done;
    return ended;
}

void Accounting::learn_unseen(ChannelId ch, Channel& c, const UnseenKernel& k) {
    // On an idle engine it started in [from, t], one kernel after its
    // previous interrupt: that bounds its think time, and the probe
    // looks narrow it until one sees the start (arm_probe).  A channel
    // that restarts after the settle reads stop is never seen otherwise.
    if (!current_ && !k.clamped && !c.preempted && c.fence_ts >= 0 && k.one_since_fence)
        c.kernel.learn_think(c.fence_ts, k.from, k.t);
    // It started after the last look: one kernel of it that ran no
    // longer than that, short of its learned length by four spreads (at
    // most a quarter), proves that length stale (its kernels shrank).
    // Its length unknown: an upper bound for learn_bounds.
    if (!current_ && c.kernel.estimate > 0 && k.n == 1 && fetched_ &&
        c.uncharged(k.completed, 1) &&
        k.gap + std::min(4 * c.kernel.spread, c.kernel.estimate / 4) + kExactStart < c.kernel.estimate)
        relearn(c);
    c.started_unseen = !current_;
    c.ever_unseen = c.ever_unseen || c.started_unseen || (current_ && k.ended);
    // Started after the settle reads stopped, or after a kernel that
    // ended unheard: its next starts are read at its trapped doorbells.
    // (Not one between two settle reads: a tenant that thinks less than
    // a millisecond would pay a trap per kernel for a start the reads
    // date within their window.)
    if (!k.clamped && (current_ ? k.ended.has_value() : settle_reads_done()))
        trap_channel(ch, c, true);
    // The channel believed on the engine ran out unheard: had it asked
    // for an interrupt there, that one, raised before this one (by more
    // than kReorder), would have come first.  It asks for none (or the
    // host handled interrupts out of order); for good, so a tenant
    // cannot shed the mark by asking again for a while.  Measuring this
    // from `now` instead (1 ms) let kernels under 1 ms after a silent
    // one go unmarked, charged 87..98% short.  Not where
    // its last completion is the one its stint was dated from: it ended
    // nothing since, and the belief was a late handler's (the engine
    // read names who runs now, after another channel's short kernel;
    // pvgpud marked honest tenants that way in 6 of 8 runs, and
    // audited them for good: 0.5 more wakeups per interrupt).
    if (current_ && k.ended && *k.ended > since_ && k.t - *k.ended > kReorder)
        if (auto cur = channels_.find(*current_); cur != channels_.end()) cur->second.ends_unheard = true;
    const bool bounded = !current_ && k.n == 1 && !k.clamped && !c.preempted && k.one_since_fence;
    if (bounded) c.kernel.learn_bounds(0, k.gap);
}

void Accounting::charge_unseen(ChannelId ch, Channel& c, const UnseenKernel& k, std::optional<ChannelId> running) {
    // Corrected by the audit looks where what ran before it is known to
    // have ended (idle, or its completion timestamp), or where the same
    // looks correct the channel believed on the engine up to this guess
    // (both sides of it are corrected, so it may be off).  Else that
    // channel's charge up to the guess stands, and so must this one's.
    // (On the timeslice GPU a neighbour's kernel cuts into a long one
    // begun unseen, whose start the looks saw and no read dated.)
    const auto cur = current_ ? channels_.find(*current_) : channels_.end();
    const bool cur_audited = cur != channels_.end() && !k.ended && audit_applies(cur->second, k.t);
    const bool corrected = (!current_ || k.ended || cur_audited) && !k.clamped;
    const bool both_corrected = corrected && cur_audited;
    // Its length unknown: half the gap, or nothing where the looks
    // correct both it and the channel believed on the engine (a large
    // guess they take back from a channel with little else charged is
    // a debt it never pays: an honest 0.1 ms kernel cut into another's
    // unseen one was charged 6 to 10 times its length).
    Duration mine = c.kernel.estimate > 0 ? std::min(k.gap, k.n * c.kernel.estimate)
                    : both_corrected ? 0
                                     : k.gap / 2;
    if (k.n == 1 && audit_mean_guessed(c, k.t, corrected)) mine = std::min(k.gap, c.audit_mean);
    if (current_ && k.ended && *k.ended <= k.t - mine) {
        // It ran out at its completion: a stint closed there, with its
        // usual length when it held one kernel begun in a window.
        charge_stint(*current_, *k.ended, running);
    } else if (current_) {
        // On a preemptive engine this channel's context was switched in
        // before its kernel ran: the dead time is nobody's.
        const Time end = std::min(k.ended.value_or(k.t), k.t - mine - (engine_.preemptive ? engine_.ctxsw : 0));
        if (both_corrected)
            charge_guess(*current_, end, k.t);
        else
            charge(*current_, end - since_);
        settle_count(*current_, running);
    }
    if (corrected) mine = audited(ch, c, k.t, mine, k.n == 1);
    charge(ch, mine);
}

Time Accounting::unseen_start(Time done) const {
    // After current_'s believed start.  With the engine idle: after the
    // last look if that came before the completion; else after the first
    // look that saw the engine idle if the completion came later (some look
    // in between saw it idle); else the kernel ran before the engine was
    // first seen idle, from when it was believed to go idle: a short kernel
    // started unseen after another, ended before the read at the other's
    // interrupt, and its own interrupt came after later looks.
    if (current_) return since_;
    if (last_seen_ <= done) return last_seen_;
    return done > idle_seen_ ? idle_seen_ : since_;
}

Time Accounting::resumed_unseen(ChannelId fenced, Time from, Time now, std::optional<ChannelId> running) {
    if (preempted_.empty()) return from;
    // The engine resumes a preempted channel's kernel where it stopped, with
    // no doorbell and no start the host sees; its completion timestamp in
    // (from, now] says it ran from `from` (or from the one before it) to
    // then.  Only the kernel's rest: its interrupt, when it comes, finds its
    // time charged (the stint that follows starts at that timestamp).
    std::vector<std::pair<Time, ChannelId>> done;
    for (ChannelId id : preempted_) {
        if (id == fenced || id == running) continue;
        if (const std::optional<Time> ts = left_engine_ ? left_engine_(id) : std::nullopt;
            ts && *ts > from && *ts <= now)
            done.emplace_back(*ts, id);
    }
    std::sort(done.begin(), done.end());
    Time prev = from;
    for (const auto& [ts, id] : done) {
        Channel& c = channels_.at(id);
        charge(id, ts - prev);
        settle_count(id, running);  // its interrupt, when it comes, finds it charged
        set_preempted(id, c, false);
        c.kernel_start = -1;
        loaded_ = id;  // the engine's context now: what starts next switches
        prev = ts;
    }
    return prev;
}

void Accounting::channel_error(ChannelId ch) {
    Entry entry(*this);
    if (traced()) return traced_sync();
    if (current_ != ch) return;
    // The GPU stopped the channel at its timestamp (the error notifier's; a
    // kernel killed on the engine is charged up to then, however late the
    // host handles it) and picked the next channel at once.
    const Time t = clock_.now();
    Time at = t;
    if (left_engine_)
        if (const std::optional<Time> done = left_engine_(ch)) at = std::clamp(*done, since_, t);
    const std::optional<ChannelId> running = read();
    charge(ch, at - since_);
    now_running(running, at, at);
    // An engine idle now may have run others since the stop: their late
    // completions are charged from the stop on, not from this read.
    last_seen_ = running ? t : at;
}

void Accounting::observed(std::optional<ChannelId> running) {
    Entry entry(*this);
    if (traced()) return traced_sync();
    running = known(running);
    const Time t = clock_.now();
    // A look saw the engine idle (a kernel that asked for no interrupt ran
    // out, say): what starts next is unseen as after a completion, so
    // audited from here, once the look is accounted.
    struct IdleSeen {
        Accounting& a;
        bool idle;
        Time t;
        ~IdleSeen() {
            if (idle && !a.current_ && !a.audit_.is_open()) a.open_audit(t, std::nullopt);
        }
    } idle_seen{*this, !running, t};
    ran_between_looks(running, t);
    if (running == current_) {
        last_seen_ = t;
        return;
    }
    // A host that stalled reads the engine before handling the completions
    // raised meanwhile: replay them first.
    if (const std::optional<Time> end = replay_look(running, t)) {
        now_running(running, *end, *end >= last_seen_ ? *end : t);
        assumed_start(*end, t);
        last_seen_ = t;
        return;
    }
    // The engine switched somewhere in (last_seen_, t]: when the channel we
    // saw last completed a kernel in there, per the GPU's completion
    // timestamp (a kernel that asked for no interrupt still gets one);
    // else at the slice end if one fell in there; else assume the middle
    // (unbiased).
    if (const std::optional<Time> ended = stint_end(t)) {
        // The next started then if the last look still saw this one on the
        // engine (a completion at the very moment of that look included: the
        // register named it, so the switch came at or after the look); else
        // somewhere after the completion.
        charge_stint(*current_, *ended, running);
        now_running(running, *ended, *ended >= last_seen_ ? *ended : t);
        assumed_start(*ended, t);
        last_seen_ = t;
        return;
    }
    switched_unseen(running, t);
}

void Accounting::switched_unseen(std::optional<ChannelId> running, Time t) {
    Time lo = last_seen_, hi = t;
    std::optional<Time> done;
    if (engine_.preemptive && current_ && left_engine_) done = left_engine_(*current_);
    const bool slice_ended = engine_.preemptive && slice_end_ > last_seen_ && slice_end_ <= t;
    bool ran_out = false;
    if (done && *done > last_seen_ && *done <= t &&
        (!running || !slice_ended || slice_end_ < *done || ran_out_at(*current_, *done))) {
        // A preemptive engine gone idle, or on to another channel with no
        // slice end after the completion, or GET says so (a kernel that
        // ended with its slice): the channel ran out of work then.
        lo = hi = *done;
        ran_out = true;
    } else if (engine_.preemptive && current_ && running && slice_ended) {
        lo = hi = slice_end_;
    }
    // A stint that ended at a completion is charged as one the interrupt
    // closes: its usual length when it held one kernel begun in a window.
    bool audited_stint = false;
    if (current_ && ran_out)
        lo = hi = charge_ran_out(*current_, lo, t, running);
    else if (current_)
        audited_stint = charge_guess(*current_, lo + (hi - lo) / 2);
    // Taken off a preemptive engine without a completion: preempted.
    if (engine_.preemptive && current_ && running && !ran_out) mark_preempted(*current_, audited_stint);
    now_running(running, lo, hi);
    last_seen_ = t;
}

void Accounting::set_preempted(ChannelId id, Channel& c, bool preempted) {
    if (preempted == c.preempted) return;
    c.preempted = preempted;
    if (preempted)
        preempted_.push_back(id);
    else
        preempted_.erase(std::find(preempted_.begin(), preempted_.end(), id));
}

void Accounting::uncount(ChannelId id, Channel& c) {
    if (c.counted_batching) --batching_;
    c.counted_batching = false;
    set_preempted(id, c, false);
}

void Accounting::count_batching(Channel& c) {
    const bool counts = c.batches || !c.one_per_kernel_seen;
    if (counts == c.counted_batching) return;
    c.counted_batching = counts;
    batching_ = counts ? batching_ + 1 : batching_ - 1;
}

std::optional<Time> Accounting::replay(std::optional<ChannelId> fenced, std::optional<ChannelId> running, Time now,
                                       Time late_before) {
    std::vector<Completed> done;
    bool others = false;
    for (const auto& [id, c] : channels_) {
        const std::optional<Time> ts = left_engine_(id);
        // The completion that began the believed stint is not in it.
        if (!ts || *ts > now || *ts < since_ || (*ts == since_ && id != current_)) continue;
        // Its kernels up to there were charged by a look at an idle engine.
        if (*ts <= c.look_charged) continue;
        done.push_back({*ts, id, 0});
        others |= id != fenced && id != current_ && *ts <= late_before;
    }
    if (!others) return std::nullopt;
    std::sort(done.begin(), done.end(), [](const Completed& a, const Completed& b) {
        return std::tie(a.ts, a.id) < std::tie(b.ts, b.id);
    });
    if (fetched_)
        for (Completed& d : done) d.get = fetched_(d.id);  // one read each, for either replay
    learn_gaps(done, running, fenced);
    if (!replay_counted(done, running) && !replay_shares(done, running)) {
        Time prev = since_;
        bool after_idle = !current_;
        for (const Completed& d : done) {
            Channel& c = channels_.at(d.id);
            // The engine may have idled in between (the host held the work
            // it was late to release): at most the kernels GET counts since
            // its last interrupt, of its usual length.  The rest is nobody's.
            // One that interrupts on every kernel: GET counts them exactly.
            const Duration cap = c.every_kernel && c.charged_known ? kernels_in(d, running) * c.kernel.estimate
                                 : after_idle                     ? c.kernel.estimate * 5 / 4
                                                                  : fetched_cap(c, d.get);
            // A look at an idle engine charged it up to there already.
            prev = std::max(prev, c.look_charged);
            const Duration mine = cap > 0 ? std::min(d.ts - prev, cap) : d.ts - prev;
            // A replay is a guess from timestamps and learned lengths, as
            // an unseen start is: the audit looks correct it the same way
            // (a channel that never interrupts would otherwise keep every
            // charge on this path, uncorrected).
            charge(d.id, audited(d.id, c, d.ts, mine, fetched_ && kernels_in(d, running) == 1));
            after_idle = false;
            prev = d.ts;
        }
    }
    for (const Completed& d : done) {
        Channel& c = channels_.at(d.id);
        c.kernel_start = -1;  // nothing seen whole: learn no length
        c.ran = true;
        // Its start was guessed from its share: its pace sets the looks'.
        // Not a channel that interrupts on every kernel (GET counts it): one
        // host stall would otherwise narrow the strata for good.
        if (!c.every_kernel) c.ever_unseen = true;
        c.charged_through = std::max(c.charged_through, d.ts);
        set_preempted(d.id, c, false);
        if (fetched_) c.charged_to(completed_kernels(d.get, d.id, running));
    }
    current_ = done.back().id;
    return done.back().ts;
}

Duration Accounting::one_kernel_guess(const Channel& c, Duration d) const {
    if (start_slack_ > 0 && c.kernel.estimate > 0 && c.fresh) return whole_kernel(c.kernel.estimate, 0, d, start_slack_);
    return d;
}

Time Accounting::charge_ran_out(ChannelId ch, Time done, Time t, std::optional<ChannelId> running) {
    charge_stint(ch, done, running);
    // The engine resumed preempted kernels the moment it ran out; those that
    // completed before the look ran from then on.
    return resumed_unseen(ch, done, t, running);
}

void Accounting::charge_stint(ChannelId ch, Time end, std::optional<ChannelId> running) {
    auto it = channels_.find(ch);
    if (it == channels_.end() || !fetched_) {
        charge(ch, end - since_);
        return;
    }
    Channel& c = it->second;
    const std::uint32_t completed = completed_kernels(fetched_(ch), ch, running);
    const bool one = c.uncharged(completed, 1);
    const Duration d = one ? one_kernel_guess(c, end - since_) : end - since_;
    charge(ch, audited(ch, c, end, d, false));
    c.charged_to(completed);
    // Seen from a kernel's start to its last completion: learn the length,
    // as at an interrupt (a look at the engine may come first, and its
    // interrupt then finds the stint closed).  Only from a channel whose
    // interrupts come one per kernel: a stint closed by a look need not end
    // at an interrupt, and a tenant that chose which kernels interrupt could
    // have it end at its short one.
    if (!c.preempted && c.every_kernel) learn_stint(c, end, completed);
    c.kernel_start = -1;
}

void Accounting::learn_stint(Channel& c, Time end, std::uint32_t completed) {
    if (c.kernel_start < 0 || end <= c.kernel_start) return;
    // GET counts the stint's kernels (the next one's entry is fetched
    // already if the engine runs it now); without GET, one kernel.
    const std::int32_t n = fetched_ ? static_cast<std::int32_t>(completed - c.start_get) + 1 : 1;
    // Only a stint that holds every kernel since its previous interrupt:
    // the tenant chose which kernels interrupt, and the last one alone may
    // be its short one.
    const bool whole_period = !fetched_ || !c.fence_get_known || static_cast<std::int32_t>(completed - c.fence_done) == n;
    if (n > 0 && whole_period) c.kernel.learn_length((end - c.kernel_start) / n);
}

void Accounting::settle_count(ChannelId ch, std::optional<ChannelId> running) {
    if (!fetched_) return;
    if (auto it = channels_.find(ch); it != channels_.end())
        it->second.charged_to(completed_kernels(fetched_(ch), ch, running));
}

std::int32_t Accounting::kernels_in(const Completed& d, std::optional<ChannelId> running) const {
    return channels_.at(d.id).kernels_since_charged(completed_kernels(d.get, d.id, running));
}

void Accounting::learn_gaps(const std::vector<Completed>& done, std::optional<ChannelId> running,
                            std::optional<ChannelId> fenced) {
    if (!fetched_) return;
    // A completion inside a gap would be a later channel's earlier one: only
    // channels with one kernel in the window come after the gap.
    for (std::size_t i = done.size(); i-- > 1;) {
        Channel& c = channels_.at(done[i].id);
        if (!c.charged_known || kernels_in(done[i], running) != 1) return;
        // The tenant chose which of its kernels interrupts: asking only after
        // its short ones would teach a short length.
        if (done[i].id == fenced) continue;
        const Duration whole = done[i].ts - done[i - 1].ts;
        if (whole <= 0) return;
        c.kernel.learn_length(whole);
    }
}

bool Accounting::replay_shares(const std::vector<Completed>& done, std::optional<ChannelId> running) {
    if (!current_ || !fetched_) return false;
    std::vector<double> work(done.size());
    double total = 0;
    bool has_current = false;
    for (std::size_t i = 0; i < done.size(); ++i) {
        const Channel& c = channels_.at(done[i].id);
        if (c.kernel.estimate == 0) return false;
        work[i] = static_cast<double>(kernels_in(done[i], running)) * static_cast<double>(c.kernel.estimate);
        total += work[i];
        has_current |= done[i].id == *current_;
    }
    // The believed channel's stint began at stint_start_; a watch read
    // charged it up to since_ already.
    const Time from = has_current ? stint_start_ : since_;
    const double window = static_cast<double>(done.back().ts - from);
    for (std::size_t i = 0; i < done.size(); ++i) {
        // Each at most its counted kernels with a quarter's margin: beyond
        // that the engine idled (held work released late), nobody's time.
        Duration d = static_cast<Duration>(std::min(window * work[i] / total, work[i] * 1.25));
        if (done[i].id == *current_) d -= since_ - from;
        charge(done[i].id, d);
    }
    return true;
}

Duration Accounting::fetched_cap(const Channel& c, std::uint32_t get) const {
    if (!c.fence_get_known) return 0;
    return (std::int64_t{static_cast<std::int32_t>(get - c.fence_get)} + 1) * c.kernel.estimate * 5 / 4;
}

std::optional<Time> Accounting::replay_look(std::optional<ChannelId> running, Time t) {
    if (!current_ || engine_.preemptive || !left_engine_) return std::nullopt;
    // With every channel interrupting on every kernel, a third channel's
    // completion is unseen only while the host is late handling it.
    return replay(std::nullopt, running, t, batching_ > 0 ? t : t - kLateInterrupt);
}

bool Accounting::replay_counted(const std::vector<Completed>& done, std::optional<ChannelId> running) {
    // The engine ran from the believed stint's start to the last completion
    // timestamp: a stalled host released nothing meanwhile, and the engine
    // does not idle while it has work.  A channel that interrupts on every
    // kernel ran the kernels GET counts since its last interrupt, each of
    // its usual length; the others share the rest, in timestamp order, each
    // at most what GET counts since its last interrupt and up to its own
    // last completion.  Ordering by timestamps alone gave a guest kernel run
    // between two throttle kernels to the throttle.
    if (!current_ || !fetched_) return false;
    struct Part {
        ChannelId id;
        Duration d;
        bool counted;
        Duration cap;
        double work;  // not counted: its kernels since last charged times their usual length
        Time ts;      // its last completion
        bool one;     // counted: one kernel
    };
    std::vector<Part> parts;
    Duration counted_sum = 0;
    double uncounted_work = 0;
    for (const Completed& done_by : done) {
        const Channel& c = channels_.at(done_by.id);
        if (c.kernel.estimate == 0) return false;
        const Duration span = done_by.ts - since_;
        const std::int32_t n =
            static_cast<std::int32_t>(completed_kernels(done_by.get, done_by.id, running) - c.fence_done);
        if (c.every_kernel && n >= 1) {
            const Duration d = std::min(span, n * c.kernel.estimate);
            parts.push_back({done_by.id, d, true, 0, 0, done_by.ts, n == 1});
            counted_sum += d;
        } else {
            const Duration cap = fetched_cap(c, done_by.get);
            const double work =
                static_cast<double>(kernels_in(done_by, running)) * static_cast<double>(c.kernel.estimate);
            parts.push_back({done_by.id, 0, false, cap > 0 ? std::min(span, cap) : span, work, done_by.ts, false});
            uncounted_work += work;
        }
    }
    if (counted_sum == 0) return false;
    const Duration window = done.back().ts - since_;
    if (counted_sum > window)
        for (Part& p : parts)
            if (p.counted) p.d = static_cast<Duration>(static_cast<double>(p.d) * window / counted_sum);
    // The others share the rest as their kernels would: in timestamp order
    // a guest kernel run between two throttle kernels went to whichever
    // uncounted channel completed first.
    const double rest = static_cast<double>(std::max<Duration>(0, window - counted_sum));
    for (Part& p : parts)
        if (!p.counted) p.d = std::min(p.cap, static_cast<Duration>(rest * p.work / uncounted_work));
    for (const Part& p : parts) {
        Channel& c = channels_.at(p.id);
        // Every part is a guess (a counted channel's kernels dated by its
        // usual length, the others' shares by theirs): the audit looks
        // correct each as at an interrupt, where a spell covers it (one
        // stays open while some channel batches, busy_spell).  A learned
        // length the tenant steered (short kernels shown, long ones run
        // silent) otherwise moved time to its batching neighbour.
        charge(p.id, audited(p.id, c, p.ts, p.d, p.counted && p.one && p.id != current_));
    }
    return true;
}

std::optional<Time> Accounting::stint_end(Time t) const {
    if (!current_ || engine_.preemptive || !left_engine_) return std::nullopt;
    const std::optional<Time> done = left_engine_(*current_);
    if (done && *done >= since_ && *done <= t) return done;
    return std::nullopt;
}

std::optional<Time> Accounting::ended_unheard(Time t) const {
    if (!current_ || !left_engine_) return std::nullopt;
    const std::optional<Time> done = left_engine_(*current_);
    // Longer ago than an interrupt's latency: a stalled host, whose late
    // interrupts the replays sort out.
    if (!done || *done <= since_ || *done > t || t - *done > kLateInterrupt) return std::nullopt;
    // Another channel completed since: the engine did not idle from then on.
    for (const auto& [id, c] : channels_)
        if (id != *current_)
            if (const std::optional<Time> other = left_engine_(id); other && *other > *done && *other <= t)
                return std::nullopt;
    return done;
}

bool Accounting::charge_guess(ChannelId ch, Time end, Time through) {
    auto it = channels_.find(ch);
    bool corrected = false;
    charge(ch, it == channels_.end() ? end - since_
                                     : audited(ch, it->second, end, end - since_, false, &corrected, through));
    return corrected;
}

void Accounting::assumed_start(Time ended, Time seen) {
    // Dated at the end of what ran before: right when its work was queued
    // behind it, but a channel that came to the idle engine later started
    // anywhere up to the look that saw it.  The audit looks correct that
    // guess as any other (audit_slack_).
    audit_slack_ = std::max(audit_slack_, seen - ended);
}

void Accounting::started_after_idle(Time ended, std::optional<ChannelId> running, Time start, Time seen) {
    charge_stint(*current_, ended, running);
    now_running(std::nullopt, ended, ended);
    now_running(running, start, start);
    last_seen_ = seen;
}

void Accounting::preempted(ChannelId next) {
    Entry entry(*this);
    if (traced()) return traced_sync();
    const Time t = clock_.now();
    if (current_) mark_preempted(*current_, charge_guess(*current_, t));
    now_running(next, t, t);
    // The host chose the moment: exact, but the dead time is nobody's.
    since_ = stint_start_ = t + engine_.preempt;
    slice_end_ = since_ + engine_.timeslice;
    slice_slack_ = 0;
    if (auto it = channels_.find(next); it != channels_.end() && it->second.kernel_start >= 0)
        it->second.kernel_start = since_;
    arm_read();
}

void Accounting::now_running(std::optional<ChannelId> running, Time lo, Time hi) {
    if (running)
        if (auto it = channels_.find(*running); it != channels_.end() && it->second.no_work_before > lo) {
            // Seen before that bound: it started between the doorbell and
            // this look, not exactly at the doorbell.
            lo = it->second.no_work_before;
            if (hi < lo) hi = std::max(lo, clock_.now());
        }
    Time at = lo + (hi - lo) / 2;
    const std::optional<ChannelId> before = current_;
    if (running && !before)
        if (auto it = channels_.find(*running); it != channels_.end() && left_engine_) {
            Channel& c = it->second;
            const Time done = left_engine_(*running).value_or(-1);
            c.kernel.learn_think(done, lo, hi);
            // While its length is unknown, a start seen in a wide window is
            // dated by its think window, where it started before (the
            // middle of a look that saw the engine idle and a late one
            // charged its first kernels up to 3.3 times their length).
            // Neither exact nor a bound: the slack stays the window's.
            if (probed(c) && done >= 0) {
                const Time think_lo = std::max(lo, done + c.kernel.think_lo);
                const Time think_hi = std::min(hi, done + c.kernel.think_hi);
                if (think_lo <= think_hi) at = think_lo + (think_hi - think_lo) / 2;
            }
        }
    current_ = running;
    stint_charged_ = 0;
    seen_lo_ = lo;
    // A new context on a preemptive engine runs its kernel after the switch.
    seen_hi_ = hi + (engine_.preemptive && running != loaded_ ? engine_.ctxsw : 0);
    since_ = at;
    stint_start_ = at;
    start_slack_ = audit_slack_ = std::max(at - lo, hi - at);
    last_seen_ = std::max(last_seen_, at);
    if (running) start_stint(running, at, lo, hi);
    engine_changed(running, before);
}

void Accounting::start_stint(std::optional<ChannelId> running, Time at, Time lo, Time hi) {
    if (engine_.preemptive) {
        // As the engine does: a new context costs a switch and gets a
        // fresh slice; the same one keeps its slice while it lasts.
        if (running != loaded_) {
            since_ = stint_start_ = at + engine_.ctxsw;
            slice_end_ = since_ + engine_.timeslice;
            slice_slack_ = start_slack_;
        } else if (at >= slice_end_) {
            slice_end_ = at + engine_.timeslice;
            slice_slack_ = start_slack_;
        }
    }
    loaded_ = running;
    if (auto it = channels_.find(*running); it != channels_.end()) {
        Channel& c = it->second;
        c.ran = true;
        c.fresh = !c.preempted;  // else it resumes a kernel begun earlier
        c.kernel_start = c.fresh && lo == hi ? since_ : -1;
        if (c.kernel_start >= 0 && fetched_) {
            c.start_get = fetched_(*running);
            c.charged_to(c.start_get - 1);  // GET counts the one that starts now
        }
    }
}

void Accounting::engine_changed(std::optional<ChannelId> running, std::optional<ChannelId> before) {
    if (!running && before) {
        settle_step_ = 0;  // just went idle: watch for the next start
        idle_seen_ = clock_.now();
        arm_probe();
        arm_idle_trap(idle_seen_);
    } else if (running) {
        idle_after_fence_.reset();
        probe_timer_.cancel();
        idle_trap_timer_.cancel();
        idle_trap_ = false;  // channels opened now are not trapped; the others leave at their doorbells
    }
    if (running != before) events_.push_back({false, 0, 0, running});
    arm_read();
}

void Accounting::ran_between_looks(std::optional<ChannelId> running, Time t) {
    if (current_ || !left_engine_ || !fetched_ || batching_ == 0) return;
    if (engine_.preemptive && !pending_) return;
    std::vector<std::pair<Time, ChannelId>> done;
    for (const auto& [id, c] : channels_) {
        if (c.preempted || !c.charged_known) continue;
        const std::optional<Time> ts = left_engine_(id);
        if (ts && *ts > last_seen_ && *ts <= t) done.emplace_back(*ts, id);
    }
    std::sort(done.begin(), done.end());
    const Time from = last_seen_;
    Duration charged = 0;
    Time last = from;
    for (const auto& [ts, id] : done) {
        Channel& c = channels_.at(id);
        // On a preemptive engine, a channel off the engine with something
        // pending may hold a kernel taken off unfinished, which GET counts.
        if (engine_.preemptive && id != running && pending_(id)) continue;
        const std::uint32_t completed = completed_kernels(fetched_(id), id, running);
        const auto n = static_cast<std::int32_t>(completed - c.charged_done);
        if (n <= 0) continue;
        // At most what fits between the previous look and its completion,
        // less what those before it were charged there: on a preemptive
        // engine their kernels may have run interleaved with its own.
        // Without a learned length, half of that, as an interrupt after an
        // unseen start charges (charge_fence): left uncharged, a tenant
        // could hide its kernels between the host's looks.
        const Duration room = ts - from - charged;
        const Duration d = c.kernel.estimate > 0 ? std::min<Duration>(n * c.kernel.estimate, room) : room / 2;
        // A guess, as at an interrupt after an unseen start: corrected alike.
        charge(id, audited(id, c, ts, d, n == 1));
        charged += d;
        c.charged_to(completed);
        c.look_charged = ts;
        idle_after_fence_.reset();  // it completed after that fence
        if (settle_reads_done()) trap_channel(id, c, true);  // it started unseen, late
        c.kernel_start = -1;
        last = ts;
    }
    // A non-preemptive engine ran them one after another until the last
    // one's completion: whatever runs now started after it.  (A preemptive
    // one may have sliced the running channel out for them.)
    if (!engine_.preemptive) last_seen_ = last;
}

void Accounting::host_kicked(ChannelId ch, std::uint32_t first) {
    Entry entry(*this);
    if (traced()) return traced_sync();
    const Time t = clock_.now();
    if (current_ && fetched_ && channels_.count(ch))
        if (const std::optional<Time> ended = ended_unheard(t)) {
            // The believed kernel ended at `ended` and its interrupt has not
            // reached the host (latency).  The engine names the released
            // channel, GET at its first released entry: the release started
            // it now, from an engine idle since `ended`.  Dated back to that
            // end by the late interrupt's read, it was charged the latency.
            const std::optional<ChannelId> running = read();
            if (running == ch && fetched_(ch) == first + 1) {
                started_after_idle(*ended, running, t, t);
                return;
            }
            observed(running);
            return;
        }
    if (current_) {
        // Busy: the kicked work queues behind what runs.  Unless the GPU
        // says the believed kernel ended unseen (no interrupt) and nothing
        // completed since, so long ago that the kicked channel, had it run
        // since, would have completed too: the engine went idle then (its
        // work was held, and the host was late to release it), and the
        // kick started it now.
        const std::optional<Time> ended = stint_end(t);
        auto it = channels_.find(ch);
        if (!ended || it == channels_.end() || it->second.kernel.estimate == 0) return;
        const std::optional<Time> ch_done = left_engine_(ch);
        if (t - *ended <= it->second.kernel.estimate * 3 / 2 || (ch_done && *ch_done > *ended)) return;
        const std::optional<ChannelId> running = read();
        if (running == ch) {
            // Other channels may have completed kernels in the believed
            // stint while the host stalled: replayed up to the last one.
            const std::optional<Time> end = replay_look(running, t);
            if (!end) charge(*current_, *ended - since_);
            const Time idle = end.value_or(*ended);
            now_running(std::nullopt, idle, idle);
            now_running(running, t, t);
            last_seen_ = t;
        } else {
            observed(running);
        }
        return;
    }
    const std::optional<ChannelId> running = read();
    ran_between_looks(running, t);
    if (running) {
        // Started by this very doorbell if it is the kicked channel; else it
        // started unseen since the last look.
        if (running == ch)
            now_running(running, t, t);
        else
            now_running(running, last_seen_, t);
    } else {
        settle_step_ = 0;
        arm_read();
    }
    last_seen_ = t;
}

void Accounting::doorbell_forwarded(ChannelId ch, std::uint32_t given) {
    Entry entry(*this);
    if (traced()) return traced_sync();
    // The idle trap did its work for this channel: this start is read right
    // after the forward (a start no look sees arms it again).
    idle_trap_ = false;
    if (!current_) arm_idle_trap(clock_.now());
    if (auto it = channels_.find(ch); it != channels_.end()) {
        Channel& c = it->second;
        if (c.idle_trapped) set_traps(ch, c, false, c.trapped);
        // A channel trapped for its own sake whose bursts keep starting
        // while the engine is busy (or right after it went idle) starts
        // where the completions show it: it goes back to direct.  A doorbell
        // behind its own pending work counts neither way (one read of the
        // pending register): counted, a burst of 17 lifted the trap before
        // the next burst's first start, the one it is for.
        if (c.trapped && !(pending_ && pending_(ch))) {
            const bool needed = current_ ? ended_unheard(clock_.now()).has_value()
                                         : clock_.now() - idle_seen_ > kSettleSpan;
            if (needed)
                c.unneeded_traps = 0;
            else if (++c.unneeded_traps >= kTrapUnneeded)
                trap_channel(ch, c, false);
        }
    }
    // Every entry the GPU had of it completed: whatever of it runs next
    // starts after this doorbell, however long ago the engine was last seen
    // (a look that finds it on the engine dates it from here).  What was
    // charged says so first, for free; the GPU's pending register, one
    // read, confirms it (a kernel preempted or charged by a guess is not
    // done, and the tenant chooses when to ring).
    if (auto it = channels_.find(ch); it != channels_.end() && current_ != ch && pending_)
        if (Channel& c = it->second; !c.preempted && c.uncharged(given, 0) && !pending_(ch))
            c.no_work_before = clock_.now();
    if (current_ == ch && pending_ && left_engine_ && !ended_unheard(clock_.now()) && !pending_(ch)) {
        // The channel believed on the engine has nothing left on the GPU
        // (one read of its pending register): it ran out at its last
        // completion, one that asked for no interrupt, and the engine has
        // idled or run others unseen since.  A look before the forward
        // closes its stint there as any look does (preempted kernels that
        // resumed then included); the read after the forward says what runs.
        observed(read());
    }
    if (current_) {
        // Busy as last seen, and the kicked work queues behind it.  Unless
        // the GPU's timestamp says the believed kernel ended and its
        // interrupt has not reached the host yet (interrupt latency): then
        // the engine may be idle and the forward start `ch` now, which the
        // late interrupt's read would date back to that end.  GET before
        // the forward and a read right after it tell which.
        if (!fetched_ || !ended_unheard(clock_.now()) || channels_.find(ch) == channels_.end()) return;
        kicked_ = ch;
        kicked_at_ = clock_.now();
        kicked_get_ = fetched_(ch);
        kick_timer_.arm(kicked_at_, [this] { kick_read(); });
        return;
    }
    kicked_ = ch;
    kicked_at_ = clock_.now();
    settle_step_ = 0;
    arm_read();  // the first settle read comes right after the forward
}

Duration Accounting::kernel_estimate(ChannelId ch) const {
    auto it = channels_.find(ch);
    return it == channels_.end() ? 0 : it->second.kernel.estimate;
}

Duration Accounting::kernel_spread(ChannelId ch) const {
    auto it = channels_.find(ch);
    return it == channels_.end() ? 0 : it->second.kernel.spread;
}

void Accounting::arm_read() {
    if (current_) {
        if (engine_.preemptive && engine_.timeslice > 0) {
            read_timer_.arm(std::max(slice_end_, clock_.now()) + kSliceReadDelay, [this] { slice_read(); });
        } else {
            auto it = channels_.find(*current_);
            const Duration usual = it == channels_.end() ? 0 : 2 * it->second.kernel.estimate;
            read_timer_.arm(clock_.now() + std::max(kBusyWatch, usual), [this] { busy_read(); });
        }
    } else if (!settle_reads_done()) {
        read_timer_.arm(clock_.now() + kSettleGaps[settle_step_], [this] { settle_read(); });
    } else {
        read_timer_.cancel();
    }
}

bool Accounting::settle_reads_done() const { return settle_step_ >= std::size(kSettleGaps); }

void Accounting::settle_read() {
    Entry entry(*this);
    const Time t = clock_.now();
    const std::optional<ChannelId> running = read();
    ran_between_looks(running, t);
    ++settle_step_;
    const std::optional<ChannelId> kicked = std::exchange(kicked_, std::nullopt);
    if (running) {
        // Started between the previous look and this one; right after the
        // previous one if they are this close (a client resubmitting on its
        // completion), or at the doorbell the host forwarded just before.
        if (kicked && running == kicked && kicked_at_ >= last_seen_ && t - kicked_at_ <= kExactStart)
            now_running(running, kicked_at_, kicked_at_);
        else if (t - last_seen_ <= kExactStart)
            now_running(running, last_seen_, last_seen_);
        else
            now_running(running, last_seen_, t);
    } else {
        arm_read();
    }
    last_seen_ = t;
    // The last settle read saw the engine idle: any start from here on is
    // unseen, whoever it is.
    if (!running && settle_reads_done() && !audit_.is_open())
        open_audit(t, idle_after_fence_, true);
}

bool Accounting::checked(const Channel& c) {
    // Its length unknown too: a look that sees it running narrows the
    // window its kernel is charged by, and the bounds it proves.
    return c.every_kernel && !c.batches && c.started_unseen && c.prev_fence_ts >= 0 && c.fence_ts > c.prev_fence_ts;
}

void Accounting::arm_check(Channel& c, Time done) {
    c.checks = 1;
    // From the end of the settle reads to where its next completion would
    // come at its last pace (at least two kernels on).
    const Time lo = clock_.now() + kSettleSpan + kProbeNarrow;
    const Time hi = std::max(done + (done - c.prev_fence_ts), lo + 2 * c.kernel.estimate);
    c.check_at = lo + std::uniform_int_distribution<Duration>(0, hi - lo)(check_rng_);
    arm_probe();
}

void Accounting::relearn(Channel& c) {
    c.kernel.relearn();
    c.probes = 0;
    c.check_at = -1;
}

bool Accounting::probed(const Channel& c) {
    return c.kernel.estimate == 0 && c.one_per_kernel_seen && !c.batches && c.kernel.think_hi >= 0 &&
           c.probes < kMaxProbes;
}

void Accounting::arm_probe() {
    probe_timer_.cancel();
    if (current_ || !left_engine_) return;
    const Time now = clock_.now();
    std::optional<Time> next;
    for (auto& [id, c] : channels_) {
        if (c.check_at > now && (!next || c.check_at < *next)) next = c.check_at;
        if (!probed(c) || c.kernel.think_hi - c.kernel.think_lo > kProbeWindow)
            continue;
        const std::optional<Time> done = left_engine_(id);
        if (!done) continue;
        // Wide: the middle.  Narrow: just outside its two ends, in turn (a
        // look at the very moment of a start may come before or after it).
        const bool wide = c.kernel.think_hi - c.kernel.think_lo > kProbeNarrow;
        const Time looks[] = {wide ? *done + c.kernel.think_lo + (c.kernel.think_hi - c.kernel.think_lo) / 2
                                   : *done + c.kernel.think_lo - kProbeNarrow / 2,
                              *done + c.kernel.think_hi + kProbeNarrow / 2};
        for (std::size_t i = 0; i < (wide ? 1U : 2U); ++i)
            if (looks[i] > now && (!next || looks[i] < *next)) next = looks[i];
    }
    if (next)
        probe_timer_.arm(*next, [this] { probe_read(); });
}

void Accounting::probe_read() {
    Entry entry(*this);
    const Time t = clock_.now();
    std::vector<ChannelId> checked_now;
    for (auto& [id, c] : channels_)
        if (c.check_at >= 0 && c.check_at <= t) {
            c.check_at = -1;
            checked_now.push_back(id);
        }
    if (current_) return;  // believed busy: the engine gets its looks anyway
    for (auto& [id, c] : channels_)
        if (probed(c)) ++c.probes;
    const std::optional<ChannelId> running = read();
    ran_between_looks(running, t);
    if (running) {
        // Started after the settle reads stopped: its next starts are read
        // at its trapped doorbells.
        if (auto it = channels_.find(*running); it != channels_.end() && settle_reads_done())
            trap_channel(*running, it->second, true);
        // Two looks this close (a narrow window's two ends): it started
        // between them, the middle unbiased.
        const Time mid = last_seen_ + (t - last_seen_) / 2;
        if (t - last_seen_ <= kExactStart)
            now_running(running, mid, mid);
        else
            now_running(running, last_seen_, t);
    }
    last_seen_ = t;
    if (running) return;
    // A check that saw the engine idle looks again, at most kChecks times
    // per idle spell, each within the channel's last pace from here: a
    // tenant that starts its long kernels later than its short ones must
    // not find a moment safe from the check.
    for (ChannelId id : checked_now)
        if (auto it = channels_.find(id); it != channels_.end() && checked(it->second) && it->second.checks < kChecks) {
            Channel& c = it->second;
            ++c.checks;
            const Duration pace = std::max(c.fence_ts - c.prev_fence_ts, 2 * c.kernel.estimate);
            c.check_at = t + 1 + std::uniform_int_distribution<Duration>(0, pace)(check_rng_);
        }
    arm_probe();
}

void Accounting::seed_looks(std::uint64_t seed) {
    const auto lo = static_cast<std::uint32_t>(seed), hi = static_cast<std::uint32_t>(seed >> 32);
    std::seed_seq check{lo, hi, 1u}, audit{lo, hi, 2u};
    check_rng_.seed(check);
    audit_.seed(audit);
}

bool Accounting::audit_mean_guessed(const Channel& c, Time t, bool corrected) const {
    // Every guess a spell covers is corrected by the looks, whatever it is:
    // the audited mean is for how far off it is, since the looks' noise
    // grows with that.
    // A learned length comes from the kernels seen whole, and a tenant whose
    // unseen kernels are not those (a short one at once after each long one
    // that started unseen) is otherwise guessed 95% short every time.  The
    // mean comes from earlier spells' looks, not this one's: the correction
    // stays unbiased.  Only a guess the looks then correct: an uncorrected
    // one also dates where the channel believed on the engine ended, and
    // the mean, unlike a learned length, is never proven stale by a look
    // (a tenant keeping its audited kernels short would pass its long ones'
    // time to that channel).
    if (!corrected || c.audit_kernels < kAuditTrusted || !audit_.covers(t)) return false;
    return c.kernel.estimate == 0 || std::abs(c.audit_mean - c.kernel.estimate) > c.kernel.estimate / kAuditMeanOff;
}

bool Accounting::sets_audit_pace(const Channel& c, bool settled) {
    // Not only after an unseen start: a tenant would show its short kernels
    // to the settle reads right after its long ones.  Batching channels too:
    // a tenant could otherwise opt out by asking for fewer interrupts.  And
    // every channel whose doorbell is not trapped once the settle reads are
    // spent: its first unseen start would be guessed at its learned length,
    // uncorrected (two 0.1 ms kernels shown to the settle reads, a 2 ms
    // think and a 500 ms kernel, on a fresh channel each time: charged
    // 0.06% of what ran, on either engine).  A trapped doorbell dates its
    // start exactly.
    const bool unseen_next = c.ever_unseen || (settled && !c.trapped && !c.idle_trapped);
    return unseen_next && c.prev_fence_ts >= 0 && c.fence_ts > c.prev_fence_ts;
}

bool Accounting::busy_spell() const {
    if (!current_ || engine_.preemptive) return false;
    if (auto it = channels_.find(*current_); it != channels_.end() && it->second.ends_unheard) return true;
    // A channel that batches (or may: a new one) ends kernels unheard, and
    // the replays that date the others' starts after them are guesses; not
    // one that never ran (an open channel never used kept honest tenants at
    // three reads per fence).
    if (batching_ == 0) return false;
    for (const auto& [id, c] : channels_)
        if (c.counted_batching && c.ran) return true;
    return false;
}

void Accounting::open_audit(Time from, std::optional<ChannelId> opener, bool settled) {
    audit_.close();
    // While busy only when what starts next may start unseen.  On a
    // preemptive engine only once the settle reads saw it idle to the last:
    // its status names a context being switched in before it runs, and a
    // look then charges that dead time (microseconds) to the audited start.
    if ((current_ && !busy_spell()) || (engine_.preemptive && !settled)) return;
    Duration width = 0;
    for (const auto& [id, c] : channels_) {
        // A channel yet to complete two kernels (or whose last fence came
        // with the host stalled, clamped): its next one starts unseen
        // whenever it comes, and half the time since the last look is all
        // a guess can say (the second one was left out once: +0.6 ms on
        // every lone sparse tenant, a +0.2% over-charge in the varied sweep).
        const bool paced = c.fenced && c.prev_fence_ts >= 0;
        const Duration pace =
            !paced ? kAuditNewPace : sets_audit_pace(c, settled) ? (c.fence_ts - c.prev_fence_ts) / c.fence_kernels : 0;
        if (pace > 0) width = width == 0 ? pace : std::min(width, pace);
    }
    if (width == 0) return;
    audit_.open(from, opener, current_, width);
}

void Accounting::audit_read(Duration weight) {
    Entry entry(*this);
    const Time t = clock_.now();
    const std::optional<ChannelId> running = read();
    audit_.record({t, weight, running});
    if (!running && !current_ && spell_done(t)) {
        audit_.close();
        return;
    }
    audit_.plan_look();
}

bool Accounting::spell_done(Time t) const {
    // The engine is idle at this look, every doorbell has been trapped long
    // enough for the remap to have landed (a later start is read at its
    // forward), and every completion the GPU timestamped was handled (a
    // kernel that ran unseen has its interrupt corrected by these looks):
    // no later look could correct anything.  An idle GPU's spell ends here,
    // not some 2^15 paces on.
    if (t < traps_set_at_ + trap_lands_) return false;
    for (const auto& [id, c] : channels_) {
        if (!c.trapped && !c.idle_trapped) return false;
        if (left_engine_)
            if (const std::optional<Time> done = left_engine_(id); done && *done > c.charged_through) return false;
    }
    return true;
}

Duration Accounting::audited(ChannelId ch, Channel& c, Time t, Duration mine, bool one, bool* corrected,
                             Time through) {
    // The rest of a kernel preempted before (only a preemptive engine
    // preempts, audited only while idle): charged as guessed.
    if (c.preempted) return mine;
    // One kernel ran within the spell: it was not on the engine seen idle at
    // its start.  Several: only when the spell began at this channel's own
    // completion (nothing else completed since, so all ran after it);
    // otherwise the earlier ones may have run before the spell, and what the
    // guess charged there stands.  Not the kernel on the engine when a spell
    // began while busy: it started before.
    const bool on_at_start = audit_.running_at_start() == ch && c.charged_through < audit_.from();
    const bool all_within = (one || audit_.opener() == ch) && !on_at_start;
    through = std::max(through, t);
    const std::optional<Duration> fix = audit_correction(ch, c, t, mine, all_within, through);
    c.charged_through = std::max(c.charged_through, through);
    if (corrected) *corrected = fix.has_value();
    if (!fix) return mine;
    c.audit_kernels = std::min(c.audit_kernels + 1, kAuditMean);
    c.audit_mean = std::max<Duration>(0, c.audit_mean + (mine + *fix - c.audit_mean) / c.audit_kernels);
    return after_debt(c, mine + *fix);
}

Duration Accounting::after_debt(const Channel& c, Duration owed) {
    // Its tenant's debt first: corrections that took back more than was
    // charged since are paid by later charges.
    Duration& debt = totals_[c.leaf].audit_debt;
    owed += debt;
    debt = std::min<Duration>(0, owed);
    return std::max<Duration>(0, owed);
}

void Accounting::charge_sighted(ChannelId x, Time t) {
    auto it = channels_.find(x);
    if (it == channels_.end()) return;
    Channel& c = it->second;
    // Its guess up to t was nothing, and every kernel of it the looks saw
    // ran after the spell's start (an idle engine, seen so).
    const std::optional<Duration> fix = audit_correction(x, c, t, 0, true, t);
    if (!fix) return;
    c.charged_through = t;
    if (*fix <= 0) return;
    const Duration owed = after_debt(c, *fix);
    charge(x, owed);
    // Its kernel goes on from t: not a fresh one whose length its stint
    // teaches, and what it was charged here has no slack to put right.
    set_preempted(x, c, true);
    c.kernel_charged = owed;
    c.kernel_slack = 0;
}

bool Accounting::audit_applies(const Channel& c, Time t) const {
    return !c.preempted && audit_.covers(t) && t > std::max(audit_.from(), c.charged_through);
}

std::optional<Duration> Accounting::audit_correction(ChannelId ch, const Channel& c, Time t, Duration mine,
                                                     bool all_within, Time through) const {
    // From the spell's start, or where this channel's time was charged up
    // to if later (its stint closed by a look, say): before that the looks
    // that saw it were charged already.
    if (!audit_applies(c, t)) return std::nullopt;
    const Time from = std::max(audit_.from(), c.charged_through);
    const Time charged_from = t - mine;
    // What this guess charged before charged_through was charged already;
    // before the spell's start too when every kernel charged ran after it
    // (the engine was seen idle there).
    const Duration fix = -std::max<Duration>(0, (all_within ? from : c.charged_through) - charged_from);
    return fix + audit_.correction(ch, from, through, charged_from, t);
}

void Accounting::kick_read() {
    Entry entry(*this);
    const std::optional<ChannelId> kicked = std::exchange(kicked_, std::nullopt);
    const std::optional<Time> ended = ended_unheard(clock_.now());
    if (!kicked || !current_ || !ended) return;  // the interrupt came first and settled it
    const Time t = clock_.now();
    const std::optional<ChannelId> running = read();
    // The entry the forward announced is on the engine, fetched after the
    // forward (GET moved by one): the engine was idle from the believed
    // kernel's end until the forward.  Anything else: as any sighting.
    if (running == kicked && fetched_(*kicked) == kicked_get_ + 1 && t - kicked_at_ <= kExactStart) {
        started_after_idle(*ended, running, kicked_at_, t);
        return;
    }
    observed(running);
}

void Accounting::busy_read() {
    Entry entry(*this);
    const Time t = clock_.now();
    const std::optional<ChannelId> running = read();
    if (running && running == current_) {
        // Others completed kernels since it was seen: it ran again after them.
        if (const std::optional<Time> end = replay_look(running, t)) {
            now_running(running, *end, *end);
            assumed_start(*end, t);
            last_seen_ = t;
            return;
        }
        // Still on the engine: charge what it ran so far (its kernel's start,
        // if known exactly, still teaches the kernel's length at its fence),
        // from a start that may be a guess: audited now, as a kernel is at
        // its interrupt.
        charge_guess(*current_, t);
        since_ = t;
        start_slack_ = 0;
        last_seen_ = t;
        arm_read();
    } else {
        observed(running);
    }
}

void Accounting::slice_read() {
    Entry entry(*this);
    const Time t = clock_.now();
    const std::optional<ChannelId> running = read();
    if (running && running == current_) {
        // Nobody else waited: the GPU renewed the slice at its end.
        slice_end_ += engine_.timeslice;
        if (slice_end_ + kSliceReadDelay <= t) slice_end_ = t;
        last_seen_ = t;
        arm_read();
    } else if (running) {
        const Time done = left_engine_ ? left_engine_(*current_).value_or(-1) : -1;
        // Its start, hence the slice end, is known within start_slack_ (and
        // kExactStart for one seen exactly): a kernel that ended with its
        // slice may have completed just after the slice end believed.
        if (done <= std::min(slice_end_ + start_slack_ + kExactStart, t) && ran_out_at(*current_, done)) {
            // Its interrupt is on the way.  The next one started after the
            // switch from there (or after the preempted kernels that resumed
            // there and completed).
            const Time end = charge_ran_out(*current_, done, t, running);
            now_running(running, end, end);
        } else {
            // Switched at the slice end, as programmed.  A stint begun at a
            // guessed start is audited here, as a kernel is at its
            // interrupt: else the kernel's end, charged from an exact start,
            // pulled that guess towards a length the tenant taught with
            // short kernels (44% charged).  The slice
            // end is known as well as the start its slice began at: the
            // next channel started in there, after the last look that saw
            // this one (a neighbour's 0.5 ms kernel, cut in where the GPU's
            // slice ended, was charged 0.1 ms).
            const Time lo = std::max(last_seen_, std::min(slice_end_ - slice_slack_, t));
            const Time hi = std::max(lo, std::min(slice_end_ + slice_slack_, t));
            mark_preempted(*current_, charge_guess(*current_, lo + (hi - lo) / 2, hi));
            now_running(running, lo, hi);
        }
        last_seen_ = t;
    } else {
        observed(running);
    }
}

bool Accounting::ran_out_at(ChannelId ch, Time done) const {
    auto it = channels_.find(ch);
    // (GET is read only when that can matter: each read costs.)
    if (it == channels_.end() || !fetched_ || !it->second.charged_known || done <= since_) return false;
    // One kernel fetched since it was last charged, the one that completed;
    // or several, and the GPU's pending register says none is left (a
    // preempted kernel is fetched and not completed: pending).
    return it->second.uncharged(fetched_(ch), 1) || (pending_ && !pending_(ch));
}

void Accounting::mark_preempted(ChannelId ch, bool audited_stint) {
    auto it = channels_.find(ch);
    if (it == channels_.end()) return;
    Channel& c = it->second;
    if (ch == current_) {
        // Its kernel goes on later: what this stint was charged, and how
        // far off its start may be, let that kernel's completion put it
        // right (charge_fence).
        if (!c.preempted) c.kernel_charged = c.kernel_slack = 0;
        c.kernel_charged += stint_charged_;
        if (!audited_stint) c.kernel_slack += start_slack_;
    }
    set_preempted(ch, c, true);
}

Duration Accounting::gpu_time(EntityId leaf) const {
    // The trace read up to now first: the stint believed running may have
    // ended (its events wait for the next entry point).
    if (traced()) trace_sync_();
    auto it = totals_.find(leaf);
    Duration d = it == totals_.end() ? 0 : it->second.gpu_time;
    if (current_) {
        auto c = channels_.find(*current_);
        if (c != channels_.end() && c->second.leaf == leaf) d += std::max<Duration>(0, clock_.now() - since_);
    }
    return d;
}

std::uint64_t Accounting::kernels(EntityId leaf) const {
    auto it = totals_.find(leaf);
    return it == totals_.end() ? 0 : it->second.kernels;
}

}  // namespace pvgpu
