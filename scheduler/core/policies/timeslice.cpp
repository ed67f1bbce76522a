// `timeslice`: disengaged time slices in the style of GVT-g and NVIDIA's
// fixed-share vGPU scheduler.
//
// Backlogged leaves take turns owning the GPU.  The owner's channels are
// Direct (no exits at all), everyone else's are Shadowed: their guests keep
// writing, the writes are held and reach the GPU at their own turn.  A turn
// lasts period * the leaf's hierarchical share among the backlogged leaves
// (formula 3.1 generalised), and ends early once the owner has had no work for
// `idle_grace`.
//
// Kernels are not preemptible on a round-robin GPU, so shadowing a leaf does
// not stop what it already queued: its in-flight kernel (and anything else
// behind IB_PUT) runs past its turn.  The policy watches the engine (the
// engine status register read at every fence interrupt, every unshadow and a
// slow poll while someone is overrunning) and charges the time a non-owner
// spent on the engine as a debt that shortens its next turn, deficit round
// robin style.  The owner whose turn was eaten by that overrun gets the time
// back by a slice extension.
//
// With fewer than two backlogged leaves the policy disengages: every channel
// Direct, no timer armed, so a lone task runs at native speed and an idle host
// costs nothing.  It re-engages from a fence interrupt that shows contention.
#include <algorithm>
#include <cmath>
#include <map>
#include <optional>
#include <stdexcept>
#include <vector>

#include "policies.hpp"

namespace pvgpu {

namespace {

struct Params {
    Duration period;
    Duration min_slice;
    Duration idle_grace;
    Duration poll;
};

struct LeafState {
    Duration debt = 0;            // engine time used outside its own turns, not yet paid back
    Duration accounted = 0;       // engine time charged to it (observed)
    Time last_completion = -1;    // last fence interrupt from one of its channels
};

class TimeslicePolicy final : public Policy {
public:
    explicit TimeslicePolicy(Params p) : p_(p) {}

    std::string_view name() const override { return "timeslice"; }

    void start(PolicyContext& ctx) override {
        ctx_ = &ctx;
        slice_timer_.bind(ctx.timers());
        grace_timer_.bind(ctx.timers());
        poll_timer_.bind(ctx.timers());
        running_ = true;
        engaged_ = false;
        owner_ = kNoEntity;
        observed_.reset();
        observed_at_ = ctx.now();
    }

    void stop() override {
        if (!running_) return;
        observe();
        slice_timer_.cancel();
        grace_timer_.cancel();
        poll_timer_.cancel();
        for (const auto& [ch, leaf] : channels_) set(ch, ChannelMode::Direct);
        engaged_ = false;
        owner_ = kNoEntity;
        running_ = false;
    }

    void channel_added(ChannelId ch, EntityId leaf) override {
        if (!running_) return;
        leaf_state(leaf);
        channels_[ch] = leaf;
        // A newcomer waits for its turn like everybody else.
        set(ch, engaged_ && leaf != owner_ ? ChannelMode::Shadowed : ChannelMode::Direct);
    }

    void channel_removed(ChannelId ch, EntityId leaf) override {
        if (!running_) return;
        observe();
        if (observed_ == ch) observed_.reset();
        channels_.erase(ch);
        if (engaged_ && leaf == owner_ && !leaf_has_work(leaf)) rotate();
    }

    void tree_changed(EntityTree::Change change, EntityId id) override {
        if (!running_) return;
        // Ids are reused: a new or removed entity starts from a clean slate.
        // Weight changes need nothing: shares are recomputed at every turn.
        if (change != EntityTree::Change::Weight) leaf_state(id) = LeafState{};
    }

    void doorbell_trapped(ChannelId, std::uint32_t) override { ++traps_; }

