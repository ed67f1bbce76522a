// SPDX-License-Identifier: GPL-2.0-or-later
/*
 * kvm-wn-l2: exercise pvgpu write notify (kvm-hooks/) on a real KVM.
 * Static, for the initramfs of a TCG guest that loaded the patched kvm.ko
 * and kvm-amd.ko.  Creates an L2 VM with 64 KiB of RAM, runs real-mode L2
 * code that stores an incrementing counter to a registered page N times and
 * halts, and checks the eventfd count, the range's stats, the final memory
 * and that the only exit to userspace is the final HLT.  Then: tracking
 * switched off (no signals), on again, a store crossing a page boundary,
 * two vCPUs at once, and unregister while a vCPU runs.
 * Prints one "RESULT ..." line per check and "kvm-wn-l2: ok" at the end;
 * exit status 0 if every check passed, 1 if one failed, 2 if it could not
 * run (no /dev/kvm, no capability).
 */
#include <errno.h>
#include <fcntl.h>
#include <inttypes.h>
#include <pthread.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/eventfd.h>
#include <sys/ioctl.h>
#include <sys/mman.h>
#include <time.h>
#include <unistd.h>
#include <linux/kvm.h>
#include <linux/kvm_pvgpu.h>

#define MEM_SIZE 0x10000
#define CODE 0x1000
#define PAGE 0x8000	/* the tracked "control page" and the one after it */
#define MMIO_BASE 0x10000	/* no memslot: stores there exit to userspace */
#define SLOT_PAGE 0x20000	/* a one-page memslot, deleted and re-added */

static int kvm_fd, vm_fd, run_size;
static uint8_t *mem;
static int failures;

static void __attribute__((noreturn, format(printf, 1, 2)))
die(const char *fmt, ...)
{
	va_list ap;

	va_start(ap, fmt);
	fputs("kvm-wn-l2: ", stderr);
	vfprintf(stderr, fmt, ap);
	fputs("\n", stderr);
	va_end(ap);
	exit(2);
}

static void __attribute__((format(printf, 3, 4)))
check(int ok, const char *what, const char *fmt, ...)
{
	va_list ap;

	printf("RESULT %s %s ", what, ok ? "pass" : "FAIL");
	va_start(ap, fmt);
	vprintf(fmt, ap);
	va_end(ap);
	printf("\n");
	fflush(stdout);
	if (!ok)
		failures++;
}

/*
 * Real mode, bx = address, cx = count, (e)ax counts up:
 *   loop: inc (e)ax; mov [bx], (e)ax; dec cx; jnz loop; hlt
 */
static const uint8_t code16[] = { 0x40, 0x89, 0x07, 0x49, 0x75, 0xfa, 0xf4 };
static const uint8_t code32[] = { 0x66, 0x40, 0x66, 0x89, 0x07, 0x49, 0x75, 0xf8, 0xf4 };

struct vcpu {
	int fd;
	struct kvm_run *run;
	unsigned int exits;	/* KVM_RUN returns: exits to userspace */
	unsigned int mmio_exits;
	uint32_t code;
	uint32_t ds_base;	/* 0, or MMIO_BASE for stores outside memslots */
	int allow_mmio;
};

static void vcpu_create(struct vcpu *v, int id, uint32_t code)
{
	v->fd = ioctl(vm_fd, KVM_CREATE_VCPU, id);
	if (v->fd < 0)
		die("KVM_CREATE_VCPU: %s", strerror(errno));
	v->run = mmap(NULL, run_size, PROT_READ | PROT_WRITE, MAP_SHARED, v->fd, 0);
	if (v->run == MAP_FAILED)
		die("mmap kvm_run: %s", strerror(errno));
	v->code = code;
}

static void vcpu_setup(struct vcpu *v, uint16_t addr, uint16_t count)
{
	struct kvm_sregs sregs;
	struct kvm_regs regs = { 0 };

	if (ioctl(v->fd, KVM_GET_SREGS, &sregs) < 0)
		die("KVM_GET_SREGS: %s", strerror(errno));
	sregs.cs.base = 0;
	sregs.cs.selector = 0;
	sregs.ds.base = v->ds_base;
	sregs.ds.selector = 0;
	if (ioctl(v->fd, KVM_SET_SREGS, &sregs) < 0)
		die("KVM_SET_SREGS: %s", strerror(errno));
	regs.rip = v->code;
	regs.rbx = addr;
	regs.rcx = count;
	regs.rflags = 2;
	if (ioctl(v->fd, KVM_SET_REGS, &regs) < 0)
		die("KVM_SET_REGS: %s", strerror(errno));
	v->exits = 0;
	v->mmio_exits = 0;
}

