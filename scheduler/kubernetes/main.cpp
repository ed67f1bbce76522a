// pvgpu-device-plugin: kubelet's device plugin (API v1beta1) advertising each
// GPU of the node's pvgpud as 100 units of the extended resource
// pvgpu.org/gpu-share (docs/pvgpu-device-plugin.8.md, docs/kubernetes.md).
#include <signal.h>
#include <sys/inotify.h>
#include <sys/signalfd.h>
#include <sys/stat.h>
#include <poll.h>
#include <unistd.h>

#include <grpcpp/grpcpp.h>

#include <algorithm>
#include <cerrno>
#include <charconv>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <system_error>

#include "admin_connection.hpp"
#include "device_ids.hpp"
#include "plugin_service.hpp"
#include "proto/unique_fd.hpp"
#include "pvgpu_paths.h"

#ifndef PVGPU_VERSION
#define PVGPU_VERSION "unknown"
#endif

namespace {

using namespace pvgpu::k8s;
using SteadyClock = std::chrono::steady_clock;
using std::chrono::milliseconds;

constexpr int kExitOk = 0;
constexpr int kExitError = 1;
constexpr int kExitUsage = 2;

constexpr const char* kApiVersion = "v1beta1";
constexpr const char* kResourceName = "pvgpu.org/gpu-share";
constexpr const char* kEndpoint = "pvgpu.sock";
// A health poll waits this long for pvgpud's answer before calling it down.
constexpr milliseconds kHealthReplyTimeout{3000};
// kubelet answers Register at once; it may still be starting to listen.
constexpr auto kRegisterTimeout = std::chrono::seconds(10);

struct UsageError {
    std::string message;
};
struct FatalError {
    std::string message;
};

std::string errno_text(int err) { return std::error_code(err, std::system_category()).message(); }

// ---- options ------------------------------------------------------------------

struct Options {
    std::string kubelet_socket = "/var/lib/kubelet/device-plugins/kubelet.sock";
    std::string plugin_dir = "/var/lib/kubelet/device-plugins";
    std::string pvgpud_socket;
    std::string client_socket;
    std::string allocation_dir = "/run/pvgpu/allocations";
    milliseconds health_interval{1000};
    bool help = false;
    bool version = false;

