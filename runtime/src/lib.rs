pub mod copy_index;
pub mod sampler;
