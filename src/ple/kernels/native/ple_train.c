/* The backward of a training step's gate and conv in fp32 (ple.ops.padded_grad), in two passes over the
 * rows instead of some forty PyTorch operations over [T, HC*H] tensors.
 *
 * The forward saved, per row t of B sequences of S tokens (T = B*S) and head g (HC heads of H channels,
 * C = HC*H): the normed key kr and hidden qr [T, C] with their reciprocal norms rk, rq [T, HC], the scaled
 * ones kn = kr*(1+nk), qn = qr*(1+nq), the match, its root and the gate [T, HC], the normed gated value cr
 * [T, C] with rc [T, HC], the conv input c [T, C] and the conv's pre-activation y (any strides).
 *
 * Pass 1, rows in blocks: dy = dout * silu'(y) into a scratch [T, C]; the taps' gradient dtaps[j] +=
 * dy[p] * c[p - (K-1-j)*d] (same sequence). Pass 2, row by row: the conv input's gradient dc = dy *
 * taps[K-1] + sum_j dy[p + (K-1-j)*d] * taps[j] (+ dc_out; times the mask), then per head the RMS norm's
 * backward r * (dn - normed * mean(dn * normed)) with dn = dc * (1 + nc), the value's and the gate's
 * gradients, the match's through the sigmoid and signed square root, and the key's and hidden's norms'
 * backward in the same form; the norms' weights' gradients are sums over rows.
 *
 * Every sum over rows goes to one of GCB_PIECES fixed row ranges (its partial), and the partials are
 * added in range order; every sum over a head's channels is kept in GCB_LANES running sums added in
 * order: the same bits for any number of threads and every instruction set (no fused multiply-adds:
 * the pragma). The sigmoid's exponential is ple_exp_vec (ple_common.h), which the compiler vectorizes.
 */
#if defined(__clang__)
#pragma clang fp contract(off)
#elif defined(__GNUC__)
#pragma GCC optimize("fp-contract=off")
#endif

#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "ple_common.h"

#define GCB_PIECES 16 /* fixed row ranges, each with its partial sums: results independent of threads */
#define GCB_LANES 8   /* running sums per reduction over a head's channels */
#define GCB_BLOCK 16  /* rows of a pass-1 block (a transposed y is read 16 rows a line) */
#define GCB_CHUNK 256 /* channels of a pass-1 tile */
#define GCB_INLINE static inline __attribute__((always_inline))

typedef struct {
    int64_t B, S, hc, H, K, d, C, T;
    const float *dout, *dc_out, *mask;
    const float *value;
    int64_t value_stride;
    const float *kr, *rk, *qr, *rq, *kn, *qn, *match, *root, *gate, *cr, *rc, *c, *y;
    int64_t y_sb, y_ss, y_sc;
    const float *nk, *nq, *nc, *taps;
    float *dk, *dvalue, *dq, *dnk, *dnq, *dnc, *dtaps;
    int kpath, qpath;
    float *dy;    /* [T, C] */
    float *part;  /* per piece: dtaps [K, C], dnk, dnq, dnc [C], two row buffers [C] */
    int64_t part_floats, pieces;
    int64_t next; /* the next piece (atomic) */
    int phase;
} gcb_job;

/* silu'(y) = s (1 + y (1 - s)), s = sigmoid(y) */
GCB_INLINE float gcb_silu_grad(float y) {
    const float s = 1.0f / (1.0f + ple_exp_vec(-y)); /* a NaN y: s near 0, the product NaN */
    return s * (1.0f + y * (1.0f - s));
}

/* sum_i a[i] * b[i] over n values, GCB_LANES running sums added in order */
GCB_INLINE float gcb_dot(const float *a, const float *b, int64_t n) {
    float acc[GCB_LANES] = {0};
    int64_t i = 0;
    for (; i + GCB_LANES <= n; i += GCB_LANES)
        for (int l = 0; l < GCB_LANES; l++) acc[l] += a[i + l] * b[i + l];
    for (int l = 0; i < n; i++, l++) acc[l] += a[i] * b[i];
    float s = 0.0f;
    for (int l = 0; l < GCB_LANES; l++) s += acc[l];
    return s;
}

