/* Staged copies between pageable host memory and a device, run by a C thread that never takes
 * Python's GIL: the copy queue of one direction of the staging buffer (staging.py).
 *
 * Why C: the same loop in Python takes the GIL back after every memcpy, launch and event wait,
 * and with the decode thread running Python beside it each hand-over costs up to a thread
 * switch interval; on the H200 machine that made the pageable decode step 2-3x the pinned one
 * (docs/results.md). staging.py holds the reference loop in Python, which this one mirrors
 * chunk for chunk and which the tests compare it to.
 *
 * A lane is one direction: two pinned halves, an event per half, one copy stream. Jobs run in
 * submission order, one at a time, so a job holds the halves for all of its chunks. Per chunk,
 * host to device: wait until the half's previous DMA is done (its event), memcpy the chunk into
 * the half on OpenMP threads, queue the DMA, record the half's event. Device to host: queue the
 * chunk's DMA into a half, record its event, and while it runs drain the previous chunk from the
 * other half into its pageable destination. A job first waits for its gates (counters that
 * other threads set right after they record the CUDA events the job depends on), then makes
 * the stream wait for those events; after its last DMA it records `record` and sets its signal.
 *
 * The CUDA runtime functions come in as pointers (from the libcudart that PyTorch loaded), so
 * this file needs no CUDA headers. With `cuda` NULL the "DMA" is a plain memcpy (CPU), which
 * lets the same loop run in CI.
 */
#include <pthread.h>
#include <stddef.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#if defined(__SSE2__)
#include <emmintrin.h>
#endif

typedef int (*memcpy_async_fn)(void *dst, const void *src, size_t n, int kind, void *stream);
typedef int (*event_fn)(void *event);                             /* cudaEventSynchronize */
typedef int (*record_fn)(void *event, void *stream);              /* cudaEventRecord */
typedef int (*wait_fn)(void *stream, void *event, unsigned flags);  /* cudaStreamWaitEvent */
typedef int (*set_device_fn)(int device);                         /* cudaSetDevice */

struct kvf_cuda {
    memcpy_async_fn memcpy_async;
    event_fn event_sync;
    record_fn event_record;
    wait_fn stream_wait;
    set_device_fn set_device;
};

struct kvf_lane {           /* fixed for the life of a worker */
    int to_device;          /* 1: host to device, 0: device to host */
    int nthreads;           /* memcpy threads */
    int device;
    void *stream;           /* the lane's copy stream (NULL on CPU) */
    void *half_event[2];    /* recorded after each DMA through a half (NULL on CPU) */
};

struct kvf_pair {
    char *dst;
    char *src;
    size_t n;
};

struct kvf_job {            /* one submit(); the arrays are copied at submit */
    int n_pairs, n_waits, n_gates;
    struct kvf_pair *pairs;
    size_t chunk;           /* bytes per chunk (the last of a pair may be shorter) */
    char *half[2];
    void **waits;           /* CUDA events the stream waits for first */
    long long **gate_ctr;   /* ... once these counters reach gate_gen */
    long long *gate_gen;
    void *record;           /* CUDA event recorded after the last DMA, or NULL */
    long long *signal_ctr;  /* set to signal_gen when the job is issued (CPU: done) */
    long long signal_gen;
    long delay_us;          /* test hook: sleep before the job */
    struct kvf_job *next;
    long long ticket;
};

struct kvf_worker {
    pthread_t th;
    pthread_mutex_t mu;
    pthread_cond_t cv_job, cv_done;
    struct kvf_job *head, *tail;
    long long submitted, done;
    int err, stop, h, has_cuda;
    struct kvf_cuda cuda;
    struct kvf_lane lane;
    double busy_s;          /* seconds spent running jobs (gates and delays excluded) */
};

static double now(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return ts.tv_sec + ts.tv_nsec * 1e-9;
}

/* A copy whose destination the CPU does not read again soon (a staging half, read by the DMA;
 * a pageable KV row, read by the next delivery's memcpy long after it has left the caches):
 * non-temporal stores skip the read-for-ownership of every destination line and keep the
 * caches for the source. On this repository's CI-like machine (one thread, 16 MiB chunks into
 * two alternating halves, /tmp probe of 2026-12-05) plain memcpy moved 10.8-11.4 GB/s and this
 * loop 17.7-18.4 GB/s; pageable decode on the GPU machines is bound by this copy
 * (docs/results.md). */
