#include "audit_sampler.hpp"

#include <algorithm>
#include <utility>

namespace pvgpu {

namespace {

// Strata a kAuditPerPace'th of a channel's pace wide (between completions,
// per kernel GET counted between them: a batching channel's kernels, not
// its batches), at least kAuditMinWidth and at most kAuditMaxWidth; the
// first kAuditEven of them even (two paces), then each twice the one
// before, kAuditStrata in all (some 2^15 paces): an idle channel costs a
// bounded number of looks, and any kernel that is not idle for ten
// thousand of its paces is covered (a tenant that makes the width narrow
// buys only wider strata, noise, not a kernel left uncorrected).  A look
// per quarter pace: more looks per pace narrow the correction's spread and
// cost reads; four is where the two were weighed against each other.
constexpr Duration kAuditPerPace = 4;
constexpr Duration kAuditMinWidth = 200 * kMicrosecond;
constexpr Duration kAuditMaxWidth = 20 * kMillisecond;
constexpr int kAuditEven = 2 * kAuditPerPace;
// Strata per spell: 2 paces even, then 16 doublings, some 2^15 paces.
constexpr int kAuditStrata = kAuditEven + 16;

}  // namespace

AuditSampler::AuditSampler(Timers& timers, std::function<void(Duration)> look)
    : timer_(timers), look_(std::move(look)) {}

void AuditSampler::set_idle_cap(Duration width, Duration until) {
    idle_width_ = width;
    idle_until_ = until;
}

void AuditSampler::open(Time from, std::optional<ChannelId> opener, std::optional<ChannelId> running,
                        Duration pace) {
    from_ = end_ = from;
    opener_ = opener;
    running_ = running;
    width_ = std::clamp(pace / kAuditPerPace, kAuditMinWidth, kAuditMaxWidth);
    plan_look();
}

void AuditSampler::close() {
    timer_.cancel();
    from_ = -1;
    opener_.reset();
    running_.reset();
    strata_ = 0;
    looks_.clear();
}

void AuditSampler::plan_look() {
    if (strata_ >= kAuditStrata) return;  // a spell must end: an idle GPU goes quiet
    // (The doubling stops at 2^30 widths, years of idle time.)
    const int doublings = std::clamp(strata_ - kAuditEven + 1, 0, 30);
    Duration w = width_ << doublings;
    // On an idle engine, until every doorbell is trapped (a later start is
    // read exactly), no stratum is wider than the idle cap: a start in
    // there is corrected by one look that stands for at most that much (one
    // in a 25.6 ms stratum moved a 20 ms kernel's charge by 25.6 ms or
    // nothing).  These few do not count towards kAuditStrata, so the
    // doubling after them still covers some 2^15 paces.
    const bool capped = !running_ && w > std::max(width_, idle_width_) && end_ < from_ + idle_until_;
    if (capped)
        w = std::max(width_, idle_width_);
    else
        ++strata_;
    const Time lo = end_;
    end_ += w;
    const Time at = lo + std::uniform_int_distribution<Duration>(0, w - 1)(rng_);
    timer_.arm(at, [this, w] { look_(w); });
}

Duration AuditSampler::correction(ChannelId ch, Time from, Time through, Time charged_from, Time charged_to) const {
    Duration fix = 0;
    for (const Look& l : looks_)
        if (l.at >= from && l.at < through)
            fix += l.weight * ((l.saw == ch ? 1 : 0) - (l.at >= charged_from && l.at < charged_to ? 1 : 0));
    return fix;
}

}  // namespace pvgpu
