// Fused low-bit matmul for weight-quantized linear layers: y[M, N] = xq[M, K] @ dequant(W)[N, K]^T, where xq is
// x with each row's blocks of 32 inputs quantized to int8 (one float scale per block, as ggml's Q8 activations).
//
// Numbers: per block b of row m, d = max|x| / 127 and q = round(x * 127 / max|x|) in -127..127 (0 when the block
// is all zero), so the row is approximated by d * q. The weight's integer codes meet q in exact int32 dot
// products (VNNI's u8 x s8 instruction where the CPU has it, AVX2's u8 x s8 pair products summed in 16 then 32
// bits where it has that, plain loops otherwise: the integers are equal);
// the float part is fixed: per 64 inputs ("chunk") 16 lanes, lane l covering inputs 4l..4l+3, each lane
// acc = fma(float(dot), scale_w * d, acc) chunk by chunk in K order (then, for q4, the offsets' term
// offset_g * d_g * sum(q in g) for 16 blocks per step into the same lanes), then one fixed-order tree sum. Output (m, n) is
// therefore the same sequence of operations whatever M is and wherever row m sits in the call: a verify
// forward over k + 1 rows gives, bit for bit, the rows of k + 1 one-row calls. `kernel.py`'s torch
// reference computes the same numbers with sgemm (equal up to float rounding).
//
// Layouts (row n of the weight, K inputs, groups of G inputs, S = scale type float or _Float16):
//   q4: codes uint8 [N, K / 2]; per group of 32, byte b holds element b (low nibble) and b + 16 (high)
//       (ggml's Q4_0 / Q4_1 order); w = scale[n, g] * q + offset[n, g], q in 0..15.
//   q8: codes int8 [N, K]; w = scale[n, g] * q, groups of G = 16 or 32 inputs.
// K is a multiple of 32 (every ggml block is).
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512DQ__) && defined(__AVX512VNNI__)
#include <immintrin.h>
#define LOWBIT_VNNI 1
#define LOWBIT_AVX2 0
#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#include <immintrin.h>
#define LOWBIT_VNNI 0
#define LOWBIT_AVX2 1
#else
#define LOWBIT_VNNI 0
#define LOWBIT_AVX2 0
#endif

namespace {

constexpr int BLOCK = 32;  // inputs per activation scale
constexpr int CHUNK = 64;  // inputs per 16 lanes (4 each)
constexpr int LANES = 16;
constexpr int64_t PREFETCH_ROWS = 16;  // weight rows ahead (a hint only: it never changes a number)

struct Lanes {
    alignas(64) float v[LANES];
};

// One row of activations, quantized: codes padded with zeros to whole chunks, d per lane, and per block d * sum(q)
// padded with zeros to a multiple of 16 blocks (the q4 offsets' term runs 16 blocks at a time).
struct Row {
    const int8_t *q;
    const float *lane_scale;  // [chunks * 16]: d of the block lane l reads
    const float *block_sum;   // [blocks rounded up to 16]: d * sum(q) of each block
};

struct Quantized {
    std::vector<int8_t> q;
    std::vector<float> lane_scale, block_sum;
    int64_t padded_k, padded_blocks;

