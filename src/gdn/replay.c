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
    P->shadow_reads = fw_attn_bf16_products(L->qkv->dtype, L->gp.precision);
    P->window = window;
    P->koff = L->nv * L->dv;
    P->goff = P->koff + L->nkq * L->dk;
    return FW_OK;
}

void gdn_replay_shadow(const gdn_layer_prob *L, const gdn_replay_plan *P, int64_t slot)
{
    const fw_kernels *kt = fw_kernels_get(L->gp.isa);
    const fw_tensor *sh = &P->R->shadow;
    const float *st = L->caches->recurrent + slot * L->caches->recurrent_stride;
    for (int64_t h = 0; h < L->nv; h++)
        for (int64_t x = 0; x < L->dk; x++)
            kt->from_f32(st + (h * L->dk + x) * L->dv, L->dv,
                         (char *)fw_elem(sh, slot * sh->stride[0] + h * sh->stride[1] + x * sh->stride[2]), FW_BF16,
                         sh->stride[3]);
}

typedef struct {
    const gdn_layer_prob *L;
    const gdn_replay_plan *P;
    const fw_kernels *kt;
    gdn_prob p; /* the decodes' q, k, v, raw gates and out, rows of L->cbuf */
    int64_t s0, R0;
    float *ws;
    size_t ws_stride;
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

/* Record row `row` of slot `slot`, from entry col: n entries to f32, or from f32. */
static void rec_load(const rp_ctx *c, int64_t slot, int64_t row, int64_t col, int64_t n, float *dst)
{
    const fw_tensor *r = &c->P->R->records;
    c->kt->to_f32(fw_elem(r, slot * r->stride[0] + row * r->stride[1] + col * r->stride[2]), r->dtype, r->stride[2], n,
                  1.0f, dst);
}

static void rec_store(const rp_ctx *c, int64_t slot, int64_t row, int64_t col, int64_t n, const float *src)
{
    const fw_tensor *r = &c->P->R->records;
    c->kt->from_f32(src, n, (char *)fw_elem(r, slot * r->stride[0] + row * r->stride[1] + col * r->stride[2]), r->dtype,
                    r->stride[2]);
}

/* Item: (decode, q/k head) with the value heads that share the head's keys, so that a flush
 * overwriting its slot's first records reads them all first. */
static void replay_item(void *vctx, int64_t it, int tid)
{
    const rp_ctx *c = vctx;
    const gdn_layer_prob *L = c->L;
    const gdn_replay_plan *P = c->P;
    const gdn_prob *p = &c->p;
    const fw_kernels *kt = c->kt;
    const int64_t i = c->s0 + it / L->nkq, hk = it % L->nkq, r = L->nv / L->nkq;
    const int64_t dk = L->dk, dv = L->dv, gw = L->kda ? dk : 1, dvp = (dv + kt->vl - 1) / kt->vl * kt->vl;
    const int64_t n = L->qsl[i + 1] - L->qsl[i], r0 = L->qsl[i] - c->R0, Lc = P->len[i], W = P->window;
    const int64_t rd = P->rd[i], wr = L->wr[i], base = P->flush[i] ? 0 : Lc;
    float *Kr = c->ws + (size_t)tid * c->ws_stride, *qn = Kr + W * dk, *kn = qn + n * dk, *ur = kn + n * dk;
    float *Kt = ur + W * dvp, *ST = Kt + dk * W, *zero = ST + dk * dvp; /* the flush's product */
    const int64_t M = (2 * n + kt->vl - 1) / kt->vl * kt->vl; /* GDN: [k_t | q_t] . k_j by the table's qk */
    float *QT = zero + fw_max64(dvp, M), *C = QT + dk * M;
    float *Sf = C + W * M; /* a shadow head in f32, when its rows are strided */
    float *gr = Sf + dk * dv, *gn = gr + W * gw, *un = gn + n * gw, *a = un + n * dv, *b = a + dv, *row = b + dv;
    float *d = row + fw_max64(dk, dv), *e = d + dk, *tmp = e + dk, *gnat = tmp + dk;
    for (int64_t j = 0; j < Lc; j++)
        rec_load(c, rd, j, P->koff + hk * dk, dk, Kr + j * dk);
    for (int64_t t = 0; t < n; t++) {
        load_qk(kt, p, p->q, r0 + t, hk, p->scale, qn + t * dk);
        load_qk(kt, p, p->k, r0 + t, hk, 1.0, kn + t * dk);
    }
    if (!L->kda && Lc) { /* the committed keys against [k_t | q_t]: C [Lc][M] */
        memset(QT, 0, sizeof(float) * (size_t)(dk * M));
        memset(zero, 0, sizeof(float) * (size_t)M);
        for (int64_t t = 0; t < n; t++)
            for (int64_t x = 0; x < dk; x++) {
                QT[x * M + 2 * t] = kn[t * dk + x];
                QT[x * M + 2 * t + 1] = qn[t * dk + x];
            }
        kt->qk((int)Lc, (int)dk, (int)M, Kr, dk, QT, zero, C);
    }
    const float *ckpt = rd >= 0 ? L->caches->recurrent + rd * L->caches->recurrent_stride : NULL;
    float *out_state = L->caches->recurrent + wr * L->caches->recurrent_stride;
    for (int64_t vh = hk * r; vh < (hk + 1) * r; vh++) {
        /* the committed records of this head: u, and the cumulative log2 decays */
        for (int64_t j = 0; j < Lc; j++) {
            rec_load(c, rd, j, vh * dv, dv, ur + j * dvp);
            memset(ur + j * dvp + dv, 0, sizeof(float) * (size_t)(dvp - dv));
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
                    kt->to_f32(h0 + x * sh->stride[2] * 2, FW_BF16, sh->stride[3], dv, 1.0f, Sf + x * dv);
                hsrc = Sf;
            }
        }
        for (int64_t t = 0; t < n; t++) {
            const float *qt = qn + t * dk, *kt_ = kn + t * dk, *gt = gn + t * gw;
            /* e = G_t in log2 units, per channel (from the checkpoint) */
            for (int64_t x = 0; x < gw; x++)
                e[x] = (Gt ? Gt[x] : 0.0f) + gt[x];
            if (ckpt) {
                for (int64_t x = 0; x < dk; x++)
                    d[x] = e[L->kda ? x : 0];
                kt->exp2_inplace(d, dk);
                if (hsrc)
                    kt->gdn_dec_reads(hsrc, hdt, hld, (int)dk, 0, (int)dv, qt, kt_, d, a, b);
                else
                    kt->gdn_dec_reads(ckpt + head, FW_F32, dv, (int)dk, 0, (int)dv, qt, kt_, d, a, b);
            } else {
                memset(a, 0, sizeof(float) * (size_t)dv);
                memset(b, 0, sizeof(float) * (size_t)dv);
            }
            /* committed records j, then this step's earlier tokens */
            for (int64_t j = 0; j < Lc + t; j++) {
                const int new_tok = j >= Lc;
                const float *kj = new_tok ? kn + (j - Lc) * dk : Kr + j * dk;
                const float *uj = new_tok ? un + (j - Lc) * dv : ur + j * dvp;
                const float *g0 = new_tok ? gn + (j - Lc) * gw : gr + j * gw; /* G_j, on e's scale */
                float ck, cq;
                if (L->kda) {
                    if (!new_tok) { /* G_j of a record is from the first record: e - G_j = Gt - G_j + gt */
                        for (int64_t x = 0; x < dk; x++)
                            tmp[x] = g0[x] - (Gt ? Gt[x] : 0.0f);
                        g0 = tmp;
                    }
                    float *w = row; /* k_j decayed to t per channel, then the two dots */
                    kt->exp2_scale((int)dk, kj, gt, g0, w);
                    ck = dotf(kt_, w, dk);
                    cq = dotf(qt, w, dk);
                } else if (new_tok) {
                    const float w = exp2f(gt[0] - g0[0]);
                    ck = w * dotf(kt_, kj, dk);
                    cq = w * dotf(qt, kj, dk);
                } else {
                    const float w = exp2f((Gt[0] - g0[0]) + gt[0]);
                    ck = w * C[j * M + 2 * t];
                    cq = w * C[j * M + 2 * t + 1];
                }
                for (int64_t y = 0; y < dv; y++) {
                    a[y] += ck * uj[y];
                    b[y] += cq * uj[y];
                }
            }
            /* u_t = beta (v - k_t S_t), o_t = q_t S_t + (q_t . k_t) u_t */
            const float beta = gate_beta(p, r0 + t, vh), qk = dotf(qt, kt_, dk);
            kt->to_f32(at(p->v, r0 + t, vh), p->v->dtype, p->v->stride[2], dv, 1.0f, row);
            float *ut = un + t * dv;
            for (int64_t y = 0; y < dv; y++) {
                ut[y] = beta * (row[y] - a[y]);
                b[y] += qk * ut[y];
            }
            kt->from_f32(b, dv, (char *)at(p->out, r0 + t, vh), p->out->dtype, p->out->stride[2]);
        }
        /* a flush folds the committed records into the checkpoint of the write slot:
         * 2^Gt S + Kt U, Kt [dk][Lc] the keys decayed to the last record, by the table's qk
         * (rows in order: row x is read before it is written, so the read slot may be the
         * write slot) */
        if (P->flush[i]) {
            if (Lc) {
                for (int64_t j = 0; j < Lc; j++) {
                    if (L->kda) {
                        kt->exp2_scale((int)dk, Kr + j * dk, Gt, gr + j * gw, tmp);
                    } else {
                        const float w = exp2f(Gt[0] - gr[j]);
                        for (int64_t x = 0; x < dk; x++)
                            tmp[x] = w * Kr[j * dk + x];
                    }
                    for (int64_t x = 0; x < dk; x++)
                        Kt[x * Lc + j] = tmp[x];
                }
                memset(zero, 0, sizeof(float) * (size_t)dvp);
                kt->qk((int)dk, (int)Lc, (int)dvp, Kt, Lc, ur, zero, ST);
            }
            for (int64_t x = 0; x < gw; x++)
                e[x] = Gt ? Gt[x] : 0.0f;
            kt->exp2_inplace(e, gw);
            for (int64_t x = 0; x < dk; x++) {
                const float et = e[L->kda ? x : 0];
                for (int64_t y = 0; y < dv; y++)
                    row[y] = (ckpt ? et * ckpt[head + x * dv + y] : 0.0f) + (Lc ? ST[x * dvp + y] : 0.0f);
                memcpy(out_state + head + x * dv, row, sizeof(float) * (size_t)dv);
            }
            const fw_tensor *sh = &P->R->shadow;
            for (int64_t x = 0; x < dk; x++)
                kt->from_f32(out_state + head + x * dv, dv,
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
    int64_t nmax = 1;
    for (int64_t i = s0; i < s1; i++)
        nmax = fw_max64(nmax, L->qsl[i + 1] - L->qsl[i]);
    const int64_t dk = L->dk, dv = L->dv, gw = L->kda ? dk : 1, W = P->window;
    const int64_t dvp = (dv + c.kt->vl - 1) / c.kt->vl * c.kt->vl;
    const int64_t M = (2 * nmax + c.kt->vl - 1) / c.kt->vl * c.kt->vl;
    /* Kr, ur, Kt, C, gr: W rows; ST, zero, QT; qn, kn, gn, un, gnat: nmax rows; a, b, row, d, e, tmp */
    c.ws_stride = (size_t)(W * (2 * dk + dvp + M + gw) + dk * dvp + fw_max64(dvp, M) + dk * M + dk * dv +
                           nmax * (2 * dk + dv + 2 * gw) + 2 * dv + fw_max64(dk, dv) + 3 * dk + 16);
    const int threads = fw_threads(L->gp.threads);
    if (!(c.ws = malloc((size_t)threads * c.ws_stride * sizeof(float))))
        return fw_fail(FW_ERR_NOMEM, "cannot allocate the replay workspace");
    fw_parallel(threads, (s1 - s0) * L->nkq, replay_item, &c);
    free(c.ws);
    return FW_OK;
}
