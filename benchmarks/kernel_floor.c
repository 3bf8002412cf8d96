/* The fused step's C kernel alone against a memcpy of the bytes it must move, one decode step.
 *
 *   cc -O3 -fopenmp -fno-math-errno -fno-trapping-math -pthread -o /tmp/kernel_floor \
 *      benchmarks/kernel_floor.c -lm
 *   /tmp/kernel_floor BF16(1|0) TOKENS THREADS ISA(0 portable, 1 avx2, 2 avx512, 3 avx512bf16) [REPEAT [COLD [PLAN [LAYOUT]]]]
 *
 * Published geometry (H 2560, HC 4, K 4, dilation 3, L 9), one decode token per request, every request
 * resuming (K-1 taps from its slot). LAYOUT 0 (the default): the ring state pool [S, L, C] a session
 * keeps; 1: the engine layout [S, C, L], where every channel's run of L values moves on by one. The
 * floor copies, per token, the key, hidden, value rows and the state read (ring: K-1 columns; engine
 * layout: the whole slot) and the output and the state written (ring: one column; engine layout: the
 * whole slot) (memcpy of the written bytes, a read pass over the rest), warm like the kernel's operands. Prints medians: of
 * this thread's CPU time with THREADS 1 (time spent descheduled on a shared machine is not counted),
 * else of the wall clock.
 * COLD 1 writes 64 MB before each call (the caches then hold none of the kernel's operands, as in a
 * step between other work), and the floor copies buffers as cold.
 * PLAN: the kernel's prefetch plan, lines per run (-1 this CPU's default, the library's; 0 none; a
 * large number: whole runs), as ple_set_prefetch_lines takes it.
 * Start with MALLOC_MMAP_THRESHOLD_=1073741824 to match a process that ran ple.tune_host_allocator().
 * Built with -fopenmp, THREADS > 1 run as an OpenMP team, as the library does in a process whose PyTorch
 * uses GNU OpenMP (set OMP_WAIT_POLICY=active: PyTorch's threads spin between steps); built with
 * -fopenmp-simd instead, each call starts POSIX threads (tens of microseconds, as the library without
 * OpenMP); the line printed says which. THREADS 1 times the same either way. The floor runs on the
 * calling thread alone, whatever THREADS.
 */
#include "../src/ple/kernels/native/ple_cpu.c"

#include <stdio.h>
#include <time.h>

static clockid_t clock_used = CLOCK_MONOTONIC;

static double now(void) {
    struct timespec t;
    clock_gettime(clock_used, &t);
    return (double)t.tv_sec + 1e-9 * (double)t.tv_nsec;
}

static int cmp(const void *a, const void *b) {
    const double x = *(const double *)a, y = *(const double *)b;
    return x < y ? -1 : x > y;
}

static uint32_t seed = 12345;
static float uniform(void) {
    seed = seed * 1664525u + 1013904223u;
    return (float)(seed >> 8) / 16777216.0f * 2.0f - 1.0f;
}

static void fill(void *p, int64_t n, int bf) {
    for (int64_t i = 0; i < n; i++) {
        const float x = uniform();
        if (bf)
            ((uint16_t *)p)[i] = f32_to_bf16(x);
        else
            ((float *)p)[i] = x;
    }
}

