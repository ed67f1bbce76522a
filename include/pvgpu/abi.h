/* SPDX-License-Identifier: GPL-2.0-or-later */
/*
 * pvgpu ABI shared by the guest driver, the QEMU device and the host.
 *
 * A channel is a submission queue on the GPU.  It is made of two pieces of
 * memory, laid out exactly as below so the same bytes can sit in a memfd that
 * the daemon, QEMU and a guest application all map:
 *
 *   - a control page (4 KiB): IB_PUT is the doorbell the submitter writes,
 *     IB_GET is advanced by the GPU as it fetches ring entries, FENCE is the
 *     sequence number of the last completed entry;
 *   - a ring of PVGPU_RING_ENTRIES entries.  An entry names a unit of work
 *     (a kernel launch).  Its payload is opaque to the host scheduler: only
 *     the GPU (or the simulated GPU) interprets it.
 *
 * Everything here is plain C so the guest kernel module and QEMU can include it.
 */
#ifndef PVGPU_ABI_H
#define PVGPU_ABI_H

#ifdef __KERNEL__
#include <linux/types.h>
typedef __u8 pvgpu_u8;
typedef __u16 pvgpu_u16;
typedef __u32 pvgpu_u32;
typedef __u64 pvgpu_u64;
#else
#include <stdint.h>
typedef uint8_t pvgpu_u8;
typedef uint16_t pvgpu_u16;
typedef uint32_t pvgpu_u32;
typedef uint64_t pvgpu_u64;
#endif

#define PVGPU_ABI_VERSION 1u

#define PVGPU_PAGE_SIZE 4096u
/* Power of two so IB_PUT/IB_GET wrap with a mask; 32-bit counters never
 * need resetting (they are compared by difference). */
#define PVGPU_RING_ENTRIES 256u
#define PVGPU_RING_MASK (PVGPU_RING_ENTRIES - 1u)

/* Control page register offsets (bytes).  Only 32-bit aligned accesses are valid. */
#define PVGPU_CTRL_IB_PUT 0x00u      /* rw by submitter: entries written so far */
#define PVGPU_CTRL_IB_GET 0x04u      /* ro: entries fetched by the GPU */
#define PVGPU_CTRL_FENCE 0x08u       /* ro: fence of the last completed entry */
#define PVGPU_CTRL_STATUS 0x0cu      /* ro: PVGPU_CHAN_STATUS_* */
#define PVGPU_CTRL_ERROR 0x10u       /* ro: PVGPU_CHAN_ERR_* once STATUS says error */
#define PVGPU_CTRL_NOTIFY_FENCE 0x14u /* rw by a host client: see struct pvgpu_ctrl_page */

#define PVGPU_CHAN_STATUS_OK 0u
#define PVGPU_CHAN_STATUS_ERROR 1u

#define PVGPU_CHAN_ERR_NONE 0u
#define PVGPU_CHAN_ERR_WATCHDOG 1u   /* a kernel ran past the watchdog limit */
#define PVGPU_CHAN_ERR_BAD_ENTRY 2u  /* the GPU could not decode a ring entry */
#define PVGPU_CHAN_ERR_LOST 0x80u /* the device lost its daemon connection; re-allocate */

struct pvgpu_ctrl_page {
	volatile pvgpu_u32 ib_put;
	volatile pvgpu_u32 ib_get;
	volatile pvgpu_u32 fence;
	volatile pvgpu_u32 status;
	volatile pvgpu_u32 error;
	/* 0x14, written by a host client (protocol version 3) before it sleeps
	 * on its completion notifier: wake me when FENCE reaches this value
	 * (compared by difference).  Read by pvgpud only to decide whether to
	 * write the notifier; ignored for guests' channels. */
	volatile pvgpu_u32 notify_fence;
	pvgpu_u32 reserved[(PVGPU_PAGE_SIZE / 4u) - 6u];
};

/* Ring entry flags */
#define PVGPU_ENTRY_IRQ 0x1u /* raise a completion interrupt when done */

struct pvgpu_ring_entry {
	pvgpu_u64 payload;  /* opaque work descriptor (the simulated GPU: run time in ns) */
	pvgpu_u32 fence;    /* written to the control page's FENCE on completion */
	pvgpu_u32 flags;    /* PVGPU_ENTRY_* */
};

struct pvgpu_ring {
	struct pvgpu_ring_entry entries[PVGPU_RING_ENTRIES];
};

#define PVGPU_RING_SIZE ((unsigned)sizeof(struct pvgpu_ring))

/* Weights, at every level of the entity tree. */
#define PVGPU_WEIGHT_MIN 1u
#define PVGPU_WEIGHT_MAX 10000u
#define PVGPU_WEIGHT_DEFAULT 100u

#ifdef __cplusplus
static_assert(sizeof(struct pvgpu_ctrl_page) == PVGPU_PAGE_SIZE, "control page is one page");
static_assert(sizeof(struct pvgpu_ring_entry) == 16, "ring entry layout");
#else
_Static_assert(sizeof(struct pvgpu_ctrl_page) == PVGPU_PAGE_SIZE, "control page is one page");
_Static_assert(sizeof(struct pvgpu_ring_entry) == 16, "ring entry layout");
#endif

#endif /* PVGPU_ABI_H */