    Quantized(const float *x, int64_t M, int64_t K)
        : padded_k((K + CHUNK - 1) / CHUNK * CHUNK), padded_blocks((K / BLOCK + LANES - 1) / LANES * LANES) {
        q.assign(M * padded_k, 0);
        lane_scale.assign(M * padded_k / 4, 0.0f);
        block_sum.assign(M * padded_blocks, 0.0f);
        for (int64_t m = 0; m < M; m++) {
            const float *xr = x + m * K;
            for (int64_t b = 0; b < K / BLOCK; b++) {
                float amax = 0.0f;  // comparisons, not std::fmax (a libm call per element); inputs are finite
                for (int i = 0; i < BLOCK; i++) {
                    const float magnitude = std::fabs(xr[b * BLOCK + i]);
                    amax = magnitude > amax ? magnitude : amax;
                }
                const float d = amax / 127.0f, inverse = amax > 0.0f ? 127.0f / amax : 0.0f;
                int sum = 0;
                for (int i = 0; i < BLOCK; i++) {
                    float r = std::nearbyint(xr[b * BLOCK + i] * inverse);
                    r = r > 127.0f ? 127.0f : (r < -127.0f ? -127.0f : r);
                    q[m * padded_k + b * BLOCK + i] = (int8_t)r;
                    sum += (int)r;
                }
                for (int l = 0; l < BLOCK / 4; l++) lane_scale[m * padded_k / 4 + b * BLOCK / 4 + l] = d;
                block_sum[m * padded_blocks + b] = d * (float)sum;
            }
        }
    }
    Row row(int64_t m) const {
        return {q.data() + m * padded_k, lane_scale.data() + m * padded_k / 4, block_sum.data() + m * padded_blocks};
    }
};

inline float tree_sum(const Lanes &a) {
    float t[LANES];
    std::memcpy(t, a.v, sizeof(t));
    for (int width = LANES / 2; width >= 1; width /= 2)
        for (int i = 0; i < width; i++) t[i] = t[i] + t[i + width];
    return t[0];
}

// Weight element e (0 <= e < K) of a row, as the integer code the dot product uses.
inline int q4_code(const uint8_t *row, int64_t e) {
    const uint8_t byte = row[(e / 32) * 16 + (e % 32) % 16];
    return (e % 32) < 16 ? (byte & 15) : (byte >> 4);
}
inline int q8_code(const int8_t *row, int64_t e) { return row[e]; }

// The portable chunk: lanes whose inputs lie past K read nothing and add fma(0, 0, acc) == acc.
template <typename S, int G, typename Code, typename Codes>
inline void chunk_portable(Lanes &acc, Codes row, const S *scales, const Row &x, int64_t c, int64_t K, Code code) {
    for (int l = 0; l < LANES; l++) {
        const int64_t e0 = c * CHUNK + 4 * l;
        int32_t dot = 0;
        float scale = 0.0f;
        if (e0 < K) {
            for (int j = 0; j < 4; j++) dot += code(row, e0 + j) * (int32_t)x.q[e0 + j];
            scale = (float)scales[e0 / G];
        }
        acc.v[l] = std::fma((float)dot, scale * x.lane_scale[c * LANES + l], acc.v[l]);
    }
}

// The q4 offsets' term, sum over blocks of offset_g * (d_g * sum q_g), 16 blocks per step, added into the
// chunks' lanes (lane l takes blocks l, l + 16, ...) before their one tree sum.
template <typename S>
inline void add_offsets(Lanes &acc, const S *offsets, const Row &x, int64_t K) {
    const int64_t blocks = K / BLOCK;
    for (int64_t b0 = 0; b0 < blocks; b0 += LANES) {
        for (int l = 0; l < LANES; l++) {
            const float o = b0 + l < blocks ? (float)offsets[b0 + l] : 0.0f;
            acc.v[l] = std::fma(o, x.block_sum[b0 + l], acc.v[l]);
        }
    }
}

#if LOWBIT_VNNI || LOWBIT_AVX2
// The rest of tree_sum once its first step (lane i + lane i + 8) is done: quarters, pairs, the last two lanes.
inline float tree_sum_eight(__m256 eight) {
    const __m128 four = _mm_add_ps(_mm256_castps256_ps128(eight), _mm256_extractf128_ps(eight, 1));
    const __m128 two = _mm_add_ps(four, _mm_movehl_ps(four, four));
    return _mm_cvtss_f32(_mm_add_ss(two, _mm_movehdup_ps(two)));
}
#endif

#if LOWBIT_VNNI
// Scales of the groups one chunk covers, spread over the 16 lanes (lane l gets group l / (16 / groups)).
template <typename S, int GROUPS>
inline __m512 chunk_scales(const S *p) {
    static_assert(GROUPS == 2 || GROUPS == 4);
    __m128 v;
    if constexpr (sizeof(S) == 2) {
        __m128i h;
        if constexpr (GROUPS == 2) {
            int32_t bits;
            std::memcpy(&bits, p, 4);
            h = _mm_cvtsi32_si128(bits);
        } else {
            h = _mm_loadl_epi64((const __m128i *)p);
        }
        v = _mm_cvtph_ps(h);
    } else if constexpr (GROUPS == 2) {
        v = _mm_castpd_ps(_mm_load_sd((const double *)p));
    } else {
        v = _mm_loadu_ps((const float *)p);
    }
    const __m512i index = GROUPS == 2 ? _mm512_set_epi32(1, 1, 1, 1, 1, 1, 1, 1, 0, 0, 0, 0, 0, 0, 0, 0)
                                      : _mm512_set_epi32(3, 3, 3, 3, 2, 2, 2, 2, 1, 1, 1, 1, 0, 0, 0, 0);
    return _mm512_permutexvar_ps(index, _mm512_castps128_ps512(v));
}

// One chunk's integer dots into the lanes: acc + float(dot) * (weight scale * activation scale), the float
// operations chunk_portable does lane by lane.
inline __m512 accumulate_chunk(__m512 acc, __m512i dot, __m512 weight_scales, const Row &x, int64_t c) {
    const __m512 scale = _mm512_mul_ps(weight_scales, _mm512_loadu_ps(x.lane_scale + c * LANES));
    return _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot), scale, acc);
}

