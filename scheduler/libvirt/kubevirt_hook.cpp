// pvgpu-kubevirt-hook (installed also as onDefineDomain): KubeVirt's
// onDefineDomain hook.  KubeVirt's sidecar-shim runs it as
//   onDefineDomain --vmi VMI_JSON --domain DOMAIN_XML
// and defines the domain XML it prints.  A VMI with pvgpu.org/ annotations
// (or a pod the pvgpu device plugin gave a GPU share, PVGPU_GPU) gets the
// pvgpu device wiring and the <pvgpu:gpu> metadata, written by the same code
// as `pvgpuctl attach` (domain_xml.cpp); any other domain comes back byte for
// byte.  Messages go to standard error; a non-zero exit fails the VM's start.
#include <pvgpu/abi.h>
#include <pvgpu/protocol.h>

#include <nlohmann/json.hpp>

#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <map>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "domain_xml.hpp"
#include "proto/share_text.hpp"
#include "pvgpu_paths.h"

#ifndef PVGPU_VERSION
#define PVGPU_VERSION "unknown"
#endif

namespace {

using json = nlohmann::json;

constexpr int kExitOk = 0;
constexpr int kExitRefused = 1;
constexpr int kExitUsage = 2;

constexpr const char* kProg = "pvgpu-kubevirt-hook";
constexpr std::string_view kAnnotationPrefix = "pvgpu.org/";
constexpr const char* kWeightKey = "pvgpu.org/weight";
constexpr const char* kGpuKey = "pvgpu.org/gpu";
constexpr const char* kMaxKey = "pvgpu.org/max";
constexpr const char* kMinKey = "pvgpu.org/min";
// The hook API versions whose OnDefineDomain the sidecar-shim serves; all
// pass the same --vmi/--domain arguments, so the hook works with each.
const std::vector<std::string> kHookApiVersions = {"v1alpha1", "v1alpha2", "v1alpha3"};
// PVGPU_GPU_SHARE's unit is 1% of a GPU (the device plugin's).
constexpr std::uint32_t kShareUnitsPerGpu = 100;

// Input the hook refuses (exit 1) and bad usage (exit 2): one line each.
struct Refused {
    std::string message;
};
struct UsageError {
    std::string message;
};

// A value as the messages show it: quoted, escaped, so the message stays one line.
// (Bytes that are not UTF-8 show as U+FFFD rather than failing the message.)
std::string quoted(const std::string& v) { return json(v).dump(-1, ' ', false, json::error_handler_t::replace); }

std::string usage() {
    return R"(usage: pvgpu-kubevirt-hook [--version V] --vmi VMI_JSON --domain DOMAIN_XML [--socket PATH]
       pvgpu-kubevirt-hook --version | --help

KubeVirt onDefineDomain hook (run by KubeVirt's sidecar-shim, which looks for
an executable named onDefineDomain): prints DOMAIN_XML with the pvgpu device
and the VM's GPU share added when the VMI asks for pvgpu, else unchanged.

VMI annotations (metadata.annotations):
  pvgpu.org/weight   the VM's weight, )" + std::to_string(PVGPU_WEIGHT_MIN) + ".." +
           std::to_string(PVGPU_WEIGHT_MAX) + " (default " + std::to_string(PVGPU_WEIGHT_DEFAULT) + R"()
  pvgpu.org/gpu      the host GPU's index (0..)" + std::to_string(PVGPU_MAX_GPUS - 1) + R"(), or "any": pvgpud places it
  pvgpu.org/max, pvgpu.org/min
                     refused: share caps and reservations are not in this
                     pvgpu yet

Environment:
  PVGPU_GPU          the GPU the pvgpu device plugin reserved the VM's share
                     on: the VM runs there (a pvgpu.org/gpu naming another
                     GPU is refused)
  PVGPU_GPU_SHARE    that reservation (1 unit = 1% of a GPU); noted on
                     stderr, not applied as a minimum yet
  PVGPU_SOCKET       pvgpud's client socket, when --socket is not given

Options:
  --socket PATH      pvgpud's client socket as QEMU sees it (default
                     $PVGPU_SOCKET or )" PVGPU_SOCKET_PATH R"()
  --version [V]      alone: print the version and the hook API versions;
                     before --vmi: the hook API version V the shim speaks
  -h, --help         this text

Exit status: 0 the domain XML is on stdout, 1 refused (an invalid or
unsupported annotation or environment value, malformed VMI JSON or domain
XML), 2 bad usage.
)";
}

struct Args {
    std::optional<std::string> vmi, domain, socket, api_version;
    bool help = false, version = false;
};

