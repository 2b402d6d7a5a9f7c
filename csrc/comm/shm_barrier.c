/*
 * shm_barrier.c -- the call descriptors and the barrier: the first barrier
 * of every collective call publishes this rank's descriptor and checks every
 * rank's against rank 0's (see shm.h); the names used in those messages;
 * sf_shm_barrier.
 */
#include "shm_internal.h"

#include <stdio.h>
#include <string.h>

#include "dlpack.h"
#include "tensor_view.h"

/* ---- names for messages ------------------------------------------------------ */

static const char *kind_name(unsigned k)
{
    static const char *const names[K_NKINDS] = {
        [K_ALL_REDUCE] = "all_reduce", [K_ALL_GATHER] = "all_gather",
        [K_REDUCE_SCATTER] = "reduce_scatter", [K_BROADCAST] = "broadcast",
        [K_BARRIER] = "barrier", [K_ALL_TO_ALL] = "all_to_all",
    };
    return k < K_NKINDS && names[k] ? names[k] : "an unknown call";
}

static const char *op_name(unsigned op) { return op == SF_RED_SUM ? "sum" : op == SF_RED_MAX ? "max" : "op?"; }

const char *shm_dtype_name(sf_shm_dtype d)
{
    SFDLDataType t = {(uint8_t)(d & 0xff), (uint8_t)(d >> 8 & 0xff), (uint16_t)(d >> 16)};
    return sf_dtype_name(t);
}

/* "all_reduce(sum, 16 bytes, float32, one-shot)"; with_phase: "... in backward" */
static void describe_call(const desc *d, char *buf, size_t n);

static void describe(const desc *d, int with_phase, char *buf, size_t n)
{
    char call[160];
    describe_call(d, call, sizeof(call));
    snprintf(buf, n, "%s%s", call, !with_phase ? "" : d->phase ? " in backward" : " in forward");
}

static void describe_call(const desc *d, char *buf, size_t n)
{
    unsigned long long b = (unsigned long long)d->bytes;
    switch (d->kind) {
    case K_ALL_REDUCE:
        snprintf(buf, n, "all_reduce(%s, %llu bytes, %s, %s)", op_name(d->op), b,
                 shm_dtype_name(d->dtype),
                 d->algo == SF_AR_ONESHOT ? "one-shot" : "reduce-scatter + all-gather");
        break;
    case K_REDUCE_SCATTER:
        snprintf(buf, n, "reduce_scatter(%s, %llu bytes, %s)", op_name(d->op), b,
                 shm_dtype_name(d->dtype));
        break;
    case K_ALL_GATHER:
        snprintf(buf, n, "all_gather(%llu bytes, %s)", b, shm_dtype_name(d->dtype));
        break;
    case K_BROADCAST:
        snprintf(buf, n, "broadcast(root %d, %llu bytes, %s)", (int)d->root, b,
                 shm_dtype_name(d->dtype));
        break;
    case K_BARRIER:
        snprintf(buf, n, "barrier()");
        break;
    case K_ALL_TO_ALL:
        snprintf(buf, n, "all_to_all(%llu bytes, %s)", b, shm_dtype_name(d->dtype));
        break;
    default:
        snprintf(buf, n, "%s (kind %u)", kind_name(d->kind), (unsigned)d->kind);
    }
}

/* The ranks whose barrier count is below target. */
static uint64_t not_arrived(const sf_shm *c, uint64_t target)
{
    uint64_t mask = 0;
    for (int q = 0; q < c->nranks; q++)
        if (atomic_load_explicit(&c->ranks[q].seq, memory_order_acquire) < target)
            mask |= (uint64_t)1 << q;
    return mask;
}

/* ---- descriptors ------------------------------------------------------------ */

/* The call about to start: its first barrier publishes and checks this. */
void shm_announce(sf_shm *c, unsigned kind, uint64_t bytes, sf_shm_dtype dt, unsigned op,
                  int root, unsigned algo)
{
    memset(&c->next, 0, sizeof(c->next));
    c->next.call = ++c->calls;
    c->next.bytes = bytes;
    c->next.dtype = dt;
    c->next.root = root;
    c->next.kind = (uint8_t)kind;
    c->next.op = (uint8_t)op;
    c->next.algo = (uint8_t)algo;
    c->next.phase = (uint8_t)c->call_phase;
    c->announce = 1;
}

