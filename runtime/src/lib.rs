//! The flashplan runtime: loads plans and a checkpoint, replays plan variants round after round on a backend (CPU
//! reference or CUDA), drafts with the copy index or the MTP head, verifies exactly, and serves the OpenAI API.
//! It never depends on the compiler crate: a serving machine needs only this crate and the plan files.

#![warn(missing_docs)]

pub mod backend;
pub mod checkpoint;
pub mod copy_index;
pub mod cpu;
pub mod cuda;
pub mod engine;
pub mod fp8;
pub mod mxfp8;
mod safetensors_check;
pub mod sampler;
pub mod server;
pub mod service;
pub mod tokenizer;
