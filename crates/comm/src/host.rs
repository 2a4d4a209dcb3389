//! Host staging for transports that move host memory only (the in-process channels and
//! MPI): a tensor on another candle device is copied to the host here, inside the
//! communicator, and a result is copied back to the device of the input it came from.
//! The rest of switchyard never copies to the host for communication; a device-aware
//! backend (NCCL) would not copy at all. `recv` cannot know the receiver's device: it
//! returns a host tensor, and the receiver moves it (the pipeline executor does).

use candle_core::{Device, Result, Tensor};

/// `t` in host memory: itself when it is there already.
pub(crate) fn to_host(t: &Tensor) -> Result<Tensor> {
    match t.device().is_cpu() {
        true => Ok(t.clone()),
        false => t.to_device(&Device::Cpu),
    }
}

/// A host result `t` on `device`: itself when that is the host.
pub(crate) fn to_device(t: Tensor, device: &Device) -> Result<Tensor> {
    match device.is_cpu() {
        true => Ok(t),
        false => t.to_device(device),
    }
}
