/*
 * pvgpu: paravirtual GPU channel device.
 *
 * The device connects the guest to the host scheduler daemon pvgpud over a
 * chardev (a UNIX socket; protocol: include/pvgpu/protocol.h, docs/protocol.md
 * of the pvgpu project).  The guest asks for GPU channels through a mailbox in
 * BAR0; the daemon answers with a shared memory file (control page + ring)
 * and a doorbell eventfd, which the device maps into BAR2 (control pages and
 * doorbell pages) and BAR4 (rings).  The daemon decides per channel whether
 * the guest's doorbell writes reach the GPU directly, are trapped and counted
 * here first, or are held in a shadow page.
 *
 * The register interface is specified in docs/pvgpu-device.md of the pvgpu
 * project.  Summary:
 *
 *   BAR0  4 KiB   mailbox registers (32-bit accesses only)
 *   BAR2  slots * 8 KiB: per slot a control page (IB_PUT, IB_GET, FENCE,
 *                 STATUS, ERROR) and a doorbell page
 *   BAR1  4 KiB   MSI-X table (3 vectors, offset 0) and PBA (offset 0x800)
 *   BAR4  slots * 4 KiB: per slot the ring (256 entries of 16 bytes)
 *
 * Interrupts: MSI-X when the guest enabled it (vector 0: mailbox command
 * done, 1: notices and link changes, 2: fence waits), INTx otherwise.
 *
 * Copyright (c) 2025 the pvgpu authors
 * SPDX-License-Identifier: GPL-2.0-or-later
 */

#include "qemu/osdep.h"
#include "qemu/units.h"
#include "qemu/bswap.h"
#include "qemu/module.h"
#include "qemu/timer.h"
#include "qemu/log.h"
#include "qemu/error-report.h"
#include "qemu/rcu.h"
#include "qemu/memalign.h"
#include "qemu/sockets.h"
#include "qemu/main-loop.h"
#include "qemu/event_notifier.h"
#include "qemu/thread.h"
#include "qemu/host-utils.h"
#include "qapi/error.h"
#include "qapi/visitor.h"
#include "hw/pci/pci.h"
#include "hw/pci/msix.h"
#include "hw/qdev-properties.h"
#include "hw/qdev-properties-system.h"
#include "chardev/char-fe.h"
#include "migration/vmstate.h"
#include "migration/misc.h"
#include "migration/migration.h"   /* migration_in_postcopy() */
#include "sysemu/runstate.h"
#include "qemu/coroutine.h"
#include "sysemu/sysemu.h"
#include "sysemu/kvm.h"
#include "exec/memory.h"
#include "qom/object.h"

#include <sys/mman.h>
#include <sys/socket.h>
#include <poll.h>

#include "hw/misc/pvgpu/protocol.h"
#include "hw/misc/pvgpu/regs.h"
#include "kvm_pvgpu.h"   /* kvm-hooks/uapi/linux/kvm_pvgpu.h, copied beside */

/*
 * sysemu/kvm.h declares these for target-specific code only (NEED_CPU_H);
 * they are target-independent and exist in every build with KVM, which
 * build-qemu.sh always configures (--enable-kvm).  This file is built once
 * for all targets, so it declares them itself.
 */
int kvm_vm_ioctl(KVMState *s, int type, ...);
int kvm_vm_check_extension(KVMState *s, unsigned int extension);

#define TYPE_PVGPU "pvgpu"

/*
 * The newest client protocol version this device implements: 4, whose HELLO
 * may name the GPU (property "gpu").  Version 3 only adds host clients'
 * completion notifiers; a VMM has its own completion path (the guest
 * interrupt), so a version-3 session is a version-2 one to the device.
 */
#define PVGPU_DEVICE_PROTO_VERSION PVGPU_PROTO_VERSION_MIGRATE

/* Property "gpu" unset: pvgpud places the device on a GPU. */
#define PVGPU_DEVICE_GPU_AUTO UINT32_MAX
OBJECT_DECLARE_SIMPLE_TYPE(PvgpuState, PVGPU)

/* ------------------------------------------------------------------------ */
/* Device parameters (the register map is include/pvgpu/regs.h)             */

#define PVGPU_SHADOW_REFRESH_MS 1
/*
 * Armed fence waits are checked every elapsed/16 of the youngest armed wait,
 * within [200 us, 1 ms]: a wait ends at most 6.25% (and 1 ms) late, and a
 * guest that keeps a wait armed on an idle channel costs QEMU 1000 wake-ups
 * a second, not 5000.
 */
#define PVGPU_FENCE_POLL_MIN_NS (200 * 1000)
#define PVGPU_FENCE_POLL_MAX_NS (1000 * 1000)
#define PVGPU_FENCE_POLL_SHIFT  4
/*
 * Requests in flight: a mailbox command, a slot's re-allocation or restore
 * each, a QUIESCE and a RESUME, and on a migration's destination the guest's
 * task weights being re-sent (at most PVGPU_MAX_TASK_WEIGHTS).
 */
#define PVGPU_MAX_TASK_WEIGHTS  256   /* remembered for migration; pvgpud's bound is 4 x its channels */
#define PVGPU_MAX_REQUESTS      (PVGPU_MAX_SLOTS + PVGPU_MAX_TASK_WEIGHTS + 4)
/* Migration (section 9 of docs/pvgpu-device.md): the stream's version and
 * how long the quiesce (source) and the restore (destination) may take. */
#define PVGPU_MIG_VERSION       1
#define PVGPU_MIG_TIMEOUT_MS    10000
/*
 * Messages the daemon's socket has not taken yet wait in the device (it
 * never blocks the vCPU or the main loop on pvgpud).  Past this many unsent
 * bytes the daemon is taken to have stopped reading and the link is dropped.
 */
#define PVGPU_TX_LIMIT          (1024 * 1024)
#define PVGPU_TX_COMPACT        (64 * 1024)
#define PVGPU_REPORT_MSG_SIZE   (sizeof(struct pvgpu_msg_hdr) + \
                                 sizeof(struct pvgpu_trap_report))

/* Every BAR region takes every access size: the handlers count the ones a
 * register does not take (BAD_ACCESS) instead of QEMU dropping them. */
#define PVGPU_MMIO_OPS(rd, wr) {                                       \
        .read = (rd),                                                  \
        .write = (wr),                                                 \
        .endianness = DEVICE_LITTLE_ENDIAN,                            \
        .valid = { .min_access_size = 1, .max_access_size = 8 },       \
        .impl = { .min_access_size = 1, .max_access_size = 8 },        \
    }

/* Slot registers, then wait registers, then TASK_NAME: no overlap. */
QEMU_BUILD_BUG_ON(PVGPU_REG_SLOT_BASE + PVGPU_MAX_SLOTS * PVGPU_REG_SLOT_STRIDE >
                  PVGPU_REG_WAIT_BASE);
QEMU_BUILD_BUG_ON(PVGPU_REG_WAIT_BASE + PVGPU_MAX_SLOTS * PVGPU_REG_WAIT_STRIDE >
                  PVGPU_REG_TASK_NAME);
QEMU_BUILD_BUG_ON(PVGPU_TASK_NAME_LEN !=
                  sizeof_field(struct pvgpu_chan_alloc, task_name));

/* ------------------------------------------------------------------------ */

typedef struct PvgpuSlot {
    PvgpuState *dev;
    unsigned index;
    uint32_t state;                   /* SLOT_* */
    uint32_t mode;                    /* PVGPU_MODE_* now mapped */
    uint32_t chan_id;
    uint32_t notice;
    uint64_t pid_hint;
    char task_name[PVGPU_TASK_NAME_LEN];    /* as sent with CHAN_ALLOC (re-allocation) */

    /*
     * The channel's memory: PVGPU_CHAN_MEM_SIZE bytes of host address space
     * reserved at realize for the device's lifetime, with RAM-device regions
     * over it that are never destroyed while the machine runs (QEMU allows
     * creating and destroying only aliases and containers at run time: a
     * DMA mapping of BAR2/BAR4 by another device may outlive a channel).  A
     * channel's memfd is mapped over it (MAP_FIXED) at install; teardown maps
     * anonymous memory back, so late accesses land in a private page.
     */
    void *chan_mem;
    bool installed;                   /* chan_mem shows the daemon's memfd */
    MemoryRegion ctrl_direct;         /* control page of chan_mem */
    MemoryRegion ring;                /* ring of chan_mem */
    bool ring_mapped;                 /* ring is in BAR4 */
    EventNotifier bell;               /* the daemon's doorbell eventfd */
    bool has_bell;
    bool bell_armed;                  /* KVM ioeventfd registered */

    MemoryRegion *ctrl_mapped;        /* what BAR2 shows for the control page */
    MemoryRegion ctrl_trap;           /* MMIO over the real page */
    MemoryRegion ctrl_shadow;         /* RAM: the shadow page */
    struct pvgpu_ctrl_page *shadow;
    MemoryRegion doorbell;            /* MMIO, ioeventfd at offset 0 */
    uint32_t late_check;              /* refresh ticks left to catch late shadow stores */
    uint32_t forwarded_put;           /* last IB_PUT forwarded out of the shadow */
    uint32_t reported_held;           /* last shadow IB_PUT reported as held work */
    uint32_t shadow_seed;             /* IB_PUT copied into the shadow when mapped */

    uint32_t wait_status;             /* WAIT_* */
    uint32_t wait_fence;              /* the target of the last FENCE_WAIT */
    int64_t wait_since;               /* when it was armed (REALTIME, ns) */
    uint32_t wait_error;              /* channel ERROR when PVGPU_WAITST_E_DEAD */

    /*
     * In-kernel write notify (kernel-wn, docs/pvgpu-device.md 6.1): while
     * ctrl_direct is in the guest's address space its page is registered
     * with KVM, tracked (trapped) or not (direct); KVM signals wn_notify
     * after guest stores to a tracked page.
     */
    EventNotifier wn_notify;
    bool wn_notify_ok;                /* wn_notify initialised */
    uint64_t wn_id;                   /* KVM range id; 0: not registered */
    bool wn_want;                     /* trapped: register/keep it tracked */
    bool wn_fallback;                 /* registration failed: trap by MMIO */
    hwaddr wn_gpa;                    /* where the registered page is */
    uint32_t wn_reported;             /* IB_PUT last seen by the notify path */
} PvgpuSlot;

/*
 * Doorbell relay.  The daemon's doorbell eventfd is one open file shared
 * with pvgpud, so its O_NONBLOCK flag is pvgpud's to clear, and its counter
 * pvgpud's to fill: a write of 1 by QEMU then blocks until pvgpud reads.
 * Linux has no per-write non-blocking flag for an eventfd (nor a way to
 * reopen one as a file of our own), and a check before the write races with
 * pvgpud.  So no vCPU and not the main loop ever writes it: they set the
 * slot's bit in @pending and signal @wake (QEMU's own eventfd, never shared:
 * it cannot fill, being drained here), and the device's relay thread writes
 * the daemon's eventfds.  A pvgpud that blocks the relay stalls only its own
 * doorbells.  Kicks pending for a slot are rung once (an eventfd is a
 * counter the daemon reads as a sum: one wake-up to look at IB_PUT).
 * Under KVM a direct-mode doorbell is KVM's ioeventfd on the daemon's
 * eventfd, signalled in the kernel, which never blocks (eventfd_signal
 * saturates the counter); under TCG and qtest, where the ioeventfd would be
 * QEMU's own write() in the vCPU thread, the device handles the store and
 * kicks the relay instead.
 *
 * The relay runs detached and holds its own reference on this structure
 * and on each bell it writes, so the device never waits for it: an unplug
 * while pvgpud keeps the relay blocked leaves the thread behind until
 * pvgpud reads or goes.
 */
typedef struct PvgpuBell {
    int fd;                           /* our duplicate of the daemon's eventfd */
    unsigned refs;                    /* the slot's; the relay's while it writes */
} PvgpuBell;

typedef struct PvgpuRelay {
    QemuThread thread;
    QemuMutex lock;                   /* bell[], PvgpuBell.refs, quit */
    EventNotifier wake;               /* QEMU's own: kicks are pending */
    uint64_t pending;                 /* slots to ring (atomic) */
    PvgpuBell *bell[PVGPU_MAX_SLOTS];
    bool quit;
    unsigned refs;                    /* the device's and the thread's (atomic) */
} PvgpuRelay;

typedef struct PvgpuRequest {
    uint32_t seq;
    uint16_t type;                    /* PVGPU_MSG_* sent */
    int16_t slot;                     /* -1: none */
    bool mailbox;                     /* completes the mailbox command */
    uint64_t hint;                    /* TASK_WEIGHT: the task and ... */
    uint32_t weight;                  /* ... its weight, remembered once OK */
} PvgpuRequest;

/*
 * A slot as the migration stream carries it (pvgpu_pre_save fills it,
 * pvgpu_post_load checks and applies it): the registers the guest reads,
 * the fence wait, and the channel's memory as the guest sees it.
 */
typedef struct PvgpuSlotMig {
    uint8_t task_name[PVGPU_TASK_NAME_LEN];
    uint32_t state;                   /* PVGPU_SLOT_FREE, PVGPU_SLOT_LIVE or PVGPU_SLOT_LOST */
    uint32_t mode;                    /* PVGPU_MODE_* the guest had mapped */
    uint32_t chan_id;                 /* the source pvgpud's (SLOT_CHAN_ID until restored) */
    uint32_t notice;
    uint64_t pid_hint;
    uint32_t wait_status, wait_fence, wait_error;
    uint32_t guest_put;               /* IB_PUT as the guest last stored it */
    uint8_t mem[PVGPU_CHAN_MEM_SIZE]; /* control page (with guest_put) and ring */
} PvgpuSlotMig;

/* A guest task weight pvgpud accepted (TASK_WEIGHT), re-sent after a
 * migration: the destination's pvgpud starts without it. */
typedef struct PvgpuTaskWeight {
    uint64_t pid_hint;
    uint32_t weight;
    uint32_t reserved;
} PvgpuTaskWeight;

struct PvgpuState {
    PCIDevice pdev;
    CharBackend chr;
    uint32_t num_slots;

    MemoryRegion mmio;                /* BAR0 */
    MemoryRegion bar2, bar2_bg;
    MemoryRegion bar4, bar4_bg;

    /* mailbox */
    uint32_t cmd_status;
    uint32_t arg[3];
    uint32_t result[2];
    uint8_t task_name[PVGPU_TASK_NAME_LEN]; /* TASK_NAME as the guest wrote it */
    uint32_t irq_status;
    uint32_t irq_mask;
    uint32_t bad_access;
    uint64_t fence_done;              /* slots whose fence wait ended (rw1c) */
    unsigned waits_armed;             /* slots in PVGPU_WAITST_ARMED */

    /* daemon link */
    uint32_t link;
    uint32_t link_gen;
    uint32_t link_version;            /* protocol version agreed at HELLO */
    uint32_t next_seq;
    PvgpuRequest req[PVGPU_MAX_REQUESTS]; /* FIFO: the daemon answers in order */
    unsigned req_head, req_count;
    uint8_t rx[sizeof(struct pvgpu_msg_hdr) + PVGPU_PROTO_MAX_PAYLOAD];
    uint32_t rx_have;
    int rx_fds[PVGPU_PROTO_MAX_FDS];
    int rx_nfds;

    /*
     * Outgoing bytes the socket did not take (pvgpu_send): tx->data[0,
     * tx_head) is sent.  tx->data[tx_reports, len) holds TRAP_REPORTs only,
     * where a new report for a channel replaces that channel's unsent one.
     */
    GByteArray *tx;
    uint32_t tx_head;
    uint32_t tx_reports;
    guint tx_watch;                   /* G_IO_OUT watch while bytes wait */
    bool tx_failed;                   /* a write failed or the limit was hit */
    const char *tx_why;               /* set with tx_failed */
    QEMUBH *tx_bh;                    /* drops the link after a failed write */

    /* MODE pushes read in one go, applied together (see pvgpu_apply_modes) */
    struct pvgpu_mode mode_batch[PVGPU_MAX_SLOTS];
    unsigned mode_batch_len;

    PvgpuRelay *relay;                /* rings the daemon's doorbells */
    QEMUTimer *refresh;
    QEMUTimer *fence_timer;           /* runs while a fence wait is armed */

    /* Migration (docs/pvgpu-device.md section 9) */
    PvgpuTaskWeight weights[PVGPU_MAX_TASK_WEIGHTS]; /* oldest first */
    uint32_t num_weights;
    bool quiesced;                    /* QUIESCE sent: RESUME when the VM runs again here */
    VMChangeStateEntry *vmstate_entry;
    uint32_t mig_done[3];             /* stream: how a BUSY command completes on the destination */
    PvgpuSlotMig mig[PVGPU_MAX_SLOTS];/* stream: the slots */
    Coroutine *mig_co;                /* the incoming migration, waiting for pvgpud */
    QEMUBH *mig_bh;                   /* wakes it from the main loop */
    QEMUTimer *mig_timer;             /* its bound */
    unsigned mig_restoring;           /* CHAN_RESTOREs unanswered */
    unsigned mig_weights;             /* TASK_WEIGHTs re-sent, unanswered */
    uint32_t hello_refusals;          /* HELLOs pvgpud refused so far */
    char mig_error[160];              /* why the restore failed, or empty */
    uint64_t quiesce_us;              /* the last quiesce took (source; QOM) */
    uint64_t restore_us;              /* the last restore took (destination; QOM) */
    PvgpuSlot slots[PVGPU_MAX_SLOTS];

    uint32_t gpu;                     /* property: the host's GPU, or GPU_AUTO */

    /* In-kernel write notify: property, decision at realize, listener */
    OnOffAuto kernel_wn;
    bool use_kernel_wn;
    MemoryListener wn_listener;
    bool wn_listening;
    QEMUBH *wn_fallback_bh;
    bool wn_warned;
    uint64_t wn_faults_gone;          /* GET_STATS of ranges unregistered */
    uint64_t wn_signals_gone;

    /* counters, read-only QOM properties (qom-get) */
    uint64_t traps;                   /* IB_PUT stores reported as trapped */
    uint64_t kicks;                   /* doorbell rings asked of the relay */
    uint64_t wn_notifications;        /* kernel-wn eventfd wake-ups */
    uint64_t switches_to_trapped, switch_to_trapped_ns;
    uint64_t switches_to_direct, switch_to_direct_ns;
    uint64_t unshadows;               /* slots that left SHADOWED */
    uint64_t fence_polls;             /* runs of the fence-wait timer */
    uint64_t tx_queued_max;           /* most unsent bytes seen */
    uint64_t tx_coalesced;            /* TRAP_REPORTs merged while queued */
};

static void pvgpu_link_lost_full(PvgpuState *s, const char *why, bool closed);
#define pvgpu_link_lost(s, why) pvgpu_link_lost_full(s, why, false)
static void pvgpu_mig_wake(PvgpuState *s);
static void pvgpu_mig_restored(PvgpuState *s, PvgpuSlot *sl, const char *failed);
static void pvgpu_weight_remember(PvgpuState *s, uint64_t hint, uint32_t weight);