    std::string plugin_socket() const { return (std::filesystem::path(plugin_dir) / kEndpoint).string(); }
};

const char* const kUsage = R"(usage: pvgpu-device-plugin [OPTION]...

Kubernetes device plugin of pvgpu: advertises each GPU of the node's pvgpud
as 100 units of the extended resource pvgpu.org/gpu-share (1 unit = 1% of a
GPU's time) and hands containers pvgpud's client socket, the GPU their
units are on (PVGPU_GPU, PVGPU_GPU_SHARE) and a file saying so, which pvgpud
reads to place the container's VM there.

  --kubelet-socket PATH      kubelet's registration socket
                             (default /var/lib/kubelet/device-plugins/kubelet.sock)
  --plugin-dir DIR           where the plugin serves DIR/pvgpu.sock
                             (default /var/lib/kubelet/device-plugins)
  --pvgpud-socket PATH       pvgpud's admin socket: health and GPU count
                             (default $PVGPU_ADMIN_SOCKET, else )" PVGPU_ADMIN_SOCKET_PATH R"()
  --client-socket PATH       pvgpud's client socket mounted into containers
                             (default $PVGPU_SOCKET, else )" PVGPU_SOCKET_PATH R"()
  --allocation-dir DIR       where each allocation's file is written, mounted
                             read-only at /run/pvgpu/allocation.json for
                             pvgpud to place the VM (default /run/pvgpu/allocations)
  --health-interval-ms MS    how often pvgpud is asked (default 1000)
  -h, --help                 this help
  --version                  the version

Exit status: 0 stopped by SIGTERM or SIGINT, 1 error (kubelet refused the
registration, the plugin socket cannot be served), 2 bad usage.
)";

milliseconds parse_interval(std::string_view text) {
    long long v = 0;
    const auto [end, ec] = std::from_chars(text.data(), text.data() + text.size(), v);
    if (ec != std::errc{} || end != text.data() + text.size() || v < 10 || v > 3600000)
        throw UsageError{"--health-interval-ms: '" + std::string(text) + "' is not a whole number from 10 to 3600000"};
    return milliseconds(v);
}

// The sockets default as pvgpuctl's do: $PVGPU_ADMIN_SOCKET, $PVGPU_SOCKET.
std::string from_env(const char* name, const char* fallback) {
    const char* env = std::getenv(name);
    return (env && *env) ? env : fallback;
}

Options parse_options(int argc, char** argv) {
    Options o;
    o.pvgpud_socket = from_env("PVGPU_ADMIN_SOCKET", PVGPU_ADMIN_SOCKET_PATH);
    o.client_socket = from_env("PVGPU_SOCKET", PVGPU_SOCKET_PATH);
    for (int i = 1; i < argc; ++i) {
        std::string_view arg = argv[i];
        std::optional<std::string> value;
        if (const auto eq = arg.find('='); arg.starts_with("--") && eq != std::string_view::npos) {
            value = std::string(arg.substr(eq + 1));
            arg = arg.substr(0, eq);
        }
        if (arg == "-h" || arg == "--help" || arg == "--version") {
            if (value) throw UsageError{std::string(arg) + " takes no value"};
            (arg == "--version" ? o.version : o.help) = true;
            continue;
        }
        std::string* target = arg == "--kubelet-socket"   ? &o.kubelet_socket
                              : arg == "--plugin-dir"     ? &o.plugin_dir
                              : arg == "--pvgpud-socket"  ? &o.pvgpud_socket
                              : arg == "--client-socket"  ? &o.client_socket
                              : arg == "--allocation-dir" ? &o.allocation_dir
                                                          : nullptr;
        if (!target && arg != "--health-interval-ms")
            throw UsageError{"unknown " + std::string(arg.starts_with("-") ? "option" : "argument") + " '" +
                             std::string(arg) + "'"};
        if (!value) {
            if (i + 1 >= argc) throw UsageError{std::string(arg) + " needs a value"};
            value = argv[++i];
        }
        if (value->empty()) throw UsageError{std::string(arg) + " needs a non-empty value"};
        if (target)
            *target = *value;
        else
            o.health_interval = parse_interval(*value);
    }
    return o;
}

// ---- the gRPC server kubelet calls ----------------------------------------------

// Serves the DevicePlugin service on the plugin socket for its lifetime and
// removes the socket afterwards (unless another one has taken its path).
class PluginServer {
public:
    PluginServer(const Options& o, DeviceState& state)
        : path_(o.plugin_socket()), state_(state), service_(state, o.client_socket, o.allocation_dir, o.health_interval) {
        std::error_code ec;
        std::filesystem::remove(path_, ec);  // a stale socket of an earlier run
        grpc::ServerBuilder builder;
        builder.AddListeningPort("unix://" + path_, grpc::InsecureServerCredentials());
        builder.RegisterService(&service_);
        server_ = builder.BuildAndStart();
        struct stat st {};
        if (!server_ || ::stat(path_.c_str(), &st) != 0)
            throw FatalError{"cannot serve the device plugin on " + path_};
        inode_ = st.st_ino;
        log_line("serving " + path_);
    }
    PluginServer(const PluginServer&) = delete;
    PluginServer& operator=(const PluginServer&) = delete;
    ~PluginServer() {
        state_.end_streams();  // else Shutdown waits for kubelet's ListAndWatch
        server_->Shutdown(std::chrono::system_clock::now() + std::chrono::seconds(2));
        struct stat st {};
        if (::stat(path_.c_str(), &st) == 0 && st.st_ino == inode_) ::unlink(path_.c_str());
    }

private:
    std::string path_;
    DeviceState& state_;
    DevicePluginService service_;
    std::unique_ptr<grpc::Server> server_;
    ino_t inode_ = 0;
};

// ---- registration with kubelet --------------------------------------------------

// Registers the plugin.  Returns false when kubelet is not there (it will be
// when its socket appears); throws FatalError when kubelet refuses, as the
// API asks of a plugin.  `wait`: kubelet's socket was just created, it may
// not be listening yet.
bool register_with_kubelet(const Options& o, bool wait) {
    auto channel = grpc::CreateChannel("unix://" + o.kubelet_socket, grpc::InsecureChannelCredentials());
    auto stub = v1beta1::Registration::NewStub(channel);
    v1beta1::RegisterRequest req;
    req.set_version(kApiVersion);
    req.set_endpoint(kEndpoint);
    req.set_resource_name(kResourceName);
    req.mutable_options()->set_pre_start_required(false);
    req.mutable_options()->set_get_preferred_allocation_available(true);
    grpc::ClientContext ctx;
    ctx.set_wait_for_ready(wait);
    ctx.set_deadline(std::chrono::system_clock::now() + kRegisterTimeout);
    v1beta1::Empty reply;
    const grpc::Status st = stub->Register(&ctx, req, &reply);
    if (st.ok()) {
        log_line(std::string("registered ") + kResourceName + " with kubelet at " + o.kubelet_socket);
        return true;
    }
    const auto code = st.error_code();
    if (code == grpc::StatusCode::UNAVAILABLE || code == grpc::StatusCode::DEADLINE_EXCEEDED) {
        log_line("kubelet at " + o.kubelet_socket + " is not reachable (" + st.error_message() +
                 "); registering when its socket is created");
        return false;
    }
    throw FatalError{"kubelet refused the registration: " + st.error_message()};
}

// ---- pvgpud's health ---------------------------------------------------------------

// Asks pvgpud's admin socket for its GPUs; unreachable, every unit is
// Unhealthy (the GPU count kept), reachable again, Healthy with the count it
// has now.  Logs each change once.
class HealthPoll {
public:
    HealthPoll(std::string admin_socket, DeviceState& state) : path_(std::move(admin_socket)), state_(state) {}

