// Logging to stderr, one line per message, with a level prefix.  Under
// systemd (JOURNAL_STREAM set) each line also starts with the syslog
// priority ("<4>") so the journal records the right level.
#pragma once

#include <optional>
#include <sstream>
#include <string>
#include <string_view>

namespace pvgpu::daemon {

enum class LogLevel { Error = 0, Warning = 1, Info = 2, Debug = 3 };

void set_log_level(LogLevel level);
LogLevel log_level();
std::optional<LogLevel> parse_log_level(std::string_view s);
std::string_view to_string(LogLevel level);

void log_line(LogLevel level, const std::string& msg);

template <class... A>
void log(LogLevel level, const A&... parts) {
    if (level > log_level()) return;
    std::ostringstream os;
    (os << ... << parts);
    log_line(level, os.str());
}
template <class... A>
void log_error(const A&... p) {
    log(LogLevel::Error, p...);
}
template <class... A>
void log_warning(const A&... p) {
    log(LogLevel::Warning, p...);
}
template <class... A>
void log_info(const A&... p) {
    log(LogLevel::Info, p...);
}
template <class... A>
void log_debug(const A&... p) {
    log(LogLevel::Debug, p...);
}

}  // namespace pvgpu::daemon
