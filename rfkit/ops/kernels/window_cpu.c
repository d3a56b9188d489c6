/* The decode step of the window mixers (rfkit.models.window / rfkit.models.hybrid) on the CPU.
 *
 * One call does what WindowAttention.step_qkv does in about 35 small PyTorch ops: rotate the
 * token's query and key when given them unrotated (a layer without kept heads), write the new
 * key and value into their slot of the sink + ring buffer, fold the key the token evicts from the
 * ring into the linear-attention state (hybrid), attend over the buffer, add the state's
 * contribution under the same normaliser, and count the token. The PyTorch step is its twin and
 * the tests compare the two. Inference only, every array contiguous. rf_window_step_f32 takes
 * float32 throughout; rf_window_step_bf16 takes a bf16 model's: q, k, v, the window (keys, values)
 * and out as bf16 words, the sums and the weights float32 (rfkit.models.precision). Both are one
 * body (window_step): bf16 is loaded exactly, every sum is float32, only the output is rounded.
 *
 *   q        : (batch, hq, hd)       queries of the replaced heads (unscaled), rotated unless cos
 *                                    and sin are given
 *   k, v     : (batch, hkv, hd)      the new token's key (rotated unless cos and sin are given)
 *                                    and value
 *   cos, sin : (batch, hd)           NULL, or the token's rotary cos / sin in the activations'
 *                                    dtype: q and k are then rotated here as RoPE does (x cos +
 *                                    rotate_half(x) sin), each result rounded to that dtype as a
 *                                    rotated tensor would be
 *   keys     : (batch, hkv, ns, hd)  ns = sink + window: slots 0..sink-1 the first tokens, then a
 *   values                           ring, rank r >= sink in slot sink + r % window (in place)
 *   seen     : (batch,)              real tokens so far (in place: +1)
 *   S_state  : (batch, hkv, f, hd)   hybrid only (NULL for plain window attention), in place
 *   z_state  : (batch, hkv, f)
 *   fmap     : (hkv, hd, f / 2)      feature map: phi(x) = [softmax(x W), softmax(-x W)]
 *   g        : (hq,)                 weight of the old tokens, relu(gate) * exp(log_scale)
 *   decay    : (hkv,)                hybrid with a state decay: gamma per KV head, S and z are
 *                                    multiplied by it once per token (NULL: no decay)
 *   kvq      : (hq,)                 KV head of every query head
 *   out      : (batch, hq, hd)
 *
 * Old tokens enter as y = (A + c a) / (Z + c zl) with c = g exp(-sharpness max(m, -60)), m the
 * window's highest score, A and Z the window's unnormalised sums, a = phi(q) S and zl = phi(q) . z.
 * Returns 0, or -1 when the work buffer cannot be allocated.
 */
#include <float.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "bf16.h"
#include "phi.h"

/* Element i of an array of float32 (bf16 = 0) or bf16 words (bf16 = 1), as float32, and the store
 * back. The kernels below are written once over these and instantiated with bf16 a compile-time
 * constant, so the float32 instance reads and writes plain floats. */
static inline float ld(const void *p, int64_t i, int bf16) {
    return bf16 ? bf16_to_f32(((const rf_bf16 *)p)[i]) : ((const float *)p)[i];
}

static inline void st(void *p, int64_t i, float x, int bf16) {
    if (bf16)
        ((rf_bf16 *)p)[i] = f32_to_bf16(x);
    else
        ((float *)p)[i] = x;
}

/* n elements of p from element i as float32: p itself (float32), or converted into buf (bf16). */
static inline const float *as_f32(const void *p, int64_t i, int64_t n, int bf16, float *buf) {
    if (!bf16) return (const float *)p + i;
    const rf_bf16 *w = (const rf_bf16 *)p + i;
    for (int64_t d = 0; d < n; ++d) buf[d] = bf16_to_f32(w[d]);
    return buf;
}

/* hd elements of p from element i rotated by one row's cos / sin (RoPE's rotate_half form: channel
 * d < hd/2 pairs with d + hd/2 negated, the others with d - hd/2), as float32 in buf, each rounded
 * to the activations' dtype first (bf16: what torch's rotated tensor holds). */
static inline void rotate_into(const void *p, int64_t i, const void *cs, const void *sn, int64_t row, int64_t hd,
                               int bf16, float *buf) {
    const int64_t half = hd / 2;
    for (int64_t d = 0; d < hd; ++d) {
        const float other = d < half ? -ld(p, i + d + half, bf16) : ld(p, i + d - half, bf16);
        const float r = ld(p, i + d, bf16) * ld(cs, row + d, bf16) + other * ld(sn, row + d, bf16);
        buf[d] = bf16 ? bf16_to_f32(f32_to_bf16(r)) : r;
    }
}