    void poll_once() {
        const DeviceState::View before = state_.current();
        try {
            const nlohmann::json reply = conn_.request({{"cmd", "list"}}, kHealthReplyTimeout);
            if (!reply["ok"].get<bool>())
                throw pvgpu::DaemonError{"list: " + reply.value("error", std::string("unspecified error")), {}};
            // An older pvgpud (admin protocol < 4) drives one GPU.
            const auto gpus = reply.contains("gpus") && reply["gpus"].is_array()
                                  ? static_cast<unsigned>(reply["gpus"].size())
                                  : 1u;
            if (state_.set(gpus, true) || reported_up_ != true)
                log_line("pvgpud at " + path_ + " answers: " + std::to_string(gpus) + " GPU(s), " +
                         std::to_string(gpus * kUnitsPerGpu) + " units Healthy");
        } catch (const pvgpu::DaemonError& e) {
            conn_ = pvgpu::AdminConnection(path_);  // no late reply read as the next one's
            if (state_.set(before.gpus, false) || reported_up_ != false)
                log_line("pvgpud at " + path_ + " unreachable (" + e.message + "): " +
                         std::to_string(before.gpus * kUnitsPerGpu) + " units Unhealthy");
            reported_up_ = false;
            return;
        }
        reported_up_ = true;
    }

private:
    std::string path_;
    DeviceState& state_;
    pvgpu::AdminConnection conn_{path_};
    std::optional<bool> reported_up_;  // what the log last said
};

// ---- kubelet restarts ---------------------------------------------------------------

// inotify on the plugin directory (and kubelet's socket's, when elsewhere):
// a restarting kubelet removes the plugins' sockets and creates its own anew.
class DirWatch {
public:
    struct Events {
        bool own_socket_gone = false;
        bool kubelet_created = false;
    };

    explicit DirWatch(const Options& o)
        : fd_(::inotify_init1(IN_NONBLOCK | IN_CLOEXEC)),
          own_name_(kEndpoint),
          kubelet_name_(std::filesystem::path(o.kubelet_socket).filename().string()) {
        if (!fd_) throw FatalError{"inotify_init1: " + errno_text(errno)};
        plugin_wd_ = add(o.plugin_dir);
        kubelet_wd_ = add(std::filesystem::path(o.kubelet_socket).parent_path().string());
    }

    int fd() const { return fd_.get(); }

    // What the events queued now say.
    Events read() {
        Events ev;
        alignas(inotify_event) char buf[8192];
        for (;;) {
            const ssize_t n = ::read(fd_.get(), buf, sizeof buf);
            if (n <= 0) break;  // EAGAIN: all read
            for (ssize_t off = 0; off < n;) {
                const auto* e = reinterpret_cast<const inotify_event*>(buf + off);
                const std::string_view name = e->len ? std::string_view(e->name) : std::string_view();
                if (e->wd == plugin_wd_ && name == own_name_ && (e->mask & (IN_DELETE | IN_MOVED_FROM)))
                    ev.own_socket_gone = true;
                if (e->wd == kubelet_wd_ && name == kubelet_name_ && (e->mask & (IN_CREATE | IN_MOVED_TO)))
                    ev.kubelet_created = true;
                off += static_cast<ssize_t>(sizeof(inotify_event) + e->len);
            }
        }
        return ev;
    }

private:
    int add(const std::string& dir) {
        const int wd = ::inotify_add_watch(fd_.get(), dir.empty() ? "." : dir.c_str(),
                                           IN_CREATE | IN_DELETE | IN_MOVED_TO | IN_MOVED_FROM);
        if (wd < 0) throw FatalError{"cannot watch " + dir + ": " + errno_text(errno)};
        return wd;
    }

