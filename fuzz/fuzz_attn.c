/*
 * fuzz_attn.c: libFuzzer harness of dense and variable-length attention (fw_attn_fwd,
 * fw_attn_varlen_fwd), their fused rotary embedding, their backward (fw_attn_bwd,
 * fw_attn_varlen_bwd: after a forward that ran, on the same problem, against
 * fw_attn_bwd_ref) and the workspace query (fw_attn_workspace_size).
 * The problem: batch, lengths (mostly small, sometimes past a 64-key tile or a 512-key
 * split), heads with any GQA ratio, head dims, dtypes, layouts, params (causal, windows of any
 * sign, softcap, scale, threads, table, technique flags, precision, a caller workspace of the
 * queried size or one byte short, exactly allocated), attention sinks (fz_sinks: none, or [hq] of
 * any float dtype, layout and value class, NaN and +-inf included; with the backward, dsinks
 * now and then, or dsinks without sinks, refused), and values of three classes (fuzz_util.h).
 * Checks: the contract in fuzz_util.h, against fw_attn_ref / fw_attn_varlen_ref (and the
 * sinks' gradient against fw_attn_bwd_ref's).
 * On bf16 products the slack has 2^-8 max|v| more: the kernel rounds P = 2^(s - a) against
 * its anchor a, the reference exp(s - max) against the row's maximum, so where one key
 * dominates the reference's P is exactly 1 and the kernel's is rounded (worst case 2^-9 max|v|
 * of error, found by this harness).
 */
#include <math.h>
#include <stdlib.h>
#include <string.h>
#include "fuzz_util.h"
#include "attn/attn.h"

static const fw_dtype dts[3] = {FW_F32, FW_BF16, FW_F16};

typedef struct {
    fw_attn_params p;
    int bad;         /* a param broken on purpose */
    int short_ws;    /* workspace one byte short of the query */
    void *ws;
} params_case;

static void draw_params(fz_in *in, params_case *pc)
{
    fw_attn_params *p = &pc->p;
    fw_attn_params_init(p);
    pc->bad = pc->short_ws = 0;
    pc->ws = NULL;
    unsigned b = fz_byte(in);
    p->causal = b & 1;
    if (b & 2)
        p->window_left = fz_chance(in, 32) ? INT64_MAX : fz_range(in, -3, 70);
    if (b & 4)
        p->window_right = fz_chance(in, 32) ? INT64_MIN : fz_range(in, -3, 70);
    if (b & 8)
        p->softcap = (float)fz_range(in, 1, 200) / 8.0f;
    if (b & 16)
        p->scale = (float)(fz_range(in, -64, 64) / 32.0);
    p->threads = (int32_t)fz_range(in, 0, 3);
    p->isa = fz_isa(in);
    p->flags = fz_byte(in) & 15;
    p->flags |= fz_dec_prefetch(in);
    p->precision = (int32_t)fz_range(in, 0, 2);
    if (!fz_chance(in, 12))
        return;
    pc->bad = 1;
    switch (fz_byte(in) % 7) {
    case 0: p->scale = fz_chance(in, 128) ? NAN : -INFINITY; break;
    case 1: p->softcap = fz_chance(in, 128) ? -1.0f : NAN; break;
    case 2: p->causal = fz_chance(in, 128) ? 2 : -1; break;
    case 3: p->threads = fz_chance(in, 128) ? -1 : FW_MAX_THREADS + 1; break;
    case 4: p->precision = fz_chance(in, 128) ? 3 : -1; break;
    case 5:
        p->flags |= fz_chance(in, 128) ? FW_ATTN_DEC_PREFETCH | FW_ATTN_NO_DEC_PREFETCH
                                       : 1u << fz_range(in, 6, 31);
        break;
    case 6: p->isa = fz_chance(in, 128) ? "bogus" : ""; break;
    }
}

