// pvgpu-load: GPU load generator for pvgpud on libpvgpu (docs/pvgpu-load.1.md),
// on the host (pvgpud's socket) or inside a VM (/dev/pvgpu).
//
//   throttle: endless kernels of a fixed length (the thesis' "throttle"),
//   bench:    a finite job; prints its runtime,
//   info:     what the transport reports (device state, or pvgpud's HELLO).
//
// Each of --channels loops submits --batch kernels back to back, keeps up to
// --depth batches in flight, and waits --gap-us after a batch completes
// before submitting the next one (the simulator's workload model).  All loops
// run on one thread; waiting is done by libpvgpu (no busy spinning).
#include <pvgpu.h>
#include <pvgpu/abi.h>  // PVGPU_WEIGHT_*
#include <pvgpu/guest_ioctl.h>

#include <signal.h>
#include <sys/prctl.h>
#include <sys/resource.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <charconv>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "pvgpu_paths.h"

namespace {

using SteadyClock = std::chrono::steady_clock;
using TimePoint = SteadyClock::time_point;

constexpr int kExitOk = 0;
constexpr int kExitError = 1;
constexpr int kExitUsage = 2;
constexpr int kExitInterrupted = 3;

constexpr const char* kUsage = R"(usage: pvgpu-load throttle --kernel-us N [--channels K] [--duration-s S] [OPTIONS]
       pvgpu-load bench --kernel-us N --kernels M [--channels K] [OPTIONS]
       pvgpu-load info [--socket PATH | --device PATH] [--weight W] [--gpu N]

Generates GPU load on pvgpud through libpvgpu, from a host process (pvgpud's
socket) or from inside a VM (the guest driver's device node).

  throttle            submit kernels of N us without end, until --duration-s
                      passes or SIGINT/SIGTERM; then print a summary
  bench               run M kernels of N us per channel; print runtime_ms=<ms>
  info                print what the transport reports and exit

Options:
  --kernel-us N       kernel length in microseconds (the simulated GPU's run
                      time), 1..10000000; fractions allowed
  --kernels M         bench: kernels per channel (required, >= 1)
  --channels K        channels, one submit loop each (default 1, max 64)
  --duration-s S      throttle: stop after S seconds (default: run until killed)
  --batch B           kernels submitted back to back per batch (default 1)
  --depth D           batches kept in flight per channel (default 1: submit a
                      batch, wait for it, gap, repeat); B*D <= 256
  --gap-us G          CPU time between a completed batch and the next
                      submission, in microseconds (default 0)
  --socket PATH       use pvgpud's client socket PATH
  --device PATH       use the guest driver's device node PATH
                      (default: the device $PVGPU_DEVICE or /dev/pvgpu if it
                      exists, else the socket $PVGPU_SOCKET or
                      )" PVGPU_SOCKET_PATH R"()
  --name NAME         task name (default: the mode); host: pvgpud shows
                      host/USER/NAME; in a VM it becomes the process name, which
                      the guest driver reports
  --weight W          in a VM: this task's weight among the VM's tasks,
                      1..10000 (default: leave it, 100); not on the host,
                      where the admin sets it (pvgpuctl set-weight)
  --gpu N             host: run on pvgpud's GPU N, 0..15 (default: $PVGPU_GPU
                      if set, else pvgpud places the task); pvgpud refuses a
                      GPU the host lacks.  Not in a VM, whose GPU is its pvgpu
                      device's (there $PVGPU_GPU is ignored)
  --report-interval-s R
                      every R seconds print to stderr:
                      "pvgpu-load: t=<CLOCK_MONOTONIC s> completed=<kernels so
                      far> rate=<kernels/s> busy=<GPU fraction>" (default 0: off)
  --reconnect-timeout-s T
                      give up when pvgpud stays away for T s (default 30)
  -h, --help          this help

Output (stdout, one key=value per line):
  bench:    runtime_ms, kernels, gpu_ms, reconnects, resubmitted, mode_messages,
            polls, cpu_ms
  throttle: kernels, elapsed_ms, rate, gpu_ms, reconnects, resubmitted,
            mode_messages, polls, cpu_ms
  info:     transport, then socket: socket, protocol_version, client_id,
            max_channels, gpu (the one asked for, or "any"); device:
            device, abi_version, device_version, slots, slots_used, link,
            link_gen, irq_mode, pid_hints, channels, pid_hint, weight

Exit status:
  0  success (throttle: also when stopped by SIGINT/SIGTERM or --duration-s)
  1  runtime error: pvgpud (or the device) unreachable or gone past the
     reconnect timeout, a channel killed by the GPU, a protocol error
  2  bad usage
  3  bench interrupted by SIGINT/SIGTERM before all kernels completed
)";

