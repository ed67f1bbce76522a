// pvgpud: the pvgpu host scheduler daemon.  See docs/pvgpud.8.md.
#include <sys/resource.h>

#include <csignal>
#include <cstdio>
#include <exception>

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
    try {
        Daemon daemon(std::move(cfg));
        return daemon.run();
    } catch (const std::exception& e) {
        log_line(LogLevel::Error, e.what());
        return 1;
    }
}