static void stream_copy(char *dst, const char *src, size_t n) {
#if defined(__SSE2__)
    size_t head = (16 - ((size_t)dst & 15)) & 15;
    if (head > n)
        head = n;
    memcpy(dst, src, head);
    size_t i = head;
    for (; i + 64 <= n; i += 64) {
        __m128i a = _mm_loadu_si128((const __m128i *)(src + i));
        __m128i b = _mm_loadu_si128((const __m128i *)(src + i + 16));
        __m128i c = _mm_loadu_si128((const __m128i *)(src + i + 32));
        __m128i d = _mm_loadu_si128((const __m128i *)(src + i + 48));
        _mm_stream_si128((__m128i *)(dst + i), a);
        _mm_stream_si128((__m128i *)(dst + i + 16), b);
        _mm_stream_si128((__m128i *)(dst + i + 32), c);
        _mm_stream_si128((__m128i *)(dst + i + 48), d);
    }
    _mm_sfence();  /* the stores are visible before the DMA (or the next reader) is started */
    memcpy(dst + i, src + i, n - i);
#else
    memcpy(dst, src, n);
#endif
}

static void par_memcpy(char *dst, const char *src, size_t n, int nthreads) {
    /* one piece per thread, cut at 4 KiB so no two threads write one page */
    if (nthreads <= 1 || n < ((size_t)256 << 10)) {
        stream_copy(dst, src, n);
        return;
    }
    size_t piece = (n / nthreads + 4095) & ~(size_t)4095;
    #pragma omp parallel for num_threads(nthreads) schedule(static)
    for (int i = 0; i < nthreads; i++) {
        size_t off = (size_t)i * piece;
        if (off < n)
            stream_copy(dst + off, src + off, n - off < piece ? n - off : piece);
    }
}

/* Host to device: returns the half the next job starts in, or -1000 - err on a CUDA error. */
static int run_h2d(const struct kvf_lane *ln, const struct kvf_cuda *cu, const struct kvf_job *j, int h) {
    for (int p = 0; p < j->n_pairs; p++) {
        const struct kvf_pair *pr = &j->pairs[p];
        for (size_t off = 0; off < pr->n; off += j->chunk) {
            size_t n = pr->n - off < j->chunk ? pr->n - off : j->chunk;
            /* the half's last DMA may still read it */
            int err = cu ? cu->event_sync(ln->half_event[h]) : 0;
            if (err)
                return -1000 - err;
            par_memcpy(j->half[h], pr->src + off, n, ln->nthreads);
            if (cu) {
                err = cu->memcpy_async(pr->dst + off, j->half[h], n, 1 /* host to device */, ln->stream);
                if (!err)
                    err = cu->event_record(ln->half_event[h], ln->stream);
                if (err)
                    return -1000 - err;
            } else {
                memcpy(pr->dst + off, j->half[h], n);
            }
            h ^= 1;
        }
    }
    return h;
}

/* Device to host: every byte is in the destinations on return; 0 or -1000 - err. */
static int run_d2h(const struct kvf_lane *ln, const struct kvf_cuda *cu, const struct kvf_job *j) {
    int h = 0, pend = -1, err = 0;
    char *pend_dst = NULL;
    size_t pend_n = 0;
    for (int p = 0; p <= j->n_pairs && !err; p++) {
        const struct kvf_pair *pr = p < j->n_pairs ? &j->pairs[p] : NULL;
        size_t total = pr ? pr->n : 0;
        for (size_t off = 0; (pr ? off < total : pend >= 0) && !err; off += j->chunk) {
            size_t n = 0;
            if (pr) {  /* queue this chunk's DMA into half h */
                n = total - off < j->chunk ? total - off : j->chunk;
                if (cu) {
                    err = cu->memcpy_async(j->half[h], pr->src + off, n, 2 /* device to host */, ln->stream);
                    if (!err)
                        err = cu->event_record(ln->half_event[h], ln->stream);
                } else {
                    memcpy(j->half[h], pr->src + off, n);
                }
            }
            if (!err && pend >= 0) {  /* drain the previous chunk under this one's DMA */
                err = cu ? cu->event_sync(ln->half_event[pend]) : 0;
                if (!err)
                    par_memcpy(pend_dst, j->half[pend], pend_n, ln->nthreads);
            }
            if (pr) {
                pend = h, pend_dst = pr->dst + off, pend_n = n;
                h ^= 1;
            } else {
                pend = -1;  /* the tail: drained, nothing new */
            }
        }
    }
    return err ? -1000 - err : 0;
}

static int gate_wait(struct kvf_worker *w, long long *ctr, long long gen) {
    /* another thread sets the counter right after it records the event: a short poll;
     * -1 when the worker is being stopped meanwhile (the job is then skipped) */
    struct timespec ts = {0, 20000};
    while (__atomic_load_n(ctr, __ATOMIC_ACQUIRE) < gen) {
        if (__atomic_load_n(&w->stop, __ATOMIC_ACQUIRE))
            return -1;
        nanosleep(&ts, NULL);
    }
    return 0;
}

