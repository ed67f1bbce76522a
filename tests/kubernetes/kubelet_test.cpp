// A test kubelet for pvgpu-device-plugin, over kubelet's real device plugin
// API (the generated deviceplugin.proto code the plugin uses): it serves
// Registration on a private kubelet.sock, calls the plugin like kubelet does,
// and runs a private pvgpud with 2 simulated GPUs.  Every wait is on a gRPC
// message, a socket or a log line, bounded by a timeout that fails the test.
// usage: kubelet-test --pvgpud PATH --plugin PATH
#include <signal.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <grpcpp/grpcpp.h>

#include <algorithm>
#include <chrono>
#include <condition_variable>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <functional>
#include <memory>
#include <mutex>
#include <nlohmann/json.hpp>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "deviceplugin.grpc.pb.h"
#include "test_process.hpp"

namespace {

using namespace std::chrono_literals;
using pvgpu::test::check;
using pvgpu::test::Process;
using pvgpu::test::TestFailure;
namespace fs = std::filesystem;

constexpr auto kWait = 10s;

void log(const std::string& s) { std::printf("# %s\n", s.c_str()), std::fflush(stdout); }

// A measurement, grep-able from meson's log as RESULT key=value (ms since t0).
void result(const std::string& key, std::chrono::steady_clock::time_point t0) {
    const std::chrono::duration<double, std::milli> ms = std::chrono::steady_clock::now() - t0;
    std::printf("RESULT %s=%.1f\n", key.c_str(), ms.count());
    std::fflush(stdout);
}

// ---- kubelet's side -------------------------------------------------------------

// The Registration service on kubelet.sock: records every Register.
class TestKubelet final : public v1beta1::Registration::Service {
public:
    explicit TestKubelet(const std::string& socket) {
        grpc::ServerBuilder b;
        b.AddListeningPort("unix://" + socket, grpc::InsecureServerCredentials());
        b.RegisterService(this);
        server_ = b.BuildAndStart();
        check(server_ != nullptr, "the test kubelet cannot serve " + socket);
    }
    ~TestKubelet() override { server_->Shutdown(std::chrono::system_clock::now() + 1s); }

    grpc::Status Register(grpc::ServerContext*, const v1beta1::RegisterRequest* req, v1beta1::Empty*) override {
        const std::lock_guard lock(mu_);
        requests_.push_back(*req);
        cv_.notify_all();
        return grpc::Status::OK;
    }

    v1beta1::RegisterRequest wait_register() {
        std::unique_lock lock(mu_);
        check(cv_.wait_for(lock, kWait, [&] { return !requests_.empty(); }), "no Register from the plugin");
        return requests_.front();
    }

private:
    std::mutex mu_;
    std::condition_variable cv_;
    std::vector<v1beta1::RegisterRequest> requests_;
    std::unique_ptr<grpc::Server> server_;
};

// A ListAndWatch stream, read on its own thread.
class DeviceWatch {
public:
    explicit DeviceWatch(v1beta1::DevicePlugin::Stub& stub) {
        ctx_.set_wait_for_ready(true);
        reader_ = stub.ListAndWatch(&ctx_, v1beta1::Empty());
        thread_ = std::jthread([this] {
            v1beta1::ListAndWatchResponse r;
            while (reader_->Read(&r)) {
                const std::lock_guard lock(mu_);
                lists_.push_back(r);
                cv_.notify_all();
            }
            const std::lock_guard lock(mu_);
            ended_ = true;
            cv_.notify_all();
        });
    }
    ~DeviceWatch() {
        ctx_.TryCancel();
        thread_.join();
    }

    // The first list from `from_` on that satisfies `pred`; lists before it are consumed.
    v1beta1::ListAndWatchResponse wait_list(const std::function<bool(const v1beta1::ListAndWatchResponse&)>& pred,
                                            const std::string& what) {
        std::unique_lock lock(mu_);
        std::optional<v1beta1::ListAndWatchResponse> found;
        cv_.wait_for(lock, kWait, [&] {
            for (; next_ < lists_.size(); ++next_)
                if (pred(lists_[next_])) return found = lists_[next_++], true;
            return ended_;
        });
        check(found.has_value(), "ListAndWatch: no list with " + what + (ended_ ? " (stream ended)" : ""));
        return *found;
    }

