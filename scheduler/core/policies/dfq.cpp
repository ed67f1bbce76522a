// `dfq`: NEON's disengaged fair queuing (Menychtas et al., ASPLOS'14) as
// Fleig's thesis applies it to VMs, with hierarchical weights.
//
// The policy runs a cycle and stays out of the guests' way most of the time:
//   1. draining: every channel is shadowed and the policy waits until the GPU
//      has no pending work from anyone (checked on fence interrupts and by a
//      short poll), so what follows has the GPU to itself;
//   2. sampling: each backlogged leaf in turn gets the GPU exclusively for
//      `sample` with its channels trapped (everyone else shadowed), followed
//      by another drain.  Its GPU busy time is measured from doorbell traps
//      (idle -> busy) and fence interrupts (busy -> idle); the ring entries it
//      completed are read from IB_GET.  busy / entries is its mean request run
//      time; the busy time is charged: vtime += busy / share.
//      A sampled leaf that runs out of work ends its sample early.
//   3. freerun for `freerun`: leaves whose vtime is more than `threshold`
//      ahead of the least-served backlogged leaf are shadowed (denied), the
//      rest run direct with no traps at all.  Should the allowed leaves leave
//      the GPU idle, the denied ones are let in for the rest of the freerun
//      (and pay for it below).  The drain that starts the next cycle lets the
//      last kernels finish; then each leaf's usage is estimated as entries
//      completed (IB_GET progress, which includes work it queued while
//      shadowed and that was released at unshadow) times its sampled mean
//      request time, and vtime += usage / share.
// Entries are counted from IB_GET rather than from fence values: after a
// drain IB_GET equals the completions exactly, it is a register the guest
// cannot fake, and it counts work submitted without completion interrupts.
// share is the leaf's hierarchical share among backlogged leaves (formula 3.1
// generalised).  Draining idles the GPU and sampling serialises everybody:
// that overhead is the honest price of this design and is kept.
//
// A leaf that becomes backlogged (new, or back from idle) starts at the
// minimum vtime of the backlogged leaves, so idleness banks no credit.  With
// nothing backlogged the policy goes idle: every channel direct, no timer;
// the next fence interrupt starts a new cycle.
#include <algorithm>
#include <cmath>
#include <limits>
#include <map>
#include <optional>
#include <stdexcept>
#include <vector>

#include "policies.hpp"

namespace pvgpu {

namespace {

struct Params {
    Duration sample;
    bool weighted_sample;
    Duration freerun;
    double threshold;  // ns of virtual time
    Duration idle_grace;
    Duration settle;
    Duration drain_poll;
};

struct LeafState {
    double vtime = 0;                // share-normalised GPU time, ns
    Duration mean_request = 0;       // run time of one ring entry, last sample; 0 = never sampled
    Duration accounted = 0;          // GPU time charged (sampled + estimated)
    bool active = false;             // backlogged at the last look
    Time last_completion = -1;       // last fence interrupt from one of its channels
    std::uint32_t closed_entries = 0;  // entries of channels closed while a window was open
};

struct ChannelState {
    EntityId leaf = kNoEntity;
    std::uint32_t get_base = 0;  // IB_GET when the current measurement window opened
};

enum class Phase { Idle, Drain, Sample, Freerun };

class DfqPolicy final : public Policy {
public:
    explicit DfqPolicy(Params p) : p_(p) {}

    std::string_view name() const override { return "dfq"; }

    void start(PolicyContext& ctx) override {
        ctx_ = &ctx;
        phase_timer_.bind(ctx.timers());
        poll_timer_.bind(ctx.timers());
        running_ = true;
        phase_ = Phase::Idle;
    }

    void stop() override {
        if (!running_) return;
        phase_timer_.cancel();
        poll_timer_.cancel();
        for (const auto& [ch, st] : channels_) set(ch, ChannelMode::Direct);
        phase_ = Phase::Idle;
        sampled_ = kNoEntity;
        freerun_open_ = false;
        planned_ = false;
        to_sample_.clear();
        running_ = false;
    }

    void channel_added(ChannelId ch, EntityId leaf) override {
        if (!running_) return;
        leaf_state(leaf);
        channels_[ch] = ChannelState{leaf, ctx_->gpu().read_ib_get(ch)};
        set(ch, mode_for(leaf));
    }

