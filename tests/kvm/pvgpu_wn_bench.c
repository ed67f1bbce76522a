// SPDX-License-Identifier: GPL-2.0-or-later
/*
 * pvgpu-wn-bench: time a channel's IB_PUT stores in DIRECT and TRAPPED mode
 * from inside a guest, through the pvgpu device's BARs (sysfs resource
 * files, no guest driver), for tests/kvm/qemu_nested_test.py.
 *
 *   pvgpu-wn-bench STORES ROUNDS
 *
 * Allocates one channel.  With no work queued, pvgpud's hfq policy traps an
 * idle channel's doorbell (TRAPPED): ROUNDS times, it stores the unchanged
 * IB_PUT STORES times (a repeated IB_PUT is no new work, so the channel
 * stays trapped).  Then it submits a 200 ms kernel, which wakes the channel
 * (DIRECT), and stores ROUNDS x STORES times again.  A round whose mode
 * changed under the stores is not counted.  Between the two it turns the
 * device's memory decoding off and on (the BARs leave the address space and
 * come back) and times one more trapped round, "trapped-remapped": the page
 * must still trap.  Prints, per round and mode,
 *   RESULT store-ns mode=direct|trapped|trapped-remapped round=R ns=<mean ns per store>
 * and "RESULT features kernel_wn=0|1" (the device's FEATURES register).
 * Exit status: 0 done, 1 failure (a "FAIL:" line says which), 2 usage.
 */
#define _GNU_SOURCE
#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <stdarg.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#include "pvgpu/abi.h"
#include "pvgpu/protocol.h"
#include "pvgpu/regs.h"

#define KERNEL_NS (200u * 1000 * 1000)
#define WAIT_NS (20ull * 1000 * 1000 * 1000)

static volatile uint32_t *bar0;
static char pci_dir[512];
static uint8_t *bar2, *bar4;

static void fail(const char *fmt, ...) __attribute__((format(printf, 1, 2), noreturn));
static void fail(const char *fmt, ...)
{
	va_list ap;

	va_start(ap, fmt);
	fputs("FAIL: pvgpu-wn-bench: ", stdout);
	vprintf(fmt, ap);
	fputc('\n', stdout);
	va_end(ap);
	exit(1);
}

static uint64_t now_ns(void)
{
	struct timespec ts;

	clock_gettime(CLOCK_MONOTONIC, &ts);
	return (uint64_t)ts.tv_sec * 1000000000ull + ts.tv_nsec;
}

static uint32_t reg(unsigned off)
{
	return bar0[off / 4];
}

static void set_reg(unsigned off, uint32_t v)
{
	bar0[off / 4] = v;
}

/* Poll a device register until it equals @want; the device changes it on
 * its own (daemon replies, mode pushes), so polling is the only way here. */
static void wait_reg(unsigned off, uint32_t want, const char *what)
{
	uint64_t deadline = now_ns() + WAIT_NS;
	const struct timespec step = { 0, 100 * 1000 };

	while (reg(off) != want) {
		if (now_ns() > deadline)
			fail("%s: register %#x is %u, not %u after 20 s", what, off,
			     reg(off), want);
		nanosleep(&step, NULL);
	}
}

static unsigned read_hex(const char *dir, const char *name)
{
	char path[512], buf[32] = "";
	FILE *f;

	snprintf(path, sizeof(path), "%s/%s", dir, name);
	f = fopen(path, "r");
	if (!f)
		return 0;
	if (!fgets(buf, sizeof(buf), f))
		buf[0] = 0;
	fclose(f);
	return (unsigned)strtoul(buf, NULL, 16);
}