    bool wait_end() {
        std::unique_lock lock(mu_);
        return cv_.wait_for(lock, kWait, [&] { return ended_; });
    }

private:
    grpc::ClientContext ctx_;
    std::unique_ptr<grpc::ClientReader<v1beta1::ListAndWatchResponse>> reader_;
    std::mutex mu_;
    std::condition_variable cv_;
    std::vector<v1beta1::ListAndWatchResponse> lists_;
    std::size_t next_ = 0;
    bool ended_ = false;
    std::jthread thread_;
};

// `n` devices, all with health `health`, named gpu0-u000 .. in order.
std::function<bool(const v1beta1::ListAndWatchResponse&)> all(unsigned gpus, const std::string& health) {
    return [gpus, health](const v1beta1::ListAndWatchResponse& r) {
        if (r.devices_size() != static_cast<int>(gpus * 100)) return false;
        for (int i = 0; i < r.devices_size(); ++i) {
            char id[32];
            std::snprintf(id, sizeof id, "gpu%d-u%03d", i / 100, i % 100);
            if (r.devices(i).id() != id || r.devices(i).health() != health) return false;
        }
        return true;
    };
}

std::unique_ptr<v1beta1::DevicePlugin::Stub> plugin_stub(const std::string& socket) {
    return v1beta1::DevicePlugin::NewStub(
        grpc::CreateChannel("unix://" + socket, grpc::InsecureChannelCredentials()));
}

std::vector<std::string> units(unsigned gpu, unsigned from, unsigned to) {
    std::vector<std::string> ids;
    for (unsigned u = from; u < to; ++u) {
        char id[32];
        std::snprintf(id, sizeof id, "gpu%u-u%03u", gpu, u);
        ids.emplace_back(id);
    }
    return ids;
}

template <typename Ctx>
Ctx& deadline(Ctx& ctx) {
    ctx.set_deadline(std::chrono::system_clock::now() + kWait);
    return ctx;
}

// ---- the run ------------------------------------------------------------------------

struct Setup {
    std::string pvgpud;
    std::string plugin;
    fs::path tmp;
    fs::path kubelet_dir() const { return tmp / "device-plugins"; }
    std::string kubelet_socket() const { return kubelet_dir() / "kubelet.sock"; }
    std::string plugin_socket() const { return kubelet_dir() / "pvgpu.sock"; }
    std::string client_socket() const { return tmp / "pvgpud.sock"; }
    std::string admin_socket() const { return tmp / "admin.sock"; }
    fs::path allocation_dir() const { return tmp / "allocations"; }
};

std::unique_ptr<Process> start_pvgpud(const Setup& s, unsigned gpus) {
    auto p = std::make_unique<Process>(
        "pvgpud", std::vector<std::string>{s.pvgpud, "--socket", s.client_socket(), "--admin-socket", s.admin_socket(),
                                           "--state-dir", s.tmp / "state", "--config", s.tmp / "pvgpud.conf",
                                           "--admin-group", "", "--gpus", std::to_string(gpus)});
    if (!p->wait_line("ready", kWait)) {
        p->dump_log();
        throw TestFailure{"pvgpud did not become ready"};
    }
    return p;
}

void check_registration(const v1beta1::RegisterRequest& r) {
    check(r.version() == "v1beta1", "Register: version '" + r.version() + "'");
    check(r.endpoint() == "pvgpu.sock", "Register: endpoint '" + r.endpoint() + "'");
    check(r.resource_name() == "pvgpu.org/gpu-share", "Register: resource name '" + r.resource_name() + "'");
    check(r.options().get_preferred_allocation_available() && !r.options().pre_start_required(),
          "Register: options " + r.options().ShortDebugString());
}

void check_options(v1beta1::DevicePlugin::Stub& stub) {
    grpc::ClientContext ctx;
    v1beta1::DevicePluginOptions o;
    const auto st = stub.GetDevicePluginOptions(&deadline(ctx), v1beta1::Empty(), &o);
    check(st.ok() && o.get_preferred_allocation_available() && !o.pre_start_required(),
          "GetDevicePluginOptions: " + st.error_message() + " " + o.ShortDebugString());
    grpc::ClientContext ctx2;
    v1beta1::PreStartContainerRequest pre;
    pre.add_devices_ids("gpu0-u000");
    v1beta1::PreStartContainerResponse pre_reply;
    check(stub.PreStartContainer(&deadline(ctx2), pre, &pre_reply).ok(), "PreStartContainer failed");
}

grpc::Status preferred(v1beta1::DevicePlugin::Stub& stub, const std::vector<std::string>& available,
                       const std::vector<std::string>& must, int size, std::vector<std::string>* out) {
    v1beta1::PreferredAllocationRequest req;
    auto* c = req.add_container_requests();
    for (const auto& id : available) c->add_available_deviceids(id);
    for (const auto& id : must) c->add_must_include_deviceids(id);
    c->set_allocation_size(size);
    grpc::ClientContext ctx;
    v1beta1::PreferredAllocationResponse reply;
    const auto st = stub.GetPreferredAllocation(&deadline(ctx), req, &reply);
    if (st.ok() && reply.container_responses_size() == 1)
        out->assign(reply.container_responses(0).deviceids().begin(), reply.container_responses(0).deviceids().end());
    return st;
}

// 25 units: from GPU 1 when GPU 0 has only 10 free; from GPU 0 when a
// must-include unit is there; none when no GPU has 25 free.
void check_preferred(v1beta1::DevicePlugin::Stub& stub) {
    auto available = units(0, 0, 100);
    for (auto& id : units(1, 0, 100)) available.push_back(id);
    std::vector<std::string> got;
    auto st = preferred(stub, available, {}, 25, &got);
    check(st.ok() && got == units(0, 0, 25), "GetPreferredAllocation of 25 of 200 free: " + st.error_message());
    available = units(0, 90, 100);
    for (auto& id : units(1, 0, 100)) available.push_back(id);
    st = preferred(stub, available, {}, 25, &got);
    check(st.ok() && got == units(1, 0, 25), "GetPreferredAllocation of 25 did not pick gpu1-u000..u024: " +
                                                 st.error_message());
    available = units(0, 0, 100);
    for (auto& id : units(1, 0, 100)) available.push_back(id);
    st = preferred(stub, available, {"gpu1-u050"}, 25, &got);
    check(st.ok() && got.size() == 25 && got[0] == "gpu1-u050", "must_include gpu1-u050 not honoured");
    for (const auto& id : got) check(id.starts_with("gpu1-"), "must_include: " + id + " is not on GPU 1");
    available = units(0, 80, 100);
    for (auto& id : units(1, 80, 100)) available.push_back(id);
    st = preferred(stub, available, {}, 25, &got);
    check(st.error_code() == grpc::StatusCode::RESOURCE_EXHAUSTED,
          "GetPreferredAllocation of 25 with 20 free per GPU did not fail: " + st.error_message());
    log("GetPreferredAllocation: 25 units from one GPU, must_include honoured, no split across GPUs");
}

grpc::Status allocate(v1beta1::DevicePlugin::Stub& stub, const std::vector<std::vector<std::string>>& containers,
                      v1beta1::AllocateResponse* reply) {
    v1beta1::AllocateRequest req;
    for (const auto& ids : containers) {
        auto* c = req.add_container_requests();
        for (const auto& id : ids) c->add_devices_ids(id);
    }
    grpc::ClientContext ctx;
    return stub.Allocate(&deadline(ctx), req, reply);
}

// The allocation file a container's second mount names, read-only at
// /run/pvgpu/allocation.json, holds its GPU, units and sorted device IDs.
// Returns its host path.
std::string check_allocation_file(const v1beta1::ContainerAllocateResponse& c, const Setup& s, unsigned gpu,
                                  std::vector<std::string> ids) {
    check(c.mounts_size() == 2, "Allocate: mounts " + c.ShortDebugString());
    const auto& m = c.mounts(1);
    check(m.container_path() == "/run/pvgpu/allocation.json" && m.read_only() &&
              fs::path(m.host_path()).parent_path() == s.allocation_dir(),
          "Allocate: the allocation file's mount " + m.ShortDebugString());
    std::ifstream in(m.host_path());
    check(in.good(), "Allocate: no allocation file " + m.host_path());
    const nlohmann::json doc = nlohmann::json::parse(in, nullptr, false);
    std::sort(ids.begin(), ids.end());
    check(doc.is_object() && doc.value("gpu", -1) == static_cast<int>(gpu) &&
              doc.value("units", -1) == static_cast<int>(ids.size()) &&
              doc.value("devices", std::vector<std::string>{}) == ids,
          "Allocate: " + m.host_path() + " holds " + doc.dump() + ", expected GPU " + std::to_string(gpu) + ", " +
              std::to_string(ids.size()) + " units");
    struct stat st {};
    check(::stat(m.host_path().c_str(), &st) == 0 && (st.st_mode & 0777) == 0644,
          "Allocate: " + m.host_path() + " is not mode 0644");
    return m.host_path();
}

std::string check_grant(const v1beta1::ContainerAllocateResponse& c, const Setup& s, unsigned gpu,
                        const std::vector<std::string>& ids) {
    const std::string socket = s.client_socket();
    check(c.mounts_size() >= 1 && c.mounts(0).host_path() == socket && c.mounts(0).container_path() == socket &&
              !c.mounts(0).read_only(),
          "Allocate: mounts " + c.ShortDebugString());
    const auto& env = c.envs();
    const std::string want_gpu = std::to_string(gpu), want_share = std::to_string(ids.size());
    check(env.count("PVGPU_GPU") && env.at("PVGPU_GPU") == want_gpu && env.count("PVGPU_GPU_SHARE") &&
              env.at("PVGPU_GPU_SHARE") == want_share,
          "Allocate: envs " + c.ShortDebugString() + ", expected GPU " + want_gpu + " share " + want_share);
    return check_allocation_file(c, s, gpu, ids);
}

// The same units again reuse their file; other units get another.  An
// allocation directory that cannot be written (a regular file in its
// place) refuses Allocate with INTERNAL naming it; once it can be, it is
// created again (0755).
void check_allocation_files(v1beta1::DevicePlugin::Stub& stub, const Setup& s, const std::string& first) {
    auto ids = units(0, 0, 25);
    std::reverse(ids.begin(), ids.end());  // kubelet's order is not the file's
    v1beta1::AllocateResponse again;
    auto st = allocate(stub, {ids, units(0, 50, 60)}, &again);
    check(st.ok() && again.container_responses_size() == 2, "Allocate again failed: " + st.error_message());
    check(check_grant(again.container_responses(0), s, 0, ids) == first,
          "Allocate of the same units did not reuse " + first);
    check(check_grant(again.container_responses(1), s, 0, units(0, 50, 60)) != first,
          "Allocate of other units reused " + first);
    fs::remove_all(s.allocation_dir());
    std::ofstream(s.allocation_dir()) << "not a directory\n";
    v1beta1::AllocateResponse refused;
    st = allocate(stub, {units(1, 0, 5)}, &refused);
    check(st.error_code() == grpc::StatusCode::INTERNAL &&
              st.error_message().find(s.allocation_dir().string()) != std::string::npos,
          "Allocate with an unwritable allocation directory: status " + std::to_string(st.error_code()) + " '" +
              st.error_message() + "'");
    log("Allocate with an unwritable allocation directory refused: " + st.error_message());
    fs::remove(s.allocation_dir());
    v1beta1::AllocateResponse back;
    st = allocate(stub, {units(1, 0, 5)}, &back);
    check(st.ok() && back.container_responses_size() == 1, "Allocate after the directory came back: " +
                                                               st.error_message());
    check_grant(back.container_responses(0), s, 1, units(1, 0, 5));
    struct stat dir {};
    check(::stat(s.allocation_dir().c_str(), &dir) == 0 && S_ISDIR(dir.st_mode) && (dir.st_mode & 0777) == 0755,
          "the allocation directory was not created 0755");
    log("allocation files: the same units reuse theirs, the directory is created 0755 when missing");
}

// 25 units on GPU 0 and 30 on GPU 1 for two containers; one container's
// units across GPUs refused.
void check_allocate(v1beta1::DevicePlugin::Stub& stub, const Setup& s) {
    v1beta1::AllocateResponse reply;
    auto st = allocate(stub, {units(0, 0, 25), units(1, 10, 40)}, &reply);
    check(st.ok() && reply.container_responses_size() == 2, "Allocate failed: " + st.error_message());
    const std::string first = check_grant(reply.container_responses(0), s, 0, units(0, 0, 25));
    check_grant(reply.container_responses(1), s, 1, units(1, 10, 40));
    auto span = units(0, 30, 40);
    span.push_back("gpu1-u050");
    v1beta1::AllocateResponse refused;
    st = allocate(stub, {span}, &refused);
    check(st.error_code() == grpc::StatusCode::INVALID_ARGUMENT &&
              st.error_message().find("one GPU") != std::string::npos,
          "Allocate across GPUs: status " + std::to_string(st.error_code()) + " '" + st.error_message() + "'");
    log("Allocate: 25 units of GPU 0 and 30 of GPU 1 with the socket and their allocation files mounted; "
        "across GPUs refused: " + st.error_message());
    check_allocation_files(stub, s, first);
}

// pvgpud stopped: every unit Unhealthy, Allocate refused; back: Healthy;
// back with 3 GPUs: 300 units.
std::unique_ptr<Process> check_health(v1beta1::DevicePlugin::Stub& stub, DeviceWatch& watch,
                                      std::unique_ptr<Process> pvgpud, const Setup& s) {
    pvgpud->stop(SIGTERM, kWait);
    pvgpud.reset();
    auto t0 = std::chrono::steady_clock::now();
    watch.wait_list(all(2, "Unhealthy"), "200 Unhealthy devices after pvgpud stopped");
    result("kubernetes.unhealthy_after_stop_ms", t0);
    v1beta1::AllocateResponse reply;
    const auto st = allocate(stub, {units(0, 0, 10)}, &reply);
    check(st.error_code() == grpc::StatusCode::UNAVAILABLE, "Allocate with pvgpud down did not fail: " +
                                                                st.error_message());
    log("pvgpud stopped: 200 devices Unhealthy, Allocate refused");
    pvgpud = start_pvgpud(s, 2);
    t0 = std::chrono::steady_clock::now();
    watch.wait_list(all(2, "Healthy"), "200 Healthy devices after pvgpud came back");
    result("kubernetes.healthy_after_ready_ms", t0);
    log("pvgpud back: 200 devices Healthy");
    pvgpud->stop(SIGTERM, kWait);
    pvgpud = start_pvgpud(s, 3);
    watch.wait_list(all(3, "Healthy"), "300 Healthy devices after pvgpud came back with 3 GPUs");
    log("pvgpud back with 3 GPUs: 300 devices Healthy");
    return pvgpud;
}

// kubelet restarts as the real one does: its server goes, the plugins'
// sockets are removed, kubelet.sock is created anew.  The plugin serves
// again and registers again; the old stream ends.
void check_kubelet_restart(std::unique_ptr<TestKubelet>& kubelet, DeviceWatch& old_watch, const Setup& s) {
    kubelet.reset();
    fs::remove(s.kubelet_socket());
    fs::remove(s.plugin_socket());
    const auto t0 = std::chrono::steady_clock::now();
    kubelet = std::make_unique<TestKubelet>(s.kubelet_socket());
    check_registration(kubelet->wait_register());
    result("kubernetes.register_after_kubelet_restart_ms", t0);
    check(old_watch.wait_end(), "the ListAndWatch stream of the old server did not end");
    auto stub = plugin_stub(s.plugin_socket());
    DeviceWatch watch(*stub);
    watch.wait_list(all(3, "Healthy"), "300 Healthy devices from the plugin's new socket");
    log("kubelet restarted: the plugin registered again and serves its new socket");
    // A kubelet that only creates its socket anew (the plugin's left alone):
    // registered again on the same server.
    kubelet.reset();
    fs::remove(s.kubelet_socket());
    kubelet = std::make_unique<TestKubelet>(s.kubelet_socket());
    check_registration(kubelet->wait_register());
    check(fs::exists(s.plugin_socket()), "the plugin's socket went with kubelet's");
    log("kubelet.sock created anew: the plugin registered again");
}

void run(const Setup& s) {
    fs::create_directories(s.kubelet_dir());
    std::ofstream(s.tmp / "pvgpud.conf") << "[libvirt]\nuri = none\n";
    auto kubelet = std::make_unique<TestKubelet>(s.kubelet_socket());
    auto pvgpud = start_pvgpud(s, 2);
    Process plugin("plugin", {s.plugin, "--kubelet-socket", s.kubelet_socket(), "--plugin-dir", s.kubelet_dir(),
                              "--pvgpud-socket", s.admin_socket(), "--client-socket", s.client_socket(),
                              "--allocation-dir", s.allocation_dir(), "--health-interval-ms", "100"});
    try {
        check_registration(kubelet->wait_register());
        log("Register: v1beta1, pvgpu.sock, pvgpu.org/gpu-share");
        auto stub = plugin_stub(s.plugin_socket());
        check_options(*stub);
        {
            DeviceWatch watch(*stub);
            watch.wait_list(all(2, "Healthy"), "200 Healthy devices");
            log("ListAndWatch: 200 devices Healthy");
            check_preferred(*stub);
            check_allocate(*stub, s);
            pvgpud = check_health(*stub, watch, std::move(pvgpud), s);
            check_kubelet_restart(kubelet, watch, s);
        }
        const int status = plugin.stop(SIGTERM, kWait);
        check(WIFEXITED(status) && WEXITSTATUS(status) == 0, "the plugin's exit status on SIGTERM: " +
                                                                 std::to_string(status));
        check(!fs::exists(s.plugin_socket()), "the plugin left " + s.plugin_socket() + " behind");
        log("SIGTERM: the plugin exited 0 and removed its socket");
    } catch (const TestFailure&) {
        plugin.dump_log();
        if (pvgpud) pvgpud->dump_log();
        throw;
    }
}

}  // namespace

int main(int argc, char** argv) {
    Setup s;
    bool usage_ok = argc == 5;
    for (int i = 1; usage_ok && i + 1 < argc; i += 2) {
        const std::string opt = argv[i];
        if (opt == "--pvgpud")
            s.pvgpud = argv[i + 1];
        else if (opt == "--plugin")
            s.plugin = argv[i + 1];
        else
            usage_ok = false;
    }
    if (!usage_ok || s.pvgpud.empty() || s.plugin.empty()) {
        std::fprintf(stderr, "usage: kubelet-test --pvgpud PATH --plugin PATH\n");
        return 2;
    }
    char tmpl[] = "/tmp/pvgpu-kubelet-XXXXXX";
    if (!::mkdtemp(tmpl)) return std::perror("mkdtemp"), 1;
    s.tmp = tmpl;
    int rc = 0;
    try {
        run(s);
        log("PASS kubelet");
    } catch (const TestFailure& e) {
        std::printf("FAIL: %s\n", e.message.c_str());
        rc = 1;
    }
    std::error_code ec;
    fs::remove_all(s.tmp, ec);
    return rc;
}
