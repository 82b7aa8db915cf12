// The whole forward of a float32 or bfloat16 Llama-family model over a few rows (decode steps, verify chains and
// trees, a batch of sessions' rounds) in ONE call: no Python and no ATen dispatch per layer. Torch's
// eager forward issues ~30 operators per layer (~900 per decode step of a 30-layer model), each a few
// microseconds of Python and dispatch, and its matmul for one row is oneDNN's; here a step is the
// weights streamed once by hand-written dot products plus a few barriers.
//
// Every row is computed the same way whatever else is in the call: its norms, its dot products (per output
// j: one accumulator lane over the input in order, fused multiply-adds; see gemv), its rope, its
// attention (keys visited in key order, fixed-order sums) and its activation. The rows' results are
// equal bit for bit to those of the same row alone, so a verify forward of k + 1 tokens gives, token for
// token, the logits (and KV) the k + 1 one-token steps would, and speculative decoding equals plain
// decoding exactly; and the thread count does not change any number either (threads split outputs, never
// a sum).
//
// Layout. `model` (int64, built once by fastpath.py): [num_layers, hidden, heads, kv_heads, head_dim,
// intermediate, vocab, embed, final_norm, lm_head, cos, sin] then per layer LAYER_FIELDS pointers
// [input_norm, qkv_w, qkv_b, qk_norm, o_w, o_b, post_norm, gate_up_w, gate_up_b, down_w, down_b, window]
// (a null pointer: no bias / no qk norm; window 0: full attention). The matrices (qkv, o, gate/up, down, lm
// head) come packed in panels of PANEL outputs, [panel][in][PANEL] (see gemv); q/k/v are fused (q outputs,
// then k, then v), and so are gate/up (gate's panels, then up's, each padded to whole panels). The
// embedding is the plain [vocab, hidden] table. The KV cache is [layers, slots,
// kv_heads, head_dim] for K and for V.
// `meta` (int64, per call): [n, num_seqs, max_blocks, block_size, num_logits, tree_width, cache_slots]
// then n token ids, n positions, n new slots, n sequence indices, n first keys of the row's new tokens
// (= the sequence's cached length), n key ends (keys [0, end) of the row's sequence are candidates), n first
// rows (the row of the sequence's first new token), num_logits rows, num_seqs * max_blocks block table
// entries, and, when tree_width > 0, n * tree_width visibility bytes stored as int64 0/1 (row r sees new
// key i of its sequence iff set; without them a row sees the new keys up to itself: a chain).
#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

#include <omp.h>
#ifdef __AVX2__
#include <immintrin.h>
#endif
#include <sched.h>

namespace {

typedef float f32x8 __attribute__((vector_size(32)));
constexpr int64_t LAYER_FIELDS = 12;
constexpr int64_t HEADER = 12;  // model fields before the layers

inline f32x8 load8(const float *p) {
    f32x8 v;
    std::memcpy(&v, p, sizeof(v));
    return v;
}

inline void store8(float *p, f32x8 v) { std::memcpy(p, &v, sizeof(v)); }

// bfloat16 storage (a bfloat16 model's weights, embedding and KV cache): a float's upper 16 bits. Read, it
// widens to float exactly (the bits shifted up); the arithmetic is float32's either way, so a bfloat16
// model here computes with bfloat16 weights and keys but float32 activations.
typedef uint16_t bf16;
typedef uint16_t u16x8 __attribute__((vector_size(16)));
typedef uint32_t u32x8 __attribute__((vector_size(32)));

inline f32x8 load8(const bf16 *p) {
#ifdef __AVX2__  // one widening load and a shift (the generic form below compiles to ~3x the instructions)
    const __m256i bits = _mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)p)), 16);
#else
    u16x8 half;
    std::memcpy(&half, p, sizeof(half));
    const u32x8 bits = __builtin_convertvector(half, u32x8) << 16;
#endif
    f32x8 v;
    std::memcpy(&v, &bits, sizeof(v));
    return v;
}

inline float widen(float x) { return x; }

inline float widen(bf16 x) {
    const uint32_t bits = (uint32_t)x << 16;
    float f;
    std::memcpy(&f, &bits, sizeof(f));
    return f;
}

