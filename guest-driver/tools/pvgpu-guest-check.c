// SPDX-License-Identifier: GPL-2.0-or-later
/*
 * pvgpu-guest-check: checks of the pvgpu guest driver from inside a guest.
 *
 * Runs in a minimal (busybox) guest, so it is a static binary with no
 * dependency but libc.  Every subcommand exits 0 when all its checks pass and
 * 1 with a "FAIL:" line naming the failed check otherwise; 2 is a usage error.
 * See usage() and docs/guest.md.
 */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <inttypes.h>
#include <linux/capability.h>
#include <setjmp.h>
#include <signal.h>
#include <stdarg.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/ioctl.h>
#include <sys/mman.h>
#include <sys/prctl.h>
#include <sys/syscall.h>
#include <sys/time.h>
#include <sys/wait.h>
#include <time.h>
#include <grp.h>
#include <unistd.h>

#include "pvgpu/guest_ioctl.h"

#define CTRL_PAGES 3

static const char *prog = "pvgpu-guest-check";
static const char *subcommand = "";

static void fail(const char *fmt, ...) __attribute__((format(printf, 1, 2), noreturn));
static void fail(const char *fmt, ...)
{
	va_list ap;

	fprintf(stderr, "FAIL: %s %s: ", prog, subcommand);
	va_start(ap, fmt);
	vfprintf(stderr, fmt, ap);
	va_end(ap);
	fputc('\n', stderr);
	exit(1);
}

static void note(const char *fmt, ...) __attribute__((format(printf, 1, 2)));
static void note(const char *fmt, ...)
{
	va_list ap;

	printf("%s: ", subcommand);
	va_start(ap, fmt);
	vprintf(fmt, ap);
	va_end(ap);
	putchar('\n');
	fflush(stdout);
}

static double now_s(void)
{
	struct timespec ts;

	clock_gettime(CLOCK_MONOTONIC, &ts);
	return ts.tv_sec + ts.tv_nsec / 1e9;
}

static void pause_ms(long ms)
{
	struct timespec ts = { ms / 1000, (ms % 1000) * 1000000L };

	while (nanosleep(&ts, &ts) && errno == EINTR)
		;
}

/* ---- ioctl wrappers: return 0 or errno ---------------------------------- */

static int dev_open(void)
{
	int fd = open(PVGPU_DEVICE_NODE, O_RDWR | O_CLOEXEC);

	if (fd < 0)
		fail("open %s: %s", PVGPU_DEVICE_NODE, strerror(errno));
	return fd;
}

static int xioctl(int fd, unsigned long req, void *arg)
{
	return ioctl(fd, req, arg) ? errno : 0;
}

static struct pvgpu_ioc_info info(int fd)
{
	struct pvgpu_ioc_info in = { .size = sizeof(in) };
	int e = xioctl(fd, PVGPU_IOC_INFO, &in);

	if (e)
		fail("INFO: %s", strerror(e));
	return in;
}

static int try_alloc(int fd, struct pvgpu_ioc_alloc *a)
{
	memset(a, 0, sizeof(*a));
	a->size = sizeof(*a);
	return xioctl(fd, PVGPU_IOC_ALLOC, a);
}

static uint32_t alloc_chan(int fd)
{
	struct pvgpu_ioc_alloc a;
	int e = try_alloc(fd, &a);

	if (e)
		fail("ALLOC: %s", strerror(e));
	return a.handle;
}

static int try_free(int fd, uint32_t handle)
{
	struct pvgpu_ioc_free f = { .size = sizeof(f), .handle = handle };

	return xioctl(fd, PVGPU_IOC_FREE, &f);
}

static void free_chan(int fd, uint32_t handle)
{
	int e = try_free(fd, handle);

	if (e)
		fail("FREE %u: %s", handle, strerror(e));
}

/* WAIT: errno, or 0 with *status / *error filled in. */
static int try_wait(int fd, uint32_t handle, uint32_t fence, int64_t timeout_ns,
		    uint32_t *status, uint32_t *error)
{
	struct pvgpu_ioc_wait w = {
		.size = sizeof(w), .handle = handle, .fence = fence, .timeout_ns = timeout_ns,
	};
	int e = xioctl(fd, PVGPU_IOC_WAIT, &w);

	if (!e) {
		*status = w.status;
		*error = w.error;
	}
	return e;
}

static void expect_errno(const char *what, int got, int want)
{
	if (got != want)
		fail("%s: got %s (%d), want %s (%d)", what, got ? strerror(got) : "success",
		     got, want ? strerror(want) : "success", want);
}

/* ---- channels and submission ---------------------------------------------- */

struct chan {
	int fd;
	uint32_t handle;
	volatile struct pvgpu_ctrl_page *ctrl;
	volatile uint32_t *doorbell;
	volatile struct pvgpu_ring_entry *ring;
	uint32_t put;		/* entries submitted (= fence of the last one) */
	void *map;
};

static void chan_open(struct chan *c, int fd)
{
	memset(c, 0, sizeof(*c));
	c->fd = fd;
	c->handle = alloc_chan(fd);
	c->map = mmap(NULL, PVGPU_MMAP_CHANNEL_SIZE, PROT_READ | PROT_WRITE, MAP_SHARED, fd,
		      PVGPU_MMAP_OFFSET(c->handle));
	if (c->map == MAP_FAILED)
		fail("mmap of channel %u: %s", c->handle, strerror(errno));
	c->ctrl = c->map;
	c->doorbell = (volatile uint32_t *)((char *)c->map + PVGPU_MMAP_DOORBELL);
	c->ring = (volatile struct pvgpu_ring_entry *)((char *)c->map + PVGPU_MMAP_RING);
}

static void chan_close(struct chan *c)
{
	munmap(c->map, PVGPU_MMAP_CHANNEL_SIZE);
	free_chan(c->fd, c->handle);
}

/* Wait for `fence`; fails unless it is reached within timeout_s. */
static void chan_wait(struct chan *c, uint32_t fence, double timeout_s)
{
	uint32_t status, error;
	int e = try_wait(c->fd, c->handle, fence, (int64_t)(timeout_s * 1e9), &status, &error);

	if (e)
		fail("WAIT fence %u on channel %u: %s (FENCE %u, STATUS %u)", fence, c->handle,
		     strerror(e), c->ctrl->fence, c->ctrl->status);
	if (status != PVGPU_WAIT_OK)
		fail("WAIT fence %u on channel %u: channel dead, error %#x", fence, c->handle,
		     error);
}

/* Queue one kernel of `ns` run time: entry, then IB_PUT, then the doorbell. */
static void chan_push(struct chan *c, uint64_t ns, bool ring_doorbell)
{
	volatile struct pvgpu_ring_entry *e;

	/* At most PVGPU_RING_ENTRIES entries not completed (the ring's size). */
	if (c->put - c->ctrl->fence >= PVGPU_RING_ENTRIES)
		chan_wait(c, c->put - PVGPU_RING_ENTRIES + 1, 60);
	e = &c->ring[c->put & PVGPU_RING_MASK];
	e->payload = ns;
	e->fence = c->put + 1;
	e->flags = 0;
	__atomic_thread_fence(__ATOMIC_SEQ_CST);
	c->put++;
	c->ctrl->ib_put = c->put;
	__atomic_thread_fence(__ATOMIC_SEQ_CST);
	if (ring_doorbell)
		*c->doorbell = 1;
}

/* ---- signals and process helpers ------------------------------------------ */

static sigjmp_buf fault_jmp;
static volatile sig_atomic_t fault_sig;

static void on_fault(int sig)
{
	fault_sig = sig;
	siglongjmp(fault_jmp, 1);
}

/* The signal a read of *p raises (0: none). */
static int probe_read(volatile uint32_t *p, uint32_t *value)
{
	struct sigaction sa = { .sa_handler = on_fault }, old_segv, old_bus;
	int sig = 0;

	sigemptyset(&sa.sa_mask);
	sigaction(SIGSEGV, &sa, &old_segv);
	sigaction(SIGBUS, &sa, &old_bus);
	fault_sig = 0;
	if (sigsetjmp(fault_jmp, 1) == 0)
		*value = *p;
	else
		sig = fault_sig;
	sigaction(SIGSEGV, &old_segv, NULL);
	sigaction(SIGBUS, &old_bus, NULL);
	return sig;
}

static void on_alarm(int sig)
{
	(void)sig;
}

