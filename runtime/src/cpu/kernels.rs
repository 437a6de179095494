//! Reference kernels: plain f32 Rust twins of every kernel entry point, written for clarity. Each works on one row
//! (or one stream's rows in order, for the recurrent and causal pieces) with a fixed reduction order, so a row's
//! result never depends on how many rows share its launch (`rounds.md` section 5).

/// `sum_i a[i] * b[i]` with eight interleaved f32 partial sums combined in a fixed order (deterministic, and the
/// same for every row).
#[inline]
pub fn dot(a: &[f32], b: &[f32]) -> f32 {
    let n = a.len().min(b.len());
    let mut acc = [0f32; 8];
    let chunks = n / 8;
    for c in 0..chunks {
        let (x, y) = (&a[c * 8..c * 8 + 8], &b[c * 8..c * 8 + 8]);
        for l in 0..8 {
            acc[l] += x[l] * y[l];
        }
    }
    let mut tail = 0f32;
    for i in chunks * 8..n {
        tail += a[i] * b[i];
    }
    ((acc[0] + acc[4]) + (acc[1] + acc[5])) + ((acc[2] + acc[6]) + (acc[3] + acc[7])) + tail
}

/// `silu(x) = x * sigmoid(x)`.
#[inline]
pub fn silu(x: f32) -> f32 {
    x / (1.0 + (-x).exp())
}

/// `sigmoid(x) = 1 / (1 + exp(-x))`.
#[inline]
pub fn sigmoid(x: f32) -> f32 {
    1.0 / (1.0 + (-x).exp())
}

/// `softplus(x) = log(1 + exp(x))`, linear above 20 (torch's threshold).
#[inline]
pub fn softplus(x: f32) -> f32 {
    if x > 20.0 {
        x
    } else {
        x.exp().ln_1p()
    }
}

/// `y = W x` for one row: `w` is `[n, k]` row-major, `x` is `[k]`, `y` is `[n]` (`nn.Linear`, no bias).
pub fn matvec(w: &[f32], x: &[f32], y: &mut [f32], k: usize) {
    for (o, row) in y.iter_mut().zip(w.chunks_exact(k)) {
        *o = dot(row, x);
    }
}

/// Zero-centred RMSNorm of one vector in groups of `group` (`Qwen4ExpTextRMSNorm`):
/// `y = x * rsqrt(mean(x^2) + eps) * (1 + w)`; without `w`, just the normalisation.
pub fn rms_norm(x: &[f32], w: Option<&[f32]>, y: &mut [f32], group: usize, eps: f32) {
    for (g, (xs, ys)) in x.chunks(group).zip(y.chunks_mut(group)).enumerate() {
        let ms = dot(xs, xs) / group as f32;
        let inv = 1.0 / (ms + eps).sqrt();
        for (i, (xv, yv)) in xs.iter().zip(ys.iter_mut()).enumerate() {
            let scale = match w {
                Some(w) => 1.0 + w[g * group + i],
                None => 1.0,
            };
            *yv = xv * inv * scale;
        }
    }
}

/// `x * rsqrt(sum(x^2) + eps)` (`l2norm` of the FLA library as transformers writes it; eps inside the sum).
pub fn l2norm(x: &mut [f32], eps: f32) {
    let inv = 1.0 / (dot(x, x) + eps).sqrt();
    for v in x {
        *v *= inv;
    }
}

/// Weights of a hyper-connection (`Qwen4ExpTextGatedResidual`).
pub struct HcWeights<'a> {
    /// `hc_norm`, `[C*D]` (zero-centred, grouped by D).
    pub norm: &'a [f32],
    /// `input_mix_weight_down`, `[rank, C*D]`.
    pub down: &'a [f32],
    /// `input_mix_weight_up`, `[C*D, rank]`.
    pub up: &'a [f32],
    /// `block_inject_weight`, `[C, C*D]` (absent on the final mixer).
    pub inject: Option<&'a [f32]>,
}

/// Hyper-connection read of one row (`flash-next.md` section 4): returns the block input `a` (`[D]`) and the
/// inject weights (`[C]`, when `inject` is present).
#[allow(clippy::too_many_arguments)]
pub fn hc_read(
    h: &[f32],
    w: &HcWeights,
    dim: usize,
    hc: usize,
    rank: usize,
    eps: f32,
    a: &mut [f32],
    inj: Option<&mut [f32]>,
) {
    let width = dim * hc;
    let mut hn = vec![0f32; width];
    rms_norm(h, Some(w.norm), &mut hn, dim, eps);
    let mut lo = vec![0f32; rank];
    matvec(w.down, &hn, &mut lo, width);
    for v in &mut lo {
        *v = silu(*v / hc as f32);
    }
    let mut g = vec![0f32; width];
    matvec(w.up, &lo, &mut g, rank);
    for v in &mut g {
        *v = sigmoid(*v);
    }
    for d in 0..dim {
        let mut s = 0f32;
        for c in 0..hc {
            s += g[c * dim + d] * hn[c * dim + d];
        }
        a[d] = s / hc as f32;
    }
    if let (Some(wi), Some(inj)) = (w.inject, inj) {
        for (c, out) in inj.iter_mut().enumerate().take(hc) {
            *out = 2.0 * sigmoid(dot(&wi[c * width..(c + 1) * width], &hn) / hc as f32);
        }
    }
}