/* Run to the HLT; any other exit is a failure. */
static void *vcpu_run(void *arg)
{
	struct vcpu *v = arg;

	for (;;) {
		if (ioctl(v->fd, KVM_RUN, 0) < 0)
			die("KVM_RUN: %s", strerror(errno));
		v->exits++;
		if (v->run->exit_reason == KVM_EXIT_HLT)
			return NULL;
		if (v->run->exit_reason == KVM_EXIT_MMIO && v->allow_mmio) {
			/* what a VMM does for a trapped doorbell: note it, re-enter */
			v->mmio_exits++;
			continue;
		}
		if (v->run->exit_reason != KVM_EXIT_INTR)
			die("unexpected exit %u", v->run->exit_reason);
	}
}

static uint64_t drain(int efd)
{
	uint64_t n = 0;

	if (read(efd, &n, sizeof(n)) != sizeof(n) && errno != EAGAIN)
		die("read eventfd: %s", strerror(errno));
	return n;
}

static uint64_t reg_range(uint64_t gpa, uint64_t size, int efd, uint32_t flags, int *err)
{
	struct kvm_pvgpu_wn_range r = {
		.version = KVM_PVGPU_WN_VERSION, .flags = flags,
		.gpa = gpa, .size = size, .eventfd = efd,
	};

	*err = ioctl(vm_fd, KVM_PVGPU_WN_REGISTER, &r) < 0 ? errno : 0;
	return r.id;
}

static int ctl(unsigned long cmd, uint64_t id, uint32_t flags, struct kvm_pvgpu_wn_ctl *out)
{
	struct kvm_pvgpu_wn_ctl c = { .version = KVM_PVGPU_WN_VERSION, .flags = flags, .id = id };
	int r = ioctl(vm_fd, cmd, &c) < 0 ? errno : 0;

	if (out)
		*out = c;
	return r;
}

static double now(void)
{
	struct timespec ts;

	clock_gettime(CLOCK_MONOTONIC, &ts);
	return ts.tv_sec + ts.tv_nsec * 1e-9;
}

static double timed_run(struct vcpu *v, uint16_t addr, uint16_t count)
{
	double t;

	vcpu_setup(v, addr, count);
	t = now();
	vcpu_run(v);
	return now() - t;
}

static void set_slot1(void *host, uint64_t size)
{
	struct kvm_userspace_memory_region r = {
		.slot = 1, .guest_phys_addr = SLOT_PAGE, .memory_size = size,
		.userspace_addr = (uintptr_t)host,
	};

	if (ioctl(vm_fd, KVM_SET_USER_MEMORY_REGION, &r) < 0)
		die("KVM_SET_USER_MEMORY_REGION slot 1: %s", strerror(errno));
}

/*
 * Costs, as ratios (absolute times under nested TCG mean little): a tracked
 * store (kernel path: fault, emulation, eventfd) and a store that exits to
 * userspace as MMIO (the VMM path today), each less a direct store; and the
 * trapped/direct switch by KVM_PVGPU_WN_SET_FLAGS against one by deleting
 * and re-adding a one-page memslot (what a VMM's region swap costs KVM at
 * least).
 */