/* Wait until `pid` is blocked in the ioctl system call (/proc/PID/syscall). */
static void wait_in_ioctl(pid_t pid, double timeout_s)
{
	double end = now_s() + timeout_s;
	char path[64], buf[64];

	snprintf(path, sizeof(path), "/proc/%d/syscall", (int)pid);
	while (now_s() < end) {
		FILE *f = fopen(path, "r");
		long nr = -1;

		if (f) {
			if (fgets(buf, sizeof(buf), f))
				nr = strtol(buf, NULL, 10);
			fclose(f);
		}
		if (nr == SYS_ioctl)
			return;
		pause_ms(5);
	}
	fail("child %d did not block in ioctl within %.0f s", (int)pid, timeout_s);
}

/* Read one line the child writes to a pipe (its "ready" signal). */
static void wait_ready(int rfd, const char *what)
{
	char b;

	if (read(rfd, &b, 1) != 1)
		fail("child died before %s", what);
}

static void reap_killed(pid_t pid)
{
	int st;

	if (kill(pid, SIGKILL))
		fail("kill %d: %s", (int)pid, strerror(errno));
	if (waitpid(pid, &st, 0) != pid)
		fail("waitpid: %s", strerror(errno));
	if (!WIFSIGNALED(st) || WTERMSIG(st) != SIGKILL)
		fail("child %d did not die by SIGKILL (status %#x)", (int)pid, st);
}

static void reap_ok(pid_t pid, const char *what)
{
	int st;

	if (waitpid(pid, &st, 0) != pid)
		fail("waitpid: %s", strerror(errno));
	if (!WIFEXITED(st) || WEXITSTATUS(st) != 0)
		fail("%s (child) failed, status %#x", what, st);
}

/* ---- subcommands ---------------------------------------------------------- */

static int cmd_info(int argc, char **argv)
{
	int fd = dev_open();
	struct pvgpu_ioc_info in = info(fd);

	(void)argc;
	(void)argv;
	printf("abi_version=%u device_version=%u num_slots=%u slots_used=%u link=%u link_gen=%u "
	       "pid_hints=%u channels=%u pid_hint=%" PRIu64 " weight=%u irq_mode=%s\n",
	       in.abi_version, in.device_version, in.num_slots, in.slots_used, in.link,
	       in.link_gen, in.pid_hints, in.channels, in.pid_hint, in.weight,
	       in.irq_mode == PVGPU_IRQ_MSIX ? "msix" : in.irq_mode == PVGPU_IRQ_INTX ? "intx" : "?");
	close(fd);
	return 0;
}

static int cmd_abi(int argc, char **argv)
{
	int fd = dev_open(), fd2 = dev_open();
	struct pvgpu_ioc_info in, in2;
	struct pvgpu_ioc_alloc a;
	struct pvgpu_ioc_free f;
	struct pvgpu_ioc_wait w;
	struct pvgpu_ioc_set_weight sw;
	uint32_t h, status, error, i, other = UINT32_MAX;
	struct sigaction sa = { .sa_handler = on_alarm };
	struct itimerval it = { .it_value = { 0, 200000 } };
	double t0, dt;
	unsigned long bogus[] = {
		0, 0x12345678, _IO(PVGPU_IOC_MAGIC, 0x77), _IOWR(PVGPU_IOC_MAGIC, 0x05, int),
		_IOWR(PVGPU_IOC_MAGIC, 0x00, char[80]), _IOR(PVGPU_IOC_MAGIC, 0x01,
		struct pvgpu_ioc_alloc), _IOWR('T', 0x01, struct pvgpu_ioc_info),
	};
	char buf[128] = { 0 };

	(void)argc;
	(void)argv;
	/* Unknown ioctl numbers, including ones that differ only in size or direction. */
	for (i = 0; i < sizeof(bogus) / sizeof(bogus[0]); i++) {
		char what[64];

		snprintf(what, sizeof(what), "ioctl %#lx", bogus[i]);
		expect_errno(what, xioctl(fd, bogus[i], buf), ENOTTY);
	}

	/* INFO */
	in = (struct pvgpu_ioc_info){ .size = sizeof(in) - 8 };
	expect_errno("INFO with a short size", xioctl(fd, PVGPU_IOC_INFO, &in), EINVAL);
	in = (struct pvgpu_ioc_info){ .size = sizeof(in), .flags = 1 };
	expect_errno("INFO with flags 1", xioctl(fd, PVGPU_IOC_INFO, &in), EINVAL);
	expect_errno("INFO at address 0", xioctl(fd, PVGPU_IOC_INFO, NULL), EFAULT);
	in = info(fd);
	if (in.abi_version != PVGPU_GUEST_ABI_VERSION || in.device_version < 1 ||
	    in.num_slots < 1 || in.num_slots > 64 || in.slots_used > in.num_slots ||
	    in.link != PVGPU_LINK_READY || in.channels != 0 ||
	    (in.irq_mode != PVGPU_IRQ_MSIX && in.irq_mode != PVGPU_IRQ_INTX) ||
	    in.pid_hints > 1 || in.pid_hint != (in.pid_hints ? (uint64_t)getpid() : 0) ||
	    in.weight < PVGPU_WEIGHT_MIN || in.weight > PVGPU_WEIGHT_MAX ||
	    in.reserved[0] || in.reserved[1] || in.reserved[2] || in.reserved[3])
		fail("INFO fields not sane: abi %u version %u slots %u used %u link %u channels %u irq %u hints %u hint %" PRIu64 " weight %u",
		     in.abi_version, in.device_version, in.num_slots, in.slots_used, in.link,
		     in.channels, in.irq_mode, in.pid_hints, in.pid_hint, in.weight);
	note("INFO ok: device VERSION %u, %u slots, %s, pid hints %u", in.device_version,
	     in.num_slots, in.irq_mode == PVGPU_IRQ_MSIX ? "MSI-X" : "INTx", in.pid_hints);

	/* ALLOC */
	a = (struct pvgpu_ioc_alloc){ .size = sizeof(a) + 8 };
	expect_errno("ALLOC with a long size", xioctl(fd, PVGPU_IOC_ALLOC, &a), EINVAL);
	a = (struct pvgpu_ioc_alloc){ .size = sizeof(a), .flags = 0x80000000u };
	expect_errno("ALLOC with an unknown flag", xioctl(fd, PVGPU_IOC_ALLOC, &a), EINVAL);
	a = (struct pvgpu_ioc_alloc){ .size = sizeof(a), .reserved = { 0, 1 } };
	expect_errno("ALLOC with reserved[1] set", xioctl(fd, PVGPU_IOC_ALLOC, &a), EINVAL);
	if (info(fd).slots_used != in.slots_used)
		fail("a refused ALLOC changed slots_used");
	expect_errno("ALLOC", try_alloc(fd, &a), 0);
	h = a.handle;
	if (h >= in.num_slots || a.mmap_offset != PVGPU_MMAP_OFFSET(h) ||
	    a.pid_hint != in.pid_hint || a.reserved[0] || a.reserved[1])
		fail("ALLOC results: handle %u offset %#" PRIx64 " hint %" PRIu64, h,
		     a.mmap_offset, a.pid_hint);
	in2 = info(fd);
	if (in2.channels != 1 || in2.slots_used != in.slots_used + 1)
		fail("after ALLOC: channels %u slots_used %u (before %u)", in2.channels,
		     in2.slots_used, in.slots_used);
	if (info(fd2).channels != 0)
		fail("another open file counts this file's channel");

	/* FREE */
	f = (struct pvgpu_ioc_free){ .size = 8, .handle = h };
	expect_errno("FREE with size 8", xioctl(fd, PVGPU_IOC_FREE, &f), EINVAL);
	f = (struct pvgpu_ioc_free){ .size = sizeof(f), .flags = 2, .handle = h };
	expect_errno("FREE with a flag", xioctl(fd, PVGPU_IOC_FREE, &f), EINVAL);
	f = (struct pvgpu_ioc_free){ .size = sizeof(f), .handle = h, .reserved = 7 };
	expect_errno("FREE with reserved set", xioctl(fd, PVGPU_IOC_FREE, &f), EINVAL);
	expect_errno("FREE of handle 99999", try_free(fd, 99999), EBADF);
	expect_errno("FREE of handle -1", try_free(fd, UINT32_MAX), EBADF);
	for (i = 0; i < in.num_slots; i++)
		if (i != h)
			expect_errno("FREE of a slot this file does not hold", try_free(fd, i), EBADF);
	expect_errno("FREE through another open file", try_free(fd2, h), EBADF);
	other = alloc_chan(fd2);
	expect_errno("FREE of another file's channel", try_free(fd, other), EBADF);

	/* WAIT */
	w = (struct pvgpu_ioc_wait){ .size = sizeof(w) - 1, .handle = h };
	expect_errno("WAIT with a bad size", xioctl(fd, PVGPU_IOC_WAIT, &w), EINVAL);
	w = (struct pvgpu_ioc_wait){ .size = sizeof(w), .flags = 1, .handle = h };
	expect_errno("WAIT with a flag", xioctl(fd, PVGPU_IOC_WAIT, &w), EINVAL);
	w = (struct pvgpu_ioc_wait){ .size = sizeof(w), .handle = h, .reserved = 1 };
	expect_errno("WAIT with reserved set", xioctl(fd, PVGPU_IOC_WAIT, &w), EINVAL);
	expect_errno("WAIT on handle 99999", try_wait(fd, 99999, 0, 0, &status, &error), EBADF);
	expect_errno("WAIT on another file's channel", try_wait(fd, other, 0, 0, &status, &error),
		     EBADF);
	expect_errno("WAIT fence 0 (reached), timeout 0", try_wait(fd, h, 0, 0, &status, &error),
		     0);
	if (status != PVGPU_WAIT_OK || error)
		fail("WAIT fence 0: status %u error %#x", status, error);
	expect_errno("WAIT fence 1, timeout 0", try_wait(fd, h, 1, 0, &status, &error), ETIME);
	t0 = now_s();
	expect_errno("WAIT fence 1, timeout 100 ms",
		     try_wait(fd, h, 1, 100000000, &status, &error), ETIME);
	dt = now_s() - t0;
	if (dt < 0.099 || dt > 2.0)
		fail("WAIT with a 100 ms timeout returned after %.3f s", dt);
	note("WAIT timeout 100 ms returned ETIME after %.1f ms", dt * 1e3);
	/* A signal ends a wait with no deadline (SIGALRM without SA_RESTART). */
	sigemptyset(&sa.sa_mask);
	sigaction(SIGALRM, &sa, NULL);
	setitimer(ITIMER_REAL, &it, NULL);
	t0 = now_s();
	expect_errno("WAIT forever interrupted by SIGALRM",
		     try_wait(fd, h, 1000, -1, &status, &error), EINTR);
	note("WAIT forever interrupted by a signal after %.1f ms", (now_s() - t0) * 1e3);

	/* SET_WEIGHT (range checks come before the device version check) */
	sw = (struct pvgpu_ioc_set_weight){ .size = sizeof(sw), .weight = 0 };
	expect_errno("SET_WEIGHT 0", xioctl(fd, PVGPU_IOC_SET_WEIGHT, &sw), EINVAL);
	sw.weight = PVGPU_WEIGHT_MAX + 1;
	expect_errno("SET_WEIGHT 10001", xioctl(fd, PVGPU_IOC_SET_WEIGHT, &sw), EINVAL);
	sw = (struct pvgpu_ioc_set_weight){ .size = sizeof(sw), .weight = 100, .reserved = 1 };
	expect_errno("SET_WEIGHT reserved set", xioctl(fd, PVGPU_IOC_SET_WEIGHT, &sw), EINVAL);
	sw = (struct pvgpu_ioc_set_weight){ .size = sizeof(sw), .flags = 4, .weight = 100 };
	expect_errno("SET_WEIGHT with a flag", xioctl(fd, PVGPU_IOC_SET_WEIGHT, &sw), EINVAL);
	sw = (struct pvgpu_ioc_set_weight){ .size = 16, .weight = 100 };
	expect_errno("SET_WEIGHT size 16", xioctl(fd, PVGPU_IOC_SET_WEIGHT, &sw), EINVAL);
	sw = (struct pvgpu_ioc_set_weight){ .size = sizeof(sw), .pid = -5, .weight = 100 };
	expect_errno("SET_WEIGHT pid -5", xioctl(fd, PVGPU_IOC_SET_WEIGHT, &sw), EINVAL);

	/* Double free, then everything is back. */
	free_chan(fd, h);
	expect_errno("second FREE of the same handle", try_free(fd, h), EBADF);
	expect_errno("WAIT on a freed handle", try_wait(fd, h, 0, 0, &status, &error), EBADF);
	free_chan(fd2, other);
	if (info(fd).slots_used != in.slots_used || info(fd).channels != 0)
		fail("slots_used %u after freeing, want %u", info(fd).slots_used, in.slots_used);
	close(fd2);
	close(fd);
	note("all checks passed");
	return 0;
}