static int run_job(struct kvf_worker *w, const struct kvf_job *j, int *h) {
    const struct kvf_cuda *cu = w->has_cuda ? &w->cuda : NULL;
    for (int i = 0; i < j->n_gates; i++)
        if (gate_wait(w, j->gate_ctr[i], j->gate_gen[i]))
            return 0;
    if (j->delay_us > 0) {
        struct timespec ts = {j->delay_us / 1000000, (j->delay_us % 1000000) * 1000};
        nanosleep(&ts, NULL);
    }
    double t0 = now();
    int err = 0;
    for (int i = 0; cu && i < j->n_waits && !err; i++)
        if (j->waits[i])  /* never recorded: nothing to wait for (PyTorch does the same) */
            err = cu->stream_wait(w->lane.stream, j->waits[i], 0);
    if (err)
        return err;
    int r = w->lane.to_device ? run_h2d(&w->lane, cu, j, *h) : run_d2h(&w->lane, cu, j);
    if (r < 0)
        return -1000 - r;
    if (w->lane.to_device)
        *h = r;
    if (cu && j->record)
        err = cu->event_record(j->record, w->lane.stream);
    w->busy_s += now() - t0;
    return err;
}

static void *worker_main(void *arg) {
    struct kvf_worker *w = arg;
    if (w->has_cuda && w->cuda.set_device)
        w->cuda.set_device(w->lane.device);  /* the runtime acts on the calling thread's device */
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
        if (!err)  /* after an error jobs are skipped (still signalled) until it is taken */
            err = run_job(w, j, &h);
        if (j->signal_ctr)  /* set even on error, so no waiter hangs */
            __atomic_store_n(j->signal_ctr, j->signal_gen, __ATOMIC_RELEASE);
        pthread_mutex_lock(&w->mu);
        w->h = h;
        if (err && !w->err)
            w->err = err;
        w->done = j->ticket;
        pthread_cond_broadcast(&w->cv_done);
        free(j);
    }
    pthread_mutex_unlock(&w->mu);
    return NULL;
}

/* cuda NULL: CPU. Returns NULL on failure. */
struct kvf_worker *kvf_worker_start(const struct kvf_cuda *cuda, const struct kvf_lane *lane) {
    struct kvf_worker *w = calloc(1, sizeof *w);
    if (!w)
        return NULL;
    if (cuda) {
        w->cuda = *cuda;
        w->has_cuda = 1;
    }
    w->lane = *lane;
    pthread_mutex_init(&w->mu, NULL);
    pthread_cond_init(&w->cv_job, NULL);
    pthread_cond_init(&w->cv_done, NULL);
    if (pthread_create(&w->th, NULL, worker_main, w)) {
        free(w);
        return NULL;
    }
    return w;
}

/* Queues a copy of *job (its arrays too); returns its ticket (> 0), or -1 if out of memory. */
long long kvf_worker_submit(struct kvf_worker *w, const struct kvf_job *job) {
    size_t bytes = sizeof(struct kvf_job) + job->n_pairs * sizeof(struct kvf_pair)
                   + job->n_waits * sizeof(void *) + job->n_gates * (sizeof(long long *) + sizeof(long long));
    struct kvf_job *j = malloc(bytes);
    if (!j)
        return -1;
    *j = *job;
    char *p = (char *)(j + 1);
    j->pairs = (struct kvf_pair *)p, p += job->n_pairs * sizeof(struct kvf_pair);
    j->waits = (void **)p, p += job->n_waits * sizeof(void *);
    j->gate_ctr = (long long **)p, p += job->n_gates * sizeof(long long *);
    j->gate_gen = (long long *)p;
    memcpy(j->pairs, job->pairs, job->n_pairs * sizeof(struct kvf_pair));
    memcpy(j->waits, job->waits, job->n_waits * sizeof(void *));
    memcpy(j->gate_ctr, job->gate_ctr, job->n_gates * sizeof(long long *));
    memcpy(j->gate_gen, job->gate_gen, job->n_gates * sizeof(long long));
    j->next = NULL;
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
 * Returns the sticky error (0: none) and clears it. */
int kvf_worker_wait(struct kvf_worker *w, long long *ctr, long long gen) {
    pthread_mutex_lock(&w->mu);
    while (ctr ? __atomic_load_n(ctr, __ATOMIC_ACQUIRE) < gen : w->done < w->submitted)
        pthread_cond_wait(&w->cv_done, &w->mu);
    int err = w->err;
    w->err = 0;
    pthread_mutex_unlock(&w->mu);
    return err;
}

/* 1 when every queued job has run (the stream may still hold DMAs). */
int kvf_worker_idle(struct kvf_worker *w) {
    pthread_mutex_lock(&w->mu);
    int idle = w->done == w->submitted;
    pthread_mutex_unlock(&w->mu);
    return idle;
}

double kvf_worker_busy(struct kvf_worker *w) {
    pthread_mutex_lock(&w->mu);
    double s = w->busy_s;
    pthread_mutex_unlock(&w->mu);
    return s;
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