// float -> bfloat16 as torch rounds it: to nearest, ties to even; a NaN stays a (quiet) NaN
inline bf16 narrow(float f) {
    uint32_t bits;
    std::memcpy(&bits, &f, sizeof(bits));
    if ((bits & 0x7fffffffu) > 0x7f800000u) return (bf16)((bits >> 16) | 0x40);
    return (bf16)((bits + 0x7fffu + ((bits >> 16) & 1u)) >> 16);
}

inline void store_row(float *dst, const float *src, int64_t n) { std::memcpy(dst, src, n * sizeof(float)); }

inline void store_row(bf16 *dst, const float *src, int64_t n) {
    for (int64_t i = 0; i < n; i++) dst[i] = narrow(src[i]);
}

// x in every lane. (Not `f32x8{} + x`: adding the zero vector cannot be folded away, since -0 + +0 is +0,
// so that form costs a scalar add and a register broadcast per use where this is one broadcast load.)
inline f32x8 splat(float x) { return f32x8{x, x, x, x, x, x, x, x}; }

inline float tree_sum(f32x8 v) {
    float t[8];
    std::memcpy(t, &v, sizeof(t));
    for (int width = 4; width >= 1; width /= 2)
        for (int i = 0; i < width; i++) t[i] = t[i] + t[i + width];
    return t[0];
}

// Y[m, j] (=, or += with accumulate) x_m . W_j (+ b_j) for m < M, j in [j0, j1), j0 a multiple of PANEL.
// W comes packed in panels of PANEL outputs, [panel][k][PANEL] (fastpath.py pads the last panel with zeros),
// so for each k one panel's weights are contiguous vectors (two of 8 lanes, or one of 16 with AVX-512), and
// one input value, broadcast, meets them in fused multiply-adds: output j of row m is one accumulator lane,
// over k = 0, 1, ..., K - 1 in order, then + b_j. That sum does not depend on M, on which rows share a tile,
// on the thread's range or on the vector width, so a row's numbers are the same alone or in any batch, and
// on any build: `maddV` is a fused multiply-add, rounded once, with AVX-512, with AVX2 + FMA and (libm's fma,
// lane by lane) without either. It is spelled out because the library is built with -ffp-contract=off, where
// `acc += x * w` compiled to a multiply and an add: twice the FMA units' work, and a tile of 16 rows ran at
// half their rate (one Xeon, 2 cores, the default model's forward of M new tokens: M = 16 38 -> 32 ms,
// 17 49 -> 39, 32 78 -> 57; a prefill of 64 tokens 97 ms on oneDNN, 72 here).
// Tiles of R rows x P panels keep the FMA units busy: one row takes 4 panels at once; more
// rows go in tiles of up to TILE_ROWS against one panel: 6 with 8-lane vectors (12 accumulators of the 16
// registers), 16 with AVX-512 (16 of 32), where up to 12 rows take two panels at once (fused, a tile of 8
// rows against one panel waited on memory: 8 rows 31 ms against 27 multiplying and adding apart; two
// panels, 27). A tile streams its panel once for all its rows, so 16 sessions'
// decode steps read each weight from memory once, in one pass that multiplies as it streams (in tiles of
// 6, the first tile's pass waited on memory and the two after it re-read the panel from cache). Beyond
// TILE_ROWS rows (a prefill), tiles of WIDE_ROWS x WIDE_PANELS.
constexpr int64_t PANEL = 16;
constexpr int64_t AHEAD_BYTES = 2048;  // how far along a panel `tile` asks for its weights ahead of use
#ifdef __AVX512F__
typedef float f32xV __attribute__((vector_size(64)));
constexpr int TILE_ROWS = 16;  // up to 16 rows: one pass, one panel (16 accumulators)
constexpr int WIDE_ROWS = 8, WIDE_PANELS = 2;  // more rows (a prefill): 8 x 2 (16 accumulators, fewer broadcasts per
// multiply-add: measured on a Xeon, 16 prompts' prefill 1.51 s against 1.76-1.85 in tiles of 16 x 1, whose single
// pass wins where the rows are few: 16 decode steps 40 ms against 47)
inline f32xV loadV(const float *p) { return _mm512_loadu_ps(p); }
inline f32xV loadV(const bf16 *p) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)p)), 16));
}
inline f32xV splatV(float x) { return _mm512_set1_ps(x); }
inline f32xV maddV(f32xV acc, f32xV x, f32xV w) { return _mm512_fmadd_ps(x, w, acc); }
#else
typedef f32x8 f32xV;
constexpr int TILE_ROWS = 6;
constexpr int WIDE_ROWS = 6, WIDE_PANELS = 1;
inline f32xV loadV(const float *p) { return load8(p); }
inline f32xV loadV(const bf16 *p) { return load8(p); }
inline f32xV splatV(float x) { return splat(x); }
#ifdef __FMA__
inline f32xV maddV(f32xV acc, f32xV x, f32xV w) { return _mm256_fmadd_ps(x, w, acc); }
#else  // no FMA instructions (the portable build): libm's fma lane by lane, the same numbers, slowly
inline f32xV maddV(f32xV acc, f32xV x, f32xV w) {
    for (int i = 0; i < 8; i++) acc[i] = std::fma(x[i], w[i], acc[i]);
    return acc;
}
#endif
#endif
constexpr int64_t LANES = sizeof(f32xV) / sizeof(float);
constexpr int64_t SUB = PANEL / LANES;  // vectors per panel row