/* The decode step over activations and window K/V of one element type (module comment): q, k, v,
 * keys, values and out are float32 (bf16 = 0) or bf16 words (bf16 = 1); the new key and value are
 * copied into their slot as they are, every sum is float32 and the output is rounded once. */
static inline __attribute__((always_inline)) int window_step(
    const void *q, const void *k, const void *v, void *keys, void *values, int64_t *seen, float *S_state,
    float *z_state, const float *fmap, const float *g, const float *decay, const int64_t *kvq, void *out,
    int64_t batch, int64_t hq, int64_t hkv, int64_t hd, int64_t sink, int64_t window, int64_t f, float scaling,
    float sharpness, const void *cos, const void *sin, const int bf16) {
    const int64_t ns = sink + window, half = f / 2;
    const size_t esize = bf16 ? sizeof(rf_bf16) : sizeof(float);
    /* scores, phi, then float32 copies of an evicted key and value, of a query and its output (bf16),
     * and of a rotated new key */
    float *work = (float *)malloc(sizeof(float) * (size_t)(ns + 2 * f + 2 + 5 * hd));
    if (!work) return -1;
    float *p = work, *phi = work + ns, *kf = phi + 2 * f + 2, *vf = kf + hd, *qf = vf + hd, *yf = qf + hd;
    float *kr = yf + hd;
    unsigned char valid[ns > 0 ? ns : 1];
    for (int64_t b = 0; b < batch; ++b) {
        const int64_t n = seen[b];
        const int64_t ring = sink + n % window;
        const int64_t kb = b * hkv * ns * hd; /* this row's keys and values (element offset) */
        if (S_state && decay) { /* the state ages by one token */
            for (int64_t h = 0; h < hkv; ++h) {
                float *S = S_state + (b * hkv + h) * f * hd, *z = z_state + (b * hkv + h) * f;
                const float gm = decay[h];
                for (int64_t j = 0; j < f * hd; ++j) S[j] *= gm;
                for (int64_t j = 0; j < f; ++j) z[j] *= gm;
            }
        }
        if (S_state && n - window >= sink) { /* fold the evicted token (rank n - window) */
            for (int64_t h = 0; h < hkv; ++h) {
                const int64_t o = kb + (h * ns + ring) * hd;
                const float *ko = as_f32(keys, o, hd, bf16, kf), *vo = as_f32(values, o, hd, bf16, vf);
                feature(ko, fmap + h * hd * half, hd, half, phi);
                float *S = S_state + (b * hkv + h) * f * hd, *z = z_state + (b * hkv + h) * f;
                for (int64_t j = 0; j < f; ++j) {
                    z[j] += phi[j];
                    for (int64_t d = 0; d < hd; ++d) S[j * hd + d] += phi[j] * vo[d];
                }
            }
        }
        const int64_t slot = n < sink ? n : ring;
        for (int64_t h = 0; h < hkv; ++h) {
            const int64_t to = kb + (h * ns + slot) * hd, from = (b * hkv + h) * hd;
            if (cos) { /* rotated here: already rounded to the window's dtype, so stored exactly */
                rotate_into(k, from, cos, sin, b * hd, hd, bf16, kr);
                for (int64_t d = 0; d < hd; ++d) st(keys, to + d, kr[d], bf16);
            } else {
                memcpy((char *)keys + to * esize, (const char *)k + from * esize, esize * (size_t)hd);
            }
            memcpy((char *)values + to * esize, (const char *)v + from * esize, esize * (size_t)hd);
        }
        /* slots visible to the new token (rank n): sink slots i <= n, ring ranks >= sink */
        for (int64_t i = 0; i < sink; ++i) valid[i] = i <= n;
        for (int64_t j = 0; j < window; ++j) {
            const int64_t back = ((n - j) % window + window) % window;
            valid[sink + j] = n - back >= sink;
        }
        for (int64_t h = 0; h < hq; ++h) {
            const int64_t kv = kvq[h], kk = kb + kv * ns * hd, oh = (b * hq + h) * hd;
            const float *qh = qf;
            if (cos)
                rotate_into(q, oh, cos, sin, b * hd, hd, bf16, qf);
            else
                qh = as_f32(q, oh, hd, bf16, qf);
            float m = -FLT_MAX; /* every query sees at least itself */
            for (int64_t t = 0; t < ns; ++t) {
                if (!valid[t]) continue;
                float acc = 0.0f;
                for (int64_t d = 0; d < hd; ++d) acc += qh[d] * ld(keys, kk + t * hd + d, bf16);
                p[t] = acc * scaling;
                if (p[t] > m) m = p[t];
            }
            float Z = 0.0f;
            float *y = bf16 ? yf : (float *)out + oh;
            for (int64_t d = 0; d < hd; ++d) y[d] = 0.0f;
            for (int64_t t = 0; t < ns; ++t) {
                if (!valid[t]) continue;
                const float e = expf(p[t] - m);
                Z += e;
                for (int64_t d = 0; d < hd; ++d) y[d] += e * ld(values, kk + t * hd + d, bf16);
            }
            float c = 0.0f, zl = 0.0f;
            if (S_state && g[h] > 0.0f) {
                c = g[h] * expf(-sharpness * (m > -60.0f ? m : -60.0f));
                feature(qh, fmap + kv * hd * half, hd, half, phi);
                const float *S = S_state + (b * hkv + kv) * f * hd, *z = z_state + (b * hkv + kv) * f;
                for (int64_t j = 0; j < f; ++j) {
                    zl += phi[j] * z[j];
                    const float cj = c * phi[j];
                    for (int64_t d = 0; d < hd; ++d) y[d] += cj * S[j * hd + d];
                }
            }
            const float inv = 1.0f / (Z + c * zl);
            for (int64_t d = 0; d < hd; ++d) st(out, oh + d, y[d] * inv, bf16);
        }
        seen[b] = n + 1;
    }
    free(work);
    return 0;
}

