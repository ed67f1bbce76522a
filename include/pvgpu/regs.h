/* SPDX-License-Identifier: GPL-2.0-or-later */
/*
 * Register map of the pvgpu PCI device: the one list the QEMU device
 * (qemu-patches/hw/misc/pvgpu.c), the guest driver (guest-driver/pvgpu.c)
 * and the device tests (tests/qemu/qemu_test.py reads the #defines of this
 * file) share.  What each register does is specified in docs/pvgpu-device.md
 * (section numbers below).
 *
 * Only object-like `#define NAME value` lines whose value is an integer
 * expression (numbers, names defined before, + - * | << >> and parentheses)
 * are read by the Python tests; the function-like helpers at the end are
 * for C only.
 *
 * Plain C like abi.h, for the guest kernel module, QEMU and userspace.
 */
#ifndef PVGPU_REGS_H
#define PVGPU_REGS_H

#include "abi.h"

/* PCI identity (section 2) */
#define PVGPU_PCI_VENDOR_ID 0x1234   /* PCI_VENDOR_ID_QEMU */
#define PVGPU_PCI_DEVICE_ID 0x5047   /* "PG", experimental */

#define PVGPU_DEV_MAGIC 0x55504750u  /* REG_MAGIC reads "PGPU" */
#define PVGPU_DEV_VERSION 2u         /* REG_VERSION and the PCI revision; 2: ARG2,
                                      * TASK_NAME, CMD_TASK_WEIGHT (section 3.1) */
#define PVGPU_MAX_SLOTS 64           /* channel slots a device may have */

/* BARs (section 2) */
#define PVGPU_BAR_MBOX 0             /* the mailbox registers below */
#define PVGPU_BAR_MSIX 1             /* exclusive MSI-X BAR: table at 0, PBA at 0x800 */
#define PVGPU_BAR_CHANNELS 2         /* per slot: control page, then doorbell page */
#define PVGPU_BAR_RINGS 4            /* per slot: the ring */
#define PVGPU_BAR0_SIZE 0x1000
#define PVGPU_BAR2_STRIDE (2 * PVGPU_PAGE_SIZE)   /* a slot's control + doorbell page */
#define PVGPU_BAR2_DOORBELL PVGPU_PAGE_SIZE       /* the doorbell page in a slot's stride */
#define PVGPU_BAR4_STRIDE PVGPU_PAGE_SIZE         /* a slot's ring */

/* BAR0 mailbox registers, 32-bit accesses only (section 3) */
#define PVGPU_REG_MAGIC 0x00         /* ro: PVGPU_DEV_MAGIC */
#define PVGPU_REG_VERSION 0x04       /* ro: PVGPU_DEV_VERSION */
#define PVGPU_REG_NUM_SLOTS 0x08     /* ro */
#define PVGPU_REG_LINK 0x0c          /* ro: PVGPU_LINK_* */
#define PVGPU_REG_CMD 0x10           /* wo: PVGPU_CMD_* starts a command */
#define PVGPU_REG_CMD_STATUS 0x14    /* ro: PVGPU_CMDST_* */
#define PVGPU_REG_ARG0 0x18          /* rw */
#define PVGPU_REG_ARG1 0x1c          /* rw */
#define PVGPU_REG_RESULT0 0x20       /* ro */
#define PVGPU_REG_RESULT1 0x24       /* ro */
#define PVGPU_REG_IRQ_STATUS 0x28    /* ro: PVGPU_IRQ_* pending */
#define PVGPU_REG_IRQ_ACK 0x2c       /* wo: write 1s to clear IRQ_STATUS bits */
#define PVGPU_REG_IRQ_MASK 0x30      /* rw: PVGPU_IRQ_* that interrupt */
#define PVGPU_REG_BAD_ACCESS 0x34    /* ro: rejected guest accesses so far */
#define PVGPU_REG_LINK_GEN 0x38      /* ro: successful HELLOs so far */
#define PVGPU_REG_ARG2 0x3c          /* rw (VERSION >= 2) */
#define PVGPU_REG_FENCE_DONE_LO 0x40 /* rw1c: slots 0..31 whose fence wait ended */
#define PVGPU_REG_FENCE_DONE_HI 0x44 /* rw1c: slots 32..63 */
#define PVGPU_REG_FEATURES 0x48      /* ro: PVGPU_FEATURE_* (0 on older devices) */
#define PVGPU_REG_SLOT_BASE 0x100    /* per slot, PVGPU_REG_SLOT_STRIDE each: PVGPU_SLOT_REG_* */
#define PVGPU_REG_SLOT_STRIDE 0x10
#define PVGPU_REG_WAIT_BASE 0x600    /* per slot, PVGPU_REG_WAIT_STRIDE each: PVGPU_WAIT_REG_* */
#define PVGPU_REG_WAIT_STRIDE 0x10
#define PVGPU_REG_TASK_NAME 0xa00    /* rw, PVGPU_TASK_NAME_LEN bytes: the next CHAN_ALLOC's task */
#define PVGPU_TASK_NAME_LEN 32       /* = sizeof(struct pvgpu_chan_alloc.task_name) */

