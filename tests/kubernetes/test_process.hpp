// A child process of the test kubelet (pvgpud, pvgpu-device-plugin) whose
// stderr lines are collected, so the test can wait for a line it logs.
#pragma once

#include <sys/types.h>

#include <chrono>
#include <condition_variable>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "proto/unique_fd.hpp"

namespace pvgpu::test {

struct TestFailure {
    std::string message;
};

inline void check(bool cond, const std::string& message) {
    if (!cond) throw TestFailure{message};
}

class Process {
public:
    // Starts argv[0] with stdout on /dev/null and stderr read line by line.
    Process(std::string name, const std::vector<std::string>& argv);
    Process(const Process&) = delete;
    Process& operator=(const Process&) = delete;
    ~Process();  // kills it if still running

    // True once a stderr line holds `text` (false after `timeout` or its exit).
    bool wait_line(const std::string& text, std::chrono::milliseconds timeout);
    // Sends `sig` and waits for the exit; returns the wait status (SIGKILL
    // after `timeout`, then a TestFailure).
    int stop(int sig, std::chrono::milliseconds timeout);
    bool running();
    void dump_log() const;

private:
    void read_lines(int fd);

    std::string name_;
    pid_t pid_ = -1;
    int status_ = 0;
    mutable std::mutex mu_;
    std::condition_variable cv_;
    std::vector<std::string> lines_;
    bool eof_ = false;
    std::jthread reader_;
};

}  // namespace pvgpu::test
