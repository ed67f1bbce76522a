// SPDX-License-Identifier: GPL-2.0-or-later
/*
 * pvgpu write tracking state machine; see pvgpu_wt.h.
 *
 * Invariant kept by every function below: a gfn is protected (one protect()
 * not undone) exactly when it lies in an enabled range and no single step
 * holds it.  Holds are counted per page, so two vCPUs stepping on one page
 * share one unprotect, and the page is protected again only when the last
 * step ends.  A store by a third vCPU while the page is writable is not
 * counted as a fault, but it lands before the last step's re-protect, and so
 * before that step's signal: every store is followed by a signal.  So the
 * step signals whatever range covers the page when it ends, even one
 * registered during the step (a spurious signal only makes userspace look).
 */
#include "pvgpu_wt.h"

static struct pvwt_range *find_range_gfn(struct pvwt_vm *vm, u64 gfn)
{
	u32 i;

	for (i = 0; i < PVWT_MAX_RANGES; i++) {
		struct pvwt_range *r = &vm->ranges[i];

		if (r->id && gfn >= r->gfn && gfn - r->gfn < r->npages)
			return r;
	}
	return 0;
}

static struct pvwt_range *find_range_id(struct pvwt_vm *vm, u64 id)
{
	u32 i;

	if (!id)
		return 0;
	for (i = 0; i < PVWT_MAX_RANGES; i++)
		if (vm->ranges[i].id == id)
			return &vm->ranges[i];
	return 0;
}

static struct pvwt_hold *find_hold(struct pvwt_vm *vm, u64 gfn)
{
	u32 i;

	for (i = 0; i < PVWT_MAX_PAGES; i++)
		if (vm->holds[i].refs && vm->holds[i].gfn == gfn)
			return &vm->holds[i];
	return 0;
}

static bool page_held(struct pvwt_vm *vm, u64 gfn)
{
	return find_hold(vm, gfn) != 0;
}

/* Held pages outside every range: left behind by unregister during a step. */
static u32 orphan_holds(struct pvwt_vm *vm)
{
	u32 i, n = 0;

	for (i = 0; i < PVWT_MAX_PAGES; i++)
		if (vm->holds[i].refs && !find_range_gfn(vm, vm->holds[i].gfn))
			n++;
	return n;
}

/* protect (on) or unprotect (off) the range's pages no step holds */
static void set_range_protection(struct pvwt_vm *vm, struct pvwt_range *r, bool on)
{
	u64 gfn;

	for (gfn = r->gfn; gfn < r->gfn + r->npages; gfn++) {
		if (page_held(vm, gfn))
			continue;
		if (on)
			vm->ops->protect(vm->host, gfn);
		else
			vm->ops->unprotect(vm->host, gfn);
	}
}

static void free_range(struct pvwt_vm *vm, struct pvwt_range *r)
{
	vm->ops->release(vm->host, r->notify);
	vm->nr_pages -= (u32)r->npages;
	vm->nr_ranges--;
	*r = (struct pvwt_range){ 0 };
}

void pvwt_vm_init(struct pvwt_vm *vm, const struct pvwt_ops *ops, void *host,
		  enum pvwt_mode mode)
{
	*vm = (struct pvwt_vm){ 0 };
	vm->ops = ops;
	vm->host = host;
	vm->mode = mode;
	vm->next_id = 1;
}

void pvwt_vm_destroy(struct pvwt_vm *vm)
{
	u32 i;

	for (i = 0; i < PVWT_MAX_RANGES; i++)
		if (vm->ranges[i].id)
			free_range(vm, &vm->ranges[i]);
	for (i = 0; i < PVWT_MAX_PAGES; i++)
		vm->holds[i] = (struct pvwt_hold){ 0 };
}

void pvwt_vcpu_init(struct pvwt_vcpu *vcpu)
{
	*vcpu = (struct pvwt_vcpu){ 0 };
}

