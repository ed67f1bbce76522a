// SPDX-License-Identifier: GPL-2.0-or-later
/*
 * pvgpu guest driver: GPU channels of the pvgpu PCI device for user space.
 *
 * The device (docs/pvgpu-device.md) gives the guest a mailbox in BAR0 to
 * allocate and free channels of the host daemon, and BAR windows onto each
 * channel's control page, doorbell and ring.  This driver owns the mailbox
 * and hands channels to processes through /dev/pvgpu (/dev/pvgpu1, ... for
 * further devices, one per host GPU the VM is given): ioctls to allocate,
 * free and wait on fences (include/pvgpu/guest_ioctl.h), and mmap of the
 * caller's own channel pages, so submission needs no system call.
 *
 * Locking, outermost first:
 *   io_sem (read)   every path that touches the device; remove takes it for
 *                   write after setting `dying`, so the BARs outlive users.
 *   pf->lock        a file's channel set; mmap and free hold it so that no
 *                   mapping of a slot is created after the slot was zapped.
 *   cmd_lock        one mailbox command at a time (taken with a timeout,
 *                   see pvgpu_mbox_lock()).
 *   weights_lock    the table of task weights.
 *   lock (spinlock) slot state shared with the interrupt handler.
 * No copy to or from user space happens under pf->lock or cmd_lock.
 */

#define pr_fmt(fmt) KBUILD_MODNAME ": " fmt

#include <linux/bitops.h>
#include <linux/delay.h>
#include <linux/capability.h>
#include <linux/cred.h>
#include <linux/fs.h>
#include <linux/idr.h>
#include <linux/interrupt.h>
#include <linux/io.h>
#include <linux/jiffies.h>
#include <linux/kref.h>
#include <linux/ktime.h>
#include <linux/miscdevice.h>
#include <linux/mm.h>
#include <linux/module.h>
#include <linux/mutex.h>
#include <linux/pci.h>
#include <linux/pid.h>
#include <linux/rwsem.h>
#include <linux/sched.h>
#include <linux/sched/signal.h>
#include <linux/slab.h>
#include <linux/spinlock.h>
#include <linux/uaccess.h>
#include <linux/wait.h>
#include <linux/workqueue.h>
#include <asm/unaligned.h>

#include "pvgpu/guest_ioctl.h"
#include "pvgpu/protocol.h"
#include "pvgpu/regs.h"

#define PVGPU_DRV_VERSION "0.1.0"
#define PVGPU_MAX_WEIGHTS 256	/* remembered task weights (bounded table) */

static bool msix = true;
module_param(msix, bool, 0444);
MODULE_PARM_DESC(msix, "Use MSI-X (default 1); 0 forces the legacy INTx interrupt");

static bool pid_hints = true;
module_param(pid_hints, bool, 0444);
MODULE_PARM_DESC(pid_hints,
		 "Tag each channel with its process (tgid) so the host schedules processes separately (default 1); 0 puts all channels in the VM's entity");

static unsigned int weights_per_uid = 64;
module_param(weights_per_uid, uint, 0644);
MODULE_PARM_DESC(weights_per_uid,
		 "How many of the 256 remembered task weights the live processes of one user may hold (default 64); CAP_SYS_NICE is exempt");

static unsigned int cmd_timeout_ms = 5000;
module_param(cmd_timeout_ms, uint, 0644);
MODULE_PARM_DESC(cmd_timeout_ms,
		 "How long a mailbox command may wait for the host daemon, in ms (default 5000)");

/* Driver view of a slot (the device's SLOT_STATE is the authority on use). */
enum pvgpu_slot_use {
	PVGPU_USE_FREE,		/* not held by this driver */
	PVGPU_USE_OWNED,	/* a channel of an open file */
	PVGPU_USE_ZOMBIE,	/* the device holds it, nobody owns it: free it */
	PVGPU_USE_FREEING,	/* CHAN_FREE sent, the daemon has not answered yet */
};

struct pvgpu_file;

struct pvgpu_slot {
	enum pvgpu_slot_use use;
	struct pvgpu_file *owner;
	struct pid *tgid;	/* allocating process (a reference; no reuse) */
	u64 hint;
	u32 chan_id;
	u32 link_gen;		/* LINK_GEN when allocated */
	u32 alloc_seq;		/* tells one allocation of the slot from the next */
	struct address_space *mapping;	/* where the owner's mappings live */
	/* fence waits (see pvgpu_wait()) */
	struct list_head waiters;
	wait_queue_head_t wq;
	u32 event_seq;		/* bumped on every change a waiter must see */
	bool armed;		/* the device has a wait armed on the slot */
	u32 wait_ends;		/* device wait endings seen (IRQ handler, arm) */
	bool reached_valid;
	u32 reached;		/* a fence the device reported reached */
	/*
	 * wait_ends when `reached` was set: a waiter trusts it only if it
	 * was set after the waiter registered.  A value from long ago may
	 * be 2^31 fences behind, where the wrap-around compare inverts.
	 */
	u32 reached_gen;
	bool dead;		/* the channel died: waits end DEAD until freed */
	u32 dead_error;
};

struct pvgpu_waiter {
	struct list_head node;
	u32 fence;
};

struct pvgpu_weight {
	struct pid *pid;	/* NULL: unused entry */
	kuid_t uid;		/* whose share of the table it takes */
	u32 weight;
};

enum pvgpu_stale {
	PVGPU_STALE_NONE,
	PVGPU_STALE_ALLOC,	/* its slot, if it arrives, must be freed */
	PVGPU_STALE_FREE,	/* stale_slot becomes free when it completes */
	PVGPU_STALE_OTHER,
};

struct pvgpu_dev {
	struct kref ref;
	struct pci_dev *pdev;
	void __iomem *mbox;
	void __iomem *chan_bar;		/* BAR2: the kernel reads FENCE/STATUS */
	resource_size_t chan_phys;	/* BAR2 */
	resource_size_t ring_phys;	/* BAR4 */
	u32 version;
	u32 num_slots;
	u32 irq_mode;			/* PVGPU_IRQ_MSIX or PVGPU_IRQ_INTX */
	int nvec;
	int index;			/* -1: none; 0 is /dev/pvgpu, n is /dev/pvgpu<n> */
	char node_name[16];
	struct miscdevice misc;
	bool misc_registered;

	struct rw_semaphore io_sem;
	bool dying;

	struct mutex cmd_lock;		/* one mailbox command at a time */
	wait_queue_head_t mbox_wq;	/* cmd_lock released */
	wait_queue_head_t cmd_wq;	/* CMD_DONE */
	enum pvgpu_stale stale;		/* a command that outlived its caller */
	u32 stale_slot;

	spinlock_t lock;		/* slots[], with the IRQ handler */
	struct pvgpu_slot slots[PVGPU_MAX_SLOTS];
	u32 alloc_seq;

	struct mutex weights_lock;	/* weights[], weights_gen */
	struct pvgpu_weight weights[PVGPU_MAX_WEIGHTS];
	u32 weights_gen;		/* LINK_GEN the weights were sent under */
	bool weights_sent;

	struct work_struct link_work;
	struct work_struct reap_work;
};

struct pvgpu_file {
	struct pvgpu_dev *dev;
	struct mutex lock;		/* mmap against free of this file's slots */
};

/*
 * One node per device, numbered in probe (PCI) order: the first is
 * /dev/pvgpu, as a one-device guest has always had it; the others are
 * /dev/pvgpu1, /dev/pvgpu2, ...  An unplugged device's number is reused.
 */
#define PVGPU_MAX_DEVICES 16
static DEFINE_IDA(pvgpu_ida);

static u32 pvgpu_rd(struct pvgpu_dev *dev, u32 reg)
{
	return readl(dev->mbox + reg);
}

static void pvgpu_wr(struct pvgpu_dev *dev, u32 reg, u32 val)
{
	writel(val, dev->mbox + reg);
}

static bool fence_reached(u32 now, u32 fence)
{
	return (s32)(now - fence) >= 0;
}

static long pvgpu_cmd_jiffies(void)
{
	return msecs_to_jiffies(cmd_timeout_ms ? cmd_timeout_ms : 1);
}

static void pvgpu_dev_free(struct kref *ref)
{
	struct pvgpu_dev *dev = container_of(ref, struct pvgpu_dev, ref);
	int i;

	for (i = 0; i < PVGPU_MAX_WEIGHTS; i++)
		put_pid(dev->weights[i].pid);
	/* The number stays taken while an open file keeps dev. */
	if (dev->index >= 0)
		ida_free(&pvgpu_ida, dev->index);
	pci_dev_put(dev->pdev);
	kfree(dev);
}

/* ---- mailbox ------------------------------------------------------------ */

static bool pvgpu_cmd_settled(struct pvgpu_dev *dev)
{
	return pvgpu_rd(dev, PVGPU_REG_CMD_STATUS) != PVGPU_CMDST_BUSY;
}

static void pvgpu_slot_reset(struct pvgpu_slot *s)
{
	s->use = PVGPU_USE_FREE;
	s->owner = NULL;
	put_pid(s->tgid);	/* does not sleep (f_modown() does it under a lock) */
	s->tgid = NULL;
	s->hint = 0;
	s->chan_id = 0;
	s->mapping = NULL;
	s->armed = false;
	s->reached_valid = false;
	s->dead = false;
	s->dead_error = 0;
	s->event_seq++;
}

