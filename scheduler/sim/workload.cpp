#include "workload.hpp"

#include <algorithm>
#include <cmath>

namespace pvgpu::sim {

std::uint64_t Rng::next() {
    std::uint64_t z = (state_ += 0x9e3779b97f4a7c15ULL);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ULL;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebULL;
    return z ^ (z >> 31);
}

double Rng::uniform01() { return static_cast<double>(next() >> 11) * 0x1.0p-53; }

Duration Rng::sample(const Dist& d) {
    double us = d.a;
    switch (d.kind) {
    case Dist::Kind::Fixed: break;
    case Dist::Kind::Uniform: us = d.a + (d.b - d.a) * uniform01(); break;
    case Dist::Kind::Exp: us = -d.a * std::log(1.0 - uniform01()); break;
    }
    return std::max<Duration>(1, from_us(us));
}

SubmitLoop::SubmitLoop(EventLoop& loop, SimGpu& gpu, Scheduler& sched, ChannelId ch,
                       const Workload& w, std::uint64_t seed, DemandListener on_demand)
    : loop_(loop), gpu_(gpu), sched_(sched), ch_(ch), w_(w), rng_(seed),
      on_demand_(std::move(on_demand)), start_(from_us(w.start_ms * 1000)) {
    gpu_.set_fence_watcher(ch_, [this](std::uint32_t f) { on_fence(f); });
}

SubmitLoop::~SubmitLoop() { loop_.cancel(forge_timer_); }

// A real cheater rewrites its page from a CPU loop at any time; every 10 us
// and around each of its own doorbells and completions is as good here: the
// GPU's copy never survives long enough for a host read to depend on it.
void SubmitLoop::pin_page() {
    pvgpu_ctrl_page* page = gpu_.control_page(ch_);
    page->ib_get = 0;
    page->fence = put_;
}

void SubmitLoop::forge() {
    forge_timer_ = kNoTimer;
    if (failed_) return;
    pin_page();
    forge_timer_ = loop_.arm(loop_.now() + 10 * kMicrosecond, [this] { forge(); });
}

double SubmitLoop::demand() const {
    double busy = w_.kernel_us.mean() * w_.batch;
    return std::min(1.0, busy / (busy + w_.gap_us));
}

void SubmitLoop::start() {
    loop_.arm(start_, [this] {
        batch_left_ = w_.batch;
        submit_next();
        if (w_.forge_progress) forge();
    });
}

void SubmitLoop::set_outstanding(bool v) {
    if (v == outstanding_) return;
    outstanding_ = v;
    if (on_demand_) on_demand_(v);
}

void SubmitLoop::submit_next() {
    if (failed_) return;
    if (w_.kernels != 0) {
        std::uint64_t left = w_.kernels - submitted_;
        batch_left_ = static_cast<std::uint32_t>(std::min<std::uint64_t>(batch_left_, left));
    }
    if (batch_left_ == 0) return;
    ShadowChannel& sc = sched_.channel(ch_);
    pvgpu_ring_entry& e = sc.ring()->entries[put_ & PVGPU_RING_MASK];
    e.payload = static_cast<std::uint64_t>(rng_.sample(w_.kernel_us));
    e.fence = put_ + 1;
    e.flags = PVGPU_ENTRY_IRQ;
    ++put_;
    ++submitted_;
    --batch_left_;
    if (on_submit_) on_submit_(ch_);
    if (batch_left_ == 0) batch_fence_ = put_;
    set_outstanding(true);
    std::uint32_t put = put_;
    auto write = [this, put] {
        sched_.channel(ch_).guest_write_put(put);
        if (w_.forge_progress) pin_page();
        if (batch_left_ != 0) submit_next();
    };
    // A trapped store exits to the host first: it lands (and the vCPU goes
    // on) only after the exit is handled.
    if (sc.mode() == ChannelMode::Trapped)
        loop_.arm(loop_.now() + sched_.costs().trap, write);
    else
        write();
}

void SubmitLoop::on_fence(std::uint32_t fence) {
    ++completed_;
    if (w_.forge_progress) pin_page();
    if (fence != batch_fence_ || batch_left_ != 0) return;
    set_outstanding(false);
    if (w_.kernels != 0 && submitted_ >= w_.kernels) {
        finished_ = loop_.now();
        return;
    }
    // The next batch starts after the CPU gap.
    Duration delay = from_us(w_.gap_us);
    loop_.arm(loop_.now() + delay, [this] {
        batch_left_ = w_.batch;
        submit_next();
    });
}

}  // namespace pvgpu::sim
