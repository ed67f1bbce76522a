/* SPDX-License-Identifier: GPL-2.0-or-later */
/*
 * Register interface of the pvgpu PCI device (docs/pvgpu-device.md sections
 * 3 to 5, VERSION 2 additions from the device's VERSION 2 interface).
 */
#ifndef PVGPU_REGS_H
#define PVGPU_REGS_H

#define PVGPU_PCI_VENDOR_ID	0x1234
#define PVGPU_PCI_DEVICE_ID	0x5047

#define PVGPU_MAGIC_VALUE	0x55504750	/* "PGPU" */
#define PVGPU_MAX_SLOTS		64

/* BAR numbers */
#define PVGPU_BAR_MBOX		0
#define PVGPU_BAR_CHANNELS	2	/* per slot: control page, doorbell page */
#define PVGPU_BAR_RINGS		4	/* per slot: the ring */
#define PVGPU_BAR2_STRIDE	0x2000
#define PVGPU_BAR4_STRIDE	0x1000

/* BAR0 mailbox registers */
#define PVGPU_REG_MAGIC		0x00
#define PVGPU_REG_VERSION	0x04
#define PVGPU_REG_NUM_SLOTS	0x08
#define PVGPU_REG_LINK		0x0c
#define PVGPU_REG_CMD		0x10
#define PVGPU_REG_CMD_STATUS	0x14
#define PVGPU_REG_ARG0		0x18
#define PVGPU_REG_ARG1		0x1c
#define PVGPU_REG_RESULT0	0x20
#define PVGPU_REG_RESULT1	0x24
#define PVGPU_REG_IRQ_STATUS	0x28
#define PVGPU_REG_IRQ_ACK	0x2c
#define PVGPU_REG_IRQ_MASK	0x30
#define PVGPU_REG_BAD_ACCESS	0x34
#define PVGPU_REG_LINK_GEN	0x38
#define PVGPU_REG_ARG2		0x3c	/* VERSION >= 2 */
#define PVGPU_REG_FENCE_DONE_LO	0x40
#define PVGPU_REG_FENCE_DONE_HI	0x44
#define PVGPU_REG_SLOT_STATE(i)		(0x100 + 16 * (i))
#define PVGPU_REG_SLOT_MODE(i)		(0x104 + 16 * (i))
#define PVGPU_REG_SLOT_CHAN_ID(i)	(0x108 + 16 * (i))
#define PVGPU_REG_SLOT_NOTICE(i)	(0x10c + 16 * (i))
#define PVGPU_REG_TASK_NAME(k)		(0xa00 + 4 * (k))	/* VERSION >= 2 */
#define PVGPU_TASK_NAME_LEN		32
#define PVGPU_REG_WAIT_STATUS(i)	(0x600 + 16 * (i))
#define PVGPU_REG_WAIT_FENCE(i)		(0x604 + 16 * (i))
#define PVGPU_REG_WAIT_ERROR(i)		(0x608 + 16 * (i))

/* CMD */
#define PVGPU_CMD_CHAN_ALLOC	1
#define PVGPU_CMD_CHAN_FREE	2
#define PVGPU_CMD_FENCE_WAIT	3
#define PVGPU_CMD_TASK_WEIGHT	4	/* VERSION >= 2 */

/* CMD_STATUS */
#define PVGPU_ST_OK		0
#define PVGPU_ST_BUSY		1
#define PVGPU_ST_E_INVALID	2
#define PVGPU_ST_E_NOSLOT	3
#define PVGPU_ST_E_LINK		4
#define PVGPU_ST_E_DAEMON	5

/* IRQ causes */
#define PVGPU_IRQ_CMD_DONE	BIT(0)
#define PVGPU_IRQ_NOTICE	BIT(1)
#define PVGPU_IRQ_LINK		BIT(2)
#define PVGPU_IRQ_FENCE		BIT(3)
#define PVGPU_IRQ_ALL		0xf
#define PVGPU_MSIX_VECTORS	3

/* SLOT_STATE */
#define PVGPU_SLOT_FREE		0
#define PVGPU_SLOT_PENDING	1
#define PVGPU_SLOT_LIVE		2
#define PVGPU_SLOT_LOST		3

/* WAIT_STATUS */
#define PVGPU_WS_NONE		0
#define PVGPU_WS_ARMED		1
#define PVGPU_WS_OK		2
#define PVGPU_WS_E_DEAD		3

#endif /* PVGPU_REGS_H */