/* ------------------------------------------------------------------------ */
/* Interrupts                                                               */

/* INTx is the fallback while the guest has not enabled MSI-X: asserted
 * (level) while IRQ_STATUS & IRQ_MASK is non-zero. */
static void pvgpu_update_irq(PvgpuState *s)
{
    bool level = (s->irq_status & s->irq_mask) != 0;

    if (msix_enabled(&s->pdev)) {
        pci_set_irq(&s->pdev, 0);
    } else {
        pci_set_irq(&s->pdev, level);
    }
}

/* MSI-X: one message per cause bit that becomes newly set and is masked
 * in; a masked vector records it in the PBA (msix_notify). */
static void pvgpu_raise_irq(PvgpuState *s, uint32_t bits)
{
    uint32_t fresh = bits & ~s->irq_status & s->irq_mask;

    s->irq_status |= bits;
    if (msix_enabled(&s->pdev)) {
        if (fresh & PVGPU_IRQ_CMD_DONE) {
            msix_notify(&s->pdev, PVGPU_VEC_CMD_DONE);
        }
        if (fresh & (PVGPU_IRQ_NOTICE | PVGPU_IRQ_LINK)) {
            msix_notify(&s->pdev, PVGPU_VEC_NOTICE);
        }
        if (fresh & PVGPU_IRQ_FENCE) {
            msix_notify(&s->pdev, PVGPU_VEC_FENCE);
        }
    } else {
        pvgpu_update_irq(s);
    }
}

static void pvgpu_write_config(PCIDevice *pdev, uint32_t addr, uint32_t val,
                               int len)
{
    /* msix_write_config runs inside: (un)masking delivers pending vectors */
    pci_default_write_config(pdev, addr, val, len);
    /* MSI-X enabled or disabled: INTx follows */
    pvgpu_update_irq(PVGPU(pdev));
}

/* ------------------------------------------------------------------------ */
/* Daemon protocol: sending                                                 */

/* Forget what was queued for a connection that is gone. */
static void pvgpu_tx_reset(PvgpuState *s)
{
    if (s->tx_watch) {
        g_source_remove(s->tx_watch);
        s->tx_watch = 0;
    }
    if (s->tx) {
        g_byte_array_set_size(s->tx, 0);
    }
    s->tx_head = s->tx_reports = 0;
    s->tx_failed = false;
    s->tx_why = NULL;
}

/* The link goes down outside the sender: pvgpu_send runs inside MMIO
 * handlers and loops over slots that the link loss would rewrite. */
static void pvgpu_tx_fail(PvgpuState *s, const char *why)
{
    if (!s->tx_failed) {
        s->tx_failed = true;
        s->tx_why = why;
        qemu_bh_schedule(s->tx_bh);
    }
}

static void pvgpu_tx_fail_bh(void *opaque)
{
    PvgpuState *s = opaque;

    if (s->tx_failed) {
        pvgpu_link_lost(s, s->tx_why);
    }
}

static gboolean pvgpu_tx_ready(void *do_not_use, GIOCondition cond, void *opaque);

/* Where the trailing run's first report not yet written at all begins (a
 * report half sent is out of reach: the socket has part of it). */
static uint32_t pvgpu_tx_unsent_reports(const PvgpuState *s)
{
    uint32_t run = s->tx_reports;

    if (run < s->tx_head) {
        run += QEMU_ALIGN_UP(s->tx_head - run, PVGPU_REPORT_MSG_SIZE);
    }
    return run;
}

/* Write what waits until the socket is full; then wait for G_IO_OUT. */
static void pvgpu_tx_flush(PvgpuState *s)
{
    while (!s->tx_failed && s->tx_head < s->tx->len) {
        int n = qemu_chr_fe_write(&s->chr, s->tx->data + s->tx_head,
                                  s->tx->len - s->tx_head);
        int err = errno;

        if (n > 0) {
            s->tx_head += n;
            continue;
        }
        if (n < 0 && err == EAGAIN) {
            if (!s->tx_watch) {
                s->tx_watch = qemu_chr_fe_add_watch(&s->chr,
                                                    G_IO_OUT | G_IO_HUP,
                                                    pvgpu_tx_ready, s);
            }
            if (!s->tx_watch) {
                pvgpu_tx_fail(s, "cannot watch the pvgpud socket");
            }
            break;
        }
        /* The write may have dropped the link itself (the chardev reports
         * CLOSED from inside it), which emptied the queue. */
        if (s->link != PVGPU_LINK_DOWN) {
            pvgpu_tx_fail(s, "write to pvgpud failed");
        }
        return;
    }
    if (s->tx_head == s->tx->len) {
        g_byte_array_set_size(s->tx, 0);
        s->tx_head = s->tx_reports = 0;
    } else if (s->tx_head >= PVGPU_TX_COMPACT && s->tx_head * 2 >= s->tx->len) {
        uint32_t run = pvgpu_tx_unsent_reports(s);

        g_byte_array_remove_range(s->tx, 0, s->tx_head);
        s->tx_reports = run - s->tx_head;
        s->tx_head = 0;
    }
}

static gboolean pvgpu_tx_ready(void *do_not_use, GIOCondition cond,
                               void *opaque)
{
    PvgpuState *s = opaque;

    s->tx_watch = 0;
    pvgpu_tx_flush(s);
    return G_SOURCE_REMOVE;
}

/* A queued, unsent TRAP_REPORT for @t's channel takes @t's IB_PUT: the
 * daemon only needs the latest value.  Only within the trailing run of
 * reports, so nothing moves past another kind of message. */
static bool pvgpu_tx_coalesce(PvgpuState *s, const struct pvgpu_trap_report *t)
{
    uint32_t off;

    for (off = pvgpu_tx_unsent_reports(s); off + PVGPU_REPORT_MSG_SIZE <= s->tx->len;
         off += PVGPU_REPORT_MSG_SIZE) {
        uint8_t *q = s->tx->data + off + sizeof(struct pvgpu_msg_hdr);
        struct pvgpu_trap_report queued;

        memcpy(&queued, q, sizeof(queued));
        if (queued.chan_id == t->chan_id) {
            queued.put = t->put;
            memcpy(q, &queued, sizeof(queued));
            s->tx_coalesced++;
            return true;
        }
    }
    return false;
}

/*
 * Queue one message and write what the socket takes now.  Never blocks:
 * false when the link is failing (the link loss follows from a BH).
 */
static bool pvgpu_send(PvgpuState *s, uint16_t type, uint32_t seq,
                       const void *body, uint32_t len)
{
    struct pvgpu_msg_hdr h = {
        .magic = PVGPU_PROTO_MAGIC, .type = type, .flags = 0,
        .len = len, .seq = seq,
    };
    uint32_t total = sizeof(h) + len;
    bool report = type == PVGPU_MSG_TRAP_REPORT;

    assert(len <= PVGPU_PROTO_MAX_PAYLOAD);
    if (s->tx_failed) {
        return false;
    }
    if (report && s->tx_head < s->tx->len && pvgpu_tx_coalesce(s, body)) {
        return true;
    }
    if (s->tx->len - s->tx_head + total > PVGPU_TX_LIMIT) {
        pvgpu_tx_fail(s, "pvgpud does not read (1 MiB queued)");
        return false;
    }
    if (!report) {
        s->tx_reports = s->tx->len + total;
    }
    g_byte_array_append(s->tx, (const guint8 *)&h, sizeof(h));
    if (len) {
        g_byte_array_append(s->tx, body, len);
    }
    s->tx_queued_max = MAX(s->tx_queued_max, s->tx->len - s->tx_head);
    if (!s->tx_watch) {
        pvgpu_tx_flush(s);
    }
    return !s->tx_failed && s->link != PVGPU_LINK_DOWN;
}

/*
 * A request the daemon answers; recorded so the reply finds its context.
 * Recorded only once sent: a failed write may drop the connection from
 * inside the write (the socket chardev reports CLOSED there when no read is
 * possible, e.g. while a daemon message is being processed), and the link
 * loss has then already emptied the request queue.  No reply can be read
 * while we write, so recording after the send loses nothing.
 */
static bool pvgpu_request(PvgpuState *s, uint16_t type, const void *body,
                          uint32_t len, int slot, bool mailbox)
{
    uint32_t seq;

    if (s->link == PVGPU_LINK_DOWN || s->req_count == PVGPU_MAX_REQUESTS) {
        return false;
    }
    seq = s->next_seq + 1;
    if (seq == 0) {
        seq = 1;
    }
    if (!pvgpu_send(s, type, seq, body, len) || s->link == PVGPU_LINK_DOWN) {
        return false;
    }
    s->next_seq = seq;
    assert(s->req_count < PVGPU_MAX_REQUESTS);
    s->req[(s->req_head + s->req_count) % PVGPU_MAX_REQUESTS] = (PvgpuRequest) {
        .seq = seq, .type = type, .slot = slot, .mailbox = mailbox,
    };
    s->req_count++;
    return true;
}

/* The request recorded last (just sent). */
static PvgpuRequest *pvgpu_last_request(PvgpuState *s)
{
    assert(s->req_count);
    return &s->req[(s->req_head + s->req_count - 1) % PVGPU_MAX_REQUESTS];
}

/*
 * A request carrying one fd (QUIESCE, CHAN_RESTORE).  The fd must go with
 * the message's first byte, so only when nothing else waits to be written;
 * and it is the caller's to close once this returns: true only when the
 * whole message, and so the fd, went out.
 */
static bool pvgpu_request_fd(PvgpuState *s, uint16_t type, const void *body,
                             uint32_t len, int slot, int fd)
{
    if (s->link == PVGPU_LINK_DOWN || s->tx_head != s->tx->len || s->tx_watch) {
        return false;
    }
    if (qemu_chr_fe_set_msgfds(&s->chr, &fd, 1) < 0) {
        return false;
    }
    if (!pvgpu_request(s, type, body, len, slot, false) ||
        s->tx_head != s->tx->len) {
        /* Not (wholly) written: the fd must not ride on a later write. */
        qemu_chr_fe_set_msgfds(&s->chr, NULL, 0);
        pvgpu_link_lost(s, "cannot write a message with its fd to pvgpud");
        return false;
    }
    return true;
}

/* ------------------------------------------------------------------------ */
/* Doorbell relay (see PvgpuRelay)                                          */

static void pvgpu_bell_unref(PvgpuRelay *r, PvgpuBell *b)
{
    qemu_mutex_lock(&r->lock);
    if (--b->refs == 0) {
        close(b->fd);
        g_free(b);
    }
    qemu_mutex_unlock(&r->lock);
}

static void pvgpu_relay_unref(PvgpuRelay *r)
{
    unsigned i;

    if (qatomic_fetch_dec(&r->refs) != 1) {
        return;
    }
    for (i = 0; i < PVGPU_MAX_SLOTS; i++) {
        if (r->bell[i]) {
            close(r->bell[i]->fd);
            g_free(r->bell[i]);
        }
    }
    event_notifier_cleanup(&r->wake);
    qemu_mutex_destroy(&r->lock);
    g_free(r);
}

/* Ring the daemon's doorbell of slot @i, if the slot has one now. */
static void pvgpu_relay_ring(PvgpuRelay *r, unsigned i)
{
    static const uint64_t one = 1;
    PvgpuBell *b;
    ssize_t n;

    qemu_mutex_lock(&r->lock);
    b = r->bell[i];
    if (b) {
        b->refs++;
    }
    qemu_mutex_unlock(&r->lock);
    if (!b) {
        return;                       /* the channel went meanwhile */
    }
    /* May block, if pvgpud cleared O_NONBLOCK and filled the counter.
     * EAGAIN: the counter is full, so pvgpud has a wake-up pending. */
    do {
        n = write(b->fd, &one, sizeof(one));
    } while (n < 0 && errno == EINTR);
    pvgpu_bell_unref(r, b);
}

static void *pvgpu_relay_thread(void *opaque)
{
    PvgpuRelay *r = opaque;
    struct pollfd pfd = {
        .fd = event_notifier_get_fd(&r->wake),
        .events = POLLIN,
    };
    bool quit = false;

    while (!quit) {
        uint64_t pending;

        if (poll(&pfd, 1, -1) < 0 && errno != EINTR) {
            error_report("pvgpu: doorbell relay: poll: %s; doorbells from "
                         "QEMU stop", strerror(errno));
            break;
        }
        event_notifier_test_and_clear(&r->wake);
        qemu_mutex_lock(&r->lock);
        quit = r->quit;
        qemu_mutex_unlock(&r->lock);
        pending = qatomic_xchg(&r->pending, 0);
        while (pending && !quit) {
            pvgpu_relay_ring(r, ctz64(pending));
            pending &= pending - 1;
        }
    }
    pvgpu_relay_unref(r);
    return NULL;
}

static PvgpuRelay *pvgpu_relay_new(PvgpuState *s, Error **errp)
{
    PvgpuRelay *r = g_new0(PvgpuRelay, 1);
    char name[32];
    int ret;

    ret = event_notifier_init(&r->wake, 0);
    if (ret < 0) {
        error_setg_errno(errp, -ret, "pvgpu: cannot create an eventfd");
        g_free(r);
        return NULL;
    }
    qemu_mutex_init(&r->lock);
    r->refs = 2;                      /* the device's and the thread's */
    snprintf(name, sizeof(name), "pvgpu-bell%s%s",
             DEVICE(s)->id ? "-" : "", DEVICE(s)->id ? DEVICE(s)->id : "");
    qemu_thread_create(&r->thread, name, pvgpu_relay_thread, r,
                       QEMU_THREAD_DETACHED);
    return r;
}

/* The device lets go of its relay; the thread ends once it is not blocked. */
static void pvgpu_relay_stop(PvgpuRelay *r)
{
    qemu_mutex_lock(&r->lock);
    r->quit = true;
    qemu_mutex_unlock(&r->lock);
    event_notifier_set(&r->wake);
    pvgpu_relay_unref(r);
}

/* Slot @i's doorbell is now @fd (a duplicate the relay owns), or none. */
static void pvgpu_relay_set_bell(PvgpuRelay *r, unsigned i, int fd)
{
    PvgpuBell *old, *b = NULL;

    if (fd >= 0) {
        b = g_new0(PvgpuBell, 1);
        b->fd = fd;
        b->refs = 1;
    }
    qemu_mutex_lock(&r->lock);
    old = r->bell[i];
    r->bell[i] = b;
    qemu_mutex_unlock(&r->lock);
    if (old) {
        pvgpu_bell_unref(r, old);
    }
}

/* Ring the daemon's doorbell of @sl's channel, from any context: never
 * blocks (the relay thread writes it). */
static void pvgpu_kick(PvgpuSlot *sl)
{
    PvgpuRelay *r = sl->dev->relay;

    if (sl->has_bell && r) {
        sl->dev->kicks++;
        qatomic_or(&r->pending, 1ull << sl->index);
        event_notifier_set(&r->wake);
    }
}

/* ------------------------------------------------------------------------ */
/* Slot mappings and mode switches                                          */

static struct pvgpu_ctrl_page *slot_real(PvgpuSlot *sl)
{
    return sl->installed ? (struct pvgpu_ctrl_page *)sl->chan_mem : NULL;
}

/* Replace what backs the slot's channel regions: the daemon's memfd, or
 * (@fd < 0) fresh anonymous memory.  The address never changes. */
static bool slot_back(PvgpuSlot *sl, int fd)
{
    void *p;

    if (fd >= 0) {
        p = mmap(sl->chan_mem, PVGPU_CHAN_MEM_SIZE, PROT_READ | PROT_WRITE,
                 MAP_SHARED | MAP_FIXED, fd, 0);
    } else {
        p = mmap(sl->chan_mem, PVGPU_CHAN_MEM_SIZE, PROT_READ | PROT_WRITE,
                 MAP_PRIVATE | MAP_ANONYMOUS | MAP_FIXED, -1, 0);
    }
    return p == sl->chan_mem;
}

/* Show @mr as the slot's control page.  Call inside a transaction. */
static void slot_show_ctrl(PvgpuSlot *sl, MemoryRegion *mr)
{
    PvgpuState *s = sl->dev;

    if (sl->ctrl_mapped == mr) {
        return;
    }
    if (sl->ctrl_mapped) {
        memory_region_del_subregion(&s->bar2, sl->ctrl_mapped);
    }
    sl->ctrl_mapped = mr;
    if (mr) {
        memory_region_add_subregion_overlap(&s->bar2,
                                            sl->index * PVGPU_BAR2_STRIDE, mr, 1);
    }
}

/* Doorbell page: under KVM the ioeventfd makes a guest store to offset 0
 * signal the daemon's eventfd in the kernel, without a userspace exit.
 * Without KVM's ioeventfds (TCG, qtest) QEMU would write the eventfd itself
 * in the vCPU thread, which can block (see PvgpuRelay): the store reaches
 * pvgpu_doorbell_write instead, which kicks the relay.  Call inside a
 * transaction. */
static void slot_arm_bell(PvgpuSlot *sl, bool arm)
{
    arm = arm && sl->has_bell && kvm_eventfds_enabled();
    if (arm == sl->bell_armed) {
        return;
    }
    if (arm) {
        memory_region_add_eventfd(&sl->doorbell, 0, 4, false, 0, &sl->bell);
    } else {
        memory_region_del_eventfd(&sl->doorbell, 0, 4, false, 0, &sl->bell);
    }
    sl->bell_armed = arm;
}

/* The real page's IB_PUT is @put: tell the daemon (a trapped store) and
 * ring its doorbell. */
static void slot_report_put(PvgpuSlot *sl, uint32_t put, bool report)
{
    PvgpuState *s = sl->dev;

    if (report && s->link == PVGPU_LINK_READY) {
        struct pvgpu_trap_report t = { .chan_id = sl->chan_id, .put = put };
        pvgpu_send(s, PVGPU_MSG_TRAP_REPORT, 0, &t, sizeof(t));
    }
    pvgpu_kick(sl);
}

/* Forward an IB_PUT value the guest wrote but the GPU has not seen. */
static void slot_forward_put(PvgpuSlot *sl, uint32_t put, bool report)
{
    struct pvgpu_ctrl_page *real = slot_real(sl);

    if (!real || sl->state != PVGPU_SLOT_LIVE) {
        return;
    }
    smp_wmb();                 /* ring entries before IB_PUT */
    real->ib_put = put;
    slot_report_put(sl, put, report);
}

/* ------------------------------------------------------------------------ */
/* In-kernel write notify (kernel-wn; kvm-hooks/, docs/kvm-hooks.md)        */

/*
 * With KVM_CAP_PVGPU_WRITE_NOTIFY the control page stays the RAM mapping
 * (ctrl_direct) in TRAPPED mode too: its page is registered with KVM, which
 * write-protects it while tracked, lets each guest store complete in the
 * kernel and signals wn_notify.  DIRECT <-> TRAPPED is then
 * KVM_PVGPU_WN_SET_FLAGS, with no flat-view or memslot change.  The
 * registration follows ctrl_direct through the address space (a memory
 * listener): it exists exactly while KVM has a memslot for the page.
 */

