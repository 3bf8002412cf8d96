/* ple eval's passes over a window's next-token logits (ple.commands.evaluate): the reference's distribution,
 * and each candidate's negative log-likelihood, KL divergence to the reference and top token, in two
 * passes over each row (the row held in cache) instead of a log-softmax and its separate passes.
 *
 * Reference row z_r [V] (bf16 or float32, as the model returns it): pass 1 its maximum m_r and top
 * token (the first index of the maximum, as torch.argmax), pass 2 s_r = sum e_r, e_r[v] = exp(z_r[v] -
 * m_r) (float sums over blocks of EVAL_BLOCK values, blocks added in double). The reference distribution
 * is p_r = e_r / s_r: the rounded e_r define it, and a candidate's pass computes the same e_r again
 * (the same bits: an exponential costs less than reading a stored one from memory), so every sum below
 * is of one distribution. lse_r = m_r + log s_r. The reference keeps its logits, m_r and s_r.
 *
 * Candidate row z_c: pass 1 its maximum and top token; pass 2, with d = z_c - z_r (exact in float32
 * for logits of similar magnitude) and the reference's shift m_r,
 *   T = sum e_r d,  S = sum exp(z_c - m_r),  R = sum e_r (expm1(d) - d)  ( = S - s_r - T ),
 * where R's terms come from a polynomial of (expm1(d) - d) / d^2 for |d| <= EXPM1_SMALL (accurate
 * relative to d^2 / 2, exactly 0 for d = 0) and as exp(z_c - m_r) - e_r - e_r d beyond. Then with
 * u = T / s_r and r = R / s_r (r >= 0, second order in d),
 *   lse_c - lse_r = log1p(u + r)   (when |u + r| <= 1/2: the two normalizers close), else log(S / s_r),
 *   KL(p_r || p_c) = lse_c - lse_r - u,
 * where an error in u cancels to first order. A candidate equal to the reference gives d = 0
 * everywhere: T = R = 0 and KL exactly 0; a close one (a q8_0 table) a KL of 1e-5 nats carried by its
 * changed values alone, without the cancellation of two log-sum-exps of size 10 in float32. A
 * candidate whose maximum is more than EVAL_FAR from the reference's takes S with its own shift
 * (exp(z_c - m_r) would leave float32's range).
 *
 * The exponential is a polynomial the compiler vectorizes (Cody-Waite reduction to |r| <= ln2/2, a
 * degree-7 Taylor polynomial: its error a few float32 roundings), without fused multiply-adds (the pragma):
 * the same value gives the same bits in every loop of an instruction set. Rows are split over
 * `threads` threads (ple_team_run, ple_cpu.c); each row is one thread's, so results do not depend on
 * the number of threads. Compiled once per instruction set (function target attributes), as the
 * step's kernel is, and chosen by ple_current_isa().
 */
#if defined(__clang__)
#pragma clang fp contract(off)
#elif defined(__GNUC__)
#pragma GCC optimize("fp-contract=off")
#endif

#include <math.h>
#include <stdint.h>
#include <string.h>

#include "ple_common.h"

#define EVAL_BLOCK 512      /* values summed in float before the block's sum is added in double */
#define EVAL_FAR 60.0f      /* candidate maximum this far from the reference's: its own shift */
#define EXPM1_SMALL 0.34657f /* ln2 / 2 */
#define EVAL_INLINE static inline __attribute__((always_inline))

EVAL_INLINE float load(const void *z, int64_t i, int bf) {
    if (bf) {
        const uint32_t u = (uint32_t)((const uint16_t *)z)[i] << 16;
        float f;
        memcpy(&f, &u, 4);
        return f;
    }
    return ((const float *)z)[i];
}

/* exp(x) for x <= 64 (0 below -87: no denormals, no clamped floor) */
EVAL_INLINE float fexp(float x) {
    const float xc = x < -87.0f ? -87.0f : x;
    const float t = xc * 1.44269504f + 12582912.0f; /* 1.5 * 2^23: rounds to an integer */
    const float n = t - 12582912.0f;
    float r = xc - n * 0.693359375f; /* ln2's high part: n * it is exact */
    r = r - n * -2.12194440e-4f;
    float p = 1.98412698e-4f;
    p = p * r + 1.38888889e-3f;
    p = p * r + 8.33333333e-3f;
    p = p * r + 4.16666667e-2f;
    p = p * r + 1.66666667e-1f;
    p = p * r + 0.5f;
    p = p * r + 1.0f;
    p = p * r + 1.0f;
    const uint32_t bits = (uint32_t)((int32_t)n + 127) << 23;
    float scale;
    memcpy(&scale, &bits, 4);
    return x < -87.0f ? 0.0f : p * scale;
}