    void channel_removed(ChannelId ch, EntityId leaf) override {
        if (!running_) return;
        auto it = channels_.find(ch);
        if (it == channels_.end()) return;
        // Keep what it completed in the open window.
        leaf_state(leaf).closed_entries += ctx_->gpu().read_ib_get(ch) - it->second.get_base;
        channels_.erase(it);
        if (phase_ == Phase::Sample && leaf == sampled_ && !leaf_has_channels(leaf)) start_drain();
    }

    void tree_changed(EntityTree::Change change, EntityId id) override {
        if (!running_) return;
        // Ids are reused, so both cases start clean; a newcomer starts at the
        // system virtual time (no banked credit).  Weight changes need
        // nothing: shares are computed afresh when charging.
        if (change == EntityTree::Change::Added) {
            leaf_state(id) = LeafState{};
            leaf_state(id).vtime = system_vtime_;
        } else if (change == EntityTree::Change::Removed) {
            leaf_state(id) = LeafState{};
        }
    }

    void doorbell_trapped(ChannelId ch, std::uint32_t put) override {
        if (!running_) return;
        auto it = channels_.find(ch);
        if (it == channels_.end() || it->second.leaf != sampled_) return;
        ++trapped_doorbells_;
        // The trap comes before the write reaches the GPU: new work starts now.
        if (put != ctx_->gpu_put(ch) && !busy_since_) busy_since_ = ctx_->now();
    }

    void fence(ChannelId ch, std::uint32_t) override {
        if (!running_) return;
        auto it = channels_.find(ch);
        if (it == channels_.end()) return;
        ++fences_;
        EntityId leaf = it->second.leaf;
        leaf_state(leaf).last_completion = ctx_->now();
        if (phase_ == Phase::Idle) {
            begin_cycle();
            return;
        }
        if (leaf == sampled_) {
            ++sample_completions_;
            if (busy_since_ && !leaf_pending(sampled_)) {
                sample_busy_ += ctx_->now() - *busy_since_;
                busy_since_.reset();
            }
            // A sampled leaf that runs out of work gives the GPU back early.
            if (phase_ == Phase::Sample && !leaf_pending(sampled_) && !poll_timer_.armed())
                poll_timer_.arm(ctx_->now() + p_.idle_grace, [this] { sample_idle_check(); });
        }
        if (phase_ == Phase::Freerun && allowed(leaf) && !poll_timer_.armed() && !allowed_work())
            poll_timer_.arm(ctx_->now() + p_.idle_grace, [this] { freerun_idle_check(); });
        if (phase_ == Phase::Drain) {
            // Its guest learns of the completion after us and has had no
            // chance to submit more: if this ends the drain, count it as
            // backlogged rather than idle.
            drain_completer_ = leaf;
            check_drain();
            drain_completer_ = kNoEntity;
        }
    }

    void channel_error(ChannelId, std::uint32_t) override {
        if (!running_) return;
        ++channel_errors_;
        if (phase_ == Phase::Drain) check_drain();  // its pending work is gone
    }

    void released(ChannelId ch, std::uint32_t entries) override {
        if (!running_) return;
        released_entries_ += entries;
        auto it = channels_.find(ch);
        if (it == channels_.end()) return;
        if (it->second.leaf == sampled_ && !busy_since_ && ctx_->gpu().pending(ch)) busy_since_ = ctx_->now();
    }

    std::optional<Duration> accounted(EntityId leaf) const override { return accounted_in(leaves_, leaf); }

    std::map<std::string, double> counters() const override {
        return {
            {"cycles", static_cast<double>(cycles_)},
            {"drains", static_cast<double>(drains_)},
            {"samples", static_cast<double>(samples_)},
            {"short_samples", static_cast<double>(short_samples_)},
            {"freeruns", static_cast<double>(freeruns_)},
            {"denials", static_cast<double>(denials_)},
            {"conserving_releases", static_cast<double>(conserving_releases_)},
            {"idles", static_cast<double>(idles_)},
            {"trapped_doorbells", static_cast<double>(trapped_doorbells_)},
            {"sample_completions", static_cast<double>(sample_completions_)},
            {"fences", static_cast<double>(fences_)},
            {"channel_errors", static_cast<double>(channel_errors_)},
            {"released_entries", static_cast<double>(released_entries_)},
            {"shadow_events", static_cast<double>(shadow_events_)},
            {"drain_ms", to_ms(drain_time_)},
            {"sampled_ms", to_ms(sampled_time_)},
            {"estimated_ms", to_ms(estimated_time_)},
        };
    }

private:
    LeafState& leaf_state(EntityId leaf) { return leaf_state_in(leaves_, leaf); }
    void set(ChannelId ch, ChannelMode mode) { set_mode_counted(*ctx_, ch, mode, shadow_events_); }

