/* SPDX-License-Identifier: GPL-2.0-or-later */
/*
 * pvgpu write tracking: the state machine behind KVM_PVGPU_* (kvm-hooks/).
 *
 * Userspace registers guest-physical ranges (a pvgpu channel's control page)
 * with a notifier.  A guest store to a registered, enabled page faults in the
 * EPT/NPT; the hook counts it and either lets the store run natively under a
 * single step (PVWT_MODE_STEP: VMX monitor trap flag) or has KVM emulate it
 * (PVWT_MODE_EMULATE: the SVM fallback, KVM's page-track write path).  After
 * the store the page is protected again and the notifier signalled, so a
 * signal always follows every store to a tracked page.
 *
 * This file is plain C compiled both into kvm.ko and into the user-space unit
 * tests (fake vCPU and MMU).  It takes no locks: the caller serialises every
 * call on one VM (kvm.ko: a per-VM spinlock).  Host services (page protection,
 * memslot lookup, eventfds) are reached only through struct pvwt_ops.
 */
#ifndef PVGPU_WT_H
#define PVGPU_WT_H

#include <linux/kvm_pvgpu.h>

#ifdef __KERNEL__
#include <linux/types.h>
#include <linux/errno.h>
#else
#include <errno.h>
#include <stdbool.h>
#include <stdint.h>
typedef uint8_t u8;
typedef uint32_t u32;
typedef uint64_t u64;
#endif

#define PVWT_PAGE_SHIFT 12
#define PVWT_PAGE_SIZE (1ull << PVWT_PAGE_SHIFT)
#define PVWT_MAX_RANGES KVM_PVGPU_WN_MAX_RANGES
#define PVWT_MAX_PAGES KVM_PVGPU_WN_MAX_PAGES
/* Pages one instruction may write (a store crossing a page boundary needs 2). */
#define PVWT_STEP_MAX_PAGES 4

enum pvwt_mode {
	PVWT_MODE_STEP,		/* unprotect, single-step natively, re-protect */
	PVWT_MODE_EMULATE,	/* keep protected, the host emulates the store */
};

/* What the caller does after pvwt_write_fault(). */
enum pvwt_action {
	PVWT_NOT_TRACKED,	/* not ours: handle the fault as usual */
	PVWT_STEP,		/* page writable now: arm the single step, re-enter */
	/*
	 * Emulate the store; the host's write path calls pvwt_emulated_write().
	 * Also returned in PVWT_MODE_STEP when one instruction writes more than
	 * PVWT_STEP_MAX_PAGES tracked pages: the step is ended (vcpu->stepping
	 * is false again) and the caller disarms the single step.
	 */
	PVWT_EMULATE,
};

struct pvwt_ops {
	/* true if [gpa, gpa + size) lies entirely inside guest memslots */
	bool (*range_in_memslots)(void *host, u64 gpa, u64 size);
	/* make guest writes to gfn fault (and flush stale writable TLB entries) */
	void (*protect)(void *host, u64 gfn);
	/* undo one protect(gfn) */
	void (*unprotect)(void *host, u64 gfn);
	/* signal the notifier userspace passed at registration */
	void (*signal)(void *host, void *notify);
	/* drop the notifier reference taken at registration */
	void (*release)(void *host, void *notify);
};

struct pvwt_range {
	u64 id;			/* 0: free slot; ids are never reused */
	u64 gfn;
	u64 npages;
	bool enabled;
	void *notify;
	u64 faults;		/* write faults taken on the range */
	u64 signals;		/* notifications sent */
};

/* A page made writable for one or more single steps in flight. */
struct pvwt_hold {
	u64 gfn;
	u32 refs;		/* 0: free slot */
};

struct pvwt_vcpu {
	bool stepping;
	u8 nr_held;
	u64 held_gfn[PVWT_STEP_MAX_PAGES];
};

struct pvwt_vm {
	const struct pvwt_ops *ops;
	void *host;
	enum pvwt_mode mode;
	u64 next_id;
	u32 nr_ranges;
	u32 nr_pages;		/* pages in registered ranges */
	struct pvwt_range ranges[PVWT_MAX_RANGES];
	struct pvwt_hold holds[PVWT_MAX_PAGES];
};

struct pvwt_range_stats {
	u64 faults;		/* trapped stores: faults (step) or emulated writes */
	u64 signals;
	bool enabled;
};

void pvwt_vm_init(struct pvwt_vm *vm, const struct pvwt_ops *ops, void *host,
		  enum pvwt_mode mode);
/* Releases every notifier; the guest memory is going away, nothing is unprotected. */
void pvwt_vm_destroy(struct pvwt_vm *vm);
void pvwt_vcpu_init(struct pvwt_vcpu *vcpu);

/*
 * Register [gpa, gpa + size), page aligned.  On success the range owns the
 * notify reference (released on unregister or destroy) and *id is set;
 * on error the caller keeps it.  Errors: -EINVAL (alignment, size, overflow),
 * -EFAULT (not inside memslots), -EEXIST (overlaps a range), -ENOSPC (limits).
 */
int pvwt_register(struct pvwt_vm *vm, u64 gpa, u64 size, bool enabled,
		  void *notify, u64 *id);
/* -ENOENT if id is unknown.  Safe while a vCPU steps on the range. */
int pvwt_unregister(struct pvwt_vm *vm, u64 id);
/* The trapped/direct switch: protect or unprotect the range's pages. */
int pvwt_set_enabled(struct pvwt_vm *vm, u64 id, bool enabled);
int pvwt_get_stats(const struct pvwt_vm *vm, u64 id, struct pvwt_range_stats *out);

/*
 * The ioctl arguments (<linux/kvm_pvgpu.h>), copied in by the caller.
 * pvwt_check_range_arg: version, flags, padding (-EINVAL); the rest is
 * pvwt_register's.  pvwt_ctl: KVM_PVGPU_WN_UNREGISTER, _SET_FLAGS and
 * _GET_STATS (fills arg->faults, ->signals, ->flags); -ENOTTY for others.
 */
int pvwt_check_range_arg(const struct kvm_pvgpu_wn_range *arg);
int pvwt_ctl(struct pvwt_vm *vm, unsigned int cmd, struct kvm_pvgpu_wn_ctl *arg);

/* A guest write faulted on gpa (EPT/NPT violation). */
enum pvwt_action pvwt_write_fault(struct pvwt_vm *vm, struct pvwt_vcpu *vcpu,
				  u64 gpa);
/*
 * The single step of a vCPU finished (MTF exit, or any exit after which the
 * step is over): re-protect, then signal the ranges now covering the held
 * pages.  Returns false if the vCPU was not stepping for us.
 */
bool pvwt_step_done(struct pvwt_vm *vm, struct pvwt_vcpu *vcpu);
/*
 * The host emulated a guest write of [gpa, gpa + len) (any page, tracked or
 * not): counts a fault and signals each enabled range it touches.  In
 * kvm.ko this is the page-track write notifier, so KVM's own fault path
 * needs no hook for PVWT_MODE_EMULATE.
 */
void pvwt_emulated_write(struct pvwt_vm *vm, u64 gpa, u64 len);
/*
 * The memslot [gfn, gfn + npages) is being deleted or moved: its ranges are
 * dropped without unprotect (the protection goes with the slot).
 */
void pvwt_forget_slot(struct pvwt_vm *vm, u64 gfn, u64 npages);

#endif /* PVGPU_WT_H */