/* (expm1(d) - d) / d^2 for |d| <= ln2/2 (degree 7: relative error below 1e-8) */
EVAL_INLINE float fphi_small(float d) {
    float p = 2.75573192e-6f;
    p = p * d + 2.48015873e-5f;
    p = p * d + 1.98412698e-4f;
    p = p * d + 1.38888889e-3f;
    p = p * d + 8.33333333e-3f;
    p = p * d + 4.16666667e-2f;
    p = p * d + 1.66666667e-1f;
    return p * d + 0.5f;
}

/* The row's maximum and the first index holding it (0 for a row without a number above -inf). */
EVAL_INLINE float row_max(const void *z, int64_t V, int bf, int64_t *arg) {
    float m = -INFINITY;
    int64_t block = -1;
    for (int64_t a = 0; a < V; a += EVAL_BLOCK) {
        const int64_t b = a + EVAL_BLOCK < V ? a + EVAL_BLOCK : V;
        float bm = -INFINITY;
#pragma omp simd reduction(max : bm)
        for (int64_t i = a; i < b; i++) {
            const float v = load(z, i, bf);
            bm = v > bm ? v : bm;
        }
        if (bm > m) {
            m = bm;
            block = a;
        }
    }
    *arg = 0;
    if (block >= 0)
        for (int64_t i = block; i < V; i++)
            if (load(z, i, bf) == m) {
                *arg = i;
                break;
            }
    return m;
}

typedef struct {
    int bf_r, bf_c;
    int64_t rows, V;
    const void *zr, *zc;    /* [rows, V] each (zc null: the reference pass) */
    const int64_t *targets; /* [rows] */
    float *m;               /* [rows] the reference's maxima */
    double *s;              /* [rows] the reference's sums */
    int64_t *top;           /* [rows] out */
    double *nll;            /* [rows] out */
    double *kld;            /* [rows] out (candidate) */
    int64_t next;
} eval_job;

EVAL_INLINE void reference_row(eval_job *J, int64_t row, int bf) {
    const int64_t V = J->V;
    const void *z = (const char *)J->zr + row * V * (bf ? 2 : 4);
    int64_t top;
    const float m = row_max(z, V, bf, &top);
    double s = 0.0;
    for (int64_t a = 0; a < V; a += EVAL_BLOCK) {
        const int64_t b = a + EVAL_BLOCK < V ? a + EVAL_BLOCK : V;
        float bs = 0.0f;
#pragma omp simd reduction(+ : bs)
        for (int64_t i = a; i < b; i++) {
            bs += fexp(load(z, i, bf) - m);
        }
        s += bs;
    }
    J->m[row] = m;
    J->s[row] = s;
    J->top[row] = top;
    J->nll[row] = (double)m + log(s) - (double)load(z, J->targets[row], bf);
}

EVAL_INLINE void candidate_row(eval_job *J, int64_t row, int bf_r, int bf_c) {
    const int64_t V = J->V;
    const void *zr = (const char *)J->zr + row * V * (bf_r ? 2 : 4);
    const void *zc = (const char *)J->zc + row * V * (bf_c ? 2 : 4);
    const float mr = J->m[row];
    const double sr = J->s[row], lse_r = (double)mr + log(sr);
    int64_t top;
    const float mc = row_max(zc, V, bf_c, &top);
    const int near = mc <= mr + EVAL_FAR && mc >= mr - EVAL_FAR;
    const float shift = near ? mr : mc;
    double T = 0.0, S = 0.0, R = 0.0;
    for (int64_t a = 0; a < V; a += EVAL_BLOCK) {
        const int64_t b = a + EVAL_BLOCK < V ? a + EVAL_BLOCK : V;
        float bt = 0.0f, bs = 0.0f, br = 0.0f;
#pragma omp simd reduction(+ : bt, bs, br)
        for (int64_t i = a; i < b; i++) {
            const float r = load(zr, i, bf_r), c = load(zc, i, bf_c);
            const float er = fexp(r - mr); /* the reference pass's bits */
            const float d = c - r;
            const float x = fexp(c - shift);
            const float small = er * (d * d * fphi_small(d));
            const float big = (x - er) - er * d;
            bt += er * d;
            bs += x;
            br += (d <= EXPM1_SMALL && d >= -EXPM1_SMALL) ? small : big;
        }
        T += bt;
        S += bs;
        R += br;
    }
    /* lse_c - lse_r = log(sum p_r exp(d)) = log1p((T + R) / s_r); KL = lse_c - lse_r - T / s_r */
    const double u = T / sr;
    double dlse;
    if (near && fabs(u + R / sr) <= 0.5)
        dlse = log1p(u + R / sr);
    else
        dlse = (double)shift + log(S) - lse_r;
    J->top[row] = top;
    J->kld[row] = dlse - u;
    J->nll[row] = lse_r + dlse - (double)load(zc, J->targets[row], bf_c);
}