    // Mode of a channel joining mid-phase.
    ChannelMode mode_for(EntityId leaf) const {
        switch (phase_) {
        case Phase::Idle: return ChannelMode::Direct;
        case Phase::Drain: return ChannelMode::Shadowed;
        case Phase::Sample: return leaf == sampled_ ? ChannelMode::Trapped : ChannelMode::Shadowed;
        case Phase::Freerun: return allowed(leaf) ? ChannelMode::Direct : ChannelMode::Shadowed;
        }
        return ChannelMode::Shadowed;
    }

    // Leaves may join mid-freerun; they were not allowed when it started.
    bool allowed(EntityId leaf) const { return leaf < allowed_.size() && allowed_[leaf]; }

    bool leaf_has_channels(EntityId leaf) const {
        for (const auto& [ch, st] : channels_)
            if (st.leaf == leaf) return true;
        return false;
    }

    bool leaf_pending(EntityId leaf) const {
        for (const auto& [ch, st] : channels_)
            if (st.leaf == leaf && ctx_->gpu().pending(ch)) return true;
        return false;
    }

    bool has_work(ChannelId ch) const { return has_work_unless_killed(*ctx_, ch); }

    bool leaf_has_work(EntityId leaf) const {
        for (const auto& [ch, st] : channels_)
            if (st.leaf == leaf && has_work(ch)) return true;
        return false;
    }

    // A leaf whose completion is being handled, or that completed work less
    // than `settle` ago, is most likely between two submissions (its guest
    // sees completions after us and needs a moment to react): it counts as
    // backlogged.  A longer pause means it has nothing to do right now.
    bool between_submissions(EntityId leaf) const {
        if (leaf == drain_completer_) return true;
        Time last = leaf < leaves_.size() ? leaves_[leaf].last_completion : -1;
        return last >= 0 && ctx_->now() - last < p_.settle;
    }

    // Leaves with work on the GPU or held in a shadow page, or between two
    // submissions; ascending ids.
    std::vector<EntityId> backlogged() const {
        std::vector<EntityId> out;
        for (const auto& [ch, st] : channels_)
            if (has_work(ch) || between_submissions(st.leaf)) out.push_back(st.leaf);
        std::sort(out.begin(), out.end());
        out.erase(std::unique(out.begin(), out.end()), out.end());
        return out;
    }

    // Entries each leaf completed since the window opened (after a drain,
    // IB_GET == IB_PUT == completed, so this is exact).
    std::map<EntityId, std::uint64_t> window_entries() const {
        std::map<EntityId, std::uint64_t> out;
        for (const auto& [ch, st] : channels_)
            out[st.leaf] += static_cast<std::uint32_t>(ctx_->gpu().read_ib_get(ch) - st.get_base);
        for (EntityId id = 0; id < leaves_.size(); ++id)
            if (leaves_[id].closed_entries) out[id] += leaves_[id].closed_entries;
        return out;
    }

    void open_window() {
        for (auto& [ch, st] : channels_) st.get_base = ctx_->gpu().read_ib_get(ch);
        for (auto& s : leaves_) s.closed_entries = 0;
    }

    // Newly backlogged leaves start at the system virtual time: no banked
    // credit.  Only a cycle plan, which also counts recent completions, may
    // declare a leaf idle; elsewhere a leaf between two submissions would
    // lose its lag.
    void update_activity(const std::vector<EntityId>& backlog, bool may_deactivate) {
        for (EntityId id = 0; id < leaves_.size(); ++id) {
            bool now_active = std::binary_search(backlog.begin(), backlog.end(), id);
            LeafState& s = leaves_[id];
            if (now_active && !s.active) s.vtime = std::max(s.vtime, system_vtime_);
            if (now_active || may_deactivate) s.active = now_active;
        }
        double min_v = std::numeric_limits<double>::infinity();
        for (EntityId id : backlog) min_v = std::min(min_v, leaves_[id].vtime);
        if (!backlog.empty()) system_vtime_ = std::max(system_vtime_, min_v);
    }

    void charge(EntityId leaf, Duration used, double share) {
        if (used <= 0 || share <= 0) return;
        LeafState& s = leaf_state(leaf);
        s.vtime += static_cast<double>(used) / share;
        s.accounted += used;
    }

    // --- the cycle ---

