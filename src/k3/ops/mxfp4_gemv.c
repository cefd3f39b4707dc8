/* y[b, n] = sum_k x[b, k] * W[n, k] for an MXFP4 weight W [N, K] kept packed (issue 37; SPEC §10): two E2M1 codes
 * per byte (element 2i in the low nibble), one E8M0 scale byte per 32 elements along K. Each weight byte is read
 * once per call, for every row of x: a small batch decodes each block once and multiplies it by all its rows.
 *
 * A block's 16 bytes give 16 lanes of low-nibble values, for x's even elements, and 16 of high-nibble values, for
 * its odd ones. With AVX-512 a nibble becomes its value by one permute of the 16-entry E2M1 table and x's 32
 * elements are split into even and odd lanes by two permutes; otherwise the compiler vectorises the scalar loop.
 * Scale byte 255 (E8M0 NaN) makes the block NaN, as k3.ops.mx.decode does. Rows of W run in parallel. */
#include <stdint.h>
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

/* One row n of W against up to MAX_ROWS rows of x ([rows, K], row stride K). */
static void row(const float *x, const uint8_t *packed, const uint8_t *scale, float *y, int64_t rows, int64_t n,
                int64_t K, int64_t y_stride) {
    const int64_t blocks = K / 32;
#ifdef __AVX512F__
    const __m512 table = _mm512_loadu_ps(E2M1);
    const __m512i low = _mm512_set1_epi32(0x0F);
    const __m512i even = _mm512_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30);
    const __m512i odd = _mm512_setr_epi32(1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 27, 29, 31);
    __m512 acc[MAX_ROWS];
    for (int64_t b = 0; b < rows; ++b) acc[b] = _mm512_setzero_ps();
    for (int64_t j = 0; j < blocks; ++j) {
        __m512i bytes = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(packed + j * 16)));
        __m512 s = _mm512_set1_ps(block_scale(scale[j]));
        __m512 lo = _mm512_mul_ps(_mm512_permutexvar_ps(_mm512_and_si512(bytes, low), table), s);
        __m512 hi = _mm512_mul_ps(_mm512_permutexvar_ps(_mm512_srli_epi32(bytes, 4), table), s);
        for (int64_t b = 0; b < rows; ++b) {
            const float *xb = x + b * K + j * 32;
            __m512 first = _mm512_loadu_ps(xb), second = _mm512_loadu_ps(xb + 16);
            acc[b] = _mm512_fmadd_ps(lo, _mm512_permutex2var_ps(first, even, second), acc[b]);
            acc[b] = _mm512_fmadd_ps(hi, _mm512_permutex2var_ps(first, odd, second), acc[b]);
        }
    }
    for (int64_t b = 0; b < rows; ++b) y[b * y_stride + n] = _mm512_reduce_add_ps(acc[b]);
#else
    float acc[MAX_ROWS][16];
    memset(acc, 0, sizeof(acc));
    for (int64_t j = 0; j < blocks; ++j) {
        float s = block_scale(scale[j]), lo[16], hi[16];
        for (int i = 0; i < 16; ++i) {
            lo[i] = E2M1[packed[j * 16 + i] & 0x0F] * s;
            hi[i] = E2M1[packed[j * 16 + i] >> 4] * s;
        }
        for (int64_t b = 0; b < rows; ++b)
            for (int i = 0; i < 16; ++i)
                acc[b][i] += lo[i] * x[b * K + j * 32 + 2 * i] + hi[i] * x[b * K + j * 32 + 2 * i + 1];
    }
    for (int64_t b = 0; b < rows; ++b) {
        float total = 0.0f;
        for (int i = 0; i < 16; ++i) total += acc[b][i];
        y[b * y_stride + n] = total;
    }
#endif
}

/* x [B, K], packed [N, K/2], scale [N, K/32], y [B, N], all contiguous; K a multiple of 32. Rows of x are taken
 * MAX_ROWS at a time. */
void mxfp4_gemv(const float *x, const uint8_t *packed, const uint8_t *scale, float *y, int64_t B, int64_t N,
                int64_t K, int threads) {
    const int64_t half = K / 2, blocks = K / 32;
    for (int64_t b0 = 0; b0 < B; b0 += MAX_ROWS) {
        const int64_t rows = B - b0 < MAX_ROWS ? B - b0 : MAX_ROWS;
#pragma omp parallel for num_threads(threads) schedule(static) if (threads > 1 && N * K >= (1 << 16))
        for (int64_t n = 0; n < N; ++n)
            row(x + b0 * K, packed + n * half, scale + n * blocks, y + b0 * N, rows, n, K, N);
    }
}
