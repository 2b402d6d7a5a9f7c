/*
 * shm_wait.c -- waiting for peers, waking them, and what happens when a wait
 * fails: the abort record, timeouts, interrupts.
 *
 * Waiting (wait_step): spin briefly, then yield the core, then sleep on a
 * futex on the header's wake word (Linux; elsewhere a growing nanosleep).
 * Every release store another rank may wait for is followed by shm_wake_peers():
 * if any rank counts itself a sleeper, bump the wake word and FUTEX_WAKE.
 * A sleeper counts itself, re-checks its counter, then sleeps only while the
 * wake word still has the value it read before counting itself, so a store
 * made after its re-check always wakes it (seq_cst fences on both sides, the
 * Dekker pattern); and it sleeps at most POLL_S at a time, so the abort
 * record, the poll callback (Ctrl-C) and the timeout are still checked.
 */
#define _GNU_SOURCE
#include "shm_internal.h"

#include <errno.h>
#include <sched.h>
#include <signal.h>
#include <stdio.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/types.h>
#include <time.h>
#include <unistd.h>
#ifdef __linux__
#include <limits.h>
#include <linux/futex.h>
#include <sys/syscall.h>
#endif

/* " 1 3" for bits 1 and 3 of mask (ranks below nranks); " none" for none. */
static void format_ranks(uint64_t mask, int nranks, char *buf, size_t n)
{
    size_t len = 0;
    buf[0] = '\0';
    for (int q = 0; q < nranks && q < 64; q++) {
        if (!(mask >> q & 1))
            continue;
        int k = snprintf(buf + len, n - len, " %d", q);
        if (k < 0 || (size_t)k >= n - len)
            break;
        len += (size_t)k;
    }
    if (len == 0)
        snprintf(buf, n, " none");
}

/* ---- peers' processes ----------------------------------------------------------- */

static uint64_t pid_namespace(void)
{
    struct stat st;
    return stat("/proc/self/ns/pid", &st) == 0 ? (uint64_t)st.st_ino : 0;
}

void shm_register_self(sf_shm *c)
{
    c->ranks[c->rank].pidns = pid_namespace();
    c->ranks[c->rank].pid = (int32_t)getpid();
}

/* Whether process pid is gone: no such process, or a zombie (exited, not yet
 * reaped by its parent). */
static int process_gone(int32_t pid)
{
    if (pid <= 0)
        return 0;
    if (kill((pid_t)pid, 0) != 0)
        return errno == ESRCH;
#ifdef __linux__
    char path[64], buf[512];
    snprintf(path, sizeof(path), "/proc/%d/stat", (int)pid);
    FILE *f = fopen(path, "r");
    if (!f)
        return 0;
    size_t n = fread(buf, 1, sizeof(buf) - 1, f);
    fclose(f);
    buf[n] = '\0';
    const char *close_paren = strrchr(buf, ')');
    return close_paren && close_paren[1] == ' ' && (close_paren[2] == 'Z' || close_paren[2] == 'X');
#else
    return 0;
#endif
}

uint64_t shm_gone_ranks(const sf_shm *c)
{
    uint64_t mine = c->ranks[c->rank].pidns, gone = 0;
    if (mine == 0)
        return 0;
    for (int q = 0; q < c->nranks; q++)
        if (q != c->rank && c->ranks[q].pidns == mine && process_gone(c->ranks[q].pid))
            gone |= (uint64_t)1 << q;
    return gone;
}

/* ---- the abort record ------------------------------------------------------------ */

/* This rank broke the communicator: record why in the segment (unless another
 * rank already did: the first failure is the one everybody reports). */
void shm_raise_abort(sf_shm *c, int why, uint64_t missing)
{
    c->broken = why;
    atomic_store_explicit(&c->abort->missing[c->rank], missing, memory_order_relaxed);
    uint64_t expected = 0;
    uint64_t word = (uint64_t)why << 32 | (uint64_t)(c->rank + 1);
    atomic_compare_exchange_strong_explicit(&c->abort->word, &expected, word,
                                            memory_order_release, memory_order_relaxed);
    shm_wake_peers(c);        /* sleepers see the abort now, not at their next poll */
}

void sf_shm_abort(sf_shm *c, uint64_t token)
{
    if (c)
        shm_raise_abort(c, WHY_RAISED, token ? token : 1);
}

int sf_shm_abort_record(const sf_shm *c, int *rank, int *why, uint64_t *token)
{
    uint64_t word = c ? atomic_load_explicit(&c->abort->word, memory_order_acquire) : 0;
    int who = (int)(word & 0xffffffffu) - 1;
    if (word == 0 || who < 0 || who >= c->nranks)
        return 0;
    *rank = who;
    *why = (int)(word >> 32);
    *token = atomic_load_explicit(&c->abort->missing[who], memory_order_relaxed);
    return 1;
}