int pvwt_register(struct pvwt_vm *vm, u64 gpa, u64 size, bool enabled,
		  void *notify, u64 *id)
{
	struct pvwt_range *r = 0;
	u64 gfn, npages, g;
	u32 i;

	if (!size || (gpa | size) & (PVWT_PAGE_SIZE - 1) || gpa + size < gpa)
		return -EINVAL;
	gfn = gpa >> PVWT_PAGE_SHIFT;
	npages = size >> PVWT_PAGE_SHIFT;
	if (npages > PVWT_MAX_PAGES)
		return -ENOSPC;
	if (!vm->ops->range_in_memslots(vm->host, gpa, size))
		return -EFAULT;
	for (g = gfn; g < gfn + npages; g++)
		if (find_range_gfn(vm, g))
			return -EEXIST;
	if (vm->nr_ranges == PVWT_MAX_RANGES ||
	    vm->nr_pages + orphan_holds(vm) + npages > PVWT_MAX_PAGES)
		return -ENOSPC;
	for (i = 0; i < PVWT_MAX_RANGES && !r; i++)
		if (!vm->ranges[i].id)
			r = &vm->ranges[i];

	*r = (struct pvwt_range){
		.id = vm->next_id++,
		.gfn = gfn,
		.npages = npages,
		.enabled = enabled,
		.notify = notify,
	};
	vm->nr_ranges++;
	vm->nr_pages += (u32)npages;
	if (enabled)
		set_range_protection(vm, r, true);
	*id = r->id;
	return 0;
}

int pvwt_unregister(struct pvwt_vm *vm, u64 id)
{
	struct pvwt_range *r = find_range_id(vm, id);

	if (!r)
		return -ENOENT;
	/*
	 * Held pages are writable already; the step that holds them finds no
	 * range when it ends, so it neither protects them nor signals.
	 */
	if (r->enabled)
		set_range_protection(vm, r, false);
	free_range(vm, r);
	return 0;
}

int pvwt_set_enabled(struct pvwt_vm *vm, u64 id, bool enabled)
{
	struct pvwt_range *r = find_range_id(vm, id);

	if (!r)
		return -ENOENT;
	if (r->enabled == enabled)
		return 0;
	r->enabled = enabled;
	set_range_protection(vm, r, enabled);
	return 0;
}

int pvwt_get_stats(const struct pvwt_vm *vm, u64 id, struct pvwt_range_stats *out)
{
	const struct pvwt_range *r = find_range_id((struct pvwt_vm *)vm, id);

	if (!r)
		return -ENOENT;
	out->faults = r->faults;
	out->signals = r->signals;
	out->enabled = r->enabled;
	return 0;
}

static bool vcpu_holds(const struct pvwt_vcpu *vcpu, u64 gfn)
{
	u32 i;

	for (i = 0; i < vcpu->nr_held; i++)
		if (vcpu->held_gfn[i] == gfn)
			return true;
	return false;
}

/* Take a hold on gfn for vcpu, unprotecting the page on the first hold. */
static void hold_page(struct pvwt_vm *vm, struct pvwt_vcpu *vcpu, u64 gfn)
{
	struct pvwt_hold *h = find_hold(vm, gfn);
	u32 i;

	if (!h) {
		/* cannot fail: holds on tracked pages + orphans <= PVWT_MAX_PAGES */
		for (i = 0; i < PVWT_MAX_PAGES && !h; i++)
			if (!vm->holds[i].refs)
				h = &vm->holds[i];
		h->gfn = gfn;
		vm->ops->unprotect(vm->host, gfn);
	}
	h->refs++;
	vcpu->held_gfn[vcpu->nr_held++] = gfn;
}

enum pvwt_action pvwt_write_fault(struct pvwt_vm *vm, struct pvwt_vcpu *vcpu,
				  u64 gpa)
{
	u64 gfn = gpa >> PVWT_PAGE_SHIFT;
	struct pvwt_range *r = find_range_gfn(vm, gfn);

	if (!r || !r->enabled) {
		/*
		 * A page this vCPU holds can fault again if the host MMU
		 * dropped the writable entry meanwhile: let it retry.
		 */
		return vcpu->stepping && vcpu_holds(vcpu, gfn) ? PVWT_STEP
							       : PVWT_NOT_TRACKED;
	}
	/* emulated stores are counted when written: pvwt_emulated_write() */
	if (vm->mode == PVWT_MODE_EMULATE)
		return PVWT_EMULATE;
	if (vcpu_holds(vcpu, gfn))
		return PVWT_STEP;
	r->faults++;
	if (vcpu->nr_held == PVWT_STEP_MAX_PAGES) {
		/* Too wide to step: end the step, let the host emulate it all. */
		pvwt_step_done(vm, vcpu);
		return PVWT_EMULATE;
	}
	/* A second page during the step: a store crossing a page boundary. */
	hold_page(vm, vcpu, gfn);
	vcpu->stepping = true;
	return PVWT_STEP;
}