static bool pvgpu_has_zombies(struct pvgpu_dev *dev)
{
	unsigned long flags;
	bool any = false;
	u32 i;

	spin_lock_irqsave(&dev->lock, flags);
	for (i = 0; i < dev->num_slots; i++)
		any |= dev->slots[i].use == PVGPU_USE_ZOMBIE;
	spin_unlock_irqrestore(&dev->lock, flags);
	return any;
}

/*
 * A command that its caller stopped waiting for (timeout, signal) keeps the
 * mailbox busy.  Before the next command, wait for it and finish its
 * business: a channel it allocated has no owner any more and is freed.
 */
static int pvgpu_mbox_settle(struct pvgpu_dev *dev, long timeout)
{
	unsigned long flags;
	u32 status, slot;

	if (dev->stale == PVGPU_STALE_NONE)
		return 0;
	if (!wait_event_timeout(dev->cmd_wq,
				pvgpu_cmd_settled(dev) || READ_ONCE(dev->dying),
				timeout))
		return -ETIME;	/* the daemon still has not answered it */
	if (!pvgpu_cmd_settled(dev))
		return -ENODEV;
	status = pvgpu_rd(dev, PVGPU_REG_CMD_STATUS);
	slot = pvgpu_rd(dev, PVGPU_REG_RESULT0);
	spin_lock_irqsave(&dev->lock, flags);
	if (dev->stale == PVGPU_STALE_ALLOC && status == PVGPU_CMDST_OK &&
	    slot < dev->num_slots && dev->slots[slot].use == PVGPU_USE_FREE) {
		dev->slots[slot].use = PVGPU_USE_ZOMBIE;
	} else if (dev->stale == PVGPU_STALE_FREE) {
		pvgpu_slot_reset(&dev->slots[dev->stale_slot]);
	}
	dev->stale = PVGPU_STALE_NONE;
	spin_unlock_irqrestore(&dev->lock, flags);
	return 0;
}

/*
 * Take the mailbox.  A plain mutex would make a fence wait or a killed
 * process sit behind an allocation that waits for the daemon, so the lock is
 * taken with a timeout and, if asked, interruptibly.
 */
static int pvgpu_mbox_lock(struct pvgpu_dev *dev, long timeout, bool interruptible)
{
	long left;
	int ret;

	if (interruptible)
		left = wait_event_interruptible_timeout(dev->mbox_wq,
							mutex_trylock(&dev->cmd_lock),
							timeout);
	else
		left = wait_event_timeout(dev->mbox_wq,
					  mutex_trylock(&dev->cmd_lock), timeout);
	if (left < 0)
		return -EINTR;
	if (left == 0)
		return -ETIME;
	ret = pvgpu_mbox_settle(dev, left);
	if (ret) {
		mutex_unlock(&dev->cmd_lock);
		wake_up(&dev->mbox_wq);
	}
	return ret;
}

static void pvgpu_mbox_unlock(struct pvgpu_dev *dev)
{
	/*
	 * A stale command whose CMD_DONE came before it was marked stale
	 * (the IRQ handler then saw nothing to settle) is settled from the
	 * work too, not left to the next mailbox user.
	 */
	bool reap = dev->stale == PVGPU_STALE_NONE ? pvgpu_has_zombies(dev)
						    : pvgpu_cmd_settled(dev);

	mutex_unlock(&dev->cmd_lock);
	wake_up(&dev->mbox_wq);
	if (reap && !READ_ONCE(dev->dying))
		schedule_work(&dev->reap_work);
}

/*
 * Run one command with the mailbox held.  Returns its CMD_STATUS, or a
 * negative errno if the caller gave up (the command is then stale and
 * settled by the next mailbox user).
 */
static int pvgpu_cmd(struct pvgpu_dev *dev, u32 cmd, u32 arg0, u32 arg1,
		     u32 arg2, u32 *r0, u32 *r1, bool interruptible,
		     enum pvgpu_stale stale, u32 stale_slot)
{
	long left;
	u32 status;

	lockdep_assert_held(&dev->cmd_lock);
	pvgpu_wr(dev, PVGPU_REG_ARG0, arg0);
	pvgpu_wr(dev, PVGPU_REG_ARG1, arg1);
	if (dev->version >= 2)
		pvgpu_wr(dev, PVGPU_REG_ARG2, arg2);
	pvgpu_wr(dev, PVGPU_REG_CMD, cmd);

	if (interruptible)
		left = wait_event_interruptible_timeout(dev->cmd_wq,
							pvgpu_cmd_settled(dev) ||
							READ_ONCE(dev->dying),
							pvgpu_cmd_jiffies());
	else
		left = wait_event_timeout(dev->cmd_wq,
					  pvgpu_cmd_settled(dev) ||
					  READ_ONCE(dev->dying),
					  pvgpu_cmd_jiffies());
	if (left <= 0 || !pvgpu_cmd_settled(dev)) {
		dev->stale = stale;
		dev->stale_slot = stale_slot;
		if (READ_ONCE(dev->dying))
			return -ENODEV;
		return left < 0 ? -EINTR : -ETIMEDOUT;
	}
	status = pvgpu_rd(dev, PVGPU_REG_CMD_STATUS);
	if (r0)
		*r0 = pvgpu_rd(dev, PVGPU_REG_RESULT0);
	if (r1)
		*r1 = pvgpu_rd(dev, PVGPU_REG_RESULT1);
	return status;
}

/* Free every slot nobody owns.  Called with the mailbox held. */
static void pvgpu_reap_locked(struct pvgpu_dev *dev)
{
	unsigned long flags;
	u32 i;
	int st;

	for (i = 0; i < dev->num_slots && dev->stale == PVGPU_STALE_NONE; i++) {
		spin_lock_irqsave(&dev->lock, flags);
		if (dev->slots[i].use != PVGPU_USE_ZOMBIE) {
			spin_unlock_irqrestore(&dev->lock, flags);
			continue;
		}
		dev->slots[i].use = PVGPU_USE_FREEING;
		spin_unlock_irqrestore(&dev->lock, flags);

		st = pvgpu_cmd(dev, PVGPU_CMD_CHAN_FREE, i, 0, 0, NULL, NULL,
			       false, PVGPU_STALE_FREE, i);
		if (st < 0) {
			dev_warn(&dev->pdev->dev,
				 "slot %u: CHAN_FREE not answered within %u ms; freed when the daemon answers\n",
				 i, cmd_timeout_ms);
			break;
		}
		/* E_INVALID: the device no longer holds it (reset): free too. */
		if (st != PVGPU_CMDST_OK)
			dev_warn(&dev->pdev->dev, "slot %u: CHAN_FREE status %d\n", i, st);
		spin_lock_irqsave(&dev->lock, flags);
		pvgpu_slot_reset(&dev->slots[i]);
		spin_unlock_irqrestore(&dev->lock, flags);
	}
}

/* Free unowned slots now if the mailbox can be had, else from the work. */
static void pvgpu_reap(struct pvgpu_dev *dev)
{
	if (pvgpu_mbox_lock(dev, pvgpu_cmd_jiffies(), false)) {
		schedule_work(&dev->reap_work);
		return;
	}
	pvgpu_reap_locked(dev);
	pvgpu_mbox_unlock(dev);
}

static void pvgpu_reap_work(struct work_struct *work)
{
	struct pvgpu_dev *dev = container_of(work, struct pvgpu_dev, reap_work);

	down_read(&dev->io_sem);
	if (!dev->dying && !pvgpu_mbox_lock(dev, pvgpu_cmd_jiffies(), false)) {
		pvgpu_reap_locked(dev);
		/* not pvgpu_mbox_unlock(): no rescheduling from the work itself */
		mutex_unlock(&dev->cmd_lock);
		wake_up(&dev->mbox_wq);
	}
	up_read(&dev->io_sem);
}

/* ---- task weights --------------------------------------------------------- */

static bool pvgpu_pid_alive(struct pid *pid)
{
	bool alive;

	rcu_read_lock();
	alive = pid_task(pid, PIDTYPE_TGID);
	rcu_read_unlock();
	return alive;
}

/* The entry of `tgid` (init namespace), or NULL.  weights_lock held. */
static struct pvgpu_weight *pvgpu_weight_find(struct pvgpu_dev *dev, pid_t tgid)
{
	int i;

	for (i = 0; i < PVGPU_MAX_WEIGHTS; i++) {
		struct pvgpu_weight *w = &dev->weights[i];

		if (w->pid && pid_nr(w->pid) == tgid && pvgpu_pid_alive(w->pid))
			return w;
	}
	return NULL;
}

/* The weight of `tgid`: its entry's, else the default.  weights_lock held. */
static u32 pvgpu_weight_of_locked(struct pvgpu_dev *dev, pid_t tgid)
{
	struct pvgpu_weight *w = pvgpu_weight_find(dev, tgid);

	return w ? w->weight : PVGPU_WEIGHT_DEFAULT;
}

static u32 pvgpu_weight_of(struct pvgpu_dev *dev, pid_t tgid)
{
	u32 weight;

	mutex_lock(&dev->weights_lock);
	weight = pvgpu_weight_of_locked(dev, tgid);
	mutex_unlock(&dev->weights_lock);
	return weight;
}

/* Drop entries of processes that exited, without telling the daemon. */
static void pvgpu_weights_prune(struct pvgpu_dev *dev)
{
	int i;

	for (i = 0; i < PVGPU_MAX_WEIGHTS; i++) {
		struct pvgpu_weight *w = &dev->weights[i];

		if (w->pid && !pvgpu_pid_alive(w->pid)) {
			put_pid(w->pid);
			w->pid = NULL;
		}
	}
}

