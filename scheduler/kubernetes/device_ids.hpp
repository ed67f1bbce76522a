// The devices pvgpu-device-plugin advertises: 100 units per GPU, 1 unit = 1%
// of a GPU's time, named gpu<G>-u<NNN> (gpu0-u000 .. gpu0-u099, gpu1-u000 ..).
// Which units a container gets, and the check that they come from one GPU,
// are kept here, apart from gRPC, so the unit tests reach them directly.
#pragma once

#include <optional>
#include <string>
#include <string_view>
#include <vector>

namespace pvgpu::k8s {

constexpr unsigned kUnitsPerGpu = 100;

struct Unit {
    unsigned gpu = 0;
    unsigned unit = 0;  // 0 .. kUnitsPerGpu - 1
    auto operator<=>(const Unit&) const = default;
};

// A request the plugin refuses: `message` is one line for kubelet's event.
// `exhausted`: the units asked for do not fit one GPU (not a malformed request).
struct AllocationError {
    std::string message;
    bool exhausted = false;
};

std::string device_id(Unit u);
// The unit an ID names, or nullopt when it is not one of ours.
std::optional<Unit> parse_device_id(std::string_view id);
// Every unit of `gpus` GPUs, GPU by GPU.
std::vector<std::string> all_device_ids(unsigned gpus);

// GetPreferredAllocation for one container: `size` units from one GPU, the
// GPU with the most free units among `available` that fits them (the lowest
// index on a tie), and that holds every ID of `must_include`.  Its
// must_include IDs come first, then its lowest-numbered free units.  Throws
// AllocationError for unknown IDs, must_include spanning GPUs or no GPU that
// fits.
std::vector<std::string> preferred_allocation(const std::vector<std::string>& available,
                                              const std::vector<std::string>& must_include, int size);

// What Allocate hands one container: the GPU its units are on and how many.
struct Grant {
    unsigned gpu = 0;
    unsigned units = 0;
};
// Checks one container's IDs against `gpus` advertised GPUs: all ours, on one
// GPU, no unit twice.  Throws AllocationError otherwise.
Grant grant_for(const std::vector<std::string>& ids, unsigned gpus);

}  // namespace pvgpu::k8s
