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

/* The scratch of one worker (floats): where each part starts, in the order item_of names
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

/* One item's decode and key head, its rows and slots, and its worker's scratch (as rp_layout
 * names it). Gt: the records' total log2 decay (gr's last row, rewritten per value head;
 * NULL without records: 0). */
typedef struct {
    int64_t i, hk, n, r0, Lc, rd, wr, base, R;
    int inplace; /* the records' rows read in place (contiguous), else as f32 copies */
    fw_dtype rdt;
    float *Kr, *Kd, *ur, *Kt, *ST, *zero, *Q, *S, *Pm, *O, *qn, *kn, *gr, *gn, *gnat, *un, *Sf, *row, *d, *e, *tmp;
    const void **krow, **urow, **kdrow;
    const float *Gt, *ckpt; /* ckpt: the read slot's f32 checkpoint (NULL: none) */
    float *out_state;
} rp_item;

/* Item it (decode s0 + it / n_kq, q/k head it % n_kq) on worker tid: its rows, slots and scratch. */
static rp_item item_of(const rp_ctx *c, int64_t it, int tid)
{
    const gdn_layer_prob *L = c->L;
    const gdn_replay_plan *P = c->P;
    const fw_tensor *rec = &P->R->records;
    const int64_t W = P->window, gw = L->kda ? L->dk : 1;
    rp_item m;
    m.i = c->s0 + it / L->nkq;
    m.hk = it % L->nkq;
    m.n = L->qsl[m.i + 1] - L->qsl[m.i];
    m.r0 = L->qsl[m.i] - c->R0;
    m.Lc = P->len[m.i];
    m.rd = P->rd[m.i];
    m.wr = L->wr[m.i];
    m.base = P->flush[m.i] ? 0 : m.Lc;
    m.R = 2 * m.n;
    m.inplace = rec->stride[2] == 1;
    m.rdt = m.inplace ? rec->dtype : FW_F32;
    const rp_layout l = rp_layout_of(L, W, c->nmax, c->dvp, c->nblk);
    float *ws = c->ws + (size_t)tid * c->ws_stride;
    m.Kr = ws + l.at[RP_KR]; m.Kd = ws + l.at[RP_KD]; m.ur = ws + l.at[RP_UR]; m.Kt = ws + l.at[RP_KT];
    m.ST = ws + l.at[RP_ST]; m.zero = ws + l.at[RP_ZERO]; m.Q = ws + l.at[RP_Q]; m.S = ws + l.at[RP_S];
    m.Pm = ws + l.at[RP_PM]; m.O = ws + l.at[RP_O]; m.qn = ws + l.at[RP_QN]; m.kn = ws + l.at[RP_KN];
    m.gr = ws + l.at[RP_GR]; m.gn = ws + l.at[RP_GN]; m.gnat = ws + l.at[RP_GNAT]; m.un = ws + l.at[RP_UN];
    m.Sf = ws + l.at[RP_SF]; m.row = ws + l.at[RP_ROW]; m.d = ws + l.at[RP_D]; m.e = ws + l.at[RP_E];
    m.tmp = ws + l.at[RP_TMP];
    m.krow = c->ptrs + (size_t)tid * 3 * (size_t)W;
    m.urow = m.krow + W;
    m.kdrow = m.urow + W;
    m.Gt = m.Lc ? m.gr + (m.Lc - 1) * gw : NULL;
    m.ckpt = m.rd >= 0 ? (const float *)L->caches->recurrent + m.rd * L->caches->recurrent_stride : NULL;
    m.out_state = (float *)L->caches->recurrent + m.wr * L->caches->recurrent_stride;
    return m;
}

/* The key head's rows: the records' keys (krow; Kr their f32 copies where KDA, a copy or a
 * flush needs them) and the new tokens' normalised q (scaled) and k (qn, kn). */
static void load_keys(const rp_ctx *c, const rp_item *m)
{
    const gdn_prob *p = &c->p;
    const int64_t dk = c->L->dk, koff = c->P->koff + m->hk * dk;
    const int need_kr = c->L->kda || !m->inplace || c->P->flush[m->i];
    for (int64_t j = 0; j < m->Lc; j++) {
        if (need_kr)
            rec_load(c, m->rd, j, koff, dk, m->Kr + j * dk);
        m->krow[j] = m->inplace ? (const void *)rec_at(c, m->rd, j, koff) : m->Kr + j * dk;
        m->kdrow[j] = m->Kd + j * dk;
    }
    for (int64_t t = 0; t < m->n; t++) {
        load_qk(c->kt, p, p->q, m->r0 + t, m->hk, p->scale, m->qn + t * dk);
        load_qk(c->kt, p, p->k, m->r0 + t, m->hk, 1.0, m->kn + t * dk);
    }
}

