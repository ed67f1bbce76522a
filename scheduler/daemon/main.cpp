// pvgpud: the pvgpu host scheduler daemon.  See docs/pvgpud.8.md.
#include <sched.h>
#include <sys/resource.h>

#include <cerrno>
#include <csignal>
#include <cstdio>
#include <cstring>
#include <exception>
#include <string>

#include "config.hpp"
#include "daemon.hpp"
#include "log.hpp"

using namespace pvgpu::daemon;

namespace {

// Every channel holds a memfd and an eventfd: use the hard limit.
void raise_fd_limit() {
    rlimit rl{};
    if (getrlimit(RLIMIT_NOFILE, &rl) == 0 && rl.rlim_cur < rl.rlim_max) {
        rl.rlim_cur = rl.rlim_max;
        setrlimit(RLIMIT_NOFILE, &rl);
    }
}

// pvgpud's wake-up latency is GPU idle time: hfq keeps little of each
// leaf's work queued on the GPU and hands it the next entry at a completion,
// so a daemon that waits for a CPU behind busy vCPU threads leaves the GPU
// idle meanwhile (docs/results.md section 13).  SCHED_FIFO wakes it ahead
// of every normal thread; RESET_ON_FORK keeps that from its children.  Not
// fatal when refused: a scheduler that runs late beats none.
void apply_realtime_priority(std::uint32_t priority) {
    if (priority == 0) return;
    sched_param sp{};
    sp.sched_priority = static_cast<int>(priority);
    if (sched_setscheduler(0, SCHED_FIFO | SCHED_RESET_ON_FORK, &sp) == 0) {
        log_line(LogLevel::Info, "realtime scheduling: SCHED_FIFO priority " + std::to_string(priority));
        return;
    }
    const int err = errno;
    const int now = sched_getscheduler(0) & ~SCHED_RESET_ON_FORK;
    sched_param cur{};
    sched_getparam(0, &cur);
    const std::string running = now == SCHED_FIFO || now == SCHED_RR
                                    ? "running at the real-time priority it was started with (" +
                                          std::to_string(cur.sched_priority) + ")"
                                    : "running at normal priority";
    log_line(LogLevel::Warning,
             "realtime_priority " + std::to_string(priority) + ": " + std::strerror(err) +
                 (err == EPERM ? " (needs CAP_SYS_NICE or RLIMIT_RTPRIO >= the priority, and no "
                                 "RestrictRealtime= in a systemd unit)"
                               : "") +
                 "; " + running);
}

}  // namespace

int main(int argc, char** argv) {
    Config cfg;
    try {
        CliOptions cli = parse_cli(argc, argv);
        if (cli.help) {
            std::fputs(usage().c_str(), stdout);
            return 0;
        }
        if (cli.version) {
            std::printf("pvgpud %s (protocol %u, admin protocol %d)\n", PVGPU_VERSION, PVGPU_PROTO_VERSION,
                        kAdminProtocolVersion);
            return 0;
        }
        cfg = load_config(cli);
    } catch (const ConfigError& e) {
        log_line(LogLevel::Error, e.what());
        std::fputs("Try 'pvgpud --help'.\n", stderr);
        return 2;
    }
    set_log_level(cfg.log_level);
    // A peer that goes away mid-write must cost an EPIPE, not the daemon.
    std::signal(SIGPIPE, SIG_IGN);
    raise_fd_limit();
    apply_realtime_priority(cfg.realtime_priority);
    try {
        Daemon daemon(std::move(cfg));
        return daemon.run();
    } catch (const pvgpu::BackendError& e) {
        // A GPU that cannot be opened is a configuration error: status 2.
        log_line(LogLevel::Error, e.what());
        return 2;
    } catch (const std::exception& e) {
        log_line(LogLevel::Error, e.what());
        return 1;
    }
}
