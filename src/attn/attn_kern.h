/* attn/attn_kern.h: the attn sub-table (attn/attn_table.h): the tiled forward's softmax
 * and softcap over a score tile, and the plain baseline; included by kern/table.h. */

/* ----------------------------------------------------------------- softmax -- */

static void softcap(int nk, int M, float *ST, float cap2)
{
    const vf c = vset1(cap2);
    for (int64_t i = 0; i < (int64_t)nk * M; i += VL)
        vstore(ST + i, vmul(c, vtanh(vload(ST + i))));
}

static int softmax(const fw_softmax_args *s)
{
    const int nk = s->nk, M = s->M, masked = s->lo != NULL;
    float *ST = s->ST;
    const vf ninf = vset1(-INFINITY), zero = vzero(), one = vset1(1.0f),
             bound = vset1(FW_ANCHOR_BOUND);
    int fail = 0;
    for (int m = 0; m < M; m += VL) {
        vf a = vload(s->a + m), l = vload(s->l + m);
        vf lo = zero, hi = zero;
        if (masked) {
            lo = vload(s->lo + m);
            hi = vload(s->hi + m);
        }
        vm unset = veq(a, ninf);
        vf sub = a;
        int need_sub = !s->folded;
        if (s->online || vany(unset)) {
            vf mx = ninf;
            for (int j = 0; j < nk; j++) {
                vf x = vload(ST + (int64_t)j * M + m);
                if (masked) {
                    vf jf = vset1((float)j);
                    x = vsel(vmand(vge(jf, lo), vlt(jf, hi)), x, ninf);
                }
                mx = vmax(mx, x);
            }
            if (s->online) {
                vf mnew = vmax(a, mx);
                vm grow = vlt(a, mnew);
                if (vany(grow)) {
                    vf scale = vsel(grow, vsel(unset, zero, vexp2(vsub(a, mnew))), one);
                    l = vmul(l, scale);
                    for (int c = 0; c < s->dv; c++) {
                        float *o = s->OT + (int64_t)c * M + m;
                        vstore(o, vmul(vload(o), scale));
                    }
                }
                a = mnew;
                sub = vsel(veq(a, ninf), zero, a);
            } else {
                vf anew = vsel(unset, mx, a);
                vf use = vsel(veq(anew, ninf), zero, anew);
                sub = s->folded ? vsel(unset, use, zero) : use;
                a = anew;
            }
            need_sub = 1;
        }
        vf sum = zero;
        for (int j = 0; j < nk; j++) {
            float *pj = ST + (int64_t)j * M + m;
            vf x = vload(pj);
            if (need_sub)
                x = vsub(x, sub);
            vf p = vexp2(x);
            if (masked) {
                vf jf = vset1((float)j);
                p = vmaskz(vmand(vge(jf, lo), vlt(jf, hi)), p);
            }
            vstore(pj, p);
            sum = vadd(sum, p);
        }
        l = vadd(l, sum);
        if (s->online) {
            vstore(s->a + m, a);
            vstore(s->l + m, l);
        } else {
            fail |= !vall(vlt(l, bound));
            vstore(s->pending + m, a);
            vstore(s->pending + M + m, l);
        }
    }
    if (s->online)
        return 0;
    if (fail)
        return 1;
    for (int m = 0; m < M; m += VL) {
        vstore(s->a + m, vload(s->pending + m));
        vstore(s->l + m, vload(s->pending + M + m));
    }
    return 0;
}

/* ------------------------------------------------------------ plain baseline -- */

static float dot(const float *x, const float *y, int n)
{
    vf acc = vzero();
    int i = 0;
    for (; i + VL <= n; i += VL)
        acc = vfma(vload(x + i), vload(y + i), acc);
    float s = vhsum(acc);
    for (; i < n; i++)
        s += x[i] * y[i];
    return s;
}

static void axpby(float *acc, float a, const float *x, float b, int n)
{
    /* acc = b * acc + a * x */
    vf va = vset1(a), vb = vset1(b);
    int i = 0;
    for (; i + VL <= n; i += VL)
        vstore(acc + i, vfma(va, vload(x + i), vmul(vb, vload(acc + i))));
    for (; i < n; i++)
        acc[i] = a * x[i] + b * acc[i];
}

static void plain_row(const float *q, int d, int dv, fw_dtype dt, const void *K, int64_t ldk,
                      int64_t kdim, const void *V, int64_t ldv, int64_t vdim, int64_t n, float cap2,
                      float *acc, float *mo, float *lo, float *scratch)
{
    const size_t es = fw_esize(dt);
    float m = *mo, l = *lo, *kf = scratch, *vf_ = scratch + d;
    for (int64_t j = 0; j < n; j++) {
        to_f32((const char *)K + (size_t)(j * ldk) * es, dt, kdim, d, 1.0f, kf);
        to_f32((const char *)V + (size_t)(j * ldv) * es, dt, vdim, dv, 1.0f, vf_);
        float s = dot(q, kf, d);
        if (cap2 > 0.0f)
            s = cap2 * tanhf(s);
        float p = 1.0f, scale = 1.0f;
        if (s > m) { /* p = exp2(s - s): 1, or NaN for s = +inf as in the reference */
            scale = m == -INFINITY ? 0.0f : exp2f(m - s);
            m = s;
            p = s == INFINITY ? NAN : 1.0f;
        } else { /* s = -inf adds nothing (a row that only has those ends as NaN at the store) */
            p = s == -INFINITY ? 0.0f : exp2f(s - m);
        }
        axpby(acc, p, vf_, scale, dv);
        l = l * scale + p;
    }
    *mo = m;
    *lo = l;
}

#define FW_ATTN_TABLE {.softcap = softcap, .softmax = softmax, .plain_row = plain_row}
