/* Chunk pump for the staging buffer: host to device copies from pageable memory, run from one
 * call that never holds Python's GIL (ctypes releases it for the call).
 *
 * Why C: the same loop in Python takes the GIL back after every memcpy, launch and event wait,
 * and with the decode thread running Python beside it each hand-over costs up to a thread
 * switch interval; on the H200 machine that Python made the pageable decode step 2-3x the
 * pinned one (docs/results.md, issue 4). Nothing here is new logic: staging.py holds the
 * reference loop, which this one mirrors chunk for chunk and which the tests compare it to.
 *
 * Per chunk: wait until the half's previous DMA is done (its event), memcpy the chunk into the
 * half on `nthreads` OpenMP threads, queue the DMA on the staging stream, record the half's
 * event. The CUDA runtime functions come in as pointers (from the libcudart that PyTorch
 * loaded), so this file needs no CUDA headers; with `fns` NULL the "DMA" is a plain memcpy into
 * the destination (CPU), which lets the loop run where there is no GPU.
 */
#include <pthread.h>
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#if defined(__x86_64__)
#include <emmintrin.h>
#endif

typedef int (*memcpy_async_fn)(void *dst, const void *src, size_t n, int kind, void *stream);
typedef int (*event_fn)(void *event);                     /* cudaEventSynchronize */
typedef int (*record_fn)(void *event, void *stream);      /* cudaEventRecord */
typedef int (*wait_fn)(void *stream, void *event, unsigned flags);  /* cudaStreamWaitEvent */
typedef int (*set_device_fn)(int device);                 /* cudaSetDevice */

struct kvf_cuda {
    memcpy_async_fn memcpy_async;
    event_fn event_sync;
    record_fn event_record;
    wait_fn stream_wait;
    set_device_fn set_device;
};

static double now(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return ts.tv_sec + ts.tv_nsec * 1e-9;
}

/* Copy modes: KVF_COPY_MEMCPY is glibc's memcpy; KVF_COPY_STREAM writes with non-temporal
 * (streaming) stores, which skip reading the destination's lines into the cache before
 * overwriting them and leave no dirty lines for the DMA engine to snoop. glibc switches to such
 * stores only above a size threshold that the per-thread pieces here stay under. Where the
 * CPU has no such stores (not x86-64), STREAM is memcpy. */
enum { KVF_COPY_MEMCPY = 0, KVF_COPY_STREAM = 1 };

static void copy_piece(char *dst, const char *src, size_t n, int mode) {
#if defined(__x86_64__)
    if (mode == KVF_COPY_STREAM && n >= 256) {
        size_t head = (64 - ((uintptr_t)dst & 63)) & 63;  /* to a cache line of dst */
        memcpy(dst, src, head);
        dst += head, src += head, n -= head;
        size_t body = n & ~(size_t)63;
        for (size_t i = 0; i < body; i += 64) {
            __m128i a = _mm_loadu_si128((const __m128i *)(src + i));
            __m128i b = _mm_loadu_si128((const __m128i *)(src + i + 16));
            __m128i c = _mm_loadu_si128((const __m128i *)(src + i + 32));
            __m128i d = _mm_loadu_si128((const __m128i *)(src + i + 48));
            _mm_stream_si128((__m128i *)(dst + i), a);
            _mm_stream_si128((__m128i *)(dst + i + 16), b);
            _mm_stream_si128((__m128i *)(dst + i + 32), c);
            _mm_stream_si128((__m128i *)(dst + i + 48), d);
        }
        _mm_sfence();  /* the streamed lines are visible before this thread's next store */
        memcpy(dst + body, src + body, n - body);
        return;
    }
#endif
    (void)mode;
    memcpy(dst, src, n);
}

static void par_memcpy(char *dst, const char *src, size_t n, int nthreads, int mode) {
    /* one piece per thread, cut at 4 KiB so no two threads write one page */
    if (nthreads <= 1 || n < ((size_t)256 << 10)) {
        copy_piece(dst, src, n, mode);
        return;
    }
    size_t piece = (n / nthreads + 4095) & ~(size_t)4095;
    #pragma omp parallel for num_threads(nthreads) schedule(static)
    for (int i = 0; i < nthreads; i++) {
        size_t off = (size_t)i * piece;
        if (off < n)
            copy_piece(dst + off, src + off, n - off < piece ? n - off : piece, mode);
    }
}

/* The memcpy alone, for benchmarks/host_copy_probe.py. */
void kvf_copy(char *dst, const char *src, size_t n, int nthreads, int mode) {
    par_memcpy(dst, src, n, nthreads, mode);
}

