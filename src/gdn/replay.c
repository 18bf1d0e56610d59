/* gdn/replay.c: ReplaySSM decodes of the GDN / KDA serving layer (fw_gdn_layer_replay,
 * flywheel-tpu's fused_conv1d_gdn_replay): the checks of the replay state, and the core of a
 * decode from its f32 checkpoint and committed records, without forming the state. With G
 * the cumulative log decay over the committed records and then the new tokens, token t reads
 *   S_t = 2^(G_t) S + sum_{j < t} 2^(G_t - G_j) k_j u_j^T      (log2 units; every exponent <= 0)
 * so the checkpoint enters only through (decayed k_t and q_t) . S, one pass over it per token
 * (the table's gdn_dec_reads), and each record through k_t . k_j and q_t . k_j. */
#include <math.h>
#include <stdlib.h>
#include <string.h>
#include "gdn.h"

int64_t fw_gdn_replay_record_dim(int64_t n_kq, int64_t n_v, int64_t d_k, int64_t d_v, int kda)
{
    if (n_kq < 0 || n_v < 0 || d_k < 0 || d_v < 0 || n_kq > FW_MAX_HEADS || n_v > FW_MAX_HEADS ||
        d_k > FW_MAX_HEAD_DIM || d_v > FW_MAX_HEAD_DIM)
        return -1;
    return n_v * d_v + n_kq * d_k + (kda ? n_v * d_k : (n_v + 127) / 128 * 128);
}

void gdn_replay_free(gdn_replay_plan *P)
{
    free(P->rd);
    P->rd = P->len = NULL;
    P->flush = NULL;
}

