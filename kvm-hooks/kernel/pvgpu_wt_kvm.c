// SPDX-License-Identifier: GPL-2.0-or-later
/*
 * pvgpu write notify: KVM_PVGPU_WN_* VM ioctls over the state machine in
 * pvgpu_wt.c.  Pages are protected with KVM's write tracking
 * (KVM_PAGE_TRACK_WRITE), so a guest store to them is emulated by KVM and
 * reported to the page-track notifier, which signals the range's eventfd:
 * no exit to userspace: the emulation path (PVWT_MODE_EMULATE), on SVM and,
 * by default, on VMX.  With kvm.pvgpu_wt_mtf=1 and kvm-intel loaded, new VMs
 * use the MTF step path instead (PVWT_MODE_STEP): on a write fault to a
 * tracked gfn the page is made writable, kvm-intel arms the monitor trap
 * flag, the store runs natively and the MTF exit re-protects and signals.
 * The step path is compiled but has not run on VMX hardware yet (these
 * machines have none): docs/kvm-hooks.md says how to check it.
 *
 * The per-VM state lives outside struct kvm, found by a small hash table, so
 * no KVM structure changes and the symbol CRCs of kvm.ko stay Debian's.
 * Lock order: kvm->slots_lock (memslot changes), then wt->lock, then
 * kvm->mmu_lock (taken by protect/unprotect).
 */
#include <linux/eventfd.h>
#include <linux/hashtable.h>
#include <linux/kvm_host.h>
#include <linux/slab.h>
#include <linux/spinlock.h>
#include <linux/uaccess.h>
#include <asm/kvm_page_track.h>

#include "kvm_cache_regs.h"
#include "pvgpu_wt.h"
#include "pvgpu_wt_kvm.h"

static bool pvgpu_wt_mtf;
module_param(pvgpu_wt_mtf, bool, 0644);
MODULE_PARM_DESC(pvgpu_wt_mtf, "pvgpu write notify: single-step tracked stores with MTF on VMX (new VMs)");

static const struct kvm_pvgpu_wt_step_ops *step_ops;

void kvm_pvgpu_wt_set_step_ops(const struct kvm_pvgpu_wt_step_ops *ops)
{
	WRITE_ONCE(step_ops, ops);
}
EXPORT_SYMBOL_GPL(kvm_pvgpu_wt_set_step_ops);

struct kvm_pvgpu_wt {
	struct kvm *kvm;
	struct hlist_node hash;
	spinlock_t lock;		/* serialises every pvwt_* call on vm */
	struct kvm_page_track_notifier_node node;
	struct pvwt_vm vm;
	struct pvwt_vcpu *vcpus;	/* PVWT_MODE_STEP: by vcpu_idx */
};

/* Writers hold wt_table_lock; vCPU paths look up under RCU. */
static DEFINE_MUTEX(wt_table_lock);
static DEFINE_HASHTABLE(wt_table, 6);

/*
 * The VM's state, or NULL.  It stays valid after rcu_read_unlock() for a
 * caller holding the VM (a vCPU, an ioctl): it goes only at VM teardown.
 */
static struct kvm_pvgpu_wt *wt_lookup(struct kvm *kvm)
{
	struct kvm_pvgpu_wt *wt, *found = NULL;

	rcu_read_lock();
	hash_for_each_possible_rcu(wt_table, wt, hash, (unsigned long)kvm)
		if (wt->kvm == kvm) {
			found = wt;
			break;
		}
	rcu_read_unlock();
	return found;
}

static struct kvm_pvgpu_wt *wt_find(struct kvm *kvm)
{
	struct kvm_pvgpu_wt *wt;

	lockdep_assert_held(&wt_table_lock);
	hash_for_each_possible(wt_table, wt, hash, (unsigned long)kvm)
		if (wt->kvm == kvm)
			return wt;
	return NULL;
}

/* A live user memslot: KVM's private slots (APIC access page, TSS) are not RAM. */
static struct kvm_memory_slot *wt_slot(struct kvm *kvm, gfn_t gfn)
{
	struct kvm_memory_slot *slot = gfn_to_memslot(kvm, gfn);

	if (!slot || slot->flags & KVM_MEMSLOT_INVALID || slot->id >= KVM_USER_MEM_SLOTS)
		return NULL;
	return slot;
}

static bool wt_range_in_memslots(void *host, u64 gpa, u64 size)
{
	struct kvm_pvgpu_wt *wt = host;
	gfn_t gfn;

	for (gfn = gpa_to_gfn(gpa); gfn < gpa_to_gfn(gpa + size); gfn++)
		if (!wt_slot(wt->kvm, gfn))
			return false;
	return true;
}

