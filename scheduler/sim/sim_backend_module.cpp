// libpvgpu-backend-sim.so: the built-in simulated GPU as a loadable backend,
// to test pvgpud's dlopen path (and as an example of a backend library).
#include <pvgpu/backend.h>

extern "C" const pvgpu_backend_ops* pvgpu_sim_backend_entry(pvgpu_u32 host_abi_version);

extern "C" PVGPU_BACKEND_EXPORT const pvgpu_backend_ops* pvgpu_backend_entry(pvgpu_u32 host_abi_version) {
    return pvgpu_sim_backend_entry(host_abi_version);
}