    pvgpu::UniqueFd fd_;
    std::string own_name_;
    std::string kubelet_name_;
    int plugin_wd_ = -1;
    int kubelet_wd_ = -1;
};

// ---- the plugin -----------------------------------------------------------------------

// SIGTERM and SIGINT as a readable fd; blocked before gRPC starts threads so
// that none of them takes the signal.
pvgpu::UniqueFd stop_signals() {
    sigset_t set;
    sigemptyset(&set);
    sigaddset(&set, SIGTERM);
    sigaddset(&set, SIGINT);
    if (pthread_sigmask(SIG_BLOCK, &set, nullptr) != 0) throw FatalError{"pthread_sigmask failed"};
    ::signal(SIGPIPE, SIG_IGN);
    pvgpu::UniqueFd fd(::signalfd(-1, &set, SFD_CLOEXEC | SFD_NONBLOCK));
    if (!fd) throw FatalError{"signalfd: " + errno_text(errno)};
    return fd;
}

class Plugin {
public:
    explicit Plugin(const Options& o) : o_(o), health_(o.pvgpud_socket, state_), watch_(o) {}

    int run(int signal_fd) {
        health_.poll_once();
        server_ = std::make_unique<PluginServer>(o_, state_);
        if (std::filesystem::exists(o_.kubelet_socket))
            register_with_kubelet(o_, false);
        else
            log_line("kubelet socket " + o_.kubelet_socket + " not there yet; registering when it is created");
        auto next_poll = SteadyClock::now() + o_.health_interval;
        for (;;) {
            const auto left = std::chrono::duration_cast<milliseconds>(next_poll - SteadyClock::now());
            pollfd fds[2] = {{signal_fd, POLLIN, 0}, {watch_.fd(), POLLIN, 0}};
            const int rc = ::poll(fds, 2, static_cast<int>(std::max<milliseconds::rep>(left.count(), 0)));
            if (rc < 0 && errno != EINTR) throw FatalError{"poll: " + errno_text(errno)};
            if (rc > 0 && (fds[0].revents & POLLIN)) return stop(signal_fd);
            if (rc > 0 && (fds[1].revents & POLLIN)) on_dir_events(watch_.read());
            if (SteadyClock::now() >= next_poll) {
                health_.poll_once();
                next_poll = std::max(next_poll + o_.health_interval, SteadyClock::now());
            }
        }
    }

private:
    // kubelet restarted: it removed our socket (serve again) and created
    // its own (register again).
    void on_dir_events(const DirWatch::Events& ev) {
        const bool serving = std::filesystem::exists(o_.plugin_socket());
        if (ev.own_socket_gone && !serving) {
            log_line(o_.plugin_socket() + " was removed (kubelet restarting?): serving it again");
            serve_again();
            if (!ev.kubelet_created && std::filesystem::exists(o_.kubelet_socket))
                register_with_kubelet(o_, false);
        }
        if (ev.kubelet_created) {
            if (!std::filesystem::exists(o_.plugin_socket())) serve_again();
            log_line(o_.kubelet_socket + " was created (kubelet restarted): registering again");
            register_with_kubelet(o_, true);
        }
    }

    // The old server first: its streams end and the path is free.
    void serve_again() {
        server_.reset();
        server_ = std::make_unique<PluginServer>(o_, state_);
    }

    int stop(int signal_fd) {
        signalfd_siginfo si{};
        const ssize_t n = ::read(signal_fd, &si, sizeof si);
        log_line(std::string("stopping on ") + (n == sizeof si ? strsignal(static_cast<int>(si.ssi_signo)) : "a signal"));
        server_.reset();
        log_line("stopped");
        return kExitOk;
    }

    const Options& o_;
    DeviceState state_;
    HealthPoll health_;
    DirWatch watch_;
    std::unique_ptr<PluginServer> server_;
};

}  // namespace

int main(int argc, char** argv) {
    Options o;
    try {
        o = parse_options(argc, argv);
    } catch (const UsageError& e) {
        std::fprintf(stderr, "pvgpu-device-plugin: %s\nTry 'pvgpu-device-plugin --help'.\n", e.message.c_str());
        return kExitUsage;
    }
    if (o.help) {
        std::fputs(kUsage, stdout);
        return kExitOk;
    }
    if (o.version) {
        std::printf("pvgpu-device-plugin %s (device plugin API %s)\n", PVGPU_VERSION, kApiVersion);
        return kExitOk;
    }
    try {
        if (!std::filesystem::is_directory(o.plugin_dir))
            throw FatalError{"plugin directory " + o.plugin_dir + " does not exist"};
        pvgpu::UniqueFd signals = stop_signals();
        log_line(std::string("pvgpu-device-plugin ") + PVGPU_VERSION + ": " + kResourceName + ", " +
                 std::to_string(kUnitsPerGpu) + " units per GPU of pvgpud at " + o.pvgpud_socket);
        Plugin plugin(o);
        return plugin.run(signals.get());
    } catch (const FatalError& e) {
        log_line("error: " + e.message);
    } catch (const std::exception& e) {
        log_line(std::string("error: ") + e.what());
    }
    return kExitError;
}