    void begin_cycle() {
        planned_ = false;
        start_drain();
    }

    void start_drain() {
        phase_ = Phase::Drain;
        ++drains_;
        drain_started_ = ctx_->now();
        phase_timer_.cancel();
        poll_timer_.cancel();
        for (const auto& [ch, st] : channels_) set(ch, ChannelMode::Shadowed);
        // Remaps take a while to land: before `settle` a direct write may
        // still reach the GPU, so the drain cannot be trusted earlier.
        poll_timer_.arm(drain_started_ + p_.settle, [this] { check_drain(); });
    }

    void check_drain() {
        Time now = ctx_->now();
        if (now < drain_started_ + p_.settle) return;  // the settle timer is armed
        for (const auto& [ch, st] : channels_) {
            if (ctx_->gpu().pending(ch)) {
                if (!poll_timer_.armed()) poll_timer_.arm(now + p_.drain_poll, [this] { check_drain(); });
                return;
            }
        }
        poll_timer_.cancel();
        drain_time_ += now - drain_started_;
        drain_done();
    }

    void drain_done() {
        if (sampled_ != kNoEntity) finish_sample();
        if (freerun_open_) {
            finish_freerun();
            planned_ = false;
        }
        if (!planned_ && !plan_cycle()) {
            go_idle();
            return;
        }
        while (!to_sample_.empty()) {
            EntityId leaf = to_sample_.front();
            to_sample_.erase(to_sample_.begin());
            if (leaf_has_work(leaf) || between_submissions(leaf)) {
                start_sample(leaf);
                return;
            }
        }
        start_freerun();
    }

    bool plan_cycle() {
        // A leaf that completed work during the last cycle is still active even
        // if this instant finds it between two submissions: it keeps its lag.
        std::vector<EntityId> backlog = backlogged();
        for (const auto& [ch, st] : channels_)
            if (leaves_[st.leaf].last_completion >= last_plan_at_) backlog.push_back(st.leaf);
        std::sort(backlog.begin(), backlog.end());
        backlog.erase(std::unique(backlog.begin(), backlog.end()), backlog.end());
        update_activity(backlog, true);
        last_plan_at_ = ctx_->now();
        if (backlog.empty()) return false;
        planned_ = true;
        ++cycles_;
        to_sample_ = backlog;
        cycle_size_ = backlog.size();
        cycle_shares_ = hierarchical_shares(ctx_->tree(), backlog);
        return true;
    }

    void start_sample(EntityId leaf) {
        phase_ = Phase::Sample;
        sampled_ = leaf;
        phase_started_ = ctx_->now();
        ++samples_;
        busy_since_.reset();
        sample_busy_ = 0;
        open_window();
        for (const auto& [ch, st] : channels_)
            if (st.leaf == leaf) set(ch, ChannelMode::Trapped);  // releases what it held
        // Weighted sampling: samples follow the shares, averaging `sample`.
        // It never ends before its held work has been released (settle).
        Duration length = p_.sample;
        if (p_.weighted_sample && leaf < cycle_shares_.size() && cycle_shares_[leaf] > 0)
            length = std::llround(static_cast<double>(p_.sample) * static_cast<double>(cycle_size_) *
                                  cycle_shares_[leaf]);
        phase_timer_.arm(ctx_->now() + std::max(length, p_.settle), [this] { start_drain(); });
        poll_timer_.arm(ctx_->now() + p_.idle_grace, [this] { sample_idle_check(); });
    }

    // When did a set of leaves last show activity (completion or phase start)?
    template <class Pred> Time last_activity(Pred in_set) const {
        Time t = phase_started_;
        for (EntityId id = 0; id < leaves_.size(); ++id)
            if (in_set(id)) t = std::max(t, leaves_[id].last_completion);
        return t;
    }

    void sample_idle_check() {
        if (phase_ != Phase::Sample || leaf_has_work(sampled_)) return;
        Time idle_since = last_activity([this](EntityId id) { return id == sampled_; });
        if (ctx_->now() < idle_since + p_.idle_grace) {
            poll_timer_.arm(idle_since + p_.idle_grace, [this] { sample_idle_check(); });
            return;
        }
        ++short_samples_;
        start_drain();
    }