/* The write-notify interface version KVM offers, 0 without it. */
static int pvgpu_wn_version(void)
{
    if (kvm_enabled()) {
        int v = kvm_vm_check_extension(kvm_state, KVM_CAP_PVGPU_WRITE_NOTIFY);
        return v > 0 ? v : 0;
    }
    return 0;
}

static int slot_wn_ioctl(PvgpuSlot *sl, unsigned long req,
                         struct kvm_pvgpu_wn_ctl *c)
{
    memset(c, 0, sizeof(*c));
    c->version = KVM_PVGPU_WN_VERSION;
    c->id = sl->wn_id;
    return kvm_vm_ioctl(kvm_state, req, c);
}

static int slot_wn_register(PvgpuSlot *sl, hwaddr gpa)
{
    struct kvm_pvgpu_wn_range r = {
        .version = KVM_PVGPU_WN_VERSION,
        .flags = sl->wn_want ? KVM_PVGPU_WN_ENABLED : 0,
        .gpa = gpa,
        .size = PVGPU_PAGE_SIZE,
        .eventfd = event_notifier_get_fd(&sl->wn_notify),
    };
    int ret = kvm_vm_ioctl(kvm_state, KVM_PVGPU_WN_REGISTER, &r);

    if (ret < 0) {
        return ret;
    }
    sl->wn_id = r.id;
    sl->wn_gpa = gpa;
    return 0;
}

/* The page leaves the address space: its range goes, its counts stay. */
static void slot_wn_unregister(PvgpuSlot *sl)
{
    PvgpuState *s = sl->dev;
    struct kvm_pvgpu_wn_ctl c;

    if (slot_wn_ioctl(sl, KVM_PVGPU_WN_GET_STATS, &c) == 0) {
        s->wn_faults_gone += c.faults;
        s->wn_signals_gone += c.signals;
    }
    slot_wn_ioctl(sl, KVM_PVGPU_WN_UNREGISTER, &c);
    sl->wn_id = 0;
}

static int slot_wn_set_tracked(PvgpuSlot *sl, bool on)
{
    struct kvm_pvgpu_wn_ctl c;

    memset(&c, 0, sizeof(c));
    c.version = KVM_PVGPU_WN_VERSION;
    c.id = sl->wn_id;
    c.flags = on ? KVM_PVGPU_WN_ENABLED : 0;
    return kvm_vm_ioctl(kvm_state, KVM_PVGPU_WN_SET_FLAGS, &c);
}

/* The kernel path cannot serve this slot: trap it by MMIO instead. */
static void slot_wn_failed(PvgpuSlot *sl, const char *what, int err)
{
    PvgpuState *s = sl->dev;

    if (!s->wn_warned) {
        warn_report("pvgpu: slot %u: KVM write notify %s failed (%s); the "
                    "slot's trapped mode uses MMIO exits until it is "
                    "re-mapped", sl->index, what, strerror(-err));
        s->wn_warned = true;
    }
    sl->wn_fallback = true;
    if (sl->wn_want) {
        qemu_bh_schedule(s->wn_fallback_bh);
    }
}

/*
 * The notify path's doorbell: the real page's IB_PUT changed since the last
 * look, so report it as a trapped store and ring the daemon, as the MMIO
 * path does per store.  KVM's signals add up in the eventfd, so several
 * stores may be seen as one (the last value is what the GPU would fetch).
 */
static void slot_wn_check(PvgpuSlot *sl)
{
    struct pvgpu_ctrl_page *real = slot_real(sl);
    uint32_t put;

    if (!real || sl->state != PVGPU_SLOT_LIVE || sl->mode == PVGPU_MODE_SHADOWED) {
        return;
    }
    put = qatomic_read(&real->ib_put);
    if (put == sl->wn_reported) {
        return;
    }
    sl->wn_reported = put;
    sl->dev->traps++;
    slot_report_put(sl, put, true);
}

static void slot_wn_notified(EventNotifier *e)
{
    PvgpuSlot *sl = container_of(e, PvgpuSlot, wn_notify);

    if (event_notifier_test_and_clear(e)) {
        sl->dev->wn_notifications++;
        slot_wn_check(sl);
    }
}

/*
 * Track the slot's page (TRAPPED) or not (DIRECT).  False if the kernel
 * refused: the caller maps the MMIO trap instead.  Without a registration
 * (the page is not in the address space now) the wish is recorded and the
 * registration made when the page appears.
 */
static bool slot_wn_track(PvgpuSlot *sl, bool on)
{
    struct pvgpu_ctrl_page *real = slot_real(sl);
    int ret;

    sl->wn_want = on;
    if (on && real) {
        /* Read before tracking starts: a store after it differs. */
        sl->wn_reported = qatomic_read(&real->ib_put);
    }
    if (!sl->wn_id) {
        return !(on && sl->wn_fallback);
    }
    ret = slot_wn_set_tracked(sl, on);
    if (ret < 0) {
        slot_wn_unregister(sl);
        slot_wn_failed(sl, "KVM_PVGPU_WN_SET_FLAGS", ret);
        return !on;
    }
    return true;
}

static PvgpuSlot *pvgpu_slot_of_ctrl(PvgpuState *s, MemoryRegion *mr)
{
    unsigned i;

    for (i = 0; i < s->num_slots; i++) {
        if (mr == &s->slots[i].ctrl_direct) {
            return &s->slots[i];
        }
    }
    return NULL;
}

/*
 * Slots whose registration failed while they should trap: map the MMIO
 * trap (outside the listener: no topology change from inside one), then
 * report what reached the page untracked meanwhile.
 */
static void pvgpu_wn_fallback_bh(void *opaque)
{
    PvgpuState *s = opaque;
    bool moved[PVGPU_MAX_SLOTS] = { false };
    unsigned i;

    memory_region_transaction_begin();
    for (i = 0; i < s->num_slots; i++) {
        PvgpuSlot *sl = &s->slots[i];

        if (sl->state == PVGPU_SLOT_LIVE && sl->wn_fallback && sl->wn_want &&
            sl->ctrl_mapped == &sl->ctrl_direct) {
            slot_show_ctrl(sl, &sl->ctrl_trap);
            moved[i] = true;
        }
    }
    memory_region_transaction_commit();
    for (i = 0; i < s->num_slots; i++) {
        if (moved[i]) {
            slot_wn_check(&s->slots[i]);
        }
    }
}

/* After KVM's listener (priority 10) made the memslot. */
static void pvgpu_wn_region_add(MemoryListener *l, MemoryRegionSection *sec)
{
    PvgpuState *s = container_of(l, PvgpuState, wn_listener);
    PvgpuSlot *sl = pvgpu_slot_of_ctrl(s, sec->mr);
    int ret = -EINVAL;

    if (!sl || sl->wn_id) {
        return;
    }
    /* A page partly hidden by an overlapping region cannot be tracked. */
    if (sec->offset_within_region == 0 &&
        int128_eq(sec->size, int128_make64(PVGPU_PAGE_SIZE))) {
        ret = slot_wn_register(sl, sec->offset_within_address_space);
    }
    if (ret < 0) {
        slot_wn_failed(sl, "KVM_PVGPU_WN_REGISTER", ret);
        return;
    }
    sl->wn_fallback = false;
    if (sl->wn_want) {
        /* Stores between the memslot and the registration went untracked
         * into the page: look at it once. */
        event_notifier_set(&sl->wn_notify);
    }
}

/* Before KVM's listener removes the memslot. */
static void pvgpu_wn_region_del(MemoryListener *l, MemoryRegionSection *sec)
{
    PvgpuState *s = container_of(l, PvgpuState, wn_listener);
    PvgpuSlot *sl = pvgpu_slot_of_ctrl(s, sec->mr);

    if (sl && sl->wn_id && sl->wn_gpa == sec->offset_within_address_space) {
        slot_wn_unregister(sl);
    }
}

/*
 * While shadowed, what the guest stores lands in our private page: tell the
 * daemon the IB_PUT it holds, or the scheduler would see a backlogged channel
 * as idle and let it go (the daemon holds it: nothing reaches the GPU).
 * Called on the guest's doorbell and from the refresh tick, so a guest that
 * never rings is seen within PVGPU_SHADOW_REFRESH_MS.
 */
static void slot_report_held(PvgpuSlot *sl)
{
    PvgpuState *s = sl->dev;
    struct pvgpu_trap_report t = {
        .chan_id = sl->chan_id,
        .put = qatomic_read(&sl->shadow->ib_put),
    };

    if (t.put == sl->reported_held || s->link != PVGPU_LINK_READY) {
        return;
    }
    sl->reported_held = t.put;
    pvgpu_send(s, PVGPU_MSG_TRAP_REPORT, 0, &t, sizeof(t));
}

static void pvgpu_refresh_arm(PvgpuState *s)
{
    unsigned i;

    for (i = 0; i < s->num_slots; i++) {
        PvgpuSlot *sl = &s->slots[i];
        if ((sl->state == PVGPU_SLOT_LIVE && sl->mode == PVGPU_MODE_SHADOWED) ||
            sl->late_check) {
            if (!timer_pending(s->refresh)) {
                timer_mod(s->refresh, qemu_clock_get_ms(QEMU_CLOCK_REALTIME) +
                          PVGPU_SHADOW_REFRESH_MS);
            }
            return;
        }
    }
}

/*
 * Switch a live slot to @mode; returns the IB_PUT to acknowledge.
 * Unshadowing goes through TRAPPED (thesis 4.3.2): the trap is mapped first,
 * so every later guest store traps, then the shadow's IB_PUT is copied into
 * the real page and the doorbell rung.
 */
/* Point BAR2 at the page for `mode`; the caller holds a memory transaction. */
static void slot_map_mode(PvgpuSlot *sl, uint32_t mode)
{
    struct pvgpu_ctrl_page *real = slot_real(sl);
    bool kernel_wn = sl->dev->use_kernel_wn;

    switch (mode) {
    case PVGPU_MODE_DIRECT:
        if (kernel_wn) {
            slot_wn_track(sl, false);
        }
        slot_show_ctrl(sl, &sl->ctrl_direct);
        slot_arm_bell(sl, true);
        break;
    case PVGPU_MODE_TRAPPED:
        if (kernel_wn && slot_wn_track(sl, true)) {
            slot_show_ctrl(sl, &sl->ctrl_direct);
        } else {
            slot_show_ctrl(sl, &sl->ctrl_trap);
        }
        slot_arm_bell(sl, true);
        break;
    case PVGPU_MODE_SHADOWED:
        sl->wn_want = false;
        if (sl->mode != PVGPU_MODE_SHADOWED) {
            memset(sl->shadow, 0, PVGPU_PAGE_SIZE);
            sl->shadow->ib_put = real->ib_put;
            sl->shadow->ib_get = real->ib_get;
            sl->shadow->fence = real->fence;
            sl->shadow->status = real->status;
            sl->shadow->error = real->error;
            sl->reported_held = real->ib_put;
            sl->shadow_seed = real->ib_put;
            smp_wmb();
        }
        slot_show_ctrl(sl, &sl->ctrl_shadow);
        slot_arm_bell(sl, false);
        break;
    }
}

/*
 * After the shadow is mapped (committed), and on every refresh tick while
 * shadowed.  The shadow was seeded before the commit so it never shows stale
 * values, but until the commit a DIRECT vCPU could still store IB_PUT into
 * the real page (under TCG, until its TLB flush runs): that store is newer
 * than the seed and the GPU may have seen it, so it must not be lost and
 * later rewound by the unshadow.  Nothing else writes the real IB_PUT while
 * shadowed.  Take it over unless the guest has stored into the shadow since
 * (its newer value wins: compare-and-swap against the seed).
 */
static void slot_settle_shadow(PvgpuSlot *sl)
{
    uint32_t now = qatomic_read(&slot_real(sl)->ib_put);

    if (now != sl->shadow_seed) {
        if (qatomic_cmpxchg(&sl->shadow->ib_put, sl->shadow_seed, now) ==
            sl->shadow_seed) {
            sl->reported_held = now;
        }
        sl->shadow_seed = now;
    }
}

/* After the trap is mapped (committed): release what the shadow held. */
static void slot_release_shadow(PvgpuSlot *sl)
{
    struct pvgpu_ctrl_page *real = slot_real(sl);
    uint32_t put;

    smp_mb();
    put = sl->shadow->ib_put;
    sl->forwarded_put = put;
    sl->late_check = 3;
    if (put != real->ib_put) {
        slot_forward_put(sl, put, false);
    } else {
        pvgpu_kick(sl);
    }
}

/*
 * Switch `n` slots to new modes with as few flat-view updates as possible:
 * one transaction maps every new page (leaving SHADOWED maps the trap first,
 * thesis 4.3.2), then the shadows' held IB_PUTs are released -- guest stores
 * trap by now, so none is lost or doubled -- then a second transaction maps
 * the real page for those going on to DIRECT.  guest_put[i] receives the
 * IB_PUT to acknowledge.
 */
static void slot_set_modes(PvgpuSlot **sl, const uint32_t *mode, uint32_t *guest_put,
                           unsigned n)
{
    PvgpuState *s = sl[0]->dev;
    bool from_shadow[PVGPU_MAX_SLOTS], to_shadow[PVGPU_MAX_SLOTS];
    bool second = false, to_trapped = true, to_direct = true;
    int64_t t0 = get_clock();
    unsigned i;

    assert(n <= PVGPU_MAX_SLOTS);
    memory_region_transaction_begin();
    for (i = 0; i < n; i++) {
        from_shadow[i] = sl[i]->mode == PVGPU_MODE_SHADOWED && mode[i] != PVGPU_MODE_SHADOWED;
        to_shadow[i] = sl[i]->mode != PVGPU_MODE_SHADOWED && mode[i] == PVGPU_MODE_SHADOWED;
        to_trapped = to_trapped && sl[i]->mode == PVGPU_MODE_DIRECT &&
                     mode[i] == PVGPU_MODE_TRAPPED;
        to_direct = to_direct && sl[i]->mode == PVGPU_MODE_TRAPPED &&
                    mode[i] == PVGPU_MODE_DIRECT;
        if (from_shadow[i]) {
            /*
             * Always the MMIO trap first, also with kernel-wn: the real page
             * must not take guest stores before the shadow's IB_PUT is
             * released into it (a native store there would be rewound).
             */
            slot_show_ctrl(sl[i], &sl[i]->ctrl_trap);
            slot_arm_bell(sl[i], true);
        } else {
            slot_map_mode(sl[i], mode[i]);
        }
        second = second || (from_shadow[i] &&
                            (mode[i] == PVGPU_MODE_DIRECT || s->use_kernel_wn));
    }
    memory_region_transaction_commit();
    for (i = 0; i < n; i++) {
        if (from_shadow[i]) {
            s->unshadows++;
            slot_release_shadow(sl[i]);
        } else if (to_shadow[i]) {
            slot_settle_shadow(sl[i]);
        }
    }
    if (second) {
        memory_region_transaction_begin();
        for (i = 0; i < n; i++) {
            if (from_shadow[i] && mode[i] != PVGPU_MODE_SHADOWED) {
                slot_map_mode(sl[i], mode[i]);
            }
        }
        memory_region_transaction_commit();
    }
    for (i = 0; i < n; i++) {
        sl[i]->mode = mode[i];
    }
    if (to_trapped) {
        s->switches_to_trapped++;
        s->switch_to_trapped_ns += get_clock() - t0;
    } else if (to_direct) {
        s->switches_to_direct++;
        s->switch_to_direct_ns += get_clock() - t0;
    }
    pvgpu_refresh_arm(s);
    smp_mb();
    for (i = 0; i < n; i++) {
        guest_put[i] = mode[i] == PVGPU_MODE_SHADOWED ? sl[i]->shadow->ib_put
                                                      : slot_real(sl[i])->ib_put;
    }
}

static uint32_t slot_set_mode(PvgpuSlot *sl, uint32_t mode)
{
    uint32_t put;

    slot_set_modes(&sl, &mode, &put, 1);
    return put;
}

/* Copy the GPU-written fields of the real page into the shadow. */
static void slot_shadow_show_gpu(PvgpuSlot *sl)
{
    struct pvgpu_ctrl_page *real = slot_real(sl);

    sl->shadow->ib_get = real->ib_get;
    sl->shadow->fence = real->fence;
    sl->shadow->status = real->status;
    sl->shadow->error = real->error;
}

/*
 * While a slot is shadowed its shadow page shows the real page's GPU-written
 * fields.  After unshadowing, a vCPU that still had the shadow page in its
 * TLB (TCG; KVM flushes synchronously) may store into it once more: such
 * late stores are forwarded here.
 */
static void pvgpu_refresh_cb(void *opaque)
{
    PvgpuState *s = opaque;
    unsigned i;

    for (i = 0; i < s->num_slots; i++) {
        PvgpuSlot *sl = &s->slots[i];
        struct pvgpu_ctrl_page *real = slot_real(sl);

        if (!real || sl->state != PVGPU_SLOT_LIVE) {
            sl->late_check = 0;
            continue;
        }
        if (sl->mode == PVGPU_MODE_SHADOWED) {
            slot_settle_shadow(sl);
            slot_shadow_show_gpu(sl);
            slot_report_held(sl);
        } else if (sl->late_check) {
            uint32_t late = sl->shadow->ib_put;
            sl->late_check--;
            if (late != sl->forwarded_put &&
                (int32_t)(late - real->ib_put) > 0) {
                sl->forwarded_put = late;
                slot_forward_put(sl, late, true);
            }
        }
    }
    pvgpu_refresh_arm(s);
}

/* ------------------------------------------------------------------------ */
/* Fence waits (PVGPU_CMD_FENCE_WAIT)                                       */

/* Wrap-safe: @now is at or past @target. */
static bool fence_reached(uint32_t now, uint32_t target)
{
    return (int32_t)(now - target) >= 0;
}

static void slot_wait_end(PvgpuSlot *sl, uint32_t status, uint32_t error)
{
    PvgpuState *s = sl->dev;

    assert(sl->wait_status == PVGPU_WAITST_ARMED && s->waits_armed > 0);
    s->waits_armed--;
    sl->wait_error = error;
    smp_wmb();
    sl->wait_status = status;
    s->fence_done |= 1ull << sl->index;
    pvgpu_raise_irq(s, PVGPU_IRQ_FENCE);
}

/* End the slot's armed wait if its outcome is known now. */
static void slot_wait_check(PvgpuSlot *sl)
{
    struct pvgpu_ctrl_page *real = slot_real(sl);
    uint32_t status, fence;

    if (sl->wait_status != PVGPU_WAITST_ARMED) {
        return;
    }
    if (!real) {
        slot_wait_end(sl, PVGPU_WAITST_E_DEAD, PVGPU_CHAN_ERR_LOST);
        return;
    }
    /* STATUS first: a channel that completed its work and then died shows
     * the final FENCE once STATUS says error. */
    status = real->status;
    smp_rmb();
    fence = real->fence;
    if (fence_reached(fence, sl->wait_fence)) {
        slot_wait_end(sl, PVGPU_WAITST_OK, 0);
    } else if (sl->state == PVGPU_SLOT_LOST) {
        slot_wait_end(sl, PVGPU_WAITST_E_DEAD, PVGPU_CHAN_ERR_LOST);
    } else if (sl->state != PVGPU_SLOT_LIVE) {
        slot_wait_end(sl, PVGPU_WAITST_E_DEAD, real->error);
    } else if (status == PVGPU_CHAN_STATUS_ERROR) {
        slot_wait_end(sl, PVGPU_WAITST_E_DEAD, real->error);
    }
}

