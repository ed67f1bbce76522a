// pvgpu-bench-wakeup: what it costs this machine to wake a process N times a
// second on a timerfd (poll, then timerfd_settime to the next deadline),
// with no work in between.  pvgpud wakes at least once per kernel completion
// (the simulated GPU's timer; a real host takes an interrupt instead), so
// this is the floor under its CPU at a given kernel rate, whatever the
// policy: compare scale_bench.py's pvgpud_us_per_kernel with it
// (docs/results.md section 18).  Prints the fraction of a core and the CPU
// per wakeup from getrusage over the run.
#include <poll.h>
#include <sys/resource.h>
#include <sys/timerfd.h>

#include <cerrno>
#include <charconv>
#include <cstdio>
#include <cstring>
#include <string_view>
#include <vector>

#include "core/time.hpp"
#include "proto/unique_fd.hpp"

using namespace pvgpu;

namespace {

constexpr const char* kUsage =
    "usage: pvgpu-bench-wakeup [--rates LIST] [--seconds S]\n"
    "\n"
    "Wakes on a timerfd at each rate in LIST (wakeups per second, comma-\n"
    "separated; default 577,2083: the demo load's kernel rates under none and\n"
    "under a fair split) for S seconds (default 5) and prints this process's\n"
    "CPU: the floor under pvgpud's CPU at that kernel rate.\n";

Time monotonic_now() {
    timespec ts{};
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return static_cast<Time>(ts.tv_sec) * kSecond + ts.tv_nsec;
}

Duration cpu_used() {
    rusage ru{};
    getrusage(RUSAGE_SELF, &ru);
    auto us = [](const timeval& tv) { return static_cast<Duration>(tv.tv_sec) * kSecond + tv.tv_usec * 1000; };
    return us(ru.ru_utime) + us(ru.ru_stime);
}

bool parse_positive(std::string_view s, long& out) {
    auto [end, ec] = std::from_chars(s.data(), s.data() + s.size(), out);
    return ec == std::errc() && end == s.data() + s.size() && out > 0;
}

// One run at `rate` wakeups per second; false if a syscall failed.
bool run(int fd, long rate, long seconds) {
    const Duration period = kSecond / rate;
    Time at = monotonic_now();
    const Time end = at + seconds * kSecond;
    const Duration cpu0 = cpu_used();
    long wakeups = 0;
    while (at < end) {
        at += period;
        itimerspec its{};
        its.it_value.tv_sec = at / kSecond;
        its.it_value.tv_nsec = at % kSecond;
        if (timerfd_settime(fd, TFD_TIMER_ABSTIME, &its, nullptr) != 0) {
            std::perror("pvgpu-bench-wakeup: timerfd_settime");
            return false;
        }
        pollfd p{fd, POLLIN, 0};
        if (::poll(&p, 1, -1) < 0 && errno != EINTR) {
            std::perror("pvgpu-bench-wakeup: poll");
            return false;
        }
        ++wakeups;
    }
    const double cpu_s = static_cast<double>(cpu_used() - cpu0) / kSecond;
    std::printf("RESULT wakeup.%ld.core_fraction=%.4f\n", rate, cpu_s / static_cast<double>(seconds));
    std::printf("RESULT wakeup.%ld.us_per_wakeup=%.1f\n", rate, cpu_s * 1e6 / static_cast<double>(wakeups));
    std::fflush(stdout);
    return true;
}

}  // namespace

int main(int argc, char** argv) {
    std::vector<long> rates{577, 2083};
    long seconds = 5;
    for (int i = 1; i < argc; ++i) {
        const std::string_view arg = argv[i];
        if (arg == "--help" || arg == "-h") {
            std::fputs(kUsage, stdout);
            return 0;
        }
        if ((arg == "--rates" || arg == "--seconds") && i + 1 < argc) {
            const std::string_view value = argv[++i];
            if (arg == "--seconds") {
                if (!parse_positive(value, seconds)) {
                    std::fprintf(stderr, "pvgpu-bench-wakeup: --seconds: not a positive integer: %s\n", argv[i]);
                    return 2;
                }
                continue;
            }
            rates.clear();
            for (std::size_t pos = 0; pos <= value.size();) {
                std::size_t comma = value.find(',', pos);
                if (comma == std::string_view::npos) comma = value.size();
                long r = 0;
                if (!parse_positive(value.substr(pos, comma - pos), r) || r > 1'000'000) {
                    std::fprintf(stderr, "pvgpu-bench-wakeup: --rates: want rates in 1..1000000, got %s\n",
                                 argv[i]);
                    return 2;
                }
                rates.push_back(r);
                pos = comma + 1;
            }
            continue;
        }
        std::fprintf(stderr, "pvgpu-bench-wakeup: unknown or incomplete option %s\n%s", argv[i], kUsage);
        return 2;
    }
    UniqueFd fd(timerfd_create(CLOCK_MONOTONIC, TFD_CLOEXEC));
    if (!fd) {
        std::perror("pvgpu-bench-wakeup: timerfd_create");
        return 1;
    }
    for (long rate : rates)
        if (!run(fd.get(), rate, seconds)) return 1;
    return 0;
}
