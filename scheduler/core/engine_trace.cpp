#include "engine_trace.hpp"

namespace pvgpu {

void EngineTrace::drain() const {
    buf_.clear();
    const std::uint64_t lost = gpu_.read_ctxsw_trace(buf_);
    if (lost > 0) {
        // What ran in the gap is unknown: no channel's end is known from
        // before it, and the one believed on the engine may have left.
        lost_ += lost;
        left_.clear();
        on_engine_ = 0;
        if (sink_.on_lost) sink_.on_lost(lost);
    }
    for (const CtxswRecord& r : buf_) {
        if (on_engine_ != 0 && on_engine_ != r.to) left_[on_engine_] = r.at;
        on_engine_ = r.to;
        if (sink_.on_switch) sink_.on_switch(r);
    }
}

std::optional<Time> EngineTrace::left_at(ChannelId ch) const {
    drain();
    if (ch == on_engine_) return std::nullopt;
    auto it = left_.find(ch);
    if (it == left_.end()) return std::nullopt;
    return it->second;
}

void EngineTrace::forget(ChannelId ch) {
    drain();
    left_.erase(ch);
    if (on_engine_ == ch) on_engine_ = 0;
}

}  // namespace pvgpu