// tree_sum's order with shuffles: halves (lane i + lane i + 8), then tree_sum_eight.
inline float tree_sum_vnni(__m512 v) {
    return tree_sum_eight(_mm256_add_ps(_mm512_castps512_ps256(v), _mm512_extractf32x8_ps(v, 1)));
}

template <typename S>
inline __m512 add_offsets_vnni(__m512 acc, const S *offsets, const Row &x, int64_t K) {
    const int64_t blocks = K / BLOCK;
    for (int64_t b0 = 0; b0 < blocks; b0 += LANES) {
        const __mmask16 valid = blocks - b0 >= LANES ? (__mmask16)0xFFFF : (__mmask16)((1u << (blocks - b0)) - 1);
        __m512 o;  // lanes past the last block read nothing and hold 0, as add_offsets' do
        if constexpr (sizeof(S) == 2)
            o = _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(valid, offsets + b0));
        else
            o = _mm512_maskz_loadu_ps(valid, (const float *)(offsets + b0));
        acc = _mm512_fmadd_ps(o, _mm512_loadu_ps(x.block_sum + b0), acc);
    }
    return acc;
}
#endif

#if LOWBIT_AVX2
// The 16 lanes as two 8-float halves: lanes 0..7 (inputs 0..31 of the chunk) and 8..15 (inputs 32..63).
struct Halves {
    __m256 low, high;
};

// Per 32-bit lane, the sum of its 4 byte products u8 x s8. maddubs adds pairs in 16 bits with saturation, which
// never happens here: q4 codes are at most 15 and q8 magnitudes at most 128, activations within -127..127, so a
// pair is at most 2 * 128 * 127 = 32512. The int32 dots are therefore the VNNI build's and the plain loops'.
inline __m256i dot4(__m256i unsigned_w, __m256i signed_x) {
    return _mm256_madd_epi16(_mm256_maddubs_epi16(unsigned_w, signed_x), _mm256_set1_epi16(1));
}

inline float to_float(float v) { return v; }
inline float to_float(_Float16 v) { return (float)v; }

