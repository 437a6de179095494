//! The Flash Next config, the op set, the round descriptor and the serialized plan format, shared by the compiler
//! (which writes plans) and the runtime (which replays them), and the reading of on/off environment switches
//! ([`mod@env`]). The runtime depends on this crate, never on the
//! compiler.
#![warn(missing_docs)]

pub mod config;
pub mod desc;
pub mod env;
pub mod format;
pub mod ops;
pub mod plan;
pub mod ple;
pub mod validate;

pub use config::{ConfigError, GateAct, LayerKind, ModelConfig, StorageForm};
pub use desc::{RoundDesc, SamplingParams, StreamDesc};
pub use format::{FormatError, FORMAT_VERSION};
pub use ops::{BufId, KeepSrc, Op, SampleRows, StateId, TokenSrc, WeightId};
pub use plan::*;
pub use validate::ValidationError;
