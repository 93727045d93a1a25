//! Reference quantisers for the K-quant super-blocks (Q4_K, Q5_K, Q6_K),
//! following ggml's `quantize_row_q{4,5,6}_K_ref` — what `llama-quantize`
//! runs when no importance matrix is given — operation for operation, so a
//! file written here holds the blocks llama.cpp would write (checked against
//! blocks it produced: `tests/kquant_fixtures.rs`). Used to build test models
//! and benchmark weights; not a hot path.

use crate::formats::{WeightType, QK_K};

/// ggml's `GROUP_MAX_EPS`: a group whose largest magnitude is below this is
/// all zeros.
const GROUP_MAX_EPS: f32 = 1e-15;

/// ggml's `nearest_int`: round half to even through the float adder (valid
/// for |v| < 2^22, as ggml asserts).
fn nearest_int(v: f32) -> i32 {
    let bits = (v + 12_582_912.0).to_bits() as i32;
    (bits & 0x007f_ffff) - 0x0040_0000
}

fn f16_bytes(v: f32) -> [u8; 2] {
    half::f16::from_f32(v).to_bits().to_le_bytes()
}

fn f16_round(v: f32) -> f32 {
    half::f16::from_f32(v).to_f32()
}

/// ggml's `make_qkx2_quants`: codes `l[i]` in `0..=nmax` and `(scale, −min)`
/// minimising the weighted squared error of `scale·l + min`, searching
/// `nstep + 1` candidate scales around `nmax / (max − min)`.
fn make_qkx2_quants(
    nmax: i32,
    x: &[f32],
    weights: &[f32],
    l_out: &mut [u8],
    rmin: f32,
    rdelta: f32,
    nstep: i32,
) -> (f32, f32) {
    let n = x.len();
    let mut min = x[0];
    let mut max = x[0];
    let mut sum_w = weights[0];
    let mut sum_x = sum_w * x[0];
    for i in 1..n {
        if x[i] < min {
            min = x[i];
        }
        if x[i] > max {
            max = x[i];
        }
        let w = weights[i];
        sum_w += w;
        sum_x += w * x[i];
    }
    if min > 0.0 {
        min = 0.0;
    }
    if max == min {
        l_out.fill(0);
        return (0.0, -min);
    }
    let mut iscale = nmax as f32 / (max - min);
    let mut scale = 1.0 / iscale;
    let mut best_error = 0.0f32;
    for i in 0..n {
        let l = nearest_int(iscale * (x[i] - min)).clamp(0, nmax);
        l_out[i] = l as u8;
        let diff = scale * l as f32 + min - x[i];
        best_error += weights[i] * (diff * diff);
    }
    let mut laux = [0u8; 32];
    for is in 0..=nstep {
        iscale = (rmin + rdelta * is as f32 + nmax as f32) / (max - min);
        let (mut sum_l, mut sum_l2, mut sum_xl) = (0.0f32, 0.0f32, 0.0f32);
        for i in 0..n {
            let l = nearest_int(iscale * (x[i] - min)).clamp(0, nmax);
            laux[i] = l as u8;
            let (w, lf) = (weights[i], l as f32);
            sum_l += w * lf;
            sum_l2 += w * lf * lf;
            sum_xl += w * lf * x[i];
        }
        let det = sum_w * sum_l2 - sum_l * sum_l;
        if det > 0.0 {
            let mut this_scale = (sum_w * sum_xl - sum_x * sum_l) / det;
            let mut this_min = (sum_l2 * sum_x - sum_l * sum_xl) / det;
            if this_min > 0.0 {
                this_min = 0.0;
                this_scale = sum_xl / sum_l2;
            }
            let mut cur_error = 0.0f32;
            for i in 0..n {
                let diff = this_scale * laux[i] as f32 + this_min - x[i];
                cur_error += weights[i] * (diff * diff);
            }
            if cur_error < best_error {
                l_out[..n].copy_from_slice(&laux[..n]);
                best_error = cur_error;
                scale = this_scale;
                min = this_min;
            }
        }
    }
    (scale, -min)
}