EVAL_INLINE void rows_of(eval_job *J) {
    for (;;) {
        const int64_t row = __atomic_fetch_add(&J->next, 1, __ATOMIC_RELAXED);
        if (row >= J->rows) break;
        if (J->zc == 0) {
            if (J->bf_r)
                reference_row(J, row, 1);
            else
                reference_row(J, row, 0);
        } else if (J->bf_r && J->bf_c)
            candidate_row(J, row, 1, 1);
        else if (J->bf_r)
            candidate_row(J, row, 1, 0);
        else if (J->bf_c)
            candidate_row(J, row, 0, 1);
        else
            candidate_row(J, row, 0, 0);
    }
}

static void rows_portable(eval_job *J) { rows_of(J); }

#if defined(__x86_64__) && defined(__GNUC__)
#define EVAL_X86 1
__attribute__((target(PLE_TARGET_AVX2))) static void rows_avx2(eval_job *J) { rows_of(J); }
__attribute__((target(PLE_TARGET_AVX512))) static void rows_avx512(eval_job *J) { rows_of(J); }
#endif

static void *eval_worker(void *arg) {
    eval_job *J = (eval_job *)arg;
#ifdef EVAL_X86
    const int isa = ple_current_isa(); /* 1 AVX2, 2 AVX-512, 3 AVX-512 BF16 (its AVX-512 code here) */
    if (isa >= 2)
        rows_avx512(J);
    else if (isa == 1)
        rows_avx2(J);
    else
        rows_portable(J);
#else
    rows_portable(J);
#endif
    return NULL;
}

static int targets_in_range(const int64_t *t, int64_t n, int64_t V) {
    for (int64_t i = 0; i < n; i++)
        if (t[i] < 0 || t[i] >= V) return 0;
    return 1;
}

/* The reference pass over logits zr [rows, V] (contiguous; bf16 when bf, else float32): m [rows], s [rows],
 * top [rows], nll [rows] (of targets [rows]) written. Returns 0, or -1 when a target is outside [0, V)
 * (nothing written). */
int ple_eval_reference(int bf, const void *zr, int64_t rows, int64_t V, const int64_t *targets, float *m, double *s,
                       int64_t *top, double *nll, int threads) {
    if (!targets_in_range(targets, rows, V)) return -1;
    eval_job J = {bf != 0, 0, rows, V, zr, 0, targets, m, s, top, nll, 0, 0};
    ple_team_run(threads < (int)rows ? threads : (int)(rows > 0 ? rows : 1), eval_worker, &J);
    return 0;
}

/* A candidate's pass over its logits zc [rows, V] against the reference of ple_eval_reference (zr, and
 * m, s as it left them): top [rows], nll [rows], kld [rows] (rounding may leave a KL a little below 0)
 * written. Returns 0, or -1 when a target is outside [0, V) (nothing written). */
int ple_eval_compare(int bf_r, const void *zr, int bf_c, const void *zc, int64_t rows, int64_t V,
                     const int64_t *targets, const float *m, const double *s, int64_t *top, double *nll,
                     double *kld, int threads) {
    if (!targets_in_range(targets, rows, V)) return -1;
    eval_job J = {bf_r != 0, bf_c != 0, rows, V, zr, zc, targets, (float *)m, (double *)s, top, nll, kld, 0};
    ple_team_run(threads < (int)rows ? threads : (int)(rows > 0 ? rows : 1), eval_worker, &J);
    return 0;
}
