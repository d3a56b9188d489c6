/* Mamba (S6) on the CPU: the selective scan for prefill and the whole recurrent decode step.
 *
 * rfkit compiles this file on first use with the system C compiler (see rfkit/ops/cpu_kernels.py)
 * and calls it through ctypes; the pure-PyTorch scans in rfkit/ops/scan.py are its twins and the
 * tests compare the two. The prefill scan and the decode step are inference only; the training
 * scan (rf_scan_train_*, at the end) has a backward.
 *
 * Layouts, all float32 and contiguous:
 *   u, delta, z, y : (batch, dim, length)      delta already includes bias and softplus
 *   A              : (dim, n)
 *   Bt, Ct         : (batch, length, n)        B and C transposed so one token's n values are adjacent
 *   Dskip          : (dim,)                    may be NULL
 *   z              : may be NULL (no gate)
 *   h              : (batch, dim, n)           initial state in, last state out
 *
 * Rows row_begin..row_end-1 of the flattened (batch * dim) channels are processed, so callers
 * can split the work between threads.
 *
 *   h_t = exp(delta_t * A) * h_{t-1} + delta_t * u_t * B_t
 *   y_t = (<C_t, h_t> + Dskip * u_t) * silu(z_t)
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>

void rf_selective_scan_f32(const float *u, const float *delta, const float *A, const float *Bt,
                           const float *Ct, const float *Dskip, const float *z, float *h, float *y,
                           int64_t dim, int64_t length, int64_t n, int64_t row_begin,
                           int64_t row_end) {
    for (int64_t row = row_begin; row < row_end; ++row) {
        const int64_t b = row / dim, d = row % dim;
        const float *u_r = u + row * length, *dt_r = delta + row * length;
        const float *z_r = z ? z + row * length : 0;
        float *y_r = y + row * length;
        float *h_r = h + row * n;
        const float *A_d = A + d * n;
        const float *B_b = Bt + b * length * n, *C_b = Ct + b * length * n;
        const float skip = Dskip ? Dskip[d] : 0.0f;
        for (int64_t t = 0; t < length; ++t) {
            const float dt = dt_r[t], x = u_r[t], dx = dt * x;
            const float *B_t = B_b + t * n, *C_t = C_b + t * n;
            float acc = 0.0f;
#pragma omp simd reduction(+ : acc)
            for (int64_t k = 0; k < n; ++k) {
                const float hk = expf(dt * A_d[k]) * h_r[k] + dx * B_t[k];
                h_r[k] = hk;
                acc += hk * C_t[k];
            }
            float out = acc + skip * x;
            if (z_r) {
                const float g = z_r[t];
                out *= g / (1.0f + expf(-g));
            }
            y_r[t] = out;
        }
    }
}

/* Run `t` of `threads` equal runs over `total` rows (or batch rows): [*begin, *end), empty when the
 * rows run out before the threads do. Every split below uses it, so a split never changes which
 * row a thread computes, only how many threads there are. */
static inline void rf_run_bounds(int64_t t, int64_t total, int64_t threads, int64_t *begin, int64_t *end) {
    const int64_t step = (total + threads - 1) / threads;
    *begin = t * step;
    *end = *begin + step < total ? *begin + step : total;
}

/* rf_selective_scan_f32 over all `rows`, split into `threads` equal runs of rows on OpenMP threads
 * when the library is built with OpenMP (the process's runtime: PyTorch's own pool where PyTorch
 * uses GNU OpenMP), in one run otherwise. */
void rf_selective_scan_rows_f32(const float *u, const float *delta, const float *A, const float *Bt,
                                const float *Ct, const float *Dskip, const float *z, float *h, float *y,
                                int64_t dim, int64_t length, int64_t n, int64_t rows, int64_t threads) {
#ifdef _OPENMP
#pragma omp parallel for schedule(static, 1) num_threads(threads)
#endif
    for (int64_t t = 0; t < threads; ++t) {
        int64_t begin, end;
        rf_run_bounds(t, rows, threads, &begin, &end);
        if (begin < end) rf_selective_scan_f32(u, delta, A, Bt, Ct, Dskip, z, h, y, dim, length, n, begin, end);
    }
}

