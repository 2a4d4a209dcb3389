//! What a run needs from this machine, checked before any worker starts: threads, and
//! memory for the parameters, gradients and optimizer state.

use serde::{Deserialize, Serialize};
use switchyard_models::Model;

use super::TrainConfig;
use crate::error::{err, TrainError};

impl<M: Model> TrainConfig<M> {
    /// Bytes of parameters, gradients and optimizer state of one replica of the model:
    /// [`BYTES_PER_PARAM`] per parameter. Activations come on top.
    pub fn state_bytes(&self) -> u128 {
        self.model.param_count() as u128 * u128::from(BYTES_PER_PARAM)
    }

    /// Checks what this machine must hold for `local_workers` of the job's workers (all
    /// of them on threads; under MPI, this node's): their threads, and their
    /// parameters, gradients and optimizer state in the memory available now. Returns
    /// the compute threads per worker (`threads_per_worker`, or the cores shared out).
    pub fn check_machine(&self, local_workers: usize) -> Result<usize, TrainError> {
        let threads = self.check_threads(local_workers, thread_limit())?;
        self.check_memory(local_workers, memory_info().available)?;
        Ok(threads)
    }

    /// Refuses more than `limit` compute threads for `local_workers` workers; returns
    /// the threads per worker.
    pub fn check_threads(&self, local_workers: usize, limit: usize) -> Result<usize, TrainError> {
        let threads = match self.threads_per_worker {
            0 => switchyard_comm::threads::default_threads_per_worker(local_workers),
            n => n,
        };
        let total = local_workers.saturating_mul(threads);
        if total > limit {
            return Err(err!(
                Config,
                "{local_workers} workers (--dp {} × --pp {} × --tp {}) × {threads} threads each \
                 is {total} threads on this machine, more than {limit} ({THREAD_LIMIT_WHY}): \
                 use fewer workers or --threads-per-worker, or spread the ranks over machines \
                 with --backend mpi",
                self.dp,
                self.pp,
                self.tp
            ));
        }
        Ok(threads)
    }

    /// Refuses a run whose `local_workers` workers' parameters, gradients and optimizer
    /// state alone exceed `available` bytes (no check when `None`).
    pub fn check_memory(
        &self,
        local_workers: usize,
        available: Option<u64>,
    ) -> Result<(), TrainError> {
        let Some(available) = available else {
            return Ok(());
        };
        // dp replicas, each spread over pp × tp workers; this machine holds its share.
        let world = self.world_size().max(1) as u128;
        let need = self.state_bytes() * self.dp as u128 * local_workers as u128 / world;
        if need > u128::from(available) {
            return Err(err!(
                Config,
                "not enough memory: {:.2}M parameters × {BYTES_PER_PARAM} bytes (f32 value and \
                 gradient, AdamW's two f64 moments) × {} replica(s) need {} for {local_workers} \
                 workers here, before any activation, but this machine has {} available; use a \
                 smaller model or fewer data-parallel replicas",
                self.model.param_count() as f64 / 1e6,
                self.dp,
                human_bytes(need),
                human_bytes(u128::from(available))
            ));
        }
        Ok(())
    }
}

/// Bytes each worker keeps per parameter it holds: the f32 value and gradient, and
/// AdamW's first and second moments, which the optimizer keeps in f64.
pub const BYTES_PER_PARAM: u64 = 4 + 4 + 8 + 8;

pub(super) const THREAD_LIMIT_WHY: &str =
    "16 per core and at least 1024: each worker is an OS thread with its own compute pool, \
     and far more threads than cores only adds switching";

/// The most compute threads one process may start: 16 per core, and at least 1024.
pub fn thread_limit() -> usize {
    (16 * switchyard_comm::threads::available_cores()).max(1024)
}

/// This machine's memory in bytes, from `/proc/meminfo` (Linux); `None` where it
/// cannot be read.
#[derive(Clone, Copy, Debug, Default)]
pub struct MemoryInfo {
    /// `MemTotal`.
    pub total: Option<u64>,
    /// `MemAvailable`: what can be allocated without swapping.
    pub available: Option<u64>,
}

/// Reads [`MemoryInfo`] now.
pub fn memory_info() -> MemoryInfo {
    std::fs::read_to_string("/proc/meminfo")
        .map(|t| parse_meminfo(&t))
        .unwrap_or_default()
}

fn parse_meminfo(text: &str) -> MemoryInfo {
    let field = |name: &str| {
        text.lines().find_map(|l| {
            let rest = l.strip_prefix(name)?.strip_prefix(':')?;
            let kib: u64 = rest.trim().strip_suffix("kB")?.trim().parse().ok()?;
            kib.checked_mul(1024)
        })
    };
    MemoryInfo {
        total: field("MemTotal"),
        available: field("MemAvailable"),
    }
}