int rf_window_step_f32(const float *q, const float *k, const float *v, float *keys, float *values,
                       int64_t *seen, float *S_state, float *z_state, const float *fmap,
                       const float *g, const float *decay, const int64_t *kvq, float *out, int64_t batch, int64_t hq,
                       int64_t hkv, int64_t hd, int64_t sink, int64_t window, int64_t f,
                       float scaling, float sharpness, const float *cos, const float *sin) {
    return window_step(q, k, v, keys, values, seen, S_state, z_state, fmap, g, decay, kvq, out, batch, hq, hkv, hd,
                       sink, window, f, scaling, sharpness, cos, sin, 0);
}

/* rf_window_step_f32 for bf16 activations beside a bf16 window (the precision policy of a bf16
 * model): q, k, v, keys, values, out, cos and sin are bf16 words, S_state, z_state and the weights
 * float32. */
int rf_window_step_bf16(const rf_bf16 *q, const rf_bf16 *k, const rf_bf16 *v, rf_bf16 *keys, rf_bf16 *values,
                        int64_t *seen, float *S_state, float *z_state, const float *fmap, const float *g,
                        const float *decay, const int64_t *kvq, rf_bf16 *out, int64_t batch, int64_t hq,
                        int64_t hkv, int64_t hd, int64_t sink, int64_t window, int64_t f, float scaling,
                        float sharpness, const rf_bf16 *cos, const rf_bf16 *sin) {
    return window_step(q, k, v, keys, values, seen, S_state, z_state, fmap, g, decay, kvq, out, batch, hq, hkv, hd,
                       sink, window, f, scaling, sharpness, cos, sin, 1);
}

/* float32 -> bf16 words as the kernels store them (the tests hold it to torch's cast). */
void rf_f32_to_bf16(const float *x, rf_bf16 *out, int64_t n) {
    for (int64_t i = 0; i < n; ++i) out[i] = f32_to_bf16(x[i]);
}

/* Prefill of one chunk of L tokens, every row having `seen` tokens before it, for the rows
 * row_begin..row_end-1 of the flattened (batch * hkv) KV heads (callers split rows over threads):
 *
 *   q            : (batch, hq, L, hd)           rotated queries (unscaled), any strides given as
 *                                               q_sb, q_sh, q_sl (elements; channels contiguous)
 *   rec_k, rec_v : (batch, hkv, window + L, hd) the ring in rank order (ranks seen - window ..
 *                                               seen - 1), then the chunk: index t has rank
 *                                               seen - window + t
 *   sink_k/v     : (batch, hkv, sink, hd)       sink slots, the chunk's own first tokens included
 *   S_state, z_state (hybrid, else NULL): the state before the chunk in, after the chunk out
 *   out          : (batch, L, hq, hd)           the layout the layer's output projection reads
 *
 * Query i (rank r = seen + i) attends to the sink slots j <= r and to the recent indices
 * i+1 .. i+window of rank >= sink; before it, the token of rank r - window (index i) is folded
 * into the state when its rank is >= sink (after the state has aged by one token, with a
 * decay). Same formula as rf_window_step_f32.
 *
 * Only the queries i_begin .. i_end - 1 are answered (callers may also split the chunk over
 * threads). The state must be the one before the chunk: indices 0 .. i_begin - 1 are folded
 * into it first (no query), so a piece of a chunk starts from the state its first query needs;
 * on return it is the state after index i_end - 1.
 */
