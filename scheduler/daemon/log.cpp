#include "log.hpp"

#include <unistd.h>

#include <cstdio>
#include <cstdlib>

namespace pvgpu::daemon {

namespace {

LogLevel g_level = LogLevel::Info;

bool to_journal() {
    static const bool journal = std::getenv("JOURNAL_STREAM") != nullptr;
    return journal;
}

}  // namespace

void set_log_level(LogLevel level) { g_level = level; }
LogLevel log_level() { return g_level; }

std::optional<LogLevel> parse_log_level(std::string_view s) {
    if (s == "error") return LogLevel::Error;
    if (s == "warning") return LogLevel::Warning;
    if (s == "info") return LogLevel::Info;
    if (s == "debug") return LogLevel::Debug;
    return std::nullopt;
}

std::string_view to_string(LogLevel level) {
    switch (level) {
    case LogLevel::Error: return "error";
    case LogLevel::Warning: return "warning";
    case LogLevel::Info: return "info";
    case LogLevel::Debug: return "debug";
    }
    return "?";
}

void log_line(LogLevel level, const std::string& msg) {
    // syslog priorities: err 3, warning 4, info 6, debug 7.
    static constexpr int kPriority[] = {3, 4, 6, 7};
    std::string line;
    if (to_journal()) line += "<" + std::to_string(kPriority[static_cast<int>(level)]) + ">";
    line += "pvgpud: ";
    if (level != LogLevel::Info) {
        line += to_string(level);
        line += ": ";
    }
    line += msg;
    line += '\n';
    // One write per line so lines from a crash or a concurrent test reader
    // are never interleaved mid-line.
    std::fwrite(line.data(), 1, line.size(), stderr);
    std::fflush(stderr);
}

}  // namespace pvgpu::daemon