GCB_INLINE void gcb_range(const gcb_job *J, int64_t piece, int64_t *t0, int64_t *t1) {
    *t0 = J->T * piece / J->pieces;
    *t1 = J->T * (piece + 1) / J->pieces;
}

/* Pass 1 over rows t0 .. t1-1: dy, and this piece's dtaps. */
GCB_INLINE void gcb_pass1(gcb_job *J, int64_t t0, int64_t t1, float *dtaps) {
    const int64_t C = J->C, S = J->S, K = J->K, d = J->d;
    float tile[GCB_BLOCK * GCB_CHUNK];
    for (int64_t a = t0; a < t1;) {
        const int64_t b = a / S, p = a - b * S;
        int64_t n = t1 - a < GCB_BLOCK ? t1 - a : GCB_BLOCK;
        if (p + n > S) n = S - p; /* a block stays in one sequence */
        const float *yb = J->y + b * J->y_sb + p * J->y_ss;
        for (int64_t c0 = 0; c0 < C; c0 += GCB_CHUNK) {
            const int64_t m = C - c0 < GCB_CHUNK ? C - c0 : GCB_CHUNK;
            if (J->y_sc == 1) {
                for (int64_t r = 0; r < n; r++) memcpy(tile + r * GCB_CHUNK, yb + r * J->y_ss + c0, sizeof(float) * (size_t)m);
            } else {
                for (int64_t i = 0; i < m; i++) {
                    const float *col = yb + (c0 + i) * J->y_sc;
                    for (int64_t r = 0; r < n; r++) tile[r * GCB_CHUNK + i] = col[r * J->y_ss];
                }
            }
            for (int64_t r = 0; r < n; r++) {
                const float *go = J->dout + (a + r) * C + c0, *yt = tile + r * GCB_CHUNK;
                float *o = J->dy + (a + r) * C + c0;
#pragma omp simd
                for (int64_t i = 0; i < m; i++) o[i] = go[i] * gcb_silu_grad(yt[i]);
            }
        }
        if (dtaps) {
            for (int64_t r = 0; r < n; r++) {
                const int64_t q = p + r;
                const float *g = J->dy + (a + r) * C;
                for (int64_t j = 0; j < K; j++) {
                    const int64_t back = (K - 1 - j) * d;
                    if (q < back) continue;
                    const float *x = J->c + (a + r - back) * C;
                    float *o = dtaps + j * C;
#pragma omp simd
                    for (int64_t i = 0; i < C; i++) o[i] += g[i] * x[i];
                }
            }
        }
        a += n;
    }
}

/* RMS norm backward of one head: dx = (dn - normed * mean(dn * normed)) * r, dn = dy * scale, with
 * dy * normed added to dw when it is kept. dx may be dy. */
GCB_INLINE void gcb_rms_back(const float *dy, const float *normed, const float *w, float r, int64_t H, float *dx,
                             float *dw, float *dn) {
#pragma omp simd
    for (int64_t i = 0; i < H; i++) dn[i] = dy[i] * (1.0f + w[i]);
    if (dw) {
#pragma omp simd
        for (int64_t i = 0; i < H; i++) dw[i] += dy[i] * normed[i];
    }
    const float mean = gcb_dot(dn, normed, H) / (float)H;
#pragma omp simd
    for (int64_t i = 0; i < H; i++) dx[i] = (dn[i] - normed[i] * mean) * r;
}