fw_status gdn_replay_check(const gdn_layer_prob *L, const fw_gdn_batch *batch, const fw_gdn_replay *R,
                           gdn_replay_plan *P)
{
    memset(P, 0, sizeof *P);
    if (!R)
        return fw_fail(FW_ERR_NULL, "replay is NULL");
    fw_status s;
    const fw_tensor *sh = &R->shadow, *rec = &R->records;
    if (L->caches->recurrent_dtype != FW_F32)
        return fw_fail(FW_ERR_DTYPE, "the recurrent cache is %s; ReplaySSM keeps f32 checkpoints (its bf16 copy is "
                       "recurrent_shadow)", fw_dtype_name(L->caches->recurrent_dtype));
    if ((s = fw_check_tensor(sh, "recurrent_shadow", 4, 1u << FW_BF16)) ||
        (s = fw_check_tensor(rec, "replay_state", 3, (1u << FW_F32) | (1u << FW_BF16))))
        return s;
    if (sh->shape[0] != L->slots || sh->shape[1] != L->nv || sh->shape[2] != L->dk || sh->shape[3] != L->dv)
        return fw_fail(FW_ERR_SHAPE, "recurrent_shadow is [%lld, %lld, %lld, %lld]; it must be [slots, n_v, d_k, d_v] "
                       "= [%lld, %lld, %lld, %lld]", (long long)sh->shape[0], (long long)sh->shape[1],
                       (long long)sh->shape[2], (long long)sh->shape[3], (long long)L->slots, (long long)L->nv,
                       (long long)L->dk, (long long)L->dv);
    const int64_t rdim = fw_gdn_replay_record_dim(L->nkq, L->nv, L->dk, L->dv, L->kda), window = rec->shape[1];
    if (rec->shape[0] != L->slots || rec->shape[2] != rdim)
        return fw_fail(FW_ERR_SHAPE, "replay_state is [%lld, %lld, %lld]; it must be [slots, window, record_dim] = "
                       "[%lld, window, %lld]", (long long)rec->shape[0], (long long)window,
                       (long long)rec->shape[2], (long long)L->slots, (long long)rdim);
    if (window < 1 || window < L->spec + 1)
        return fw_fail(FW_ERR_SHAPE, "replay_state keeps %lld records; the window must be at least 1 and "
                       "num_spec_tokens + 1 = %lld", (long long)window, (long long)(L->spec + 1));
    const fw_tensor *outs[2] = {sh, rec};
    static const char *onames[2] = {"recurrent_shadow", "replay_state"};
    const int64_t ext = (L->slots > 0 ? (L->slots - 1) * L->caches->recurrent_stride : 0) + L->nv * L->dk * L->dv;
    fw_tensor rv = fw_tensor_contiguous(L->caches->recurrent, FW_F32, 1, (int64_t[]){ext});
    const fw_tensor *others[5] = {L->out, L->qkv, &L->caches->conv, &rv, L->w};
    static const char *names[5] = {"out", "qkv", "the conv cache", "the recurrent cache", "conv_weight"};
    for (int i = 0; i < 2; i++) {
        if ((s = fw_check_no_alias(outs[i], onames[i])))
            return s;
        for (int j = 0; j < 5; j++)
            if (L->slots > 0 && fw_overlap(outs[i], others[j]))
                return fw_fail(FW_ERR_STRIDE, "%s overlaps %s; it must be a separate buffer", onames[i], names[j]);
    }
    if (L->slots > 0 && fw_overlap(sh, rec))
        return fw_fail(FW_ERR_STRIDE, "recurrent_shadow overlaps replay_state");
    const int64_t de = L->de, me = L->me;
    if (de > 0 && !R->replay_lens)
        return fw_fail(FW_ERR_NULL, "replay_lens is NULL");
    const int32_t *sl = batch->seq_lens, *rd0 = batch->read_state_indices ? batch->read_state_indices : L->wr;
    P->rd = malloc(sizeof(int32_t) * (size_t)(2 * (me > 0 ? me : 1)) + (size_t)(de > 0 ? de : 1));
    if (!P->rd)
        return fw_fail(FW_ERR_NOMEM, "cannot allocate the replay plan");
    P->len = P->rd + (me > 0 ? me : 1);
    P->flush = (unsigned char *)(P->len + (me > 0 ? me : 1));
    for (int64_t i = 0; i < me && !s; i++) {
        const int64_t ql = L->qsl[i + 1] - L->qsl[i];
        const int has_init = sl[i] > ql;
        if (i >= de) { /* a prefill: the layer's own read slot */
            P->rd[i] = L->ridx[i];
            continue;
        }
        const int64_t len = R->replay_lens[i];
        if (len < 0 || len > window)
            s = fw_fail(FW_ERR_INDEX, "replay_lens[%lld] is %lld; it must be 0..window = %lld", (long long)i,
                        (long long)len, (long long)window);
        else if (has_init && (rd0[i] < 0 || rd0[i] >= L->slots))
            s = fw_fail(FW_ERR_INDEX, "sequence %lld reads slot %d (read_state_indices); the caches have %lld",
                        (long long)i, (int)rd0[i], (long long)L->slots);
        P->rd[i] = has_init ? rd0[i] : -1;
        P->len[i] = has_init ? (int32_t)len : 0;
        P->flush[i] = !has_init || P->len[i] + ql > window || P->rd[i] != L->wr[i];
    }
    /* no checkpoint or records read by one sequence and written by another */
    if (!s)
        s = gdn_check_window_slots(me, de, L->qsl, P->rd, L->wr, L->slots);
    if (s) {
        gdn_replay_free(P);
        return s;
    }
    P->R = R;
    P->shadow_reads = fw_bf16_products(L->gp.isa, L->qkv->dtype, L->gp.precision);
    P->window = window;
    P->koff = L->nv * L->dv;
    P->goff = P->koff + L->nkq * L->dk;
    return FW_OK;
}

void gdn_replay_shadow(const gdn_layer_prob *L, const gdn_replay_plan *P, int64_t slot)
{
    const fw_kernels *kt = fw_kernels_get(L->gp.isa);
    const fw_tensor *sh = &P->R->shadow;
    const float *st = (const float *)L->caches->recurrent + slot * L->caches->recurrent_stride;
    for (int64_t h = 0; h < L->nv; h++)
        for (int64_t x = 0; x < L->dk; x++)
            kt->cvt.from_f32(st + (h * L->dk + x) * L->dv, L->dv,
                         (char *)fw_elem(sh, slot * sh->stride[0] + h * sh->stride[1] + x * sh->stride[2]), FW_BF16,
                         sh->stride[3]);
}

