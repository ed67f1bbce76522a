// hfq's preemption for a returning bursty leaf: see Preemption in preemption.hpp.
#include "core/policies/hfq/hfq.hpp"

namespace pvgpu::hfq {

void Preemption::start(Timers& timers, const EngineArbitration& engine) {
    preempt_timer_.bind(timers);
    // A preemption as slow as a slice buys nothing over its end.
    can_preempt_ = engine.preemptive && engine.preempt < engine.timeslice;
    preempt_cost_ = engine.preempt;
}

void Preemption::returned(ChannelId ch, Time now) {
    if (can_preempt_) preempt_timer_.arm(now, [this, ch] { preempt_for(ch); });
}

void Preemption::preempt_for(ChannelId ch) {
    auto it = hfq_.chans_.find(ch);
    if (it == hfq_.chans_.end() || hfq_.fq_.nodes_[it->second].shadowed || !hfq_.ctx_->gpu().pending(ch)) return;
    // A leaf that thinks for less than a preemption takes would pay one
    // per return: the engine is held for it instead (anticipation_until).
    if (hfq_.fq_.nodes_[it->second].think >= 0 && hfq_.fq_.nodes_[it->second].think < preempt_cost_) return;
    const std::optional<ChannelId> running = hfq_.ctx_->engine_status();
    if (!running || *running == ch) return;
    auto run = hfq_.chans_.find(*running);
    if (run == hfq_.chans_.end()) return;
    // A leaf below its share catching up takes the engine from any leaf
    // that asks for its share or more; others only from a blocked one.
    const EntityId self = it->second, other = run->second;
    const bool owed_credit = hfq_.fq_.nodes_[self].below_share && hfq_.catch_up_.credit(self) > preempt_cost_ &&
                             !hfq_.fq_.nodes_[other].below_share && !hfq_.catch_up_.catching_up(other);
    if (!owed_credit && !hfq_.fq_.nodes_[other].shadowed) return;
    // The fed or cut kernel may have ended without an interrupt: its
    // channel's completion timestamp moved since (memory, not a register).
    Feeder& feeder = hfq_.feeder_;
    feeder.forget_ended();
    if (cut_ch_ != 0 && hfq_.ctx_->gpu().left_engine_at(cut_ch_) != cut_done_) cut_ch_ = 0;
    // Fed past the cap (or resuming after such a kernel was cut, its
    // leaf still past it), the kernel is the returning leaf's to take.
    const bool owed = feeder.fed_beyond_cap(*running) ||
                      (cut_ch_ == *running && hfq_.fq_.lead_of(run->second) > static_cast<double>(hfq_.p_.feed_lead));
    // Its credit outweighs the engine's dead time; otherwise only a leaf
    // well behind its share preempts.
    if (!owed && !owed_credit && !hfq_.fq_.behind(self)) return;
    // A fed kernel about to end costs the returning leaf less than a
    // preemption would cost the engine.
    const Time now = hfq_.ctx_->now();
    // A cut kernel not yet seen back on the engine (the read above is
    // the first look) ran at least what it had run before the cut.
    const std::optional<Time> fed_at = feeder.fed_at(*running);
    const Duration ran = fed_at ? now - *fed_at
                         : cut_ch_ == *running
                             ? cut_ran_ + (cut_back_at_ >= 0 ? now - cut_back_at_ : 0)
                             : -1;
    if (ran >= 0)
        if (Duration est = hfq_.ctx_->kernel_estimate(*running); est > 0 && est - ran <= preempt_cost_) return;
    if (!hfq_.ctx_->preempt(ch)) return;
    ++preemptions_;
    if (owed || cut_ch_ == *running) {
        cut_ch_ = *running;
        cut_ran_ = ran;
        cut_back_at_ = -1;
        cut_done_ = hfq_.ctx_->gpu().left_engine_at(cut_ch_);
    }
    feeder.preempted();
}

}  // namespace pvgpu::hfq
