#include "kernel_model.hpp"

#include <algorithm>

namespace pvgpu {

namespace {

// A length is learned from bounds (learn_bounds) once this many kernels in a
// row agreed and they narrowed to a 64th of it: kernels of varied lengths
// whose wide windows happen to overlap for a while teach nothing.
constexpr int kBoundKernels = 16;

}  // namespace

void KernelModel::learn_length(Duration whole) {
    if (estimate == 0) {
        estimate = whole;
        spread = whole / 2;
        return;
    }
    const Duration dev = whole > estimate ? whole - estimate : estimate - whole;
    spread += (dev - spread) / 4;
    estimate += (whole - estimate) / 8;
}

void KernelModel::learn_bounds(Duration lo, Duration hi) {
    if (estimate > 0 || hi < 0) return;
    lo = std::max<Duration>(0, lo);
    // Bounds of the same length seen again: keep what both allow.  Apart:
    // its kernels changed, start over from these.
    if (len_hi >= 0 && lo <= len_hi && hi >= len_lo) {
        lo = std::max(lo, len_lo);
        hi = std::min(hi, len_hi);
        ++len_kernels;
    } else {
        len_kernels = 1;
    }
    len_lo = lo;
    len_hi = hi;
    // Narrow enough to charge by (a 64th of the length at most): learned.
    if (hi > 0 && hi - lo <= std::max(kExactStart, hi / 64) && len_kernels >= kBoundKernels) {
        learn_length(lo + (hi - lo) / 2);
        spread = (hi - lo) / 2;  // every kernel seen fits
    }
}

void KernelModel::learn_think(Time done, Time lo, Time hi) {
    // Its previous completion: the kernel that started in [lo, hi] had not
    // ended before it.
    if (estimate > 0 || done < 0 || done > lo) return;
    Duration lo_think = lo - done, hi_think = hi - done;
    // The same think time seen again: keep what both windows allow.
    // Windows that only touch are not the same: a start seen at the look
    // that ended one window and began the next would pin it to a point.
    if (think_hi >= 0 && lo_think < think_hi && hi_think > think_lo) {
        lo_think = std::max(lo_think, think_lo);
        hi_think = std::min(hi_think, think_hi);
    }
    think_lo = lo_think;
    think_hi = hi_think;
}

void KernelModel::relearn() {
    estimate = spread = 0;
    think_lo = 0;
    think_hi = -1;
    len_lo = 0;
    len_hi = -1;
}

}  // namespace pvgpu