/* The guest frees the slot: its wait is forgotten, no interrupt. */
static void slot_wait_cancel(PvgpuSlot *sl)
{
    PvgpuState *s = sl->dev;

    if (sl->wait_status == PVGPU_WAITST_ARMED) {
        s->waits_armed--;
    }
    sl->wait_status = PVGPU_WAITST_NONE;
    sl->wait_fence = 0;
    sl->wait_error = 0;
    s->fence_done &= ~(1ull << sl->index);
}

/* The fence timer runs while a wait is armed and is idle otherwise; its
 * period grows with the age of the youngest armed wait. */
static void pvgpu_fence_arm(PvgpuState *s)
{
    int64_t now, youngest = INT64_MIN, period, when;
    unsigned i;

    if (!s->fence_timer) {
        return;
    }
    if (!s->waits_armed) {
        timer_del(s->fence_timer);
        return;
    }
    now = qemu_clock_get_ns(QEMU_CLOCK_REALTIME);
    for (i = 0; i < s->num_slots; i++) {
        if (s->slots[i].wait_status == PVGPU_WAITST_ARMED) {
            youngest = MAX(youngest, s->slots[i].wait_since);
        }
    }
    period = MAX(0, now - youngest) >> PVGPU_FENCE_POLL_SHIFT;
    period = MIN(MAX(period, PVGPU_FENCE_POLL_MIN_NS), PVGPU_FENCE_POLL_MAX_NS);
    when = now + period;
    /* A new wait may want the check sooner than the one pending. */
    if (!timer_pending(s->fence_timer) ||
        (int64_t)timer_expire_time_ns(s->fence_timer) > when) {
        timer_mod_ns(s->fence_timer, when);
    }
}

static void pvgpu_fence_check(PvgpuState *s)
{
    unsigned i;

    for (i = 0; i < s->num_slots && s->waits_armed; i++) {
        slot_wait_check(&s->slots[i]);
    }
    pvgpu_fence_arm(s);
}

static void pvgpu_fence_cb(void *opaque)
{
    PvgpuState *s = opaque;

    s->fence_polls++;
    pvgpu_fence_check(s);
}

/*
 * The daemon's channel memory must stay as large as it is while mapped: a
 * memfd that can shrink lets the daemon truncate it under the guest, and an
 * access beyond its end would kill QEMU with SIGBUS.  pvgpud seals its memfds
 * (F_SEAL_SHRINK); anything else is refused.
 */
static bool pvgpu_memfd_ok(int memfd)
{
    struct stat st;
    int seals = fcntl(memfd, F_GET_SEALS);

    if (seals < 0 || !(seals & F_SEAL_SHRINK)) {
        warn_report("pvgpu: pvgpud sent channel memory that is not sealed "
                    "against shrinking (F_SEAL_SHRINK); channel refused");
        return false;
    }
    if (fstat(memfd, &st) < 0 || st.st_size < PVGPU_CHAN_MEM_SIZE) {
        warn_report("pvgpu: pvgpud sent channel memory smaller than %u bytes; "
                    "channel refused", PVGPU_CHAN_MEM_SIZE);
        return false;
    }
    return true;
}

/*
 * The doorbell fd becomes a KVM ioeventfd while the channel is direct, and
 * KVM's memory listener aborts QEMU when KVM_IOEVENTFD refuses an fd that
 * is not an eventfd.  Only an eventfd is taken from the daemon.
 */
static bool pvgpu_bellfd_ok(int bellfd)
{
    char path[64], target[32];
    ssize_t n;

    snprintf(path, sizeof(path), "/proc/self/fd/%d", bellfd);
    n = readlink(path, target, sizeof(target) - 1);
    if (n < 0) {
        warn_report("pvgpu: cannot tell what pvgpud's doorbell fd is (%s); "
                    "channel refused", strerror(errno));
        return false;
    }
    target[n] = 0;
    if (strcmp(target, "anon_inode:[eventfd]") != 0) {
        warn_report("pvgpu: pvgpud sent a doorbell fd that is not an eventfd "
                    "(%s); channel refused", target);
        return false;
    }
    return true;
}

/* Install a fresh daemon channel in @sl.  Takes ownership of the fds. */
static bool slot_install(PvgpuSlot *sl, uint32_t chan_id, uint32_t mode,
                         int memfd, int bellfd)
{
    PvgpuState *s = sl->dev;
    int relay_fd = -1;

    assert(!sl->installed);
    if (!pvgpu_memfd_ok(memfd) || !pvgpu_bellfd_ok(bellfd)) {
        goto fail;
    }
    /* The relay rings the doorbell through a duplicate of its own, which
     * the slot's teardown cannot close under a write in progress. */
    relay_fd = fcntl(bellfd, F_DUPFD_CLOEXEC, 0);
    if (relay_fd < 0) {
        warn_report("pvgpu: cannot duplicate pvgpud's doorbell fd: %s; "
                    "channel refused", strerror(errno));
        goto fail;
    }
    if (!slot_back(sl, memfd)) {
        goto fail;
    }
    close(memfd);

    /* The chardev made the received fds blocking, and O_NONBLOCK belongs
     * to the open file the daemon shares: give the daemon its flag back.
     * (Nothing here relies on it staying set: see PvgpuRelay.) */
    qemu_socket_set_nonblock(bellfd);
    pvgpu_relay_set_bell(s->relay, sl->index, relay_fd);
    event_notifier_init_fd(&sl->bell, bellfd);
    sl->has_bell = true;
    sl->installed = true;
    sl->chan_id = chan_id;
    sl->notice = 0;
    sl->late_check = 0;
    sl->state = PVGPU_SLOT_LIVE;
    sl->mode = PVGPU_MODE_DIRECT;
    sl->wn_fallback = false;          /* a fresh channel tries the kernel again */

    memory_region_transaction_begin();
    memory_region_add_subregion_overlap(&s->bar4, sl->index * PVGPU_PAGE_SIZE,
                                        &sl->ring, 1);
    sl->ring_mapped = true;
    slot_set_mode(sl, PVGPU_MODE_DIRECT);
    if (mode != PVGPU_MODE_DIRECT) {
        slot_set_mode(sl, mode);
    }
    memory_region_transaction_commit();
    return true;

fail:
    if (relay_fd >= 0) {
        close(relay_fd);
    }
    close(memfd);
    close(bellfd);
    return false;
}

/*
 * Take the slot's channel out of the BARs, give the daemon's memory back and
 * close the doorbell.  The regions stay: a FlatView not yet reclaimed or a
 * DMA mapping of another device may still point at them, and reaches a
 * private zero page from now on.
 */
static void slot_teardown(PvgpuSlot *sl)
{
    PvgpuState *s = sl->dev;

    memory_region_transaction_begin();
    slot_arm_bell(sl, false);
    slot_show_ctrl(sl, NULL);
    if (sl->ring_mapped) {
        memory_region_del_subregion(&s->bar4, &sl->ring);
        sl->ring_mapped = false;
    }
    memory_region_transaction_commit();
    if (sl->installed) {
        sl->installed = false;
        if (!slot_back(sl, -1)) {
            /* Only ENOMEM: the memfd stays mapped until the device dies. */
            warn_report("pvgpu: slot %u: cannot unmap channel memory: %s",
                        sl->index, strerror(errno));
        }
    }
    if (sl->has_bell) {
        pvgpu_relay_set_bell(s->relay, sl->index, -1);
        event_notifier_cleanup(&sl->bell);
        sl->has_bell = false;
    }
    sl->late_check = 0;
}

/* The daemon is gone: the slot's channel no longer exists.  The guest keeps
 * a readable control page saying so; its stores are dropped. */
static void slot_mark_lost(PvgpuSlot *sl)
{
    struct pvgpu_ctrl_page *real = slot_real(sl);

    if (real) {
        real->error = PVGPU_CHAN_ERR_LOST;
        smp_wmb();
        real->status = PVGPU_CHAN_STATUS_ERROR;
        memory_region_transaction_begin();
        slot_arm_bell(sl, false);
        slot_show_ctrl(sl, &sl->ctrl_trap);
        memory_region_transaction_commit();
    }
    sl->state = PVGPU_SLOT_LOST;
    sl->mode = PVGPU_MODE_TRAPPED;
    sl->late_check = 0;
    slot_wait_check(sl);      /* an armed wait ends now: reached or lost */
}

static void slot_free(PvgpuSlot *sl)
{
    slot_wait_cancel(sl);
    slot_teardown(sl);
    sl->state = PVGPU_SLOT_FREE;
    sl->mode = PVGPU_MODE_DIRECT;
    sl->chan_id = 0;
    sl->pid_hint = 0;
    memset(sl->task_name, 0, sizeof(sl->task_name));
    sl->notice = 0;
}

static PvgpuSlot *slot_by_chan(PvgpuState *s, uint32_t chan_id)
{
    unsigned i;

    if (chan_id == 0) {
        return NULL;
    }
    for (i = 0; i < s->num_slots; i++) {
        PvgpuSlot *sl = &s->slots[i];
        if (sl->chan_id == chan_id &&
            (sl->state == PVGPU_SLOT_LIVE || sl->state == PVGPU_SLOT_FREEING)) {
            return sl;
        }
    }
    return NULL;
}

/* ------------------------------------------------------------------------ */
/* Control page: trapped mode                                               */

static uint64_t pvgpu_trap_read(void *opaque, hwaddr addr, unsigned size)
{
    PvgpuSlot *sl = opaque;
    struct pvgpu_ctrl_page *real = slot_real(sl);

    if (size != 4 || (addr & 3)) {
        sl->dev->bad_access++;
        return ~0ull;
    }
    if (!real || addr > PVGPU_CTRL_ERROR) {
        return 0;
    }
    return ((volatile uint32_t *)real)[addr / 4];
}

static void pvgpu_trap_write(void *opaque, hwaddr addr, uint64_t val,
                             unsigned size)
{
    PvgpuSlot *sl = opaque;
    PvgpuState *s = sl->dev;

    if (size != 4 || addr != PVGPU_CTRL_IB_PUT) {
        /* The GPU-owned fields are read-only through the trap. */
        s->bad_access++;
        return;
    }
    if (sl->state != PVGPU_SLOT_LIVE) {
        return;           /* lost channel: nothing executes any more */
    }
    s->traps++;
    slot_forward_put(sl, (uint32_t)val, true);
}

static const MemoryRegionOps pvgpu_trap_ops =
    PVGPU_MMIO_OPS(pvgpu_trap_read, pvgpu_trap_write);

/* ------------------------------------------------------------------------ */
/* Doorbell pages and unmapped BAR space                                    */

static uint64_t pvgpu_doorbell_read(void *opaque, hwaddr addr, unsigned size)
{
    return 0;
}

static void pvgpu_doorbell_write(void *opaque, hwaddr addr, uint64_t val,
                                 unsigned size)
{
    PvgpuSlot *sl = opaque;

    if (size != 4 || addr != 0) {
        sl->dev->bad_access++;
        return;
    }
    /* Reached when no KVM ioeventfd took the store: the slot is free, lost
     * or shadowed (held: the GPU must not see it, the daemon must), or
     * there is no KVM (slot_arm_bell). */
    if (sl->state != PVGPU_SLOT_LIVE) {
        return;
    }
    if (sl->mode == PVGPU_MODE_SHADOWED) {
        slot_report_held(sl);
    } else {
        pvgpu_kick(sl);
    }
}

static const MemoryRegionOps pvgpu_doorbell_ops =
    PVGPU_MMIO_OPS(pvgpu_doorbell_read, pvgpu_doorbell_write);

static uint64_t pvgpu_bg_read(void *opaque, hwaddr addr, unsigned size)
{
    return ~0ull;       /* an empty slot reads as all ones */
}

static void pvgpu_bg_write(void *opaque, hwaddr addr, uint64_t val,
                           unsigned size)
{
    PvgpuState *s = opaque;

    s->bad_access++;
}

static const MemoryRegionOps pvgpu_bg_ops =
    PVGPU_MMIO_OPS(pvgpu_bg_read, pvgpu_bg_write);

/* ------------------------------------------------------------------------ */
/* Mailbox (BAR0)                                                           */

static void pvgpu_cmd_done(PvgpuState *s, uint32_t status, uint32_t r0,
                           uint32_t r1)
{
    s->result[0] = r0;
    s->result[1] = r1;
    smp_wmb();
    s->cmd_status = status;
    pvgpu_raise_irq(s, PVGPU_IRQ_CMD_DONE);
}

/*
 * TASK_NAME as the protocol's text field: the bytes up to the first NUL,
 * at most PVGPU_TASK_NAME_LEN - 1 of them, non-printable ones as '?', NUL-padded.
 * The guest's register is never trusted to be terminated or printable.
 */
static void pvgpu_task_name(const PvgpuState *s, char *out)
{
    size_t i;

    memset(out, 0, PVGPU_TASK_NAME_LEN);
    for (i = 0; i < PVGPU_TASK_NAME_LEN - 1 && s->task_name[i]; i++) {
        uint8_t c = s->task_name[i];
        out[i] = (c >= 0x20 && c <= 0x7e) ? c : '?';
    }
}

static void pvgpu_cmd_alloc(PvgpuState *s)
{
    struct pvgpu_chan_alloc a = { 0 };
    PvgpuSlot *sl = NULL;
    unsigned i;

    if (s->link != PVGPU_LINK_READY) {
        pvgpu_cmd_done(s, PVGPU_CMDST_E_LINK, 0, 0);
        return;
    }
    for (i = 0; i < s->num_slots; i++) {
        if (s->slots[i].state == PVGPU_SLOT_FREE) {
            sl = &s->slots[i];
            break;
        }
    }
    if (!sl) {
        pvgpu_cmd_done(s, PVGPU_CMDST_E_NOSLOT, 0, 0);
        return;
    }
    a.pid_hint = ((uint64_t)s->arg[1] << 32) | s->arg[0];
    pvgpu_task_name(s, a.task_name);
    sl->pid_hint = a.pid_hint;
    memcpy(sl->task_name, a.task_name, sizeof(sl->task_name));
    sl->state = PVGPU_SLOT_PENDING;
    s->cmd_status = PVGPU_CMDST_BUSY;
    if (!pvgpu_request(s, PVGPU_MSG_CHAN_ALLOC, &a, sizeof(a), sl->index,
                       true)) {
        /* Still BUSY: the link loss completes the command with E_LINK. */
        sl->state = PVGPU_SLOT_FREE;
        pvgpu_link_lost(s, "write to the daemon failed");
    }
}

static void pvgpu_cmd_free(PvgpuState *s)
{
    uint32_t idx = s->arg[0];
    PvgpuSlot *sl;
    struct pvgpu_chan_ref ref = { 0 };

    if (idx >= s->num_slots) {
        pvgpu_cmd_done(s, PVGPU_CMDST_E_INVALID, 0, 0);
        return;
    }
    sl = &s->slots[idx];
    if (sl->state == PVGPU_SLOT_LOST) {
        /* The daemon already dropped it. */
        slot_free(sl);
        pvgpu_cmd_done(s, PVGPU_CMDST_OK, idx, 0);
        return;
    }
    if (sl->state != PVGPU_SLOT_LIVE) {
        pvgpu_cmd_done(s, PVGPU_CMDST_E_INVALID, idx, 0);
        return;
    }
    ref.chan_id = sl->chan_id;
    slot_wait_cancel(sl);
    sl->state = PVGPU_SLOT_FREEING;
    /* Nothing the guest writes now may reach the channel. */
    memory_region_transaction_begin();
    slot_arm_bell(sl, false);
    slot_show_ctrl(sl, &sl->ctrl_trap);
    memory_region_transaction_commit();
    s->cmd_status = PVGPU_CMDST_BUSY;
    if (!pvgpu_request(s, PVGPU_MSG_CHAN_FREE, &ref, sizeof(ref), idx, true)) {
        /* The link loss frees the slot and completes the command (E_LINK). */
        pvgpu_link_lost(s, "write to the daemon failed");
    }
}

/*
 * The guest's weight for one of its tasks (the daemon's entity
 * <vm>/task-<hint>).  Checked here first so that nonsense never reaches the
 * daemon; then BUSY until the daemon answers, like CHAN_ALLOC: a daemon that
 * never answers holds the mailbox until the link drops (E_LINK) or the
 * device is reset.
 */
static void pvgpu_cmd_task_weight(PvgpuState *s)
{
    struct pvgpu_task_weight tw = { 0 };

    tw.pid_hint = ((uint64_t)s->arg[1] << 32) | s->arg[0];
    tw.weight = s->arg[2];
    if (tw.pid_hint == 0 || tw.weight > PVGPU_WEIGHT_MAX) {
        pvgpu_cmd_done(s, PVGPU_CMDST_E_INVALID, 0, 0);
        return;
    }
    if (s->link != PVGPU_LINK_READY) {
        pvgpu_cmd_done(s, PVGPU_CMDST_E_LINK, 0, 0);
        return;
    }
    if (s->link_version < PVGPU_PROTO_VERSION_TASK_WEIGHT) {
        /* An older pvgpud: it would take the message for a protocol error. */
        pvgpu_cmd_done(s, PVGPU_CMDST_E_DAEMON, 0, PVGPU_E_VERSION);
        return;
    }
    s->cmd_status = PVGPU_CMDST_BUSY;
    if (!pvgpu_request(s, PVGPU_MSG_TASK_WEIGHT, &tw, sizeof(tw), -1, true)) {
        pvgpu_link_lost(s, "write to the daemon failed");
        return;
    }
    pvgpu_last_request(s)->hint = tw.pid_hint;
    pvgpu_last_request(s)->weight = tw.weight;
}

/*
 * Arm the slot's fence wait.  The command itself completes at once (RESULT0
 * = slot, RESULT1 = WAIT_STATUS); the wait ends later, from the fence
 * timer, a NOTICE or the loss of the daemon link, or at once when FENCE is
 * already there or the channel is already dead.  The vCPU never waits.
 */
static void pvgpu_cmd_fence_wait(PvgpuState *s)
{
    uint32_t idx = s->arg[0];
    PvgpuSlot *sl;

    if (idx >= s->num_slots) {
        pvgpu_cmd_done(s, PVGPU_CMDST_E_INVALID, 0, 0);
        return;
    }
    sl = &s->slots[idx];
    if ((sl->state != PVGPU_SLOT_LIVE && sl->state != PVGPU_SLOT_LOST) ||
        sl->wait_status == PVGPU_WAITST_ARMED) {
        /* no channel, or one wait per slot */
        pvgpu_cmd_done(s, PVGPU_CMDST_E_INVALID, idx, sl->wait_status);
        return;
    }
    sl->wait_fence = s->arg[1];
    sl->wait_error = 0;
    sl->wait_since = qemu_clock_get_ns(QEMU_CLOCK_REALTIME);
    sl->wait_status = PVGPU_WAITST_ARMED;
    s->waits_armed++;
    s->fence_done &= ~(1ull << idx);
    slot_wait_check(sl);
    pvgpu_fence_arm(s);
    pvgpu_cmd_done(s, PVGPU_CMDST_OK, idx, sl->wait_status);
}

