// What the accounting has learned of one channel's kernels: their mean
// length and spread, from kernels seen whole; while that is unknown, the
// bounds the looks proved of its kernels one by one, and its think time
// (how long after its own completion its next kernel started on an idle
// engine).  A value: it touches nothing but itself.
#pragma once

#include "time.hpp"

namespace pvgpu {

struct KernelModel {
    // A start seen between two reads this close is taken as exactly known.
    static constexpr Duration kExactStart = 2 * kMicrosecond;

    Duration estimate = 0;  // learned from whole kernels seen start to end; 0: none yet
    Duration spread = 0;    // mean deviation of those from the estimate
    // While its length is unknown: how long after its own completion
    // its next kernel started on an idle engine, as far as the looks
    // placed it ([think_lo, think_hi]; think_hi < 0: not yet).
    Duration think_lo = 0, think_hi = -1;
    // While its length is unknown: what the looks proved of it, kernel by
    // kernel ([len_lo, len_hi]; len_hi < 0: nothing yet).  A kernel seen
    // on the engine in a window is bounded both ways, one that started
    // after the last look from above.  Kernels of one length narrow this
    // to it even when no look sees a start exactly (the think time
    // jitters); bounds that contradict say the length changed.
    Duration len_lo = 0, len_hi = -1;
    int len_kernels = 0;  // kernels whose bounds agreed on [len_lo, len_hi]

    // One more sample of its kernel length, whole kernels only (TCP's SRTT
    // and RTTVAR: a mean that follows a change within a few samples, and
    // how far one sample strays from it).  The first sample's spread is
    // half of it, as TCP starts RTTVAR.
    void learn_length(Duration whole);
    // One kernel ran at least lo and at most hi (len_lo, len_hi); learned
    // once enough kernels in a row agree on a narrow enough window.
    void learn_bounds(Duration lo, Duration hi);
    // Its previous kernel completed at `done`, and the next started on an
    // idle engine in [lo, hi]: narrows the think window.
    void learn_think(Time done, Time lo, Time hi);
    // The learned length is proven wrong: forget it, and what taught it.
    void relearn();
};

}  // namespace pvgpu