// Scales of the groups one chunk covers, lane l getting group l / (16 / GROUPS) (chunk_scales' spread).
template <typename S, int GROUPS>
inline Halves chunk_scales_avx2(const S *p) {
    static_assert(GROUPS == 2 || GROUPS == 4);
    if constexpr (GROUPS == 2) return {_mm256_set1_ps(to_float(p[0])), _mm256_set1_ps(to_float(p[1]))};
    const float g0 = to_float(p[0]), g1 = to_float(p[1]), g2 = to_float(p[2]), g3 = to_float(p[3]);
    return {_mm256_setr_ps(g0, g0, g0, g0, g1, g1, g1, g1), _mm256_setr_ps(g2, g2, g2, g2, g3, g3, g3, g3)};
}

// accumulate_chunk on two halves: acc + float(dot) * (weight scale * activation scale), lane by lane.
inline Halves accumulate_halves(Halves acc, __m256i dot_low, __m256i dot_high, Halves weight_scales, const Row &x,
                                int64_t c) {
    const float *lane_scale = x.lane_scale + c * LANES;
    const __m256 low = _mm256_mul_ps(weight_scales.low, _mm256_loadu_ps(lane_scale));
    const __m256 high = _mm256_mul_ps(weight_scales.high, _mm256_loadu_ps(lane_scale + 8));
    return {_mm256_fmadd_ps(_mm256_cvtepi32_ps(dot_low), low, acc.low),
            _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot_high), high, acc.high)};
}

// tree_sum's order: lane i + lane i + 8 is the sum of the halves, then tree_sum_eight.
inline float tree_sum_halves(Halves v) { return tree_sum_eight(_mm256_add_ps(v.low, v.high)); }

// add_offsets on two halves: 16 blocks per step, lanes past the last block adding fma(0, 0, acc).
template <typename S>
inline Halves add_offsets_halves(Halves acc, const S *offsets, const Row &x, int64_t K) {
    const int64_t blocks = K / BLOCK;
    for (int64_t b0 = 0; b0 < blocks; b0 += LANES) {
        __m256 o_low, o_high;
        if (blocks - b0 >= LANES) {
            if constexpr (sizeof(S) == 2) {
                o_low = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(offsets + b0)));
                o_high = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(offsets + b0 + 8)));
            } else {
                o_low = _mm256_loadu_ps((const float *)(offsets + b0));
                o_high = _mm256_loadu_ps((const float *)(offsets + b0 + 8));
            }
        } else {
            alignas(32) float o[LANES] = {};  // the last, partial step
            for (int64_t l = 0; l < blocks - b0; l++) o[l] = to_float(offsets[b0 + l]);
            o_low = _mm256_load_ps(o), o_high = _mm256_load_ps(o + 8);
        }
        acc.low = _mm256_fmadd_ps(o_low, _mm256_loadu_ps(x.block_sum + b0), acc.low);
        acc.high = _mm256_fmadd_ps(o_high, _mm256_loadu_ps(x.block_sum + b0 + 8), acc.high);
    }
    return acc;
}

inline void store_halves(Lanes &lanes, Halves v) {
    _mm256_store_ps(lanes.v, v.low);
    _mm256_store_ps(lanes.v + 8, v.high);
}
#endif