/* Copies n_pairs (dst, src, size) through two halves in chunks of chunk[i] bytes for pair i,
 * starting in half `h`, the memcpy in copy mode `mode`. On CUDA the stream first waits for the n_waits events in `waits`, and
 * `record` (when not NULL) is recorded after the last DMA: the whole event-ordered call is one
 * trip out of Python. times[0..2] accumulate seconds waiting for a half, in memcpy, and
 * issuing; counts[0] accumulates chunks. skip_half_wait is a test-only negative control. Returns the half the next copy starts in (0 or 1), or
 * -1000 - err when a CUDA call fails with err. */
int kvf_h2d(int n_pairs, char **dsts, char **srcs, const size_t *sizes, const size_t *chunk,
            char *half0, char *half1, void *ev0, void *ev1, void *stream, int h, int nthreads,
            int mode, const struct kvf_cuda *cuda, double *times, long *counts, int skip_half_wait,
            int n_waits, void **waits, void *record) {
    char *halves[2] = {half0, half1};
    void *events[2] = {ev0, ev1};
    for (int i = 0; cuda && i < n_waits; i++) {
        if (!waits[i])
            continue;  /* never recorded: nothing to wait for (PyTorch does the same) */
        int err = cuda->stream_wait(stream, waits[i], 0);
        if (err)
            return -1000 - err;
    }
    for (int p = 0; p < n_pairs; p++) {
        for (size_t off = 0; off < sizes[p]; off += chunk[p]) {
            size_t n = sizes[p] - off < chunk[p] ? sizes[p] - off : chunk[p];
            double t0 = now();
            /* the half's last DMA may still read it (skip_half_wait: test-only negative control) */
            int err = cuda && !skip_half_wait ? cuda->event_sync(events[h]) : 0;
            if (err)
                return -1000 - err;
            double t1 = now();
            par_memcpy(halves[h], srcs[p] + off, n, nthreads, mode);
            double t2 = now();
            if (cuda) {
                err = cuda->memcpy_async(dsts[p] + off, halves[h], n, 1 /* host to device */, stream);
                if (!err)
                    err = cuda->event_record(events[h], stream);
                if (err)
                    return -1000 - err;
            } else {
                memcpy(dsts[p] + off, halves[h], n);
            }
            times[0] += t1 - t0;
            times[1] += t2 - t1;
            times[2] += now() - t2;
            counts[0] += 1;
            h ^= 1;
        }
    }
    if (cuda && record) {
        int err = cuda->event_record(record, stream);
        if (err)
            return -1000 - err;
    }
    return h;
}

/* Device to host, for the event-ordered write-backs: after the stream waits for `waits`, each
 * chunk's DMA goes into a half, and while it runs the previous chunk is drained from the other
 * half into its pageable destination; `record` is recorded after the last DMA. Returns 0, or
 * -1000 - err. CUDA only (the CPU path stays in staging.py). */
int kvf_d2h(int n_pairs, char **dsts, char **srcs, const size_t *sizes, const size_t *chunk,
            char *half0, char *half1, void *ev0, void *ev1, void *stream, int nthreads,
            int mode, const struct kvf_cuda *cuda, double *times, long *counts,
            int n_waits, void **waits, void *record) {
    char *halves[2] = {half0, half1};
    void *events[2] = {ev0, ev1};
    int err = 0, h = 0, pend_h = -1;
    char *pend_dst = NULL;
    size_t pend_n = 0;
    for (int i = 0; i < n_waits && !err; i++)
        if (waits[i])  /* never recorded: nothing to wait for */
            err = cuda->stream_wait(stream, waits[i], 0);
    for (int p = 0; p < n_pairs && !err; p++) {
        for (size_t off = 0; off < sizes[p] && !err; off += chunk[p]) {
            size_t n = sizes[p] - off < chunk[p] ? sizes[p] - off : chunk[p];
            double t0 = now();
            err = cuda->memcpy_async(halves[h], srcs[p] + off, n, 2 /* device to host */, stream);
            if (!err)
                err = cuda->event_record(events[h], stream);
            times[2] += now() - t0;
            counts[0] += 1;
            if (!err && pend_h >= 0) {  /* drain the previous chunk under this one's DMA */
                double t1 = now();
                err = cuda->event_sync(events[pend_h]);
                double t2 = now();
                par_memcpy(pend_dst, halves[pend_h], pend_n, nthreads, mode);
                times[0] += t2 - t1;
                times[1] += now() - t2;
            }
            pend_h = h;
            pend_dst = dsts[p] + off;
            pend_n = n;
            h ^= 1;
        }
    }
    if (!err && pend_h >= 0) {
        double t1 = now();
        err = cuda->event_sync(events[pend_h]);
        double t2 = now();
        if (!err)
            par_memcpy(pend_dst, halves[pend_h], pend_n, nthreads, mode);
        times[0] += t2 - t1;
        times[1] += now() - t2;
    }
    if (!err && record)
        err = cuda->event_record(record, stream);
    return err ? -1000 - err : 0;
}