/// ggml's `make_qx_quants` with `rmse_type == 1` and no importance weights:
/// signed codes `l[i] + nmax` in `0..2·nmax` and their scale.
fn make_qx_quants_rmse1(nmax: i32, x: &[f32], l_out: &mut [i8]) -> f32 {
    let n = x.len();
    let mut max = 0.0f32;
    let mut amax = 0.0f32;
    for &v in x {
        if v.abs() > amax {
            amax = v.abs();
            max = v;
        }
    }
    if amax < GROUP_MAX_EPS {
        l_out.fill(0);
        return 0.0;
    }
    let code = |iscale: f32, v: f32| nearest_int(iscale * v).clamp(-nmax, nmax - 1);
    let sums = |iscale: f32| {
        let (mut sumlx, mut suml2) = (0.0f32, 0.0f32);
        for &v in x {
            let l = code(iscale, v) as f32;
            let w = v * v;
            sumlx += w * v * l;
            suml2 += w * l * l;
        }
        (sumlx, suml2)
    };
    let mut iscale = -(nmax as f32) / max;
    for i in 0..n {
        l_out[i] = (code(iscale, x[i]) + nmax) as i8;
    }
    let (sumlx, suml2) = sums(iscale);
    let mut scale = if suml2 != 0.0 { sumlx / suml2 } else { 0.0 };
    let mut best = scale * sumlx;
    for is in -9..=9 {
        if is == 0 {
            continue;
        }
        iscale = -(nmax as f32 + 0.1 * is as f32) / max;
        let (sumlx, suml2) = sums(iscale);
        if suml2 > 0.0 && sumlx * sumlx > best * suml2 {
            for i in 0..n {
                l_out[i] = (code(iscale, x[i]) + nmax) as i8;
            }
            scale = sumlx / suml2;
            best = scale * sumlx;
        }
    }
    scale
}

/// Q4_K and Q5_K (`nmax` 15 or 31): one super-block of 256 weights to the
/// scale bytes and codes (`d`, `dmin`, `scales[12]`, `codes[256]`).
fn quantize_k4_k5(x: &[f32], nmax: i32) -> ([u8; 2], [u8; 2], [u8; 12], [u8; QK_K]) {
    let (rmin, nstep) = if nmax == 15 { (-1.0, 20) } else { (-0.5, 15) };
    let mut l = [0u8; QK_K];
    let mut scales = [0.0f32; 8];
    let mut mins = [0.0f32; 8];
    let mut weights = [0.0f32; 32];
    let (mut max_scale, mut max_min) = (0.0f32, 0.0f32);
    for j in 0..8 {
        let xs = &x[32 * j..32 * j + 32];
        let mut sum_x2 = 0.0f32;
        for &v in xs {
            sum_x2 += v * v;
        }
        let av_x = (sum_x2 / 32.0).sqrt();
        for (w, &v) in weights.iter_mut().zip(xs) {
            *w = av_x + v.abs();
        }
        let (s, m) = make_qkx2_quants(
            nmax,
            xs,
            &weights,
            &mut l[32 * j..32 * j + 32],
            rmin,
            0.1,
            nstep,
        );
        scales[j] = s;
        mins[j] = m;
        if s > max_scale {
            max_scale = s;
        }
        if m > max_min {
            max_min = m;
        }
    }
    let inv_scale = if max_scale > 0.0 {
        63.0 / max_scale
    } else {
        0.0
    };
    let inv_min = if max_min > 0.0 { 63.0 / max_min } else { 0.0 };
    let mut packed = [0u8; 12];
    for j in 0..8 {
        // ggml stores nearest_int into a uint8_t before capping at 63.
        let ls = (nearest_int(inv_scale * scales[j]) as u8).min(63);
        let lm = (nearest_int(inv_min * mins[j]) as u8).min(63);
        if j < 4 {
            packed[j] = ls;
            packed[j + 4] = lm;
        } else {
            packed[j + 4] = (ls & 0xF) | ((lm & 0xF) << 4);
            packed[j - 4] |= (ls >> 4) << 6;
            packed[j] |= (lm >> 4) << 6;
        }
    }
    let (d, dmin) = (f16_bytes(max_scale / 63.0), f16_bytes(max_min / 63.0));
    let (df, dminf) = (f16_round(max_scale / 63.0), f16_round(max_min / 63.0));
    for j in 0..8 {
        let (sc, m) = crate::blocks::scale_min_k4(&packed, j);
        let d = df * f32::from(sc);
        if d == 0.0 {
            continue;
        }
        let dm = dminf * f32::from(m);
        for ii in 0..32 {
            l[32 * j + ii] = nearest_int((x[32 * j + ii] + dm) / d).clamp(0, nmax) as u8;
        }
    }
    (d, dmin, packed, l)
}