/*
 * Make the daemon forget the weight of `w`'s process (TASK_WEIGHT with
 * weight 0) and drop the entry: the process has exited, and a new process
 * given the same pid must start at the default weight, not inherit this one.
 * weights_lock and the mailbox held.  A command left unanswered keeps the
 * entry (to be forgotten later) and returns its error: the mailbox is stale.
 */
static int pvgpu_weight_forget(struct pvgpu_dev *dev, struct pvgpu_weight *w)
{
	u32 r1 = 0;
	int st;

	st = pvgpu_cmd(dev, PVGPU_CMD_TASK_WEIGHT, pid_nr(w->pid), 0, 0, NULL, &r1,
		       false, PVGPU_STALE_OTHER, 0);
	if (st < 0)
		return st;
	/* E_LINK: no daemon now; the next one never knew the weight. */
	if (st != PVGPU_CMDST_OK && st != PVGPU_CMDST_E_LINK)
		dev_warn_ratelimited(&dev->pdev->dev,
				     "forgetting the weight of exited pid %d failed: status %d\n",
				     pid_nr(w->pid), st);
	put_pid(w->pid);
	w->pid = NULL;
	return 0;
}

/*
 * Forget the weights of processes that have exited, and that of `exiting`
 * (a process past its last use of the device; NULL: none), at the daemon
 * too.  The daemon bounds what it remembers per VM, and only the guest knows
 * that a pid is gone.  weights_lock and the mailbox held.
 */
static int pvgpu_weights_sweep(struct pvgpu_dev *dev, struct pid *exiting)
{
	int i, ret;

	for (i = 0; i < PVGPU_MAX_WEIGHTS; i++) {
		struct pvgpu_weight *w = &dev->weights[i];

		if (!w->pid || (w->pid != exiting && pvgpu_pid_alive(w->pid)))
			continue;
		ret = pvgpu_weight_forget(dev, w);
		if (ret)
			return ret;
	}
	return 0;
}

/* Whether the table holds an entry to sweep.  weights_lock held. */
static bool pvgpu_weights_stale(struct pvgpu_dev *dev, struct pid *exiting)
{
	int i;

	for (i = 0; i < PVGPU_MAX_WEIGHTS; i++) {
		struct pvgpu_weight *w = &dev->weights[i];

		if (w->pid && (w->pid == exiting || !pvgpu_pid_alive(w->pid)))
			return true;
	}
	return false;
}

/*
 * Sweep the table now if there is something to sweep (see
 * pvgpu_weights_sweep()): before an allocation, so that a process reusing
 * the pid of an exited weighted one starts at the default weight, and when
 * a process that had a weight exits.  Best effort: a busy mailbox leaves
 * the entries for the next sweep.  io_sem held (read).
 */
static void pvgpu_weights_tidy(struct pvgpu_dev *dev, struct pid *exiting)
{
	if (dev->version < 2)
		return;
	mutex_lock(&dev->weights_lock);
	if (pvgpu_weights_stale(dev, exiting) &&
	    !pvgpu_mbox_lock(dev, pvgpu_cmd_jiffies(), false)) {
		pvgpu_weights_sweep(dev, exiting);
		pvgpu_mbox_unlock(dev);
	}
	mutex_unlock(&dev->weights_lock);
}

/*
 * The entry a new weight of `pid` goes to: its own, else a free one within
 * `uid`'s share of the table (unless `exempt`).  -EDQUOT: the user's live
 * processes hold weights_per_uid entries; -ENOSPC: the table is full of
 * live processes' weights.  weights_lock held, exited entries swept.
 */
static struct pvgpu_weight *pvgpu_weight_slot(struct pvgpu_dev *dev, struct pid *pid,
					       kuid_t uid, bool exempt)
{
	struct pvgpu_weight *w, *free = NULL;
	unsigned int mine = 0;
	int i;

	for (i = 0; i < PVGPU_MAX_WEIGHTS; i++) {
		w = &dev->weights[i];
		if (w->pid == pid)
			return w;
		if (!w->pid) {
			if (!free)
				free = w;
			continue;
		}
		if (uid_eq(w->uid, uid))
			mine++;
	}
	if (!exempt && mine >= READ_ONCE(weights_per_uid))
		return ERR_PTR(-EDQUOT);
	return free ? free : ERR_PTR(-ENOSPC);
}

static int pvgpu_weight_errno(int st, u32 r1)
{
	switch (st) {
	case PVGPU_CMDST_OK:
		return 0;
	case PVGPU_CMDST_E_INVALID:
		return -EINVAL;
	case PVGPU_CMDST_E_LINK:
		return -ENOLINK;
	case PVGPU_CMDST_E_DAEMON:
		return r1 == PVGPU_E_LIMIT ? -ENOSPC : -EIO;
	default:
		return st < 0 ? st : -EIO;
	}
}

/* After a daemon restart the new daemon knows no weights: send them again. */
static void pvgpu_weights_resend(struct pvgpu_dev *dev, u32 gen)
{
	u32 r1 = 0;
	int i, st;

	mutex_lock(&dev->weights_lock);
	if (dev->weights_sent && dev->weights_gen == gen) {
		mutex_unlock(&dev->weights_lock);
		return;
	}
	pvgpu_weights_prune(dev);
	if (pvgpu_mbox_lock(dev, pvgpu_cmd_jiffies(), false)) {
		mutex_unlock(&dev->weights_lock);
		return;
	}
	for (i = 0; i < PVGPU_MAX_WEIGHTS; i++) {
		struct pvgpu_weight *w = &dev->weights[i];

		if (!w->pid)
			continue;
		st = pvgpu_cmd(dev, PVGPU_CMD_TASK_WEIGHT, pid_nr(w->pid), 0,
			       w->weight, NULL, &r1, false, PVGPU_STALE_OTHER, 0);
		if (st < 0)
			break;
		if (st != PVGPU_CMDST_OK)
			dev_warn(&dev->pdev->dev,
				 "re-sending the weight of pid %d failed: errno %d\n",
				 pid_nr(w->pid), -pvgpu_weight_errno(st, r1));
	}
	pvgpu_mbox_unlock(dev);
	if (i == PVGPU_MAX_WEIGHTS) {
		dev->weights_sent = true;
		dev->weights_gen = gen;
	}
	mutex_unlock(&dev->weights_lock);
}

/* ---- link changes --------------------------------------------------------- */

static void pvgpu_mark_dead(struct pvgpu_slot *s, u32 error)
{
	if (!s->dead) {
		s->dead = true;
		s->dead_error = error;
	}
	s->event_seq++;
	wake_up_all(&s->wq);
}

/*
 * Losing the daemon loses every channel (the device marks its slots LOST and
 * may later re-allocate them in place as fresh channels).  Either way the
 * owner's channel is gone: its waits end DEAD/LOST until it frees the handle.
 */
static void pvgpu_link_work(struct work_struct *work)
{
	struct pvgpu_dev *dev = container_of(work, struct pvgpu_dev, link_work);
	unsigned long flags;
	u32 link, gen, i, state;

	down_read(&dev->io_sem);
	if (dev->dying)
		goto out;
	link = pvgpu_rd(dev, PVGPU_REG_LINK);
	gen = pvgpu_rd(dev, PVGPU_REG_LINK_GEN);
	for (i = 0; i < dev->num_slots; i++) {
		state = pvgpu_rd(dev, PVGPU_REG_SLOT(i, PVGPU_SLOT_REG_STATE));
		spin_lock_irqsave(&dev->lock, flags);
		if (dev->slots[i].use == PVGPU_USE_OWNED &&
		    (state == PVGPU_SLOT_LOST || dev->slots[i].link_gen != gen)) {
			if (!dev->slots[i].dead)
				dev_info(&dev->pdev->dev,
					 "slot %u: channel lost with the daemon link\n", i);
			pvgpu_mark_dead(&dev->slots[i], PVGPU_CHAN_ERR_LOST);
		}
		spin_unlock_irqrestore(&dev->lock, flags);
	}
	if (link == PVGPU_LINK_READY && dev->version >= 2)
		pvgpu_weights_resend(dev, gen);
	if (pvgpu_has_zombies(dev))
		pvgpu_reap(dev);
out:
	up_read(&dev->io_sem);
}

/* ---- interrupts ------------------------------------------------------------ */