Args parse_args(int argc, char** argv) {
    Args a;
    for (int i = 1; i < argc; ++i) {
        std::string_view key = argv[i];
        std::optional<std::string> inline_value;
        if (const auto eq = key.find('='); eq != std::string_view::npos && key.starts_with("--")) {
            inline_value = std::string(key.substr(eq + 1));
            key = key.substr(0, eq);
        }
        auto value = [&]() -> std::string {
            if (inline_value) return *inline_value;
            if (i + 1 >= argc) throw UsageError{std::string(key) + " needs a value"};
            return argv[++i];
        };
        if (key == "-h" || key == "--help") {
            a.help = true;
        } else if (key == "--version") {
            // Alone (or last): print versions.  Followed by a value: the API version.
            if (inline_value || (i + 1 < argc && std::string_view(argv[i + 1]).rfind("--", 0) != 0))
                a.api_version = value();
            else
                a.version = true;
        } else if (key == "--vmi") {
            a.vmi = value();
        } else if (key == "--domain") {
            a.domain = value();
        } else if (key == "--socket") {
            a.socket = value();
            if (a.socket->empty()) throw UsageError{"--socket needs a path"};
        } else {
            throw UsageError{"unknown argument " + quoted(std::string(key))};
        }
    }
    return a;
}

void check_api_version(const std::string& v) {
    for (const auto& known : kHookApiVersions)
        if (v == known) return;
    std::string list;
    for (const auto& known : kHookApiVersions) list += (list.empty() ? "" : ", ") + known;
    throw UsageError{"--version: hook API version " + quoted(v) + " is not one of " + list};
}

// The VMI's pvgpu.org/ annotations.  Kubernetes annotations are strings; a
// key under pvgpu.org/ that the hook does not know is refused, so that a
// typo does not silently mean the default.
std::map<std::string, std::string> pvgpu_annotations(const std::string& vmi_text) {
    json vmi;
    try {
        vmi = json::parse(vmi_text);
    } catch (const json::parse_error& e) {
        throw Refused{std::string("--vmi: not JSON: ") + e.what()};
    }
    if (!vmi.is_object()) throw Refused{"--vmi: not a VirtualMachineInstance (a JSON object)"};
    const auto meta = vmi.find("metadata");
    if (meta == vmi.end() || meta->is_null()) return {};
    if (!meta->is_object()) throw Refused{"--vmi: metadata is not an object"};
    const auto ann = meta->find("annotations");
    if (ann == meta->end() || ann->is_null()) return {};
    if (!ann->is_object()) throw Refused{"--vmi: metadata.annotations is not an object"};
    std::map<std::string, std::string> out;
    for (const auto& [key, value] : ann->items()) {
        if (!std::string_view(key).starts_with(kAnnotationPrefix)) continue;
        if (key != kWeightKey && key != kGpuKey && key != kMaxKey && key != kMinKey)
            throw Refused{"annotation " + quoted(key) + ": unknown; pvgpu takes " + kWeightKey + " and " + kGpuKey};
        if (!value.is_string()) throw Refused{"annotation " + key + ": " + value.dump() + " is not a string"};
        out[key] = value.get<std::string>();
    }
    return out;
}

// An environment variable; nullopt when unset or empty (as pvgpuctl treats
// PVGPU_SOCKET).
std::optional<std::string> env(const char* name) {
    const char* v = std::getenv(name);
    if (!v || !*v) return std::nullopt;
    return std::string(v);
}

// What the device plugin allocated: the GPU and the share reserved on it.
struct Allocation {
    std::optional<std::uint32_t> gpu;
    std::optional<std::uint32_t> share;  // units, 1 = 1% of a GPU
};

Allocation read_allocation() {
    Allocation al;
    if (const auto g = env("PVGPU_GPU")) {
        al.gpu = pvgpu::parse_gpu_index(*g);
        if (!al.gpu)
            throw Refused{"environment PVGPU_GPU: " + quoted(*g) + " is not a GPU index from 0 to " +
                          std::to_string(PVGPU_MAX_GPUS - 1)};
    }
    if (const auto s = env("PVGPU_GPU_SHARE")) {
        al.share = pvgpu::decimal_in(*s, 1, kShareUnitsPerGpu);
        if (!al.share)
            throw Refused{"environment PVGPU_GPU_SHARE: " + quoted(*s) + " is not a whole number from 1 to " +
                          std::to_string(kShareUnitsPerGpu)};
        if (!al.gpu) throw Refused{"environment PVGPU_GPU_SHARE is set but PVGPU_GPU (the GPU it is on) is not"};
    }
    return al;
}