/* Start the mailbox command @cmd (a guest write to CMD). */
static void pvgpu_cmd_start(PvgpuState *s, uint32_t cmd)
{
    if (s->cmd_status == PVGPU_CMDST_BUSY) {
        s->bad_access++;          /* one command at a time */
        return;
    }
    switch (cmd) {
    case PVGPU_CMD_CHAN_ALLOC:
        pvgpu_cmd_alloc(s);
        break;
    case PVGPU_CMD_CHAN_FREE:
        pvgpu_cmd_free(s);
        break;
    case PVGPU_CMD_FENCE_WAIT:
        pvgpu_cmd_fence_wait(s);
        break;
    case PVGPU_CMD_TASK_WEIGHT:
        pvgpu_cmd_task_weight(s);
        break;
    default:
        s->bad_access++;
        pvgpu_cmd_done(s, PVGPU_CMDST_E_INVALID, 0, 0);
        break;
    }
}

/* An offset of BAR0 that names no register (it is past the BAR). */
#define PVGPU_REG_NONE PVGPU_BAR0_SIZE

/*
 * The register the aligned BAR0 offset @addr names, as the MMIO handlers'
 * switches spell it: a register of a slot's array as slot 0's
 * (PVGPU_REG_SLOT(0, r), PVGPU_REG_WAIT(0, r)) with the slot in *@index, a
 * word of TASK_NAME as PVGPU_REG_TASK_NAME with its byte offset in *@index,
 * anything else as itself.  Array offsets of slots the device does not have
 * name no register.
 */
static hwaddr pvgpu_mmio_decode(const PvgpuState *s, hwaddr addr,
                                unsigned *index)
{
    hwaddr base, stride;

    *index = 0;
    if (addr >= PVGPU_REG_TASK_NAME &&
        addr < PVGPU_REG_TASK_NAME + PVGPU_TASK_NAME_LEN) {
        *index = addr - PVGPU_REG_TASK_NAME;
        return PVGPU_REG_TASK_NAME;
    }
    if (addr >= PVGPU_REG_WAIT_BASE) {
        base = PVGPU_REG_WAIT_BASE;
        stride = PVGPU_REG_WAIT_STRIDE;
    } else if (addr >= PVGPU_REG_SLOT_BASE) {
        base = PVGPU_REG_SLOT_BASE;
        stride = PVGPU_REG_SLOT_STRIDE;
    } else {
        return addr;
    }
    if ((addr - base) / stride >= s->num_slots) {
        return PVGPU_REG_NONE;
    }
    *index = (addr - base) / stride;
    return base + (addr - base) % stride;
}

static uint64_t pvgpu_mmio_read(void *opaque, hwaddr addr, unsigned size)
{
    PvgpuState *s = opaque;
    unsigned i;

    if (size != 4 || (addr & 3)) {
        s->bad_access++;
        return ~0ull;
    }
    switch (pvgpu_mmio_decode(s, addr, &i)) {
    case PVGPU_REG_MAGIC:
        return PVGPU_DEV_MAGIC;
    case PVGPU_REG_VERSION:
        return PVGPU_DEV_VERSION;
    case PVGPU_REG_NUM_SLOTS:
        return s->num_slots;
    case PVGPU_REG_LINK:
        return s->link;
    case PVGPU_REG_CMD_STATUS:
        return s->cmd_status;
    case PVGPU_REG_ARG0:
        return s->arg[0];
    case PVGPU_REG_ARG1:
        return s->arg[1];
    case PVGPU_REG_ARG2:
        return s->arg[2];
    case PVGPU_REG_RESULT0:
        return s->result[0];
    case PVGPU_REG_RESULT1:
        return s->result[1];
    case PVGPU_REG_IRQ_STATUS:
        return s->irq_status;
    case PVGPU_REG_IRQ_MASK:
        return s->irq_mask;
    case PVGPU_REG_BAD_ACCESS:
        return s->bad_access;
    case PVGPU_REG_LINK_GEN:
        return s->link_gen;
    case PVGPU_REG_FENCE_DONE_LO:
        return (uint32_t)s->fence_done;
    case PVGPU_REG_FENCE_DONE_HI:
        return (uint32_t)(s->fence_done >> 32);
    case PVGPU_REG_FEATURES:
        return s->use_kernel_wn ? PVGPU_FEATURE_KERNEL_WN : 0;
    case PVGPU_REG_SLOT(0, PVGPU_SLOT_REG_STATE):
        return s->slots[i].state == PVGPU_SLOT_FREEING ? PVGPU_SLOT_LIVE
                                                       : s->slots[i].state;
    case PVGPU_REG_SLOT(0, PVGPU_SLOT_REG_MODE):
        return s->slots[i].mode;
    case PVGPU_REG_SLOT(0, PVGPU_SLOT_REG_CHAN_ID):
        return s->slots[i].chan_id;
    case PVGPU_REG_SLOT(0, PVGPU_SLOT_REG_NOTICE):
        return s->slots[i].notice;
    case PVGPU_REG_WAIT(0, PVGPU_WAIT_REG_STATUS):
        return s->slots[i].wait_status;
    case PVGPU_REG_WAIT(0, PVGPU_WAIT_REG_FENCE):
        return s->slots[i].wait_fence;
    case PVGPU_REG_WAIT(0, PVGPU_WAIT_REG_ERROR):
        return s->slots[i].wait_error;
    case PVGPU_REG_TASK_NAME:
        return ldl_le_p(&s->task_name[i]);
    }
    return 0;
}

static void pvgpu_mmio_write(void *opaque, hwaddr addr, uint64_t val,
                             unsigned size)
{
    PvgpuState *s = opaque;
    unsigned i;

    if (size != 4 || (addr & 3)) {
        s->bad_access++;
        return;
    }
    switch (pvgpu_mmio_decode(s, addr, &i)) {
    case PVGPU_REG_CMD:
        pvgpu_cmd_start(s, val);
        break;
    case PVGPU_REG_ARG0:
        s->arg[0] = val;
        break;
    case PVGPU_REG_ARG1:
        s->arg[1] = val;
        break;
    case PVGPU_REG_ARG2:
        s->arg[2] = val;
        break;
    case PVGPU_REG_IRQ_ACK:
        s->irq_status &= ~(uint32_t)val;
        pvgpu_update_irq(s);
        break;
    case PVGPU_REG_IRQ_MASK:
        s->irq_mask = val & PVGPU_IRQ_ALL;
        pvgpu_update_irq(s);
        break;
    case PVGPU_REG_FENCE_DONE_LO:
        s->fence_done &= ~(uint64_t)(uint32_t)val;
        break;
    case PVGPU_REG_FENCE_DONE_HI:
        s->fence_done &= ~((uint64_t)(uint32_t)val << 32);
        break;
    case PVGPU_REG_TASK_NAME:
        stl_le_p(&s->task_name[i], val);
        break;
    default:
        s->bad_access++;              /* read-only or unknown */
        break;
    }
}

static const MemoryRegionOps pvgpu_mmio_ops =
    PVGPU_MMIO_OPS(pvgpu_mmio_read, pvgpu_mmio_write);

/* ------------------------------------------------------------------------ */
/* Daemon protocol: receiving                                               */

static void pvgpu_rx_reset(PvgpuState *s)
{
    int i;

    for (i = 0; i < s->rx_nfds; i++) {
        close(s->rx_fds[i]);
    }
    s->rx_nfds = 0;
    s->rx_have = 0;
}

static void pvgpu_send_hello(PvgpuState *s)
{
    struct pvgpu_hello h = { 0 };
    const char *name = qemu_name ? qemu_name : "";
    size_t i;

    h.version = PVGPU_DEVICE_PROTO_VERSION;
    h.role = PVGPU_ROLE_VMM;
    memcpy(h.uuid, qemu_uuid.data, sizeof(h.uuid));
    for (i = 0; i < PVGPU_NAME_LEN - 1 && name[i]; i++) {
        h.name[i] = (name[i] >= 0x20 && name[i] <= 0x7e) ? name[i] : '?';
    }
    h.pid = getpid();
    h.gpu = s->gpu == PVGPU_DEVICE_GPU_AUTO ? PVGPU_GPU_ANY
                                            : PVGPU_GPU_INDEX(s->gpu);
    s->link = PVGPU_LINK_HELLO;
    if (!pvgpu_request(s, PVGPU_MSG_HELLO, &h, sizeof(h), -1, false)) {
        pvgpu_link_lost(s, "cannot send HELLO");
    }
}

/* Re-allocate the channels the last connection lost (best effort). */
static void pvgpu_realloc_lost(PvgpuState *s)
{
    unsigned i;

    for (i = 0; i < s->num_slots; i++) {
        PvgpuSlot *sl = &s->slots[i];
        struct pvgpu_chan_alloc a = { 0 };

        if (sl->state != PVGPU_SLOT_LOST) {
            continue;
        }
        a.pid_hint = sl->pid_hint;
        memcpy(a.task_name, sl->task_name, sizeof(a.task_name));
        if (!pvgpu_request(s, PVGPU_MSG_CHAN_ALLOC, &a, sizeof(a), i, false)) {
            return;
        }
    }
}

/* @closed: the chardev already reported the connection closed. */
static void pvgpu_link_lost_full(PvgpuState *s, const char *why, bool closed)
{
    unsigned i;
    bool was_up = s->link != PVGPU_LINK_DOWN;

    if (s->link == PVGPU_LINK_HELLO) {
        s->hello_refusals++;          /* the HELLO did not get through */
    }
    s->quiesced = false;              /* pvgpud let go of everything */
    s->mig_weights = 0;
    s->mode_batch_len = 0;            /* their channels are gone */
    if (was_up) {
        qemu_log_mask(LOG_UNIMP, "pvgpu: daemon link lost: %s\n", why);
        warn_report("pvgpu: connection to pvgpud lost (%s); channels are gone", why);
    }
    s->link = PVGPU_LINK_DOWN;
    s->link_version = 0;
    s->req_count = 0;
    pvgpu_rx_reset(s);
    pvgpu_tx_reset(s);
    for (i = 0; i < s->num_slots; i++) {
        PvgpuSlot *sl = &s->slots[i];
        switch (sl->state) {
        case PVGPU_SLOT_PENDING:
            sl->state = PVGPU_SLOT_FREE;
            break;
        case PVGPU_SLOT_FREEING:
            slot_free(sl);
            break;
        case PVGPU_SLOT_LIVE:
            slot_mark_lost(sl);
            break;
        case PVGPU_SLOT_RESTORING:
            pvgpu_mig_restored(s, sl, "the connection to pvgpud was lost");
            break;
        }
    }
    if (s->cmd_status == PVGPU_CMDST_BUSY && !s->mig_co) {
        pvgpu_cmd_done(s, PVGPU_CMDST_E_LINK, 0, 0);
    }
    pvgpu_mig_wake(s);
    /* Drop the connection too, so a reconnecting chardev starts afresh. */
    if (was_up && !closed) {
        qemu_chr_fe_disconnect(&s->chr);
    }
    pvgpu_raise_irq(s, PVGPU_IRQ_LINK);
}

/* The reply the daemon owes for a request of @type (0: none). */
static uint16_t pvgpu_reply_type(uint16_t type)
{
    switch (type) {
    case PVGPU_MSG_HELLO:       return PVGPU_MSG_HELLO_REPLY;
    case PVGPU_MSG_CHAN_ALLOC:  return PVGPU_MSG_CHAN_REPLY;
    case PVGPU_MSG_CHAN_FREE:   return PVGPU_MSG_FREE_REPLY;
    case PVGPU_MSG_TASK_WEIGHT: return PVGPU_MSG_TASK_WEIGHT_REPLY;
    case PVGPU_MSG_QUIESCE:     return PVGPU_MSG_QUIESCE_REPLY;
    case PVGPU_MSG_RESUME:      return PVGPU_MSG_RESUME_REPLY;
    case PVGPU_MSG_CHAN_RESTORE: return PVGPU_MSG_CHAN_REPLY;
    }
    return 0;
}

static void pvgpu_on_reply(PvgpuState *s, const struct pvgpu_msg_hdr *h,
                           const uint8_t *body)
{
    PvgpuRequest r;
    PvgpuSlot *sl;

    if (!s->req_count || s->req[s->req_head].seq != h->seq) {
        pvgpu_link_lost(s, "reply out of order");
        return;
    }
    /* Checked before the request is taken: a reply of another type (a PONG
     * to a CHAN_ALLOC, say) would otherwise leave its mailbox command BUSY
     * for good.  The link loss completes it with E_LINK. */
    if (pvgpu_reply_type(s->req[s->req_head].type) != h->type) {
        pvgpu_link_lost(s, "reply of the wrong type");
        return;
    }
    r = s->req[s->req_head];
    s->req_head = (s->req_head + 1) % PVGPU_MAX_REQUESTS;
    s->req_count--;
    sl = r.slot >= 0 ? &s->slots[r.slot] : NULL;

    switch (h->type) {
    case PVGPU_MSG_HELLO_REPLY: {
        struct pvgpu_hello_reply hr;
        memcpy(&hr, body, sizeof(hr));
        if (hr.status != PVGPU_OK) {
            error_report("pvgpu: pvgpud refused HELLO (status %u)", hr.status);
            pvgpu_link_lost(s, "HELLO refused");
            return;
        }
        if (hr.version < 1 || hr.version > PVGPU_DEVICE_PROTO_VERSION) {
            error_report("pvgpu: pvgpud answered HELLO with protocol version "
                         "%u (this device speaks 1..%u)", hr.version,
                         PVGPU_DEVICE_PROTO_VERSION);
            pvgpu_link_lost(s, "HELLO_REPLY with a version never offered");
            return;
        }
        if (s->gpu != PVGPU_DEVICE_GPU_AUTO &&
            hr.version < PVGPU_PROTO_VERSION_GPU) {
            error_report("pvgpu: pvgpud speaks protocol version %u, which "
                         "cannot place a device on a GPU (gpu=%u needs "
                         "version %u)", hr.version, s->gpu,
                         PVGPU_PROTO_VERSION_GPU);
            pvgpu_link_lost(s, "HELLO named a GPU pvgpud cannot place");
            return;
        }
        s->link_version = hr.version;
        s->link = PVGPU_LINK_READY;
        s->link_gen++;
        pvgpu_realloc_lost(s);
        pvgpu_raise_irq(s, PVGPU_IRQ_LINK);
        return;
    }
    case PVGPU_MSG_CHAN_REPLY: {
        struct pvgpu_chan_reply cr;
        memcpy(&cr, body, sizeof(cr));
        assert(sl);
        if (cr.status == PVGPU_OK) {
            int memfd = s->rx_fds[0], bellfd = s->rx_fds[1];
            if (s->rx_nfds != 2 || cr.mem_size != PVGPU_CHAN_MEM_SIZE ||
                cr.mode > PVGPU_MODE_SHADOWED || cr.chan_id == 0) {
                pvgpu_link_lost(s, "malformed CHAN_REPLY");
                return;
            }
            s->rx_nfds = 0;
            if (sl->state != (r.type == PVGPU_MSG_CHAN_RESTORE ? PVGPU_SLOT_RESTORING :
                              r.mailbox ? PVGPU_SLOT_PENDING : PVGPU_SLOT_LOST)) {
                /* A re-allocation for a slot the guest freed meanwhile. */
                struct pvgpu_chan_ref ref = { .chan_id = cr.chan_id };
                close(memfd);
                close(bellfd);
                pvgpu_request(s, PVGPU_MSG_CHAN_FREE, &ref, sizeof(ref), -1,
                              false);
                return;
            }
            if (sl->state == PVGPU_SLOT_LOST) {
                slot_teardown(sl);    /* the old channel's memory */
            }
            if (!slot_install(sl, cr.chan_id, cr.mode, memfd, bellfd)) {
                struct pvgpu_chan_ref ref = { .chan_id = cr.chan_id };
                /* Give it back; the FREE_REPLY finds no slot. */
                pvgpu_request(s, PVGPU_MSG_CHAN_FREE, &ref, sizeof(ref), -1,
                              false);
                if (r.type == PVGPU_MSG_CHAN_RESTORE) {
                    pvgpu_mig_restored(s, sl, "its channel memory was refused");
                    return;
                }
                sl->state = r.mailbox ? PVGPU_SLOT_FREE : PVGPU_SLOT_LOST;
                if (r.mailbox) {
                    pvgpu_cmd_done(s, PVGPU_CMDST_E_DAEMON, 0, PVGPU_E_INTERNAL);
                }
                return;
            }
            if (r.type == PVGPU_MSG_CHAN_RESTORE) {
                pvgpu_mig_restored(s, sl, NULL);
            } else if (r.mailbox) {
                pvgpu_cmd_done(s, PVGPU_CMDST_OK, sl->index, cr.chan_id);
            } else {
                pvgpu_raise_irq(s, PVGPU_IRQ_LINK);
            }
        } else if (r.type == PVGPU_MSG_CHAN_RESTORE) {
            if (sl->state == PVGPU_SLOT_RESTORING) {
                char why[64];
                snprintf(why, sizeof(why), "pvgpud refused it (status %u)",
                         cr.status);
                pvgpu_mig_restored(s, sl, why);
            }
        } else if (r.mailbox && sl->state == PVGPU_SLOT_PENDING) {
            sl->state = PVGPU_SLOT_FREE;
            pvgpu_cmd_done(s, PVGPU_CMDST_E_DAEMON, 0, cr.status);
        }
        return;
    }
    case PVGPU_MSG_FREE_REPLY:
        if (sl) {
            uint32_t idx = sl->index;
            slot_free(sl);
            if (r.mailbox) {
                pvgpu_cmd_done(s, PVGPU_CMDST_OK, idx, 0);
            }
        }
        return;
    case PVGPU_MSG_TASK_WEIGHT_REPLY: {
        struct pvgpu_status_reply sr;
        memcpy(&sr, body, sizeof(sr));
        if (sr.chan_id != 0 || sr.status > PVGPU_E_INTERNAL) {
            pvgpu_link_lost(s, "malformed TASK_WEIGHT_REPLY");
            return;
        }
        if (r.mailbox) {
            if (sr.status == PVGPU_OK) {
                pvgpu_weight_remember(s, r.hint, r.weight);
            }
            pvgpu_cmd_done(s, sr.status == PVGPU_OK ? PVGPU_CMDST_OK : PVGPU_CMDST_E_DAEMON,
                           0, sr.status);
        } else if (s->mig_weights) {
            /* re-sent after a migration (pvgpu_post_load) */
            s->mig_weights--;
            if (sr.status != PVGPU_OK) {
                warn_report("pvgpu: pvgpud refused the guest's weight %u of task "
                            "%" PRIu64 " after the migration (status %u)",
                            r.weight, r.hint, sr.status);
            }
            pvgpu_mig_wake(s);
        }
        return;
    }
    case PVGPU_MSG_QUIESCE_REPLY:
    case PVGPU_MSG_RESUME_REPLY: {
        /* The quiesce's outcome came on its own socket (pvgpu_quiesce). */
        struct pvgpu_status_reply sr;
        memcpy(&sr, body, sizeof(sr));
        if (sr.status > PVGPU_E_INTERNAL) {
            pvgpu_link_lost(s, "malformed QUIESCE_REPLY/RESUME_REPLY");
        }
        return;
    }
    }
}

