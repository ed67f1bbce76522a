// RAII for GLib sources.  A Source owns one reference to an attached GSource
// and destroys (detaches) it when it goes.  Callbacks are std::function
// objects owned by the GSource and freed when GLib finalizes it, which GLib
// defers until a running dispatch returns: a callback may therefore destroy
// the Source that is calling it.  Exceptions never cross into GLib's C
// frames: a throwing callback is logged and the loop goes on.
#pragma once

#include <glib.h>

#include <cstdint>
#include <functional>
#include <memory>
#include <unordered_map>
#include <utility>

namespace pvgpu::daemon {

class Source {
public:
    Source() = default;
    explicit Source(GSource* attached) : src_(attached) {}
    Source(const Source&) = delete;
    Source& operator=(const Source&) = delete;
    Source(Source&& o) noexcept : src_(std::exchange(o.src_, nullptr)) {}
    Source& operator=(Source&& o) noexcept {
        if (this != &o) {
            reset();
            src_ = std::exchange(o.src_, nullptr);
        }
        return *this;
    }
    ~Source() { reset(); }

    void reset();
    GSource* get() const { return src_; }
    // Attached and not yet destroyed (an idle that returned false is done).
    bool active() const { return src_ && !g_source_is_destroyed(src_); }
    explicit operator bool() const { return active(); }

private:
    GSource* src_ = nullptr;
};

// Runs `fn` from the loop until it returns false.
Source add_idle(GMainContext* ctx, std::function<bool()> fn, int priority = G_PRIORITY_DEFAULT);
// Runs `fn` every `interval_ms` (monotonic) until it returns false.  The
// daemon's own timers are GlibTimers; this serves C libraries' event loops.
Source add_timeout(GMainContext* ctx, unsigned interval_ms, std::function<bool()> fn);
// Runs `fn` from the loop whenever `signum` arrives (g_unix_signal semantics).
Source add_signal(GMainContext* ctx, int signum, std::function<void()> fn);

// Watches one file descriptor; the condition can change in place (a socket
// adds G_IO_OUT only while it has something queued).  HUP and ERR are always
// reported.
class FdWatch {
public:
    using Fn = std::function<void(GIOCondition)>;
    FdWatch() = default;
    FdWatch(GMainContext* ctx, int fd, GIOCondition cond, Fn fn);

    void set_condition(GIOCondition cond);
    GIOCondition condition() const { return cond_; }
    void reset() { src_.reset(); }
    explicit operator bool() const { return src_.active(); }

private:
    Source src_;
    gpointer tag_ = nullptr;
    GIOCondition cond_{};
};

// Many descriptors behind one: an epoll set that the GLib loop watches as
// a single fd.  GLib polls every attached fd on every iteration (poll(2),
// then a check per source); with hundreds of clients that was most of
// pvgpud's CPU (issue 12: 128 host clients, perf: do_sys_poll, sock_poll,
// g_main_context_check).  Level-triggered, like GLib's own watches.
class FdMux {
public:
    explicit FdMux(GMainContext* ctx);  // throws std::system_error
    FdMux(const FdMux&) = delete;
    FdMux& operator=(const FdMux&) = delete;
    ~FdMux();

    struct Entry;  // a watched fd and its callback (gsource.cpp)

private:
    friend class MuxWatch;
    void dispatch();

    int epfd_ = -1;
    FdWatch watch_;
    std::uint64_t next_token_ = 1;
    std::unordered_map<std::uint64_t, std::shared_ptr<Entry>> entries_;
};

// One fd in an FdMux, with FdWatch's interface and semantics (HUP and ERR
// always reported; a callback may destroy its own watch or others).
class MuxWatch {
public:
    using Fn = FdWatch::Fn;
    MuxWatch() = default;
    MuxWatch(FdMux& mux, int fd, GIOCondition cond, Fn fn);  // throws std::system_error
    MuxWatch(const MuxWatch&) = delete;
    MuxWatch& operator=(const MuxWatch&) = delete;
    MuxWatch(MuxWatch&& o) noexcept;
    MuxWatch& operator=(MuxWatch&& o) noexcept;
    ~MuxWatch() { reset(); }

    void set_condition(GIOCondition cond);
    GIOCondition condition() const { return cond_; }
    void reset();
    explicit operator bool() const { return mux_ != nullptr; }

private:
    FdMux* mux_ = nullptr;
    int fd_ = -1;
    std::uint64_t token_ = 0;
    GIOCondition cond_{};
};

// Runs f, logging instead of propagating any exception (for C callbacks).
void guarded(const char* what, const std::function<void()>& f) noexcept;

}  // namespace pvgpu::daemon
