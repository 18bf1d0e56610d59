/* attn/bwd_kern.h: the bwd sub-table (attn/attn_table.h): the attention backward's
 * elementwise step; included by kern/table.h. */

/* Backward's elementwise step on R query rows x FW_DEC_KEYS keys (row stride FW_DEC_KEYS), in
 * place. S (raw q.k) becomes P = 2^(s - lse2[r]), s = qs S (log2 units) or with a softcap
 * cap2 tanh(qs S); dP (dO.v) becomes dS = P (dP - D[r]), times 1 - tanh^2 with a softcap, the
 * derivative of the score by qs S up to the constant the driver applies at the end. Keys
 * outside [lo[r], hi[r]) get P = dS = 0 by selection, so a NaN there never enters the row's
 * sums (it can still reach the products, as in the forward). */
static void bwd_ds(int R, float *S, float *dP, const float *lse2, const float *D, const float *lo,
                   const float *hi, float qs, float cap2)
{
    const vf q = vset1(qs), c = vset1(cap2), one = vset1(1.0f);
    for (int r = 0; r < R; r++) {
        const vf l = vset1(lse2[r]), dd = vset1(D[r]), vlo = vset1(lo[r]), vhi = vset1(hi[r]);
        float *s = S + (size_t)r * FW_DEC_KEYS, *dp = dP + (size_t)r * FW_DEC_KEYS;
        for (int x = 0; x < FW_DEC_KEYS; x += VL) {
            const vf j = vload(dec_iota + x);
            const vm in = vmand(vge(j, vlo), vlt(j, vhi));
            vf sc = vmul(q, vload(s + x)), t = one;
            if (cap2 > 0.0f) {
                t = vtanh(sc);
                sc = vmul(c, t);
            }
            const vf p = vmaskz(in, vexp2(vsub(sc, l)));
            vf ds = vmul(p, vsub(vload(dp + x), dd));
            if (cap2 > 0.0f)
                ds = vmul(ds, vsub(one, vmul(t, t)));
            vstore(s + x, p);
            vstore(dp + x, vmaskz(in, ds));
        }
    }
}

#define FW_BWD_TABLE {.ds = bwd_ds}