/* WAIT_ANY over `n` targets: errno, or 0 with *index / *status / *error filled in. */
static int try_wait_any(int fd, const struct pvgpu_wait_target *t, uint32_t n,
			int64_t timeout_ns, uint32_t *index, uint32_t *status, uint32_t *error)
{
	struct pvgpu_ioc_wait_any w = {
		.size = sizeof(w), .count = n, .targets = (uintptr_t)t, .timeout_ns = timeout_ns,
		.index = 0xdead, .status = 0xdead, .error = 0xdead,
	};
	int e = xioctl(fd, PVGPU_IOC_WAIT_ANY, &w);

	if (!e) {
		*index = w.index;
		*status = w.status;
		*error = w.error;
	}
	return e;
}

static struct pvgpu_ioc_wait_any wait_any_arg(const struct pvgpu_wait_target *t, uint32_t n)
{
	return (struct pvgpu_ioc_wait_any){ .size = sizeof(struct pvgpu_ioc_wait_any), .count = n,
					    .targets = (uintptr_t)t };
}

/* A WAIT_ANY that must end OK on target `want` within max_s; returns the time taken. */
static double expect_wait_any(const char *what, int fd, const struct pvgpu_wait_target *t,
			      uint32_t n, int64_t timeout_ns, uint32_t want, double max_s)
{
	uint32_t index, status, error;
	double t0 = now_s(), dt;
	int e = try_wait_any(fd, t, n, timeout_ns, &index, &status, &error);

	dt = now_s() - t0;
	if (e)
		fail("%s: %s after %.3f s", what, strerror(e), dt);
	if (index != want || status != PVGPU_WAIT_OK || error)
		fail("%s: index %u status %u error %#x, want index %u OK", what, index, status,
		     error, want);
	if (dt > max_s)
		fail("%s: took %.3f s, want at most %.1f s", what, dt, max_s);
	return dt;
}