typedef struct {
    const gdn_layer_prob *L;
    const gdn_replay_plan *P;
    const fw_kernels *kt;
    gdn_prob p; /* the decodes' q, k, v, raw gates and out, rows of L->cbuf */
    int64_t s0, R0;
    int64_t nmax, dvp, nblk; /* the most tokens of a decode; dv padded to the table's vectors;
                                blocks of FW_DEC_KEYS records in a window */
    float *ws;
    size_t ws_stride;
    const void **ptrs; /* per thread: 3 x window row pointers */
} rp_ctx;

/* x . y with four running sums (one is bound by the adds' latency). */
static float dotf(const float *x, const float *y, int64_t n)
{
    float s[4] = {0.0f, 0.0f, 0.0f, 0.0f};
    int64_t i = 0;
    for (; i + 4 <= n; i += 4)
        for (int l = 0; l < 4; l++)
            s[l] += x[i + l] * y[i + l];
    for (; i < n; i++)
        s[0] += x[i] * y[i];
    return (s[0] + s[1]) + (s[2] + s[3]);
}

/* Record row `row` of slot `slot`, from entry col: its address; n entries to f32; from f32. */
static const char *rec_at(const rp_ctx *c, int64_t slot, int64_t row, int64_t col)
{
    const fw_tensor *r = &c->P->R->records;
    return fw_elem(r, slot * r->stride[0] + row * r->stride[1] + col * r->stride[2]);
}

static void rec_load(const rp_ctx *c, int64_t slot, int64_t row, int64_t col, int64_t n, float *dst)
{
    const fw_tensor *r = &c->P->R->records;
    c->kt->cvt.to_f32(rec_at(c, slot, row, col), r->dtype, r->stride[2], n, 1.0f, dst);
}

static void rec_store(const rp_ctx *c, int64_t slot, int64_t row, int64_t col, int64_t n, const float *src)
{
    const fw_tensor *r = &c->P->R->records;
    c->kt->cvt.from_f32(src, n, (char *)rec_at(c, slot, row, col), r->dtype, r->stride[2]);
}

/* The scratch of one worker (floats): where each part starts, in the order replay_item names
 * them, each on its own 64 bytes. */
enum { RP_KR, RP_KD, RP_UR, RP_KT, RP_ST, RP_ZERO, RP_Q, RP_S, RP_PM, RP_O, RP_QN, RP_KN, RP_GR, RP_GN, RP_GNAT,
       RP_UN, RP_SF, RP_ROW, RP_D, RP_E, RP_TMP, RP_PARTS };
typedef struct {
    int64_t at[RP_PARTS], total;
} rp_layout;

static rp_layout rp_layout_of(const gdn_layer_prob *L, int64_t W, int64_t nmax, int64_t dvp, int64_t nblk)
{
    const int64_t dk = L->dk, dv = L->dv, gw = L->kda ? dk : 1, R = 2 * nmax, K = FW_DEC_KEYS;
    const int64_t sizes[RP_PARTS] = {W * dk, W * dk, W * dvp, dk * W, dk * dvp, dvp, R * dk, nblk * R * K,
                                     nblk * R * K, R * dv, nmax * dk, nmax * dk, W * gw, nmax * gw, nmax * gw,
                                     nmax * dv, dk * dv, fw_max64(dk, dv), dk, dk, dk};
    rp_layout l;
    l.total = 0;
    for (int i = 0; i < RP_PARTS; i++) {
        l.at[i] = l.total;
        l.total += (sizes[i] + 15) / 16 * 16;
    }
    return l;
}

/* Item: (decode, q/k head) with the value heads that share the head's keys, so that a flush
 * overwriting its slot's first records reads them all first. The records enter through the
 * decode kernels: their keys against [k_t | q_t] (dec_qk_rows), then the coefficients times
 * their u rows (dec_pv), both reading the records in place when their rows are contiguous. */
