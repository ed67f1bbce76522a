/* SPDX-License-Identifier: GPL-2.0-or-later */
/*
 * pvgpu wire protocol between pvgpud and its clients (the QEMU pvgpu device,
 * host processes through libpvgpu).  A UNIX stream socket carries messages:
 * a fixed header followed by `len` bytes of payload.  All integers are
 * little-endian (every supported host is), structs are packed by layout
 * (natural alignment, no implicit padding: every struct here is a multiple
 * of 8 bytes and checked below).  File descriptors travel with SCM_RIGHTS on
 * the message that names them.
 *
 * Versioning: HELLO carries the client's version; the daemon answers with the
 * version it will speak (the lower of the two) or refuses.  Unknown message
 * types are errors; new message types need a new version and are used only
 * once HELLO agreed on it.  Version 2 adds TASK_WEIGHT / TASK_WEIGHT_REPLY;
 * version 3 adds the completion notifier of host clients' channels (a third
 * fd on CHAN_REPLY, see struct pvgpu_chan_reply); version 4 lets HELLO name
 * the GPU (struct pvgpu_hello.gpu, which older versions sent as a reserved
 * zero); version 5 adds live migration of a VMM's channels (QUIESCE,
 * RESUME, CHAN_RESTORE and their replies); everything else is as in
 * version 1.
 *
 * Admin clients (pvgpuctl) use a separate socket speaking newline-delimited
 * JSON; see docs/protocol.md.
 */
#ifndef PVGPU_PROTOCOL_H
#define PVGPU_PROTOCOL_H

#include "abi.h"

#define PVGPU_PROTO_MAGIC 0x55504750u /* "PGPU" little-endian */
#define PVGPU_PROTO_VERSION 5u
#define PVGPU_PROTO_VERSION_TASK_WEIGHT 2u /* first version with TASK_WEIGHT */
#define PVGPU_PROTO_VERSION_COMPLETION 3u  /* first version with completion notifiers */
#define PVGPU_PROTO_VERSION_GPU 4u         /* first version whose HELLO may name a GPU */
#define PVGPU_PROTO_VERSION_MIGRATE 5u     /* first version with QUIESCE/RESUME/CHAN_RESTORE */
#define PVGPU_PROTO_MAX_PAYLOAD 1024u /* a larger len is a protocol error */
#define PVGPU_PROTO_MAX_FDS 3u        /* fds one message may carry */

struct pvgpu_msg_hdr {
	pvgpu_u32 magic;  /* PVGPU_PROTO_MAGIC */
	pvgpu_u16 type;   /* enum pvgpu_msg_type */
	pvgpu_u16 flags;  /* reserved, 0 */
	pvgpu_u32 len;    /* payload bytes after the header */
	pvgpu_u32 seq;    /* request id; replies echo it; pushes use 0 */
};

enum pvgpu_msg_type {
	/* client -> daemon */
	PVGPU_MSG_HELLO = 1,          /* struct pvgpu_hello */
	PVGPU_MSG_CHAN_ALLOC = 2,     /* struct pvgpu_chan_alloc */
	PVGPU_MSG_CHAN_FREE = 3,      /* struct pvgpu_chan_ref */
	PVGPU_MSG_MODE_ACK = 4,       /* struct pvgpu_mode_ack */
	PVGPU_MSG_TRAP_REPORT = 5,    /* struct pvgpu_trap_report */
	PVGPU_MSG_PING = 6,           /* no payload; daemon answers PONG */
	PVGPU_MSG_TASK_WEIGHT = 7,    /* v2, VMM only: struct pvgpu_task_weight */
	PVGPU_MSG_QUIESCE = 8,        /* v5, VMM only: struct pvgpu_quiesce + fd [done socket] */
	PVGPU_MSG_RESUME = 9,         /* v5, VMM only: struct pvgpu_chan_ref (zero) */
	PVGPU_MSG_CHAN_RESTORE = 10,  /* v5, VMM only: struct pvgpu_chan_restore + fd [saved memory];
	                               * answered by CHAN_REPLY */

