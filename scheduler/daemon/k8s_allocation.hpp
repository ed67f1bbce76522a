// The allocation file of a Kubernetes pod (issue 55, docs/kubernetes.md):
// pvgpu-device-plugin writes {"gpu": N, "units": K, "devices": [...]} for
// each container whose pvgpu.org/gpu-share units kubelet reserved, and
// kubelet mounts it read-only into the compute container.  pvgpud reads it
// as the VMM process sees it (through /proc/PID/root), so that a VM whose
// device names no GPU lands on the one the cluster reserved for its pod.
#pragma once

#include <sys/types.h>

#include <cstddef>
#include <cstdint>
#include <optional>
#include <string>
#include <string_view>

namespace pvgpu::daemon {

// Larger is not a file the plugin wrote.
inline constexpr std::size_t kMaxAllocationFileBytes = 4096;

// What the file's text says: the GPU, or why it says none (one line, for
// the refused client and the log).  Fields other than "gpu" are ignored.
struct AllocationParse {
    std::optional<std::uint32_t> gpu;
    std::string error;
};
// `gpus`: the number of GPUs of this host (a gpu at or above it is an error).
AllocationParse parse_allocation(std::string_view text, std::size_t gpus);

// The file as process `pid` sees it.  Absent: no file there, or no such
// process (no reservation); Text: its contents in `text`; Error: why it
// cannot be read, in `text`.
struct AllocationRead {
    enum class Kind { Absent, Text, Error };
    Kind kind = Kind::Absent;
    std::string text;
};
// `path` is absolute and resolved inside the process's root directory: its
// symbolic links cannot lead out of it, and the file itself may not be one.
AllocationRead read_allocation_file(pid_t pid, const std::string& path);

}  // namespace pvgpu::daemon