static void wt_track(struct kvm_pvgpu_wt *wt, u64 gfn, bool add)
{
	struct kvm *kvm = wt->kvm;
	struct kvm_memory_slot *slot = wt_slot(kvm, gfn);

	/* the state machine only tracks gfns inside live slots */
	if (WARN_ON_ONCE(!slot))
		return;
	write_lock(&kvm->mmu_lock);
	if (add)
		kvm_slot_page_track_add_page(kvm, slot, gfn, KVM_PAGE_TRACK_WRITE);
	else
		kvm_slot_page_track_remove_page(kvm, slot, gfn, KVM_PAGE_TRACK_WRITE);
	write_unlock(&kvm->mmu_lock);
}

static void wt_protect(void *host, u64 gfn)
{
	wt_track(host, gfn, true);
}

static void wt_unprotect(void *host, u64 gfn)
{
	wt_track(host, gfn, false);
}

static void wt_signal(void *host, void *notify)
{
	eventfd_signal(notify, 1);
}

static void wt_release(void *host, void *notify)
{
	eventfd_ctx_put(notify);
}

static const struct pvwt_ops wt_ops = {
	.range_in_memslots = wt_range_in_memslots,
	.protect = wt_protect,
	.unprotect = wt_unprotect,
	.signal = wt_signal,
	.release = wt_release,
};

/* KVM emulated a guest write to a write-tracked page (any tracker's). */
static void wt_track_write(struct kvm_vcpu *vcpu, gpa_t gpa, const u8 *new,
			   int bytes, struct kvm_page_track_notifier_node *node)
{
	struct kvm_pvgpu_wt *wt = container_of(node, struct kvm_pvgpu_wt, node);

	spin_lock(&wt->lock);
	pvwt_emulated_write(&wt->vm, gpa, bytes);
	spin_unlock(&wt->lock);
}

static void wt_track_flush_slot(struct kvm *kvm, struct kvm_memory_slot *slot,
				struct kvm_page_track_notifier_node *node)
{
	struct kvm_pvgpu_wt *wt = container_of(node, struct kvm_pvgpu_wt, node);

	spin_lock(&wt->lock);
	pvwt_forget_slot(&wt->vm, slot->base_gfn, slot->npages);
	spin_unlock(&wt->lock);
}

static struct kvm_pvgpu_wt *wt_get_or_create(struct kvm *kvm)
{
	struct kvm_pvgpu_wt *wt;

	mutex_lock(&wt_table_lock);
	wt = wt_find(kvm);
	if (!wt) {
		bool step = pvgpu_wt_mtf && READ_ONCE(step_ops);

		wt = kzalloc(sizeof(*wt), GFP_KERNEL_ACCOUNT);
		if (wt && step) {
			wt->vcpus = kvcalloc(KVM_MAX_VCPUS, sizeof(*wt->vcpus),
					     GFP_KERNEL_ACCOUNT);
			if (!wt->vcpus) {
				kfree(wt);
				wt = NULL;
			}
		}
		if (wt) {
			wt->kvm = kvm;
			spin_lock_init(&wt->lock);
			pvwt_vm_init(&wt->vm, &wt_ops, wt,
				     step ? PVWT_MODE_STEP : PVWT_MODE_EMULATE);
			wt->node.track_write = wt_track_write;
			wt->node.track_flush_slot = wt_track_flush_slot;
			kvm_page_track_register_notifier(kvm, &wt->node);
			hash_add_rcu(wt_table, &wt->hash, (unsigned long)kvm);
		}
	}
	mutex_unlock(&wt_table_lock);
	return wt;
}

static long wt_register(struct kvm *kvm, void __user *argp)
{
	struct kvm_pvgpu_wn_range arg;
	struct eventfd_ctx *ctx;
	struct kvm_pvgpu_wt *wt;
	u64 id = 0;
	int idx, r;

	if (copy_from_user(&arg, argp, sizeof(arg)))
		return -EFAULT;
	r = pvwt_check_range_arg(&arg);
	if (r)
		return r;
	ctx = eventfd_ctx_fdget(arg.eventfd);
	if (IS_ERR(ctx))
		return -EINVAL;
	wt = wt_get_or_create(kvm);
	if (!wt) {
		eventfd_ctx_put(ctx);
		return -ENOMEM;
	}
	/* memslots stay put while slots_lock is held; srcu for gfn_to_memslot */
	mutex_lock(&kvm->slots_lock);
	idx = srcu_read_lock(&kvm->srcu);
	spin_lock(&wt->lock);
	r = pvwt_register(&wt->vm, arg.gpa, arg.size,
			  arg.flags & KVM_PVGPU_WN_ENABLED, ctx, &id);
	spin_unlock(&wt->lock);
	srcu_read_unlock(&kvm->srcu, idx);
	mutex_unlock(&kvm->slots_lock);
	if (r) {
		eventfd_ctx_put(ctx);
		return r;
	}
	arg.id = id;
	if (copy_to_user(argp, &arg, sizeof(arg))) {
		/* userspace cannot learn the id: take the range back */
		mutex_lock(&kvm->slots_lock);
		idx = srcu_read_lock(&kvm->srcu);
		spin_lock(&wt->lock);
		pvwt_unregister(&wt->vm, id);
		spin_unlock(&wt->lock);
		srcu_read_unlock(&kvm->srcu, idx);
		mutex_unlock(&kvm->slots_lock);
		return -EFAULT;
	}
	return 0;
}