static inline float silu_f(float v) { return v / (1.0f + expf(-v)); }

/* torch.nn.functional.softplus with its default threshold 20 */
static inline float softplus_f(float v) { return v > 20.0f ? v : log1pf(expf(v)); }

/* One decode token through everything between in_proj and out_proj:
 *
 *   conv_state <- shift left, append x;  xc = silu(<conv_state, conv_w> + conv_b)
 *   [dt_raw, B, C] = x_proj_w @ xc;      dt = softplus(dt_proj_w @ dt_raw + dt_b)
 *   h = exp(dt * A) * h + dt * xc * B    (A = -exp(A_log));   y = (<C, h> + Dskip * xc) * silu(z)
 *
 * xz        : (batch, 2 * di)       in_proj output, x then z
 * conv_state: (batch, di, k)        updated in place
 * ssm_state : (batch, di, n)        updated in place
 * conv_w    : (di, k)   conv_b: (di,) or NULL
 * x_proj_w  : (r + 2n, di)   dt_proj_w: (di, r)   dt_b: (di,)   A_log: (di, n)   Dskip: (di,)
 * y         : (batch, di)           output (before out_proj)
 * Returns 0, or -1 when the work buffer cannot be allocated.
 */
int rf_mamba_step_f32(const float *xz, float *conv_state, float *ssm_state, const float *conv_w,
                      const float *conv_b, const float *x_proj_w, const float *dt_proj_w,
                      const float *dt_b, const float *A_log, const float *Dskip, float *y,
                      int64_t batch, int64_t di, int64_t k, int64_t n, int64_t r) {
    const int64_t nx = r + 2 * n;
    float *xc = (float *)malloc(sizeof(float) * (size_t)(di + nx));
    if (!xc) return -1;
    float *xdbl = xc + di;
    for (int64_t b = 0; b < batch; ++b) {
        const float *x = xz + b * 2 * di, *z = x + di;
        float *cs = conv_state + b * di * k, *h = ssm_state + b * di * n;
        for (int64_t d = 0; d < di; ++d) {
            float *c = cs + d * k;
            float acc = conv_b ? conv_b[d] : 0.0f;
            for (int64_t j = 0; j + 1 < k; ++j) {
                c[j] = c[j + 1];
                acc += c[j] * conv_w[d * k + j];
            }
            c[k - 1] = x[d];
            acc += x[d] * conv_w[d * k + k - 1];
            xc[d] = silu_f(acc);
        }
        for (int64_t j = 0; j < nx; ++j) {
            const float *w = x_proj_w + j * di;
            float acc = 0.0f;
#pragma omp simd reduction(+ : acc)
            for (int64_t d = 0; d < di; ++d) acc += w[d] * xc[d];
            xdbl[j] = acc;
        }
        const float *Bv = xdbl + r, *Cv = xdbl + r + n;
        float *y_b = y + b * di;
        for (int64_t d = 0; d < di; ++d) {
            const float *w = dt_proj_w + d * r;
            float v = dt_b[d];
            for (int64_t q = 0; q < r; ++q) v += w[q] * xdbl[q];
            const float dt = softplus_f(v), dx = dt * xc[d];
            const float *al = A_log + d * n;
            float *hd = h + d * n;
            float acc = 0.0f;
#pragma omp simd reduction(+ : acc)
            for (int64_t q = 0; q < n; ++q) {
                const float hq = expf(-dt * expf(al[q])) * hd[q] + dx * Bv[q];
                hd[q] = hq;
                acc += hq * Cv[q];
            }
            y_b[d] = (acc + Dskip[d] * xc[d]) * silu_f(z[d]);
        }
    }
    free(xc);
    return 0;
}

/* Training: the scan's forward, keeping the state before every `chunk` tokens, and its backward.
 * D and z stay in PyTorch (autograd differentiates them), so the forward's y is <C_t, h_t> alone.
 *
 *   hck : (batch, dim, nchunks, n)   the state before each chunk, nchunks = ceil(length / chunk)
 *   h   : (batch, dim, n)            initial state in, last state out
 */