template <int R, int P, typename W>
inline void tile(const float *X, int64_t K, const W *wp, const float *bias, int64_t j, int64_t j1, float *Y,
                 int64_t ldy, bool accumulate) {
    f32xV acc[R][P][SUB] = {};
    constexpr int64_t LINE_K = 64 / (PANEL * sizeof(W)), AHEAD_K = AHEAD_BYTES / (PANEL * sizeof(W));  // in k
    for (int64_t k = 0; k < K; k++) {
        // a tile of several rows computes long enough per weight line that the next panel's line, asked
        // for now, arrives before it is needed (measured: 4 rows from memory ~25% faster)
        if constexpr (R > 2) __builtin_prefetch(wp + (P * K + k) * PANEL);
        // and each panel's own line AHEAD_BYTES on: the hardware prefetcher alone kept too few lines in
        // flight (measured on a 2-core Xeon, forward of M new tokens, 2 threads: bf16 M = 1 11.6 -> 10.1 ms,
        // fp32 M = 2 21.8 -> 19.4, M = 9 29.7 -> 24.4, M = 32 60.7 -> 53.5; 1 KB or 4 KB ahead: the same or
        // slower). Asked once per cache line, and only within the panel.
        if (k % LINE_K == 0 && k + AHEAD_K < K)
            for (int p = 0; p < P; p++) __builtin_prefetch(wp + (p * K + k + AHEAD_K) * PANEL);
        f32xV w[P][SUB];
        for (int p = 0; p < P; p++)
            for (int s = 0; s < SUB; s++) w[p][s] = loadV(wp + (p * K + k) * PANEL + s * LANES);
        for (int r = 0; r < R; r++) {
            const f32xV xr = splatV(X[r * K + k]);
            for (int p = 0; p < P; p++)
                for (int s = 0; s < SUB; s++) acc[r][p][s] = maddV(acc[r][p][s], xr, w[p][s]);
        }
    }
    for (int r = 0; r < R; r++)
        for (int p = 0; p < P; p++) {
            float sums[PANEL];
            std::memcpy(sums, acc[r][p], sizeof(sums));
            float *y = Y + r * ldy;
            for (int64_t i = 0; i < PANEL && j + p * PANEL + i < j1; i++) {
                const int64_t out = j + p * PANEL + i;
                const float v = bias ? sums[i] + bias[out] : sums[i];
                y[out] = accumulate ? y[out] + v : v;
            }
        }
}

// `rows` (1..R) rows against P panels: tile<rows, P>.
template <int R, int P, typename W>
inline void rows_by_panel(int64_t rows, const float *X, int64_t K, const W *wp, const float *bias, int64_t j,
                          int64_t j1, float *Y, int64_t ldy, bool accumulate) {
    if constexpr (R > 1) {
        if (rows < R) return rows_by_panel<R - 1, P>(rows, X, K, wp, bias, j, j1, Y, ldy, accumulate);
    }
    tile<R, P>(X, K, wp, bias, j, j1, Y, ldy, accumulate);
}