// y rows m0..m0+ROWS-1, outputs n0..n1-1.
template <typename S, int ROWS>
void q4_pass(const Row *rows, int64_t K, const uint8_t *codes, const S *scales, const S *offsets, int64_t n0, int64_t n1,
             int64_t N, float *y) {
    const int64_t full = K / CHUNK, chunks = (K + CHUNK - 1) / CHUNK, groups = K / BLOCK;
    for (int64_t n = n0; n < n1; n++) {
        const uint8_t *row = codes + n * (K / 2);
        const S *sc = scales + n * groups;
        Lanes lanes[ROWS];
        int64_t c = 0;
#if LOWBIT_VNNI
        __m512 acc[ROWS];
        for (int r = 0; r < ROWS; r++) acc[r] = _mm512_setzero_ps();
        const __m256i low = _mm256_set1_epi8(15);
        const __m512i order = _mm512_set_epi64(11, 10, 3, 2, 9, 8, 1, 0);
        for (; c < full; c++) {
            _mm_prefetch((const char *)(row + PREFETCH_ROWS * (K / 2) + c * 32), _MM_HINT_T0);
            const __m256i raw = _mm256_loadu_si256((const __m256i *)(row + c * 32));
            const __m256i lo = _mm256_and_si256(raw, low), hi = _mm256_and_si256(_mm256_srli_epi16(raw, 4), low);
            const __m512i w = _mm512_permutex2var_epi64(_mm512_castsi256_si512(lo), order, _mm512_castsi256_si512(hi));
            const __m512 ws = chunk_scales<S, 2>(sc + 2 * c);
            for (int r = 0; r < ROWS; r++) {
                const __m512i dot = _mm512_dpbusd_epi32(_mm512_setzero_si512(), w, _mm512_loadu_si512(rows[r].q + c * CHUNK));
                acc[r] = accumulate_chunk(acc[r], dot, ws, rows[r], c);
            }
        }
        if (c == chunks) {  // no tail chunk: reduce in registers
            for (int r = 0; r < ROWS; r++)
                y[r * N + n] = tree_sum_vnni(add_offsets_vnni(acc[r], offsets + n * groups, rows[r], K));
            continue;
        }
        for (int r = 0; r < ROWS; r++) _mm512_store_ps(lanes[r].v, acc[r]);
#elif LOWBIT_AVX2
        Halves acc[ROWS];
        for (int r = 0; r < ROWS; r++) acc[r] = {_mm256_setzero_ps(), _mm256_setzero_ps()};
        const __m256i low = _mm256_set1_epi8(15);
        for (; c < full; c++) {
            _mm_prefetch((const char *)(row + PREFETCH_ROWS * (K / 2) + c * 32), _MM_HINT_T0);
            const __m256i raw = _mm256_loadu_si256((const __m256i *)(row + c * 32));
            const __m256i lo = _mm256_and_si256(raw, low), hi = _mm256_and_si256(_mm256_srli_epi16(raw, 4), low);
            // the chunk's first block (its 16 low then 16 high nibbles), then its second
            const __m256i w0 = _mm256_permute2x128_si256(lo, hi, 0x20), w1 = _mm256_permute2x128_si256(lo, hi, 0x31);
            const Halves ws = chunk_scales_avx2<S, 2>(sc + 2 * c);
            for (int r = 0; r < ROWS; r++) {
                const int8_t *xq = rows[r].q + c * CHUNK;
                acc[r] = accumulate_halves(acc[r], dot4(w0, _mm256_loadu_si256((const __m256i *)xq)),
                                           dot4(w1, _mm256_loadu_si256((const __m256i *)(xq + 32))), ws, rows[r], c);
            }
        }
        if (c == chunks) {
            for (int r = 0; r < ROWS; r++)
                y[r * N + n] = tree_sum_halves(add_offsets_halves(acc[r], offsets + n * groups, rows[r], K));
            continue;
        }
        for (int r = 0; r < ROWS; r++) store_halves(lanes[r], acc[r]);
#else
        for (int r = 0; r < ROWS; r++) lanes[r] = Lanes{};
#endif
        for (; c < chunks; c++)
            for (int r = 0; r < ROWS; r++) chunk_portable<S, BLOCK>(lanes[r], row, sc, rows[r], c, K, q4_code);
        for (int r = 0; r < ROWS; r++) {
            add_offsets(lanes[r], offsets + n * groups, rows[r], K);
            y[r * N + n] = tree_sum(lanes[r]);
        }
    }
}