bool pvwt_step_done(struct pvwt_vm *vm, struct pvwt_vcpu *vcpu)
{
	u64 signalled[PVWT_STEP_MAX_PAGES];
	u32 i, j, nr_signalled = 0;

	if (!vcpu->stepping)
		return false;
	/* Re-protect first, so the store is complete before anyone is told. */
	for (i = 0; i < vcpu->nr_held; i++) {
		u64 gfn = vcpu->held_gfn[i];
		struct pvwt_hold *h = find_hold(vm, gfn);
		struct pvwt_range *r;

		if (--h->refs)
			continue;
		r = find_range_gfn(vm, gfn);
		if (r && r->enabled)
			vm->ops->protect(vm->host, gfn);
	}
	for (i = 0; i < vcpu->nr_held; i++) {
		struct pvwt_range *r = find_range_gfn(vm, vcpu->held_gfn[i]);
		bool seen = false;

		/* unregistered during the step: its notifier is gone */
		if (!r)
			continue;
		for (j = 0; j < nr_signalled; j++)
			seen |= signalled[j] == r->id;
		if (seen)
			continue;
		signalled[nr_signalled++] = r->id;
		r->signals++;
		vm->ops->signal(vm->host, r->notify);
	}
	pvwt_vcpu_init(vcpu);
	return true;
}

void pvwt_emulated_write(struct pvwt_vm *vm, u64 gpa, u64 len)
{
	u64 first, last;
	u32 i;

	if (!len || gpa + len < gpa)
		return;
	first = gpa >> PVWT_PAGE_SHIFT;
	last = (gpa + len - 1) >> PVWT_PAGE_SHIFT;
	for (i = 0; i < PVWT_MAX_RANGES; i++) {
		struct pvwt_range *r = &vm->ranges[i];

		if (!r->id || !r->enabled || last < r->gfn ||
		    first >= r->gfn + r->npages)
			continue;
		r->faults++;
		r->signals++;
		vm->ops->signal(vm->host, r->notify);
	}
}

void pvwt_forget_slot(struct pvwt_vm *vm, u64 gfn, u64 npages)
{
	u32 i;

	for (i = 0; i < PVWT_MAX_RANGES; i++) {
		struct pvwt_range *r = &vm->ranges[i];

		u64 g;

		if (!r->id || r->gfn >= gfn + npages || gfn >= r->gfn + r->npages)
			continue;
		/* pages of the range in other slots keep their protection: undo it */
		for (g = r->gfn; r->enabled && g < r->gfn + r->npages; g++)
			if ((g < gfn || g >= gfn + npages) && !page_held(vm, g))
				vm->ops->unprotect(vm->host, g);
		free_range(vm, r);
	}
}

static bool reserved_zero(const __u64 *reserved, u32 n)
{
	u32 i;

	for (i = 0; i < n; i++)
		if (reserved[i])
			return false;
	return true;
}

int pvwt_check_range_arg(const struct kvm_pvgpu_wn_range *arg)
{
	if (arg->version != KVM_PVGPU_WN_VERSION ||
	    arg->flags & ~KVM_PVGPU_WN_FLAGS_ALL || arg->pad ||
	    !reserved_zero(arg->reserved, 4))
		return -EINVAL;
	return 0;
}

int pvwt_ctl(struct pvwt_vm *vm, unsigned int cmd, struct kvm_pvgpu_wn_ctl *arg)
{
	struct pvwt_range_stats st;
	int r;

	if (arg->version != KVM_PVGPU_WN_VERSION || !reserved_zero(arg->reserved, 4))
		return -EINVAL;
	switch (cmd) {
	case KVM_PVGPU_WN_UNREGISTER:
		return arg->flags ? -EINVAL : pvwt_unregister(vm, arg->id);
	case KVM_PVGPU_WN_SET_FLAGS:
		if (arg->flags & ~KVM_PVGPU_WN_FLAGS_ALL)
			return -EINVAL;
		return pvwt_set_enabled(vm, arg->id, arg->flags & KVM_PVGPU_WN_ENABLED);
	case KVM_PVGPU_WN_GET_STATS:
		if (arg->flags)
			return -EINVAL;
		r = pvwt_get_stats(vm, arg->id, &st);
		if (r)
			return r;
		arg->faults = st.faults;
		arg->signals = st.signals;
		arg->flags = st.enabled ? KVM_PVGPU_WN_ENABLED : 0;
		return 0;
	}
	return -ENOTTY;
}
