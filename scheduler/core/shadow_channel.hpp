// The guest-visible side of a channel's control page and the three ways the
// hypervisor can map it (thesis 4.3, LoGV):
//   Direct   - guest IB_PUT writes reach the GPU; nothing is trapped.
//   Trapped  - every IB_PUT write exits to the host, is reported, then forwarded.
//   Shadowed - the page is a private RAM page: the guest keeps writing, the GPU
//              sees nothing; the work is held, not lost.  (A store no ring
//              could hold is not work: it goes through, for the GPU to reject.)
// Unshadowing is race-free: the page traps first, then the held IB_PUT is copied
// to the GPU (all of it, or a partial release), then the real page is mapped.
// FENCE lives in semaphore memory that is never remapped, so a guest always sees
// completions of work the GPU already has.
#pragma once

#include <cstdint>
#include <functional>
#include <optional>
#include <string_view>

#include "gpu_device.hpp"

namespace pvgpu {

enum class ChannelMode { Direct, Trapped, Shadowed };
std::string_view to_string(ChannelMode m);

class ShadowChannel {
public:
    // Called for each trapped doorbell write, before it is forwarded.
    using TrapHandler = std::function<void(ChannelId, std::uint32_t put)>;

    // Called when a shadowed channel's guest stores new work into the shadow
    // page: the device reports it on the doorbell store, which exits.
    using HeldHandler = std::function<void(ChannelId, std::uint32_t held)>;

    ShadowChannel(GpuDevice& gpu, ChannelId ch, TrapHandler on_trap, HeldHandler on_held = {});

    ChannelId id() const { return ch_; }
    ChannelMode mode() const { return mode_; }

    // --- guest side: what a store to / load from the mapped page does ---
    // Returns true when the write trapped (the vCPU exited).
    bool guest_write_put(std::uint32_t put);
    std::uint32_t guest_read_put() const;
    std::uint32_t guest_read_get() const;
    std::uint32_t guest_read_fence() const { return gpu_->read_fence(ch_); }
    pvgpu_ring* ring() { return gpu_->ring(ch_); }

    // --- host side ---
    void set_trapped();   // Direct -> Trapped, or Shadowed -> Trapped releasing everything
    void set_direct();    // any -> Direct, releasing everything held
    void set_shadowed();  // any -> Shadowed, freezing what the guest sees
    // While shadowed: hand at most `max` held entries to the GPU.  Returns how many.
    std::uint32_t release(std::uint32_t max);
    // The GPU reported the channel stopped (its error interrupt).
    void set_dead() { dead_ = true; }
    // Entries the guest wrote that the GPU has not been given.
    std::uint32_t held() const { return guest_put_ - gpu_put_; }
    // The GPU's IB_PUT, where the host knows it without a register read:
    // trapped or shadowed, every store to it is the host's own.  A direct
    // guest stores to the GPU unseen (the model passes its stores through
    // here, but a host would not): nullopt.
    std::optional<std::uint32_t> known_gpu_put() const {
        if (mode_ == ChannelMode::Direct) return std::nullopt;
        return gpu_put_;
    }
    // IB_PUT as last given to the GPU.  Right after a release or an
    // unshadow it is the host's own store, whatever the mode is now.
    std::uint32_t put_given() const { return gpu_put_; }
    // Entries handed to the GPU by release()/unshadow since the last call.
    std::uint32_t take_released() {
        auto r = released_;
        released_ = 0;
        return r;
    }

private:
    // A store more than a ring ahead of the GPU's IB_PUT, or behind it,
    // cannot name held work: it is the GPU's to judge (BAD_ENTRY kills the
    // channel), not the host's to hold, so it goes through even while
    // shadowed.  Held, it would keep a broken channel alive, make held()
    // wrap, and reach the GPU only at some later release.
    bool beyond_ring(std::uint32_t put) const;
    // Writes the GPU's IB_PUT and remembers it.
    void forward(std::uint32_t put);

    GpuDevice* gpu_;
    ChannelId ch_;
    TrapHandler on_trap_;
    HeldHandler on_held_;
    ChannelMode mode_ = ChannelMode::Direct;
    std::uint32_t guest_put_ = 0;    // IB_PUT as the guest last wrote it
    std::uint32_t gpu_put_ = 0;      // IB_PUT as the GPU was last given it
    std::uint32_t shadow_get_ = 0;   // IB_GET frozen in the shadow page
    std::uint32_t released_ = 0;
    bool dead_ = false;
};

}  // namespace pvgpu