/* ---- The delivery worker: a copy thread with no Python in it ------------------------------
 *
 * The transport's deliveries as a queue of jobs run by one pthread, so no step of a delivery
 * needs the GIL: the decode thread submits a job (pairs, events, gates, the event to record)
 * and goes on; the worker waits for the job's gates (counters that other threads set when
 * the events they guard have been recorded, the host side of the transport's SlotEvents),
 * then runs kvf_h2d for it (stream waits, chunks, record), then publishes the job's signal
 * counter. Jobs run in submission order, one at a time, so a job holds the halves for all
 * of its chunks as a Python-side copy holds the direction's lock. Errors are sticky until
 * taken; a job after an error is skipped but still signalled, so no waiter hangs. */

struct kvf_job {
    struct kvf_job *next;
    long long ticket;
    int n_pairs, n_waits, n_gates;
    char **dsts, **srcs;
    size_t *sizes, *chunk;
    void **waits;
    long long **gate_ctr, *gate_gen;
    char *half0, *half1;
    void *ev0, *ev1, *stream, *record;
    long long *signal_ctr, signal_gen;
    int nthreads, mode;
};

struct kvf_worker {
    pthread_t th;
    pthread_mutex_t mu;
    pthread_cond_t cv_job, cv_done;
    struct kvf_job *head, *tail;
    long long submitted, done;
    int err, stop, h, device, has_cuda;
    struct kvf_cuda cuda;
    double times[3];
    long chunks;
};

static int gate_wait(struct kvf_worker *w, long long *ctr, long long gen) {
    /* another thread marks the counter right after it records the event: a short poll;
     * -1 when the worker is being stopped meanwhile (the job is then skipped) */
    struct timespec ts = {0, 20000};
    while (__atomic_load_n(ctr, __ATOMIC_ACQUIRE) < gen) {
        if (__atomic_load_n(&w->stop, __ATOMIC_ACQUIRE))
            return -1;
        nanosleep(&ts, NULL);
    }
    return 0;
}

static void *worker_main(void *arg) {
    struct kvf_worker *w = arg;
    if (w->has_cuda && w->cuda.set_device)
        w->cuda.set_device(w->device);  /* the runtime acts on the calling thread's device */
    pthread_mutex_lock(&w->mu);
    for (;;) {
        while (!w->head && !w->stop)
            pthread_cond_wait(&w->cv_job, &w->mu);
        if (!w->head)
            break;
        struct kvf_job *j = w->head;
        w->head = j->next;
        if (!w->head)
            w->tail = NULL;
        int err = w->err, h = w->h;
        pthread_mutex_unlock(&w->mu);
        double times[3] = {0, 0, 0};
        long chunks = 0;
        int gated = 0;
        for (int i = 0; !err && !gated && i < j->n_gates; i++)
            gated = gate_wait(w, j->gate_ctr[i], j->gate_gen[i]);
        if (!err && !gated) {
            int r = kvf_h2d(j->n_pairs, j->dsts, j->srcs, j->sizes, j->chunk, j->half0, j->half1,
                            j->ev0, j->ev1, j->stream, h, j->nthreads, j->mode,
                            w->has_cuda ? &w->cuda : NULL, times, &chunks, 0,
                            j->n_waits, j->waits, j->record);
            if (r < 0)
                err = -1000 - r;
            else
                h = r;
        }
        if (j->signal_ctr)  /* marked even on error, so no waiter hangs */
            __atomic_store_n(j->signal_ctr, j->signal_gen, __ATOMIC_RELEASE);
        pthread_mutex_lock(&w->mu);
        w->h = h;
        if (err && !w->err)
            w->err = err;
        for (int i = 0; i < 3; i++)
            w->times[i] += times[i];
        w->chunks += chunks;
        w->done = j->ticket;
        pthread_cond_broadcast(&w->cv_done);
        free(j);
    }
    pthread_mutex_unlock(&w->mu);
    return NULL;
}

/* cuda NULL: CPU (the "DMA" is a memcpy into the destination). Returns NULL on failure. */
struct kvf_worker *kvf_worker_start(const struct kvf_cuda *cuda, int device) {
    struct kvf_worker *w = calloc(1, sizeof *w);
    if (!w)
        return NULL;
    if (cuda) {
        w->cuda = *cuda;
        w->has_cuda = 1;
    }
    w->device = device;
    pthread_mutex_init(&w->mu, NULL);
    pthread_cond_init(&w->cv_job, NULL);
    pthread_cond_init(&w->cv_done, NULL);
    if (pthread_create(&w->th, NULL, worker_main, w)) {
        free(w);
        return NULL;
    }
    return w;
}