/* One query head's output: softmax over the sink slots (sk, sv, nsink) and the recent keys (rk,
 * rv, nw), plus, when S is given (hybrid, open gate), the state's share c phi(q) S with
 * c = g exp(-sharp max(m, -60)) (sharp: the block's sharpness, 1 by default), under one
 * normaliser. p: scratch of nsink + nw. Instantiated for head
 * widths 64 and 128 as compile-time constants, so the query and the output stay in registers and
 * every key is read once; window_query_any takes the width at run time (hd_arg). */
#define RF_WINDOW_QUERY(NAME, HD)                                                                     \
    static void NAME(const float *qh, const float *sk, const float *sv, int64_t nsink,               \
                     const float *rk, const float *rv, int64_t nw, float scaling, float *p, float *y,  \
                     float gh, float sharp, const float *fm, int64_t half, const float *S,          \
                     const float *z, float *phi, int64_t hd_arg) {                                     \
        (void)hd_arg;                                                                                  \
        float qs[HD], acc[HD];                                                                         \
        for (int64_t d = 0; d < HD; ++d) { qs[d] = qh[d] * scaling; acc[d] = 0.0f; }                   \
        float m = -FLT_MAX;                                                                            \
        for (int64_t t = 0; t < nsink + nw; ++t) {                                                     \
            const float *kt = t < nsink ? sk + t * HD : rk + (t - nsink) * HD;                         \
            float dot = 0.0f;                                                                          \
            for (int64_t d = 0; d < HD; ++d) dot += qs[d] * kt[d];                                     \
            p[t] = dot;                                                                                \
            m = dot > m ? dot : m;                                                                     \
        }                                                                                              \
        float Z = 0.0f;                                                                                \
        for (int64_t t = 0; t < nsink + nw; ++t) { p[t] = expf(p[t] - m); Z += p[t]; }                 \
        for (int64_t t = 0; t < nsink + nw; ++t) {                                                     \
            const float e = p[t], *vt = t < nsink ? sv + t * HD : rv + (t - nsink) * HD;               \
            for (int64_t d = 0; d < HD; ++d) acc[d] += e * vt[d];                                      \
        }                                                                                              \
        if (S && gh > 0.0f) {                                                                          \
            const float c = gh * expf(-sharp * (m > -60.0f ? m : -60.0f));                             \
            feature(qh, fm, HD, half, phi);                                                            \
            float zl = 0.0f;                                                                           \
            for (int64_t j = 0; j < 2 * half; ++j) {                                                   \
                zl += phi[j] * z[j];                                                                   \
                const float cj = c * phi[j], *Sj = S + j * HD;                                         \
                for (int64_t d = 0; d < HD; ++d) acc[d] += cj * Sj[d];                                 \
            }                                                                                          \
            Z += c * zl;                                                                               \
        }                                                                                              \
        const float inv = 1.0f / Z;                                                                    \
        for (int64_t d = 0; d < HD; ++d) y[d] = acc[d] * inv;                                          \
    }
RF_WINDOW_QUERY(window_query_64, 64)
RF_WINDOW_QUERY(window_query_128, 128)
RF_WINDOW_QUERY(window_query_any, hd_arg)