	/* daemon -> client */
	PVGPU_MSG_HELLO_REPLY = 64,   /* struct pvgpu_hello_reply */
	PVGPU_MSG_CHAN_REPLY = 65,    /* struct pvgpu_chan_reply + fds [memfd, doorbell eventfd
	                               * (, v3 host client: completion notifier)] */
	PVGPU_MSG_FREE_REPLY = 66,    /* struct pvgpu_status_reply */
	PVGPU_MSG_MODE = 67,          /* struct pvgpu_mode (pushed) */
	PVGPU_MSG_NOTICE = 68,        /* struct pvgpu_notice (pushed) */
	PVGPU_MSG_ERROR = 69,         /* struct pvgpu_error; the daemon may close after it */
	PVGPU_MSG_PONG = 70,          /* no payload */
	PVGPU_MSG_TASK_WEIGHT_REPLY = 71, /* v2: struct pvgpu_status_reply (chan_id 0) */
	PVGPU_MSG_QUIESCE_REPLY = 72, /* v5: struct pvgpu_status_reply (chan_id: channels held) */
	PVGPU_MSG_RESUME_REPLY = 73,  /* v5: struct pvgpu_status_reply (chan_id: channels resumed) */
};

/* Client roles */
#define PVGPU_ROLE_VMM 1u  /* a VMM: one VM, channels keyed by guest pid hints */
#define PVGPU_ROLE_HOST 2u /* a host process: one host task */

#define PVGPU_NAME_LEN 64u

struct pvgpu_hello {
	pvgpu_u32 version;             /* PVGPU_PROTO_VERSION the client speaks */
	pvgpu_u32 role;                /* PVGPU_ROLE_* */
	pvgpu_u8 uuid[16];             /* VMM: the VM's UUID; host: zero */
	char name[PVGPU_NAME_LEN];     /* VM or task name, NUL-padded */
	pvgpu_u32 pid;                 /* informational */
	pvgpu_u32 gpu;                 /* PVGPU_GPU_ANY: the daemon places the client;
	                                * PVGPU_GPU_INDEX(n): GPU n (v4; zero before) */
};

/* pvgpu_hello.gpu: a host has at most PVGPU_MAX_GPUS GPUs, numbered from 0.
 * Zero (what clients before version 4 send) leaves the choice to pvgpud.
 * A HELLO naming a GPU the host lacks is refused with an ERROR saying why
 * (PVGPU_E_INVALID) followed by the HELLO_REPLY. */
#define PVGPU_MAX_GPUS 16u
#define PVGPU_GPU_ANY 0u
#define PVGPU_GPU_INDEX(n) ((pvgpu_u32)(n) + 1u)

/* Status codes in replies */
enum pvgpu_status {
	PVGPU_OK = 0,
	PVGPU_E_VERSION = 1,      /* no common protocol version */
	PVGPU_E_INVALID = 2,      /* a field is out of range */
	PVGPU_E_STATE = 3,        /* not allowed now (e.g. before HELLO) */
	PVGPU_E_LIMIT = 4,        /* too many channels for this client */
	PVGPU_E_NOENT = 5,        /* no such channel */
	PVGPU_E_INTERNAL = 6,     /* the daemon failed (memfd, eventfd, ...) */
};

struct pvgpu_hello_reply {
	pvgpu_u32 status;          /* enum pvgpu_status */
	pvgpu_u32 version;         /* the version both sides now speak */
	pvgpu_u32 client_id;
	pvgpu_u32 max_channels;    /* per client */
};

struct pvgpu_chan_alloc {
	pvgpu_u64 pid_hint;        /* VMM: guest grouping id (0 = none); host: ignored */
	char task_name[32];        /* optional display name of the guest task */
};

/* Layout of the channel memfd (mmap it whole): the control page at offset 0,
 * the ring at PVGPU_PAGE_SIZE. */