    void fence(ChannelId ch, std::uint32_t) override {
        if (!running_) return;
        auto it = channels_.find(ch);
        if (it == channels_.end()) return;
        EntityId leaf = it->second;
        ++fences_;
        leaf_state(leaf).last_completion = ctx_->now();
        // The engine looked idle at the last observation, yet ch completed
        // work: a direct doorbell started it in between (upper bound again).
        if (!observed_) {
            charge(leaf, ctx_->now() - observed_at_);
            observed_at_ = ctx_->now();
        }
        // Whatever runs now was put on the engine by this completion.
        observe(true);
        if (!engaged_) {
            maybe_engage(leaf);
            return;
        }
        if (leaf == owner_ && !leaf_has_work(owner_) && !grace_timer_.armed())
            grace_timer_.arm(ctx_->now() + p_.idle_grace, [this] { grace_expired(); });
        update_poll();
    }

    void channel_error(ChannelId, std::uint32_t) override {
        if (!running_) return;
        observe();  // a killed channel leaves the engine
    }

    void released(ChannelId ch, std::uint32_t entries) override {
        if (!running_) return;
        released_entries_ += entries;
        observe(false, ch);  // the released work may be on the engine now
    }

    std::optional<Duration> accounted(EntityId leaf) const override { return accounted_in(leaves_, leaf); }

    std::map<std::string, double> counters() const override {
        return {
            {"slices", static_cast<double>(slices_)},
            {"switches", static_cast<double>(switches_)},
            {"engagements", static_cast<double>(engagements_)},
            {"disengagements", static_cast<double>(disengagements_)},
            {"early_ends", static_cast<double>(early_ends_)},
            {"skipped_turns", static_cast<double>(skipped_turns_)},
            {"extensions", static_cast<double>(extensions_)},
            {"overrun_ms", to_ms(overrun_)},
            {"shadow_events", static_cast<double>(shadow_events_)},
            {"polls", static_cast<double>(polls_)},
            {"fences", static_cast<double>(fences_)},
            {"traps", static_cast<double>(traps_)},
            {"released_entries", static_cast<double>(released_entries_)},
        };
    }

private:
    LeafState& leaf_state(EntityId leaf) { return leaf_state_in(leaves_, leaf); }
    void set(ChannelId ch, ChannelMode mode) { set_mode_counted(*ctx_, ch, mode, shadow_events_); }

    bool has_work(ChannelId ch) const { return has_work_unless_killed(*ctx_, ch); }

    // The owner completed work within the grace period: its guest is most
    // likely preparing the next submission.
    bool owner_between_submissions() const {
        if (owner_ >= leaves_.size() || leaves_[owner_].last_completion < 0) return false;
        return ctx_->now() - leaves_[owner_].last_completion < p_.idle_grace;
    }

    bool leaf_has_work(EntityId leaf) const {
        for (const auto& [ch, owner] : channels_)
            if (owner == leaf && has_work(ch)) return true;
        return false;
    }

    // Leaves with work, ascending ids (the rotation order).
    std::vector<EntityId> backlogged() const {
        std::vector<EntityId> out;
        for (const auto& [ch, leaf] : channels_)
            if (has_work(ch) && std::find(out.begin(), out.end(), leaf) == out.end()) out.push_back(leaf);
        std::sort(out.begin(), out.end());
        return out;
    }

    // Engine accounting: the interval since the last observation belongs to
    // the channel the engine status register showed then.  If the engine was
    // idle then and is busy now, a direct doorbell started the work somewhere
    // in between: charge the whole interval (an upper bound, exact for
    // back-to-back submitters) unless we know it started just now: after a
    // completion anything may have been started; after a release, only the
    // released channel.
    void observe(bool after_completion = false, std::optional<ChannelId> released = std::nullopt) {
        Time now = ctx_->now();
        std::optional<ChannelId> current = ctx_->engine_status();  // counted MMIO read
        if (observed_)
            charge_channel(*observed_, now - observed_at_);
        else if (current && !after_completion && released != current)
            charge_channel(*current, now - observed_at_);
        observed_ = current;
        observed_at_ = now;
    }