/* Apply the batched MODE pushes (one flat-view update for all), then ack. */
static void pvgpu_flush_modes(PvgpuState *s)
{
    PvgpuSlot *sl[PVGPU_MAX_SLOTS];
    uint32_t mode[PVGPU_MAX_SLOTS], put[PVGPU_MAX_SLOTS];
    struct pvgpu_mode_ack ack[PVGPU_MAX_SLOTS];
    unsigned i, n = 0, len = s->mode_batch_len;

    s->mode_batch_len = 0;
    for (i = 0; i < len; i++) {
        const struct pvgpu_mode *m = &s->mode_batch[i];
        PvgpuSlot *x = slot_by_chan(s, m->chan_id);

        if (!x || x->state != PVGPU_SLOT_LIVE) {
            continue;                 /* raced with CHAN_FREE */
        }
        sl[n] = x;
        mode[n] = m->mode;
        memset(&ack[n], 0, sizeof(ack[n]));
        ack[n].chan_id = m->chan_id;
        ack[n].mode = m->mode;
        ack[n].mode_seq = m->mode_seq;
        n++;
    }
    if (n == 0) {
        return;
    }
    slot_set_modes(sl, mode, put, n);
    for (i = 0; i < n; i++) {
        ack[i].guest_put = put[i];
        pvgpu_send(s, PVGPU_MSG_MODE_ACK, 0, &ack[i], sizeof(ack[i]));
    }
}

static void pvgpu_on_message(PvgpuState *s)
{
    if (((const struct pvgpu_msg_hdr *)s->rx)->type != PVGPU_MSG_MODE) {
        pvgpu_flush_modes(s);     /* MODEs read earlier take effect first */
    }
    struct pvgpu_msg_hdr h;
    const uint8_t *body = s->rx + sizeof(h);

    memcpy(&h, s->rx, sizeof(h));
    if (s->rx_nfds && !(h.type == PVGPU_MSG_CHAN_REPLY)) {
        pvgpu_link_lost(s, "fds on a message that carries none");
        return;
    }
    switch (h.type) {
    case PVGPU_MSG_MODE: {
        struct pvgpu_mode m;
        unsigned i;

        memcpy(&m, body, sizeof(m));
        if (m.mode > PVGPU_MODE_SHADOWED || m.reserved) {
            pvgpu_link_lost(s, "bad MODE");
            return;
        }
        /* Batched with the other MODEs of this read; a second switch of
         * the same channel must see the first one done. */
        for (i = 0; i < s->mode_batch_len; i++) {
            if (s->mode_batch[i].chan_id == m.chan_id) {
                pvgpu_flush_modes(s);
                break;
            }
        }
        if (s->mode_batch_len == PVGPU_MAX_SLOTS) {
            pvgpu_flush_modes(s);
        }
        s->mode_batch[s->mode_batch_len++] = m;
        return;
    }
    case PVGPU_MSG_NOTICE: {
        struct pvgpu_notice n;
        PvgpuSlot *sl;

        memcpy(&n, body, sizeof(n));
        sl = slot_by_chan(s, n.chan_id);
        if (sl && n.kind >= PVGPU_NOTICE_WATCHDOG &&
            n.kind <= PVGPU_NOTICE_DEGRADED) {
            sl->notice = n.kind;
            /*
             * A guest reads STATUS on the NOTICE interrupt: a shadowed slot
             * must show the death now, not at the next refresh tick.
             */
            if (sl->state == PVGPU_SLOT_LIVE && sl->mode == PVGPU_MODE_SHADOWED &&
                slot_real(sl)) {
                slot_shadow_show_gpu(sl);
            }
            pvgpu_raise_irq(s, PVGPU_IRQ_NOTICE);
            pvgpu_fence_check(s);     /* a dead channel ends its wait */
        }
        return;
    }
    case PVGPU_MSG_ERROR: {
        struct pvgpu_error e;
        memcpy(&e, body, sizeof(e));
        e.message[sizeof(e.message) - 1] = 0;
        if (s->link == PVGPU_LINK_HELLO) {
            /* Why pvgpud refuses the HELLO (a GPU it lacks, say); one
             * before version 4 takes a named GPU for a protocol error. */
            error_report("pvgpu: pvgpud refused HELLO: %s%s", e.message,
                         s->gpu != PVGPU_DEVICE_GPU_AUTO &&
                         strstr(e.message, "reserved field is not zero") ?
                         " (this pvgpud predates protocol version 4 and "
                         "cannot place a device on a GPU: drop 'gpu')" : "");
            pvgpu_link_lost(s, "HELLO refused");
            return;
        }
        error_report("pvgpu: pvgpud: %s", e.message);
        pvgpu_link_lost(s, "daemon sent ERROR");
        return;
    }
    default:
        if (h.seq == 0) {
            pvgpu_link_lost(s, "reply without seq");
            return;
        }
        pvgpu_on_reply(s, &h, body);
        /* fds not taken by the reply are closed */
        pvgpu_rx_reset(s);
        return;
    }
}

static uint32_t pvgpu_payload_size(uint16_t type)
{
    switch (type) {
    case PVGPU_MSG_HELLO_REPLY: return sizeof(struct pvgpu_hello_reply);
    case PVGPU_MSG_CHAN_REPLY:  return sizeof(struct pvgpu_chan_reply);
    case PVGPU_MSG_FREE_REPLY:  return sizeof(struct pvgpu_status_reply);
    case PVGPU_MSG_MODE:        return sizeof(struct pvgpu_mode);
    case PVGPU_MSG_NOTICE:      return sizeof(struct pvgpu_notice);
    case PVGPU_MSG_ERROR:       return sizeof(struct pvgpu_error);
    case PVGPU_MSG_PONG:        return 0;
    case PVGPU_MSG_TASK_WEIGHT_REPLY: return sizeof(struct pvgpu_status_reply);
    case PVGPU_MSG_QUIESCE_REPLY: return sizeof(struct pvgpu_status_reply);
    case PVGPU_MSG_RESUME_REPLY: return sizeof(struct pvgpu_status_reply);
    }
    return UINT32_MAX;            /* unknown or wrong direction */
}

/* Bytes still missing from the message being assembled.  Reading exactly up
 * to message boundaries makes the fds of a CHAN_REPLY (sent with its first
 * byte) arrive with that message's header. */
static uint32_t pvgpu_rx_want(PvgpuState *s)
{
    const struct pvgpu_msg_hdr *h = (const void *)s->rx;

    if (s->rx_have < sizeof(*h)) {
        return sizeof(*h) - s->rx_have;
    }
    return sizeof(*h) + h->len - s->rx_have;
}

static int pvgpu_chr_can_read(void *opaque)
{
    PvgpuState *s = opaque;

    if (s->link == PVGPU_LINK_DOWN) {
        return 0;
    }
    return pvgpu_rx_want(s);
}

static void pvgpu_chr_read(void *opaque, const uint8_t *buf, int size)
{
    PvgpuState *s = opaque;
    int fds[PVGPU_PROTO_MAX_FDS];
    int n, i;

    n = qemu_chr_fe_get_msgfds(&s->chr, fds, PVGPU_PROTO_MAX_FDS);
    if (n > 0) {
        if (s->rx_nfds) {
            for (i = 0; i < n; i++) {
                close(fds[i]);
            }
            pvgpu_link_lost(s, "fds for two messages");
            return;
        }
        memcpy(s->rx_fds, fds, n * sizeof(int));
        s->rx_nfds = n;
    }
    while (size > 0 && s->link != PVGPU_LINK_DOWN) {
        const struct pvgpu_msg_hdr *h = (const void *)s->rx;
        uint32_t take = MIN((uint32_t)size, pvgpu_rx_want(s));

        memcpy(s->rx + s->rx_have, buf, take);
        s->rx_have += take;
        buf += take;
        size -= take;
        if (s->rx_have == sizeof(*h)) {
            if (h->magic != PVGPU_PROTO_MAGIC || h->flags ||
                h->len > PVGPU_PROTO_MAX_PAYLOAD ||
                pvgpu_payload_size(h->type) != h->len) {
                pvgpu_link_lost(s, "malformed message header");
                return;
            }
        }
        if (s->rx_have >= sizeof(*h) && pvgpu_rx_want(s) == 0) {
            pvgpu_on_message(s);
            s->rx_have = 0;
            if (s->rx_nfds) {       /* left over: not for this message */
                pvgpu_rx_reset(s);
            }
        }
    }
    pvgpu_flush_modes(s);
    pvgpu_mig_wake(s);
}

static void pvgpu_chr_event(void *opaque, QEMUChrEvent event)
{
    PvgpuState *s = opaque;

    switch (event) {
    case CHR_EVENT_OPENED:
        if (s->link != PVGPU_LINK_DOWN) {
            return;
        }
        pvgpu_rx_reset(s);
        pvgpu_tx_reset(s);
        s->req_count = 0;
        pvgpu_send_hello(s);
        break;
    case CHR_EVENT_CLOSED:
        pvgpu_link_lost_full(s, "connection closed", true);
        break;
    default:
        break;
    }
}

/* ------------------------------------------------------------------------ */
/* Migration (docs/pvgpu-device.md section 9)                               */

/* A guest task weight pvgpud accepted; weight 0 forgets it.  Bounded: the
 * one set longest ago makes room (as pvgpud bounds them). */
static void pvgpu_weight_remember(PvgpuState *s, uint64_t hint, uint32_t weight)
{
    uint32_t i;

    for (i = 0; i < s->num_weights; i++) {
        if (s->weights[i].pid_hint == hint) {
            break;
        }
    }
    if (i < s->num_weights) {
        memmove(&s->weights[i], &s->weights[i + 1],
                (s->num_weights - i - 1) * sizeof(s->weights[0]));
        s->num_weights--;
    }
    if (weight == 0) {
        return;
    }
    if (s->num_weights == PVGPU_MAX_TASK_WEIGHTS) {
        memmove(&s->weights[0], &s->weights[1],
                (s->num_weights - 1) * sizeof(s->weights[0]));
        s->num_weights--;
    }
    s->weights[s->num_weights++] = (PvgpuTaskWeight) {
        .pid_hint = hint, .weight = weight,
    };
}

/*
 * Source: hold every channel at pvgpud (QUIESCE) and wait until the work on
 * the GPU has completed.  Runs in pre_save, with the VM stopped and the
 * migration thread holding the BQL, so the main loop cannot read the
 * chardev: pvgpud says it is done on a socket of our own, which we poll
 * here, bounded.  Returns 0 or -1 with the reason reported.
 */
static int pvgpu_quiesce(PvgpuState *s)
{
    struct pvgpu_quiesce q = { 0 };
    struct pvgpu_quiesce_done d = { 0 };
    int64_t deadline = qemu_clock_get_ms(QEMU_CLOCK_REALTIME) + PVGPU_MIG_TIMEOUT_MS;
    uint32_t seq;
    int sv[2];
    ssize_t n;

    if (s->link_version < PVGPU_PROTO_VERSION_MIGRATE) {
        error_report("pvgpu: pvgpud speaks protocol version %u; migrating a VM "
                     "with GPU channels needs version %u", s->link_version,
                     PVGPU_PROTO_VERSION_MIGRATE);
        return -1;
    }
    if (s->tx_head != s->tx->len) {
        error_report("pvgpu: %u bytes for pvgpud are still unsent (it does not "
                     "read); cannot quiesce the channels",
                     (unsigned)(s->tx->len - s->tx_head));
        return -1;
    }
    if (socketpair(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC, 0, sv) < 0) {
        error_report("pvgpu: cannot quiesce the channels: socketpair: %s",
                     strerror(errno));
        return -1;
    }
    if (!pvgpu_request_fd(s, PVGPU_MSG_QUIESCE, &q, sizeof(q), -1, sv[1])) {
        close(sv[0]);
        close(sv[1]);
        error_report("pvgpu: cannot send QUIESCE to pvgpud");
        return -1;
    }
    close(sv[1]);
    seq = pvgpu_last_request(s)->seq;
    s->quiesced = true;               /* RESUME from here on if we stay */
    for (;;) {
        int64_t left = deadline - qemu_clock_get_ms(QEMU_CLOCK_REALTIME);
        struct pollfd pfd = { .fd = sv[0], .events = POLLIN };
        int r;

        if (left <= 0) {
            close(sv[0]);
            error_report("pvgpu: pvgpud did not quiesce the channels within "
                         "%d ms", PVGPU_MIG_TIMEOUT_MS);
            return -1;
        }
        r = poll(&pfd, 1, left);
        if (r < 0 && errno == EINTR) {
            continue;
        }
        if (r != 0) {
            break;
        }
    }
    n = recv(sv[0], &d, sizeof(d), MSG_DONTWAIT);
    close(sv[0]);
    if (n != sizeof(d) || d.seq != seq) {
        error_report("pvgpu: pvgpud did not answer QUIESCE (connection lost?)");
        return -1;
    }
    if (d.status != PVGPU_OK) {
        error_report("pvgpu: pvgpud could not quiesce the channels (status %u%s)",
                     d.status, d.status == PVGPU_E_INTERNAL ?
                     ": the work on the GPU did not complete in time" : "");
        return -1;
    }
    return 0;
}

/*
 * The VM runs again here: after a failed or cancelled migration (or a
 * snapshot) the channels go back to work.
 */
static void pvgpu_vm_state(void *opaque, bool running, RunState state)
{
    PvgpuState *s = opaque;
    struct pvgpu_chan_ref ref = { 0 };

    if (!running || !s->quiesced) {
        return;
    }
    s->quiesced = false;
    if (s->link == PVGPU_LINK_READY &&
        !pvgpu_request(s, PVGPU_MSG_RESUME, &ref, sizeof(ref), -1, false)) {
        pvgpu_link_lost(s, "write to the daemon failed");
    }
}

static int pvgpu_pre_save(void *opaque)
{
    PvgpuState *s = opaque;
    bool live = false;
    unsigned i;

    if (migration_in_postcopy()) {
        error_report("pvgpu: post-copy migration is not supported: the GPU "
                     "channels are saved with the VM stopped, after the work "
                     "on the GPU completed; migrate without post-copy");
        return -ENOTSUP;
    }
    for (i = 0; i < s->num_slots; i++) {
        live = live || s->slots[i].state == PVGPU_SLOT_LIVE;
    }
    /* A second save of a quiesced VM (a snapshot after a failed
     * migration, the VM never resumed) finds the channels held already. */
    if (live && !s->quiesced) {
        int64_t t0 = get_clock();

        if (pvgpu_quiesce(s) < 0) {
            return -EIO;
        }
        s->quiesce_us = (get_clock() - t0) / 1000;
    }
    for (i = 0; i < s->num_slots; i++) {
        PvgpuSlot *sl = &s->slots[i];
        PvgpuSlotMig *m = &s->mig[i];
        struct pvgpu_ctrl_page *real = slot_real(sl);

        memset(m, 0, sizeof(*m));
        memcpy(m->task_name, sl->task_name, PVGPU_TASK_NAME_LEN);
        m->pid_hint = sl->pid_hint;
        m->mode = sl->mode;
        m->chan_id = sl->chan_id;
        m->notice = sl->notice;
        m->wait_status = sl->wait_status;
        m->wait_fence = sl->wait_fence;
        m->wait_error = sl->wait_error;
        switch (sl->state) {
        case PVGPU_SLOT_LIVE:
        case PVGPU_SLOT_LOST:
            m->state = sl->state;
            if (real) {
                memcpy(m->mem, sl->chan_mem, PVGPU_CHAN_MEM_SIZE);
                m->guest_put = sl->state == PVGPU_SLOT_LIVE && sl->mode == PVGPU_MODE_SHADOWED
                               ? qatomic_read(&sl->shadow->ib_put) : real->ib_put;
                ((struct pvgpu_ctrl_page *)m->mem)->ib_put = m->guest_put;
            }
            break;
        default:
            /* FREE, or a free or allocation in flight: the destination's
             * slot is free (the source's pvgpud drops what it had). */
            m->state = PVGPU_SLOT_FREE;
            m->mode = PVGPU_MODE_DIRECT;
            m->chan_id = 0;
            m->wait_status = PVGPU_WAITST_NONE;
            break;
        }
    }
    /* How a command still BUSY completes on the destination: a free is
     * done there (the slot is free); anything else failed with the link. */
    s->mig_done[0] = PVGPU_CMDST_E_LINK;
    s->mig_done[1] = s->mig_done[2] = 0;
    for (i = 0; s->cmd_status == PVGPU_CMDST_BUSY && i < s->req_count; i++) {
        PvgpuRequest *r = &s->req[(s->req_head + i) % PVGPU_MAX_REQUESTS];
        if (r->mailbox && r->type == PVGPU_MSG_CHAN_FREE) {
            s->mig_done[0] = PVGPU_CMDST_OK;
            s->mig_done[1] = r->slot;
        }
    }
    return 0;
}

static void pvgpu_mig_bh(void *opaque)
{
    PvgpuState *s = opaque;
    Coroutine *co = s->mig_co;

    if (co) {
        s->mig_co = NULL;
        aio_co_enter(qemu_get_aio_context(), co);
    }
}

static void pvgpu_mig_wake(PvgpuState *s)
{
    if (s->mig_co) {
        qemu_bh_schedule(s->mig_bh);
    }
}

static void pvgpu_mig_timer_cb(void *opaque)
{
    pvgpu_mig_wake(opaque);
}

/* A CHAN_RESTORE was answered: @failed is why it did not work, or NULL. */
static void pvgpu_mig_restored(PvgpuState *s, PvgpuSlot *sl, const char *failed)
{
    if (failed) {
        sl->state = PVGPU_SLOT_FREE;
        if (!s->mig_error[0]) {
            snprintf(s->mig_error, sizeof(s->mig_error),
                     "the channel of slot %u: %s", sl->index, failed);
        }
    }
    if (s->mig_restoring) {
        s->mig_restoring--;
    }
    pvgpu_mig_wake(s);
}

/* The incoming migration's coroutine waits (the main loop runs on) until
 * @what holds or the deadline passes.  False on the deadline. */
static bool pvgpu_mig_wait(PvgpuState *s, bool (*what)(PvgpuState *),
                           int64_t deadline)
{
    while (!what(s)) {
        if (qemu_clock_get_ms(QEMU_CLOCK_REALTIME) >= deadline) {
            return false;
        }
        timer_mod(s->mig_timer, deadline);
        s->mig_co = qemu_coroutine_self();
        qemu_coroutine_yield();
        s->mig_co = NULL;
    }
    timer_del(s->mig_timer);
    return true;
}