static void bench(struct vcpu *v, uint64_t id, int efd, unsigned int n)
{
	double direct, tracked, mmio, flags, slot, t;
	void *page;
	unsigned int i, k = 200;

	ctl(KVM_PVGPU_WN_SET_FLAGS, id, 0, NULL);
	direct = timed_run(v, PAGE + 0x40, (uint16_t)n);
	ctl(KVM_PVGPU_WN_SET_FLAGS, id, KVM_PVGPU_WN_ENABLED, NULL);
	tracked = timed_run(v, PAGE + 0x40, (uint16_t)n);
	drain(efd);
	v->ds_base = MMIO_BASE;
	v->allow_mmio = 1;
	mmio = timed_run(v, 0x40, (uint16_t)n);
	check(v->mmio_exits == n, "bench-mmio-exits", "mmio_exits=%u", v->mmio_exits);
	v->ds_base = 0;
	v->allow_mmio = 0;
	tracked = (tracked - direct) / n;
	mmio = (mmio - direct) / n;
	printf("RESULT kvm-doorbell-us kernel_path=%.2f userspace_exit=%.2f direct_total=%.2f"
	       " ratio_userspace_exit_to_kernel_path=%.2f\n", tracked * 1e6, mmio * 1e6,
	       direct * 1e6 / n, mmio / tracked);

	t = now();
	for (i = 0; i < k; i++) {
		ctl(KVM_PVGPU_WN_SET_FLAGS, id, 0, NULL);
		ctl(KVM_PVGPU_WN_SET_FLAGS, id, KVM_PVGPU_WN_ENABLED, NULL);
	}
	flags = (now() - t) / (2 * k);
	page = mmap(NULL, 0x1000, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_ANONYMOUS, -1, 0);
	if (page == MAP_FAILED)
		die("mmap: %s", strerror(errno));
	set_slot1(page, 0x1000);
	t = now();
	for (i = 0; i < k; i++) {
		set_slot1(page, 0);
		set_slot1(page, 0x1000);
	}
	slot = (now() - t) / (2 * k);
	set_slot1(page, 0);
	munmap(page, 0x1000);
	printf("RESULT kvm-switch-us set_flags=%.2f memslot=%.2f ratio_memslot_to_set_flags=%.2f\n",
	       flags * 1e6, slot * 1e6, slot / flags);
	fflush(stdout);
}

static uint32_t rd32(uint32_t gpa)
{
	uint32_t v;

	memcpy(&v, mem + gpa, sizeof(v));
	return v;
}