    void charge_channel(ChannelId ch, Duration d) {
        if (auto it = channels_.find(ch); it != channels_.end()) charge(it->second, d);
    }

    void charge(EntityId leaf, Duration d) {
        if (d <= 0) return;
        LeafState& s = leaf_state(leaf);
        s.accounted += d;
        if (engaged_ && leaf != owner_) {
            // Overrun: engine time outside its own turn, paid back later.
            s.debt += d;
            overrun_ += d;
            slice_intrusion_ += d;
        }
    }

    void maybe_engage(EntityId fenced) {
        // The fenced leaf is about to resubmit (its guest sees the completion
        // after us), so it counts as backlogged.
        std::vector<EntityId> cands = backlogged();
        if (std::find(cands.begin(), cands.end(), fenced) == cands.end()) {
            cands.push_back(fenced);
            std::sort(cands.begin(), cands.end());
        }
        if (cands.size() < 2) return;
        engaged_ = true;
        ++engagements_;
        for (auto& s : leaves_) s.debt = 0;
        // Whoever is on the engine goes first: its kernel runs anyway.
        EntityId first = fenced;
        if (observed_)
            if (auto it = channels_.find(*observed_); it != channels_.end()) first = it->second;
        auto [leaf, slice] = choose(cands, first, true);
        begin_turn(leaf, slice);
    }

    void disengage() {
        engaged_ = false;
        owner_ = kNoEntity;
        ++disengagements_;
        slice_timer_.cancel();
        grace_timer_.cancel();
        poll_timer_.cancel();
        // Without contention nobody owes anybody.
        for (auto& s : leaves_) s.debt = 0;
        for (const auto& [ch, leaf] : channels_) set(ch, ChannelMode::Direct);
    }

    // Picks the next owner among `cands` (ascending), starting after `prev`
    // (or at it when `inclusive`), and the length of its turn.  Debt is paid
    // first: a turn worth less than its debt is skipped.
    std::pair<EntityId, Duration> choose(const std::vector<EntityId>& cands, EntityId prev, bool inclusive) {
        std::vector<double> share = hierarchical_shares(ctx_->tree(), cands);
        std::size_t n = cands.size();
        std::size_t start = 0;
        while (start < n && (inclusive ? cands[start] < prev : cands[start] <= prev)) ++start;
        for (std::size_t step = 0;; ++step) {
            EntityId c = cands[(start + step) % n];
            Duration credit = std::max<Duration>(1, std::llround(static_cast<double>(p_.period) * share[c]));
            LeafState& s = leaf_state(c);
            Duration allowance = credit - s.debt;
            if (allowance >= p_.min_slice) {
                s.debt = 0;
                return {c, allowance};
            }
            if (allowance > 0) {
                s.debt = p_.min_slice - allowance;
                return {c, p_.min_slice};
            }
            // Every skip lowers a debt by a positive credit, so this ends.
            s.debt = -allowance;
            ++skipped_turns_;
        }
    }

    void begin_turn(EntityId leaf, Duration slice) {
        if (leaf != owner_) ++switches_;
        owner_ = leaf;
        ++slices_;
        slice_intrusion_ = 0;
        slice_compensated_ = 0;
        grace_timer_.cancel();
        for (const auto& [ch, l] : channels_) set(ch, l == leaf ? ChannelMode::Direct : ChannelMode::Shadowed);
        slice_timer_.arm(ctx_->now() + slice, [this] { slice_expired(); });
        update_poll();
    }

    void slice_expired() {
        observe();
        bool owner_busy = leaf_has_work(owner_) || owner_between_submissions();
        if (owner_busy && slice_intrusion_ > slice_compensated_) {
            // Others' overrun ate into this turn: give the owner the time back.
            Duration owed = slice_intrusion_ - slice_compensated_;
            slice_compensated_ = slice_intrusion_;
            ++extensions_;
            slice_timer_.arm(ctx_->now() + owed, [this] { slice_expired(); });
            return;
        }
        rotate();
    }

