// The DevicePlugin gRPC service kubelet calls (deviceplugin.proto), and the
// device state it serves: how many GPUs pvgpud has and whether it answers.
#pragma once

#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <mutex>
#include <string>

#include "deviceplugin.grpc.pb.h"

namespace pvgpu::k8s {

// Written by the health poll, read by the gRPC handlers.  Every change of the
// device list bumps `generation` and wakes the ListAndWatch streams.
class DeviceState {
public:
    struct View {
        unsigned gpus = 0;  // 0 until pvgpud answered once
        bool healthy = false;
        std::uint64_t generation = 0;
        std::uint64_t epoch = 0;  // of the serving gRPC server (end_streams)
    };

    // Returns true when the list kubelet sees changed.
    bool set(unsigned gpus, bool healthy);
    View current() const;
    // Until the list changes from `seen`, the streams of `seen.epoch` are
    // ended, or `timeout` passes; returns the state then.
    View wait_change(const View& seen, std::chrono::milliseconds timeout) const;
    // Ends the ListAndWatch streams now open, before their server shuts down.
    void end_streams();

private:
    mutable std::mutex mu_;
    mutable std::condition_variable cv_;
    View view_;
};

// Where a container finds its allocation file (pvgpud's [kubernetes]
// allocation_file reads it there, through the VMM's /proc/PID/root).
inline constexpr const char* kAllocationMountPath = "/run/pvgpu/allocation.json";

class DevicePluginService final : public v1beta1::DevicePlugin::Service {
public:
    // `client_socket`: pvgpud's client socket mounted into containers.
    // `allocation_dir`: where each allocation's file is written (created
    // when missing) to be mounted at kAllocationMountPath.
    // `cancel_check`: how often a ListAndWatch stream with no change looks
    // whether kubelet went away (the sync API has no cancel callback).
    DevicePluginService(DeviceState& state, std::string client_socket, std::string allocation_dir,
                        std::chrono::milliseconds cancel_check)
        : state_(state),
          client_socket_(std::move(client_socket)),
          allocation_dir_(std::move(allocation_dir)),
          cancel_check_(cancel_check) {}

    grpc::Status GetDevicePluginOptions(grpc::ServerContext*, const v1beta1::Empty*,
                                        v1beta1::DevicePluginOptions* reply) override;
    grpc::Status ListAndWatch(grpc::ServerContext* ctx, const v1beta1::Empty*,
                              grpc::ServerWriter<v1beta1::ListAndWatchResponse>* writer) override;
    grpc::Status GetPreferredAllocation(grpc::ServerContext*, const v1beta1::PreferredAllocationRequest* req,
                                        v1beta1::PreferredAllocationResponse* reply) override;
    grpc::Status Allocate(grpc::ServerContext*, const v1beta1::AllocateRequest* req,
                          v1beta1::AllocateResponse* reply) override;
    grpc::Status PreStartContainer(grpc::ServerContext*, const v1beta1::PreStartContainerRequest*,
                                   v1beta1::PreStartContainerResponse*) override;

private:
    DeviceState& state_;
    const std::string client_socket_;
    const std::string allocation_dir_;
    const std::chrono::milliseconds cancel_check_;
};

// The plugin's log lines on stderr ("pvgpu-device-plugin: ..."), whole lines
// from any thread.
void log_line(const std::string& message);

}  // namespace pvgpu::k8s