// The VM's metadata from its annotations and the allocation.
pvgpu::virt::GpuMetadata share_of(const std::map<std::string, std::string>& ann, const Allocation& al) {
    for (const char* key : {kMaxKey, kMinKey})
        if (ann.count(key))
            throw Refused{std::string("annotation ") + key +
                          ": share caps and reservations (issue \"Share controls\") are not in this pvgpu yet;" +
                          " remove the annotation"};
    pvgpu::virt::GpuMetadata m{PVGPU_WEIGHT_DEFAULT};
    if (const auto w = ann.find(kWeightKey); w != ann.end()) {
        const auto weight = pvgpu::parse_weight(w->second);
        if (!weight)
            throw Refused{std::string("annotation ") + kWeightKey + ": " + quoted(w->second) +
                          " is not a whole number from " + std::to_string(PVGPU_WEIGHT_MIN) + " to " +
                          std::to_string(PVGPU_WEIGHT_MAX)};
        m.weight = *weight;
    }
    if (const auto g = ann.find(kGpuKey); g != ann.end()) {
        const auto choice = pvgpu::parse_gpu_choice(g->second);
        if (!choice)
            throw Refused{std::string("annotation ") + kGpuKey + ": " + quoted(g->second) +
                          " is not a GPU index from 0 to " + std::to_string(PVGPU_MAX_GPUS - 1) + " or \"any\""};
        if (al.gpu && choice->index && *choice->index != *al.gpu)
            throw Refused{std::string("annotation ") + kGpuKey + ": " + quoted(g->second) + " names GPU " +
                          std::to_string(*choice->index) + " but the device plugin reserved the VM's share on GPU " +
                          std::to_string(*al.gpu) + " (PVGPU_GPU)"};
        m.device = choice->index;
    }
    if (al.gpu) m.device = al.gpu;  // the reservation's GPU, "any" included
    return m;
}

// The domain XML to KubeVirt; a short write fails the hook rather than
// handing back half a domain.
void write_out(std::string_view xml) {
    if (std::fwrite(xml.data(), 1, xml.size(), stdout) != xml.size() || std::fflush(stdout) != 0)
        throw Refused{std::string("writing the domain XML to standard output: ") + std::strerror(errno)};
}

int run(const Args& a) {
    if (a.api_version) check_api_version(*a.api_version);
    if (!a.vmi || !a.domain) throw UsageError{"--vmi and --domain are both required (see --help)"};
    const auto ann = pvgpu_annotations(*a.vmi);
    const Allocation al = read_allocation();
    if (ann.empty() && !al.gpu) {
        // Not a pvgpu VM: KubeVirt gets back exactly what it sent.
        write_out(*a.domain);
        return kExitOk;
    }
    const pvgpu::virt::GpuMetadata m = share_of(ann, al);
    const std::string socket = a.socket ? *a.socket : env("PVGPU_SOCKET").value_or(PVGPU_SOCKET_PATH);
    // A ',' would split QEMU's chardev options; said here, where it came from.
    if (socket.find(',') != std::string::npos)
        throw Refused{std::string(a.socket ? "--socket" : "environment PVGPU_SOCKET") + ": " + quoted(socket) +
                      " contains ',', which QEMU's -chardev cannot take"};
    std::string out;
    try {
        out = pvgpu::virt::attach_device(*a.domain, pvgpu::virt::DeviceWiring{socket, 0, "", m.device}, m);
    } catch (const pvgpu::virt::XmlError& e) {
        throw Refused{std::string("--domain: ") + e.what()};
    }
    write_out(out);
    const std::string on = m.device ? "GPU " + std::to_string(*m.device) : "any GPU (pvgpud places it)";
    std::fprintf(stderr, "%s: pvgpu device added (socket %s), weight %u, %s\n", kProg, socket.c_str(), m.weight,
                 on.c_str());
    if (al.share)
        std::fprintf(stderr,
                     "%s: PVGPU_GPU_SHARE=%u: the reservation of %u%% of GPU %u is not applied as the VM's minimum "
                     "share (share controls are not in this pvgpu yet); the VM is placed on GPU %u\n",
                     kProg, *al.share, *al.share, *al.gpu, *al.gpu);
    return kExitOk;
}

}  // namespace

int main(int argc, char** argv) {
    try {
        const Args a = parse_args(argc, argv);
        if (a.help) {
            std::fputs(usage().c_str(), stdout);
            return kExitOk;
        }
        if (a.version && !a.vmi && !a.domain) {
            std::printf("%s %s\nhook API versions:", kProg, PVGPU_VERSION);
            for (const auto& v : kHookApiVersions) std::printf(" %s", v.c_str());
            std::printf("\n");
            return kExitOk;
        }
        return run(a);
    } catch (const UsageError& e) {
        std::fprintf(stderr, "%s: %s\n", kProg, e.message.c_str());
        return kExitUsage;
    } catch (const Refused& e) {
        std::fprintf(stderr, "%s: %s\n", kProg, e.message.c_str());
        return kExitRefused;
    } catch (const std::exception& e) {
        std::fprintf(stderr, "%s: %s\n", kProg, e.what());
        return kExitRefused;
    }
}
