/*
 * common.c -- argument checks, dtype conversion of rows, exp / max / sum-exp
 * over fp32 rows (AVX2+FMA where sf_cpu_has_simd(), plain C otherwise), and
 * the row-parallel thread driver.
 */
#define _GNU_SOURCE
#include "common.h"

#include <math.h>
#include <pthread.h>
#include <stdatomic.h>

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#define SFK_X86 1
#endif

sf_status sfk_convert(sfk_dtype from, const void *src, sfk_dtype to, void *dst, int64_t n,
                      sf_error *err)
{
    sf_status rc;
    if ((rc = sfk_check_dtype("convert", from, err)) || (rc = sfk_check_dtype("convert", to, err)) ||
        (rc = sfk_check_size("convert", "n", n, err)) ||
        (rc = sfk_check_ptr("convert", "src", src, n, err)) ||
        (rc = sfk_check_ptr("convert", "dst", dst, n, err)))
        return rc;
    float buf[1024];
    for (int64_t i = 0; i < n; i += 1024) {
        const int64_t len = n - i < 1024 ? n - i : 1024;
        sfk_load(from, (const char *)src + (size_t)i * (size_t)sfk_size(from), len, buf);
        sfk_store(to, buf, len, (char *)dst + (size_t)i * (size_t)sfk_size(to));
    }
    return SF_OK;
}

/* ---- rows ----------------------------------------------------------------- */

void sfk_load(sfk_dtype t, const void *src, int64_t n, float *dst)
{
    if (t == SFK_F32) {
        memcpy(dst, src, (size_t)n * 4);
    } else if (t == SFK_BF16) {
        const uint16_t *s = src;
        for (int64_t i = 0; i < n; i++) dst[i] = sf_bf16_to_f32(s[i]);
    } else {
        const uint16_t *s = src;
        for (int64_t i = 0; i < n; i++) dst[i] = sf_f16_to_f32(s[i]);
    }
}

void sfk_store(sfk_dtype t, const float *src, int64_t n, void *dst)
{
    if (t == SFK_F32) {
        if ((const void *)src != dst) memmove(dst, src, (size_t)n * 4);
    } else if (t == SFK_BF16) {
        uint16_t *d = dst;
        for (int64_t i = 0; i < n; i++) d[i] = sf_f32_to_bf16(src[i]);
    } else {
        uint16_t *d = dst;
        for (int64_t i = 0; i < n; i++) d[i] = sf_f32_to_f16(src[i]);
    }
}

const float *sfk_row(sfk_dtype t, const void *base, int64_t row, int64_t n, float *scratch)
{
    const char *p = (const char *)base + (size_t)(row * n) * (size_t)sfk_size(t);
    if (t == SFK_F32) return (const float *)p;
    sfk_load(t, p, n, scratch);
    return scratch;
}

/* ---- exp ---------------------------------------------------------------- */

/* r or x, whichever is larger; NaN once either is NaN (torch's max) */
static inline float max_nan(float r, float x) { return x > r || x != x ? x : r; }

#ifdef SFK_X86
#define AVX2 __attribute__((target("avx2,fma")))

#define exp8 sfk_exp8    /* common.h */

AVX2 static void exp_avx2(const float *src, float *dst, int64_t n)
{
    int64_t i = 0;
    for (; i + 8 <= n; i += 8)
        _mm256_storeu_ps(dst + i, exp8(_mm256_loadu_ps(src + i)));
    for (; i < n; i++) dst[i] = expf(src[i]);
}

AVX2 static void scaled_exp_avx2(const float *src, float *dst, int64_t n, float shift, float scale,
                                  float off)
{
    const __m256 sh = _mm256_set1_ps(shift), sc = _mm256_set1_ps(scale), of = _mm256_set1_ps(off);
    int64_t i = 0;
    for (; i + 8 <= n; i += 8) {
        __m256 e = exp8(_mm256_sub_ps(_mm256_loadu_ps(src + i), sh));
        _mm256_storeu_ps(dst + i, _mm256_fmsub_ps(sc, e, of));
    }
    for (; i < n; i++) dst[i] = scale * expf(src[i] - shift) - off;
}

AVX2 static float hsum8(__m256 v)
{
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_shuffle_ps(s, s, 1));
    return _mm_cvtss_f32(s);
}

