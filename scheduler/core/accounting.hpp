// The accounting: GPU time per channel and per leaf entity, kept by the
// scheduler itself under every policy (`none` included), from what a host
// can read from the GPU (docs/design.md, "The accounting").  Never the
// work's own durations, never the tenant-writable control page, never a
// timestamp the tenant's own work asks the GPU to write.
//
// The pieces:
//  - Accounting (this file): the ledger.  Who is believed on the engine
//    and since when (current_, since_), what each channel and leaf is
//    charged (Totals), the engine reads that date starts, the doorbell
//    traps it asks of the host, and the listener that hears every charge.
//  - KernelModel (kernel_model.hpp), one per channel, a value: its
//    kernels' learned length and spread, and while that is unknown the
//    bounds and think time the looks proved.
//  - AuditSampler (audit_sampler.hpp): the audit looks at random moments
//    that correct a guessed charge on average, and their correction.
//  - Trace mode (set_trace, accounting_trace.cpp): a GPU that keeps a
//    context-switch trace has every stint dated and charged exactly; none
//    of the guessing is used.
//
// How an event flows without a trace: a completion interrupt (fence) is
// dated (fence_time) and the engine read names who runs now.  The kernel
// is charged to its channel: charge_seen_fence when it was believed on the
// engine, else charge_unseen_fence, whose guess (learned length, half a
// window) the audit spell corrects (audited).  What the kernel teaches goes
// to its KernelModel; the next stint is dated (now_running).  A look at
// the engine (observed, or a read of the accounting's own: settle, busy,
// slice, probe, check, audit) closes the believed stint at its best known
// end the same way.  Charges reach the listener once the entry point is
// done (Entry).
#pragma once

#include <algorithm>
#include <cstdint>
#include <exception>
#include <functional>
#include <optional>
#include <random>
#include <unordered_map>
#include <vector>

#include "audit_sampler.hpp"
#include "entity_tree.hpp"
#include "gpu_device.hpp"
#include "kernel_model.hpp"
#include "time.hpp"

namespace pvgpu {

class Accounting {
public:
    // One engine-status register read (the scheduler counts its cost).
    using StatusRead = std::function<std::optional<ChannelId>()>;
    // What a listener hears: `d` of GPU time charged to `ch` (its leaf's
    // total grew by d), or a change of the channel seen on the engine.
    struct Event {
        bool is_charge;
        ChannelId ch;                      // charge
        Duration d;                        // charge
        std::optional<ChannelId> running;  // change (nullopt: idle)
    };
    using Listener = std::function<void(const Event&)>;

    Accounting(const Clock& clock, Timers& timers, StatusRead read, EngineArbitration engine);
    Accounting(const Accounting&) = delete;
    Accounting& operator=(const Accounting&) = delete;

    // Seeds the random moments of the check and audit looks.  Their odds
    // are what keeps a guess right on average, so a host seeds them from
    // its own entropy: with the fixed default (kept for the simulator's
    // reproducible runs), a tenant that knows the code could replay the
    // sequence and think where no look falls.
    void seed_looks(std::uint64_t seed);

    void channel_added(ChannelId ch, EntityId leaf);
    // Before the GPU forgets the channel: its time so far stays with its leaf.
    void channel_removed(ChannelId ch);
    // The entity is gone; its id may be reused.
    void entity_removed(EntityId id);

    // A completion interrupt of `ch` (its kernel was on the engine until now).
    void fence(ChannelId ch);
    // `ch` was stopped by the GPU (watchdog, bad entry).
    void channel_error(ChannelId ch);
    // Someone else read the engine status now: an observation for free.
    void observed(std::optional<ChannelId> running);
    // The host itself just wrote `ch`'s doorbell (released held work from
    // ring position `first` on): if the engine was idle, whatever starts now
    // starts now.  Reads the engine.
    void host_kicked(ChannelId ch, std::uint32_t first);
    // A trapped doorbell of `ch`, forwarded to the GPU right after this call:
    // read the engine once that happened.  `given`: the IB_PUT the GPU had
    // before it (the host's own last store, or a read after a direct spell).
    void doorbell_forwarded(ChannelId ch, std::uint32_t given);

