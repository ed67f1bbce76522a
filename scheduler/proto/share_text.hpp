// A VM's share as text: the weight and GPU values pvgpuctl's options, the
// domain metadata and the KubeVirt hook's annotations take.  One set of
// rules so that every front end accepts the same values; each caller words
// its own error.  Header-only: pvgpuctl built without libvirt uses it too.
#pragma once

#include <pvgpu/abi.h>       // PVGPU_WEIGHT_MIN, PVGPU_WEIGHT_MAX
#include <pvgpu/protocol.h>  // PVGPU_MAX_GPUS

#include <charconv>
#include <cstdint>
#include <optional>
#include <string_view>

namespace pvgpu {

// A decimal in lo..hi with nothing around it (no sign, space or exponent):
// "0200" is 200, " 200", "+200" and "2e2" are not numbers.
inline std::optional<std::uint32_t> decimal_in(std::string_view text, std::uint32_t lo, std::uint32_t hi) {
    std::uint64_t n = 0;
    const auto [end, ec] = std::from_chars(text.data(), text.data() + text.size(), n);
    if (text.empty() || ec != std::errc{} || end != text.data() + text.size() || n < lo || n > hi)
        return std::nullopt;
    return static_cast<std::uint32_t>(n);
}

// A weight, PVGPU_WEIGHT_MIN..PVGPU_WEIGHT_MAX; nullopt: not one.
inline std::optional<std::uint32_t> parse_weight(std::string_view text) {
    return decimal_in(text, PVGPU_WEIGHT_MIN, PVGPU_WEIGHT_MAX);
}

// A GPU index, 0..PVGPU_MAX_GPUS-1; nullopt: not one.
inline std::optional<std::uint32_t> parse_gpu_index(std::string_view text) {
    return decimal_in(text, 0, PVGPU_MAX_GPUS - 1);
}

// Where a VM runs: "any" (index nullopt: pvgpud places it) or a GPU index.
struct GpuChoice {
    std::optional<std::uint32_t> index;
};

// nullopt: neither "any" nor a GPU index.
inline std::optional<GpuChoice> parse_gpu_choice(std::string_view text) {
    if (text == "any") return GpuChoice{std::nullopt};
    const std::optional<std::uint32_t> n = parse_gpu_index(text);
    return n ? std::optional<GpuChoice>(GpuChoice{n}) : std::nullopt;
}

}  // namespace pvgpu