int main(int argc, char **argv) {
    if (argc < 5) {
        fprintf(stderr, "usage: %s BF16 TOKENS THREADS ISA [REPEAT [COLD [PLAN [LAYOUT]]]]\n", argv[0]);
        return 2;
    }
    const int bf = atoi(argv[1]), threads = atoi(argv[3]), isa = atoi(argv[4]);
    const int64_t R = atoi(argv[2]);
    const int reps = argc > 5 ? atoi(argv[5]) : 200, cold = argc > 6 ? atoi(argv[6]) : 0;
    const size_t flush_bytes = (size_t)64 << 20;
    char *flush = cold ? malloc(flush_bytes) : 0;
    if (cold && !flush) return 3;
    const int64_t H = 2560, HC = 4, C = H * HC, K = 4, D = 3, L = 9, esz = bf ? 2 : 4;
    if (threads == 1) clock_used = CLOCK_THREAD_CPUTIME_ID;
    const int64_t plan = argc > 7 ? atoll(argv[7]) : -1;
    const int engine = argc > 8 ? atoi(argv[8]) : 0;
    if (R < 1 || reps < 1 || ple_set_isa(isa) != 0 || ple_set_prefetch_lines(plan) != 0) {
        fprintf(stderr, "bad arguments, or this CPU lacks instruction set %d\n", isa);
        return 2;
    }
    char *key = malloc((size_t)(R * C * esz)), *val = malloc((size_t)(R * H * esz));
    char *hid = malloc((size_t)(R * C * esz)), *state = malloc((size_t)(R * L * C * esz));
    char *out = malloc((size_t)(R * C * esz)), *cout = malloc((size_t)(R * C * esz));
    float *wkq = malloc(sizeof(float) * (size_t)C), *wc = malloc(sizeof(float) * (size_t)C);
    float *cw = malloc(sizeof(float) * (size_t)(K * C));
    int64_t *starts = malloc(sizeof(int64_t) * (size_t)(R + 1)), *slots = malloc(sizeof(int64_t) * (size_t)R);
    int64_t *base = calloc((size_t)R, sizeof(int64_t));
    uint8_t *init = malloc((size_t)R);
    const int64_t state_rd = engine ? L * C : (K - 1) * C, state_wr = engine ? L * C : C;
    const int64_t rd = R * (2 * C + H + state_rd) * esz, wr = R * (C + state_wr) * esz;
    char *src = malloc((size_t)rd), *dst = malloc((size_t)rd);
    double *t_kernel = malloc(sizeof(double) * (size_t)reps), *t_copy = malloc(sizeof(double) * (size_t)reps);
    if (!key || !val || !hid || !state || !out || !cout || !wkq || !wc || !cw || !starts || !slots || !base ||
        !init || !src || !dst || !t_kernel || !t_copy)
        return 3;
    fill(key, R * C, bf);
    fill(hid, R * C, bf);
    fill(val, R * H, bf);
    fill(state, R * L * C, bf);
    for (int64_t i = 0; i < C; i++) wkq[i] = 1.0f + 0.1f * uniform(), wc[i] = 0.5f + 0.1f * uniform();
    for (int64_t i = 0; i < K * C; i++) cw[i] = 0.25f * uniform();
    for (int64_t r = 0; r <= R; r++) starts[r] = r;
    for (int64_t r = 0; r < R; r++) slots[r] = r, init[r] = 1;
    memset(src, 1, (size_t)rd);
    memset(dst, 1, (size_t)rd);
    volatile char sink = 0;
    for (int i = 0; i < reps; i++) {
        if (cold) memset(flush, i, flush_bytes);
        const double a = now();
        const int rc = ple_gate_conv(bf, R, H, HC, K, D, L, R, R, 1e-6f, key, C, val, H, hid, C, wkq, wc, cw, starts,
                                     slots, init, 0, 0, state, engine ? 0 : base, 1, 0, 0, 0, out, cout, 0, 32, threads);
        double b = now();
        t_kernel[i] = b - a;
        if (rc != 0) {
            fprintf(stderr, "ple_gate_conv returned %d\n", rc);
            return 1;
        }
        if (cold) {
            memset(flush, i + 1, flush_bytes);
            b = now();
        }
        memcpy(dst, src, (size_t)wr);
        char s = 0;
        for (int64_t j = wr; j < rd; j += 64) s = (char)(s + src[j]);
        sink = (char)(sink + s);
        t_copy[i] = now() - b;
    }
    qsort(t_kernel, (size_t)reps, sizeof(double), cmp);
    qsort(t_copy, (size_t)reps, sizeof(double), cmp);
    const double k = t_kernel[reps / 2], c = t_copy[reps / 2];
    const int64_t lines = ple_prefetch_lines();
    char plan_text[32];
    if (lines == PLAN_ALL)
        snprintf(plan_text, sizeof plan_text, "whole runs");
    else
        snprintf(plan_text, sizeof plan_text, "%ld lines", (long)lines);
    const char *team = threads == 1 ? "" : ple_team_kind() ? " (an OpenMP team)" : " (threads started per call)";
    printf("%s, %s, %ld tokens, %d threads%s, isa %d, prefetch %s, %s%s: kernel %.0f us, floor %.0f us (%.1f MB, one thread), "
           "kernel / floor %.2f\n",
           bf ? "bf16" : "fp32", engine ? "engine layout" : "ring", (long)R, threads, team, isa, plan_text, threads == 1 ? "CPU time" : "wall",
           cold ? ", cold" : "", k * 1e6, c * 1e6, (double)(rd + wr) / 1e6, k / c);
    return 0;
}
