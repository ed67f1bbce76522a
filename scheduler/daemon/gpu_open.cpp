#include "gpu_open.hpp"

#include "log.hpp"

namespace pvgpu::daemon {

std::unique_ptr<BackendGpu> open_gpu_device(std::uint32_t index, const GpuConfig& gpu, const Clock& clock,
                                            Timers& timers) {
    const std::string who = "GPU " + std::to_string(index) + " (" + gpu.name + ")";
    BackendHooks hooks;
    hooks.log = [who](int level, std::string_view msg) {
        const std::string line = who + ": " + std::string(msg);
        switch (level) {
        case PVGPU_BACKEND_LOG_ERROR: log_error(line); break;
        case PVGPU_BACKEND_LOG_WARNING: log_warning(line); break;
        case PVGPU_BACKEND_LOG_INFO: log_info(line); break;
        default: log_debug(line); break;
        }
    };
    try {
        return open_backend(gpu.backend, backend_options(gpu), clock, timers, std::move(hooks));
    } catch (const BackendError& e) {
        throw BackendError(who + ": " + e.what());
    }
}

}  // namespace pvgpu::daemon