/* Pass 2 over rows t0 .. t1-1. */
GCB_INLINE void gcb_pass2(gcb_job *J, int64_t t0, int64_t t1, float *dnk, float *dnq, float *dnc, float *dc,
                          float *dn) {
    const int64_t C = J->C, S = J->S, K = J->K, d = J->d, H = J->H, HC = J->hc;
    const float sqrt_h = sqrtf((float)H);
    for (int64_t t = t0; t < t1; t++) {
        const int64_t p = t % S;
        const float *g = J->dy + t * C, *last = J->taps + (K - 1) * C;
#pragma omp simd
        for (int64_t i = 0; i < C; i++) dc[i] = g[i] * last[i];
        for (int64_t j = 0; j + 1 < K; j++) {
            const int64_t back = (K - 1 - j) * d;
            if (p + back >= S) continue;
            const float *g2 = J->dy + (t + back) * C, *w = J->taps + j * C;
#pragma omp simd
            for (int64_t i = 0; i < C; i++) dc[i] += g2[i] * w[i];
        }
        if (J->dc_out) {
            const float *e = J->dc_out + t * C;
#pragma omp simd
            for (int64_t i = 0; i < C; i++) dc[i] += e[i];
        }
        const float *go = J->dout + t * C;
        const float m = J->mask ? J->mask[t] : 1.0f;
        float dgate[64], dmatch[64];
        for (int64_t h = 0; h < HC; h++) {
            const int64_t o = h * H;
            float *x = dc + o;
            if (J->mask) {
#pragma omp simd
                for (int64_t i = 0; i < H; i++) x[i] *= m;
            }
            /* dc's norm backward in place: dc becomes the gated value's gradient, plus dv */
            gcb_rms_back(x, J->cr + t * C + o, J->nc + o, J->rc[t * HC + h], H, x, dnc ? dnc + o : 0, dn);
            if (J->mask) {
#pragma omp simd
                for (int64_t i = 0; i < H; i++) x[i] += go[o + i] * m;
            } else {
#pragma omp simd
                for (int64_t i = 0; i < H; i++) x[i] += go[o + i];
            }
            const float *v = J->value + t * J->value_stride;
            dgate[h] = gcb_dot(x, v, H);
        }
        if (J->dvalue) {
            float *dv = J->dvalue + t * H;
            const float *gt = J->gate + t * HC;
            for (int64_t i = 0; i < H; i++) {
                float s = 0.0f;
                for (int64_t h = 0; h < HC; h++) s += dc[h * H + i] * gt[h];
                dv[i] = s;
            }
        }
        for (int64_t h = 0; h < HC; h++) {
            const float gt = J->gate[t * HC + h], mt = J->match[t * HC + h];
            const float live = fabsf(mt) >= 1e-6f ? 1.0f : 0.0f;
            dmatch[h] = dgate[h] * gt * (1.0f - gt) * (0.5f / J->root[t * HC + h]) * live / sqrt_h;
        }
        /* the key's and hidden's norms: dy = the other side's scaled norm times dmatch */
        for (int pass = 0; pass < 2; pass++) {
            if (pass == 0 ? !J->kpath : !J->qpath) continue;
            const float *other = pass == 0 ? J->qn : J->kn, *normed = pass == 0 ? J->kr : J->qr;
            const float *w = pass == 0 ? J->nk : J->nq, *r = pass == 0 ? J->rk : J->rq;
            float *dx = pass == 0 ? J->dk : J->dq, *dw = pass == 0 ? dnk : dnq;
            for (int64_t h = 0; h < HC; h++) {
                const int64_t o = h * H;
                const float *u_in = other + t * C + o;
                float *u = dc + o; /* the row buffer is free again: dc's values were used above */
                const float dm = dmatch[h];
#pragma omp simd
                for (int64_t i = 0; i < H; i++) u[i] = u_in[i] * dm;
                gcb_rms_back(u, normed + t * C + o, w + o, r[t * HC + h], H, dx ? dx + t * C + o : u,
                             dw ? dw + o : 0, dn);
            }
        }
    }
}

GCB_INLINE void gcb_run(gcb_job *J) {
    const int64_t C = J->C, K = J->K;
    for (;;) {
        const int64_t piece = __atomic_fetch_add(&J->next, 1, __ATOMIC_RELAXED);
        if (piece >= J->pieces) break;
        int64_t t0, t1;
        gcb_range(J, piece, &t0, &t1);
        float *part = J->part + piece * J->part_floats;
        if (J->phase == 0) {
            gcb_pass1(J, t0, t1, J->dtaps ? part : 0);
        } else {
            float *dnk = part + K * C, *dnq = dnk + C, *dnc = dnq + C, *dc = dnc + C, *dn = dc + C;
            gcb_pass2(J, t0, t1, J->dnk ? dnk : 0, J->dnq ? dnq : 0, J->dnc ? dnc : 0, dc, dn);
        }
    }
}

static void gcb_portable(gcb_job *J) { gcb_run(J); }