template <typename S, int G, int ROWS>
void q8_pass(const Row *rows, int64_t K, const int8_t *codes, const S *scales, int64_t n0, int64_t n1, int64_t N,
             float *y) {
    const int64_t full = K / CHUNK, chunks = (K + CHUNK - 1) / CHUNK;
    for (int64_t n = n0; n < n1; n++) {
        const int8_t *row = codes + n * K;
        const S *sc = scales + n * (K / G);
        Lanes lanes[ROWS];
        int64_t c = 0;
#if LOWBIT_VNNI
        __m512 acc[ROWS];
        for (int r = 0; r < ROWS; r++) acc[r] = _mm512_setzero_ps();
        for (; c < full; c++) {
            _mm_prefetch((const char *)(row + PREFETCH_ROWS * K + c * CHUNK), _MM_HINT_T0);
            const __m512i w = _mm512_loadu_si512(row + c * CHUNK);
            const __m512i magnitude = _mm512_abs_epi8(w);  // u8 x s8: the weight's sign moves onto the activation
            const __mmask64 negative = _mm512_movepi8_mask(w);
            const __m512 ws = chunk_scales<S, CHUNK / G>(sc + c * (CHUNK / G));
            for (int r = 0; r < ROWS; r++) {
                const __m512i xq = _mm512_loadu_si512(rows[r].q + c * CHUNK);
                const __m512i signed_x = _mm512_mask_sub_epi8(xq, negative, _mm512_setzero_si512(), xq);
                const __m512i dot = _mm512_dpbusd_epi32(_mm512_setzero_si512(), magnitude, signed_x);
                acc[r] = accumulate_chunk(acc[r], dot, ws, rows[r], c);
            }
        }
        if (c == chunks) {
            for (int r = 0; r < ROWS; r++) y[r * N + n] = tree_sum_vnni(acc[r]);
            continue;
        }
        for (int r = 0; r < ROWS; r++) _mm512_store_ps(lanes[r].v, acc[r]);
#elif LOWBIT_AVX2
        Halves acc[ROWS];
        for (int r = 0; r < ROWS; r++) acc[r] = {_mm256_setzero_ps(), _mm256_setzero_ps()};
        for (; c < full; c++) {
            _mm_prefetch((const char *)(row + PREFETCH_ROWS * K + c * CHUNK), _MM_HINT_T0);
            const __m256i w0 = _mm256_loadu_si256((const __m256i *)(row + c * CHUNK));
            const __m256i w1 = _mm256_loadu_si256((const __m256i *)(row + c * CHUNK + 32));
            const __m256i magnitude0 = _mm256_abs_epi8(w0), magnitude1 = _mm256_abs_epi8(w1);
            const Halves ws = chunk_scales_avx2<S, CHUNK / G>(sc + c * (CHUNK / G));
            for (int r = 0; r < ROWS; r++) {  // u8 x s8: the weight's sign moves onto the activation
                const int8_t *xq = rows[r].q + c * CHUNK;
                const __m256i x0 = _mm256_sign_epi8(_mm256_loadu_si256((const __m256i *)xq), w0);
                const __m256i x1 = _mm256_sign_epi8(_mm256_loadu_si256((const __m256i *)(xq + 32)), w1);
                acc[r] = accumulate_halves(acc[r], dot4(magnitude0, x0), dot4(magnitude1, x1), ws, rows[r], c);
            }
        }
        if (c == chunks) {
            for (int r = 0; r < ROWS; r++) y[r * N + n] = tree_sum_halves(acc[r]);
            continue;
        }
        for (int r = 0; r < ROWS; r++) store_halves(lanes[r], acc[r]);
#else
        for (int r = 0; r < ROWS; r++) lanes[r] = Lanes{};
#endif
        for (; c < chunks; c++)
            for (int r = 0; r < ROWS; r++) chunk_portable<S, G>(lanes[r], row, sc, rows[r], c, K, q8_code);
        for (int r = 0; r < ROWS; r++) y[r * N + n] = tree_sum(lanes[r]);
    }
}