/* The caller workspace: none, the queried size, or one byte short. Fails if the query does. */
static int draw_workspace(fz_in *in, params_case *pc, const fw_tensor *q, const fw_tensor *k,
                          const fw_tensor *v)
{
    unsigned b = fz_byte(in) % 8;
    if (b < 5)
        return 0;
    size_t bytes;
    fw_status st = fw_attn_workspace_size(q, k, v, &pc->p, &bytes);
    if (st != FW_OK)
        return 1;
    pc->short_ws = b == 7 && bytes > 0;
    pc->p.workspace_bytes = bytes - (size_t)pc->short_ws;
    pc->ws = malloc(pc->p.workspace_bytes ? pc->p.workspace_bytes : 1);
    pc->p.workspace = pc->ws;
    return 0;
}

/* The backward of a forward that ran: dout of q's dtype, gradients of any dtype (sometimes a
 * broken descriptor, which must be refused with nothing written), the forward's params less
 * what the backward does not take; against the float64 reference given the same out and lse.
 * Slack: the gradients carry f32 roundings of the scores (smax), of P and of dP - D, relative
 * to the larger of the gradient and |dout| |v| (the scale of dP and D). */
static void check_backward(fz_in *in, const fz_tensor *q, const fz_tensor *k, const fz_tensor *v,
                           const fz_tensor *o, const fz_tensor *l, int varlen, const int32_t *cuq,
                           const int32_t *cuk, int64_t batch, const int64_t *qs, const int64_t *ks,
                           const int64_t *vs, const fw_attn_params *fp, int values, int special,
                           double smax)
{
    const int nd = varlen ? 3 : 4;
    fw_attn_params p = *fp;
    p.flags &= FW_ATTN_PLAIN;
    p.rotary_cos = p.rotary_sin = NULL;
    p.workspace = NULL;
    p.workspace_bytes = 0;
    const fw_dtype gdt = dts[fz_range(in, 0, 2)];
    fz_tensor g, dq, dk, dv;
    fz_tensor_new(in, &g, q->t.dtype, nd, o->t.shape, 0, FZ_NONE, FZ_MODERATE, 1.0);
    fz_tensor_new(in, &dq, gdt, nd, qs, 1, FZ_ALL, 0, 0);
    fz_tensor_new(in, &dk, gdt, nd, ks, 1, FZ_ALL, 0, 0);
    fz_tensor_new(in, &dv, gdt, nd, vs, 1, FZ_ALL, 0, 0);
    /* dsinks [hq] f32 mostly with sinks (sometimes broken), rarely without (refused; never
     * for an input that ends here, whose bytes read as zeros) */
    fz_tensor ds = {0};
    const int with_ds = p.sinks ? fz_chance(in, 160) : fz_byte(in) >= 252;
    if (with_ds) {
        const int64_t dshape[1] = {q->t.shape[nd - 2]};
        fz_tensor_new(in, &ds, FW_F32, 1, dshape, 1, FZ_ALL, 0, 0);
        p.dsinks = &ds.t;
    }
    const int bad = dq.bad | dk.bad | dv.bad | (with_ds && (ds.bad || !p.sinks));
    fz_describe_tensor("dout", &g, FZ_MODERATE);
    fz_describe_tensor("dq", &dq, -1);
    fz_describe_tensor("dk", &dk, -1);
    fz_describe_tensor("dv", &dv, -1);
    if (with_ds)
        fz_describe_tensor("dsinks", &ds, -1);
    unsigned char *s0 = fz_snapshot(&dq), *s1 = fz_snapshot(&dk), *s2 = fz_snapshot(&dv), *s3 = with_ds ? fz_snapshot(&ds) : NULL;
    fw_status st = varlen ? fw_attn_varlen_bwd(&q->t, &k->t, &v->t, &o->t, &g.t, &l->t, cuq, cuk,
                                               batch, &dq.t, &dk.t, &dv.t, &p)
                          : fw_attn_bwd(&q->t, &k->t, &v->t, &o->t, &g.t, &l->t, &dq.t, &dk.t,
                                        &dv.t, &p);
    FZ_CHECK(st == FW_OK || *fw_last_error(), "backward: status %d without a message", (int)st);
    if (bad)
        FZ_CHECK(st != FW_OK, "backward: a broken gradient was accepted");
    else
        FZ_CHECK(st == FW_OK, "backward of a forward that ran failed: %s", fw_last_error());
    if (st != FW_OK) {
        FZ_CHECK(fz_unchanged(&dq, s0) && fz_unchanged(&dk, s1) && fz_unchanged(&dv, s2) &&
                 (!with_ds || fz_unchanged(&ds, s3)),
                 "backward failed (%s) but wrote its outputs", fw_last_error());
    } else {
        const fz_tensor *got[3] = {&dq, &dk, &dv};
        const int64_t *shp[3] = {qs, ks, vs};
        const int64_t n[4] = {fz_numel(&dq.t), fz_numel(&dk.t), fz_numel(&dv.t), with_ds ? fz_numel(&ds.t) : 0},
                      all = n[0] + n[1] + n[2] + n[3];
        /* exact, and with the roundings of bf16 products when the call used them */
        const int bf16 = !(p.flags & FW_ATTN_PLAIN) && fw_bf16_products(p.isa, q->t.dtype, p.precision);
        double *ex = calloc((size_t)(2 * all) + 1, sizeof(double)), *sr = ex + all;
        for (int pass = 0; pass < 1 + bf16; pass++) {
            fw_tensor r[4];
            for (int i = 0, off = 0; i < 3; off += (int)n[i], i++)
                r[i] = fw_tensor_contiguous((pass ? sr : ex) + off, FW_F64, nd, shp[i]);
            r[3] = fw_tensor_contiguous((pass ? sr : ex) + n[0] + n[1] + n[2], FW_F64, 1, &n[3]);
            fw_attn_params rp = p;
            rp.dsinks = with_ds ? &r[3] : NULL;
            rp.precision = pass ? FW_PREC_BF16 : FW_PREC_F32;
            fw_status rs = varlen ? fw_attn_varlen_bwd_ref(&q->t, &k->t, &v->t, &o->t, &g.t, &l->t,
                                                           cuq, cuk, batch, &r[0], &r[1], &r[2], &rp)
                                  : fw_attn_bwd_ref(&q->t, &k->t, &v->t, &o->t, &g.t, &l->t, &r[0],
                                                    &r[1], &r[2], &rp);
            FZ_CHECK(rs == FW_OK, "the backward ran but its reference failed: %s", fw_last_error());
        }
        if (!bf16)
            memcpy(sr, ex, (size_t)all * sizeof(double));
        const double dpmax = fz_absmax(&g.t) * fz_absmax(&v->t) * (double)v->t.shape[nd - 1];
        const char *names[3] = {"dq", "dk", "dv"};
        for (int i = 0, off = 0; i < 3; off += (int)n[i], i++) {
            const double gmax = fz_absmax_d(ex + off, n[i]);
            fz_compare(names[i], &got[i]->t, sr + off, ex + off, n[i], values,
                       special ? FZ_WIDER | FZ_ANY_NONFINITE : 0,
                       (gmax + dpmax) * (2 * fz_eps(gdt) + 1e-4 + 32 * smax * 0x1p-23));
        }
        if (with_ds) {
            /* sum over the rows of exp(sink - lse) sum_x dout out: each term carries the f32
             * roundings of lse and of the products of dout and out */
            const double rows = (double)fz_numel(&l->t) / (double)fw_max64(n[3], 1);
            const double dmax = fz_absmax(&g.t) * fz_absmax(&o->t) * (double)o->t.shape[nd - 1];
            const double smax_sink = fz_absmax(p.sinks), lmax = fz_absmax(&l->t);
            const int64_t off = n[0] + n[1] + n[2];
            fz_compare("dsinks", &ds.t, sr + off, ex + off, n[3], values,
                       special ? FZ_WIDER | FZ_ANY_NONFINITE : 0,
                       (fz_absmax_d(ex + off, n[3]) + rows * dmax) *
                           (1e-4 + 128 * (lmax + smax_sink + smax) * 0x1p-23));
        }
        free(ex);
    }
    free(s0); free(s1); free(s2); free(s3);
    fz_tensor_free(&g);
    fz_tensor_free(&dq);
    fz_tensor_free(&dk);
    fz_tensor_free(&dv);
    fz_tensor_free(&ds);
}