static void *map_bar(const char *dir, int bar, size_t *len)
{
	char path[512];
	struct stat st;
	off_t size;
	void *p;
	int fd;

	snprintf(path, sizeof(path), "%s/resource%d", dir, bar);
	fd = open(path, O_RDWR | O_SYNC);
	if (fd < 0)
		fail("open %s: %s", path, strerror(errno));
	if (fstat(fd, &st) < 0 || st.st_size <= 0)
		fail("%s: no size", path);
	size = st.st_size;
	p = mmap(NULL, size, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
	if (p == MAP_FAILED)
		fail("mmap %s: %s", path, strerror(errno));
	close(fd);
	if (len)
		*len = size;
	return p;
}

static void open_device(void)
{
	const char *root = "/sys/bus/pci/devices";
	char dir[512], path[600];
	struct dirent *e;
	DIR *d = opendir(root);
	FILE *f;

	if (!d)
		fail("%s: %s", root, strerror(errno));
	while ((e = readdir(d))) {
		snprintf(dir, sizeof(dir), "%s/%s", root, e->d_name);
		if (read_hex(dir, "vendor") == PVGPU_PCI_VENDOR_ID && read_hex(dir, "device") == PVGPU_PCI_DEVICE_ID)
			break;
	}
	closedir(d);
	if (!e)
		fail("no pvgpu PCI device (%04x:%04x)", PVGPU_PCI_VENDOR_ID, PVGPU_PCI_DEVICE_ID);
	/* Without a driver the BARs may not decode yet. */
	snprintf(path, sizeof(path), "%s/enable", dir);
	f = fopen(path, "w");
	if (!f || fputs("1", f) < 0 || fclose(f) != 0)
		fail("enable %s: %s", dir, strerror(errno));
	snprintf(pci_dir, sizeof(pci_dir), "%s", dir);
	bar0 = map_bar(dir, 0, NULL);
	bar2 = map_bar(dir, 2, NULL);
	bar4 = map_bar(dir, 4, NULL);
	if (reg(PVGPU_REG_MAGIC) != PVGPU_DEV_MAGIC)
		fail("MAGIC %#x", reg(PVGPU_REG_MAGIC));
}

/*
 * Turn the device's memory decoding off and on again (PCI command register,
 * through sysfs): the BARs leave the guest's address space and come back,
 * as when a guest reprograms them.  The host must re-register the control
 * page with KVM on the way back.
 */
static void toggle_memory_decode(void)
{
	char path[600];
	uint16_t cmd, off;
	int fd;

	snprintf(path, sizeof(path), "%s/config", pci_dir);
	fd = open(path, O_RDWR);
	if (fd < 0 || pread(fd, &cmd, 2, 4) != 2)
		fail("%s: %s", path, strerror(errno));
	off = cmd & ~2u;
	if (pwrite(fd, &off, 2, 4) != 2 || pwrite(fd, &cmd, 2, 4) != 2)
		fail("write %s: %s", path, strerror(errno));
	close(fd);
}

static unsigned alloc_channel(void)
{
	wait_reg(PVGPU_REG_LINK, PVGPU_LINK_READY, "daemon link");
	set_reg(PVGPU_REG_ARG0, 0xbe7c);
	set_reg(PVGPU_REG_ARG1, 0);
	set_reg(PVGPU_REG_CMD, PVGPU_CMD_CHAN_ALLOC);
	{
		uint64_t deadline = now_ns() + WAIT_NS;
		const struct timespec step = { 0, 100 * 1000 };

		while (reg(PVGPU_REG_CMD_STATUS) == PVGPU_CMDST_BUSY) {
			if (now_ns() > deadline)
				fail("CHAN_ALLOC still busy after 20 s");
			nanosleep(&step, NULL);
		}
	}
	if (reg(PVGPU_REG_CMD_STATUS) != PVGPU_CMDST_OK)
		fail("CHAN_ALLOC status %u", reg(PVGPU_REG_CMD_STATUS));
	return reg(PVGPU_REG_RESULT0);
}

/* Mean ns per store of @put to IB_PUT, or 0 if the mode changed meanwhile. */
static uint64_t time_stores(volatile uint32_t *ib_put, uint32_t put, unsigned n,
			    unsigned slot, uint32_t mode)
{
	uint64_t t0, t1;
	unsigned i;

	t0 = now_ns();
	for (i = 0; i < n; i++)
		*ib_put = put;
	t1 = now_ns();
	if (reg(PVGPU_REG_SLOT(slot, PVGPU_SLOT_REG_MODE)) != mode)
		return 0;
	return (t1 - t0) / n;
}

static void report(const char *mode, unsigned round, uint64_t ns)
{
	if (ns)
		printf("RESULT store-ns mode=%s round=%u ns=%llu\n", mode, round,
		       (unsigned long long)ns);
	else
		printf("round %u (%s) not counted: the mode changed under the stores\n",
		       round, mode);
}

int main(int argc, char **argv)
{
	volatile struct pvgpu_ctrl_page *ctrl;
	volatile uint32_t *doorbell;
	volatile struct pvgpu_ring_entry *ring;
	unsigned stores, rounds, slot, r;
	uint32_t put = 0;

	if (argc != 3 || (stores = strtoul(argv[1], NULL, 0)) == 0 ||
	    (rounds = strtoul(argv[2], NULL, 0)) == 0) {
		fprintf(stderr, "usage: pvgpu-wn-bench STORES ROUNDS\n");
		return 2;
	}
	setvbuf(stdout, NULL, _IOLBF, 0);
	open_device();
	printf("RESULT features kernel_wn=%u\n", reg(PVGPU_REG_FEATURES) & PVGPU_FEATURE_KERNEL_WN);
	slot = alloc_channel();
	ctrl = (volatile struct pvgpu_ctrl_page *)(bar2 + slot * PVGPU_BAR2_STRIDE);
	doorbell = (volatile uint32_t *)(bar2 + slot * PVGPU_BAR2_STRIDE + PVGPU_BAR2_DOORBELL);
	ring = (volatile struct pvgpu_ring_entry *)(bar4 + slot * PVGPU_PAGE_SIZE);

	/* pvgpu-load left pvgpud idle: hfq traps the new, idle channel. */
	wait_reg(PVGPU_REG_SLOT(slot, PVGPU_SLOT_REG_MODE), PVGPU_MODE_TRAPPED, "idle channel trapped");
	for (r = 0; r < rounds; r++)
		report("trapped", r, time_stores(&ctrl->ib_put, put, stores, slot,
						 PVGPU_MODE_TRAPPED));

	/* The BARs leave and come back: the page must trap as before. */
	toggle_memory_decode();
	report("trapped-remapped", 0, time_stores(&ctrl->ib_put, put, stores, slot,
						  PVGPU_MODE_TRAPPED));

	/* Work wakes the channel: direct while (and after) the kernel runs. */
	ring[put & PVGPU_RING_MASK].payload = KERNEL_NS;
	ring[put & PVGPU_RING_MASK].fence = put + 1;
	ring[put & PVGPU_RING_MASK].flags = 0;
	__sync_synchronize();
	ctrl->ib_put = ++put;
	*doorbell = 1;
	wait_reg(PVGPU_REG_SLOT(slot, PVGPU_SLOT_REG_MODE), PVGPU_MODE_DIRECT, "busy channel direct");
	for (r = 0; r < rounds; r++)
		report("direct", r, time_stores(&ctrl->ib_put, put, stores, slot,
						PVGPU_MODE_DIRECT));
	{
		uint64_t deadline = now_ns() + WAIT_NS;
		const struct timespec step = { 0, 1000 * 1000 };

		while (ctrl->fence != put) {
			if (now_ns() > deadline)
				fail("the kernel did not complete in 20 s");
			nanosleep(&step, NULL);
		}
	}
	printf("pvgpu-wn-bench: ok\n");
	return 0;
}