static void replay_item(void *vctx, int64_t it, int tid)
{
    const rp_ctx *c = vctx;
    const gdn_layer_prob *L = c->L;
    const gdn_replay_plan *P = c->P;
    const gdn_prob *p = &c->p;
    const fw_kernels *kt = c->kt;
    const fw_tensor *rec = &P->R->records;
    const int64_t i = c->s0 + it / L->nkq, hk = it % L->nkq, r = L->nv / L->nkq;
    const int64_t dk = L->dk, dv = L->dv, gw = L->kda ? dk : 1, dvp = c->dvp, KS = FW_DEC_KEYS;
    const int64_t n = L->qsl[i + 1] - L->qsl[i], r0 = L->qsl[i] - c->R0, Lc = P->len[i], W = P->window;
    const int64_t rd = P->rd[i], wr = L->wr[i], base = P->flush[i] ? 0 : Lc, R = 2 * n;
    const rp_layout l = rp_layout_of(L, W, c->nmax, dvp, c->nblk);
    float *ws = c->ws + (size_t)tid * c->ws_stride;
    float *Kr = ws + l.at[RP_KR], *Kd = ws + l.at[RP_KD], *ur = ws + l.at[RP_UR], *Kt = ws + l.at[RP_KT];
    float *ST = ws + l.at[RP_ST], *zero = ws + l.at[RP_ZERO], *Q = ws + l.at[RP_Q], *S = ws + l.at[RP_S];
    float *Pm = ws + l.at[RP_PM], *O = ws + l.at[RP_O], *qn = ws + l.at[RP_QN], *kn = ws + l.at[RP_KN];
    float *gr = ws + l.at[RP_GR], *gn = ws + l.at[RP_GN], *gnat = ws + l.at[RP_GNAT], *un = ws + l.at[RP_UN];
    float *Sf = ws + l.at[RP_SF], *row = ws + l.at[RP_ROW], *d = ws + l.at[RP_D], *e = ws + l.at[RP_E];
    float *tmp = ws + l.at[RP_TMP];
    const void **krow = c->ptrs + (size_t)tid * 3 * (size_t)W, **urow = krow + W, **kdrow = urow + W;
    /* the records' rows in place (contiguous), else as f32 copies */
    const int inplace = rec->stride[2] == 1;
    const fw_dtype rdt = inplace ? rec->dtype : FW_F32;
    const int need_kr = L->kda || !inplace || P->flush[i];
    for (int64_t j = 0; j < Lc; j++) {
        if (need_kr)
            rec_load(c, rd, j, P->koff + hk * dk, dk, Kr + j * dk);
        krow[j] = inplace ? (const void *)rec_at(c, rd, j, P->koff + hk * dk) : Kr + j * dk;
        kdrow[j] = Kd + j * dk;
    }
    for (int64_t t = 0; t < n; t++) {
        load_qk(kt, p, p->q, r0 + t, hk, p->scale, qn + t * dk);
        load_qk(kt, p, p->k, r0 + t, hk, 1.0, kn + t * dk);
    }
    /* GDN: the records' keys against [k_t | q_t], once for the head's value heads */
    if (!L->kda && Lc) {
        for (int64_t t = 0; t < n; t++) {
            memcpy(Q + 2 * t * dk, kn + t * dk, sizeof(float) * (size_t)dk);
            memcpy(Q + (2 * t + 1) * dk, qn + t * dk, sizeof(float) * (size_t)dk);
        }
        for (int64_t j0 = 0; j0 < Lc; j0 += KS)
            kt->dec.qk_rows((int)R, (int)fw_min64(KS, Lc - j0), (int)dk, Q, krow + j0, rdt, NULL, 0,
                            S + (j0 / KS) * R * KS);
    }
    const float *ckpt = rd >= 0 ? (const float *)L->caches->recurrent + rd * L->caches->recurrent_stride : NULL;
    float *out_state = (float *)L->caches->recurrent + wr * L->caches->recurrent_stride;
    for (int64_t vh = hk * r; vh < (hk + 1) * r; vh++) {
        /* the committed records of this head: u rows, and the cumulative log2 decays */
        for (int64_t j = 0; j < Lc; j++) {
            if (!inplace || P->flush[i]) {
                rec_load(c, rd, j, vh * dv, dv, ur + j * dvp);
                memset(ur + j * dvp + dv, 0, sizeof(float) * (size_t)(dvp - dv));
            }
            urow[j] = inplace ? (const void *)rec_at(c, rd, j, vh * dv) : ur + j * dvp;
            rec_load(c, rd, j, P->goff + vh * gw, gw, gr + j * gw);
            for (int64_t x = 0; x < gw; x++)
                gr[j * gw + x] = (float)(gr[j * gw + x] * FW_LOG2E) + (j ? gr[(j - 1) * gw + x] : 0.0f);
        }
        const float *Gt = Lc ? gr + (Lc - 1) * gw : NULL; /* total over the records (NULL: 0) */
        /* the new tokens' log2 decays, cumulative from the last record */
        for (int64_t t = 0; t < n; t++) {
            float *gt = gn + t * gw;
            if (L->kda)
                kda_log2_decays(kt, p, r0 + t, vh, gt, tmp);
            else
                gt[0] = (float)(gate_g(p, r0 + t, vh) * FW_LOG2E);
            for (int64_t x = 0; x < gw; x++)
                gnat[t * gw + x] = (float)(gt[x] / FW_LOG2E);
            for (int64_t x = 0; t && x < gw; x++)
                gt[x] += gt[x - gw];
        }
        const size_t head = (size_t)(vh * dk * dv);
        /* bf16 products read the checkpoint's bf16 shadow (in place when its rows are
         * contiguous, else through f32 scratch), f32 products the checkpoint itself */
        const void *hsrc = NULL;
        fw_dtype hdt = FW_F32;
        int64_t hld = dv;
        if (ckpt && P->shadow_reads) {
            const fw_tensor *sh = &P->R->shadow;
            const char *h0 = fw_elem(sh, rd * sh->stride[0] + vh * sh->stride[1]);
            if (sh->stride[3] == 1) {
                hsrc = h0;
                hdt = FW_BF16;
                hld = sh->stride[2];
            } else {
                for (int64_t x = 0; x < dk; x++)
                    kt->cvt.to_f32(h0 + x * sh->stride[2] * 2, FW_BF16, sh->stride[3], dv, 1.0f, Sf + x * dv);
                hsrc = Sf;
            }
        }
        /* a_t, b_t (rows 2t, 2t + 1 of O): the checkpoint's reads, decayed to token t */
        for (int64_t t = 0; t < n; t++) {
            float *a = O + 2 * t * dv, *b = a + dv;
            if (ckpt) {
                for (int64_t x = 0; x < gw; x++)
                    e[x] = (Gt ? Gt[x] : 0.0f) + gn[t * gw + x];
                kt->gdn.exp2_inplace(e, gw); /* one decay for GDN, one per channel for KDA */
                for (int64_t x = 0; x < dk; x++)
                    d[x] = e[L->kda ? x : 0];
                kt->gdn.dec_reads(hsrc ? hsrc : ckpt + head, hdt, hld, (int)dk, 0, (int)dv, qn + t * dk, kn + t * dk, d,
                                  a, b);
            } else {
                memset(a, 0, sizeof(float) * (size_t)(2 * dv));
            }
        }
        /* plus the committed records': coefficients 2^(G_t - G_j) (k_t . k_j, q_t . k_j) */
        if (Lc) {
            if (L->kda) { /* per channel: the keys decayed to the last record, the tokens' from it */
                for (int64_t j = 0; j < Lc; j++)
                    kt->gdn.exp2_scale((int)dk, Kr + j * dk, Gt, gr + j * gw, Kd + j * dk);
                for (int64_t t = 0; t < n; t++) {
                    kt->gdn.exp2_scale((int)dk, kn + t * dk, gn + t * gw, NULL, Q + 2 * t * dk);
                    kt->gdn.exp2_scale((int)dk, qn + t * dk, gn + t * gw, NULL, Q + (2 * t + 1) * dk);
                }
                for (int64_t j0 = 0; j0 < Lc; j0 += KS)
                    kt->dec.qk_rows((int)R, (int)fw_min64(KS, Lc - j0), (int)dk, Q, kdrow + j0, FW_F32, NULL, 0,
                                    Pm + (j0 / KS) * R * KS);
            } else {
                for (int64_t j = 0; j < Lc; j++)
                    for (int64_t t = 0; t < n; t++) {
                        const float w = exp2f((Gt[0] - gr[j]) + gn[t]);
                        const int64_t o = (j / KS) * R * KS + j % KS;
                        Pm[o + 2 * t * KS] = w * S[o + 2 * t * KS];
                        Pm[o + (2 * t + 1) * KS] = w * S[o + (2 * t + 1) * KS];
                    }
            }
            for (int64_t j0 = 0; j0 < Lc; j0 += KS)
                kt->dec.pv((int)R, (int)fw_min64(KS, Lc - j0), (int)dv, Pm + (j0 / KS) * R * KS, urow + j0, rdt, NULL,
                           0, O);
        }
        /* token by token: this step's earlier tokens, then u_t = beta (v - k_t S_t) and
         * o_t = q_t S_t + (q_t . k_t) u_t */
        for (int64_t t = 0; t < n; t++) {
            const float *qt = qn + t * dk, *kt_ = kn + t * dk, *gt = gn + t * gw;
            float *a = O + 2 * t * dv, *b = a + dv;
            for (int64_t j = 0; j < t; j++) {
                const float *kj = kn + j * dk, *uj = un + j * dv, *g0 = gn + j * gw;
                float ck, cq;
                if (L->kda) {
                    kt->gdn.exp2_scale((int)dk, kj, gt, g0, row);
                    ck = dotf(kt_, row, dk);
                    cq = dotf(qt, row, dk);
                } else {
                    const float w = exp2f(gt[0] - g0[0]);
                    ck = w * dotf(kt_, kj, dk);
                    cq = w * dotf(qt, kj, dk);
                }
                for (int64_t y = 0; y < dv; y++) {
                    a[y] += ck * uj[y];
                    b[y] += cq * uj[y];
                }
            }
            const float beta = gate_beta(p, r0 + t, vh), qk = dotf(qt, kt_, dk);
            kt->cvt.to_f32(at(p->v, r0 + t, vh), p->v->dtype, p->v->stride[2], dv, 1.0f, row);
            float *ut = un + t * dv;
            for (int64_t y = 0; y < dv; y++) {
                ut[y] = beta * (row[y] - a[y]);
                b[y] += qk * ut[y];
            }
            kt->cvt.from_f32(b, dv, (char *)at(p->out, r0 + t, vh), p->out->dtype, p->out->stride[2]);
        }
        /* a flush folds the committed records into the checkpoint of the write slot:
         * 2^Gt S + Kt U, Kt [dk][Lc] the keys decayed to the last record, by the table's qk
         * (rows in order: row x is read before it is written, so the read slot may be the
         * write slot) */
        if (P->flush[i]) {
            if (Lc) {
                for (int64_t j = 0; j < Lc; j++) {
                    if (L->kda) {
                        memcpy(tmp, Kd + j * dk, sizeof(float) * (size_t)dk);
                    } else {
                        const float w = exp2f(Gt[0] - gr[j]);
                        for (int64_t x = 0; x < dk; x++)
                            tmp[x] = w * Kr[j * dk + x];
                    }
                    for (int64_t x = 0; x < dk; x++)
                        Kt[x * Lc + j] = tmp[x];
                }
                memset(zero, 0, sizeof(float) * (size_t)dvp);
                kt->mm.qk((int)dk, (int)Lc, (int)dvp, Kt, Lc, ur, zero, ST);
            }
            for (int64_t x = 0; x < gw; x++)
                e[x] = Gt ? Gt[x] : 0.0f;
            kt->gdn.exp2_inplace(e, gw);
            for (int64_t x = 0; x < dk; x++) {
                const float et = e[L->kda ? x : 0];
                for (int64_t y = 0; y < dv; y++)
                    row[y] = (ckpt ? et * ckpt[head + x * dv + y] : 0.0f) + (Lc ? ST[x * dvp + y] : 0.0f);
                memcpy(out_state + head + x * dv, row, sizeof(float) * (size_t)dv);
            }
            const fw_tensor *sh = &P->R->shadow;
            for (int64_t x = 0; x < dk; x++)
                kt->cvt.from_f32(out_state + head + x * dv, dv,
                             (char *)fw_elem(sh, wr * sh->stride[0] + vh * sh->stride[1] + x * sh->stride[2]), FW_BF16,
                             sh->stride[3]);
        }
        for (int64_t t = 0; t < n; t++) {
            rec_store(c, wr, base + t, vh * dv, dv, un + t * dv);
            rec_store(c, wr, base + t, P->goff + vh * gw, gw, gnat + t * gw);
        }
    }
    for (int64_t t = 0; t < n; t++)
        rec_store(c, wr, base + t, P->koff + hk * dk, dk, kn + t * dk);
}

