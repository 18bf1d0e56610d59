/* gdn/gdn_kern.h: the gdn sub-table (gdn/gdn_table.h): Gated DeltaNet's and KDA's chunk
 * and decode kernels over the vector layer; included by kern/table.h. */

/* --------------------------------------------------------- Gated DeltaNet -- */

/* x[i] = 2^x[i]. Arguments below -126 give 0 (callers mask with -1e30, never -inf). */
static void exp2_inplace(float *x, int64_t n)
{
    int64_t i = 0;
    for (; i + VL <= n; i += VL)
        vstore(x + i, vexp2(vload(x + i)));
    for (; i < n; i++)
        x[i] = exp2f(x[i]);
}

/* Row r of x [rows][n] times scale / sqrt(|x_r|^2 + eps) (l2 = 1) or times scale (l2 = 0). */
static void rows_l2scale(float *x, int rows, int n, float scale, int l2, float eps)
{
    for (int r = 0; r < rows; r++) {
        float *xr = x + (size_t)r * n, s = scale;
        if (l2) {
            vf a0 = vzero(), a1 = vzero();
            int i = 0;
            for (; i + 2 * VL <= n; i += 2 * VL) {
                const vf u = vload(xr + i), w = vload(xr + i + VL);
                a0 = vfma(u, u, a0);
                a1 = vfma(w, w, a1);
            }
            double ss = vhsum(vadd(a0, a1));
            for (; i < n; i++)
                ss += (double)xr[i] * xr[i];
            s = (float)(scale / sqrt(ss + (double)eps));
        }
        const vf vs = vset1(s);
        int i = 0;
        for (; i + VL <= n; i += VL)
            vstore(xr + i, vmul(vs, vload(xr + i)));
        for (; i < n; i++)
            xr[i] *= s;
    }
}

/* The chunk's gate matrices, rows i < L, columns j < 64, gam[] in log2 units (read to 64):
 *   A[i][j]  = beta[i] 2^(gam_i - gam_j) KK[i][j]  for j < i, else 0
 *   G[i][j]  = 2^(gam_i - gam_j) QK[i][j]           for j <= i, j < L, else 0
 * Masked differences become -1e30 before exp2 (never -inf: 2^(-inf) is NaN in some tables). */
static void gdn_gates(int L, const float *gam, const float *beta, const float *KK, const float *QK,
                      float *A, float *G, int ldg)
{
    const vf big = vset1(-1e30f);
    for (int i = 0; i < L; i++) {
        const vf gi = vset1(gam[i]), fi = vset1((float)i), fl = vset1((float)L), bi = vset1(beta[i]);
        for (int j = 0; j < 64; j += VL) {
            const vf jv = vload(dec_iota + j), dlt = vsub(gi, vload(gam + j));
            const vf ea = vexp2(vsel(vlt(jv, fi), dlt, big));
            const vf eg = vexp2(vsel(vmand(vlt(jv, vadd(fi, vset1(1.0f))), vlt(jv, fl)), dlt, big));
            vstore(A + (size_t)i * 64 + j, vmul(vmul(ea, bi), vload(KK + (size_t)i * 64 + j)));
            vstore(G + (size_t)i * ldg + j, vmul(eg, vload(QK + (size_t)i * 64 + j)));
        }
    }
}

/* X = (I + A)^-1 for A strictly lower triangular, L x L (row strides lda, ldx), by forward
 * substitution: row i of X is e_i - sum_{m<i} A[i][m] X[m][:], vectors along the columns. */
static void tri_inv_fwd(const float *A, int lda, int L, float *X, int ldx)
{
    for (int i = 0; i < L; i++) {
        float *xi = X + (size_t)i * ldx;
        for (int j = 0; j < L; j++)
            xi[j] = j == i ? 1.0f : 0.0f;
        for (int m = 0; m < i; m++) {
            const vf a = vset1(-A[(size_t)i * lda + m]);
            const float *xm = X + (size_t)m * ldx;
            int j = 0;
            for (; j + VL <= m + 1; j += VL)
                vstore(xi + j, vfma(a, vload(xm + j), vload(xi + j)));
            for (; j <= m; j++)
                xi[j] += -A[(size_t)i * lda + m] * xm[j];
        }
    }
}