static int cmd_wait_any(int argc, char **argv)
{
	int fd = dev_open(), fd2 = dev_open();
	struct pvgpu_wait_target t[PVGPU_WAIT_ANY_MAX + 1];
	struct pvgpu_ioc_wait_any w;
	struct chan a, b;
	uint32_t other, index, status, error, i;
	struct sigaction sa = { .sa_handler = on_alarm };
	struct itimerval it = { .it_value = { 0, 200000 } };
	double dt;

	(void)argc;
	(void)argv;
	chan_open(&a, fd);
	chan_open(&b, fd);
	other = alloc_chan(fd2);
	t[0] = (struct pvgpu_wait_target){ .handle = a.handle, .fence = 1 };
	t[1] = (struct pvgpu_wait_target){ .handle = b.handle, .fence = 1 };

	/* The argument as the driver checks it. */
	w = wait_any_arg(t, 2);
	w.size = sizeof(w) - 8;
	expect_errno("WAIT_ANY with a bad size", xioctl(fd, PVGPU_IOC_WAIT_ANY, &w), EINVAL);
	w = wait_any_arg(t, 2);
	w.flags = 1;
	expect_errno("WAIT_ANY with a flag", xioctl(fd, PVGPU_IOC_WAIT_ANY, &w), EINVAL);
	w = wait_any_arg(t, 2);
	w.reserved0 = 1;
	expect_errno("WAIT_ANY with reserved0 set", xioctl(fd, PVGPU_IOC_WAIT_ANY, &w), EINVAL);
	w = wait_any_arg(t, 2);
	w.reserved1 = 1;
	expect_errno("WAIT_ANY with reserved1 set", xioctl(fd, PVGPU_IOC_WAIT_ANY, &w), EINVAL);
	w = wait_any_arg(t, 2);
	w.reserved[1] = 1;
	expect_errno("WAIT_ANY with reserved[1] set", xioctl(fd, PVGPU_IOC_WAIT_ANY, &w), EINVAL);
	w = wait_any_arg(t, 0);
	expect_errno("WAIT_ANY with count 0", xioctl(fd, PVGPU_IOC_WAIT_ANY, &w), EINVAL);
	for (i = 0; i <= PVGPU_WAIT_ANY_MAX; i++)
		t[i] = (struct pvgpu_wait_target){ .handle = a.handle, .fence = 1 };
	w = wait_any_arg(t, PVGPU_WAIT_ANY_MAX + 1);
	expect_errno("WAIT_ANY with count PVGPU_WAIT_ANY_MAX + 1",
		     xioctl(fd, PVGPU_IOC_WAIT_ANY, &w), EINVAL);
	w = wait_any_arg(t, 1000000);
	expect_errno("WAIT_ANY with count 1000000", xioctl(fd, PVGPU_IOC_WAIT_ANY, &w), EINVAL);
	w = wait_any_arg(NULL, 2);
	expect_errno("WAIT_ANY with targets at address 0", xioctl(fd, PVGPU_IOC_WAIT_ANY, &w),
		     EFAULT);
	expect_errno("WAIT_ANY at address 0", xioctl(fd, PVGPU_IOC_WAIT_ANY, NULL), EFAULT);
	w = wait_any_arg(t, PVGPU_WAIT_ANY_MAX);
	expect_errno("WAIT_ANY over PVGPU_WAIT_ANY_MAX targets, timeout 0",
		     xioctl(fd, PVGPU_IOC_WAIT_ANY, &w), ETIME);
	t[1] = (struct pvgpu_wait_target){ .handle = 99999, .fence = 0 };
	w = wait_any_arg(t, 2);
	expect_errno("WAIT_ANY naming handle 99999", xioctl(fd, PVGPU_IOC_WAIT_ANY, &w), EBADF);
	t[1] = (struct pvgpu_wait_target){ .handle = other, .fence = 0 };
	expect_errno("WAIT_ANY naming another file's channel",
		     xioctl(fd, PVGPU_IOC_WAIT_ANY, &w), EBADF);
	t[1] = (struct pvgpu_wait_target){ .handle = a.handle, .fence = 0 };
	expect_errno("WAIT_ANY through another open file",
		     xioctl(fd2, PVGPU_IOC_WAIT_ANY, &w), EBADF);

	/* Nothing reached: timeout 0 only looks, a timeout passes. */
	t[0] = (struct pvgpu_wait_target){ .handle = a.handle, .fence = 1 };
	t[1] = (struct pvgpu_wait_target){ .handle = b.handle, .fence = 1 };
	expect_errno("WAIT_ANY on unreached fences, timeout 0",
		     try_wait_any(fd, t, 2, 0, &index, &status, &error), ETIME);
	dt = now_s();
	expect_errno("WAIT_ANY on unreached fences, timeout 100 ms",
		     try_wait_any(fd, t, 2, 100000000, &index, &status, &error), ETIME);
	dt = now_s() - dt;
	if (dt < 0.099 || dt > 2.0)
		fail("WAIT_ANY with a 100 ms timeout returned after %.3f s", dt);
	/* A reached fence of the second target ends even a zero timeout. */
	t[1].fence = 0;
	expect_wait_any("WAIT_ANY with the second target reached, timeout 0", fd, t, 2, 0, 1, 1.0);

	/* Work on the second channel only: it ends the wait, promptly. */
	chan_push(&b, 50000000, true);	/* 50 ms */
	t[1].fence = b.put;
	dt = expect_wait_any("WAIT_ANY, only the second channel busy, timeout 30 s", fd, t, 2,
			     30000000000LL, 1, 10.0);
	note("WAIT_ANY over two channels woke on the second after %.1f ms (a 50 ms kernel)",
	     dt * 1e3);
	chan_push(&b, 20000000, true);
	t[1].fence = b.put;
	expect_wait_any("WAIT_ANY forever, only the second channel busy", fd, t, 2, -1, 1, 10.0);

	/* One channel named twice (the later, lower fence is the one reached). */
	t[1] = (struct pvgpu_wait_target){ .handle = b.handle, .fence = b.put + 5 };
	t[2] = (struct pvgpu_wait_target){ .handle = b.handle, .fence = b.put + 1 };
	chan_push(&b, 10000000, true);
	expect_wait_any("WAIT_ANY naming one channel twice", fd, t, 3, -1, 2, 10.0);

	/* Both reached: the lowest index is reported. */
	chan_push(&a, 1000000, true);
	chan_wait(&a, a.put, 30);
	t[1].fence = b.put;
	expect_wait_any("WAIT_ANY with both reached", fd, t, 2, 0, 0, 1.0);

	/* One target is WAIT. */
	chan_push(&b, 1000000, true);
	t[0] = (struct pvgpu_wait_target){ .handle = b.handle, .fence = b.put };
	expect_wait_any("WAIT_ANY over one target", fd, t, 1, 30000000000LL, 0, 10.0);

	/*
	 * A signal ends a wait with no deadline.  Last: the device cannot
	 * lower the waits armed for these far fences, so a later wait for a
	 * nearer one would sleep until its own timeout (docs/guest.md).
	 */
	t[0] = (struct pvgpu_wait_target){ .handle = a.handle, .fence = a.put + 1000 };
	t[1] = (struct pvgpu_wait_target){ .handle = b.handle, .fence = b.put + 1000 };
	sigemptyset(&sa.sa_mask);
	sigaction(SIGALRM, &sa, NULL);
	setitimer(ITIMER_REAL, &it, NULL);
	expect_errno("WAIT_ANY forever interrupted by SIGALRM",
		     try_wait_any(fd, t, 2, -1, &index, &status, &error), EINTR);

	/* A freed channel among the targets. */
	chan_close(&a);
	expect_errno("WAIT_ANY naming a freed handle",
		     try_wait_any(fd, t, 2, 0, &index, &status, &error), EBADF);
	chan_close(&b);
	free_chan(fd2, other);
	close(fd2);
	close(fd);
	note("all checks passed");
	return 0;
}

static int cmd_mmap(int argc, char **argv)
{
	int fd = dev_open(), fd2 = dev_open();
	struct pvgpu_ioc_info in = info(fd);
	long pg = PVGPU_PAGE_SIZE;
	struct chan c;
	uint32_t other, v, i, unowned = UINT32_MAX;
	void *p;
	int sig;

	(void)argc;
	(void)argv;
	chan_open(&c, fd);
	if (c.ctrl->ib_put || c.ctrl->ib_get || c.ctrl->fence ||
	    c.ctrl->status != PVGPU_CHAN_STATUS_OK || c.ctrl->error)
		fail("fresh control page: put %u get %u fence %u status %u error %u",
		     c.ctrl->ib_put, c.ctrl->ib_get, c.ctrl->fence, c.ctrl->status, c.ctrl->error);
	for (i = 0; i < PVGPU_RING_ENTRIES; i++)
		if (c.ring[i].payload || c.ring[i].fence || c.ring[i].flags)
			fail("fresh ring entry %u not zero", i);
	/* The ring is this channel's memory: what is written reads back. */
	c.ring[5].payload = 0x1122334455667788ull;
	if (c.ring[5].payload != 0x1122334455667788ull)
		fail("ring write did not read back");
	c.ring[5].payload = 0;

	/* Each page alone, and the pages in pairs. */
	for (i = 0; i < CTRL_PAGES; i++) {
		p = mmap(NULL, pg, PROT_READ | PROT_WRITE, MAP_SHARED, fd,
			 PVGPU_MMAP_OFFSET(c.handle) + i * pg);
		if (p == MAP_FAILED)
			fail("mmap of page %u alone: %s", i, strerror(errno));
		munmap(p, pg);
	}
	p = mmap(NULL, 2 * pg, PROT_READ, MAP_SHARED, fd, PVGPU_MMAP_OFFSET(c.handle) + pg);
	if (p == MAP_FAILED)
		fail("mmap of doorbell + ring: %s", strerror(errno));
	munmap(p, 2 * pg);

#define REFUSED(what, len, prot, flags, f, off, want)                                   \
	do {                                                                             \
		p = mmap(NULL, (len), (prot), (flags), (f), (off));                       \
		if (p != MAP_FAILED)                                                     \
			fail("mmap %s succeeded", what);                                 \
		expect_errno("mmap " what, errno, want);                                 \
	} while (0)
	REFUSED("of 4 pages", 4 * pg, PROT_READ, MAP_SHARED, fd, PVGPU_MMAP_OFFSET(c.handle),
		EINVAL);
	REFUSED("of 2 pages from the ring", 2 * pg, PROT_READ, MAP_SHARED, fd,
		PVGPU_MMAP_OFFSET(c.handle) + 2 * pg, EINVAL);
	REFUSED("of the hole page", pg, PROT_READ, MAP_SHARED, fd,
		PVGPU_MMAP_OFFSET(c.handle) + 3 * pg, EINVAL);
	REFUSED("past the last slot", pg, PROT_READ, MAP_SHARED, fd,
		PVGPU_MMAP_OFFSET(in.num_slots), EINVAL);
	REFUSED("MAP_PRIVATE", pg, PROT_READ, MAP_PRIVATE, fd, PVGPU_MMAP_OFFSET(c.handle),
		EINVAL);
	REFUSED("PROT_EXEC", pg, PROT_READ | PROT_EXEC, MAP_SHARED, fd,
		PVGPU_MMAP_OFFSET(c.handle), EPERM);
	REFUSED("of our channel through another open file", pg, PROT_READ, MAP_SHARED, fd2,
		PVGPU_MMAP_OFFSET(c.handle), EACCES);
	other = alloc_chan(fd2);
	REFUSED("of another file's channel", pg, PROT_READ | PROT_WRITE, MAP_SHARED, fd,
		PVGPU_MMAP_OFFSET(other), EACCES);
	for (i = 0; i < in.num_slots && unowned == UINT32_MAX; i++)
		if (i != c.handle && i != other)
			unowned = i;
	if (unowned != UINT32_MAX)
		REFUSED("of a slot nobody holds here", pg, PROT_READ, MAP_SHARED, fd,
			PVGPU_MMAP_OFFSET(unowned), EACCES);

	/* mremap cannot grow a channel mapping onto the next channel's pages. */
	p = mremap((void *)c.ctrl, PVGPU_MMAP_CHANNEL_SIZE, 4 * pg, MREMAP_MAYMOVE);
	if (p != MAP_FAILED)
		fail("mremap grew the channel mapping");
	note("mremap growth refused: %s", strerror(errno));

	/* A child does not inherit the mapping (VM_DONTCOPY). */
	pid_t pid = fork();

	if (pid == 0) {
		sig = probe_read(&c.ctrl->fence, &v);
		if (sig != SIGSEGV)
			fail("child reading the parent's mapping: signal %d, want SIGSEGV", sig);
		_exit(0);
	}
	reap_ok(pid, "inherited mapping check");

	/* After FREE the mapping is gone: an access raises SIGBUS, it never reaches
	 * the slot's next owner.
	 */
	free_chan(fd, c.handle);
	sig = probe_read(&c.ctrl->fence, &v);
	if (sig != SIGBUS)
		fail("reading a freed channel's mapping: signal %d, want SIGBUS", sig);
	munmap(c.map, PVGPU_MMAP_CHANNEL_SIZE);
	REFUSED("of a freed channel", pg, PROT_READ, MAP_SHARED, fd, PVGPU_MMAP_OFFSET(c.handle),
		EACCES);
#undef REFUSED
	free_chan(fd2, other);
	close(fd2);
	close(fd);
	note("all checks passed");
	return 0;
}