fn quantize_q6_k(x: &[f32], out: &mut Vec<u8>) {
    let mut l = [0i8; QK_K];
    let mut scales = [0.0f32; 16];
    let (mut max_scale, mut max_abs_scale) = (0.0f32, 0.0f32);
    for ib in 0..16 {
        let s = make_qx_quants_rmse1(32, &x[16 * ib..16 * ib + 16], &mut l[16 * ib..16 * ib + 16]);
        scales[ib] = s;
        if s.abs() > max_abs_scale {
            max_abs_scale = s.abs();
            max_scale = s;
        }
    }
    if max_abs_scale < GROUP_MAX_EPS {
        out.extend_from_slice(&[0u8; 210]);
        return;
    }
    let iscale = -128.0 / max_scale;
    let d = f16_round(1.0 / iscale);
    let mut sc = [0i8; 16];
    for ib in 0..16 {
        sc[ib] = nearest_int(iscale * scales[ib]).min(127) as i8;
    }
    for j in 0..16 {
        let dj = d * f32::from(sc[j]);
        if dj == 0.0 {
            continue;
        }
        for ii in 0..16 {
            l[16 * j + ii] = (nearest_int(x[16 * j + ii] / dj).clamp(-32, 31) + 32) as i8;
        }
    }
    let mut ql = [0u8; 128];
    let mut qh = [0u8; 64];
    for half in 0..2 {
        let (j, ql, qh) = (
            128 * half,
            &mut ql[64 * half..64 * half + 64],
            &mut qh[32 * half..32 * half + 32],
        );
        let q = |k: usize| l[k] as u8;
        for i in 0..32 {
            ql[i] = (q(j + i) & 0xF) | (q(j + i + 64) & 0xF) << 4;
            ql[i + 32] = (q(j + i + 32) & 0xF) | (q(j + i + 96) & 0xF) << 4;
            qh[i] = (q(j + i) >> 4)
                | (q(j + i + 32) >> 4) << 2
                | (q(j + i + 64) >> 4) << 4
                | (q(j + i + 96) >> 4) << 6;
        }
    }
    out.extend_from_slice(&ql);
    out.extend_from_slice(&qh);
    out.extend(sc.iter().map(|&s| s as u8));
    out.extend_from_slice(&f16_bytes(1.0 / iscale));
}

/// Quantises `x` (a multiple of 256 weights) as `ty` (a K-quant type).
pub(crate) fn quantize_row(ty: WeightType, x: &[f32], out: &mut Vec<u8>) {
    for sb in x.chunks_exact(QK_K) {
        match ty {
            WeightType::Q4_K | WeightType::Q5_K => {
                let nmax = if ty == WeightType::Q4_K { 15 } else { 31 };
                let (d, dmin, scales, l) = quantize_k4_k5(sb, nmax);
                out.extend_from_slice(&d);
                out.extend_from_slice(&dmin);
                out.extend_from_slice(&scales);
                if ty == WeightType::Q5_K {
                    let mut qh = [0u8; 32];
                    for (chunk, lc) in l.chunks_exact(64).enumerate() {
                        for j in 0..32 {
                            qh[j] |= (lc[j] >> 4) << (2 * chunk);
                            qh[j] |= (lc[j + 32] >> 4) << (2 * chunk + 1);
                        }
                    }
                    out.extend_from_slice(&qh);
                }
                for lc in l.chunks_exact(64) {
                    for j in 0..32 {
                        out.push((lc[j] & 0xF) | (lc[j + 32] & 0xF) << 4);
                    }
                }
            }
            WeightType::Q6_K => quantize_q6_k(sb, out),
            _ => unreachable!("{} is not a K-quant type", ty.name()),
        }
    }
}