static void pvgpu_fence_irq(struct pvgpu_dev *dev)
{
	unsigned long done, flags;
	u32 lo, hi, i, ws, we, wf, wf2;
	struct pvgpu_slot *s;

	lo = pvgpu_rd(dev, PVGPU_REG_FENCE_DONE_LO);
	if (lo)
		pvgpu_wr(dev, PVGPU_REG_FENCE_DONE_LO, lo);
	hi = dev->num_slots > 32 ? pvgpu_rd(dev, PVGPU_REG_FENCE_DONE_HI) : 0;
	if (hi)
		pvgpu_wr(dev, PVGPU_REG_FENCE_DONE_HI, hi);
	done = (unsigned long)lo | ((unsigned long)hi << 32);

	for_each_set_bit(i, &done, dev->num_slots) {
		/*
		 * Another CPU may arm the slot's next wait while these are
		 * read (pvgpu_arm() holds only the mailbox): the target before
		 * and after the status, so that an OK is believed only for the
		 * target it ended; the error after the status it goes with.
		 */
		wf = pvgpu_rd(dev, PVGPU_REG_WAIT(i, PVGPU_WAIT_REG_FENCE));
		ws = pvgpu_rd(dev, PVGPU_REG_WAIT(i, PVGPU_WAIT_REG_STATUS));
		we = pvgpu_rd(dev, PVGPU_REG_WAIT(i, PVGPU_WAIT_REG_ERROR));
		wf2 = pvgpu_rd(dev, PVGPU_REG_WAIT(i, PVGPU_WAIT_REG_FENCE));
		s = &dev->slots[i];
		spin_lock_irqsave(&dev->lock, flags);
		if (s->use == PVGPU_USE_OWNED && ws != PVGPU_WAITST_ARMED) {
			s->armed = false;
			s->wait_ends++;
			if (ws == PVGPU_WAITST_OK && wf == wf2) {
				if (!s->reached_valid || fence_reached(wf, s->reached))
					s->reached = wf;
				s->reached_valid = true;
				s->reached_gen = s->wait_ends;
			} else if (ws == PVGPU_WAITST_E_DEAD) {
				pvgpu_mark_dead(s, we ? we : PVGPU_CHAN_ERR_LOST);
			}
			s->event_seq++;
			wake_up_all(&s->wq);
		}
		spin_unlock_irqrestore(&dev->lock, flags);
	}
}

static irqreturn_t pvgpu_irq(int irq, void *data)
{
	struct pvgpu_dev *dev = data;
	u32 status;

	status = pvgpu_rd(dev, PVGPU_REG_IRQ_STATUS);
	/* All ones: the device is gone (surprise removal); not ours to claim. */
	if (status == ~0u)
		return IRQ_NONE;
	status &= PVGPU_IRQ_ALL;
	if (!status)
		return IRQ_NONE;
	/* Ack before scanning: a cause set again meanwhile raises a new interrupt. */
	pvgpu_wr(dev, PVGPU_REG_IRQ_ACK, status);
	if (status & PVGPU_IRQ_CMD_DONE) {
		wake_up_all(&dev->cmd_wq);
		if (dev->stale != PVGPU_STALE_NONE)
			schedule_work(&dev->reap_work);
	}
	if (status & PVGPU_IRQ_FENCE)
		pvgpu_fence_irq(dev);
	if (status & (PVGPU_IRQ_LINK | PVGPU_IRQ_NOTICE))
		schedule_work(&dev->link_work);
	return IRQ_HANDLED;
}

/* ---- file operations -------------------------------------------------------- */

/*
 * The caller's slot for `handle`, or NULL: a handle is usable only through
 * the open file that allocated it and only by the allocating process.
 * dev->lock held.
 */
static struct pvgpu_slot *pvgpu_own_slot(struct pvgpu_file *pf, u32 handle)
{
	struct pvgpu_dev *dev = pf->dev;
	struct pvgpu_slot *s;

	if (handle >= dev->num_slots)
		return NULL;
	s = &dev->slots[handle];
	if (s->use != PVGPU_USE_OWNED || s->owner != pf || s->tgid != task_tgid(current))
		return NULL;
	return s;
}

static int pvgpu_open(struct inode *inode, struct file *filp)
{
	struct pvgpu_dev *dev = container_of(filp->private_data, struct pvgpu_dev, misc);
	struct pvgpu_file *pf;

	/* misc_open() calls us under misc_mtx: remove cannot free dev meanwhile. */
	pf = kzalloc(sizeof(*pf), GFP_KERNEL);
	if (!pf)
		return -ENOMEM;
	kref_get(&dev->ref);
	pf->dev = dev;
	mutex_init(&pf->lock);
	filp->private_data = pf;
	return nonseekable_open(inode, filp);
}

/*
 * Take a channel away from its owner: zap the mappings first so that no
 * store reaches the slot once it can be reallocated, wake the waiters (they
 * see the slot is no longer theirs), and leave the slot to pvgpu_reap().
 * pf->lock held (no mmap of the slot can run meanwhile).
 */
static void pvgpu_disown(struct pvgpu_file *pf, u32 slot)
{
	struct pvgpu_dev *dev = pf->dev;
	struct pvgpu_slot *s = &dev->slots[slot];
	unsigned long flags;

	lockdep_assert_held(&pf->lock);
	if (s->mapping)
		unmap_mapping_range(s->mapping, PVGPU_MMAP_OFFSET(slot),
				    PVGPU_MMAP_CHANNEL_SIZE, 1);
	spin_lock_irqsave(&dev->lock, flags);
	s->use = PVGPU_USE_ZOMBIE;
	s->owner = NULL;
	s->event_seq++;
	wake_up_all(&s->wq);
	spin_unlock_irqrestore(&dev->lock, flags);
}

/*
 * Free the file's channels: all, or those of process `tgid` and of
 * processes that have exited (a process that closed its descriptor or kept
 * only a mapping, while a child holds the file, exits without a flush in
 * its own context).  pf->lock held.
 */
static void pvgpu_release_channels(struct pvgpu_file *pf, bool all, struct pid *tgid)
{
	struct pvgpu_dev *dev = pf->dev;
	unsigned long flags;
	bool match, any = false;
	u32 i;

	for (i = 0; i < dev->num_slots; i++) {
		struct pvgpu_slot *s = &dev->slots[i];

		spin_lock_irqsave(&dev->lock, flags);
		match = s->use == PVGPU_USE_OWNED && s->owner == pf &&
			(all || s->tgid == tgid || !pid_has_task(s->tgid, PIDTYPE_TGID));
		spin_unlock_irqrestore(&dev->lock, flags);
		if (match) {
			pvgpu_disown(pf, i);
			any = true;
		}
	}
	if (any && !READ_ONCE(dev->dying))
		pvgpu_reap(dev);
}

/*
 * Channels belong to the open file and to the process that allocated them.
 * A forked child that shares the file cannot use them; when the allocating
 * process exits while the file lives on (a child still holds it), its
 * channels are freed here, on the final close of its file table, or on the
 * next close of the file by anyone once it has exited.
 */
static int pvgpu_flush(struct file *filp, fl_owner_t id)
{
	struct pvgpu_file *pf = filp->private_data;
	struct pvgpu_dev *dev = pf->dev;
	bool exiting = current->flags & PF_EXITING;

	down_read(&dev->io_sem);
	mutex_lock(&pf->lock);
	pvgpu_release_channels(pf, false, exiting ? task_tgid(current) : NULL);
	mutex_unlock(&pf->lock);
	/*
	 * The whole process is exiting (its last thread is past
	 * signal->live): its weight is forgotten now, at the daemon too.  Its
	 * pid cannot be reused before it is reaped.  A process that closed
	 * the file before exiting is swept later (SET_WEIGHT, ALLOC).
	 */
	if (exiting && !atomic_read(&current->signal->live) && !dev->dying)
		pvgpu_weights_tidy(dev, task_tgid(current));
	up_read(&dev->io_sem);
	return 0;
}

static int pvgpu_release(struct inode *inode, struct file *filp)
{
	struct pvgpu_file *pf = filp->private_data;
	struct pvgpu_dev *dev = pf->dev;

	down_read(&dev->io_sem);
	mutex_lock(&pf->lock);
	pvgpu_release_channels(pf, true, NULL);
	mutex_unlock(&pf->lock);
	up_read(&dev->io_sem);
	kref_put(&dev->ref, pvgpu_dev_free);
	kfree(pf);
	return 0;
}

static u32 pvgpu_slots_used(struct pvgpu_dev *dev)
{
	u32 i, used = 0;

	for (i = 0; i < dev->num_slots; i++)
		used += pvgpu_rd(dev, PVGPU_REG_SLOT(i, PVGPU_SLOT_REG_STATE)) != PVGPU_SLOT_FREE;
	return used;
}

static u64 pvgpu_caller_hint(void)
{
	return pid_hints ? (u64)current->tgid : 0;
}

/*
 * The ioctl handlers below take their argument copied in and leave what
 * goes back in it: pvgpu_ioctl() copies outside io_sem (see there).
 */
static long pvgpu_ioc_info(struct pvgpu_file *pf, struct pvgpu_ioc_info *info)
{
	struct pvgpu_dev *dev = pf->dev;
	unsigned long flags;
	u32 i;

	if (info->size != sizeof(*info) || info->flags)
		return -EINVAL;
	memset(info, 0, sizeof(*info));
	info->size = sizeof(*info);
	info->abi_version = PVGPU_GUEST_ABI_VERSION;
	info->device_version = dev->version;
	info->num_slots = dev->num_slots;
	info->slots_used = pvgpu_slots_used(dev);
	info->link = pvgpu_rd(dev, PVGPU_REG_LINK);
	info->link_gen = pvgpu_rd(dev, PVGPU_REG_LINK_GEN);
	info->pid_hints = pid_hints;
	spin_lock_irqsave(&dev->lock, flags);
	for (i = 0; i < dev->num_slots; i++)
		info->channels += dev->slots[i].use == PVGPU_USE_OWNED &&
				  dev->slots[i].owner == pf;
	spin_unlock_irqrestore(&dev->lock, flags);
	info->pid_hint = pvgpu_caller_hint();
	info->weight = pvgpu_weight_of(dev, current->tgid);
	info->irq_mode = dev->irq_mode;
	return 0;
}

