// Opening one configured GPU for pvgpud: its backend, with the options of
// its [gpu.N] group.  Throws std::runtime_error naming the GPU and why.
#pragma once

#include <memory>
#include <string>

#include "config.hpp"
#include "core/gpu_device.hpp"
#include "core/time.hpp"

namespace pvgpu::sim {
class SimGpu;
}

namespace pvgpu::daemon {

struct OpenedGpu {
    std::unique_ptr<GpuDevice> device;
    std::string arbitration;  // "round-robin", "timeslice", or the backend's word
    std::string description;  // for the log
    const sim::SimGpu* sim = nullptr;
};

OpenedGpu open_gpu_device(const GpuConfig& gpu, const Clock& clock, Timers& timers);

}  // namespace pvgpu::daemon