/// `n` bytes for people: `1.50 GiB`.
pub(super) fn human_bytes(n: u128) -> String {
    let units = ["bytes", "KiB", "MiB", "GiB", "TiB", "PiB", "EiB"];
    let mut x = n as f64;
    let mut u = 0;
    while x >= 1024.0 && u + 1 < units.len() {
        x /= 1024.0;
        u += 1;
    }
    match u {
        0 => format!("{n} bytes"),
        _ => format!("{x:.2} {}", units[u]),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The trainer's checks, on the GPT.
    type TrainConfig = super::TrainConfig<switchyard_models::GptConfig>;

    #[test]
    fn threads_are_capped_and_say_why() {
        let e = TrainConfig {
            threads_per_worker: 100_000,
            ..TrainConfig::default()
        }
        .validate()
        .unwrap_err()
        .to_string();
        assert!(
            e.contains("--threads-per-worker 100000 is more than"),
            "{e}"
        );
        let mut c = TrainConfig {
            dp: 100_000,
            ..TrainConfig::default()
        };
        let e = c
            .check_threads(c.world_size(), 1024)
            .unwrap_err()
            .to_string();
        assert!(
            e.contains(
                "400000 workers (--dp 100000 × --pp 2 × --tp 2) × 1 threads each is 400000 threads"
            ),
            "{e}"
        );
        assert!(e.contains("more than 1024 (16 per core"), "{e}");
        c.dp = 1;
        c.threads_per_worker = 300;
        assert!(c
            .check_threads(4, 1024)
            .unwrap_err()
            .to_string()
            .contains("1200 threads"));
        assert_eq!(c.check_threads(3, 1024).unwrap(), 300);
        c.threads_per_worker = 0;
        assert!(c.check_threads(4, 1024).unwrap() >= 1);
        assert!(thread_limit() >= 1024);
    }

    #[test]
    fn a_model_larger_than_memory_is_refused_with_the_sizes() {
        let mut c = TrainConfig::default();
        c.model.d_model = 16384;
        c.model.n_layer = 96;
        let need = c.state_bytes() * c.dp as u128;
        // 309 B parameters × 24 bytes.
        assert!(
            need > 7_000_000_000_000 && need < 8_000_000_000_000,
            "{need}"
        );
        let e = c.check_memory(4, Some(64 << 30)).unwrap_err().to_string();
        assert!(e.contains("need 6.75 TiB for 4 workers here"), "{e}");
        assert!(e.contains("this machine has 64.00 GiB available"), "{e}");
        // The machine's share under MPI: 1 of the 4 workers.
        let e = c.check_memory(1, Some(64 << 30)).unwrap_err().to_string();
        assert!(e.contains("need 1.69 TiB for 1 workers"), "{e}");
        assert!(c.check_memory(4, None).is_ok());
        // On no machine of today does it fit in total memory either.
        let e = c.validate().unwrap_err().to_string();
        assert!(e.contains("the model does not fit"), "{e}");
        let small = TrainConfig::default();
        assert!(small.check_memory(4, Some(1 << 30)).is_ok());
        assert!(small.check_memory(4, Some(1 << 10)).is_err());
    }

    #[test]
    fn meminfo_is_parsed() {
        let m = parse_meminfo(
            "MemTotal:       16318412 kB\nMemFree: 1 kB\nMemAvailable:    8000000 kB\n",
        );
        assert_eq!(m.total, Some(16318412 * 1024));
        assert_eq!(m.available, Some(8000000 * 1024));
        let m = parse_meminfo("nothing here");
        assert!(m.total.is_none() && m.available.is_none());
        assert_eq!(human_bytes(1536 << 20), "1.50 GiB");
        assert_eq!(human_bytes(12), "12 bytes");
    }
}

/// A size in bytes, written `512MiB`, `1.5GiB`, `2GB`, `300kB` or a plain count
/// (binary units are powers of 1024, decimal ones of 1000).
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(try_from = "String", into = "String")]
pub struct Bytes(pub u64);

impl std::str::FromStr for Bytes {
    type Err = String;
    fn from_str(s: &str) -> Result<Bytes, String> {
        let t = s.trim();
        let split = t
            .find(|c: char| !(c.is_ascii_digit() || c == '.'))
            .unwrap_or(t.len());
        let (num, unit) = t.split_at(split);
        let scale: f64 = match unit.trim().to_ascii_lowercase().as_str() {
            "" | "b" => 1.0,
            "kb" => 1e3,
            "mb" => 1e6,
            "gb" => 1e9,
            "tb" => 1e12,
            "kib" | "k" => 1024.0,
            "mib" | "m" => 1024.0f64.powi(2),
            "gib" | "g" => 1024.0f64.powi(3),
            "tib" | "t" => 1024.0f64.powi(4),
            u => {
                return Err(format!(
                    "`{s}`: unknown unit `{u}` (use B, kB, MB, GB, TB, KiB, MiB, GiB or TiB)"
                ))
            }
        };
        let x: f64 = num
            .parse()
            .map_err(|_| format!("`{s}` is not a size such as 512MiB or 2GB"))?;
        let bytes = x * scale;
        if !(1.0..1.8e19).contains(&bytes) {
            return Err(format!("`{s}`: a size must be at least 1 byte"));
        }
        Ok(Bytes(bytes as u64))
    }
}

impl std::fmt::Display for Bytes {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&human_bytes(u128::from(self.0)))
    }
}

impl TryFrom<String> for Bytes {
    type Error = String;
    fn try_from(s: String) -> Result<Bytes, String> {
        s.parse()
    }
}

impl From<Bytes> for String {
    fn from(b: Bytes) -> String {
        format!("{}B", b.0)
    }
}

#[cfg(test)]
mod bytes_tests {
    use super::Bytes;

    #[test]
    fn sizes_read_in_binary_and_decimal_units() {
        assert_eq!("512MiB".parse::<Bytes>().unwrap(), Bytes(512 << 20));
        assert_eq!("1.5GiB".parse::<Bytes>().unwrap(), Bytes(3 << 29));
        assert_eq!("2GB".parse::<Bytes>().unwrap(), Bytes(2_000_000_000));
        assert_eq!("4096".parse::<Bytes>().unwrap(), Bytes(4096));
        assert_eq!(String::from(Bytes(7)).parse::<Bytes>().unwrap(), Bytes(7));
        for bad in ["", "MiB", "12 parsecs", "0", "-5MiB"] {
            assert!(bad.parse::<Bytes>().is_err(), "{bad}");
        }
    }
}