    void set_listener(Listener l) { listener_ = std::move(l); }
    // What the looks cannot date, a trapped doorbell dates exactly: the
    // engine is read right after the host forwards it.  The accounting asks
    // the host to trap a channel's doorbells (a policy may trap or shadow
    // more; the host keeps the stronger mode) while the engine has been
    // seen idle for kIdleTrap, every channel's until its own next doorbell;
    // and a channel's of its own once a kernel of it started unseen on an
    // idle engine, until kTrapUnneeded of its bursts in a row began while
    // the engine was busy (a sparse tenant
    // pays one trap per kernel instead of noisy guesses).  A listener hears
    // each channel whose wish changed, delivered as events are.
    using TrapListener = std::function<void(ChannelId, bool)>;
    void set_trap_listener(TrapListener l) { trap_listener_ = std::move(l); }
    bool wants_trap(ChannelId ch) const;
    // How long the host takes to remap a channel (a trap asked for lands
    // within twice that, one switch possibly in flight before it).
    void set_remap_delay(Duration d);
    // When a channel last left the engine, from the GPU's context-switch
    // trace (EngineTrace::left_at; nullopt while it is on the engine): a
    // fence whose channel has left is charged up to that moment, not up to
    // when its interrupt ran.
    using LeftEngine = std::function<std::optional<Time>(ChannelId)>;
    void set_left_engine(LeftEngine l) { left_engine_ = std::move(l); }
    // Exact accounting from the GPU's context-switch trace (a GPU that keeps
    // one: GpuDevice::read_ctxsw_trace).  `sync` reads the records written
    // since the last read and hands each to trace_switch (or trace_lost);
    // the accounting calls it at every entry point and every kTraceSync
    // while the engine is busy.  Each stint is then charged from its switch
    // in to its switch out, as the GPU dated them: nothing is guessed, no
    // look is made and no doorbell trapped for the accounting's sake.
    // Without it (a GPU without a trace) the accounting guesses as the
    // header says.  Kernel lengths are learned from the stints and GET.
    using TraceSync = std::function<void()>;
    void set_trace(TraceSync sync);
    bool traced() const { return static_cast<bool>(trace_sync_); }
    void trace_switch(const CtxswRecord& r);
    void trace_lost(std::uint64_t n);
    // Records the GPU dropped before the host read them (time not charged).
    std::uint64_t trace_records_lost() const { return trace_lost_; }
    // The GPU's GET register (GpuDevice::read_ib_get: entries it fetched):
    // a stint of several kernels without interrupts teaches their mean.
    using Fetched = std::function<std::uint32_t(ChannelId)>;
    void set_fetched(Fetched f) { fetched_ = std::move(f); }
    // The GPU's pending register (GpuDevice::pending: work queued or fetched
    // and not completed).
    using Pending = std::function<bool(ChannelId)>;
    void set_pending(Pending p) { pending_ = std::move(p); }
    // The channel on the engine as last seen (no read).
    std::optional<ChannelId> running() const {
        if (traced()) trace_sync_();  // the records up to now
        return current_;
    }
    // Mean length of `ch`'s kernels seen whole; 0 if none yet.
    Duration kernel_estimate(ChannelId ch) const;
    // Mean deviation of those lengths from the estimate (TCP's RTTVAR to
    // its SRTT): how far one kernel may run past the mean.  0 if none yet.
    Duration kernel_spread(ChannelId ch) const;
    // The host preempted the engine now (GpuDevice::preempt_to): `next`
    // runs after the engine's preemption dead time, which nobody is charged.
    void preempted(ChannelId next);

