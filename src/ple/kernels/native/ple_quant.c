/* Fused gather + dequantize of block-format table rows (ple.table.formats.blocks) on the CPU.
 *
 * ple_quant_lookup reads, for each of n row ids, the row's stored bytes and writes its head_dim
 * values in the activation dtype: float32 values computed exactly as ple.table.formats.blocks defines them
 * (one float32 rounding per operation, in its order: no fused multiply-add, hence the pragma and
 * the separate statements), then rounded once, to nearest even, to bf16 or fp16.
 *
 * Returns 0, or -1 when an id is outside [0, rows) (nothing is written), -2 for an unknown format or
 * output kind.
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

enum { F_Q8_0 = 0, F_Q5_1, F_Q5_0, F_Q4_1, F_Q4_0, F_IQ4_NL, F_MXFP4, F_NVFP4 };
enum { OUT_F32 = 0, OUT_F16 = 1, OUT_BF16 = 2 };

static const float IQ4NL[16] = {-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113};
static const float MXFP4[16] = {0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12};
static const float E2M1[16] = {0.0f, 0.5f, 1.0f, 1.5f, 2.0f, 3.0f, 4.0f, 6.0f,
                               -0.0f, -0.5f, -1.0f, -1.5f, -2.0f, -3.0f, -4.0f, -6.0f};

static float bits_f32(uint32_t u) {
    float f;
    memcpy(&f, &u, 4);
    return f;
}

static uint32_t f32_bits(float f) {
    uint32_t u;
    memcpy(&u, &f, 4);
    return u;
}

/* IEEE half (little-endian bytes) -> float, exactly. */
static float half_at(const uint8_t *p) {
    uint32_t h = (uint32_t)p[0] | ((uint32_t)p[1] << 8);
    uint32_t sign = (h & 0x8000u) << 16, e = (h >> 10) & 31u, m = h & 0x3ffu;
    if (e == 31) return bits_f32(sign | 0x7f800000u | (m << 13));
    if (e == 0) {
        float v = (float)m * 5.9604644775390625e-8f; /* m * 2^-24, exact */
        return sign ? -v : v;
    }
    return bits_f32(sign | ((e + 112u) << 23) | (m << 13));
}

/* float8 e4m3fn byte -> float, exactly (0x7f and 0xff are NaN). */
static float e4m3(uint8_t b) {
    uint32_t e = (b >> 3) & 15u, m = b & 7u;
    float mag;
    if ((b & 127u) == 127u) return NAN;
    if (e == 0) mag = (float)m * 0.001953125f; /* m * 2^-9 */
    else mag = bits_f32(((e + 120u) << 23) | (m << 20));
    return (b & 128u) ? -mag : mag;
}