/* GDN: the records' keys against [k_t | q_t] (rows 2t, 2t + 1 of Q) into S, block by block
 * of FW_DEC_KEYS records, once for the head's value heads. */
static void gdn_record_scores(const rp_ctx *c, const rp_item *m)
{
    const int64_t dk = c->L->dk, KS = FW_DEC_KEYS;
    for (int64_t t = 0; t < m->n; t++) {
        memcpy(m->Q + 2 * t * dk, m->kn + t * dk, sizeof(float) * (size_t)dk);
        memcpy(m->Q + (2 * t + 1) * dk, m->qn + t * dk, sizeof(float) * (size_t)dk);
    }
    for (int64_t j0 = 0; j0 < m->Lc; j0 += KS)
        c->kt->dec.qk_rows((int)m->R, (int)fw_min64(KS, m->Lc - j0), (int)dk, m->Q, m->krow + j0, m->rdt, NULL, 0,
                           m->S + (j0 / KS) * m->R * KS);
}

/* Value head vh's committed records: their u rows (urow; ur their f32 copies, zero-padded to
 * dvp, where a copy or a flush needs them), and their log2 decays cumulative over the
 * records (gr). */
static void head_records(const rp_ctx *c, const rp_item *m, int64_t vh)
{
    const int64_t dv = c->L->dv, dvp = c->dvp, gw = c->L->kda ? c->L->dk : 1, goff = c->P->goff + vh * gw;
    float *gr = m->gr;
    for (int64_t j = 0; j < m->Lc; j++) {
        if (!m->inplace || c->P->flush[m->i]) {
            rec_load(c, m->rd, j, vh * dv, dv, m->ur + j * dvp);
            memset(m->ur + j * dvp + dv, 0, sizeof(float) * (size_t)(dvp - dv));
        }
        m->urow[j] = m->inplace ? (const void *)rec_at(c, m->rd, j, vh * dv) : m->ur + j * dvp;
        rec_load(c, m->rd, j, goff, gw, gr + j * gw);
        for (int64_t x = 0; x < gw; x++)
            gr[j * gw + x] = (float)(gr[j * gw + x] * FW_LOG2E) + (j ? gr[(j - 1) * gw + x] : 0.0f);
    }
}

/* The new tokens' log2 decays of value head vh, cumulative from the last record (gn), and
 * each token's own natural-log decay, the one its record keeps (gnat). */
static void head_token_decays(const rp_ctx *c, const rp_item *m, int64_t vh)
{
    const gdn_prob *p = &c->p;
    const int64_t gw = c->L->kda ? c->L->dk : 1;
    for (int64_t t = 0; t < m->n; t++) {
        float *gt = m->gn + t * gw;
        if (c->L->kda)
            kda_log2_decays(c->kt, p, m->r0 + t, vh, gt, m->tmp);
        else
            gt[0] = (float)(gate_g(p, m->r0 + t, vh) * FW_LOG2E);
        for (int64_t x = 0; x < gw; x++)
            m->gnat[t * gw + x] = (float)(gt[x] / FW_LOG2E);
        for (int64_t x = 0; t && x < gw; x++)
            gt[x] += gt[x - gw];
    }
}

/* The checkpoint of value head vh as the decode reads it (m->ckpt non-NULL): with bf16
 * products its bf16 shadow (in place when its rows are contiguous, else through f32 scratch
 * Sf), with f32 products the checkpoint itself; *dt and *ld its dtype and row stride. */
static const void *ckpt_rows(const rp_ctx *c, const rp_item *m, int64_t vh, fw_dtype *dt, int64_t *ld)
{
    const int64_t dk = c->L->dk, dv = c->L->dv;
    *dt = FW_F32;
    *ld = dv;
    if (!c->P->shadow_reads)
        return m->ckpt + vh * dk * dv;
    const fw_tensor *sh = &c->P->R->shadow;
    const char *h0 = fw_elem(sh, m->rd * sh->stride[0] + vh * sh->stride[1]);
    if (sh->stride[3] == 1) {
        *dt = FW_BF16;
        *ld = sh->stride[2];
        return h0;
    }
    for (int64_t x = 0; x < dk; x++)
        c->kt->cvt.to_f32(h0 + x * sh->stride[2] * 2, FW_BF16, sh->stride[3], dv, 1.0f, m->Sf + x * dv);
    return m->Sf;
}

/* a_t, b_t (rows 2t, 2t + 1 of O) of value head vh: the checkpoint's reads (k_t and q_t
 * against it, decayed to token t), or 0 without a checkpoint. */