static long wt_ctl(struct kvm *kvm, unsigned int ioctl, void __user *argp)
{
	struct kvm_pvgpu_wn_ctl arg;
	struct kvm_pvgpu_wt *wt;
	int idx, r;

	if (copy_from_user(&arg, argp, sizeof(arg)))
		return -EFAULT;
	wt = wt_lookup(kvm);
	if (!wt)
		return arg.version == KVM_PVGPU_WN_VERSION ? -ENOENT : -EINVAL;
	mutex_lock(&kvm->slots_lock);
	idx = srcu_read_lock(&kvm->srcu);
	spin_lock(&wt->lock);
	r = pvwt_ctl(&wt->vm, ioctl, &arg);
	spin_unlock(&wt->lock);
	srcu_read_unlock(&kvm->srcu, idx);
	mutex_unlock(&kvm->slots_lock);
	if (!r && ioctl == KVM_PVGPU_WN_GET_STATS &&
	    copy_to_user(argp, &arg, sizeof(arg)))
		return -EFAULT;
	return r;
}

long kvm_pvgpu_wt_ioctl(struct kvm *kvm, unsigned int ioctl, void __user *argp)
{
	if (ioctl == KVM_PVGPU_WN_REGISTER)
		return wt_register(kvm, argp);
	return wt_ctl(kvm, ioctl, argp);
}

/* VM teardown: the guest memory goes too, so nothing is unprotected. */
void kvm_pvgpu_wt_destroy(struct kvm *kvm)
{
	struct kvm_pvgpu_wt *wt;

	mutex_lock(&wt_table_lock);
	wt = wt_find(kvm);
	if (wt)
		hash_del_rcu(&wt->hash);
	mutex_unlock(&wt_table_lock);
	if (!wt)
		return;
	synchronize_rcu();	/* other VMs' lookups may still walk past it */
	kvm_page_track_unregister_notifier(kvm, &wt->node);
	pvwt_vm_destroy(&wt->vm);
	kvfree(wt->vcpus);
	kfree(wt);
}

bool kvm_pvgpu_wt_page_fault(struct kvm_vcpu *vcpu, gfn_t gfn)
{
	const struct kvm_pvgpu_wt_step_ops *ops = READ_ONCE(step_ops);
	struct kvm_pvgpu_wt *wt = wt_lookup(vcpu->kvm);
	struct kvm_memory_slot *slot;
	enum pvwt_action act;
	struct pvwt_vcpu *pv;

	/* a nested guest's faults go through vmcs02: leave them to emulation */
	if (!wt || wt->vm.mode != PVWT_MODE_STEP || !ops || is_guest_mode(vcpu))
		return false;
	pv = &wt->vcpus[vcpu->vcpu_idx];
	spin_lock(&wt->lock);
	act = pvwt_write_fault(&wt->vm, pv, gfn_to_gpa(gfn));
	if (act == PVWT_STEP) {
		/*
		 * Another tracker (shadow paging, KVMGT) still protects the
		 * page: the retried store would fault forever.  Emulate it.
		 */
		slot = wt_slot(vcpu->kvm, gfn);
		if (!slot || kvm_slot_page_track_is_active(vcpu->kvm, slot, gfn,
							   KVM_PAGE_TRACK_WRITE)) {
			pvwt_step_done(&wt->vm, pv);
			act = PVWT_EMULATE;
		}
	}
	spin_unlock(&wt->lock);
	if (act == PVWT_STEP) {
		ops->arm(vcpu);
		return true;
	}
	if (!pv->stepping)
		ops->disarm(vcpu);
	return false;
}

bool kvm_pvgpu_wt_step_done(struct kvm_vcpu *vcpu)
{
	struct kvm_pvgpu_wt *wt = wt_lookup(vcpu->kvm);
	bool done;

	if (!wt || wt->vm.mode != PVWT_MODE_STEP)
		return false;
	spin_lock(&wt->lock);
	done = pvwt_step_done(&wt->vm, &wt->vcpus[vcpu->vcpu_idx]);
	spin_unlock(&wt->lock);
	return done;
}
EXPORT_SYMBOL_GPL(kvm_pvgpu_wt_step_done);
