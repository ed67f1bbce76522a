// Metrics for Prometheus in the text exposition format (version 0.0.4),
// written as a file for node_exporter's textfile collector.  The text is
// rendered from the admin protocol's `list` and `stats` replies, so the
// exporter shows exactly what pvgpuctl shows.  The file is replaced
// atomically (write a temporary file in the same directory, fsync, rename),
// so the collector never reads a half-written file.
#pragma once

#include <functional>
#include <nlohmann/json.hpp>
#include <string>

#include "core/time.hpp"
#include "proto/atomic_file.hpp"  // write_file_atomically

namespace pvgpu::daemon {

// The exposition text for one `list` and one `stats` reply (admin protocol 2
// or later).  Every per-entity and per-GPU series carries a label gpu="N"
// (the GPU's index; pvgpu_gpu_info maps it to the GPU's name).  Admin
// protocol 4 reports per GPU in "gpus"; an older reply, without it, is one
// GPU, gpu="0".
std::string render_prometheus(const nlohmann::json& list, const nlohmann::json& stats);

// Rewrites the textfile every `interval` with what `render` returns; a
// failed write is logged (once per distinct error) and retried next time.
class TextfileExporter {
public:
    using Render = std::function<std::string()>;
    TextfileExporter(std::string path, Duration interval, const Clock& clock, Timers& timers, Render render);
    TextfileExporter(const TextfileExporter&) = delete;
    TextfileExporter& operator=(const TextfileExporter&) = delete;
    // Removes the file: stale metrics must not outlive the daemon.
    ~TextfileExporter();

    // Writes now; returns whether the write succeeded.
    bool write_now();

private:
    void tick();

    std::string path_;
    Duration interval_;
    const Clock& clock_;
    Timer timer_;
    Render render_;
    std::string last_error_;
};

}  // namespace pvgpu::daemon