// Outputs [j, j1) for the M rows, P panels at a time (then one), the rows in as few tiles of up to R as
// possible, of sizes within one of each other (a tile of few rows leaves the FMA units idle part of the
// time): with R = 6, 16 rows are 6, 5, 5.
template <int R, int P, typename W>
inline void tiles(const float *X, int64_t M, int64_t K, const W *Wp, const float *bias, int64_t j, int64_t j1,
                  float *Y, int64_t ldy, bool accumulate) {
    const int64_t panel_values = K * PANEL;
    const int64_t num_tiles = (M + R - 1) / R, base = M / num_tiles, num_larger = M % num_tiles;
    for (bool whole; j < j1; j += (whole ? P : 1) * PANEL) {
        const W *wp = Wp + (j / PANEL) * panel_values;
        whole = j + P * PANEL <= j1;  // P panels left, else one at a time
        for (int64_t t = 0, m = 0; t < num_tiles; t++) {
            const int64_t rows = base + (t < num_larger);
            if (whole) {
                rows_by_panel<R, P>(rows, X + m * K, K, wp, bias, j, j1, Y + m * ldy, ldy, accumulate);
            } else {
                rows_by_panel<R, 1>(rows, X + m * K, K, wp, bias, j, j1, Y + m * ldy, ldy, accumulate);
            }
            m += rows;
        }
    }
}

template <typename W>
void gemv(const float *X, int64_t M, int64_t K, const W *Wp, const float *bias, int64_t j0, int64_t j1,
          float *Y, int64_t ldy, bool accumulate) {
    if (M <= 0) return;  // (a prefill that asks for no logits)
    int64_t j = j0;
    const int64_t panel_values = K * PANEL;
    if (M <= 2) {  // few rows: several panels at once, so enough accumulators are in flight
        for (; j + 4 * PANEL <= j1; j += 4 * PANEL) {
            const W *wp = Wp + (j / PANEL) * panel_values;
            __builtin_prefetch(wp + 4 * panel_values);
            if (M == 2) {
                tile<2, 2>(X, K, wp, bias, j, j1, Y, ldy, accumulate);
                tile<2, 2>(X, K, wp + 2 * panel_values, bias, j + 2 * PANEL, j1, Y, ldy, accumulate);
            } else {
                tile<1, 4>(X, K, wp, bias, j, j1, Y, ldy, accumulate);
            }
        }
    }
#ifdef __AVX512F__
    if (M <= 12) {  // (16 or 24 accumulators of the 32 registers)
        if (M <= 8) {
            tiles<8, 2>(X, M, K, Wp, bias, j, j1, Y, ldy, accumulate);
        } else {
            tiles<12, 2>(X, M, K, Wp, bias, j, j1, Y, ldy, accumulate);
        }
        return;
    }
#endif
    if (M <= TILE_ROWS) {
        tiles<TILE_ROWS, 1>(X, M, K, Wp, bias, j, j1, Y, ldy, accumulate);
    } else {
        tiles<WIDE_ROWS, WIDE_PANELS>(X, M, K, Wp, bias, j, j1, Y, ldy, accumulate);
    }
}

// o[0, 8C) = sum over j < count, in j's order, of p[j] * v[slots[j] * stride + (0, 8C)], then / total: C vectors
// of a value row at a time, so each row is read once for all of them (C = 8: 64 values, in registers).
template <int C, typename V>
inline void weighted_values(const float *p, const int64_t *slots, int64_t count, const V *v, int64_t stride,
                            float total, float *o) {
    f32x8 acc[C] = {};
    for (int64_t j = 0; j < count; j++) {
        const f32x8 pj = splat(p[j]);
        const V *row = v + slots[j] * stride;
        for (int c = 0; c < C; c++) acc[c] += pj * load8(row + 8 * c);
    }
    for (int c = 0; c < C; c++) store8(o + 8 * c, acc[c] / splat(total));
}

// RMSNorm as transformers computes it in float32: w * (x * 1/sqrt(mean(x^2) + eps)).
void rms_norm(const float *x, const float *w, int64_t n, float eps, float *out) {
    f32x8 acc{};
    for (int64_t i = 0; i < n; i += 8) {
        const f32x8 v = load8(x + i);
        acc += v * v;
    }
    const float r = 1.0f / std::sqrt(tree_sum(acc) / (float)n + eps);
    for (int64_t i = 0; i < n; i++) out[i] = w[i] * (x[i] * r);
}