static void head_checkpoint_reads(const rp_ctx *c, const rp_item *m, int64_t vh)
{
    const int64_t dk = c->L->dk, dv = c->L->dv, gw = c->L->kda ? dk : 1;
    fw_dtype hdt = FW_F32;
    int64_t hld = dv;
    const void *h = m->ckpt ? ckpt_rows(c, m, vh, &hdt, &hld) : NULL;
    for (int64_t t = 0; t < m->n; t++) {
        float *a = m->O + 2 * t * dv, *b = a + dv;
        if (m->ckpt) {
            for (int64_t x = 0; x < gw; x++)
                m->e[x] = (m->Gt ? m->Gt[x] : 0.0f) + m->gn[t * gw + x];
            c->kt->gdn.exp2_inplace(m->e, gw); /* one decay for GDN, one per channel for KDA */
            for (int64_t x = 0; x < dk; x++)
                m->d[x] = m->e[c->L->kda ? x : 0];
            c->kt->gdn.dec_reads(h, hdt, hld, (int)dk, 0, (int)dv, m->qn + t * dk, m->kn + t * dk, m->d, a, b);
        } else {
            memset(a, 0, sizeof(float) * (size_t)(2 * dv));
        }
    }
}

/* Adds to a_t, b_t the committed records' reads: the coefficients 2^(G_t - G_j) (k_t . k_j,
 * q_t . k_j) (Pm) times the records' u rows. GDN scales the scores S; KDA decays the keys
 * per channel (Kd: the records' to the last record; Q: the tokens' from it) and scores them. */
static void head_record_reads(const rp_ctx *c, const rp_item *m, int64_t vh)
{
    const fw_kernels *kt = c->kt;
    const int64_t dk = c->L->dk, dv = c->L->dv, gw = c->L->kda ? dk : 1, Lc = m->Lc, R = m->R, KS = FW_DEC_KEYS;
    if (c->L->kda) {
        for (int64_t j = 0; j < Lc; j++)
            kt->gdn.exp2_scale((int)dk, m->Kr + j * dk, m->Gt, m->gr + j * gw, m->Kd + j * dk);
        for (int64_t t = 0; t < m->n; t++) {
            kt->gdn.exp2_scale((int)dk, m->kn + t * dk, m->gn + t * gw, NULL, m->Q + 2 * t * dk);
            kt->gdn.exp2_scale((int)dk, m->qn + t * dk, m->gn + t * gw, NULL, m->Q + (2 * t + 1) * dk);
        }
        for (int64_t j0 = 0; j0 < Lc; j0 += KS)
            kt->dec.qk_rows((int)R, (int)fw_min64(KS, Lc - j0), (int)dk, m->Q, m->kdrow + j0, FW_F32, NULL, 0,
                            m->Pm + (j0 / KS) * R * KS);
    } else {
        for (int64_t j = 0; j < Lc; j++)
            for (int64_t t = 0; t < m->n; t++) {
                const float w = exp2f((m->Gt[0] - m->gr[j]) + m->gn[t]);
                const int64_t o = (j / KS) * R * KS + j % KS;
                m->Pm[o + 2 * t * KS] = w * m->S[o + 2 * t * KS];
                m->Pm[o + (2 * t + 1) * KS] = w * m->S[o + (2 * t + 1) * KS];
            }
    }
    for (int64_t j0 = 0; j0 < Lc; j0 += KS)
        kt->dec.pv((int)R, (int)fw_min64(KS, Lc - j0), (int)dv, m->Pm + (j0 / KS) * R * KS, m->urow + j0, m->rdt,
                   NULL, 0, m->O);
}

/* Token by token for value head vh: a_t, b_t plus this step's earlier tokens, then
 * u_t = beta (v - a_t) (un) and o_t = b_t + (q_t . k_t) u_t, stored to out. */