/* The same inverse in FlyWheel's matmul form: the 16 x 16 diagonal blocks by forward
 * substitution, then block row I, column J < I as X_IJ = -X_II (sum_{M=J}^{I-1} A_IM X_MJ),
 * in order of distance I - J, each a pair of 16 x 16 block products (broadcast FMAs along
 * the block's 16 columns). L is padded to a multiple of 16 with identity rows, which leaves
 * the inverse's first L rows and columns exact. */
#define TRI_B 16
static void tri_inv_blocked(const float *A, int lda, int L, float *X, int ldx)
{
    const int nb = (L + TRI_B - 1) / TRI_B, Lp = nb * TRI_B;
    float Ap[64 * 64], tmp[TRI_B * TRI_B];
    for (int i = 0; i < Lp; i++)
        for (int j = 0; j < Lp; j++)
            Ap[i * 64 + j] = i < L && j < L ? A[(size_t)i * lda + j] : 0.0f;
    for (int i = 0; i < Lp; i++)
        for (int j = 0; j < Lp; j++)
            X[(size_t)i * ldx + j] = 0.0f;
    for (int b = 0; b < nb; b++)
        tri_inv_fwd(Ap + b * TRI_B * 64 + b * TRI_B, 64, TRI_B, X + (size_t)b * TRI_B * ldx + b * TRI_B, ldx);
    for (int dist = 1; dist < nb; dist++)
        for (int I = dist; I < nb; I++) {
            const int J = I - dist;
            for (int r = 0; r < TRI_B; r++) {
                float *t = tmp + r * TRI_B;
                for (int c = 0; c < TRI_B; c++)
                    t[c] = 0.0f;
                for (int mcol = J * TRI_B; mcol < I * TRI_B; mcol++) {
                    const vf a = vset1(Ap[(I * TRI_B + r) * 64 + mcol]);
                    const float *xm = X + (size_t)mcol * ldx + J * TRI_B;
                    for (int c = 0; c < TRI_B; c += VL)
                        vstore(t + c, vfma(a, vload(xm + c), vload(t + c)));
                }
            }
            for (int r = 0; r < TRI_B; r++) {
                float *xo = X + (size_t)(I * TRI_B + r) * ldx + J * TRI_B;
                for (int c = 0; c < TRI_B; c++)
                    xo[c] = 0.0f;
                for (int q2 = 0; q2 <= r; q2++) {
                    const vf a = vset1(-X[(size_t)(I * TRI_B + r) * ldx + I * TRI_B + q2]);
                    for (int c = 0; c < TRI_B; c += VL)
                        vstore(xo + c, vfma(a, vload(tmp + q2 * TRI_B + c), vload(xo + c)));
                }
            }
        }
}

/* KDA: dst = x o 2^(g1 - g0) over n elements (x NULL: ones; g0 NULL: zeros). The chunk's
 * per-channel decays enter its operands this way, every exponent a difference <= 0. */
/* KDA's decayed operands: e = 2^(float)(g1 - g0) (the difference in double; g0 NULL: 0),
 * dx = x o e (x NULL: e) and, with dy, dy = y o e: one exponential for two operands, the
 * same bits as exp2_scale on the rounded differences. */
static void exp2d_scale2(int n, const double *g1, const double *g0, const float *x, float *dx, const float *y,
                         float *dy)
{
    int i = 0;
    for (; i + VL <= n; i += VL) {
        const vf e = vexp2(vload_dsub(g1, g0, i));
        vstore(dx + i, x ? vmul(vload(x + i), e) : e);
        if (dy)
            vstore(dy + i, vmul(vload(y + i), e));
    }
    for (; i < n; i++) {
        const float e = exp2f((float)(g1[i] - (g0 ? g0[i] : 0.0)));
        dx[i] = x ? x[i] * e : e;
        if (dy)
            dy[i] = y[i] * e;
    }
}

static void exp2_scale(int n, const float *x, const float *g1, const float *g0, float *dst)
{
    int i = 0;
    for (; i + VL <= n; i += VL) {
        vf e = g0 ? vsub(vload(g1 + i), vload(g0 + i)) : vload(g1 + i);
        e = vexp2(e);
        vstore(dst + i, x ? vmul(vload(x + i), e) : e);
    }
    for (; i < n; i++) {
        const float e = exp2f(g1[i] - (g0 ? g0[i] : 0.0f));
        dst[i] = x ? x[i] * e : e;
    }
}

