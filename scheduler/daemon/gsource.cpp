#include "gsource.hpp"

#include <glib-unix.h>

#include <exception>
#include <memory>

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

}  // namespace pvgpu::daemon