static uint32_t pvgpu_mig_refusals_seen;

static bool pvgpu_mig_linked(PvgpuState *s)
{
    return s->link == PVGPU_LINK_READY || s->hello_refusals != pvgpu_mig_refusals_seen;
}

static bool pvgpu_mig_settled(PvgpuState *s)
{
    return s->link != PVGPU_LINK_READY || (!s->mig_restoring && !s->mig_weights);
}

/* Checks what the guest (or a corrupted stream) could have put in the
 * stream before anything of it is used.  NULL, or why it does not fit. */
static const char *pvgpu_mig_check(PvgpuState *s, char *buf, size_t len)
{
    unsigned i;

    if (s->cmd_status > PVGPU_CMDST_E_DAEMON || s->mig_done[0] > PVGPU_CMDST_E_DAEMON ||
        s->mig_done[0] == PVGPU_CMDST_BUSY) {
        return "mailbox status out of range";
    }
    if ((s->irq_status | s->irq_mask) & ~PVGPU_IRQ_ALL) {
        return "interrupt bits out of range";
    }
    if (s->num_slots < 64 && (s->fence_done >> s->num_slots)) {
        return "fence-done bits beyond the slots";
    }
    for (i = 0; i < s->num_slots; i++) {
        const PvgpuSlotMig *m = &s->mig[i];
        const struct pvgpu_ctrl_page *c = (const void *)m->mem;

        if (m->state != PVGPU_SLOT_FREE && m->state != PVGPU_SLOT_LIVE &&
            m->state != PVGPU_SLOT_LOST) {
            snprintf(buf, len, "slot %u: state %u", i, m->state);
            return buf;
        }
        if (m->mode > PVGPU_MODE_SHADOWED) {
            snprintf(buf, len, "slot %u: mode %u", i, m->mode);
            return buf;
        }
        if (m->wait_status > PVGPU_WAITST_E_DEAD || m->notice > PVGPU_NOTICE_DEGRADED) {
            snprintf(buf, len, "slot %u: wait status %u, notice %u", i,
                     m->wait_status, m->notice);
            return buf;
        }
        if (m->state == PVGPU_SLOT_FREE && m->wait_status != PVGPU_WAITST_NONE) {
            snprintf(buf, len, "slot %u: a fence wait on a free slot", i);
            return buf;
        }
        if (m->state == PVGPU_SLOT_LIVE && m->guest_put - c->ib_get > PVGPU_RING_ENTRIES) {
            snprintf(buf, len, "slot %u: IB_PUT %u is more than a ring ahead of "
                     "IB_GET %u", i, m->guest_put, c->ib_get);
            return buf;
        }
    }
    for (i = 0; i < s->num_weights; i++) {
        if (s->weights[i].pid_hint == 0 || s->weights[i].weight == 0 ||
            s->weights[i].weight > PVGPU_WEIGHT_MAX || s->weights[i].reserved) {
            snprintf(buf, len, "task weight %u out of range", i);
            return buf;
        }
    }
    return NULL;
}

/* The saved channel memory as a sealed memfd for CHAN_RESTORE, or -1. */
static int pvgpu_mig_memfd(const PvgpuSlotMig *m)
{
    int fd = memfd_create("pvgpu-restore", MFD_CLOEXEC | MFD_ALLOW_SEALING);

    if (fd < 0) {
        return -1;
    }
    if (pwrite(fd, m->mem, PVGPU_CHAN_MEM_SIZE, 0) != PVGPU_CHAN_MEM_SIZE ||
        fcntl(fd, F_ADD_SEALS, F_SEAL_SHRINK | F_SEAL_GROW | F_SEAL_WRITE |
              F_SEAL_SEAL) < 0) {
        close(fd);
        return -1;
    }
    return fd;
}

/*
 * Destination: the stream is in.  Check it all, then re-create every live
 * channel at this host's pvgpud from its saved state and re-send the
 * guest's task weights, waiting (the incoming migration's coroutine
 * yields; the main loop runs the link) until pvgpud has answered: only
 * then does QEMU let the guest run.  Any failure fails the load, and QEMU
 * exits; the source, told by the return path, runs on.
 */
static int pvgpu_post_load(void *opaque, int version_id)
{
    PvgpuState *s = opaque;
    int64_t deadline = qemu_clock_get_ms(QEMU_CLOCK_REALTIME) + PVGPU_MIG_TIMEOUT_MS;
    char buf[96];
    const char *bad = pvgpu_mig_check(s, buf, sizeof(buf));
    unsigned i, live = 0;
    uint32_t gen, irqs;
    int64_t t0 = get_clock();

    if (bad) {
        error_report("pvgpu: the migration stream does not fit this device: %s",
                     bad);
        return -EINVAL;
    }
    for (i = 0; i < s->num_slots; i++) {
        if (s->slots[i].state != PVGPU_SLOT_FREE) {
            error_report("pvgpu: cannot load device state over live channels");
            return -EINVAL;
        }
        live += s->mig[i].state == PVGPU_SLOT_LIVE;
    }
    if ((live || s->num_weights) && !qemu_in_coroutine()) {
        error_report("pvgpu: GPU channels can only be restored by an incoming "
                     "pre-copy migration (not post-copy, not loadvm)");
        return -ENOTSUP;
    }
    /* What the guest saw on the source, whenever this host's HELLO lands:
     * its channels were not lost, so the link did not change for it. */
    gen = s->link_gen;
    irqs = s->irq_status;
    s->mig_error[0] = 0;
    s->waits_armed = 0;
    for (i = 0; i < s->num_slots; i++) {
        PvgpuSlot *sl = &s->slots[i];
        PvgpuSlotMig *m = &s->mig[i];

        /* The protocol's text field, whatever the stream says (a name
         * pvgpud refuses would end the link, not just this channel). */
        memset(sl->task_name, 0, PVGPU_TASK_NAME_LEN);
        for (size_t k = 0; k < PVGPU_TASK_NAME_LEN - 1 && m->task_name[k]; k++) {
            uint8_t c = m->task_name[k];
            sl->task_name[k] = (c >= 0x20 && c <= 0x7e) ? c : '?';
        }
        sl->pid_hint = m->pid_hint;
        sl->notice = m->notice;
        sl->wait_status = m->wait_status;
        sl->wait_fence = m->wait_fence;
        sl->wait_error = m->wait_error;
        sl->wait_since = qemu_clock_get_ns(QEMU_CLOCK_REALTIME);
        s->waits_armed += sl->wait_status == PVGPU_WAITST_ARMED;
        if (m->state == PVGPU_SLOT_LOST) {
            /* Its channel was gone on the source too: the guest reads the
             * saved page (STATUS error, ERROR lost) until it frees it. */
            memcpy(sl->chan_mem, m->mem, PVGPU_CHAN_MEM_SIZE);
            sl->installed = true;
            sl->chan_id = m->chan_id;
            sl->state = PVGPU_SLOT_LOST;
            sl->mode = PVGPU_MODE_TRAPPED;
            memory_region_transaction_begin();
            memory_region_add_subregion_overlap(&s->bar4, i * PVGPU_PAGE_SIZE,
                                                &sl->ring, 1);
            sl->ring_mapped = true;
            slot_show_ctrl(sl, &sl->ctrl_trap);
            memory_region_transaction_commit();
        } else if (m->state == PVGPU_SLOT_LIVE) {
            sl->state = PVGPU_SLOT_RESTORING;
            sl->chan_id = m->chan_id;
            sl->mode = m->mode;
        }
    }
    if (live || s->num_weights) {
        /* A HELLO refused before the stream came counts as refused: a
         * refusal is pvgpud's decision, the next try is refused too. */
        pvgpu_mig_refusals_seen = s->link == PVGPU_LINK_READY || !s->hello_refusals
                                  ? s->hello_refusals : s->hello_refusals - 1;
        if (!pvgpu_mig_wait(s, pvgpu_mig_linked, deadline) ||
            s->link != PVGPU_LINK_READY) {
            error_report("pvgpu: cannot restore the GPU channels: %s",
                         s->link == PVGPU_LINK_READY ? "" :
                         s->hello_refusals != pvgpu_mig_refusals_seen ?
                         "this host's pvgpud did not accept the VM (HELLO)" :
                         "no connection to this host's pvgpud");
            return -EIO;
        }
        if (s->link_version < PVGPU_PROTO_VERSION_MIGRATE) {
            error_report("pvgpu: this host's pvgpud speaks protocol version %u; "
                         "restoring GPU channels needs version %u",
                         s->link_version, PVGPU_PROTO_VERSION_MIGRATE);
            return -EIO;
        }
        for (i = 0; i < s->num_slots && s->link == PVGPU_LINK_READY; i++) {
            PvgpuSlotMig *m = &s->mig[i];
            const struct pvgpu_ctrl_page *c = (const void *)m->mem;
            struct pvgpu_chan_restore r = { 0 };
            int fd;

            if (s->slots[i].state != PVGPU_SLOT_RESTORING) {
                continue;
            }
            r.pid_hint = m->pid_hint;
            memcpy(r.task_name, s->slots[i].task_name, PVGPU_TASK_NAME_LEN);
            r.ib_put = m->guest_put;
            r.ib_get = c->ib_get;
            r.fence = c->fence;
            r.mode = m->mode;
            fd = pvgpu_mig_memfd(m);
            if (fd < 0) {
                error_report("pvgpu: cannot restore slot %u: memfd: %s", i,
                             strerror(errno));
                return -EIO;
            }
            if (!pvgpu_request_fd(s, PVGPU_MSG_CHAN_RESTORE, &r, sizeof(r), i, fd)) {
                close(fd);
                break;
            }
            close(fd);
            s->mig_restoring++;
        }
        for (i = 0; i < s->num_weights && s->link == PVGPU_LINK_READY; i++) {
            struct pvgpu_task_weight tw = {
                .pid_hint = s->weights[i].pid_hint,
                .weight = s->weights[i].weight,
            };
            if (!pvgpu_request(s, PVGPU_MSG_TASK_WEIGHT, &tw, sizeof(tw), -1,
                               false)) {
                break;
            }
            pvgpu_last_request(s)->hint = tw.pid_hint;
            pvgpu_last_request(s)->weight = tw.weight;
            s->mig_weights++;
        }
        if (!pvgpu_mig_wait(s, pvgpu_mig_settled, deadline) ||
            s->link != PVGPU_LINK_READY || s->mig_error[0]) {
            error_report("pvgpu: cannot restore the GPU channels: %s",
                         s->mig_error[0] ? s->mig_error :
                         s->link != PVGPU_LINK_READY ? "the connection to pvgpud was lost" :
                         "pvgpud did not answer in time");
            return -EIO;
        }
    }
    s->link_gen = gen;
    s->irq_status = irqs;
    s->restore_us = (get_clock() - t0) / 1000;
    if (s->cmd_status == PVGPU_CMDST_BUSY) {
        pvgpu_cmd_done(s, s->mig_done[0], s->mig_done[1], s->mig_done[2]);
    }
    pvgpu_fence_check(s);
    pvgpu_fence_arm(s);
    pvgpu_refresh_arm(s);
    pvgpu_update_irq(s);
    return 0;
}

static bool pvgpu_weights_fit(void *opaque, int version_id)
{
    PvgpuState *s = opaque;

    if (s->num_weights > PVGPU_MAX_TASK_WEIGHTS) {
        error_report("pvgpu: the migration stream has %u task weights "
                     "(at most %u)", s->num_weights, PVGPU_MAX_TASK_WEIGHTS);
        return false;
    }
    return true;
}

static const VMStateDescription vmstate_pvgpu_slot = {
    .name = "pvgpu/slot",
    .version_id = PVGPU_MIG_VERSION,
    .minimum_version_id = PVGPU_MIG_VERSION,
    .fields = (VMStateField[]) {
        VMSTATE_UINT8_ARRAY(task_name, PvgpuSlotMig, PVGPU_TASK_NAME_LEN),
        VMSTATE_UINT32(state, PvgpuSlotMig),
        VMSTATE_UINT32(mode, PvgpuSlotMig),
        VMSTATE_UINT32(chan_id, PvgpuSlotMig),
        VMSTATE_UINT32(notice, PvgpuSlotMig),
        VMSTATE_UINT64(pid_hint, PvgpuSlotMig),
        VMSTATE_UINT32(wait_status, PvgpuSlotMig),
        VMSTATE_UINT32(wait_fence, PvgpuSlotMig),
        VMSTATE_UINT32(wait_error, PvgpuSlotMig),
        VMSTATE_UINT32(guest_put, PvgpuSlotMig),
        VMSTATE_UINT8_ARRAY(mem, PvgpuSlotMig, PVGPU_CHAN_MEM_SIZE),
        VMSTATE_END_OF_LIST()
    },
};

static const VMStateDescription vmstate_pvgpu_weight = {
    .name = "pvgpu/task-weight",
    .version_id = PVGPU_MIG_VERSION,
    .minimum_version_id = PVGPU_MIG_VERSION,
    .fields = (VMStateField[]) {
        VMSTATE_UINT64(pid_hint, PvgpuTaskWeight),
        VMSTATE_UINT32(weight, PvgpuTaskWeight),
        VMSTATE_UINT32(reserved, PvgpuTaskWeight),
        VMSTATE_END_OF_LIST()
    },
};

static const VMStateDescription vmstate_pvgpu = {
    .name = "pvgpu",
    .version_id = PVGPU_MIG_VERSION,
    .minimum_version_id = PVGPU_MIG_VERSION,
    .pre_save = pvgpu_pre_save,
    .post_load = pvgpu_post_load,
    .fields = (VMStateField[]) {
        VMSTATE_PCI_DEVICE(pdev, PvgpuState),
        VMSTATE_MSIX(pdev, PvgpuState),
        VMSTATE_UINT32_EQUAL(num_slots, PvgpuState,
                             " (pvgpu: the destination's 'slots' differs "
                             "from the source's)"),
        VMSTATE_UINT32(cmd_status, PvgpuState),
        VMSTATE_UINT32_ARRAY(arg, PvgpuState, 3),
        VMSTATE_UINT32_ARRAY(result, PvgpuState, 2),
        VMSTATE_UINT8_ARRAY(task_name, PvgpuState, PVGPU_TASK_NAME_LEN),
        VMSTATE_UINT32(irq_status, PvgpuState),
        VMSTATE_UINT32(irq_mask, PvgpuState),
        VMSTATE_UINT32(bad_access, PvgpuState),
        VMSTATE_UINT64(fence_done, PvgpuState),
        VMSTATE_UINT32(link_gen, PvgpuState),
        VMSTATE_UINT32_ARRAY(mig_done, PvgpuState, 3),
        VMSTATE_STRUCT_VARRAY_UINT32(mig, PvgpuState, num_slots,
                                     PVGPU_MIG_VERSION, vmstate_pvgpu_slot,
                                     PvgpuSlotMig),
        VMSTATE_UINT32(num_weights, PvgpuState),
        VMSTATE_VALIDATE("pvgpu task weights", pvgpu_weights_fit),
        VMSTATE_STRUCT_VARRAY_UINT32(weights, PvgpuState, num_weights,
                                     PVGPU_MIG_VERSION, vmstate_pvgpu_weight,
                                     PvgpuTaskWeight),
        VMSTATE_END_OF_LIST()
    },
};

/* ------------------------------------------------------------------------ */
/* Device life cycle                                                        */

/* Undo the kernel-wn set-up; ranges still registered go with the listener
 * (its removal calls region_del for every page still mapped). */
static void pvgpu_wn_cleanup(PvgpuState *s)
{
    unsigned i;

    if (s->wn_listening) {
        memory_listener_unregister(&s->wn_listener);
        s->wn_listening = false;
    }
    if (s->wn_fallback_bh) {
        qemu_bh_delete(s->wn_fallback_bh);
        s->wn_fallback_bh = NULL;
    }
    for (i = 0; i < PVGPU_MAX_SLOTS; i++) {
        PvgpuSlot *sl = &s->slots[i];

        if (sl->wn_notify_ok) {
            event_notifier_set_handler(&sl->wn_notify, NULL);
            event_notifier_cleanup(&sl->wn_notify);
            sl->wn_notify_ok = false;
        }
    }
}

/* The properties make a device, or say why not in @errp. */
static bool pvgpu_check_properties(PvgpuState *s, Error **errp)
{
    if (!qemu_chr_fe_backend_connected(&s->chr)) {
        error_setg(errp, "pvgpu: 'chardev' must name a socket chardev "
                   "connected to pvgpud");
        return false;
    }
    if (!qemu_uuid_set) {
        error_setg(errp, "pvgpu: the VM needs a UUID (-uuid): pvgpud keys "
                   "VMs by UUID");
        return false;
    }
    if (s->num_slots < 1 || s->num_slots > PVGPU_MAX_SLOTS ||
        (s->num_slots & (s->num_slots - 1))) {
        error_setg(errp, "pvgpu: 'slots' must be a power of two in 1..%d "
                   "(got %u)", PVGPU_MAX_SLOTS, s->num_slots);
        return false;
    }
    if (s->gpu != PVGPU_DEVICE_GPU_AUTO && s->gpu >= PVGPU_MAX_GPUS) {
        error_setg(errp, "pvgpu: 'gpu' must be a GPU index in 0..%u, or "
                   "unset to let pvgpud place the device (got %u)",
                   PVGPU_MAX_GPUS - 1, s->gpu);
        return false;
    }
    s->use_kernel_wn = s->kernel_wn != ON_OFF_AUTO_OFF && pvgpu_wn_version() > 0;
    if (s->kernel_wn == ON_OFF_AUTO_ON && !s->use_kernel_wn) {
        error_setg(errp, "pvgpu: kernel-wn=on needs KVM with the pvgpu write "
                   "notify extension (KVM_CAP_PVGPU_WRITE_NOTIFY): %s",
                   !kvm_enabled() ? "this VM does not run under KVM "
                                    "(-accel kvm)"
                                  : "the host's kvm.ko lacks it (load the one "
                                    "kvm-hooks/build.sh builds)");
        return false;
    }
    return true;
}

/*
 * Interrupts: INTA, and MSI-X with its table and PBA in their own 4 KiB BAR1
 * (table at 0, PBA at 0x800), so BAR0 stays the mailbox alone.  INTx when
 * the guest does not enable MSI-X, or when the platform has no MSI at all.
 */
static bool pvgpu_init_irqs(PvgpuState *s, Error **errp)
{
    PCIDevice *pdev = &s->pdev;
    Error *err = NULL;
    unsigned i;
    int ret;

    pci_config_set_interrupt_pin(pdev->config, 1);
    ret = msix_init_exclusive_bar(pdev, PVGPU_MSIX_VECTORS, PVGPU_BAR_MSIX,
                                  &err);
    if (ret == -ENOTSUP) {
        warn_report_err(err);
        return true;
    }
    if (ret) {
        error_propagate(errp, err);
        return false;
    }
    for (i = 0; i < PVGPU_MSIX_VECTORS; i++) {
        msix_vector_use(pdev, i);
    }
    return true;
}