/* Queues one job (the arrays are copied); returns its ticket (> 0), or -1 if out of memory. */
long long kvf_worker_submit(struct kvf_worker *w, int n_pairs, char **dsts, char **srcs,
                            const size_t *sizes, const size_t *chunk, char *half0, char *half1,
                            void *ev0, void *ev1, void *stream, int nthreads, int mode,
                            int n_waits, void **waits, int n_gates, long long **gate_ctr,
                            const long long *gate_gen, void *record, long long *signal_ctr,
                            long long signal_gen) {
    size_t bytes = sizeof(struct kvf_job) + n_pairs * (2 * sizeof(char *) + 2 * sizeof(size_t))
                   + n_waits * sizeof(void *) + n_gates * (sizeof(long long *) + sizeof(long long));
    struct kvf_job *j = malloc(bytes);
    if (!j)
        return -1;
    char *p = (char *)(j + 1);
    j->dsts = (char **)p, p += n_pairs * sizeof(char *);
    j->srcs = (char **)p, p += n_pairs * sizeof(char *);
    j->sizes = (size_t *)p, p += n_pairs * sizeof(size_t);
    j->chunk = (size_t *)p, p += n_pairs * sizeof(size_t);
    j->waits = (void **)p, p += n_waits * sizeof(void *);
    j->gate_ctr = (long long **)p, p += n_gates * sizeof(long long *);
    j->gate_gen = (long long *)p;
    memcpy(j->dsts, dsts, n_pairs * sizeof(char *));
    memcpy(j->srcs, srcs, n_pairs * sizeof(char *));
    memcpy(j->sizes, sizes, n_pairs * sizeof(size_t));
    memcpy(j->chunk, chunk, n_pairs * sizeof(size_t));
    memcpy(j->waits, waits, n_waits * sizeof(void *));
    memcpy(j->gate_ctr, gate_ctr, n_gates * sizeof(long long *));
    memcpy(j->gate_gen, gate_gen, n_gates * sizeof(long long));
    j->next = NULL;
    j->n_pairs = n_pairs, j->n_waits = n_waits, j->n_gates = n_gates;
    j->half0 = half0, j->half1 = half1, j->ev0 = ev0, j->ev1 = ev1, j->stream = stream;
    j->record = record, j->signal_ctr = signal_ctr, j->signal_gen = signal_gen;
    j->nthreads = nthreads, j->mode = mode;
    pthread_mutex_lock(&w->mu);
    j->ticket = ++w->submitted;
    if (w->tail)
        w->tail->next = j;
    else
        w->head = j;
    w->tail = j;
    pthread_cond_signal(&w->cv_job);
    long long t = j->ticket;
    pthread_mutex_unlock(&w->mu);
    return t;
}

/* Blocks until *ctr >= gen (a job's signal) or, with ctr NULL, until every job is done.
 * Returns the sticky error (0: none) and, with take, clears it. */
int kvf_worker_wait(struct kvf_worker *w, long long *ctr, long long gen, int take) {
    pthread_mutex_lock(&w->mu);
    while (ctr ? __atomic_load_n(ctr, __ATOMIC_ACQUIRE) < gen : w->done < w->submitted)
        pthread_cond_wait(&w->cv_done, &w->mu);
    int err = w->err;
    if (take)
        w->err = 0;
    pthread_mutex_unlock(&w->mu);
    return err;
}

/* The half the next job starts in: read it (h < 0) or set it (only while idle). */
int kvf_worker_half(struct kvf_worker *w, int h) {
    pthread_mutex_lock(&w->mu);
    if (h >= 0)
        w->h = h;
    h = w->h;
    pthread_mutex_unlock(&w->mu);
    return h;
}

/* Accumulated wait / memcpy / issue seconds and chunks (for the staging buffer's stats). */
void kvf_worker_stats(struct kvf_worker *w, double *times, long *chunks) {
    pthread_mutex_lock(&w->mu);
    memcpy(times, w->times, sizeof w->times);
    *chunks = w->chunks;
    pthread_mutex_unlock(&w->mu);
}

void kvf_store(long long *ctr, long long v) {
    __atomic_store_n(ctr, v, __ATOMIC_RELEASE);
}

/* Runs what is queued (a job still waiting for a gate is skipped), then ends the thread and
 * frees the worker. */
void kvf_worker_stop(struct kvf_worker *w) {
    pthread_mutex_lock(&w->mu);
    __atomic_store_n(&w->stop, 1, __ATOMIC_RELEASE);
    pthread_cond_signal(&w->cv_job);
    pthread_mutex_unlock(&w->mu);
    pthread_join(w->th, NULL);
    pthread_cond_destroy(&w->cv_job);
    pthread_cond_destroy(&w->cv_done);
    pthread_mutex_destroy(&w->mu);
    free(w);
}