AVX2 static float sum_exp_avx2(const float *x, int64_t n, float shift)
{
    __m256 acc0 = _mm256_setzero_ps(), acc1 = _mm256_setzero_ps();
    __m256 sh = _mm256_set1_ps(shift);
    int64_t i = 0;
    for (; i + 16 <= n; i += 16) {
        acc0 = _mm256_add_ps(acc0, exp8(_mm256_sub_ps(_mm256_loadu_ps(x + i), sh)));
        acc1 = _mm256_add_ps(acc1, exp8(_mm256_sub_ps(_mm256_loadu_ps(x + i + 8), sh)));
    }
    float s = hsum8(_mm256_add_ps(acc0, acc1));
    for (; i < n; i++) s += expf(x[i] - shift);
    return s;
}

AVX2 static float max_avx2(const float *x, int64_t n)
{
    __m256 m = _mm256_set1_ps(-INFINITY), nan = _mm256_setzero_ps();
    int64_t i = 0;
    for (; i + 8 <= n; i += 8) {
        const __m256 v = _mm256_loadu_ps(x + i);
        m = _mm256_max_ps(m, v);
        nan = _mm256_or_ps(nan, _mm256_cmp_ps(v, v, _CMP_UNORD_Q));
    }
    if (_mm256_movemask_ps(nan)) return NAN;
    float b[8];
    _mm256_storeu_ps(b, m);
    float r = -INFINITY;
    for (int j = 0; j < 8; j++) r = max_nan(r, b[j]);
    for (; i < n; i++) r = max_nan(r, x[i]);
    return r;
}
#endif

void sfk_exp(const float *src, float *dst, int64_t n)
{
#ifdef SFK_X86
    if (sf_cpu_has_simd()) { exp_avx2(src, dst, n); return; }
#endif
    for (int64_t i = 0; i < n; i++) dst[i] = expf(src[i]);
}

void sfk_scaled_exp(const float *src, float *dst, int64_t n, float shift, float scale, float off)
{
#ifdef SFK_X86
    if (sf_cpu_has_simd()) { scaled_exp_avx2(src, dst, n, shift, scale, off); return; }
#endif
    for (int64_t i = 0; i < n; i++) dst[i] = scale * expf(src[i] - shift) - off;
}

float sfk_sum_exp(const float *x, int64_t n, float shift)
{
#ifdef SFK_X86
    if (sf_cpu_has_simd()) return sum_exp_avx2(x, n, shift);
#endif
    float s = 0.0f;
    for (int64_t i = 0; i < n; i++) s += expf(x[i] - shift);
    return s;
}

float sfk_max(const float *x, int64_t n)
{
#ifdef SFK_X86
    if (sf_cpu_has_simd()) return max_avx2(x, n);
#endif
    float r = -INFINITY;
    for (int64_t i = 0; i < n; i++) r = max_nan(r, x[i]);
    return r;
}

/* ---- threads ------------------------------------------------------------
 *
 * A persistent pool: sfk_parallel_rows hands chunks 1.. of a call to
 * nthreads - 1 workers made once (lazily, at the first parallel call) and
 * runs chunk 0 itself.  The pool has sfk_get_num_threads() - 1 workers; a call
 * after sfk_set_num_threads changed that count stops the old workers and makes
 * the new ones (nothing else ever creates threads: pool_stats().created
 * stays put over any number of calls).
 *
 * Waiting, both ways (a worker for work, the caller for the workers), is a
 * short bounded spin then a block on a condition variable.  The spin
 * (SPIN_ITERS pause instructions: some 10-40 us, by the CPU's pause latency)
 * catches the next call of a run of back-to-back kernels without a futex
 * wake-up; the block means an idle pool costs no CPU.  The spin is short on
 * purpose: on the shared 2-core machine (load 3-5 from other processes)
 * 4000 pauses (~200 us) made a 2-thread [2048 x 256] layer_norm take 437 us
 * against 270 us for a thread per call and 230 us on one thread -- the
 * spinning burns the process's share of the CPUs and the caller is then
 * preempted -- while 256 pauses gave 251 us (benchmarks/kernel_pool.py).
 * There is no unbounded spin anywhere.
 *
 * One parallel call at a time: g_call is taken with trylock, and a call that
 * finds the pool busy (another Python thread's kernel -- the kernels run
 * without the GIL -- or a kernel nested in a kernel) runs all its rows
 * inline as thread 0, which every kernel supports (tid 0 < nthreads).
 *
 * Fork: pthread_atfork takes g_call before fork() (so no call is half done),
 * and in the child, which has none of the workers, forgets them and
 * reinitializes the locks; the child makes its own pool at its first
 * parallel call.  sfk_pool_shutdown (run at interpreter exit) stops and joins
 * the workers, so leak checkers see no threads or memory left over. */