static int cmd_submit(int argc, char **argv)
{
	unsigned long n, us;
	int fd = dev_open();
	struct chan c;
	double t0, tp, dt;

	if (argc != 2)
		return -1;
	n = strtoul(argv[0], NULL, 0);
	us = strtoul(argv[1], NULL, 0);
	if (n < 1 || n > 10000000 || us > 1000000)
		fail("N must be 1..10000000 and KERNEL_US 0..1000000");
	chan_open(&c, fd);
	t0 = now_s();
	for (unsigned long i = 0; i < n; i++)
		chan_push(&c, us * 1000ull, true);
	tp = now_s() - t0;
	chan_wait(&c, c.put, 60 + n * us * 4e-6);
	dt = now_s() - t0;
	if (c.ctrl->fence != c.put || c.ctrl->ib_get != c.put)
		fail("after the wait: FENCE %u IB_GET %u, want %u", c.ctrl->fence, c.ctrl->ib_get,
		     c.put);
	/*
	 * Waits are interrupt driven: the whole run takes about the GPU time
	 * (measured 89-100 %% busy under TCG).  A lost wakeup shows up as a
	 * WAIT that sleeps to its 60 s timeout and still finds the fence.
	 */
	if (dt > 2 * n * us * 1e-6 + 5)
		fail("%lu kernels of %lu us took %.1f s: a WAIT slept past the fence", n, us, dt);
	printf("completed=%u seconds=%.3f submit_seconds=%.3f kernels_per_s=%.0f gpu_busy=%.0f%%\n",
	       c.ctrl->fence, dt, tp, n / dt, 100.0 * n * us * 1e-6 / dt);
	chan_close(&c);
	close(fd);
	return 0;
}

static int cmd_cycles(int argc, char **argv)
{
	unsigned long n, i;
	int fd = dev_open();
	uint32_t before, used;
	struct chan c;
	double t0;

	if (argc != 1)
		return -1;
	n = strtoul(argv[0], NULL, 0);
	before = info(fd).slots_used;
	t0 = now_s();
	for (i = 0; i < n; i++) {
		chan_open(&c, fd);
		if (i % 64 == 0) {	/* now and then, prove the channel works */
			chan_push(&c, 1000, true);
			chan_wait(&c, 1, 30);
		}
		chan_close(&c);
	}
	used = info(fd).slots_used;
	if (used != before || info(fd).channels != 0)
		fail("after %lu cycles slots_used is %u, was %u", n, used, before);
	printf("cycles=%lu slots_used=%u seconds=%.2f\n", n, used, now_s() - t0);
	close(fd);
	return 0;
}

static int cmd_fork(int argc, char **argv)
{
	int fd = dev_open();
	struct pvgpu_ioc_info before = info(fd);
	uint32_t status, error, v;
	struct chan c;
	pid_t pid;
	void *p;

	(void)argc;
	(void)argv;
	chan_open(&c, fd);
	pid = fork();
	if (pid < 0)
		fail("fork: %s", strerror(errno));
	if (pid == 0) {
		struct chan mine;

		subcommand = "fork (child)";
		expect_errno("child FREE of the parent's channel", try_free(fd, c.handle), EBADF);
		expect_errno("child WAIT on the parent's channel",
			     try_wait(fd, c.handle, 0, 0, &status, &error), EBADF);
		p = mmap(NULL, PVGPU_PAGE_SIZE, PROT_READ, MAP_SHARED, fd,
			 PVGPU_MMAP_OFFSET(c.handle));
		if (p != MAP_FAILED)
			fail("child mapped the parent's channel");
		expect_errno("child mmap of the parent's channel", errno, EACCES);
		if (probe_read(&c.ctrl->fence, &v) != SIGSEGV)
			fail("child still has the parent's mapping");
		/* The child's own channel on the inherited file works. */
		chan_open(&mine, fd);
		chan_push(&mine, 1000, true);
		chan_wait(&mine, 1, 30);
		chan_close(&mine);
		/* ... and one it does not free is freed when it exits. */
		chan_open(&mine, fd);
		_exit(0);
	}
	reap_ok(pid, "fork");
	/* The parent's channel still works; the child's leftover channel is gone. */
	chan_push(&c, 1000, true);
	chan_wait(&c, 1, 30);
	if (info(fd).channels != 1 || info(fd).slots_used != before.slots_used + 1)
		fail("after the child exited: channels %u slots_used %u, want 1 and %u",
		     info(fd).channels, info(fd).slots_used, before.slots_used + 1);
	chan_close(&c);
	if (info(fd).slots_used != before.slots_used)
		fail("slots_used %u at the end, was %u", info(fd).slots_used, before.slots_used);

	/*
	 * An owner that closed its descriptor (keeping only the mapping) and
	 * exited while its child still holds the file: no flush ran in its
	 * context, so its channel is freed at the file's next close by anyone.
	 */
	int go[2], tell[2];
	pid_t owner, holder;

	if (pipe(go) || pipe(tell))
		fail("pipe: %s", strerror(errno));
	/* The holder is orphaned by the owner's exit: it becomes our child. */
	if (prctl(PR_SET_CHILD_SUBREAPER, 1))
		fail("PR_SET_CHILD_SUBREAPER: %s", strerror(errno));
	owner = fork();
	if (owner < 0)
		fail("fork: %s", strerror(errno));
	if (owner == 0) {
		int f = dev_open();

		subcommand = "fork (owner)";
		chan_open(&c, f);
		holder = fork();
		if (holder < 0)
			fail("fork: %s", strerror(errno));
		if (holder == 0) {
			uint32_t held, after;
			char b;
			int d;

			subcommand = "fork (holder)";
			close(go[1]);
			if (read(go[0], &b, 1) != 1)	/* the owner has exited and been reaped */
				fail("no word that the owner exited");
			held = info(f).slots_used;
			d = dup(f);
			if (d < 0)
				fail("dup: %s", strerror(errno));
			close(d);
			after = info(f).slots_used;
			if (after + 1 != held)
				fail("the exited owner's channel outlived a close: slots_used %u, was %u",
				     after, held);
			_exit(0);
		}
		if (write(tell[1], &holder, sizeof(holder)) != sizeof(holder))
			_exit(3);
		close(f);	/* the mapping stays until the exit */
		_exit(0);
	}
	close(tell[1]);
	reap_ok(owner, "fork (owner)");
	if (read(tell[0], &holder, sizeof(holder)) != sizeof(holder))
		fail("the owner died before it forked the holder");
	if (write(go[1], "g", 1) != 1)
		fail("pipe write: %s", strerror(errno));
	reap_ok(holder, "fork (holder)");
	prctl(PR_SET_CHILD_SUBREAPER, 0);
	close(go[0]);
	close(go[1]);
	close(tell[0]);
	if (info(fd).slots_used != before.slots_used)
		fail("slots_used %u after the holder exited, was %u", info(fd).slots_used,
		     before.slots_used);
	close(fd);
	note("all checks passed");
	return 0;
}