static void head_token_steps(const rp_ctx *c, const rp_item *m, int64_t vh)
{
    const gdn_prob *p = &c->p;
    const fw_kernels *kt = c->kt;
    const int64_t dk = c->L->dk, dv = c->L->dv, gw = c->L->kda ? dk : 1;
    float *row = m->row;
    for (int64_t t = 0; t < m->n; t++) {
        const float *qt = m->qn + t * dk, *kt_ = m->kn + t * dk, *gt = m->gn + t * gw;
        float *a = m->O + 2 * t * dv, *b = a + dv;
        for (int64_t j = 0; j < t; j++) {
            const float *kj = m->kn + j * dk, *uj = m->un + j * dv, *g0 = m->gn + j * gw;
            float ck, cq;
            if (c->L->kda) {
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
        const float beta = gate_beta(p, m->r0 + t, vh), qk = dotf(qt, kt_, dk);
        kt->cvt.to_f32(at(p->v, m->r0 + t, vh), p->v->dtype, p->v->stride[2], dv, 1.0f, row);
        float *ut = m->un + t * dv;
        for (int64_t y = 0; y < dv; y++) {
            ut[y] = beta * (row[y] - a[y]);
            b[y] += qk * ut[y];
        }
        kt->cvt.from_f32(b, dv, (char *)at(p->out, m->r0 + t, vh), p->out->dtype, p->out->stride[2]);
    }
}

/* A flush of value head vh folds the committed records into the checkpoint of the write
 * slot, 2^Gt S + Kt U with Kt [dk][Lc] the keys decayed to the last record (by the table's
 * qk), and writes its bf16 shadow. Rows in order: row x is read before it is written, so the
 * read slot may be the write slot. */
static void head_flush(const rp_ctx *c, const rp_item *m, int64_t vh)
{
    const fw_kernels *kt = c->kt;
    const int64_t dk = c->L->dk, dv = c->L->dv, dvp = c->dvp, gw = c->L->kda ? dk : 1, Lc = m->Lc;
    const size_t head = (size_t)(vh * dk * dv);
    float *tmp = m->tmp, *row = m->row, *e = m->e;
    if (Lc) {
        for (int64_t j = 0; j < Lc; j++) {
            if (c->L->kda) {
                memcpy(tmp, m->Kd + j * dk, sizeof(float) * (size_t)dk);
            } else {
                const float w = exp2f(m->Gt[0] - m->gr[j]);
                for (int64_t x = 0; x < dk; x++)
                    tmp[x] = w * m->Kr[j * dk + x];
            }
            for (int64_t x = 0; x < dk; x++)
                m->Kt[x * Lc + j] = tmp[x];
        }
        memset(m->zero, 0, sizeof(float) * (size_t)dvp);
        kt->mm.qk((int)dk, (int)Lc, (int)dvp, m->Kt, Lc, m->ur, m->zero, m->ST);
    }
    for (int64_t x = 0; x < gw; x++)
        e[x] = m->Gt ? m->Gt[x] : 0.0f;
    kt->gdn.exp2_inplace(e, gw);
    for (int64_t x = 0; x < dk; x++) {
        const float et = e[c->L->kda ? x : 0];
        for (int64_t y = 0; y < dv; y++)
            row[y] = (m->ckpt ? et * m->ckpt[head + x * dv + y] : 0.0f) + (Lc ? m->ST[x * dvp + y] : 0.0f);
        memcpy(m->out_state + head + x * dv, row, sizeof(float) * (size_t)dv);
    }
    const fw_tensor *sh = &c->P->R->shadow;
    for (int64_t x = 0; x < dk; x++)
        kt->cvt.from_f32(m->out_state + head + x * dv, dv,
                         (char *)fw_elem(sh, m->wr * sh->stride[0] + vh * sh->stride[1] + x * sh->stride[2]), FW_BF16,
                         sh->stride[3]);
}

/* Item: (decode, q/k head) with the value heads that share the head's keys, so that a flush
 * overwriting its slot's first records reads them all first. The records enter through the
 * decode kernels: their keys against [k_t | q_t] (dec_qk_rows), then the coefficients times
 * their u rows (dec_pv), both reading the records in place when their rows are contiguous.
 * The new tokens' records (u rows and decays per value head, then the keys) are written from
 * row base of the write slot: 0 after a flush, else after the committed ones. */
static void replay_item(void *vctx, int64_t it, int tid)
{
    const rp_ctx *c = vctx;
    const gdn_layer_prob *L = c->L;
    const int64_t dk = L->dk, dv = L->dv, gw = L->kda ? dk : 1, r = L->nv / L->nkq;
    const rp_item m = item_of(c, it, tid);
    load_keys(c, &m);
    if (!L->kda && m.Lc)
        gdn_record_scores(c, &m);
    for (int64_t vh = m.hk * r; vh < (m.hk + 1) * r; vh++) {
        head_records(c, &m, vh);
        head_token_decays(c, &m, vh);
        head_checkpoint_reads(c, &m, vh);
        if (m.Lc)
            head_record_reads(c, &m, vh);
        head_token_steps(c, &m, vh);
        if (c->P->flush[m.i])
            head_flush(c, &m, vh);
        for (int64_t t = 0; t < m.n; t++) {
            rec_store(c, m.wr, m.base + t, vh * dv, dv, m.un + t * dv);
            rec_store(c, m.wr, m.base + t, c->P->goff + vh * gw, gw, m.gnat + t * gw);
        }
    }
    for (int64_t t = 0; t < m.n; t++)
        rec_store(c, m.wr, m.base + t, c->P->koff + m.hk * dk, dk, m.kn + t * dk);
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
