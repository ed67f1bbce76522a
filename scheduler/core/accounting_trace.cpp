// Accounting from the GPU's context-switch trace (Accounting::set_trace).
//
// The trace dates every change of the channel on the engine, so a stint is
// charged exactly: from the record that loaded the channel to the record
// that loaded the next one (or idled the engine).  The stint still running
// is charged up to each read, so a listener hears GPU time as it is used.
//
// Worked example, one engine, channels a and b, records read at 5 ms:
//     0.0 ms  a        a charged 2.0 ms   (0.0 .. 2.0)
//     2.0 ms  b        b charged 1.5 ms   (2.0 .. 3.5)
//     3.5 ms  idle
//     4.0 ms  a        a charged 1.0 ms   (4.0 .. 5.0), and on from 5.0
// GET then says how many kernels each completed, which teaches their mean
// length whenever the channel is off the engine with nothing half-run.
#include <algorithm>
#include <cstdlib>

#include "accounting.hpp"

namespace pvgpu {
namespace {

// While the engine is busy the trace is read at least this often: the
// stint running is charged up to each read (a tenant that asks for no
// interrupt still has its time heard within this), and a GPU's trace
// buffer (4096 records in the simulated GPU) does not fill between reads
// unless channels change more than every 2.4 us.
constexpr Duration kTraceSync = 10 * kMillisecond;

}  // namespace

void Accounting::set_trace(TraceSync sync) {
    trace_sync_ = std::move(sync);
    // Nothing is guessed: no looks, no traps.
    idle_trap_timer_.cancel();
    read_timer_.cancel();
    idle_trap_ = false;
}

void Accounting::trace_switch(const CtxswRecord& r) {
    const std::optional<ChannelId> next = r.to != 0 ? std::optional<ChannelId>(r.to) : std::nullopt;
    if (next == current_) return;
    const Time at = std::max(r.at, since_);
    if (current_) {
        auto it = channels_.find(*current_);
        if (it != channels_.end()) {
            charge(*current_, at - since_);
            it->second.closed += it->second.kernel_charged + (at - since_);
            it->second.kernel_charged = 0;
            trace_left_.push_back(*current_);
        }
    }
    current_ = next;
    since_ = at;
    events_.push_back({false, 0, 0, current_});
}

void Accounting::trace_lost(std::uint64_t n) {
    // What ran in the gap is unknown: none of it is charged.  The engine
    // register says who runs now; from now on the records are whole again.
    trace_lost_ += n;
    const std::optional<ChannelId> running = read();
    current_ = running;
    since_ = clock_.now();
    events_.push_back({false, 0, 0, current_});
}

void Accounting::traced_sync() {
    trace_left_.clear();
    trace_sync_();
    // The stint running is charged up to now (kernel_charged keeps what
    // of it was charged so, for the next closed stint).
    const Time now = clock_.now();
    if (current_ && now > since_) {
        if (auto it = channels_.find(*current_); it != channels_.end()) {
            charge(*current_, now - since_);
            it->second.kernel_charged += now - since_;
        }
        since_ = now;
    }
    for (ChannelId ch : trace_left_) traced_learn(ch);
    trace_left_.clear();
    arm_trace_timer();
}

void Accounting::traced_learn(ChannelId ch) {
    auto it = channels_.find(ch);
    if (it == channels_.end() || current_ == ch || !fetched_) return;
    Channel& c = it->second;
    c.learned_closed += c.closed;
    c.closed = 0;
    // Off the engine, every kernel GET counts has ended, unless a
    // preemptive engine took one off half-run: then wait for a time the
    // channel has nothing pending.
    if (engine_.preemptive && pending_ && pending_(ch)) return;
    const std::uint32_t get = fetched_(ch);
    const auto n = static_cast<std::int32_t>(get - c.learned_get);
    if (n <= 0) return;
    const Duration mean = c.learned_closed / n;
    c.learned_get = get;
    c.learned_closed = 0;
    c.kernel.learn_length(mean);
}

void Accounting::arm_trace_timer() {
    if (!current_) {
        trace_timer_.cancel();
        return;
    }
    if (!trace_timer_.armed())
        trace_timer_.arm(clock_.now() + kTraceSync, [this] {
            Entry entry(*this);
            traced_sync();
        });
}

}  // namespace pvgpu