    // GPU time of a leaf since it appeared, the running stint up to now included.
    Duration gpu_time(EntityId leaf) const;
    // Completion interrupts seen for a leaf's channels (one per flagged kernel).
    std::uint64_t kernels(EntityId leaf) const;
    // Engine-status reads the accounting made itself.
    std::uint64_t reads() const { return reads_; }

private:
    // The trace-less accounting in detail (a GPU with a context-switch trace
    // needs none of it): from completion interrupts and the engine status
    // register naming the channel on the engine; where it says "completion
    // timestamp" it means when the trace-less host last knew the channel to
    // leave the engine (none).
    //
    // On a non-preemptive GPU a completion plus one engine-status read at that
    // moment says who runs next and since when, so no periodic poll is needed.
    // Only a start on an idle engine is unseen (a direct doorbell, or held work
    // a policy released): after the engine is seen idle it is read a few more
    // times at growing intervals (0 .. 1 ms, six reads at most, stopping at
    // the first start seen), which catches a client that resubmits on its
    // completion.  A start later than that is charged the kernel length learned
    // from kernels seen whole, bounded by the time since the engine was seen
    // idle.  A start the host causes itself (it released held work or forwarded
    // a trapped doorbell) is read at once, so it is exact: where no read would
    // date a start, the accounting asks the host to trap the doorbell that
    // causes it (set_trap_listener).  On a preemptive GPU
    // the host knows the time slice it programmed, so the engine status is read
    // once per slice end while busy.  Engine-status reads a policy makes anyway
    // are free observations.  A host that handles interrupts late (a stalled
    // loop) reads the engine as it is now, after other channels may have run:
    // the GPU's completion timestamps order what ran meanwhile, and GET counts
    // the kernels of a channel that interrupts on every one.  Channels that ask
    // for one interrupt per batch take turns on the engine unseen: GET counts
    // each one's kernels between looks, and the timestamps of the last turns
    // teach their lengths.  A listener
    // hears every charge and every change of the channel seen on the engine:
    // policies charge their virtual time from here instead of polling the
    // engine themselves.
    struct Channel {
        EntityId leaf = kNoEntity;
        KernelModel kernel{};          // its kernels' length and think time, as learned
        Time kernel_start = -1;        // exact start of its current kernel, if seen
        std::uint32_t start_get = 0;   // GET then (that kernel's entry fetched)
        std::uint32_t fence_get = 0;   // GET at its last completion interrupt
        bool fence_get_known = false;
        std::uint32_t fence_done = 0;  // kernels it had completed then (with fence_get_known)
        Time fence_ts = -1;            // the GPU's completion timestamp then (-1: none, or not believed)
        // Trace mode: GPU time of its closed stints, and the kernels (GET)
        // and that time when its length was last learned.
        Duration closed = 0;
        std::uint32_t learned_get = 0;
        Duration learned_closed = 0;
        bool every_kernel = false;     // its interrupts in time came one per kernel
        bool several_before = false;   // its last interrupt in time came after several kernels
        bool batches = false;          // ... and so did the one before it
        // Two of its interrupts in time in a row came after exactly one
        // kernel each.  Until then it may be asking for one per batch: the
        // host cannot tell a new channel's first kernels, which may
        // interrupt only at the batch's end, from ones that interrupt each.
        // A channel that never interrupts in time stays unsure for good.
        bool one_per_kernel_seen = false;
        bool counted_batching = false;  // in batching_
        bool fresh = false;            // its stint on the engine began a new kernel
        bool preempted = false;        // its kernel was taken off the engine unfinished
        // No kernel of it starts before this: a doorbell the host forwarded
        // found every entry the GPU had of it charged, and the GPU's pending
        // register said none was left.
        Time no_work_before = 0;
        // Its kernels up to this completion timestamp were charged by a look
        // at an idle engine (ran_between_looks): replays leave them out.
        Time look_charged = -1;
        // Its running time up to here is charged (a completion, a stint
        // closed): audit looks before it are not this channel's to count.
        Time charged_through = -1;
        bool fenced = false;  // it completed a kernel (an interrupt came)
        bool ran = false;     // it completed a kernel, or was seen on the engine
        // Probe looks spent while its length was unknown, less one given
        // back every kProbeRefill interrupts in time (refill counts them).
        int probes = 0;
        int refill = 0;
        // Its kernel before the last one completed then (-1: not known):
        // the time between its completions bounds where the next runs.
        Time prev_fence_ts = -1;
        std::int32_t fence_kernels = 1;  // kernels between those two completions (by GET)
        bool started_unseen = false;  // its last kernel started on an idle engine no look saw
        bool ever_unseen = false;     // ... or any kernel of it did, or one after an unheard end (audit looks)
        // Its doorbells are trapped for its own sake (wants_trap), and how
        // many of its bursts in a row began with the engine busy since.
        bool trapped = false;
        int unneeded_traps = 0;
        bool idle_trapped = false;  // trapped by the idle trap, until its own doorbell
        // A stint of it ended at a completion whose interrupt, if it asked
        // for one, was due long before another channel's came: while it is
        // believed on the engine, what starts after it starts unseen, and a
        // spell stays open (busy_spell).  For good: a tenant could ask for
        // interrupts again for a while to shed it.
        bool ends_unheard = false;
        Time check_at = -1;           // a check look is due then (-1: none)
        // Mean of its kernels' audited charges (each right on average):
        // the guess an audit then corrects least, over up to kAuditMean
        // kernels.
        Duration audit_mean = 0;
        int audit_kernels = 0;
        int checks = 0;               // check looks in this idle spell
        // While preempted: what that kernel's stints were charged, and how
        // far off their starts may have been (the sum of their slacks).
        Duration kernel_charged = 0;
        Duration kernel_slack = 0;
        // Kernels it completed (by GET) whose time is charged: a replay
        // counts its kernels from here.
        std::uint32_t charged_done = 0;
        bool charged_known = false;
        void charged_to(std::uint32_t done) {
            charged_done = done;
            charged_known = true;
        }
        // Known to have exactly `n` of `completed` kernels not charged yet.
        bool uncharged(std::uint32_t completed, std::uint32_t n) const {
            return charged_known && completed - charged_done == n;
        }
        // Of `completed` kernels, those whose time is not charged yet (1
        // when that is not known).
        std::int32_t kernels_since_charged(std::uint32_t completed) const {
            return charged_known ? std::max<std::int32_t>(1, static_cast<std::int32_t>(completed - charged_done)) : 1;
        }
    };
    struct Totals {
        Duration gpu_time = 0;
        std::uint64_t kernels = 0;
        // What audit corrections took back beyond what was charged since
        // (<= 0): later charges of any of its channels pay it first (kept
        // per channel, a short-lived channel's debt was lost when it
        // closed).
        Duration audit_debt = 0;
    };

