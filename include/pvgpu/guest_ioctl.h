/* SPDX-License-Identifier: GPL-2.0-or-later WITH Linux-syscall-note */
/*
 * pvgpu guest ABI: the ioctls and mmap layout of /dev/pvgpu, shared by the
 * guest kernel module (guest-driver/) and guest user space (libpvgpu's
 * guest transport, pvgpu-load, the guest test tools).
 *
 * Every ioctl argument starts with `size` (the caller's sizeof the struct)
 * and `flags`.  The driver refuses (EINVAL) a size other than the one of
 * this ABI version, any flag it does not know, and any reserved field that is
 * not zero, so fields can be added later under a new size without ambiguity.
 * Output fields are written only on success.
 *
 * Channels are named by a handle the driver returns: the device slot.  A
 * process can use, map and free only the handles it allocated through the
 * same open file; everything else is EBADF (ioctl) or EACCES (mmap).
 *
 * mmap: the three pages of a channel lie at the file offset
 * PVGPU_MMAP_OFFSET(handle) and are mapped together or one at a time:
 *   +0              the control page (IB_PUT, IB_GET, FENCE, STATUS, ERROR)
 *   +PVGPU_PAGE_SIZE  the doorbell page (a 32-bit store of any value at 0
 *                     tells the GPU that IB_PUT moved)
 *   +2*PVGPU_PAGE_SIZE the ring (PVGPU_RING_ENTRIES entries)
 * A submitter writes ring entries, then stores IB_PUT, then rings the
 * doorbell (docs/pvgpu-device.md section 6).
 */
#ifndef PVGPU_GUEST_IOCTL_H
#define PVGPU_GUEST_IOCTL_H

#include "abi.h"
#include "regs.h" /* PVGPU_LINK_*: struct pvgpu_ioc_info.link is the device's LINK */

#ifdef __KERNEL__
#include <linux/ioctl.h>
typedef __s32 pvgpu_s32;
typedef __s64 pvgpu_s64;
#else
#include <sys/ioctl.h>
typedef int32_t pvgpu_s32;
typedef int64_t pvgpu_s64;
#endif

#define PVGPU_GUEST_ABI_VERSION 1u
#define PVGPU_DEVICE_NODE "/dev/pvgpu"

#define PVGPU_MMAP_PAGES_PER_CHANNEL 4u /* 3 used, 1 hole: offsets are a power of two */
#define PVGPU_MMAP_OFFSET(handle) \
	((pvgpu_u64)(handle) * PVGPU_MMAP_PAGES_PER_CHANNEL * PVGPU_PAGE_SIZE)
#define PVGPU_MMAP_CTRL 0u
#define PVGPU_MMAP_DOORBELL (1u * PVGPU_PAGE_SIZE)
#define PVGPU_MMAP_RING (2u * PVGPU_PAGE_SIZE)
#define PVGPU_MMAP_CHANNEL_SIZE (3u * PVGPU_PAGE_SIZE)

/* PVGPU_IOC_INFO: the device and the caller as the driver sees them. */
struct pvgpu_ioc_info {
	pvgpu_u32 size;            /* in: sizeof(struct pvgpu_ioc_info) */
	pvgpu_u32 flags;           /* in: 0 */
	pvgpu_u32 abi_version;     /* out: PVGPU_GUEST_ABI_VERSION */
	pvgpu_u32 device_version;  /* out: the device's VERSION register */
	pvgpu_u32 num_slots;       /* out: channel slots of the device */
	pvgpu_u32 slots_used;      /* out: slots allocated by anyone in this guest */
	pvgpu_u32 link;            /* out: PVGPU_LINK_* */
	pvgpu_u32 link_gen;        /* out: changes after every daemon reconnect */
	pvgpu_u32 pid_hints;       /* out: 1 if the module sends pid hints */
	pvgpu_u32 channels;        /* out: channels held by this open file */
	pvgpu_u64 pid_hint;        /* out: the hint this caller's channels carry (0: none) */
	pvgpu_u32 weight;          /* out: this caller's weight inside its VM */
	pvgpu_u32 irq_mode;        /* out: 1 MSI-X, 2 INTx */
	pvgpu_u64 reserved[4];     /* out: 0 */
};

#define PVGPU_IRQ_MSIX 1u
#define PVGPU_IRQ_INTX 2u

/* PVGPU_IOC_ALLOC: a new channel for the caller. */
struct pvgpu_ioc_alloc {
	pvgpu_u32 size;            /* in */
	pvgpu_u32 flags;           /* in: 0 */
	pvgpu_u32 handle;          /* out: the channel's handle (device slot) */
	pvgpu_u32 chan_id;         /* out: the host daemon's channel id (for logs) */
	pvgpu_u64 mmap_offset;     /* out: PVGPU_MMAP_OFFSET(handle) */
	pvgpu_u64 pid_hint;        /* out: the hint the channel was allocated with */
	pvgpu_u64 reserved[2];     /* in: 0 */
};

/* PVGPU_IOC_FREE: give a channel back.  The driver removes the caller's
 * mappings of it first (a later access raises SIGBUS): the slot may be handed
 * to another process next, so an old mapping must not reach it. */
struct pvgpu_ioc_free {
	pvgpu_u32 size;
	pvgpu_u32 flags;           /* in: 0 */
	pvgpu_u32 handle;          /* in */
	pvgpu_u32 reserved;        /* in: 0 */
};

/* PVGPU_IOC_WAIT: sleep until the channel's FENCE reaches `fence`
 * (wrap-safe 32-bit compare), the channel dies, the timeout passes (ETIME)
 * or a signal arrives (EINTR, restartable).  Interrupt-driven: no polling. */