static int pvgpu_alloc_errno(int st, u32 r1)
{
	switch (st) {
	case PVGPU_CMDST_E_NOSLOT:
		return -ENOSPC;
	case PVGPU_CMDST_E_LINK:
		return -ENOLINK;
	case PVGPU_CMDST_E_DAEMON:
		if (r1 == PVGPU_E_LIMIT)
			return -EDQUOT;
		if (r1 == PVGPU_E_STATE)
			return -EBUSY;
		return -EIO;
	default:
		return st < 0 ? st : -EIO;
	}
}

static void pvgpu_write_task_name(struct pvgpu_dev *dev)
{
	char comm[TASK_COMM_LEN];
	char name[PVGPU_TASK_NAME_LEN] = {};
	int k;

	/* NUL-padded, little-endian bytes; the device sanitises the bytes. */
	get_task_comm(comm, current);
	strscpy(name, comm, sizeof(name));
	for (k = 0; k < PVGPU_TASK_NAME_LEN / 4; k++)
		pvgpu_wr(dev, PVGPU_REG_TASK_NAME + 4 * k,
			 get_unaligned_le32(name + 4 * k));
}

/* Free the caller's channel `handle`; false if it is not the caller's. */
static bool pvgpu_free_handle(struct pvgpu_file *pf, u32 handle)
{
	struct pvgpu_dev *dev = pf->dev;
	unsigned long flags;
	bool own;

	mutex_lock(&pf->lock);
	spin_lock_irqsave(&dev->lock, flags);
	own = pvgpu_own_slot(pf, handle);
	spin_unlock_irqrestore(&dev->lock, flags);
	if (own)
		pvgpu_disown(pf, handle);
	mutex_unlock(&pf->lock);
	if (own)
		pvgpu_reap(dev);
	return own;
}

static long pvgpu_ioc_alloc(struct pvgpu_file *pf, struct pvgpu_ioc_alloc *req)
{
	struct pvgpu_dev *dev = pf->dev;
	unsigned long flags;
	struct pvgpu_slot *s;
	u32 slot = 0, chan = 0, gen;
	u64 hint = pvgpu_caller_hint();
	int st;

	if (req->size != sizeof(*req) || req->flags || req->reserved[0] || req->reserved[1])
		return -EINVAL;

	/*
	 * Weights left by exited processes go first: one may have had the
	 * caller's pid, which the daemon must not apply to the caller.
	 */
	pvgpu_weights_tidy(dev, NULL);
	st = pvgpu_mbox_lock(dev, pvgpu_cmd_jiffies(), true);
	if (st)
		return st == -ETIME ? -ETIMEDOUT : st;
	if (dev->version >= 2)
		pvgpu_write_task_name(dev);
	/* An allocation that succeeds started and ended under this generation. */
	gen = pvgpu_rd(dev, PVGPU_REG_LINK_GEN);
	st = pvgpu_cmd(dev, PVGPU_CMD_CHAN_ALLOC, lower_32_bits(hint),
		       upper_32_bits(hint), 0, &slot, &chan, true,
		       PVGPU_STALE_ALLOC, 0);
	if (st == PVGPU_CMDST_OK) {
		spin_lock_irqsave(&dev->lock, flags);
		if (slot >= dev->num_slots || dev->slots[slot].use != PVGPU_USE_FREE) {
			spin_unlock_irqrestore(&dev->lock, flags);
			dev_err(&dev->pdev->dev, "CHAN_ALLOC returned slot %u in use\n", slot);
			pvgpu_mbox_unlock(dev);
			return -EIO;
		}
		s = &dev->slots[slot];
		pvgpu_slot_reset(s);	/* no state of an earlier owner survives */
		s->use = PVGPU_USE_OWNED;
		s->owner = pf;
		s->tgid = get_pid(task_tgid(current));
		s->hint = hint;
		s->chan_id = chan;
		s->link_gen = gen;
		s->alloc_seq = ++dev->alloc_seq;
		spin_unlock_irqrestore(&dev->lock, flags);
	}
	pvgpu_mbox_unlock(dev);
	if (st != PVGPU_CMDST_OK)
		return pvgpu_alloc_errno(st, chan);

	req->handle = slot;
	req->chan_id = chan;
	req->mmap_offset = PVGPU_MMAP_OFFSET(slot);
	req->pid_hint = hint;
	return 0;
}

static long pvgpu_ioc_free(struct pvgpu_file *pf, struct pvgpu_ioc_free *req)
{
	if (req->size != sizeof(*req) || req->flags || req->reserved)
		return -EINVAL;
	return pvgpu_free_handle(pf, req->handle) ? 0 : -EBADF;
}

/*
 * Arm the device's wait on the slot for the lowest fence any waiter of the
 * slot wants.  The device holds one armed wait per slot and it cannot be
 * lowered, so a waiter that wants an earlier fence than the armed one is
 * woken when that wait ends and re-arms then.
 */
static int pvgpu_arm(struct pvgpu_dev *dev, struct pvgpu_slot *s, u32 handle,
		     u32 alloc_seq, long timeout)
{
	struct pvgpu_waiter *w;
	unsigned long flags;
	u32 target = 0, r1 = 0, we, ends;
	bool have = false;
	int st;

	st = pvgpu_mbox_lock(dev, timeout, true);
	if (st)
		return st;
	spin_lock_irqsave(&dev->lock, flags);
	if (s->use != PVGPU_USE_OWNED || s->alloc_seq != alloc_seq || s->armed ||
	    s->dead) {
		spin_unlock_irqrestore(&dev->lock, flags);
		pvgpu_mbox_unlock(dev);
		return 0;
	}
	list_for_each_entry(w, &s->waiters, node) {
		if (!have || (s32)(w->fence - target) < 0)
			target = w->fence;
		have = true;
	}
	/*
	 * Armed from here on: the IRQ handler clears it when the wait ends,
	 * possibly before this command's result is looked at below.
	 */
	s->armed = true;
	ends = s->wait_ends;
	spin_unlock_irqrestore(&dev->lock, flags);

	st = pvgpu_cmd(dev, PVGPU_CMD_FENCE_WAIT, handle, target, 0, NULL, &r1,
		       false, PVGPU_STALE_OTHER, 0);
	we = pvgpu_rd(dev, PVGPU_REG_WAIT(handle, PVGPU_WAIT_REG_ERROR));
	spin_lock_irqsave(&dev->lock, flags);
	if (s->use == PVGPU_USE_OWNED && s->alloc_seq == alloc_seq) {
		if (st == PVGPU_CMDST_OK && r1 == PVGPU_WAITST_OK) {
			s->armed = false;
			s->wait_ends++;	/* ended at once (its interrupt follows) */
			if (!s->reached_valid || fence_reached(target, s->reached))
				s->reached = target;
			s->reached_valid = true;
			s->reached_gen = s->wait_ends;
		} else if (st == PVGPU_CMDST_OK && r1 == PVGPU_WAITST_E_DEAD) {
			s->armed = false;
			pvgpu_mark_dead(s, we ? we : PVGPU_CHAN_ERR_LOST);
		} else if (st == PVGPU_CMDST_E_INVALID && r1 == PVGPU_WAITST_ARMED) {
			/* an earlier wait is armed, unless it ended meanwhile */
			s->armed = s->wait_ends == ends;
		} else if (st == PVGPU_CMDST_OK && r1 == PVGPU_WAITST_ARMED) {
			/* armed; s->armed is false already if it ended meanwhile */
		} else if (st == PVGPU_CMDST_E_INVALID) {
			/* the device does not hold the channel any more */
			s->armed = false;
			pvgpu_mark_dead(s, PVGPU_CHAN_ERR_LOST);
		} else {
			s->armed = false;
		}
		s->event_seq++;
		wake_up_all(&s->wq);
	}
	spin_unlock_irqrestore(&dev->lock, flags);
	pvgpu_mbox_unlock(dev);
	return st < 0 ? st : 0;
}

/*
 * One target of a wait: a waiter on its slot's list (pvgpu_arm() arms for
 * the lowest fence on it) and an entry on its slot's wait queue.
 *
 * A wait on several slots sleeps poll-style, with one wait queue entry on
 * each target's s->wq, rather than on a queue of the open file: the places
 * that wake a slot's waiters (the IRQ handler, pvgpu_arm(), disown, link
 * loss, remove) stay as they are and need not find the slot's owner file
 * (disown clears it), and an event on one channel wakes only the threads
 * waiting on that channel, not every waiting thread of the file.
 */
struct pvgpu_wait_one {
	struct pvgpu_waiter waiter;	/* on s->waiters; .fence: the target */
	wait_queue_entry_t wqe;		/* on s->wq */
	struct pvgpu_slot *s;
	u32 handle;
	u32 alloc_seq;
	u32 seq;			/* s->event_seq at the last look */
	u32 since;			/* s->wait_ends when it registered */
	int state;			/* the last look: PVGPU_WAIT_*, -EBADF, or -1 */
	u32 error;			/* with PVGPU_WAIT_DEAD */
	bool need_arm;
};

/* Whether anything a waiter must see happened on a target's slot. */
static bool pvgpu_wait_changed(const struct pvgpu_wait_one *t, u32 count)
{
	u32 i;

	for (i = 0; i < count; i++)
		if (READ_ONCE(t[i].s->event_seq) != t[i].seq)
			return true;
	return false;
}

/*
 * Jiffies until `deadline` (ktime_get_ns), 0 once it has passed, else at
 * least 1.  The deadline is kept on CLOCK_MONOTONIC, the clock the caller
 * measures its timeout by: a TCG guest's jiffies ran ahead of it under host
 * load, and a 100 ms WAIT returned ETIME after 73 ms (CI, vm-abuse).
 */