static int same_call(const desc *a, const desc *b)
{
    return a->call == b->call && a->kind == b->kind && a->bytes == b->bytes &&
           a->dtype == b->dtype && a->op == b->op && a->root == b->root && a->algo == b->algo &&
           a->phase == b->phase;
}

/* After the first barrier of a call: every rank's descriptor for this
 * barrier against rank 0's.  Every rank reads the same slots, so every rank
 * returns the same answer. */
static sf_status verify(sf_shm *c, uint64_t target, sf_error *err)
{
    desc d0 = c->ranks[0].slot[target & 1];
    for (int r = 0; r < c->nranks; r++) {
        desc d = c->ranks[r].slot[target & 1];
        if (d.seq != target) {
            /* r reached this barrier inside another call: the barrier counts
             * no longer line up, nothing later can be trusted. */
            shm_raise_abort(c, WHY_DESYNC, (uint64_t)1 << r);
            return sf_fail(err, SF_EPEER,
                           "%s: rank %d reached barrier #%llu of call #%llu (%s) inside another "
                           "call; the group is out of step (the communicator is now broken)",
                           c->label, r, (unsigned long long)target,
                           (unsigned long long)c->next.call, kind_name(c->next.kind));
        }
        if (r > 0 && !same_call(&d0, &d)) {
            char a[192], b[192], at[48] = "";
            int phases = d0.phase != d.phase; /* named where they differ (a skipped backward) */
            describe(&d0, phases, a, sizeof(a));
            describe(&d, phases, b, sizeof(b));
            if (d.call != d0.call)
                snprintf(at, sizeof(at), " as its call #%llu", (unsigned long long)d.call);
            return sf_fail(err, SF_EMISMATCH,
                           "%s: collective mismatch at call #%llu: rank 0 called %s, rank %d "
                           "called %s%s", c->label, (unsigned long long)d0.call, a, r, b, at);
        }
    }
    return SF_OK;
}

/* ---- barrier -------------------------------------------------------------- */

/* Arrive, wait for every rank; the first barrier of a call also publishes
 * this rank's descriptor (before the release store) and checks everyone's. */
sf_status shm_barrier(sf_shm *c, const char *what, sf_error *err)
{
    uint64_t target = ++c->my_seq;
    rank_line *me = &c->ranks[c->rank];
    int first = c->announce;
    if (first) {
        c->next.seq = target;
        me->slot[target & 1] = c->next;
        c->announce = 0;
    }
    atomic_store_explicit(&me->seq, target, memory_order_release);
    shm_wake_peers(c);
    waiter w;
    shm_wait_init(&w);
    for (int r = 0; r < c->nranks; r++) {
        if (r == c->rank)
            continue;
        while (atomic_load_explicit(&c->ranks[r].seq, memory_order_acquire) < target) {
            int why = shm_wait_step(&w, c, &c->ranks[r].seq, target);
            if (why)
                return shm_wait_failed(c, why, what, not_arrived(c, target), err);
        }
    }
    return first ? verify(c, target, err) : SF_OK;
}

/* The end of a call: its first barrier if no chunk ran one (zero bytes). */
sf_status shm_finish(sf_shm *c, const char *what, sf_error *err)
{
    return c->announce ? shm_barrier(c, what, err) : SF_OK;
}

void sf_shm_set_phase(sf_shm *c, unsigned phase)
{
    if (c)
        c->call_phase = phase ? 1u : 0u;
}

void sf_shm_rank_state(const sf_shm *c, int r, uint64_t *seq, unsigned *phase)
{
    const rank_line *line = &c->ranks[r];
    uint64_t s = atomic_load_explicit(&line->seq, memory_order_acquire);
    *seq = s;
    *phase = s ? line->slot[s & 1].phase : 0u;
}

sf_status sf_shm_barrier(sf_shm *c, sf_error *err)
{
    sf_status rc = shm_check(c, "barrier", err);
    if (rc)
        return rc;
    shm_announce(c, K_BARRIER, 0, 0, 0, -1, 0);
    return shm_barrier(c, "barrier", err);
}