#define SFK_MAX_THREADS 64
#define SPIN_ITERS 256

static _Atomic int g_threads = 1;

void sfk_set_num_threads(int n)
{
    atomic_store(&g_threads, n < 1 ? 1 : n > SFK_MAX_THREADS ? SFK_MAX_THREADS : n);
}

int sfk_get_num_threads(void) { return atomic_load(&g_threads); }

int sfk_threads_for(int64_t rows, int64_t cost)
{
    int t = sfk_get_num_threads();
    if (rows < t) t = (int)(rows > 0 ? rows : 1);
    if (sfk_sat_mul(rows, cost > 0 ? cost : 1) < SFK_PAR_MIN) t = 1;
    return t;
}

/* rows * t / n without overflow: base * t + (extra * t) / n with rows =
 * base * n + extra (both products fit: base * t <= rows, extra * t < n * n). */
static int64_t split_point(int64_t rows, int t, int n)
{
    const int64_t base = rows / n, extra = rows % n;
    return base * t + extra * t / n;
}

static inline void cpu_relax(void)
{
#ifdef SFK_X86
    _mm_pause();
#else
    __asm__ __volatile__("" ::: "memory");
#endif
}

typedef struct {
    pthread_mutex_t mu;             /* guards the sleeps on work / done */
    pthread_cond_t work, done;
    pthread_t th[SFK_MAX_THREADS];
    _Atomic int nworkers;           /* workers running (the caller is thread 0); read by stats */
    /* the current job, written by the caller before it bumps gen */
    sfk_rows_fn fn;
    void *ctx;
    int64_t rows;
    int nthreads;
    _Atomic uint64_t gen;           /* bumped once per job (and to stop) */
    _Atomic int pending;            /* workers yet to finish the current job */
    _Atomic int stop;
    uint64_t start_gen;             /* gen when the workers were made (they wait for the next) */
} pool_t;

static pool_t g_pool = {.mu = PTHREAD_MUTEX_INITIALIZER, .work = PTHREAD_COND_INITIALIZER,
                        .done = PTHREAD_COND_INITIALIZER};
static pthread_mutex_t g_call = PTHREAD_MUTEX_INITIALIZER;   /* one parallel call at a time */
static pthread_once_t g_atfork_once = PTHREAD_ONCE_INIT;
static _Atomic int64_t g_created, g_pool_calls, g_inline_busy;

static void *worker_main(void *arg)
{
    const int id = (int)(intptr_t)arg;      /* thread id of this worker's chunk: 1.. */
    pool_t *p = &g_pool;
    /* not gen now: the first job may have been published already */
    uint64_t seen = p->start_gen;
    for (;;) {
        for (int i = 0; i < SPIN_ITERS && atomic_load(&p->gen) == seen; i++) cpu_relax();
        if (atomic_load(&p->gen) == seen) {
            pthread_mutex_lock(&p->mu);
            while (atomic_load(&p->gen) == seen) pthread_cond_wait(&p->work, &p->mu);
            pthread_mutex_unlock(&p->mu);
        }
        seen = atomic_load(&p->gen);
        if (atomic_load(&p->stop)) break;
        /* every worker acknowledges every job (pending counts them all), so
         * none can lag a job behind and read the next job's fields */
        if (id < p->nthreads)
            p->fn(p->ctx, split_point(p->rows, id, p->nthreads),
                  split_point(p->rows, id + 1, p->nthreads), id);
        if (atomic_fetch_sub(&p->pending, 1) == 1) {
            pthread_mutex_lock(&p->mu);
            pthread_cond_signal(&p->done);
            pthread_mutex_unlock(&p->mu);
        }
    }
    return NULL;
}

