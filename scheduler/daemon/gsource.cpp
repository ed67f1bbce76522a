#include "gsource.hpp"

#include <glib-unix.h>
#include <sys/epoll.h>
#include <unistd.h>

#include <array>
#include <cerrno>
#include <exception>
#include <memory>
#include <system_error>

#include "log.hpp"

namespace pvgpu::daemon {

void guarded(const char* what, const std::function<void()>& f) noexcept {
    try {
        f();
    } catch (const std::exception& e) {
        log_error("internal error in ", what, ": ", e.what());
    } catch (...) {
        log_error("internal error in ", what);
    }
}

void Source::reset() {
    if (!src_) return;
    g_source_destroy(src_);
    g_source_unref(src_);
    src_ = nullptr;
}

namespace {

using BoolFn = std::function<bool()>;

gboolean call_bool_fn(gpointer data) {
    bool again = false;
    guarded("main loop callback", [&] { again = (*static_cast<BoolFn*>(data))(); });
    return again ? G_SOURCE_CONTINUE : G_SOURCE_REMOVE;
}

void free_bool_fn(gpointer data) { std::unique_ptr<BoolFn> owner(static_cast<BoolFn*>(data)); }

Source attach_with(GMainContext* ctx, GSource* src, BoolFn fn) {
    g_source_set_callback(src, call_bool_fn, std::make_unique<BoolFn>(std::move(fn)).release(), free_bool_fn);
    g_source_attach(src, ctx);
    return Source(src);
}

// An fd source: GSource header first so GLib's pointer is ours.
struct FdSource {
    GSource base;
    FdWatch::Fn* fn;
    gpointer tag;
};

gboolean fd_dispatch(GSource* s, GSourceFunc, gpointer) {
    auto* fs = reinterpret_cast<FdSource*>(s);
    GIOCondition cond = g_source_query_unix_fd(s, fs->tag);
    guarded("fd callback", [&] { (*fs->fn)(cond); });
    return G_SOURCE_CONTINUE;
}

void fd_finalize(GSource* s) {
    auto* fs = reinterpret_cast<FdSource*>(s);
    std::unique_ptr<FdWatch::Fn> owner(fs->fn);
    fs->fn = nullptr;
}

GSourceFuncs fd_funcs = {nullptr, nullptr, fd_dispatch, fd_finalize, nullptr, nullptr};

}  // namespace

Source add_idle(GMainContext* ctx, std::function<bool()> fn, int priority) {
    GSource* src = g_idle_source_new();
    g_source_set_priority(src, priority);
    return attach_with(ctx, src, std::move(fn));
}

Source add_timeout(GMainContext* ctx, unsigned interval_ms, std::function<bool()> fn) {
    return attach_with(ctx, g_timeout_source_new(interval_ms), std::move(fn));
}

Source add_signal(GMainContext* ctx, int signum, std::function<void()> fn) {
    return attach_with(ctx, g_unix_signal_source_new(signum), [f = std::move(fn)] {
        f();
        return true;
    });
}

FdWatch::FdWatch(GMainContext* ctx, int fd, GIOCondition cond, Fn fn) : cond_(cond) {
    GSource* s = g_source_new(&fd_funcs, sizeof(FdSource));
    auto* fs = reinterpret_cast<FdSource*>(s);
    fs->fn = std::make_unique<Fn>(std::move(fn)).release();
    fs->tag = g_source_add_unix_fd(s, fd, cond);
    tag_ = fs->tag;
    // GLib blocks a non-recursive source while dispatching it by removing
    // and re-adding its fds, each time writing the context's wakeup eventfd
    // and costing an extra poll round.  These callbacks never iterate the
    // loop themselves, so let them "recurse" and skip that.
    g_source_set_can_recurse(s, TRUE);
    g_source_attach(s, ctx);
    src_ = Source(s);
}

void FdWatch::set_condition(GIOCondition cond) {
    if (!src_.active() || cond == cond_) return;
    cond_ = cond;
    g_source_modify_unix_fd(src_.get(), tag_, cond);
}

// ---- FdMux ------------------------------------------------------------------

struct FdMux::Entry {
    MuxWatch::Fn fn;
};

namespace {

std::uint32_t epoll_events(GIOCondition cond) {
    std::uint32_t ev = 0;
    if (cond & G_IO_IN) ev |= EPOLLIN;
    if (cond & G_IO_OUT) ev |= EPOLLOUT;
    return ev;  // EPOLLHUP and EPOLLERR are always reported
}

GIOCondition glib_condition(std::uint32_t ev) {
    int c = 0;
    if (ev & EPOLLIN) c |= G_IO_IN;
    if (ev & EPOLLOUT) c |= G_IO_OUT;
    if (ev & EPOLLHUP) c |= G_IO_HUP;
    if (ev & EPOLLERR) c |= G_IO_ERR;
    return static_cast<GIOCondition>(c);
}

}  // namespace

FdMux::FdMux(GMainContext* ctx) : epfd_(epoll_create1(EPOLL_CLOEXEC)) {
    if (epfd_ < 0) throw std::system_error(errno, std::generic_category(), "epoll_create1");
    watch_ = FdWatch(ctx, epfd_, G_IO_IN, [this](GIOCondition) { dispatch(); });
}

FdMux::~FdMux() {
    watch_.reset();
    ::close(epfd_);
}

void FdMux::dispatch() {
    // Bounded per round so one busy round cannot starve the rest of the
    // loop; level-triggered, the epoll fd stays readable for the others.
    std::array<epoll_event, 64> events;
    int n;
    do {
        n = epoll_wait(epfd_, events.data(), static_cast<int>(events.size()), 0);
    } while (n < 0 && errno == EINTR);
    for (int i = 0; i < n; ++i) {
        // Copies: struct epoll_event is packed, its u64 is not aligned.
        const std::uint64_t token = events[static_cast<std::size_t>(i)].data.u64;
        const std::uint32_t ready = events[static_cast<std::size_t>(i)].events;
        // A callback may have removed this or a later watch: look it up, and
        // keep the entry alive while its own callback runs.
        auto it = entries_.find(token);
        if (it == entries_.end()) continue;
        std::shared_ptr<Entry> e = it->second;
        const GIOCondition cond = glib_condition(ready);
        guarded("fd callback", [&] { e->fn(cond); });
    }
}

MuxWatch::MuxWatch(FdMux& mux, int fd, GIOCondition cond, Fn fn) : fd_(fd), cond_(cond) {
    const std::uint64_t token = mux.next_token_++;
    epoll_event ev{};
    ev.events = epoll_events(cond);
    ev.data.u64 = token;
    if (epoll_ctl(mux.epfd_, EPOLL_CTL_ADD, fd, &ev) != 0)
        throw std::system_error(errno, std::generic_category(), "epoll_ctl(ADD)");
    mux.entries_.emplace(token, std::make_shared<FdMux::Entry>(FdMux::Entry{std::move(fn)}));
    mux_ = &mux;
    token_ = token;
}

MuxWatch::MuxWatch(MuxWatch&& o) noexcept
    : mux_(std::exchange(o.mux_, nullptr)), fd_(o.fd_), token_(o.token_), cond_(o.cond_) {}

MuxWatch& MuxWatch::operator=(MuxWatch&& o) noexcept {
    if (this != &o) {
        reset();
        mux_ = std::exchange(o.mux_, nullptr);
        fd_ = o.fd_;
        token_ = o.token_;
        cond_ = o.cond_;
    }
    return *this;
}

void MuxWatch::set_condition(GIOCondition cond) {
    if (!mux_ || cond == cond_) return;
    epoll_event ev{};
    ev.events = epoll_events(cond);
    ev.data.u64 = token_;
    // Fails only for an fd closed under the watch, a caller bug; the old
    // condition then stays, as GLib would leave it.
    if (epoll_ctl(mux_->epfd_, EPOLL_CTL_MOD, fd_, &ev) == 0) cond_ = cond;
}

void MuxWatch::reset() {
    if (!mux_) return;
    // The fd is still open here (owners reset their watch before closing).
    (void)epoll_ctl(mux_->epfd_, EPOLL_CTL_DEL, fd_, nullptr);
    mux_->entries_.erase(token_);
    mux_ = nullptr;
}

}  // namespace pvgpu::daemon
