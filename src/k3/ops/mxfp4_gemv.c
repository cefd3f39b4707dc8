/* y[b, n] = sum_k x[b, k] * W[n, k] for an MXFP4 weight W [N, K] kept packed (issue 37; SPEC §10): two E2M1 codes
 * per byte (element 2i in the low nibble), one E8M0 scale byte per 32 elements along K. Each weight byte is read
 * once per call, for every row of x: a small batch decodes each block once and multiplies it by all its rows.
 * `mxfp4_experts` runs a whole routed-experts layer this way in one call: gate and up, the gated activation, down,
 * and the routing-weighted sum, each chosen expert's bytes read once for up to MAX_ROWS (16) of its tokens.
 *
 * A block's 16 bytes give 16 lanes of low-nibble values, for x's even elements, and 16 of high-nibble values, for
 * its odd ones: x is read split into its even and odd elements (copied so once per call). With AVX-512 a nibble
 * becomes its value by one permute of the 16-entry E2M1 table, scaled by the block's scale first; otherwise the
 * compiler vectorises the scalar loop. Scale byte 255 (E8M0 NaN) makes the block NaN, as k3.ops.mx.decode does. Rows
 * of W run in parallel. */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#ifdef __AVX512F__
#include <immintrin.h>
#endif

static const float E2M1[16] = {0.0f, 0.5f, 1.0f, 1.5f, 2.0f, 3.0f, 4.0f, 6.0f,
                               -0.0f, -0.5f, -1.0f, -1.5f, -2.0f, -3.0f, -4.0f, -6.0f};

/* 2^(s - 127) from its bits: the exponent field s (byte 0: the subnormal 2^-127), NaN for byte 255. */
static float block_scale(uint8_t s) {
    uint32_t bits = s == 0 ? 0x00400000u : s == 255 ? 0x7FC00000u : (uint32_t)s << 23;
    float out;
    memcpy(&out, &bits, sizeof(out));
    return out;
}

#define MAX_ROWS 16

/* x's row in the order the kernel reads it: its even elements, then its odd ones (a block's low and high nibbles
 * are the weights of those). */
static void split(const float *x, int64_t K, float *out) {
    for (int64_t i = 0; i < K / 2; ++i) out[i] = x[2 * i], out[K / 2 + i] = x[2 * i + 1];
}

#ifdef __AVX512F__
/* One row of W (its packed bytes and scales) against exactly R rows of x, each split (`split`): sums[b]. Inlined
 * with R a constant, the accumulators stay in registers. Each row's sum is computed in the same order whatever R
 * is: a row's result does not depend on the other rows of the batch. */
static inline __attribute__((always_inline)) void rows_of(const float *const *x, const uint8_t *packed,
                                                          const uint8_t *scale, int64_t K, float *sums, const int R) {
    const __m512 table = _mm512_loadu_ps(E2M1);
    __m512 acc0[8], acc1[8];
    for (int b = 0; b < R; ++b) acc0[b] = acc1[b] = _mm512_setzero_ps();
    for (int64_t j = 0; j < K / 32; ++j) {
        __m512i bytes = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(packed + j * 16)));
        __m512 scaled = _mm512_mul_ps(table, _mm512_set1_ps(block_scale(scale[j])));
        __m512 lo = _mm512_permutexvar_ps(bytes, scaled);                      /* index bits 0-3: the low nibble */
        __m512 hi = _mm512_permutexvar_ps(_mm512_srli_epi32(bytes, 4), scaled); /* the high nibble */
        for (int b = 0; b < R; ++b) {
            acc0[b] = _mm512_fmadd_ps(lo, _mm512_loadu_ps(x[b] + j * 16), acc0[b]);
            acc1[b] = _mm512_fmadd_ps(hi, _mm512_loadu_ps(x[b] + K / 2 + j * 16), acc1[b]);
        }
    }
    for (int b = 0; b < R; ++b) sums[b] = _mm512_reduce_add_ps(_mm512_add_ps(acc0[b], acc1[b]));
}
#endif