/* The workspace query alone, on descriptors of any size (it reads no data): it never fails
 * on sizes a call accepts, and does not depend on the lengths. */
static void workspace_query(fz_in *in)
{
    static char dummy[64];
    int64_t big = fz_chance(in, 128) ? (int64_t)1 << fz_range(in, 20, 62) : fz_range(in, 0, 100);
    int64_t hkv = 1 + fz_range(in, 0, 15), hq = hkv * (1 + fz_range(in, 0, 15));
    int64_t d = 1 + fz_range(in, 0, FW_MAX_HEAD_DIM + 8), dv = 1 + fz_range(in, 0, FW_MAX_HEAD_DIM + 8);
    int64_t qs[4] = {1, big, hq, d}, ks[4] = {1, big, hkv, d}, vs[4] = {1, big, hkv, dv};
    fw_dtype dt = dts[fz_range(in, 0, 2)];
    fw_tensor q = fw_tensor_contiguous(dummy, dt, 4, qs), k = fw_tensor_contiguous(dummy, dt, 4, ks),
              v = fw_tensor_contiguous(dummy, dt, 4, vs);
    params_case pc;
    draw_params(in, &pc);
    size_t a = 0, b = 0;
    fw_status s1 = fw_attn_workspace_size(&q, &k, &v, &pc.p, &a);
    q.shape[1] = k.shape[1] = v.shape[1] = 1;
    fw_status s2 = fw_attn_workspace_size(&q, &k, &v, &pc.p, &b);
    if (d <= FW_MAX_HEAD_DIM && dv <= FW_MAX_HEAD_DIM && !pc.bad)
        FZ_CHECK(s2 == FW_OK, "workspace query of a valid problem failed: %s", fw_last_error());
    if (s1 == FW_OK && s2 == FW_OK)
        FZ_CHECK(a == b, "workspace depends on the length: %zu at %lld rows, %zu at 1", a,
                 (long long)big, b);
    FZ_CHECK(fw_attn_workspace_size(&q, &k, &v, &pc.p, NULL) != FW_OK, "NULL bytes accepted");
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    fz_in in = {data, size, 0};
    unsigned op = fz_byte(&in) % 8;
    if (op == 7) {
        workspace_query(&in);
        return 0;
    }
    const int varlen = op >= 4;
    fw_dtype dt = dts[fz_range(&in, 0, 2)], odt = dts[fz_range(&in, 0, 2)];
    int64_t hkv = 1 + fz_range(&in, 0, 2), G = 1 + fz_range(&in, 0, 3), hq = hkv * G;
    int64_t d = 1 + fz_size(&in, 15, 140), dv = fz_chance(&in, 160) ? d : 1 + fz_size(&in, 15, 140);
    int64_t batch, sq = 0, sk = 0, tq = 0, tk = 0;
    int32_t cuq[11] = {0}, cuk[11] = {0};
    if (varlen) {
        batch = fz_size(&in, 4, 10);
        for (int64_t i = 0; i < batch; i++) {
            cuq[i + 1] = cuq[i] + (int32_t)fz_size(&in, 6, 100);
            cuk[i + 1] = cuk[i] + (int32_t)fz_size(&in, 6, 100);
        }
        tq = cuq[batch];
        tk = cuk[batch];
        if ((double)tq * (double)tk * (double)(hq * (d + dv)) > (1 << 22))
            d = dv = 1 + d % 8;
    } else {
        batch = fz_size(&in, 2, 4);
        sq = fz_size(&in, 9, 140);
        sk = fz_size(&in, 9, 600);
        if (sq * sk > 8192)
            sq = 1 + sq % 4; /* a long context for a few queries: the split-KV decode */
        if (batch * hq * sq * sk * (d + dv) > (1 << 20)) { /* keeps an execution under a few ms */
            batch = sq = 1;
            d = dv = 1 + d % 8;
        }
    }
    int bad = 0; /* after the size caps, which may shrink d */
    if (fz_chance(&in, 3)) { /* head dims past the limit, or heads that do not group */
        if (fz_chance(&in, 128))
            d = FW_MAX_HEAD_DIM + 1;
        else if (hkv > 1)
            hq += 1;
        else
            hkv = 0;
        bad = 1;
    }
    int vq = fz_vclass(&in), vk = fz_vclass(&in), vv = fz_vclass(&in);
    fz_seed(&in);
    int64_t qs[4], ks[4], vs[4], os[4], ls[3];
    if (varlen) {
        int64_t q3[3] = {tq, hq, d}, k3[3] = {tk, hkv, d}, v3[3] = {tk, hkv, dv},
                o3[3] = {tq, hq, dv}, l2[2] = {hq, tq};
        memcpy(qs, q3, sizeof q3); memcpy(ks, k3, sizeof k3); memcpy(vs, v3, sizeof v3);
        memcpy(os, o3, sizeof o3); memcpy(ls, l2, sizeof l2);
    } else {
        int64_t q4[4] = {batch, sq, hq, d}, k4[4] = {batch, sk, hkv, d}, v4[4] = {batch, sk, hkv, dv},
                o4[4] = {batch, sq, hq, dv}, l3[3] = {batch, hq, sq};
        memcpy(qs, q4, sizeof q4); memcpy(ks, k4, sizeof k4); memcpy(vs, v4, sizeof v4);
        memcpy(os, o4, sizeof o4); memcpy(ls, l3, sizeof l3);
    }
    const int nd = varlen ? 3 : 4;
    fz_tensor q, k, v, o, l;
    fz_tensor_new(&in, &q, dt, nd, qs, 0, FZ_ALL, vq, 1 + fz_range(&in, 0, 2));
    fz_tensor_new(&in, &k, dt, nd, ks, 0, FZ_ALL, vk, 1 + fz_range(&in, 0, 2));
    fz_tensor_new(&in, &v, dt, nd, vs, 0, FZ_ALL, vv, 1 + fz_range(&in, 0, 2));
    fz_tensor_new(&in, &o, odt, nd, os, 1, FZ_ALL, 0, 0);
    const int with_lse = !fz_chance(&in, 40);
    fz_tensor_new(&in, &l, FW_F32, nd - 1, ls, 1, with_lse ? FZ_ALL : FZ_NONE, 0, 0);
    bad |= q.bad | k.bad | v.bad | o.bad | (with_lse && l.bad);
    if (varlen && batch && fz_chance(&in, 10)) { /* offsets that do not describe the rows */
        int64_t i = fz_range(&in, 0, batch);
        int32_t *cu = fz_chance(&in, 128) ? cuq : cuk;
        cu[i] += i == 0 || fz_chance(&in, 128) ? 1 : -1 - cu[i];
        bad |= i == 0 || i == batch || cu[i] < cu[i - 1] || cu[i] > cu[i + 1];
    }
    if (varlen && fz_chance(&in, 3)) {
        batch = -1;
        bad = 1;
    }
    params_case pc;
    draw_params(&in, &pc);
    bad |= pc.bad;
    /* a fused rotary embedding now and then: tables of any float dtype, a rotary dim past d/2
     * or too few positions or more queries than keys in some sequence are refused */
    fz_tensor rc = {0}, rs = {0};
    double rgrow = 1.0;
    if (fz_chance(&in, 40)) {
        int64_t h = d / 2 > 1 ? 1 + fz_range(&in, 0, d / 2 - 1) : 1, npos = 0, qmore = 0;
        for (int64_t i = 0; i < (varlen ? batch : 1); i++) {
            const int64_t nq = varlen ? cuq[i + 1] - cuq[i] : sq, nk = varlen ? cuk[i + 1] - cuk[i] : sk;
            npos = nk > npos ? nk : npos;
            qmore |= nq > nk && (varlen || batch > 0);
        }
        npos += fz_range(&in, 0, 2);
        if (fz_chance(&in, 16))
            npos = npos > 0 ? npos - 1 : 0;
        const int64_t tshape[2] = {npos, h};
        const fw_dtype tdt = dts[fz_range(&in, 0, 2)];
        fz_tensor_new(&in, &rc, tdt, 2, tshape, 0, FZ_NONE, FZ_MODERATE, 1.0);
        fz_tensor_new(&in, &rs, tdt, 2, tshape, 0, FZ_NONE, FZ_MODERATE, 1.0);
        pc.p.rotary_cos = &rc.t;
        pc.p.rotary_sin = &rs.t;
        pc.p.rotary_interleaved = fz_byte(&in) & 1;
        pc.p.rotary_q_only = fz_chance(&in, 64);
        int64_t need = 0; /* the positions the call uses */
        for (int64_t i = 0; i < (varlen ? batch : (batch > 0)); i++)
            need = (varlen ? cuk[i + 1] - cuk[i] : sk) > need ? (varlen ? cuk[i + 1] - cuk[i] : sk) : need;
        bad |= 2 * h > d || qmore || need > npos;
        const double t = fz_absmax(&rc.t) + fz_absmax(&rs.t);
        rgrow = t > 1.0 ? t * t : 1.0;
    }
    /* attention sinks now and then (fz_sinks) */
    fz_tensor snk;
    int vsink;
    if (fz_sinks(&in, &snk, hq, &vsink)) {
        pc.p.sinks = &snk.t;
        bad |= snk.bad;
    }
    fz_desc[0] = 0;
    fz_describe("%s batch %lld, hq %lld, hkv %lld, d %lld, dv %lld; causal %d window %lld,%lld "
                "softcap %g scale %g threads %d isa %s flags %u precision %d",
                varlen ? "varlen" : "dense", (long long)batch, (long long)hq, (long long)hkv,
                (long long)d, (long long)dv, (int)pc.p.causal, (long long)pc.p.window_left,
                (long long)pc.p.window_right, (double)pc.p.softcap, (double)pc.p.scale,
                (int)pc.p.threads, pc.p.isa ? pc.p.isa : "default", (unsigned)pc.p.flags,
                (int)pc.p.precision);
    if (varlen)
        for (int64_t i = 0; i < batch; i++)
            fz_describe("%s(%d,%d)", i ? " " : "\n  seqs ", (int)(cuq[i + 1] - cuq[i]), (int)(cuk[i + 1] - cuk[i]));
    fz_describe_tensor("q", &q, vq);
    fz_describe_tensor("k", &k, vk);
    fz_describe_tensor("v", &v, vv);
    if (pc.p.rotary_cos)
        fz_describe("\n  rotary interleaved %d q_only %d", (int)pc.p.rotary_interleaved,
                    (int)pc.p.rotary_q_only);
    if (pc.p.rotary_cos)
        fz_describe_tensor("rotary_cos", &rc, FZ_MODERATE);
    if (pc.p.sinks)
        fz_describe_tensor("sinks", &snk, vsink);
    fz_describe_tensor("out", &o, -1);
    if (with_lse)
        fz_describe_tensor("lse", &l, -1);
    if (draw_workspace(&in, &pc, &q.t, &k.t, &v.t))
        FZ_CHECK(bad, "workspace query of a valid problem failed: %s", fw_last_error());

    unsigned char *so = fz_snapshot(&o), *sl = fz_snapshot(&l);
    const fw_tensor *lp = with_lse ? &l.t : NULL;
    fw_status st = varlen ? fw_attn_varlen_fwd(&q.t, &k.t, &v.t, cuq, cuk, batch, &o.t, lp, &pc.p)
                          : fw_attn_fwd(&q.t, &k.t, &v.t, &o.t, lp, &pc.p);
    FZ_CHECK(st == FW_OK || *fw_last_error(), "status %d without a message", (int)st);
    if (bad)
        FZ_CHECK(st != FW_OK, "a broken problem was accepted");
    /* the queried size always suffices; one byte less may (a shape whose path needs less) */
    FZ_CHECK(st != FW_ERR_WORKSPACE || pc.short_ws, "the queried workspace was refused: %s", fw_last_error());
    if (st != FW_OK) {
        FZ_CHECK(fz_unchanged(&o, so) && fz_unchanged(&l, sl), "failed (%s) but wrote its outputs",
                 fw_last_error());
    } else {
        /* the references: exact (f32 products) and with the kernel's roundings */
        int64_t no = fz_numel(&o.t), nl = fz_numel(&l.t);
        double *ex = calloc((size_t)(no + nl) + 1, sizeof(double));
        double *sr = calloc((size_t)(no + nl) + 1, sizeof(double));
        fw_tensor eo = fw_tensor_contiguous(ex, FW_F64, nd, os), el = fw_tensor_contiguous(ex + no, FW_F64, nd - 1, ls);
        fw_tensor ro = fw_tensor_contiguous(sr, FW_F64, nd, os), rl = fw_tensor_contiguous(sr + no, FW_F64, nd - 1, ls);
        fw_attn_params rp = pc.p;
        const int bf16 = !(rp.flags & FW_ATTN_PLAIN) && fw_bf16_products(rp.isa, dt, rp.precision);
        rp.precision = FW_PREC_F32;
        fw_status r1 = varlen ? fw_attn_varlen_ref(&q.t, &k.t, &v.t, cuq, cuk, batch, &eo, &el, &rp, 0, INT64_MAX)
                              : fw_attn_ref(&q.t, &k.t, &v.t, &eo, &el, &rp, 0, INT64_MAX);
        FZ_CHECK(r1 == FW_OK, "the kernel ran but the reference failed: %s", fw_last_error());
        if (bf16) {
            rp.precision = FW_PREC_BF16;
            r1 = varlen ? fw_attn_varlen_ref(&q.t, &k.t, &v.t, cuq, cuk, batch, &ro, &rl, &rp, 0, INT64_MAX)
                        : fw_attn_ref(&q.t, &k.t, &v.t, &ro, &rl, &rp, 0, INT64_MAX);
            FZ_CHECK(r1 == FW_OK, "the bf16 reference failed: %s", fw_last_error());
        } else {
            memcpy(sr, ex, (size_t)(no + nl) * sizeof(double));
        }
        const int values = vq != FZ_HUGE && vk != FZ_HUGE && vv != FZ_HUGE;
        const double vmax = fz_absmax(&v.t), scale = pc.p.scale != 0 ? fabs(pc.p.scale) : 1 / sqrt((double)d);
        const double smax = scale * fz_absmax(&q.t) * fz_absmax(&k.t) * (double)d * rgrow;
        fz_compare("out", &o.t, sr, ex, no, values, vv == FZ_SPECIAL ? FZ_WIDER | FZ_ANY_NONFINITE : 0,
                   vmax * (2 * fz_eps(odt) + 1e-4 + 8 * smax * 0x1p-23 + (bf16 ? 0x1p-8 : 0)));
        if (with_lse)
            fz_compare("lse", &l.t, sr + no, ex + no, nl, values, 0, fz_lse_slack(ex + no, nl, smax));
        free(ex);
        free(sr);
        if (with_lse && !pc.p.rotary_cos && fz_chance(&in, 96))
            check_backward(&in, &q, &k, &v, &o, &l, varlen, cuq, cuk, batch, qs, ks, vs, &pc.p,
                           values, vq == FZ_SPECIAL || vk == FZ_SPECIAL || vv == FZ_SPECIAL ||
                           vsink == FZ_SPECIAL, smax);
    }
    free(so);
    free(sl);
    free(pc.ws);
    fz_tensor_free(&q);
    fz_tensor_free(&k);
    fz_tensor_free(&v);
    fz_tensor_free(&o);
    fz_tensor_free(&l);
    fz_tensor_free(&rc);
    fz_tensor_free(&rs);
    fz_tensor_free(&snk);
    return 0;
}
