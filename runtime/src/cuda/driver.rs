//! Owned CUDA driver objects, each released on drop: device allocations, pinned host memory, instantiated graphs
//! and events; and the error of a failed driver call.

use std::ffi::c_void;

use cudarc::driver::{result, sys};

use crate::backend::BackendError;

pub(super) fn dev_err(what: &str) -> impl Fn(result::DriverError) -> BackendError + '_ {
    move |e| BackendError::Device(format!("{what}: {e}"))
}

/// A device allocation freed on drop.
pub(super) struct DevBuf {
    pub(super) ptr: u64,
}

impl DevBuf {
    pub(super) fn new(bytes: usize) -> Result<DevBuf, BackendError> {
        let bytes = bytes.max(256);
        // SAFETY: a plain allocation, zeroed below.
        let ptr = unsafe { result::malloc_sync(bytes) }.map_err(dev_err("cuMemAlloc"))?;
        unsafe { result::memset_d8_sync(ptr, 0, bytes) }.map_err(dev_err("cuMemset"))?;
        Ok(DevBuf { ptr })
    }
}

impl Drop for DevBuf {
    fn drop(&mut self) {
        // SAFETY: allocated by malloc_sync, freed once.
        let _ = unsafe { result::free_sync(self.ptr) };
    }
}

/// Pinned host memory (flags 0: cached, not write-combined).
pub(super) struct Pinned {
    pub(super) ptr: *mut u8,
    pub(super) bytes: usize,
}

impl Pinned {
    pub(super) fn new(bytes: usize) -> Result<Pinned, BackendError> {
        let bytes = bytes.max(256);
        // SAFETY: allocation of pinned host memory.
        let ptr = unsafe { result::malloc_host(bytes, 0) }.map_err(dev_err("cuMemHostAlloc"))?;
        Ok(Pinned {
            ptr: ptr as *mut u8,
            bytes,
        })
    }
}

impl Drop for Pinned {
    fn drop(&mut self) {
        // SAFETY: allocated by malloc_host, freed once.
        let _ = unsafe { result::free_host(self.ptr as *mut c_void) };
    }
}

pub(super) struct Graph {
    pub(super) exec: sys::CUgraphExec,
    pub(super) graph: sys::CUgraph,
}

impl Drop for Graph {
    fn drop(&mut self) {
        // SAFETY: created by instantiate / end_capture, destroyed once (here).
        unsafe {
            let _ = result::graph::exec_destroy(self.exec);
            let _ = result::graph::destroy(self.graph);
        }
    }
}

/// A CUDA event, destroyed on drop (benchmark timing).
pub(super) struct Event(pub(super) sys::CUevent);

impl Event {
    pub(super) fn new() -> Result<Event, BackendError> {
        result::event::create(sys::CUevent_flags::CU_EVENT_DEFAULT)
            .map(Event)
            .map_err(dev_err("event"))
    }
    /// An event for ordering only (fork and join of graph branches).
    pub(super) fn untimed() -> Result<Event, BackendError> {
        result::event::create(sys::CUevent_flags::CU_EVENT_DISABLE_TIMING)
            .map(Event)
            .map_err(dev_err("event"))
    }
}

impl Drop for Event {
    fn drop(&mut self) {
        // SAFETY: created by event::create, destroyed once (here).
        let _ = unsafe { result::event::destroy(self.0) };
    }
}
