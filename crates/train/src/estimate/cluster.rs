//! Other hardware for `switchyard plan --cluster FILE`: a TOML description of a cluster
//! (devices per node, memory per device, peak FLOP/s and the fraction a training run
//! achieves, latency and bandwidth within a node and between nodes), turned into the
//! memory budget and a [`TimeModel`] for a layout.
//!
//! ```toml
//! name = "DGX A100 80GB"
//! devices_per_node = 8
//! memory_per_device = "80GiB"
//! peak_flops = 312e12     # per device, the dtype the run computes in
//! achievable = 0.5        # the fraction of it a large run sustains
//! [intra_node]            # NVLink / NVSwitch, per device and direction
//! latency_s = 5e-6
//! bytes_per_s = 300e9
//! [inter_node]            # InfiniBand, per device
//! latency_s = 10e-6
//! bytes_per_s = 25e9
//! ```
//!
//! The layout decides which link an axis uses, Megatron's placement: tensor parallelism
//! innermost (within a node while `tp ≤ devices_per_node`), then data parallelism, then the
//! pipeline. A group that fits in one node uses the node's links, otherwise the network.

use std::path::Path;

use serde::Deserialize;

use super::time::{AlphaBeta, TimeModel};
use crate::error::{err, TrainError};
use crate::Bytes;

/// One link: latency and bandwidth.
#[derive(Debug, Clone, Copy, PartialEq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Link {
    pub latency_s: f64,
    pub bytes_per_s: f64,
}

impl From<Link> for AlphaBeta {
    fn from(l: Link) -> AlphaBeta {
        AlphaBeta {
            alpha_s: l.latency_s,
            bytes_per_s: l.bytes_per_s,
        }
    }
}

/// A cluster's description (see the module docs).
#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Cluster {
    pub name: String,
    pub devices_per_node: usize,
    pub memory_per_device: Bytes,
    pub peak_flops: f64,
    pub achievable: f64,
    pub intra_node: Link,
    pub inter_node: Link,
}

impl Cluster {
    /// Reads and checks a TOML description.
    pub fn load(path: &Path) -> Result<Cluster, TrainError> {
        let text = std::fs::read_to_string(path)
            .map_err(|e| err!(Config, "cannot read --cluster {}: {e}", path.display()))?;
        Cluster::parse(&text).map_err(|e| err!(Config, "--cluster {}: {e}", path.display()))
    }

    /// Parses and checks a TOML description.
    pub fn parse(text: &str) -> Result<Cluster, String> {
        let c: Cluster = toml::from_str(text).map_err(|e| e.to_string())?;
        let positive = |what: &str, x: f64| match x.is_finite() && x > 0.0 {
            true => Ok(()),
            false => Err(format!("{what} must be a positive number, got {x}")),
        };
        if c.devices_per_node == 0 {
            return Err("devices_per_node must be at least 1".into());
        }
        positive("peak_flops", c.peak_flops)?;
        positive("achievable", c.achievable)?;
        if c.achievable > 1.0 {
            return Err(format!(
                "achievable is a fraction of the peak, at most 1, got {}",
                c.achievable
            ));
        }
        for (what, l) in [("intra_node", c.intra_node), ("inter_node", c.inter_node)] {
            positive(&format!("{what}.bytes_per_s"), l.bytes_per_s)?;
            if !(l.latency_s.is_finite() && l.latency_s >= 0.0) {
                return Err(format!("{what}.latency_s must be 0 or more"));
            }
        }
        Ok(c)
    }

    /// The link a group of `size` ranks uses whose members are `stride` devices apart.
    fn link(&self, size: usize, stride: usize) -> Link {
        match size * stride <= self.devices_per_node {
            true => self.intra_node,
            false => self.inter_node,
        }
    }

    /// The time model of a `dp × pp × tp` layout on this cluster: one device a worker, its
    /// achievable FLOP/s, no fixed cost per layer; tensor-parallel all-reduces on the
    /// tensor group's link, pipeline messages on the link between consecutive stages,
    /// data-parallel all-reduces on the replicas' link.
    pub fn time_model(&self, dp: usize, tp: usize) -> TimeModel {
        let mut tm = TimeModel::linear(self.peak_flops * self.achievable, 0.0);
        tm.collective = self.link(tp, 1).into();
        tm.dp_collective = Some(self.link(dp, tp).into());
        // Consecutive stages are dp · tp devices apart.
        tm.p2p = self.link(2, dp * tp).into();
        tm
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const DGX: &str = include_str!("../../../../clusters/dgx-a100-80gb.toml");

    #[test]
    fn a_description_reads_and_places_the_axes_on_links() {
        let c = Cluster::parse(DGX).unwrap();
        assert_eq!(c.devices_per_node, 8);
        assert_eq!(c.memory_per_device, Bytes(80 << 30));
        // tp 8 stays in a node; dp 2 of tp 8 crosses; the pipeline crosses nodes.
        let tm = c.time_model(2, 8);
        assert_eq!(tm.collective, AlphaBeta::from(c.intra_node));
        assert_eq!(tm.dp_collective, Some(c.inter_node.into()));
        assert_eq!(tm.p2p, AlphaBeta::from(c.inter_node));
        let small = c.time_model(2, 2);
        assert_eq!(small.p2p, AlphaBeta::from(c.intra_node));
    }

    #[test]
    fn a_bad_description_is_refused_naming_the_key() {
        for (bad, want) in [
            (
                DGX.replace("achievable = 0.5", "achievable = 1.5"),
                "at most 1",
            ),
            (
                DGX.replace("devices_per_node = 8", "devices_per_node = 0"),
                "devices_per_node",
            ),
            (
                DGX.replace("peak_flops = 312e12", "peak_flops = -1.0"),
                "peak_flops",
            ),
            (format!("{DGX}\ncolour = \"green\""), "colour"),
        ] {
            let e = Cluster::parse(&bad).unwrap_err();
            assert!(e.contains(want), "{want}: {e}");
        }
    }
}
