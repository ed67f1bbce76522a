// The audit looks (Horvitz-Thompson sampling): a spell opens where what
// starts next may start unseen; the time after its start is cut into
// strata, and the engine is read once at a uniform random moment in each.
// A look at u in a stratum of width w stands for the whole stratum: a
// guess that charged a channel [t - mine, t] is corrected, for each look
// before t, by w times (ran at u) - (charged at u), which is right on
// average whatever the tenant does, and zero where the guess was right.
//
// The sampler owns the spell, its plan, its random draws and the looks
// made.  The accounting decides when a spell opens and at which pace
// (Accounting::open_audit), makes each look (it reads the engine: `look`),
// records it here, and asks for the correction of a charge.
#pragma once

#include <functional>
#include <optional>
#include <random>
#include <vector>

#include "gpu_device.hpp"
#include "time.hpp"

namespace pvgpu {

class AuditSampler {
public:
    struct Look {
        Time at;
        Duration weight;  // its stratum's width
        std::optional<ChannelId> saw;
    };
    // `look(w)`: read the engine now for a stratum `w` wide, and record().
    AuditSampler(Timers& timers, std::function<void(Duration)> look);
    AuditSampler(const AuditSampler&) = delete;
    AuditSampler& operator=(const AuditSampler&) = delete;

    void seed(std::seed_seq& seq) { rng_.seed(seq); }
    // On an idle engine, strata are at most `width` wide until `until` after
    // the spell's start (every doorbell is trapped by then).
    void set_idle_cap(Duration width, Duration until);

    // A spell from `from`: `opener`'s completion began it (none: a look saw
    // the engine idle), `running` was believed on the engine then, and
    // `pace` is the shortest pace of the channels it audits.
    void open(Time from, std::optional<ChannelId> opener, std::optional<ChannelId> running, Duration pace);
    void close();
    bool is_open() const { return from_ >= 0; }
    Time from() const { return from_; }
    std::optional<ChannelId> opener() const { return opener_; }
    std::optional<ChannelId> running_at_start() const { return running_; }
    // The open spell's strata reach a completion at t.
    bool covers(Time t) const { return from_ >= 0 && t > from_ && t <= end_; }

    // A look made (at the moment planned); then plan_look() for the next
    // stratum, unless the spell is done.
    void record(const Look& l) { looks_.push_back(l); }
    void plan_look();

    // What the looks in [from, through) say of a guess that charged `ch`
    // [charged_from, charged_to): each adds its weight where it saw `ch`,
    // and takes it back where the guess charged `ch`.
    Duration correction(ChannelId ch, Time from, Time through, Time charged_from, Time charged_to) const;

private:
    Timer timer_;
    std::function<void(Duration)> look_;
    std::minstd_rand rng_{0xa0d17};
    Duration idle_width_ = 0;
    Duration idle_until_ = 0;
    Time from_ = -1;  // the spell's start (-1: none open)
    std::optional<ChannelId> opener_;
    // Believed on the engine when it began (a spell while busy): the kernel
    // it ran then may have started before the spell.
    std::optional<ChannelId> running_;
    Time end_ = 0;  // end of the last stratum planned
    Duration width_ = 0;
    int strata_ = 0;
    std::vector<Look> looks_;
};

}  // namespace pvgpu