    std::optional<ChannelId> read();
    // A GPU id the accounting was not told of (or let go of) reads as idle.
    std::optional<ChannelId> known(std::optional<ChannelId> running) const;
    // channel_removed: what the channel ran up to now is charged; then it
    // is forgotten (also if that failed).
    void settle_removed(ChannelId ch);
    void forget(ChannelId ch);
    void charge(ChannelId ch, Duration d);
    // `running` is on the engine from some moment in [lo, hi].
    void now_running(std::optional<ChannelId> running, Time lo, Time hi);
    // now_running's steps: `running` (not idle) dated at `at` (seen in
    // [lo, hi]): its context's slice and its kernel's start; then what
    // changes when the engine went idle or busy, and the listener's event.
    void start_stint(std::optional<ChannelId> running, Time at, Time lo, Time hi);
    void engine_changed(std::optional<ChannelId> running, std::optional<ChannelId> before);
    // observed's last step: the engine switched somewhere in (last_seen_, t]
    // with no completion of the channel believed on it to date it.
    void switched_unseen(std::optional<ChannelId> running, Time t);
    void arm_read();
    // A look at `t` at an engine believed idle since last_seen_: channels whose
    // completion timestamp lies in between and whose GET counts kernels not
    // charged ran them unseen (started after the settle reads stopped, asked
    // for no interrupt, ended before this look).  Each is charged its usual
    // length per kernel (half the room while that is unknown), all of them
    // together at most the time from the previous look to each one's
    // completion, and they are counted as charged: the kernel's own late
    // interrupt finds them so, and replays leave out completions up to
    // look_charged.  On a non-preemptive engine the look dates what runs now
    // after the last of them.  On a preemptive engine only channels with
    // nothing pending count, one read of that register each (GET counts a
    // kernel taken off unfinished as fetched), and the one on the engine less
    // its running kernel.  Only while some channel may batch; one GET read per
    // channel whose timestamp moved.
    void ran_between_looks(std::optional<ChannelId> running, Time t);
    // On a non-preemptive engine the channel believed on it ran until its
    // last completion since its stint began, at or before t, even if it was
    // seen on the engine after that: had it run another kernel, that
    // timestamp would have moved (the sighting was late or stale).  nullopt
    // when none is known.
    std::optional<Time> stint_end(Time t) const;
    // On a non-preemptive engine, a completion interrupt of `fenced` (or a
    // look at the engine) after a third channel completed kernels since the
    // believed stint began: the engine took turns unseen, between
    // interrupts asked for once per batch, or while the host stalled.  The
    // engine ran from the stint's start to the last completion timestamp;
    // replay_counted and replay_shares split that (returns the last
    // timestamp: the caller places the next start there).  nullopt (nothing
    // charged) when no third channel completed meanwhile.
    // A third channel's completion counts before `late_before` only; the
    // caller replays only while some channel batches (or may), or when late.
    std::optional<Time> replay(std::optional<ChannelId> fenced, std::optional<ChannelId> running, Time now,
                               Time late_before);
    // batching_ counts `c` while it batches or is not yet seen not to.
    void count_batching(Channel& c);
    // `c` leaves batching_ and preempted_ (it is removed, or its id reused).
    void uncount(ChannelId id, Channel& c);
    void set_preempted(ChannelId id, Channel& c, bool preempted);
    // After `fenced`'s completion at `from`, handled late (at `now`) on a
    // preemptive engine: preempted channels that resumed and completed
    // unseen meanwhile are charged their kernels' rest.  Returns the last
    // such completion (`from` if none): the engine moved on from there.
    Time resumed_unseen(ChannelId fenced, Time from, Time now, std::optional<ChannelId> running);
    // A look at the engine (a read, or the host releasing work) that may
    // follow such turns: replay() without a fenced channel.
    std::optional<Time> replay_look(std::optional<ChannelId> running, Time t);
    // A channel's part in a replay.
    struct Completed {
        Time ts;             // its last completion timestamp
        ChannelId id;
        std::uint32_t get;   // its GET now (0 where the GPU gives none)
    };
    // The replay when some channel in it interrupts on every kernel: GET
    // counts its kernels exactly.  false (nothing charged) when none does.
    bool replay_counted(const std::vector<Completed>& done, std::optional<ChannelId> running);
    // `ch`'s stint was charged up to its last completion: its kernels so far
    // are charged (one GET read).
    void settle_count(ChannelId ch, std::optional<ChannelId> running);
    // `c`'s stint of `d` (by the middle of the window its start was seen
    // in) held one kernel of its own, started fresh: one of its usual
    // length, if that fits the window, is the better guess.
    Duration one_kernel_guess(const Channel& c, Duration d) const;
    // `ch`'s stint ended at `end` (a completion timestamp): charged, with
    // the guess above when GET says it held one kernel, and its kernels
    // counted as charged (settle_count's one GET read).
    void charge_stint(ChannelId ch, Time end, std::optional<ChannelId> running);
    // `ch` ran out of work at `done` (a completion timestamp), seen by a
    // look at `t`: its stint is charged as above, and the preempted kernels
    // (a preemptive engine's; none elsewhere) that resumed there and
    // completed by `t` are charged their rest (resumed_unseen).  Returns
    // when the engine moved on.
    Time charge_ran_out(ChannelId ch, Time done, Time t, std::optional<ChannelId> running);
    // `c` was seen from its stint's first kernel's start to `end` (the last
    // one's completion; `completed` kernels by GET then): learn their length.
    void learn_stint(Channel& c, Time end, std::uint32_t completed);
    // Kernels `d`'s channel completed in the replayed window, by GET since
    // its time was last charged (1 when that is not known).
    std::int32_t kernels_in(const Completed& d, std::optional<ChannelId> running) const;
    // The replay from what GET counts: the window, from the believed stint's
    // start to the last completion, split in proportion to each channel's
    // kernels times its usual length.  false (nothing charged) while a
    // channel's length is not known yet.
    bool replay_shares(const std::vector<Completed>& done, std::optional<ChannelId> running);
    // Learns kernel lengths from a replay's completion timestamps: a
    // channel that completed one kernel, after which nobody but channels
    // that also completed one did, ran that kernel from the previous
    // completion to its own.  Not from the gap that ends at `fenced`'s
    // interrupt: the tenant chose where to ask for it.
    void learn_gaps(const std::vector<Completed>& done, std::optional<ChannelId> running,
                    std::optional<ChannelId> fenced);
    // The kernels GET counts since `c`'s last interrupt, of its usual
    // length, with a quarter's margin; 0 when not known.
    Duration fetched_cap(const Channel& c, std::uint32_t get) const;
    // When a completion interrupt's kernel ended, as far as the host can
    // tell at `now`; `clamped`: the GPU's timestamp lay before what was
    // believed (learn nothing from it).
    struct FenceTime {
        Time t;
        bool clamped;
    };
    FenceTime fence_time(ChannelId ch, Time now) const;
    // An interrupt handled in time, `completed` kernels done by GET: whether
    // `c` interrupts on every kernel or batches, and its probe budget.
    void learn_interrupts(Channel& c, std::uint32_t completed);
    // What a fence leaves for the next: its GET and timestamp, a check
    // look, the audit spell that starts here and the idle trap.
    void note_fence(ChannelId ch, Channel& c, Time t, bool clamped, bool late, std::uint32_t get,
                    std::uint32_t completed, Time now);
    // A completion handled in time: `ch`'s kernel ended at t, and GET
    // counts `completed` kernels done (meaningful only with fetched_).
    void charge_fence(ChannelId ch, Channel& c, Time t, bool clamped, std::optional<ChannelId> running,
                      std::uint32_t completed);
    // charge_fence of the channel believed on the engine (its stint since
    // since_, one kernel begun in a window bounded and guessed as such).
    void charge_seen_fence(ChannelId ch, Channel& c, Time t, bool clamped, std::uint32_t completed);
    // charge_fence of a kernel that started unseen after the last
    // observation; the channel believed on the engine is charged up to it.
    void charge_unseen_fence(ChannelId ch, Channel& c, Time t, bool clamped, std::optional<ChannelId> running,
                             std::uint32_t completed, Time now);
    // Where the channel believed on the engine ran out before a completion
    // at t (stint_end, or GET on a preemptive engine); nullopt if unknown.
    std::optional<Time> current_ran_out(Time t) const;
    // A kernel begun unseen that completed at t: it started in [from, t]
    // (gap wide), `n` kernels of it uncharged, `ended` as current_ran_out.
    struct UnseenKernel {
        Time t;
        Time from;
        Duration gap;
        std::int32_t n;
        std::uint32_t completed;
        bool clamped;
        bool one_since_fence;  // one kernel since its previous interrupt, whose GET that read saw
        std::optional<Time> ended;
    };
    // What such a kernel teaches: its think time and bounds, a stale
    // length, its trap, and whether the channel before it ends unheard.
    void learn_unseen(ChannelId ch, Channel& c, const UnseenKernel& k);
    // Its charge (audited where the looks cover it), and the charge of the
    // channel believed on the engine up to where it began.
    void charge_unseen(ChannelId ch, Channel& c, const UnseenKernel& k, std::optional<ChannelId> running);
    void slice_read();
    // Off a preemptive engine, `ch` (believed on it) ran out of work at its
    // completion timestamp `done`: GET says the one kernel it fetched since
    // it was last charged is the one that completed, or the GPU's pending
    // register says it has no work left.  With more fetched and work left
    // it would have run on to a slice end (or been preempted there: GET and
    // the timestamp cannot tell which, and a tenant's kernel lengths must
    // not).  True also for a kernel that ended exactly with its slice: it
    // was not preempted.  Reads GET (and the pending register).
    bool ran_out_at(ChannelId ch, Time done) const;
    void busy_read();
    void settle_read();
    // The reads after the engine went idle are spent: a start now is seen
    // by no read.
    bool settle_reads_done() const;
    // `audited_stint`: the stint just charged was corrected by the audit
    // looks, so its start's slack is not the kernel's to put right again.
    void mark_preempted(ChannelId ch, bool audited_stint);

