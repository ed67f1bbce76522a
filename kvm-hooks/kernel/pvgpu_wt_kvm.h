/* SPDX-License-Identifier: GPL-2.0-or-later */
/* pvgpu write notify: the KVM side of kvm-hooks (see pvgpu_wt_kvm.c). */
#ifndef ARCH_X86_KVM_PVGPU_WT_KVM_H
#define ARCH_X86_KVM_PVGPU_WT_KVM_H

struct kvm;

long kvm_pvgpu_wt_ioctl(struct kvm *kvm, unsigned int ioctl, void __user *argp);
void kvm_pvgpu_wt_destroy(struct kvm *kvm);

#endif