static long pvgpu_jiffies_left(u64 deadline)
{
	u64 now = ktime_get_ns();

	if (now >= deadline)
		return 0;
	return clamp_t(u64, nsecs_to_jiffies(deadline - now), 1, MAX_SCHEDULE_TIMEOUT / 2);
}

/*
 * Sleep until any of the `count` targets (handle and fence filled in by the
 * caller) reaches its fence or dies, as PVGPU_IOC_WAIT and
 * PVGPU_IOC_WAIT_ANY describe.  On success *index, *status and *error say
 * which target ended the wait and how (the lowest index when several did).
 * Every target is taken off its slot's lists before this returns.
 */
static long pvgpu_wait(struct pvgpu_file *pf, struct pvgpu_wait_one *t, u32 count,
		       s64 timeout_ns, u32 *index, u32 *status, u32 *error)
{
	struct pvgpu_dev *dev = pf->dev;
	unsigned long flags;
	u64 deadline = 0;	/* ktime_get_ns() */
	u32 i, j, hit = 0, st, fence, err = 0;
	long left = 0, ret = 0;
	bool forever = timeout_ns < 0, tried_arm;
	int done = -1;		/* PVGPU_WAIT_* when known */

	if (timeout_ns > 0)
		deadline = ktime_get_ns() + (u64)timeout_ns;	/* no overflow: both below 2^63 */

	/* All targets the caller's, or none is waited on. */
	spin_lock_irqsave(&dev->lock, flags);
	for (i = 0; i < count; i++) {
		t[i].s = pvgpu_own_slot(pf, t[i].handle);
		if (!t[i].s) {
			spin_unlock_irqrestore(&dev->lock, flags);
			return -EBADF;
		}
	}
	for (i = 0; i < count; i++) {
		t[i].alloc_seq = t[i].s->alloc_seq;
		t[i].since = t[i].s->wait_ends;
		list_add_tail(&t[i].waiter.node, &t[i].s->waiters);
		init_waitqueue_entry(&t[i].wqe, current);
		add_wait_queue(&t[i].s->wq, &t[i].wqe);
	}
	spin_unlock_irqrestore(&dev->lock, flags);

	for (;;) {
		spin_lock_irqsave(&dev->lock, flags);
		if (dev->dying)
			ret = -ENODEV;
		for (i = 0; i < count; i++) {
			struct pvgpu_slot *s = t[i].s;

			t[i].state = -1;
			if (s->use != PVGPU_USE_OWNED || s->alloc_seq != t[i].alloc_seq) {
				t[i].state = -EBADF;	/* freed meanwhile by another thread */
			} else if (s->reached_valid && (s32)(s->reached_gen - t[i].since) > 0 &&
				   fence_reached(s->reached, t[i].waiter.fence)) {
				t[i].state = PVGPU_WAIT_OK;
			} else if (s->dead) {
				t[i].state = PVGPU_WAIT_DEAD;
				t[i].error = s->dead_error;
			}
			t[i].seq = s->event_seq;
			t[i].need_arm = !s->armed;
		}
		spin_unlock_irqrestore(&dev->lock, flags);
		if (ret)
			break;

		for (i = 0; i < count && done < 0 && !ret; i++) {
			void __iomem *ctrl = dev->chan_bar + t[i].handle * PVGPU_BAR2_STRIDE;

			hit = i;
			if (t[i].state == -EBADF) {
				ret = -EBADF;
				break;
			}
			if (t[i].state >= 0) {
				done = t[i].state;
				err = t[i].error;
				break;
			}
			/*
			 * The control page is the owner's own memory: what it
			 * says can only mislead the owner's own wait.  STATUS
			 * before FENCE so a fence reached before the channel
			 * died counts as reached.
			 */
			st = readl(ctrl + PVGPU_CTRL_STATUS);
			fence = readl(ctrl + PVGPU_CTRL_FENCE);
			if (fence_reached(fence, t[i].waiter.fence)) {
				done = PVGPU_WAIT_OK;
			} else if (st != PVGPU_CHAN_STATUS_OK) {
				done = PVGPU_WAIT_DEAD;
				err = readl(ctrl + PVGPU_CTRL_ERROR);
			}
		}
		if (ret || done >= 0)
			break;

		if (!forever) {
			left = timeout_ns == 0 ? 0 : pvgpu_jiffies_left(deadline);
			if (!left) {
				ret = -ETIME;
				break;
			}
		} else {
			left = MAX_SCHEDULE_TIMEOUT;
		}

		/* Arm every slot that is not armed (once per slot), then look again. */
		tried_arm = false;
		for (i = 0; i < count && !ret; i++) {
			if (!t[i].need_arm)
				continue;
			for (j = 0; j < i && t[j].s != t[i].s; j++)
				;
			if (j < i)
				continue;	/* the same slot as an earlier target */
			/* Each arm may wait for the mailbox: within what is left. */
			if (!forever) {
				left = pvgpu_jiffies_left(deadline);
				if (!left)
					break;
			}
			ret = pvgpu_arm(dev, t[i].s, t[i].handle, t[i].alloc_seq,
					forever ? pvgpu_cmd_jiffies() : left);
			if (ret == -ETIME && forever)
				ret = 0;	/* mailbox busy: try again */
			tried_arm = true;
		}
		if (ret)
			break;
		/* Look again; past the deadline, that look says ETIME. */
		if (tried_arm || (!forever && !pvgpu_jiffies_left(deadline)))
			continue;

		/* Sleep on all the targets' slots at once (see pvgpu_wait_one). */
		for (;;) {
			set_current_state(TASK_INTERRUPTIBLE);
			if (READ_ONCE(dev->dying) || pvgpu_wait_changed(t, count))
				break;
			if (signal_pending(current)) {
				ret = -EINTR;
				break;
			}
			if (!left)
				break;	/* timed out: the next look says ETIME */
			left = schedule_timeout(left);
		}
		__set_current_state(TASK_RUNNING);
		if (ret)
			break;
	}

	spin_lock_irqsave(&dev->lock, flags);
	for (i = 0; i < count; i++) {
		list_del(&t[i].waiter.node);
		remove_wait_queue(&t[i].s->wq, &t[i].wqe);
	}
	spin_unlock_irqrestore(&dev->lock, flags);
	if (ret)
		return ret == -ETIMEDOUT ? -ETIME : ret;

	*index = hit;
	*status = done;
	*error = done == PVGPU_WAIT_DEAD ? err : 0;
	return 0;
}

static long pvgpu_ioc_wait(struct pvgpu_file *pf, struct pvgpu_ioc_wait *req)
{
	struct pvgpu_wait_one one = {};
	u32 index;

	if (req->size != sizeof(*req) || req->flags || req->reserved)
		return -EINVAL;
	one.handle = req->handle;
	one.waiter.fence = req->fence;
	return pvgpu_wait(pf, &one, 1, req->timeout_ns, &index, &req->status, &req->error);
}

/*
 * The targets of a WAIT_ANY, copied in before io_sem is taken; NULL with
 * *err set on a bad request.
 */
static struct pvgpu_wait_one *pvgpu_wait_any_targets(const struct pvgpu_ioc_wait_any *req,
						     long *err)
{
	struct pvgpu_wait_target *targets;
	struct pvgpu_wait_one *t;
	u32 i;

	*err = -EINVAL;
	if (req->size != sizeof(*req) || req->flags || req->reserved0 || req->reserved1 ||
	    req->reserved[0] || req->reserved[1])
		return NULL;
	if (req->count == 0 || req->count > PVGPU_WAIT_ANY_MAX)
		return NULL;

	targets = memdup_user(u64_to_user_ptr(req->targets),
			      req->count * sizeof(*targets));
	if (IS_ERR(targets)) {
		*err = PTR_ERR(targets);
		return NULL;
	}
	t = kcalloc(req->count, sizeof(*t), GFP_KERNEL);
	if (!t) {
		kfree(targets);
		*err = -ENOMEM;
		return NULL;
	}
	for (i = 0; i < req->count; i++) {
		t[i].handle = targets[i].handle;
		t[i].waiter.fence = targets[i].fence;
	}
	kfree(targets);
	return t;
}

/*
 * Like nice: any process may lower its weight, or raise it up to the
 * default; above the default (and above what it has now) needs
 * CAP_SYS_NICE.  Another process's weight needs CAP_SYS_ADMIN.  The
 * processes of one user hold at most weights_per_uid entries of the table
 * (CAP_SYS_NICE exempt), so that no user can fill it for the others.
 */