    const Clock& clock_;
    StatusRead read_;
    EngineArbitration engine_;
    Timer read_timer_;  // slice-end or watch reads while busy, settle reads while idle
    std::unordered_map<ChannelId, Channel> channels_;
    std::unordered_map<EntityId, Totals> totals_;
    std::optional<ChannelId> current_;  // on the engine as last seen
    std::optional<ChannelId> loaded_;   // last context on the engine (preemptive: keeps its slice)
    Time since_ = 0;                    // current_ is charged from here
    // Channels whose kernel was taken off the engine unfinished (few: a
    // late interrupt looks at these, not at every channel).
    std::vector<ChannelId> preempted_;
    // Channels seen to batch (two interrupts in time in a row after several
    // kernels each; for good), or not yet seen not to (one_per_kernel_seen):
    // while any, interrupts and looks replay the completions they may have
    // made unheard (each reads every channel's completion timestamp).
    std::size_t batching_ = 0;
    Time stint_start_ = 0;              // current_ came on the engine then (since_ less what a watch read charged)
    Duration start_slack_ = 0;          // since_ is its start +- this
    // The stint's start was known within this when it was seen (a busy
    // read zeroes start_slack_, having charged the guess so far, which the
    // audit looks still correct at its fence).
    Duration audit_slack_ = 0;
    // The stint now_running began was dated at `ended`, the end of the one
    // before, on the assumption that the engine did not idle until `seen`.
    void assumed_start(Time ended, Time seen);
    // Charges the channel believed on the engine from since_ to `end`,
    // audited (since_ may be a guess) with the looks up to `through` (if
    // later: where what follows it was guessed to begin is a guess too);
    // true if the looks corrected it.
    bool charge_guess(ChannelId ch, Time end, Time through = -1);
    Time seen_lo_ = 0, seen_hi_ = 0;    // current_'s kernel started in [seen_lo_, seen_hi_] (as looks proved)
    Duration stint_charged_ = 0;        // charged to current_ since it was last seen to start
    Time last_seen_ = 0;                // last observation of the engine
    Time idle_seen_ = 0;                // idle: the first look that saw it so
    // The earliest a kernel completed at `done` can have started, the host
    // not having seen it on the engine (idle, or current_ believed there).
    Time unseen_start(Time done) const;
    Time slice_end_ = 0;                // preemptive: when current_'s slice ends
    Duration slice_slack_ = 0;          // ... within this (its slice began at a start so dated)
    std::size_t settle_step_ = 0;       // settle reads made since the engine went idle
    std::optional<ChannelId> kicked_;   // a doorbell the host forwarded, read after it
    Time kicked_at_ = -1;
    // A doorbell forwarded while current_ is believed on the engine, though
    // the GPU's timestamp says its kernel ended (its interrupt is on its
    // way): the channel's GET before the forward, and a read right after it.
    std::uint32_t kicked_get_ = 0;
    Timer kick_timer_;
    void kick_read();
    // A channel whose length is unknown and whose kernels start on an idle
    // engine after the settle reads stopped is never seen whole.  If it
    // restarts a steady time after its own completion, one look placed in
    // the middle of where its last start was seen halves that window each
    // time; once the window is within kProbeNarrow, two looks just outside
    // its ends see the start (dated at their middle) and the length is
    // learned.  At most two looks per such channel and idle spell, windows
    // up to kProbeWindow, at most kMaxProbes looks per channel: none on an
    // idle GPU once they are spent.  Only for a channel whose interrupts
    // come one per kernel: a stint seen whole teaches no length otherwise.
    Timer probe_timer_;
    void arm_probe();
    void probe_read();
    // `c` gets probe looks (and its starts are dated by its think window):
    // its length unknown, its interrupts seen to come one per kernel, a
    // think window open, looks left.
    static bool probed(const Channel& c);
    // A channel whose length is known and whose kernels start unseen on an
    // idle engine is charged that length per kernel: a tenant whose kernels
    // grow (or one that showed short kernels first) would be charged the
    // old length for good.  After each such kernel, one look at a random
    // moment between the end of the settle reads and where its next
    // completion would come at its last pace (check_at); a look that sees
    // it on the engine proves its kernel at least as long as from that look
    // to its completion, and a proof beyond the length learned (plus four
    // spreads, at most a quarter) forgets the length: the probe looks (a
    // fresh budget) and the bounds learn it again.  A look that sees the
    // engine idle bounds the next kernel from above, which catches kernels
    // that shrank, and looks again within the channel's pace from there
    // (kChecks looks per idle spell and channel at most).  The tenant
    // cannot see when the host reads the engine, nor predict the draw.  A
    // kernel up to a quarter longer than learned is not proof: a tenant may
    // hide that much, and more by alternating kernels the accounting sees
    // whole with long ones it does not.
    static bool checked(const Channel& c);
    void arm_check(Channel& c, Time done);
    // `c`'s learned length is proven wrong: learn it again (its model, and
    // a fresh budget of probe looks).
    static void relearn(Channel& c);
    std::minstd_rand check_rng_{0x5eed};
    // Audit looks.  Every deterministic guess above (a learned length, half
    // a window) is one a tenant can steer: it chooses which kernels the
    // looks see whole, and how its lengths and think times vary.  An unseen
    // start is therefore also corrected by looks at random moments whose
    // odds the host fixed in advance (AuditSampler: once the settle reads
    // saw the engine idle at A, the time after A is cut into strata, one
    // look at a uniform moment in each; widths: a channel's pace, then
    // doubling until the next completion; on an idle engine none wider than
    // kAuditIdleWidth until every doorbell is trapped).  The looks' results
    // feed nothing else (a guess that used them would be biased by them).  Sampling goes
    // on after a look sees a channel: stopping there (that channel runs to
    // its completion) was cheaper, but a sighting of another channel, or of
    // an earlier kernel of the same one, then left a kernel uncorrected or
    // double-charged.  A spell opens where
    // the engine is seen idle, and at a completion that leaves a channel
    // known to end unheard on the engine (what starts after it starts
    // unseen), or while some channel batches (replays guess).  What no
    // spell covers keeps its guess: a replay where no channel interrupts on
    // every kernel (replay_shares: audited the same way, its looks' noise
    // is too large, strata being a quarter of a batching channel's interval
    // between interrupts wide: a 1 ms leaf of a case within 0.23% had a
    // standard deviation of 5.3%; the target accounting-review).  Past
    // 50 ms of idle time the idle trap dates the next
    // start exactly (set_trap_listener): none comes past the last stratum
    // unseen.
    // Its pace sets the strata's width: it started unseen once (or, once
    // the settle reads are spent on an idle engine, any start of it would
    // be unseen), and its last two completions are known.
    static bool sets_audit_pace(const Channel& c, bool settled);
    // The guess for one kernel of `c` begun unseen, completed at t, is its
    // audited mean rather than its learned length (`corrected`: the looks
    // will correct that guess).
    bool audit_mean_guessed(const Channel& c, Time t, bool corrected) const;
    // opener: whose completion began the spell (none: a look saw the
    // engine idle).  settled: the settle reads saw the engine idle to the
    // last, so every paced channel sets the pace.
    void open_audit(Time from, std::optional<ChannelId> opener, bool settled = false);
    // A spell is needed while the engine is busy (non-preemptive engines):
    // the channel believed on it ends stints unheard, or some channel
    // batches and replays guess who ran, once such a channel has run (an
    // open channel never used costs nothing).  Honest host clients and
    // guests interrupt on every kernel: for them only while a channel is
    // new.
    bool busy_spell() const;
    void audit_read(Duration weight);  // a look for a stratum this wide (AuditSampler's)
    // An idle look at t that ends the spell (no later look could correct
    // anything).
    bool spell_done(Time t) const;
    Time traps_set_at_ = 0;  // the last time a channel's doorbell was trapped
    Duration trap_lands_ = 0;  // a trap asked for has landed by this long after (set_remap_delay)
    // The correction for `ch`'s kernel that completed at t, charged `mine`;
    // nullopt where the looks do not cover it.
    // all_within: every kernel charged ran after the spell's start.
    std::optional<Duration> audit_correction(ChannelId ch, const Channel& c, Time t, Duration mine,
                                             bool all_within, Time through) const;
    // The open spell's strata reach a completion at t, and audited() would
    // correct a charge of `c` up to t (a preempted kernel's rest is not:
    // charged as guessed).
    bool audit_applies(const Channel& c, Time t) const;
    // Preemptive engine: `x`, not believed on the engine, is seen there at
    // a completion at t; it ran before it as far as the looks saw (charged
    // that, up to t).
    void charge_sighted(ChannelId x, Time t);
    // `owed` to `c`, its tenant's audit debt paid first (Totals::audit_debt).
    Duration after_debt(const Channel& c, Duration owed);
    // `mine`, charged `c` as [t - mine, t] for its kernels completed by t
    // (`one`: a single one), corrected (its debt paid first).
    // `corrected`, if given: whether the looks covered it.  `through`
    // (if later than t): the looks up to there are this channel's too, its
    // guess ending at t (a stint cut where another channel's guess began).
    Duration audited(ChannelId ch, Channel& c, Time t, Duration mine, bool one, bool* corrected = nullptr,
                     Time through = -1);
    AuditSampler audit_;
    // The engine has been idle since this channel's completion (nothing
    // seen on it, nothing else completed since): a spell opened later in
    // that idle time began at its completion too.
    std::optional<ChannelId> idle_after_fence_;
    // current_ completed a kernel at this timestamp, after it was believed
    // on the engine (on either engine; stint_end() only where a completion
    // ends the stint), and no other channel completed one since.
    std::optional<Time> ended_unheard(Time t) const;
    // current_ ran until `ended`, the engine idled, and `running` started at
    // `start` (the host's own doorbell); the engine was read at `seen`.
    void started_after_idle(Time ended, std::optional<ChannelId> running, Time start, Time seen);