/* "rank 1 was interrupted", "rank 0 timed out waiting for ranks that did not
 * arrive: 2"; the reason code in *why (WHY_NONE when no rank failed). */
static void abort_story(const sf_shm *c, char *buf, size_t n, int *why)
{
    uint64_t word = atomic_load_explicit(&c->abort->word, memory_order_acquire);
    int who = (int)(word & 0xffffffffu) - 1;
    *why = (int)(word >> 32);
    if (word == 0) {
        snprintf(buf, n, "an earlier failure on this rank");
        return;
    }
    if (who < 0 || who >= c->nranks) {
        snprintf(buf, n, "an unreadable abort record (%#llx)", (unsigned long long)word);
        return;
    }
    char ranks[256];
    uint64_t missing = atomic_load_explicit(&c->abort->missing[who], memory_order_relaxed);
    format_ranks(missing, c->nranks, ranks, sizeof(ranks));
    const char *self = who == c->rank ? " (this rank)" : "";
    switch (*why) {
    case WHY_TIMEOUT:
        snprintf(buf, n, "rank %d%s timed out after waiting for ranks that did not arrive:%s",
                 who, self, ranks);
        break;
    case WHY_INTERRUPT:
        snprintf(buf, n, "rank %d%s was interrupted", who, self);
        break;
    case WHY_RAISED:
        snprintf(buf, n, "rank %d%s raised an exception (its own error says which, where)", who, self);
        break;
    case WHY_DESYNC:
        snprintf(buf, n, "rank %d%s found the group out of step with rank%s", who, self, ranks);
        break;
    case WHY_EXITED:
        snprintf(buf, n, "rank%s exited (its process is gone; rank %d%s found it waiting for it)",
                 ranks, who, self);
        break;
    default:
        snprintf(buf, n, "rank %d%s failed (reason %d)", who, self, *why);
    }
}

/* A wait saw another rank's abort record: fail this call and break the
 * communicator here too.  A peer's timeout reads as a timeout. */
static sf_status peer_aborted(sf_shm *c, const char *what, sf_error *err)
{
    char story[512];
    int why;
    abort_story(c, story, sizeof(story), &why);
    if (!c->broken)
        c->broken = -1;
    return sf_fail(err, why == WHY_TIMEOUT ? SF_ETIMEOUT : SF_EPEER,
                   "%s: %s on rank %d stopped because %s (the communicator is now broken)",
                   c->label, what, c->rank, story);
}

sf_status shm_check(sf_shm *c, const char *what, sf_error *err)
{
    if (!c)
        return sf_fail(err, SF_EINVAL, "shm: no communicator");
    c->announce = 0;
    if (c->broken || atomic_load_explicit(&c->abort->word, memory_order_acquire)) {
        char story[512];
        int why;
        abort_story(c, story, sizeof(story), &why);
        if (!c->broken)
            c->broken = -1;
        return sf_fail(err, SF_EPEER, "%s: %s refused: the communicator is broken because %s",
                       c->label, what, story);
    }
    return SF_OK;
}

/* ---- waiting ------------------------------------------------------------ */

static inline void cpu_relax(void)
{
#if defined(__x86_64__) || defined(__i386__)
    __builtin_ia32_pause();
#elif defined(__aarch64__)
    __asm__ __volatile__("yield" ::: "memory");
#endif
}