    void finish_sample() {
        EntityId leaf = sampled_;
        sampled_ = kNoEntity;
        if (busy_since_) {  // no completion interrupt told us when it ended
            sample_busy_ += ctx_->now() - *busy_since_;
            busy_since_.reset();
        }
        std::uint64_t entries = window_entries()[leaf];
        if (entries == 0 || sample_busy_ <= 0) return;
        LeafState& s = leaf_state(leaf);
        s.mean_request = std::max<Duration>(1, sample_busy_ / static_cast<Duration>(entries));
        double share = leaf < cycle_shares_.size() ? cycle_shares_[leaf] : 0.0;
        if (share <= 0) share = hierarchical_shares(ctx_->tree(), {leaf})[leaf];
        charge(leaf, sample_busy_, share);
        sampled_time_ += sample_busy_;
    }

    void start_freerun() {
        std::vector<EntityId> backlog = backlogged();
        update_activity(backlog, false);
        if (backlog.empty()) {
            go_idle();
            return;
        }
        double min_v = std::numeric_limits<double>::infinity();
        for (EntityId id : backlog)
            if (leaves_[id].mean_request > 0) min_v = std::min(min_v, leaves_[id].vtime);
        if (std::isinf(min_v)) {  // nobody with work has been sampled yet
            begin_cycle();
            return;
        }
        phase_ = Phase::Freerun;
        phase_started_ = ctx_->now();
        freerun_open_ = true;
        ++freeruns_;
        freerun_backlog_ = backlog;
        // Unsampled leaves cannot be charged, so they wait for their sample.
        allowed_.assign(leaves_.size(), 0);
        for (EntityId id = 0; id < leaves_.size(); ++id)
            allowed_[id] = leaves_[id].mean_request > 0 && leaves_[id].vtime - min_v <= p_.threshold;
        for (EntityId id : backlog)
            if (!allowed_[id]) ++denials_;
        open_window();
        for (const auto& [ch, st] : channels_)
            set(ch, allowed(st.leaf) ? ChannelMode::Direct : ChannelMode::Shadowed);
        phase_timer_.arm(ctx_->now() + p_.freerun, [this] { start_drain(); });
        poll_timer_.arm(ctx_->now() + p_.idle_grace, [this] { freerun_idle_check(); });
    }

    bool allowed_work() const {
        for (const auto& [ch, st] : channels_)
            if (allowed(st.leaf) && has_work(ch)) return true;
        return false;
    }

    // Work conservation inside a freerun: once the allowed leaves have left
    // the GPU idle for `idle_grace`, denied leaves with held work may run for
    // the rest of it.  Their usage is estimated like everybody's, so the
    // denial is paid for later.  Short gaps (a guest's CPU time between
    // kernels) do not count: filling them with a denied leaf's long kernels
    // would starve the allowed leaf on a non-preemptive GPU.
    void freerun_idle_check() {
        if (phase_ != Phase::Freerun || allowed_work()) return;
        Time idle_since = last_activity([this](EntityId id) { return allowed(id); });
        if (ctx_->now() < idle_since + p_.idle_grace) {
            poll_timer_.arm(idle_since + p_.idle_grace, [this] { freerun_idle_check(); });
            return;
        }
        for (const auto& [ch, st] : channels_) {
            if (!allowed(st.leaf) && leaf_has_work(st.leaf) && leaves_[st.leaf].mean_request > 0) {
                if (allowed_.size() <= st.leaf) allowed_.resize(st.leaf + 1, 0);
                allowed_[st.leaf] = 1;
                ++conserving_releases_;
            }
        }
        for (const auto& [ch, st] : channels_)
            if (allowed(st.leaf)) set(ch, ChannelMode::Direct);
    }

    void finish_freerun() {
        freerun_open_ = false;
        std::map<EntityId, std::uint64_t> entries = window_entries();
        // Shares among the leaves that wanted the GPU in this freerun (the
        // entities still alive: a leaf may have been removed meanwhile).
        std::vector<EntityId> charged;
        for (EntityId id : freerun_backlog_)
            if (ctx_->tree().valid(id)) charged.push_back(id);
        for (const auto& [leaf, n] : entries)
            if (n > 0 && ctx_->tree().valid(leaf) &&
                !std::binary_search(freerun_backlog_.begin(), freerun_backlog_.end(), leaf))
                charged.push_back(leaf);
        std::sort(charged.begin(), charged.end());
        std::vector<double> share = hierarchical_shares(ctx_->tree(), charged);
        for (const auto& [leaf, n] : entries) {
            if (n == 0 || leaf >= leaves_.size() || !ctx_->tree().valid(leaf)) continue;
            Duration usage = static_cast<Duration>(n) * leaves_[leaf].mean_request;
            charge(leaf, usage, share[leaf]);
            estimated_time_ += usage;
        }
    }

