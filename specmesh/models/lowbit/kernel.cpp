// Fused dequantize-matmul for weight-only low-bit linear layers: y[M, N] = x[M, K] @ dequant(W)[N, K]^T.
//
// Batch invariance by construction: output (m, n) is computed by the same sequence of float operations
// whatever M is and wherever row m sits in the call (two chains of 16 lane accumulators fed group by
// group in K order, then one fixed-order tree sum), so a verify forward over k + 1 rows gives, bit for bit, the
// rows of k + 1 one-row calls. Rows are processed ROWS at a time so the dequantized group is reused
// across rows (a verify costs about one decode step); that only changes which rows share a pass.
//
// Layouts (row n of the weight, K inputs, groups of G inputs, S = scale type float or _Float16):
//   q4: codes uint8 [N, K / 2]; per group of 32, byte b holds element b (low nibble) and b + 16 (high)
//       (ggml's Q4_0 / Q4_1 order); w = scale[n, g] * q + offset[n, g], q in 0..15.
//   q8: codes int8 [N, K]; w = scale[n, g] * q, groups of G = 16 or 32 inputs.
// K is a multiple of 32 (every ggml block is).
#include <cstdint>
#include <cstring>

typedef float f32x16 __attribute__((vector_size(64)));
typedef uint8_t u8x16 __attribute__((vector_size(16)));
typedef int8_t i8x16 __attribute__((vector_size(16)));
typedef int32_t i32x16 __attribute__((vector_size(64)));

// Bytes to floats, widened through int32 (gcc scalarises a direct byte -> float vector conversion,
// and the int8 one even through int32, so AVX-512 builds say it with intrinsics).
#if defined(__AVX512F__)
#include <immintrin.h>
static inline f32x16 u8_to_float(u8x16 v) { return (f32x16)_mm512_cvtepi32_ps(_mm512_cvtepu8_epi32((__m128i)v)); }
static inline f32x16 i8_to_float(i8x16 v) { return (f32x16)_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32((__m128i)v)); }
#else
static inline f32x16 u8_to_float(u8x16 v) {
    return __builtin_convertvector(__builtin_convertvector(v, i32x16), f32x16);
}
static inline f32x16 i8_to_float(i8x16 v) {
    return __builtin_convertvector(__builtin_convertvector(v, i32x16), f32x16);
}
#endif

static inline f32x16 load16(const float *p) {
    f32x16 v;
    std::memcpy(&v, p, sizeof(v));
    return v;
}

static inline float tree_sum(f32x16 v) {
    float t[16];
    std::memcpy(t, &v, sizeof(t));
    for (int width = 8; width >= 1; width /= 2)
        for (int i = 0; i < width; i++) t[i] = t[i] + t[i + width];
    return t[0];
}

template <typename S, int ROWS>
static void q4_pass(const float *x, int64_t K, const uint8_t *codes, const S *scales, const S *offsets, int64_t n0,
                    int64_t n1, int64_t N, float *y) {
    const int64_t num_groups = K / 32;
    for (int64_t n = n0; n < n1; n++) {
        f32x16 acc_lo[ROWS], acc_hi[ROWS];  // two chains per row: the FMA latency, not the loads, bounds one row
        for (int r = 0; r < ROWS; r++) acc_lo[r] = acc_hi[r] = f32x16{};
        const uint8_t *c = codes + n * (K / 2);
        const S *sc = scales + n * num_groups;
        const S *of = offsets + n * num_groups;
        for (int64_t g = 0; g < num_groups; g++) {
            u8x16 raw;
            std::memcpy(&raw, c + g * 16, 16);
            const float s = (float)sc[g], o = (float)of[g];
            const f32x16 lo = u8_to_float(raw & 15) * s + o;
            const f32x16 hi = u8_to_float(raw >> 4) * s + o;
            for (int r = 0; r < ROWS; r++) {
                const float *xr = x + r * K + g * 32;
                acc_lo[r] += lo * load16(xr);
                acc_hi[r] += hi * load16(xr + 16);
            }
        }
        for (int r = 0; r < ROWS; r++) y[r * N + n] = tree_sum(acc_lo[r] + acc_hi[r]);
    }
}