/*
 * SIGKILL a child in the middle of submitting (mode 's') or of a WAIT
 * ('w'), once with a file it opened itself (freed by the last close) and
 * once with a file inherited from us (freed when its process exits).
 */
static void kill_case(char mode, bool inherited)
{
	int fd = dev_open(), pfd[2];
	uint32_t before = info(fd).slots_used;
	struct chan c;
	pid_t pid;

	if (pipe(pfd))
		fail("pipe: %s", strerror(errno));
	pid = fork();
	if (pid < 0)
		fail("fork: %s", strerror(errno));
	if (pid == 0) {
		close(pfd[0]);
		chan_open(&c, inherited ? fd : dev_open());
		if (mode == 's') {
			/* Submit 1 ms kernels forever, the ring kept full. */
			for (;;) {
				chan_push(&c, 1000000, true);
				if (c.put == 300 && write(pfd[1], "r", 1) != 1)
					_exit(3);
			}
		}
		chan_push(&c, 1000000000ull, true);	/* 1 s: the wait blocks */
		if (write(pfd[1], "r", 1) != 1)
			_exit(3);
		chan_wait(&c, 1000, 600);
		_exit(4);
	}
	close(pfd[1]);
	wait_ready(pfd[0], "it submitted");
	if (mode == 'w')
		wait_in_ioctl(pid, 10);
	reap_killed(pid);
	close(pfd[0]);
	if (info(fd).slots_used != before)
		fail("%s file: slots_used %u after the kill, was %u",
		     inherited ? "inherited" : "own", info(fd).slots_used, before);
	/* The device and the daemon still serve new work. */
	chan_open(&c, fd);
	chan_push(&c, 1000, true);
	chan_wait(&c, 1, 30);
	chan_close(&c);
	close(fd);
	note("%s file: channel freed, slots_used back to %u, new work completes",
	     inherited ? "inherited" : "own", before);
}

static int cmd_kill_submit(int argc, char **argv)
{
	(void)argc;
	(void)argv;
	kill_case('s', false);
	kill_case('s', true);
	return 0;
}

static int cmd_kill_wait(int argc, char **argv)
{
	(void)argc;
	(void)argv;
	kill_case('w', false);
	kill_case('w', true);
	return 0;
}

static int cmd_fill_ring(int argc, char **argv)
{
	int fd = dev_open();
	uint32_t before = info(fd).slots_used;
	struct chan c;
	pid_t pid;

	(void)argc;
	(void)argv;
	pid = fork();
	if (pid == 0) {
		/* A full ring of 10 ms kernels, then exit without waiting or freeing. */
		chan_open(&c, dev_open());
		for (uint32_t i = 0; i < PVGPU_RING_ENTRIES; i++)
			chan_push(&c, 10000000, true);
		if (c.ctrl->fence == c.put)
			fail("the ring drained before the exit; the check proves nothing");
		_exit(0);
	}
	reap_ok(pid, "fill-ring");
	if (info(fd).slots_used != before)
		fail("slots_used %u after the filler exited, was %u", info(fd).slots_used, before);
	chan_open(&c, fd);
	chan_push(&c, 1000, true);
	chan_wait(&c, 1, 30);
	chan_close(&c);
	close(fd);
	note("a full ring was dropped at exit; slots_used back to %u; new work completes",
	     before);
	return 0;
}

static int set_weight(int fd, int pid, uint32_t weight)
{
	struct pvgpu_ioc_set_weight sw = { .size = sizeof(sw), .pid = pid, .weight = weight };

	return xioctl(fd, PVGPU_IOC_SET_WEIGHT, &sw);
}

static void drop_all_capabilities(void)
{
	struct __user_cap_header_struct hdr = { .version = _LINUX_CAPABILITY_VERSION_3 };
	struct __user_cap_data_struct data[2] = { { 0 } };

	if (syscall(SYS_capset, &hdr, data))
		fail("capset: %s", strerror(errno));
	if (prctl(PR_CAPBSET_READ, CAP_SYS_ADMIN) < 0)
		fail("prctl: %s", strerror(errno));
}

static int cmd_weight(int argc, char **argv)
{
	int fd = dev_open();
	struct pvgpu_ioc_info in = info(fd);
	unsigned long w;
	pid_t pid;
	int e;

	if (argc != 1)
		return -1;
	w = strtoul(argv[0], NULL, 0);
	if (w < PVGPU_WEIGHT_MIN || w > PVGPU_WEIGHT_MAX)
		fail("W must be %u..%u", PVGPU_WEIGHT_MIN, PVGPU_WEIGHT_MAX);
	e = set_weight(fd, 0, w);
	if (in.device_version < 2) {
		expect_errno("SET_WEIGHT on a VERSION 1 device", e, EOPNOTSUPP);
		note("device VERSION %u: SET_WEIGHT answers EOPNOTSUPP as documented",
		     in.device_version);
		return 0;
	}
	expect_errno("SET_WEIGHT of the own process", e, 0);
	if (info(fd).weight != w)
		fail("INFO.weight %u after SET_WEIGHT %lu", info(fd).weight, w);
	expect_errno("SET_WEIGHT with the own pid", set_weight(fd, getpid(), w), 0);
	expect_errno("SET_WEIGHT of a pid that does not exist", set_weight(fd, 4000000, w),
		     ESRCH);
	pid = fork();
	if (pid == 0) {
		subcommand = "weight (child)";
		drop_all_capabilities();
		expect_errno("SET_WEIGHT of pid 1 without CAP_SYS_ADMIN", set_weight(fd, 1, w),
			     EPERM);
		expect_errno("SET_WEIGHT of the parent without CAP_SYS_ADMIN",
			     set_weight(fd, getppid(), w), EPERM);
		/* Like nice: above the default needs CAP_SYS_NICE, dropped too. */
		expect_errno("SET_WEIGHT of itself without CAP_SYS_NICE", set_weight(fd, 0, w),
			     w > PVGPU_WEIGHT_DEFAULT ? EPERM : 0);
		expect_errno("SET_WEIGHT of itself to 50 without capabilities",
			     set_weight(fd, 0, 50), 0);
		_exit(0);
	}
	reap_ok(pid, "weight");
	note("weight %lu set and reported; foreign pid refused without CAP_SYS_ADMIN, above the default without CAP_SYS_NICE",
	     w);
	close(fd);
	return 0;
}

/*
 * For the daemon-restart test: submit a long kernel, print "lost: ready",
 * and wait.  The host kills pvgpud: the wait must end DEAD/0x80.  With
 * --recover the host restarts pvgpud: after the reconnect the old handle
 * still answers DEAD/0x80, and a new channel works.
 */