/* Stop and join the workers (g_call held). */
static void pool_stop(pool_t *p)
{
    if (p->nworkers == 0) return;
    atomic_store(&p->stop, 1);
    pthread_mutex_lock(&p->mu);
    atomic_fetch_add(&p->gen, 1);
    pthread_cond_broadcast(&p->work);
    pthread_mutex_unlock(&p->mu);
    for (int i = 0; i < p->nworkers; i++) pthread_join(p->th[i], NULL);
    p->nworkers = 0;
    atomic_store(&p->stop, 0);
}

/* Make `want` workers (g_call held); fewer if pthread_create fails. */
static void pool_start(pool_t *p, int want)
{
    p->start_gen = atomic_load(&p->gen);     /* before pthread_create: the workers see it */
    for (int i = 0; i < want; i++) {
        if (pthread_create(&p->th[i], NULL, worker_main, (void *)(intptr_t)(i + 1)) != 0) break;
        p->nworkers = i + 1;
        atomic_fetch_add(&g_created, 1);
    }
}

static void atfork_prepare(void) { pthread_mutex_lock(&g_call); }
static void atfork_parent(void) { pthread_mutex_unlock(&g_call); }
static void atfork_child(void)
{
    /* The workers do not exist here; a worker may have held mu at fork. */
    pthread_mutex_init(&g_call, NULL);
    pthread_mutex_init(&g_pool.mu, NULL);
    pthread_cond_init(&g_pool.work, NULL);
    pthread_cond_init(&g_pool.done, NULL);
    g_pool.nworkers = 0;
    atomic_store(&g_pool.pending, 0);
    atomic_store(&g_pool.stop, 0);
}

static void register_atfork(void) { pthread_atfork(atfork_prepare, atfork_parent, atfork_child); }

void sfk_parallel_rows(int64_t rows, int nthreads, sfk_rows_fn fn, void *ctx)
{
    if (rows <= 0) return;
    if (nthreads > SFK_MAX_THREADS) nthreads = SFK_MAX_THREADS;
    if (nthreads <= 1) { fn(ctx, 0, rows, 0); return; }
    pthread_once(&g_atfork_once, register_atfork);
    if (pthread_mutex_trylock(&g_call) != 0) {
        atomic_fetch_add(&g_inline_busy, 1);
        fn(ctx, 0, rows, 0);       /* pool busy (another thread's call, or nested) */
        return;
    }
    pool_t *p = &g_pool;
    int want = sfk_get_num_threads() - 1;
    if (want < nthreads - 1) want = nthreads - 1;
    if (p->nworkers != want) {
        pool_stop(p);
        pool_start(p, want);
    }
    if (p->nworkers < nthreads - 1) {       /* could not make the workers */
        pthread_mutex_unlock(&g_call);
        fn(ctx, 0, rows, 0);
        return;
    }
    atomic_fetch_add(&g_pool_calls, 1);
    p->fn = fn;
    p->ctx = ctx;
    p->rows = rows;
    p->nthreads = nthreads;
    atomic_store(&p->pending, p->nworkers);
    pthread_mutex_lock(&p->mu);
    atomic_fetch_add(&p->gen, 1);           /* publishes the job (seq_cst) */
    pthread_cond_broadcast(&p->work);
    pthread_mutex_unlock(&p->mu);
    fn(ctx, 0, split_point(rows, 1, nthreads), 0);
    for (int i = 0; i < SPIN_ITERS && atomic_load(&p->pending) > 0; i++) cpu_relax();
    if (atomic_load(&p->pending) > 0) {
        pthread_mutex_lock(&p->mu);
        while (atomic_load(&p->pending) > 0) pthread_cond_wait(&p->done, &p->mu);
        pthread_mutex_unlock(&p->mu);
    }
    pthread_mutex_unlock(&g_call);
}

void sfk_pool_shutdown(void)
{
    /* trylock: a call still running in another thread (a daemon thread at
     * exit) keeps its pool; the process is going away anyway */
    if (pthread_mutex_trylock(&g_call) != 0) return;
    pool_stop(&g_pool);
    pthread_mutex_unlock(&g_call);
}

void sfk_pool_stats(int64_t *created, int64_t *workers, int64_t *calls, int64_t *inline_busy)
{
    *created = atomic_load(&g_created);
    *workers = g_pool.nworkers;
    *calls = atomic_load(&g_pool_calls);
    *inline_busy = atomic_load(&g_inline_busy);
}
