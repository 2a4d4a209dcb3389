//! The memory savers a run can switch on: activation recomputation and ZeRO.

use serde::{Deserialize, Serialize};

use crate::error::{err, TrainError};

/// Activation recomputation (`--recompute`): what a forward pass keeps for its backward.
///
/// * `none`: everything the ops save (the fastest);
/// * `selective`: the fused ops keep the inputs of their products but not what is cheap
///   to compute again from them (the GELU's output, the LayerNorms' outputs), which
///   their backward recomputes (Korthikanti et al. 2022);
/// * `full`: each transformer block keeps only its input; the executor runs the block's
///   forward again, with autograd, just before its backward (one more forward a step).
///
/// Gradients are the same in every mode: the same kernels run on the same inputs.
/// Ordered by how much they save.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Recompute {
    #[default]
    None,
    Selective,
    Full,
}

impl Recompute {
    pub const ALL: [Recompute; 3] = [Recompute::None, Recompute::Selective, Recompute::Full];

    /// The flag value and TOML string.
    pub fn name(self) -> &'static str {
        match self {
            Recompute::None => "none",
            Recompute::Selective => "selective",
            Recompute::Full => "full",
        }
    }
}

impl std::fmt::Display for Recompute {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

impl std::str::FromStr for Recompute {
    type Err = TrainError;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        Recompute::ALL
            .into_iter()
            .find(|r| r.name() == s.trim())
            .ok_or_else(|| {
                err!(
                    Config,
                    "unknown recompute mode `{s}`: expected none, selective or full"
                )
            })
    }
}

/// `--zero`: stages 0 to 3; stage 3 frees parameters in place, which is built for the
/// CPU only.
pub(super) fn check_zero(zero: u8, device: &crate::DeviceSpec) -> Result<(), TrainError> {
    match zero {
        0..=2 => Ok(()),
        3 if device.is_cpu() => Ok(()),
        3 => Err(err!(
            Config,
            "--zero 3 on --device {device}: ZeRO stage 3 frees and gathers parameters in \
             place in CPU memory only; use --zero 2 (sharded optimizer state and gradients) \
             on this device, or --device cpu"
        )),
        z => Err(err!(
            Config,
            "--zero {z}: there is no ZeRO stage {z}; use 0 (off), 1 (sharded optimizer \
             state), 2 (also sharded gradients) or 3 (also sharded parameters)"
        )),
    }
}

#[cfg(test)]
mod tests {
    use super::super::tests::{err, TrainConfig};
    use super::*;

    #[test]
    fn names_round_trip_and_unknown_ones_are_refused() {
        for r in Recompute::ALL {
            assert_eq!(r.to_string().parse::<Recompute>().unwrap(), r);
        }
        let e = "some".parse::<Recompute>().unwrap_err().to_string();
        assert!(e.contains("`some`") && e.contains("selective"), "{e}");
    }

    #[test]
    fn zero_stages_up_to_three_are_accepted_and_others_are_refused_first() {
        for z in 0..=3 {
            let c = TrainConfig {
                zero: z,
                dp: 2,
                pp: 1,
                batch: 8,
                ..TrainConfig::default()
            };
            c.validate().unwrap();
        }
        // Refused before anything else is looked at (here: an impossible layout).
        let e = err(|c| {
            c.zero = 7;
            c.tp = 3;
        });
        assert!(e.contains("--zero 7: there is no ZeRO stage 7"), "{e}");
        // Stage 3 frees parameters in CPU memory: another device is refused first.
        let e = err(|c| {
            c.zero = 3;
            c.device = crate::DeviceSpec::Cuda(0);
        });
        assert!(e.contains("--zero 3 on --device cuda:0"), "{e}");
        // Configurations and manifests written before the field existed are stage 0.
        let c: TrainConfig = serde_json::from_str(r#"{"dp": 2}"#).unwrap();
        assert_eq!(c.zero, 0);
        let c: TrainConfig = serde_json::from_str(r#"{"zero": 2}"#).unwrap();
        assert_eq!(c.zero, 2);
    }
}