int main(int argc, char **argv)
{
	unsigned int n = argc > 1 ? (unsigned int)strtoul(argv[1], NULL, 0) : 1000;
	struct kvm_userspace_memory_region region;
	struct kvm_pvgpu_wn_ctl st;
	struct vcpu v0, v1;
	pthread_t t0, t1;
	uint64_t id, id2, got;
	int efd, err, version;

	if (n == 0 || n > 0xffff)
		die("usage: kvm-wn-l2 [N]  (stores per run, 1..65535; default 1000)");
	kvm_fd = open("/dev/kvm", O_RDWR | O_CLOEXEC);
	if (kvm_fd < 0)
		die("/dev/kvm: %s", strerror(errno));
	vm_fd = ioctl(kvm_fd, KVM_CREATE_VM, 0);
	if (vm_fd < 0)
		die("KVM_CREATE_VM: %s", strerror(errno));
	version = ioctl(vm_fd, KVM_CHECK_EXTENSION, KVM_CAP_PVGPU_WRITE_NOTIFY);
	if (version != KVM_PVGPU_WN_VERSION)
		die("KVM_CAP_PVGPU_WRITE_NOTIFY is %d, want %d: patched kvm.ko not loaded?",
		    version, KVM_PVGPU_WN_VERSION);
	run_size = ioctl(kvm_fd, KVM_GET_VCPU_MMAP_SIZE, 0);
	mem = mmap(NULL, MEM_SIZE, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_ANONYMOUS, -1, 0);
	if (mem == MAP_FAILED)
		die("mmap guest memory: %s", strerror(errno));
	memcpy(mem + CODE, code16, sizeof(code16));
	memcpy(mem + CODE + 0x100, code32, sizeof(code32));
	region = (struct kvm_userspace_memory_region){
		.slot = 0, .guest_phys_addr = 0, .memory_size = MEM_SIZE,
		.userspace_addr = (uintptr_t)mem,
	};
	if (ioctl(vm_fd, KVM_SET_USER_MEMORY_REGION, &region) < 0)
		die("KVM_SET_USER_MEMORY_REGION: %s", strerror(errno));
	efd = eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC);
	if (efd < 0)
		die("eventfd: %s", strerror(errno));

	/* validation */
	reg_range(PAGE + 1, 0x1000, efd, KVM_PVGPU_WN_ENABLED, &err);
	check(err == EINVAL, "register-unaligned", "errno=%d", err);
	reg_range(MEM_SIZE, 0x1000, efd, KVM_PVGPU_WN_ENABLED, &err);
	check(err == EFAULT, "register-outside-memslots", "errno=%d", err);
	reg_range(PAGE, 0x1000, -1, KVM_PVGPU_WN_ENABLED, &err);
	check(err == EINVAL, "register-bad-eventfd", "errno=%d", err);

	id = reg_range(PAGE, 0x2000, efd, KVM_PVGPU_WN_ENABLED, &err);
	check(err == 0 && id != 0, "register", "errno=%d id=%" PRIu64, err, id);
	reg_range(PAGE + 0x1000, 0x1000, efd, KVM_PVGPU_WN_ENABLED, &err);
	check(err == EEXIST, "register-overlap", "errno=%d", err);

	/* N tracked stores: N signals, the final value, one exit (the HLT) */
	vcpu_create(&v0, 0, CODE);
	vcpu_create(&v1, 1, CODE);
	vcpu_setup(&v0, PAGE, (uint16_t)n);
	vcpu_run(&v0);
	got = drain(efd);
	ctl(KVM_PVGPU_WN_GET_STATS, id, 0, &st);
	check(got == n && st.signals == n && st.faults == n && rd32(PAGE) == n && v0.exits == 1,
	      "tracked-stores", "n=%u eventfd=%" PRIu64 " faults=%llu signals=%llu memory=%u exits=%u",
	      n, got, (unsigned long long)st.faults, (unsigned long long)st.signals,
	      rd32(PAGE), v0.exits);

	/* switched off: the stores go through, nobody is told */
	check(ctl(KVM_PVGPU_WN_SET_FLAGS, id, 0, NULL) == 0, "switch-off", "-");
	vcpu_setup(&v0, PAGE + 4, (uint16_t)n);
	vcpu_run(&v0);
	got = drain(efd);
	check(got == 0 && rd32(PAGE + 4) == n && v0.exits == 1, "untracked-stores",
	      "eventfd=%" PRIu64 " memory=%u exits=%u", got, rd32(PAGE + 4), v0.exits);
	check(ctl(KVM_PVGPU_WN_SET_FLAGS, id, KVM_PVGPU_WN_ENABLED, NULL) == 0, "switch-on", "-");
	vcpu_setup(&v0, PAGE + 8, (uint16_t)n);
	vcpu_run(&v0);
	got = drain(efd);
	check(got == n && rd32(PAGE + 8) == n, "retracked-stores", "eventfd=%" PRIu64 " memory=%u",
	      got, rd32(PAGE + 8));

	/* 32-bit stores crossing into the range's second page */
	v0.code = CODE + 0x100;
	vcpu_setup(&v0, PAGE + 0xffe, (uint16_t)n);
	vcpu_run(&v0);
	got = drain(efd);
	check(got >= n && rd32(PAGE + 0xffe) == n && v0.exits == 1, "page-crossing-stores",
	      "eventfd=%" PRIu64 " memory=%u exits=%u", got, rd32(PAGE + 0xffe), v0.exits);
	v0.code = CODE;

	/* two vCPUs storing to the same page at once */
	vcpu_setup(&v0, PAGE + 0x10, (uint16_t)n);
	vcpu_setup(&v1, PAGE + 0x14, (uint16_t)n);
	pthread_create(&t0, NULL, vcpu_run, &v0);
	pthread_create(&t1, NULL, vcpu_run, &v1);
	pthread_join(t0, NULL);
	pthread_join(t1, NULL);
	got = drain(efd);
	check(got == 2ull * n && rd32(PAGE + 0x10) == n && rd32(PAGE + 0x14) == n,
	      "two-vcpus", "eventfd=%" PRIu64 " memory=%u,%u exits=%u,%u", got,
	      rd32(PAGE + 0x10), rd32(PAGE + 0x14), v0.exits, v1.exits);

	bench(&v0, id, efd, n);

	/* unregister while a vCPU is storing */
	vcpu_setup(&v0, PAGE + 0x20, 0xffff);
	pthread_create(&t0, NULL, vcpu_run, &v0);
	/* poll (bounded: 20 s) until the vCPU's stores are being tracked */
	for (unsigned int i = 0; !drain(efd) && i < 200000; i++)
		usleep(100);
	err = ctl(KVM_PVGPU_WN_UNREGISTER, id, 0, NULL);
	pthread_join(t0, NULL);
	check(err == 0 && rd32(PAGE + 0x20) == 0xffff &&
	      ctl(KVM_PVGPU_WN_GET_STATS, id, 0, NULL) == ENOENT, "unregister-during-run",
	      "errno=%d memory=%u", err, rd32(PAGE + 0x20));
	drain(efd);
	id2 = reg_range(PAGE, 0x1000, efd, KVM_PVGPU_WN_ENABLED, &err);
	check(err == 0 && id2 != id, "register-again", "errno=%d id=%" PRIu64, err, id2);

	close(vm_fd);	/* teardown with a range registered */
	printf("kvm-wn-l2: %s\n", failures ? "FAILED" : "ok");
	return failures ? 1 : 0;
}