volatile sig_atomic_t g_stop = 0;
extern "C" void on_signal(int) { g_stop = 1; }

struct UsageError {
    std::string message;
};

struct Options {
    std::string mode;
    double kernel_us = 0;
    std::uint64_t kernels = 0;
    unsigned channels = 1;
    std::optional<double> duration_s;
    unsigned batch = 1;
    unsigned depth = 1;
    double gap_us = 0;
    pvgpu::Transport transport = pvgpu::Transport::Auto;
    std::string socket;
    std::string device;
    std::uint32_t weight = 0;
    std::optional<std::uint32_t> gpu;
    std::string name;
    double report_interval_s = 0;
    double reconnect_timeout_s = 30;
};

std::string format_g(double v) {
    char buf[32];
    std::snprintf(buf, sizeof buf, "%g", v);
    return buf;
}

double parse_number(std::string_view opt, std::string_view text, double lo, double hi) {
    double v = 0;
    const auto [end, ec] = std::from_chars(text.data(), text.data() + text.size(), v);
    if (ec != std::errc{} || end != text.data() + text.size() || !std::isfinite(v))
        throw UsageError{std::string(opt) + ": not a number: '" + std::string(text) + "'"};
    if (v < lo || v > hi)
        throw UsageError{std::string(opt) + ": " + std::string(text) + " is out of range " + format_g(lo) +
                         ".." + format_g(hi)};
    return v;
}

std::uint64_t parse_count(std::string_view opt, std::string_view text, std::uint64_t lo, std::uint64_t hi) {
    std::uint64_t v = 0;
    const auto [end, ec] = std::from_chars(text.data(), text.data() + text.size(), v);
    if (ec != std::errc{} || end != text.data() + text.size())
        throw UsageError{std::string(opt) + ": not a non-negative integer: '" + std::string(text) + "'"};
    if (v < lo || v > hi)
        throw UsageError{std::string(opt) + ": " + std::string(text) + " is out of range " +
                         std::to_string(lo) + ".." + std::to_string(hi)};
    return v;
}

