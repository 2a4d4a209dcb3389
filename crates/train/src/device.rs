//! [`DeviceSpec`]: the candle device a run asks for (`--device cpu|cuda:N|metal`).

use std::fmt;
use std::str::FromStr;

use candle_core::Device;
use serde::{Deserialize, Deserializer, Serialize, Serializer};

use crate::error::{err, TrainError};

/// The candle device a run computes on: `cpu` (the default), `cuda:N` (`cuda` is
/// `cuda:0`) or `metal`. Written as that text in a configuration file or a manifest.
///
/// A build without candle's backend for the device refuses it before any work, naming
/// the cargo feature to enable ([`DeviceSpec::check`]). On a non-CPU device the ops run
/// as their composed twins (`switchyard_ops::OpsBackend`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub enum DeviceSpec {
    #[default]
    Cpu,
    /// A CUDA GPU by ordinal.
    Cuda(usize),
    /// The Metal GPU.
    Metal,
}

impl DeviceSpec {
    /// Whether this is the CPU.
    pub fn is_cpu(&self) -> bool {
        *self == DeviceSpec::Cpu
    }

    /// Refuses a device whose candle backend this build does not have, naming the cargo
    /// feature that adds it. Touches no device.
    pub fn check(&self) -> Result<(), TrainError> {
        let (available, feature, needs) = match self {
            DeviceSpec::Cpu => return Ok(()),
            DeviceSpec::Cuda(_) => (
                candle_core::utils::cuda_is_available(),
                "cuda",
                "the CUDA toolkit",
            ),
            DeviceSpec::Metal => (candle_core::utils::metal_is_available(), "metal", "macOS"),
        };
        if !available {
            return Err(err!(
                Config,
                "--device {self}: this build has no {} backend; rebuild switchyard with \
                 `--features {feature}` (candle's {feature} backend; needs {needs}), or use \
                 --device cpu",
                feature.to_uppercase().replace("METAL", "Metal")
            ));
        }
        Ok(())
    }

    /// The candle device, after [`DeviceSpec::check`]; an error names the device.
    pub fn open(&self) -> Result<Device, TrainError> {
        self.check()?;
        let dev = match self {
            DeviceSpec::Cpu => Ok(Device::Cpu),
            DeviceSpec::Cuda(n) => Device::new_cuda(*n),
            DeviceSpec::Metal => Device::new_metal(0),
        };
        dev.map_err(|e| err!(Config, "--device {self}: cannot open it: {e}"))
    }
}

impl fmt::Display for DeviceSpec {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            DeviceSpec::Cpu => f.write_str("cpu"),
            DeviceSpec::Cuda(n) => write!(f, "cuda:{n}"),
            DeviceSpec::Metal => f.write_str("metal"),
        }
    }
}

impl FromStr for DeviceSpec {
    type Err = TrainError;

    fn from_str(s: &str) -> Result<Self, TrainError> {
        let bad = || {
            err!(
                Config,
                "unknown device {s:?}: expected cpu, cuda, cuda:N (a GPU ordinal) or metal"
            )
        };
        match s {
            "cpu" => Ok(DeviceSpec::Cpu),
            "cuda" => Ok(DeviceSpec::Cuda(0)),
            "metal" => Ok(DeviceSpec::Metal),
            _ => match s.strip_prefix("cuda:") {
                Some(n) => n.parse().map(DeviceSpec::Cuda).map_err(|_| bad()),
                None => Err(bad()),
            },
        }
    }
}

impl Serialize for DeviceSpec {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.collect_str(self)
    }
}

impl<'de> Deserialize<'de> for DeviceSpec {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        String::deserialize(d)?
            .parse()
            .map_err(serde::de::Error::custom)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_parse_and_print() {
        for (text, want) in [
            ("cpu", DeviceSpec::Cpu),
            ("cuda", DeviceSpec::Cuda(0)),
            ("cuda:3", DeviceSpec::Cuda(3)),
            ("metal", DeviceSpec::Metal),
        ] {
            assert_eq!(text.parse::<DeviceSpec>().unwrap(), want);
        }
        assert_eq!(DeviceSpec::Cuda(1).to_string(), "cuda:1");
        for bad in ["gpu", "cuda:x", "cuda:", "CPU"] {
            let e = bad.parse::<DeviceSpec>().unwrap_err().to_string();
            assert!(e.contains("expected cpu, cuda, cuda:N"), "{bad}: {e}");
        }
    }

    /// This build has neither GPU backend (CI builds without `--features cuda|metal`):
    /// asking for one names the feature.
    #[test]
    fn a_backend_this_build_lacks_is_refused_naming_the_feature() {
        assert!(DeviceSpec::Cpu.check().is_ok());
        if !candle_core::utils::cuda_is_available() {
            let e = DeviceSpec::Cuda(0).open().unwrap_err().to_string();
            assert!(
                e.contains("--device cuda:0") && e.contains("--features cuda"),
                "{e}"
            );
        }
        if !candle_core::utils::metal_is_available() {
            let e = DeviceSpec::Metal.check().unwrap_err().to_string();
            assert!(e.contains("--features metal"), "{e}");
        }
    }
}