/* One row of W (its packed bytes and scales) against up to MAX_ROWS rows of x, each K long and split: sums[b]. */
static void row(const float *const *x, const uint8_t *packed, const uint8_t *scale, int64_t rows, int64_t K,
                float *sums) {
#ifdef __AVX512F__
    int64_t b = 0;
    for (; b + 8 <= rows; b += 8) rows_of(x + b, packed, scale, K, sums + b, 8);
    if (rows - b >= 4) rows_of(x + b, packed, scale, K, sums + b, 4), b += 4;
    if (rows - b >= 2) rows_of(x + b, packed, scale, K, sums + b, 2), b += 2;
    if (rows - b == 1) rows_of(x + b, packed, scale, K, sums + b, 1);
#else
    float acc[MAX_ROWS][16];
    memset(acc, 0, sizeof(acc));
    for (int64_t j = 0; j < K / 32; ++j) {
        float s = block_scale(scale[j]), lo[16], hi[16];
        for (int i = 0; i < 16; ++i) {
            lo[i] = E2M1[packed[j * 16 + i] & 0x0F] * s;
            hi[i] = E2M1[packed[j * 16 + i] >> 4] * s;
        }
        for (int64_t b = 0; b < rows; ++b)
            for (int i = 0; i < 16; ++i)
                acc[b][i] += lo[i] * x[b][j * 16 + i] + hi[i] * x[b][K / 2 + j * 16 + i];
    }
    for (int64_t b = 0; b < rows; ++b) {
        float total = 0.0f;
        for (int i = 0; i < 16; ++i) total += acc[b][i];
        sums[b] = total;
    }
#endif
}

/* x [B, K], packed [N, K/2], scale [N, K/32], y [B, N], all contiguous; K a multiple of 32. Rows of x are taken
 * MAX_ROWS at a time. Returns 0, or -2 (having done nothing) if memory runs out. */
int mxfp4_gemv(const float *x, const uint8_t *packed, const uint8_t *scale, float *y, int64_t B, int64_t N,
               int64_t K, int threads) {
    const int64_t half = K / 2, blocks = K / 32;
    float *xs = malloc((size_t)(B ? B : 1) * (size_t)K * sizeof(float));
    if (!xs) return -2;
    for (int64_t b = 0; b < B; ++b) split(x + b * K, K, xs + b * K);
    for (int64_t b0 = 0; b0 < B; b0 += MAX_ROWS) {
        const int64_t rows = B - b0 < MAX_ROWS ? B - b0 : MAX_ROWS;
        const float *rows_x[MAX_ROWS];
        for (int64_t b = 0; b < rows; ++b) rows_x[b] = xs + (b0 + b) * K;
#pragma omp parallel for num_threads(threads) schedule(static) if (threads > 1 && N * K >= (1 << 16))
        for (int64_t n = 0; n < N; ++n) {
            float sums[MAX_ROWS];
            row(rows_x, packed + n * half, scale + n * blocks, rows, K, sums);
            for (int64_t b = 0; b < rows; ++b) y[(b0 + b) * N + n] = sums[b];
        }
    }
    free(xs);
    return 0;
}

/* The gated activation of k3.model.width (SPEC Eq. 12-13, 18), in the order PyTorch computes it: SiTU
 * softCap(g, c_g) * sigmoid(g) * softCap(u, c_u) (activation 0), or SwiGLU silu(g) * u (activation 1). */
static float gated(float g, float u, int activation, float gate_cap, float up_cap) {
    if (activation == 1) return g / (1.0f + expf(-g)) * u;
    return gate_cap * tanhf(g / gate_cap) * (1.0f / (1.0f + expf(-g))) * (up_cap * tanhf(u / up_cap));
}