// Rows in passes of up to PASS_ROWS (the weight chunk is decoded once per pass). Output rows are split across threads in
// contiguous static chunks, and each thread walks its chunk in blocks of 32 outputs, running every pass over a
// block before the next: a block's weights (at most tens of KB) stay in cache however many rows the call has,
// so a prompt of hundreds of tokens costs one read of the weight.
// Rows per pass: 8 where 32 vector registers hold their accumulators (AVX-512), 4 on AVX2's 16 (8 rows' 16
// accumulators would spill). A row's numbers do not depend on the pass it is in.
constexpr int64_t PASS_ROWS = LOWBIT_AVX2 ? 4 : 8;

template <typename Pass>
void over_rows(const Quantized &xq, int64_t M, int64_t N, int num_threads, Pass pass) {
    constexpr int64_t OUTPUT_BLOCK = 32;
    std::vector<Row> rows(M);
    for (int64_t m = 0; m < M; m++) rows[m] = xq.row(m);
#pragma omp parallel for num_threads(num_threads) schedule(static)
    for (int t = 0; t < num_threads; t++) {
        const int64_t n0 = N * t / num_threads, n1 = N * (t + 1) / num_threads;
        for (int64_t b0 = n0; b0 < n1; b0 += OUTPUT_BLOCK) {
            const int64_t b1 = b0 + OUTPUT_BLOCK < n1 ? b0 + OUTPUT_BLOCK : n1;
            for (int64_t m0 = 0; m0 < M; m0 += PASS_ROWS) {
                const Row *r = rows.data() + m0;
                switch (M - m0 < PASS_ROWS ? M - m0 : PASS_ROWS) {
                    case 1: pass.template operator()<1>(r, m0, b0, b1); break;
                    case 2: pass.template operator()<2>(r, m0, b0, b1); break;
                    case 3: pass.template operator()<3>(r, m0, b0, b1); break;
                    case 4: pass.template operator()<4>(r, m0, b0, b1); break;
                    case 5: pass.template operator()<5>(r, m0, b0, b1); break;
                    case 6: pass.template operator()<6>(r, m0, b0, b1); break;
                    case 7: pass.template operator()<7>(r, m0, b0, b1); break;
                    default: pass.template operator()<8>(r, m0, b0, b1); break;
                }
            }
        }
    }
}

template <typename S>
void q4_matmul(const float *x, int64_t M, int64_t K, const uint8_t *codes, const S *scales, const S *offsets, int64_t N,
               float *y, int num_threads) {
    const Quantized xq(x, M, K);
    over_rows(xq, M, N, num_threads, [&]<int ROWS>(const Row *rows, int64_t m0, int64_t n0, int64_t n1) {
        q4_pass<S, ROWS>(rows, K, codes, scales, offsets, n0, n1, N, y + m0 * N);
    });
}

template <typename S, int G>
void q8_matmul(const float *x, int64_t M, int64_t K, const int8_t *codes, const S *scales, int64_t N, float *y,
               int num_threads) {
    const Quantized xq(x, M, K);
    over_rows(xq, M, N, num_threads, [&]<int ROWS>(const Row *rows, int64_t m0, int64_t n0, int64_t n1) {
        q8_pass<S, G, ROWS>(rows, K, codes, scales, n0, n1, N, y + m0 * N);
    });
}

}  // namespace

// The C entry points (ctypes): q4 with fp16 or fp32 scales and offsets; q8 with groups of 16 or 32.
extern "C" {
int lowbit_has_vnni() { return LOWBIT_VNNI; }
int lowbit_has_avx2() { return LOWBIT_AVX2; }
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
void lowbit_q8g16_f16(const float *x, int64_t M, int64_t K, const int8_t *codes, const _Float16 *scales, int64_t N,
                      float *y, int num_threads) {
    q8_matmul<_Float16, 16>(x, M, K, codes, scales, N, y, num_threads);
}
}