void rf_scan_train_fwd_f32(const float *u, const float *delta, const float *A, const float *Bt,
                           const float *Ct, float *h, float *hck, float *y, int64_t dim,
                           int64_t length, int64_t n, int64_t chunk, int64_t row_begin,
                           int64_t row_end) {
    const int64_t nck = (length + chunk - 1) / chunk;
    for (int64_t row = row_begin; row < row_end; ++row) {
        const int64_t b = row / dim, d = row % dim;
        const float *u_r = u + row * length, *dt_r = delta + row * length;
        float *y_r = y + row * length, *h_r = h + row * n, *ck_r = hck + row * nck * n;
        const float *A_d = A + d * n;
        const float *B_b = Bt + b * length * n, *C_b = Ct + b * length * n;
        for (int64_t t = 0; t < length; ++t) {
            if (t % chunk == 0) {
                float *dst = ck_r + (t / chunk) * n;
                for (int64_t k = 0; k < n; ++k) dst[k] = h_r[k];
            }
            const float dt = dt_r[t], dx = dt * u_r[t];
            const float *B_t = B_b + t * n, *C_t = C_b + t * n;
            float acc = 0.0f;
#pragma omp simd reduction(+ : acc)
            for (int64_t k = 0; k < n; ++k) {
                const float hk = expf(dt * A_d[k]) * h_r[k] + dx * B_t[k];
                h_r[k] = hk;
                acc += hk * C_t[k];
            }
            y_r[t] = acc;
        }
    }
}

/* The backward of rf_scan_train_fwd_f32 for batch rows b_begin..b_end-1. Each chunk's states are
 * recomputed from its checkpoint, then the recurrence runs backwards with
 *
 *   g_t = dy_t C_t + exp(delta_{t+1} A) g_{t+1}       (g after the last token: dh_last, or 0)
 *   du_t = delta_t <g_t, B_t>,   ddelta_t = <g_t, A exp(delta_t A) h_{t-1}> + u_t <g_t, B_t>
 *   dA  += delta_t g_t exp(delta_t A) h_{t-1}         (into dA_part (batch, dim, n); summed by the caller)
 *   dB_t += delta_t u_t g_t,   dC_t += dy_t h_t       (summed over dim: dBt, dCt (batch, length, n), zeroed)
 *   dh0 = exp(delta_0 A) g_0
 *
 * A batch row owns its rows of every output, so threads over the batch never write the same memory.
 * Returns 0, or -1 when the work buffer cannot be allocated. */