static int cmd_lost(int argc, char **argv)
{
	bool recover = argc == 1 && !strcmp(argv[0], "--recover");
	int fd = dev_open();
	uint32_t status, error, gen;
	struct chan c, fresh;
	double end;
	int e;

	if (argc > 1 || (argc == 1 && !recover))
		return -1;
	gen = info(fd).link_gen;
	if (info(fd).device_version >= 2) {
		/* The driver must send it again to the restarted daemon. */
		expect_errno("SET_WEIGHT 250", set_weight(fd, 0, 250), 0);
		note("weight 250 set for pid %d", (int)getpid());
	}
	chan_open(&c, fd);
	/* 200 s of work (1 s kernels, under the watchdog): the daemon dies first. */
	for (int i = 0; i < 200; i++)
		chan_push(&c, 1000000000ull, true);
	note("ready (channel %u, link_gen %u): kill pvgpud now", c.handle, gen);
	e = try_wait(fd, c.handle, c.put, 300 * 1000000000ll, &status, &error);
	if (e)
		fail("WAIT: %s", strerror(e));
	if (status != PVGPU_WAIT_DEAD || error != PVGPU_CHAN_ERR_LOST)
		fail("WAIT after the daemon died: status %u error %#x, want DEAD/0x80",
		     status, error);
	note("wait ended DEAD/0x80");
	e = try_wait(fd, c.handle, c.put, 0, &status, &error);
	if (e || status != PVGPU_WAIT_DEAD || error != PVGPU_CHAN_ERR_LOST)
		fail("second WAIT: errno %d status %u error %#x, want DEAD/0x80", e, status,
		     error);
	if (!recover) {
		chan_close(&c);
		close(fd);
		return 0;
	}
	note("waiting for the daemon link to come back");
	end = now_s() + 120;
	while (info(fd).link != PVGPU_LINK_READY || info(fd).link_gen == gen) {
		if (now_s() > end)
			fail("the link did not come back within 120 s");
		pause_ms(50);
	}
	/* The slot may have been re-allocated in place: still dead for us. */
	e = try_wait(fd, c.handle, 0, 0, &status, &error);
	if (e || status != PVGPU_WAIT_DEAD || error != PVGPU_CHAN_ERR_LOST)
		fail("WAIT after the reconnect: errno %d status %u error %#x, want DEAD/0x80",
		     e, status, error);
	e = try_wait(fd, c.handle, c.put, 1000000000ll, &status, &error);
	if (e || status != PVGPU_WAIT_DEAD || error != PVGPU_CHAN_ERR_LOST)
		fail("WAIT(1 s) after the reconnect: errno %d status %u error %#x, want DEAD/0x80",
		     e, status, error);
	chan_close(&c);
	chan_open(&fresh, fd);
	chan_push(&fresh, 1000, true);
	chan_wait(&fresh, 1, 30);
	/* 3 s more work so the host can look at the task entity meanwhile. */
	note("new channel %u works; busy for 3 s (task-%d)", fresh.handle, (int)getpid());
	for (int i = 0; i < 1500; i++)
		chan_push(&fresh, 2000000, true);
	chan_wait(&fresh, fresh.put, 60);
	if (info(fd).device_version >= 2 && info(fd).weight != 250)
		fail("INFO.weight %u after the restart, want 250", info(fd).weight);
	chan_close(&fresh);
	note("recovered: the old handle stayed DEAD/0x80 until freed, a new channel works");
	close(fd);
	return 0;
}

/*
 * For the daemon-stall test: print "alloc-timeout: ready", then allocate
 * until an ALLOC fails ETIMEDOUT (the host stops pvgpud with SIGSTOP), print
 * "alloc-timeout: timed out" (the host resumes it with SIGCONT): the daemon's
 * late answer allocates a channel nobody owns, which the driver must free.
 */
static int cmd_alloc_timeout(int argc, char **argv)
{
	int fd = dev_open(), e = 0;
	uint32_t before = info(fd).slots_used;
	struct pvgpu_ioc_alloc a;
	struct chan c;
	double end;

	(void)argv;
	if (argc)
		return -1;
	note("ready: stop pvgpud (SIGSTOP) now");
	end = now_s() + 120;
	while (now_s() < end) {
		e = try_alloc(fd, &a);
		if (e)
			break;
		free_chan(fd, a.handle);
	}
	expect_errno("ALLOC while the daemon is stopped", e, ETIMEDOUT);
	note("timed out: resume pvgpud (SIGCONT) now");
	end = now_s() + 120;
	while (info(fd).slots_used != before) {
		if (now_s() > end)
			fail("slots_used %u 120 s after the timeout, was %u: the late channel was not freed",
			     info(fd).slots_used, before);
		pause_ms(50);
	}
	chan_open(&c, fd);
	chan_push(&c, 1000, true);
	chan_wait(&c, 1, 30);
	chan_close(&c);
	note("the late channel was freed (slots_used back to %u); new work completes", before);
	close(fd);
	return 0;
}

/* ---- task weights of short-lived and unprivileged processes -------------- */

/* Write `v` to a /proc or /sys file; errno or 0. */
static int write_file(const char *path, const char *v)
{
	int fd = open(path, O_WRONLY | O_CLOEXEC), e = 0;

	if (fd < 0)
		return errno;
	if (write(fd, v, strlen(v)) != (ssize_t)strlen(v))
		e = errno ? errno : EIO;
	close(fd);
	return e;
}

static unsigned long read_ulong(const char *path)
{
	char buf[32] = "";
	int fd = open(path, O_RDONLY | O_CLOEXEC);
	ssize_t n;

	if (fd < 0)
		fail("open %s: %s", path, strerror(errno));
	n = read(fd, buf, sizeof(buf) - 1);
	close(fd);
	if (n <= 0)
		fail("read %s", path);
	return strtoul(buf, NULL, 10);
}

/* A child that sets its weight and exits, closing the device first or not. */
static pid_t weighted_exit(uint32_t weight, bool close_first)
{
	pid_t pid = fork();
	int fd, e;

	if (pid < 0)
		fail("fork: %s", strerror(errno));
	if (pid)
		return pid;
	fd = dev_open();
	e = set_weight(fd, 0, weight);
	if (e) {
		fprintf(stderr, "FAIL: %s %s: SET_WEIGHT %u of pid %d: %s\n", prog, subcommand,
			weight, (int)getpid(), strerror(e));
		_exit(1);
	}
	if (close_first)
		close(fd);
	_exit(0);	/* closes the device at exit otherwise (flush while exiting) */
}

/*
 * A child with pid `want` (through ns_last_pid; the guest is otherwise
 * quiet): it checks it starts at the default weight, allocates a channel,
 * writes a byte to `ready` and holds the channel until `hold` reaches EOF
 * (the caller closes `hold_wr`, the pipe's write end).
 * Returns its pid, or 0 if another pid came (the caller tries again).
 */
static pid_t reuse_pid(pid_t want, int ready, int hold, int hold_wr)
{
	char last[16], byte = 1;
	struct chan c;
	int st, fd;
	pid_t pid;

	snprintf(last, sizeof(last), "%d", (int)want - 1);
	st = write_file("/proc/sys/kernel/ns_last_pid", last);
	if (st)
		fail("ns_last_pid: %s", strerror(st));
	pid = fork();
	if (pid < 0)
		fail("fork: %s", strerror(errno));
	if (pid == 0) {
		if (getpid() != want)
			_exit(3);
		subcommand = "churn (reused pid)";
		/* Only the parent may keep the write end: its close ends the hold. */
		close(hold_wr);
		fd = dev_open();
		if (info(fd).weight != PVGPU_WEIGHT_DEFAULT)
			fail("pid %d reused: INFO.weight %u, want the default %u", (int)want,
			     info(fd).weight, PVGPU_WEIGHT_DEFAULT);
		chan_open(&c, fd);
		if (write(ready, &byte, 1) != 1)
			_exit(1);
		while (read(hold, &byte, 1) > 0)
			;
		chan_close(&c);
		_exit(0);
	}
	if (pid != want) {
		waitpid(pid, &st, 0);
		return 0;
	}
	return pid;
}

/*
 * Issue 51 item 4: N short-lived processes one after the other, each setting
 * its own weight and exiting (every other one closes the device first, so
 * only a later sweep forgets it); every SET_WEIGHT succeeds, where the
 * daemon used to refuse all after its 256th remembered weight.  Then the
 * pids of two exited weighted processes (one closed the device, one exited
 * holding it) are given to new processes: they start at the default weight
 * and hold a channel for HOLD_S seconds after "churn: reused P1 P2", so the
 * host can look at task-P1 and task-P2 (default weight, not the old 3000).
 */
static int cmd_churn(int argc, char **argv)
{
	int ready[2], hold[2], fd = dev_open();
	pid_t old[2], reused[2];
	unsigned long n, hold_s, i;
	double t0;
	char byte;

	if (argc != 2)
		return -1;
	n = strtoul(argv[0], NULL, 0);
	hold_s = strtoul(argv[1], NULL, 0);
	if (info(fd).device_version < 2)
		fail("the device is VERSION %u: no task weights", info(fd).device_version);
	t0 = now_s();
	for (i = 0; i < n; i++) {
		pid_t pid = weighted_exit(200 + i % 1000, i & 1);

		reap_ok(pid, "churn");
	}
	note("%lu short-lived processes set their weight (%.1f s)", n, now_s() - t0);

	if (pipe2(ready, O_CLOEXEC) || pipe2(hold, O_CLOEXEC))
		fail("pipe: %s", strerror(errno));
	for (i = 0; i < 2; i++) {
		int tries;

		old[i] = weighted_exit(3000, i == 0);
		reap_ok(old[i], "churn (weight 3000)");
		for (tries = 0; tries < 20; tries++) {
			reused[i] = reuse_pid(old[i], ready[1], hold[0], hold[1]);
			if (reused[i])
				break;
		}
		if (!reused[i])
			fail("pid %d was not given again in 20 tries", (int)old[i]);
		if (read(ready[0], &byte, 1) != 1)
			fail("the process with reused pid %d did not get going", (int)old[i]);
	}
	note("reused %d %d", (int)reused[0], (int)reused[1]);
	pause_ms(hold_s * 1000);
	close(hold[1]);
	for (i = 0; i < 2; i++)
		reap_ok(reused[i], "churn (reused pid)");
	note("reused pids started at the default weight");
	close(fd);
	return 0;
}