template <typename S, int G, int ROWS>
static void q8_pass(const float *x, int64_t K, const int8_t *codes, const S *scales, int64_t n0, int64_t n1, int64_t N,
                    float *y) {
    for (int64_t n = n0; n < n1; n++) {
        f32x16 acc_a[ROWS], acc_b[ROWS];  // inputs j..j+15 and j+16..j+31 of every 32: two chains
        for (int r = 0; r < ROWS; r++) acc_a[r] = acc_b[r] = f32x16{};
        const int8_t *c = codes + n * K;
        const S *sc = scales + n * (K / G);
        for (int64_t j = 0; j < K; j += 32) {
            i8x16 raw_a, raw_b;
            std::memcpy(&raw_a, c + j, 16);
            std::memcpy(&raw_b, c + j + 16, 16);
            const f32x16 wa = i8_to_float(raw_a) * (float)sc[j / G];
            const f32x16 wb = i8_to_float(raw_b) * (float)sc[(j + 16) / G];
            for (int r = 0; r < ROWS; r++) {
                acc_a[r] += wa * load16(x + r * K + j);
                acc_b[r] += wb * load16(x + r * K + j + 16);
            }
        }
        for (int r = 0; r < ROWS; r++) y[r * N + n] = tree_sum(acc_a[r] + acc_b[r]);
    }
}

// Rows in passes of up to 8 (registers hold 2 x 8 accumulators); output rows split across threads in
// contiguous static chunks, so each thread streams its part of the weight once per pass.
template <typename Pass>
static void over_rows(int64_t M, int64_t N, int num_threads, Pass pass) {
#pragma omp parallel for num_threads(num_threads) schedule(static)
    for (int t = 0; t < num_threads; t++) {
        const int64_t n0 = N * t / num_threads, n1 = N * (t + 1) / num_threads;
        for (int64_t m0 = 0; m0 < M; m0 += 8) {
            switch (M - m0 < 8 ? M - m0 : 8) {
                case 1: pass.template operator()<1>(m0, n0, n1); break;
                case 2: pass.template operator()<2>(m0, n0, n1); break;
                case 3: pass.template operator()<3>(m0, n0, n1); break;
                case 4: pass.template operator()<4>(m0, n0, n1); break;
                case 5: pass.template operator()<5>(m0, n0, n1); break;
                case 6: pass.template operator()<6>(m0, n0, n1); break;
                case 7: pass.template operator()<7>(m0, n0, n1); break;
                default: pass.template operator()<8>(m0, n0, n1); break;
            }
        }
    }
}

template <typename S>
static void q4_matmul(const float *x, int64_t M, int64_t K, const uint8_t *codes, const S *scales, const S *offsets,
                      int64_t N, float *y, int num_threads) {
    over_rows(M, N, num_threads, [&]<int ROWS>(int64_t m0, int64_t n0, int64_t n1) {
        q4_pass<S, ROWS>(x + m0 * K, K, codes, scales, offsets, n0, n1, N, y + m0 * N);
    });
}

template <typename S, int G>
static void q8_matmul(const float *x, int64_t M, int64_t K, const int8_t *codes, const S *scales, int64_t N, float *y,
                      int num_threads) {
    over_rows(M, N, num_threads, [&]<int ROWS>(int64_t m0, int64_t n0, int64_t n1) {
        q8_pass<S, G, ROWS>(x + m0 * K, K, codes, scales, n0, n1, N, y + m0 * N);
    });
}

// The C entry points (ctypes): q4 with fp16 or fp32 scales and offsets; q8 with groups of 16 or 32.
extern "C" {
void lowbit_q4_f16(const float *x, int64_t M, int64_t K, const uint8_t *codes, const _Float16 *scales,
                   const _Float16 *offsets, int64_t N, float *y, int num_threads) {
    q4_matmul<_Float16>(x, M, K, codes, scales, offsets, N, y, num_threads);
}
void lowbit_q4_f32(const float *x, int64_t M, int64_t K, const uint8_t *codes, const float *scales,
                   const float *offsets, int64_t N, float *y, int num_threads) {
    q4_matmul<float>(x, M, K, codes, scales, offsets, N, y, num_threads);
}
void lowbit_q8g32_f16(const float *x, int64_t M, int64_t K, const int8_t *codes, const _Float16 *scales, int64_t N,
                      float *y, int num_threads) {
    q8_matmul<_Float16, 32>(x, M, K, codes, scales, N, y, num_threads);
}
void lowbit_q8g32_f32(const float *x, int64_t M, int64_t K, const int8_t *codes, const float *scales, int64_t N,
                      float *y, int num_threads) {
    q8_matmul<float, 32>(x, M, K, codes, scales, N, y, num_threads);
}
void lowbit_q8g16_f32(const float *x, int64_t M, int64_t K, const int8_t *codes, const float *scales, int64_t N,
                      float *y, int num_threads) {
    q8_matmul<float, 16>(x, M, K, codes, scales, N, y, num_threads);
}
}
