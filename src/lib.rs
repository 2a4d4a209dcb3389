//! # switchyard
//!
//! The facade crate: re-exports every switchyard crate under one name.
pub use switchyard_comm as comm;
pub use switchyard_schedule as schedule;