fw_status gdn_replay_run(const gdn_layer_prob *L, const gdn_replay_plan *P, int64_t s0, int64_t s1)
{
    rp_ctx c;
    memset(&c, 0, sizeof c);
    c.L = L;
    c.P = P;
    c.kt = fw_kernels_get(L->gp.isa);
    c.s0 = s0;
    c.R0 = L->qsl[s0];
    const int64_t rn = L->qsl[s1] - c.R0, dim = L->dim;
    fw_tensor y2 = fw_tensor_contiguous(L->cbuf, L->qkv->dtype, 2, (int64_t[]){rn, dim});
    fw_tensor q = gdn_rows_view(&y2, 0, rn, 0, L->nkq, L->dk);
    fw_tensor k = gdn_rows_view(&y2, 0, rn, L->nkq * L->dk, L->nkq, L->dk);
    fw_tensor v = gdn_rows_view(&y2, 0, rn, 2 * L->nkq * L->dk, L->nv, L->dv);
    fw_tensor o = gdn_rows_view(L->out, c.R0, rn, 0, L->nv, L->dv);
    fw_tensor tg = L->kda ? gdn_rows_view(L->a, c.R0, rn, 0, L->nv, L->dk) : gdn_rows2(L->a, c.R0, rn);
    fw_tensor tb = gdn_rows2(L->b, c.R0, rn);
    fw_status s = fw_gdn_check(&c.p, &q, &k, &v, &tg, &tb, NULL, 0, 0, &o, &L->gp, 0);
    if (s)
        return s;
    c.nmax = 1;
    for (int64_t i = s0; i < s1; i++)
        c.nmax = fw_max64(c.nmax, L->qsl[i + 1] - L->qsl[i]);
    c.dvp = (L->dv + c.kt->vl - 1) / c.kt->vl * c.kt->vl;
    c.nblk = (P->window + FW_DEC_KEYS - 1) / FW_DEC_KEYS;
    c.ws_stride = (size_t)rp_layout_of(L, P->window, c.nmax, c.dvp, c.nblk).total;
    const int threads = fw_threads(L->gp.threads);
    c.ws = aligned_alloc(64, (size_t)threads * c.ws_stride * sizeof(float));
    c.ptrs = malloc(sizeof(void *) * (size_t)(threads * 3 * P->window));
    if (!c.ws || !c.ptrs) {
        free(c.ws);
        free(c.ptrs);
        return fw_fail(FW_ERR_NOMEM, "cannot allocate the replay workspace");
    }
    fw_parallel(threads, (s1 - s0) * L->nkq, replay_item, &c);
    free(c.ws);
    free(c.ptrs);
    return FW_OK;
}