/// One GatedDeltaNet update of value head state `s` (`[dk, dv]`, k-major) with normalised `k` (`[dk]`), `v`
/// (`[dv]`), decay `g` and `beta` (`torch_recurrent_gated_delta_rule`): `S *= exp(g)`,
/// `S += k (beta (v - S^T k))^T`. The same routine serves the verify pass and the commit replay, so the committed
/// state is bit-identical to plain decoding.
pub fn gdn_update(s: &mut [f32], k: &[f32], v: &[f32], g: f32, beta: f32, dv: usize) {
    let decay = g.exp();
    for x in s.iter_mut() {
        *x *= decay;
    }
    let mut kv_mem = vec![0f32; dv];
    for (i, ki) in k.iter().enumerate() {
        let row = &s[i * dv..(i + 1) * dv];
        for e in 0..dv {
            kv_mem[e] += row[e] * ki;
        }
    }
    let delta: Vec<f32> = (0..dv).map(|e| (v[e] - kv_mem[e]) * beta).collect();
    for (i, ki) in k.iter().enumerate() {
        let row = &mut s[i * dv..(i + 1) * dv];
        for e in 0..dv {
            row[e] += ki * delta[e];
        }
    }
}

/// `o = S^T q` for one value head (`[dk, dv]` state, `[dk]` query) into `o` (`[dv]`).
pub fn gdn_output(s: &[f32], q: &[f32], o: &mut [f32], dv: usize) {
    o.iter_mut().for_each(|x| *x = 0.0);
    for (i, qi) in q.iter().enumerate() {
        let row = &s[i * dv..(i + 1) * dv];
        for e in 0..dv {
            o[e] += row[e] * qi;
        }
    }
}

/// Rotary tables: `inv_freq` (`rot / 2` values) and the attention factor (YaRN's mscale, 1 for default RoPE),
/// from transformers' `_compute_default_rope_parameters` / `_compute_yarn_parameters`.
#[derive(Debug, Clone)]
pub struct Rope {
    /// Inverse frequencies, f32 as torch computes them.
    pub inv_freq: Vec<f32>,
    /// cos/sin multiplier.
    pub attention_factor: f32,
}

impl Rope {
    /// Builds the tables from the config.
    pub fn new(cfg: &flashplan_plan::ModelConfig) -> Rope {
        let r = &cfg.rope;
        let dim = cfg.rotary_dim() as usize;
        let base = r.theta;
        let pos_freqs: Vec<f64> = (0..dim / 2)
            .map(|i| base.powf((2 * i) as f64 / dim as f64))
            .collect();
        if r.rope_type != "yarn" {
            return Rope {
                inv_freq: pos_freqs.iter().map(|p| (1.0 / p) as f32).collect(),
                attention_factor: 1.0,
            };
        }
        let factor = r.factor;
        let attention_factor = r.attention_factor.unwrap_or(if factor <= 1.0 {
            1.0
        } else {
            0.1 * factor.ln() + 1.0
        });
        let orig = r
            .original_max_position_embeddings
            .unwrap_or(cfg.max_position_embeddings) as f64;
        let corr = |rot: f64| {
            (dim as f64 * (orig / (rot * 2.0 * std::f64::consts::PI)).ln()) / (2.0 * base.ln())
        };
        let (mut low, mut high) = (corr(r.beta_fast), corr(r.beta_slow));
        if r.truncate {
            low = low.floor();
            high = high.ceil();
        }
        let low = low.max(0.0);
        let high = high.min(dim as f64 - 1.0);
        let high = if low == high { high + 0.001 } else { high };
        let inv_freq = (0..dim / 2)
            .map(|i| {
                let ramp = ((i as f32 - low as f32) / (high as f32 - low as f32)).clamp(0.0, 1.0);
                let extra = 1.0 - ramp;
                let inter = (1.0 / (factor * pos_freqs[i])) as f32;
                let extrap = (1.0 / pos_freqs[i]) as f32;
                inter * (1.0 - extra) + extrap * extra
            })
            .collect();
        Rope {
            inv_freq,
            attention_factor: attention_factor as f32,
        }
    }

    /// Applies rotate-half RoPE at `pos` to the first `2 * inv_freq.len()` values of `x`.
    pub fn apply(&self, x: &mut [f32], pos: u64) {
        let half = self.inv_freq.len();
        for i in 0..half {
            let f = pos as f32 * self.inv_freq[i];
            let (c, s) = (
                f.cos() * self.attention_factor,
                f.sin() * self.attention_factor,
            );
            let (x1, x2) = (x[i], x[i + half]);
            x[i] = x1 * c - x2 * s;
            x[i + half] = x2 * c + x1 * s;
        }
    }
}

/// Top `k` indices of `scores` by (score descending, index ascending).
pub fn top_k(scores: &[f32], k: usize) -> Vec<usize> {
    let mut idx: Vec<usize> = (0..scores.len()).collect();
    idx.sort_by(|&a, &b| {
        scores[b]
            .partial_cmp(&scores[a])
            .unwrap_or(std::cmp::Ordering::Equal)
            .then(a.cmp(&b))
    });
    idx.truncate(k);
    idx
}

/// SwiGLU expert for one row: `down (silu(gate x) * up x)`; `gate_up` `[2I, D]` (gate rows then up rows),
/// `down` `[D, I]`.
pub fn swiglu(x: &[f32], gate_up: &[f32], down: &[f32], inter: usize, out: &mut [f32]) {
    let d = x.len();
    let mut hmid = vec![0f32; inter];
    for (i, hv) in hmid.iter_mut().enumerate() {
        let g = dot(&gate_up[i * d..(i + 1) * d], x);
        let u = dot(&gate_up[(inter + i) * d..(inter + i + 1) * d], x);
        *hv = silu(g) * u;
    }
    matvec(down, &hmid, out, inter);
}