struct pvgpu_ioc_wait {
	pvgpu_u32 size;
	pvgpu_u32 flags;           /* in: 0 */
	pvgpu_u32 handle;          /* in */
	pvgpu_u32 fence;           /* in */
	pvgpu_s64 timeout_ns;      /* in: < 0 waits forever, 0 only checks */
	pvgpu_u32 status;          /* out: PVGPU_WAIT_* */
	pvgpu_u32 error;           /* out: with PVGPU_WAIT_DEAD, the channel's PVGPU_CHAN_ERR_* */
	pvgpu_u64 reserved;        /* in: 0 */
};

#define PVGPU_WAIT_OK 0u     /* FENCE reached */
#define PVGPU_WAIT_DEAD 1u   /* the channel died first; `error` says why (0x80: link lost) */

/* PVGPU_IOC_WAIT_ANY: PVGPU_IOC_WAIT over several channels at once: sleeps
 * until any target's channel reaches its fence or dies, the timeout passes
 * (ETIME) or a signal arrives (EINTR, restartable).  `index` says which
 * target ended the wait (the lowest such index when several did); `status`
 * and `error` are as PVGPU_IOC_WAIT's for that target.  Targets may name one
 * channel more than once.  Every handle must be the caller's when the wait
 * starts (EBADF).  One that another thread frees during the wait ends it
 * with EBADF, unless a target before it in the array reached its fence or
 * died first (the targets are looked at in order).  Interrupt-driven.
 * Added within ABI version 1: a module without it answers ENOTTY. */
struct pvgpu_wait_target {
	pvgpu_u32 handle;          /* in */
	pvgpu_u32 fence;           /* in */
};

#define PVGPU_WAIT_ANY_MAX 64u  /* targets per call: as many as a device has slots */

struct pvgpu_ioc_wait_any {
	pvgpu_u32 size;
	pvgpu_u32 flags;           /* in: 0 */
	pvgpu_u32 count;           /* in: 1..PVGPU_WAIT_ANY_MAX */
	pvgpu_u32 reserved0;       /* in: 0 */
	pvgpu_u64 targets;         /* in: user address of `count` struct pvgpu_wait_target */
	pvgpu_s64 timeout_ns;      /* in: < 0 waits forever, 0 only checks */
	pvgpu_u32 index;           /* out: the target that ended the wait */
	pvgpu_u32 status;          /* out: PVGPU_WAIT_* of that target */
	pvgpu_u32 error;           /* out: with PVGPU_WAIT_DEAD, its channel's PVGPU_CHAN_ERR_* */
	pvgpu_u32 reserved1;       /* in: 0 */
	pvgpu_u64 reserved[2];     /* in: 0 */
};

/* PVGPU_IOC_SET_WEIGHT: the weight of a guest task inside its VM's share,
 * like nice: 1..10000, default 100.  `pid` 0 (or the caller's own tgid) sets
 * the caller's weight; another task's weight needs CAP_SYS_ADMIN.  The host
 * applies it only inside the VM's share. */
struct pvgpu_ioc_set_weight {
	pvgpu_u32 size;
	pvgpu_u32 flags;           /* in: 0 */
	pvgpu_s32 pid;             /* in: 0 = the caller's process */
	pvgpu_u32 weight;          /* in: PVGPU_WEIGHT_MIN..PVGPU_WEIGHT_MAX */
	pvgpu_u64 reserved;        /* in: 0 */
};

#define PVGPU_IOC_MAGIC 0xb7
#define PVGPU_IOC_INFO _IOWR(PVGPU_IOC_MAGIC, 0x00, struct pvgpu_ioc_info)
#define PVGPU_IOC_ALLOC _IOWR(PVGPU_IOC_MAGIC, 0x01, struct pvgpu_ioc_alloc)
#define PVGPU_IOC_FREE _IOWR(PVGPU_IOC_MAGIC, 0x02, struct pvgpu_ioc_free)
#define PVGPU_IOC_WAIT _IOWR(PVGPU_IOC_MAGIC, 0x03, struct pvgpu_ioc_wait)
#define PVGPU_IOC_SET_WEIGHT _IOWR(PVGPU_IOC_MAGIC, 0x04, struct pvgpu_ioc_set_weight)
#define PVGPU_IOC_WAIT_ANY _IOWR(PVGPU_IOC_MAGIC, 0x05, struct pvgpu_ioc_wait_any)

#ifdef __cplusplus
#define PVGPU_GUEST_STATIC_ASSERT static_assert
#else
#define PVGPU_GUEST_STATIC_ASSERT _Static_assert
#endif
PVGPU_GUEST_STATIC_ASSERT(sizeof(struct pvgpu_ioc_info) == 88, "info layout");
PVGPU_GUEST_STATIC_ASSERT(sizeof(struct pvgpu_ioc_alloc) == 48, "alloc layout");
PVGPU_GUEST_STATIC_ASSERT(sizeof(struct pvgpu_ioc_free) == 16, "free layout");
PVGPU_GUEST_STATIC_ASSERT(sizeof(struct pvgpu_ioc_wait) == 40, "wait layout");
PVGPU_GUEST_STATIC_ASSERT(sizeof(struct pvgpu_ioc_set_weight) == 24, "set_weight layout");
PVGPU_GUEST_STATIC_ASSERT(sizeof(struct pvgpu_wait_target) == 8, "wait_target layout");
PVGPU_GUEST_STATIC_ASSERT(sizeof(struct pvgpu_ioc_wait_any) == 64, "wait_any layout");

#endif /* PVGPU_GUEST_IOCTL_H */