Options parse_args(int argc, char** argv) {
    Options o;
    std::vector<std::string_view> args(argv + 1, argv + argc);
    if (args.empty()) throw UsageError{"missing mode (throttle, bench or info)"};
    bool have_kernel_us = false;
    bool have_kernels = false;
    std::string workload_option;  // one given, for info's complaint
    for (std::size_t i = 0; i < args.size(); ++i) {
        std::string_view a = args[i];
        if (a == "-h" || a == "--help") {
            std::fputs(kUsage, stdout);
            std::exit(kExitOk);
        }
        if (!a.starts_with("-")) {
            if (!o.mode.empty()) throw UsageError{"unexpected argument '" + std::string(a) + "'"};
            if (a != "throttle" && a != "bench" && a != "info")
                throw UsageError{"unknown mode '" + std::string(a) + "' (throttle, bench or info)"};
            o.mode = a;
            continue;
        }
        std::string_view key = a;
        std::optional<std::string_view> inline_value;
        if (const auto eq = a.find('='); eq != std::string_view::npos) {
            key = a.substr(0, eq);
            inline_value = a.substr(eq + 1);
        }
        auto value = [&]() -> std::string_view {
            if (inline_value) return *inline_value;
            if (i + 1 >= args.size()) throw UsageError{std::string(key) + " needs a value"};
            return args[++i];
        };
        if (key != "--socket" && key != "--device" && key != "--weight" && key != "--gpu" && key != "--name" &&
            key != "--reconnect-timeout-s")
            workload_option = key;
        if (key == "--kernel-us") {
            o.kernel_us = parse_number(key, value(), 1e-3, 1e7);
            have_kernel_us = true;
        } else if (key == "--kernels") {
            o.kernels = parse_count(key, value(), 1, std::uint64_t{1} << 40);
            have_kernels = true;
        } else if (key == "--channels") {
            o.channels = static_cast<unsigned>(parse_count(key, value(), 1, 64));
        } else if (key == "--duration-s") {
            o.duration_s = parse_number(key, value(), 0, 1e7);
        } else if (key == "--batch") {
            o.batch = static_cast<unsigned>(parse_count(key, value(), 1, 256));
        } else if (key == "--depth") {
            o.depth = static_cast<unsigned>(parse_count(key, value(), 1, 256));
        } else if (key == "--gap-us") {
            o.gap_us = parse_number(key, value(), 0, 1e9);
        } else if (key == "--socket" || key == "--device") {
            const auto t = key == "--socket" ? pvgpu::Transport::Socket : pvgpu::Transport::Device;
            if (o.transport != pvgpu::Transport::Auto && o.transport != t)
                throw UsageError{"--socket and --device exclude each other"};
            o.transport = t;
            (t == pvgpu::Transport::Socket ? o.socket : o.device) = value();
            if ((t == pvgpu::Transport::Socket ? o.socket : o.device).empty())
                throw UsageError{std::string(key) + ": empty path"};
        } else if (key == "--weight") {
            o.weight = static_cast<std::uint32_t>(parse_count(key, value(), PVGPU_WEIGHT_MIN, PVGPU_WEIGHT_MAX));
        } else if (key == "--gpu") {
            o.gpu = static_cast<std::uint32_t>(parse_count(key, value(), 0, pvgpu::kMaxGpus - 1));
        } else if (key == "--name") {
            o.name = value();
        } else if (key == "--report-interval-s") {
            o.report_interval_s = parse_number(key, value(), 0, 1e6);
        } else if (key == "--reconnect-timeout-s") {
            o.reconnect_timeout_s = parse_number(key, value(), 0, 1e6);
        } else {
            throw UsageError{"unknown option '" + std::string(key) + "'"};
        }
    }
    if (o.mode.empty()) throw UsageError{"missing mode (throttle, bench or info)"};
    if (o.mode == "info" && !workload_option.empty())
        throw UsageError{workload_option + " is for throttle and bench, not info"};
    if (o.mode != "info" && !have_kernel_us) throw UsageError{"--kernel-us is required"};
    if (o.mode == "bench" && !have_kernels) throw UsageError{"bench needs --kernels M"};
    if (o.mode == "throttle" && have_kernels) throw UsageError{"--kernels is for bench; throttle runs endless"};
    if (o.mode == "bench" && o.duration_s) throw UsageError{"--duration-s is for throttle"};
    if (o.batch * o.depth > 256)
        throw UsageError{"--batch times --depth must not exceed the ring (256 entries)"};
    if (o.name.size() > 63) throw UsageError{"--name is longer than 63 bytes"};
    if (o.socket.empty()) {
        const char* env = std::getenv("PVGPU_SOCKET");
        o.socket = (env && *env) ? env : pvgpu::kDefaultSocketPath;
    }
    if (o.name.empty()) o.name = o.mode;
    return o;
}

// One submit loop on one channel.
struct Loop {
    pvgpu::Channel channel;
    std::deque<std::uint64_t> in_flight;  // last fence of each batch in flight
    std::uint64_t submitted = 0;
    TimePoint next_submit{};               // gap: no submission before this
};

double seconds_since_boot(TimePoint t) {
    return std::chrono::duration<double>(t.time_since_epoch()).count();  // CLOCK_MONOTONIC
}

double cpu_ms() {
    rusage ru{};
    ::getrusage(RUSAGE_SELF, &ru);
    return (static_cast<double>(ru.ru_utime.tv_sec + ru.ru_stime.tv_sec) * 1e3) +
           (static_cast<double>(ru.ru_utime.tv_usec + ru.ru_stime.tv_usec) / 1e3);
}

const char* link_text(std::uint32_t link) {
    switch (link) {
    case PVGPU_LINK_DOWN: return "down";
    case PVGPU_LINK_HELLO: return "hello";
    case PVGPU_LINK_READY: return "ready";
    default: return "unknown";
    }
}

const char* irq_text(std::uint32_t mode) {
    switch (mode) {
    case PVGPU_IRQ_MSIX: return "msix";
    case PVGPU_IRQ_INTX: return "intx";
    default: return "unknown";
    }
}