#define PVGPU_CHAN_MEM_SIZE (PVGPU_PAGE_SIZE + PVGPU_RING_SIZE)
#define PVGPU_CHAN_RING_OFFSET PVGPU_PAGE_SIZE

/* With status OK it carries the channel's memfd and doorbell eventfd and,
 * in a version-3 session with a host client, a third fd: the completion
 * notifier, the read end of a pipe.  pvgpud writes a byte to it whenever a
 * completion interrupt of the channel brings FENCE to or past the control
 * page's NOTIFY_FENCE (struct pvgpu_ctrl_page), and when the channel dies.
 * A pipe rather than an eventfd: pvgpud keeps the write end to itself, so
 * nothing the client does to its end (clearing O_NONBLOCK, filling it) can
 * make pvgpud's write block. */
struct pvgpu_chan_reply {
	pvgpu_u32 status;
	pvgpu_u32 chan_id;
	pvgpu_u32 mem_size;        /* PVGPU_CHAN_MEM_SIZE */
	pvgpu_u32 mode;            /* initial enum pvgpu_chan_mode */
};

struct pvgpu_chan_ref {
	pvgpu_u32 chan_id;
	pvgpu_u32 reserved;
};

struct pvgpu_status_reply {
	pvgpu_u32 status;
	pvgpu_u32 chan_id;         /* TASK_WEIGHT_REPLY: 0 */
};

/* Version 2, VMM only: the guest's weight for one of its tasks (the entity
 * <vm>/task-<pid_hint>), applied inside the VM's share, never enlarging it.
 * weight 1..PVGPU_WEIGHT_MAX sets it, 0 forgets it (back to the default). */
struct pvgpu_task_weight {
	pvgpu_u64 pid_hint;        /* non-zero */
	pvgpu_u32 weight;          /* 0 or PVGPU_WEIGHT_MIN..PVGPU_WEIGHT_MAX */
	pvgpu_u32 reserved;
};

enum pvgpu_chan_mode {
	PVGPU_MODE_DIRECT = 0,
	PVGPU_MODE_TRAPPED = 1,
	PVGPU_MODE_SHADOWED = 2,
};

/* Pushed by the daemon.  The client switches its mapping and answers with
 * MODE_ACK carrying the same mode_seq and the IB_PUT the guest last wrote
 * (for a client leaving SHADOWED: its shadow page's IB_PUT, which the daemon
 * then releases).  Unshadow is always SHADOWED -> TRAPPED -> DIRECT. */
struct pvgpu_mode {
	pvgpu_u32 chan_id;
	pvgpu_u32 mode;            /* enum pvgpu_chan_mode */
	pvgpu_u32 mode_seq;        /* increases per channel */
	pvgpu_u32 reserved;
};

struct pvgpu_mode_ack {
	pvgpu_u32 chan_id;
	pvgpu_u32 mode;
	pvgpu_u32 mode_seq;
	pvgpu_u32 guest_put;       /* IB_PUT as the guest last wrote it */
};

/* A VMM forwarded a trapped doorbell write. */
struct pvgpu_trap_report {
	pvgpu_u32 chan_id;
	pvgpu_u32 put;
};

/* Notice kinds */
#define PVGPU_NOTICE_WATCHDOG 1u   /* a kernel ran past the watchdog: channel dead */
#define PVGPU_NOTICE_BAD_ENTRY 2u  /* the GPU could not decode an entry: channel dead */
#define PVGPU_NOTICE_DEGRADED 3u   /* the client ignored a mode switch; enforced host-side */

struct pvgpu_notice {
	pvgpu_u32 kind;
	pvgpu_u32 chan_id;
	pvgpu_u64 pid_hint;        /* which guest task it was */
};

