#include "shadow_channel.hpp"

namespace pvgpu {

std::string_view to_string(ChannelMode m) {
    switch (m) {
    case ChannelMode::Direct: return "direct";
    case ChannelMode::Trapped: return "trapped";
    case ChannelMode::Shadowed: return "shadowed";
    }
    return "?";
}

ShadowChannel::ShadowChannel(GpuDevice& gpu, ChannelId ch, TrapHandler on_trap, HeldHandler on_held)
    : gpu_(&gpu), ch_(ch), on_trap_(std::move(on_trap)), on_held_(std::move(on_held)),
      guest_put_(gpu.read_ib_put(ch)), gpu_put_(guest_put_) {}

void ShadowChannel::forward(std::uint32_t put) {
    gpu_->write_ib_put(ch_, put);
    gpu_put_ = put;
}

bool ShadowChannel::guest_write_put(std::uint32_t put) {
    const std::uint32_t before = guest_put_;
    guest_put_ = put;
    switch (mode_) {
    case ChannelMode::Direct:
        forward(put);
        return false;
    case ChannelMode::Trapped:
        if (on_trap_) on_trap_(ch_, put);
        // The handler may have shadowed the channel; then the write is held.
        if (mode_ != ChannelMode::Shadowed || beyond_ring(put)) forward(put);
        return true;
    case ChannelMode::Shadowed:
        if (beyond_ring(put)) {
            forward(put);
            return false;
        }
        if (put != before && on_held_) on_held_(ch_, held());
        return false;
    }
    return false;
}

bool ShadowChannel::beyond_ring(std::uint32_t put) const {
    // More held than a ring, or "held" behind what the GPU already has.
    return put - gpu_put_ > PVGPU_RING_ENTRIES;
}

std::uint32_t ShadowChannel::guest_read_put() const { return guest_put_; }

std::uint32_t ShadowChannel::guest_read_get() const {
    return mode_ == ChannelMode::Shadowed ? shadow_get_ : gpu_->read_ib_get(ch_);
}

std::uint32_t ShadowChannel::release(std::uint32_t max) {
    // A dead channel runs nothing more: hand it nothing.  (Between its
    // death and the error interrupt the host cannot know; what it hands
    // over then is lost with the channel, as on hardware.)
    if (dead_) return 0;
    std::uint32_t h = held();
    std::uint32_t n = h < max ? h : max;
    if (n == 0) return 0;
    forward(gpu_put_ + n);
    released_ += n;
    return n;
}

void ShadowChannel::set_trapped() {
    // Trap first so a guest store racing with the switch is seen, then copy.
    ChannelMode old = mode_;
    mode_ = ChannelMode::Trapped;
    if (old == ChannelMode::Shadowed) release(held());
}

void ShadowChannel::set_direct() {
    if (mode_ == ChannelMode::Shadowed) set_trapped();
    mode_ = ChannelMode::Direct;
}

void ShadowChannel::set_shadowed() {
    if (mode_ == ChannelMode::Shadowed) return;
    shadow_get_ = gpu_->read_ib_get(ch_);
    mode_ = ChannelMode::Shadowed;
}

}  // namespace pvgpu