static long pvgpu_ioc_set_weight(struct pvgpu_file *pf, const struct pvgpu_ioc_set_weight *r)
{
	struct pvgpu_dev *dev = pf->dev;
	struct pvgpu_ioc_set_weight req = *r;
	struct pvgpu_weight *w;
	struct task_struct *task;
	struct pid *pid;
	bool nice_cap;
	u32 r1 = 0;
	int st, ret;

	if (req.size != sizeof(req) || req.flags || req.reserved)
		return -EINVAL;
	if (req.weight < PVGPU_WEIGHT_MIN || req.weight > PVGPU_WEIGHT_MAX || req.pid < 0)
		return -EINVAL;
	if (dev->version < 2)
		return -EOPNOTSUPP;

	if (req.pid == 0) {
		pid = get_task_pid(current, PIDTYPE_TGID);
	} else {
		rcu_read_lock();
		task = pid_task(find_vpid(req.pid), PIDTYPE_TGID);
		pid = task ? get_task_pid(task, PIDTYPE_TGID) : NULL;
		rcu_read_unlock();
		if (!pid)
			return -ESRCH;
	}
	if (pid_nr(pid) != current->tgid && !capable(CAP_SYS_ADMIN)) {
		put_pid(pid);
		return -EPERM;
	}
	nice_cap = capable(CAP_SYS_NICE);

	mutex_lock(&dev->weights_lock);
	if (req.weight > PVGPU_WEIGHT_DEFAULT && !nice_cap &&
	    req.weight > pvgpu_weight_of_locked(dev, pid_nr(pid))) {
		ret = -EPERM;
		goto out;
	}
	ret = pvgpu_mbox_lock(dev, pvgpu_cmd_jiffies(), true);
	if (ret) {
		ret = ret == -ETIME ? -ETIMEDOUT : ret;
		goto out;
	}
	/* Exited processes' entries first: they may make room, and are told. */
	ret = pvgpu_weights_sweep(dev, NULL);
	if (ret) {
		pvgpu_mbox_unlock(dev);
		ret = ret == -ETIME ? -ETIMEDOUT : ret;
		goto out;
	}
	/* The entry is found before the daemon is told: no weight it keeps is unknown here. */
	w = pvgpu_weight_slot(dev, pid, current_uid(), nice_cap);
	if (IS_ERR(w)) {
		pvgpu_mbox_unlock(dev);
		ret = PTR_ERR(w);
		goto out;
	}
	st = pvgpu_cmd(dev, PVGPU_CMD_TASK_WEIGHT, pid_nr(pid), 0, req.weight,
		       NULL, &r1, true, PVGPU_STALE_OTHER, 0);
	pvgpu_mbox_unlock(dev);
	ret = pvgpu_weight_errno(st, r1);
	/*
	 * Unanswered (st < 0), the daemon may still apply it: kept too, so
	 * that it is forgotten with the process like any other.
	 */
	if (!ret || st < 0) {
		if (!w->pid) {
			w->pid = get_pid(pid);
			w->uid = current_uid();
		}
		w->weight = req.weight;
	}
out:
	mutex_unlock(&dev->weights_lock);
	put_pid(pid);
	return ret;
}

union pvgpu_ioc_arg {
	struct pvgpu_ioc_info info;
	struct pvgpu_ioc_alloc alloc;
	struct pvgpu_ioc_free free;
	struct pvgpu_ioc_wait wait;
	struct pvgpu_ioc_set_weight set_weight;
	struct pvgpu_ioc_wait_any wait_any;
};

/*
 * Arguments are copied in before io_sem is taken and back out after it is
 * dropped: a copy may fault, and the fault takes mmap_lock, which mmap()
 * holds while it takes io_sem; with remove waiting for io_sem as writer,
 * the two readers would deadlock.
 */
static long pvgpu_ioctl(struct file *filp, unsigned int cmd, unsigned long arg)
{
	struct pvgpu_file *pf = filp->private_data;
	struct pvgpu_dev *dev = pf->dev;
	void __user *uarg = (void __user *)arg;
	struct pvgpu_wait_one *targets = NULL;
	union pvgpu_ioc_arg a;
	size_t size;
	bool out;
	long ret;

	switch (cmd) {
	case PVGPU_IOC_INFO:
	case PVGPU_IOC_ALLOC:
	case PVGPU_IOC_WAIT:
	case PVGPU_IOC_WAIT_ANY:
		out = true;
		break;
	case PVGPU_IOC_FREE:
	case PVGPU_IOC_SET_WEIGHT:
		out = false;
		break;
	default:
		return -ENOTTY;
	}
	size = _IOC_SIZE(cmd);
	BUILD_BUG_ON(sizeof(a) > 128);	/* on the stack */
	if (copy_from_user(&a, uarg, size))
		return -EFAULT;
	if (cmd == PVGPU_IOC_WAIT_ANY) {
		targets = pvgpu_wait_any_targets(&a.wait_any, &ret);
		if (!targets)
			return ret;
	}

	down_read(&dev->io_sem);
	if (dev->dying) {
		ret = -ENODEV;
		goto unlock;
	}
	switch (cmd) {
	case PVGPU_IOC_INFO:
		ret = pvgpu_ioc_info(pf, &a.info);
		break;
	case PVGPU_IOC_ALLOC:
		ret = pvgpu_ioc_alloc(pf, &a.alloc);
		break;
	case PVGPU_IOC_FREE:
		ret = pvgpu_ioc_free(pf, &a.free);
		break;
	case PVGPU_IOC_WAIT:
		ret = pvgpu_ioc_wait(pf, &a.wait);
		break;
	case PVGPU_IOC_WAIT_ANY:
		ret = pvgpu_wait(pf, targets, a.wait_any.count, a.wait_any.timeout_ns,
				 &a.wait_any.index, &a.wait_any.status, &a.wait_any.error);
		break;
	default:
		ret = pvgpu_ioc_set_weight(pf, &a.set_weight);
		break;
	}
unlock:
	up_read(&dev->io_sem);
	kfree(targets);
	if (ret || !out)
		return ret;
	if (copy_to_user(uarg, &a, size)) {
		/* The caller never learns the handle: the channel goes back. */
		if (cmd == PVGPU_IOC_ALLOC) {
			down_read(&dev->io_sem);
			if (!dev->dying)
				pvgpu_free_handle(pf, a.alloc.handle);
			up_read(&dev->io_sem);
		}
		return -EFAULT;
	}
	return 0;
}

/* A zapped or never-populated page of a channel mapping: no anonymous fill-in. */
static vm_fault_t pvgpu_vm_fault(struct vm_fault *vmf)
{
	return VM_FAULT_SIGBUS;
}

static const struct vm_operations_struct pvgpu_vm_ops = {
	.fault = pvgpu_vm_fault,
};

static int pvgpu_mmap(struct file *filp, struct vm_area_struct *vma)
{
	struct pvgpu_file *pf = filp->private_data;
	struct pvgpu_dev *dev = pf->dev;
	u64 off = (u64)vma->vm_pgoff << PAGE_SHIFT;
	u64 len = vma->vm_end - vma->vm_start;
	u64 stride = PVGPU_MMAP_OFFSET(1);
	u32 handle = off / stride, first = (off % stride) >> PAGE_SHIFT;
	unsigned long flags, i;
	struct pvgpu_slot *s;
	int ret = 0;

	BUILD_BUG_ON(PAGE_SIZE != PVGPU_PAGE_SIZE);
	if (off / stride >= dev->num_slots || len == 0 ||
	    (off % stride) + len > PVGPU_MMAP_CHANNEL_SIZE)
		return -EINVAL;
	if (!(vma->vm_flags & VM_SHARED))
		return -EINVAL;	/* device memory cannot be copied on write */
	if (vma->vm_flags & VM_EXEC)
		return -EPERM;

	down_read(&dev->io_sem);
	mutex_lock(&pf->lock);
	spin_lock_irqsave(&dev->lock, flags);
	s = dev->dying ? NULL : pvgpu_own_slot(pf, handle);
	if (s)
		s->mapping = filp->f_mapping;
	spin_unlock_irqrestore(&dev->lock, flags);
	if (!s) {
		ret = dev->dying ? -ENODEV : -EACCES;
		goto out;
	}

	/*
	 * VM_DONTCOPY: a child does not inherit the mapping (it cannot use
	 * the channel either); VM_DONTEXPAND: mremap cannot grow it onto a
	 * page of another channel.
	 */
	vma->vm_flags |= VM_IO | VM_PFNMAP | VM_DONTEXPAND | VM_DONTDUMP | VM_DONTCOPY;
	vma->vm_flags &= ~VM_MAYEXEC;
	vma->vm_page_prot = pgprot_noncached(vma->vm_page_prot);
	vma->vm_ops = &pvgpu_vm_ops;
	for (i = 0; i < len >> PAGE_SHIFT && !ret; i++) {
		u32 page = first + i;
		resource_size_t phys;

		if (page < 2)
			phys = dev->chan_phys + handle * PVGPU_BAR2_STRIDE +
			       page * PAGE_SIZE;
		else
			phys = dev->ring_phys + handle * PVGPU_BAR4_STRIDE;
		ret = io_remap_pfn_range(vma, vma->vm_start + i * PAGE_SIZE,
					 phys >> PAGE_SHIFT, PAGE_SIZE,
					 vma->vm_page_prot);
	}
out:
	mutex_unlock(&pf->lock);
	up_read(&dev->io_sem);
	return ret;
}

static const struct file_operations pvgpu_fops = {
	.owner = THIS_MODULE,
	.open = pvgpu_open,
	.flush = pvgpu_flush,
	.release = pvgpu_release,
	.unlocked_ioctl = pvgpu_ioctl,
	.compat_ioctl = compat_ptr_ioctl,	/* same layout on i386 */
	.mmap = pvgpu_mmap,
	.llseek = no_llseek,
};

/* ---- PCI ------------------------------------------------------------------ */