/*
 * Slot @i's windows: the memory its channel will be mapped on (reserved
 * now), the control page as BAR2 may show it (direct, trapped, shadowed),
 * its doorbell page in BAR2 and its ring in BAR4.
 */
static bool pvgpu_init_slot(PvgpuState *s, unsigned i, Error **errp)
{
    PvgpuSlot *sl = &s->slots[i];
    char name[64];

    sl->dev = s;
    sl->index = i;
    sl->shadow = qemu_memalign(PVGPU_PAGE_SIZE, PVGPU_PAGE_SIZE);
    memset(sl->shadow, 0, PVGPU_PAGE_SIZE);
    sl->chan_mem = mmap(NULL, PVGPU_CHAN_MEM_SIZE, PROT_READ | PROT_WRITE,
                        MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (sl->chan_mem == MAP_FAILED) {
        sl->chan_mem = NULL;
        error_setg_errno(errp, errno, "pvgpu: cannot reserve channel memory");
        return false;
    }
    snprintf(name, sizeof(name), "pvgpu-ctrl%u", i);
    memory_region_init_ram_device_ptr(&sl->ctrl_direct, OBJECT(s), name,
                                      PVGPU_PAGE_SIZE, sl->chan_mem);
    snprintf(name, sizeof(name), "pvgpu-ring%u", i);
    memory_region_init_ram_device_ptr(&sl->ring, OBJECT(s), name,
                                      PVGPU_PAGE_SIZE,
                                      (uint8_t *)sl->chan_mem +
                                      PVGPU_CHAN_RING_OFFSET);
    snprintf(name, sizeof(name), "pvgpu-trap%u", i);
    memory_region_init_io(&sl->ctrl_trap, OBJECT(s), &pvgpu_trap_ops, sl,
                          name, PVGPU_PAGE_SIZE);
    snprintf(name, sizeof(name), "pvgpu-shadow%u", i);
    memory_region_init_ram_device_ptr(&sl->ctrl_shadow, OBJECT(s), name,
                                      PVGPU_PAGE_SIZE, sl->shadow);
    snprintf(name, sizeof(name), "pvgpu-doorbell%u", i);
    memory_region_init_io(&sl->doorbell, OBJECT(s), &pvgpu_doorbell_ops,
                          sl, name, PVGPU_PAGE_SIZE);
    memory_region_add_subregion_overlap(&s->bar2,
                                        i * PVGPU_BAR2_STRIDE +
                                        PVGPU_BAR2_DOORBELL,
                                        &sl->doorbell, 1);
    return true;
}

/*
 * BAR0, the mailbox; BAR2 and BAR4, the slots' windows over a background
 * that answers where no channel is mapped.  Registered with PCI by realize.
 */
static bool pvgpu_init_bars(PvgpuState *s, Error **errp)
{
    unsigned i;

    memory_region_init_io(&s->mmio, OBJECT(s), &pvgpu_mmio_ops, s,
                          "pvgpu-mmio", PVGPU_BAR0_SIZE);
    memory_region_init(&s->bar2, OBJECT(s), "pvgpu-ctrl",
                       s->num_slots * PVGPU_BAR2_STRIDE);
    memory_region_init_io(&s->bar2_bg, OBJECT(s), &pvgpu_bg_ops, s,
                          "pvgpu-ctrl-empty", s->num_slots * PVGPU_BAR2_STRIDE);
    memory_region_add_subregion_overlap(&s->bar2, 0, &s->bar2_bg, 0);
    memory_region_init(&s->bar4, OBJECT(s), "pvgpu-ring",
                       s->num_slots * PVGPU_BAR4_STRIDE);
    memory_region_init_io(&s->bar4_bg, OBJECT(s), &pvgpu_bg_ops, s,
                          "pvgpu-ring-empty", s->num_slots * PVGPU_BAR4_STRIDE);
    memory_region_add_subregion_overlap(&s->bar4, 0, &s->bar4_bg, 0);

    for (i = 0; i < s->num_slots; i++) {
        if (!pvgpu_init_slot(s, i, errp)) {
            return false;
        }
    }
    return true;
}

/* kernel-wn: an eventfd per slot for KVM's write notify, and the listener
 * that registers the trapped control pages with KVM (section 6.1). */
static bool pvgpu_init_kernel_wn(PvgpuState *s, Error **errp)
{
    unsigned i;
    int ret;

    if (!s->use_kernel_wn) {
        return true;
    }
    for (i = 0; i < s->num_slots; i++) {
        PvgpuSlot *sl = &s->slots[i];

        ret = event_notifier_init(&sl->wn_notify, 0);
        if (ret < 0) {
            error_setg_errno(errp, -ret, "pvgpu: cannot create an eventfd "
                             "for KVM write notify");
            return false;
        }
        sl->wn_notify_ok = true;
        event_notifier_set_handler(&sl->wn_notify, slot_wn_notified);
    }
    s->wn_fallback_bh = qemu_bh_new(pvgpu_wn_fallback_bh, s);
    s->wn_listener = (MemoryListener) {
        .name = "pvgpu-wn",
        .region_add = pvgpu_wn_region_add,
        .region_del = pvgpu_wn_region_del,
        .priority = 20,   /* after KVM's add, before KVM's del */
    };
    memory_listener_register(&s->wn_listener, &address_space_memory);
    s->wn_listening = true;
    return true;
}

/* The device's state at power-on, its timers and bottom halves, and the
 * daemon connection's handlers: from here on HELLO goes out on connect. */
static void pvgpu_start(PvgpuState *s)
{
    s->irq_mask = PVGPU_IRQ_ALL;
    s->link = PVGPU_LINK_DOWN;
    s->refresh = timer_new_ms(QEMU_CLOCK_REALTIME, pvgpu_refresh_cb, s);
    s->fence_timer = timer_new_ns(QEMU_CLOCK_REALTIME, pvgpu_fence_cb, s);
    s->tx = g_byte_array_new();
    s->tx_bh = qemu_bh_new(pvgpu_tx_fail_bh, s);
    s->mig_bh = qemu_bh_new(pvgpu_mig_bh, s);
    s->mig_timer = timer_new_ms(QEMU_CLOCK_REALTIME, pvgpu_mig_timer_cb, s);
    s->vmstate_entry = qemu_add_vm_change_state_handler(pvgpu_vm_state, s);

    qemu_chr_fe_set_handlers(&s->chr, pvgpu_chr_can_read, pvgpu_chr_read,
                             pvgpu_chr_event, NULL, s, NULL, true);
}

/*
 * Undo a realize that failed after the relay started.  The subregions the
 * device owns hold references on it: without them gone a failed realize is
 * never finalized (pvgpu_exit does the same).
 */
static void pvgpu_realize_undo(PvgpuState *s)
{
    unsigned i;

    memory_region_transaction_begin();
    for (i = 0; i < s->num_slots; i++) {
        if (s->slots[i].doorbell.container) {
            memory_region_del_subregion(&s->bar2, &s->slots[i].doorbell);
        }
    }
    if (s->bar2_bg.container) {
        memory_region_del_subregion(&s->bar2, &s->bar2_bg);
    }
    if (s->bar4_bg.container) {
        memory_region_del_subregion(&s->bar4, &s->bar4_bg);
    }
    memory_region_transaction_commit();
    pvgpu_wn_cleanup(s);
    msix_uninit_exclusive_bar(&s->pdev);  /* no-op when MSI-X is absent */
    pvgpu_relay_stop(s->relay);
    s->relay = NULL;
}

static void pvgpu_realize(PCIDevice *pdev, Error **errp)
{
    PvgpuState *s = PVGPU(pdev);

    if (!pvgpu_check_properties(s, errp)) {
        return;
    }
    s->relay = pvgpu_relay_new(s, errp);
    if (!s->relay) {
        return;
    }
    if (!pvgpu_init_irqs(s, errp) || !pvgpu_init_bars(s, errp) ||
        !pvgpu_init_kernel_wn(s, errp)) {
        pvgpu_realize_undo(s);
        return;
    }
    pci_register_bar(pdev, PVGPU_BAR_MBOX, PCI_BASE_ADDRESS_SPACE_MEMORY,
                     &s->mmio);
    pci_register_bar(pdev, PVGPU_BAR_CHANNELS, PCI_BASE_ADDRESS_SPACE_MEMORY,
                     &s->bar2);
    pci_register_bar(pdev, PVGPU_BAR_RINGS, PCI_BASE_ADDRESS_SPACE_MEMORY,
                     &s->bar4);
    pvgpu_start(s);
}

/*
 * Unplug (or the end of QEMU): everything goes back to the daemon.  Closing
 * the connection is what does it -- pvgpud frees a VMM client's channels and
 * removes its VM when the client goes -- and lets a re-plugged device say
 * HELLO on a fresh connection.  The chardev itself stays (it belongs to the
 * command line or to chardev-add); a reconnecting one reconnects without us.
 */
static void pvgpu_exit(PCIDevice *pdev)
{
    PvgpuState *s = PVGPU(pdev);
    unsigned i;

    if (qemu_chr_fe_backend_connected(&s->chr)) {
        qemu_chr_fe_set_handlers(&s->chr, NULL, NULL, NULL, NULL, NULL, NULL,
                                 true);
        qemu_chr_fe_disconnect(&s->chr);
    }
    qemu_chr_fe_deinit(&s->chr, false);
    s->link = PVGPU_LINK_DOWN;
    s->req_count = 0;
    pvgpu_tx_reset(s);
    g_byte_array_free(s->tx, true);
    s->tx = NULL;
    qemu_bh_delete(s->tx_bh);
    s->tx_bh = NULL;
    if (s->refresh) {
        timer_free(s->refresh);
        s->refresh = NULL;
    }
    if (s->fence_timer) {
        timer_free(s->fence_timer);
        s->fence_timer = NULL;
    }
    /* Our subregions hold references on the device (their owner): all of
     * them must go, or an unplugged device is never finalized. */
    memory_region_transaction_begin();
    for (i = 0; i < s->num_slots; i++) {
        PvgpuSlot *sl = &s->slots[i];
        if (!sl->dev) {
            continue;
        }
        slot_free(sl);
        memory_region_del_subregion(&s->bar2, &sl->doorbell);
    }
    if (s->bar2_bg.container) {
        memory_region_del_subregion(&s->bar2, &s->bar2_bg);
        memory_region_del_subregion(&s->bar4, &s->bar4_bg);
    }
    memory_region_transaction_commit();
    if (s->relay) {
        pvgpu_relay_stop(s->relay);
        s->relay = NULL;
    }
    pvgpu_wn_cleanup(s);
    pvgpu_rx_reset(s);
    msix_unuse_all_vectors(pdev);
    msix_uninit_exclusive_bar(pdev);
    if (s->vmstate_entry) {
        qemu_del_vm_change_state_handler(s->vmstate_entry);
        s->vmstate_entry = NULL;
    }
    if (s->mig_bh) {
        qemu_bh_delete(s->mig_bh);
        s->mig_bh = NULL;
    }
    if (s->mig_timer) {
        timer_free(s->mig_timer);
        s->mig_timer = NULL;
    }
}

static void pvgpu_finalize(Object *obj)
{
    PvgpuState *s = PVGPU(obj);
    unsigned i;

    /* The shadow pages and channel memory back RAM regions that die with
     * the device (nothing can map them any more). */
    for (i = 0; i < PVGPU_MAX_SLOTS; i++) {
        qemu_vfree(s->slots[i].shadow);
        s->slots[i].shadow = NULL;
        if (s->slots[i].chan_mem) {
            munmap(s->slots[i].chan_mem, PVGPU_CHAN_MEM_SIZE);
            s->slots[i].chan_mem = NULL;
        }
    }
}

/*
 * Device reset (guest reboot, system_reset): the guest forgets every
 * channel, so they go back to the daemon; mailbox, interrupt and wait state
 * return to power-on values.  A command in flight finishes silently.  The
 * daemon link stays up.
 */
static void pvgpu_reset(DeviceState *dev)
{
    PvgpuState *s = PVGPU(dev);
    unsigned i;

    for (i = 0; i < s->req_count; i++) {
        s->req[(s->req_head + i) % PVGPU_MAX_REQUESTS].mailbox = false;
    }
    for (i = 0; i < s->num_slots; i++) {
        PvgpuSlot *sl = &s->slots[i];
        struct pvgpu_chan_ref ref = { 0 };

        slot_wait_cancel(sl);
        switch (sl->state) {
        case PVGPU_SLOT_PENDING:           /* its CHAN_REPLY will be given back */
            sl->state = PVGPU_SLOT_FREE;
            break;
        case PVGPU_SLOT_LOST:
            slot_free(sl);
            break;
        case PVGPU_SLOT_LIVE:
            ref.chan_id = sl->chan_id;
            sl->state = PVGPU_SLOT_FREEING;
            memory_region_transaction_begin();
            slot_arm_bell(sl, false);
            slot_show_ctrl(sl, &sl->ctrl_trap);
            memory_region_transaction_commit();
            if (!pvgpu_request(s, PVGPU_MSG_CHAN_FREE, &ref, sizeof(ref), i, false)) {
                pvgpu_link_lost(s, "write to the daemon failed");
            }
            break;
        }
    }
    s->cmd_status = PVGPU_CMDST_OK;
    memset(s->arg, 0, sizeof(s->arg));
    memset(s->task_name, 0, sizeof(s->task_name));
    s->result[0] = s->result[1] = 0;
    s->irq_status = 0;
    s->irq_mask = PVGPU_IRQ_ALL;
    s->fence_done = 0;
    s->bad_access = 0;
    pvgpu_update_irq(s);
}

static Property pvgpu_properties[] = {
    DEFINE_PROP_CHR("chardev", PvgpuState, chr),
    DEFINE_PROP_UINT32("slots", PvgpuState, num_slots, 16),
    DEFINE_PROP_UINT32("gpu", PvgpuState, gpu, PVGPU_DEVICE_GPU_AUTO),
    DEFINE_PROP_ON_OFF_AUTO("kernel-wn", PvgpuState, kernel_wn, ON_OFF_AUTO_AUTO),
    DEFINE_PROP_END_OF_LIST(),
};

/* kernel-wn-faults / kernel-wn-signals: KVM's counts for this device's
 * pages, the ranges registered now and those already gone. */
static void pvgpu_get_wn_stat(Object *obj, Visitor *v, const char *name,
                              void *opaque, Error **errp)
{
    PvgpuState *s = PVGPU(obj);
    bool faults = GPOINTER_TO_INT(opaque);
    uint64_t val = faults ? s->wn_faults_gone : s->wn_signals_gone;
    unsigned i;

    for (i = 0; i < s->num_slots && i < PVGPU_MAX_SLOTS; i++) {
        struct kvm_pvgpu_wn_ctl c;

        if (s->slots[i].wn_id &&
            slot_wn_ioctl(&s->slots[i], KVM_PVGPU_WN_GET_STATS, &c) == 0) {
            val += faults ? c.faults : c.signals;
        }
    }
    visit_type_uint64(v, name, &val, errp);
}

static bool pvgpu_get_wn_active(Object *obj, Error **errp)
{
    return PVGPU(obj)->use_kernel_wn;
}

/* Read-only counters for monitoring (qom-get), docs/pvgpu-device.md 6.1. */
static void pvgpu_instance_init(Object *obj)
{
    PvgpuState *s = PVGPU(obj);

    object_property_add_bool(obj, "kernel-wn-active", pvgpu_get_wn_active, NULL);
    object_property_add(obj, "kernel-wn-faults", "uint64", pvgpu_get_wn_stat,
                        NULL, NULL, GINT_TO_POINTER(1));
    object_property_add(obj, "kernel-wn-signals", "uint64", pvgpu_get_wn_stat,
                        NULL, NULL, GINT_TO_POINTER(0));
    object_property_add_uint64_ptr(obj, "kernel-wn-notifications",
                                   &s->wn_notifications, OBJ_PROP_FLAG_READ);
    object_property_add_uint64_ptr(obj, "trap-reports", &s->traps,
                                   OBJ_PROP_FLAG_READ);
    object_property_add_uint64_ptr(obj, "doorbell-kicks", &s->kicks,
                                   OBJ_PROP_FLAG_READ);
    object_property_add_uint64_ptr(obj, "switches-to-trapped",
                                   &s->switches_to_trapped, OBJ_PROP_FLAG_READ);
    object_property_add_uint64_ptr(obj, "switch-to-trapped-ns",
                                   &s->switch_to_trapped_ns, OBJ_PROP_FLAG_READ);
    object_property_add_uint64_ptr(obj, "switches-to-direct",
                                   &s->switches_to_direct, OBJ_PROP_FLAG_READ);
    object_property_add_uint64_ptr(obj, "switch-to-direct-ns",
                                   &s->switch_to_direct_ns, OBJ_PROP_FLAG_READ);
    object_property_add_uint64_ptr(obj, "unshadows", &s->unshadows,
                                   OBJ_PROP_FLAG_READ);
    object_property_add_uint64_ptr(obj, "fence-polls", &s->fence_polls,
                                   OBJ_PROP_FLAG_READ);
    object_property_add_uint64_ptr(obj, "tx-queued-max", &s->tx_queued_max,
                                   OBJ_PROP_FLAG_READ);
    object_property_add_uint64_ptr(obj, "tx-coalesced", &s->tx_coalesced,
                                   OBJ_PROP_FLAG_READ);
    object_property_add_uint64_ptr(obj, "quiesce-us", &s->quiesce_us,
                                   OBJ_PROP_FLAG_READ);
    object_property_add_uint64_ptr(obj, "restore-us", &s->restore_us,
                                   OBJ_PROP_FLAG_READ);
}

static void pvgpu_class_init(ObjectClass *klass, void *data)
{
    DeviceClass *dc = DEVICE_CLASS(klass);
    PCIDeviceClass *k = PCI_DEVICE_CLASS(klass);

    k->realize = pvgpu_realize;
    k->exit = pvgpu_exit;
    k->config_write = pvgpu_write_config;
    dc->reset = pvgpu_reset;
    k->vendor_id = PVGPU_PCI_VENDOR_ID;
    k->device_id = PVGPU_PCI_DEVICE_ID;
    k->revision = PVGPU_DEV_VERSION;
    k->class_id = PCI_CLASS_DISPLAY_OTHER;
    dc->desc = "pvgpu paravirtual GPU channels (pvgpud)";
    set_bit(DEVICE_CATEGORY_DISPLAY, dc->categories);
    device_class_set_props(dc, pvgpu_properties);
    dc->vmsd = &vmstate_pvgpu;
}

static const TypeInfo pvgpu_info = {
    .name = TYPE_PVGPU,
    .parent = TYPE_PCI_DEVICE,
    .instance_size = sizeof(PvgpuState),
    .instance_init = pvgpu_instance_init,
    .instance_finalize = pvgpu_finalize,
    .class_init = pvgpu_class_init,
    .interfaces = (InterfaceInfo[]) {
        { INTERFACE_CONVENTIONAL_PCI_DEVICE },
        { },
    },
};

static void pvgpu_register_types(void)
{
    type_register_static(&pvgpu_info);
}

type_init(pvgpu_register_types)