/* A routed-experts layer (k3.model.width.Experts.forward) on packed weights: out [N, W] = sum over the k choices
 * of token t of weights[t, j] * down_e(act(gate_e(x_t), up_e(x_t))), e = indices[t, j], summed in the order of
 * the chosen experts' numbers. gate_up [E, 2F, W/2] (rows :F gate, F: up) with scales [E, 2F, W/32]; down
 * [E, W, F/2] with scales [E, W, F/32]; x [N, W], weights [N, k] fp32, indices [N, k]; W and F multiples of 32.
 * Each expert with tokens runs on them MAX_ROWS at a time: its gate and up rows in parallel (each thread
 * activating the columns it computed), then its down rows (each thread adding its columns into out). Returns 0;
 * having done nothing, -1 if an index is outside [0, E) and -2 if memory runs out. */
int mxfp4_experts(const float *x, const float *weights, const int64_t *indices, const uint8_t *gate_up_packed,
                  const uint8_t *gate_up_scale, const uint8_t *down_packed, const uint8_t *down_scale, float *out,
                  int64_t N, int64_t k, int64_t E, int64_t W, int64_t F, int activation, float gate_cap,
                  float up_cap, int threads) {
    const int64_t pairs = N * k;
    for (int64_t p = 0; p < pairs; ++p)
        if (indices[p] < 0 || indices[p] >= E) return -1;
    int64_t *start = calloc((size_t)E + 1, sizeof(int64_t));
    int64_t *order = malloc((size_t)(pairs ? pairs : 1) * sizeof(int64_t));
    float *h = malloc((size_t)MAX_ROWS * (size_t)F * sizeof(float));
    float *xs = malloc((size_t)(N ? N : 1) * (size_t)W * sizeof(float));
    if (!start || !order || !h || !xs) {
        free(start), free(order), free(h), free(xs);
        return -2;
    }
    for (int64_t t = 0; t < N; ++t) split(x + t * W, W, xs + t * W);
    for (int64_t p = 0; p < pairs; ++p) ++start[indices[p] + 1];
    for (int64_t e = 0; e < E; ++e) start[e + 1] += start[e];
    for (int64_t p = 0; p < pairs; ++p) order[start[indices[p]]++] = p;  /* pairs by expert, tokens ascending */
    for (int64_t e = E; e > 0; --e) start[e] = start[e - 1];
    start[0] = 0;
    memset(out, 0, (size_t)(N * W) * sizeof(float));
#pragma omp parallel num_threads(threads) if (threads > 1 && F * W >= (1 << 15))
    for (int64_t e = 0; e < E; ++e) {
        const uint8_t *gp = gate_up_packed + e * 2 * F * (W / 2), *gs = gate_up_scale + e * 2 * F * (W / 32);
        const uint8_t *dp = down_packed + e * W * (F / 2), *ds = down_scale + e * W * (F / 32);
        for (int64_t p0 = start[e]; p0 < start[e + 1]; p0 += MAX_ROWS) {
            const int64_t rows = start[e + 1] - p0 < MAX_ROWS ? start[e + 1] - p0 : MAX_ROWS;
            const float *rows_x[MAX_ROWS], *hs[MAX_ROWS];
            for (int64_t b = 0; b < rows; ++b) rows_x[b] = xs + order[p0 + b] / k * W, hs[b] = h + b * F;
#pragma omp for schedule(static)
            for (int64_t f = 0; f < F; ++f) {
                float g[MAX_ROWS], u[MAX_ROWS];
                row(rows_x, gp + f * (W / 2), gs + f * (W / 32), rows, W, g);
                row(rows_x, gp + (F + f) * (W / 2), gs + (F + f) * (W / 32), rows, W, u);
                for (int64_t b = 0; b < rows; ++b)  /* h is written split, as `row` reads it */
                    h[b * F + (f % 2) * (F / 2) + f / 2] = gated(g[b], u[b], activation, gate_cap, up_cap);
            }
#pragma omp for schedule(static)
            for (int64_t n = 0; n < W; ++n) {
                float y[MAX_ROWS];
                row(hs, dp + n * (F / 2), ds + n * (F / 32), rows, F, y);
                for (int64_t b = 0; b < rows; ++b) out[order[p0 + b] / k * W + n] += y[b] * weights[order[p0 + b]];
            }
        }
    }
    free(start), free(order), free(h), free(xs);
    return 0;
}
