//! The `dp × pp × tp` device mesh and the groups derived from it.
//!
//! Rank order follows Megatron-LM: the tensor-parallel axis varies fastest, then the
//! data-parallel axis, then the pipeline axis:
//!
//! ```text
//! rank = (pp_index · dp + dp_index) · tp + tp_index
//! ```
//!
//! so the members of a tensor-parallel group are neighbours (the chattiest traffic stays
//! on one node), and a pipeline stage is a contiguous block of `dp · tp` ranks.
//!
//! For `dp = 2, pp = 2, tp = 2`:
//!
//! ```text
//! rank  0 1 2 3 4 5 6 7
//! pp    0 0 0 0 1 1 1 1
//! dp    0 0 1 1 0 0 1 1
//! tp    0 1 0 1 0 1 0 1
//! ```

use std::fmt;
use std::sync::Arc;

use crate::{CommError, Communicator, Result};

/// The sizes of the three mesh axes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct MeshShape {
    pub dp: usize,
    pub pp: usize,
    pub tp: usize,
}

/// One rank's position on each axis.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct MeshCoord {
    pub dp: usize,
    pub pp: usize,
    pub tp: usize,
}

impl fmt::Display for MeshShape {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "dp={} pp={} tp={}", self.dp, self.pp, self.tp)
    }
}

impl MeshShape {
    pub fn new(dp: usize, pp: usize, tp: usize) -> MeshShape {
        MeshShape { dp, pp, tp }
    }

    /// The number of ranks the mesh needs.
    pub fn world_size(&self) -> usize {
        self.dp * self.pp * self.tp
    }

    /// Refuses a mesh with an empty axis.
    pub fn validate(&self) -> Result<()> {
        if self.dp == 0 || self.pp == 0 || self.tp == 0 {
            return Err(CommError::EmptyMeshAxis(*self));
        }
        Ok(())
    }

    /// The coordinates of `rank`.
    pub fn coord(&self, rank: usize) -> MeshCoord {
        MeshCoord {
            tp: rank % self.tp,
            dp: (rank / self.tp) % self.dp,
            pp: rank / (self.tp * self.dp),
        }
    }

    /// The rank at `c`.
    pub fn rank(&self, c: MeshCoord) -> usize {
        (c.pp * self.dp + c.dp) * self.tp + c.tp
    }
}

/// One rank's view of the mesh: its coordinates and its three groups.
#[derive(Clone)]
pub struct Mesh {
    pub shape: MeshShape,
    pub coord: MeshCoord,
    /// Every rank of the job.
    pub world: Arc<dyn Communicator>,
    /// The ranks that differ from this one only in `tp`.
    pub tp: Arc<dyn Communicator>,
    /// The ranks that differ from this one only in `pp` (group rank = pipeline rank).
    pub pp: Arc<dyn Communicator>,
    /// The ranks that differ from this one only in `dp`.
    pub dp: Arc<dyn Communicator>,
}

impl Mesh {
    /// Derives the groups of `shape` from `world`. Collective: every rank of `world`
    /// must call it with the same shape.
    pub fn new(world: Arc<dyn Communicator>, shape: MeshShape) -> Result<Mesh> {
        let rank = world.rank();
        let invalid = |reason: String| CommError::Invalid {
            op: "Mesh::new",
            rank,
            reason,
        };
        shape.validate().map_err(|e| invalid(e.to_string()))?;
        if shape.world_size() != world.world_size() {
            return Err(invalid(format!(
                "the mesh {shape} needs {} ranks but the world has {}",
                shape.world_size(),
                world.world_size()
            )));
        }
        let c = shape.coord(rank);
        let tp = world.split_named(c.pp * shape.dp + c.dp, c.tp, "tp")?;
        let pp = world.split_named(c.dp * shape.tp + c.tp, c.pp, "pp")?;
        let dp = world.split_named(c.pp * shape.tp + c.tp, c.dp, "dp")?;
        Ok(Mesh {
            shape,
            coord: c,
            world,
            tp,
            pp,
            dp,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rank_order_is_tp_then_dp_then_pp() {
        let s = MeshShape::new(2, 2, 2);
        let coords: Vec<_> = (0..8).map(|r| s.coord(r)).collect();
        assert_eq!(
            coords[1],
            MeshCoord {
                dp: 0,
                pp: 0,
                tp: 1
            }
        );
        assert_eq!(
            coords[2],
            MeshCoord {
                dp: 1,
                pp: 0,
                tp: 0
            }
        );
        assert_eq!(
            coords[4],
            MeshCoord {
                dp: 0,
                pp: 1,
                tp: 0
            }
        );
        for r in 0..8 {
            assert_eq!(s.rank(s.coord(r)), r);
        }
    }

    #[test]
    fn empty_axis_is_refused() {
        let e = MeshShape::new(1, 0, 2).validate().unwrap_err();
        assert_eq!(
            e.to_string(),
            "every mesh axis needs at least 1 rank, got dp=1 pp=0 tp=2"
        );
    }
}