/* log(1 + z) for z in [0, 1] with only vector arithmetic: 1 + z = 2^e m, e = [z > sqrt2 - 1],
 * m in [sqrt(1/2), sqrt2], t = (m - 1) / (m + 1) from z itself ((z - 1) / (z + 3) or z /
 * (z + 2), so 1 + z is never rounded), log m = 2 atanh t to t^9 (|t| <= 0.172: the next term
 * is below 4e-10). */
FW_INLINE vf vlog1p_unit(vf z)
{
    const vm big = vlt(vset1(0.41421356f), z);
    const vf t = vsel(big, vdiv(vsub(z, vset1(1.0f)), vadd(z, vset1(3.0f))), vdiv(z, vadd(z, vset1(2.0f))));
    const vf s = vmul(t, t);
    vf p = vfma(s, vset1(1.0f / 9.0f), vset1(1.0f / 7.0f));
    p = vfma(p, s, vset1(1.0f / 5.0f));
    p = vfma(p, s, vset1(1.0f / 3.0f));
    p = vfma(p, s, vset1(1.0f));
    return vadd(vmul(vadd(t, t), p), vsel(big, vset1(0.69314718f), vzero()));
}

/* KDA's gates of one row, in log2 units, from the raw a (n channels) and the value head's
 * dt_bias row (NULL: 0), ea = exp(a_log), lb = lower_bound: y = a + dt_bias, then
 * -ea softplus(y) (lb = 0; softplus(y) = max(y, 0) + log1p(e^-|y|), and y above 20) or
 * lb sigmoid(ea y). Vectorised; within a few ulp of gate_g_at's libm form (gdn.h). */
static void kda_gates(int n, const float *a, const float *bias, float ea, float lb, float *g2)
{
    const float l2e = 1.44269504088896341f; /* log2(e) */
    const vf L2E = vset1(l2e), E = vset1(ea);
    int i = 0;
    for (; i + VL <= n; i += VL) {
        const vf y = bias ? vadd(vload(a + i), vload(bias + i)) : vload(a + i);
        vf g;
        if (lb < 0.0f) {
            g = vdiv(vset1(lb), vadd(vset1(1.0f), vexp2(vmul(vmul(vset1(-1.0f), vmul(E, y)), L2E))));
        } else {
            const vf ay = vmax(y, vsub(vzero(), y));
            const vf sp = vadd(vmax(y, vzero()), vlog1p_unit(vexp2(vmul(vsub(vzero(), ay), L2E))));
            g = vmul(vsub(vzero(), E), vsel(vlt(vset1(20.0f), y), y, sp));
        }
        vstore(g2 + i, vmul(g, L2E));
    }
    for (; i < n; i++) {
        const float y = a[i] + (bias ? bias[i] : 0.0f);
        const float g = lb < 0.0f ? lb / (1.0f + expf(-ea * y)) : -ea * (y > 20.0f ? y : log1pf(expf(y)));
        g2[i] = g * l2e;
    }
}

/* KDA's pairs inside each block of FW_KDA_BLOCK rows of a chunk (products cover the pairs across
 * blocks). For j <= i in one block, KE = K_j o E_{j+1} o ... o E_i, with E_s the step decays
 * 2^(g_s) [L][dk]: K_j decayed to row i by products, with no exponent of a difference at all.
 *   A[i][j] = beta_i K_i . KE  (j < i),      G[i][j] = Q_i . KE  (j <= i)
 * Entries outside the diagonal blocks are left as they are. */
