// The DevicePlugin service (plugin_service.hpp).
#include "plugin_service.hpp"

#include <sys/stat.h>

#include <algorithm>
#include <cerrno>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <nlohmann/json.hpp>
#include <vector>

#include "device_ids.hpp"
#include "proto/atomic_file.hpp"

namespace pvgpu::k8s {

namespace {

constexpr const char* kHealthy = "Healthy";  // kubelet's constants.go
constexpr const char* kUnhealthy = "Unhealthy";

void fill_devices(const DeviceState::View& v, v1beta1::ListAndWatchResponse* out) {
    for (const auto& id : all_device_ids(v.gpus)) {
        auto* d = out->add_devices();
        d->set_id(id);
        d->set_health(v.healthy ? kHealthy : kUnhealthy);
    }
}

std::string joined(const google::protobuf::RepeatedPtrField<std::string>& ids) {
    std::string s;
    for (const auto& id : ids) s += (s.empty() ? "" : ",") + id;
    return s.size() > 200 ? s.substr(0, 200) + "..." : s;
}

grpc::Status refused(const char* call, const AllocationError& e) {
    log_line(std::string(call) + " refused: " + e.message);
    return {e.exhausted ? grpc::StatusCode::RESOURCE_EXHAUSTED : grpc::StatusCode::INVALID_ARGUMENT, e.message};
}

// The file name of an allocation: 16 hex digits of FNV-1a 64 of its sorted
// IDs joined by ",", so that the same units reuse one file.
std::string allocation_name(const std::vector<std::string>& sorted_ids) {
    std::uint64_t h = 0xcbf29ce484222325ull;
    const auto add = [&h](unsigned char c) { h = (h ^ c) * 0x100000001b3ull; };
    for (std::size_t i = 0; i < sorted_ids.size(); ++i) {
        if (i) add(',');
        for (const char c : sorted_ids[i]) add(static_cast<unsigned char>(c));
    }
    char name[24];
    std::snprintf(name, sizeof name, "%016llx", static_cast<unsigned long long>(h));
    return name;
}

struct WriteError {
    std::string message;
};

// The allocation's file in `dir` (created 0755 when missing): its path.
std::string write_allocation(const std::string& dir, const Grant& g, std::vector<std::string> ids) {
    std::sort(ids.begin(), ids.end());
    const std::string path = (std::filesystem::path(dir) / (allocation_name(ids) + ".json")).string();
    std::error_code ec;
    if (!std::filesystem::is_directory(dir, ec)) {
        std::filesystem::create_directories(std::filesystem::path(dir).parent_path(), ec);
        if (::mkdir(dir.c_str(), 0755) != 0 && errno != EEXIST)
            throw WriteError{"cannot create " + dir + " for " + path + ": " + std::strerror(errno)};
    }
    const nlohmann::json doc = {{"gpu", g.gpu}, {"units", g.units}, {"devices", ids}};
    try {
        write_file_atomically(path, doc.dump() + "\n");
    } catch (const std::runtime_error& e) {
        throw WriteError{"cannot write " + path + ": " + e.what()};
    }
    return path;
}

}  // namespace

void log_line(const std::string& message) {
    static std::mutex mu;
    const std::lock_guard lock(mu);
    std::fprintf(stderr, "pvgpu-device-plugin: %s\n", message.c_str());
    std::fflush(stderr);
}

// ---- DeviceState --------------------------------------------------------------

bool DeviceState::set(unsigned gpus, bool healthy) {
    {
        const std::lock_guard lock(mu_);
        if (view_.gpus == gpus && view_.healthy == healthy) return false;
        view_.gpus = gpus;
        view_.healthy = healthy;
        ++view_.generation;
    }
    cv_.notify_all();
    return true;
}

DeviceState::View DeviceState::current() const {
    const std::lock_guard lock(mu_);
    return view_;
}

DeviceState::View DeviceState::wait_change(const View& seen, std::chrono::milliseconds timeout) const {
    std::unique_lock lock(mu_);
    cv_.wait_for(lock, timeout,
                 [&] { return view_.generation != seen.generation || view_.epoch != seen.epoch; });
    return view_;
}

void DeviceState::end_streams() {
    {
        const std::lock_guard lock(mu_);
        ++view_.epoch;
    }
    cv_.notify_all();
}

// ---- the service --------------------------------------------------------------

grpc::Status DevicePluginService::GetDevicePluginOptions(grpc::ServerContext*, const v1beta1::Empty*,
                                                         v1beta1::DevicePluginOptions* reply) {
    reply->set_pre_start_required(false);
    reply->set_get_preferred_allocation_available(true);
    return grpc::Status::OK;
}

// The whole list at once, then again on every change, until kubelet goes
// away or this server shuts down.
grpc::Status DevicePluginService::ListAndWatch(grpc::ServerContext* ctx, const v1beta1::Empty*,
                                               grpc::ServerWriter<v1beta1::ListAndWatchResponse>* writer) {
    DeviceState::View v = state_.current();
    const std::uint64_t epoch = v.epoch;
    log_line("ListAndWatch: kubelet watches the devices");
    for (;;) {
        v1beta1::ListAndWatchResponse list;
        fill_devices(v, &list);
        if (!writer->Write(list)) {
            log_line("ListAndWatch: the stream closed");
            return grpc::Status::OK;
        }
        const std::uint64_t sent = v.generation;
        do {
            v = state_.wait_change(v, cancel_check_);
            if (v.epoch != epoch) return grpc::Status::OK;
            if (ctx->IsCancelled()) {
                log_line("ListAndWatch: kubelet cancelled the stream");
                return grpc::Status::CANCELLED;
            }
        } while (v.generation == sent);
    }
}

grpc::Status DevicePluginService::GetPreferredAllocation(grpc::ServerContext*,
                                                         const v1beta1::PreferredAllocationRequest* req,
                                                         v1beta1::PreferredAllocationResponse* reply) {
    for (const auto& c : req->container_requests()) {
        const std::vector<std::string> available(c.available_deviceids().begin(), c.available_deviceids().end());
        const std::vector<std::string> must(c.must_include_deviceids().begin(), c.must_include_deviceids().end());
        try {
            auto* out = reply->add_container_responses();
            for (auto& id : preferred_allocation(available, must, c.allocation_size())) out->add_deviceids(id);
        } catch (const AllocationError& e) {
            return refused("GetPreferredAllocation", e);
        }
    }
    return grpc::Status::OK;
}

// Per container: pvgpud's client socket at the same path inside, read-write,
// the allocation's file at kAllocationMountPath, read-only (pvgpud places the
// VM by it), and the GPU and number of units for the KubeVirt hook
// (PVGPU_GPU, PVGPU_GPU_SHARE).
grpc::Status DevicePluginService::Allocate(grpc::ServerContext*, const v1beta1::AllocateRequest* req,
                                           v1beta1::AllocateResponse* reply) {
    const DeviceState::View v = state_.current();
    if (!v.healthy) {
        log_line("Allocate refused: pvgpud is not reachable");
        return {grpc::StatusCode::UNAVAILABLE, "pvgpud is not reachable; its GPUs' units are unhealthy"};
    }
    for (const auto& c : req->container_requests()) {
        const std::vector<std::string> ids(c.devices_ids().begin(), c.devices_ids().end());
        Grant g;
        try {
            g = grant_for(ids, v.gpus);
        } catch (const AllocationError& e) {
            return refused("Allocate", e);
        }
        std::string file;
        try {
            file = write_allocation(allocation_dir_, g, ids);
        } catch (const WriteError& e) {
            log_line("Allocate refused: " + e.message);
            return {grpc::StatusCode::INTERNAL, e.message};
        }
        auto* out = reply->add_container_responses();
        auto* m = out->add_mounts();
        m->set_host_path(client_socket_);
        m->set_container_path(client_socket_);
        m->set_read_only(false);
        m = out->add_mounts();
        m->set_host_path(file);
        m->set_container_path(kAllocationMountPath);
        m->set_read_only(true);
        (*out->mutable_envs())["PVGPU_GPU"] = std::to_string(g.gpu);
        (*out->mutable_envs())["PVGPU_GPU_SHARE"] = std::to_string(g.units);
        log_line("Allocate: " + std::to_string(g.units) + " units of GPU " + std::to_string(g.gpu) + " (" +
                 joined(c.devices_ids()) + "), " + file);
    }
    return grpc::Status::OK;
}

grpc::Status DevicePluginService::PreStartContainer(grpc::ServerContext*, const v1beta1::PreStartContainerRequest*,
                                                    v1beta1::PreStartContainerResponse*) {
    return grpc::Status::OK;  // not required (GetDevicePluginOptions): nothing to do
}

}  // namespace pvgpu::k8s
