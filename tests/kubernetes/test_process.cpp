// Child processes of the test kubelet (test_process.hpp).
#include "test_process.hpp"

#include <fcntl.h>
#include <signal.h>
#include <spawn.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstdio>
#include <cstring>

extern char** environ;

namespace pvgpu::test {

Process::Process(std::string name, const std::vector<std::string>& argv) : name_(std::move(name)) {
    int p[2];
    check(::pipe2(p, O_CLOEXEC) == 0, "pipe2 failed");
    UniqueFd rd(p[0]);
    UniqueFd wr(p[1]);
    posix_spawn_file_actions_t fa;
    posix_spawn_file_actions_init(&fa);
    posix_spawn_file_actions_addopen(&fa, 0, "/dev/null", O_RDONLY, 0);
    posix_spawn_file_actions_addopen(&fa, 1, "/dev/null", O_WRONLY, 0);
    posix_spawn_file_actions_adddup2(&fa, wr.get(), 2);
    std::vector<char*> args;
    for (const auto& a : argv) args.push_back(const_cast<char*>(a.c_str()));
    args.push_back(nullptr);
    const int rc = ::posix_spawn(&pid_, args[0], &fa, nullptr, args.data(), environ);
    posix_spawn_file_actions_destroy(&fa);
    check(rc == 0, "cannot start " + argv[0] + ": " + std::strerror(rc));
    wr.reset();  // EOF on rd once the child is gone
    reader_ = std::jthread([this, fd = std::move(rd)] { read_lines(fd.get()); });
}

Process::~Process() {
    if (pid_ > 0) {
        ::kill(pid_, SIGKILL);
        ::waitpid(pid_, nullptr, 0);
    }
}

void Process::read_lines(int fd) {
    std::string buf;
    char chunk[4096];
    ssize_t n;
    while ((n = ::read(fd, chunk, sizeof chunk)) != 0) {
        if (n < 0) {
            if (errno == EINTR) continue;
            break;
        }
        buf.append(chunk, static_cast<std::size_t>(n));
        std::size_t nl;
        while ((nl = buf.find('\n')) != std::string::npos) {
            const std::lock_guard lock(mu_);
            lines_.push_back(buf.substr(0, nl));
            buf.erase(0, nl + 1);
            cv_.notify_all();
        }
    }
    const std::lock_guard lock(mu_);
    eof_ = true;
    cv_.notify_all();
}

bool Process::wait_line(const std::string& text, std::chrono::milliseconds timeout) {
    std::unique_lock lock(mu_);
    const auto has = [&] {
        for (const auto& l : lines_)
            if (l.find(text) != std::string::npos) return true;
        return false;
    };
    cv_.wait_for(lock, timeout, [&] { return has() || eof_; });
    return has();
}

int Process::stop(int sig, std::chrono::milliseconds timeout) {
    check(pid_ > 0, name_ + " is not running");
    ::kill(pid_, sig);
    bool ended;
    {
        // Its stderr's EOF is its exit (neither child forks).
        std::unique_lock lock(mu_);
        ended = cv_.wait_for(lock, timeout, [&] { return eof_; });
    }
    if (!ended) ::kill(pid_, SIGKILL);
    ::waitpid(pid_, &status_, 0);
    pid_ = -1;
    check(ended, name_ + " did not exit within " + std::to_string(timeout.count()) + " ms of signal " +
                     std::to_string(sig));
    return status_;
}

bool Process::running() {
    const std::lock_guard lock(mu_);
    return pid_ > 0 && !eof_;
}

void Process::dump_log() const {
    const std::lock_guard lock(mu_);
    for (const auto& l : lines_) std::printf("#   [%s] %s\n", name_.c_str(), l.c_str());
}

}  // namespace pvgpu::test