static void kda_diag(int L, int dk, const float *Q, const float *K, const float *E, const float *beta,
                     float *A, int lda, float *G, int ldg)
{
    float ke[FW_MAX_HEAD_DIM];
    const int nv = dk / VL * VL;
    for (int b0 = 0; b0 < L; b0 += FW_KDA_BLOCK) {
        const int b1 = b0 + FW_KDA_BLOCK < L ? b0 + FW_KDA_BLOCK : L;
        for (int j = b0; j < b1; j++) {
            memcpy(ke, K + (size_t)j * dk, sizeof(float) * (size_t)dk);
            for (int i = j; i < b1; i++) {
                const float *ki = K + (size_t)i * dk, *qi = Q + (size_t)i * dk, *ei = E + (size_t)i * dk;
                vf sk = vzero(), sq = vzero();
                int x = 0;
                for (; x < nv; x += VL) {
                    vf e = vload(ke + x);
                    if (i > j) {
                        e = vmul(e, vload(ei + x));
                        vstore(ke + x, e);
                    }
                    sk = vfma(vload(ki + x), e, sk);
                    sq = vfma(vload(qi + x), e, sq);
                }
                float tk = vhsum(sk), tq = vhsum(sq);
                for (; x < dk; x++) {
                    if (i > j)
                        ke[x] *= ei[x];
                    tk += ki[x] * ke[x];
                    tq += qi[x] * ke[x];
                }
                if (i > j)
                    A[(size_t)i * lda + j] = beta[i] * tk;
                G[(size_t)i * ldg + j] = tq;
            }
        }
    }
}

/* Column vectors of the state per register block of the decode step: the block's a and b
 * sums (2 x GDN_CV accumulators) stay in registers over all dk rows. */
#define GDN_CV 8

/* a = h^T (d o k), b = h^T (d o q) over rows 0 .. dk-1 (d the rows' decays) for cv column
 * vectors of h from column 0. */
FW_INLINE void gdn_dec_ab_in(const int cv, const void *h, const fw_dtype dt, int64_t ldh, int dk,
                             const float *q, const float *k, const float *d, float *a, float *b)
{
    vf va[GDN_CV], vb[GDN_CV];
    for (int c = 0; c < cv; c++)
        va[c] = vb[c] = vzero();
    for (int r = 0; r < dk; r++) {
        const char *hr = (const char *)h + (size_t)r * (size_t)ldh * (dt == FW_F32 ? 4 : 2);
        const vf kr = vset1(d[r] * k[r]), qr = vset1(d[r] * q[r]);
        for (int c = 0; c < cv; c++) {
            const vf x = vload_in(hr, dt, c * VL);
            va[c] = vfma(kr, x, va[c]);
            vb[c] = vfma(qr, x, vb[c]);
        }
    }
    for (int c = 0; c < cv; c++) {
        vstore(a + c * VL, va[c]);
        vstore(b + c * VL, vb[c]);
    }
}

FW_INLINE void gdn_dec_ab(const int cv, const float *h, int64_t ldh, int dk, const float *q,
                          const float *k, const float *d, float *a, float *b)
{
    gdn_dec_ab_in(cv, h, FW_F32, ldh, dk, q, k, d, a, b);
}

/* h = diag(decay) h + k dl^T for cv column vectors of h (f32, or bf16: read into f32 and
 * rounded back) from column 0. */
FW_INLINE void gdn_dec_update_in(const int cv, void *h, const fw_dtype dt, int64_t ldh, int dk, const float *k,
                                 const float *dl, const float *decay)
{
    vf d[GDN_CV];
    for (int c = 0; c < cv; c++)
        d[c] = vload(dl + c * VL);
    for (int r = 0; r < dk; r++) {
        char *hr = (char *)h + (size_t)r * (size_t)ldh * (dt == FW_F32 ? 4 : 2);
        const vf kr = vset1(k[r]), al = vset1(decay[r]);
        for (int c = 0; c < cv; c++)
            vstore_as(hr, dt, c * VL, vfma(kr, d[c], vmul(al, vload_in(hr, dt, c * VL))));
    }
}

FW_INLINE void gdn_dec_update(const int cv, float *h, int64_t ldh, int dk, const float *k,
                              const float *dl, const float *decay)
{
    gdn_dec_update_in(cv, h, FW_F32, ldh, dk, k, dl, decay);
}

static __attribute__((noinline)) void gdn_dec_ab_tail(int cv, const float *h, int64_t ldh, int dk,
                                                      const float *q, const float *k, const float *d,
                                                      float *a, float *b)
{
    gdn_dec_ab(cv, h, ldh, dk, q, k, d, a, b);
}

static __attribute__((noinline)) void gdn_dec_ab_bf16(int cv, const void *h, int64_t ldh, int dk,
                                                      const float *q, const float *k, const float *d,
                                                      float *a, float *b)
{
    gdn_dec_ab_in(cv, h, FW_BF16, ldh, dk, q, k, d, a, b);
}

