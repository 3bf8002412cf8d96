/* The direct tier's reader: pieces of a file read with pread from a pool of threads.
 *
 * A reader owns `depth` threads and one descriptor. A call hands it pieces sorted by file offset,
 * each (offset, length, destination); the reader covers them with spans aligned to `align` bytes
 * (pieces that start inside the current span join it, so neighbouring rows share one read), and
 * the threads take spans one at a time from the call's shared counter: up to `depth` reads are in
 * flight. Each thread reads into its own aligned buffer (what O_DIRECT needs), then copies the
 * span's pieces to their destinations. With `drop` set (a descriptor without O_DIRECT), each read
 * is followed by posix_fadvise(DONTNEED) on its range, so no cached pages stay behind.
 *
 * Calls from several threads run together: each call joins a queue, the threads serve the oldest
 * call that still has spans to hand out, then the next, so a call never waits for another to finish
 * while threads are idle, and each caller waits for its own spans only.
 *
 * Errors (a read that fails, or returns fewer bytes than the file holds there) stop the call: the
 * first is reported in `ple_read_error` (errno, 0 for a short read; the span's offset, length and
 * the bytes read) and the call returns -1.
 *
 * The threads do not exist in a forked child: a child never calls into a reader its parent made
 * (it makes its own; the parent's is left as it is, neither used nor freed).
 */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

typedef struct {
    int32_t err;    /* errno of the failed read; 0 for a short read */
    int64_t offset; /* the read's file offset */
    int64_t length; /* bytes asked for */
    int64_t got;    /* bytes read (short read), or -1 */
} ple_read_error;

typedef struct {
    int64_t start, length; /* aligned file span */
    int64_t first, last;   /* its pieces [first, last) */
} span_t;

typedef struct read_call {
    const int64_t *offsets, *lengths;
    uint8_t *const *dests;
    span_t *spans;
    int64_t nspans, max_span;
    atomic_llong next; /* the next span to hand out */
    atomic_int failed;
    ple_read_error error;
    int active; /* threads working on it (under the reader's mu) */
    int queued; /* still in the queue: spans left to hand out (under mu) */
    struct read_call *later;
} read_call;

typedef struct ple_reader {
    int fd, depth, drop;
    int64_t align, file_size;
    pthread_t *threads;
    int started;
    pthread_mutex_t mu;
    pthread_cond_t work_cv, done_cv;
    int stop;
    int calls;              /* calls in progress (queued or not) */
    read_call *head, *tail; /* calls with spans left to hand out, oldest first */
} ple_reader;

static int64_t align_down(int64_t x, int64_t a) { return x - x % a; }
static int64_t align_up(int64_t x, int64_t a) { return x + (a - x % a) % a; }

static void fail(read_call *c, int err, int64_t off, int64_t len, int64_t got) {
    int expected = 0;
    if (atomic_compare_exchange_strong(&c->failed, &expected, 1)) {
        c->error.err = err;
        c->error.offset = off;
        c->error.length = len;
        c->error.got = got;
    }
}

/* Read one span into buf and copy its pieces out; 0 or -1 (error recorded). */
static int read_span(const ple_reader *r, read_call *c, const span_t *s, uint8_t *buf) {
    int64_t want = s->length;
    if (s->start + want > r->file_size) want = r->file_size - s->start; /* the last block of the file */
    int64_t done = 0;
    while (done < want) {
        ssize_t got = pread(r->fd, buf + done, (size_t)(s->length - done), s->start + done);
        if (got < 0) {
            if (errno == EINTR) continue;
            fail(c, errno, s->start, s->length, -1);
            return -1;
        }
        if (got == 0) break;
        done += got;
        if (r->align > 1 && done % r->align) break; /* O_DIRECT: a partial block is the end of the file */
    }
    if (done < want) {
        fail(c, 0, s->start, s->length, done);
        return -1;
    }
    if (r->drop) posix_fadvise(r->fd, s->start, s->length, POSIX_FADV_DONTNEED);
    for (int64_t p = s->first; p < s->last; p++)
        memcpy(c->dests[p], buf + (c->offsets[p] - s->start), (size_t)c->lengths[p]);
    return 0;
}

/* Take `c` out of the queue (under mu): it has no span left to hand out. */
static void dequeue(ple_reader *r, read_call *c) {
    if (!c->queued) return;
    c->queued = 0;
    read_call **p = &r->head, *prev = NULL;
    while (*p != c) {
        prev = *p;
        p = &(*p)->later;
    }
    *p = c->later;
    if (r->tail == c) r->tail = prev;
    c->later = NULL;
}

static void *worker(void *arg) {
    ple_reader *r = (ple_reader *)arg;
    uint8_t *buf = NULL;
    int64_t cap = 0;
    for (;;) {
        pthread_mutex_lock(&r->mu);
        while (!r->stop && r->head == NULL) pthread_cond_wait(&r->work_cv, &r->mu);
        if (r->stop) {
            pthread_mutex_unlock(&r->mu);
            break;
        }
        read_call *c = r->head;
        c->active++;
        pthread_mutex_unlock(&r->mu);
        if (c->max_span > cap) {
            free(buf);
            buf = NULL;
            cap = 0;
            void *p = NULL;
            if (posix_memalign(&p, 4096, (size_t)c->max_span) == 0) {
                buf = p;
                cap = c->max_span;
            } else {
                fail(c, ENOMEM, 0, c->max_span, -1);
            }
        }
        while (buf != NULL && !atomic_load(&c->failed)) {
            int64_t k = atomic_fetch_add(&c->next, 1);
            if (k >= c->nspans) break;
            if (read_span(r, c, &c->spans[k], buf) != 0) break;
        }
        pthread_mutex_lock(&r->mu);
        dequeue(r, c); /* every span is handed out (or the call failed): newcomers serve the next call */
        if (--c->active == 0) pthread_cond_broadcast(&r->done_cv);
        pthread_mutex_unlock(&r->mu);
    }
    free(buf);
    return NULL;
}