    void go_idle() {
        phase_ = Phase::Idle;
        ++idles_;
        phase_timer_.cancel();
        poll_timer_.cancel();
        to_sample_.clear();
        planned_ = false;
        sampled_ = kNoEntity;
        freerun_open_ = false;
        last_plan_at_ = ctx_->now();
        for (const auto& [ch, st] : channels_) set(ch, ChannelMode::Direct);
    }

    Params p_;
    PolicyContext* ctx_ = nullptr;
    bool running_ = false;
    Phase phase_ = Phase::Idle;
    std::map<ChannelId, ChannelState> channels_;  // ordered: deterministic mode switches
    std::vector<LeafState> leaves_;
    double system_vtime_ = 0;  // monotonic minimum vtime of the backlogged leaves

    Timer phase_timer_;  // end of a sample or of a freerun
    Timer poll_timer_;   // drain polling, sampled leaf idle check

    // Cycle plan.
    bool planned_ = false;
    Time last_plan_at_ = 0;
    Time phase_started_ = 0;  // start of the current sample or freerun
    std::size_t cycle_size_ = 0;  // leaves planned for sampling this cycle
    std::vector<EntityId> to_sample_;
    std::vector<double> cycle_shares_;

    // Drain.
    Time drain_started_ = 0;
    EntityId drain_completer_ = kNoEntity;  // set while a fence interrupt is being handled

    // Sample of one leaf (open through the drain that follows it).
    EntityId sampled_ = kNoEntity;
    std::optional<Time> busy_since_;
    Duration sample_busy_ = 0;

    // Freerun (open through the drain that follows it).
    bool freerun_open_ = false;
    std::vector<EntityId> freerun_backlog_;
    std::vector<char> allowed_;

    std::uint64_t cycles_ = 0, drains_ = 0, samples_ = 0, short_samples_ = 0, freeruns_ = 0;
    std::uint64_t denials_ = 0, conserving_releases_ = 0, idles_ = 0, trapped_doorbells_ = 0, sample_completions_ = 0;
    std::uint64_t fences_ = 0, channel_errors_ = 0, released_entries_ = 0, shadow_events_ = 0;
    Duration drain_time_ = 0, sampled_time_ = 0, estimated_time_ = 0;
};

}  // namespace

PolicyInfo dfq_info() {
    return {"dfq",
            "NEON disengaged fair queuing with weights (thesis): drain, exclusive trapped sampling, "
            "freerun with vtime-threshold denial",
            {
                {"sample_ms", 10.0,
                 "exclusive GPU time a backlogged leaf gets per cycle to measure its request size (mean over "
                 "leaves when weighted_sample is on)"},
                {"weighted_sample", 1.0,
                 "1: a leaf's sample is sample_ms * leaves * its share, so sampling follows the weights; "
                 "0: every leaf gets sample_ms (the thesis with equal weights)"},
                {"freerun_ms", 50.0, "length of the freerun phase in which non-denied leaves run direct"},
                {"threshold_ms", 5.0,
                 "a leaf whose virtual time (share-normalised GPU ms) leads the least-served backlogged "
                 "leaf by more than this is denied the next freerun"},
                {"idle_grace_us", 1000.0,
                 "a sampled leaf idle this long ends its sample; allowed leaves idle this long in a freerun "
                 "let the denied ones in (work conservation)"},
                {"settle_us", 100.0,
                 "time after shadowing before a drain can complete; must cover the remap latency"},
                {"drain_poll_us", 200.0,
                 "pending-work poll period while draining, for work that raises no completion interrupt"},
            }};
}

std::unique_ptr<Policy> make_dfq(const PolicyParams& p) {
    const PolicyInfo info = dfq_info();
    const ParamReader get{p, info};
    // In this order, so the first bad one is named.
    Params params{
        static_cast<Duration>(get.positive("sample_ms") * kMillisecond),
        get("weighted_sample") != 0,
        static_cast<Duration>(get.positive("freerun_ms") * kMillisecond),
        get("threshold_ms") * static_cast<double>(kMillisecond),
        static_cast<Duration>(get("idle_grace_us") * kMicrosecond),
        static_cast<Duration>(get("settle_us") * kMicrosecond),
        static_cast<Duration>(get.positive("drain_poll_us") * kMicrosecond),
    };
    return std::make_unique<DfqPolicy>(params);
}

}  // namespace pvgpu
