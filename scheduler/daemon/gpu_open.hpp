// Opening one configured GPU for pvgpud through the backend ABI
// (include/pvgpu/backend.h): the built-in simulated GPU or a backend
// module, with the engine keys of its [gpu.N] group as options.  Throws
// BackendError naming the GPU, its backend and why.
#pragma once

#include <memory>
#include <string>

#include "backend/backend_gpu.hpp"
#include "config.hpp"
#include "core/time.hpp"

namespace pvgpu::daemon {

std::unique_ptr<BackendGpu> open_gpu_device(std::uint32_t index, const GpuConfig& gpu, const Clock& clock,
                                            Timers& timers);

}  // namespace pvgpu::daemon
