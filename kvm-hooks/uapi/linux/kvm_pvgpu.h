/* SPDX-License-Identifier: GPL-2.0 WITH Linux-syscall-note */
/*
 * pvgpu write notify: KVM VM ioctls that write-track guest RAM pages (pvgpu
 * channel control pages) and signal an eventfd after each guest store,
 * without an exit to userspace.  Included at the end of the patched
 * <linux/kvm.h> (kvm-hooks/patches/); userspace may include it directly
 * after <linux/kvm.h>.  See docs/kvm-hooks.md.
 *
 * Probe: KVM_CHECK_EXTENSION(KVM_CAP_PVGPU_WRITE_NOTIFY) on the VM fd returns
 * the interface version (KVM_PVGPU_WN_VERSION), 0 if absent.  Every struct
 * carries that version; a kernel rejects versions it does not know, unknown
 * flags and non-zero reserved fields with -EINVAL.
 */
#ifndef _UAPI_LINUX_KVM_PVGPU_H
#define _UAPI_LINUX_KVM_PVGPU_H

#include <linux/types.h>
#include <linux/ioctl.h>

#ifndef KVMIO
#define KVMIO 0xAE
#endif

/* Out of upstream's numbering, so a later upstream capability cannot clash. */
#define KVM_CAP_PVGPU_WRITE_NOTIFY 0x70760001
#define KVM_PVGPU_WN_VERSION 1

/* The range is tracked (trapped); without it, stores go through (direct). */
#define KVM_PVGPU_WN_ENABLED (1u << 0)
#define KVM_PVGPU_WN_FLAGS_ALL KVM_PVGPU_WN_ENABLED

/* Per VM: ranges and tracked pages (a pvgpu device has <= 64 channels). */
#define KVM_PVGPU_WN_MAX_RANGES 64
#define KVM_PVGPU_WN_MAX_PAGES 256

struct kvm_pvgpu_wn_range {
	__u32 version;		/* KVM_PVGPU_WN_VERSION */
	__u32 flags;		/* KVM_PVGPU_WN_ENABLED */
	__u64 gpa;		/* page aligned, inside memslots */
	__u64 size;		/* page aligned, > 0 */
	__s32 eventfd;		/* signalled after stores to the range */
	__u32 pad;		/* 0 */
	__u64 id;		/* out: the range's id, never reused in this VM */
	__u64 reserved[4];	/* 0 */
};

struct kvm_pvgpu_wn_ctl {
	__u32 version;		/* KVM_PVGPU_WN_VERSION */
	__u32 flags;		/* SET_FLAGS: KVM_PVGPU_WN_ENABLED or 0; else 0 */
	__u64 id;		/* from KVM_PVGPU_WN_REGISTER */
	__u64 faults;		/* GET_STATS out: write faults taken */
	__u64 signals;		/* GET_STATS out: eventfd signals sent */
	__u64 reserved[4];	/* 0 */
};

/*
 * REGISTER: -EINVAL bad argument or eventfd, -EFAULT outside memslots,
 * -EEXIST overlaps a range, -ENOSPC per-VM limit.  Others: -ENOENT unknown id.
 */
#define KVM_PVGPU_WN_REGISTER	_IOWR(KVMIO, 0xf0, struct kvm_pvgpu_wn_range)
#define KVM_PVGPU_WN_UNREGISTER	_IOW(KVMIO, 0xf1, struct kvm_pvgpu_wn_ctl)
#define KVM_PVGPU_WN_SET_FLAGS	_IOW(KVMIO, 0xf2, struct kvm_pvgpu_wn_ctl)
#define KVM_PVGPU_WN_GET_STATS	_IOWR(KVMIO, 0xf3, struct kvm_pvgpu_wn_ctl)

#endif /* _UAPI_LINUX_KVM_PVGPU_H */