/*
 * Issue 51 item 8: like nice, a process without CAP_SYS_NICE may lower its
 * weight and raise it up to the default, never above; one user's live
 * processes hold at most weights_per_uid entries of the driver's table
 * (EDQUOT beyond), and entries of exited ones are given back.  The checks
 * run as uid/gid 65534 without capabilities; root (CAP_SYS_NICE) may go
 * above the default.
 */
static int cmd_unpriv(int argc, char **argv)
{
	int fd = dev_open(), res[2], hold[2];
	unsigned long limit, i, ok = 0, quota = 0;
	pid_t pid;

	(void)argv;
	if (argc)
		return -1;
	if (info(fd).device_version < 2)
		fail("the device is VERSION %u: no task weights", info(fd).device_version);
	expect_errno("SET_WEIGHT 10000 with CAP_SYS_NICE", set_weight(fd, 0, 10000), 0);
	expect_errno("SET_WEIGHT back to the default", set_weight(fd, 0, PVGPU_WEIGHT_DEFAULT), 0);
	limit = read_ulong("/sys/module/pvgpu/parameters/weights_per_uid");
	if (limit < 2 || limit > 200)
		fail("weights_per_uid %lu: the check wants 2..200", limit);

	pid = fork();
	if (pid < 0)
		fail("fork: %s", strerror(errno));
	if (pid == 0) {
		subcommand = "unpriv (uid 65534)";
		if (setgroups(0, NULL) || setgid(65534) || setuid(65534))
			fail("dropping to uid 65534: %s", strerror(errno));
		drop_all_capabilities();
		expect_errno("SET_WEIGHT 10000", set_weight(fd, 0, 10000), EPERM);
		expect_errno("SET_WEIGHT default + 1", set_weight(fd, 0, PVGPU_WEIGHT_DEFAULT + 1),
			     EPERM);
		expect_errno("SET_WEIGHT default", set_weight(fd, 0, PVGPU_WEIGHT_DEFAULT), 0);
		expect_errno("SET_WEIGHT 50", set_weight(fd, 0, 50), 0);
		if (info(fd).weight != 50)
			fail("INFO.weight %u after SET_WEIGHT 50", info(fd).weight);
		expect_errno("SET_WEIGHT 80 (up, to the default at most)", set_weight(fd, 0, 80), 0);
		expect_errno("SET_WEIGHT 150", set_weight(fd, 0, 150), EPERM);
		if (info(fd).weight != 80)
			fail("INFO.weight %u after a refused raise, want 80", info(fd).weight);

		/* This process holds one entry: limit - 1 more, then EDQUOT. */
		if (pipe2(res, O_CLOEXEC) || pipe2(hold, O_CLOEXEC))
			fail("pipe: %s", strerror(errno));
		for (i = 0; i < limit + 1; i++) {
			pid_t kid = fork();

			if (kid < 0)
				fail("fork: %s", strerror(errno));
			if (kid == 0) {
				int e;
				char byte;

				/* Only the parent keeps the write end: its close ends the hold. */
				close(hold[1]);
				e = set_weight(fd, 0, 60);
				if (write(res[1], &e, sizeof(e)) != sizeof(e))
					_exit(1);
				while (read(hold[0], &byte, 1) > 0)
					;
				_exit(0);
			}
		}
		for (i = 0; i < limit + 1; i++) {
			int e;

			if (read(res[0], &e, sizeof(e)) != sizeof(e))
				fail("a weighted child did not answer");
			if (e == 0)
				ok++;
			else if (e == EDQUOT)
				quota++;
			else
				fail("SET_WEIGHT of child: %s", strerror(e));
		}
		close(hold[1]);
		while (wait(NULL) > 0)
			;
		if (ok != limit - 1 || quota != 2)
			fail("%lu children of one user: %lu weights set, %lu EDQUOT; want %lu and 2 (weights_per_uid %lu)",
			     limit + 1, ok, quota, limit - 1, limit);
		/* Their entries are given back once they have exited. */
		pid = fork();
		if (pid == 0)
			_exit(set_weight(fd, 0, 60) ? 1 : 0);
		reap_ok(pid, "SET_WEIGHT after the others exited");
		_exit(0);
	}
	reap_ok(pid, "unpriv");
	note("without CAP_SYS_NICE: no weight above the default, %lu table entries per user", limit);
	close(fd);
	return 0;
}

static const struct {
	const char *name;
	const char *args;
	int (*run)(int argc, char **argv);
	const char *help;
} commands[] = {
	{ "info", "", cmd_info, "print PVGPU_IOC_INFO" },
	{ "abi", "", cmd_abi, "bad ioctl numbers, sizes, flags, reserved fields, handles; INFO" },
	{ "mmap", "", cmd_mmap, "own channel mappable; foreign, oversize, private mappings refused" },
	{ "wait-any", "", cmd_wait_any,
	  "WAIT_ANY: argument checks, the second of two channels ends the wait, ETIME" },
	{ "submit", "N KERNEL_US", cmd_submit, "submit N kernels, WAIT for the last one" },
	{ "cycles", "N", cmd_cycles, "N alloc/map/free cycles; slots_used back where it was" },
	{ "fork", "", cmd_fork, "a child with the inherited fd cannot use the parent's channels; an exited owner's are freed while a child holds the file" },
	{ "kill-submit", "", cmd_kill_submit, "SIGKILL a submitting child; its channel is freed" },
	{ "kill-wait", "", cmd_kill_wait, "SIGKILL a child blocked in WAIT; its channel is freed" },
	{ "fill-ring", "", cmd_fill_ring, "a child fills its ring and exits; channel freed" },
	{ "weight", "W", cmd_weight, "SET_WEIGHT own process; EPERM for pid 1 without caps" },
	{ "churn", "N HOLD_S", cmd_churn,
	  "N short-lived weighted processes; reused pids start at the default (see docs/guest.md)" },
	{ "unpriv", "", cmd_unpriv,
	  "without CAP_SYS_NICE no weight above the default; weights_per_uid entries per user" },
	{ "alloc-timeout", "", cmd_alloc_timeout,
	  "for the daemon stall test: ALLOC ETIMEDOUT, the late channel freed" },
	{ "lost", "[--recover]", cmd_lost,
	  "for the daemon restart test: WAIT ends DEAD/0x80 (see docs/guest.md)" },
};

static void usage(FILE *out)
{
	size_t i;

	fprintf(out, "usage: %s COMMAND [ARGS]\n\nChecks of the pvgpu guest driver (%s).\n"
		"Exit status: 0 all checks passed, 1 a check failed (a FAIL: line says which), 2 usage.\n\n",
		prog, PVGPU_DEVICE_NODE);
	for (i = 0; i < sizeof(commands) / sizeof(commands[0]); i++)
		fprintf(out, "  %-12s %-12s %s\n", commands[i].name, commands[i].args,
			commands[i].help);
}

int main(int argc, char **argv)
{
	size_t i;

	setvbuf(stdout, NULL, _IOLBF, 0);
	if (argc < 2 || !strcmp(argv[1], "--help") || !strcmp(argv[1], "-h")) {
		usage(argc < 2 ? stderr : stdout);
		return argc < 2 ? 2 : 0;
	}
	for (i = 0; i < sizeof(commands) / sizeof(commands[0]); i++) {
		if (strcmp(argv[1], commands[i].name))
			continue;
		subcommand = commands[i].name;
		if (commands[i].run(argc - 2, argv + 2) < 0) {
			fprintf(stderr, "usage: %s %s %s\n", prog, commands[i].name,
				commands[i].args);
			return 2;
		}
		return 0;
	}
	fprintf(stderr, "%s: unknown command '%s'\n", prog, argv[1]);
	usage(stderr);
	return 2;
}