    void grace_expired() {
        observe();
        if (leaf_has_work(owner_)) return;  // it came back in time
        if (owner_between_submissions()) {
            grace_timer_.arm(leaves_[owner_].last_completion + p_.idle_grace, [this] { grace_expired(); });
            return;
        }
        ++early_ends_;
        rotate();
    }

    void rotate() {
        observe();
        grace_timer_.cancel();
        std::vector<EntityId> cands = backlogged();
        if (owner_ != kNoEntity && owner_between_submissions() &&
            std::find(cands.begin(), cands.end(), owner_) == cands.end()) {
            cands.push_back(owner_);
            std::sort(cands.begin(), cands.end());
        }
        if (cands.size() < 2) {
            disengage();
            return;
        }
        auto [leaf, slice] = choose(cands, owner_, false);
        begin_turn(leaf, slice);
    }

    // While a non-owner still has work on the GPU (its overrun), read the
    // engine status now and then so the overrun is measured even when its
    // entries raise no interrupt.
    void update_poll() {
        bool overrunning = false;
        for (const auto& [ch, leaf] : channels_)
            if (leaf != owner_ && ctx_->gpu().pending(ch)) overrunning = true;
        if (!engaged_ || !overrunning) {
            poll_timer_.cancel();
        } else if (!poll_timer_.armed()) {
            poll_timer_.arm(ctx_->now() + p_.poll, [this] {
                ++polls_;
                observe();
                update_poll();
            });
        }
    }

    Params p_;
    PolicyContext* ctx_ = nullptr;
    bool running_ = false;
    bool engaged_ = false;
    EntityId owner_ = kNoEntity;
    std::map<ChannelId, EntityId> channels_;  // ordered: deterministic mode switches
    std::vector<LeafState> leaves_;

    Timer slice_timer_;
    Timer grace_timer_;
    Timer poll_timer_;
    Duration slice_intrusion_ = 0;    // non-owner engine time during this turn
    Duration slice_compensated_ = 0;  // part of it already given back

    std::optional<ChannelId> observed_;  // engine status at the last observation
    Time observed_at_ = 0;

    std::uint64_t slices_ = 0, switches_ = 0, engagements_ = 0, disengagements_ = 0;
    std::uint64_t early_ends_ = 0, skipped_turns_ = 0, extensions_ = 0, shadow_events_ = 0;
    std::uint64_t polls_ = 0, fences_ = 0, traps_ = 0, released_entries_ = 0;
    Duration overrun_ = 0;
};

}  // namespace

PolicyInfo timeslice_info() {
    return {"timeslice",
            "disengaged time slices (GVT-g / fixed-share vGPU): backlogged leaves own the GPU in turn, "
            "overrun is measured and paid back",
            {
                {"period_ms", 20.0,
                 "scheduling period: a leaf's turn is period * its hierarchical share of the backlogged leaves"},
                {"min_slice_ms", 1.0, "shortest turn worth a remap; a turn shorter than its debt is skipped"},
                {"idle_grace_us", 500.0,
                 "a turn ends early once the owner has had no GPU work for this long (covers CPU gaps "
                 "between a completion and the next submission)"},
                {"poll_us", 500.0,
                 "engine status poll period while a shadowed leaf still has work on the GPU (overrun)"},
            }};
}

std::unique_ptr<Policy> make_timeslice(const PolicyParams& p) {
    const PolicyInfo info = timeslice_info();
    const ParamReader get{p, info};
    Params params{
        static_cast<Duration>(get.positive("period_ms") * kMillisecond),
        static_cast<Duration>(get("min_slice_ms") * kMillisecond),
        static_cast<Duration>(get("idle_grace_us") * kMicrosecond),
        static_cast<Duration>(get.positive("poll_us") * kMicrosecond),
    };
    return std::make_unique<TimeslicePolicy>(params);
}

}  // namespace pvgpu
