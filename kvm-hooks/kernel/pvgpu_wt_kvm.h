/* SPDX-License-Identifier: GPL-2.0-or-later */
/* pvgpu write notify: the KVM side of kvm-hooks (see pvgpu_wt_kvm.c). */
#ifndef ARCH_X86_KVM_PVGPU_WT_KVM_H
#define ARCH_X86_KVM_PVGPU_WT_KVM_H

#include <linux/kvm_types.h>
#include <linux/types.h>

struct kvm;
struct kvm_vcpu;

long kvm_pvgpu_wt_ioctl(struct kvm *kvm, unsigned int ioctl, void __user *argp);
void kvm_pvgpu_wt_destroy(struct kvm *kvm);

/*
 * The single-step (MTF) path, offered by kvm-intel: arm and disarm the
 * monitor trap flag of the current (loaded) vCPU.  NULL: emulation only.
 */
struct kvm_pvgpu_wt_step_ops {
	void (*arm)(struct kvm_vcpu *vcpu);
	void (*disarm)(struct kvm_vcpu *vcpu);
};
void kvm_pvgpu_wt_set_step_ops(const struct kvm_pvgpu_wt_step_ops *ops);
/*
 * A TDP write fault hit a write-tracked gfn: true if the vCPU is to retry
 * it under a single step (the page is writable now), false to emulate.
 */
bool kvm_pvgpu_wt_page_fault(struct kvm_vcpu *vcpu, gfn_t gfn);
/* An MTF exit: true if it ended a pvgpu step (the caller disarms MTF). */
bool kvm_pvgpu_wt_step_done(struct kvm_vcpu *vcpu);

#endif