static __attribute__((noinline)) void gdn_dec_update_tail(int cv, float *h, int64_t ldh, int dk,
                                                          const float *k, const float *dl,
                                                          const float *decay)
{
    gdn_dec_update(cv, h, ldh, dk, k, dl, decay);
}

static __attribute__((noinline)) void gdn_dec_update_bf16(int cv, void *h, int64_t ldh, int dk,
                                                          const float *k, const float *dl,
                                                          const float *decay)
{
    gdn_dec_update_in(cv, h, FW_BF16, ldh, dk, k, dl, decay);
}

/* One fused decode step on columns [c0, c1) of a state h [dk][ldh] (GDN_COLS at most), with
 * D = diag(decay) the decays of h's rows (all alike for GDN, one per key channel for KDA):
 * first a = h^T D k and b = h^T D q, then delta = beta (v - a), o = b + delta (k . q), and
 * the update h = D h + k delta^T on the second pass. Each pass takes GDN_CV column
 * vectors at a time with their sums or deltas in registers, so h is the only array in
 * memory it reads and writes. Measured (`flywheel bench gdn --decode --seqs 1 --h 16 --hv 32
 * --dk 128 --dv 128 --dtype bf16`): with a and b in memory, loaded and stored for every row,
 * 107 / 65 us a step on 1 / 2 threads; in registers, 70 / 45 us (64 sequences: 6.1-6.2 ->
 * 5.7-5.8 ms, where DRAM bandwidth bounds it).
 * The columns are independent, so threads can split them. */
#define GDN_COLS 1024
/* The fused step's two reads of the state, alone (ReplaySSM reads a checkpoint it does not
 * update, f32 or its bf16 shadow: hdt): a[c] = sum_r decay[r] k[r] h[r][c], b[c] = the same
 * with q, for c in [c0, c1); ldh in elements. */
static void gdn_dec_reads(const void *hv, fw_dtype hdt, int64_t ldh, int dk, int c0, int c1, const float *q,
                          const float *k, const float *decay, float *a, float *b)
{
    const int n = c1 - c0, nv = n / VL * VL, es = hdt == FW_F32 ? 4 : 2;
    const char *h = (const char *)hv + (size_t)c0 * (size_t)es;
    a += c0;
    b += c0;
    for (int c = 0; c < nv; c += GDN_CV * VL) {
        const int cv = (nv - c) / VL < GDN_CV ? (nv - c) / VL : GDN_CV;
        const char *hc = h + (size_t)c * (size_t)es;
        if (hdt != FW_F32 && cv == GDN_CV)
            gdn_dec_ab_in(GDN_CV, hc, FW_BF16, ldh, dk, q, k, decay, a + c, b + c);
        else if (hdt != FW_F32)
            gdn_dec_ab_bf16(cv, hc, ldh, dk, q, k, decay, a + c, b + c);
        else if (cv == GDN_CV)
            gdn_dec_ab(GDN_CV, (const float *)hc, ldh, dk, q, k, decay, a + c, b + c);
        else
            gdn_dec_ab_tail(cv, (const float *)hc, ldh, dk, q, k, decay, a + c, b + c);
    }
    for (int c = nv; c < n; c++) {
        a[c] = b[c] = 0.0f;
        for (int r = 0; r < dk; r++) {
            const char *e = h + ((size_t)r * (size_t)ldh + (size_t)c) * (size_t)es;
            const float x = hdt == FW_F32 ? *(const float *)e : fw_cvt_bf16_f32(*(const uint16_t *)e);
            a[c] += decay[r] * k[r] * x;
            b[c] += decay[r] * q[r] * x;
        }
    }
}