// exp(x) for any float (the lowbit attention's method, kept to inputs <= 88): x = n ln2 + r, e^r by its Taylor
// series to r^7, times 2^n; 0 below -87, +inf handled by the clamp to 88 (e^88 ~ 1.65e38, finite).
inline float exp_approx(float x) {
    const float clamped = x < -87.0f ? -87.0f : (x > 88.0f ? 88.0f : x);
    const float n = std::nearbyint(clamped * 1.44269504088896341f);
    float r = std::fma(n, -0.693145751953125f, clamped);
    r = std::fma(n, -1.428606765330187e-06f, r);
    float p = 1.0f / 5040.0f;
    p = std::fma(p, r, 1.0f / 720.0f);
    p = std::fma(p, r, 1.0f / 120.0f);
    p = std::fma(p, r, 1.0f / 24.0f);
    p = std::fma(p, r, 1.0f / 6.0f);
    p = std::fma(p, r, 0.5f);
    p = std::fma(p, r, 1.0f);
    p = std::fma(p, r, 1.0f);
    const int32_t bits = ((int32_t)n + 127) << 23;
    float two_n;
    std::memcpy(&two_n, &bits, sizeof(two_n));
    return x < -87.0f ? 0.0f : p * two_n;
}

// x [.., D] at position `pos`: rotate-half rope, x * cos + rotate(x) * sin, rotate(x) = (-x2, x1).
void rope(float *x, const float *cos, const float *sin, int64_t D) {
    const int64_t half = D / 2;
    for (int64_t i = 0; i < half; i++) {
        const float a = x[i], b = x[i + half];
        x[i] = a * cos[i] - b * sin[i];
        x[i + half] = b * cos[i + half] + a * sin[i + half];
    }
}

// The threads' meeting point between phases. Waiting threads spin briefly, then yield their core
// (sched_yield) instead of sleeping on a futex as OpenMP's barrier does after its spin: on an idle
// machine the sibling arrives within microseconds either way, and on a machine with more runnable
// threads than cores a yielding waiter hands its core to whoever the barrier waits for rather than
// burning it (measured under load: OpenMP's barrier made 2 threads ~7x slower than 1).
struct Barrier {
    std::atomic<int64_t> arrived{0};
    std::atomic<int64_t> generation{0};
    int64_t total = 1;

    void wait() {
        if (total == 1) return;
        const int64_t gen = generation.load(std::memory_order_acquire);
        if (arrived.fetch_add(1, std::memory_order_acq_rel) == total - 1) {
            arrived.store(0, std::memory_order_relaxed);
            generation.store(gen + 1, std::memory_order_release);
            return;
        }
        for (int spins = 0; generation.load(std::memory_order_acquire) == gen; spins++) {
            if (spins < 256) {
#if defined(__x86_64__) || defined(__i386__)
                __builtin_ia32_pause();
#endif
            } else {
                sched_yield();
            }
        }
    }
};

struct Range {
    int64_t lo, hi;
};

// [0, n) cut into `parts` pieces, each a multiple of `align` long (the last takes the rest).
inline Range split(int64_t n, int64_t parts, int64_t part, int64_t align) {
    const int64_t units = n / align;
    const int64_t lo = units * part / parts * align;
    const int64_t hi = part + 1 == parts ? n : units * (part + 1) / parts * align;
    return {lo, hi};
}

}  // namespace

