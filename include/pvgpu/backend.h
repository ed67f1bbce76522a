/* SPDX-License-Identifier: GPL-2.0-or-later */
/*
 * pvgpu GPU backend ABI: how pvgpud reaches a GPU.
 *
 * A backend is a shared object (libpvgpu-backend-NAME.so) that exports one
 * symbol, PVGPU_BACKEND_ENTRY_SYMBOL; pvgpud loads it with dlopen when
 * pvgpud.conf's [gpu.N] group says `backend = /path/to/libpvgpu-backend-NAME.so`.
 * The simulated GPU is a backend too, linked into pvgpud (`backend = sim`,
 * the default).  Nothing else of pvgpud is visible to a backend: this header
 * and abi.h are the whole contract.  docs/backend.md explains it at length.
 *
 * What a backend shows the host is what a host can read from real hardware
 * (../shared/DESIGN.md section 4): the GPU's own channel registers (IB_PUT,
 * IB_GET, FENCE, STATUS, pending), the engine status register naming the
 * channel on the engine, interrupts that ring entries ask for
 * (PVGPU_ENTRY_IRQ) and channel errors, the context-switch trace and the
 * utilisation counter.  Never how long a piece of work takes, and nothing
 * the submitted work itself asks the GPU to write (a completion timestamp
 * is written only where an entry asks for one, and a tenant writes its
 * entries).
 *
 * Threading: pvgpud calls every function below from one thread, its
 * scheduling thread, never concurrently and never re-entrantly from inside
 * a host callback.  A backend calls the host's callbacks (struct
 * pvgpu_backend_host) only on that thread: from inside a call the host made
 * into the backend, or from a timer or fd callback the host delivered.  A
 * driver that takes interrupts on a thread of its own hands them over through
 * an fd (an eventfd) it asked the host to watch (fd_watch).
 *
 * Versioning: PVGPU_BACKEND_ABI_VERSION changes whenever a struct here changes
 * incompatibly.  The host calls the entry with the version it speaks; the
 * backend returns its ops table for that version (or NULL if it cannot speak
 * it).  The table starts with the version the backend speaks and the table's
 * size, so the host refuses a mismatch with a clear message rather than
 * calling through a table laid out differently.  Within a version, new
 * members are only ever appended; `size` says which a table has.
 *
 * Channel ids are chosen by the backend: non-zero 32-bit values, unique
 * among its live channels (0 means "no channel").  Times are nanoseconds on
 * the host's monotonic clock (now_ns), durations nanoseconds.
 *
 * Everything here is plain C; a C++ backend must not let an exception leave
 * any function of its table, and the host's callbacks never unwind into the
 * backend.
 */
#ifndef PVGPU_BACKEND_H
#define PVGPU_BACKEND_H

#include <stddef.h>

#include "abi.h"