/* Version 5, VMM only: live migration (docs/protocol.md 2.6).
 *
 * QUIESCE holds every channel of the VM the way a move between GPUs does:
 * each is shadowed (the guest's doorbells are held), the work already on
 * the GPU completes, and then IB_GET and FENCE are final.  The message
 * carries one fd: a connected socket (SOCK_SEQPACKET or SOCK_DGRAM) of the
 * client's on which pvgpud sends one struct pvgpu_quiesce_done once every
 * channel has drained or the drain failed (send() with MSG_DONTWAIT: a
 * client that does not read cannot block pvgpud), so that a client whose
 * main loop is stopped (QEMU saving device state under its big lock) can
 * wait for it.  QUIESCE_REPLY follows on the connection with the same
 * status.  Channels the client opens while quiesced are held too.
 * RESUME gives the channels back to the policy as they were (a failed or
 * cancelled migration); a client that closes its connection while
 * quiesced (the source QEMU after a completed migration) frees them as any
 * disconnect does. */
struct pvgpu_quiesce {
	pvgpu_u32 timeout_ms;      /* 0: pvgpud's own bound (the watchdog + 1 s) */
	pvgpu_u32 reserved;
};

struct pvgpu_quiesce_done {
	pvgpu_u32 status;          /* PVGPU_OK: drained; E_STATE: a move or quiesce under way;
	                            * E_INTERNAL: the drain outlasted its bound */
	pvgpu_u32 channels;        /* channels held */
	pvgpu_u32 seq;             /* the QUIESCE's */
	pvgpu_u32 reserved;
};

/* CHAN_RESTORE: a channel re-created where another pvgpud left it (the
 * destination of a migration).  The fd is a regular file (a memfd) of at
 * least PVGPU_CHAN_MEM_SIZE bytes holding the control page and ring as
 * saved; pvgpud copies it into the new channel's memory, which starts with
 * IB_GET = ib_get, FENCE = fence and runs the entries from ib_get to ib_put
 * (at most PVGPU_RING_ENTRIES of them).  `mode` is the mode the guest had
 * mapped (informational: the destination's policy decides, and CHAN_REPLY
 * says what it chose). */
struct pvgpu_chan_restore {
	pvgpu_u64 pid_hint;
	char task_name[32];
	pvgpu_u32 ib_put;
	pvgpu_u32 ib_get;
	pvgpu_u32 fence;
	pvgpu_u32 mode;            /* enum pvgpu_chan_mode */
};

struct pvgpu_error {
	pvgpu_u32 status;          /* enum pvgpu_status */
	pvgpu_u32 reserved;
	char message[120];         /* NUL-terminated */
};

#ifdef __cplusplus
#define PVGPU_STATIC_ASSERT static_assert
#else
#define PVGPU_STATIC_ASSERT _Static_assert
#endif
PVGPU_STATIC_ASSERT(sizeof(struct pvgpu_msg_hdr) == 16, "header layout");
PVGPU_STATIC_ASSERT(sizeof(struct pvgpu_hello) == 96, "hello layout");
PVGPU_STATIC_ASSERT(sizeof(struct pvgpu_hello_reply) == 16, "hello reply layout");
PVGPU_STATIC_ASSERT(sizeof(struct pvgpu_chan_alloc) == 40, "alloc layout");
PVGPU_STATIC_ASSERT(sizeof(struct pvgpu_chan_reply) == 16, "chan reply layout");
PVGPU_STATIC_ASSERT(sizeof(struct pvgpu_mode) == 16, "mode layout");
PVGPU_STATIC_ASSERT(sizeof(struct pvgpu_mode_ack) == 16, "mode ack layout");
PVGPU_STATIC_ASSERT(sizeof(struct pvgpu_notice) == 16, "notice layout");
PVGPU_STATIC_ASSERT(sizeof(struct pvgpu_error) == 128, "error layout");
PVGPU_STATIC_ASSERT(sizeof(struct pvgpu_task_weight) == 16, "task weight layout");
PVGPU_STATIC_ASSERT(sizeof(struct pvgpu_quiesce) == 8, "quiesce layout");
PVGPU_STATIC_ASSERT(sizeof(struct pvgpu_quiesce_done) == 16, "quiesce done layout");
PVGPU_STATIC_ASSERT(sizeof(struct pvgpu_chan_restore) == 56, "chan restore layout");

#endif /* PVGPU_PROTOCOL_H */