/* A slot's registers, from PVGPU_REG_SLOT_BASE + slot * PVGPU_REG_SLOT_STRIDE */
#define PVGPU_SLOT_REG_STATE 0x0     /* ro: PVGPU_SLOT_* */
#define PVGPU_SLOT_REG_MODE 0x4      /* ro: PVGPU_MODE_* (protocol.h) mapped now */
#define PVGPU_SLOT_REG_CHAN_ID 0x8   /* ro: the daemon's channel id */
#define PVGPU_SLOT_REG_NOTICE 0xc    /* ro: last PVGPU_NOTICE_* (protocol.h), 0: none */

/* A slot's fence wait, from PVGPU_REG_WAIT_BASE + slot * PVGPU_REG_WAIT_STRIDE (section 4.1) */
#define PVGPU_WAIT_REG_STATUS 0x0    /* ro: PVGPU_WAITST_* */
#define PVGPU_WAIT_REG_FENCE 0x4     /* ro: the fence waited for */
#define PVGPU_WAIT_REG_ERROR 0x8     /* ro: the channel's ERROR with PVGPU_WAITST_E_DEAD */

/* REG_FEATURES bits */
#define PVGPU_FEATURE_KERNEL_WN (1u << 0) /* TRAPPED runs through KVM write notify (section 6.1) */

/* REG_LINK: the daemon connection (also struct pvgpu_ioc_info.link) */
#define PVGPU_LINK_DOWN 0u           /* no daemon connection */
#define PVGPU_LINK_HELLO 1u          /* connected, HELLO in flight */
#define PVGPU_LINK_READY 2u          /* HELLO answered OK */

/* REG_CMD (section 4) */
#define PVGPU_CMD_CHAN_ALLOC 1       /* ARG0/ARG1: pid hint lo/hi */
#define PVGPU_CMD_CHAN_FREE 2        /* ARG0: slot */
#define PVGPU_CMD_FENCE_WAIT 3       /* ARG0: slot, ARG1: fence */
#define PVGPU_CMD_TASK_WEIGHT 4      /* ARG0/ARG1: pid hint lo/hi, ARG2: weight (VERSION >= 2) */

/* REG_CMD_STATUS */
#define PVGPU_CMDST_OK 0
#define PVGPU_CMDST_BUSY 1           /* the command is in flight */
#define PVGPU_CMDST_E_INVALID 2      /* unknown command or bad argument */
#define PVGPU_CMDST_E_NOSLOT 3       /* every slot is in use */
#define PVGPU_CMDST_E_LINK 4         /* no READY daemon connection */
#define PVGPU_CMDST_E_DAEMON 5       /* the daemon refused; RESULT1: its pvgpu_status */

/* REG_IRQ_STATUS, REG_IRQ_ACK, REG_IRQ_MASK causes (section 5) */
#define PVGPU_IRQ_CMD_DONE (1u << 0) /* a mailbox command completed */
#define PVGPU_IRQ_NOTICE (1u << 1)   /* a slot's NOTICE changed */
#define PVGPU_IRQ_LINK (1u << 2)     /* LINK or a slot's state changed */
#define PVGPU_IRQ_FENCE (1u << 3)    /* a fence wait ended (FENCE_DONE) */
#define PVGPU_IRQ_ALL (PVGPU_IRQ_CMD_DONE | PVGPU_IRQ_NOTICE | PVGPU_IRQ_LINK | PVGPU_IRQ_FENCE)

/* MSI-X vectors (section 5) */
#define PVGPU_MSIX_VECTORS 3
#define PVGPU_VEC_CMD_DONE 0         /* PVGPU_IRQ_CMD_DONE */
#define PVGPU_VEC_NOTICE 1           /* PVGPU_IRQ_NOTICE, PVGPU_IRQ_LINK */
#define PVGPU_VEC_FENCE 2            /* PVGPU_IRQ_FENCE */

/* SLOT_REG_STATE */
#define PVGPU_SLOT_FREE 0
#define PVGPU_SLOT_PENDING 1         /* CHAN_ALLOC sent */
#define PVGPU_SLOT_LIVE 2
#define PVGPU_SLOT_LOST 3            /* the daemon connection dropped (section 8) */
/* The device's own states, not guest states */
#define PVGPU_SLOT_FREEING 4         /* CHAN_FREE sent; reads as PVGPU_SLOT_LIVE */
#define PVGPU_SLOT_RESTORING 5       /* migration destination: CHAN_RESTORE sent, before the guest runs */

/* WAIT_REG_STATUS (section 4.1) */
#define PVGPU_WAITST_NONE 0          /* never armed, or cancelled by CHAN_FREE */
#define PVGPU_WAITST_ARMED 1         /* FENCE has not reached the target yet */
#define PVGPU_WAITST_OK 2            /* FENCE reached the target */
#define PVGPU_WAITST_E_DEAD 3        /* the channel died or was lost first */

/* C helpers: a slot's register R (PVGPU_SLOT_REG_* / PVGPU_WAIT_REG_*) */
#define PVGPU_REG_SLOT(slot, r) (PVGPU_REG_SLOT_BASE + PVGPU_REG_SLOT_STRIDE * (slot) + (r))
#define PVGPU_REG_WAIT(slot, r) (PVGPU_REG_WAIT_BASE + PVGPU_REG_WAIT_STRIDE * (slot) + (r))

#endif /* PVGPU_REGS_H */