    // Events reach the listener only once the entry point that made them is
    // done, so a listener may call back into the accounting (a policy that
    // unshadows releases work: host_kicked) and always sees it consistent.
    class Entry {
    public:
        explicit Entry(Accounting& a) : a_(a), unwinding_(std::uncaught_exceptions()) { ++a_.depth_; }
        // A listener's failure reaches the accounting's caller (not
        // std::terminate), unless another is already on its way.
        ~Entry() noexcept(false);
        Entry(const Entry&) = delete;
        Entry& operator=(const Entry&) = delete;
    private:
        Accounting& a_;
        int unwinding_;
    };
    Listener listener_;
    // The idle trap (set_trap_listener): armed while the engine is believed
    // idle; once it fires every channel is trapped, each until its own
    // doorbell (idle_trap_: channels opened meanwhile too, until a doorbell
    // or a sighting of a busy engine).
    Timer idle_trap_timer_;
    bool idle_trap_ = false;
    void idle_trap_fired();
    // `c`'s own trap (Channel::trapped).
    void trap_channel(ChannelId id, Channel& c, bool on);
    // Sets both of `c`'s traps; the listener hears when their union changed.
    void set_traps(ChannelId id, Channel& c, bool idle, bool own);
    void arm_idle_trap(Time idle_since);
    TrapListener trap_listener_;
    std::vector<std::pair<ChannelId, bool>> trap_changes_;
    LeftEngine left_engine_;
    // Trace mode (set_trace): accounting_trace.cpp.
    TraceSync trace_sync_;
    Timer trace_timer_;
    std::vector<ChannelId> trace_left_;  // left the engine in the records just read
    std::uint64_t trace_lost_ = 0;
    void traced_sync();
    void traced_learn(ChannelId ch);
    void arm_trace_timer();
    Fetched fetched_;
    Pending pending_;
    std::vector<Event> events_;
    int depth_ = 0;
    bool delivering_ = false;
    std::uint64_t reads_ = 0;
};

}  // namespace pvgpu
