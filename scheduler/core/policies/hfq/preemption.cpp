// Preemption: see leaves.cpp (bursty leaves).
#include "core/policies/hfq/hfq.hpp"

namespace pvgpu::hfq {

void HfqPolicy::preempt_for(ChannelId ch) {
    auto it = chans_.find(ch);
    if (it == chans_.end() || nodes_[it->second].shadowed || !ctx_->gpu().pending(ch)) return;
    // A leaf that thinks for less than a preemption takes would pay one
    // per return: the engine is held for it instead (anticipation_until).
    if (nodes_[it->second].think >= 0 && nodes_[it->second].think < preempt_cost_) return;
    const std::optional<ChannelId> running = ctx_->engine_status();
    if (!running || *running == ch) return;
    auto run = chans_.find(*running);
    if (run == chans_.end() || !nodes_[run->second].shadowed) return;
    // The fed or cut kernel may have ended without an interrupt: its
    // channel's completion timestamp moved since (memory, not a register).
    if (fed_ch_ != 0 && ctx_->gpu().left_engine_at(fed_ch_) != fed_done_) fed_ch_ = 0;
    if (cut_ch_ != 0 && ctx_->gpu().left_engine_at(cut_ch_) != cut_done_) cut_ch_ = 0;
    // Fed past the cap (or resuming after such a kernel was cut, its
    // leaf still past it), the kernel is the returning leaf's to take.
    const bool owed = (fed_beyond_cap_ && fed_ch_ == *running) ||
                      (cut_ch_ == *running && lead_of(run->second) > static_cast<double>(p_.feed_lead));
    if (!owed && !behind(it->second)) return;
    // A fed kernel about to end costs the returning leaf less than a
    // preemption would cost the engine.
    const Time now = ctx_->now();
    // A cut kernel not yet seen back on the engine (the read above is
    // the first look) ran at least what it had run before the cut.
    const Duration ran = fed_ch_ == *running ? now - fed_at_
                         : cut_ch_ == *running
                             ? cut_ran_ + (cut_back_at_ >= 0 ? now - cut_back_at_ : 0)
                             : -1;
    if (ran >= 0)
        if (Duration est = ctx_->kernel_estimate(*running); est > 0 && est - ran <= preempt_cost_) return;
    if (!ctx_->preempt(ch)) return;
    ++preemptions_;
    if (owed || cut_ch_ == *running) {
        cut_ch_ = *running;
        cut_ran_ = ran;
        cut_back_at_ = -1;
        cut_done_ = ctx_->gpu().left_engine_at(cut_ch_);
    }
    fed_ch_ = 0;
    feeding_ = false;
}

}  // namespace pvgpu::hfq