static int pvgpu_setup_irqs(struct pvgpu_dev *dev)
{
	struct pci_dev *pdev = dev->pdev;
	int i, ret, nvec = -ENOSPC;

	if (msix)
		nvec = pci_alloc_irq_vectors(pdev, PVGPU_MSIX_VECTORS,
					     PVGPU_MSIX_VECTORS, PCI_IRQ_MSIX);
	if (nvec > 0) {
		dev->irq_mode = PVGPU_IRQ_MSIX;
	} else {
		if (msix)
			dev_info(&pdev->dev, "MSI-X unavailable (%d), using INTx\n", nvec);
		nvec = pci_alloc_irq_vectors(pdev, 1, 1, PCI_IRQ_LEGACY);
		if (nvec < 0)
			return nvec;
		dev->irq_mode = PVGPU_IRQ_INTX;
	}
	dev->nvec = nvec;
	for (i = 0; i < nvec; i++) {
		ret = request_irq(pci_irq_vector(pdev, i), pvgpu_irq,
				  dev->irq_mode == PVGPU_IRQ_INTX ? IRQF_SHARED : 0,
				  "pvgpu", dev);
		if (ret) {
			while (--i >= 0)
				free_irq(pci_irq_vector(pdev, i), dev);
			pci_free_irq_vectors(pdev);
			return ret;
		}
	}
	return 0;
}

static void pvgpu_free_irqs(struct pvgpu_dev *dev)
{
	int i;

	for (i = 0; i < dev->nvec; i++)
		free_irq(pci_irq_vector(dev->pdev, i), dev);
	pci_free_irq_vectors(dev->pdev);
}

static int pvgpu_probe(struct pci_dev *pdev, const struct pci_device_id *id)
{
	struct pvgpu_dev *dev;
	u32 magic, i;
	int ret;

	ret = pcim_enable_device(pdev);
	if (ret)
		return ret;
	ret = pcim_iomap_regions(pdev, BIT(PVGPU_BAR_MBOX) | BIT(PVGPU_BAR_CHANNELS) |
				 BIT(PVGPU_BAR_RINGS), KBUILD_MODNAME);
	if (ret)
		return ret;

	dev = kzalloc(sizeof(*dev), GFP_KERNEL);
	if (!dev)
		return -ENOMEM;
	kref_init(&dev->ref);
	dev->index = ida_alloc_max(&pvgpu_ida, PVGPU_MAX_DEVICES - 1, GFP_KERNEL);
	if (dev->index < 0) {
		ret = dev->index == -ENOSPC ? -EBUSY : dev->index;
		if (ret == -EBUSY)
			dev_err(&pdev->dev, "more than %d pvgpu devices; ignoring this one\n",
				PVGPU_MAX_DEVICES);
		goto put;
	}
	if (dev->index == 0)
		strscpy(dev->node_name, "pvgpu", sizeof(dev->node_name));
	else
		snprintf(dev->node_name, sizeof(dev->node_name), "pvgpu%d", dev->index);
	dev->pdev = pci_dev_get(pdev);
	dev->mbox = pcim_iomap_table(pdev)[PVGPU_BAR_MBOX];
	dev->chan_bar = pcim_iomap_table(pdev)[PVGPU_BAR_CHANNELS];
	dev->chan_phys = pci_resource_start(pdev, PVGPU_BAR_CHANNELS);
	dev->ring_phys = pci_resource_start(pdev, PVGPU_BAR_RINGS);
	init_rwsem(&dev->io_sem);
	mutex_init(&dev->cmd_lock);
	mutex_init(&dev->weights_lock);
	init_waitqueue_head(&dev->mbox_wq);
	init_waitqueue_head(&dev->cmd_wq);
	spin_lock_init(&dev->lock);
	INIT_WORK(&dev->link_work, pvgpu_link_work);
	INIT_WORK(&dev->reap_work, pvgpu_reap_work);
	for (i = 0; i < PVGPU_MAX_SLOTS; i++) {
		INIT_LIST_HEAD(&dev->slots[i].waiters);
		init_waitqueue_head(&dev->slots[i].wq);
	}

	magic = pvgpu_rd(dev, PVGPU_REG_MAGIC);
	dev->version = pvgpu_rd(dev, PVGPU_REG_VERSION);
	dev->num_slots = pvgpu_rd(dev, PVGPU_REG_NUM_SLOTS);
	if (magic != PVGPU_DEV_MAGIC || dev->version < 1 ||
	    dev->num_slots < 1 || dev->num_slots > PVGPU_MAX_SLOTS ||
	    pci_resource_len(pdev, PVGPU_BAR_CHANNELS) <
	    (resource_size_t)dev->num_slots * PVGPU_BAR2_STRIDE ||
	    pci_resource_len(pdev, PVGPU_BAR_RINGS) <
	    (resource_size_t)dev->num_slots * PVGPU_BAR4_STRIDE) {
		dev_err(&pdev->dev, "not a pvgpu device: magic %#x version %u slots %u\n",
			magic, dev->version, dev->num_slots);
		ret = -ENODEV;
		goto put;
	}

	pci_set_master(pdev);	/* MSI-X messages are memory writes */
	pvgpu_wr(dev, PVGPU_REG_IRQ_MASK, PVGPU_IRQ_ALL);
	ret = pvgpu_setup_irqs(dev);
	if (ret) {
		dev_err(&pdev->dev, "no interrupt: %d\n", ret);
		goto put;
	}

	dev->misc.minor = MISC_DYNAMIC_MINOR;
	dev->misc.name = dev->node_name;
	dev->misc.fops = &pvgpu_fops;
	dev->misc.mode = 0660;
	dev->misc.parent = &pdev->dev;
	ret = misc_register(&dev->misc);
	if (ret) {
		pvgpu_free_irqs(dev);
		/* an interrupt may have queued them before misc_register failed */
		cancel_work_sync(&dev->link_work);
		cancel_work_sync(&dev->reap_work);
		goto put;
	}
	dev->misc_registered = true;
	pci_set_drvdata(pdev, dev);

	dev_info(&pdev->dev, "/dev/%s: pvgpu VERSION %u, %u slots, %s, link %u, pid hints %s\n",
		 dev->node_name, dev->version, dev->num_slots,
		 dev->irq_mode == PVGPU_IRQ_MSIX ? "MSI-X" : "INTx",
		 pvgpu_rd(dev, PVGPU_REG_LINK), pid_hints ? "on" : "off");
	return 0;

put:
	kref_put(&dev->ref, pvgpu_dev_free);
	return ret;
}

/*
 * Unbind with files still open (rmmod cannot get here then: the open files
 * hold the module).  Users are cut off, mappings zapped, and the channels
 * given back to the daemon; the files keep only the memory of `dev`.
 */
static void pvgpu_remove(struct pci_dev *pdev)
{
	struct pvgpu_dev *dev = pci_get_drvdata(pdev);
	struct address_space *mapping;
	unsigned long flags;
	u32 i;

	misc_deregister(&dev->misc);

	spin_lock_irqsave(&dev->lock, flags);
	WRITE_ONCE(dev->dying, true);
	for (i = 0; i < dev->num_slots; i++)
		wake_up_all(&dev->slots[i].wq);
	spin_unlock_irqrestore(&dev->lock, flags);
	wake_up_all(&dev->cmd_wq);
	wake_up_all(&dev->mbox_wq);
	cancel_work_sync(&dev->link_work);
	cancel_work_sync(&dev->reap_work);

	/* Wait for every user of the device to leave. */
	down_write(&dev->io_sem);
	for (i = 0; i < dev->num_slots; i++) {
		spin_lock_irqsave(&dev->lock, flags);
		mapping = dev->slots[i].use == PVGPU_USE_OWNED ? dev->slots[i].mapping : NULL;
		spin_unlock_irqrestore(&dev->lock, flags);
		if (mapping)
			unmap_mapping_range(mapping, PVGPU_MMAP_OFFSET(i),
					    PVGPU_MMAP_CHANNEL_SIZE, 1);
	}
	/*
	 * Give every channel back.  `dying` makes the mailbox helpers give up
	 * at once, so poll here: once per unbind, bounded by the command
	 * timeout per slot.
	 */
	for (i = 0; i < dev->num_slots; i++) {
		unsigned long end = jiffies + pvgpu_cmd_jiffies();
		u32 state = pvgpu_rd(dev, PVGPU_REG_SLOT(i, PVGPU_SLOT_REG_STATE));

		if (state != PVGPU_SLOT_LIVE && state != PVGPU_SLOT_LOST)
			continue;
		while (!pvgpu_cmd_settled(dev) && time_before(jiffies, end))
			msleep(20);
		pvgpu_wr(dev, PVGPU_REG_ARG0, i);
		pvgpu_wr(dev, PVGPU_REG_CMD, PVGPU_CMD_CHAN_FREE);
		while (!pvgpu_cmd_settled(dev) && time_before(jiffies, end))
			msleep(20);
	}
	up_write(&dev->io_sem);

	pvgpu_free_irqs(dev);
	cancel_work_sync(&dev->link_work);
	cancel_work_sync(&dev->reap_work);

	kref_put(&dev->ref, pvgpu_dev_free);
}

static const struct pci_device_id pvgpu_ids[] = {
	{ PCI_DEVICE(PVGPU_PCI_VENDOR_ID, PVGPU_PCI_DEVICE_ID) },
	{ }
};
MODULE_DEVICE_TABLE(pci, pvgpu_ids);

static struct pci_driver pvgpu_driver = {
	.name = KBUILD_MODNAME,
	.id_table = pvgpu_ids,
	.probe = pvgpu_probe,
	.remove = pvgpu_remove,
};
module_pci_driver(pvgpu_driver);

MODULE_DESCRIPTION("pvgpu paravirtual GPU channels for guests (/dev/pvgpu, /dev/pvgpu1, ...)");
MODULE_AUTHOR("pvgpu project");
MODULE_LICENSE("GPL");
MODULE_VERSION(PVGPU_DRV_VERSION);