int rf_scan_train_bwd_f32(const float *u, const float *delta, const float *A, const float *Bt,
                          const float *Ct, const float *hck, const float *dy, const float *dh_last,
                          float *du, float *ddelta, float *dA_part, float *dBt, float *dCt, float *dh0,
                          int64_t dim, int64_t length, int64_t n, int64_t chunk, int64_t b_begin,
                          int64_t b_end) {
    const int64_t nck = (length + chunk - 1) / chunk;
    float *hs = (float *)malloc(sizeof(float) * (size_t)((chunk + 1) * n + 2 * n));
    if (!hs) return -1;
    float *carry = hs + (chunk + 1) * n, *dA_acc = carry + n;
    for (int64_t b = b_begin; b < b_end; ++b) {
        const float *B_b = Bt + b * length * n, *C_b = Ct + b * length * n;
        float *dB_b = dBt + b * length * n, *dC_b = dCt + b * length * n;
        for (int64_t d = 0; d < dim; ++d) {
            const int64_t row = b * dim + d;
            const float *u_r = u + row * length, *dt_r = delta + row * length, *dy_r = dy + row * length;
            float *du_r = du + row * length, *ddt_r = ddelta + row * length;
            const float *A_d = A + d * n;
            for (int64_t k = 0; k < n; ++k) {
                carry[k] = dh_last ? dh_last[row * n + k] : 0.0f;
                dA_acc[k] = 0.0f;
            }
            for (int64_t c = nck - 1; c >= 0; --c) {
                const int64_t t0 = c * chunk, t1 = t0 + chunk < length ? t0 + chunk : length;
                const float *ck = hck + (row * nck + c) * n;
                for (int64_t k = 0; k < n; ++k) hs[k] = ck[k];
                for (int64_t t = t0; t < t1; ++t) {
                    const float dt = dt_r[t], dx = dt * u_r[t];
                    const float *B_t = B_b + t * n, *prev = hs + (t - t0) * n;
                    float *next = hs + (t - t0 + 1) * n;
#pragma omp simd
                    for (int64_t k = 0; k < n; ++k) next[k] = expf(dt * A_d[k]) * prev[k] + dx * B_t[k];
                }
                for (int64_t t = t1 - 1; t >= t0; --t) {
                    const float dt = dt_r[t], x = u_r[t], g_y = dy_r[t];
                    const float *B_t = B_b + t * n, *C_t = C_b + t * n;
                    const float *prev = hs + (t - t0) * n, *cur = prev + n;
                    float *dB_t = dB_b + t * n, *dC_t = dC_b + t * n;
                    float gB = 0.0f, gAh = 0.0f;
#pragma omp simd reduction(+ : gB, gAh)
                    for (int64_t k = 0; k < n; ++k) {
                        const float a = expf(dt * A_d[k]);
                        const float g = carry[k] + g_y * C_t[k];
                        const float gah = g * a * prev[k];
                        dC_t[k] += g_y * cur[k];
                        dB_t[k] += g * dt * x;
                        dA_acc[k] += gah * dt;
                        gB += g * B_t[k];
                        gAh += gah * A_d[k];
                        carry[k] = g * a;
                    }
                    du_r[t] = dt * gB;
                    ddt_r[t] = gAh + x * gB;
                }
            }
            for (int64_t k = 0; k < n; ++k) {
                dh0[row * n + k] = carry[k];
                dA_part[row * n + k] = dA_acc[k];
            }
        }
    }
    free(hs);
    return 0;
}

/* rf_scan_train_fwd_f32 over all rows and rf_scan_train_bwd_f32 over all batch rows, split into
 * `threads` runs on OpenMP threads when the library is built with OpenMP, in one run otherwise.
 * The backward returns -1 when a run could not allocate its work buffer. */
void rf_scan_train_fwd_rows_f32(const float *u, const float *delta, const float *A, const float *Bt,
                                const float *Ct, float *h, float *hck, float *y, int64_t dim,
                                int64_t length, int64_t n, int64_t chunk, int64_t rows,
                                int64_t threads) {
#ifdef _OPENMP
#pragma omp parallel for schedule(static, 1) num_threads(threads)
#endif
    for (int64_t t = 0; t < threads; ++t) {
        int64_t begin, end;
        rf_run_bounds(t, rows, threads, &begin, &end);
        if (begin < end) rf_scan_train_fwd_f32(u, delta, A, Bt, Ct, h, hck, y, dim, length, n, chunk, begin, end);
    }
}

int rf_scan_train_bwd_batches_f32(const float *u, const float *delta, const float *A, const float *Bt,
                                  const float *Ct, const float *hck, const float *dy,
                                  const float *dh_last, float *du, float *ddelta, float *dA_part,
                                  float *dBt, float *dCt, float *dh0, int64_t dim, int64_t length,
                                  int64_t n, int64_t chunk, int64_t batch, int64_t threads) {
    int failed = 0;
#ifdef _OPENMP
#pragma omp parallel for schedule(static, 1) num_threads(threads) reduction(| : failed)
#endif
    for (int64_t t = 0; t < threads; ++t) {
        int64_t begin, end;
        rf_run_bounds(t, batch, threads, &begin, &end);
        if (begin < end && rf_scan_train_bwd_f32(u, delta, A, Bt, Ct, hck, dy, dh_last, du, ddelta, dA_part,
                                                 dBt, dCt, dh0, dim, length, n, chunk, begin, end) != 0)
            failed |= 1;
    }
    return failed ? -1 : 0;
}