#ifdef __cplusplus
extern "C" {
#endif

#define PVGPU_BACKEND_ABI_VERSION 2u

/* The one symbol a backend exports, of type pvgpu_backend_entry_fn. */
#define PVGPU_BACKEND_ENTRY_SYMBOL "pvgpu_backend_entry"

/* Buffer size the host gives for error messages (NUL-terminated, truncated). */
#define PVGPU_BACKEND_ERROR_LEN 256u

/* Log levels of pvgpu_backend_host.log (syslog's order). */
#define PVGPU_BACKEND_LOG_ERROR 3
#define PVGPU_BACKEND_LOG_WARNING 4
#define PVGPU_BACKEND_LOG_INFO 6
#define PVGPU_BACKEND_LOG_DEBUG 7

/* A host timer or fd watch; 0 is none. */
typedef pvgpu_u64 pvgpu_backend_handle;

/* A callback the host runs on its scheduling thread. */
typedef void (*pvgpu_backend_callback)(void *arg);

/*
 * What the host offers a GPU it opens.  Owned by the host, valid from open
 * until close returns; the backend keeps the pointer.  `ctx` is the first
 * argument of every function here.
 */
struct pvgpu_backend_host {
	pvgpu_u32 abi_version;        /* PVGPU_BACKEND_ABI_VERSION */
	pvgpu_u32 size;               /* sizeof(struct pvgpu_backend_host) */
	void *ctx;

	/* The host's monotonic clock (ns).  Every time in this ABI is on it. */
	pvgpu_u64 (*now_ns)(void *ctx);

	/* One-shot timer: `fn(arg)` runs on the scheduling thread once now_ns
	 * reaches `at_ns` (at once if it has), never from inside timer_arm.
	 * Returns a non-zero handle.  Cancelling a fired or unknown handle does
	 * nothing.  A simulated GPU needs timers to model its engine; a real
	 * driver may never arm one.  The backend cancels its timers before
	 * close returns (the host cancels any left over, and logs it). */
	pvgpu_backend_handle (*timer_arm)(void *ctx, pvgpu_u64 at_ns, pvgpu_backend_callback fn,
	                                  void *arg);
	void (*timer_cancel)(void *ctx, pvgpu_backend_handle timer);

	/* Watch a file descriptor: `fn(arg)` runs on the scheduling thread
	 * whenever `fd` is readable, until fd_unwatch.  The backend keeps
	 * owning the fd.  NULL when the host cannot watch fds: a backend that
	 * needs it fails open with a message saying so.  Returns a non-zero
	 * handle, or 0 on failure. */
	pvgpu_backend_handle (*fd_watch)(void *ctx, int fd, pvgpu_backend_callback fn, void *arg);
	void (*fd_unwatch)(void *ctx, pvgpu_backend_handle watch);

	/* Interrupts.  `fence_irq`: an entry flagged PVGPU_ENTRY_IRQ on
	 * `channel` completed and the channel's FENCE register now holds
	 * `fence` (or a later value).  `channel_error`: the GPU stopped
	 * `channel` (PVGPU_CHAN_ERR_*: watchdog, bad entry); its pending work
	 * is dropped, STATUS reads PVGPU_CHAN_STATUS_ERROR and it ignores
	 * doorbells until destroyed.  Each at most once per event, in the
	 * order the engine raised them.  The host may call back into the
	 * backend from inside these (register reads, doorbells, preempt_to,
	 * even channel_destroy of that channel). */
	void (*fence_irq)(void *ctx, pvgpu_u32 channel, pvgpu_u32 fence);
	void (*channel_error)(void *ctx, pvgpu_u32 channel, pvgpu_u32 error);

	/* A line for pvgpud's log (PVGPU_BACKEND_LOG_*); `msg` has no newline. */
	void (*log)(void *ctx, int level, const char *msg);
};

/* How the engine shares itself between channels (what the host programmed
 * or the hardware fixes).  Non-preemptive: each kernel runs to completion,
 * channels served in turn.  Preemptive: the engine switches channels at
 * the end of every `timeslice_ns` while others wait, `ctxsw_ns` of dead
 * time per switch, and the host may preempt (preempt_to) at `preempt_ns`
 * of dead time per preemption. */
/* pvgpu_backend_arbitration.flags */
#define PVGPU_BACKEND_HAS_CTXSW_TRACE 0x1u /* this GPU keeps a context-switch trace (ops.ctxsw_trace) */

struct pvgpu_backend_arbitration {
	pvgpu_u32 preemptive;         /* 0 or 1 */
	pvgpu_u32 flags;              /* PVGPU_BACKEND_HAS_*; other bits 0 */
	pvgpu_u64 timeslice_ns;
	pvgpu_u64 ctxsw_ns;
	pvgpu_u64 preempt_ns;
	char name[32];                /* "round-robin", "timeslice", or the hardware's word; NUL-terminated */
};

/* Where a new channel's positions start: IB_GET = IB_PUT = `get` (nothing
 * queued), FENCE = `fence`.  Both 0 for a fresh channel; a channel drained
 * on one GPU is re-created on another with the positions it stopped at. */
struct pvgpu_backend_channel_start {
	pvgpu_u32 get;
	pvgpu_u32 fence;
};

/* An open GPU; opaque to the host. */
struct pvgpu_backend_gpu;

/*
 * The backend's function table.  Static storage, valid while the backend
 * is loaded.  Every member is required (non-NULL) unless it says otherwise.
 * One record of the context-switch trace (NVIDIA's FECS context-switch
 * trace writes one, for the host, each time the engine loads a context).
 */
struct pvgpu_backend_ctxsw {
	pvgpu_u64 at_ns;              /* when the engine changed channel */
	pvgpu_u32 channel;            /* the channel it loaded; 0: it went idle */
	pvgpu_u32 reserved;           /* 0 */
};

/*
 * `gpu` is what open returned; `channel` one that channel_create returned
 * on that gpu and channel_destroy has not destroyed: the host never passes
 * anything else (a backend may abort if it does).
 */
struct pvgpu_backend_ops {
	pvgpu_u32 abi_version;        /* PVGPU_BACKEND_ABI_VERSION the table follows */
	pvgpu_u32 size;               /* sizeof(struct pvgpu_backend_ops) as the backend was built */
	const char *name;             /* short name for logs: "sim", "nouveau", ... */

	/* Opens one GPU.  `options` are `n_options` "key=value" strings from
	 * pvgpud.conf's [gpu.N] group (the host's own keys removed); an
	 * unknown key or a bad value fails the open.  On failure returns NULL
	 * with a one-line message in `err` (at most `err_len` bytes with the
	 * NUL), e.g. "unknown option 'foo' (known: arbitration, ...)" or
	 * "timeslice_us: '0' is not an integer in 1..10000000".  `host` stays
	 * valid until close returns. */
	struct pvgpu_backend_gpu *(*open)(const struct pvgpu_backend_host *host,
	                                  const char *const *options, pvgpu_u32 n_options,
	                                  char *err, size_t err_len);
	/* Stops the engine, drops every channel still open, cancels the
	 * backend's timers and fd watches, frees the gpu.  Raises nothing. */
	void (*close)(struct pvgpu_backend_gpu *gpu);

	/* One line for pvgpud's log, e.g. "simulated GPU, round-robin,
	 * watchdog 2000 ms".  Owned by the backend, valid until close. */
	const char *(*describe)(struct pvgpu_backend_gpu *gpu);
	/* Fills `out` (zeroed by the host). */
	void (*arbitration)(struct pvgpu_backend_gpu *gpu, struct pvgpu_backend_arbitration *out);

	/* Channels.  The host owns `ctrl` (one page) and `ring` and keeps them
	 * mapped until channel_destroy returns; the submitter (a guest) may
	 * write anything into them at any time.  The GPU writes its copies of
	 * IB_GET, FENCE, STATUS and ERROR into `ctrl` (from creation on, at
	 * `start`), never IB_PUT (the submitter's), reads ring entries when
	 * a doorbell makes them valid, and must not trust either page for its
	 * own state.  `start` may be NULL (both 0).  Returns 0 and the new
	 * id in `*channel`, or non-zero with a message in `err` (out of
	 * channels, memory the GPU cannot map). */
	int (*channel_create)(struct pvgpu_backend_gpu *gpu, struct pvgpu_ctrl_page *ctrl,
	                      struct pvgpu_ring *ring, const struct pvgpu_backend_channel_start *start,
	                      pvgpu_u32 *channel, char *err, size_t err_len);
	/* Takes the channel off the engine (its kernel is lost), forgets it and
	 * stops touching its memory before returning.  Raises nothing for it. */
	void (*channel_destroy)(struct pvgpu_backend_gpu *gpu, pvgpu_u32 channel);

	/* The GPU's own channel registers (the control page holds copies a
	 * tenant can overwrite; the host never reads those).  Writing IB_PUT is
	 * the doorbell: entries up to it become the GPU's (it fetches them
	 * then: later writes to the ring do not change them).  More than
	 * PVGPU_RING_ENTRIES outstanding, or an entry the GPU cannot decode,
	 * kills the channel with PVGPU_CHAN_ERR_BAD_ENTRY.  A dead channel
	 * ignores doorbells. */
	void (*write_ib_put)(struct pvgpu_backend_gpu *gpu, pvgpu_u32 channel, pvgpu_u32 put);
	pvgpu_u32 (*read_ib_put)(struct pvgpu_backend_gpu *gpu, pvgpu_u32 channel);
	/* Entries fetched (the one on the engine included). */
	pvgpu_u32 (*read_ib_get)(struct pvgpu_backend_gpu *gpu, pvgpu_u32 channel);
	/* Fence of the last completed entry. */
	pvgpu_u32 (*read_fence)(struct pvgpu_backend_gpu *gpu, pvgpu_u32 channel);
	/* PVGPU_CHAN_STATUS_*. */
	pvgpu_u32 (*read_status)(struct pvgpu_backend_gpu *gpu, pvgpu_u32 channel);
	/* 1 while work is queued or fetched and not completed (IB_PUT !=
	 * completed) on a live channel, else 0. */
	int (*pending)(struct pvgpu_backend_gpu *gpu, pvgpu_u32 channel);

	/* Engine status register: 1 and the channel whose context is on the
	 * engine in `*channel`, or 0 when the engine is idle. */
	int (*engine_status)(struct pvgpu_backend_gpu *gpu, pvgpu_u32 *channel);
	/* The context-switch trace: a record each time the engine changed the
	 * channel it runs (another channel, or idle), whatever the work asks
	 * for.  Copies up to `max` records not read before into `out`, oldest
	 * first, and returns how many; `*lost` (never NULL) gets the number of
	 * records dropped since the previous call because the backend's buffer
	 * was full (the host then knows less, never something false).  May be
	 * NULL (the GPU keeps no trace). */
	pvgpu_u32 (*ctxsw_trace)(struct pvgpu_backend_gpu *gpu, struct pvgpu_backend_ctxsw *out,
	                         pvgpu_u32 max, pvgpu_u64 *lost);
	/* Host preemption (the host owns the runlist): the kernel on the engine
	 * is taken off, to resume later where it stopped, and `next` loaded
	 * after the arbitration's preempt_ns, with a fresh slice.  Returns 1,
	 * or 0 and changes nothing on an engine that cannot preempt, when the
	 * engine is idle, or when `next` is on it already or has no pending
	 * work.  May be NULL (cannot preempt). */
	int (*preempt_to)(struct pvgpu_backend_gpu *gpu, pvgpu_u32 next);
	/* A kernel running longer than `limit_ns` is killed with its channel
	 * (channel_error, PVGPU_CHAN_ERR_WATCHDOG); 0 disables. */
	void (*set_watchdog)(struct pvgpu_backend_gpu *gpu, pvgpu_u64 limit_ns);

	/* The utilisation counter: nanoseconds the engine executed work since
	 * open, a kernel on the engine counted up to now (NVML's per-GPU
	 * utilisation is this counter sampled over a window).  Readable at any
	 * moment; never decreases. */
	pvgpu_u64 (*busy_ns)(struct pvgpu_backend_gpu *gpu);
	/* Times the engine changed channel since open (a context-switch trace,
	 * NVIDIA's FECS trace, counted). */
	pvgpu_u64 (*context_switches)(struct pvgpu_backend_gpu *gpu);
};

/* The entry symbol: returns the table for `host_abi_version`, or NULL when
 * the backend cannot speak it.  May be called more than once. */
typedef const struct pvgpu_backend_ops *(*pvgpu_backend_entry_fn)(pvgpu_u32 host_abi_version);

#if defined(__GNUC__)
#define PVGPU_BACKEND_EXPORT __attribute__((visibility("default")))
#else
#define PVGPU_BACKEND_EXPORT
#endif

/* What a backend defines (PVGPU_BACKEND_EXPORT keeps it visible in a
 * library built with -fvisibility=hidden). */
PVGPU_BACKEND_EXPORT const struct pvgpu_backend_ops *pvgpu_backend_entry(pvgpu_u32 host_abi_version);

#ifdef __cplusplus
}
#endif

#endif /* PVGPU_BACKEND_H */
