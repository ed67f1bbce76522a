// What the host knows from the GPU's context-switch trace (GpuDevice::
// read_ctxsw_trace): when each channel last left the engine.  The trace is
// written by the GPU for the host whatever the tenant's work asks for, so
// this is the one time source beside the host's own clock: a kernel that
// raised no interrupt ended no later than its channel left the engine.
//
// On a non-preemptive engine a channel leaves at the end of a kernel (the
// next one is another channel's, or none); on a preemptive engine also at
// a slice end or a host preemption, mid-kernel.  A channel still on the
// engine has no known end.  Records are read lazily, at each question.
#pragma once

#include <cstdint>
#include <functional>
#include <optional>
#include <unordered_map>
#include <vector>

#include "gpu_device.hpp"
#include "time.hpp"

namespace pvgpu {

class EngineTrace {
public:
    explicit EngineTrace(GpuDevice& gpu) : gpu_(gpu) {}
    EngineTrace(const EngineTrace&) = delete;
    EngineTrace& operator=(const EngineTrace&) = delete;

    // Who hears each record as it is read (the accounting, in trace mode),
    // and of records the GPU lost.
    struct Sink {
        std::function<void(const CtxswRecord&)> on_switch;
        std::function<void(std::uint64_t lost)> on_lost;
    };
    void set_sink(Sink s) { sink_ = std::move(s); }
    // Whether the GPU keeps a trace at all.
    bool available() const { return gpu_.has_ctxsw_trace(); }
    // Reads what the GPU wrote since the last read.
    void sync() const { drain(); }

    // When `ch` last left the engine, as far as the trace says: nullopt
    // while it is on the engine, or if it never left (or its record was
    // lost).
    std::optional<Time> left_at(ChannelId ch) const;
    // The channel is gone: its id may be reused.
    void forget(ChannelId ch);
    // Records the GPU dropped before the host read them.
    std::uint64_t lost() const { return lost_; }

private:
    void drain() const;

    GpuDevice& gpu_;
    Sink sink_;
    mutable std::vector<CtxswRecord> buf_;
    mutable std::unordered_map<ChannelId, Time> left_;
    mutable ChannelId on_engine_ = 0;
    mutable std::uint64_t lost_ = 0;
};

}  // namespace pvgpu