static void gdn_dec_cols(void *hv, fw_dtype hdt, int64_t ldh, int dk, int c0, int c1, const float *q,
                         const float *k, const float *v, const float *decay, float beta, float kq,
                         float *o)
{
    float a[GDN_COLS], b[GDN_COLS], dl[GDN_COLS];
    const int n = c1 - c0, nv = n / VL * VL, es = hdt == FW_F32 ? 4 : 2;
    char *h = (char *)hv + (size_t)c0 * (size_t)es;
    gdn_dec_reads(h, hdt, ldh, dk, 0, n, q, k, decay, a, b);
    for (int c = 0; c < n; c++) {
        dl[c] = beta * (v[c0 + c] - a[c]);
        o[c0 + c] = b[c] + dl[c] * kq;
    }
    for (int c = 0; c < nv; c += GDN_CV * VL) {
        const int cv = (nv - c) / VL < GDN_CV ? (nv - c) / VL : GDN_CV;
        char *hc = h + (size_t)c * (size_t)es;
        if (hdt != FW_F32 && cv == GDN_CV)
            gdn_dec_update_in(GDN_CV, hc, FW_BF16, ldh, dk, k, dl + c, decay);
        else if (hdt != FW_F32)
            gdn_dec_update_bf16(cv, hc, ldh, dk, k, dl + c, decay);
        else if (cv == GDN_CV)
            gdn_dec_update(GDN_CV, (float *)hc, ldh, dk, k, dl + c, decay);
        else
            gdn_dec_update_tail(cv, (float *)hc, ldh, dk, k, dl + c, decay);
    }
    for (int r = 0; r < dk; r++)
        for (int c = nv; c < n; c++) {
            char *e = h + ((size_t)r * (size_t)ldh + (size_t)c) * (size_t)es;
            if (hdt == FW_F32) {
                *(float *)e = k[r] * dl[c] + decay[r] * *(float *)e;
            } else {
                const float x = k[r] * dl[c] + decay[r] * fw_cvt_bf16_f32(*(uint16_t *)e);
                *(uint16_t *)e = fw_cvt_f32_bf16(x);
            }
        }
}

/* The plain recurrent step the baseline times: four separate passes over h, as ggml does:
 * decay (row r by decay[r]), a = h^T k, h += k delta^T, o = h^T q. */
static void gdn_step4(float *h, int64_t ldh, int dk, int dv, const float *q, const float *k,
                      const float *v, const float *decay, float beta, float *o, float *tmp)
{
    const int nv = dv / VL * VL;
    for (int r = 0; r < dk; r++) {
        float *hr = h + (size_t)r * ldh;
        const vf al = vset1(decay[r]);
        int c = 0;
        for (; c < nv; c += VL)
            vstore(hr + c, vmul(al, vload(hr + c)));
        for (; c < dv; c++)
            hr[c] *= decay[r];
    }
    for (int c = 0; c < dv; c++)
        tmp[c] = 0.0f;
    for (int r = 0; r < dk; r++) {
        const float *hr = h + (size_t)r * ldh;
        const vf kr = vset1(k[r]);
        int c = 0;
        for (; c < nv; c += VL)
            vstore(tmp + c, vfma(kr, vload(hr + c), vload(tmp + c)));
        for (; c < dv; c++)
            tmp[c] += k[r] * hr[c];
    }
    for (int c = 0; c < dv; c++)
        tmp[c] = beta * (v[c] - tmp[c]);
    for (int r = 0; r < dk; r++) {
        float *hr = h + (size_t)r * ldh;
        const vf kr = vset1(k[r]);
        int c = 0;
        for (; c < nv; c += VL)
            vstore(hr + c, vfma(kr, vload(tmp + c), vload(hr + c)));
        for (; c < dv; c++)
            hr[c] += k[r] * tmp[c];
    }
    for (int c = 0; c < dv; c++)
        o[c] = 0.0f;
    for (int r = 0; r < dk; r++) {
        const float *hr = h + (size_t)r * ldh;
        const vf qr = vset1(q[r]);
        int c = 0;
        for (; c < nv; c += VL)
            vstore(o + c, vfma(qr, vload(hr + c), vload(o + c)));
        for (; c < dv; c++)
            o[c] += q[r] * hr[c];
    }
}

#define FW_GDN_TABLE                                                                             \
    {.exp2_inplace = exp2_inplace, .rows_l2scale = rows_l2scale, .gates = gdn_gates,              \
     .tri_inv_fwd = tri_inv_fwd, .tri_inv_blocked = tri_inv_blocked, .dec_cols = gdn_dec_cols,    \
     .dec_reads = gdn_dec_reads, .step4 = gdn_step4, .exp2_scale = exp2_scale,                    \
     .exp2d_scale2 = exp2d_scale2, .kda_diag = kda_diag, .kda_gates = kda_gates}