int rf_window_prefill_f32(const float *q, const float *rec_k, const float *rec_v, const float *sink_k,
                          const float *sink_v, float *S_state, float *z_state, const float *fmap,
                          const float *g, const float *decay, const int64_t *kvq, float *out, int64_t hq, int64_t hkv,
                          int64_t hd, int64_t sink, int64_t window, int64_t f, int64_t L, int64_t seen,
                          int64_t q_sb, int64_t q_sh, int64_t q_sl, float scaling, float sharpness, int64_t row_begin,
                          int64_t row_end, int64_t i_begin, int64_t i_end) {
    const int64_t half = f / 2, nr = window + L;
    float *p = (float *)malloc(sizeof(float) * (size_t)(sink + window + 2 * f + 2));
    if (!p) return -1;
    float *phi = p + sink + window;
    for (int64_t row = row_begin; row < row_end; ++row) {
        const int64_t b = row / hkv, kv = row % hkv;
        const float *rk = rec_k + row * nr * hd, *rv = rec_v + row * nr * hd;
        const float *sk = sink_k + row * sink * hd, *sv = sink_v + row * sink * hd;
        const float *fm = fmap ? fmap + kv * hd * half : NULL;
        float *S = S_state ? S_state + row * f * hd : NULL, *z = z_state ? z_state + row * f : NULL;
        for (int64_t i = S ? 0 : i_begin; i < i_end; ++i) {
            const int64_t r = seen + i;
            if (S && decay) { /* the state ages by one token */
                const float gm = decay[kv];
                for (int64_t j = 0; j < f * hd; ++j) S[j] *= gm;
                for (int64_t j = 0; j < f; ++j) z[j] *= gm;
            }
            if (S && r - window >= sink) { /* fold the token of rank r - window (index i) */
                feature(rk + i * hd, fm, hd, half, phi);
                const float *vo = rv + i * hd;
                for (int64_t j = 0; j < f; ++j) {
                    z[j] += phi[j];
                    const float pj = phi[j];
                    float *Sj = S + j * hd;
                    for (int64_t d = 0; d < hd; ++d) Sj[d] += pj * vo[d];
                }
            }
            if (i < i_begin) continue; /* another piece answers this query */
            /* recent indices first .. i + window (rank >= sink), sink slots 0 .. nsink - 1 */
            const int64_t first = (sink - (seen - window) > i + 1) ? sink - (seen - window) : i + 1;
            const int64_t nw = i + window >= first ? i + window - first + 1 : 0; /* none: rank < sink */
            const int64_t nsink = r + 1 < sink ? r + 1 : sink;
            const float *wk = rk + first * hd, *wv = rv + first * hd;
            for (int64_t h = 0; h < hq; ++h) {
                if (kvq[h] != kv) continue;
                const float *qh = q + b * q_sb + h * q_sh + i * q_sl;
                float *y = out + ((b * L + i) * hq + h) * hd;
                const float gh = S ? g[h] : 0.0f;
                if (hd == 64)
                    window_query_64(qh, sk, sv, nsink, wk, wv, nw, scaling, p, y, gh, sharpness, fm, half, S, z, phi, hd);
                else if (hd == 128)
                    window_query_128(qh, sk, sv, nsink, wk, wv, nw, scaling, p, y, gh, sharpness, fm, half, S, z, phi, hd);
                else
                    window_query_any(qh, sk, sv, nsink, wk, wv, nw, scaling, p, y, gh, sharpness, fm, half, S, z, phi, hd);
            }
        }
    }
    free(p);
    return 0;
}

/* rf_window_prefill_f32 over the jobs (row_begin, row_end, i_begin, i_end) of `jobs` (4 x njobs),
 * one OpenMP thread each when the library is built with OpenMP (in the process's OpenMP runtime:
 * PyTorch's own pool where PyTorch uses GNU OpenMP, so the work goes to its warm threads instead of
 * racing their spin-wait), one after another otherwise. Job j reads and writes the state at
 * S_state + j * s_stride, z_state + j * z_stride: 0 when the jobs split the rows, the size of one
 * state when they are pieces of the chunk (each with its own copy). Returns 0, or -1 when a work
 * buffer cannot be allocated. */
int rf_window_prefill_jobs_f32(const float *q, const float *rec_k, const float *rec_v, const float *sink_k,
                               const float *sink_v, float *S_state, float *z_state, const float *fmap,
                               const float *g, const float *decay, const int64_t *kvq, float *out, int64_t hq,
                               int64_t hkv, int64_t hd, int64_t sink, int64_t window, int64_t f, int64_t L,
                               int64_t seen, int64_t q_sb, int64_t q_sh, int64_t q_sl, float scaling,
                               float sharpness, const int64_t *jobs, int64_t njobs, int64_t s_stride, int64_t z_stride) {
    int rc = 0;
#ifdef _OPENMP
#pragma omp parallel for schedule(static, 1) num_threads(njobs) reduction(| : rc)
#endif
    for (int64_t j = 0; j < njobs; ++j) {
        const int64_t *job = jobs + 4 * j;
        rc |= rf_window_prefill_f32(q, rec_k, rec_v, sink_k, sink_v, S_state ? S_state + j * s_stride : NULL,
                                    z_state ? z_state + j * z_stride : NULL, fmap, g, decay, kvq, out, hq, hkv, hd,
                                    sink, window, f, L, seen, q_sb, q_sh, q_sl, scaling, sharpness, job[0], job[1], job[2],
                                    job[3]);
    }
    return rc;
}

/* 1 when this library was built with OpenMP (its jobs run in parallel), else 0. */
int rf_openmp(void) {
#ifdef _OPENMP
    return 1;
#else
    return 0;
#endif
}