int print_info(const pvgpu::TransportInfo& i) {
    std::printf("transport=%s\n", pvgpu::transport_name(i.transport));
    if (i.transport == pvgpu::Transport::Socket) {
        std::printf("socket=%s\n", i.path.c_str());
        std::printf("protocol_version=%u\n", i.protocol_version);
        std::printf("client_id=%u\n", i.client_id);
        std::printf("max_channels=%u\n", i.max_channels);
        if (i.gpu)
            std::printf("gpu=%u\n", *i.gpu);
        else
            std::printf("gpu=any\n");
    } else {
        std::printf("device=%s\n", i.path.c_str());
        std::printf("abi_version=%u\n", i.abi_version);
        std::printf("device_version=%u\n", i.device_version);
        std::printf("slots=%u\n", i.num_slots);
        std::printf("slots_used=%u\n", i.slots_used);
        std::printf("link=%s\n", link_text(i.link));
        std::printf("link_gen=%u\n", i.link_gen);
        std::printf("irq_mode=%s\n", irq_text(i.irq_mode));
        std::printf("pid_hints=%s\n", i.pid_hints ? "on" : "off");
        std::printf("channels=%u\n", i.channels);
        std::printf("pid_hint=%llu\n", static_cast<unsigned long long>(i.pid_hint));
        std::printf("weight=%u\n", i.weight);
    }
    std::fflush(stdout);
    return kExitOk;
}