#if defined(__x86_64__) && defined(__GNUC__)
#define GCB_X86 1
__attribute__((target(PLE_TARGET_AVX2))) static void gcb_avx2(gcb_job *J) { gcb_run(J); }
__attribute__((target(PLE_TARGET_AVX512))) static void gcb_avx512(gcb_job *J) { gcb_run(J); }
#endif

static void *gcb_worker(void *arg) {
    gcb_job *J = (gcb_job *)arg;
#ifdef GCB_X86
    const int isa = ple_current_isa();
    if (isa >= 2)
        gcb_avx512(J);
    else if (isa == 1)
        gcb_avx2(J);
    else
        gcb_portable(J);
#else
    gcb_portable(J);
#endif
    return NULL;
}

/* The gradients of the gate and conv of B sequences of S tokens (see the top of the file); every tensor
 * fp32, [T, C] ones contiguous, value rows `value_stride` floats apart, y with strides (y_sb, y_ss,
 * y_sc), [T, HC] ones contiguous, mask [T] or null, dc_out [T, C] or null. Outputs that are null are
 * not computed: dk [T, C], dvalue [T, H], dq [T, C], dnk, dnq, dnc [C], dtaps [K, C]; kpath / qpath
 * say whether the key's / hidden's norm backward runs (for dk or dnk, dq or dnq). Returns 0, -1 for a
 * bad geometry, -2 out of memory. */
int ple_gate_conv_backward(int64_t B, int64_t S, int64_t hc, int64_t H, int64_t K, int64_t dilation,
                           const float *dout, const float *dc_out, const float *mask, const float *value,
                           int64_t value_stride, const float *kr, const float *rk, const float *qr, const float *rq,
                           const float *kn, const float *qn, const float *match, const float *root,
                           const float *gate, const float *cr, const float *rc, const float *c, const float *y,
                           int64_t y_sb, int64_t y_ss, int64_t y_sc, const float *nk, const float *nq,
                           const float *nc, const float *taps, float *dk, float *dvalue, float *dq, float *dnk,
                           float *dnq, float *dnc, float *dtaps, int kpath, int qpath, int threads) {
    if (B < 0 || S < 0 || hc < 1 || hc > 64 || H < 1 || K < 1 || dilation < 1 || value_stride < H) return -1;
    const int64_t C = hc * H, T = B * S;
    gcb_job J = {B, S, hc, H, K, dilation, C, T, dout, dc_out, mask, value, value_stride, kr, rk, qr, rq, kn, qn,
                 match, root, gate, cr, rc, c, y, y_sb, y_ss, y_sc, nk, nq, nc, taps, dk, dvalue, dq, dnk, dnq,
                 dnc, dtaps, kpath, qpath, 0, 0, 0, 0, 0, 0};
    J.pieces = T < GCB_PIECES ? (T > 0 ? T : 1) : GCB_PIECES;
    J.part_floats = K * C + 5 * C;
    J.dy = malloc(sizeof(float) * (size_t)(T > 0 ? T * C : 1));
    J.part = calloc((size_t)(J.pieces * J.part_floats), sizeof(float));
    if (!J.dy || !J.part) {
        free(J.dy);
        free(J.part);
        return -2;
    }
    const int n = threads < (int)J.pieces ? threads : (int)J.pieces;
    for (J.phase = 0; J.phase < 2; J.phase++) {
        J.next = 0;
        if (T > 0) ple_team_run(n, gcb_worker, &J);
    }
    /* the partials, added in piece order */
    float *outs[4] = {dtaps, dnk, dnq, dnc};
    const int64_t at[4] = {0, K * C, K * C + C, K * C + 2 * C}, len[4] = {K * C, C, C, C};
    for (int k = 0; k < 4; k++) {
        if (!outs[k]) continue;
        memset(outs[k], 0, sizeof(float) * (size_t)len[k]);
        for (int64_t pc = 0; pc < J.pieces; pc++) {
            const float *src = J.part + pc * J.part_floats + at[k];
            for (int64_t i = 0; i < len[k]; i++) outs[k][i] += src[i];
        }
    }
    free(J.dy);
    free(J.part);
    return 0;
}