void ple_reader_free(ple_reader *r);

/* A reader of `fd` (whose size is `file_size`) with `depth` threads, in `*out`; returns 0, or an
 * errno value (out of memory or threads). Reads are aligned to `align` bytes (4096 for O_DIRECT). */
int ple_reader_new(int fd, int depth, int64_t align, int drop, int64_t file_size, ple_reader **out) {
    *out = NULL;
    if (depth < 1 || align < 1) return EINVAL;
    ple_reader *r = calloc(1, sizeof *r);
    if (r == NULL) return ENOMEM;
    r->fd = fd;
    r->depth = depth;
    r->align = align;
    r->drop = drop;
    r->file_size = file_size;
    pthread_mutex_init(&r->mu, NULL);
    pthread_cond_init(&r->work_cv, NULL);
    pthread_cond_init(&r->done_cv, NULL);
    r->threads = calloc((size_t)depth, sizeof *r->threads);
    if (r->threads == NULL) {
        ple_reader_free(r);
        return ENOMEM;
    }
    for (int i = 0; i < depth; i++) {
        pthread_attr_t attr;
        pthread_attr_init(&attr);
        pthread_attr_setstacksize(&attr, 64 << 10);
        int rc = pthread_create(&r->threads[i], &attr, worker, r);
        pthread_attr_destroy(&attr);
        if (rc != 0) {
            ple_reader_free(r);
            return rc;
        }
        r->started++;
    }
    *out = r;
    return 0;
}

void ple_reader_free(ple_reader *r) {
    if (r == NULL) return;
    pthread_mutex_lock(&r->mu);
    while (r->calls > 0) pthread_cond_wait(&r->done_cv, &r->mu); /* calls in progress finish first */
    r->stop = 1;
    pthread_cond_broadcast(&r->work_cv);
    pthread_mutex_unlock(&r->mu);
    for (int i = 0; i < r->started; i++) pthread_join(r->threads[i], NULL);
    free(r->threads);
    pthread_cond_destroy(&r->work_cv);
    pthread_cond_destroy(&r->done_cv);
    pthread_mutex_destroy(&r->mu);
    free(r);
}

/* Read `n` pieces: piece i is `lengths[i]` bytes at file offset `offsets[i]` (sorted ascending),
 * copied to `dests[i]`. Spans are at most `max_span` bytes unless one piece needs more. Returns the
 * number of reads issued, or -1 with `*error` filled. Safe to call from several threads at once. */
int64_t ple_reader_read(ple_reader *r, int64_t n, const int64_t *offsets, const int64_t *lengths,
                        uint8_t *const *dests, int64_t max_span, ple_read_error *error) {
    memset(error, 0, sizeof *error);
    if (n <= 0) return 0;
    for (int64_t i = 0; i < n; i++) {
        if (offsets[i] < 0 || lengths[i] <= 0 || (i && offsets[i] < offsets[i - 1]) ||
            offsets[i] + lengths[i] > r->file_size) {
            error->err = EINVAL;
            error->offset = offsets[i];
            error->length = lengths[i];
            error->got = -1;
            return -1;
        }
    }
    span_t *spans = malloc((size_t)n * sizeof *spans);
    if (spans == NULL) {
        error->err = ENOMEM;
        error->got = -1;
        return -1;
    }
    const int64_t a = r->align;
    int64_t k = 0, widest = a;
    for (int64_t i = 0; i < n; i++) {
        int64_t start = align_down(offsets[i], a), end = align_up(offsets[i] + lengths[i], a);
        if (k) {
            span_t *s = &spans[k - 1];
            int64_t s_end = s->start + s->length;
            if (start < s_end && (end <= s_end || end - s->start <= max_span)) {
                if (end > s_end) s->length = end - s->start;
                s->last = i + 1;
                if (s->length > widest) widest = s->length;
                continue;
            }
        }
        spans[k].start = start;
        spans[k].length = end - start;
        spans[k].first = i;
        spans[k].last = i + 1;
        if (end - start > widest) widest = end - start;
        k++;
    }
    read_call c;
    memset(&c, 0, sizeof c);
    c.offsets = offsets;
    c.lengths = lengths;
    c.dests = dests;
    c.spans = spans;
    c.nspans = k;
    c.max_span = widest;
    atomic_init(&c.next, 0);
    atomic_init(&c.failed, 0);
    pthread_mutex_lock(&r->mu);
    r->calls++;
    c.queued = 1;
    if (r->tail) r->tail->later = &c;
    else r->head = &c;
    r->tail = &c;
    /* wake as many threads as there are spans, up to all of them */
    if (k >= r->depth) pthread_cond_broadcast(&r->work_cv);
    else
        for (int64_t i = 0; i < k; i++) pthread_cond_signal(&r->work_cv);
    while (c.queued || c.active > 0) pthread_cond_wait(&r->done_cv, &r->mu);
    r->calls--;
    if (r->calls == 0) pthread_cond_broadcast(&r->done_cv); /* a free() waiting for the calls */
    pthread_mutex_unlock(&r->mu);
    free(spans);
    if (atomic_load(&c.failed)) {
        *error = c.error;
        return -1;
    }
    return k;
}
