//! The backend interface: one variant replay per call, over device-side round descriptors
//! (`architecture.md`, "Backends"). The CPU reference and the CUDA backend implement it.

use flashplan_plan::{IoBuf, PlanBody, RoundDesc, VariantKind};

/// Errors replaying a variant.
#[derive(Debug, thiserror::Error)]
pub enum BackendError {
    /// The plan has no variant of this kind (compile it with wider options).
    #[error("the plan has no variant {0}; recompile the plans with wider --max-depth/--streams")]
    NoVariant(String),
    /// The descriptor does not fit the variant.
    #[error("bad round descriptor: {0}")]
    BadDescriptor(String),
    /// A weight the variant reads was not loaded.
    #[error("weight `{0}` is not loaded")]
    MissingWeight(String),
    /// A device error.
    #[error("device: {0}")]
    Device(String),
    /// An environment switch with a value it does not accept (the message names the variable and the values).
    #[error("{0}")]
    Setting(String),
}

/// A backend that replays plan variants.
pub trait Backend: Send {
    /// The plan body it runs.
    fn body(&self) -> &PlanBody;
    /// Replays the variant of `kind` with this descriptor.
    ///
    /// # Errors
    /// [`BackendError`] when the variant does not exist or the descriptor does not fit it.
    fn run(&mut self, kind: VariantKind, desc: &RoundDesc) -> Result<(), BackendError>;
    /// Reads an io buffer back (f32 elements; token ids and counts are u32 bit patterns).
    fn io(&self, buf: IoBuf) -> &[f32];
    /// Writes into an io buffer at an element offset (tests feed the MTP given residual streams).
    fn write_io(&mut self, buf: IoBuf, offset: usize, data: &[f32]);
    /// Clears a slot's state for a new stream (PLE history set to eos).
    fn reset_slot(&mut self, slot: u32);
    /// A copy of a slot's whole state (tests compare states after rounds).
    fn slot_state(&self, slot: u32) -> Vec<f32>;
}

/// A boxed backend is a backend, so the engine and the service can run on one chosen at run time
/// (`Engine<Box<dyn Backend>>`: the CLI picks the CUDA backend when a GPU is present, else the CPU one).
impl<B: Backend + ?Sized> Backend for Box<B> {
    fn body(&self) -> &PlanBody {
        (**self).body()
    }
    fn run(&mut self, kind: VariantKind, desc: &RoundDesc) -> Result<(), BackendError> {
        (**self).run(kind, desc)
    }
    fn io(&self, buf: IoBuf) -> &[f32] {
        (**self).io(buf)
    }
    fn write_io(&mut self, buf: IoBuf, offset: usize, data: &[f32]) {
        (**self).write_io(buf, offset, data)
    }
    fn reset_slot(&mut self, slot: u32) {
        (**self).reset_slot(slot)
    }
    fn slot_state(&self, slot: u32) -> Vec<f32> {
        (**self).slot_state(slot)
    }
}

/// Checks that a descriptor fits a variant of `kind` in `body`: one entry per stream, `streams * window` tokens,
/// every stream's slot, rows and positions in range. Both backends call it before a replay.
///
/// # Errors
/// [`BackendError::BadDescriptor`] naming the variant and what does not fit.
pub fn check_desc(
    body: &PlanBody,
    kind: VariantKind,
    desc: &RoundDesc,
) -> Result<(), BackendError> {
    let (s, w) = kind.shape();
    if desc.streams.len() != s as usize || desc.tokens.len() != (s * w) as usize {
        return Err(BackendError::BadDescriptor(format!(
            "{}: {} streams and {} tokens given, {} and {} expected",
            kind.name(),
            desc.streams.len(),
            desc.tokens.len(),
            s,
            s * w
        )));
    }
    for sd in &desc.streams {
        if sd.slot >= body.state.slots
            || sd.rows > w
            || (sd.pos + sd.rows) as u64 > body.state.context
        {
            return Err(BackendError::BadDescriptor(format!(
                "{}: stream {sd:?} out of range",
                kind.name()
            )));
        }
    }
    Ok(())
}
