//! The deterministic generator behind [`crate::Init`]: SplitMix64 and Box-Muller.
//!
//! The stream for a parameter depends only on `(seed, name)`, never on the
//! tensor-parallel degree, the rank or the creation order. Changing this file changes
//! every initial weight: treat the stream as part of the reproducibility contract.

/// 64-bit FNV-1a of a string.
fn fnv1a(s: &str) -> u64 {
    s.bytes().fold(0xcbf2_9ce4_8422_2325, |h, b| {
        (h ^ u64::from(b)).wrapping_mul(0x0000_0100_0000_01b3)
    })
}

/// SplitMix64's output function (also a good 64-bit mixer).
fn mix(mut z: u64) -> u64 {
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

/// SplitMix64 (Steele, Lea and Flood 2014).
pub(crate) struct SplitMix64(u64);

impl SplitMix64 {
    /// The generator for parameter `name` under `seed`.
    pub(crate) fn for_param(seed: u64, name: &str) -> Self {
        SplitMix64(mix(seed ^ mix(fnv1a(name))))
    }

    pub(crate) fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        mix(self.0)
    }

    /// Uniform in (0, 1] with 53 random bits.
    fn uniform_open0(&mut self) -> f64 {
        ((self.next_u64() >> 11) + 1) as f64 * (1.0 / (1u64 << 53) as f64)
    }

    /// `n` independent standard normal samples (Box-Muller, both outputs used).
    pub(crate) fn normals(&mut self, n: usize) -> Vec<f64> {
        let mut out = Vec::with_capacity(n + 1);
        while out.len() < n {
            let r = (-2.0 * self.uniform_open0().ln()).sqrt();
            let theta = std::f64::consts::TAU * self.uniform_open0();
            out.push(r * theta.cos());
            out.push(r * theta.sin());
        }
        out.truncate(n);
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn streams_depend_on_seed_and_name_only() {
        let a = SplitMix64::for_param(1, "w").normals(5);
        assert_eq!(a, SplitMix64::for_param(1, "w").normals(5));
        assert_ne!(a, SplitMix64::for_param(2, "w").normals(5));
        assert_ne!(a, SplitMix64::for_param(1, "v").normals(5));
        // A prefix of a longer stream is the shorter stream.
        assert_eq!(a[..3], SplitMix64::for_param(1, "w").normals(3)[..]);
    }

    #[test]
    fn normals_have_unit_moments() {
        let x = SplitMix64::for_param(7, "moments").normals(200_000);
        let n = x.len() as f64;
        let mean = x.iter().sum::<f64>() / n;
        let var = x.iter().map(|v| (v - mean).powi(2)).sum::<f64>() / n;
        assert!(mean.abs() < 0.01, "mean {mean}");
        assert!((var - 1.0).abs() < 0.01, "variance {var}");
    }
}
