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
#include <stddef.h>
#include <stdint.h>
#include <string.h>
#include <time.h>
#if defined(__x86_64__)
#include <emmintrin.h>
#endif

typedef int (*memcpy_async_fn)(void *dst, const void *src, size_t n, int kind, void *stream);
typedef int (*event_fn)(void *event);                     /* cudaEventSynchronize */
typedef int (*record_fn)(void *event, void *stream);      /* cudaEventRecord */
typedef int (*wait_fn)(void *stream, void *event, unsigned flags);  /* cudaStreamWaitEvent */

struct kvf_cuda {
    memcpy_async_fn memcpy_async;
    event_fn event_sync;
    record_fn event_record;
    wait_fn stream_wait;
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