static double now_s(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

/* Spin briefly, yield up to ~2000 times, then sleep on the futex.  Measured
 * (benchmarks/collectives_under_load.py): going to sleep after ~10 us instead
 * made a quiet 4-64 KiB all-reduce 3-4x slower (the peer arrives a little
 * later than that, and a futex sleep + wake costs more than the wait), and did
 * not help under 2 busy loops on 2 cores, where every waiter loses its core
 * for a scheduler slice either way. */
#define SPIN_STEPS 64
#define YIELD_STEPS 2048

static inline header *hdr(const sf_shm *c) { return (header *)c->base; }

#ifdef __linux__
static void futex_sleep(_Atomic uint32_t *word, uint32_t seen, double seconds)
{
    if (seconds <= 0)
        return;
    struct timespec ts;
    ts.tv_sec = (time_t)seconds;
    ts.tv_nsec = (long)((seconds - (double)ts.tv_sec) * 1e9);
    /* EAGAIN (the word moved), EINTR (a signal: the caller polls) and
     * ETIMEDOUT all mean: look again. */
    syscall(SYS_futex, (uint32_t *)word, FUTEX_WAIT, seen, &ts, NULL, 0);
}
#endif

/* After a release store that a peer may be waiting for: bump the wake word
 * and wake the sleepers, if any (see "Waiting" at the top). */
void shm_wake_peers(sf_shm *c)
{
    header *h = hdr(c);
    /* The fence orders the caller's release store before the read of
     * `sleepers`; the wake word is written only when someone sleeps, so the
     * common case touches no shared line for writing. */
    atomic_thread_fence(memory_order_seq_cst);
    if (atomic_load_explicit(&h->sleepers, memory_order_seq_cst) != 0) {
        atomic_fetch_add_explicit(&h->wake, 1u, memory_order_seq_cst);
#ifdef __linux__
        syscall(SYS_futex, (uint32_t *)&h->wake, FUTEX_WAKE, INT_MAX, NULL, NULL, 0);
#endif
        c->wakes++;
    }
}

/* What one backoff step found. */

void shm_wait_init(waiter *w)
{
    w->iter = 0;
    w->sleep_ns = 1000;
    w->deadline = -1.0;
    w->next_poll = 0.0;
}

/* One backoff step of a wait for *a >= target.  The abort record, the poll
 * callback (every POLL_S) and the clock are checked every 64 steps while
 * yielding, and after every sleep, each only while *a is short of target. */
int shm_wait_step(waiter *w, sf_shm *c, _Atomic uint64_t *a, uint64_t target)
{
    unsigned i = w->iter;
    if (i < YIELD_STEPS)
        w->iter++;
    if (i < SPIN_STEPS) {
        cpu_relax();
        return W_WAIT;
    }
    if (i < YIELD_STEPS) {
        sched_yield();
        if ((i - SPIN_STEPS) & 63)
            return W_WAIT;
    } else {
#ifdef __linux__
        header *h = hdr(c);
        uint32_t seen = atomic_load_explicit(&h->wake, memory_order_seq_cst);
        atomic_fetch_add_explicit(&h->sleepers, 1u, memory_order_seq_cst);
        atomic_thread_fence(memory_order_seq_cst);
        if (atomic_load_explicit(a, memory_order_acquire) < target) {
            double until = w->next_poll < w->deadline ? w->next_poll : w->deadline;
            double left = until - now_s();
            futex_sleep(&h->wake, seen, left < POLL_S ? (left > 1e-4 ? left : 1e-4) : POLL_S);
            c->sleeps++;
        }
        atomic_fetch_sub_explicit(&h->sleepers, 1u, memory_order_seq_cst);
#else
        (void)a;
        (void)target;
        struct timespec ts = {0, w->sleep_ns};
        nanosleep(&ts, NULL);
        if (w->sleep_ns < 100000)
            w->sleep_ns *= 2;
#endif
    }
    double t = now_s();
    if (w->deadline < 0) {
        w->deadline = t + c->timeout_s;
        w->next_poll = t + POLL_S;
    }
    /* The counter may have arrived while this rank slept, and a peer that
     * left the finished call raised (an abort) before this rank woke: the
     * call is complete here too, so it succeeds (the caller's loop sees the
     * counter); the abort fails this rank's next call instead.  Failing it
     * would break a call every rank finished, outside any step's guard. */
    if (atomic_load_explicit(a, memory_order_acquire) >= target)
        return W_WAIT;
    if (atomic_load_explicit(&c->abort->word, memory_order_acquire))
        return W_ABORT;
    if (t >= w->next_poll) {
        w->next_poll = t + POLL_S;
        uint64_t gone = shm_gone_ranks(c); /* a peer killed, or gone through os._exit */
        if (gone) {
            shm_raise_abort(c, WHY_EXITED, gone);
            return W_ABORT;
        }
        if (c->poll && c->poll(c->poll_ctx))
            return W_INTR;
    }
    return t > w->deadline ? W_TIMEOUT : W_WAIT;
}

/* A wait ended without its counter: fail the call with the reason (why from
 * wait_step); `missing` has a bit for each rank still awaited. */
sf_status shm_wait_failed(sf_shm *c, int why, const char *what, uint64_t missing,
                           sf_error *err)
{
    char ranks[256];
    format_ranks(missing, c->nranks, ranks, sizeof(ranks));
    switch (why) {
    case W_TIMEOUT:
        shm_raise_abort(c, WHY_TIMEOUT, missing);
        return sf_fail(err, SF_ETIMEOUT,
                       "%s: %s timed out after %.3g s on rank %d; ranks that did not arrive:%s "
                       "(the communicator is now broken)",
                       c->label, what, c->timeout_s, c->rank, ranks);
    case W_INTR:
        shm_raise_abort(c, WHY_INTERRUPT, missing);
        return sf_fail(err, SF_EINTR,
                       "%s: %s interrupted on rank %d while waiting for ranks%s (the "
                       "communicator is now broken)", c->label, what, c->rank, ranks);
    default:
        return peer_aborted(c, what, err);
    }
}