int run(const Options& o) {
    pvgpu::ClientOptions copt;
    copt.transport = o.transport;
    copt.socket_path = o.socket;
    copt.device_path = o.device;
    copt.weight = o.weight;
    copt.gpu = o.gpu;
    copt.name = o.name;
    copt.reconnect_timeout = std::chrono::milliseconds(static_cast<std::int64_t>(o.reconnect_timeout_s * 1000));
    copt.log = [](const std::string& line) { std::fprintf(stderr, "pvgpu-load: %s\n", line.c_str()); };
    pvgpu::Client client(copt);
    if (o.mode == "info") return print_info(client.info());
    if (client.transport() == pvgpu::Transport::Device) {
        // The guest driver names a task after its process (comm), read when
        // a channel is allocated.
        ::prctl(PR_SET_NAME, o.name.substr(0, 15).c_str(), 0UL, 0UL, 0UL);
    }
    std::fprintf(stderr, "pvgpu-load: transport=%s path=%s\n", pvgpu::transport_name(client.transport()),
                 client.transport() == pvgpu::Transport::Device ? client.info().path.c_str() : o.socket.c_str());

    const bool bench = o.mode == "bench";
    const auto kernel_ns = static_cast<std::uint64_t>(std::llround(o.kernel_us * 1000));
    const auto gap = std::chrono::nanoseconds(static_cast<std::int64_t>(o.gap_us * 1000));

    std::vector<Loop> loops(o.channels);
    for (Loop& l : loops) l.channel = client.alloc_channel();

    const TimePoint start = SteadyClock::now();
    const TimePoint end = o.duration_s
        ? start + std::chrono::nanoseconds(static_cast<std::int64_t>(*o.duration_s * 1e9))
        : TimePoint::max();
    const auto report_every = std::chrono::nanoseconds(static_cast<std::int64_t>(o.report_interval_s * 1e9));
    TimePoint next_report = o.report_interval_s > 0 ? start + report_every : TimePoint::max();
    std::uint64_t reported_completed = 0;
    TimePoint reported_at = start;
    std::fprintf(stderr, "pvgpu-load: %s name=%s client_id=%u channels=%u kernel_us=%g t=%.6f\n",
                 o.mode.c_str(), o.name.c_str(), client.client_id(), o.channels, o.kernel_us,
                 seconds_since_boot(start));

    auto total_completed = [&] {
        std::uint64_t n = 0;
        for (Loop& l : loops) n += l.channel.completed();  // fences count kernels from 1
        return n;
    };

    TimePoint finished = start;
    bool done = false;
    std::vector<pvgpu::Client::WaitGoal> goals;
    std::vector<std::uint64_t> batch_payloads;
    while (!g_stop) {
        TimePoint now = SteadyClock::now();
        if (now >= end) break;
        done = bench;
        TimePoint wake = std::min(end, next_report);
        goals.clear();
        for (Loop& l : loops) {
            const std::uint64_t completed = l.channel.completed();
            while (!l.in_flight.empty() && completed >= l.in_flight.front()) {
                l.in_flight.pop_front();
                l.next_submit = now + gap;
            }
            while (l.in_flight.size() < o.depth && now >= l.next_submit &&
                   (!bench || l.submitted < o.kernels)) {
                const std::uint64_t n = bench ? std::min<std::uint64_t>(o.batch, o.kernels - l.submitted) : o.batch;
                batch_payloads.assign(n, kernel_ns);
                l.in_flight.push_back(l.channel.submit(batch_payloads));  // one doorbell per batch
                l.submitted += n;
            }
            if (bench && (l.submitted < o.kernels || !l.in_flight.empty())) done = false;
            if (!l.in_flight.empty()) goals.push_back({&l.channel, l.in_flight.front()});
            if (l.in_flight.size() < o.depth && (!bench || l.submitted < o.kernels))
                wake = std::min(wake, l.next_submit);
        }
        if (done) {
            finished = SteadyClock::now();
            break;
        }
        if (now >= next_report) {
            const std::uint64_t c = total_completed();
            const double dt = std::chrono::duration<double>(now - reported_at).count();
            const double rate = dt > 0 ? static_cast<double>(c - reported_completed) / dt : 0;
            std::fprintf(stderr, "pvgpu-load: t=%.6f completed=%llu rate=%.1f busy=%.4f\n",
                         seconds_since_boot(now), static_cast<unsigned long long>(c), rate,
                         rate * o.kernel_us / 1e6);
            std::fflush(stderr);
            reported_completed = c;
            reported_at = now;
            next_report += report_every;
            if (next_report <= now) next_report = now + report_every;
            continue;
        }
        client.wait_any(goals, wake);
    }

    const TimePoint stop = bench && done ? finished : SteadyClock::now();
    const std::uint64_t kernels = total_completed();
    const double elapsed_ms = std::chrono::duration<double, std::milli>(stop - start).count();
    const double gpu_ms = static_cast<double>(kernels) * o.kernel_us / 1e3;
    if (bench && done) std::printf("runtime_ms=%.3f\n", elapsed_ms);
    std::printf("kernels=%llu\n", static_cast<unsigned long long>(kernels));
    if (!bench) {
        std::printf("elapsed_ms=%.3f\n", elapsed_ms);
        std::printf("rate=%.1f\n", elapsed_ms > 0 ? static_cast<double>(kernels) * 1e3 / elapsed_ms : 0.0);
    }
    std::printf("gpu_ms=%.3f\n", gpu_ms);
    std::printf("reconnects=%llu\n", static_cast<unsigned long long>(client.stats().reconnects));
    std::printf("resubmitted=%llu\n", static_cast<unsigned long long>(client.stats().resubmitted));
    std::printf("mode_messages=%llu\n", static_cast<unsigned long long>(client.stats().mode_messages));
    std::printf("polls=%llu\n", static_cast<unsigned long long>(client.stats().polls));
    std::printf("cpu_ms=%.1f\n", cpu_ms());
    std::fflush(stdout);
    if (bench && !done) {
        std::fprintf(stderr, "pvgpu-load: interrupted before the bench finished\n");
        return kExitInterrupted;
    }
    return kExitOk;
}

}  // namespace

int main(int argc, char** argv) {
    Options opts;
    try {
        opts = parse_args(argc, argv);
    } catch (const UsageError& e) {
        std::fprintf(stderr, "pvgpu-load: %s\n(see pvgpu-load --help)\n", e.message.c_str());
        return kExitUsage;
    }

    // Stop cleanly on SIGINT/SIGTERM: no SA_RESTART, so a wait returns early.
    struct sigaction sa{};
    sa.sa_handler = on_signal;
    sigemptyset(&sa.sa_mask);
    ::sigaction(SIGINT, &sa, nullptr);
    ::sigaction(SIGTERM, &sa, nullptr);
    // Wake-ups at the computed completion times, not up to 50 us later
    // (the default timer slack): late wake-ups would idle the channel.
    ::prctl(PR_SET_TIMERSLACK, 1000UL, 0UL, 0UL, 0UL);

    try {
        return run(opts);
    } catch (const pvgpu::ClientError& e) {
        std::fprintf(stderr, "pvgpu-load: %s\n", e.what());
        return kExitError;
    } catch (const std::exception& e) {
        std::fprintf(stderr, "pvgpu-load: unexpected error: %s\n", e.what());
        return kExitError;
    }
}
