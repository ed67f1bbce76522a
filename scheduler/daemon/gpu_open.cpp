#include "gpu_open.hpp"

#include <charconv>
#include <stdexcept>

#include "sim/sim_gpu.hpp"

namespace pvgpu::daemon {

OpenedGpu open_gpu_device(const GpuConfig& gpu, const Clock& clock, Timers& timers) {
    if (gpu.backend != "sim") throw std::runtime_error(gpu.name + ": backend " + gpu.backend + ": not supported yet");
    sim::SimGpuConfig c;
    if (gpu.arbitration)
        c.arbitration = *gpu.arbitration == "timeslice" ? sim::Arbitration::Timeslice : sim::Arbitration::RoundRobin;
    if (gpu.timeslice_us) c.timeslice = *gpu.timeslice_us * kMicrosecond;
    if (gpu.ctxsw_us) c.ctxsw = *gpu.ctxsw_us * kMicrosecond;
    if (gpu.preempt_us) c.preempt = *gpu.preempt_us * kMicrosecond;
    if (gpu.watchdog_ms) c.watchdog = *gpu.watchdog_ms * kMillisecond;
    auto dev = std::make_unique<sim::SimGpu>(clock, timers, c);
    OpenedGpu o;
    o.sim = dev.get();
    o.arbitration = std::string(sim::to_string(c.arbitration));
    o.description = "simulated GPU, " + o.arbitration + ", watchdog " + std::to_string(c.watchdog / kMillisecond) + " ms";
    o.device = std::move(dev);
    return o;
}

}  // namespace pvgpu::daemon
