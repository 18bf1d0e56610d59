/* isa_poly.h: polynomials written once over a vector layer's vfma and vset1; included by each
 * isa_*.h after those. */

/* 2^f for |f| <= 1/2 by a degree-5 polynomial, to about 2 ulp (vexp2's). */
static inline vf vexp2_poly(vf f)
{
    vf p = vfma(vset1(1.3276470126584172e-3f), f, vset1(9.675540961325169e-3f));
    p = vfma(p, f, vset1(5.550713464617729e-2f));
    p = vfma(p, f, vset1(2.4022120237350464e-1f));
    p = vfma(p, f, vset1(6.931469440460205e-1f));
    return vfma(p, f, vset1(1.0f));
}

/* 2^f for |f| <= 1/2 by a degree-3 polynomial, relative error below 7.5e-5 (2^-13.7; a
 * relative-error minimax fit, Lawson's iteration on 4001 points): for results rounded to bf16
 * (half an ulp 2^-9) or f16 (2^-11), two FMAs cheaper than vexp2's degree 5. */
static inline vf vexp2_half_poly(vf f)
{
    vf p = vfma(vset1(0.0551713765422494f), f, vset1(0.24261121066824773f));
    p = vfma(p, f, vset1(0.6932610306922079f));
    return vfma(p, f, vset1(0.9999280695723584f));
}