static uint16_t to_bf16(float f) {
    uint32_t u = f32_bits(f);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x40u); /* NaN stays NaN */
    return (uint16_t)((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}

static uint16_t to_f16(float f) {
    uint32_t u = f32_bits(f);
    uint32_t sign = (u >> 16) & 0x8000u, a = u & 0x7fffffffu;
    if (a > 0x7f800000u) return (uint16_t)(sign | 0x7e00u | ((a >> 13) & 0x3ffu));
    if (a >= 0x477ff000u) return (uint16_t)(sign | 0x7c00u); /* rounds to infinity */
    if (a < 0x38800000u) {                                     /* below 2^-14: subnormal or zero */
        float v = fabsf(f) * 16777216.0f;                       /* exact: value in units of 2^-24 */
        return (uint16_t)(sign | (uint32_t)nearbyintf(v));
    }
    a = a + 0xfffu + ((a >> 13) & 1u);
    return (uint16_t)(sign | ((a - 0x38000000u) >> 13));
}

static void store(void *out, int64_t at, const float *v, int64_t n, int kind) {
    if (kind == OUT_F32) {
        memcpy((float *)out + at, v, (size_t)n * 4);
    } else if (kind == OUT_BF16) {
        uint16_t *o = (uint16_t *)out + at;
        for (int64_t i = 0; i < n; i++) o[i] = to_bf16(v[i]);
    } else {
        uint16_t *o = (uint16_t *)out + at;
        for (int64_t i = 0; i < n; i++) o[i] = to_f16(v[i]);
    }
}

/* Values of one 32-value GGML block into v[32]. */
static void decode32(int fmt, const uint8_t *b, float *v) {
    float d, m, t;
    uint32_t qh;
    int j;
    switch (fmt) {
    case F_Q8_0:
        d = half_at(b);
        for (j = 0; j < 32; j++) v[j] = (float)(int8_t)b[2 + j] * d;
        return;
    case F_Q4_0:
        d = half_at(b);
        for (j = 0; j < 16; j++) {
            v[j] = d * (float)((int)(b[2 + j] & 15u) - 8);
            v[j + 16] = d * (float)((int)(b[2 + j] >> 4) - 8);
        }
        return;
    case F_IQ4_NL:
        d = half_at(b);
        for (j = 0; j < 16; j++) {
            v[j] = d * IQ4NL[b[2 + j] & 15u];
            v[j + 16] = d * IQ4NL[b[2 + j] >> 4];
        }
        return;
    case F_Q4_1:
        d = half_at(b);
        m = half_at(b + 2);
        for (j = 0; j < 16; j++) {
            t = d * (float)(b[4 + j] & 15u);
            v[j] = t + m;
            t = d * (float)(b[4 + j] >> 4);
            v[j + 16] = t + m;
        }
        return;
    case F_Q5_0:
        d = half_at(b);
        qh = (uint32_t)b[2] | ((uint32_t)b[3] << 8) | ((uint32_t)b[4] << 16) | ((uint32_t)b[5] << 24);
        for (j = 0; j < 16; j++) {
            uint32_t lo = (b[6 + j] & 15u) | (((qh >> j) & 1u) << 4);
            uint32_t hi = (uint32_t)(b[6 + j] >> 4) | (((qh >> (j + 16)) & 1u) << 4);
            v[j] = d * ((float)lo - 16.0f);
            v[j + 16] = d * ((float)hi - 16.0f);
        }
        return;
    case F_Q5_1:
        d = half_at(b);
        m = half_at(b + 2);
        qh = (uint32_t)b[4] | ((uint32_t)b[5] << 8) | ((uint32_t)b[6] << 16) | ((uint32_t)b[7] << 24);
        for (j = 0; j < 16; j++) {
            uint32_t lo = (b[8 + j] & 15u) | (((qh >> j) & 1u) << 4);
            uint32_t hi = (uint32_t)(b[8 + j] >> 4) | (((qh >> (j + 16)) & 1u) << 4);
            t = d * (float)lo;
            v[j] = t + m;
            t = d * (float)hi;
            v[j + 16] = t + m;
        }
        return;
    default: { /* F_MXFP4: 2^(e-128) times twice the E2M1 value */
        uint32_t e = b[0];
        d = bits_f32(e < 2 ? (0x00200000u << e) : ((e - 1u) << 23));
        for (j = 0; j < 16; j++) {
            v[j] = d * MXFP4[b[1 + j] & 15u];
            v[j + 16] = d * MXFP4[b[1 + j] >> 4];
        }
        return;
    }
    }
}


static int ids_in_range(const int64_t *ids, int64_t n, int64_t rows) {
    int64_t bad = 0;
    for (int64_t i = 0; i < n; i++) bad |= (int64_t)((uint64_t)ids[i] >= (uint64_t)rows);
    return bad == 0;
}

#define QUANT_CHUNK 64 /* rows a thread takes at a time */

typedef struct {
    int fmt, kind;
    const uint8_t *data;
    int64_t row_nbytes, block_nbytes, head_dim, n;
    const int64_t *ids;
    float global_scale;
    void *out;
    int64_t next;
} job_t;

static void decode_rows(const job_t *job, int64_t a, int64_t b) {
    float v[32], t;
    const int64_t D = job->head_dim;
    for (int64_t i = a; i < b; i++) {
        const uint8_t *row = job->data + job->ids[i] * job->row_nbytes;
        if (job->fmt == F_NVFP4) {
            const uint8_t *sc = row + D / 2;
            for (int64_t c = 0; c < D; c += 16) {
                float s = e4m3(sc[c / 16]);
                for (int j = 0; j < 16; j += 2) {
                    uint8_t byte = row[(c + j) / 2];
                    t = E2M1[byte & 15u] * s;
                    v[j] = t * job->global_scale;
                    t = E2M1[byte >> 4] * s;
                    v[j + 1] = t * job->global_scale;
                }
                store(job->out, i * D + c, v, 16, job->kind);
            }
        } else {
            for (int64_t c = 0, k = 0; c < D; c += 32, k++) {
                decode32(job->fmt, row + k * job->block_nbytes, v);
                store(job->out, i * D + c, v, 32, job->kind);
            }
        }
    }
}

static void *quant_worker(void *arg) {
    job_t *job = (job_t *)arg;
    for (;;) {
        const int64_t a = __atomic_fetch_add(&job->next, QUANT_CHUNK, __ATOMIC_RELAXED);
        if (a >= job->n) break;
        decode_rows(job, a, a + QUANT_CHUNK < job->n ? a + QUANT_CHUNK : job->n);
    }
    return NULL;
}

/* Rows ids[0 .. n) decoded into out on up to `threads` threads (a team of ple_team_run, at least 256
 * rows each). Returns 0; -1, writing nothing, when an id is outside [0, rows); -2 for a bad format or
 * output kind. */
int ple_quant_lookup(int fmt, const uint8_t *data, int64_t rows, int64_t row_nbytes, int64_t head_dim,
                     const int64_t *ids, int64_t n, float global_scale, int out_kind, void *out, int threads) {
    static const int64_t BLOCK_NBYTES[8] = {34, 24, 22, 20, 18, 18, 17, 9};
    if (fmt < 0 || fmt > F_NVFP4 || out_kind < OUT_F32 || out_kind > OUT_BF16) return -2;
    if (!ids_in_range(ids, n, rows)) return -1;
    if (threads < 1) threads = 1;
    if (n < 256 * (int64_t)threads) threads = (int)(n / 256) > 1 ? (int)(n / 256) : 1;
    job_t job = {fmt, out_kind, data, row_nbytes, BLOCK_NBYTES[fmt], head_dim, n, ids, global_scale, out, 0};
    ple_team_run(threads, quant_worker, &job);
    return 0;
}

/* ---------------------------------------------------------------------------------------------------
 * Row gathers of plain formats. A decode step reads about a thousand rows of a few hundred bytes at
 * random places of a table far larger than the caches: copied one after another, each row waits for
 * memory on its own. Here the rows PREFETCH_ROWS ahead are requested while the current one is copied,
 * so their reads overlap; `threads` threads (a team of ple_team_run, ple_cpu.c) take chunks of
 * GATHER_CHUNK rows from a shared counter.
 *
 * ple_gather_rows: row i of out (row_bytes bytes) = row ids[i] of data (rows `stride` bytes apart).
 * ple_gather_lut: the same rows of bytes, each byte b written as the esize-byte element lut[b] (the
 * value of every float8 byte in the activation dtype): the gather and the dequantization in one pass.
 * Both check every id first and return -1, writing nothing, when one is outside [0, rows); -2 for a
 * bad geometry.
 */
#ifndef PREFETCH_ROWS
#define PREFETCH_ROWS 16
#endif
#define GATHER_CHUNK 128

static void prefetch_row(const uint8_t *row, int64_t row_bytes) {
    for (int64_t o = 0; o < row_bytes; o += 64) __builtin_prefetch(row + o, 0, 0);
    __builtin_prefetch(row + row_bytes - 1, 0, 0);
}

typedef struct {
    const uint8_t *data;
    int64_t stride, row_bytes, n;
    const int64_t *ids;
    const void *lut; /* null: plain bytes */
    int esize;
    void *out;
    int64_t next;
} gather_job_t;

static void gather_range(const gather_job_t *G, int64_t a, int64_t b) {
    const int64_t stride = G->stride, row_bytes = G->row_bytes;
    for (int64_t i = a; i < b && i < a + PREFETCH_ROWS; i++) prefetch_row(G->data + G->ids[i] * stride, row_bytes);
    for (int64_t i = a; i < b; i++) {
        if (i + PREFETCH_ROWS < b) prefetch_row(G->data + G->ids[i + PREFETCH_ROWS] * stride, row_bytes);
        const uint8_t *src = G->data + G->ids[i] * stride;
        if (!G->lut) {
            memcpy((uint8_t *)G->out + i * row_bytes, src, (size_t)row_bytes);
        } else if (G->esize == 2) {
            const uint16_t *t = (const uint16_t *)G->lut;
            uint16_t *o = (uint16_t *)G->out + i * row_bytes;
            for (int64_t j = 0; j < row_bytes; j++) o[j] = t[src[j]];
        } else {
            const uint32_t *t = (const uint32_t *)G->lut;
            uint32_t *o = (uint32_t *)G->out + i * row_bytes;
            for (int64_t j = 0; j < row_bytes; j++) o[j] = t[src[j]];
        }
    }
}

static void *gather_worker(void *arg) {
    gather_job_t *G = (gather_job_t *)arg;
    for (;;) {
        const int64_t a = __atomic_fetch_add(&G->next, GATHER_CHUNK, __ATOMIC_RELAXED);
        if (a >= G->n) break;
        gather_range(G, a, a + GATHER_CHUNK < G->n ? a + GATHER_CHUNK : G->n);
    }
    return NULL;
}

static int gather(gather_job_t *G, int threads) {
    const int64_t chunks = (G->n + GATHER_CHUNK - 1) / GATHER_CHUNK;
    if (threads > chunks) threads = chunks > 0 ? (int)chunks : 1;
    ple_team_run(threads, gather_worker, G);
    return 0;
}

int ple_gather_rows(const uint8_t *data, int64_t rows, int64_t stride, int64_t row_bytes, const int64_t *ids,
                    int64_t n, uint8_t *out, int threads) {
    if (rows < 0 || row_bytes < 1 || stride < row_bytes || n < 0) return -2;
    if (!ids_in_range(ids, n, rows)) return -1;
    gather_job_t G = {data, stride, row_bytes, n, ids, NULL, 1, out, 0};
    return gather(&G, threads);
}

int ple_gather_lut(const uint8_t *data, int64_t rows, int64_t stride, int64_t row_bytes, const int64_t *ids,
                   int64_t n, const void *lut, int esize, void *out, int threads) {
    if (rows < 0 || row_bytes < 1 || stride < row_bytes || n < 0 || (esize != 2 && esize != 4)) return -2;
    if (!ids_in_range(ids, n, rows)) return -1;
    gather_job_t G = {data, stride, row_bytes, n, ids, lut, esize, out, 0};
    return gather(&G, threads);
}

/*
 * ple_overlay_rows: the rows of several row overlays (ple.table.tiers.adapted.RowOverlay, each held
 * fully in memory), put in place over looked-up rows. For each i < n whose which[i] = a is >= 0: ids[i]
 * is searched among keys[a][0 .. counts[a]) (sorted, distinct); when found at p, row slots[a][p] of
 * rows[a] (row_bytes each, capacity[a] rows) is copied to out + i * row_bytes. The searches of
 * SEARCH_GROUP ids advance together, one level at a time (each level requesting the next level's two
 * possible keys), so that their reads of the keys overlap; then their rows are requested together.
 * Returns how many rows were copied; -1 (before anything is written) for an adapter outside
 * [0, adapters); -2 for a bad geometry or a slot outside its rows (what was copied before stays).
 */
#define SEARCH_GROUP 32

int64_t ple_overlay_rows(int64_t n, const int64_t *ids, const int64_t *which, int64_t adapters,
                         const int64_t *const *keys, const int64_t *counts, const int64_t *const *slots,
                         const uint8_t *const *rows, const int64_t *capacity, int64_t row_bytes, uint8_t *out) {
    if (n < 0 || adapters < 0 || row_bytes < 1) return -2;
    for (int64_t i = 0; i < n; i++)
        if (which[i] >= adapters) return -1;
    int64_t copied = 0;
    int64_t at[SEARCH_GROUP], lo[SEARCH_GROUP], len[SEARCH_GROUP], who[SEARCH_GROUP];
    for (int64_t i0 = 0; i0 < n;) {
        int g = 0; /* the next ids of an adapter, up to SEARCH_GROUP of them */
        for (; i0 < n && g < SEARCH_GROUP; i0++) {
            const int64_t a = which[i0];
            if (a < 0 || counts[a] <= 0) continue;
            at[g] = i0, who[g] = a, lo[g] = 0, len[g] = counts[a];
            g++;
        }
        for (int busy = 1; busy;) {
            busy = 0;
            for (int j = 0; j < g; j++) {
                if (len[j] <= 0) continue;
                const int64_t half = len[j] >> 1, *k = keys[who[j]];
                const int right = k[lo[j] + half] < ids[at[j]];
                /* the next probe is a quarter of the range to either side: request both */
                __builtin_prefetch(k + lo[j] + (half >> 1), 0, 0);
                __builtin_prefetch(k + lo[j] + half + 1 + ((len[j] - half - 1) >> 1), 0, 0);
                lo[j] = right ? lo[j] + half + 1 : lo[j];
                len[j] = right ? len[j] - half - 1 : half;
                busy |= len[j] > 0;
            }
        }
        const uint8_t *src[SEARCH_GROUP];
        for (int j = 0; j < g; j++) { /* the rows found, requested together */
            const int64_t a = who[j];
            src[j] = NULL;
            if (lo[j] >= counts[a] || keys[a][lo[j]] != ids[at[j]]) continue;
            const int64_t s = slots[a][lo[j]];
            if (s < 0 || s >= capacity[a]) return -2;
            src[j] = rows[a] + s * row_bytes;
            prefetch_row(src[j], row_bytes);
        }
        for (int j = 0; j < g; j++) {
            if (!src[j]) continue;
            memcpy(out + at[j] * row_bytes, src[j], (size_t)row_bytes);
            copied++;
        }
    }
    return copied;
}