// W: the storage of the matrices, the embedding and the KV cache (float, or bf16 for a bfloat16 model);
// norms, biases and the rope tables are float either way.
template <typename W>
void forward(const int64_t *model, float eps, float scale, W *k_cache, W *v_cache, const int64_t *meta, float *logits,
             int num_threads) {
    const int64_t L = model[0], hidden = model[1], H = model[2], KVH = model[3], D = model[4], inter = model[5],
                  vocab = model[6];
    const W *embed = (const W *)model[7], *lm_head = (const W *)model[9];
    const float *final_norm = (const float *)model[8], *cos_table = (const float *)model[10],
                *sin_table = (const float *)model[11];
    const int64_t n = meta[0], num_seqs = meta[1], max_blocks = meta[2], block_size = meta[3], num_logits = meta[4],
                  tree_width = meta[5], cache_slots = meta[6];
    const int64_t *token_ids = meta + 7, *positions = token_ids + n, *new_slots = positions + n,
                  *row_seq = new_slots + n, *row_start = row_seq + n, *row_end = row_start + n,
                  *row_first = row_end + n, *logits_rows = row_first + n, *tables = logits_rows + num_logits,
                  *tree = tables + num_seqs * max_blocks;
    (void)num_seqs;
    const int64_t qkv_dim = (H + 2 * KVH) * D, group = H / KVH, layer_stride = cache_slots * KVH * D;
    int64_t max_keys = 1;
    for (int64_t r = 0; r < n; r++) max_keys = std::max(max_keys, row_end[r]);

    std::vector<float> x(n * hidden), qkv(n * qkv_dim), att(n * H * D), gu(n * 2 * inter), act(n * inter);
    for (int64_t r = 0; r < n; r++)
        for (int64_t i = 0; i < hidden; i++) x[r * hidden + i] = widen(embed[token_ids[r] * hidden + i]);

    Barrier barrier;
#pragma omp parallel num_threads(num_threads)
    {
        const int64_t T = omp_get_num_threads(), t = omp_get_thread_num();
#pragma omp single
        barrier.total = T;  // (the single's own barrier publishes it)
        std::vector<float> h(n * hidden), scores(group * max_keys);
        std::vector<int64_t> slots(max_keys);
        for (int64_t l = 0; l < L; l++) {
            const int64_t *p = model + HEADER + l * LAYER_FIELDS;
            const float *input_norm = (const float *)p[0], *qkv_b = (const float *)p[2], *qk_norm = (const float *)p[3],
                        *o_b = (const float *)p[5], *post_norm = (const float *)p[6], *gu_b = (const float *)p[8],
                        *down_b = (const float *)p[10];
            const W *qkv_w = (const W *)p[1], *o_w = (const W *)p[4], *gu_w = (const W *)p[7], *down_w = (const W *)p[9];
            const int64_t window = p[11];
            W *layer_k = k_cache + l * layer_stride, *layer_v = v_cache + l * layer_stride;

            // q/k/v of every row (each thread norms every row itself: cheaper than a barrier)
            for (int64_t r = 0; r < n; r++) rms_norm(&x[r * hidden], input_norm, hidden, eps, &h[r * hidden]);
            Range part = split(qkv_dim, T, t, PANEL);
            gemv(h.data(), n, hidden, qkv_w, qkv_b, part.lo, part.hi, qkv.data(), qkv_dim, false);
            barrier.wait();
            // qk norm, rope, and the new keys and values into the cache: one task per (row, q or k head)
            const int64_t rope_heads = H + KVH;
            Range tasks = split(n * rope_heads, T, t, 1);
            for (int64_t task = tasks.lo; task < tasks.hi; task++) {
                const int64_t r = task / rope_heads, head = task % rope_heads;
                float *v = &qkv[r * qkv_dim + head * D];
                if (qk_norm) rms_norm(v, qk_norm + head * D, D, eps, v);
                rope(v, cos_table + positions[r] * D, sin_table + positions[r] * D, D);
                if (head >= H) {
                    const int64_t g = head - H;
                    store_row(layer_k + (new_slots[r] * KVH + g) * D, v, D);
                    store_row(layer_v + (new_slots[r] * KVH + g) * D, &qkv[r * qkv_dim + (H + KVH + g) * D], D);
                }
            }
            barrier.wait();
            // attention: one task per (row, kv head), its query heads together, keys in key order
            tasks = split(n * KVH, T, t, 1);
            for (int64_t task = tasks.lo; task < tasks.hi; task++) {
                const int64_t r = task / KVH, g = task % KVH, b = row_seq[r], start = row_start[r];
                const int64_t *table = tables + b * max_blocks;
                const int64_t own = r - row_first[r];  // this row's index among its sequence's new tokens
                const int64_t q_pos = positions[r];
                int64_t count = 0;
                for (int64_t j = 0; j < row_end[r]; j++) {
                    if (j >= start) {
                        const int64_t i = j - start;
                        if (tree_width ? !tree[r * tree_width + i] : i > own) continue;
                    }
                    if (window) {
                        const int64_t k_pos = j < start ? j : positions[row_first[r] + j - start];
                        if (q_pos - k_pos >= window) continue;
                    }
                    slots[count++] = table[j / block_size] * block_size + j % block_size;
                }
                // scores of the group's query heads, each key read once for all of them; per (head, key) the
                // dot product is 8-lane partial sums then a fixed tree, in the same order for every row
                for (int64_t j = 0; j < count; j++) {
                    const W *key = layer_k + (slots[j] * KVH + g) * D;
                    for (int64_t hh = 0; hh < group; hh++) {
                        const float *q = &qkv[r * qkv_dim + (g * group + hh) * D];
                        f32x8 acc{};
                        for (int64_t i = 0; i < D; i += 8) acc += load8(q + i) * load8(key + i);
                        scores[hh * max_keys + j] = tree_sum(acc) * scale;
                    }
                }
                for (int64_t hh = 0; hh < group; hh++) {
                    float *s = &scores[hh * max_keys];
                    float best = -std::numeric_limits<float>::infinity();
                    for (int64_t j = 0; j < count; j++) best = s[j] > best ? s[j] : best;
                    float total = 0.0f;
                    for (int64_t j = 0; j < count; j++) {
                        s[j] = exp_approx(s[j] - best);
                        total += s[j];
                    }
                    // each output value: its keys' p_j v_j summed in key order; the keys outside, 64 values of a
                    // value row at a time inside, so a row of V is read once per head rather than once per 8
                    float *o = &att[r * H * D + (g * group + hh) * D];
                    const W *v = layer_v + g * D;
                    int64_t i = 0;
                    for (; i + 64 <= D; i += 64) weighted_values<8>(s, slots.data(), count, v, KVH * D, total, o + i);
                    for (; i < D; i += 8) weighted_values<1>(s, slots.data(), count, v + i, KVH * D, total, o + i);
                }
            }
            barrier.wait();
            part = split(hidden, T, t, PANEL);
            gemv(att.data(), n, H * D, o_w, o_b, part.lo, part.hi, x.data(), hidden, true);
            barrier.wait();
            for (int64_t r = 0; r < n; r++) rms_norm(&x[r * hidden], post_norm, hidden, eps, &h[r * hidden]);
            part = split(inter, T, t, PANEL);  // gate rows j and up rows inter + j together: silu(gate) * up here
            gemv(h.data(), n, hidden, gu_w, gu_b, part.lo, part.hi, gu.data(), 2 * inter, false);
            gemv(h.data(), n, hidden, gu_w + (inter + PANEL - 1) / PANEL * PANEL * hidden, gu_b ? gu_b + inter : nullptr,
                 part.lo, part.hi, gu.data() + inter, 2 * inter, false);  // (up's panels follow gate's, padded)
            for (int64_t r = 0; r < n; r++)
                for (int64_t j = part.lo; j < part.hi; j++) {
                    const float g = gu[r * 2 * inter + j];
                    act[r * inter + j] = g / (1.0f + exp_approx(-g)) * gu[r * 2 * inter + inter + j];
                }
            barrier.wait();
            part = split(hidden, T, t, PANEL);
            gemv(act.data(), n, inter, down_w, down_b, part.lo, part.hi, x.data(), hidden, true);
            barrier.wait();
        }
        for (int64_t i = 0; i < num_logits; i++)
            rms_norm(&x[logits_rows[i] * hidden], final_norm, hidden, eps, &h[i * hidden]);
        const Range part = split(vocab, T, t, PANEL);
        gemv(h.data(), num_logits, hidden, lm_head, nullptr, part.lo, part.hi, logits, vocab, false);
    }
}

extern "C" int64_t fastpath_layer_fields() { return LAYER_FIELDS; }

extern "C" void fastpath_forward(const int64_t *model, float eps, float scale, float *k_cache, float *v_cache,
                                 const int64_t *meta, float *logits, int num_threads) {
    forward<float>(model, eps, scale, k_cache, v_cache, meta, logits, num_threads);
}

extern "C" void fastpath_forward_bf16(const int64_t *model, float eps, float scale, bf16 *k_cache, bf16 *v_cache,
                                      const int64_t *meta, float *logits, int num_threads) {
    forward<bf16>(model, eps, scale, k_cache, v_cache, meta, logits, num_threads);
}
